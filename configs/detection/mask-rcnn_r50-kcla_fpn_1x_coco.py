# Mask R-CNN with a ResNet-50-KCLA backbone on COCO 2017, 1x schedule
# (batch 16 total, lr 0.02), frozen_stages=1, norm_eval=True.
_base_ = 'mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py'
custom_imports = dict(imports=['kcla_mm'], allow_failed_imports=False)
# torch's generator in checkpoints: --resume continues exactly; --resume,
# load_from and test.py's checkpoint load with torch's weights_only=True
# (mmengine's own types allowed only while the runner loads)
custom_hooks = [dict(type='TorchRNGStateHook'), dict(type='SafeLoadHook')]

model = dict(
    backbone=dict(
        _delete_=True,
        type='ResNetKCLA',
        depth=50,
        num_stages=4,
        out_indices=(0, 1, 2, 3),
        frozen_stages=1,
        norm_cfg=dict(type='BN', requires_grad=True),
        norm_eval=True,
        style='pytorch',
        layer_attention='KCLA',
        head_dim=64,
        init_cfg=dict(type='Pretrained',
                      checkpoint='torchvision://resnet50')))
