"""KCLAFPN: mmdet's FPN whose output levels attend to each other via KCLA."""
from typing import List, Optional, Tuple

import torch.nn as nn
from mmdet.models.necks import FPN
from torch import Tensor

from kcla_mm.ops.kcla_state import IMPLS
from ..layers import KCLALayer, KCLAState
from ..layers.utils import (check_head_dim, check_layer_cfg,
                            check_positive_int, check_probability,
                            check_temperature_range)


class KCLAFPN(FPN):
    """FPN with Key-Correlated Layer Attention across pyramid levels.

    A drop-in for mmdet's ``FPN`` (same arguments, same outputs). FPN's
    top-down path carries coarse context to the fine levels; KCLAFPN then
    runs one KCLA pass over the ``num_outs`` outputs from the finest level to
    the coarsest, so every level P_i becomes ``P_i + Y_i`` where Y_i attends
    to P_0..P_i through KCLA's recurrent state (U, Z) (docs/method.md §2).
    Between levels the state is bridged like the backbone's cross-stage
    adapter (docs/method.md §3) but by bilinear resizing of A' = U / Z instead
    of a strided convolution (all levels have ``out_channels`` channels).

    Args:
        in_channels, out_channels, num_outs, ...: as mmdet's ``FPN``.
        head_dim (int): channels per KCLA head; must divide
            ``out_channels``. Defaults to 64.
        temperature_range (tuple[float, float]): KCLA's (s_min, s_max).
            Defaults to (0.7, 1 / 0.7).
        kcla_drop_path (float): drop-path rate of the attention branch.
            Defaults to 0.0.
        kcla_norm_cfg (dict): norm of the attention branch and adapters.
            Defaults to ``dict(type='BN')``.
        kcla_impl (str): ``'auto'``, ``'fused'`` or ``'torch'``.
            Defaults to ``'auto'``.

    Example:
        >>> import torch
        >>> neck = KCLAFPN([16, 32], 32, num_outs=3, head_dim=16).eval()
        >>> outs = neck([torch.rand(1, 16, 16, 16), torch.rand(1, 32, 8, 8)])
        >>> [tuple(o.shape) for o in outs]
        [(1, 32, 16, 16), (1, 32, 8, 8), (1, 32, 4, 4)]
    """

    def __init__(self,
                 in_channels: List[int],
                 out_channels: int,
                 num_outs: int,
                 *args,
                 head_dim: int = 64,
                 temperature_range: Tuple[float, float] = (0.7, 1 / 0.7),
                 kcla_drop_path: float = 0.0,
                 kcla_norm_cfg: dict = dict(type='BN'),
                 kcla_impl: str = 'auto',
                 **kwargs) -> None:
        if not isinstance(in_channels, (list, tuple)) or not all(
                isinstance(c, int) and not isinstance(c, bool) and c > 0
                for c in in_channels):
            raise TypeError('KCLAFPN: in_channels must be a list of positive '
                            f'ints, got {in_channels!r}')
        owner = type(self).__name__
        check_positive_int(out_channels, 'out_channels', owner)
        check_head_dim(out_channels, head_dim, owner)
        check_temperature_range(temperature_range, owner)
        check_probability(kcla_drop_path, 'kcla_drop_path', owner)
        check_layer_cfg(kcla_norm_cfg, 'kcla_norm_cfg', owner)
        if kcla_impl not in IMPLS:
            raise ValueError(f'{owner}: kcla_impl must be one of {IMPLS}, '
                             f'got {kcla_impl!r}')
        super().__init__(list(in_channels), out_channels, num_outs, *args,
                         **kwargs)
        self.level_attentions = nn.ModuleList(
            KCLALayer(
                out_channels,
                head_dim=head_dim,
                temperature_range=temperature_range,
                drop_path=kcla_drop_path,
                state_in_channels=None if level == 0 else out_channels,
                state_resize=True,
                norm_cfg=kcla_norm_cfg,
                impl=kcla_impl) for level in range(num_outs))

    def forward(self, inputs: Tuple[Tensor]) -> tuple:
        """Multi-level features (as FPN's) -> ``num_outs`` maps (B, C, H_i, W_i)."""
        if len(inputs) != len(self.in_channels):
            raise ValueError(f'KCLAFPN: got {len(inputs)} input levels, the '
                             f'neck was built for in_channels='
                             f'{self.in_channels}')
        outs = []
        state: Optional[KCLAState] = None
        for level_out, attention in zip(super().forward(inputs),
                                        self.level_attentions):
            out, state = attention(level_out, state)
            outs.append(out)
        return tuple(outs)
