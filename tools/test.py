"""Test a kcla_mm checkpoint with mmdet's or mmseg's own tools/test.py.

usage: test.py CONFIG CHECKPOINT [options of the library's tools/test.py]

The library is the config's default_scope (mmdet for configs/detection/,
mmseg for configs/segmentation/); every option (--work-dir, --show-dir,
--cfg-options, --launcher) is that test.py's. ``mim test kcla_mm CONFIG
--checkpoint CHECKPOINT`` runs this script.
"""
from library_tools import run_library_tool

if __name__ == '__main__':
    run_library_tool('test.py', __doc__)
