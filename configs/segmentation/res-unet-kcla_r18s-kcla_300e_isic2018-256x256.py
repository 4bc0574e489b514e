# KCLA in the encoder and across the decoder stages (KCLADecoderAttention:
# each decoder stage attends to the coarser ones through KCLA's state) on
# ISIC 2018. A kcla_mm extension of the paper's model, which has KCLA in the
# encoder only.
_base_ = './res-unet_r18s-kcla_300e_isic2018-256x256.py'
model = dict(
    decode_head=dict(
        decoder_attention=dict(type='KCLADecoderAttention', head_dim=16)))
