"""tools/dist_train.sh: 2 CPU processes (gloo) train one identical model
(the demo's ResNet-18-KCLA Faster R-CNN, with the KCLAFPN neck)."""
import os
import os.path as osp
import socket
import subprocess
import sys

import pytest
import torch

from .helpers import DEMO_CONFIG, ROOT, make_synthetic_coco

# A hook, imported by the test config, that writes every rank's parameters.
HOOK = '''
import os
import torch
from mmengine.hooks import Hook
from mmdet.registry import HOOKS


@HOOKS.register_module()
class SaveRankParametersHook(Hook):
    def before_train(self, runner):
        self.initial = self.params(runner)

    def params(self, runner):
        model = getattr(runner.model, 'module', runner.model)
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    def after_train(self, runner):
        wrapper = runner.model
        torch.save(dict(
            world_size=runner.world_size,
            wrapper=type(wrapper).__name__,
            find_unused_parameters=getattr(
                wrapper, 'find_unused_parameters', None),
            initial=self.initial,
            params=self.params(runner)),
            os.path.join(runner.work_dir, f'params_rank{runner.rank}.pth'))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_cpu_ranks_end_with_identical_parameters(tmp_path):
    root = make_synthetic_coco(tmp_path / 'data', 16, 4)
    (tmp_path / 'rank_params_hook.py').write_text(HOOK)
    config = tmp_path / 'dist_config.py'
    config.write_text(f'''
_base_ = {DEMO_CONFIG!r}
custom_imports = dict(imports=['kcla_mm', 'rank_params_hook'],
                      allow_failed_imports=False)
custom_hooks = [dict(type='SaveRankParametersHook')]
model = dict(neck=dict(type='KCLAFPN', head_dim=16))
train_cfg = dict(max_iters=4, val_interval=4)
train_dataloader = dict(batch_size=2, dataset=dict(data_root={root!r}))
val_dataloader = dict(dataset=dict(data_root={root!r}))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file={root + 'annotations/instances_val2017.json'!r})
test_evaluator = val_evaluator
''')
    work_dir = tmp_path / 'work'
    env = dict(os.environ, PYTHON=sys.executable, PORT=str(free_port()),
               PYTHONPATH=str(tmp_path), CUDA_VISIBLE_DEVICES='')
    result = subprocess.run(
        ['bash', osp.join(ROOT, 'tools', 'dist_train.sh'), str(config), '2',
         '--work-dir', str(work_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[
        -3000:]
    ranks = [torch.load(work_dir / f'params_rank{r}.pth', weights_only=False)
             for r in range(2)]
    for r in ranks:
        assert r['world_size'] == 2
        assert r['wrapper'] == 'MMDistributedDataParallel'
        assert r['find_unused_parameters'] is False
    first, second = ranks[0]['params'], ranks[1]['params']
    assert first.keys() == second.keys()
    assert any('layer1_attn' in k for k in first)
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0,
                                   msg=name)
    # the ranks trained: the backbone's parameters (KCLA's too) moved
    initial = ranks[0]['initial']
    moved = [k for k in first if not torch.equal(first[k], initial[k])]
    assert 'backbone.layer4_attn.1.v_conv.weight' in moved
    assert 'neck.level_attentions.4.v_conv.weight' in moved
    assert len(moved) > 0.9 * len(first), (len(moved), len(first))
    assert (work_dir / 'iter_4.pth').is_file()
