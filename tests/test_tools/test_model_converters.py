"""tools/model_converters: the authors' checkpoints, plain ResNet weights,
publishing, and the model index.

The authors' architecture is rebuilt here independently of kcla_mm (plain
PyTorch modules with the names of ``bgx666/KCLA``'s ``imagenet/
kcla_resnet.py``, computing docs/method.md's equations), saved in their
format and converted; ResNetKCLA with the converted weights must then
compute the same features.
"""
import glob
import hashlib
import logging
import math
import os
import os.path as osp
from functools import lru_cache

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from .helpers import ROOT, load_tool

STAGE_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


@lru_cache()
def tool(name):
    """tools/model_converters/<name>.py as a module (main(argv) -> rc)."""
    return load_tool(name, 'model_converters')


# --------------------------------------------------------------------------
# The authors' architecture, independently (docs/method.md §2, §3, §5)
# --------------------------------------------------------------------------
def eca_kernel(channels):
    t = int(abs((math.log2(channels) + 1) / 2))
    return t if t % 2 else t + 1


class AuthorsKCLALayer(nn.Module):
    """One KCLA layer with the authors' parameter names; the state is
    (U (B, G, d, H, W), Z (B, G, 1, 1, 1))."""

    def __init__(self, channels, init_layer, head_dim=64):
        super().__init__()
        g = channels // head_dim
        k = eca_kernel(channels)
        self.heads, self.head, self.init_layer = g, head_dim, init_layer
        if init_layer:  # built at every init layer, as the authors do
            self.adjust_channel = nn.Conv2d(
                channels // 2, channels, 1, stride=2, groups=g, bias=False)
            self.u_Wk = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)
            self.u_bn = nn.BatchNorm2d(channels)
        self.bn_attention = nn.BatchNorm2d(channels)
        self.Wq = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)
        self.Wk = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)
        self.Wv = nn.Conv2d(
            channels, channels, 3, padding=1, groups=channels, bias=False)
        self.head_att = nn.Linear(g, g, bias=False)
        s = torch.exp(torch.linspace(math.log(0.7), math.log(1 / 0.7), g))
        self.norm_d = nn.Parameter((1 / s).view(1, g, 1, 1, 1),
                                   requires_grad=False)

    def weight(self, key):
        return torch.exp(
            torch.clamp(key.norm(dim=2, keepdim=True) / self.norm_d, max=10))

    def forward(self, x, state):
        b, c, h, w = x.shape
        g, d = self.heads, self.head
        if state is not None and self.init_layer:  # Algorithm 1
            u, z = state
            a = (u / z).reshape(b, -1, u.shape[-2], u.shape[-1])
            if a.shape[1] != c:
                a = self.adjust_channel(a)
            a = self.u_bn(a)
            z = self.weight(
                self.u_Wk(a.mean((2, 3)).view(b, 1, c)).view(b, g, d, 1, 1))
            state = (a.view(b, g, d, h, w) * z, z)
        pooled = x.mean((2, 3)).view(b, 1, c)
        q = self.Wq(pooled).view(b, g, d, 1, 1)
        k = self.Wk(pooled).view(b, g, d, 1, 1)
        wk = self.weight(k)
        if state is None:
            u, z = wk * x.view(b, g, d, h, w), wk
        else:
            u, z = state[0] + wk * x.view(b, g, d, h, w), state[1] + wk
        o = self.Wv((u / (z + 1e-3)).view(b, c, h, w))
        r = (q * k).sum(2).view(b, g) / k.norm(dim=2).view(b, g)
        gate = torch.sigmoid(self.head_att(r)).view(b, g, 1, 1, 1)
        o = (gate * o.view(b, g, d, h, w)).view(b, c, h, w)
        return F.relu(self.bn_attention(o)), (u, z)


class AuthorsBottleneck(nn.Module):
    """torchvision's bottleneck (stride on conv2)."""

    def __init__(self, inplanes, planes, stride):
        super().__init__()
        out = planes * 4
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride, bias=False),
                nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(y + identity)


