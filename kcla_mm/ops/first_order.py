"""The fused ops' backwards are first order only: differentiating a
gradient through them (``create_graph=True``, e.g. a gradient penalty)
raises an error that names the way out."""
import functools
from typing import Callable

import torch
from torch import Tensor
from torch.autograd import Function

SECOND_ORDER_ERROR = (
    "KCLA's fused kernels have no second derivative: a gradient taken "
    'with create_graph=True (a gradient penalty, a Hessian-vector product) '
    "cannot be differentiated through them; run the model's KCLA layers "
    "on PyTorch ops (kcla_impl='torch' in ResNetKCLA and KCLAFPN, "
    "impl='torch' in KCLALayer and KCLADecoderAttention)")


class _SecondOrderBarrier(Function):
    """Identity on a backward's gradients; raising when differentiated."""

    @staticmethod
    def forward(ctx, *grads: Tensor) -> tuple:
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        raise RuntimeError(SECOND_ORDER_ERROR)


def first_order_only(backward: Callable) -> Callable:
    """``torch.autograd.function.once_differentiable`` with
    :data:`SECOND_ORDER_ERROR` as its error: ``backward`` runs without
    grad; under ``create_graph=True`` its gradients lead to a node that
    raises the error if a second backward reaches it."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
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
