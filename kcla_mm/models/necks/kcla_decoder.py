"""KCLADecoderAttention: KCLA across the stages of a UNet decoder."""
from typing import Optional, Sequence, Tuple

import torch.nn as nn
from mmengine.model import BaseModule
from torch import Tensor

from kcla_mm.ops.kcla_state import IMPLS
from ..layers import KCLALayer, KCLAState
from ..layers.utils import (check_head_dim, check_layer_cfg,
                            check_positive_float, check_probability,
                            check_temperature_range)


class KCLADecoderAttention(BaseModule):
    """Key-Correlated Layer Attention across UNet decoder stages.

    The decoder stages run from coarse to fine; stage i's output D_i
    (B, C_i, H_i, W_i) becomes ``D_i + Y_i``, where Y_i attends to
    D_0..D_i through KCLA's recurrent state (U, Z) (docs/method.md §2). Between
    stages the state is bridged like the backbone's cross-stage adapter
    (docs/method.md §3), except that A' = U / Z is resized bilinearly up to the
    finer stage's resolution, and the grouped 1x1 conv only changes width.

    Args:
        stage_channels (Sequence[int]): C_i of each decoder stage, coarsest
            first; ``head_dim`` must divide each.
        head_dim (int): channels per KCLA head. Defaults to 16.
        temperature_range (tuple[float, float]): KCLA's (s_min, s_max).
            Defaults to (0.7, 1 / 0.7).
        drop_path (float): drop-path rate of the attention branch.
            Defaults to 0.0.
        norm_cfg (dict): norm of the attention branch and adapters.
            Defaults to ``dict(type='BN')``.
        norm_init (float): initial weight of each branch norm (1 in
            docs/method.md §2). Defaults to 1.0.
        impl (str): ``'auto'``, ``'fused'`` or ``'torch'``.
            Defaults to ``'auto'``.
        init_cfg (dict or list[dict], optional): initialisation config.

    Example:
        >>> import torch
        >>> attn = KCLADecoderAttention([32, 16], head_dim=16).eval()
        >>> d0, state = attn(torch.rand(1, 32, 8, 8), 0)
        >>> d1, state = attn(torch.rand(1, 16, 16, 16), 1, state)
        >>> tuple(d1.shape), tuple(state.u.shape)
        ((1, 16, 16, 16), (1, 16, 16, 16))
    """

    def __init__(self,
                 stage_channels: Sequence[int],
                 head_dim: int = 16,
                 temperature_range: Tuple[float, float] = (0.7, 1 / 0.7),
                 drop_path: float = 0.0,
                 norm_cfg: dict = dict(type='BN'),
                 norm_init: float = 1.0,
                 impl: str = 'auto',
                 init_cfg=None) -> None:
        super().__init__(init_cfg)
        owner = type(self).__name__
        if not isinstance(stage_channels, (list, tuple)) or \
                not stage_channels or \
                not all(isinstance(c, int) and c > 0 for c in stage_channels):
            raise ValueError(f'{owner}: stage_channels must be a non-empty '
                             f'sequence of positive ints, got '
                             f'{stage_channels!r}')
        for channels in stage_channels:
            check_head_dim(channels, head_dim, owner)
        check_temperature_range(temperature_range, owner)
        check_probability(drop_path, 'drop_path', owner)
        check_layer_cfg(norm_cfg, 'norm_cfg', owner)
        check_positive_float(
            norm_init, 'norm_init', owner,
            why=' (the branch ReLU passes no gradient at 0)')
        if impl not in IMPLS:
            raise ValueError(f'{owner}: impl must be one of {IMPLS}, got '
                             f'{impl!r}')
        self.stage_channels = tuple(stage_channels)
        self.layers = nn.ModuleList(
            KCLALayer(
                channels,
                head_dim=head_dim,
                temperature_range=temperature_range,
                drop_path=drop_path,
                state_in_channels=stage_channels[i - 1] if i else None,
                state_resize=True,
                norm_cfg=norm_cfg,
                norm_init=norm_init,
                impl=impl) for i, channels in enumerate(stage_channels))

    def forward(self,
                x: Tensor,
                stage_idx: int,
                state: Optional[KCLAState] = None
                ) -> Tuple[Tensor, KCLAState]:
        """Stage ``stage_idx``'s output (B, C_i, H_i, W_i) -> (X + Y, state).

        ``state`` is what the previous stage returned (None at stage 0).
        """
        if not 0 <= stage_idx < len(self.layers):
            raise ValueError(f'{type(self).__name__}: stage_idx must be in '
                             f'[0, {len(self.layers) - 1}], got {stage_idx}')
        return self.layers[stage_idx](x, state)