class AuthorsStage(nn.Module):
    """``layers`` (blocks) and ``attention`` (one KCLA layer per block, init
    layers at blocks 0 and 11)."""

    def __init__(self, inplanes, planes, num_blocks, stride):
        super().__init__()
        self.layers = nn.Sequential(*[
            AuthorsBottleneck(inplanes if i == 0 else planes * 4, planes,
                              stride if i == 0 else 1)
            for i in range(num_blocks)
        ])
        self.attention = nn.Sequential(*[
            AuthorsKCLALayer(planes * 4, init_layer=i in (0, 11))
            for i in range(num_blocks)
        ])

    def forward(self, x, state):
        for block, attention in zip(self.layers, self.attention):
            x = block(x)
            y, state = attention(x, state)
            x = x + y
        return x, state


class AuthorsResNetKCLA(nn.Module):
    """The authors' ImageNet ResNet-KCLA; forward returns the 4 stage
    outputs."""

    def __init__(self, depth):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        inplanes = 64
        for s, (n, planes) in enumerate(
                zip(STAGE_BLOCKS[depth], (64, 128, 256, 512))):
            self.add_module(f'layer{s + 1}',
                            AuthorsStage(inplanes, planes, n, min(s, 1) + 1))
            inplanes = planes * 4
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        outs, state = [], None
        for s in range(1, 5):
            x, state = getattr(self, f'layer{s}')(x, state)
            outs.append(x)
        return outs


def randomise(model, seed):
    """Random weights and BN statistics, scaled so that activations stay
    O(1) and most layer weights |K| s fall below the clamp at 10."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith('norm_d'):
            continue
        if p.dim() > 1:
            p.data = torch.randn(p.shape, generator=gen) / math.sqrt(
                p[0].numel())
        elif name.endswith('bias'):
            p.data = torch.randn(p.shape, generator=gen) * 0.1
        else:
            p.data = torch.rand(p.shape, generator=gen) * 0.5 + 0.5
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean = torch.randn(m.num_features, generator=gen) * 0.1
            m.running_var = torch.rand(m.num_features, generator=gen) + 0.5
            m.num_batches_tracked.fill_(1000)
    return model.eval()


def save_authors_checkpoint(model, path, depth):
    """The authors' torch.save format, with DataParallel's ``module.``."""
    torch.save(
        dict(
            epoch=100,
            arch=f'resnet{depth}_kcla',
            state_dict={f'module.{k}': v
                        for k, v in model.state_dict().items()},
            best_acc1=torch.tensor(77.78),
            optimizer=dict(state={}, param_groups=[dict(lr=0.1,
                                                        params=[0])])),
        path)


def strip_module(state_dict):
    return {k[len('module.'):]: v for k, v in state_dict.items()}


def image():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(1, 3, 64, 64, generator=gen)


def assert_features_close(ours, theirs):
    assert len(ours) == len(theirs) == 4
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, i
        scale = b.abs().max().item()
        err = (a - b).abs().max().item()
        assert err <= 1e-4 * scale, f'stage {i + 1}: |diff| {err} vs ' \
            f'max |feature| {scale}'


@pytest.fixture(scope='module')
def authors_r50(tmp_path_factory):
    """(authors' R50 features on :func:`image`, its checkpoint path, the
    converted path)."""
    folder = tmp_path_factory.mktemp('authors_r50')
    model = randomise(AuthorsResNetKCLA(50), seed=0)
    with torch.no_grad():
        features = model(image())
    src = str(folder / 'model_best.pth.tar')
    save_authors_checkpoint(model, src, 50)
    dst = str(folder / 'r50_kcla.pth')
    assert tool('kcla_official_to_mm').main([src, dst]) == 0
    return features, src, dst


@pytest.fixture(scope='module')
def authors_r101_file(tmp_path_factory):
    """An authors' ResNet-101 checkpoint (their default init)."""
    src = str(tmp_path_factory.mktemp('authors_r101') / 'model_best.pth.tar')
    save_authors_checkpoint(AuthorsResNetKCLA(101), src, 101)
    return src


def features_of(depth, state_dict):
    """ResNetKCLA(depth) with ``state_dict`` (strict) on :func:`image`."""
    from kcla_mm import ResNetKCLA
    model = ResNetKCLA(depth=depth)
    model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        return model.eval()(image())


