"""ResUNetHead: a UNet decoder over the stages of a ResNet encoder."""
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
from mmcv.cnn import ConvModule
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from mmseg.models.utils import resize
from mmseg.registry import MODELS
from torch import Tensor


def _build_optional(cfg: Optional[dict], name: str, owner: str,
                    **defaults) -> Optional[nn.Module]:
    """Build ``cfg`` (a config dict with 'type') from mmseg's MODELS with
    ``defaults`` added, or return None for None."""
    if cfg is None:
        return None
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise ValueError(f"{owner}: {name} must be a config dict with a "
                         f"'type', got {cfg!r}")
    if isinstance(cfg['type'], str) and MODELS.get(cfg['type']) is None:
        raise KeyError(f'{owner}: {name} has type {cfg["type"]!r}, which is '
                       "not in mmseg's MODELS registry; allowed: a registered "
                       "module, e.g. 'KCLADecoderAttention' or "
                       "'ExternalAttention'")
    try:
        return MODELS.build(dict(cfg, **defaults))
    except TypeError as e:  # e.g. an unexpected keyword argument
        raise TypeError(f'{owner}: {name}={cfg!r} cannot be built: {e}') \
            from e


class ResUNetHead(BaseDecodeHead):
    """UNet decoder for ResNet encoders (mmseg decode head).

    Takes the encoder's features finest first (e.g. ``ResNetKCLA`` with
    ``with_stem_out=True``: stem, stage 1, ..., stage 4). Starting from the
    coarsest, each decoder stage i resizes the running feature bilinearly to
    the next finer skip's resolution, concatenates the skip and applies
    ``num_convs`` 3x3 ConvModules (conv, norm, act)::

        D_0 = Convs_0(cat(F_{n-2}, up(F_{n-1})))
        D_i = Convs_i(cat(F_{n-2-i}, up(D_{i-1})))      i = 1 .. n-2

    With ``decoder_attention`` (e.g. ``dict(type='KCLADecoderAttention',
    head_dim=16)``) every decoder stage output also attends to the earlier
    decoder stages: D_i <- D_i + Y_i through KCLA's recurrent state. With
    ``bottleneck_attention`` (e.g. ``dict(type='ExternalAttention')``) the
    coarsest feature F_{n-1} first passes through that module.
    Resizing to the skip's size (not a fixed factor 2) keeps odd input
    sizes and stages without downsampling aligned.

    Args:
        in_channels (Sequence[int]): channels of the selected encoder
            features, finest first (at least 2).
        channels (int): channels of the last decoder stage, the input of
            ``conv_seg``; must equal ``decoder_channels[-1]``.
        decoder_channels (Sequence[int]): output channels of each decoder
            stage, coarsest first; ``len(in_channels) - 1`` entries.
        num_convs (int): 3x3 convs per decoder stage. Defaults to 2.
        decoder_attention (dict, optional): config of the attention across
            decoder stages, built from mmseg's MODELS with
            ``stage_channels=decoder_channels``. Defaults to None.
        bottleneck_attention (dict, optional): config of a module applied
            to the coarsest feature (channel-preserving, built from mmseg's
            MODELS with ``in_channels=in_channels[-1]``). Defaults to None.
        **kwargs: the rest of mmseg's ``BaseDecodeHead`` arguments
            (``num_classes``, ``in_index``, ``norm_cfg``, ``loss_decode``,
            ``out_channels``, ``threshold``, ...);
            ``input_transform`` is fixed to ``'multiple_select'``.

    Shapes:
        inputs: tuple of (B, C_j, H_j, W_j) encoder features;
        output: (B, out_channels, H_0, W_0) logits at the finest
        selected feature's resolution.
    """

    def __init__(self,
                 in_channels: Sequence[int],
                 channels: int,
                 decoder_channels: Sequence[int],
                 num_convs: int = 2,
                 decoder_attention: Optional[dict] = None,
                 bottleneck_attention: Optional[dict] = None,
                 **kwargs) -> None:
        owner = type(self).__name__
        if 'input_transform' in kwargs:
            raise ValueError(f'{owner}: input_transform is always '
                             "'multiple_select'; do not set it")
        if not isinstance(in_channels, (list, tuple)) or \
                len(in_channels) < 2 or not all(
                    isinstance(c, int) and not isinstance(c, bool) and c > 0
                    for c in in_channels):
            raise ValueError(f'{owner}: in_channels must be a sequence of at '
                             f'least 2 positive ints (encoder features, '
                             f'finest first), got {in_channels!r}')
        if not isinstance(decoder_channels, (list, tuple)) or \
                len(decoder_channels) != len(in_channels) - 1 or \
                not all(isinstance(c, int) and not isinstance(c, bool)
                        and c > 0 for c in decoder_channels):
            raise ValueError(
                f'{owner}: decoder_channels must be {len(in_channels) - 1} '
                f'positive ints (one per decoder stage, len(in_channels) - '
                f'1), got {decoder_channels!r}')
        if channels != decoder_channels[-1]:
            raise ValueError(f'{owner}: channels ({channels!r}) must equal '
                             f'the last decoder stage, decoder_channels[-1] '
                             f'= {decoder_channels[-1]}')
        if not isinstance(num_convs, int) or isinstance(num_convs, bool) \
                or num_convs < 1:
            raise ValueError(f'{owner}: num_convs must be an int >= 1, got '
                             f'{num_convs!r}')
        super().__init__(
            list(in_channels),
            channels,
            input_transform='multiple_select',
            **kwargs)
        self.decoder_channels = tuple(decoder_channels)
        skips = list(in_channels[-2::-1])
        previous = [in_channels[-1]] + list(decoder_channels[:-1])
        self.up_blocks = nn.ModuleList(
            self._conv_block(skip + prev, out, num_convs)
            for skip, prev, out in zip(skips, previous, decoder_channels))
        self.decoder_attention = _build_optional(
            decoder_attention, 'decoder_attention', owner,
            stage_channels=self.decoder_channels)
        self.bottleneck_attention = _build_optional(
            bottleneck_attention, 'bottleneck_attention', owner,
            in_channels=in_channels[-1])

    def _conv_block(self, in_channels: int, out_channels: int,
                    num_convs: int) -> nn.Sequential:
        return nn.Sequential(*[
            ConvModule(
                in_channels if j == 0 else out_channels,
                out_channels,
                3,
                padding=1,
                conv_cfg=self.conv_cfg,
                norm_cfg=self.norm_cfg,
                act_cfg=self.act_cfg) for j in range(num_convs)
        ])

    def forward(self, inputs: List[Tensor]) -> Tensor:
        """Encoder features -> (B, out_channels, H_0, W_0) logits."""
        feats = self._transform_inputs(inputs)
        for feat, expected in zip(feats, self.in_channels):
            if feat.dim() != 4 or feat.shape[1] != expected:
                raise ValueError(
                    f'{type(self).__name__}: encoder features have shapes '
                    f'{[tuple(f.shape) for f in feats]}, the head was built '
                    f'for in_channels={list(self.in_channels)}')
        x = feats[-1]
        if self.bottleneck_attention is not None:
            x = self.bottleneck_attention(x)
        state = None
        for i, (skip, block) in enumerate(zip(feats[-2::-1],
                                              self.up_blocks)):
            x = resize(
                x,
                size=skip.shape[2:],
                mode='bilinear',
                align_corners=self.align_corners)
            x = block(torch.cat([skip, x], dim=1))
            if self.decoder_attention is not None:
                x, state = self.decoder_attention(x, i, state)
        return self.cls_seg(x)
