"""Start a ResNetKCLA checkpoint from plain ResNet weights.

No KCLA ImageNet weights have been published (docs/method.md §5), so a
ResNetKCLA usually starts from a plain ResNet: torchvision's files
(``conv1.weight``, ``bn1.*``, ``layer1.0.conv1.weight`` ..., ``fc.*``), or
an mmdet / mmseg / mmpretrain checkpoint (the same names under
``backbone.``; ``module.`` is stripped too). The tool builds ResNetKCLA,
runs its initialisation (the layer-attention modules get docs/method.md's init,
seeded by ``--seed``), loads the ResNet weights over it and reports exactly
which keys were loaded, which are new (listed by module) and which were not
used (``fc.*``, necks and heads). The full state dict is written atomically
as ``{'state_dict', 'meta'}``.

A checkpoint of another depth or architecture (backbone keys the model
lacks, ResNet keys the checkpoint lacks, shape mismatches) fails with exit
code 1, names the keys and writes nothing.

Example:
    python tools/model_converters/resnet_to_kcla.py \\
        resnet50-0676ba61.pth checkpoints/resnet50-kcla_init.pth --depth 50
"""
import argparse
import os.path as osp
import sys

import torch
from mmengine.logging import MMLogger

from kcla_mm import ResNetKCLA, __version__
from kcla_mm.models.backbones.resnet_kcla import LAYER_ATTENTIONS
from kcla_mm.utils.checkpoint import (CheckpointMismatchError,
                                      check_output_file, format_keys,
                                      format_mismatch, get_state_dict,
                                      group_by_module, load_checkpoint_file,
                                      merge_resnet_state_dict,
                                      save_checkpoint_atomic, split_backbone)
from kcla_mm.utils.cli import sigterm_as_interrupt


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('src', help='plain ResNet checkpoint')
    parser.add_argument('dst', help='output checkpoint for ResNetKCLA')
    parser.add_argument(
        '--depth', type=int, required=True,
        choices=sorted(ResNetKCLA.arch_settings), help='ResNet depth')
    parser.add_argument(
        '--layer-attention', default='KCLA', choices=LAYER_ATTENTIONS,
        help='layer attention of the ResNetKCLA (default KCLA)')
    parser.add_argument(
        '--head-dim', type=int, default=None,
        help="channels per head (default: ResNetKCLA's for the attention)")
    parser.add_argument(
        '--seed', type=int, default=0,
        help='seed of the new layers\' initialisation (default 0)')
    parser.add_argument(
        '--max-list', type=int, default=10,
        help='keys listed per category (default 10)')
    parser.add_argument(
        '--unsafe-load', action='store_true',
        help='torch.load with weights_only=False (only for trusted files)')
    args = parser.parse_args(argv)
    for option, value, low in (('--head-dim', args.head_dim, 1),
                               ('--seed', args.seed, 0),
                               ('--max-list', args.max_list, 1)):
        if value is not None and value < low:
            parser.error(f'argument {option}: must be an int >= {low}, got '
                         f'{value}')
    return args


def convert(src: str, dst: str, depth: int, layer_attention: str = 'KCLA',
            head_dim=None, seed: int = 0, max_list: int = 10,
            unsafe_load: bool = False) -> dict:
    """Merge the ResNet weights of ``src`` into an initialised ResNetKCLA
    and save it to ``dst``; returns the summary.

    Raises:
        ValueError: unreadable source or (as
            :class:`CheckpointMismatchError`) mismatched keys. Nothing is
            written then.
    """
    check_output_file(dst, src)
    checkpoint = load_checkpoint_file(src, unsafe_load)
    state_dict, other = split_backbone(get_state_dict(checkpoint))
    model = ResNetKCLA(
        depth=depth, layer_attention=layer_attention, head_dim=head_dim)
    attn_prefixes = tuple(f'{name}.' for name in model.attn_layers)

    def is_new(key):
        return key.startswith(attn_prefixes)

    try:  # check names and shapes before the (slow) initialisation
        merge_resnet_state_dict(state_dict, model.state_dict(), is_new)
    except CheckpointMismatchError as e:
        hint = ''
        if any('.layers.' in k or '.attention.' in k
               for k in e.report.unexpected):
            hint = ("\n  (this looks like the KCLA authors' format: use "
                    'tools/model_converters/kcla_official_to_mm.py)')
        raise CheckpointMismatchError(
            f'{src} does not match ResNetKCLA(depth={depth}):\n' +
            format_mismatch(e.report, max_list) + hint, e.report) from None
    torch.manual_seed(seed)
    model.init_weights()
    merged, report = merge_resnet_state_dict(state_dict, model.state_dict(),
                                             is_new)
    report.unused = other + report.unused
    new_modules = list(group_by_module(report.new))
    meta = dict(
        converter='tools/model_converters/resnet_to_kcla.py',
        kcla_mm_version=__version__,
        source=osp.basename(src),
        depth=depth,
        layer_attention=layer_attention,
        head_dim=head_dim,
        seed=seed,
        num_loaded=len(report.loaded),
        new_modules=new_modules)
    sha = save_checkpoint_atomic(dict(state_dict=merged, meta=meta), dst)
    new_params = sum(merged[k].numel() for k in report.new
                     if merged[k].is_floating_point()
                     and 'running_' not in k)
    return dict(report=report, sha256=sha, dst=osp.abspath(dst),
                new_modules=new_modules, new_params=new_params)


def main(argv=None) -> int:
    args = parse_args(argv)
    # mmengine logs every parameter's initialiser at INFO; keep the report
    # readable
    MMLogger.get_instance('resnet_to_kcla', log_level='WARNING')
    try:
        with sigterm_as_interrupt():
            result = convert(args.src, args.dst, args.depth,
                             args.layer_attention, args.head_dim, args.seed,
                             args.max_list, args.unsafe_load)
    except KeyboardInterrupt:
        print(f'error: interrupted\nnothing written to {args.dst}',
              file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f'error: {e}\nnothing written to {args.dst}', file=sys.stderr)
        return 1
    report = result['report']
    print(f'loaded: {len(report.loaded)} tensors (stem and residual '
          'blocks)')
    groups = group_by_module(report.new)
    print(f'new: {len(report.new)} tensors in {len(groups)} '
          f'{args.layer_attention} modules ({result["new_params"] / 1e6:.3f}M'
          f' parameters, seed {args.seed}):')
    for module, names in groups.items():
        children = list(dict.fromkeys(n.rsplit('.', 1)[0] for n in names))
        print(f'  {module} ({len(names)} tensors): {", ".join(children)}')
    if report.unused:
        print(f'unused: {len(report.unused)} tensors\n'
              f'{format_keys(report.unused, args.max_list, "  ")}')
    if report.filled:
        print(f'kept at 0: {len(report.filled)} BN num_batches_tracked '
              'counters absent from the source')
    print(f'saved {result["dst"]} (sha256 {result["sha256"][:8]})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
