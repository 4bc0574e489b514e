"""Train a kcla_mm config with mmdet's or mmseg's own tools/train.py.

usage: train.py CONFIG [options of the library's tools/train.py]

The library is the config's default_scope (mmdet for configs/detection/,
mmseg for configs/segmentation/); every option (--work-dir, --resume,
--amp, --cfg-options, --launcher) is that train.py's. ``mim train kcla_mm
CONFIG`` runs this script.
"""
from library_tools import run_library_tool

if __name__ == '__main__':
    run_library_tool('train.py', __doc__)
