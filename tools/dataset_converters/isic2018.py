"""Convert ISIC 2018 Task 1 (lesion segmentation) to mmseg's layout.

Input: the folder holding the official downloads as distributed, each
either as its zip file or as the folder it extracts to::

    ISIC2018_Task1-2_{Training,Validation,Test}_Input(.zip)
        ISIC_xxxxxxx.jpg                    (2594 / 100 / 1000 images)
    ISIC2018_Task1_{Training,Validation,Test}_GroundTruth(.zip)
        ISIC_xxxxxxx_segmentation.png

The validation and test downloads are optional. ``--split`` chooses:

* ``random`` (default): the 2594 training images are split at random,
  seeded by ``--seed`` (default 0), 70/10/20 into train/val/test
  (1816/259/519); the usual protocol of papers on ISIC 2018.
* ``official``: train is the training download, val and test are the
  official validation (100) and test (1000) downloads, which must exist.

Output::

    <out>/img_dir/{train,val,test}/ISIC_xxxxxxx.jpg   (copied as they are)
    <out>/ann_dir/{train,val,test}/ISIC_xxxxxxx.png   (0 background, 1 lesion)

Masks are binarised at 128 (grey value >= 128 is lesion). The output is
written atomically; an image without a mask, a mask without an image or a
missing download stops the conversion with exit code 1 and writes nothing.

Example:
    python tools/dataset_converters/isic2018.py data/downloads/isic2018 \\
        data/isic2018 --split random --seed 0
"""
import argparse
import contextlib
import sys
from typing import Dict

from lesion_seg_utils import (MAX_PIXELS, RawArchive,
                              add_max_pixels_option, check_max_pixels,
                              check_out_dir, check_seed, pair, random_split,
                              run_conversion, write_dataset)

# split -> (images download, masks download)
DOWNLOADS = {
    'train': ('ISIC2018_Task1-2_Training_Input',
              'ISIC2018_Task1_Training_GroundTruth'),
    'val': ('ISIC2018_Task1-2_Validation_Input',
            'ISIC2018_Task1_Validation_GroundTruth'),
    'test': ('ISIC2018_Task1-2_Test_Input', 'ISIC2018_Task1_Test_GroundTruth'),
}
IMAGE_PATTERN = r'(?:^|/)(ISIC_\d{7})\.jpg$'
MASK_PATTERN = r'(?:^|/)(ISIC_\d{7})_segmentation\.png$'
SPLIT_MODES = ('random', 'official')
RANDOM_FRACTIONS = {'train': 0.7, 'val': 0.1, 'test': 0.2}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('src_dir', help='folder holding the ISIC 2018 '
                        'downloads (zip files or extracted folders)')
    parser.add_argument('out_dir', help='dataset root to create')
    parser.add_argument(
        '--split', choices=SPLIT_MODES, default='random',
        help='random: seeded 70/10/20 split of the training images; '
        'official: the official validation and test downloads')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the random split')
    parser.add_argument('--overwrite', action='store_true',
                        help='replace an existing non-empty out_dir')
    add_max_pixels_option(parser)
    args = parser.parse_args(argv)
    check_seed(parser, args.seed)
    check_max_pixels(parser, args.max_pixels)
    return args


def convert(src_dir: str, out_dir: str, split: str = 'random', seed: int = 0,
            overwrite: bool = False,
            max_pixels: int = MAX_PIXELS) -> Dict[str, int]:
    """Convert the downloads in ``src_dir`` to ``out_dir``.

    Args:
        src_dir (str): Folder holding the official downloads.
        out_dir (str): Dataset root to create.
        split (str): ``'random'`` (seeded 70/10/20 split of the training
            images) or ``'official'`` (official val/test downloads).
            Defaults to ``'random'``.
        seed (int): Seed of the random split. Defaults to 0.
        overwrite (bool): Replace an existing non-empty ``out_dir``.
            Defaults to False.
        max_pixels (int): Largest image or mask accepted, in pixels.
            Defaults to ``MAX_PIXELS``.

    Returns:
        dict[str, int]: Number of images per split.

    Raises:
        ValueError: If ``split`` is not one of ``SPLIT_MODES``.
        ConversionError: On a missing download, unpaired, unreadable or
            oversized files, an image in two splits, or an ``out_dir`` that
            is, holds or lies inside ``src_dir`` or a download.
        FileExistsError: If ``out_dir`` is not empty and not ``overwrite``
            (checked before the downloads are read).
    """
    if split not in SPLIT_MODES:
        raise ValueError(f'split must be one of {SPLIT_MODES}, got {split!r}')
    check_out_dir(src_dir, out_dir, overwrite)
    used = ('train', ) if split == 'random' else tuple(DOWNLOADS)
    with contextlib.ExitStack() as stack:
        samples = {}
        for name in used:
            images, masks = DOWNLOADS[name]
            img_src = stack.enter_context(RawArchive(src_dir, [images]))
            mask_src = stack.enter_context(RawArchive(src_dir, [masks]))
            samples[name] = pair(img_src, IMAGE_PATTERN, mask_src,
                                 MASK_PATTERN)
        if split == 'random':
            samples = random_split(samples['train'], tuple(RANDOM_FRACTIONS),
                                   tuple(RANDOM_FRACTIONS.values()), seed)
        write_dataset(out_dir, samples, overwrite, max_pixels)
    return {name: len(s) for name, s in samples.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    counts = run_conversion(lambda: convert(
        args.src_dir, args.out_dir, args.split, args.seed, args.overwrite,
        args.max_pixels))
    if counts is None:
        return 1
    how = ('official validation/test downloads' if args.split == 'official'
           else f'random 70/10/20 split of the training images, seed '
           f'{args.seed}')
    print(f'ISIC 2018 written to {args.out_dir} ({how}): '
          + ', '.join(f'{n} {split}' for split, n in counts.items())
          + ' images')
    return 0


if __name__ == '__main__':
    sys.exit(main())
