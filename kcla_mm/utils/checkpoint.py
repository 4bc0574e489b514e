"""Checkpoint conversion for ResNetKCLA, and atomic checkpoint writing.

Two sources of weights (docs/method.md §5):

1. The KCLA authors' checkpoints (``bgx666/KCLA``, ``imagenet/
   kcla_resnet.py``): ``torch.save({'epoch', 'arch', 'state_dict',
   'best_acc1', 'optimizer'})`` with keys usually prefixed ``module.``.
   :func:`convert_official_state_dict` renames them to ResNetKCLA's names
   (:data:`OFFICIAL_ATTENTION_NAMES`) and checks every key, shape and the
   frozen temperatures ``norm_d``.
2. Plain ResNet weights (torchvision, mmdet, mmpretrain names, which agree:
   ``conv1``, ``bn1``, ``layer1.0.conv1`` ...): :func:`merge_resnet_state_dict`
   loads them over a freshly initialised ResNetKCLA and reports which keys
   were loaded, which are new and which were not used.

Both return a :class:`KeyReport`; a conversion with missing, unexpected or
mis-shaped keys raises :class:`CheckpointMismatchError` listing them, so a
checkpoint of another depth or architecture never half-loads.

Nothing here imports the models (``kcla_mm.utils`` is imported first by
``kcla_mm``): the functions take the target model's ``state_dict()``.
"""
import hashlib
import io
import os
import os.path as osp
import re
import stat
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import (Callable, Dict, List, Mapping, Optional, Sequence,
                    Tuple)

import torch
from torch import Tensor

from .safe_load import allow_mmengine_checkpoints

# authors' KCLA sub-module name -> ResNetKCLA's (relative to the layer)
OFFICIAL_ATTENTION_NAMES = OrderedDict([
    ('Wq', 'q_conv'),
    ('Wk', 'k_conv'),
    ('Wv', 'v_conv'),
    ('head_att', 'gate'),
    ('bn_attention', 'bn'),
    ('adjust_channel', 'adapter.conv'),
    ('u_bn', 'adapter.bn'),
    ('u_Wk', 'adapter.k_conv'),
])
# their frozen temperatures 1 / s (an nn.Parameter there, a non-persistent
# buffer here): checked against ours, not stored
OFFICIAL_NORM_D = 'norm_d'

# blocks per stage of the Bottleneck ResNets the authors build
OFFICIAL_DEPTHS = {(3, 4, 6, 3): 50, (3, 4, 23, 3): 101, (3, 8, 36, 3): 152}

_STEM = re.compile(r'^(conv1|bn1)\.(.+)$')
_BLOCK = re.compile(r'^layer(\d+)\.layers\.(\d+)\.(.+)$')
_ATTN = re.compile(r'^layer(\d+)\.attention\.(\d+)\.([A-Za-z_]+)(?:\.(.+))?$')
_MM_BLOCK = re.compile(r'^layer(\d+)\.(\d+)\.(.+)$')
_MM_ATTN = re.compile(r'^layer(\d+)_attn\.(\d+)\.(.+)$')
_BACKBONE_ROOTS = re.compile(r'^(conv1|bn1|norm1|stem|layer\d+(_attn)?)$')


class CheckpointMismatchError(ValueError):
    """A checkpoint does not match the model; ``report`` lists the keys."""

    def __init__(self, message: str, report: 'KeyReport') -> None:
        super().__init__(message)
        self.report = report


