# ResNet-UNet whose encoder carries KCLA (head dim 16, drop-path 0.2, as the
# authors' segmentation encoder) on ISIC 2018.
_base_ = './res-unet_r18s_300e_isic2018-256x256.py'
model = dict(
    backbone=dict(layer_attention='KCLA', head_dim=16, kcla_drop_path=0.2))
