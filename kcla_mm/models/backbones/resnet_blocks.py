"""ResNet blocks and stages with mmdet's ResNet structure and key names.

Written against mmcv/mmengine only, so ResNetKCLA serves mmdet and mmseg
alike; parameter names (``conv1``, ``norm1``, ``downsample.0`` ...) match
mmdet's ``ResNet`` so its checkpoints load unchanged.
"""
from typing import List, Optional

import torch.nn as nn
from mmcv.cnn import build_conv_layer, build_norm_layer, build_plugin_layer
from mmengine.model import BaseModule, Sequential
from torch import Tensor

from ..layers.utils import checkpoint_keeping_stats

PLUGIN_POSITIONS = ('after_conv1', 'after_conv2', 'after_conv3')


def block_shortcut(block: nn.Module, x: Tensor,
                   identity: Optional[Tensor]) -> Tensor:
    """``block``'s shortcut of ``x``: ``identity`` if the caller computed it,
    else ``block.downsample(x)`` or ``x``. The blocks take it after their
    residual branch, as mmdet's do: taken first, torch.compile (inductor,
    torch 2.13) fails in backward once it makes the spatial sizes dynamic
    ("Cannot convert expression to float")."""
    if identity is not None:
        return identity
    return x if block.downsample is None else block.downsample(x)


class BasicBlock(BaseModule):
    """3x3 + 3x3 residual block (ResNet-18/34); output channels = planes."""
    expansion = 1

    def __init__(self,
                 inplanes: int,
                 planes: int,
                 stride: int = 1,
                 dilation: int = 1,
                 downsample: Optional[nn.Module] = None,
                 style: str = 'pytorch',
                 with_cp: bool = False,
                 conv_cfg: Optional[dict] = None,
                 norm_cfg: dict = dict(type='BN'),
                 dcn: Optional[dict] = None,
                 plugins: Optional[List[dict]] = None,
                 init_cfg=None) -> None:
        super().__init__(init_cfg)
        if dcn is not None:
            raise ValueError('dcn is only supported by Bottleneck blocks '
                             '(depth 50/101/152), got dcn with BasicBlock')
        if plugins:
            raise ValueError('plugins are only supported by Bottleneck '
                             'blocks (depth 50/101/152)')
        self.norm1_name, norm1 = build_norm_layer(norm_cfg, planes, postfix=1)
        self.norm2_name, norm2 = build_norm_layer(norm_cfg, planes, postfix=2)
        self.conv1 = build_conv_layer(
            conv_cfg,
            inplanes,
            planes,
            3,
            stride=stride,
            padding=dilation,
            dilation=dilation,
            bias=False)
        self.add_module(self.norm1_name, norm1)
        self.conv2 = build_conv_layer(
            conv_cfg, planes, planes, 3, padding=1, bias=False)
        self.add_module(self.norm2_name, norm2)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.with_cp = with_cp

    @property
    def norm1(self) -> nn.Module:
        return getattr(self, self.norm1_name)

    @property
    def norm2(self) -> nn.Module:
        return getattr(self, self.norm2_name)

    @property
    def last_norm(self) -> nn.Module:
        return self.norm2

    defers_last_norm = True  # see Bottleneck.defers_last_norm

    def forward(self,
                x: Tensor,
                identity: Optional[Tensor] = None,
                fuse_tail: bool = False,
                defer_last_norm: bool = False):
        """(B, C_in, H, W) -> (B, C_out, H', W'); ``identity``: the
        shortcut if the caller already computed it (default: downsample(x)
        or x); ``fuse_tail=True`` returns ``(out, shortcut)`` before their
        add and the block's last ReLU, for a layer that applies both itself
        (never checkpointed: the caller ensures ``with_cp`` is off); with
        ``defer_last_norm=True`` ``out`` comes before :attr:`last_norm`
        too, which that layer applies."""

        def _branches(x, identity):
            out = self.relu(self.norm1(self.conv1(x)))
            out = self.conv2(out)
            if not defer_last_norm:
                out = self.norm2(out)
            return out, block_shortcut(self, x, identity)

        if defer_last_norm and not fuse_tail:
            raise ValueError('defer_last_norm=True needs fuse_tail=True: '
                             'the caller applies the last norm')
        if fuse_tail:
            return _branches(x, identity)

        def _inner_forward(x, identity):
            out, identity = _branches(x, identity)
            return out + identity

        if self.with_cp and x.requires_grad:
            out = checkpoint_keeping_stats(_inner_forward, self, x, identity)
        else:
            out = _inner_forward(x, identity)
        return self.relu(out)