@dataclass
class KeyReport:
    """Where every key of a conversion went.

    Attributes:
        loaded (list[str]): model keys filled from the checkpoint.
        new (list[str]): model keys the checkpoint has no counterpart for
            by design (layers absent from a plain ResNet); kept as
            initialised.
        filled (list[str]): BN ``num_batches_tracked`` counters absent from
            the checkpoint (older torch); kept as initialised.
        unused (list[str]): checkpoint keys outside the backbone (``fc``,
            detector heads).
        dropped (list[str]): checkpoint keys of modules the authors build but
            their forward never runs; ``dropped_why`` maps each to the
            reason.
        unexpected (list[str]): checkpoint backbone keys with no counterpart
            in the model (another depth or architecture). An error.
        missing (list[str]): model keys the checkpoint should have had. An
            error.
        shape_mismatch (list[str]): keys present on both sides with
            different shapes. An error.
        value_mismatch (list[str]): constants that differ (``norm_d``). An
            error.
    """
    loaded: List[str] = field(default_factory=list)
    new: List[str] = field(default_factory=list)
    filled: List[str] = field(default_factory=list)
    unused: List[str] = field(default_factory=list)
    dropped: List[str] = field(default_factory=list)
    dropped_why: Dict[str, str] = field(default_factory=dict)
    unexpected: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    shape_mismatch: List[str] = field(default_factory=list)
    value_mismatch: List[str] = field(default_factory=list)

    ERRORS = ('unexpected', 'missing', 'shape_mismatch', 'value_mismatch')

    @property
    def ok(self) -> bool:
        return not any(getattr(self, name) for name in self.ERRORS)

    def errors(self) -> Dict[str, List[str]]:
        return {
            name: getattr(self, name)
            for name in self.ERRORS if getattr(self, name)
        }


def format_keys(keys: Sequence[str], limit: int = 10,
                indent: str = '    ') -> str:
    """The first ``limit`` keys, one per line, then '... and N more'."""
    lines = [indent + k for k in keys[:limit]]
    if len(keys) > limit:
        lines.append(f'{indent}... and {len(keys) - limit} more')
    return '\n'.join(lines)


def format_mismatch(report: KeyReport, limit: int = 10) -> str:
    """The error categories of ``report``: count, then the first keys."""
    titles = dict(
        unexpected='unexpected keys (in the checkpoint, not in the model)',
        missing='missing keys (in the model, not in the checkpoint)',
        shape_mismatch='shape mismatches',
        value_mismatch='value mismatches')
    return '\n'.join(f'  {titles[name]} ({len(keys)}):\n'
                     f'{format_keys(keys, limit)}'
                     for name, keys in report.errors().items())


def load_checkpoint_file(path: str, unsafe_load: bool = False) -> dict:
    """``torch.load`` to CPU, with ``weights_only`` and mmengine's own
    checkpoint types allowed (:func:`allow_mmengine_checkpoints`) unless
    ``unsafe_load``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a directory or another non-regular file (a
            FIFO would block), or cannot be read as a checkpoint.
    """
    if not osp.lexists(path):
        raise FileNotFoundError(f'checkpoint not found: {path}')
    if osp.isdir(path):
        raise ValueError(f'{path} is a directory, not a checkpoint file')
    if not osp.exists(path) or not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f'{path} is not a regular file')
    try:
        with allow_mmengine_checkpoints():
            checkpoint = torch.load(
                path, map_location='cpu', weights_only=not unsafe_load)
    except Exception as e:  # pickle, zip and torch errors alike
        hint = '' if unsafe_load else (
            ' (it was read with weights_only=True; if you trust the file '
            'and it pickles other objects, pass --unsafe-load)')
        raise ValueError(f'cannot read {path} as a torch checkpoint: '
                         f'{type(e).__name__}: {e}{hint}') from e
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f'{path} holds a {type(checkpoint).__name__}, not '
                         'a checkpoint dict or state dict')
    return checkpoint


def check_output_file(out: str, src: str, what: str = 'dst') -> None:
    """Refuse an output path that names no file, is a directory, or is the
    source checkpoint ``src`` (the same path, a symlink or a hard link to
    it), before anything is read or written.

    Raises:
        ValueError: Naming ``what`` and the path.
    """
    if not osp.basename(out):
        raise ValueError(f'{what} {out!r} names no file')
    if osp.isdir(out):
        raise ValueError(f'{what} {out} is a directory; name a file')
    if osp.realpath(out) == osp.realpath(src) or (
            osp.exists(out) and osp.exists(src) and osp.samefile(out, src)):
        raise ValueError(f'{what} {out} is the source checkpoint {src}; '
                         'the source is never replaced: name another file')


