"""Shared pieces of the tests that drive mmdet's own tools."""
import os.path as osp
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DEMO_CONFIG = osp.join(ROOT, 'configs', 'demo',
                       'faster-rcnn_r18-kcla_fpn_synthetic-coco.py')


def make_synthetic_coco(root, num_train: int, num_val: int) -> str:
    """Generate the synthetic COCO dataset under ``root``; returns 'root/'."""
    subprocess.run([
        sys.executable,
        osp.join(ROOT, 'tools', 'dataset_converters',
                 'make_synthetic_coco.py'), str(root), '--num-train',
        str(num_train), '--num-val', str(num_val)
    ], check=True, capture_output=True)
    return f'{root}/'


def mmdet_tool(name: str) -> str:
    """Path of mmdet's own tools/<name> in its wheel."""
    import mmdet
    return osp.join(osp.dirname(mmdet.__file__), '.mim', 'tools', name)


def data_options(root: str) -> list:
    """--cfg-options pointing every dataset and evaluator at ``root``."""
    ann = root + 'annotations/instances_val2017.json'
    return [f'{split}_dataloader.dataset.data_root={root}'
            for split in ('train', 'val', 'test')] + [
                f'val_evaluator.ann_file={ann}',
                f'test_evaluator.ann_file={ann}'
            ]
