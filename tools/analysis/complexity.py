"""Parameters and FLOPs of ResNet with KCLA, MRLA-light and standard layer
attention (LA) vs the plain ResNet, and their scaling with depth.

FLOPs are counted by mmengine's jit-tracing FlopAnalyzer
(``mmengine.analysis``, fvcore's conventions: a FLOP is one multiply-add of
a conv/linear/einsum, BatchNorm costs 2 per element in eval mode (5 in
training), elementwise ops cost nothing). With --elementwise the tool also
counts 1 FLOP per output element of every elementwise op (add, mul, div,
ReLU, sigmoid, exp, ...) and 1 per input element of reductions (mean, sum,
norm).

KCLA's fused path and the tracer: the tracer cannot record the fused
kernels of ``kcla_mm._ext``, so a ``KCLALayer`` takes its PyTorch path
(the same math in plain ops) while ``torch.jit`` traces: the count of the
default model is that of ``kcla_impl='torch'`` (the fused ops are C++
autograd ops, of which a trace would keep only the empty outputs).

Section 1 (backbones): ResNet-{--depths} at --img-size, batch 1, eval mode,
for each layer attention and the plain ResNet (layer_attention=None): the
parameters (``mmengine.analysis.parameter_count``), FLOPs, and the extra
over plain. Section 2 (depth): a stack of --stack-depths layers
(--stack-channels channels at --stack-size, batch 1, like section (d) of
benchmark_kcla.py): FLOPs (linear in depth for KCLA and MRLA-light,
quadratic for LA), the state carried after the last layer (constant for
KCLA: U and Z; grows linearly for LA: every key and value) and the
activations saved for backward in training mode (linear for KCLA, quadratic
for LA: each layer stacks all earlier values), all layers on the PyTorch
path. Prints tables; writes OUT_DIR/complexity.json and
OUT_DIR/complexity_depth.png.

Example:
    .venv/bin/python tools/analysis/complexity.py --out-dir \
        work_dirs/complexity
    .venv/bin/python tools/analysis/complexity.py --depths 50 \
        --stack-depths 8 16 --elementwise
"""
import argparse
import logging
import os
import os.path as osp
import sys
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn

ATTENTIONS = ('KCLA', 'MRLA-light', 'LA')
STACK_KINDS = ('KCLA', 'LA', 'MRLA-light')
CONVENTION = (
    'mmengine FlopAnalyzer (fvcore): 1 FLOP = 1 multiply-add of conv/linear/'
    'einsum; BatchNorm 2 per element (eval), 5 (training); elementwise ops '
    '0')
CONVENTION_ELEMENTWISE = CONVENTION[:-len('elementwise ops 0')] + (
    'elementwise ops 1 per output element, reductions 1 per input element')

# ops counted by --elementwise (fvcore ignores them, or has no handle)
ELEMENTWISE_OPS = ('aten::add', 'aten::add_', 'aten::sub', 'aten::rsub',
                   'aten::mul', 'aten::mul_', 'aten::div', 'aten::div_',
                   'aten::relu', 'aten::relu_', 'aten::sigmoid', 'aten::exp',
                   'aten::clamp', 'aten::clamp_min', 'aten::softmax',
                   'aten::sqrt', 'aten::rsqrt')
