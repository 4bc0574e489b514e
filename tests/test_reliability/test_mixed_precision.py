"""Mixed precision: the AMP configs, and training under CPU autocast.

mmengine 0.10.7 on a machine without a GPU: ``AmpOptimWrapper`` refuses to
build (it asserts a GPU, NPU, MLU or MUSA), and ``mmengine.runner.amp.
autocast`` allows only bfloat16 on CPU, although torch 2.13's CPU autocast
also runs float16 (convolutions and matmuls in float16; their backward is
slow on CPU). So the AMP configs cannot train with ``tools/train.py`` here;
these tests check what they change, and train their synthetic-data variants
(the demo configs with the AMP configs' change to ``optim_wrapper``) with
:class:`CPUAutocastOptimWrapper`: ``AmpOptimWrapper``'s autocast context on
CPU, in bfloat16 and float16, without its loss scaler.
"""
import os.path as osp
from contextlib import contextmanager

import pytest
import torch
from mmengine.config import Config
from mmengine.optim import OptimWrapper, build_optim_wrapper

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIGS = osp.join(ROOT, 'configs')
AMP_CONFIGS = {  # AMP config -> (its base, its dtype, the demo variant)
    'detection/faster-rcnn_r50-kcla_fpn_amp-1x_coco.py':
    ('detection/faster-rcnn_r50-kcla_fpn_1x_coco.py', 'float16',
     'demo/faster-rcnn_r18-kcla_fpn_synthetic-coco.py'),
    'segmentation/res-unet_r18s-kcla_amp-300e_isic2018-256x256.py':
    ('segmentation/res-unet_r18s-kcla_300e_isic2018-256x256.py', 'bfloat16',
     'demo/res-unet_r18s-kcla_synthetic-isic2018.py'),
}
DETECTOR, SEGMENTOR = AMP_CONFIGS


def load(name):
    return Config.fromfile(osp.join(CONFIGS, name))


class CPUAutocastOptimWrapper(OptimWrapper):
    """``AmpOptimWrapper``'s autocast context on CPU, any autocast dtype.

    No loss scaling: the gradients it sees are the unscaled ones. Before
    every optimizer step it records the names of the parameters whose
    gradient is missing or not finite.
    """

    def __init__(self, model, dtype: torch.dtype, **kwargs):
        super().__init__(**kwargs)
        self.cast_dtype = dtype
        self.named_parameters = list(model.named_parameters())
        self.bad_grads = []  # one list of names per step

    @contextmanager
    def optim_context(self, model):
        with super().optim_context(model), torch.autocast(
                'cpu', dtype=self.cast_dtype):
            yield

    def step(self, **kwargs):
        self.bad_grads.append([
            name for name, p in self.named_parameters if p.requires_grad and
            (p.grad is None or not torch.isfinite(p.grad).all())
        ])
        super().step(**kwargs)


@pytest.mark.parametrize('name', AMP_CONFIGS)
def test_amp_config_changes_only_the_optim_wrapper(name):
    # that each config builds its model is tested with every shipped config
    # (tests/test_configs)
    base_name, dtype, _ = AMP_CONFIGS[name]
    cfg, base = load(name), load(base_name)
    wrapper = cfg.optim_wrapper
    assert wrapper.type == 'AmpOptimWrapper' and wrapper.dtype == dtype
    assert wrapper.get('loss_scale', 'dynamic') == 'dynamic'
    assert wrapper.optimizer == base.optim_wrapper.optimizer
    changed = {key for key in set(cfg) | set(base)
               if cfg.get(key) != base.get(key)}
    assert changed == {'optim_wrapper'}


