"""The extension's C++ sources compile as C++17.

torch before 2.12 builds extensions with -std=c++17 (later ones with
-std=c++20), and runtime.txt allows torch>=2.1: this torch's headers still
compile as C++17, so a syntax-only pass over the CPU build's sources with
-std=c++17 keeps C++20-only code out (a call with explicit template
arguments to an undeclared name once broke the build on torch 2.11).
"""
import glob
import os
import os.path as osp
import subprocess
import sysconfig

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CSRC = osp.join(ROOT, 'kcla_mm', 'ops', 'csrc')
# setup.py's CPU sources
SOURCES = sorted(
    glob.glob(osp.join(CSRC, 'pytorch', '*.cpp')) +
    glob.glob(osp.join(CSRC, 'pytorch', 'cpu', '*.cpp')))


@pytest.mark.slow
def test_cpu_sources_compile_as_cpp17():
    assert len(SOURCES) == 10
    includes = [osp.join(CSRC, 'common')] + include_paths() + [
        sysconfig.get_paths()['include']
    ]
    command = [os.environ.get('CXX', 'c++'), '-std=c++17', '-fsyntax-only',
               '-fopenmp', '-DTORCH_API_INCLUDE_EXTENSION_H',
               '-DTORCH_EXTENSION_NAME=_ext'] + [f'-I{d}' for d in includes]
    jobs = [(src, subprocess.Popen(command + [src],
                                   stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT,
                                   text=True)) for src in SOURCES]
    failed = {}
    for src, job in jobs:
        out, _ = job.communicate(timeout=600)
        if job.returncode != 0:
            failed[osp.relpath(src, ROOT)] = out[-2000:]
    assert failed == {}
