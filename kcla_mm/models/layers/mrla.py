"""MRLA-light (Fang et al. 2023), the light recurrent layer attention.

o = sigmoid(<Q_g, K_g> / sqrt(d)) * DWConv3x3(X)_g + lambda * X_in, with X_in
the block's input after its downsample; out = X + DropPath(BN(o)). Earlier
layers reach block t through X_in, decaying geometrically with products of
lambda (docs/method.md §6).
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
from mmcv.cnn.bricks.drop import DropPath
from mmengine.model import BaseModule
from torch import Tensor

from .eca import build_eca_conv, eca_project
from .utils import (add_norm_before_convs, check_feature, check_head_dim,
                    check_probability, state_dtype)


class MRLALight(BaseModule):
    """MRLA-light for one residual block.

    Args:
        channels (int): C of the block output.
        head_dim (int): d; must divide C. Defaults to 32.
        drop_path (float): drop-path rate. Defaults to 0.2.
        norm_cfg (dict): norm config. Defaults to ``dict(type='BN')``.
        init_cfg (dict or list[dict], optional): initialisation config.
    """

    needs_identity = True

    def __init__(self,
                 channels: int,
                 head_dim: int = 32,
                 drop_path: float = 0.2,
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
        self.scale = 1.0 / math.sqrt(head_dim)
        self.norm_name = add_norm_before_convs(self, norm_cfg, channels)
        self.q_conv = build_eca_conv(channels)
        self.k_conv = build_eca_conv(channels)
        self.v_conv = nn.Conv2d(
            channels, channels, 3, padding=1, groups=channels, bias=False)
        self.lambda_t = nn.Parameter(torch.ones(channels, 1, 1))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self,
                x: Tensor,
                state: Optional[Tensor] = None,
                identity: Optional[Tensor] = None) -> Tuple[Tensor, None]:
        """X (B, C, H, W) and X_in (B, C, H, W) -> (X + Y, None)."""
        owner = type(self).__name__
        check_feature(x, self.channels, owner)
        if identity is None or identity.shape != x.shape:
            raise ValueError(
                f'{owner}: identity (the block input after downsample) must '
                f'have the shape of x {tuple(x.shape)}, got '
                f'{None if identity is None else tuple(identity.shape)}')
        b, c, h, w = x.shape
        g = self.num_heads
        pooled = x.to(state_dtype(x)).mean((2, 3))
        query = eca_project(self.q_conv, pooled, g)
        key = eca_project(self.k_conv, pooled, g)
        gate = torch.sigmoid((query * key).sum(-1) * self.scale)  # (B, G)
        value = self.v_conv(x).view(b, g, c // g, h, w)
        # gate in float32, as in KCLALayer (float16 gradient overflow)
        out = (value.to(gate.dtype) * gate.view(b, g, 1, 1, 1)).view(
            b, c, h, w) + self.lambda_t * identity
        y = self.drop_path(getattr(self, self.norm_name)(out.to(x.dtype)))
        return x + y, None
