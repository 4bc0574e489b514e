"""Benchmark KCLA against plain ResNet and its own reference path.

Prints, for one run on this machine, side by side and as ratios:
  (a) ResNet-50-KCLA vs mmdet ResNet-50: training step (forward + backward,
      batch 4 (--batch), 224x224 (--size H W, e.g. 800 1216 for a
      detector's input), float32 or under autocast (--amp: float16 on
      CUDA, bfloat16 on the CPU)) and inference (eval, no grad), each with
      both sides' minor page faults per call;
  (b) activation memory of a training step: the distinct storages one
      forward (batch 8) leaves alive for backward, saved by autograd or
      kept by KCLA's state tapes, parameters excluded, and the peak during
      that forward;
  (c) the fused op vs its PyTorch reference: one layer's feature-map work
      (the block's shortcut add and final ReLU, GAP, state update, normalisation, depthwise
      3x3, gate, BN with batch statistics, ReLU, drop-path, add), forward
      + backward at each ResNet-50 stage size (batch 4);
  (d) time and state memory of a stack of 8/16/32/64 layers for KCLA,
      standard layer attention and MRLA-light;
  (e) ExternalAttention vs mmcv's NonLocal2d (embedded Gaussian), one
      module at 256 channels, batch 1, at --ea-sizes (32 to 128 square):
      forward + backward time, attention-map size, peak memory of the step
      and activation memory saved for backward, with a PNG plot at
      --ea-plot;
  (f) dispatch counts of ResNet-50-KCLA vs the plain ResNet-50 (batch 2,
      96x96), one training step and one inference forward, on --device's
      route: aten ops (views and metadata-only ops left out), calls into
      kcla_mm._ext and host synchronisations (``_local_scalar_dense``,
      copies to the host);
      eager GPU training of small per-layer ops is launch-bound, so these
      counts predict the GPU ratio, and they do not depend on the machine.
Times are medians of --runs runs after --warmup runs, with torch's thread
count pinned to --threads; the two sides of a ratio are timed interleaved.

Example:
    .venv/bin/python tools/analysis/benchmark_kcla.py --threads 2
    .venv/bin/python tools/analysis/benchmark_kcla.py --sections e \
        --runs 3 --warmup 1 --ea-plot work_dirs/benchmark/ea.png
"""
import argparse
import os
import os.path as osp
import resource
import statistics
import time
from types import BuiltinFunctionType
from typing import Callable, Dict, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kcla_mm.models import ResNetKCLA
from kcla_mm.models.layers import (ExternalAttention, KCLALayer,
                                   LayerAttention, MRLALight)
from kcla_mm.ops import kcla_state_update_reference
from kcla_mm.ops.kcla_branch import GradHandoff, kcla_branch, relu_pool

STAGES_R50 = ((256, 56), (512, 28), (1024, 14), (2048, 7))
SECTIONS = 'abcdef'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--runs', type=int, default=9)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--sections', default=SECTIONS,
                        help='which sections to run, e.g. "ab"')
    parser.add_argument('--device', default='cpu')
    parser.add_argument(
        '--baseline', choices=('mmdet', 'resnetkcla'), default='mmdet',
        help="(a), (b): the plain ResNet-50: mmdet's, or ResNetKCLA with "
        "layer_attention=None (the same network, tested equal to mmdet's; "
        'for machines whose mmcv has no ops, which mmdet.models needs)')
    parser.add_argument('--batch', type=int, default=4,
                        help='(a): batch size')
    parser.add_argument('--size', type=int, nargs=2, default=[224, 224],
                        metavar=('H', 'W'), help='(a): input height, width')
    parser.add_argument(
        '--amp', action='store_true',
        help='(a): both networks under autocast (float16 on CUDA, '
        'bfloat16 on the CPU), as mmdet\'s AmpOptimWrapper runs them')
    parser.add_argument('--ea-sizes', type=int, nargs='+',
                        default=[32, 64, 96, 128],
                        help='(e): square feature-map sizes')
    parser.add_argument('--ea-plot',
                        default='work_dirs/benchmark/ea_vs_nonlocal.png',
                        help='(e): where to write the PNG plot')
    args = parser.parse_args(argv)
    for name, least in (('threads', 1), ('runs', 1), ('warmup', 0),
                        ('batch', 1)):
        if getattr(args, name) < least:
            parser.error(f'argument --{name}: must be an int >= {least}, '
                         f'got {getattr(args, name)}')
    if min(args.size) < 32:  # ResNet-50's stride: 1x1 at stage 4
        parser.error('argument --size: height and width must be >= 32, '
                     f'got {args.size}')
    if not args.sections or set(args.sections) - set(SECTIONS):
        parser.error(f'argument --sections: letters of "{SECTIONS}", got '
                     f'{args.sections!r}')
    if min(args.ea_sizes) < 2:  # (e)'s BNs train on batch 1: > 1 value
        parser.error('argument --ea-sizes: sizes must be >= 2, got '
                     f'{args.ea_sizes}')
    return args


