"""Shared pieces of the analysis tools (key_correlation.py,
attention_maps.py): building a ResNetKCLA backbone from the command line,
reading images, the attention layers of a backbone, and plots.

The backbone comes from one of three sources (``--backbone``):

* ``random``: ``ResNetKCLA(--depth, ...)`` initialised by its own scheme
  (seeded by ``--seed``);
* ``checkpoint``: the same architecture options, weights from
  ``--checkpoint``, a state dict of a ResNetKCLA (bare, under
  ``'state_dict'``, or with every key prefixed ``backbone.``);
* ``config``: ``--config`` of a detector/segmentor whose ``model.backbone``
  is a ResNetKCLA, weights from the ``backbone.`` keys of the trained
  ``--checkpoint``.

Loading is strict: missing or unexpected backbone keys are an error.
"""
import argparse
import json
import logging
import os
import os.path as osp
import sys
from contextlib import contextmanager
from typing import Dict, List, NamedTuple, Tuple

import numpy as np
import torch
import torch.nn as nn

IMAGE_EXTS = ('.jpg', '.jpeg', '.png')
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def fail(message: str) -> None:
    """Exit with status 1 and ``error: message`` on stderr."""
    sys.exit(f'error: {message}')


def add_backbone_args(parser: argparse.ArgumentParser,
                      layer_attention: bool = True) -> None:
    """The ``--backbone`` options shared by the tools."""
    group = parser.add_argument_group('backbone')
    group.add_argument(
        '--backbone', choices=('random', 'checkpoint', 'config'),
        default='random',
        help='random init, a ResNetKCLA state dict (--checkpoint), or a '
        'trained detector/segmentor (--config + --checkpoint)')
    group.add_argument('--checkpoint', help='weights for --backbone '
                       'checkpoint/config')
    group.add_argument('--config', help='detector/segmentor config for '
                       '--backbone config')
    group.add_argument('--depth', type=int, default=50,
                       help='ResNet depth (random/checkpoint)')
    group.add_argument('--base-channels', type=int, default=64,
                       help='width of stage 1 (random/checkpoint)')
    group.add_argument('--head-dim', type=int, default=None,
                       help='channels per head (random/checkpoint); default '
                       'the layer attention\'s own (KCLA 64, MRLA-light 32)')
    if layer_attention:
        group.add_argument(
            '--layer-attention', default='KCLA',
            choices=('KCLA', 'MRLA-light', 'LA'),
            help='layer attention of the backbone (random/checkpoint)')
    group.add_argument('--seed', type=int, default=0,
                       help='seed of the random init')


def check_backbone_args(parser: argparse.ArgumentParser,
                        args: argparse.Namespace) -> None:
    """argparse errors naming the option for inconsistent backbone options."""
    if args.backbone in ('checkpoint', 'config') and not args.checkpoint:
        parser.error(f'--checkpoint is required with --backbone '
                     f'{args.backbone}')
    if args.backbone == 'config' and not args.config:
        parser.error('--config is required with --backbone config')
    if args.backbone != 'config' and args.config:
        parser.error('--config is only used with --backbone config')
    if args.backbone == 'random' and args.checkpoint:
        parser.error('--checkpoint is not used with --backbone random')
    for name in ('checkpoint', 'config'):
        path = getattr(args, name)
        if path and not osp.isfile(path):
            parser.error(f'--{name}: no such file: {path}')


@contextmanager
def quiet_mmengine():
    """Silence mmengine's INFO logs (init_weights prints every parameter)."""
    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _read_checkpoint(path: str) -> Dict[str, torch.Tensor]:
    from mmengine.runner.checkpoint import _load_checkpoint

    from kcla_mm.utils import allow_mmengine_checkpoints
    try:
        with quiet_mmengine(), allow_mmengine_checkpoints():
            ckpt = _load_checkpoint(path, map_location='cpu')
    except Exception as e:  # noqa: BLE001 (any unreadable file)
        fail(f'cannot read checkpoint {path}: {e}')
    if isinstance(ckpt, dict) and isinstance(ckpt.get('state_dict'), dict):
        ckpt = ckpt['state_dict']
    if not isinstance(ckpt, dict) or not ckpt:
        fail(f'checkpoint {path} holds no state dict')
    return ckpt


