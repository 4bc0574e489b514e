# ResNet-UNet (the KCLA authors' small ResNet-18 encoder, no layer
# attention) on ISIC 2018, 256x256, the authors' AdamW + cosine recipe: the
# baseline of res-unet_r18s-kcla_300e_isic2018-256x256.py.
_base_ = [
    '../_base_/models/res-unet_r18s.py', '../_base_/datasets/isic2018.py',
    '../_base_/schedules/adamw-cosine_300e.py'
]
custom_imports = dict(imports=['kcla_mm'], allow_failed_imports=False)