def _timed(fn: Callable[[], None], device: str) -> float:
    if device.startswith('cuda'):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith('cuda'):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median_times(fns: Sequence[Callable[[], None]], runs: int, warmup: int,
                 device: str) -> list:
    """Median seconds of each of ``fns``, timed interleaved (one run of each
    per round), so that drifting machine load shifts all of them alike and
    their ratios stay comparable."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(runs):
        for fn, ts in zip(fns, times):
            ts.append(_timed(fn, device))
    return [statistics.median(ts) for ts in times]


def median_time(fn: Callable[[], None], runs: int, warmup: int,
                device: str) -> float:
    return median_times([fn], runs, warmup, device)[0]


def minor_faults() -> int:
    """Minor page faults of this process so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def counting_faults(fn: Callable[[], None],
                    counts: list) -> Callable[[], None]:
    """``fn``, appending the minor page faults of each call to ``counts``
    (on the CPU, glibc's heap trimming hands memory back to the system and
    the next step faults it in again; see docs/benchmarks.md)."""
    def counted():
        before = minor_faults()
        fn()
        counts.append(minor_faults() - before)
    return counted


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


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensor storages created by ops inside the mode.

    Counts every op's outputs (backward ops included) while they are alive,
    on any device; storages that existed before entering are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[int, tuple] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.live:
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
                    self.current += self.live[ref.cdata][1]
        self.peak = max(self.peak, self.current)
        return out


def forward_memory(model: nn.Module, x: torch.Tensor) -> Tuple[int, int]:
    """(held, peak) bytes of a forward of ``model``: the tensors it leaves
    alive (its outputs, and what their graph holds for backward: saved by
    autograd or kept by the layers themselves, as KCLA's state tapes), and
    the most alive at once during it."""
    with PeakMemory() as tracker:
        outs = model(x)
    held = sum(nbytes for ref, nbytes in tracker.live.values()
               if not ref.expired())
    del outs
    return held, tracker.peak


def peak_bytes(fn: Callable[[], None]) -> int:
    """Peak bytes of the tensors ``fn`` creates (see PeakMemory)."""
    with PeakMemory() as tracker:
        fn()
    return tracker.peak


def to_host(t: torch.Tensor, kwargs: dict) -> bool:
    """Whether a ``_to_copy`` of ``t`` is a copy to the host: from another
    device, or to the CPU unchanged (``.to('cpu', copy=True)``, a
    device-to-host transfer where ``t`` is on a GPU)."""
    if kwargs.get('device') != torch.device('cpu'):
        return False
    return t.device.type != 'cpu' or kwargs.get('dtype', t.dtype) == t.dtype


# views and metadata-only ops: no kernel launch on any device
VIEW_OPS = frozenset(('view', '_unsafe_view', 'reshape', 'expand',
                      'transpose', 't', 'permute', 'slice', 'select',
                      'squeeze', 'unsqueeze', 'detach', 'alias',
                      'as_strided'))


