# res-unet_r18s-kcla_300e_isic2018-256x256.py with mixed-precision training:
# mmengine's AmpOptimWrapper with bfloat16 autocast (float32's range, so
# no loss scaling needed; the wrapper's dynamic scaler is harmless). Needs
# a GPU with bfloat16 (Ampere or newer): mmengine 0.10.7 builds
# AmpOptimWrapper only with a GPU (or NPU/MLU/MUSA). Under autocast the
# KCLA layers keep their keys, layer weights and state (U, Z) in float32.
_base_ = './res-unet_r18s-kcla_300e_isic2018-256x256.py'

optim_wrapper = dict(type='AmpOptimWrapper', dtype='bfloat16')
