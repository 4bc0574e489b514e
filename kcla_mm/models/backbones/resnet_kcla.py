"""ResNetKCLA: mmdet's ResNet with a layer-attention module after each block."""
import warnings
from typing import List, Optional, Sequence, Tuple

import torch.nn as nn
from mmcv.cnn import build_conv_layer, build_norm_layer
from mmengine.model import BaseModule
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from kcla_mm.ops.kcla_branch import release_invertible
from kcla_mm.ops.kcla_state import IMPLS
from ..layers import KCLALayer, LayerAttention, MRLALight
from ..layers.utils import (check_layer_cfg, check_positive_float,
                            check_positive_int, check_probability,
                            check_temperature_range,
                            checkpoint_keeping_stats, hooked)
from .resnet_blocks import (BasicBlock, Bottleneck, block_shortcut,
                            make_res_layer)

LAYER_ATTENTIONS = ('KCLA', 'LA', 'MRLA-light')
DEFAULT_HEAD_DIMS = {'KCLA': 64, 'LA': 64, 'MRLA-light': 32}


def _check_int_seq(value, name: str, length: int, lo: int) -> Tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) != length or \
            not all(isinstance(v, int) and not isinstance(v, bool)
                    and v >= lo for v in value):
        raise ValueError(f'ResNetKCLA: {name} must be a sequence of '
                         f'{length} ints >= {lo} (one per stage, '
                         f'num_stages={length}), got {value!r}')
    return tuple(value)


