"""The fused KCLA branch (docs/method.md §2, steps 4-8) as autograd ops.

For a block output ``x`` (B, C, H, W), the state ``u`` before it, per-head
weights ``w``, the updated normaliser ``z`` and the head gate ``gate``
(all (B, G)), the depthwise kernel ``weight`` (C, 1, 3, 3), a BatchNorm and
drop-path multipliers ``keep`` (B,)::

    u_next = u + w * x
    o      = gate * DWConv3x3(u_next / (z + eps))
    out    = x + keep * ReLU(BN(o))

:func:`relu_pool` applies a residual block's shortcut add and final ReLU
in place and pools the result in the same pass (KCLA's GAP), keeping only
a 1-bit mask for backward, so the block's ReLU output is never saved.

:func:`kcla_branch` (training) saves ``out`` (which the next block's conv
saves anyway), two bit masks and per-channel statistics, and ``u_next``;
backward recomputes ``o`` from ``u_next`` and recovers ``x = out - keep *
ReLU(BN(o))``. With BN in eval mode forward and backward are one pass each
over the maps; with batch statistics each takes one more (the statistics,
and their gradient terms). With a :class:`StateTape` the layer does not
even save ``u_next``: the next layer's backward inverts the running sum,
``u = u_next' - w' * x'``, and hands the result back through the tape, so
the state costs one buffer per chain of layers instead of one feature map
per layer (:func:`release_invertible`). :func:`kcla_branch_inference`
folds BN into one pass and updates the state in place;
:func:`kcla_layer_inference` runs a whole layer (with its tail op and
heads) in one call. Where :func:`layer_supported`, :func:`kcla_branch`'s
forward and backward are one call each (BN's statistics, their fold and
the gradient sums inside); elsewhere one kernel per pass, with that glue
in ATen. All run the kernels of ``kcla_mm._ext``
(float32/float64), the autograd ops as C++ Functions
(``csrc/pytorch/kcla_branch_autograd.cpp``), which call the tapes' and
handoffs' methods; callers check :func:`branch_supported` (and
:func:`layer_supported`).
"""
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
from mmengine.model.utils import _BatchNormXd
from torch import Tensor

from .ext_loader import get_ext, has_device_impl
from .kcla_heads import as_operand, head_params


# A layer keeps its incoming state instead of letting backward invert the
# running sum when Z grew more than this factor since the oldest state the
# inversion would recover: the recovered U carries a relative error of about
# eps * Z_now / Z. The growth is checked on the device, in the branch op;
# :func:`release_invertible` reads all of a forward's answers at once.
MAX_INVERSION_GROWTH = 16.0