def get_state_dict(checkpoint: Mapping) -> Dict[str, Tensor]:
    """``checkpoint['state_dict']``, or ``checkpoint`` itself if it is a
    bare state dict (torchvision's files).

    Raises:
        ValueError: If there is no dict of tensors, or (naming the first
            bad entry) a key is not a string or a weight is not floating
            point (integer BN ``num_batches_tracked`` counters excepted) or
            holds NaN or inf.
    """
    if 'state_dict' in checkpoint:
        state_dict = checkpoint['state_dict']
    else:
        state_dict = checkpoint
    if not isinstance(state_dict, Mapping) or not state_dict or not all(
            isinstance(v, Tensor) for v in state_dict.values()):
        raise ValueError(
            'no state dict found: expected a dict of tensors, or a dict with '
            f'a "state_dict" entry; got the keys {list(checkpoint)[:8]}')
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ValueError(f'state dict key {key!r} '
                             f'({type(key).__name__}) is not a string')
        if not value.is_floating_point():
            if key.endswith('num_batches_tracked'):
                continue
            raise ValueError(f'state dict entry {key!r} is {value.dtype}, '
                             'not floating point')
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f'state dict entry {key!r} holds NaN or inf')
    return dict(state_dict)


def strip_prefix(state_dict: Mapping[str, Tensor],
                 prefix: str = 'module.') -> Dict[str, Tensor]:
    """Remove ``prefix`` (DataParallel/DDP's ``module.``) where present."""
    n = len(prefix)
    return {(k[n:] if k.startswith(prefix) else k): v
            for k, v in state_dict.items()}


def split_backbone(state_dict: Mapping[str, Tensor]
                   ) -> Tuple[Dict[str, Tensor], List[str]]:
    """(backbone state dict, other keys) of a possibly whole-model state dict.

    ``module.`` is stripped; if any key starts with ``backbone.`` (mmdet,
    mmseg, mmpretrain models) only those are kept, without the prefix, and
    the rest (necks, heads) are returned as other keys.
    """
    state_dict = strip_prefix(state_dict, 'module.')
    if not any(k.startswith('backbone.') for k in state_dict):
        return state_dict, []
    backbone = {k[len('backbone.'):]: v for k, v in state_dict.items()
                if k.startswith('backbone.')}
    return backbone, sorted(k for k in state_dict
                            if not k.startswith('backbone.'))


def is_backbone_key(key: str) -> bool:
    """Whether ``key`` names a ResNet backbone tensor (stem or stage)."""
    return bool(_BACKBONE_ROOTS.match(key.split('.', 1)[0]))


def official_to_mm_key(key: str) -> Optional[str]:
    """ResNetKCLA's name of an authors' key (no ``module.``); None if the key
    is not part of their backbone. ``norm_d`` maps to
    ``layer{s}_attn.{i}.norm_d`` (a buffer of ours, not in the state dict).
    """
    m = _STEM.match(key)
    if m:
        return key
    m = _BLOCK.match(key)
    if m:
        return f'layer{m[1]}.{m[2]}.{m[3]}'
    m = _ATTN.match(key)
    if m:
        module, rest = m[3], m[4]
        prefix = f'layer{m[1]}_attn.{m[2]}'
        if module == OFFICIAL_NORM_D and rest is None:
            return f'{prefix}.norm_d'
        if module in OFFICIAL_ATTENTION_NAMES and rest is not None:
            return f'{prefix}.{OFFICIAL_ATTENTION_NAMES[module]}.{rest}'
    return None


