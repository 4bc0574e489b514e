"""The fused KCLA branch (spec section 2, steps 4-8) as autograd ops.

For a block output ``x`` (B, C, H, W), the state ``u`` before it, per-head
weights ``w``, the updated normaliser ``z`` and the head gate ``gate``
(all (B, G)), the depthwise kernel ``weight`` (C, 1, 3, 3), a BatchNorm and
drop-path multipliers ``keep`` (B,)::

    u_next = u + w * x
    o      = gate * DWConv3x3(u_next / (z + eps))
    out    = x + keep * ReLU(BN(o))

:func:`kcla_branch` (training) saves only ``x`` (which the block's ReLU
saves anyway) and ``u_next`` for backward and recomputes ``o`` there. With a
:class:`StateTape` it does not even save ``u_next``: the next layer's
backward inverts the running sum, ``u = u_next' - w' * x'``, and hands the
result back through the tape, so the state costs one buffer per chain of
layers instead of one feature map per layer. :func:`kcla_branch_inference`
folds BN into one pass per plane and may update the state in place. Both run
the kernels of ``kcla_mm._ext`` (float32/float64); callers check
:func:`branch_supported`.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from .ext_loader import get_ext, has_device_impl


# A layer saves its incoming state instead of inverting the running sum when
# Z grew more than this factor since the oldest state the inversion would
# recover: the recovered U carries a relative error of about eps * Z_now / Z.
MAX_INVERSION_GROWTH = 32.0


class StateTape:
    """Hands a layer's ``u_next`` back to it in backward, from its successor.

    The layer that did not save its ``u_next`` reads :attr:`u` in its
    backward; the next layer's backward writes it there first (autograd runs
    the successor first: it consumes ``u_next``). :attr:`z_floor` (B, G) is
    Z of the oldest state that would be recovered by inversion alone.
    """

    def __init__(self) -> None:
        self.u: Optional[Tensor] = None
        self.z_floor: Optional[Tensor] = None

    def take(self) -> Tensor:
        u, self.u = self.u, None
        if u is None:
            raise RuntimeError(
                'KCLA state inversion: the next layer\'s backward did not '
                'hand back this layer\'s state; every layer that continues '
                'a state from a layer with invert_state=True must run the '
                'fused training path, and the graph cannot be backwarded '
                'twice')
        return u


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
                use_batch_stats: bool, eps: float,
                tape_in: Optional[StateTape], tape_out: Optional[StateTape],
                save_u: bool) -> Tuple[Tensor, Tensor]:
        ext = get_ext()
        u_next = torch.empty_like(x)
        o = torch.empty_like(x)
        ext.kcla_branch_forward(x, u, w, z, gate, weight, u_next, o, eps)
        mean, invstd = _batch_norm_stats(o, norm, use_batch_stats)
        scale = (bn_weight.to(x.dtype) * invstd).contiguous()
        shift = (bn_bias.to(x.dtype) - mean * scale).contiguous()
        out = torch.empty_like(x)
        b, c, h, w_ = x.shape
        mask = x.new_empty((b, c, (h * w_ + 7) // 8), dtype=torch.uint8)
        ext.kcla_bn_relu_add_forward(o, x, scale, shift, keep, out, mask)
        ctx.save_for_backward(x, u_next if tape_out is None else None, w, z,
                              gate, weight, keep, mean, invstd, scale, mask,
                              u if save_u else None)
        ctx.tape_in = tape_in
        ctx.tape_out = tape_out
        ctx.has_u = u is not None
        ctx.use_batch_stats = use_batch_stats
        ctx.eps = eps
        ctx.bn_dtype = bn_weight.dtype
        return out, u_next

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, grad_u_next: Tensor) -> tuple:
        (x, u_next, w, z, gate, weight, keep, mean, invstd, scale, mask,
         saved_u) = ctx.saved_tensors
        owned = ctx.tape_out is not None
        if owned:
            u_next = ctx.tape_out.take()
        ext = get_ext()
        grad_out = grad_out.contiguous()
        o = torch.empty_like(x)
        ext.kcla_branch_recompute(u_next, z, gate, weight, o, ctx.eps)
        grad_o = torch.empty_like(x)
        sum_grad = torch.empty_like(scale)
        sum_grad_centered = torch.empty_like(scale)
        ext.kcla_bn_relu_add_backward(grad_out, o, scale, mask, keep, mean,
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
        if saved_u is not None:  # hand the previous layer its state
            ctx.tape_in.u = saved_u
        elif ctx.tape_in is not None:  # ... by inverting the running sum
            u = u_next if owned else u_next.clone()
            b, g = w.shape
            u.view(b, g, -1).addcmul_(x.view(b, g, -1), w.view(b, g, 1),
                                      value=-1)
            ctx.tape_in.u = u
        return (grad_x, grad_u, grad_w, grad_z, grad_gate, grad_weight,
                sum_grad_xhat.to(ctx.bn_dtype), sum_grad.to(ctx.bn_dtype),
                None, None, None, None, None, None, None)


def kcla_branch(x: Tensor,
                u: Optional[Tensor],
                w: Tensor,
                z: Tensor,
                gate: Tensor,
                weight: Tensor,
                norm: nn.BatchNorm2d,
                keep: Tensor,
                eps: float = 1e-3,
                tape_in: Optional[StateTape] = None,
                tape_out: Optional[StateTape] = None
                ) -> Tuple[Tensor, Tensor]:
    """Training/autograd branch; returns ``(out, u_next)``, both (B, C, H, W).

    ``norm`` uses batch statistics (and updates its running ones) when in
    training mode, as ``nn.BatchNorm2d`` does. ``tape_in``: the tape of the
    layer that produced ``u``, which this layer's backward fills with ``u``.
    ``tape_out``: if given, ``u_next`` is not saved; the next layer's
    backward must fill this tape. ``u`` itself is saved instead of inverted
    when Z grew by more than :data:`MAX_INVERSION_GROWTH` since
    ``tape_in.z_floor``.
    """
    use_batch_stats = norm.training or norm.running_mean is None
    dtype = x.dtype
    if u is None:
        tape_in = None
    save_u = tape_in is not None and bool(
        (z > MAX_INVERSION_GROWTH * tape_in.z_floor).any())
    if tape_out is not None:
        tape_out.z_floor = z if tape_in is None or save_u else \
            tape_in.z_floor
    return KCLABranchFunction.apply(
        x, None if u is None else u.contiguous(), w.to(dtype).contiguous(),
        z.to(dtype).contiguous(), gate.to(dtype).contiguous(),
        weight.to(dtype).contiguous(), norm.weight, norm.bias,
        keep.to(dtype).contiguous(), norm, use_batch_stats, float(eps),
        tape_in, tape_out, save_u)


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
