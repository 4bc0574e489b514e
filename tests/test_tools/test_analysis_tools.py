"""tools/analysis/{key_correlation,attention_maps,complexity}.py: the numbers
they write are recomputed here independently (from docs/method.md's formulas
and the layers' own weights), on small ResNet-18 backbones (base width 16, head
dim 16) and three tiny random PNGs."""
import json
import logging
import math
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from kcla_mm.models import ResNetKCLA
from .helpers import ANALYSIS, ROOT, load_tool

SMALL = dict(depth=18, base_channels=16, head_dim=16)
SMALL_ARGS = ['--depth', '18', '--base-channels', '16', '--head-dim', '16',
              '--img-size', '64']


@pytest.fixture(scope='module')
def tools():
    from mmengine.logging import MMLogger
    MMLogger.get_current_instance().setLevel(logging.WARNING)
    return {name: load_tool(name) for name in
            ('analysis_utils', 'key_correlation', 'attention_maps',
             'complexity')}


@pytest.fixture
def image_dir(tmp_path):
    folder = tmp_path / 'images'
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        low = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        Image.fromarray(low).resize((64, 48), Image.BILINEAR).save(
            folder / f'img{i}.png')
    return folder


def save_backbone(path, seed=0, **kwargs):
    """A randomly initialised small ResNetKCLA and its state dict at
    ``path``; returns the model (eval)."""
    from mmengine.logging import MMLogger
    MMLogger.get_current_instance().setLevel(logging.WARNING)
    torch.manual_seed(seed)
    model = ResNetKCLA(**{**SMALL, **kwargs})
    model.init_weights()
    torch.save(model.state_dict(), path)
    return model.eval()


def layer_inputs(model, images):
    """Per attention layer: (x, U, Z) it receives, cloned at call time (x
    after the block's last norm, shortcut add and ReLU, which ResNetKCLA
    leaves to KCLA layers)."""
    captured = {}
    handles = []
    for stage, name in enumerate(model.attn_layers):
        for block, layer in enumerate(getattr(model, name)):
            def hook(module, args, kwargs, key=f'{name}.{block}'):
                state = args[1] if len(args) > 1 else None
                u = getattr(state, 'u', None)
                x = args[0]
                if kwargs.get('tail_norm') is not None:
                    x = kwargs['tail_norm'](x)
                if kwargs.get('shortcut') is not None:
                    x = x + kwargs['shortcut']
                x = x.clamp_min(0) if kwargs.get('relu_input') else x
                captured[key] = (x.clone(),
                                 None if u is None else u.clone(),
                                 None if u is None else state.z.clone())
            handles.append(layer.register_forward_pre_hook(
                hook, with_kwargs=True))
    with torch.no_grad():
        model(images)
    for h in handles:
        h.remove()
    return captured


@torch.no_grad()
def eca(conv, pooled):
    return F.conv1d(pooled[:, None], conv.weight,
                    padding=conv.padding)[:, 0]