class DispatchCount(TorchDispatchMode):
    """Counts, inside the mode: aten ops other than views and ``empty*``
    (:attr:`ops`), host synchronisations (:attr:`syncs`: the
    ``_local_scalar_dense`` of ``.item()`` or ``bool(tensor)``, and copies
    to the host, counted on the CPU too, where they stand for a GPU's) and
    Python calls into ``kcla_mm._ext`` (:attr:`ext_calls`; the aten ops the
    extension dispatches are in :attr:`ops`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = self.ext_calls = 0
        self._patched: Dict[str, Callable] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.syncs += name == '_local_scalar_dense' or (
            name == '_to_copy' and to_host(args[0], kwargs or {}))
        if name not in VIEW_OPS and not name.startswith('empty'):
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from kcla_mm.ops import get_ext
        ext = get_ext()
        for name in dir(ext) if ext is not None else ():
            fn = getattr(ext, name)
            if isinstance(fn, BuiltinFunctionType) and \
                    not name.startswith('_'):
                self._patched[name] = fn
                setattr(ext, name, self._counting(fn))
        self._ext = ext
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._patched.items():
            setattr(self._ext, name, fn)
        self._patched.clear()
        return super().__exit__(*exc)

    def _counting(self, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.ext_calls += 1
            return fn(*args, **kwargs)
        return counted


def dispatch_counts(model: nn.Module, x: torch.Tensor,
                    training: bool) -> DispatchCount:
    """Counts of one training step (forward + backward of the outputs'
    mean sum) or one no-grad eval forward, after one uncounted warm-up."""
    def step():
        model.train(training)
        with torch.set_grad_enabled(training):
            outs = model(x)
            if training:
                sum(o.mean() for o in outs).backward()
        model.zero_grad(set_to_none=True)

    step()
    with DispatchCount() as counts:
        step()
    return counts


def build_pair(device, baseline='mmdet'):
    """A plain ResNet-50 (see --baseline) and ResNet-50-KCLA, with BN
    updating in training mode."""
    torch.manual_seed(0)
    if baseline == 'mmdet':
        from mmdet.models.backbones import ResNet
        plain = ResNet(50, norm_eval=False)
    else:
        plain = ResNetKCLA(50, layer_attention=None, norm_eval=False)
    plain = plain.to(device)
    kcla = ResNetKCLA(50, norm_eval=False).to(device)
    return plain, kcla


def row(name, base, ours, unit, fmt='{:.1f}'):
    print(f'  {name:<34} {fmt.format(base):>12} {fmt.format(ours):>12} '
          f'{unit:<4} {ours / base:>6.2f}x')


def section_a(args):
    h, w = args.size
    device_type = torch.device(args.device).type
    amp_dtype = torch.float16 if device_type == 'cuda' else torch.bfloat16
    precision = f', autocast {str(amp_dtype)[6:]}' if args.amp else ''
    print(f'(a) ResNet-50 ({args.baseline}) vs ResNet-50-KCLA, batch '
          f'{args.batch} at {h}x{w}{precision}'
          f'{"":>8}{"ResNet-50":>12} {"R50-KCLA":>12}      ratio')
    plain, kcla = build_pair(args.device, args.baseline)
    x = torch.rand(args.batch, 3, h, w, device=args.device)

    def forward(model):
        with torch.autocast(device_type, amp_dtype, enabled=args.amp):
            return model(x)

    def train_step(model):
        def step():
            model.train()
            outs = forward(model)
            sum(o.float().mean() for o in outs).backward()
            model.zero_grad(set_to_none=True)
        return step

    def infer(model):
        def step():
            model.eval()
            with torch.no_grad():
                forward(model)
        return step

    for name, make in (('training step (fwd+bwd)', train_step),
                       ('inference (eval, no grad)', infer)):
        faults = ([], [])
        t_plain, t_kcla = median_times(
            [counting_faults(make(plain), faults[0]),
             counting_faults(make(kcla), faults[1])], args.runs, args.warmup,
            args.device)
        row(name, t_plain * 1e3, t_kcla * 1e3, 'ms')
        f_plain, f_kcla = (statistics.median(f[args.warmup:]) for f in faults)
        print(f'  {"  minor page faults per call":<34} {f_plain:>12.0f} '
              f'{f_kcla:>12.0f}')


def section_b(args):
    print(f'(b) activation memory of a training step, batch 8 at 224x224, '
          f'ResNet-50 ({args.baseline}) vs ResNet-50-KCLA')
    plain, kcla = build_pair(args.device, args.baseline)
    x = torch.rand(8, 3, 224, 224, device=args.device)
    plain.train()
    kcla.train()
    (plain_held, plain_peak), (held, peak) = (
        forward_memory(m, x) for m in (plain, kcla))
    row('held for backward', plain_held / 2**20, held / 2**20, 'MiB')
    row('peak during the forward', plain_peak / 2**20, peak / 2**20, 'MiB')


def branch_case(channels: int, size: int, device: str, batch: int = 4):
    """Inputs of one layer's feature-map work at a stage size: the block's
    residual branch and shortcut, the incoming state, per-head scalars, a
    training BN."""
    torch.manual_seed(0)
    g = channels // 64
    s = torch.randn(batch, channels, size, size, device=device,
                    requires_grad=True)
    r = torch.rand(batch, channels, size, size, device=device,
                   requires_grad=True)
    u = torch.rand(batch, channels, size, size, device=device) * 3
    w = (torch.rand(batch, g, device=device) + 0.5).requires_grad_()
    z = (w.detach() + 2).requires_grad_()
    gate = torch.rand(batch, g, device=device).requires_grad_()
    weight = (torch.randn(channels, 1, 3, 3, device=device) /
              3).requires_grad_()
    keep = torch.tensor([1.25, 1.25, 0.0, 1.25][:batch], device=device)
    norm = nn.BatchNorm2d(channels).to(device).train()
    return s, r, u, w, z, gate, weight, keep, norm


def branch_reference(s, r, u, w, z, gate, weight, keep, norm, eps=1e-3):
    """The same maths with PyTorch ops, as KCLALayer's reference path runs
    it: shortcut add, ReLU, GAP, state update, DWConv, gate, BN, ReLU,
    drop-path, add."""
    b, c, h, wd = s.shape
    g = w.shape[1]
    x = F.relu(s + r)
    pooled = x.mean((2, 3))
    u_next, agg = kcla_state_update_reference(x, u, w, z, eps)
    o = F.conv2d(agg, weight, padding=1, groups=c)
    o = (o.view(b, g, c // g, h, wd) * gate.view(b, g, 1, 1, 1)).view_as(o)
    y = F.relu(norm(o)) * keep.view(b, 1, 1, 1)
    return x + y, u_next, pooled


def branch_fused(s, r, u, w, z, gate, weight, keep, norm, eps=1e-3):
    """The fused op as KCLALayer runs it: relu_pool, then the branch
    written over its output, whose backward hands its gradient of x to
    relu_pool's backward to overwrite."""
    handoff = GradHandoff()
    x, pooled = relu_pool(s, r, handoff)
    out, u_next = kcla_branch(x, u, w, z, gate, weight, norm, keep, eps,
                              out_in_place=True, x_handoff=handoff)
    return out, u_next, pooled


