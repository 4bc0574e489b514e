"""mmengine 0.10.7 runner checkpoints resume under torch >= 2.6 with
SafeLoadHook, with ``weights_only=True``.

The checkpoint holds HistoryBuffer and numpy objects, which torch's default
``weights_only=True`` refuses; they load inside
``allow_mmengine_checkpoints()`` (which SafeLoadHook wraps around the
runner's ``load_checkpoint``) and nowhere else.
"""
import pickle

import numpy as np
import pytest
import torch
import torch.nn as nn
from mmengine.logging import HistoryBuffer
from mmengine.model import BaseModel
from mmengine.runner import Runner, load_checkpoint
from torch.utils.data import Dataset

from kcla_mm.engine import SafeLoadHook
from kcla_mm.utils import allow_mmengine_checkpoints


class LinearRegression(BaseModel):

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, inputs, targets, mode='tensor'):
        pred = self.linear(inputs)
        if mode == 'loss':
            return dict(loss=((pred - targets)**2).mean())
        return pred


class RandomRegression(Dataset):

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 4, generator=gen)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return dict(inputs=self.x[i], targets=self.y[i])


def make_runner(work_dir, max_iters, resume=False, safe_load=True):
    # the model is built before the runner seeds torch: seed it here, so
    # every runner starts from the same weights whatever ran before
    torch.manual_seed(0)
    return Runner(
        model=LinearRegression(),
        work_dir=str(work_dir),
        train_dataloader=dict(
            dataset=RandomRegression(),
            sampler=dict(type='DefaultSampler', shuffle=True),
            batch_size=4,
            num_workers=0,
            collate_fn=dict(type='default_collate')),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01, momentum=0.9)),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        default_hooks=dict(
            checkpoint=dict(type='CheckpointHook', interval=2,
                            by_epoch=False),
            logger=dict(type='LoggerHook', interval=1)),
        custom_hooks=[SafeLoadHook()] if safe_load else None,
        randomness=dict(seed=0),
        resume=resume,
        # mmengine keeps one visualizer and logger per experiment name (a
        # timestamp by default): two runners started in the same second
        # would share the first one's, writing into its (maybe removed)
        # work_dir
        experiment_name=f'{work_dir.parent.name}-{work_dir.name}-{max_iters}',
        default_scope='mmengine')


def test_checkpoint_loads_with_weights_only_inside_the_block_only(tmp_path):
    runner = make_runner(tmp_path, max_iters=2)
    runner.train()
    path = tmp_path / 'iter_2.pth'
    with pytest.raises(pickle.UnpicklingError, match='HistoryBuffer'):
        torch.load(path, weights_only=True)
    with allow_mmengine_checkpoints():
        ckpt = torch.load(path, weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match='HistoryBuffer'):
        torch.load(path, weights_only=True)
    loss = ckpt['message_hub']['log_scalars']['train/loss']
    assert type(loss) is HistoryBuffer  # mmengine's class, not the check's
    assert 'load_checkpoint' in vars(runner)  # the hook's wrapper
    live = runner.message_hub.get_scalar('train/loss')
    np.testing.assert_array_equal(loss.data[0], live.data[0])
    assert loss.mean() == live.mean() and loss.current() == live.current()
    assert isinstance(ckpt['meta']['seed'], (int, np.integer))
    # mmengine's load_checkpoint (init_detector's, the inferencers') too
    model = LinearRegression()
    with pytest.raises(pickle.UnpicklingError, match='HistoryBuffer'):
        load_checkpoint(model, str(path))
    with allow_mmengine_checkpoints():
        load_checkpoint(model, str(path))
    torch.testing.assert_close(model.linear.weight,
                               ckpt['state_dict']['linear.weight'])


def test_runner_without_the_hook_cannot_resume(tmp_path):
    """Why the configs list SafeLoadHook: mmengine's Runner loads with
    torch's default and refuses its own checkpoint."""
    make_runner(tmp_path, max_iters=2).train()
    resumed = make_runner(tmp_path, max_iters=4, resume=True,
                          safe_load=False)
    with pytest.raises(pickle.UnpicklingError, match='HistoryBuffer'):
        resumed.train()


def test_hook_wraps_only_its_runner_and_only_once(tmp_path):
    original = Runner.load_checkpoint
    runner = make_runner(tmp_path, max_iters=2)
    hook = SafeLoadHook()
    hook.before_run(runner)
    wrapped = runner.load_checkpoint
    hook.before_run(runner)  # train() then test(): one wrapper
    assert runner.load_checkpoint is wrapped
    assert Runner.load_checkpoint is original
    other = make_runner(tmp_path / 'other', max_iters=2, safe_load=False)
    assert 'load_checkpoint' not in vars(other)


def test_runner_resumes_and_matches_uninterrupted_run(tmp_path):
    full = make_runner(tmp_path / 'full', max_iters=4)
    full.train()
    make_runner(tmp_path / 'part', max_iters=2).train()
    resumed = make_runner(tmp_path / 'part', max_iters=4, resume=True)
    resumed.train()
    assert resumed.iter == 4
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b)
