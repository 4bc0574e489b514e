# ResNet-UNet with the KCLA authors' small segmentation encoder: BasicBlock
# stages [2, 2, 2, 2] of widths 32/64/128/128 (strides 2, 2, 2, 1) after a
# 16-channel 7x7 stem with stride 1 and no max-pool; the stem output is the
# finest skip. Decoder: four bilinear-upsample + skip-concat + 2x(conv3x3,
# BN, ReLU) stages of widths 64/32/16/16. Binary (background / lesion), the
# authors' BCE + Dice loss written with mmseg's losses on two output
# channels: softmax cross-entropy over logits (a, b) is BCE on z = b - a, and
# DiceLoss(use_sigmoid=False, ignore_index=0) is the Dice of the lesion
# channel alone (smooth 1, as the authors). mmseg 1.2.2's out_channels=1 mode
# cannot be used: its DiceLoss then one-hot encodes the labels into a single
# background channel and scores the lesion logit against background.
# This base has no layer attention; the configs set
# backbone.layer_attention.
norm_cfg = dict(type='BN', requires_grad=True)
data_preprocessor = dict(
    type='SegDataPreProcessor',
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=(256, 256))
model = dict(
    type='EncoderDecoder',
    data_preprocessor=data_preprocessor,
    backbone=dict(
        type='ResNetKCLA',
        depth=18,
        stem_channels=16,
        stage_channels=(32, 64, 128, 128),
        strides=(2, 2, 2, 1),
        stem_stride=1,
        stem_pool=False,
        with_stem_out=True,
        out_indices=(0, 1, 2, 3),
        norm_cfg=norm_cfg,
        norm_eval=False,
        zero_init_residual=False,
        layer_attention=None),
    decode_head=dict(
        type='ResUNetHead',
        in_channels=[16, 32, 64, 128, 128],
        in_index=[0, 1, 2, 3, 4],
        channels=16,
        decoder_channels=[64, 32, 16, 16],
        num_convs=2,
        num_classes=2,
        dropout_ratio=0.0,
        norm_cfg=norm_cfg,
        align_corners=True,
        loss_decode=[
            dict(
                type='CrossEntropyLoss',
                use_sigmoid=False,
                avg_non_ignore=True,
                loss_weight=1.0),
            dict(
                type='DiceLoss',
                use_sigmoid=False,
                naive_dice=True,
                eps=1.0,
                ignore_index=0,
                loss_weight=1.0)
        ]),
    train_cfg=dict(),
    test_cfg=dict(mode='whole'))
