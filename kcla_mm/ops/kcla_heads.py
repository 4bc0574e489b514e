"""KCLALayer's per-head scalars (docs/method.md §2, steps 1-3) as one op.

From the pooled block output ``pooled`` (B, C) and the ECA kernels, the
temperatures ``norm_d`` (G,) and the gate's (G, G) weight::

    Q, K  = Conv1d_q(pooled), Conv1d_k(pooled)          viewed (B, G, d)
    w     = exp(min(|K_g| / norm_d_g, max_log_weight))
    z'    = z + w                                       (z None: w)
    gate  = sigmoid(gate_weight @ (<Q_g, K_g> / max(|K_g|, key_eps)))

:func:`kcla_heads` runs forward and backward in ``kcla_mm._ext`` (float32
and float64) instead of some 20 small torch ops each way, as a C++
autograd op (``csrc/pytorch/kcla_ops_autograd.cpp``); callers check
:func:`kcla_mm.ops.kcla_branch.layer_supported`.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .ext_loader import get_ext


def kcla_heads(pooled: Tensor, z: Optional[Tensor], q_kernel: Tensor,
               k_kernel: Tensor, norm_d: Tensor, gate_weight: Tensor,
               key_eps: float, max_log_weight: float
               ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(w, z', gate)``, each (B, G), with gradients for ``pooled``
    (B, C), ``z`` (B, G) or None, the ECA kernels (any shape of k
    elements), ``gate_weight`` (G, G); ``norm_d`` (G,) is a constant. All
    are cast to ``pooled``'s dtype."""
    dtype = pooled.dtype
    return tuple(get_ext().kcla_heads_autograd(
        pooled.contiguous(), None if z is None else as_operand(z, dtype),
        *head_params(q_kernel, k_kernel, norm_d, gate_weight, dtype),
        float(key_eps), float(max_log_weight)))


def as_operand(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` contiguous in ``dtype``, as the extension takes it: ``t``
    itself where it already is (a differentiable cast otherwise)."""
    return t if t.dtype == dtype and t.is_contiguous() else \
        t.to(dtype).contiguous()


def head_params(q_kernel: Tensor, k_kernel: Tensor, norm_d: Tensor,
                gate_weight: Tensor, dtype) -> Tuple[Tensor, ...]:
    """The heads' parameters as the extension takes them, contiguous in
    ``dtype`` (differentiable casts; the ECA kernels and ``norm_d`` of any
    shape, ``gate_weight`` (G, G))."""
    return tuple(as_operand(t, dtype)
                 for t in (q_kernel, k_kernel, norm_d, gate_weight))
