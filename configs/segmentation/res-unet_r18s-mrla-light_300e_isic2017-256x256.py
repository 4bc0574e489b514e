# ResNet-UNet whose encoder carries MRLA-light (head dim 32), the baseline
# the KCLA paper compares with, on ISIC 2017.
_base_ = './res-unet_r18s_300e_isic2017-256x256.py'
model = dict(
    backbone=dict(
        layer_attention='MRLA-light', head_dim=32, kcla_drop_path=0.2))
