"""KCLAStateAdapter in inference (docs/method.md §3, Algorithm 1) as one
``kcla_mm._ext`` call.

From the incoming state (U (B, C', H', W'), Z (B, G')), with the adapter's
grouped 1x1 conv ``weight`` (G groups) at ``stride`` and its eval BN::

    A' = BN(Conv1x1(U / Z))                              (B, C, h, w)
    z  = exp(min(|Conv1d_u(GAP(A'))_g| / norm_d_g, max_log_weight))
    U' = z A'

A' is affine in the strided U, so the op needs GAP(U) at the stride, the
per-head scalars, then one batched matmul, instead of some 25 small torch
ops; callers check :func:`kcla_mm.ops.kcla_branch.layer_supported`.
"""
from typing import Tuple

import torch.nn as nn
from torch import Tensor

from .ext_loader import get_ext
from .kcla_branch import bn_params
from .kcla_heads import as_operand


def kcla_adapter_inference(u: Tensor, z: Tensor, weight: Tensor,
                           stride: int, norm: nn.BatchNorm2d,
                           k_kernel: Tensor, norm_d: Tensor,
                           max_log_weight: float) -> Tuple[Tensor, Tensor]:
    """(U', z): (B, C, ceil(H' / s), ceil(W' / s)) and (B, G), no grad.

    ``weight`` is the conv's as (C, C' / G) (identity blocks where the
    adapter has no conv), ``norm`` an eval-mode BatchNorm2d (folded in the
    op), ``k_kernel`` the ECA kernel of Conv1d_u, ``norm_d`` the layer's G
    temperatures; every operand is cast to ``u``'s dtype (float32 or
    float64).
    """
    dtype = u.dtype
    b, c, g = u.shape[0], weight.shape[0], norm_d.numel()
    size = [-(-n // stride) for n in u.shape[2:]]
    u_out = u.new_empty((b, c, *size))
    z_out = u.new_empty((b, g))
    get_ext().kcla_adapter_inference(
        as_operand(u, dtype), as_operand(z, dtype),
        as_operand(weight, dtype), stride,
        *bn_params(norm, dtype), as_operand(k_kernel, dtype),
        as_operand(norm_d, dtype), u_out, z_out, float(norm.eps),
        float(max_log_weight))
    return u_out, z_out