def mm_to_official_key(key: str) -> Optional[str]:
    """The authors' name of a ResNetKCLA key (inverse of
    :func:`official_to_mm_key`); None if they have none."""
    if _STEM.match(key):
        return key
    m = _MM_ATTN.match(key)
    if m:
        rest = m[3]
        for theirs, ours in reversed(OFFICIAL_ATTENTION_NAMES.items()):
            if rest.startswith(ours + '.'):
                return (f'layer{m[1]}.attention.{m[2]}.{theirs}.'
                        f'{rest[len(ours) + 1:]}')
        if rest == 'norm_d':
            return f'layer{m[1]}.attention.{m[2]}.{OFFICIAL_NORM_D}'
        return None
    m = _MM_BLOCK.match(key)
    if m:
        return f'layer{m[1]}.layers.{m[2]}.{m[3]}'
    return None


def infer_official_depth(state_dict: Mapping[str, Tensor]) -> int:
    """ResNet depth of an authors' state dict, from its blocks per stage.

    Raises:
        ValueError: no authors'-format block keys, or a block layout that is
            not ResNet-50/101/152.
    """
    blocks: Dict[int, set] = {}
    for key in state_dict:
        m = _BLOCK.match(key)
        if m:
            blocks.setdefault(int(m[1]), set()).add(int(m[2]))
    if not blocks:
        raise ValueError(
            "no block keys of the KCLA authors' format "
            '(layer{s}.layers.{i}.*) found; the first keys are '
            f'{sorted(state_dict)[:5]}. A plain ResNet checkpoint goes '
            'through tools/model_converters/resnet_to_kcla.py instead')
    layout = tuple(len(blocks.get(s, ())) for s in range(1, 5))
    if layout not in OFFICIAL_DEPTHS:
        known = ', '.join(f'{v}: {k}' for k, v in OFFICIAL_DEPTHS.items())
        raise ValueError(f'cannot infer the depth from {layout} blocks per '
                         f'stage (known: {known}); pass --depth')
    return OFFICIAL_DEPTHS[layout]


def _rounded(values: Tensor) -> List[float]:
    return [round(v, 4) for v in values.tolist()]


def _describe_shape(key: str, mm_key: str, src: Tensor, dst: Tensor) -> str:
    name = key if key == mm_key else f'{key} -> {mm_key}'
    return (f'{name}: checkpoint {tuple(src.shape)} vs model '
            f'{tuple(dst.shape)}')


def _official_unused(mm_key: str, target: Mapping[str, Tensor]
                     ) -> Optional[str]:
    """Why the authors' forward never uses the module of ``mm_key`` (a key
    of ours absent from ``target``), or None if it would."""
    m = _MM_ATTN.match(mm_key)
    if not m or not m[3].startswith('adapter.'):
        return None
    if (m[1], m[2]) == ('1', '0'):
        return ('the first KCLA layer of the network has no incoming state '
                'to adapt')
    layer = f'layer{m[1]}_attn.{m[2]}'
    if m[3].startswith('adapter.conv.') and \
            f'{layer}.adapter.bn.weight' in target:
        return ('the incoming state already has this layer\'s width, so '
                'their forward skips adjust_channel')
    return None


