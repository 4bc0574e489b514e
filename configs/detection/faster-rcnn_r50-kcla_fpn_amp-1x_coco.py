# faster-rcnn_r50-kcla_fpn_1x_coco.py with mixed-precision training: mmengine's
# AmpOptimWrapper (float16 autocast, dynamic loss scaling), as mmdet's
# faster-rcnn_r50_fpn_amp-1x_coco.py does for the plain ResNet-50. Under
# autocast the KCLA layers keep their keys, layer weights and state (U, Z)
# in float32 (23 layer weights of e^10 would overflow float16).
# mmengine 0.10.7 builds AmpOptimWrapper only with a GPU (or NPU/MLU/MUSA);
# on a CPU-only machine train with the non-AMP config.
_base_ = './faster-rcnn_r50-kcla_fpn_1x_coco.py'

optim_wrapper = dict(
    type='AmpOptimWrapper', dtype='float16', loss_scale='dynamic')
