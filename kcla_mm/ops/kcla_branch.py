"""The fused KCLA branch (spec section 2, steps 4-8) as autograd ops.

For a block output ``x`` (B, C, H, W), the state ``u`` before it, per-head
weights ``w``, the updated normaliser ``z`` and the head gate ``gate``
(all (B, G)), the depthwise kernel ``weight`` (C, 1, 3, 3), a BatchNorm and
drop-path multipliers ``keep`` (B,)::

    u_next = u + w * x
    o      = gate * DWConv3x3(u_next / (z + eps))
    out    = x + keep * ReLU(BN(o))

:func:`kcla_branch` (training) saves only ``x`` and ``u_next`` for backward
and recomputes ``o`` there, so a layer keeps one extra feature map, not the
five of the unfused graph. :func:`kcla_branch_inference` folds BN into one
pass per plane and may update the state in place. Both run the kernels of
``kcla_mm._ext`` (float32/float64); callers check :func:`branch_supported`.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from .ext_loader import get_ext, has_device_impl


def branch_supported(x: Tensor, norm: nn.Module) -> bool:
    """Whether the fused branch can run for ``x`` and this norm layer."""
    return (type(norm) is nn.BatchNorm2d and norm.affine
            and x.dtype in (torch.float32, torch.float64)
            and has_device_impl(x.device.type, 'branch'))


def _batch_norm_stats(o: Tensor, norm: nn.BatchNorm2d,
                      use_batch_stats: bool) -> Tuple[Tensor, Tensor]:
    """Mean and 1 / std of BN; updates the running statistics in training."""
    if use_batch_stats:
        var, mean = torch.var_mean(o, dim=(0, 2, 3), unbiased=False)
        if norm.track_running_stats and norm.running_mean is not None:
            n = o.numel() // o.shape[1]
            norm.num_batches_tracked.add_(1)
            momentum = norm.momentum if norm.momentum is not None else \
                1.0 / float(norm.num_batches_tracked)
            norm.running_mean.mul_(1 - momentum).add_(momentum * mean)
            norm.running_var.mul_(1 - momentum).add_(
                momentum * var * n / max(n - 1, 1))
    else:
        mean, var = norm.running_mean, norm.running_var
    return mean.to(o.dtype), torch.rsqrt(var.to(o.dtype) + norm.eps)


class KCLABranchFunction(Function):
    """Autograd op of the whole branch; see the module docstring."""

    @staticmethod
    def forward(ctx, x: Tensor, u: Optional[Tensor], w: Tensor, z: Tensor,
                gate: Tensor, weight: Tensor, bn_weight: Tensor,
                bn_bias: Tensor, keep: Tensor, norm: nn.BatchNorm2d,
                use_batch_stats: bool, eps: float) -> Tuple[Tensor, Tensor]:
        ext = get_ext()
        u_next = torch.empty_like(x)
        o = torch.empty_like(x)
        ext.kcla_branch_forward(x, u, w, z, gate, weight, u_next, o, eps)
        mean, invstd = _batch_norm_stats(o, norm, use_batch_stats)
        scale = (bn_weight.to(x.dtype) * invstd).contiguous()
        shift = (bn_bias.to(x.dtype) - mean * scale).contiguous()
        out = torch.empty_like(x)
        ext.kcla_bn_relu_add_forward(o, x, scale, shift, keep, out)
        ctx.save_for_backward(x, u_next, w, z, gate, weight, keep, mean,
                              invstd, scale, shift)
        ctx.has_u = u is not None
        ctx.use_batch_stats = use_batch_stats
        ctx.eps = eps
        ctx.bn_dtype = bn_weight.dtype
        return out, u_next

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, grad_u_next: Tensor) -> tuple:
        (x, u_next, w, z, gate, weight, keep, mean, invstd, scale,
         shift) = ctx.saved_tensors
        ext = get_ext()
        grad_out = grad_out.contiguous()
        o = torch.empty_like(x)
        ext.kcla_branch_recompute(u_next, z, gate, weight, o, ctx.eps)
        grad_o = torch.empty_like(x)
        sum_grad = torch.empty_like(scale)
        sum_grad_centered = torch.empty_like(scale)
        ext.kcla_bn_relu_add_backward(grad_out, o, scale, shift, keep, mean,
                                      grad_o, sum_grad, sum_grad_centered)
        del o
        # sum over positions of g_n * x_hat, x_hat = (o - mean) * invstd
        sum_grad_xhat = invstd * sum_grad_centered
        if ctx.use_batch_stats:  # the batch statistics depend on o
            n = x.numel() // x.shape[1]
            beta = -scale * invstd * sum_grad_xhat / n
            alpha = -scale * sum_grad / n
        else:
            alpha = beta = torch.zeros_like(scale)
        grad_x = torch.empty_like(x)
        grad_u = torch.empty_like(x) if ctx.has_u else None
        grad_w, grad_z, grad_gate = (torch.empty_like(w) for _ in range(3))
        grad_weight = torch.empty_like(weight)
        ext.kcla_branch_backward(grad_o, alpha.contiguous(), beta.contiguous(),
                                 mean.contiguous(), grad_u_next.contiguous(),
                                 grad_out, x,
                                 u_next, w, z, gate, weight, grad_x, grad_u,
                                 grad_w, grad_z, grad_gate, grad_weight,
                                 ctx.eps)
        return (grad_x, grad_u, grad_w, grad_z, grad_gate, grad_weight,
                sum_grad_xhat.to(ctx.bn_dtype), sum_grad.to(ctx.bn_dtype),
                None, None, None, None)


def kcla_branch(x: Tensor, u: Optional[Tensor], w: Tensor, z: Tensor,
                gate: Tensor, weight: Tensor, norm: nn.BatchNorm2d,
                keep: Tensor, eps: float = 1e-3) -> Tuple[Tensor, Tensor]:
    """Training/autograd branch; returns ``(out, u_next)``, both (B, C, H, W).

    ``norm`` uses batch statistics (and updates its running ones) when in
    training mode, as ``nn.BatchNorm2d`` does.
    """
    use_batch_stats = norm.training or norm.running_mean is None
    dtype = x.dtype
    return KCLABranchFunction.apply(
        x, None if u is None else u.contiguous(), w.to(dtype).contiguous(),
        z.to(dtype).contiguous(), gate.to(dtype).contiguous(),
        weight.to(dtype).contiguous(), norm.weight, norm.bias,
        keep.to(dtype).contiguous(), norm, use_batch_stats, float(eps))


def kcla_branch_inference(x: Tensor, u: Optional[Tensor], w: Tensor,
                          z: Tensor, gate: Tensor, weight: Tensor,
                          norm: nn.BatchNorm2d,
                          eps: float = 1e-3) -> Tuple[Tensor, Tensor]:
    """No-grad eval branch with BN folded; returns ``(out, u_next)``.

    The state is updated in place: the returned ``u_next`` is ``u`` (when
    given), so an incoming state cannot be reused after this call.
    """
    dtype = x.dtype
    invstd = torch.rsqrt(norm.running_var.to(dtype) + norm.eps)
    scale = (norm.weight.to(dtype) * invstd).contiguous()
    shift = (norm.bias.to(dtype) - norm.running_mean.to(dtype) *
             scale).contiguous()
    u_next = torch.empty_like(x) if u is None else u
    out = torch.empty_like(x)
    get_ext().kcla_branch_inference(x, u, w.to(dtype).contiguous(),
                                    z.to(dtype).contiguous(),
                                    gate.to(dtype).contiguous(),
                                    weight.to(dtype).contiguous(), scale,
                                    shift, u_next, out, float(eps))
    return out, u_next