def branch_step(fn, case):
    s, *rest = case

    def step():
        outs = fn(s * 1.0, *rest)  # a fresh non-leaf input, as a block's
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return step


def section_c(args):
    print('(c) the fused op vs its PyTorch reference: shortcut add + ReLU + '
          'GAP + steps 4-8 of one layer, forward + backward, batch 4, BN '
          'training')
    print(f'  {"stage size":<34} {"PyTorch":>12} {"fused":>12}      '
          f'ratio (PyTorch / fused)')
    for channels, size in STAGES_R50:
        case = branch_case(channels, size, args.device)
        t_ref, t_fused = median_times(
            [branch_step(branch_reference, case),
             branch_step(branch_fused, case)], args.runs, args.warmup,
            args.device)
        print(f'  {f"{channels} channels at {size}x{size}":<34} '
              f'{t_ref * 1e3:>12.2f} {t_fused * 1e3:>12.2f} ms  '
              f'{t_ref / t_fused:>6.2f}x faster')


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


EA_CHANNELS = 256


def build_ea_nonlocal(device: str):
    """ExternalAttention (64 slots, 1 head, BN) and NonLocal2d (embedded
    Gaussian, reduction 2, BN), both at 256 channels, training mode."""
    from mmcv.cnn import NonLocal2d
    torch.manual_seed(0)
    ea = ExternalAttention(EA_CHANNELS).to(device).train()
    nonlocal_block = NonLocal2d(
        EA_CHANNELS,
        reduction=2,
        use_scale=True,
        norm_cfg=dict(type='BN'),
        mode='embedded_gaussian').to(device).train()
    return ea, nonlocal_block


