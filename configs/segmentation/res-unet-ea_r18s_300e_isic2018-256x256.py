# ResNet-UNet with External Attention (two learnable 64-slot memories,
# double normalisation; Guo et al. 2021) on the encoder's coarsest feature
# (128 channels at 1/8 resolution) before decoding, on ISIC 2018: spatial
# attention linear in the number of pixels. The small encoder's BasicBlocks
# take no block plugins, so EA goes into the decoder head.
_base_ = './res-unet_r18s_300e_isic2018-256x256.py'
model = dict(
    decode_head=dict(
        bottleneck_attention=dict(type='ExternalAttention', num_slots=64)))
