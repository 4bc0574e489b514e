"""Training killed with SIGKILL after a checkpoint, resumed with ``--resume``
through mmdet's/mmseg's own tools/train.py, ends where an uninterrupted run
of the same config and seed ends: bit-identical parameters, optimizer state,
training losses after the resume point and validation metrics.

The configs are the demo detector and the demo segmentor, iteration-based
with mmengine's ``InfiniteSampler``, ``randomness=dict(seed=0,
deterministic=True)`` and no worker processes. mmengine's resume replays the
data stream exactly (re-seeded sampler, ``iter`` batches skipped, the
pipeline's numpy draws replayed by the skip) but not torch's global
generator, which Faster R-CNN's anchor/RoI samplers and the KCLA drop-path
draw from during the training step; without restoring it the resumed run
differs by ~1e-3. The demo configs (like every kcla_mm config) carry
kcla_mm's :class:`TorchRNGStateHook`, which checkpoints that generator; the
comparison itself is exact, with no tolerance. (The detector's COCO AP after
4 iterations from scratch is 0; its metrics comparison is a formality, the
segmentor's is not.)

mmengine 0.10.7 writes a checkpoint non-atomically (``torch.save`` into
memory, then ``open(final_name, 'wb').write``), and only then the
``last_checkpoint`` file naming it; so the kill waits for
``last_checkpoint``, not for the ``.pth`` file to appear.
"""
import glob
import json
import os
import os.path as osp
import signal
import subprocess
import sys
import time

import pytest
import torch

from kcla_mm.utils import allow_mmengine_checkpoints
from ..test_tools.helpers import (ROOT, data_options, make_synthetic_coco,
                                  make_synthetic_lesion_dataset, mmdet_tool,
                                  mmseg_tool)

MAX_ITERS = 4
INTERVAL = 2  # checkpoint interval; the kill follows the first one
# logged values that are not timings
TIMINGS = {'time', 'data_time', 'memory', 'eta'}


def detector_case(tmp_path):
    root = make_synthetic_coco(tmp_path / 'coco', num_train=12, num_val=4)
    options = data_options(root) + ['train_dataloader.batch_size=2']
    return (mmdet_tool('train.py'),
            osp.join(ROOT, 'configs', 'demo',
                     'faster-rcnn_r18-kcla_fpn_synthetic-coco.py'), options)


def segmentor_case(tmp_path):
    root = make_synthetic_lesion_dataset(
        tmp_path / 'lesions', 'isic2018',
        ['--num-train', '20', '--num-val', '0', '--num-test', '0'])
    options = [f'{split}_dataloader.dataset.data_root={root}'
               for split in ('train', 'val', 'test')]
    # 64x64 instead of the demo's 128x128 (the Resize steps' scale)
    options += ['model.data_preprocessor.size=(64,64)',
                'train_dataloader.dataset.pipeline.2.scale=(64,64)',
                'val_dataloader.dataset.pipeline.1.scale=(64,64)',
                'test_dataloader.dataset.pipeline.1.scale=(64,64)',
                'train_dataloader.batch_size=2']
    return (mmseg_tool('train.py'),
            osp.join(ROOT, 'configs', 'demo',
                     'res-unet_r18s-kcla_synthetic-isic2018.py'), options)


def train_command(tool, config, work_dir, options, resume=False):
    run_options = [
        f'train_cfg.max_iters={MAX_ITERS}',
        f'train_cfg.val_interval={MAX_ITERS}',
        f'default_hooks.checkpoint.interval={INTERVAL}',
        'default_hooks.checkpoint.max_keep_ckpts=-1',
        'default_hooks.logger.interval=1',
        'randomness.seed=0', 'randomness.deterministic=True',
        'train_dataloader.num_workers=0',
        'train_dataloader.persistent_workers=False'
    ]
    return [sys.executable, tool, config, '--work-dir', str(work_dir)] + (
        ['--resume'] if resume else []) + [
            '--cfg-options', *options, *run_options]


def environment():
    env = dict(os.environ)
    # one thread per run: the uninterrupted run trains alongside the other
    # two, and every run gets the same reduction order
    env.update(OMP_NUM_THREADS='1', MKL_NUM_THREADS='1')
    return env


def start(cmd, log):
    with open(log, 'w') as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, env=environment())


def finish(proc, log):
    try:
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, tail(log)


def tail(log, chars=3000):
    with open(log) as f:
        return f.read()[-chars:]


def complete_checkpoint(work_dir):
    """The checkpoint ``last_checkpoint`` names, or None. mmengine writes
    ``last_checkpoint`` after the checkpoint file itself is written."""
    pointer = work_dir / 'last_checkpoint'
    try:
        path = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    return path if path.endswith('.pth') and osp.isfile(path) else None


