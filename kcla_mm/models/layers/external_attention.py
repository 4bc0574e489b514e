"""External attention (Guo et al. 2021, "Beyond Self-attention: External
Attention using Two Linear Layers for Visual Tasks"), as in the authors'
EANet ``External_attention`` module, with an optional multi-head form.

For features F (B, C, H, W), N = H * W positions, S memory slots and h heads
of d = C / h channels each:

    F'      = Conv1x1(F)                              (B, C, H, W)
    F'_g    = F' split into heads                     (B, h, d, N)
    A~      = M_k F'_g          M_k: (S, d)           (B, h, S, N)
  double normalisation (``double_normalization=True``, the paper's):
    A^[s,n] = exp(A~[s,n]) / sum_n' exp(A~[s,n'])     softmax over positions
    A[s,n]  = A^[s,n] / (eps + sum_s' A^[s',n])       l1 over slots
  single normalisation (``double_normalization=False``; self-attention's
  normalisation, over what is attended to):
    A[s,n]  = exp(A~[s,n]) / sum_s' exp(A~[s',n])     softmax over slots
    F_out   = M_v A             M_v: (d, S)           (B, h, d, N)
    out     = ReLU(F + Norm(Conv1x1(F_out)))          (B, C, H, W)

M_k and M_v are shared by the heads (as in the authors' multi-head EAMLP);
with h = 1 the module is EANet's ``External_attention`` with the same
parameter names (``conv1``, ``linear_0`` = M_k, ``linear_1`` = M_v,
``conv2``). The attention map holds h * S * N numbers per image: linear in
N, where self-attention's is N * N.

The simple ``ExternalAttention`` of External-Attention-pytorch also
normalises twice (softmax over positions, then over slots), so it is the
``double_normalization=True`` form without the convolutions and residual.
"""
import math
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn as nn
from mmcv.cnn import build_norm_layer
from mmengine.model import BaseModule
from torch import Tensor

from .utils import check_feature, check_layer_cfg, state_dtype


