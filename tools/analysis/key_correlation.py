"""Cosine similarity of the KCLA keys of the layers within each stage.

The paper's central observation (docs/method.md §1): the keys K^s of the layers
of a stage point in nearly the same direction, so softmax(Q.K^s) depends on
s only through |K^s|. For every attention layer of a ResNetKCLA backbone this
tool computes the key of each image, K = Conv1d_k(GAP(X)) (B, C) with X the
block output the layer receives (docs/method.md §2, step 1; read by a forward
pre-hook, the key recomputed from the layer's own ``k_conv``), and for every
pair of layers (s, t) of a stage (all of them have C channels):

    cos(s, t) = mean over the N images of <K^s_n, K^t_n> / (|K^s_n| |K^t_n|)

i.e. the per-image cosine averaged over images (its standard deviation over
images is reported too). The per-head variant (keys split into G heads of d
channels, cosine per head, mean over heads, then over images) is in the JSON,
and so is the same cosine for the pooled inputs GAP(X) themselves (the
summary's last column): the keys inherit their alignment from them through
each layer's own Conv1d_k.

Images (jpg/jpeg/png in IMAGE_DIR) are resized to --img-size square
(bilinear, aspect ratio not kept) and ImageNet-normalised. Writes
OUT_DIR/key_cosine_stage{1..4}.png (annotated heatmaps) and
OUT_DIR/key_correlation.json (all numbers), and prints a summary.

Example:
    .venv/bin/python tools/analysis/key_correlation.py --backbone random \
        --depth 50 data/images work_dirs/key_correlation
    .venv/bin/python tools/analysis/key_correlation.py --backbone config \
        --config configs/detection/faster-rcnn_r50-kcla_fpn_1x_coco.py \
        --checkpoint work_dirs/faster-rcnn/epoch_12.pth data/images out
"""
import argparse
import os
import os.path as osp
import sys
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from analysis_utils import (add_backbone_args, attention_input,  # noqa: E402
                            attention_layers, build_backbone,
                            check_backbone_args, fail, find_images, heatmap,
                            load_images, new_figure, save_figure, write_json)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('image_dir', help='folder of jpg/png images')
    parser.add_argument('out_dir', help='where to write PNGs and JSON')
    parser.add_argument('--img-size', type=int, default=224,
                        help='square input size (>= 32)')
    parser.add_argument('--max-images', type=int, default=None,
                        help='use at most this many images (sorted by name)')
    parser.add_argument('--batch-size', type=int, default=8)
    add_backbone_args(parser)
    args = parser.parse_args(argv)
    check_backbone_args(parser, args)
    if args.img_size < 32:
        parser.error(f'--img-size must be >= 32, got {args.img_size}')
    if args.max_images is not None and args.max_images < 1:
        parser.error(f'--max-images must be >= 1, got {args.max_images}')
    if args.batch_size < 1:
        parser.error(f'--batch-size must be >= 1, got {args.batch_size}')
    return args


@torch.no_grad()
def collect_keys(model: torch.nn.Module, images: torch.Tensor,
                 batch_size: int = 8) -> Dict[str, Tuple[torch.Tensor,
                                                         torch.Tensor]]:
    """GAP(X) (N, C) and K = Conv1d_k(GAP(X)) (N, G, d) of every attention
    layer, float32.

    X is the input of the layer (the block output), captured by a forward
    pre-hook; the key is recomputed from the layer's ``k_conv`` exactly as
    the layer does (docs/method.md §2, step 1).
    """
    from kcla_mm.models.layers.eca import eca_project
    layers = attention_layers(model)
    pooled: Dict[str, List[torch.Tensor]] = {l.name: [] for l in layers}
    keys: Dict[str, List[torch.Tensor]] = {l.name: [] for l in layers}
    handles = []
    for layer in layers:
        def hook(module, args, kwargs, name=layer.name):
            gap = attention_input(args, kwargs).mean((2, 3))
            pooled[name].append(gap)
            keys[name].append(eca_project(module.k_conv, gap,
                                          module.num_heads))
        handles.append(layer.module.register_forward_pre_hook(
            hook, with_kwargs=True))
    try:
        for start in range(0, len(images), batch_size):
            model(images[start:start + batch_size])
    finally:
        for handle in handles:
            handle.remove()
    return {name: (torch.cat(pooled[name]), torch.cat(keys[name]))
            for name in keys}


def key_cosines(keys: List[torch.Tensor]) -> Dict[str, np.ndarray]:
    """Pairwise cosines of the keys of L layers, each (N, G, d).

    Returns mean and std over the N images of the per-image cosine of the
    whole keys (L, L), and the mean over images of the per-head cosine
    averaged over heads (L, L).
    """
    flat = torch.stack([F.normalize(k.flatten(1), dim=1) for k in keys], 1)
    per_image = torch.einsum('nsc,ntc->nst', flat, flat)  # (N, L, L)
    heads = torch.stack([F.normalize(k, dim=2) for k in keys], 1)
    per_head = torch.einsum('nsgd,ntgd->nstg', heads, heads).mean(-1)
    return dict(
        mean=per_image.mean(0).double().numpy(),
        std=per_image.std(0, unbiased=False).double().numpy(),
        per_head_mean=per_head.mean(0).double().numpy())