@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU-only behaviour')
@pytest.mark.parametrize('name', AMP_CONFIGS)
def test_mmengine_builds_amp_optim_wrapper_only_with_a_gpu(name):
    """Why the CPU test below uses :class:`CPUAutocastOptimWrapper` (and
    why the AMP configs' comments say they need a GPU)."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(AssertionError, match='only available training on '
                       'gpu'):
        build_optim_wrapper(model, load(name).optim_wrapper)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')
@pytest.mark.parametrize('name', AMP_CONFIGS)
def test_amp_optim_wrapper_builds_and_autocasts_on_gpu(name):
    from mmengine.optim import AmpOptimWrapper
    _, dtype, _ = AMP_CONFIGS[name]
    model = torch.nn.Linear(2, 2).cuda()
    wrapper = build_optim_wrapper(model, load(name).optim_wrapper)
    assert isinstance(wrapper, AmpOptimWrapper)
    with wrapper.optim_context(model):
        assert model(torch.ones(1, 2, device='cuda')).dtype == getattr(
            torch, dtype)


def detector_batch():
    from mmdet.testing import demo_mm_inputs
    return demo_mm_inputs(2, [(3, 32, 32)] * 2, num_items=[3, 3],
                          num_classes=3)


def segmentor_batch(size=32):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    gen = torch.Generator().manual_seed(0)
    inputs, samples = [], []
    for _ in range(2):
        inputs.append(torch.randint(0, 256, (3, size, size),
                                    dtype=torch.uint8, generator=gen))
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(
            data=(torch.rand(1, size, size, generator=gen) > 0.5).long())
        sample.set_metainfo(dict(img_shape=(size, size),
                                 ori_shape=(size, size),
                                 pad_shape=(size, size)))
        samples.append(sample)
    return dict(inputs=inputs, data_samples=samples)


def build_detector(cfg):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules()
    model = MODELS.build(cfg.model)
    # mmcv 2.1.0's CPU nms and RoIAlign kernels take float32 only
    # ('expected scalar type Float but found Half'; their CUDA kernels take
    # half), so on CPU the RPN and R-CNN heads run outside autocast on
    # float32 copies of the FPN features; backbone and neck run under it.
    for head, method in ((model.rpn_head, 'loss_and_predict'),
                         (model.roi_head, 'loss')):
        setattr(head, method, float32_features(getattr(head, method)))
    return model


def float32_features(method):

    def wrapped(features, *args, **kwargs):
        with torch.autocast('cpu', enabled=False):
            return method(tuple(f.float() for f in features), *args,
                          **kwargs)

    return wrapped


def build_segmentor(cfg):
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules()
    cfg.model.data_preprocessor.size = (32, 32)
    return MODELS.build(cfg.model)  # all of it runs under autocast


@pytest.mark.slow
@pytest.mark.parametrize('name,dtype', [
    (DETECTOR, torch.float16), (DETECTOR, torch.bfloat16),
    (SEGMENTOR, torch.bfloat16), (SEGMENTOR, torch.float16)
], ids=['detector-float16', 'detector-bfloat16', 'segmentor-bfloat16',
        'segmentor-float16'])
def test_synthetic_variant_trains_under_cpu_autocast(name, dtype):
    import kcla_mm  # noqa: F401  (the configs' custom_imports)
    _, _, demo = AMP_CONFIGS[name]
    cfg = load(demo)
    torch.manual_seed(0)
    if name == DETECTOR:
        model, batch = build_detector(cfg), detector_batch()
    else:
        model, batch = build_segmentor(cfg), segmentor_batch()
    model.init_weights()
    model.train()
    optimizer = build_optim_wrapper(
        model, dict(type='OptimWrapper',
                    optimizer=cfg.optim_wrapper.optimizer)).optimizer
    wrapper = CPUAutocastOptimWrapper(
        model, dtype, optimizer=optimizer,
        clip_grad=cfg.optim_wrapper.get('clip_grad'))

    seen = []  # (input dtype, state dtypes) of every KCLA layer call

    def record(layer, args, output):
        _, state = output
        seen.append((args[0].dtype, state.u.dtype, state.z.dtype))

    for module in model.modules():
        if type(module).__name__ == 'KCLALayer':
            module.register_forward_hook(record)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        log_vars = model.train_step(batch, wrapper)
        assert all(torch.isfinite(torch.as_tensor(v)) for v in
                   log_vars.values()), log_vars
    assert wrapper.bad_grads == [[], []]
    # every KCLA layer ran on autocast-dtype features, its state in float32
    assert seen and set(seen) == {(dtype, torch.float32, torch.float32)}
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
