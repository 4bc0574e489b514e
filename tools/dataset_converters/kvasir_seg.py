"""Convert Kvasir-SEG (polyp segmentation) to mmseg's layout.

Input: the folder holding the official download as distributed, either
``kvasir-seg.zip`` or the ``Kvasir-SEG/`` folder it extracts to::

    Kvasir-SEG/images/<name>.jpg   (1000 images)
    Kvasir-SEG/masks/<name>.jpg    (same names; JPEG, so noisy)

There is no official split. ``--split`` gives the split sizes for the 1000
images; a copy of another size is split in the same proportions. The
images are permuted with ``numpy.random.default_rng(--seed)`` (default 0):

* ``880-120`` (default): train/val only. Test configs evaluate on val.
* ``800-100-100``: train/val/test.

Output::

    <out>/img_dir/{train,val[,test]}/<name>.jpg   (copied as they are)
    <out>/ann_dir/{train,val[,test]}/<name>.png   (0 background, 1 polyp)

Masks are binarised at 128 (grey value >= 128 is polyp), which removes the
JPEG noise. The output is written atomically; an image without a mask, a
mask without an image or a missing download stops the conversion with exit
code 1 and writes nothing.

Example:
    python tools/dataset_converters/kvasir_seg.py data/downloads \\
        data/kvasir_seg --split 880-120 --seed 0
"""
import argparse
import sys
from typing import Dict

from lesion_seg_utils import (MAX_PIXELS, RawArchive, add_max_pixels_option,
                              check_max_pixels, check_out_dir, check_seed,
                              pair, random_split, run_conversion,
                              write_dataset)

# accepted names of the download: the extracted folder, then the zip file
DOWNLOAD_NAMES = ('Kvasir-SEG', 'kvasir-seg')
IMAGE_PATTERN = r'(?:^|/)images/([^/]+)\.jpg$'
MASK_PATTERN = r'(?:^|/)masks/([^/]+)\.jpg$'
# --split -> split sizes of the 1000 official images
SPLITS = {
    '880-120': {'train': 880, 'val': 120},
    '800-100-100': {'train': 800, 'val': 100, 'test': 100},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('src_dir', help='folder holding kvasir-seg.zip or '
                        'its extracted Kvasir-SEG/ folder')
    parser.add_argument('out_dir', help='dataset root to create')
    parser.add_argument(
        '--split', choices=tuple(SPLITS), default='880-120',
        help='train-val(-test) sizes of the 1000 images; 880-120 writes '
        'train and val only')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the random split')
    parser.add_argument('--overwrite', action='store_true',
                        help='replace an existing non-empty out_dir')
    add_max_pixels_option(parser)
    args = parser.parse_args(argv)
    check_seed(parser, args.seed)
    check_max_pixels(parser, args.max_pixels)
    return args


def convert(src_dir: str, out_dir: str, split: str = '880-120',
            seed: int = 0, overwrite: bool = False,
            max_pixels: int = MAX_PIXELS) -> Dict[str, int]:
    """Convert the download in ``src_dir`` to ``out_dir``.

    Args:
        src_dir (str): Folder holding ``kvasir-seg.zip`` or ``Kvasir-SEG/``.
        out_dir (str): Dataset root to create.
        split (str): A key of ``SPLITS``. Defaults to ``'880-120'``.
        seed (int): Seed of the random split. Defaults to 0.
        overwrite (bool): Replace an existing non-empty ``out_dir``.
            Defaults to False.
        max_pixels (int): Largest image or mask accepted, in pixels.
            Defaults to ``MAX_PIXELS``.

    Returns:
        dict[str, int]: Number of images per split.

    Raises:
        ValueError: If ``split`` is not a key of ``SPLITS``.
        ConversionError: On a missing download, unpaired, unreadable or
            oversized files, or an ``out_dir`` that is, holds or lies inside
            ``src_dir`` or the download.
        FileExistsError: If ``out_dir`` is not empty and not ``overwrite``
            (checked before the downloads are read).
    """
    if split not in SPLITS:
        raise ValueError(
            f'split must be one of {tuple(SPLITS)}, got {split!r}')
    check_out_dir(src_dir, out_dir, overwrite)
    sizes = SPLITS[split]
    total = sum(sizes.values())
    with RawArchive(src_dir, DOWNLOAD_NAMES) as archive:
        samples = pair(archive, IMAGE_PATTERN, archive, MASK_PATTERN)
        splits = random_split(samples, tuple(sizes),
                              [n / total for n in sizes.values()], seed)
        write_dataset(out_dir, splits, overwrite, max_pixels)
    return {name: len(s) for name, s in splits.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    counts = run_conversion(lambda: convert(
        args.src_dir, args.out_dir, args.split, args.seed, args.overwrite,
        args.max_pixels))
    if counts is None:
        return 1
    note = ' (no test split: test configs use val)' if (
        'test' not in counts) else ''
    print(f'Kvasir-SEG written to {args.out_dir} (random {args.split} split, '
          f'seed {args.seed}): '
          + ', '.join(f'{n} {split}' for split, n in counts.items())
          + f' images{note}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
