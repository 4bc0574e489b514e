"""Argument checks shared by the layer-attention modules."""
from typing import Optional

import torch
from torch import Tensor


def state_dtype(x: Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32 (also under autocast)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_feature(x: Tensor, channels: int, owner: str) -> None:
    """Raise TypeError/ValueError unless ``x`` is a float (B, channels, H, W)."""
    if not isinstance(x, Tensor):
        raise TypeError(f'{owner}: input must be a Tensor, got '
                        f'{type(x).__name__}')
    if x.dim() != 4:
        raise ValueError(f'{owner}: input must be 4-D (B, C, H, W), got shape '
                         f'{tuple(x.shape)}')
    if x.shape[1] != channels:
        raise ValueError(f'{owner}: input has {x.shape[1]} channels, the layer '
                         f'was built for channels={channels}')
    if not x.is_floating_point():
        raise TypeError(f'{owner}: input must be floating point, got {x.dtype}')


def check_head_dim(channels: int, head_dim: int, owner: str) -> int:
    """Number of heads G = channels / head_dim; ValueError unless it divides."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) \
            or head_dim < 1:
        raise ValueError(f'{owner}: head_dim must be a positive int, got '
                         f'{head_dim!r}')
    if channels % head_dim != 0:
        raise ValueError(f'{owner}: head_dim={head_dim} must divide the '
                         f'channels ({channels}); allowed: divisors of '
                         f'{channels}')
    return channels // head_dim


def check_probability(value: float, name: str, owner: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not 0.0 <= value < 1.0:
        raise ValueError(f'{owner}: {name} must be a float in [0, 1), got '
                         f'{value!r}')


def log_uniform_temperatures(num_heads: int,
                             temperature_range: tuple) -> Tensor:
    """s = exp(linspace(ln s_min, ln s_max, G)), (G,), float32."""
    if not (isinstance(temperature_range, (tuple, list))
            and len(temperature_range) == 2
            and all(isinstance(t, (int, float)) and t > 0
                    for t in temperature_range)
            and temperature_range[0] <= temperature_range[1]):
        raise ValueError('temperature_range must be (s_min, s_max) with '
                         f'0 < s_min <= s_max, got {temperature_range!r}')
    lo, hi = (float(t) for t in temperature_range)
    return torch.exp(
        torch.linspace(torch.tensor(lo).log().item(),
                       torch.tensor(hi).log().item(), num_heads))


def spatial_check(state_hw: tuple, x_hw: tuple, owner: str,
                  hint: Optional[str] = None) -> None:
    if tuple(state_hw) != tuple(x_hw):
        raise ValueError(f'{owner}: the incoming state is {tuple(state_hw)} '
                         f'but the input is {tuple(x_hw)}' +
                         (f'; {hint}' if hint else ''))
