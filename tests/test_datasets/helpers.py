"""Shared pieces of the dataset tests: the converters' folder on sys.path,
sizes of the synthetic downloads."""
import os
import os.path as osp
import sys
from typing import Dict

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
sys.path.insert(0, osp.join(ROOT, 'tools', 'dataset_converters'))

IMG_SIZE = 48
COUNTS = {
    'isic2017': {'train': 6, 'val': 3, 'test': 4},
    'isic2018': {'train': 10, 'val': 2, 'test': 3},
    'kvasir': {'all': 10},
}


def files_of(root: str) -> Dict[str, bytes]:
    """Relative path (with '/') -> bytes of every file under ``root``."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = osp.join(d, n)
            with open(path, 'rb') as f:
                out[osp.relpath(path, root).replace(os.sep, '/')] = f.read()
    return out