def _load_strict(model: nn.Module, state: Dict[str, torch.Tensor],
                 source: str) -> None:
    result = model.load_state_dict(state, strict=False)
    problems = []
    if result.missing_keys:
        problems.append(f'{len(result.missing_keys)} missing keys (e.g. '
                        f'{result.missing_keys[:3]})')
    if result.unexpected_keys:
        problems.append(f'{len(result.unexpected_keys)} unexpected keys '
                        f'(e.g. {result.unexpected_keys[:3]})')
    if problems:
        fail(f'{source} does not match the backbone: ' +
             '; '.join(problems) +
             ' (check --depth/--base-channels/--head-dim/--layer-attention '
             'or the config)')


def build_backbone(args: argparse.Namespace) -> Tuple[nn.Module, dict]:
    """The ResNetKCLA the options describe, in eval mode, and a JSON-able
    description of it."""
    from kcla_mm.models import ResNetKCLA
    if args.backbone == 'config':
        from mmengine.config import Config
        try:
            cfg = Config.fromfile(args.config)
            backbone_cfg = cfg.model.backbone.to_dict()
        except Exception as e:  # noqa: BLE001
            fail(f'cannot read model.backbone from --config {args.config}: '
                 f'{e}')
        kind = str(backbone_cfg.pop('type', ''))
        if kind.split('.')[-1] != 'ResNetKCLA':
            fail(f'--config {args.config}: model.backbone.type is '
                 f'{kind!r}, expected ResNetKCLA')
        for key in ('init_cfg', 'pretrained'):
            backbone_cfg.pop(key, None)
        try:
            model = ResNetKCLA(**backbone_cfg)
        except (TypeError, ValueError) as e:
            fail(f'--config {args.config}: cannot build the backbone: {e}')
        state = _read_checkpoint(args.checkpoint)
        state = {k[len('backbone.'):]: v for k, v in state.items()
                 if k.startswith('backbone.')}
        if not state:
            fail(f'--checkpoint {args.checkpoint} has no backbone.* weights')
        _load_strict(model, state, f'--checkpoint {args.checkpoint}')
        info = dict(source='config', config=args.config,
                    checkpoint=args.checkpoint, **backbone_cfg)
    else:
        kwargs = dict(depth=args.depth, base_channels=args.base_channels,
                      head_dim=args.head_dim,
                      layer_attention=getattr(args, 'layer_attention',
                                              'KCLA'))
        try:
            if args.backbone == 'random':
                torch.manual_seed(args.seed)
            model = ResNetKCLA(**kwargs)
        except (TypeError, ValueError) as e:
            fail(f'cannot build the backbone: {e}')
        if args.backbone == 'random':
            with quiet_mmengine():
                model.init_weights()
            info = dict(source='random', seed=args.seed, **kwargs)
        else:
            state = _read_checkpoint(args.checkpoint)
            if state and all(k.startswith('backbone.') for k in state):
                state = {k[len('backbone.'):]: v for k, v in state.items()}
            _load_strict(model, state, f'--checkpoint {args.checkpoint}')
            info = dict(source='checkpoint', checkpoint=args.checkpoint,
                        **kwargs)
    if model.layer_attention is None:
        fail('the backbone has no layer attention (layer_attention=None)')
    info['layer_attention'] = model.layer_attention
    return model.eval(), info


def find_images(folder: str) -> List[str]:
    """Image files (jpg/jpeg/png) directly in ``folder``, sorted."""
    if not osp.isdir(folder):
        fail(f'image folder {folder} does not exist')
    return sorted(
        osp.join(folder, name) for name in os.listdir(folder)
        if name.lower().endswith(IMAGE_EXTS)
        and osp.isfile(osp.join(folder, name)))