# --------------------------------------------------------------------------
# kcla_official_to_mm.py
# --------------------------------------------------------------------------
def test_official_r50_converts_to_the_same_features(authors_r50):
    features, src, dst = authors_r50
    checkpoint = torch.load(dst, map_location='cpu', weights_only=True)
    assert set(checkpoint) == {'state_dict', 'meta'}
    meta = checkpoint['meta']
    assert meta['depth'] == 50 and meta['source_epoch'] == 100
    assert meta['source_arch'] == 'resnet50_kcla'
    assert abs(meta['source_best_acc1'] - 77.78) < 1e-4
    # the only authors' tensors not carried over: the first layer's
    # adapter, which their forward never runs (no state before it)
    assert sorted(meta['dropped_keys']) == sorted(
        f'layer1.attention.0.{k}' for k in (
            'adjust_channel.weight', 'u_Wk.weight', 'u_bn.weight',
            'u_bn.bias', 'u_bn.running_mean', 'u_bn.running_var',
            'u_bn.num_batches_tracked'))
    assert_features_close(features_of(50, checkpoint['state_dict']), features)
    # the mapping table, spot-checked against the authors' tensors
    theirs = strip_module(torch.load(src, weights_only=True)['state_dict'])
    for mine, their in [
        ('layer2_attn.0.adapter.conv.weight',
         'layer2.attention.0.adjust_channel.weight'),
        ('layer2_attn.0.adapter.bn.running_var',
         'layer2.attention.0.u_bn.running_var'),
        ('layer2_attn.0.adapter.k_conv.weight',
         'layer2.attention.0.u_Wk.weight'),
        ('layer3_attn.4.gate.weight', 'layer3.attention.4.head_att.weight'),
        ('layer4_attn.2.bn.bias', 'layer4.attention.2.bn_attention.bias'),
        ('layer4.0.downsample.1.weight',
         'layer4.layers.0.downsample.1.weight'),
    ]:
        assert torch.equal(checkpoint['state_dict'][mine], theirs[their])


def test_official_comparison_detects_a_wrong_mapping(authors_r50):
    """Negative control: swapping two tensors of one layer must break the
    feature match, so the comparison above can see a mapping error."""
    from kcla_mm import ResNetKCLA
    features, _, dst = authors_r50
    converted = torch.load(dst, weights_only=True)['state_dict']
    model = ResNetKCLA(depth=50).eval()
    for pair in [('q_conv', 'k_conv'), ('bn', 'adapter.bn')]:
        state_dict = dict(converted)
        a, b = (f'layer3_attn.0.{name}.weight' for name in pair)
        state_dict[a], state_dict[b] = state_dict[b], state_dict[a]
        model.load_state_dict(state_dict)
        with torch.no_grad():
            mine = model(image())[2]
        diff = (mine - features[2]).abs().max()
        assert diff > 1e-2 * features[2].abs().max(), pair


@pytest.mark.slow
def test_official_r101_converts_to_the_same_features(tmp_path, capsys):
    """ResNet-101 has the block-11 init layer in stage 3 (depth inferred)."""
    model = randomise(AuthorsResNetKCLA(101), seed=1)
    with torch.no_grad():
        features = model(image())
    src = str(tmp_path / 'model_best.pth.tar')
    save_authors_checkpoint(model, src, 101)
    dst = str(tmp_path / 'r101_kcla.pth')
    assert tool('kcla_official_to_mm').main([src, dst]) == 0
    out = capsys.readouterr().out
    assert 'ResNetKCLA(depth=101)' in out
    assert 'layer3.attention.11: adjust_channel.weight' in out
    state_dict = torch.load(dst, weights_only=True)['state_dict']
    assert 'layer3_attn.11.adapter.conv.weight' not in state_dict
    assert torch.equal(state_dict['layer3_attn.11.adapter.bn.weight'],
                       model.layer3.attention[11].u_bn.weight)
    assert_features_close(features_of(101, state_dict), features)


