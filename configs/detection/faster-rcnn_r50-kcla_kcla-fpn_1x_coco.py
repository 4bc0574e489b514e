# Faster R-CNN R50-KCLA with KCLA also across the FPN levels (KCLAFPN, a
# drop-in for mmdet's FPN: same arguments and outputs; each output level
# adds a KCLA branch that attends to the finer levels through the recurrent
# state, resized between levels). 256 channels / head_dim 64 = 4 heads.
_base_ = './faster-rcnn_r50-kcla_fpn_1x_coco.py'
model = dict(neck=dict(type='KCLAFPN', head_dim=64))