def run_and_kill_after_checkpoint(cmd, work_dir, log):
    """Start ``cmd``; SIGKILL it as soon as its first checkpoint is
    complete. Returns that checkpoint's path."""
    proc = start(cmd, log)
    deadline = time.monotonic() + 600
    try:
        while complete_checkpoint(work_dir) is None:
            assert proc.poll() is None, (
                'the run ended before its first checkpoint:\n' + tail(log))
            assert time.monotonic() < deadline, 'no checkpoint in 600 s'
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return complete_checkpoint(work_dir)


def logged_scalars(work_dir):
    """step -> logged values (no timings) of the newest run in work_dir,
    and its validation metrics."""
    # one <timestamp>/ folder per run; the names sort by time
    scalars = sorted(
        glob.glob(str(work_dir / '2*' / 'vis_data' / 'scalars.json')))[-1]
    train, metrics = {}, {}
    with open(scalars) as f:
        for line in f:
            entry = json.loads(line)
            values = {k: v for k, v in entry.items()
                      if k not in TIMINGS | {'step', 'iter'}}
            if 'iter' in entry:
                train[entry['iter']] = values
            else:
                metrics.update(values)
    return train, metrics


def load(path):
    # weights_only=True with mmengine's own types allowed, as the configs'
    # SafeLoadHook lets --resume load; a truncated file raises here
    with allow_mmengine_checkpoints():
        return torch.load(path, map_location='cpu', weights_only=True)


def assert_same_tensors(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for key in a:
        if isinstance(a[key], dict):
            assert_same_tensors(a[key], b[key], f'{what}.{key}')
        elif isinstance(a[key], torch.Tensor):
            diff = (a[key].double() - b[key].double()).abs().max().item()
            assert torch.equal(a[key], b[key]), \
                f'{what}.{key} differs by up to {diff:.3g}'
        else:
            assert a[key] == b[key], f'{what}.{key}: {a[key]} != {b[key]}'


def kill_check_and_resume(tool, config, work_dir, options, tmp_path):
    """Train in ``work_dir``, SIGKILL after the first checkpoint, check that
    checkpoint, resume to the end. Returns the iteration resumed from."""
    killed = run_and_kill_after_checkpoint(
        train_command(tool, config, work_dir, options), work_dir,
        tmp_path / 'b.log')
    # killed mid-run: the last complete checkpoint is an intermediate one
    # and it loads (not truncated), holding everything resume needs
    checkpoint = load(killed)
    step = checkpoint['meta']['iter']
    assert osp.basename(killed) == f'iter_{step}.pth'
    assert 0 < step < MAX_ITERS
    assert not (work_dir / f'iter_{MAX_ITERS}.pth').exists()
    assert {'state_dict', 'optimizer', 'param_schedulers', 'message_hub',
            'torch_rng_state'} <= set(checkpoint)

    log = tmp_path / 'c.log'
    finish(start(train_command(tool, config, work_dir, options, resume=True),
                 log), log)
    assert f'resumed epoch: 0, iter: {step}' in tail(log, 10**7)
    return step


@pytest.mark.slow
@pytest.mark.parametrize('case', [detector_case, segmentor_case],
                         ids=['faster-rcnn-r18-kcla', 'res-unet-r18s-kcla'])
def test_killed_and_resumed_run_equals_uninterrupted_run(case, tmp_path):
    tool, config, options = case(tmp_path)
    full, part = tmp_path / 'full', tmp_path / 'part'

    # the uninterrupted run trains alongside the killed and resumed ones
    uninterrupted = start(train_command(tool, config, full, options),
                          tmp_path / 'a.log')
    try:
        step = kill_check_and_resume(tool, config, part, options, tmp_path)
    except BaseException:
        uninterrupted.kill()
        uninterrupted.wait()
        raise
    finish(uninterrupted, tmp_path / 'a.log')

    final_full = load(full / f'iter_{MAX_ITERS}.pth')
    final_resumed = load(part / f'iter_{MAX_ITERS}.pth')
    assert final_resumed['meta']['iter'] == MAX_ITERS
    assert_same_tensors(final_full['state_dict'],
                        final_resumed['state_dict'], 'state_dict')
    assert_same_tensors(final_full['optimizer'], final_resumed['optimizer'],
                        'optimizer')

    full_train, full_metrics = logged_scalars(full)
    resumed_train, resumed_metrics = logged_scalars(part)
    assert sorted(resumed_train) == list(range(step + 1, MAX_ITERS + 1))
    for i in resumed_train:
        assert resumed_train[i] == full_train[i], f'iteration {i}'
    assert full_metrics and resumed_metrics == full_metrics