def convert_official_state_dict(
        state_dict: Mapping[str, Tensor],
        target: Mapping[str, Tensor],
        norm_d: Mapping[str, Tensor],
        rtol: float = 1e-5) -> Tuple[Dict[str, Tensor], KeyReport]:
    """Rename an authors' KCLA state dict to ResNetKCLA's names, checking it.

    Args:
        state_dict (Mapping[str, Tensor]): the authors' state dict, with or
            without the ``module.`` prefix.
        target (Mapping[str, Tensor]): ``ResNetKCLA(...).state_dict()`` of
            the model to load it into (names and shapes).
        norm_d (Mapping[str, Tensor]): the model's temperature buffers by
            layer name (``'layer1_attn.0'`` -> ``norm_d`` (G,)).
        rtol (float): relative tolerance of the ``norm_d`` check.

    Returns:
        tuple[dict, KeyReport]: the state dict in ResNetKCLA's names (every
        key of ``target``) and where each key went. ``fc.*`` is unused,
        the modules their forward never runs are dropped (the first layer's
        adapter; ``adjust_channel`` of a block-11 init layer).

    Raises:
        CheckpointMismatchError: unexpected, missing or mis-shaped keys, or
            temperatures that differ from the model's.
    """
    state_dict = strip_prefix(state_dict, 'module.')
    report = KeyReport()
    out: Dict[str, Tensor] = {}
    mis_shaped, seen_norm_d = set(), set()
    for key in sorted(state_dict):
        value = state_dict[key]
        if key.startswith('fc.'):
            report.unused.append(key)
            continue
        mm_key = official_to_mm_key(key)
        if mm_key is None:
            report.unexpected.append(key)
            continue
        if mm_key.endswith('.norm_d'):
            layer = mm_key[:-len('.norm_d')]
            if layer not in norm_d:
                report.unexpected.append(key)
                continue
            seen_norm_d.add(layer)
            ours = norm_d[layer].detach().float().flatten().cpu()
            theirs = value.detach().float().flatten()
            if theirs.numel() != ours.numel() or not torch.allclose(
                    theirs, ours, rtol=rtol, atol=0):
                report.value_mismatch.append(
                    f'{key}: checkpoint {_rounded(theirs)} vs model '
                    f'{_rounded(ours)} (other head_dim or temperature_range)')
            continue
        if mm_key not in target:
            reason = _official_unused(mm_key, target)
            if reason is None:
                report.unexpected.append(key)
            else:
                report.dropped.append(key)
                report.dropped_why[key] = reason
            continue
        if tuple(value.shape) != tuple(target[mm_key].shape):
            report.shape_mismatch.append(
                _describe_shape(key, mm_key, value, target[mm_key]))
            mis_shaped.add(mm_key)
            continue
        out[mm_key] = value
        report.loaded.append(mm_key)
    for mm_key, value in target.items():
        if mm_key in out or mm_key in mis_shaped:
            continue
        if mm_key.endswith('.num_batches_tracked'):
            out[mm_key] = value.clone()
            report.filled.append(mm_key)
        else:
            theirs = mm_to_official_key(mm_key)
            report.missing.append(
                f'{theirs} (model: {mm_key})' if theirs else mm_key)
    for layer in sorted(set(norm_d) - seen_norm_d):
        theirs = mm_to_official_key(f'{layer}.norm_d')
        report.missing.append(f'{theirs} (model: {layer}.norm_d buffer)')
    if not report.ok:
        raise CheckpointMismatchError(
            'the checkpoint does not match the model:\n' +
            format_mismatch(report), report)
    return OrderedDict((k, out[k]) for k in target), report


def merge_resnet_state_dict(
        state_dict: Mapping[str, Tensor],
        target: Mapping[str, Tensor],
        is_new: Callable[[str], bool]) -> Tuple[Dict[str, Tensor], KeyReport]:
    """Load plain ResNet weights over a model's (initialised) state dict.

    Args:
        state_dict (Mapping[str, Tensor]): backbone keys in torchvision /
            mmdet names (``module.`` and ``backbone.`` already handled by
            :func:`split_backbone`).
        target (Mapping[str, Tensor]): the initialised model's
            ``state_dict()``.
        is_new (Callable[[str], bool]): whether a model key belongs to a
            module a plain ResNet lacks (the layer-attention modules).

    Returns:
        tuple[dict, KeyReport]: ``target`` with the loaded tensors replaced,
        and where each key went (``loaded``, ``new``, ``filled``, ``unused``:
        non-backbone keys such as ``fc.weight``).

    Raises:
        CheckpointMismatchError: backbone keys the model lacks (another depth
            or architecture), ResNet keys the checkpoint lacks, or shape
            mismatches.
    """
    report = KeyReport()
    out = OrderedDict(target)  # entries are replaced, tensors not mutated
    mis_shaped = set()
    for key in sorted(state_dict):
        value = state_dict[key]
        if key in target:
            if tuple(value.shape) != tuple(target[key].shape):
                report.shape_mismatch.append(
                    _describe_shape(key, key, value, target[key]))
                mis_shaped.add(key)
            else:
                out[key] = value.to(target[key].dtype)
                report.loaded.append(key)
        elif is_backbone_key(key):
            report.unexpected.append(key)
        else:
            report.unused.append(key)
    loaded = set(report.loaded) | mis_shaped
    for key in target:
        if key in loaded:
            continue
        if is_new(key):
            report.new.append(key)
        elif key.endswith('.num_batches_tracked'):
            report.filled.append(key)
        else:
            report.missing.append(key)
    if not report.ok:
        raise CheckpointMismatchError(
            'the checkpoint does not match the model:\n' +
            format_mismatch(report), report)
    return out, report


