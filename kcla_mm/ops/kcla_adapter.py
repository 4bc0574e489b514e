"""KCLAStateAdapter (docs/method.md §3, Algorithm 1) as ``kcla_mm._ext``
ops: :func:`kcla_adapter_inference` (no grad, eval BN folded, one call)
and :func:`kcla_adapter` (autograd, batch or running statistics).

From the incoming state (U (B, C', H', W'), Z (B, G')), with the adapter's
grouped 1x1 conv ``weight`` (G groups) at ``stride`` and its eval BN::

    A' = BN(Conv1x1(U / Z))                              (B, C, h, w)
    z  = exp(min(|Conv1d_u(GAP(A'))_g| / norm_d_g, max_log_weight))
    U' = z A'

A' is affine in the strided U, so the op needs GAP(U) at the stride, the
per-head scalars, then one batched matmul, instead of some 25 small torch
ops; callers check :func:`kcla_mm.ops.kcla_branch.layer_supported`.
"""
from typing import Optional, Tuple

import torch.nn as nn
from torch import Tensor

from .ext_loader import get_ext
from .kcla_branch import bn_params, running_stats_momentum
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


def kcla_adapter(u: Tensor, z: Tensor, conv: Optional[nn.Conv2d],
                 stride: int, norm: nn.BatchNorm2d, k_kernel: Tensor,
                 norm_d: Tensor, max_log_weight: float
                 ) -> Tuple[Tensor, Tensor]:
    """(U', z): (B, C, ceil(H' / s), ceil(W' / s)) and (B, G), with
    gradients for ``u``, ``z`` and the parameters of ``conv`` (the grouped
    1x1 conv, G groups; None: identity), ``norm`` and ``k_kernel``.

    ``norm`` (a BatchNorm2d with affine parameters) uses batch statistics
    and updates its running ones in training mode, as ``nn.BatchNorm2d``
    does; its running statistics otherwise. With batch statistics only the
    strided state, centred, is saved for backward (the running ones: the
    strided state). The maps take two batched matmuls each way in ATen,
    the per-head scalars one kernel; float32 and float64 (every operand is
    cast to ``u``'s dtype); callers check
    :func:`kcla_mm.ops.kcla_branch.layer_supported`.
    """
    dtype = u.dtype
    batch_stats = norm.training or norm.running_mean is None
    momentum = running_stats_momentum(norm) if batch_stats else None
    # the running statistics: read with running ones, updated with batch
    # ones where the norm tracks them (a momentum)
    running = (norm.running_mean, norm.running_var) \
        if momentum is not None or not batch_stats else (None, None)
    return tuple(get_ext().kcla_adapter_autograd(
        u, as_operand(z, dtype),
        None if conv is None else as_operand(conv.weight, dtype),
        as_operand(norm.weight, dtype), as_operand(norm.bias, dtype),
        *running, as_operand(k_kernel, dtype), as_operand(norm_d, dtype),
        stride, batch_stats, -1.0 if momentum is None else float(momentum),
        float(norm.eps), float(max_log_weight)))
