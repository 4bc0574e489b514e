"""kcla_mm demo: build ResNet-50-KCLA by name and run it on CPU.

Builds the backbone through mmdet's registry (as a config would), checks the
fused KCLA op against the PyTorch path on the whole backbone, and prints the
stage shapes, the parameter overhead over mmdet's ResNet-50 and the time of
a forward pass of both.
"""
import time

import torch
from mmdet.registry import MODELS

import kcla_mm
from kcla_mm.ops import ext_device_types


def median_time(model, x, runs=3):
    times = []
    with torch.no_grad():
        model(x)  # warm-up
        for _ in range(runs):
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    torch.manual_seed(0)
    print(f'kcla_mm {kcla_mm.__version__}; kcla_mm._ext devices: '
          f'{list(ext_device_types())}; torch threads: '
          f'{torch.get_num_threads()}')
    kcla = MODELS.build(dict(type='ResNetKCLA', depth=50, kcla_impl='fused'))
    kcla.init_weights()
    torch_path = MODELS.build(
        dict(type='ResNetKCLA', depth=50, kcla_impl='torch'))
    torch_path.load_state_dict(kcla.state_dict())
    plain = MODELS.build(dict(type='ResNet', depth=50))
    x = torch.rand(2, 3, 224, 224)
    kcla.eval(), torch_path.eval(), plain.eval()
    with torch.no_grad():
        outs = kcla(x)
        ref = torch_path(x)
    diff = max((a - b).abs().max().item() for a, b in zip(outs, ref))
    print('stage outputs:', [tuple(o.shape) for o in outs])
    print(f'fused vs PyTorch path: max abs difference {diff:.2e}')
    n_kcla = sum(p.numel() for p in kcla.parameters())
    n_plain = sum(p.numel() for p in plain.parameters())
    print(f'parameters: ResNet-50 {n_plain / 1e6:.3f}M, ResNet-50-KCLA '
          f'{n_kcla / 1e6:.3f}M (+{(n_kcla - n_plain) / 1e6:.3f}M)')
    t_kcla, t_plain = median_time(kcla, x), median_time(plain, x)
    print(f'inference, batch 2 at 224x224: ResNet-50 {t_plain * 1e3:.0f} ms, '
          f'ResNet-50-KCLA {t_kcla * 1e3:.0f} ms ({t_kcla / t_plain:.2f}x)')
    if diff > 1e-3:
        raise SystemExit('fused and PyTorch paths disagree')


if __name__ == '__main__':
    main()