class Bottleneck(BaseModule):
    """1x1 + 3x3 + 1x1 residual block; output channels = 4 * planes.

    ``style='pytorch'`` puts the stride on the 3x3 conv, ``'caffe'`` on the
    first 1x1. ``dcn`` replaces the 3x3 conv; ``plugins`` insert modules
    after conv1/conv2/conv3 as in mmdet.
    """
    expansion = 4

    def __init__(self,
                 inplanes: int,
                 planes: int,
                 stride: int = 1,
                 dilation: int = 1,
                 downsample: Optional[nn.Module] = None,
                 style: str = 'pytorch',
                 with_cp: bool = False,
                 conv_cfg: Optional[dict] = None,
                 norm_cfg: dict = dict(type='BN'),
                 dcn: Optional[dict] = None,
                 plugins: Optional[List[dict]] = None,
                 init_cfg=None) -> None:
        super().__init__(init_cfg)
        plugins = plugins or []
        for plugin in plugins:
            if plugin.get('position') not in PLUGIN_POSITIONS:
                raise ValueError(f'plugin position must be one of '
                                 f'{PLUGIN_POSITIONS}, got '
                                 f'{plugin.get("position")!r}')
        self.with_cp = with_cp
        conv1_stride, conv2_stride = (1, stride) if style == 'pytorch' else (
            stride, 1)
        self.norm1_name, norm1 = build_norm_layer(norm_cfg, planes, postfix=1)
        self.norm2_name, norm2 = build_norm_layer(norm_cfg, planes, postfix=2)
        self.norm3_name, norm3 = build_norm_layer(
            norm_cfg, planes * self.expansion, postfix=3)
        self.conv1 = build_conv_layer(
            conv_cfg, inplanes, planes, 1, stride=conv1_stride, bias=False)
        self.add_module(self.norm1_name, norm1)
        if dcn is not None:
            dcn = dict(dcn)
        fallback_on_stride = dcn.pop('fallback_on_stride', False) \
            if dcn is not None else False
        use_dcn = dcn is not None and not (fallback_on_stride
                                           and conv2_stride > 1)
        self.conv2 = build_conv_layer(
            dcn if use_dcn else conv_cfg,
            planes,
            planes,
            3,
            stride=conv2_stride,
            padding=dilation,
            dilation=dilation,
            bias=False)
        self.add_module(self.norm2_name, norm2)
        self.conv3 = build_conv_layer(
            conv_cfg, planes, planes * self.expansion, 1, bias=False)
        self.add_module(self.norm3_name, norm3)
        self.relu = nn.ReLU(inplace=True)
        # registered after the convs, as in mmdet: the same parameter order,
        # so an mmdet run's optimizer state lines up with this network
        self.downsample = downsample
        widths = dict(
            after_conv1=planes,
            after_conv2=planes,
            after_conv3=planes * self.expansion)
        self.plugin_names = {
            position: self._make_plugins(
                widths[position],
                [p['cfg'] for p in plugins if p['position'] == position],
                position)
            for position in PLUGIN_POSITIONS
        }

    def _make_plugins(self, in_channels: int, cfgs: List[dict],
                      position: str) -> List[str]:
        names = []
        for cfg in cfgs:
            cfg = cfg.copy()
            name, layer = build_plugin_layer(
                cfg,
                in_channels=in_channels,
                postfix=cfg.pop('postfix', ''))
            if hasattr(self, name):
                raise ValueError(f'duplicate plugin name {name!r} at '
                                 f'{position}; set distinct postfix values')
            self.add_module(name, layer)
            names.append(name)
        return names

    def _plugins(self, x: Tensor, position: str) -> Tensor:
        for name in self.plugin_names[position]:
            x = getattr(self, name)(x)
        return x

    @property
    def norm1(self) -> nn.Module:
        return getattr(self, self.norm1_name)

    @property
    def norm2(self) -> nn.Module:
        return getattr(self, self.norm2_name)

    @property
    def norm3(self) -> nn.Module:
        return getattr(self, self.norm3_name)

    @property
    def last_norm(self) -> nn.Module:
        return self.norm3

    @property
    def defers_last_norm(self) -> bool:
        """Whether ``forward`` can leave :attr:`last_norm` to the caller
        (no after_conv3 plugins follow it)."""
        return not self.plugin_names['after_conv3']

    def forward(self,
                x: Tensor,
                identity: Optional[Tensor] = None,
                fuse_tail: bool = False,
                defer_last_norm: bool = False):
        """(B, C_in, H, W) -> (B, 4 planes, H', W'); ``identity``: the
        shortcut if the caller already computed it (default: downsample(x)
        or x); ``fuse_tail=True`` returns ``(out, shortcut)`` before their
        add and the block's last ReLU, for a layer that applies both itself
        (never checkpointed: the caller ensures ``with_cp`` is off); with
        ``defer_last_norm=True`` ``out`` comes before :attr:`last_norm`
        too, which that layer applies (not with after_conv3 plugins)."""

        def _branches(x, identity):
            out = self.relu(self.norm1(self.conv1(x)))
            out = self._plugins(out, 'after_conv1')
            out = self.relu(self.norm2(self.conv2(out)))
            out = self._plugins(out, 'after_conv2')
            out = self.conv3(out)
            if not defer_last_norm:
                out = self._plugins(self.norm3(out), 'after_conv3')
            return out, block_shortcut(self, x, identity)

        if defer_last_norm and not (fuse_tail and self.defers_last_norm):
            raise ValueError(
                'defer_last_norm=True needs fuse_tail=True and a block '
                'without after_conv3 plugins (they run after the last norm)')
        if fuse_tail:
            return _branches(x, identity)

        def _inner_forward(x, identity):
            out, identity = _branches(x, identity)
            return out + identity

        if self.with_cp and x.requires_grad:
            out = checkpoint_keeping_stats(_inner_forward, self, x, identity)
        else:
            out = _inner_forward(x, identity)
        return self.relu(out)


