"""Benchmark KCLA against plain ResNet and its own reference path.

Prints, for one run on this machine, side by side and as ratios:
  (a) ResNet-50-KCLA vs mmdet ResNet-50: training step (forward + backward,
      batch 4, 224x224) and inference (eval, no grad);
  (b) activation memory of a training step: the distinct storages autograd
      keeps for backward after one forward (batch 8), parameters excluded;
  (c) the fused KCLA layer vs its PyTorch reference path, forward +
      backward of one layer at each ResNet-50 stage size (batch 4);
  (d) time and state memory of a stack of 8/16/32/64 layers for KCLA,
      standard layer attention and MRLA-light.
Times are medians of --runs runs after --warmup runs, with torch's thread
count pinned to --threads.

Example:
    .venv/bin/python tools/analysis/benchmark_kcla.py --threads 2
"""
import argparse
import statistics
import time
from typing import Callable, Dict

import torch
import torch.nn as nn

from kcla_mm.models import ResNetKCLA
from kcla_mm.models.layers import KCLALayer, LayerAttention, MRLALight

STAGES_R50 = ((256, 56), (512, 28), (1024, 14), (2048, 7))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--sections', default='abcd',
                        help='which sections to run, e.g. "ab"')
    parser.add_argument('--device', default='cpu')
    return parser.parse_args(argv)


def median_time(fn: Callable[[], None], runs: int, warmup: int,
                device: str) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device.startswith('cuda'):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith('cuda'):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages saved for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    storages: Dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = model(x)
    del outs
    return sum(storages.values())


def build_pair(device):
    """mmdet's ResNet-50 and ResNet-50-KCLA, training mode (BN updating)."""
    from mmdet.models.backbones import ResNet
    torch.manual_seed(0)
    plain = ResNet(50, norm_eval=False).to(device)
    kcla = ResNetKCLA(50, norm_eval=False).to(device)
    return plain, kcla


def row(name, base, ours, unit, fmt='{:.1f}'):
    print(f'  {name:<34} {fmt.format(base):>12} {fmt.format(ours):>12} '
          f'{unit:<4} {ours / base:>6.2f}x')


def section_a(args):
    print('(a) ResNet-50 vs ResNet-50-KCLA, batch 4 at 224x224'
          f'{"":>8}{"ResNet-50":>12} {"R50-KCLA":>12}      ratio')
    plain, kcla = build_pair(args.device)
    x = torch.rand(4, 3, 224, 224, device=args.device)

    def train_step(model):
        def step():
            model.train()
            outs = model(x)
            sum(o.mean() for o in outs).backward()
            model.zero_grad(set_to_none=True)
        return step

    def infer(model):
        def step():
            model.eval()
            with torch.no_grad():
                model(x)
        return step

    for name, make in (('training step (fwd+bwd)', train_step),
                       ('inference (eval, no grad)', infer)):
        t_plain = median_time(make(plain), args.runs, args.warmup,
                              args.device)
        t_kcla = median_time(make(kcla), args.runs, args.warmup, args.device)
        row(name, t_plain * 1e3, t_kcla * 1e3, 'ms')


def section_b(args):
    print('(b) activation memory of a training step, batch 8 at 224x224')
    plain, kcla = build_pair(args.device)
    x = torch.rand(8, 3, 224, 224, device=args.device)
    plain.train()
    kcla.train()
    row('saved for backward', saved_activation_bytes(plain, x) / 2**20,
        saved_activation_bytes(kcla, x) / 2**20, 'MiB')


def layer_step(layer, x, backward=True):
    def step():
        out, state = layer(x)
        if backward:
            out.sum().backward()
    return step


def section_c(args):
    print('(c) one KCLA layer, forward + backward, batch 4'
          f'{"":>13}{"PyTorch":>12} {"fused":>12}      ratio')
    for channels, size in STAGES_R50:
        x = torch.rand(4, channels, size, size, device=args.device,
                       requires_grad=True)
        times = {}
        for impl in ('torch', 'fused'):
            torch.manual_seed(0)
            layer = KCLALayer(channels, impl=impl).to(args.device).train()
            times[impl] = median_time(layer_step(layer, x), args.runs,
                                      args.warmup, args.device)
        row(f'{channels} channels at {size}x{size}', times['torch'] * 1e3,
            times['fused'] * 1e3, 'ms')


def section_d(args):
    print('(d) a stack of layers (256 channels at 14x14, batch 4, '
          'forward, no grad)')
    print(f'  {"depth":>5} ' + ''.join(
        f'{k + " ms":>14}{k + " state KiB":>18}'
        for k in ('KCLA', 'LA', 'MRLA')))
    x = torch.rand(4, 256, 14, 14, device=args.device)
    for depth in (8, 16, 32, 64):
        cells = []
        for kind in ('KCLA', 'LA', 'MRLA'):
            if kind == 'KCLA':
                layers = [KCLALayer(256) for _ in range(depth)]
            elif kind == 'LA':
                layers = [LayerAttention(256, reset_cache=(i == 0))
                          for i in range(depth)]
            else:
                layers = [MRLALight(256) for _ in range(depth)]
            layers = [m.to(args.device).eval() for m in layers]
            sizes = []

            def run():
                state = None
                out = x
                with torch.no_grad():
                    for layer in layers:
                        if kind == 'MRLA':
                            out, _ = layer(out, None, out)
                            state = out  # its context: one feature map
                        else:
                            out, state = layer(out, state)
                sizes.append(sum(t.numel() * t.element_size()
                                 for t in _state_tensors(state)))

            t = median_time(run, args.runs, args.warmup, args.device)
            cells.append(f'{t * 1e3:>14.1f}{sizes[-1] / 1024:>18.0f}')
        print(f'  {depth:>5} ' + ''.join(cells))


def _state_tensors(state):
    if isinstance(state, torch.Tensor):
        return [state]
    if hasattr(state, 'keys') and hasattr(state, 'values') and \
            isinstance(state.keys, list):
        return state.keys + state.values
    return [t for t in state if isinstance(t, torch.Tensor)]  # (u, z)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from kcla_mm.ops import ext_device_types
    print(f'torch {torch.__version__}, device {args.device}, threads '
          f'{torch.get_num_threads()} (pinned), median of {args.runs} runs '
          f'after {args.warmup} warm-up; kcla_mm._ext devices: '
          f'{list(ext_device_types())}')
    for key, fn in (('a', section_a), ('b', section_b), ('c', section_c),
                    ('d', section_d)):
        if key in args.sections:
            fn(args)


if __name__ == '__main__':
    main()
