# Faster R-CNN R50-KCLA (faster-rcnn_r50-kcla_fpn_1x_coco.py: KCLA after
# every block, ImageNet-initialised ResNet-50, 1x schedule) with the
# ExternalAttention plugins of faster-rcnn_r50-ea_fpn_1x_coco.py inside the
# bottlenecks of stages 3 and 4 (after conv3, before the residual sum; the
# KCLA layer then follows the block).
_base_ = './faster-rcnn_r50-kcla_fpn_1x_coco.py'

ea_plugins = [
    dict(
        cfg=dict(
            type='ExternalAttention',
            num_slots=64,
            num_heads=1,
            with_relu=False,
            zero_init=True),
        stages=(False, False, True, True),
        position='after_conv3')
]
model = dict(backbone=dict(plugins=ea_plugins))
