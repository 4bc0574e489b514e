# Faster R-CNN with mmdet's own ResNet-50 and an ExternalAttention block
# plugin (Guo et al. 2021, the EANet module: 64 memory slots, one head,
# double normalisation) after conv3 (+ norm3) of every bottleneck in stages
# 3 and 4, before the residual sum, on COCO 2017 with the 1x schedule of the
# base config (12 epochs, batch 16 = 8 GPUs x 2 images, lr 0.02,
# frozen_stages=1, norm_eval=True, ImageNet-initialised ResNet-50).
# with_relu=False, zero_init=True: the plugin's output is F + BN(conv(...))
# with the BN's weight starting at 0, so at init every block computes what
# the ImageNet ResNet-50 did (as mmcv's ContextBlock / NonLocal2d plugins);
# the EANet module's trailing ReLU would clip the branch before the
# identity sum. The memories and 1x1 convs start from the authors' init.
# The plugin's two 1x1 C x C convs at C = 1024 / 2048 add 39.4 M parameters
# to ResNet-50's 23.5 M. With norm_eval=True the plugins' BNs keep their
# initial running statistics (their affine weights train), as every BN of
# this backbone does.
_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'
custom_imports = dict(imports=['kcla_mm'], allow_failed_imports=False)
# torch's generator in checkpoints: --resume continues exactly; --resume,
# load_from and test.py's checkpoint load with torch's weights_only=True
# (mmengine's own types allowed only while the runner loads)
custom_hooks = [dict(type='TorchRNGStateHook'), dict(type='SafeLoadHook')]

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