REDUCTION_OPS = ('aten::mean', 'aten::sum', 'aten::linalg_vector_norm')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--depths', type=int, nargs='+', default=[50, 101],
                        help='ResNet depths of section 1 (18/34/50/101/152)')
    parser.add_argument('--attentions', nargs='+', default=list(ATTENTIONS),
                        choices=ATTENTIONS,
                        help='layer attentions compared with plain ResNet')
    parser.add_argument('--img-size', type=int, default=224)
    parser.add_argument('--stack-depths', type=int, nargs='+',
                        default=[8, 16, 32, 64],
                        help='section 2: number of layers in the stack')
    parser.add_argument('--stack-channels', type=int, default=256)
    parser.add_argument('--stack-size', type=int, default=14,
                        help='section 2: square feature-map side')
    parser.add_argument('--stack-head-dim', type=int, default=64,
                        help='section 2: head dim of KCLA and LA')
    parser.add_argument('--stack-mrla-head-dim', type=int, default=32,
                        help='section 2: head dim of MRLA-light')
    parser.add_argument('--elementwise', action='store_true',
                        help='also count elementwise ops and reductions')
    parser.add_argument('--out-dir', default='work_dirs/complexity')
    args = parser.parse_args(argv)
    bad = [d for d in args.depths if d not in (18, 34, 50, 101, 152)]
    if bad:
        parser.error(f'--depths must be among 18, 34, 50, 101, 152, got '
                     f'{bad}')
    if args.img_size < 32:
        parser.error(f'--img-size must be >= 32, got {args.img_size}')
    if any(d < 1 for d in args.stack_depths) or \
            sorted(set(args.stack_depths)) != args.stack_depths:
        parser.error('--stack-depths must be increasing ints >= 1, got '
                     f'{args.stack_depths}')
    if args.stack_size < 2:  # training-mode BN needs > 1 value (batch 1)
        parser.error(f'--stack-size must be >= 2, got {args.stack_size}')
    for name in ('stack_head_dim', 'stack_mrla_head_dim'):
        value = getattr(args, name)
        if value < 1 or args.stack_channels % value:
            parser.error(f'--{name.replace("_", "-")} ({value}) must divide '
                         f'--stack-channels ({args.stack_channels})')
    return args


def _shape(value) -> Optional[List[int]]:
    from mmengine.analysis.jit_handles import get_shape
    return get_shape(value)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _elementwise_handle(inputs, outputs) -> int:
    shape = _shape(outputs[0])
    return _numel(shape) if shape is not None else 0


def _reduction_handle(inputs, outputs) -> int:
    shape = _shape(inputs[0])
    return _numel(shape) if shape is not None else 0


def flop_analyzer(model: nn.Module, inputs: tuple,
                  elementwise: bool = False):
    """mmengine's FlopAnalyzer (with, if ``elementwise``, handles for
    elementwise ops and reductions)."""
    from mmengine.analysis import FlopAnalyzer
    analyzer = FlopAnalyzer(model, inputs)
    if elementwise:
        analyzer.set_op_handle(**{op: _elementwise_handle
                                  for op in ELEMENTWISE_OPS})
        analyzer.set_op_handle(**{op: _reduction_handle
                                  for op in REDUCTION_OPS})
    analyzer.unsupported_ops_warnings(False)
    analyzer.uncalled_modules_warnings(False)
    analyzer.tracer_warnings('none')
    return analyzer


def count_flops(model: nn.Module, inputs: tuple,
                elementwise: bool = False) -> Dict[str, object]:
    """Total FLOPs, per operator and per top-level module, and the traced
    ops without a handle. The model's mode (train/eval) is used as is."""
    analyzer = flop_analyzer(model, inputs, elementwise)
    total = analyzer.total()
    by_module = analyzer.by_module()
    return dict(
        total=int(total),
        by_operator={k: int(v) for k, v in analyzer.by_operator().items()},
        by_module={k: int(v) for k, v in by_module.items()
                   if k and '.' not in k},
        unsupported=dict(analyzer.unsupported_ops()))


def count_params(model: nn.Module) -> int:
    from mmengine.analysis import parameter_count
    return int(parameter_count(model)[''])


def build_resnet(depth: int, layer_attention: Optional[str],
                 **kwargs) -> nn.Module:
    """ResNetKCLA in eval mode, drop-path off."""
    from kcla_mm.models import ResNetKCLA
    return ResNetKCLA(depth, layer_attention=layer_attention,
                      kcla_drop_path=0.0, **kwargs).eval()


