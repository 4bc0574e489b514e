"""mmengine 0.10.7 runner checkpoints resume under torch >= 2.6.

The checkpoint holds HistoryBuffer and numpy objects, which torch's default
``weights_only=True`` refuses unless kcla_mm declares them safe.
"""
import numpy as np
import torch
import torch.nn as nn
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch.utils.data import Dataset

import kcla_mm  # noqa: F401  (applies the fix on import)


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


def make_runner(work_dir, max_iters, resume=False):
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
        randomness=dict(seed=0),
        resume=resume,
        # mmengine keeps one visualizer and logger per experiment name (a
        # timestamp by default): two runners started in the same second
        # would share the first one's, writing into its (maybe removed)
        # work_dir
        experiment_name=f'{work_dir.parent.name}-{work_dir.name}-{max_iters}',
        default_scope='mmengine')


def test_checkpoint_is_loadable_with_weights_only(tmp_path):
    runner = make_runner(tmp_path, max_iters=2)
    runner.train()
    ckpt = torch.load(tmp_path / 'iter_2.pth', weights_only=True)
    hub = ckpt['message_hub']
    assert 'log_scalars' in hub
    assert isinstance(ckpt['meta']['seed'], (int, np.integer))


def test_runner_resumes_and_matches_uninterrupted_run(tmp_path):
    full = make_runner(tmp_path / 'full', max_iters=4)
    full.train()
    make_runner(tmp_path / 'part', max_iters=2).train()
    resumed = make_runner(tmp_path / 'part', max_iters=4, resume=True)
    resumed.train()
    assert resumed.iter == 4
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b)