def capturing(t: Tensor) -> bool:
    """Whether ``t``'s stream is being captured into a CUDA graph, where the
    host cannot read device values."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class StateTape:
    """Hands a layer's ``u_next`` back to it in backward, from its successor.

    The layer that did not save its ``u_next`` takes it in its backward; the
    next layer's backward hands it over first (autograd runs the successor
    first: it consumes ``u_next``), recovered by inverting its own update,
    unless the successor keeps ``u_next`` in :attr:`kept` (a successor that
    does not invert, such as one on PyTorch ops or a state adapter, or one
    whose growth check in :attr:`keep_flag` is not yet read: see
    :func:`release_invertible`). :attr:`z_floor` (B, G) is Z of the oldest
    state that would be recovered by inversion alone. :attr:`grad_u` is the
    gradient the successor's backward returned for ``u_next`` (see
    :class:`GradHandoff`).
    """

    def __init__(self) -> None:
        self.u: Optional[Tensor] = None
        self.writable = False
        self.z_floor: Optional[Tensor] = None
        self.grad_u = GradHandoff()
        self.kept: Optional[Tensor] = None
        self.keep_flag: Optional[Tensor] = None

    def keep(self, u: Tensor, flag: Optional[Tensor] = None) -> None:
        """Keeps ``u`` for the taker, for good or, with ``flag`` (a device
        bool), until :func:`release_invertible` reads it. Detached: the tape
        is reachable from the node that produced ``u`` (it takes from the
        tape), and a reference back would be a cycle through C++ that no
        garbage collector breaks."""
        self.kept, self.keep_flag = u.detach(), flag

    def hand(self, u: Tensor, writable: bool) -> None:
        """``writable``: the taker may invert ``u`` in place (False for a
        tensor saved or kept: a second backward, ``retain_graph=True``,
        reads it again)."""
        self.u, self.writable = u, writable

    def take(self) -> Tuple[Tensor, bool]:
        """``u_next`` and whether it is writable."""
        u, self.u = self.u, None
        if u is None and self.kept is not None:
            return self.kept, False
        if u is None:
            raise RuntimeError(
                'KCLA state inversion: the next layer\'s backward did not '
                'hand back this layer\'s state; a backward must reach a '
                'layer with invert_state=True through the next one (a loss '
                'on its output alone cannot; set invert_state=False on it '
                'for that)')
        return u, self.writable


def release_invertible(tapes: Sequence[StateTape]) -> None:
    """Drops the states that ``tapes`` keep only until their growth check
    is read, where backward can recover them by inversion.

    One host read for all of them: call it once a forward's layers have run
    (``ResNetKCLA`` does, after its last stage). Until then every layer
    keeps its incoming state, exact and one map each; a tape whose check
    says Z grew too fast keeps it for good. Under CUDA-graph capture nothing
    is read and every state is kept.
    """
    pending = [t for t in tapes if t.keep_flag is not None]
    if not pending or capturing(pending[0].keep_flag):
        return
    flags = torch.stack([t.keep_flag for t in pending]).to('cpu', copy=True)
    for tape, grew in zip(pending, flags.tolist()):
        tape.keep_flag = None
        if not grew:
            tape.kept = None


class GradHandoff:
    """A gradient that one op's backward returns for its input, handed to
    the op that produced that input: when autograd passes this very tensor
    on (no other gradient was summed into it), the producer's backward is
    its only user and overwrites it in place, sparing a map's allocation
    and memory traffic."""

    def __init__(self) -> None:
        self._grad: Optional[Tensor] = None

    def give(self, grad: Optional[Tensor]) -> None:
        self._grad = grad

    def owns(self, grad: Optional[Tensor]) -> bool:
        """Whether ``grad`` is the handed tensor (which is then released)."""
        handed, self._grad = self._grad, None
        return grad is not None and grad is handed


# BatchNorms that compute what nn.BatchNorm2d does on (B, C, H, W) maps:
# mmengine's runner turns SyncBN into _BatchNormXd (BatchNorm without the
# input-dim check) when it trains or tests on one process
PLAIN_BATCH_NORMS = (nn.BatchNorm2d, _BatchNormXd)


def plain_affine_bn(norm: nn.Module) -> bool:
    """Whether ``norm`` is one of :data:`PLAIN_BATCH_NORMS` itself (no
    subclass such as SyncBatchNorm, whose statistics span processes) with
    affine parameters, as the fused ops compute it."""
    return type(norm) in PLAIN_BATCH_NORMS and norm.affine


def branch_supported(x: Tensor, norm: nn.Module) -> bool:
    """Whether the fused branch can run for ``x`` and this norm layer."""
    return (plain_affine_bn(norm)
            and x.dtype in (torch.float32, torch.float64)
            and has_device_impl(x.device.type, 'branch'))


# Devices whose 'layer' kernels have not yet passed the CUDA tests on a real
# GPU: there impl='auto' keeps the per-pass route that one has passed, and
# impl='fused' opts in (docs/gpu.md).
UNVERIFIED_LAYER_DEVICES = frozenset({'cuda'})


def layer_supported(x: Tensor, impl: str = 'auto') -> bool:
    """Whether the extension's ``'layer'`` group (:func:`kcla_layer_inference`,
    the one-call training branch, :func:`kcla_mm.ops.kcla_heads.kcla_heads`
    and the adapter ops) runs for ``x`` under ``impl`` (on top of
    :func:`branch_supported`): the device has it, verified, or ``impl`` is
    ``'fused'``."""
    device = x.device.type
    return has_device_impl(device, 'layer') and (
        impl == 'fused' or device not in UNVERIFIED_LAYER_DEVICES)


def foldable_bn(norm: nn.Module) -> bool:
    """Whether ``norm`` is an eval-mode :func:`plain_affine_bn` with running
    statistics: an affine map
    :func:`kcla_layer_inference` can fold in."""
    return (plain_affine_bn(norm) and not norm.training
            and norm.running_mean is not None)


def relu_pool(s: Tensor,
              residual: Optional[Tensor] = None,
              handoff: Optional[GradHandoff] = None,
              impl: str = 'auto') -> Tuple[Tensor, Tensor]:
    """``x = ReLU(s + residual)`` in place and ``x.mean((2, 3))``,
    (B, C, H, W) -> ((B, C, H, W), (B, C)); ``s`` (and ``residual``, if
    given: a block's shortcut) must be contiguous; ``s`` is overwritten.
    With autograd it saves only the ReLU's bit mask. ``handoff``: where the
    op consuming ``x`` hands its gradient of ``x`` back through it, backward
    writes the gradient of ``s`` over it (where :func:`layer_supported`
    under ``impl``, as the one-call branch hands it over)."""
    if torch.is_grad_enabled() and (s.requires_grad or (
            residual is not None and residual.requires_grad)):
        return tuple(get_ext().kcla_relu_pool_autograd(
            s, residual, handoff, layer_supported(s, impl)))
    pooled = s.new_empty(s.shape[:2])
    get_ext().kcla_relu_pool_forward(s, residual, None, pooled)
    return s, pooled


def running_stats_momentum(norm: nn.BatchNorm2d) -> Optional[float]:
    """Counts a training batch in ``norm.num_batches_tracked`` and returns
    the momentum of its running-statistics update, as ``nn.BatchNorm2d``
    does; None when ``norm`` keeps no running statistics."""
    if not norm.track_running_stats or norm.running_mean is None:
        return None
    norm.num_batches_tracked.add_(1)
    return norm.momentum if norm.momentum is not None else \
        1.0 / float(norm.num_batches_tracked)


def update_running_stats(norm: nn.BatchNorm2d, mean: Tensor, var: Tensor,
                         n: int) -> None:
    """nn.BatchNorm2d's running-statistics update from batch ``mean`` and
    biased ``var`` over ``n`` values per channel."""
    momentum = running_stats_momentum(norm)
    if momentum is None:
        return
    norm.running_mean.mul_(1 - momentum).add_(
        momentum * mean.to(norm.running_mean.dtype))
    norm.running_var.mul_(1 - momentum).add_(
        momentum * var.to(norm.running_var.dtype) * n / max(n - 1, 1))


def bn_params(norm: nn.BatchNorm2d, dtype: torch.dtype) -> Tuple[Tensor, ...]:
    """(weight, bias, running_mean, running_var) of an eval-mode ``norm``
    in ``dtype``, as the one-call inference op folds them."""
    return tuple(as_operand(t, dtype) for t in (norm.weight, norm.bias,
                                                norm.running_mean,
                                                norm.running_var))


def new_state(x: Tensor) -> Tensor:
    """The U buffer of a state that starts at the layer of ``x``, (B, C, H,
    W) like ``x``, for the no-grad kernels to write.

    Zero-filled although they write all of it: in ResNet-50 inference on a
    2-core CPU VM, the first layer took 1.9-7.4 ms per forward (over 5 ms
    in most processes) when the one-call kernel's own writes were the
    first to its fresh 12.8 MB U, against 2.2-2.3 ms with this fill
    included.
    """
    return torch.zeros_like(x)


def _folded_bn(norm: nn.BatchNorm2d, mean: Tensor, var: Tensor,
               dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """(invstd, scale, shift) with BN(o) = scale * o + shift, each (C,)."""
    invstd = torch.rsqrt(var.to(dtype) + norm.eps)
    scale = norm.weight.to(dtype) * invstd
    shift = norm.bias.to(dtype) - mean.to(dtype) * scale
    return invstd, scale.contiguous(), shift.contiguous()


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
                tape_out: Optional[StateTape] = None,
                out_in_place: bool = False,
                x_handoff: Optional[GradHandoff] = None,
                impl: str = 'auto') -> Tuple[Tensor, Tensor]:
    """Training/autograd branch; returns ``(out, u_next)``, both (B, C, H, W).

    ``norm`` uses batch statistics (and updates its running ones) when in
    training mode, as ``nn.BatchNorm2d`` does. ``tape_in``: the tape of the
    layer that produced ``u``, which this layer's backward fills with ``u``.
    ``tape_out``: if given, ``u_next`` is not saved; the next layer's
    backward must fill this tape. With ``tape_in``, ``u`` (the previous
    layer's unsaved ``u_next``) is kept on ``tape_in`` with the device's
    answer whether Z grew by more than :data:`MAX_INVERSION_GROWTH` since
    ``tape_in.z_floor``, for :func:`release_invertible` to drop it where
    backward can invert. ``out_in_place``: write
    ``out`` over ``x`` (which must then be a tensor nobody else needs, e.g.
    :func:`relu_pool`'s). ``x_handoff``: backward hands its gradient of
    ``x`` through it (to :func:`relu_pool`, which produced ``x``).
    ``impl``: the layer's, for :func:`layer_supported`.
    """
    use_batch_stats = norm.training or norm.running_mean is None
    dtype = x.dtype
    if u is None:
        tape_in = None
    # the one-call kernels of the 'layer' group, where the running
    # statistics (if any) have x's dtype
    one_call = layer_supported(x, impl) and (norm.running_mean is None or
                                       norm.running_mean.dtype == dtype)
    z = as_operand(z, dtype)
    results = get_ext().kcla_branch_autograd(
        x, None if u is None else u.contiguous(), as_operand(w, dtype), z,
        as_operand(gate, dtype), as_operand(weight, dtype), norm.weight,
        norm.bias, as_operand(keep, dtype), norm.running_mean,
        norm.running_var,
        running_stats_momentum(norm) if use_batch_stats else None,
        use_batch_stats, one_call, norm.eps, float(eps), tape_in, tape_out,
        out_in_place, x_handoff,
        None if tape_in is None else tape_in.z_floor, MAX_INVERSION_GROWTH)
    if tape_in is not None:
        tape_in.keep(u, results[2])
    if tape_out is not None:
        tape_out.z_floor = z if tape_in is None else results[3]
    return results[0], results[1]


def kcla_branch_inference(x: Tensor,
                          u: Optional[Tensor],
                          w: Tensor,
                          z: Tensor,
                          gate: Tensor,
                          weight: Tensor,
                          norm: nn.BatchNorm2d,
                          eps: float = 1e-3,
                          out_in_place: bool = False) -> Tuple[Tensor, Tensor]:
    """No-grad eval branch with BN folded, one pass; returns
    ``(out, u_next)``.

    The state is updated in place: the returned ``u_next`` is ``u`` (when
    given), so an incoming state cannot be reused after this call; with
    ``out_in_place`` so is ``x``.
    """
    dtype = x.dtype
    _, scale, shift = _folded_bn(norm, norm.running_mean, norm.running_var,
                                 dtype)
    u_next = new_state(x) if u is None else u
    out = x if out_in_place else torch.empty_like(x)
    get_ext().kcla_branch_forward(x, u, as_operand(w, dtype),
                                  as_operand(z, dtype),
                                  as_operand(gate, dtype),
                                  as_operand(weight, dtype), scale, shift,
                                  None, u_next, out, None, float(eps))
    return out, u_next


def kcla_layer_inference(s: Tensor,
                         residual: Optional[Tensor],
                         u: Optional[Tensor],
                         z: Optional[Tensor],
                         q_kernel: Tensor,
                         k_kernel: Tensor,
                         norm_d: Tensor,
                         gate_weight: Tensor,
                         weight: Tensor,
                         norm: nn.BatchNorm2d,
                         eps: float,
                         key_eps: float,
                         max_log_weight: float,
                         tail_norm: Optional[nn.BatchNorm2d] = None
                         ) -> Tuple[Tensor, Tensor, Tensor]:
    """A whole KCLA layer, no grad, eval BN, in one call; returns
    ``(out, u_next, z_next)``.

    ``out = x + ReLU(BN(gate * DWConv3x3(u_next / (z_next + eps))))`` with
    ``x = ReLU(tail_norm(s) + residual)`` (both optional), the heads from
    ``GAP(x)`` (ECA kernels ``q_kernel``, ``k_kernel`` (k elements),
    ``norm_d`` (G elements), ``gate_weight`` (G, G)) and ``u_next = u + w *
    x``; both BNs are folded inside the op. ``s`` (B, C, H, W) contiguous
    is overwritten with ``out``; ``u`` (with ``z`` (B, G), or neither: the
    first layer) is updated in place.
    """
    dtype = s.dtype
    b, g = s.shape[0], gate_weight.shape[0]
    tail = (None, ) * 4 if tail_norm is None else bn_params(tail_norm, dtype)
    u_next = new_state(s) if u is None else u
    w = s.new_empty((b, g))
    z_next = s.new_empty((b, g))
    gate = s.new_empty((b, g))
    get_ext().kcla_layer_inference(
        s, residual, *tail, u,
        None if z is None else as_operand(z, dtype),
        *head_params(q_kernel, k_kernel, norm_d, gate_weight, dtype),
        as_operand(weight, dtype), *bn_params(norm, dtype), u_next, w,
        z_next, gate, float(eps), float(key_eps), float(max_log_weight),
        float(norm.eps), 0.0 if tail_norm is None else float(tail_norm.eps))
    return s, u_next, z_next