def backbone_rows(depths: Sequence[int], attentions: Sequence[str],
                  img_size: int = 224, elementwise: bool = False,
                  **kwargs) -> List[dict]:
    """Params and FLOPs of each depth, plain and with each attention."""
    rows = []
    x = torch.rand(1, 3, img_size, img_size)
    for depth in depths:
        plain = None
        for kind in (None, ) + tuple(attentions):
            torch.manual_seed(0)
            model = build_resnet(depth, kind, **kwargs)
            flops = count_flops(model, (x, ), elementwise)
            row = dict(depth=depth, layer_attention=kind or 'none',
                       params=count_params(model), flops=flops['total'],
                       attention_flops=sum(
                           v for k, v in flops['by_module'].items()
                           if k.endswith('_attn')),
                       by_operator=flops['by_operator'])
            if kind is None:
                plain = row
            row['extra_params'] = row['params'] - plain['params']
            row['extra_flops'] = row['flops'] - plain['flops']
            row['extra_flops_percent'] = 100.0 * row['extra_flops'] / \
                plain['flops']
            rows.append(row)
    return rows


class LayerStack(nn.Module):
    """``depth`` attention layers of one kind applied in sequence, each
    continuing the previous one's state (section (d) of benchmark_kcla.py;
    MRLA-light gets its input as X_in)."""

    def __init__(self, kind: str, depth: int, channels: int,
                 head_dim: int = 64) -> None:
        super().__init__()
        from kcla_mm.models.layers import (KCLALayer, LayerAttention,
                                           MRLALight)
        self.kind = kind
        if kind == 'KCLA':
            layers = [KCLALayer(channels, head_dim, drop_path=0.0,
                                impl='torch') for _ in range(depth)]
        elif kind == 'LA':
            layers = [LayerAttention(channels, head_dim, drop_path=0.0,
                                     reset_cache=i == 0)
                      for i in range(depth)]
        elif kind == 'MRLA-light':
            layers = [MRLALight(channels, head_dim, drop_path=0.0)
                      for _ in range(depth)]
        else:
            raise ValueError(f'LayerStack: kind must be one of '
                             f'{STACK_KINDS}, got {kind!r}')
        self.layers = nn.ModuleList(layers)
        self.final_state = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        for layer in self.layers:
            if self.kind == 'MRLA-light':
                x, _ = layer(x, None, x)
                state = x  # its context: one feature map
            else:
                x, state = layer(x, state)
        self.final_state = state
        return x


