"""Standard (quadratic) layer attention, the baseline KCLA approximates.

Within a stage, block t attends to the keys K^s and values V^s = DWConv(X^s)
of all blocks s <= t with a per-head softmax over s (docs/method.md §6).
Time is O(t) per block (O(D^2) in depth) and the cache grows with t.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn.bricks.drop import DropPath
from mmengine.model import BaseModule
from torch import Tensor

from .eca import build_eca_conv, eca_project
from .state import LayerAttentionCache
from .utils import (add_norm_before_convs, check_feature, check_head_dim,
                    check_probability, state_dtype)


def softmax_layer_attention(query: Tensor, keys: Tensor, values: Tensor,
                            scale: Tensor) -> Tensor:
    """sum_s softmax_s(scale * <Q_g, K^s_g>) V^s_g for every head g.

    Args:
        query (Tensor): (B, G, d).
        keys (Tensor): (B, T, G, d).
        values (Tensor): (B, T, C, H, W) with C = G * d.
        scale (Tensor or float): multiplier of the logits, broadcastable to
            (B, T, G) (e.g. (G,) for one temperature per head).

    Returns:
        Tensor: (B, C, H, W).
    """
    b, t, c, h, w = values.shape
    g = query.shape[1]
    logits = torch.einsum('bgd,btgd->btg', query, keys) * scale
    attn = logits.softmax(dim=1)  # over the layers s
    out = torch.einsum('btg,btgdhw->bgdhw', attn,
                       values.reshape(b, t, g, c // g, h, w))
    return out.reshape(b, c, h, w)


class LayerAttention(BaseModule):
    """Standard multi-head layer attention (LA / MRLA-base) for one block.

    Args:
        channels (int): C of the block output.
        head_dim (int): d; must divide C. Defaults to 64.
        drop_path (float): drop-path rate. Defaults to 0.2.
        reset_cache (bool): start a new cache here (first block of a
            stage) instead of extending the incoming one. Defaults to False.
        norm_cfg (dict): norm config. Defaults to ``dict(type='BN')``.
        init_cfg (dict or list[dict], optional): initialisation config.
    """

    def __init__(self,
                 channels: int,
                 head_dim: int = 64,
                 drop_path: float = 0.2,
                 reset_cache: bool = False,
                 norm_cfg: dict = dict(type='BN'),
                 init_cfg=[
                     dict(
                         type='Xavier',
                         layer=['Conv1d'],
                         distribution='uniform'),
                     dict(
                         type='Kaiming',
                         layer='Conv2d',
                         mode='fan_out',
                         nonlinearity='relu'),
                     dict(type='Constant', val=1, layer=['_BatchNorm'])
                 ]) -> None:
        super().__init__(init_cfg)
        owner = type(self).__name__
        self.channels = channels
        self.num_heads = check_head_dim(channels, head_dim, owner)
        check_probability(drop_path, 'drop_path', owner)
        self.reset_cache = reset_cache
        self.scale = 1.0 / math.sqrt(head_dim)
        self.norm_name = add_norm_before_convs(self, norm_cfg, channels)
        self.q_conv = build_eca_conv(channels)
        self.k_conv = build_eca_conv(channels)
        self.v_conv = nn.Conv2d(
            channels, channels, 3, padding=1, groups=channels, bias=False)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self,
                x: Tensor,
                cache: Optional[LayerAttentionCache] = None
                ) -> Tuple[Tensor, LayerAttentionCache]:
        """X (B, C, H, W) -> (X + Y, the cache extended by this layer)."""
        check_feature(x, self.channels, type(self).__name__)
        g = self.num_heads
        pooled = x.to(state_dtype(x)).mean((2, 3))
        query = eca_project(self.q_conv, pooled, g)
        key = eca_project(self.k_conv, pooled, g)
        value = self.v_conv(x)
        if cache is None or self.reset_cache:
            cache = LayerAttentionCache([], [])
        elif cache.values[-1].shape != value.shape:
            raise ValueError(
                f'{type(self).__name__}: the cached values are '
                f'{tuple(cache.values[-1].shape)} but this layer gives '
                f'{tuple(value.shape)}; set reset_cache=True at stage starts')
        cache = LayerAttentionCache(cache.keys + [key],
                                    cache.values + [value])
        out = softmax_layer_attention(
            query, torch.stack(cache.keys, 1),
            torch.stack(cache.values, 1).to(query.dtype), self.scale)
        y = self.drop_path(
            F.relu(getattr(self, self.norm_name)(out.to(x.dtype))))
        return x + y, cache
