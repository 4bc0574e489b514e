"""ECA-style channel convolutions that produce KCLA's queries and keys."""
import math

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .utils import state_dtype


def eca_kernel_size(channels: int) -> int:
    """Kernel size of the ECA Conv1d for ``channels`` (spec section 2).

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
    state.
    """
    b, c = pooled.shape
    dtype = state_dtype(pooled)
    # the same cross-correlation as conv(pooled), as windows @ kernel: CPU
    # convolution backends take milliseconds for this (B, 1, C) input
    pad = conv.padding[0]
    windows = F.pad(pooled.to(dtype), (pad, pad)).unfold(
        1, conv.kernel_size[0], 1)
    out = windows @ conv.weight.to(dtype).view(-1)
    return out.view(b, num_heads, c // num_heads)