def group_by_module(keys: Sequence[str], depth: int = 2
                    ) -> Dict[str, List[str]]:
    """``{'layer1_attn.0': ['bn.bias', ...]}``: keys grouped by their first
    ``depth`` name components, in first-seen order."""
    groups: Dict[str, List[str]] = OrderedDict()
    for key in keys:
        parts = key.split('.')
        groups.setdefault('.'.join(parts[:depth]),
                          []).append('.'.join(parts[depth:]))
    return groups


def checkpoint_bytes(obj: object) -> bytes:
    """``torch.save(obj)`` to memory; the bytes do not depend on the file
    name, so the same content always has the same SHA-256."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write_bytes_atomic(data: bytes, path: str) -> str:
    """Write ``data`` to ``path`` through a temporary file in the same folder
    and ``os.replace``: readers see the old file or the whole new one, and a
    failure leaves nothing behind, no folder made for it included. Returns
    the absolute path."""
    path = osp.abspath(path)
    folder = osp.dirname(path)
    missing = []  # the folders to make, innermost first
    while not osp.isdir(folder):
        missing.append(folder)
        folder = osp.dirname(folder)
    tmp = None
    try:
        for created in reversed(missing):
            os.mkdir(created)
        fd, tmp = tempfile.mkstemp(prefix=f'.{osp.basename(path)}.',
                                   suffix='.tmp', dir=osp.dirname(path))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> a normal file's
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None and osp.exists(tmp):
            os.remove(tmp)
        for created in missing:
            if osp.isdir(created) and not os.listdir(created):
                os.rmdir(created)
        raise
    return path


def save_checkpoint_atomic(obj: object, path: str) -> str:
    """``torch.save(obj, path)`` atomically; returns the file's SHA-256."""
    data = checkpoint_bytes(obj)
    write_bytes_atomic(data, path)
    return hashlib.sha256(data).hexdigest()


def publish_checkpoint(in_file: str, out_file: str,
                       keep_keys: Sequence[str] = ('state_dict', 'meta'),
                       unsafe_load: bool = False
                       ) -> Tuple[str, str, List[str]]:
    """Strip a training checkpoint to ``keep_keys`` and name it by its hash.

    Writes ``<out_file without .pth>-<first 8 hex of SHA-256>.pth``
    atomically (mmdet's ``publish_model.py`` convention).

    Returns:
        tuple[str, str, list[str]]: the published path, the full SHA-256 and
        the removed top-level keys.
    """
    stem = out_file[:-len('.pth')] if out_file.endswith('.pth') else out_file
    if not osp.basename(stem):
        raise ValueError(f'out_file {out_file!r} names no file')
    checkpoint = load_checkpoint_file(in_file, unsafe_load)
    state_dict = get_state_dict(checkpoint)  # a checked dict of tensors
    if 'state_dict' not in checkpoint:  # a bare state dict
        checkpoint = dict(state_dict=state_dict)
    removed = [k for k in checkpoint if k not in keep_keys]
    published = {k: checkpoint[k] for k in keep_keys if k in checkpoint}
    data = checkpoint_bytes(published)
    sha = hashlib.sha256(data).hexdigest()
    final = f'{stem}-{sha[:8]}.pth'
    check_output_file(final, in_file, 'out_file')
    final = write_bytes_atomic(data, final)
    return final, sha, removed