def test_official_wrong_depth_fails_listing_keys(authors_r101_file,
                                                 tmp_path, capsys):
    src = authors_r101_file
    dst = tmp_path / 'out.pth'
    assert tool('kcla_official_to_mm').main(
        [src, str(dst), '--depth', '50', '--max-list', '3']) == 1
    err = capsys.readouterr().err
    # stage 3 blocks 6..22: 17 x (18 block + 10 KCLA tensors) + block 11's
    # 7 adapter tensors (adjust_channel, u_Wk, u_bn)
    assert ('unexpected keys (in the checkpoint, not in the model) (483):\n'
            '    layer3.attention.10.Wk.weight\n'
            '    layer3.attention.10.Wq.weight\n'
            '    layer3.attention.10.Wv.weight\n'
            '    ... and 480 more\n') in err
    assert 'nothing written' in err
    assert os.listdir(tmp_path) == []


def test_official_rejects_a_plain_resnet(tmp_path, capsys):
    from mmdet.models.backbones import ResNet
    src = str(tmp_path / 'resnet50.pth')
    torch.save(ResNet(50).state_dict(), src)
    dst = tmp_path / 'out.pth'
    converter = tool('kcla_official_to_mm')
    assert converter.main([src, str(dst)]) == 1
    assert 'resnet_to_kcla.py' in capsys.readouterr().err
    assert converter.main([src, str(dst), '--depth', '50']) == 1
    err = capsys.readouterr().err
    # all but the stem (conv1, bn1: 6 tensors) fails
    assert 'unexpected keys (in the checkpoint, not in the model) (312)' in err
    assert 'missing keys (in the model, not in the checkpoint) (422)' in err
    assert 'layer1.layers.0.conv1.weight (model: ' \
        'layer1.0.conv1.weight)' in err
    assert 'resnet_to_kcla.py' in err
    assert sorted(os.listdir(tmp_path)) == ['resnet50.pth']


def test_official_shape_and_temperature_mismatches(authors_r50, tmp_path,
                                                   capsys):
    _, src, _ = authors_r50
    checkpoint = torch.load(src, weights_only=True)
    sd = checkpoint['state_dict']
    sd['module.layer2.attention.1.Wv.weight'] = torch.zeros(512, 1, 5, 5)
    # temperatures of another range (s in [0.5, 2])
    sd['module.layer4.attention.0.norm_d'] = 1 / torch.exp(
        torch.linspace(math.log(0.5), math.log(2), 32)).view(1, 32, 1, 1, 1)
    del sd['module.layer1.layers.0.bn1.running_mean']
    bad = str(tmp_path / 'bad.pth.tar')
    torch.save(checkpoint, bad)
    dst = tmp_path / 'out.pth'
    assert tool('kcla_official_to_mm').main([bad, str(dst)]) == 1
    err = capsys.readouterr().err
    assert ('layer2.attention.1.Wv.weight -> layer2_attn.1.v_conv.weight: '
            'checkpoint (512, 1, 5, 5) vs model (512, 1, 3, 3)') in err
    assert 'layer4.attention.0.norm_d: checkpoint [2.0' in err
    assert 'layer1.layers.0.bn1.running_mean (model: ' \
        'layer1.0.bn1.running_mean)' in err
    assert not dst.exists()


def test_detector_config_loads_the_converted_backbone(authors_r50, tmp_path):
    """Faster R-CNN R50-KCLA with the backbone's init_cfg pointing at the
    converted file: every backbone tensor loaded, no missing keys logged.
    Then the trained detector's own checkpoint loads into a fresh backbone
    with prefix='backbone.'."""
    from mmengine.config import Config
    from mmengine.logging import MMLogger
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules()
    import kcla_mm  # noqa: F401

    _, _, dst = authors_r50
    expected = torch.load(dst, weights_only=True)['state_dict']
    cfg = Config.fromfile(
        osp.join(ROOT, 'configs', 'detection',
                 'faster-rcnn_r50-kcla_fpn_1x_coco.py'))
    cfg.model.backbone.init_cfg = dict(type='Pretrained', checkpoint=dst)

    class Records(logging.Handler):

        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    logger = MMLogger.get_instance('test_model_converters', log_level='INFO')
    logger.addHandler(records)
    try:
        detector = MODELS.build(cfg.model)
        detector.init_weights()
    finally:
        logger.removeHandler(records)
    log = '\n'.join(records.messages)
    assert f'load model from: {dst}' in log
    assert 'missing keys' not in log and 'unexpected key' not in log
    loaded = detector.backbone.state_dict()
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key

    whole = str(tmp_path / 'detector.pth')
    torch.save(dict(state_dict=detector.state_dict(), meta={}), whole)
    cfg.model.backbone.init_cfg = dict(
        type='Pretrained', checkpoint=whole, prefix='backbone.')
    fresh = MODELS.build(cfg.model.backbone)
    fresh.init_weights()
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


