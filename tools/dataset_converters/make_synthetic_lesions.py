"""Generate a small synthetic copy of an ISIC 2017/2018 or Kvasir-SEG download.

Images show a textured background (skin-like for ISIC, mucosa-like for
Kvasir) with one or two smooth blob-shaped lesions of a darker, redder
colour; about one lesion in five is small. The files follow the raw layout
and naming of the official download, so the converters in this folder read
them as they read the real data:

* ``isic2017``: ``ISIC-2017_{Training,Validation,Test_v2}_Data/`` with
  ``ISIC_xxxxxxx.jpg`` (+ ``_superpixels.png`` files and a metadata CSV) and
  ``ISIC-2017_*_Part1_GroundTruth/`` with 0/255 ``_segmentation.png`` masks;
* ``isic2018``: ``ISIC2018_Task1-2_{Training,Validation,Test}_Input/`` and
  ``ISIC2018_Task1_*_GroundTruth/`` (validation/test only when
  ``--num-val``/``--num-test`` > 0);
* ``kvasir``: ``Kvasir-SEG/images/<name>.jpg``, ``Kvasir-SEG/masks/<name>.jpg``
  (JPEG masks, so they carry compression noise like the real ones) and
  ``Kvasir-SEG/kavsir_bboxes.json``.

With ``--zip`` each download is written as its zip file instead
(``kvasir-seg.zip`` for Kvasir). The copy is deterministic in ``--seed``
and written atomically (generated next to ``<out>``, renamed into place).

Example:
    python tools/dataset_converters/make_synthetic_lesions.py \\
        data/downloads/isic2017 --layout isic2017 --num-train 40
"""
import argparse
import io
import json
import os
import os.path as osp
import sys
import zipfile
from typing import Dict, Optional, Tuple

import numpy as np
from PIL import Image

import isic2017
import isic2018
from lesion_seg_utils import atomic_output, check_destination, check_seed

LAYOUTS = ('isic2017', 'isic2018', 'kvasir')
DEFAULT_COUNTS = {
    'isic2017': {'train': 20, 'val': 5, 'test': 10},
    'isic2018': {'train': 20, 'val': 5, 'test': 10},
    'kvasir': {'all': 40},
}
# (background, lesion) mean RGB colours per style
COLORS = {
    'skin': ((208, 165, 140), (110, 62, 48)),
    'mucosa': ((215, 125, 100), (160, 45, 45)),
}
KVASIR_DIR, KVASIR_ZIP = 'Kvasir-SEG', 'kvasir-seg'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('out_dir', help='folder to create, holding the '
                        'synthetic downloads')
    parser.add_argument('--layout', choices=LAYOUTS, required=True,
                        help='official download to imitate')
    parser.add_argument('--num-train', type=int,
                        help='ISIC: images in the training download '
                        '(default 20)')
    parser.add_argument('--num-val', type=int,
                        help='ISIC: images in the validation download '
                        '(default 5; isic2018: 0 omits it)')
    parser.add_argument('--num-test', type=int,
                        help='ISIC: images in the test download '
                        '(default 10; isic2018: 0 omits it)')
    parser.add_argument('--num', type=int,
                        help='kvasir: number of images (default 40)')
    parser.add_argument('--img-size', type=int, default=96,
                        help='square image side in pixels (>= 32)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--zip', action='store_true',
                        help='write each download as its zip file')
    parser.add_argument('--overwrite', action='store_true',
                        help='replace an existing non-empty out_dir')
    args = parser.parse_args(argv)
    split_opts = {'train': args.num_train, 'val': args.num_val,
                  'test': args.num_test}
    given = [f'--num-{k}' for k, v in split_opts.items() if v is not None]
    if args.layout == 'kvasir':
        if given:
            parser.error(f'{", ".join(given)} do not apply to --layout '
                         'kvasir (one pool of images); use --num')
        args.counts = {'all': DEFAULT_COUNTS['kvasir']['all']
                       if args.num is None else args.num}
    else:
        if args.num is not None:
            parser.error(f'--num applies to --layout kvasir only, not '
                         f'{args.layout}; use --num-train/--num-val/'
                         '--num-test')
        args.counts = {
            k: DEFAULT_COUNTS[args.layout][k] if v is None else v
            for k, v in split_opts.items()
        }
    try:
        check_counts(args.layout, args.counts)
    except ValueError as e:
        parser.error(str(e))
    if args.img_size < 32:
        parser.error(f'--img-size must be >= 32, got {args.img_size}')
    check_seed(parser, args.seed)
    return args


