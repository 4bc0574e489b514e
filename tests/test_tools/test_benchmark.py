"""tools/analysis/benchmark_kcla.py runs; its depth table shows KCLA's
constant state and standard layer attention's growing cache (sizes only:
no timing is asserted)."""
import subprocess
import sys

from .helpers import ROOT


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
