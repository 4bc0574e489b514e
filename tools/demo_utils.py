"""Helpers shared by the demos (``demo.py``, ``seg_demo.py``)."""
import argparse
import glob
import os
import os.path as osp
import subprocess
import sys
import tempfile

# the folder that holds configs/ and tools/: the repository, or kcla_mm/.mim
# where kcla_mm is installed from a wheel; data and work directories are
# relative to the current directory instead
ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def require_at_least(parser: argparse.ArgumentParser,
                     args: argparse.Namespace, **least: int) -> None:
    """``parser.error`` (exit status 2) naming the option if any of
    ``least``'s options is below its least value (None: not given)."""
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f'argument --{name.replace("_", "-")}: must be an '
                         f'int >= {low}, got {value}')


def make_work_dir(path: str) -> str:
    """The absolute ``path``, made if missing and checked writable; exits
    with an ``error:`` line naming ``--work-dir`` otherwise (a file, a
    folder under a file, no permission)."""
    path = osp.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        sys.exit(f'error: --work-dir {path}: {e.strerror or e}')
    return path


def run(cmd: list) -> None:
    """Run ``cmd``; exit if it fails."""
    print('\n$ ' + ' '.join(cmd), flush=True)
    result = subprocess.run(cmd)
    if result.returncode != 0:
        sys.exit(f'error: {osp.basename(cmd[1])} failed with exit code '
                 f'{result.returncode}')


def latest(pattern: str) -> str:
    """The newest file matching ``pattern``; exits if there is none."""
    paths = sorted(glob.glob(pattern), key=osp.getmtime)
    if not paths:
        sys.exit(f'error: nothing matches {pattern}')
    return paths[-1]