def make_res_layer(block: type,
                   inplanes: int,
                   planes: int,
                   num_blocks: int,
                   stride: int = 1,
                   avg_down: bool = False,
                   conv_cfg: Optional[dict] = None,
                   norm_cfg: dict = dict(type='BN'),
                   **block_kwargs) -> Sequential:
    """One ResNet stage as mmdet's ``ResLayer``: block 0 strides/downsamples."""
    downsample = None
    if stride != 1 or inplanes != planes * block.expansion:
        layers = []
        conv_stride = stride
        if avg_down:  # as mmdet: the pool is there even at stride 1
            conv_stride = 1
            layers.append(
                nn.AvgPool2d(
                    kernel_size=stride,
                    stride=stride,
                    ceil_mode=True,
                    count_include_pad=False))
        layers += [
            build_conv_layer(
                conv_cfg,
                inplanes,
                planes * block.expansion,
                kernel_size=1,
                stride=conv_stride,
                bias=False),
            build_norm_layer(norm_cfg, planes * block.expansion)[1]
        ]
        downsample = nn.Sequential(*layers)
    blocks = [
        block(
            inplanes,
            planes,
            stride=stride,
            downsample=downsample,
            conv_cfg=conv_cfg,
            norm_cfg=norm_cfg,
            **block_kwargs)
    ]
    for _ in range(1, num_blocks):
        blocks.append(
            block(
                planes * block.expansion,
                planes,
                stride=1,
                conv_cfg=conv_cfg,
                norm_cfg=norm_cfg,
                **block_kwargs))
    return Sequential(*blocks)