def check_counts(layout: str, counts: Dict[str, int]) -> None:
    """Raise ValueError unless ``counts`` fits ``layout``.

    Args:
        layout (str): One of ``LAYOUTS``.
        counts (dict[str, int]): Images per download: keys ``train``, ``val``,
            ``test`` for ISIC, ``all`` for Kvasir. Every count must be >= 1,
            except isic2018's val/test (0 omits that download).
    """
    if layout not in LAYOUTS:
        raise ValueError(f'layout must be one of {LAYOUTS}, got {layout!r}')
    allowed = tuple(DEFAULT_COUNTS[layout])
    if tuple(sorted(counts)) != tuple(sorted(allowed)):
        raise ValueError(f'counts for layout {layout} need the keys '
                         f'{allowed}, got {tuple(counts)}')
    for key, num in counts.items():
        least = 0 if layout == 'isic2018' and key != 'train' else 1
        option = '--num' if key == 'all' else f'--num-{key}'
        if num < least:
            raise ValueError(f'{option} must be >= {least} for layout '
                             f'{layout}, got {num}')


def smooth_noise(rng: np.random.Generator, size: int,
                 cells: int) -> np.ndarray:
    """Low-frequency noise, shape (size, size), float32, about N(0, 1)."""
    coarse = rng.normal(0, 1, (cells, cells)).astype(np.float32)
    return np.asarray(
        Image.fromarray(coarse).resize((size, size),
                                       Image.Resampling.BILINEAR))


def blob_alpha(rng: np.random.Generator, size: int,
               small: bool) -> np.ndarray:
    """Soft coverage of one blob-shaped lesion, shape (size, size) in [0, 1].

    The boundary is a circle whose radius is modulated by a few low angular
    harmonics; the edge is about two pixels wide.
    """
    radius = size * (rng.uniform(0.05, 0.08) if small else
                     rng.uniform(0.12, 0.28))
    cx, cy = rng.uniform(radius, size - radius, 2)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dist = np.hypot(xx - cx, yy - cy)
    theta = np.arctan2(yy - cy, xx - cx)
    boundary = np.ones_like(theta)
    for k in (2, 3, 5):
        boundary += rng.uniform(0, 0.4 / k) * np.cos(
            k * theta + rng.uniform(0, 2 * np.pi))
    return np.clip((radius * boundary - dist) / 2 + 0.5, 0, 1)


def make_image(rng: np.random.Generator, size: int,
               style: str) -> Tuple[np.ndarray, np.ndarray]:
    """One image and its lesion mask.

    Args:
        rng (np.random.Generator): Source of randomness.
        size (int): Image side in pixels.
        style (str): ``'skin'`` or ``'mucosa'`` (a key of ``COLORS``).

    Returns:
        tuple[np.ndarray, np.ndarray]: The image, shape (size, size, 3)
        uint8 RGB, and the mask, shape (size, size) bool (True: lesion).
    """
    bg_mean, lesion_mean = (np.array(c, np.float32) for c in COLORS[style])
    bg = bg_mean + rng.uniform(-15, 15, 3)
    img = bg + 12 * smooth_noise(rng, size, 6)[..., None]
    if style == 'mucosa':  # endoscope light: bright centre, dark corners
        yy, xx = np.mgrid[-1:1:size * 1j, -1:1:size * 1j]
        img *= (1.1 - 0.35 * (xx**2 + yy**2))[..., None]
    alpha = np.zeros((size, size), np.float32)
    for _ in range(1 if rng.random() < 0.7 else 2):
        alpha = np.maximum(alpha, blob_alpha(rng, size, rng.random() < 0.2))
    lesion = (lesion_mean + rng.uniform(-15, 15, 3) +
              15 * smooth_noise(rng, size, 8)[..., None])
    img = img * (1 - alpha[..., None]) + lesion * alpha[..., None]
    img += rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8), alpha >= 0.5


