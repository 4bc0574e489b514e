"""Argument checks, dtype helpers and gradient checkpointing shared by the
layer-attention modules and the backbone."""
import contextlib
import inspect
import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from mmcv.cnn import build_norm_layer
from mmengine.registry import MODELS
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from kcla_mm.utils.compat import autocast_enabled, has_global_module_hooks


def state_dtype(x: Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32 (also under autocast)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def add_norm_before_convs(module: nn.Module, norm_cfg: dict,
                          channels: int) -> str:
    """Build ``norm_cfg`` for ``channels``, register it on ``module`` and
    return its name. Called before the module registers its convs: mmcv's
    ``fuse_conv_bn`` (mmdet's benchmark ``--fuse-conv-bn``) folds a BN child
    into the Conv2d child registered just before it, which is wrong where
    the BN normalises more than that conv's output (the layer attentions'
    gates and mixes) or where the conv's bias would be ignored (the KCLA
    adapter's matmul); KCLA's inference ops fold their BNs themselves."""
    name, norm = build_norm_layer(norm_cfg, channels)
    module.add_module(name, norm)
    return name


def autocast_off(device_type: str):
    """A context that turns autocast off on ``device_type`` where it is on;
    else (also on devices without autocast, e.g. 'meta' for shape runs) a
    no-op."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def hooked(*modules: Optional[nn.Module]) -> bool:
    """Whether calling one of ``modules`` (None: none) would run hooks:
    forward or backward hooks of its own, or global module hooks (the test
    ``nn.Module.__call__`` makes). KCLA then calls such a module instead of
    reading its weights (fused kernels, matmul forms), so that the hooks
    see the calls they wait for: hook-based FLOP counters, feature probes,
    ``torch.nn.utils.prune``'s per-call weight."""
    if has_global_module_hooks():
        return True
    for m in modules:
        if m is not None and (m._forward_hooks or m._forward_pre_hooks
                              or m._backward_hooks or m._backward_pre_hooks):
            return True
    return False


def check_feature(x: Tensor, channels: int, owner: str) -> None:
    """Raise TypeError/ValueError unless ``x`` is a float (B, channels, H, W)."""
    if not isinstance(x, Tensor):
        raise TypeError(f'{owner}: input must be a Tensor, got '
                        f'{type(x).__name__}')
    if x.dim() != 4:
        raise ValueError(f'{owner}: input must be 4-D (B, C, H, W), got shape '
                         f'{tuple(x.shape)}')
    if x.shape[1] != channels:
        raise ValueError(f'{owner}: input has {x.shape[1]} channels, the layer '
                         f'was built for channels={channels}')
    if not x.is_floating_point():
        raise TypeError(f'{owner}: input must be floating point, got {x.dtype}')


def check_head_dim(channels: int, head_dim: int, owner: str) -> int:
    """Number of heads G = channels / head_dim; ValueError unless it divides."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) \
            or head_dim < 1:
        raise ValueError(f'{owner}: head_dim must be a positive int, got '
                         f'{head_dim!r}')
    if channels % head_dim != 0:
        raise ValueError(f'{owner}: head_dim={head_dim} must divide the '
                         f'channels ({channels}); allowed: divisors of '
                         f'{channels}')
    return channels // head_dim


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_probability(value: float, name: str, owner: str) -> None:
    if not _is_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f'{owner}: {name} must be a float in [0, 1), got '
                         f'{value!r}')


def check_positive_int(value, name: str, owner: str,
                       optional: bool = False) -> None:
    """ValueError unless ``value`` is an int >= 1 (or None if optional)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        allowed = 'a positive int' + (' or None' if optional else '')
        raise ValueError(f'{owner}: {name} must be {allowed}, got {value!r}')


def check_positive_float(value, name: str, owner: str,
                         allow_zero: bool = False, why: str = '') -> None:
    """ValueError unless ``value`` is a finite number > 0 (>= 0 if
    ``allow_zero``); ``why`` is appended to the allowed range."""
    if not _is_number(value) or not math.isfinite(value) or \
            not (value >= 0 if allow_zero else value > 0):
        bound = '>= 0' if allow_zero else '> 0'
        raise ValueError(f'{owner}: {name} must be a finite float {bound}'
                         f'{why}, got {value!r}')


def check_bool(value, name: str, owner: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f'{owner}: {name} must be a bool (True or False), '
                        f'got {value!r}')


def check_temperature_range(value, owner: str,
                            name: str = 'temperature_range') -> None:
    """ValueError unless ``value`` is (s_min, s_max), 0 < s_min <= s_max."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2
            and all(_is_number(t) and 0 < t < math.inf for t in value)
            and value[0] <= value[1]):
        raise ValueError(f'{owner}: {name} must be (s_min, s_max) with '
                         f'0 < s_min <= s_max, got {value!r}')


def check_layer_cfg(cfg, name: str, owner: str, optional: bool = False,
                    example: str = "dict(type='BN')") -> None:
    """Raise unless ``cfg`` is a config dict whose 'type' mmcv can build.

    The type is looked up as mmcv's ``build_norm_layer`` and
    ``build_conv_layer`` do (mmengine's MODELS, current scope first), so
    that an unknown type is named here instead of as ``Cannot find None``.
    """
    if optional and cfg is None:
        return
    if not isinstance(cfg, dict) or 'type' not in cfg:
        allowed = f"a config dict with a 'type' (e.g. {example})" + (
            ' or None' if optional else '')
        raise TypeError(f'{owner}: {name} must be {allowed}, got {cfg!r}')
    layer_type = cfg['type']
    if inspect.isclass(layer_type):
        return
    found = None
    if isinstance(layer_type, str):
        with MODELS.switch_scope_and_registry(None) as registry:
            found = registry.get(layer_type)
    if found is None:
        raise KeyError(f'{owner}: {name} has type {layer_type!r}, which is '
                       'not a registered layer; allowed: a type registered '
                       f'in mmengine\'s MODELS by mmcv (e.g. {example})')


def log_uniform_temperatures(num_heads: int,
                             temperature_range: tuple) -> Tensor:
    """s = exp(linspace(ln s_min, ln s_max, G)), (G,), float32."""
    check_temperature_range(temperature_range, 'log_uniform_temperatures')
    lo, hi = (float(t) for t in temperature_range)
    return torch.exp(
        torch.linspace(torch.tensor(lo).log().item(),
                       torch.tensor(hi).log().item(), num_heads))


def spatial_check(state_hw: tuple, x_hw: tuple, owner: str,
                  hint: Optional[str] = None) -> None:
    if tuple(state_hw) != tuple(x_hw):
        raise ValueError(f'{owner}: the incoming state is {tuple(state_hw)} '
                         f'but the input is {tuple(x_hw)}' +
                         (f'; {hint}' if hint else ''))


@contextlib.contextmanager
def running_stats_kept(module: nn.Module):
    """Undo on exit the running-statistics updates that ``module``'s
    BatchNorms make inside the context. A BatchNorm counts each update in
    ``num_batches_tracked`` (torch's and kcla_mm's own fused ops alike);
    those that did not update are left untouched, so that the tensors
    autograd saved from them stay valid."""
    norms = [m for m in module.modules()
             if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [(m.num_batches_tracked._version, m.running_mean.clone(),
              m.running_var.clone(), m.num_batches_tracked.clone())
             for m in norms]
    try:
        yield
    finally:
        for m, (version, mean, var, count) in zip(norms, saved):
            if m.num_batches_tracked._version != version:
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)


def checkpoint_keeping_stats(fn: Callable, module: nn.Module, *args):
    """``fn(*args)`` under ``torch.utils.checkpoint`` (non-reentrant), whose
    recomputation in backward leaves the running statistics of ``module``'s
    BatchNorms as the forward left them: torch's checkpoint alone updates
    them twice per step (pytorch/pytorch#96136), so that with_cp would
    change what a model learns."""
    calls = []

    def run(*inputs):
        kept = running_stats_kept(module) if calls else \
            contextlib.nullcontext()
        calls.append(True)
        with kept:
            return fn(*inputs)

    return cp.checkpoint(run, *args, use_reentrant=False)