# --------------------------------------------------------------------------
# resnet_to_kcla.py
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def torchvision_r50(tmp_path_factory):
    """A torchvision-layout ResNet-50 file (torchvision is not installed;
    mmdet's ResNet has the same names) with ``fc`` and, like torchvision's
    older files, no BN ``num_batches_tracked``."""
    from mmdet.models.backbones import ResNet
    torch.manual_seed(3)
    resnet = ResNet(50)
    resnet.init_weights()
    for m in resnet.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.0)
            nn.init.normal_(m.running_mean, std=0.1)
    state_dict = {
        k: v
        for k, v in resnet.state_dict().items()
        if not k.endswith('num_batches_tracked')
    }
    state_dict['fc.weight'] = torch.randn(1000, 2048)
    state_dict['fc.bias'] = torch.randn(1000)
    path = str(tmp_path_factory.mktemp('tv') / 'resnet50-tv.pth')
    torch.save(state_dict, path)
    return state_dict, path


def test_resnet_to_kcla_loads_and_reports(torchvision_r50, tmp_path, capsys):
    from kcla_mm import ResNetKCLA
    state_dict, src = torchvision_r50
    dst = str(tmp_path / 'r50_kcla_init.pth')
    assert tool('resnet_to_kcla').main([src, dst, '--depth', '50']) == 0
    out = capsys.readouterr().out
    assert 'loaded: 265 tensors' in out
    # 16 KCLA layers, 0.293M parameters (the authors' 0.302M less the first
    # layer's adapter, which the authors build but never run)
    assert 'new: 165 tensors in 16 KCLA modules (0.293M parameters' in out
    assert ('  layer1_attn.0 (9 tensors): bn, q_conv, k_conv, v_conv, gate\n'
            in out)
    assert ('  layer2_attn.0 (16 tensors): bn, q_conv, k_conv, v_conv, gate, '
            'adapter.bn, adapter.conv, adapter.k_conv\n') in out
    assert 'unused: 2 tensors\n  fc.bias\n  fc.weight' in out
    assert 'kept at 0: 53 BN num_batches_tracked' in out
    checkpoint = torch.load(dst, weights_only=True)
    merged = checkpoint['state_dict']
    assert checkpoint['meta']['num_loaded'] == 265
    assert len(checkpoint['meta']['new_modules']) == 16
    for key, value in state_dict.items():
        if not key.startswith('fc.'):
            assert torch.equal(merged[key], value), key
    # the KCLA layers carry docs/method.md's fresh init
    assert torch.equal(merged['layer3_attn.2.bn.weight'], torch.ones(1024))
    assert merged['layer3_attn.2.v_conv.weight'].std() > 0
    ResNetKCLA(depth=50).load_state_dict(merged, strict=True)


def test_resnet_to_kcla_takes_a_detector_checkpoint(torchvision_r50,
                                                    tmp_path, capsys):
    """mmdet/mmpretrain names: ``backbone.`` prefix; necks and heads are
    reported unused."""
    state_dict, _ = torchvision_r50
    whole = {f'backbone.{k}': v for k, v in state_dict.items()
             if not k.startswith('fc.')}
    whole['neck.lateral_convs.0.conv.weight'] = torch.zeros(256, 256, 1, 1)
    whole['roi_head.bbox_head.fc_cls.weight'] = torch.zeros(81, 1024)
    src = str(tmp_path / 'detector.pth')
    torch.save(dict(state_dict=whole, meta={}), src)
    dst = str(tmp_path / 'out.pth')
    assert tool('resnet_to_kcla').main(
        [src, dst, '--depth', '50', '--layer-attention', 'MRLA-light']) == 0
    out = capsys.readouterr().out
    assert 'loaded: 265 tensors' in out
    assert 'MRLA-light modules' in out
    assert 'unused: 2 tensors\n  neck.lateral_convs.0.conv.weight\n  ' \
        'roi_head.bbox_head.fc_cls.weight' in out