def encode(array: np.ndarray, fmt: str, **kwargs) -> bytes:
    """An image array encoded as ``fmt`` (``'JPEG'`` or ``'PNG'``)."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def isic_files(layout: str, counts: Dict[str, int], size: int,
               rng: np.random.Generator) -> Dict[str, bytes]:
    """Files of the ISIC downloads, relative path -> bytes.

    Sample ids ``ISIC_0000000`` ... run on across the splits.
    """
    downloads = (isic2017 if layout == 'isic2017' else isic2018).DOWNLOADS
    # superpixel index maps (isic2017 only), RGB-encoded as in the download
    step = -(-size // 8)
    cells = np.kron(np.arange(64, dtype=np.uint8).reshape(8, 8),
                    np.ones((step, step), np.uint8))[:size, :size]
    superpixels = encode(cells[..., None] * np.array([1, 0, 0], np.uint8),
                         'PNG')
    files, index = {}, 0
    for split, (img_dir, mask_dir) in downloads.items():
        if counts[split] == 0:
            continue
        ids = [f'ISIC_{index + i:07d}' for i in range(counts[split])]
        index += counts[split]
        for name in ids:
            img, mask = make_image(rng, size, 'skin')
            files[f'{img_dir}/{name}.jpg'] = encode(img, 'JPEG', quality=90)
            files[f'{mask_dir}/{name}_segmentation.png'] = encode(
                mask.astype(np.uint8) * 255, 'PNG')
            if layout == 'isic2017':
                files[f'{img_dir}/{name}_superpixels.png'] = superpixels
        if layout == 'isic2017':
            rows = [f'{n},{int(rng.integers(20, 80))},unknown' for n in ids]
            files[f'{img_dir}/{img_dir}_metadata.csv'] = '\n'.join(
                ['image_id,age_approximate,sex'] + rows).encode() + b'\n'
        else:
            for folder in (img_dir, mask_dir):
                files[f'{folder}/LICENSE.txt'] = b'CC-BY-NC (synthetic)\n'
                files[f'{folder}/ATTRIBUTION.txt'] = b'synthetic copy\n'
    return files


def kvasir_files(num: int, size: int,
                 rng: np.random.Generator) -> Dict[str, bytes]:
    """Files of the Kvasir-SEG download, relative path -> bytes.

    Names are 25 random lower-case letters and digits, like the real ones.
    """
    alphabet = np.array(list('abcdefghijklmnopqrstuvwxyz0123456789'))
    names = set()
    while len(names) < num:
        names.add('cju' + ''.join(rng.choice(alphabet, 22)))
    files, boxes = {}, {}
    for name in sorted(names):
        img, mask = make_image(rng, size, 'mucosa')
        files[f'{KVASIR_DIR}/images/{name}.jpg'] = encode(
            img, 'JPEG', quality=90)
        rgb_mask = np.repeat(mask.astype(np.uint8)[..., None] * 255, 3, 2)
        files[f'{KVASIR_DIR}/masks/{name}.jpg'] = encode(
            rgb_mask, 'JPEG', quality=75)
        ys, xs = np.nonzero(mask)
        boxes[name] = dict(
            height=size, width=size,
            bbox=[dict(label='polyp', xmin=int(xs.min()), ymin=int(ys.min()),
                       xmax=int(xs.max()), ymax=int(ys.max()))]
            if len(xs) else [])
    files[f'{KVASIR_DIR}/kavsir_bboxes.json'] = json.dumps(boxes).encode()
    return files


def write_files(root: str, files: Dict[str, bytes], as_zip: bool) -> None:
    """Write the files under ``root``, or one zip file per top folder.

    Zip members carry a fixed timestamp, so the zip files are deterministic.
    """
    if not as_zip:
        for path, data in files.items():
            os.makedirs(osp.join(root, osp.dirname(path)), exist_ok=True)
            with open(osp.join(root, path), 'wb') as f:
                f.write(data)
        return
    tops = sorted({path.split('/')[0] for path in files})
    for top in tops:
        stem = KVASIR_ZIP if top == KVASIR_DIR else top
        with zipfile.ZipFile(osp.join(root, stem + '.zip'), 'w',
                             zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(p for p in files if p.startswith(top + '/')):
                zf.writestr(zipfile.ZipInfo(path, (1980, 1, 1, 0, 0, 0)),
                            files[path], zipfile.ZIP_DEFLATED)


def make_dataset(out_dir: str, layout: str,
                 counts: Optional[Dict[str, int]] = None, img_size: int = 96,
                 seed: int = 0, as_zip: bool = False,
                 overwrite: bool = False) -> str:
    """Create the synthetic download at ``out_dir``; return its path.

    Args:
        out_dir (str): Folder to create.
        layout (str): One of ``LAYOUTS``.
        counts (dict[str, int], optional): Images per download (see
            :func:`check_counts`). Defaults to ``DEFAULT_COUNTS[layout]``.
        img_size (int): Square image side in pixels. Defaults to 96.
        seed (int): Seed; equal arguments give identical files. Defaults
            to 0.
        as_zip (bool): Write each download as its zip file. Defaults to
            False.
        overwrite (bool): Replace an existing non-empty ``out_dir``.
            Defaults to False.

    Raises:
        ValueError: If ``layout`` or ``counts`` is invalid.
        FileExistsError: If ``out_dir`` is not empty and not ``overwrite``.
    """
    if counts is None:
        counts = DEFAULT_COUNTS.get(layout, {})
    check_counts(layout, counts)
    out_dir = osp.abspath(out_dir)
    check_destination(out_dir, overwrite)
    with atomic_output(out_dir) as tmp:
        rng = np.random.default_rng(seed)
        if layout == 'kvasir':
            files = kvasir_files(counts['all'], img_size, rng)
        else:
            files = isic_files(layout, counts, img_size, rng)
        write_files(tmp, files, as_zip)
    return out_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        path = make_dataset(args.out_dir, args.layout, args.counts,
                            args.img_size, args.seed, args.zip,
                            args.overwrite)
    except (FileExistsError, OSError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    counts = ', '.join(f'{n} {k}' for k, n in args.counts.items()
                       if k != 'all') or str(args.counts.get('all'))
    print(f'synthetic {args.layout} download written to {path} ({counts}'
          f' images of {args.img_size}x{args.img_size}'
          + (', zipped' if args.zip else '') + ')')
    return 0


if __name__ == '__main__':
    sys.exit(main())
