"""Convert a checkpoint of the KCLA authors' ImageNet code to ResNetKCLA.

The source is what ``bgx666/KCLA``'s ``imagenet/`` training saves:
``torch.save({'epoch', 'arch', 'state_dict', 'best_acc1', 'optimizer'})``
with keys usually prefixed ``module.``. Their names map to ours as follows
(``{s}`` stage 1-4, ``{i}`` block index)::

    conv1.*, bn1.*                          conv1.*, bn1.*
    layer{s}.layers.{i}.<conv/bn/downsample> layer{s}.{i}.<same>
    layer{s}.attention.{i}.Wq               layer{s}_attn.{i}.q_conv
    layer{s}.attention.{i}.Wk               layer{s}_attn.{i}.k_conv
    layer{s}.attention.{i}.Wv               layer{s}_attn.{i}.v_conv
    layer{s}.attention.{i}.head_att         layer{s}_attn.{i}.gate
    layer{s}.attention.{i}.bn_attention     layer{s}_attn.{i}.bn
    layer{s}.attention.{i}.adjust_channel   layer{s}_attn.{i}.adapter.conv
    layer{s}.attention.{i}.u_bn             layer{s}_attn.{i}.adapter.bn
    layer{s}.attention.{i}.u_Wk             layer{s}_attn.{i}.adapter.k_conv
    layer{s}.attention.{i}.norm_d           checked against our buffer
    fc.*                                    not used (classifier)

Their forward never runs ``layer1.attention.0``'s adjust_channel/u_bn/u_Wk
(no state before the first layer) nor ``adjust_channel`` of the block-11 init
layer of ResNet-101/152 (the state already has its width): those are dropped
and listed. Any other unmatched key, missing key, shape or temperature
mismatch (another depth or architecture) fails with exit code 1, lists the
keys and writes nothing.

The output, ``{'state_dict', 'meta'}`` in ResNetKCLA's names, is written
atomically and loads with::

    model = dict(backbone=dict(type='ResNetKCLA', depth=50,
                               init_cfg=dict(type='Pretrained',
                                             checkpoint='DST')))

(the backbone's ``init_cfg``, without ``prefix``: the keys have no
``backbone.`` prefix. ``prefix='backbone.'`` is for loading the backbone
out of a whole detector/segmentor checkpoint instead.)

Example:
    python tools/model_converters/kcla_official_to_mm.py \\
        model_best.pth.tar checkpoints/resnet50-kcla_in1k.pth
"""
import argparse
import os.path as osp
import re
import sys

from kcla_mm import ResNetKCLA, __version__
from kcla_mm.utils.checkpoint import (CheckpointMismatchError,
                                      check_output_file,
                                      convert_official_state_dict,
                                      format_mismatch, get_state_dict,
                                      group_by_module, infer_official_depth,
                                      load_checkpoint_file,
                                      save_checkpoint_atomic, strip_prefix)
from kcla_mm.utils.cli import sigterm_as_interrupt

DEPTHS = (50, 101, 152)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('src', help="the authors' checkpoint (.pth.tar)")
    parser.add_argument('dst', help='output checkpoint for ResNetKCLA')
    parser.add_argument(
        '--depth', type=int, choices=DEPTHS,
        help='ResNet depth; default: inferred from the blocks per stage')
    parser.add_argument(
        '--max-list', type=int, default=10,
        help='keys listed per category on a mismatch (default 10)')
    parser.add_argument(
        '--unsafe-load', action='store_true',
        help='torch.load with weights_only=False (only for trusted files)')
    args = parser.parse_args(argv)
    if args.max_list < 1:
        parser.error(f'argument --max-list: must be an int >= 1, got '
                     f'{args.max_list}')
    return args


def _meta_value(value):
    """A checkpoint field as a plain Python value (tensors -> numbers)."""
    if hasattr(value, 'item') and getattr(value, 'numel', lambda: 0)() == 1:
        return value.item()
    return value if isinstance(value, (int, float, str)) else None


def convert(src: str, dst: str, depth=None, max_list: int = 10,
            unsafe_load: bool = False) -> dict:
    """Convert ``src`` into ``dst``; returns the conversion summary.

    Raises:
        ValueError: unreadable source, undeterminable depth, or (as
            :class:`CheckpointMismatchError`) mismatched keys. Nothing is
            written then.
    """
    check_output_file(dst, src)
    checkpoint = load_checkpoint_file(src, unsafe_load)
    state_dict = strip_prefix(get_state_dict(checkpoint), 'module.')
    inferred = depth is None
    if inferred:
        depth = infer_official_depth(state_dict)
    model = ResNetKCLA(depth=depth, layer_attention='KCLA')
    norm_d = {
        f'{name}.{j}': layer.norm_d
        for name in model.attn_layers
        for j, layer in enumerate(getattr(model, name))
    }
    try:
        converted, report = convert_official_state_dict(
            state_dict, model.state_dict(), norm_d)
    except CheckpointMismatchError as e:
        hint = ''
        if any(re.match(r'layer\d+\.\d+\.', k) for k in e.report.unexpected):
            hint = ('\n  (this looks like a plain ResNet checkpoint: use '
                    'tools/model_converters/resnet_to_kcla.py)')
        raise CheckpointMismatchError(
            f'{src} does not match ResNetKCLA(depth={depth}'
            f'{", inferred" if inferred else ""}):\n' +
            format_mismatch(e.report, max_list) + hint, e.report) from None
    meta = dict(
        converter='tools/model_converters/kcla_official_to_mm.py',
        kcla_mm_version=__version__,
        source=osp.basename(src),
        source_format='bgx666/KCLA imagenet',
        depth=depth,
        dropped_keys=report.dropped)
    for key in ('arch', 'epoch', 'best_acc1'):
        value = _meta_value(checkpoint.get(key))
        if value is not None:
            meta[f'source_{key}'] = value
    sha = save_checkpoint_atomic(dict(state_dict=converted, meta=meta), dst)
    return dict(depth=depth, report=report, sha256=sha, dst=osp.abspath(dst))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        with sigterm_as_interrupt():
            result = convert(args.src, args.dst, args.depth, args.max_list,
                             args.unsafe_load)
    except KeyboardInterrupt:
        print(f'error: interrupted\nnothing written to {args.dst}',
              file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f'error: {e}\nnothing written to {args.dst}', file=sys.stderr)
        return 1
    report = result['report']
    print(f'ResNetKCLA(depth={result["depth"]}): '
          f'{len(report.loaded)} tensors converted')
    if report.unused:
        print(f'not used (classifier): {", ".join(report.unused)}')
    if report.dropped:
        print(f'dropped: {len(report.dropped)} tensors of modules their '
              'forward never runs:')
        for module, names in group_by_module(report.dropped, 3).items():
            reason = report.dropped_why[f'{module}.{names[0]}']
            print(f'  {module}: {", ".join(names)} ({reason})')
    if report.filled:
        print(f'{len(report.filled)} BN num_batches_tracked counters absent '
              'from the source, kept at 0')
    print(f'saved {result["dst"]} (sha256 {result["sha256"][:8]})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
