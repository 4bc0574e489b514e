"""What the fused ops' backwards cannot do, as errors that name the way
out: they are first order only (a gradient taken with
``create_graph=True`` cannot be differentiated again through them) and
take one gradient at a time (no batched gradients). The C++ autograd ops
of the branch (``csrc/pytorch/kcla_branch_autograd.cpp``) guard their
backwards the same way, with these messages, which
:func:`~kcla_mm.ops.ext_loader.get_ext` hands them."""
import functools
from typing import Callable

import torch
from torch import Tensor
from torch.autograd import Function

TORCH_OPS_REMEDY = (
    "run the model's KCLA layers on PyTorch ops (kcla_impl='torch' in "
    "ResNetKCLA and KCLAFPN, impl='torch' in KCLALayer and "
    'KCLADecoderAttention)')
SECOND_ORDER_ERROR = (
    "KCLA's fused kernels have no second derivative: a gradient taken "
    'with create_graph=True (a gradient penalty, a Hessian-vector product) '
    f'cannot be differentiated through them; {TORCH_OPS_REMEDY}')
BATCHED_GRAD_ERROR = (
    "KCLA's fused kernels take one gradient at a time, not batched ones "
    '(torch.autograd.grad(..., is_grads_batched=True), '
    'torch.autograd.functional.jacobian / hessian with vectorize=True); '
    f'{TORCH_OPS_REMEDY}, or leave vectorize off')


class _SecondOrderBarrier(Function):
    """Identity on a backward's gradients; raising when differentiated."""

    @staticmethod
    def forward(ctx, *grads: Tensor) -> tuple:
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        raise RuntimeError(SECOND_ORDER_ERROR)


def _batched(t) -> bool:
    """Whether ``t`` is a vmap BatchedTensor (no storage for the kernels):
    legacy vmap batches the gradients of ``is_grads_batched``."""
    return isinstance(t, Tensor) and (
        torch._C._functorch.is_legacy_batchedtensor(t)
        or torch._C._functorch.is_batchedtensor(t))


def fused_backward(backward: Callable) -> Callable:
    """``torch.autograd.function.once_differentiable`` with errors of its
    own: ``backward`` runs without grad, on unbatched gradients
    (:data:`BATCHED_GRAD_ERROR` otherwise); under ``create_graph=True``
    its gradients lead to a node that raises :data:`SECOND_ORDER_ERROR` if
    a second backward reaches it."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if any(_batched(g) for g in grads):
            raise RuntimeError(BATCHED_GRAD_ERROR)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled() or not any(
                isinstance(g, Tensor) and g.requires_grad for g in grads):
            return outputs
        # detached leaves that require grad, so that each guarded gradient
        # gets the barrier as its grad_fn
        tensors = [o.detach().requires_grad_() for o in outputs
                   if isinstance(o, Tensor)]
        if not tensors:
            return outputs
        guarded = iter(_SecondOrderBarrier.apply(*tensors))
        return tuple(next(guarded) if isinstance(o, Tensor) else o
                     for o in outputs)

    return wrapper
