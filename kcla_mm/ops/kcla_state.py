"""The KCLA state update (docs/method.md §2, steps 4-5) as a fused op with a
reference.

For a block output ``x`` (B, C, H, W) split into G heads of d = C / G
channels, per-head layer weights ``w`` (B, G) and the already updated
normaliser ``z`` (B, G) (= Z_prev + w, or w for the first layer)::

    u_next = u + w * x          (u is None for the first layer: u_next = w * x)
    agg    = u_next / (z + eps)

Both outputs are (B, C, H, W). :func:`kcla_state_update` runs the compiled
kernels of ``kcla_mm._ext`` (a C++ autograd op,
``csrc/pytorch/kcla_ops_autograd.cpp``) when it implements the tensors'
device, and :func:`kcla_state_update_reference` (plain PyTorch) otherwise.
"""
from typing import Optional, Tuple

from torch import Tensor

from .ext_loader import get_ext, has_device_impl, torch_ops_only

IMPLS = ('auto', 'fused', 'torch')


def kcla_state_update_reference(x: Tensor, u: Optional[Tensor], w: Tensor,
                                z: Tensor,
                                eps: float = 1e-3) -> Tuple[Tensor, Tensor]:
    """Plain-PyTorch state update; same arguments as :func:`kcla_state_update`."""
    b, c, h, wd = x.shape
    g = w.shape[1]
    # reshape, not view: x and u may be channels_last or other strided views
    wx = (w.view(b, g, 1, 1, 1) *
          x.reshape(b, g, c // g, h, wd)).reshape(b, c, h, wd)
    u_next = wx if u is None else u + wx
    agg = u_next.reshape(b, g, -1) / (z.view(b, g, 1) + eps)
    return u_next, agg.view(b, c, h, wd)


def check_state_inputs(x: Tensor, u: Optional[Tensor], w: Tensor,
                       z: Tensor) -> None:
    """Raise TypeError/ValueError naming the first bad argument."""
    for name, t in (('x', x), ('u', u), ('w', w), ('z', z)):
        if name == 'u' and t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f'kcla_state_update: `{name}` must be a Tensor, '
                            f'got {type(t).__name__}')
    if x.dim() != 4:
        raise ValueError('kcla_state_update: `x` must be 4-D (B, C, H, W), '
                         f'got shape {tuple(x.shape)}')
    if not x.is_floating_point():
        raise TypeError('kcla_state_update: `x` must be floating point, got '
                        f'{x.dtype}')
    b, c = x.shape[:2]
    if w.dim() != 2 or w.shape[0] != b or w.shape[1] == 0 \
            or c % w.shape[1] != 0:
        raise ValueError(f'kcla_state_update: `w` must be (B, G) with B={b} '
                         f'and G dividing C={c}, got shape {tuple(w.shape)}')
    if z.shape != w.shape:
        raise ValueError('kcla_state_update: `z` must have the shape of `w` '
                         f'{tuple(w.shape)}, got {tuple(z.shape)}')
    if u is not None and u.shape != x.shape:
        raise ValueError('kcla_state_update: `u` must have the shape of `x` '
                         f'{tuple(x.shape)}, got {tuple(u.shape)}')
    for name, t in (('u', u), ('w', w), ('z', z)):
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f'kcla_state_update: `{name}` is on {t.device} '
                             f'but `x` is on {x.device}')
        if t.dtype != x.dtype:
            raise TypeError(f'kcla_state_update: `{name}` has dtype {t.dtype} '
                            f'but `x` has dtype {x.dtype}')


def kcla_state_update(x: Tensor,
                      w: Tensor,
                      z: Tensor,
                      u: Optional[Tensor] = None,
                      eps: float = 1e-3,
                      impl: str = 'auto') -> Tuple[Tensor, Tensor]:
    """Accumulate ``x`` into the state and normalise it.

    Args:
        x (Tensor): block output, (B, C, H, W).
        w (Tensor): per-head layer weights, (B, G), G divides C.
        z (Tensor): the updated normaliser Z_prev + w, (B, G).
        u (Tensor, optional): the state U before this layer, (B, C, H, W);
            None for the first layer.
        eps (float): added to ``z`` before dividing. Defaults to 1e-3.
        impl (str): ``'auto'`` (fused kernel when ``kcla_mm._ext``
            implements the device and not
            :func:`~kcla_mm.ops.ext_loader.torch_ops_only`; else PyTorch),
            ``'fused'`` (the kernel; an error where ``torch_ops_only``) or
            ``'torch'``. Defaults to ``'auto'``.

    Returns:
        tuple[Tensor, Tensor]: ``u_next`` and ``agg``, both (B, C, H, W).
    """
    if impl not in IMPLS:
        raise ValueError(f'kcla_state_update: `impl` must be one of {IMPLS}, '
                         f'got {impl!r}')
    check_state_inputs(x, u, w, z)
    use_fused = impl == 'fused' or (impl == 'auto' and not torch_ops_only()
                                    and has_device_impl(x.device.type))
    if not use_fused:
        return kcla_state_update_reference(x, u, w, z, eps)
    if get_ext() is None or not has_device_impl(x.device.type):
        raise RuntimeError(
            "kcla_state_update(impl='fused'): kcla_mm._ext has no "
            f"implementation for device '{x.device.type}' (built for "
            f'{list(get_ext().device_types()) if get_ext() else []})')
    if torch_ops_only():  # the tracer would record empty outputs
        raise RuntimeError(
            "kcla_state_update(impl='fused'): the fused kernels cannot run "
            'under torch.jit tracing, torch.export, a torch.func transform '
            "or forward-mode AD; use impl='auto' (which then takes the "
            "PyTorch path) or impl='torch'")
    return tuple(get_ext().kcla_state_autograd(
        x.contiguous(), None if u is None else u.contiguous(),
        w.contiguous(), z.contiguous(), float(eps)))