def test_resnet_to_kcla_rejects_other_depths_and_shapes(torchvision_r50,
                                                        tmp_path, capsys):
    state_dict, src = torchvision_r50
    converter = tool('resnet_to_kcla')
    dst = tmp_path / 'out.pth'
    # a ResNet-101 file (stage 3 has blocks 6..22 too) for --depth 50
    r101 = dict(state_dict)
    for i in range(6, 23):
        r101.update({
            k.replace('layer3.5.', f'layer3.{i}.'): v
            for k, v in state_dict.items() if k.startswith('layer3.5.')
        })
    r101['conv1.weight'] = torch.zeros(64, 4, 7, 7)  # and a 4-channel stem
    bad = str(tmp_path / 'r101.pth')
    torch.save(r101, bad)
    assert converter.main(
        [bad, str(dst), '--depth', '50', '--max-list', '2']) == 1
    err = capsys.readouterr().err
    # 17 blocks x 15 tensors (no num_batches_tracked in this file)
    assert 'unexpected keys (in the checkpoint, not in the model) (255):\n' \
        '    layer3.10.bn1.bias\n    layer3.10.bn1.running_mean\n' \
        '    ... and 253 more' in err
    assert 'conv1.weight: checkpoint (64, 4, 7, 7) vs model (64, 3, 7, 7)' \
        in err
    assert not dst.exists()


def test_resnet_to_kcla_points_authors_checkpoints_elsewhere(
        authors_r50, tmp_path, capsys):
    _, src, _ = authors_r50
    assert tool('resnet_to_kcla').main(
        [src, str(tmp_path / 'out.pth'), '--depth', '50']) == 1
    assert 'kcla_official_to_mm.py' in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------
# publish_model.py and atomic writes
# --------------------------------------------------------------------------
def test_publish_model_keeps_weights_and_meta(tmp_path, capsys):
    from mmengine.logging import MessageHub
    hub = MessageHub.get_instance('publish_test')
    hub.update_scalar('train/loss', 0.5)
    state_dict = {'backbone.conv1.weight': torch.randn(4, 3, 3, 3)}
    src = str(tmp_path / 'epoch_12.pth')
    torch.save(
        dict(
            meta=dict(epoch=12, iter=1200, seed=0, cfg='model = dict()'),
            state_dict=state_dict,
            optimizer=dict(state={}, param_groups=[dict(lr=0.02)]),
            param_schedulers=[dict(last_epoch=12)],
            message_hub=hub.state_dict()), src)
    out = str(tmp_path / 'pub' / 'faster-rcnn_r50-kcla.pth')
    publish = tool('publish_model')
    assert publish.main([src, out]) == 0
    printed = capsys.readouterr().out
    assert 'removed: optimizer, param_schedulers, message_hub' in printed
    files = os.listdir(tmp_path / 'pub')
    assert len(files) == 1
    name = files[0]
    with open(tmp_path / 'pub' / name, 'rb') as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert name == f'faster-rcnn_r50-kcla-{sha[:8]}.pth'
    assert sha in printed
    published = torch.load(tmp_path / 'pub' / name, weights_only=True)
    assert set(published) == {'state_dict', 'meta'}
    assert published['meta']['epoch'] == 12
    assert torch.equal(published['state_dict']['backbone.conv1.weight'],
                       state_dict['backbone.conv1.weight'])
    # the same input gives the same bytes, hence the same name
    assert publish.main([src, out]) == 0
    assert os.listdir(tmp_path / 'pub') == [name]


