"""Effective layer-attention weights and head gates of a backbone, one image.

For every attention layer of a ResNetKCLA backbone this tool plots how much
its aggregate draws on each earlier layer of its stage, per head:

KCLA (docs/method.md §2). The aggregate A = U / (Z + eps) with
U = sum_s w_s X^s and Z = sum_s w_s is a softmax-like average of the layers
in the state:

    a_ts = w_s / (Z_t + eps),   w_s = exp(min(|K^s_g| * s_g, 10))

per head g, over the layers s of the current state. The cross-stage adapter
(docs/method.md §3) re-initialises the state at every init layer (block 0 of a
stage, and block 11 of long stages) with U = z A', Z = z: everything before
it enters as one extra source, the entry "carried state", whose weight is
z / (Z_t + eps). The weights are non-negative and sum to Z_t / (Z_t + eps),
i.e. to 1 up to eps / Z_t <= eps (every w, z >= 1). The tool recomputes w,
z and the gate from each layer's own submodules (q_conv, k_conv, norm_d,
gate, adapter) on the layer's input (forward pre-hooks) and checks that the
sum of the weights equals the Z of the state the layer returns.

MRLA-light (docs/method.md §6): o_t = gate_t * DWConv(X^t) + lambda_t * X_in,t,
out_t = X^t + BN_t(o_t). Inside a stage X_in,t = out_{t-1} (no downsample
after block 0), and in eval mode BN_r(o) = alpha_r * o + beta_r with
alpha_r = gamma_r / sqrt(running_var_r + eps_bn). Unrolling the lambda path,
o_t = sum_{s <= t} e_ts * DWConv(X^s) + (terms in X^r, beta_r and the first
block's input), with per-channel coefficients

    e_tt = gate_t,   e_ts = gate_s * prod_{r = s+1..t} lambda_r * alpha_{r-1}

so earlier layers decay geometrically through products of lambda (and of
the BN scales; lambda = 1 and alpha ~ 1 at initialisation). The tool
reports e_ts averaged over each head's channels; they are not normalised.
The head gates are sigmoid(<Q_g, K_g> / sqrt(d)).

LA (standard layer attention): the softmax weights over the layers of the
stage, softmax_s(<Q^t_g, K^s_g> / sqrt(d)).

KCLA's head gates sigmoid(Phi(r)), r_g = <Q_g, K_g> / |K_g|, are plotted
per layer and head. The image is resized to --img-size square and
ImageNet-normalised. Writes OUT_DIR/attention_stage{1..4}.png (the head-mean
weights of every layer, then each layer's per-head weights),
OUT_DIR/gates.png and OUT_DIR/attention_maps.json (all numbers).

Example:
    .venv/bin/python tools/analysis/attention_maps.py demo.jpg out \
        --backbone random --depth 50
    .venv/bin/python tools/analysis/attention_maps.py demo.jpg out \
        --layer-attention MRLA-light
"""
import argparse
import math
import os
import os.path as osp
import sys
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from analysis_utils import (add_backbone_args, attention_input,  # noqa: E402
                            attention_layers, build_backbone,
                            check_backbone_args, fail, heatmap, load_image,
                            new_figure, save_figure, write_json)

# the tool's consistency check: sum of the recomputed KCLA weights vs the
# Z of the layer's own state (relative)
Z_RTOL = 1e-4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('image', help='a jpg/png image')
    parser.add_argument('out_dir', help='where to write PNGs and JSON')
    parser.add_argument('--img-size', type=int, default=224,
                        help='square input size (>= 32)')
    add_backbone_args(parser)
    args = parser.parse_args(argv)
    check_backbone_args(parser, args)
    if args.img_size < 32:
        parser.error(f'--img-size must be >= 32, got {args.img_size}')
    return args


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


