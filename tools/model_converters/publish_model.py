"""Prepare a trained checkpoint for release.

Keeps ``state_dict`` and ``meta`` and drops the training state (optimizer,
message hub, parameter schedulers, EMA copies ...), then writes
``OUT-<first 8 hex digits of its SHA-256>.pth`` (``OUT`` without ``.pth``),
as mmdet's ``publish_model.py`` does, but in Python only: the hash is
computed in memory and the file is written atomically (temporary file in the
destination folder, then ``os.replace``). The same input always gives the
same bytes, hence the same name.

Example:
    python tools/model_converters/publish_model.py \\
        work_dirs/faster-rcnn_r50-kcla_fpn_1x_coco/epoch_12.pth \\
        faster-rcnn_r50-kcla_fpn_1x_coco.pth
"""
import argparse
import sys

from kcla_mm.utils.checkpoint import publish_checkpoint
from kcla_mm.utils.cli import sigterm_as_interrupt


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('in_file', help='trained checkpoint')
    parser.add_argument(
        'out_file', help='output name; the hash is inserted before .pth')
    parser.add_argument(
        '--keep-keys', nargs='+', default=['state_dict', 'meta'],
        help='top-level keys to keep (default: state_dict meta)')
    parser.add_argument(
        '--unsafe-load', action='store_true',
        help='torch.load with weights_only=False (only for trusted files)')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if 'state_dict' not in args.keep_keys:
        print(f'error: --keep-keys must include state_dict, got '
              f'{args.keep_keys}', file=sys.stderr)
        return 1
    try:
        with sigterm_as_interrupt():
            final, sha, removed = publish_checkpoint(
                args.in_file, args.out_file, args.keep_keys,
                args.unsafe_load)
    except KeyboardInterrupt:
        print('error: interrupted\nnothing written', file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f'error: {e}\nnothing written', file=sys.stderr)
        return 1
    if removed:
        print(f'removed: {", ".join(removed)}')
    print(f'published {final} (sha256 {sha})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