def test_publish_model_rejects_non_checkpoints(tmp_path, capsys):
    src = tmp_path / 'notes.pth'
    src.write_text('not a checkpoint')
    assert tool('publish_model').main(
        [str(src), str(tmp_path / 'out.pth')]) == 1
    assert 'cannot read' in capsys.readouterr().err
    assert os.listdir(tmp_path) == ['notes.pth']


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    from kcla_mm.utils import checkpoint as ckpt

    def fail(src, dst):
        raise OSError('disk full')

    monkeypatch.setattr(ckpt.os, 'replace', fail)
    with pytest.raises(OSError, match='disk full'):
        ckpt.save_checkpoint_atomic({'a': torch.zeros(2)},
                                    str(tmp_path / 'x.pth'))
    assert os.listdir(tmp_path) == []


def test_key_mapping_round_trips():
    from kcla_mm.utils.checkpoint import (mm_to_official_key,
                                          official_to_mm_key)
    pairs = {
        'conv1.weight': 'conv1.weight',
        'bn1.running_var': 'bn1.running_var',
        'layer2.layers.0.downsample.1.bias': 'layer2.0.downsample.1.bias',
        'layer3.attention.5.Wq.weight': 'layer3_attn.5.q_conv.weight',
        'layer3.attention.5.Wk.weight': 'layer3_attn.5.k_conv.weight',
        'layer3.attention.5.Wv.weight': 'layer3_attn.5.v_conv.weight',
        'layer3.attention.5.head_att.weight': 'layer3_attn.5.gate.weight',
        'layer3.attention.5.bn_attention.bias': 'layer3_attn.5.bn.bias',
        'layer4.attention.0.adjust_channel.weight':
        'layer4_attn.0.adapter.conv.weight',
        'layer4.attention.0.u_bn.running_mean':
        'layer4_attn.0.adapter.bn.running_mean',
        'layer4.attention.0.u_Wk.weight':
        'layer4_attn.0.adapter.k_conv.weight',
        'layer4.attention.0.norm_d': 'layer4_attn.0.norm_d',
    }
    for theirs, ours in pairs.items():
        assert official_to_mm_key(theirs) == ours
        assert mm_to_official_key(ours) == theirs
    for other in ('fc.weight', 'layer1.attention.0.se.fc.weight',
                  'layer1.0.conv1.weight'):
        assert official_to_mm_key(other) is None


# --------------------------------------------------------------------------
# model-index.yml and the metafiles
# --------------------------------------------------------------------------
def test_model_index_lists_every_config():
    with open(osp.join(ROOT, 'model-index.yml')) as f:
        index = yaml.safe_load(f)
    imports = index['Import']
    assert sorted(imports) == ['configs/detection/metafile.yml',
                               'configs/segmentation/metafile.yml']
    listed = set()
    for metafile in imports:
        with open(osp.join(ROOT, metafile)) as f:
            meta = yaml.safe_load(f)
        collections = {c['Name']: c for c in meta['Collections']}
        for c in collections.values():
            if 'KCLA' in c['Name']:
                assert c['Paper']['URL'] == \
                    'https://arxiv.org/abs/2606.28405'
            else:  # a baseline's own paper
                assert c['Paper']['URL'].startswith('https://arxiv.org/abs/')
            assert c['Paper']['Title']
            assert osp.isfile(osp.join(ROOT, c['README'])), c['README']
            assert c['Metadata']['Training Data']
            assert c['Metadata']['Architecture']
        names = [m['Name'] for m in meta['Models']]
        assert len(names) == len(set(names))
        for model in meta['Models']:
            assert model['In Collection'] in collections
            assert osp.isfile(osp.join(ROOT, model['Config'])), \
                model['Config']
            assert osp.basename(model['Config']) == model['Name'] + '.py'
            for key in ('Training Data', 'Epochs', 'Batch Size',
                        'Training Resources'):
                assert model['Metadata'][key], (model['Name'], key)
            # nothing has been measured or released yet
            assert not model.get('Results') and 'Weights' not in model
            listed.add(model['Config'])
    shipped = {
        osp.relpath(p, ROOT)
        for kind in ('detection', 'segmentation')
        for p in glob.glob(osp.join(ROOT, 'configs', kind, '*.py'))
    }
    assert listed == shipped