def off_diagonal(matrix: np.ndarray) -> np.ndarray:
    return matrix[~np.eye(len(matrix), dtype=bool)]


def analyse(model: torch.nn.Module, images: torch.Tensor,
            batch_size: int = 8) -> List[dict]:
    """One dict per stage: layer names, cosine matrices, key norms."""
    collected = collect_keys(model, images, batch_size)
    layers = attention_layers(model)
    stages = []
    for stage in sorted({layer.stage for layer in layers}):
        names = [layer.name for layer in layers if layer.stage == stage]
        stage_keys = [collected[name][1] for name in names]
        cos = key_cosines(stage_keys)
        gap_cos = key_cosines([collected[name][0][:, None] for name in names])
        off = off_diagonal(cos['mean'])
        gap_off = off_diagonal(gap_cos['mean'])
        stages.append(
            dict(
                stage=stage + 1,
                channels=int(stage_keys[0].shape[1] * stage_keys[0].shape[2]),
                num_heads=int(stage_keys[0].shape[1]),
                layers=names,
                cosine=cos['mean'].tolist(),
                cosine_std_over_images=cos['std'].tolist(),
                cosine_per_head=cos['per_head_mean'].tolist(),
                mean_off_diagonal=float(off.mean()) if off.size else None,
                min_off_diagonal=float(off.min()) if off.size else None,
                gap_cosine=gap_cos['mean'].tolist(),
                gap_mean_off_diagonal=float(gap_off.mean())
                if gap_off.size else None,
                key_norm_mean=[
                    float(k.flatten(1).norm(dim=1).mean()) for k in stage_keys
                ]))
    return stages


def plot_stage(stage: dict, path: str, title: str) -> None:
    matrix = np.asarray(stage['cosine'])
    n = len(matrix)
    fig, ax = new_figure(figsize=(2.5 + 0.45 * n, 2 + 0.4 * n))
    labels = [name.split('_attn.')[-1] for name in stage['layers']]
    labels = [f'block {b}' for b in labels]
    im = heatmap(ax, matrix, labels, labels,
                 f'{title}\nstage {stage["stage"]} ({stage["channels"]} ch): '
                 'key cosine, mean over images', vmin=min(0.0, matrix.min()),
                 vmax=1.0)
    fig.colorbar(im, ax=ax, fraction=0.046)
    save_figure(fig, path)


def _fmt(value) -> str:
    return '-' if value is None else f'{value:.4f}'


def main(argv=None):
    args = parse_args(argv)
    paths = find_images(args.image_dir)
    if args.max_images is not None:
        paths = paths[:args.max_images]
    images, names, skipped = load_images(paths, args.img_size)
    if not names:
        fail(f'no readable images (jpg/jpeg/png) in {args.image_dir}' +
             (f' ({len(skipped)} unreadable)' if skipped else ''))
    for path in skipped:
        print(f'warning: skipped unreadable image {path}', file=sys.stderr)
    model, info = build_backbone(args)
    stages = analyse(model, images, args.batch_size)

    os.makedirs(args.out_dir, exist_ok=True)
    title = (f'{info["source"]} ResNet-{model.depth}-'
             f'{info["layer_attention"]}, {len(names)} images')
    print(f'{title}; cosine of the keys K = Conv1d_k(GAP(X)) between the '
          'layers of each stage (mean over images of the per-image cosine)')
    print(f'  {"stage":>5} {"layers":>6} {"channels":>8} '
          f'{"mean off-diag":>14} {"min off-diag":>13} {"GAP(X) mean":>12}')
    for stage in stages:
        path = osp.join(args.out_dir, f'key_cosine_stage{stage["stage"]}.png')
        plot_stage(stage, path, title)
        print(f'  {stage["stage"]:>5} {len(stage["layers"]):>6} '
              f'{stage["channels"]:>8} '
              f'{_fmt(stage["mean_off_diagonal"]):>14} '
              f'{_fmt(stage["min_off_diagonal"]):>13} '
              f'{_fmt(stage["gap_mean_off_diagonal"]):>12}')
    write_json(
        dict(
            backbone=info,
            depth=model.depth,
            img_size=args.img_size,
            images=[osp.basename(p) for p in names],
            skipped_images=[osp.basename(p) for p in skipped],
            key='K = Conv1d_k(GAP(X)) of each attention layer, X its input '
            '(the block output); shape (C,) per image, or (G, d) per head',
            averaging='cosine[s][t] = mean over images of the per-image '
            'cosine of the keys of layers s and t; cosine_std_over_images is '
            'its standard deviation over images; cosine_per_head = mean over '
            'images of the mean over heads of the per-head cosine; '
            'gap_cosine: the same cosine for the pooled inputs GAP(X) the '
            'keys are computed from',
            stages=stages),
        osp.join(args.out_dir, 'key_correlation.json'))
    print(f'wrote {len(stages)} PNGs and key_correlation.json to '
          f'{args.out_dir}')


if __name__ == '__main__':
    main()