class ResNetKCLA(BaseModule):
    """ResNet backbone with Key-Correlated Layer Attention.

    A drop-in replacement for mmdet's ``ResNet`` (same arguments, parameter
    names and outputs) in which every residual block is followed by a
    layer-attention module that attends to the earlier blocks: ``'KCLA'``
    (the paper's recurrent state), ``'LA'`` (standard quadratic layer
    attention) or ``'MRLA-light'``; ``layer_attention=None`` gives exactly
    mmdet's ResNet. The KCLA state flows across stages through the
    cross-stage adapter at the blocks in ``state_init_blocks``.

    Args:
        depth (int): 18, 34, 50, 101 or 152.
        in_channels (int): input image channels. Defaults to 3.
        stem_channels (int, optional): stem width. Defaults to
            ``base_channels``.
        base_channels (int): width of stage 1's blocks. Defaults to 64.
        stage_channels (Sequence[int], optional): width (planes, before
            the block expansion) of each stage. Defaults to
            ``base_channels * 2**i``.
        stem_stride (int): stride of the stem's first conv, 1 or 2.
            Defaults to 2.
        stem_pool (bool): max-pool (stride 2) after the stem.
            Defaults to True.
        with_stem_out (bool): also return the stem output
            (B, stem_channels, H / stem_stride, W / stem_stride), before the
            stage outputs (the finest skip of a UNet). Defaults to False.
        num_stages (int): 1 to 4. Defaults to 4.
        strides (Sequence[int]): first-block stride of each stage.
            Defaults to (1, 2, 2, 2).
        dilations (Sequence[int]): dilation of each stage.
            Defaults to (1, 1, 1, 1).
        out_indices (Sequence[int]): stages whose outputs are returned.
            Defaults to (0, 1, 2, 3).
        style (str): ``'pytorch'`` (stride on the 3x3 conv) or ``'caffe'``.
            Defaults to ``'pytorch'``.
        deep_stem (bool): three 3x3 convs instead of the 7x7 stem.
            Defaults to False.
        avg_down (bool): AvgPool before the downsample 1x1 conv.
            Defaults to False.
        frozen_stages (int): stages (and their attention layers) to freeze;
            -1 freezes nothing, 0 the stem. Defaults to -1.
        conv_cfg (dict, optional): conv config of the blocks.
        norm_cfg (dict): norm config. Defaults to
            ``dict(type='BN', requires_grad=True)``.
        norm_eval (bool): keep every BN (attention BNs included) in eval
            mode during training. Defaults to True.
        dcn (dict, optional): deformable conv config for the 3x3 convs.
        stage_with_dcn (Sequence[bool]): stages using ``dcn``.
        plugins (list[dict], optional): mmdet-style block plugins.
        with_cp (bool): gradient checkpointing of blocks and attention
            layers; the recomputation in backward leaves the BatchNorms'
            running statistics alone (mmdet's ResNet updates them a second
            time). Defaults to False.
        zero_init_residual (bool): zero-init each block's last norm.
            Defaults to True.
        layer_attention (str, optional): ``'KCLA'``, ``'LA'``,
            ``'MRLA-light'`` or None. Defaults to ``'KCLA'``.
        head_dim (int, optional): channels per head. Defaults to 64 for
            KCLA and LA, 32 for MRLA-light.
        temperature_range (tuple[float, float]): KCLA's (s_min, s_max).
            Defaults to (0.7, 1 / 0.7).
        kcla_drop_path (float): drop-path rate of the attention branch.
            Defaults to 0.2.
        kcla_norm_init (float): initial weight of each KCLA branch's BN
            (docs/method.md: 1). Defaults to 1.0.
        state_init_blocks (Sequence[int]): blocks (index within a stage)
            whose KCLA layer re-initialises the state through the
            cross-stage adapter; must contain 0. Defaults to (0, 11).
        kcla_impl (str): the KCLA layers' implementation, ``'auto'``,
            ``'fused'`` or ``'torch'`` (see :class:`KCLALayer`'s ``impl``).
            Defaults to ``'auto'``.
        pretrained (str, optional): deprecated, use ``init_cfg``.
        init_cfg (dict or list[dict], optional): initialisation config.

    Example:
        >>> import torch
        >>> model = ResNetKCLA(depth=18)
        >>> outs = model(torch.rand(1, 3, 64, 64))
        >>> [tuple(o.shape) for o in outs]
        [(1, 64, 16, 16), (1, 128, 8, 8), (1, 256, 4, 4), (1, 512, 2, 2)]
    """

    arch_settings = {
        18: (BasicBlock, (2, 2, 2, 2)),
        34: (BasicBlock, (3, 4, 6, 3)),
        50: (Bottleneck, (3, 4, 6, 3)),
        101: (Bottleneck, (3, 4, 23, 3)),
        152: (Bottleneck, (3, 8, 36, 3))
    }

    def __init__(self,
                 depth: int,
                 in_channels: int = 3,
                 stem_channels: Optional[int] = None,
                 base_channels: int = 64,
                 stage_channels: Optional[Sequence[int]] = None,
                 stem_stride: int = 2,
                 stem_pool: bool = True,
                 with_stem_out: bool = False,
                 num_stages: int = 4,
                 strides: Sequence[int] = (1, 2, 2, 2),
                 dilations: Sequence[int] = (1, 1, 1, 1),
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 style: str = 'pytorch',
                 deep_stem: bool = False,
                 avg_down: bool = False,
                 frozen_stages: int = -1,
                 conv_cfg: Optional[dict] = None,
                 norm_cfg: dict = dict(type='BN', requires_grad=True),
                 norm_eval: bool = True,
                 dcn: Optional[dict] = None,
                 stage_with_dcn: Sequence[bool] = (False, False, False,
                                                   False),
                 plugins: Optional[List[dict]] = None,
                 with_cp: bool = False,
                 zero_init_residual: bool = True,
                 layer_attention: Optional[str] = 'KCLA',
                 head_dim: Optional[int] = None,
                 temperature_range: Tuple[float, float] = (0.7, 1 / 0.7),
                 kcla_drop_path: float = 0.2,
                 kcla_norm_init: float = 1.0,
                 state_init_blocks: Sequence[int] = (0, 11),
                 kcla_impl: str = 'auto',
                 pretrained: Optional[str] = None,
                 init_cfg=None) -> None:
        super().__init__(init_cfg)
        if depth not in self.arch_settings:
            raise ValueError(f'ResNetKCLA: depth must be one of '
                             f'{sorted(self.arch_settings)}, got {depth!r}')
        if not isinstance(num_stages, int) or isinstance(num_stages, bool) \
                or not 1 <= num_stages <= 4:
            raise ValueError('ResNetKCLA: num_stages must be an int in '
                             f'[1, 4], got {num_stages!r}')
        owner = 'ResNetKCLA'
        check_positive_int(in_channels, 'in_channels', owner)
        check_positive_int(base_channels, 'base_channels', owner)
        check_positive_int(stem_channels, 'stem_channels', owner,
                           optional=True)
        strides = _check_int_seq(strides, 'strides', num_stages, 1)
        dilations = _check_int_seq(dilations, 'dilations', num_stages, 1)
        if stage_channels is None:
            stage_channels = [base_channels * 2**i for i in range(num_stages)]
        stage_channels = _check_int_seq(stage_channels, 'stage_channels',
                                        num_stages, 1)
        if stem_stride not in (1, 2):
            raise ValueError('ResNetKCLA: stem_stride must be 1 or 2, got '
                             f'{stem_stride!r}')
        for name, flag in (('stem_pool', stem_pool),
                           ('with_stem_out', with_stem_out),
                           ('deep_stem', deep_stem), ('avg_down', avg_down),
                           ('norm_eval', norm_eval), ('with_cp', with_cp),
                           ('zero_init_residual', zero_init_residual)):
            if not isinstance(flag, bool):
                raise TypeError(f'ResNetKCLA: {name} must be a bool, got '
                                f'{flag!r}')
        if not isinstance(out_indices, (tuple, list)) or not out_indices or \
                not all(isinstance(i, int) and 0 <= i < num_stages
                        for i in out_indices):
            raise ValueError('ResNetKCLA: out_indices must be a non-empty '
                             f'sequence of ints in [0, {num_stages - 1}] '
                             f'(num_stages={num_stages}), got {out_indices!r}')
        if style not in ('pytorch', 'caffe'):
            raise ValueError("ResNetKCLA: style must be 'pytorch' or "
                             f"'caffe', got {style!r}")
        if not isinstance(frozen_stages, int) or \
                not -1 <= frozen_stages <= num_stages:
            raise ValueError('ResNetKCLA: frozen_stages must be an int in '
                             f'[-1, {num_stages}], got {frozen_stages!r}')
        check_layer_cfg(conv_cfg, 'conv_cfg', owner, optional=True,
                        example="dict(type='Conv2d')")
        check_layer_cfg(norm_cfg, 'norm_cfg', owner)
        check_layer_cfg(dcn, 'dcn', owner, optional=True,
                        example="dict(type='DCNv2', deform_groups=1)")
        # mmdet's ResNet indexes stage_with_dcn by stage; without dcn a
        # longer sequence (the 4-stage default with num_stages < 4) is fine
        if not isinstance(stage_with_dcn, (tuple, list)) or not all(
                isinstance(flag, bool) for flag in stage_with_dcn) or (
                    len(stage_with_dcn) != num_stages if dcn is not None
                    else len(stage_with_dcn) < num_stages):
            raise ValueError('ResNetKCLA: stage_with_dcn needs one bool per '
                             f'stage (num_stages={num_stages}), got '
                             f'{stage_with_dcn!r}')
        if plugins is not None and (
                not isinstance(plugins, (tuple, list)) or not all(
                    isinstance(p, dict) and isinstance(p.get('cfg'), dict)
                    and 'position' in p for p in plugins)):
            raise ValueError(
                'ResNetKCLA: plugins must be None or a list of dicts '
                "dict(cfg=dict(type=...), position='after_conv1'|"
                "'after_conv2'|'after_conv3'[, stages=...]), got "
                f'{plugins!r}')
        if layer_attention is not None and \
                layer_attention not in LAYER_ATTENTIONS:
            raise ValueError('ResNetKCLA: layer_attention must be one of '
                             f'{LAYER_ATTENTIONS} or None, got '
                             f'{layer_attention!r}')
        if kcla_impl not in IMPLS:
            raise ValueError(f'ResNetKCLA: kcla_impl must be one of {IMPLS}, '
                             f'got {kcla_impl!r}')
        # divisibility by head_dim is checked per stage, naming the width
        check_positive_int(head_dim, 'head_dim', owner, optional=True)
        check_temperature_range(temperature_range, owner)
        check_probability(kcla_drop_path, 'kcla_drop_path', owner)
        check_positive_float(
            kcla_norm_init, 'kcla_norm_init', owner,
            why=' (the branch ReLU passes no gradient at 0)')
        if not isinstance(state_init_blocks, (tuple, list)) or \
                0 not in state_init_blocks or \
                not all(isinstance(b, int) and b >= 0
                        for b in state_init_blocks):
            raise ValueError('ResNetKCLA: state_init_blocks must be a '
                             'sequence of block indices >= 0 containing 0 '
                             f'(stage starts), got {state_init_blocks!r}')
        if pretrained is not None and init_cfg is not None:
            raise ValueError('ResNetKCLA: init_cfg and pretrained cannot be '
                             'set at the same time; use init_cfg')

        block, stage_blocks = self.arch_settings[depth]
        if init_cfg is None:
            if isinstance(pretrained, str):
                warnings.warn('ResNetKCLA: pretrained is deprecated, use '
                              'init_cfg=dict(type="Pretrained", '
                              'checkpoint=...)')
                self.init_cfg = dict(type='Pretrained', checkpoint=pretrained)
            elif pretrained is None:
                self.init_cfg = [
                    dict(type='Kaiming', layer='Conv2d'),
                    dict(
                        type='Constant',
                        val=1,
                        layer=['_BatchNorm', 'GroupNorm'])
                ]
            else:
                raise TypeError('ResNetKCLA: pretrained must be a str or '
                                f'None, got {type(pretrained).__name__}')
        block_init_cfg = None
        if zero_init_residual and pretrained is None and init_cfg is None:
            block_init_cfg = dict(
                type='Constant',
                val=0,
                override=dict(
                    name='norm2' if block is BasicBlock else 'norm3'))

        self.depth = depth
        self.stem_channels = stem_channels or base_channels
        self.base_channels = base_channels
        self.stage_channels = stage_channels
        self.stem_stride = stem_stride
        self.stem_pool = stem_pool
        self.with_stem_out = with_stem_out
        self.num_stages = num_stages
        self.strides = strides
        self.dilations = dilations
        self.out_indices = tuple(out_indices)
        self.style = style
        self.deep_stem = deep_stem
        self.avg_down = avg_down
        self.frozen_stages = frozen_stages
        self.conv_cfg = conv_cfg
        self.norm_cfg = norm_cfg
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self.zero_init_residual = zero_init_residual
        self.layer_attention = layer_attention
        self.stage_blocks = stage_blocks[:num_stages]

        self._make_stem_layer(in_channels, self.stem_channels)
        self.res_layers = []
        self.attn_layers = []
        inplanes = self.stem_channels
        for i, num_blocks in enumerate(self.stage_blocks):
            planes = stage_channels[i]
            res_layer = make_res_layer(
                block,
                inplanes,
                planes,
                num_blocks,
                stride=strides[i],
                dilation=dilations[i],
                style=style,
                avg_down=avg_down,
                with_cp=with_cp,
                conv_cfg=conv_cfg,
                norm_cfg=norm_cfg,
                dcn=dcn if stage_with_dcn[i] else None,
                plugins=self._stage_plugins(plugins, i),
                init_cfg=block_init_cfg)
            layer_name = f'layer{i + 1}'
            self.add_module(layer_name, res_layer)
            self.res_layers.append(layer_name)
            width = planes * block.expansion
            if layer_attention is not None:
                attn_name = f'{layer_name}_attn'
                prev_width = None if i == 0 else inplanes
                self.add_module(
                    attn_name,
                    nn.ModuleList([
                        self._make_attention(
                            layer_attention, width, j, prev_width, strides[i],
                            head_dim, temperature_range, kcla_drop_path,
                            state_init_blocks, kcla_impl, kcla_norm_init, i)
                        for j in range(num_blocks)
                    ]))
                self.attn_layers.append(attn_name)
            inplanes = width
        self.feat_dim = inplanes
        if layer_attention == 'KCLA' and not with_cp:
            self._invert_states(state_init_blocks)
        self._freeze_stages()

    def _invert_states(self, state_init_blocks: Sequence[int]) -> None:
        """KCLA layers whose successor continues their state do not save it
        for backward; the successor inverts the running sum instead."""
        for name in self.attn_layers:
            layers = getattr(self, name)
            for j, layer in enumerate(layers):
                layer.invert_state = j + 1 < len(layers) and \
                    j + 1 not in state_init_blocks

    def _make_stem_layer(self, in_channels: int, stem_channels: int) -> None:
        if self.deep_stem:
            mid = stem_channels // 2
            layers = []
            for j, (cin, cout, stride) in enumerate(
                [(in_channels, mid, self.stem_stride), (mid, mid, 1),
                 (mid, stem_channels, 1)]):
                layers += [
                    build_conv_layer(
                        self.conv_cfg,
                        cin,
                        cout,
                        kernel_size=3,
                        stride=stride,
                        padding=1,
                        bias=False),
                    build_norm_layer(self.norm_cfg, cout)[1],
                    nn.ReLU(inplace=True)
                ]
            self.stem = nn.Sequential(*layers)
        else:
            self.conv1 = build_conv_layer(
                self.conv_cfg,
                in_channels,
                stem_channels,
                kernel_size=7,
                stride=self.stem_stride,
                padding=3,
                bias=False)
            self.norm1_name, norm1 = build_norm_layer(
                self.norm_cfg, stem_channels, postfix=1)
            self.add_module(self.norm1_name, norm1)
            self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1) \
            if self.stem_pool else nn.Identity()

    @property
    def norm1(self) -> nn.Module:
        return getattr(self, self.norm1_name)

    def _stage_plugins(self, plugins: Optional[List[dict]],
                       stage_idx: int) -> List[dict]:
        """The plugins of stage ``stage_idx``, without their 'stages' key."""
        stage_plugins = []
        for plugin in plugins or []:
            plugin = plugin.copy()
            stages = plugin.pop('stages', None)
            if stages is not None and len(stages) != self.num_stages:
                raise ValueError('ResNetKCLA: a plugin\'s stages needs one '
                                 f'entry per stage ({self.num_stages}), got '
                                 f'{stages!r}')
            if stages is None or stages[stage_idx]:
                stage_plugins.append(plugin)
        return stage_plugins

    def _make_attention(self, kind: str, width: int, block_idx: int,
                        prev_width: Optional[int], stride: int,
                        head_dim: Optional[int], temperature_range: tuple,
                        drop_path: float, state_init_blocks: Sequence[int],
                        impl: str, norm_init: float,
                        stage_idx: int) -> nn.Module:
        """The attention layer after block ``block_idx`` of a stage."""
        head_dim = head_dim if head_dim is not None else \
            DEFAULT_HEAD_DIMS[kind]
        norm_cfg = self.norm_cfg
        try:
            if kind == 'KCLA':
                state_in_channels = None
                if block_idx in state_init_blocks:
                    state_in_channels = width if block_idx else prev_width
                return KCLALayer(
                    width,
                    head_dim=head_dim,
                    temperature_range=temperature_range,
                    drop_path=drop_path,
                    state_in_channels=state_in_channels,
                    state_stride=stride if block_idx == 0 else 1,
                    norm_cfg=norm_cfg,
                    norm_init=norm_init,
                    impl=impl)
            if kind == 'LA':
                return LayerAttention(
                    width,
                    head_dim=head_dim,
                    drop_path=drop_path,
                    reset_cache=block_idx == 0,
                    norm_cfg=norm_cfg)
            return MRLALight(
                width, head_dim=head_dim, drop_path=drop_path,
                norm_cfg=norm_cfg)
        except ValueError as e:
            raise ValueError(f'ResNetKCLA (stage {stage_idx + 1}, '
                             f'{width} channels): {e}') from e

    def _freeze_stages(self) -> None:
        if self.frozen_stages >= 0:
            stem = [self.stem] if self.deep_stem else [self.conv1, self.norm1]
            for m in stem:
                m.eval()
                for param in m.parameters():
                    param.requires_grad = False
        for i in range(1, self.frozen_stages + 1):
            modules = [getattr(self, f'layer{i}')]
            if self.layer_attention is not None:
                modules.append(getattr(self, f'layer{i}_attn'))
            for m in modules:
                m.eval()
                for param in m.parameters():
                    param.requires_grad = False

    def init_weights(self) -> None:
        """Initialise the attention layers by their own scheme
        (docs/method.md §2).

        With a ``Pretrained`` init_cfg they are initialised first and the
        checkpoint is loaded over them (plain ResNet weights lack them);
        otherwise after the backbone's generic Kaiming/Constant scheme.
        """
        cfgs = self.init_cfg if isinstance(self.init_cfg, list) else \
            [self.init_cfg]
        pretrained = any(
            isinstance(cfg, dict) and cfg.get('type') == 'Pretrained'
            for cfg in cfgs)
        attention = [
            layer for name in self.attn_layers for layer in getattr(self, name)
        ]
        if not pretrained:
            super().init_weights()
        for layer in attention:
            layer.init_weights()
        if pretrained:
            super().init_weights()

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError('ResNetKCLA: input must be a Tensor, got '
                            f'{type(x).__name__}')
        if x.dim() != 4 or x.shape[1] != self._in_channels():
            raise ValueError(
                'ResNetKCLA: input must be (B, in_channels, H, W) with '
                f'in_channels={self._in_channels()}, got shape '
                f'{tuple(x.shape)}')

    def _in_channels(self) -> int:
        first = self.stem[0] if self.deep_stem else self.conv1
        return first.in_channels

    def _attend(self, attn: nn.Module, x: Tensor, state,
                identity: Optional[Tensor]):
        args = (x, state, identity) if identity is not None else (x, state)
        if self.with_cp and x.requires_grad:
            return checkpoint_keeping_stats(attn, attn, *args)
        return attn(*args)

    def _fuses_tail(self, block: nn.Module,
                    attn: Optional[nn.Module]) -> bool:
        """Whether ``attn`` applies ``block``'s shortcut add and final ReLU
        itself: KCLA layers do (fused with their pooling, so the ReLU
        output is never saved for backward), except under with_cp, where
        the checkpointed attention must not overwrite its input, and where
        the block's ReLU has hooks (:func:`hooked`: the block then calls it
        for its final ReLU too, as mmdet's blocks do)."""
        return (isinstance(attn, KCLALayer) and not self.with_cp
                and not hooked(block.relu))

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """(B, in_channels, H, W) -> one (B, C_i, H_i, W_i) per out
        index (preceded by the stem output if ``with_stem_out``)."""
        self._check_input(x)
        if self.deep_stem:
            x = self.stem(x)
        else:
            x = self.relu(self.norm1(self.conv1(x)))
        outs = [x] if self.with_stem_out else []
        x = self.maxpool(x)
        state = None
        tapes = []  # of the layers whose successors may invert their state
        for i, layer_name in enumerate(self.res_layers):
            blocks = getattr(self, layer_name)
            attns = getattr(self, self.attn_layers[i]) \
                if self.attn_layers else [None] * len(blocks)
            for block, attn in zip(blocks, attns):
                identity = None
                if getattr(attn, 'needs_identity', False):  # MRLA-light
                    # computed once, shared by the block and the attention
                    identity = block_shortcut(block, x, None)
                if self._fuses_tail(block, attn):
                    # the layer applies the block's last norm, or folds it
                    # into its one-call inference op
                    tail_norm = block.last_norm if block.defers_last_norm \
                        else None
                    out, shortcut = block(
                        x, identity, fuse_tail=True,
                        defer_last_norm=tail_norm is not None)
                    x, state = attn(out, state, relu_input=True,
                                    shortcut=shortcut, tail_norm=tail_norm)
                else:
                    x = block(x, identity)
                    if attn is not None:
                        x, state = self._attend(attn, x, state, identity)
                if getattr(state, 'tape', None) is not None:
                    tapes.append(state.tape)
            if i in self.out_indices:
                outs.append(x)
        release_invertible(tapes)
        return tuple(outs)

    def train(self, mode: bool = True) -> 'ResNetKCLA':
        """Set train mode, keeping frozen stages and (norm_eval) BNs in eval."""
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, _BatchNorm):
                    m.eval()
        return self