class L1Normalize(nn.Module):
    """x / (eps + sum(x, dim)), the l1 step of the double normalisation.

    Args:
        dim (int): the dimension summed over.
        eps (float): added to the sum.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x / (self.eps + x.sum(dim=self.dim, keepdim=True))

    def extra_repr(self) -> str:
        return f'dim={self.dim}, eps={self.eps}'


def _check_positive_int(value, name: str, owner: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'{owner}: {name} must be a positive int, got '
                         f'{value!r}')


class ExternalAttention(BaseModule):
    """External attention with two memory units and a residual.

    Usable as an mmdet ResNet block plugin (``plugins=[dict(cfg=dict(
    type='ExternalAttention'), stages=..., position='after_conv3')]``):
    mmcv's ``build_plugin_layer`` passes ``in_channels`` and names the
    module ``external_attention`` plus the plugin's postfix. Inside a
    pretrained ResNet, ``with_relu=False, zero_init=True`` makes the plugin
    the identity at init (as mmcv's ContextBlock and NonLocal2d are), so
    the block computes exactly what it was trained to.

    Args:
        in_channels (int): C, channels of the input and the output.
        num_slots (int): S, memory slots (rows of M_k and M_v) per head.
            Defaults to 64.
        num_heads (int): h; must divide ``in_channels``. Defaults to 1 (the
            authors' EANet module).
        norm_cfg (dict, optional): norm after the output 1x1 conv; None for
            a biased conv without norm. Defaults to ``dict(type='BN')``.
        with_relu (bool): ReLU after the residual sum, as the authors do;
            False for none (a ResNet plugin is followed by the block's own
            identity sum and ReLU). Defaults to True.
        zero_init (bool): start the attention branch at zero (the norm's
            weight 0; conv2's weight 0 without an affine norm), so the
            module starts as ReLU(F), or F without ReLU. Defaults to False
            (the authors' init).
        double_normalization (bool): softmax over positions, then l1 over
            slots (True); or one softmax over slots (False).
            Defaults to True.
        eps (float): added to the l1 denominator. Defaults to 1e-9 (the
            authors' value).
        init_cfg (dict or list[dict], optional): initialisation config,
            applied after the authors' scheme (see ``init_weights``).

    Shape:
        input (B, C, H, W) -> output (B, C, H, W); ``attention_map``
        (B, h, S, H * W). The submodule ``normalize`` (``softmax`` over
        positions then ``l1`` over slots; or one softmax over slots) maps
        the logits (B * h, S, H * W) to the attention: hook it to read the
        intermediate maps.

    Example:
        >>> import torch
        >>> ea = ExternalAttention(256, num_slots=64, num_heads=4)
        >>> x = torch.rand(2, 256, 16, 16)
        >>> tuple(ea(x).shape), tuple(ea.attention_map(x).shape)
        ((2, 256, 16, 16), (2, 4, 64, 256))
    """

    _abbr_ = 'external_attention'

    def __init__(self,
                 in_channels: int,
                 num_slots: int = 64,
                 num_heads: int = 1,
                 norm_cfg: Optional[dict] = dict(type='BN'),
                 with_relu: bool = True,
                 zero_init: bool = False,
                 double_normalization: bool = True,
                 eps: float = 1e-9,
                 init_cfg=None) -> None:
        super().__init__(init_cfg)
        owner = type(self).__name__
        _check_positive_int(in_channels, 'in_channels', owner)
        _check_positive_int(num_slots, 'num_slots', owner)
        _check_positive_int(num_heads, 'num_heads', owner)
        if in_channels % num_heads:
            raise ValueError(f'{owner}: num_heads={num_heads} must divide '
                             f'in_channels ({in_channels}); allowed: '
                             f'divisors of {in_channels}')
        for name, value in (('with_relu', with_relu),
                            ('zero_init', zero_init),
                            ('double_normalization', double_normalization)):
            if not isinstance(value, bool):
                raise ValueError(f'{owner}: {name} must be a bool, got '
                                 f'{value!r}')
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) \
                or not 0 <= eps < math.inf:
            raise ValueError(f'{owner}: eps must be a float >= 0, got '
                             f'{eps!r}')
        check_layer_cfg(norm_cfg, 'norm_cfg', owner, optional=True)
        self.in_channels = in_channels
        self.num_slots = num_slots
        self.num_heads = num_heads
        self.double_normalization = double_normalization
        self.with_relu = with_relu
        self.zero_init = zero_init
        head_channels = in_channels // num_heads
        self.conv1 = nn.Conv2d(in_channels, in_channels, 1)
        self.linear_0 = nn.Conv1d(head_channels, num_slots, 1, bias=False)
        self.linear_1 = nn.Conv1d(num_slots, head_channels, 1, bias=False)
        self.conv2 = nn.Conv2d(
            in_channels, in_channels, 1, bias=norm_cfg is None)
        self.norm_name = None
        if norm_cfg is not None:
            self.norm_name, norm = build_norm_layer(norm_cfg, in_channels)
            self.add_module(self.norm_name, norm)
        # parameter-free; submodules so that forward hooks can read the
        # attention before and after each step. Logits are (B * h, S, N).
        if double_normalization:
            self.normalize = nn.Sequential(
                OrderedDict(
                    softmax=nn.Softmax(dim=2), l1=L1Normalize(1, float(eps))))
        else:
            self.normalize = nn.Softmax(dim=1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The authors' (EANet) initialisation.

        Convs get N(0, sqrt(2 / n)) with n = kernel size * out channels;
        M_k starts as M_v transposed (EANet ties them at init by sharing
        storage; the last draw there is M_v's, so both follow M_v's std
        sqrt(2 / d)); they train independently. Norm weight 1, bias 0 (if
        affine). ``conv1``'s bias, left at PyTorch's default by the
        authors, is zeroed here; under double normalisation it has no
        effect (a per-slot constant in the logits cancels in the softmax
        over positions). ``zero_init`` then zeroes the branch's last scale.
        """
        for conv in (self.conv1, self.conv2):
            nn.init.normal_(conv.weight, 0, math.sqrt(2.0 / conv.out_channels))
            if conv.bias is not None:
                nn.init.zeros_(conv.bias)
        nn.init.normal_(self.linear_1.weight, 0,
                        math.sqrt(2.0 / self.linear_1.out_channels))
        with torch.no_grad():
            self.linear_0.weight.copy_(self.linear_1.weight.permute(1, 0, 2))
        norm = getattr(self, self.norm_name) if self.norm_name else None
        affine = getattr(norm, 'weight', None) is not None
        if affine:
            nn.init.constant_(norm.weight, 0.0 if self.zero_init else 1.0)
            nn.init.zeros_(norm.bias)
        elif self.zero_init:
            nn.init.zeros_(self.conv2.weight)

    def init_weights(self) -> None:
        """Re-apply the authors' scheme, then ``init_cfg`` if one is given.

        The scheme is also applied at construction: a backbone whose
        ``Pretrained`` init_cfg skips its children's ``init_weights`` still
        leaves this module initialised the authors' way, and a backbone's
        generic Kaiming/Constant init_cfg does not replace it.
        """
        if not self._is_init:
            self.reset_parameters()
        super().init_weights()

    def extra_repr(self) -> str:
        return (f'in_channels={self.in_channels}, '
                f'num_slots={self.num_slots}, num_heads={self.num_heads}, '
                f'double_normalization={self.double_normalization}, '
                f'with_relu={self.with_relu}, zero_init={self.zero_init}')

    def attention_map(self, x: Tensor) -> Tensor:
        """Normalised attention of every position over the memory slots.

        Computed in float32 (float64 for float64 input).

        Args:
            x (Tensor): features F, (B, C, H, W).

        Returns:
            Tensor: A, (B, h, S, H * W).
        """
        check_feature(x, self.in_channels, type(self).__name__)
        return self._attention(x)

    def _attention(self, x: Tensor) -> Tensor:
        b, c, height, width = x.shape
        feat = self.conv1(x).reshape(b * self.num_heads,
                                     c // self.num_heads, height * width)
        attn = self.normalize(self.linear_0(feat).to(state_dtype(x)))
        return attn.view(b, self.num_heads, self.num_slots, height * width)

    def forward(self, x: Tensor) -> Tensor:
        """F (B, C, H, W) -> ReLU(F + Norm(Conv1x1(M_v A))) (B, C, H, W)."""
        check_feature(x, self.in_channels, type(self).__name__)
        b, c, height, width = x.shape
        attn = self._attention(x).to(x.dtype)
        out = self.conv2(self.linear_1(
            attn.view(b * self.num_heads, self.num_slots,
                      height * width)).view(b, c, height, width))
        if self.norm_name:
            out = getattr(self, self.norm_name)(out)
        out = x + out
        # clamp, not relu: relu saves its output for backward, and mmdet's
        # Bottleneck adds the identity in place to its after_conv3 plugins'
        # output; clamp saves its input
        return out.clamp(min=0) if self.with_relu else out