def state_bytes(state) -> int:
    """Bytes of the tensors a stack carries to the next layer."""
    if isinstance(state, torch.Tensor):
        tensors = [state]
    elif hasattr(state, 'values') and isinstance(state.values, list):
        tensors = state.keys + state.values  # LayerAttentionCache
    else:
        tensors = [t for t in state if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for
    backward during one forward of ``model`` on ``x``."""
    skip = {t.untyped_storage().data_ptr()
            for t in list(model.parameters()) + list(model.buffers())}
    storages: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(storages.values())


def stack_rows(depths: Sequence[int], channels: int = 256, size: int = 14,
               head_dim: int = 64, mrla_head_dim: int = 32,
               elementwise: bool = False,
               kinds: Sequence[str] = STACK_KINDS) -> List[dict]:
    """FLOPs (eval), state bytes and saved-activation bytes (training) of
    a stack of each depth and kind, batch 1 (head dim ``head_dim`` for KCLA
    and LA, ``mrla_head_dim`` for MRLA-light)."""
    rows = []
    x = torch.rand(1, channels, size, size)
    for depth in depths:
        for kind in kinds:
            torch.manual_seed(0)
            head = mrla_head_dim if kind == 'MRLA-light' else head_dim
            stack = LayerStack(kind, depth, channels, head).eval()
            flops = count_flops(stack, (x, ), elementwise)['total']
            stack.train()
            saved = saved_activation_bytes(stack, x.clone().requires_grad_())
            state = state_bytes(stack.final_state)
            stack.final_state = None
            rows.append(dict(depth=depth, kind=kind, flops=flops,
                             state_bytes=state, saved_bytes=saved))
    return rows


def print_tables(backbones: List[dict], stacks: List[dict],
                 img_size: int, convention: str) -> None:
    if backbones:
        print(f'(1) backbones at {img_size}x{img_size}, batch 1, eval; '
              f'{convention}')
        print(f'  {"model":<22}{"params":>12}{"+params":>10}'
              f'{"GFLOPs":>9}{"+MFLOPs":>10}{"+%":>7}{"attn MFLOPs":>13}')
        for r in backbones:
            name = f'ResNet-{r["depth"]} ' + ('' if r['layer_attention'] ==
                                               'none' else
                                               r['layer_attention'])
            print(f'  {name:<22}{r["params"]:>12,}{r["extra_params"]:>10,}'
                  f'{r["flops"] / 1e9:>9.3f}{r["extra_flops"] / 1e6:>10.1f}'
                  f'{r["extra_flops_percent"]:>7.2f}'
                  f'{r["attention_flops"] / 1e6:>13.1f}')
    if stacks:
        kinds = list(dict.fromkeys(r['kind'] for r in stacks))
        print('(2) a stack of layers, batch 1: MFLOPs (eval) / state KiB / '
              'saved-for-backward MiB (training)')
        print(f'  {"depth":>5} ' + ''.join(f'{k:>30}' for k in kinds))
        for depth in dict.fromkeys(r['depth'] for r in stacks):
            cells = []
            for kind in kinds:
                r = next(r for r in stacks
                         if r['depth'] == depth and r['kind'] == kind)
                cells.append(f'{r["flops"] / 1e6:>12.1f} /'
                             f'{r["state_bytes"] / 1024:>7.0f} /'
                             f'{r["saved_bytes"] / 2**20:>7.1f}')
            print(f'  {depth:>5} ' + ''.join(cells))


def plot_stacks(stacks: List[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    kinds = list(dict.fromkeys(r['kind'] for r in stacks))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, marker, size in zip(kinds, 'os^v', (9, 6, 4, 3)):
        rows = [r for r in stacks if r['kind'] == kind]
        depths = [r['depth'] for r in rows]
        axes[0].plot(depths, [r['flops'] / 1e6 for r in rows], f'{marker}-',
                     markersize=size, label=kind)
        line, = axes[1].plot(depths, [r['saved_bytes'] / 2**20 for r in rows],
                             f'{marker}-', markersize=size,
                             label=f'{kind}: saved for backward')
        axes[1].plot(depths, [r['state_bytes'] / 2**20 for r in rows],
                     f'{marker}--', markersize=size, color=line.get_color(),
                     label=f'{kind}: state')
    axes[0].set_ylabel('MFLOPs (forward)')
    axes[1].set_ylabel('MiB (log-log: slope 1 linear, 2 quadratic)')
    axes[1].set_xscale('log', base=2)
    axes[1].set_yscale('log')
    for ax in axes:
        ax.set_xlabel('layers in the stack')
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title('FLOPs: linear (KCLA, MRLA-light), quadratic (LA)',
                      fontsize=9)
    axes[1].set_title('memory: state and activations saved for backward',
                      fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    from mmengine.logging import MMLogger
    MMLogger.get_current_instance().setLevel(logging.WARNING)
    convention = CONVENTION_ELEMENTWISE if args.elementwise else CONVENTION
    try:
        backbones = backbone_rows(args.depths, args.attentions,
                                  args.img_size, args.elementwise)
        stacks = stack_rows(args.stack_depths, args.stack_channels,
                            args.stack_size, args.stack_head_dim,
                            args.stack_mrla_head_dim, args.elementwise)
    except (RuntimeError, ValueError) as e:
        sys.exit(f'error: {e}')
    print_tables(backbones, stacks, args.img_size, convention)
    os.makedirs(args.out_dir, exist_ok=True)
    title = (f'{args.stack_channels} channels at {args.stack_size}x'
             f'{args.stack_size}, batch 1')
    png = osp.join(args.out_dir, 'complexity_depth.png')
    plot_stacks(stacks, png, title)
    import json
    with open(osp.join(args.out_dir, 'complexity.json'), 'w') as f:
        json.dump(
            dict(convention=convention,
                 kcla_path='PyTorch path (KCLALayer uses it while torch.jit '
                 'traces)',
                 img_size=args.img_size,
                 backbones=backbones,
                 stack=dict(channels=args.stack_channels,
                            size=args.stack_size,
                            head_dim=args.stack_head_dim,
                            mrla_head_dim=args.stack_mrla_head_dim,
                            rows=stacks)), f, indent=1)
    print(f'wrote complexity.json and complexity_depth.png to '
          f'{args.out_dir}')


if __name__ == '__main__':
    main()
