# Mask R-CNN R50-KCLA with KCLA also across the FPN levels (KCLAFPN, see
# faster-rcnn_r50-kcla_kcla-fpn_1x_coco.py).
_base_ = './mask-rcnn_r50-kcla_fpn_1x_coco.py'
model = dict(neck=dict(type='KCLAFPN', head_dim=64))