@torch.no_grad()
def collect(model: torch.nn.Module, image: torch.Tensor) -> List[dict]:
    """Per attention layer (forward order), what its weights derive from,
    recomputed from its submodules on its input (batch of one image)."""
    from kcla_mm.models.layers import KCLALayer, LayerAttention, MRLALight
    from kcla_mm.models.layers.eca import eca_project
    from kcla_mm.models.layers.kcla import layer_weights
    layers = attention_layers(model)
    records: Dict[str, dict] = {}
    handles = []

    def pre_hook(module, args, kwargs, layer):
        x = attention_input(args, kwargs)
        state = args[1] if len(args) > 1 else kwargs.get('state')
        g = module.num_heads
        pooled = x.mean((2, 3))
        query = eca_project(module.q_conv, pooled, g)
        key = eca_project(module.k_conv, pooled, g)
        rec = dict(name=layer.name, stage=layer.stage, block=layer.block,
                   num_heads=g)
        if isinstance(module, KCLALayer):
            relevance = (query * key).sum(-1) / key.norm(dim=-1).clamp_min(
                module.key_eps)
            rec.update(
                kind='KCLA', eps=module.eps, has_state=state is not None,
                w=_np(layer_weights(key, module.norm_d)[0]),
                gate=_np(torch.sigmoid(
                    F.linear(relevance, module.gate.weight.float()))[0]),
                carried=None)
            if module.adapter is not None and state is not None:
                # computed now: the fused eval path updates states in place
                _, carried_key = module.adapter(state, g, x.shape[2:])
                rec['carried'] = _np(
                    layer_weights(carried_key, module.norm_d)[0])
        elif isinstance(module, MRLALight):
            norm = getattr(module, module.norm_name)
            if getattr(norm, 'running_var', None) is None or norm.training:
                fail(f'{layer.name}: the MRLA-light weights need an eval-mode '
                     'BatchNorm with running statistics')
            alpha = norm.weight / torch.sqrt(norm.running_var + norm.eps)
            rec.update(
                kind='MRLA-light',
                gate=_np(torch.sigmoid(
                    (query * key).sum(-1) * module.scale)[0]),
                lam=_np(module.lambda_t.flatten()), alpha=_np(alpha))
        elif isinstance(module, LayerAttention):
            cache = state
            keys = [] if cache is None or module.reset_cache else \
                [k.float() for k in cache.keys]
            keys = torch.stack(keys + [key], 1)  # (1, T, G, d)
            logits = torch.einsum('bgd,btgd->btg', query, keys) * module.scale
            rec.update(kind='LA', attn=_np(logits.softmax(1)[0]),
                       gate=None)
        else:
            fail(f'{layer.name}: unsupported attention layer '
                 f'{type(module).__name__}')
        records[layer.name] = rec

    def post_hook(module, args, output, layer):
        state = output[1]
        if records[layer.name]['kind'] == 'KCLA':
            records[layer.name]['z_out'] = _np(state.z[0])

    for layer in layers:
        handles.append(layer.module.register_forward_pre_hook(
            lambda m, a, kw, layer=layer: pre_hook(m, a, kw, layer),
            with_kwargs=True))
        handles.append(layer.module.register_forward_hook(
            lambda m, a, o, layer=layer: post_hook(m, a, o, layer)))
    try:
        model(image[None])
    finally:
        for handle in handles:
            handle.remove()
    return [records[layer.name] for layer in layers]


def kcla_weights(records: List[dict]) -> List[dict]:
    """a_ts = w_s / (Z_t + eps) over the sources of each layer's state."""
    out = []
    chain: List[tuple] = []
    for rec in records:
        if rec['carried'] is not None:
            chain = [(f'carried state (block {rec["block"]})', rec['carried'])]
        elif not rec['has_state']:
            chain = []
        chain = chain + [(f'block {rec["block"]}', rec['w'])]
        z = np.sum([w for _, w in chain], axis=0)
        if not np.allclose(z, rec['z_out'], rtol=Z_RTOL, atol=0):
            fail(f'{rec["name"]}: the recomputed Z {z} differs from the '
                 f'layer\'s own {rec["z_out"]}')
        weights = np.stack([w for _, w in chain]) / (z + rec['eps'])
        out.append(
            dict(sources=[s for s, _ in chain], weights=weights,
                 z=z, gate=rec['gate']))
    return out


