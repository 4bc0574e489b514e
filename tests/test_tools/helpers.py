"""Shared pieces of the tests that drive mmdet's own tools."""
import hashlib
import importlib.util
import os
import os.path as osp
import stat
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DEMO_CONFIG = osp.join(ROOT, 'configs', 'demo',
                       'faster-rcnn_r18-kcla_fpn_synthetic-coco.py')
ANALYSIS = osp.join(ROOT, 'tools', 'analysis')


def load_tool(name, folder='analysis'):
    """tools/<folder>/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(
        f'{folder}_{name}', osp.join(ROOT, 'tools', folder, f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree_snapshot(root) -> dict:
    """Every entry under ``root``: mode and content (a file's hash, a link's
    target), without following links or opening FIFOs; equal snapshots
    mean nothing under ``root`` was added, removed or changed."""
    state = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = osp.join(d, name)
            st = os.lstat(path)
            content = None
            if stat.S_ISREG(st.st_mode):
                with open(path, 'rb') as f:
                    content = hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            state[osp.relpath(path, root)] = (st.st_mode, content)
    return state


def assert_demo_rejects(tool: str, option: str, value: str, tmp_path) -> None:
    """``tools/<tool>`` given ``option value`` (a count below one) stops
    with argparse's exit status 2 and a message naming the option, before
    it creates its work directory or data root."""
    result = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', tool), '--work-dir',
         str(tmp_path / 'work'), '--data-root', str(tmp_path / 'data'),
         option, value],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f'argument {option}: must be an int >= 1, got {value}' in \
        result.stderr
    assert not (tmp_path / 'work').exists()
    assert not (tmp_path / 'data').exists()


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


def mmseg_tool(name: str) -> str:
    """Path of mmseg's own tools/<name> in its wheel."""
    import mmseg
    return osp.join(osp.dirname(mmseg.__file__), '.mim', 'tools', name)


def make_synthetic_lesion_dataset(root, layout: str, counts: list,
                                  img_size: int = 64) -> str:
    """A synthetic raw download of ``layout`` converted by its converter.

    ``counts``: make_synthetic_lesions.py's size options, e.g.
    ``['--num', '10']``. Returns the mmseg-layout root, ending in '/'.
    """
    converters = osp.join(ROOT, 'tools', 'dataset_converters')
    raw, out = f'{root}/raw_{layout}', f'{root}/{layout}'
    subprocess.run([
        sys.executable, osp.join(converters, 'make_synthetic_lesions.py'), raw,
        '--layout', layout, '--img-size', str(img_size), *counts
    ], check=True, capture_output=True)
    converter = 'kvasir_seg.py' if layout == 'kvasir' else f'{layout}.py'
    subprocess.run(
        [sys.executable, osp.join(converters, converter), raw, out],
        check=True, capture_output=True)
    return out + '/'


def seg_short_run_options(root: str) -> list:
    """--cfg-options for a one-epoch run of a segmentation config on a small
    dataset at ``root``: data roots, 64x64 input, batch 2, no worker
    processes."""
    options = []
    for split in ('train', 'val', 'test'):
        loader = f'{split}_dataloader'
        options += [f'{loader}.dataset.data_root={root}',
                    f'{loader}.num_workers=0',
                    f'{loader}.persistent_workers=False']
    # 64x64 instead of the configs' 256x256 (the Resize steps' scale)
    options += ['model.data_preprocessor.size=(64,64)',
                'train_dataloader.dataset.pipeline.2.scale=(64,64)'] + [
        f'{split}_dataloader.dataset.pipeline.1.scale=(64,64)'
        for split in ('val', 'test')]
    return options + ['train_dataloader.batch_size=2',
                      'train_cfg.max_epochs=1', 'train_cfg.val_interval=1',
                      'default_hooks.checkpoint.interval=1',
                      'randomness.seed=0']