# ---------------------------------------------------------------- keys
def test_key_correlation_matches_independent_cosines(tools, image_dir,
                                                     tmp_path):
    ckpt = tmp_path / 'backbone.pth'
    model = save_backbone(ckpt)
    out = tmp_path / 'out'
    tools['key_correlation'].main([
        str(image_dir), str(out), '--backbone', 'checkpoint', '--checkpoint',
        str(ckpt), *SMALL_ARGS
    ])
    assert sorted(p.name for p in out.iterdir()) == [
        'key_correlation.json'] + [f'key_cosine_stage{i}.png'
                                   for i in range(1, 5)]
    assert all((out / f'key_cosine_stage{i}.png').stat().st_size > 1000
               for i in range(1, 5))
    result = json.loads((out / 'key_correlation.json').read_text())
    assert result['images'] == ['img0.png', 'img1.png', 'img2.png']
    images, _, _ = tools['analysis_utils'].load_images(
        sorted(str(p) for p in image_dir.iterdir()), 64)
    inputs = layer_inputs(model, images)
    for stage in result['stages']:
        names = stage['layers']
        assert names == [f'layer{stage["stage"]}_attn.{b}' for b in (0, 1)]
        layers = [getattr(model, n.split('.')[0])[int(n.split('.')[1])]
                  for n in names]
        keys = [eca(layer.k_conv, inputs[n][0].mean((2, 3)))
                for n, layer in zip(names, layers)]
        per_image = F.cosine_similarity(keys[0], keys[1], dim=1)  # (N,)
        cos = np.asarray(stage['cosine'])
        assert cos.shape == (2, 2)
        np.testing.assert_allclose(np.diag(cos), 1, atol=1e-6)
        np.testing.assert_allclose(cos, cos.T, atol=1e-7)
        # mean over the 3 images of the per-image cosine
        assert cos[0, 1] == pytest.approx(per_image.mean().item(), abs=1e-5)
        assert stage['cosine_std_over_images'][0][1] == pytest.approx(
            per_image.std(unbiased=False).item(), abs=1e-5)
        gap = F.cosine_similarity(inputs[names[0]][0].mean((2, 3)),
                                  inputs[names[1]][0].mean((2, 3)), dim=1)
        assert stage['gap_cosine'][0][1] == pytest.approx(
            gap.mean().item(), abs=1e-5)


def test_key_correlation_from_config_equals_checkpoint(tools, image_dir,
                                                       tmp_path):
    """--backbone config takes the backbone.* weights of a detector
    checkpoint and ignores the config's init_cfg."""
    model = save_backbone(tmp_path / 'backbone.pth')
    detector = {'meta': {'epoch': 12},
                'state_dict': {**{f'backbone.{k}': v for k, v in
                                  model.state_dict().items()},
                               'neck.conv.weight': torch.zeros(2)}}
    torch.save(detector, tmp_path / 'detector.pth')
    config = tmp_path / 'detector_cfg.py'
    config.write_text(
        "model = dict(type='FasterRCNN', backbone=dict(type='ResNetKCLA', "
        "depth=18, base_channels=16, head_dim=16, init_cfg=dict("
        "type='Pretrained', checkpoint='does-not-exist.pth')))\n")
    runs = {}
    for source, extra in (
            ('checkpoint', ['--checkpoint', str(tmp_path / 'backbone.pth'),
                            *SMALL_ARGS]),
            ('config', ['--config', str(config), '--checkpoint',
                        str(tmp_path / 'detector.pth'), '--img-size', '64'])):
        out = tmp_path / source
        tools['key_correlation'].main(
            [str(image_dir), str(out), '--backbone', source, *extra])
        runs[source] = json.loads((out / 'key_correlation.json').read_text())
    for a, b in zip(runs['checkpoint']['stages'], runs['config']['stages']):
        np.testing.assert_allclose(a['cosine'], b['cosine'], atol=1e-6)
    assert runs['config']['backbone']['source'] == 'config'


@pytest.mark.parametrize('content', [None, b'not an image'])
def test_key_correlation_no_readable_images(tools, tmp_path, content):
    """Empty folder, or only unreadable files: exit 1 naming the folder,
    nothing written."""
    folder = tmp_path / 'empty'
    folder.mkdir()
    if content is not None:
        (folder / 'broken.png').write_bytes(content)
    out = tmp_path / 'out'
    with pytest.raises(SystemExit) as exc:
        tools['key_correlation'].main([str(folder), str(out)])
    assert isinstance(exc.value.code, str)  # sys.exit(msg): status 1
    assert exc.value.code.startswith('error: no readable images')
    assert str(folder) in exc.value.code
    assert not out.exists()