def mrla_weights(records: List[dict]) -> List[dict]:
    """e_ts = gate_s * prod_{r=s+1..t} lambda_r * alpha_{r-1}, per channel,
    averaged over each head's channels."""
    out = []
    chain: List[tuple] = []  # (source, per-channel coefficient)
    prev = None
    for rec in records:
        g = rec['num_heads']
        channels = len(rec['lam'])
        gate_c = np.repeat(rec['gate'], channels // g)
        if rec['block'] == 0:
            chain = []
        else:  # X_in,t = out_{t-1}: earlier terms scaled by lambda_t alpha
            factor = rec['lam'] * prev['alpha']
            chain = [(s, c * factor) for s, c in chain]
        chain = chain + [(f'block {rec["block"]}', gate_c)]
        weights = np.stack([c.reshape(g, -1).mean(1) for _, c in chain])
        out.append(dict(sources=[s for s, _ in chain], weights=weights,
                        gate=rec['gate']))
        prev = rec
    return out


def la_weights(records: List[dict]) -> List[dict]:
    return [
        dict(sources=[f'block {b}' for b in range(
            rec['block'] - len(rec['attn']) + 1, rec['block'] + 1)],
             weights=rec['attn'], gate=None) for rec in records
    ]


def effective_weights(records: List[dict]) -> List[dict]:
    """Per layer: its sources, weights (sources, G), gate (G,) or None."""
    kind = records[0]['kind']
    fn = dict(KCLA=kcla_weights, LA=la_weights)
    weights = fn.get(kind, mrla_weights)(records)
    for w, rec in zip(weights, records):
        w.update(name=rec['name'], stage=rec['stage'], block=rec['block'])
    return weights


def _stage_columns(layers: List[dict]) -> List[str]:
    columns: List[str] = []
    for layer in layers:
        for source in layer['sources']:
            if source not in columns:
                columns.append(source)
    return columns


def plot_stage(stage: int, layers: List[dict], path: str, title: str,
               kind: str) -> None:
    columns = _stage_columns(layers)
    mean = np.full((len(layers), len(columns)), np.nan)
    for i, layer in enumerate(layers):
        for source, w in zip(layer['sources'], layer['weights']):
            mean[i, columns.index(source)] = np.mean(w)
    ncols = min(len(layers), 4)
    nrows = math.ceil(len(layers) / ncols)
    top = max(3.6, 0.28 * len(layers) + 1.6)  # the head-mean panel
    fig = new_figure(figsize=(4.2 * ncols, top + 3.6 * nrows))[0]
    fig.clf()
    grid = fig.add_gridspec(1 + nrows, ncols,
                            height_ratios=[top] + [3.6] * nrows)
    vmax = 1.0 if kind != 'MRLA-light' else max(1.0, np.nanmax(mean))
    rows = [f'block {layer["block"]}' for layer in layers]
    ax = fig.add_subplot(grid[0, :])
    im = heatmap(ax, mean, rows, columns,
                 f'stage {stage + 1}: mean over heads (row: layer, column: '
                 'source)', 0.0, vmax)
    fig.colorbar(im, ax=ax, fraction=0.03)
    for i, (layer, row) in enumerate(zip(layers, rows)):
        ax = fig.add_subplot(grid[1 + i // ncols, i % ncols])
        w = np.asarray(layer['weights']).T  # (G, sources)
        heatmap(ax, w, [f'head {g}' for g in range(len(w))],
                layer['sources'], f'{row}: per head', 0.0, vmax,
                annotate=w.size <= 32)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, title_space=True)


def plot_gates(weights: List[dict], records: List[dict], path: str,
               title: str) -> None:
    stages = sorted({rec['stage'] for rec in records})
    fig, axes = new_figure(1, len(stages), figsize=(4.5 * len(stages), 3.8),
                           squeeze=False)
    for ax, stage in zip(axes[0], stages):
        idx = [i for i, rec in enumerate(records) if rec['stage'] == stage]
        gates = np.stack([weights[i]['gate'] for i in idx])
        heatmap(ax, gates, [f'block {records[i]["block"]}' for i in idx],
                [str(g) for g in range(gates.shape[1])],
                f'stage {stage + 1}: gate per head', 0.0, 1.0,
                annotate=gates.shape[1] <= 16)
        ax.set_xlabel('head')
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, title_space=True)


DEFINITIONS = {
    'KCLA': 'weights[s][g] = w_s,g / (Z_g + eps), w = exp(min(|K_g| * s_g, '
    '10)), Z = sum of the weights of the sources in the state; the source '
    '"carried state (block j)" is the state re-initialised by the '
    'cross-stage adapter at block j (z = exp(min(|k_u,g| * s_g, 10))); per '
    'head the weights sum to Z / (Z + eps); gate = sigmoid(Phi(r)), '
    'r_g = <Q_g, K_g> / |K_g|',
    'MRLA-light': 'weights[s][g] = mean over the channels of head g of '
    'gate_s * prod_{r=s+1..t} lambda_r * alpha_{r-1}, alpha = BN weight / '
    'sqrt(running_var + eps): the coefficient of DWConv(X^s) in o_t along '
    'the lambda path (not normalised); gate = sigmoid(<Q_g, K_g> / sqrt(d))',
    'LA': 'weights[s][g] = softmax over the layers s of the stage of '
    '<Q^t_g, K^s_g> / sqrt(d)'
}


def main(argv=None):
    args = parse_args(argv)
    if not osp.isfile(args.image):
        fail(f'image {args.image} does not exist')
    try:
        image = load_image(args.image, args.img_size)
    except (OSError, ValueError, SyntaxError) as e:
        fail(f'cannot read image {args.image}: {e}')
    model, info = build_backbone(args)
    records = collect(model, image)
    weights = effective_weights(records)
    kind = records[0]['kind']

    os.makedirs(args.out_dir, exist_ok=True)
    title = (f'{info["source"]} ResNet-{model.depth}-{kind}, '
             f'{osp.basename(args.image)}')
    stages = sorted({rec['stage'] for rec in records})
    for stage in stages:
        layers = [w for w, rec in zip(weights, records)
                  if rec['stage'] == stage]
        plot_stage(stage, layers,
                   osp.join(args.out_dir, f'attention_stage{stage + 1}.png'),
                   title, kind)
    if kind != 'LA':
        plot_gates(weights, records, osp.join(args.out_dir, 'gates.png'),
                   title)
    layers_json = []
    print(f'{title}: effective weight on each source (mean over heads)')
    for rec, w in zip(records, weights):
        entry = dict(name=rec['name'], stage=rec['stage'] + 1,
                     block=rec['block'], sources=w['sources'],
                     weights=np.asarray(w['weights']).tolist(),
                     weight_sum=np.asarray(w['weights']).sum(0).tolist())
        if w['gate'] is not None:
            entry['gate'] = np.asarray(w['gate']).tolist()
        if kind == 'KCLA':
            entry['z'] = w['z'].tolist()
            entry['layer_weight_w'] = rec['w'].tolist()
        if kind == 'MRLA-light':
            entry['lambda_head_mean'] = rec['lam'].reshape(
                rec['num_heads'], -1).mean(1).tolist()
        layers_json.append(entry)
        cells = ' '.join(
            f'{s.replace("carried state", "carried")}={np.mean(v):.3f}'
            for s, v in zip(w['sources'], w['weights']))
        print(f'  {rec["name"]:<14} {cells}')
    write_json(
        dict(
            image=args.image,
            img_size=args.img_size,
            backbone=info,
            layer_attention=kind,
            definition=DEFINITIONS[kind],
            eps=records[0].get('eps'),
            layers=layers_json), osp.join(args.out_dir,
                                          'attention_maps.json'))
    print(f'wrote {len(stages) + (kind != "LA")} PNGs and '
          f'attention_maps.json to {args.out_dir}')


if __name__ == '__main__':
    main()
