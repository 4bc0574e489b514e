"""Generate a small COCO-format instance-segmentation dataset.

Images hold a few non-overlapping shapes (one class per shape: circle,
square, triangle) on a textured background, with boxes and polygon masks.
The layout is COCO2017's, so a COCO config only needs ``data_root``::

    <out>/train2017/000000000001.png ...
    <out>/val2017/...
    <out>/annotations/instances_train2017.json, instances_val2017.json

The dataset is deterministic in ``--seed`` and written atomically: it is
generated next to ``<out>`` and renamed into place, so a failed run leaves
no partial dataset.

Example:
    python tools/dataset_converters/make_synthetic_coco.py data/synthetic_coco
"""
import argparse
import json
import math
import os
import os.path as osp
import shutil
import sys
import tempfile
from typing import Dict, List, Tuple

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ('circle', 'square', 'triangle')
# one hue per class (with jitter), so a short CPU training run can learn it
CLASS_COLORS = ((220, 60, 60), (60, 200, 80), (70, 90, 230))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('out_dir', help='dataset root to create')
    parser.add_argument('--num-train', type=int, default=64)
    parser.add_argument('--num-val', type=int, default=16)
    parser.add_argument('--img-size', type=int, default=128,
                        help='square image side in pixels (>= 64)')
    parser.add_argument('--max-objects', type=int, default=4)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--overwrite', action='store_true',
                        help='replace an existing out_dir')
    args = parser.parse_args(argv)
    for name in ('num_train', 'num_val', 'max_objects'):
        if getattr(args, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be >= 1, got '
                         f'{getattr(args, name)}')
    if args.img_size < 64:
        parser.error(f'--img-size must be >= 64, got {args.img_size}')
    if args.seed < 0:  # numpy.random.default_rng's requirement
        parser.error(f'argument --seed: must be an int >= 0, got {args.seed}')
    return args


def shape_polygon(cls: str, cx: float, cy: float, r: float,
                  angle: float) -> List[Tuple[float, float]]:
    """Polygon (x, y) points of a shape of radius ``r`` centred at (cx, cy)."""
    if cls == 'circle':
        n = 24
        return [(cx + r * math.cos(2 * math.pi * i / n),
                 cy + r * math.sin(2 * math.pi * i / n)) for i in range(n)]
    n = 4 if cls == 'square' else 3
    return [(cx + r * math.cos(angle + 2 * math.pi * i / n),
             cy + r * math.sin(angle + 2 * math.pi * i / n)) for i in range(n)]


def polygon_area(points: List[Tuple[float, float]]) -> float:
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    return float(0.5 * abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))))


def make_image(rng: np.random.Generator, size: int, max_objects: int
               ) -> Tuple[Image.Image, List[Dict]]:
    """One image and its objects (class index, polygon, box)."""
    base = rng.integers(90, 160, size=3)
    noise = rng.normal(0, 12, size=(size, size, 3))
    ramp = np.linspace(-20, 20, size)[None, :, None]
    pixels = np.clip(base + noise + ramp, 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels)
    draw = ImageDraw.Draw(img)
    objects, boxes = [], []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        for _attempt in range(20):  # place without overlapping earlier ones
            r = float(rng.uniform(size * 0.08, size * 0.2))
            cx, cy = (float(v) for v in rng.uniform(r + 1, size - r - 1, 2))
            box = (cx - r, cy - r, cx + r, cy + r)
            if all(box[2] < b[0] or b[2] < box[0] or box[3] < b[1]
                   or b[3] < box[1] for b in boxes):
                break
        else:
            continue
        label = int(rng.integers(len(CLASSES)))
        points = shape_polygon(CLASSES[label], cx, cy, r,
                               float(rng.uniform(0, math.pi)))
        color = tuple(
            int(np.clip(c + rng.integers(-25, 26), 0, 255))
            for c in CLASS_COLORS[label])
        draw.polygon(points, fill=color)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        boxes.append(box)
        objects.append(
            dict(label=label, points=points,
                 bbox=(min(xs), min(ys), max(xs) - min(xs),
                       max(ys) - min(ys))))
    return img, objects


def write_split(root: str, split: str, num_images: int, size: int,
                max_objects: int, rng: np.random.Generator) -> Dict:
    """Write one split's images; return its COCO annotation dict."""
    img_dir = osp.join(root, f'{split}2017')
    os.makedirs(img_dir)
    images, annotations = [], []
    for img_id in range(1, num_images + 1):
        img, objects = make_image(rng, size, max_objects)
        file_name = f'{img_id:012d}.png'
        img.save(osp.join(img_dir, file_name))
        images.append(
            dict(id=img_id, file_name=file_name, width=size, height=size))
        for obj in objects:
            annotations.append(
                dict(
                    id=len(annotations) + 1,
                    image_id=img_id,
                    category_id=obj['label'] + 1,
                    bbox=[round(v, 2) for v in obj['bbox']],
                    area=round(polygon_area(obj['points']), 2),
                    segmentation=[[
                        round(v, 2) for p in obj['points'] for v in p
                    ]],
                    iscrowd=0))
    categories = [dict(id=i + 1, name=n) for i, n in enumerate(CLASSES)]
    return dict(images=images, annotations=annotations, categories=categories)


def make_dataset(out_dir: str, num_train: int = 64, num_val: int = 16,
                 img_size: int = 128, max_objects: int = 4, seed: int = 0,
                 overwrite: bool = False) -> str:
    """Create the dataset at ``out_dir`` atomically; return its path."""
    out_dir = osp.abspath(out_dir)
    if osp.exists(out_dir) and not overwrite:
        raise FileExistsError(f'out_dir {out_dir} exists; pass --overwrite '
                              'to replace it')
    parent = osp.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='.synthetic_coco.', dir=parent)
    try:
        rng = np.random.default_rng(seed)
        os.makedirs(osp.join(tmp, 'annotations'))
        for split, num in (('train', num_train), ('val', num_val)):
            coco = write_split(tmp, split, num, img_size, max_objects, rng)
            with open(osp.join(tmp, 'annotations',
                               f'instances_{split}2017.json'), 'w') as f:
                json.dump(coco, f)
        if osp.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        path = make_dataset(args.out_dir, args.num_train, args.num_val,
                            args.img_size, args.max_objects, args.seed,
                            args.overwrite)
    except (FileExistsError, OSError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    print(f'synthetic COCO dataset written to {path} '
          f'({args.num_train} train / {args.num_val} val images, classes '
          f'{", ".join(CLASSES)})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
