# Faster R-CNN with a ResNet-50-KCLA backbone on COCO 2017, 1x schedule
# (12 epochs, batch 16 total = 8 GPUs x 2 images, lr 0.02), frozen_stages=1
# and norm_eval=True as in the KCLA authors' recipe. The backbone starts from
# torchvision's ImageNet ResNet-50 (the KCLA layers from their own init).
_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'
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
