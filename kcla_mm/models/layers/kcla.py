"""Key-Correlated Layer Attention (KCLA), docs/method.md §2-4.

Every residual block's output X attends to all earlier block outputs of the
network through a recurrent state (U, Z) (:class:`KCLAState`), so the cost
per block is independent of depth.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn.bricks.drop import DropPath
from mmengine.model import BaseModule
from torch import Tensor

from kcla_mm.ops import kcla_state_update
from kcla_mm.ops.ext_loader import torch_ops_only
from kcla_mm.ops.kcla_adapter import kcla_adapter, kcla_adapter_inference
from kcla_mm.ops.kcla_branch import (GradHandoff, StateTape,
                                     branch_supported, foldable_bn, kcla_branch,
                                     kcla_branch_inference,
                                     kcla_layer_inference, layer_supported,
                                     plain_affine_bn, relu_pool,
                                     update_running_stats)
from kcla_mm.ops.kcla_heads import as_operand, kcla_heads
from kcla_mm.ops.kcla_state import IMPLS
from .eca import build_eca_conv, eca_project, eca_project_pair
from .state import KCLAState
from .utils import (add_norm_before_convs, autocast_off, check_bool,
                    check_feature, check_head_dim, check_layer_cfg,
                    check_positive_float, check_positive_int,
                    check_probability, check_temperature_range,
                    checkpoint_keeping_stats, hooked,
                    log_uniform_temperatures, spatial_check, state_dtype)

# exp(min(|K| * s, MAX_LOG_WEIGHT)): the authors' clamp of the layer weights.
MAX_LOG_WEIGHT = 10.0


def layer_weights(key: Tensor, norm_d: Tensor) -> Tensor:
    """w_g = exp(min(|K_g| / norm_d_g, 10)) for keys (B, G, d) -> (B, G)."""
    return torch.exp(torch.clamp(key.norm(dim=-1) / norm_d,
                                 max=MAX_LOG_WEIGHT))


def grouped_pointwise(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """``conv(x_full)`` for a grouped 1x1 conv without bias or padding,
    given ``x = x_full[:, :, ::s, ::s]`` (s = ``conv.stride``, the only
    pixels it reads), (B, C', H, W) -> (B, C, H, W), as one batched matmul
    (CPU convolution backends are slow for these grouped, strided 1x1
    convs, forward and backward)."""
    g = conv.groups
    b, c_in, h, w = x.shape
    weight = conv.weight.to(x.dtype).view(g, -1, c_in // g)
    out = torch.matmul(weight, x.reshape(b, g, c_in // g, h * w))
    return out.view(b, -1, h, w)


class KCLAStateAdapter(BaseModule):
    """Cross-stage adaptation of a carried state (docs/method.md §3, the
    paper's Algorithm 1).

    A' = BN(Conv1x1(U / Z)) (the conv only when width or resolution
    changes), and the key k_u = Conv1d_u(GAP(A')) that weighs it. With
    ``resize=True`` (pyramid levels, :class:`KCLAFPN`) A' is instead resized
    bilinearly to the layer's resolution, and the conv only changes width.

    Args:
        in_channels (int): C' of the incoming state.
        out_channels (int): C of the layer.
        num_heads (int): G of the layer; the 1x1 conv's groups.
        stride (int): the stage's real spatial stride (1 for dilated stages).
        norm_cfg (dict): norm layer config. Defaults to ``dict(type='BN')``.
        resize (bool): bridge resolutions by resizing, not by a strided
            conv. Defaults to False.
        init_cfg (dict or list[dict], optional): initialisation config.
    """

    def __init__(self,
                 in_channels: int,
                 out_channels: int,
                 num_heads: int,
                 stride: int = 1,
                 norm_cfg: dict = dict(type='BN'),
                 resize: bool = False,
                 init_cfg=None) -> None:
        super().__init__(init_cfg)
        if resize and stride != 1:
            raise ValueError('KCLAStateAdapter: resize=True bridges '
                             f'resolutions itself; stride must be 1, got '
                             f'{stride}')
        if in_channels % num_heads != 0:
            raise ValueError(
                f'KCLAStateAdapter: the incoming state has {in_channels} '
                f'channels, not divisible by the {num_heads} heads of the '
                f'{out_channels}-channel layer; choose head_dim so that '
                'channels / head_dim divides every stage width')
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.stride = stride
        self.resize = resize
        self.norm_name = add_norm_before_convs(self, norm_cfg, out_channels)
        if in_channels != out_channels or stride != 1:
            self.conv = nn.Conv2d(
                in_channels,
                out_channels,
                kernel_size=1,
                stride=stride,
                groups=num_heads,
                bias=False)
        else:
            self.conv = None
        self.k_conv = build_eca_conv(out_channels)

    def forward(self, state: KCLAState, num_heads: int,
                size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
        """Adapt ``state`` (B, C', H', W') to (B, C, H, W), (H, W) = ``size``.

        Returns:
            tuple[Tensor, Tensor]: A' (B, C, H, W) float32 and its key
            (B, G, d) float32.
        """
        if state.u.shape[1] != self.in_channels:
            raise ValueError(f'KCLAStateAdapter: the incoming state has '
                             f'{state.u.shape[1]} channels, expected '
                             f'in_channels={self.in_channels}')
        # a conv with hooks is called (on all of A), else a matmul over
        # the pixels it reads
        conv_called = self.conv is not None and hooked(self.conv)
        s = 1 if conv_called else self.stride
        # U / Z (no eps, the authors' Algorithm 1)
        a = KCLAState(state.u[:, :, ::s, ::s], state.z).aggregate()
        if self.resize and tuple(a.shape[2:]) != tuple(size):
            a = F.interpolate(a, size=size, mode='bilinear',
                              align_corners=False)
        if self.conv is not None:
            a = a.to(self.conv.weight.dtype)
            a = self.conv(a) if conv_called else grouped_pointwise(
                a, self.conv)
        a = self.norm(a).to(state.u.dtype)
        key = eca_project(self.k_conv, a.mean((2, 3)), num_heads)
        return a, key

    def folds(self) -> bool:
        """Whether :meth:`folded_state` applies: a BatchNorm2d with affine
        parameters (batch or running statistics), no resize; not where
        :func:`torch_ops_only`, nor where the submodules it does not call
        have hooks (:func:`hooked`)."""
        return (not self.resize and plain_affine_bn(self.norm)
                and not torch_ops_only()
                and not hooked(self.conv, self.norm, self.k_conv))

    def folded_state(self, state: KCLAState, num_heads: int,
                     norm_d: Tensor,
                     impl: str = 'auto') -> Tuple[Tensor, Tensor]:
        """(U, Z) = (z A', z) of Algorithm 1, z = layer_weights(k_u), as one
        batched matmul (:meth:`folds`; differentiable, updates BN's running
        statistics in training like ``nn.BatchNorm2d``). Unless ``impl`` is
        ``'torch'``, where :func:`layer_supported` for the state: one
        :func:`kcla_adapter_inference` call (no grad, eval BN), else
        :func:`kcla_adapter` (the same maths as an autograd op, its
        per-head scalars in one kernel each way).

        With Y = Conv1x1(U / Z) (U at the conv's stride) and Uc = U - GAP(U)
        per sample and channel: GAP(Y) = W_b GAP(U) with W_b the conv
        weights over Z per sample; BN's batch variance is the mean of the
        per-sample variances W_b Cov(Uc) W_b^T plus the variance of GAP(Y)
        over the batch; GAP(A') = k (GAP(Y) - mean) + beta (k = gamma /
        std) gives k_u; then U' = (z k W_b) Uc + z GAP(A'). Only Uc (the
        strided state, centred) is kept for backward. With running
        statistics the raw strided state stands in for Uc (one pass less).

        Returns:
            tuple[Tensor, Tensor]: U (B, C, H, W) and Z (B, G).
        """
        s, norm = self.stride, self.norm
        g, g_in = num_heads, state.z.shape[1]
        u = state.u[:, :, ::s, ::s]
        b, c_in, h, w = u.shape
        batch_stats = norm.training or norm.running_mean is None
        if batch_stats and b * h * w == 1:  # as nn.BatchNorm2d raises
            raise ValueError(
                'Expected more than 1 value per channel when training, got '
                f'input size {(b, self.out_channels, h, w)} '
                '(KCLAStateAdapter: its BatchNorm uses batch statistics)')
        dtype = state.u.dtype
        if impl != 'torch' and dtype in (torch.float32, torch.float64) \
                and layer_supported(state.u, impl):
            if not torch.is_grad_enabled() and foldable_bn(norm):
                weight = self._grouped_weight(g, state.u)
                return kcla_adapter_inference(
                    state.u, state.z, weight.reshape(-1, weight.shape[2]),
                    s, norm, self.k_conv.weight, norm_d, MAX_LOG_WEIGHT)
            if norm.running_mean is None or norm.running_mean.dtype == dtype:
                return kcla_adapter(state.u, state.z, self.conv, s, norm,
                                    self.k_conv.weight, norm_d,
                                    MAX_LOG_WEIGHT)
        weight = self._grouped_weight(g, state.u)
        u = u.reshape(b, g, c_in // g, h * w)
        u_mean = u.mean(-1, keepdim=True)
        inv_z = (1 / state.z).repeat_interleave(c_in // g_in, 1)
        w_b = weight * inv_z.view(b, g, 1, -1)  # (B, G, C / G, C' / G)
        y_mean = (w_b @ u_mean).squeeze(-1)  # GAP(Y), (B, G, C / G)
        if batch_stats:
            u = u - u_mean  # centred: the covariance and the matmul below
            cov = u @ u.transpose(2, 3) / (h * w)
            mean = y_mean.mean(0)
            var = ((w_b @ cov) * w_b).sum(-1).mean(0) + \
                (y_mean - mean).square().mean(0)
            update_running_stats(norm, mean.detach().view(-1),
                                 var.detach().view(-1), b * h * w)
        else:
            mean = norm.running_mean.view(g, -1)
            var = norm.running_var.view(g, -1)
        k = norm.weight.view(g, -1) * torch.rsqrt(var + norm.eps)
        pooled = k * (y_mean - mean) + norm.bias.view(g, -1)  # GAP(A')
        z = layer_weights(eca_project(self.k_conv, pooled.view(b, -1), g),
                          norm_d)
        z_g = z.view(b, g, 1)
        # U' = z (k (W_b U - mean) + beta): the bias is z GAP(A') for the
        # centred U, less z k GAP(Y) for the raw one
        bias = z_g * pooled if batch_stats else z_g * (pooled - k * y_mean)
        out = torch.baddbmm(bias.view(b * g, -1, 1),
                            ((z_g * k).unsqueeze(-1) * w_b).view(
                                b * g, -1, c_in // g),
                            u.view(b * g, c_in // g, h * w))
        return out.view(b, -1, h, w), z

    def _grouped_weight(self, num_heads: int, u: Tensor) -> Tensor:
        """The 1x1 conv's weight as (G, C / G, C' / G) in ``u``'s dtype;
        identity blocks where there is no conv."""
        g, c_in = num_heads, self.in_channels
        if self.conv is not None:
            return self.conv.weight.to(u.dtype).view(g, -1, c_in // g)
        return torch.eye(c_in // g, dtype=u.dtype,
                         device=u.device).expand(g, -1, -1)

    @property
    def norm(self) -> nn.Module:
        return getattr(self, self.norm_name)


class KCLALayer(BaseModule):
    """The KCLA layer placed after one residual block (docs/method.md §2).

    With G = C / head_dim heads and X the block output (B, C, H, W)::

        Q, K  = Conv1d_q(GAP(X)), Conv1d_k(GAP(X))        (B, G, d)
        w     = exp(min(|K_g| * s_g, 10))                  (B, G)
        U, Z  = U + w X, Z + w    (first layer: w X, w)
        A     = U / (Z + eps)
        gate  = sigmoid(Phi(<Q_g, K_g> / |K_g|))           (B, G)
        Y     = DropPath(ReLU(BN(gate * DWConv3x3(A))))
        out   = X + Y

    s_g are G fixed log-uniform temperatures; the layer stores
    ``norm_d = 1 / s``. U and Z are kept in float32 (also under autocast).
    A layer built with ``state_in_channels`` first re-initialises the
    incoming state with :class:`KCLAStateAdapter` (U = z A', Z = z).

    Setting ``invert_state = True`` (``ResNetKCLA`` does, for every layer
    whose successor continues its state) makes the fused training path drop
    this layer's U from the saved tensors: the successor keeps it on a
    :class:`~kcla_mm.ops.kcla_branch.StateTape` and, once
    :func:`~kcla_mm.ops.kcla_branch.release_invertible` has read its growth
    check, drops it where backward can recover it as U_next - w X, so
    training memory for the state is one buffer per chain, independent of
    depth (``ResNetKCLA.forward`` releases after its last stage). A
    successor on PyTorch ops (or with an adapter) keeps the state for it.

    Submodules with hooks (their own or global: :func:`hooked`) are called
    as modules, so the hooks see their calls: the fused kernels and the
    matmul forms that read their weights step aside (FLOP counters that
    hook every module, feature probes, ``torch.nn.utils.prune``).

    Args:
        channels (int): C, the block's output channels.
        head_dim (int): d, channels per head; must divide C. Defaults to 64.
        temperature_range (tuple[float, float]): (s_min, s_max).
            Defaults to (0.7, 1 / 0.7).
        drop_path (float): drop-path rate of the Y branch. Defaults to 0.2.
        state_in_channels (int, optional): if given, this is an init layer:
            it adapts an incoming state of this many channels. Defaults to
            None (continue the incoming state, or start one).
        state_stride (int): spatial stride from the incoming state to X,
            for the adapter. Defaults to 1.
        state_resize (bool): the adapter resizes the incoming state to X's
            resolution instead (pyramid levels). Defaults to False.
        norm_cfg (dict): norm config of the Y branch and the adapter.
            Defaults to ``dict(type='BN')``.
        norm_init (float): initial weight of the Y branch's norm; the
            method (docs/method.md §2) and the authors use 1. Smaller values
            start every block closer to the plain ResNet, which steadies
            short from-scratch training.
            Defaults to 1.0.
        eps (float): added to Z before dividing. Defaults to 1e-3.
        key_eps (float): lower bound of |K| in the gate (zero inputs).
            Defaults to 1e-6.
        impl (str): ``'auto'`` (the extension's kernels where
            ``kcla_mm._ext`` supports the device; on CUDA without its
            'layer' group, not yet verified on a GPU: docs/gpu.md),
            ``'fused'`` (the kernels, the 'layer' group included) or
            ``'torch'``. Defaults to ``'auto'``.
        init_cfg (dict or list[dict], optional): initialisation config.
            Defaults to the authors' scheme.

    Example:
        >>> layer = KCLALayer(128, head_dim=32)
        >>> x = torch.rand(2, 128, 8, 8)
        >>> out, state = layer(x)
        >>> tuple(out.shape), tuple(state.u.shape), tuple(state.z.shape)
        ((2, 128, 8, 8), (2, 128, 8, 8), (2, 4))
    """

    def __init__(self,
                 channels: int,
                 head_dim: int = 64,
                 temperature_range: tuple = (0.7, 1 / 0.7),
                 drop_path: float = 0.2,
                 state_in_channels: Optional[int] = None,
                 state_stride: int = 1,
                 state_resize: bool = False,
                 norm_cfg: dict = dict(type='BN'),
                 norm_init: float = 1.0,
                 eps: float = 1e-3,
                 key_eps: float = 1e-6,
                 impl: str = 'auto',
                 init_cfg=[
                     dict(
                         type='Xavier',
                         layer=['Conv1d', 'Linear'],
                         distribution='uniform'),
                     dict(
                         type='Kaiming',
                         layer='Conv2d',
                         mode='fan_out',
                         nonlinearity='relu'),
                     dict(type='Constant', val=1, layer=['_BatchNorm'])
                 ]) -> None:
        super().__init__(init_cfg)
        owner = type(self).__name__
        check_positive_int(channels, 'channels', owner)
        self.channels = channels
        self.num_heads = check_head_dim(channels, head_dim, owner)
        self.head_dim = head_dim
        check_temperature_range(temperature_range, owner)
        check_probability(drop_path, 'drop_path', owner)
        check_positive_int(state_in_channels, 'state_in_channels', owner,
                           optional=True)
        if state_in_channels is not None and \
                state_in_channels % self.num_heads:
            raise ValueError(
                f'{owner}: state_in_channels={state_in_channels} must be '
                f'divisible by the {self.num_heads} heads (channels / '
                f'head_dim = {channels} / {head_dim}); allowed: multiples '
                f'of {self.num_heads}')
        check_positive_int(state_stride, 'state_stride', owner)
        check_bool(state_resize, 'state_resize', owner)
        if state_resize and state_stride != 1:
            raise ValueError(f'{owner}: state_resize=True bridges '
                             'resolutions by resizing; state_stride must be '
                             f'1 with it, got state_stride={state_stride}')
        check_layer_cfg(norm_cfg, 'norm_cfg', owner)
        check_positive_float(
            norm_init, 'norm_init', owner,
            why=' (the branch ReLU passes no gradient at 0)')
        check_positive_float(eps, 'eps', owner, allow_zero=True)
        check_positive_float(key_eps, 'key_eps', owner,
                             why=' (the lower bound of |K| in the gate)')
        if impl not in IMPLS:
            raise ValueError(f'{owner}: impl must be one of {IMPLS}, got '
                             f'{impl!r}')
        self.norm_init = float(norm_init)
        self.impl = impl
        self.eps = eps
        self.key_eps = key_eps
        self.register_buffer(
            'norm_d',
            1.0 / log_uniform_temperatures(self.num_heads, temperature_range),
            persistent=False)
        self.norm_name = add_norm_before_convs(self, norm_cfg, channels)
        self.q_conv = build_eca_conv(channels)
        self.k_conv = build_eca_conv(channels)
        self.v_conv = nn.Conv2d(
            channels, channels, 3, padding=1, groups=channels, bias=False)
        self.gate = nn.Linear(self.num_heads, self.num_heads, bias=False)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.invert_state = False
        self.adapter = None
        if state_in_channels is not None:
            self.adapter = KCLAStateAdapter(state_in_channels, channels,
                                            self.num_heads, state_stride,
                                            norm_cfg, state_resize)

    @property
    def norm(self) -> nn.Module:
        return getattr(self, self.norm_name)

    def init_weights(self) -> None:
        """The authors' scheme (``init_cfg``), then the branch norm's weight
        set to ``norm_init``."""
        first = not self._is_init
        super().init_weights()
        if first:
            nn.init.constant_(self.norm.weight, self.norm_init)

    def extra_repr(self) -> str:
        return (f'channels={self.channels}, num_heads={self.num_heads}, '
                f'impl={self.impl!r}')

    def _initial_state(self, x: Tensor, state: Optional[KCLAState]
                       ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(U, Z) before this layer's own update; (None, None) to start."""
        owner = type(self).__name__
        if self.adapter is not None:
            if state is None:
                raise ValueError(
                    f'{owner}: this init layer adapts an incoming state '
                    f'(state_in_channels={self.adapter.in_channels}) but '
                    'got none')
            return self._adapted_state(state, x.shape[2:])
        if state is None:
            return None, None
        if tuple(state.u.shape) != tuple(x.shape) \
                or state.num_heads != self.num_heads:
            raise ValueError(
                f'{owner}: the incoming state has U {tuple(state.u.shape)} '
                f'and {state.num_heads} heads, but the input is '
                f'{tuple(x.shape)} with {self.num_heads} heads; a layer '
                'after a change of width or resolution needs '
                'state_in_channels')
        return state.u, state.z

    def _adapted_state(self, state: KCLAState,
                       size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
        """U = z A', Z = z from the adapter (Algorithm 1).

        With gradients on, the adapter is recomputed in backward instead of
        keeping its maps (A', the conv and BN outputs): only the incoming
        state is kept, which the previous layer keeps anyway. The recompute
        leaves the running BN statistics alone. With a plain BatchNorm2d
        the adapter instead folds into one batched matmul
        (:meth:`KCLAStateAdapter.folded_state`), keeping only the strided
        state.
        """
        if self.adapter.folds():
            u, z = self.adapter.folded_state(state, self.num_heads,
                                             self.norm_d, self._impl())
            spatial_check(u.shape[2:], size, type(self).__name__,
                          'check the stage stride (state_stride)')
            return u, z

        def adapt(u: Tensor, z: Tensor) -> Tuple[Tensor, Tensor]:
            a, key = self.adapter(KCLAState(u, z), self.num_heads, size)
            spatial_check(a.shape[2:], size, type(self).__name__,
                          'check the stage stride (state_stride)')
            z = layer_weights(key, self.norm_d)
            b, c, h, w = a.shape
            u = (a.view(b, self.num_heads, -1, h, w) *
                 z.view(b, self.num_heads, 1, 1, 1)).view(b, c, h, w)
            return u, z

        if torch.is_grad_enabled() and not torch_ops_only():
            return checkpoint_keeping_stats(adapt, self.adapter, state.u,
                                            state.z)
        return adapt(state.u, state.z)

    def _impl(self) -> str:
        """:attr:`impl`, or ``'torch'`` where :func:`torch_ops_only` (a
        torch.jit trace, e.g. FLOP counting, torch.export, a torch.func
        transform, forward-mode AD)."""
        return 'torch' if torch_ops_only() else self.impl

    def _use_fused_branch(self, x: Tensor) -> bool:
        """Fused kernels for steps 4-8 (float32 BN layers, extension built,
        not :func:`torch_ops_only`, no hooks on the modules they do not
        call: :func:`hooked`)."""
        return (self._impl() != 'torch'
                and x.dtype in (torch.float32, torch.float64)
                and branch_supported(x, self.norm)
                and not hooked(self.v_conv, self.norm, self.drop_path))

    def _fuses_heads(self, x: Tensor) -> bool:
        """Whether the heads run as one op where the branch is fused: a
        device with the extension's layer ops, no hooks on the query, key
        and gate modules."""
        return layer_supported(x, self._impl()) and not hooked(
            self.q_conv, self.k_conv, self.gate)

    def folds_tail_norm(self, x: Tensor,
                        tail_norm: Optional[nn.Module] = None) -> bool:
        """Whether a no-grad call with ``relu_input=True`` on ``x`` (or a
        tensor of its dtype and device) runs the whole layer as one
        :func:`kcla_layer_inference` call, folding ``tail_norm`` (None:
        nothing to fold) into it: eval-mode BatchNorms, no grad, no active
        drop-path, a device the extension's layer op supports, no hooks on
        the modules it does not call (:func:`hooked`)."""
        return (not torch.is_grad_enabled() and self._use_fused_branch(x)
                and self._fuses_heads(x)
                and foldable_bn(self.norm) and not self._drops_path()
                and (tail_norm is None or (foldable_bn(tail_norm)
                                           and not hooked(tail_norm))))

    def _layer_inference(self, x: Tensor, state: Optional[KCLAState],
                         shortcut: Optional[Tensor],
                         tail_norm: Optional[nn.Module], dtype: torch.dtype
                         ) -> Tuple[Tensor, KCLAState]:
        """The whole layer through ``kcla_mm._ext`` in one call (see
        :meth:`folds_tail_norm`); ``x`` and the incoming U are
        overwritten."""
        u, z = self._initial_state(x, state)
        out, u, z = kcla_layer_inference(
            as_operand(x, dtype),
            None if shortcut is None else as_operand(shortcut, dtype), u,
            z, self.q_conv.weight, self.k_conv.weight, self.norm_d,
            self.gate.weight, self.v_conv.weight, self.norm, self.eps,
            self.key_eps, MAX_LOG_WEIGHT, tail_norm)
        return out.to(x.dtype), KCLAState(u, z)

    def _drops_path(self) -> bool:
        """Whether the Y branch's drop-path is active (training mode)."""
        return self.training and getattr(self.drop_path, 'drop_prob',
                                         0.0) > 0

    def _fused_branch(self, x: Tensor, u: Optional[Tensor], weight: Tensor,
                      z: Tensor, gate: Tensor,
                      tape_in: Optional[StateTape], out_in_place: bool,
                      x_handoff: Optional[GradHandoff] = None
                      ) -> Tuple[Tensor, KCLAState]:
        """(X + Y, state) through ``kcla_mm._ext``; in no-grad eval mode the
        incoming U is updated in place; with ``out_in_place`` X + Y is
        written over ``x``."""
        b, _, h, w = x.shape
        if self.norm.training or self.norm.running_mean is None:
            if b * h * w == 1:  # as nn.BatchNorm2d (the torch path) raises
                raise ValueError(
                    'Expected more than 1 value per channel when training, '
                    f'got input size {x.shape} ({type(self).__name__}: its '
                    'branch BatchNorm uses batch statistics)')
        elif not torch.is_grad_enabled() and not self._drops_path():
            out, u = kcla_branch_inference(x, u, weight, z, gate,
                                           self.v_conv.weight, self.norm,
                                           self.eps, out_in_place)
            return out, KCLAState(u, z)
        if self._drops_path():  # mmcv DropPath's masks, from its draws
            keep_prob = 1 - self.drop_path.drop_prob
            keep = torch.rand((b, 1, 1, 1), dtype=x.dtype,
                              device=x.device).add_(keep_prob).floor_(
                              ).div_(keep_prob).view(b)
        else:
            keep = x.new_ones(b)
        tape_out = StateTape() if self.invert_state else None
        out, u = kcla_branch(x, u, weight, z, gate, self.v_conv.weight,
                             self.norm, keep, self.eps, tape_in, tape_out,
                             out_in_place, x_handoff, self._impl())
        return out, KCLAState(u, z, tape_out)

    def forward(self,
                x: Tensor,
                state: Optional[KCLAState] = None,
                relu_input: bool = False,
                shortcut: Optional[Tensor] = None,
                tail_norm: Optional[nn.Module] = None
                ) -> Tuple[Tensor, KCLAState]:
        """Attend to the earlier layers and add the result to ``x``.

        Args:
            x (Tensor): the block output, (B, C, H, W).
            state (KCLAState, optional): the state after the previous layer.
            relu_input (bool): ``x`` is the block's residual sum before its
                final ReLU (or, with ``shortcut``, its residual branch
                before the add); the layer applies that ReLU itself (on the
                fused path together with its pooling, saving nothing but a
                bit mask) and may overwrite ``x``. Defaults to False.
            shortcut (Tensor, optional): the block's shortcut (B, C, H, W),
                added to ``x`` before the ReLU; only with ``relu_input``.
                Defaults to None.
            tail_norm (nn.Module, optional): the block's last norm layer,
                not yet applied to ``x``; only with ``relu_input``. Folded
                into the one-call inference op where that runs (see
                :meth:`folds_tail_norm`), else applied first. Defaults to
                None.

        Returns:
            tuple[Tensor, KCLAState]: X + Y (B, C, H, W) and the new state.
        """
        check_feature(x, self.channels, type(self).__name__)
        if tail_norm is not None and not relu_input:
            raise ValueError(f'{type(self).__name__}: tail_norm is the '
                             'block\'s last norm before its final ReLU; pass '
                             'it with relu_input=True')
        if shortcut is not None:
            if not relu_input:
                raise ValueError(f'{type(self).__name__}: shortcut is added '
                                 'before the block\'s final ReLU; pass it '
                                 'with relu_input=True')
            if not isinstance(shortcut, Tensor) or \
                    shortcut.shape != x.shape:
                raise ValueError(
                    f'{type(self).__name__}: shortcut must be a Tensor of '
                    f'the input\'s shape {tuple(x.shape)}, got '
                    f'{getattr(shortcut, "shape", type(shortcut).__name__)}')
        b, c, h, w = x.shape
        g = self.num_heads
        no_autocast = autocast_off(x.device.type)
        folds = relu_input and self.folds_tail_norm(x, tail_norm)
        if tail_norm is not None and not folds:
            x = tail_norm(x)
        with no_autocast:
            dtype = state_dtype(x)
            if folds:
                return self._layer_inference(x, state, shortcut, tail_norm,
                                             dtype)
            fused = self._use_fused_branch(x)
            # relu_pool's output feeds only the branch, which hands back
            # its gradient for relu_pool's backward to overwrite
            x_handoff = GradHandoff() if fused and relu_input else None
            if fused:
                x_in = as_operand(x, dtype)
                if relu_input:
                    x_in, pooled = relu_pool(
                        x_in, None if shortcut is None else
                        as_operand(shortcut, dtype), x_handoff, self._impl())
                else:
                    pooled = x_in.mean((2, 3))
            else:
                if shortcut is not None:
                    x = x + shortcut
                if relu_input:
                    x = F.relu(x, inplace=True)
                pooled = x.to(dtype).mean((2, 3))
            u, z = self._initial_state(x, state)
            if fused and self._fuses_heads(x):  # the heads in one op
                weight, z, gate = kcla_heads(
                    pooled, z, self.q_conv.weight, self.k_conv.weight,
                    self.norm_d, self.gate.weight, self.key_eps,
                    MAX_LOG_WEIGHT)
            else:
                query, key = eca_project_pair(self.q_conv, self.k_conv,
                                              pooled, g)
                weight = layer_weights(key, self.norm_d)
                relevance = (query * key).sum(-1) / key.norm(
                    dim=-1).clamp_min(self.key_eps)
                gate = torch.sigmoid(
                    self.gate(relevance.to(self.gate.weight.dtype)).to(dtype)
                    if hooked(self.gate) else
                    F.linear(relevance, self.gate.weight.to(dtype)))
                z = weight if z is None else z + weight
            tape_in = None if state is None else state.tape
            if tape_in is not None and (self.adapter is not None
                                        or not fused):
                # the previous layer did not save its state (invert_state),
                # and this one does not invert it: keep it for that backward
                tape_in.keep(state.u)
                tape_in = None
            if fused:
                out, new_state = self._fused_branch(x_in, u, weight, z, gate,
                                                    tape_in, relu_input,
                                                    x_handoff)
                return out.to(x.dtype), new_state
            u, agg = kcla_state_update(
                x.to(dtype), weight, z, u, eps=self.eps, impl=self._impl())
        out = self.v_conv(agg.to(x.dtype))
        # gate in float32: its gradient sums over d * H * W products, which
        # overflows float16 (and sigmoid'(saturated) * inf = NaN)
        out = out.view(b, g, c // g, h, w).to(dtype) * gate.view(
            b, g, 1, 1, 1)
        y = self.drop_path(F.relu(self.norm(out.view(b, c, h, w).to(x.dtype))))
        return x + y, KCLAState(u, z)
