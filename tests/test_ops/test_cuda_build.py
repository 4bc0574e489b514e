"""kcla_mm._ext compiles and links with CUDA here, without a GPU.

Runs tools/check_cuda_build.sh: a separate virtualenv with torch 2.14.1 (a
CUDA 13.0 build) and the machine's nvcc build the extension out of tree
with FORCE_CUDA=1 and check it defines the CUDA launchers, then compile the
CUDA sources as C++17 against torch 2.11.0's headers. Slow (minutes);
skipped only where no nvcc exists. Also checks what can be checked here of
tools/gpu_check.sh, the GPU machine's build, tests and benchmark.
"""
import os
import os.path as osp
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CUDA_HOME = os.environ.get('CUDA_HOME', '/usr/local/cuda')


@pytest.mark.slow
@pytest.mark.skipif(
    not osp.exists(osp.join(CUDA_HOME, 'bin', 'nvcc'))
    and shutil.which('nvcc') is None,
    reason='no CUDA toolkit (nvcc) on this machine')
def test_extension_builds_with_cuda(tmp_path):
    result = subprocess.run(
        ['bash', osp.join(ROOT, 'tools', 'check_cuda_build.sh')],
        cwd=ROOT,
        env=dict(os.environ, KCLA_CUDA_BUILD_DIR=str(tmp_path / 'build')),
        capture_output=True,
        text=True,
        timeout=40 * 60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[
        -3000:]
    assert '[cuda-check] ok:' in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason='a GPU is visible')
def test_gpu_check_refuses_without_a_gpu_and_names_existing_tests(tmp_path):
    script = osp.join(ROOT, 'tools', 'gpu_check.sh')
    with open(script) as f:
        named = re.findall(r'tests/\S+\.py', f.read())
    assert len(named) == 8
    assert [p for p in named if not osp.isfile(osp.join(ROOT, p))] == []
    logs = tmp_path / 'logs'
    result = subprocess.run(['bash', script, str(logs)],
                            cwd=ROOT,
                            env=dict(os.environ, PYTHON=sys.executable),
                            capture_output=True,
                            text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert 'has no torch that sees a CUDA GPU' in result.stderr
    assert not logs.exists()  # refused before building anything
