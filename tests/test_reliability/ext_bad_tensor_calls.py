"""Calls every raw entry of ``kcla_mm._ext`` with valid CPU tensors, then
with all of them on the meta device (a device the extension has no kernel
for, as CUDA on a CPU-only build), one of them on meta, one of them of the
wrong dtype, all float16 and all int64.

Run by test_op_devices.py in a subprocess, so that a crash (a kernel
reading a pointer it must not) fails that test instead of killing pytest.
Prints one JSON line before each call (``state: calling``, flushed: a crash
names the call) and one with its outcome.
"""
import importlib.machinery
import importlib.util
import json
import os.path as osp
import sys

import torch

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


def load_ext():
    """kcla_mm._ext from its file in the checkout, without importing kcla_mm
    (and mmdet, mmseg with it): only the compiled entries are under test.
    Elsewhere (an installed kcla_mm), through kcla_mm."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = osp.join(ROOT, 'kcla_mm', '_ext' + suffix)
        if osp.isfile(path):
            spec = importlib.util.spec_from_file_location('kcla_mm._ext',
                                                          path)
            ext = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(ext)
            return ext
    from kcla_mm.ops import load_ext as load_installed
    return load_installed()


EXT = load_ext()

B, C, H, W, G = 2, 4, 3, 3, 2
EPS = 1e-3


def tensors():
    f = dict(dtype=torch.float32)
    m = lambda: torch.rand(B, C, H, W, **f)  # noqa: E731
    hd = lambda: torch.rand(B, G, **f) + 0.5  # noqa: E731
    ch = lambda: torch.rand(C, **f) + 0.5  # noqa: E731
    pl = lambda *k: torch.rand(B, C, *k, **f)  # noqa: E731
    return dict(
        x=m(), s=m(), u=m(), u_next=m(), u_prev=m(), agg=m(), out=m(),
        grad_u_next=m(), grad_agg=m(), grad_x=m(), grad_u=m(), grad_out=m(),
        grad_s=m(), residual=m(), w=hd(), z=hd() + 1, gate=hd() / 2, grad_w=hd(),
        grad_z=hd(), weight=torch.rand(C, 1, 3, 3, **f), scale=ch(),
        shift=ch(), mean=ch(), alpha=ch(), beta=ch(), keep=torch.ones(B, **f),
        pooled=pl(), grad_pooled=pl(), stats=pl(2), bn_sums=pl(2),
        head_sums=pl(3), weight_sums=pl(9),
        mask=torch.zeros(B, C, (H * W + 7) // 8, dtype=torch.uint8),
        q_kernel=torch.rand(3, **f),
        k_kernel=torch.rand(3, **f), norm_d=torch.rand(G, **f) + 0.5,
        gate_weight=torch.rand(G, G, **f), z_next=hd(), w_out=hd(),
        gate_out=hd(), pooled_in=torch.rand(B, C, **f),
        grad_pooled_out=torch.rand(B, C, **f), grad_gate=hd(),
        grad_q_kernel=torch.rand(3, **f), grad_k_kernel=torch.rand(3, **f),
        grad_gate_weight=torch.rand(G, G, **f), bn_weight=ch(),
        bn_bias=ch(), running_mean=ch(), running_var=ch(), invstd=ch(),
        grad_weight=torch.rand(C, 1, 3, 3, **f), grad_bn_weight=ch(),
        grad_bn_bias=ch())


ENTRIES = {
    'kcla_state_forward': 'x u w z u_next agg',
    'kcla_state_backward': 'grad_u_next grad_agg x w z agg grad_x grad_u '
                           'grad_w grad_z',
    'kcla_relu_pool_forward': 's residual mask pooled',
    'kcla_relu_pool_backward': 'grad_x grad_pooled mask grad_s',
    'kcla_branch_stats': 'x u w z gate weight u_next stats',
    'kcla_branch_forward': 'x u w z gate weight scale shift keep u_next out '
                           'mask',
    'kcla_branch_apply': 'x u_next z gate weight scale shift keep out mask',
    'kcla_branch_bn_sums': 'grad_out u_next z gate weight keep mask mean '
                           'bn_sums',
    'kcla_branch_backward': 'grad_out grad_u_next out u_next w z gate weight '
                            'scale shift keep mask alpha beta mean grad_x '
                            'grad_u u_prev bn_sums head_sums weight_sums',
    'kcla_branch_train_forward': 'x u w z gate weight bn_weight bn_bias '
                                 'running_mean running_var keep u_next out '
                                 'mask mean invstd scale shift',
    'kcla_branch_train_backward': 'grad_out grad_u_next out u_next w z gate '
                                  'weight scale shift keep mask mean invstd '
                                  'grad_x grad_u u_prev grad_w grad_z '
                                  'grad_gate grad_weight grad_bn_weight '
                                  'grad_bn_bias',
    'kcla_layer_inference': 's residual bn_weight bn_bias running_mean '
                            'running_var u z q_kernel k_kernel norm_d '
                            'gate_weight weight bn_weight bn_bias '
                            'running_mean running_var u_next w_out z_next '
                            'gate_out',
    'kcla_heads_forward': 'pooled_in z q_kernel k_kernel norm_d gate_weight '
                          'w_out z_next gate_out',
    'kcla_heads_backward': 'pooled_in q_kernel k_kernel norm_d gate_weight '
                           'w_out gate_out grad_w grad_gate grad_pooled_out '
                           'grad_q_kernel grad_k_kernel grad_gate_weight',
}
NO_EPS = ('kcla_relu_pool_forward', 'kcla_relu_pool_backward')
# scalars before eps: (momentum, bn_eps), batch_stats
PRE_EPS = {'kcla_branch_train_forward': (0.1, 1e-5),
           'kcla_branch_train_backward': (True,)}
# scalars after eps (the heads ops take key_eps in its place)
MORE_SCALARS = {'kcla_layer_inference': (1e-6, 10.0, 1e-5, 1e-5),
                'kcla_heads_forward': (10.0,),
                'kcla_heads_backward': (10.0,)}


def call(entry, names, case, change):
    args = tensors()
    args = [change(n, args[n]) for n in names.split()]
    args += PRE_EPS.get(entry, ())
    if entry not in NO_EPS:
        args.append(EPS)
    args += MORE_SCALARS.get(entry, ())
    print(json.dumps(dict(entry=entry, case=case, state='calling')),
          flush=True)
    try:
        getattr(EXT, entry)(*args)
        result = dict(error=None)
    except Exception as e:  # noqa: BLE001
        result = dict(error=type(e).__name__, message=str(e).split('\n')[0])
    print(json.dumps(dict(entry=entry, case=case, **result)), flush=True)


def main():
    for entry, names in ENTRIES.items():
        call(entry, names, 'valid', lambda n, t: t)
        call(entry, names, 'all:meta', lambda n, t: t.to('meta'))
        for name in names.split():
            call(entry, names, f'meta:{name}',
                 lambda n, t, name=name: t.to('meta') if n == name else t)
            wrong = torch.float64 if name != 'mask' else torch.float32
            call(entry, names, f'dtype:{name}',
                 lambda n, t, name=name, wrong=wrong: t.to(wrong)
                 if n == name else t)
        call(entry, names, 'all:half', lambda n, t: t.half()
             if t.is_floating_point() else t)
        call(entry, names, 'all:int', lambda n, t: t.long()
             if t.is_floating_point() else t)


if __name__ == '__main__':
    sys.exit(main())