def module_step(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step():
        module(x).sum().backward()
        module.zero_grad(set_to_none=True)
        x.grad = None
    return step


def section_e(args) -> None:
    print('(e) ExternalAttention (64 slots) vs NonLocal2d (embedded '
          f'Gaussian), {EA_CHANNELS} channels, batch 1, forward + backward')
    print(f'  {"size":>7} {"N":>6} |{"EA ms":>9}{"NL ms":>10}{"NL/EA":>7} |'
          f'{"EA map":>8}{"NL map":>9} |{"EA peak":>9}{"NL peak":>9}'
          f'{"NL/EA":>7} |{"EA saved":>9}{"NL saved":>9}{"NL/EA":>7}')
    print(f'  {"":>7} {"":>6} |{"":>26} |{"KiB":>8}{"KiB":>9} |'
          f'{"MiB":>9}{"MiB":>9}{"":>7} |{"MiB":>9}{"MiB":>9}')
    ea, nonlocal_block = build_ea_nonlocal(args.device)
    results = []
    for size in args.ea_sizes:
        n = size * size
        x = torch.rand(1, EA_CHANNELS, size, size, device=args.device,
                       requires_grad=True)
        r = dict(n=n)
        for key, module in (('ea', ea), ('nl', nonlocal_block)):
            step = module_step(module, x)
            r[f'{key}_ms'] = median_time(step, args.runs, args.warmup,
                                         args.device) * 1e3
            r[f'{key}_peak'] = peak_bytes(step) / 2**20
            r[f'{key}_saved'] = saved_activation_bytes(module, x) / 2**20
        with torch.no_grad():
            r['ea_map'] = ea.attention_map(x).numel() * 4 // 1024
        r['nl_map'] = n * n * 4 // 1024  # (B, N, N) float32 pairwise weight
        print(f'  {f"{size}x{size}":>7} {n:>6} |{r["ea_ms"]:>9.1f}'
              f'{r["nl_ms"]:>10.1f}{r["nl_ms"] / r["ea_ms"]:>7.1f} |'
              f'{r["ea_map"]:>8}{r["nl_map"]:>9} |{r["ea_peak"]:>9.1f}'
              f'{r["nl_peak"]:>9.1f}{r["nl_peak"] / r["ea_peak"]:>7.1f} |'
              f'{r["ea_saved"]:>9.1f}{r["nl_saved"]:>9.1f}'
              f'{r["nl_saved"] / r["ea_saved"]:>7.1f}')
        results.append(r)
    plot_section_e(results, args.ea_plot)
    print(f'  plot: {args.ea_plot}')


def plot_section_e(results: Sequence[dict], path: str) -> None:
    """Time and peak memory against N, log-log, EA vs NonLocal2d."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    n = [r['n'] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], 'ms', 'forward + backward (ms)'),
                           (axes[1], 'peak', 'peak memory (MiB)')):
        for module, name in (('ea', 'ExternalAttention'),
                             ('nl', 'NonLocal2d')):
            ax.plot(n, [r[f'{module}_{key}'] for r in results], 'o-',
                    label=name)
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('positions N = H x W')
        ax.set_ylabel(label)
        ax.grid(True, which='both', alpha=0.3)
        ax.legend()
    fig.suptitle(f'{EA_CHANNELS} channels, batch 1, threads '
                 f'{torch.get_num_threads()}')
    fig.tight_layout()
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section_f(args) -> None:
    print(f'(f) dispatch counts on {args.device}, ResNet-50 ({args.baseline})'
          ' vs ResNet-50-KCLA, batch 2 at 96x96'
          f'{"":>4}{"ResNet-50":>12} {"R50-KCLA":>12}      ratio')
    plain, kcla = build_pair(args.device, args.baseline)
    x = torch.rand(2, 3, 96, 96, device=args.device)
    for name, training in (('training step', True), ('inference', False)):
        base, ours = (dispatch_counts(m, x, training) for m in (plain, kcla))
        row(f'{name}: aten ops', base.ops, ours.ops, '', '{:.0f}')
        print(f'  {"  calls into kcla_mm._ext":<34} {base.ext_calls:>12} '
              f'{ours.ext_calls:>12}')
        row('  ops + calls', base.ops + base.ext_calls,
            ours.ops + ours.ext_calls, '', '{:.0f}')
        print(f'  {"  host synchronisations":<34} {base.syncs:>12} '
              f'{ours.syncs:>12}')


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
    from kcla_mm.ops import get_ext
    isa = get_ext().cpu_isa() if get_ext() is not None else 'none'
    print(f'torch {torch.__version__}, device {args.device}, threads '
          f'{torch.get_num_threads()} (pinned), median of {args.runs} runs '
          f'after {args.warmup} warm-up; kcla_mm._ext devices: '
          f'{list(ext_device_types("branch"))}, CPU kernels: {isa}')
    for key, fn in zip(SECTIONS, (section_a, section_b, section_c,
                                  section_d, section_e, section_f)):
        if key in args.sections:
            fn(args)


if __name__ == '__main__':
    main()
