"""tools/analysis/benchmark_kcla.py runs; its depth table shows KCLA's
constant state and standard layer attention's growing cache (sizes only:
no timing is asserted)."""
import subprocess
import sys

import pytest

from .helpers import ROOT, load_tool


def test_depth_section_state_sizes():
    result = subprocess.run(
        [sys.executable, 'tools/analysis/benchmark_kcla.py', '--sections',
         'd', '--runs', '1', '--warmup', '0'],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in ('8', '16', '32', '64')]
    assert [int(r[0]) for r in rows] == [8, 16, 32, 64]
    kcla_state = [float(r[2]) for r in rows]
    la_state = [float(r[4]) for r in rows]
    # KCLA: U (4 x 256 x 14 x 14 float32) + Z, whatever the depth
    assert kcla_state == [kcla_state[0]] * 4
    assert 784 <= kcla_state[0] < 785
    # LA: one key and one value per layer
    assert [s / la_state[0] for s in la_state] == [1, 2, 4, 8]


def test_external_attention_section_memory_scaling(tmp_path):
    """(e): ExternalAttention's attention map and saved activations grow
    linearly in N = H * W, NonLocal2d's map quadratically (sizes only)."""
    plot = tmp_path / 'ea.png'
    result = subprocess.run(
        [sys.executable, 'tools/analysis/benchmark_kcla.py', '--sections',
         'e', '--runs', '1', '--warmup', '0', '--ea-sizes', '16', '32', '64',
         '--ea-plot', str(plot)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        cells = line.replace('|', ' ').split()
        if cells and cells[0] in ('16x16', '32x32', '64x64'):
            rows[int(cells[1])] = [float(c) for c in cells[2:]]
    assert sorted(rows) == [256, 1024, 4096]
    # columns: EA ms, NL ms, NL/EA, EA map KiB, NL map KiB, EA peak,
    # NL peak, NL/EA, EA saved, NL saved, NL/EA
    for n, r in rows.items():
        assert r[3] == 64 * n * 4 / 1024  # (1, 1 head, 64 slots, N) float32
        assert r[4] == n * n * 4 / 1024  # (1, N, N) float32
    ea_saved = [rows[n][8] for n in (256, 1024, 4096)]
    nl_saved = [rows[n][9] for n in (256, 1024, 4096)]
    assert 3.8 < ea_saved[2] / ea_saved[1] < 4.2  # x4 positions: x4
    assert nl_saved[2] / nl_saved[1] > 8  # dominated by the N x N map
    assert rows[4096][6] > 4 * rows[4096][5]  # peak: NonLocal2d >> EA
    assert plot.stat().st_size > 0


def test_fused_op_section_times_the_same_maths():
    """(c) compares like with like: the fused op and its PyTorch reference,
    as the benchmark runs them, give the same outputs, gradients and BN
    running statistics."""
    import copy

    import torch
    bench = load_tool('benchmark_kcla')
    case = bench.branch_case(128, 5, 'cpu')
    results = []
    for fn in (bench.branch_reference, bench.branch_fused):
        s, r, u, w, z, gate, weight, keep, norm = copy.deepcopy(case)
        leaves = (s, r, w, z, gate, weight, norm.weight, norm.bias)
        outs = fn(s * 1.0, r, u, w, z, gate, weight, keep, norm)
        seeds = [torch.linspace(-1, 1, t.numel()).view_as(t) for t in outs]
        torch.autograd.backward(outs, seeds)
        results.append([t.detach() for t in outs] +
                       [t.grad for t in leaves] +
                       [norm.running_mean, norm.running_var])
    assert len(results[0]) == 13
    for ref, fused in zip(*results):
        torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('options, header', [
    ([], 'batch 1 at 224x224'),
    (['--size', '64', '96', '--amp'], 'batch 1 at 64x96, autocast bfloat16'),
])
def test_network_section_prints_times_and_page_faults(options, header):
    """(a) runs both networks (at --size, under autocast with --amp) and
    prints, for training and inference, the two medians and their ratio,
    then each side's minor page faults per call (numbers only: no timing
    is asserted)."""
    result = subprocess.run(
        [sys.executable, 'tools/analysis/benchmark_kcla.py', '--sections',
         'a', '--runs', '1', '--warmup', '0', '--batch', '1'] + options,
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert header in lines[1]
    for name in ('training step (fwd+bwd)', 'inference (eval, no grad)'):
        at = next(i for i, line in enumerate(lines) if name in line)
        plain_ms, kcla_ms, unit, ratio = lines[at].split()[-4:]
        assert unit == 'ms' and float(plain_ms) > 0 and float(kcla_ms) > 0
        # the ratio of the unrounded times: within rounding of the printed
        assert abs(float(ratio[:-1]) -
                   float(kcla_ms) / float(plain_ms)) < 0.01
        faults = lines[at + 1].split()
        assert faults[:5] == ['minor', 'page', 'faults', 'per', 'call']
        assert all(int(f) >= 0 for f in faults[5:]) and len(faults) == 7


@pytest.mark.parametrize('argv, message', [
    (['--sections', 'xyz'], '--sections: letters of "abcdef", got \'xyz\''),
    (['--sections', ''], '--sections: letters of "abcdef", got \'\''),
    (['--runs', '0'], '--runs: must be an int >= 1, got 0'),
    (['--threads', '0'], '--threads: must be an int >= 1, got 0'),
    (['--warmup', '-1'], '--warmup: must be an int >= 0, got -1'),
    (['--batch', '0'], '--batch: must be an int >= 1, got 0'),
    (['--ea-sizes', '32', '1'], '--ea-sizes: sizes must be >= 2, got [32, 1]'),
    (['--size', '16', '64'], '--size: height and width must be >= 32, got '
     '[16, 64]'),
])
def test_bad_arguments_name_the_option(argv, message, capsys):
    """A bad option value stops the tool before any section runs (argparse
    exit status 2), with a message naming the option and the value."""
    bench = load_tool('benchmark_kcla')
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert bench.parse_args([]).sections == 'abcdef'


def test_dispatch_count_counts_ops_syncs_and_extension_calls():
    """(f)'s counter on known work: an add and a sum count, a view does
    not, ``float()`` of a tensor is one op and one host synchronisation,
    so is a copy to the host (a dtype conversion on the CPU is an op
    only), and each call into the extension counts once; the extension's
    functions are its own again afterwards."""
    import torch

    from kcla_mm.ops import get_ext
    bench = load_tool('benchmark_kcla')
    x = torch.rand(3)
    ext = get_ext()
    original = ext.device_types
    with bench.DispatchCount() as counts:
        y = (x + 1).view(3, 1)
        float(y.sum())
        ext.device_types('state')
    assert (counts.ops, counts.syncs, counts.ext_calls) == (3, 1, 1)
    with bench.DispatchCount() as counts:
        x.to('cpu', copy=True)
        x.to(torch.zeros(1, dtype=torch.float64))
    assert (counts.ops, counts.syncs) == (3, 1)
    assert ext.device_types is original


def test_dispatch_counts_bound_the_layer_attention_route():
    """(f) on this machine's route, batch 2 at 96x96: the plain ResNet-50
    calls no extension and never synchronises; ResNet-50-KCLA's inference
    never synchronises and dispatches at most 1.3x the plain network's ops
    + extension calls; its training step at most 1.5x, with one
    synchronisation (the state tapes' growth checks, read together). Bounds,
    so that the route cannot silently grow."""
    import torch
    bench = load_tool('benchmark_kcla')
    plain, kcla = bench.build_pair('cpu')
    x = torch.rand(2, 3, 96, 96)
    for training, ratio, syncs in ((False, 1.3, 0), (True, 1.5, 1)):
        base = bench.dispatch_counts(plain, x, training)
        ours = bench.dispatch_counts(kcla, x, training)
        assert (base.syncs, base.ext_calls) == (0, 0)
        assert ours.ext_calls > 0
        assert ours.syncs == syncs
        assert ours.ops + ours.ext_calls <= ratio * base.ops
