# The demo detector (faster-rcnn_r18-kcla_fpn_synthetic-coco.py: Faster
# R-CNN from scratch on the synthetic COCO dataset, CPU) with the backbone of
# faster-rcnn_r50-kcla-ea_fpn_1x_coco.py at 1/4 width: ResNet-50-KCLA with
# base_channels=16 (stage outputs 64/128/256/512 channels) and an
# ExternalAttention plugin (32 slots; identity at init) after conv3 of every
# bottleneck in stages 3 and 4. Plugins need bottlenecks (depth 50+):
# ResNet-18's basic blocks take none, in mmdet's ResNet as in ResNetKCLA.
_base_ = './faster-rcnn_r18-kcla_fpn_synthetic-coco.py'

model = dict(
    backbone=dict(
        depth=50,
        base_channels=16,
        plugins=[
            dict(
                cfg=dict(
                    type='ExternalAttention',
                    num_slots=32,
                    with_relu=False,
                    zero_init=True),
                stages=(False, False, True, True),
                position='after_conv3')
        ]),
    neck=dict(in_channels=[64, 128, 256, 512]))