def load_image(path: str, size: int) -> torch.Tensor:
    """RGB image resized to size x size (bilinear), ImageNet-normalised,
    (3, size, size) float32. Raises OSError/ValueError if unreadable."""
    from PIL import Image
    with Image.open(path) as img:
        img = img.convert('RGB').resize((size, size), Image.BILINEAR)
        arr = np.asarray(img, dtype=np.float32) / 255.0
    mean = np.asarray(IMAGENET_MEAN, dtype=np.float32)
    std = np.asarray(IMAGENET_STD, dtype=np.float32)
    return torch.from_numpy((arr - mean) / std).permute(2, 0, 1).contiguous()


def load_images(paths: List[str], size: int) -> Tuple[torch.Tensor,
                                                      List[str], List[str]]:
    """(N, 3, size, size) of the readable images, their paths, and the
    paths that could not be read."""
    tensors, names, skipped = [], [], []
    for path in paths:
        try:
            tensors.append(load_image(path, size))
            names.append(path)
        except (OSError, ValueError, SyntaxError):
            skipped.append(path)
    images = torch.stack(tensors) if tensors else torch.empty(0, 3, size,
                                                               size)
    return images, names, skipped


class AttnLayer(NamedTuple):
    """One attention layer of a ResNetKCLA: ``name`` is its module path,
    e.g. 'layer3_attn.5', ``stage`` and ``block`` are 0-based."""
    name: str
    stage: int
    block: int
    module: nn.Module


def attention_layers(model: nn.Module) -> List[AttnLayer]:
    """The attention layers of ``model`` in forward order."""
    layers = []
    for stage, attn_name in enumerate(model.attn_layers):
        for block, module in enumerate(getattr(model, attn_name)):
            layers.append(AttnLayer(f'{attn_name}.{block}', stage, block,
                                    module))
    return layers


def attention_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The block output X an attention layer attends with, from the
    arguments of its forward (a forward pre-hook registered with
    ``with_kwargs=True``): ResNetKCLA hands KCLA layers the block's
    residual branch and its ``shortcut``, before their add and the block's
    final ReLU (``relu_input=True``), in inference also before the block's
    last norm (``tail_norm``)."""
    x = args[0]
    if kwargs.get('tail_norm') is not None:
        x = kwargs['tail_norm'](x)
    x = x.float()
    if kwargs.get('shortcut') is not None:
        x = x + kwargs['shortcut'].float()
    return torch.relu(x) if kwargs.get('relu_input') else x


def heatmap(ax, matrix: np.ndarray, row_labels: List[str],
            col_labels: List[str], title: str, vmin: float, vmax: float,
            fmt: str = '{:.2f}', cmap: str = 'viridis',
            annotate: bool = True):
    """An annotated imshow of ``matrix`` (NaN cells left blank)."""
    masked = np.ma.masked_invalid(matrix)
    im = ax.imshow(masked, vmin=vmin, vmax=vmax, cmap=cmap, aspect='auto')
    ax.set_xticks(range(len(col_labels)))
    ax.set_xticklabels(col_labels, rotation=60, ha='right', fontsize=7)
    ax.set_yticks(range(len(row_labels)))
    ax.set_yticklabels(row_labels, fontsize=7)
    ax.set_title(title, fontsize=9)
    rows, cols = matrix.shape
    if annotate and rows * cols <= 900:
        size = 7 if max(rows, cols) <= 12 else 4
        mid = (vmin + vmax) / 2
        for i in range(rows):
            for j in range(cols):
                if np.isfinite(matrix[i, j]):
                    ax.text(j, i, fmt.format(matrix[i, j]), ha='center',
                            va='center', fontsize=size,
                            color='black' if matrix[i, j] > mid else 'white')
    return im


def new_figure(*args, **kwargs):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: str, title_space: bool = False) -> None:
    """Lay out (leaving room for a suptitle), write and close ``fig``."""
    import matplotlib.pyplot as plt
    if title_space:
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(data: dict, path: str) -> None:
    with open(path, 'w') as f:
        json.dump(data, f, indent=1)