def test_key_correlation_checkpoint_mismatch(tools, image_dir, tmp_path):
    save_backbone(tmp_path / 'r18.pth')
    out = tmp_path / 'out'
    with pytest.raises(SystemExit) as exc:
        tools['key_correlation'].main([
            str(image_dir), str(out), '--backbone', 'checkpoint',
            '--checkpoint', str(tmp_path / 'r18.pth'), '--depth', '34',
            '--base-channels', '16', '--head-dim', '16'
        ])
    assert 'missing keys' in exc.value.code and 'r18.pth' in exc.value.code
    assert not out.exists()
    with pytest.raises(SystemExit) as exc:  # argparse: names the option
        tools['key_correlation'].parse_args(
            [str(image_dir), str(out), '--backbone', 'config'])
    assert exc.value.code == 2


def test_key_correlation_cli_exit_status(tmp_path):
    """As a script: an empty folder exits with status 1 and a message."""
    empty = tmp_path / 'nothing'
    empty.mkdir()
    result = subprocess.run(
        [sys.executable, osp.join(ANALYSIS, 'key_correlation.py'),
         str(empty), str(tmp_path / 'out')],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip() == \
        f'error: no readable images (jpg/jpeg/png) in {empty}'
    assert not (tmp_path / 'out').exists()


# ------------------------------------------------------- attention maps
def spec_weight(key, num_heads):
    """w = exp(min(|K_g| * s_g, 10)), s = exp(linspace(ln 0.7, ln 1/0.7))."""
    s = torch.exp(torch.linspace(math.log(0.7), math.log(1 / 0.7),
                                 num_heads))
    k = key.view(key.shape[0], num_heads, -1)
    return torch.exp(torch.clamp(k.norm(dim=-1) * s, max=10))


@pytest.mark.parametrize('init_blocks', [(0, ), (0, 1)])
def test_attention_maps_kcla_weights(tools, image_dir, tmp_path,
                                     init_blocks):
    """Effective weights: non-negative, sum to 1 per head up to eps, and
    equal to w_s / (Z + eps) recomputed here from docs/method.md's formulas
    (the carried state's z through the adapter's own conv/BN/key conv).
    init_blocks (0, 1): block 1 re-anchors the state too (config path)."""
    image = str(image_dir / 'img1.png')
    out = tmp_path / 'out'
    model = save_backbone(tmp_path / 'backbone.pth',
                          state_init_blocks=init_blocks)
    if init_blocks == (0, ):
        args = ['--backbone', 'checkpoint', '--checkpoint',
                str(tmp_path / 'backbone.pth'), *SMALL_ARGS]
    else:
        torch.save({'state_dict': {f'backbone.{k}': v for k, v in
                                   model.state_dict().items()}},
                   tmp_path / 'det.pth')
        (tmp_path / 'cfg.py').write_text(
            "model = dict(backbone=dict(type='ResNetKCLA', depth=18, "
            "base_channels=16, head_dim=16, state_init_blocks=(0, 1)))\n")
        args = ['--backbone', 'config', '--config', str(tmp_path / 'cfg.py'),
                '--checkpoint', str(tmp_path / 'det.pth'), '--img-size', '64']
    tools['attention_maps'].main([image, str(out), *args])
    assert sorted(p.name for p in out.iterdir()) == [
        'attention_maps.json'] + [f'attention_stage{i}.png'
                                  for i in range(1, 5)] + ['gates.png']
    result = json.loads((out / 'attention_maps.json').read_text())
    eps = result['eps']
    assert eps == 1e-3

    x_img = tools['analysis_utils'].load_image(image, 64)[None]
    inputs = layer_inputs(model, x_img)
    chain = []
    for entry in result['layers']:
        stage, block = entry['stage'] - 1, entry['block']
        layer = getattr(model, f'layer{stage + 1}_attn')[block]
        x, u, z_in = inputs[entry['name']]
        g = layer.num_heads
        pooled = x.mean((2, 3))
        key = eca(layer.k_conv, pooled)
        w = spec_weight(key, g)[0]
        if layer.adapter is not None:  # docs/method.md §3, by hand
            b, c_in, h, wd = u.shape
            a = (u.view(b, z_in.shape[1], -1, h, wd) /
                 z_in.view(b, -1, 1, 1, 1)).view(b, c_in, h, wd)
            if layer.adapter.conv is not None:
                with torch.no_grad():
                    a = layer.adapter.conv(a)
            bn = getattr(layer.adapter, layer.adapter.norm_name)
            a = F.batch_norm(a, bn.running_mean, bn.running_var, bn.weight,
                             bn.bias, False, 0.0, bn.eps)
            z0 = spec_weight(eca(layer.adapter.k_conv, a.mean((2, 3))), g)[0]
            chain = [(f'carried state (block {block})', z0)]
        elif u is None:
            chain = []
        chain.append((f'block {block}', w))
        assert entry['sources'] == [s for s, _ in chain]
        total = sum(v for _, v in chain)
        expected = torch.stack([v for _, v in chain]) / (total + eps)
        weights = np.asarray(entry['weights'])  # (sources, G)
        np.testing.assert_allclose(weights, expected.numpy(), rtol=1e-4)
        assert (weights >= 0).all()
        # sum per head: Z / (Z + eps), i.e. 1 up to eps / Z <= 1e-3 (Z >= 1)
        sums = weights.sum(0)
        np.testing.assert_allclose(sums, (total / (total + eps)).numpy(),
                                   rtol=1e-5)
        assert np.all(np.abs(sums - 1) <= eps + 1e-6)
        # head gate sigmoid(Phi(r)), r = <Q, K> / |K|
        q = eca(layer.q_conv, pooled).view(1, g, -1)
        k = key.view(1, g, -1)
        r = (q * k).sum(-1) / k.norm(dim=-1)
        gate = torch.sigmoid(r @ layer.gate.weight.detach().T)[0]
        np.testing.assert_allclose(entry['gate'], gate.numpy(), rtol=1e-4,
                                   atol=1e-6)
    sources = {s for e in result['layers'] for s in e['sources']}
    if init_blocks == (0, 1):
        assert 'carried state (block 1)' in sources
        block1 = [e for e in result['layers'] if e['block'] == 1]
        assert all(e['sources'] == ['carried state (block 1)', 'block 1']
                   for e in block1)
    else:
        assert 'carried state (block 1)' not in sources
        # the first layer of the network has no carried state
        assert result['layers'][0]['sources'] == ['block 0']


def test_attention_maps_mrla_light(tools, image_dir, tmp_path):
    """MRLA-light: e_ts = gate_s * prod_{r=s+1..t} lambda_r * alpha_{r-1},
    averaged over each head's channels, recomputed with random lambda and
    BN statistics."""
    torch.manual_seed(1)
    model = ResNetKCLA(**{**SMALL, 'depth': 34},
                       layer_attention='MRLA-light').eval()
    for name in model.attn_layers:
        for layer in getattr(model, name):
            layer.lambda_t.data.uniform_(0.2, 1.0)
            bn = getattr(layer, layer.norm_name)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.running_var.uniform_(0.5, 2.0)
    torch.save(model.state_dict(), tmp_path / 'mrla.pth')
    out = tmp_path / 'out'
    image = str(image_dir / 'img2.png')
    tools['attention_maps'].main([
        image, str(out), '--backbone', 'checkpoint', '--checkpoint',
        str(tmp_path / 'mrla.pth'), '--layer-attention', 'MRLA-light',
        '--depth', '34', '--base-channels', '16', '--head-dim', '16',
        '--img-size', '64'
    ])
    result = json.loads((out / 'attention_maps.json').read_text())
    assert result['layer_attention'] == 'MRLA-light'
    inputs = layer_inputs(model, tools['analysis_utils'].load_image(
        image, 64)[None])
    gates, lams, alphas = {}, {}, {}
    for entry in result['layers']:
        stage, t = entry['stage'] - 1, entry['block']
        layer = getattr(model, f'layer{stage + 1}_attn')[t]
        g = layer.num_heads
        pooled = inputs[entry['name']][0].mean((2, 3))
        q = eca(layer.q_conv, pooled).view(g, -1)
        k = eca(layer.k_conv, pooled).view(g, -1)
        gates[t] = torch.sigmoid((q * k).sum(-1) / math.sqrt(q.shape[1]))
        lams[t] = layer.lambda_t.detach().flatten()
        bn = getattr(layer, layer.norm_name)
        alphas[t] = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
        expected = []
        for s in range(t + 1):
            coeff = gates[s].repeat_interleave(q.shape[1])
            for r in range(s + 1, t + 1):
                coeff = coeff * lams[r] * alphas[r - 1]
            expected.append(coeff.view(g, -1).mean(1))
        assert entry['sources'] == [f'block {s}' for s in range(t + 1)]
        np.testing.assert_allclose(entry['weights'],
                                   torch.stack(expected).numpy(), rtol=1e-4,
                                   atol=1e-7)
        np.testing.assert_allclose(entry['gate'], gates[t].numpy(),
                                   rtol=1e-4, atol=1e-7)
    # stage 3 of ResNet-34 has 6 blocks: block 5 sees blocks 0..5
    last = [e for e in result['layers'] if e['stage'] == 3][-1]
    assert len(last['sources']) == 6
    assert (out / 'gates.png').stat().st_size > 1000


# ------------------------------------------------------------ complexity
def test_param_counts(tools):
    """parameter_count == sum(numel); KCLA adds 293,101 parameters to
    mmdet's ResNet-50 (docs/method.md §2: 0.293M)."""
    from mmdet.models.backbones import ResNet
    cx = tools['complexity']
    counts = {}
    for kind in (None, 'KCLA', 'MRLA-light', 'LA'):
        model = cx.build_resnet(50, kind)
        counts[kind] = cx.count_params(model)
        assert counts[kind] == sum(p.numel() for p in model.parameters())
    assert counts[None] == cx.count_params(ResNet(50)) == 23_508_032
    assert counts['KCLA'] - counts[None] == 293_101


def kcla_extra_flops(model, img_size):
    """KCLA's extra FLOPs (fvcore conventions, eval) from the layer shapes:
    per layer the depthwise 3x3 (9 C H W), its BN (2 C H W), Conv1d_q/k
    (k C each) and Phi (G^2); per adapter the grouped 1x1 conv
    (C C' / G H W), its BN (2 C H W) and Conv1d_u (k C)."""
    sizes = {}
    hooks = [layer.register_forward_pre_hook(
        lambda m, a: sizes.__setitem__(m, a[0].shape[2:]))
        for name in model.attn_layers for layer in getattr(model, name)]
    with torch.no_grad():
        model(torch.rand(1, 3, img_size, img_size))
    for h in hooks:
        h.remove()
    total = 0
    for layer, (h, w) in sizes.items():
        c, g, hw = layer.channels, layer.num_heads, h * w
        total += 11 * c * hw + 2 * layer.k_conv.kernel_size[0] * c + g * g
        if layer.adapter is not None:
            total += 2 * c * hw + layer.adapter.k_conv.kernel_size[0] * c
            if layer.adapter.conv is not None:
                total += c * layer.adapter.in_channels // g * hw
    return total


def test_kcla_flops_r50(tools):
    """KCLA's extra FLOPs on ResNet-50 at 224: all inside the attention
    layers, equal to the count from the layer shapes, and small."""
    cx = tools['complexity']
    rows = cx.backbone_rows([50], ['KCLA'], 224)
    plain, kcla = rows
    assert plain['flops'] == pytest.approx(4.11e9, rel=0.01)
    assert kcla['extra_flops'] == kcla['attention_flops']
    assert kcla['extra_flops'] == kcla_extra_flops(
        cx.build_resnet(50, 'KCLA'), 224)
    assert 0 < kcla['extra_flops_percent'] < 3  # measured 2.06%


@pytest.mark.skipif(
    not __import__('kcla_mm.ops', fromlist=['x']).ext_available(),
    reason='kcla_mm._ext not built')
def test_fused_and_torch_paths_count_the_same(tools):
    """Traced, a KCLA layer takes its PyTorch path whatever kcla_impl says
    (torch.jit cannot record the fused kernels): the default and the
    fused-forced models count what the PyTorch path counts, train and eval,
    with and without BN running statistics, and nothing is left unsupported
    (mmengine would count an untraceable op as 0)."""
    cx = tools['complexity']
    x = torch.rand(2, 3, 64, 64)
    for norm_cfg in (dict(type='BN'),
                     dict(type='BN', track_running_stats=False)):
        # two stages: 4 KCLA layers, with and without an incoming state,
        # and the cross-stage adapter
        models = {
            impl: cx.build_resnet(
                18, 'KCLA', base_channels=16, head_dim=16, kcla_impl=impl,
                num_stages=2, strides=(1, 2), dilations=(1, 1),
                out_indices=(0, 1), norm_cfg=norm_cfg)
            for impl in ('auto', 'fused', 'torch')
        }
        for train in (False, True):
            for elementwise in (False, True):
                counts = {impl: cx.count_flops(m.train(train), (x, ),
                                               elementwise)
                          for impl, m in models.items()}
                assert counts['auto']['total'] == \
                    counts['fused']['total'] == counts['torch']['total']
                assert not any('PythonOp' in op
                               for c in counts.values()
                               for op in c['unsupported'])


def test_stack_scaling(tools):
    """FLOPs: linear in depth for KCLA (FLOPs(32) / FLOPs(16) = 2),
    super-linear for LA; state: constant for KCLA, linear for LA; saved
    activations: linear for KCLA, quadratic-ish for LA."""
    depths = (8, 16, 32)
    rows = tools['complexity'].stack_rows(depths, channels=32, size=4,
                                          head_dim=16, kinds=('KCLA', 'LA'))
    get = {(r['kind'], r['depth']): r for r in rows}
    kcla = [get['KCLA', d] for d in depths]
    la = [get['LA', d] for d in depths]
    assert kcla[2]['flops'] == 2 * kcla[1]['flops'] == 4 * kcla[0]['flops']
    assert la[2]['flops'] / la[1]['flops'] > 2.5
    assert len({r['state_bytes'] for r in kcla}) == 1
    assert kcla[0]['state_bytes'] == (32 * 4 * 4 + 2) * 4  # U + Z float32
    assert [r['state_bytes'] / la[0]['state_bytes'] for r in la] == [1, 2, 4]
    assert kcla[2]['saved_bytes'] / kcla[1]['saved_bytes'] == \
        pytest.approx(2, rel=0.05)
    assert la[2]['saved_bytes'] / la[1]['saved_bytes'] > 2.5


def test_complexity_main(tools, tmp_path, capsys):
    out = tmp_path / 'cx'
    tools['complexity'].main([
        '--depths', '18', '--attentions', 'MRLA-light', '--img-size', '64',
        '--stack-depths', '2', '4', '--stack-channels', '32', '--stack-size',
        '4', '--stack-head-dim', '16', '--stack-mrla-head-dim', '16',
        '--out-dir', str(out)
    ])
    assert 'ResNet-18 MRLA-light' in capsys.readouterr().out
    data = json.loads((out / 'complexity.json').read_text())
    names = [(r['depth'], r['layer_attention']) for r in data['backbones']]
    assert names == [(18, 'none'), (18, 'MRLA-light')]
    assert data['backbones'][0]['params'] == 11_176_512  # ResNet-18
    stack = {(r['kind'], r['depth']): r for r in data['stack']['rows']}
    assert stack['MRLA-light', 4]['flops'] == \
        2 * stack['MRLA-light', 2]['flops']
    assert (out / 'complexity_depth.png').stat().st_size > 1000
    with pytest.raises(SystemExit) as exc:
        tools['complexity'].parse_args(['--stack-head-dim', '48'])
    assert exc.value.code == 2
    assert '--stack-head-dim (48) must divide' in capsys.readouterr().err
