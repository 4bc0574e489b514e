"""ECA-style channel convolutions that produce KCLA's queries and keys."""
import math
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .utils import hooked, state_dtype


def eca_kernel_size(channels: int) -> int:
    """Kernel size of the ECA Conv1d for ``channels`` (docs/method.md §2).

    t = int(|log2(C) + 1| / 2); k = t if t is odd else t + 1. For example
    64 -> 3, 128..1024 -> 5, 2048 -> 7.
    """
    t = int(abs(math.log2(channels) + 1) / 2)
    return t if t % 2 else t + 1


def build_eca_conv(channels: int) -> nn.Conv1d:
    """Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False) sliding on channels."""
    k = eca_kernel_size(channels)
    return nn.Conv1d(1, 1, kernel_size=k, padding=(k - 1) // 2, bias=False)


def eca_project(conv: nn.Conv1d, pooled: Tensor, num_heads: int) -> Tensor:
    """Apply ``conv`` to pooled features (B, C) -> (B, G, C // G).

    Computed in float32 (float64 for float64 input), whatever the autocast
    state; as a matmul unless ``conv`` has hooks (:func:`hooked`), which
    a call of ``conv`` runs.
    """
    b, c = pooled.shape
    dtype = state_dtype(pooled)
    if hooked(conv):
        out = conv(pooled.to(conv.weight.dtype).unsqueeze(1)).to(dtype)
    else:
        out = _windows(conv, pooled.to(dtype)) @ conv.weight.to(dtype).view(
            -1)
    return out.view(b, num_heads, c // num_heads)


def eca_project_pair(conv_a: nn.Conv1d, conv_b: nn.Conv1d, pooled: Tensor,
                     num_heads: int) -> Tuple[Tensor, Tensor]:
    """``eca_project`` with two convs of one kernel size (KCLA's query and
    key) in one matmul: (B, C) -> two (B, G, C // G)."""
    if conv_a.kernel_size != conv_b.kernel_size:
        raise ValueError('eca_project_pair: the two convs have kernel sizes '
                         f'{conv_a.kernel_size} and {conv_b.kernel_size}')
    if hooked(conv_a, conv_b):
        return (eca_project(conv_a, pooled, num_heads),
                eca_project(conv_b, pooled, num_heads))
    b, c = pooled.shape
    dtype = state_dtype(pooled)
    kernels = torch.stack([conv_a.weight.to(dtype).view(-1),
                           conv_b.weight.to(dtype).view(-1)], dim=1)
    out = _windows(conv_a, pooled.to(dtype)) @ kernels  # (B, C, 2)
    shape = (b, num_heads, c // num_heads)
    return out[..., 0].view(shape), out[..., 1].view(shape)


def _windows(conv: nn.Conv1d, pooled: Tensor) -> Tensor:
    """The zero-padded sliding windows of ``conv`` over the channels of
    ``pooled`` (B, C) -> (B, C, k): the same cross-correlation as
    ``conv(pooled)`` becomes windows @ kernel (CPU convolution backends
    take milliseconds for this (B, 1, C) input)."""
    pad = conv.padding[0]
    return F.pad(pooled, (pad, pad)).unfold(1, conv.kernel_size[0], 1)
