"""Convert ISIC 2017 Task 1 (lesion segmentation) to mmseg's layout.

Input: the folder holding the official downloads as distributed, each
either as its zip file or as the folder it extracts to::

    ISIC-2017_{Training,Validation,Test_v2}_Data(.zip)
        ISIC_xxxxxxx.jpg
    ISIC-2017_{Training,Validation,Test_v2}_Part1_GroundTruth(.zip)
        ISIC_xxxxxxx_segmentation.png

(``*_superpixels.png`` and the metadata CSV are ignored.) The official
split is kept: 2000 train / 150 val / 600 test images. Output::

    <out>/img_dir/{train,val,test}/ISIC_xxxxxxx.jpg   (copied as they are)
    <out>/ann_dir/{train,val,test}/ISIC_xxxxxxx.png   (0 background, 1 lesion)

Masks are binarised at 128 (grey value >= 128 is lesion). The output is
written atomically; an image without a mask, a mask without an image or a
missing download stops the conversion with exit code 1 and writes nothing.

Example:
    python tools/dataset_converters/isic2017.py data/downloads/isic2017 \\
        data/isic2017
"""
import argparse
import contextlib
import sys
from typing import Dict

from lesion_seg_utils import (MAX_PIXELS, RawArchive,
                              add_max_pixels_option, check_max_pixels,
                              check_out_dir, pair, run_conversion,
                              write_dataset)

# split -> (images download, masks download)
DOWNLOADS = {
    'train': ('ISIC-2017_Training_Data',
              'ISIC-2017_Training_Part1_GroundTruth'),
    'val': ('ISIC-2017_Validation_Data',
            'ISIC-2017_Validation_Part1_GroundTruth'),
    'test': ('ISIC-2017_Test_v2_Data', 'ISIC-2017_Test_v2_Part1_GroundTruth'),
}
IMAGE_PATTERN = r'(?:^|/)(ISIC_\d{7})\.jpg$'
MASK_PATTERN = r'(?:^|/)(ISIC_\d{7})_segmentation\.png$'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('src_dir', help='folder holding the ISIC 2017 '
                        'downloads (zip files or extracted folders)')
    parser.add_argument('out_dir', help='dataset root to create')
    parser.add_argument('--overwrite', action='store_true',
                        help='replace an existing non-empty out_dir')
    add_max_pixels_option(parser)
    args = parser.parse_args(argv)
    check_max_pixels(parser, args.max_pixels)
    return args


def convert(src_dir: str, out_dir: str, overwrite: bool = False,
            max_pixels: int = MAX_PIXELS) -> Dict[str, int]:
    """Convert the downloads in ``src_dir`` to ``out_dir``.

    Args:
        src_dir (str): Folder holding the official downloads.
        out_dir (str): Dataset root to create.
        overwrite (bool): Replace an existing non-empty ``out_dir``.
            Defaults to False.
        max_pixels (int): Largest image or mask accepted, in pixels.
            Defaults to ``MAX_PIXELS``.

    Returns:
        dict[str, int]: Number of images per split.

    Raises:
        ConversionError: On a missing download, unpaired, unreadable or
            oversized files, an image in two splits, or an ``out_dir`` that
            is, holds or lies inside ``src_dir`` or a download.
        FileExistsError: If ``out_dir`` is not empty and not ``overwrite``
            (checked before the downloads are read).
    """
    check_out_dir(src_dir, out_dir, overwrite)
    with contextlib.ExitStack() as stack:
        splits = {}
        for split, (images, masks) in DOWNLOADS.items():
            img_src = stack.enter_context(RawArchive(src_dir, [images]))
            mask_src = stack.enter_context(RawArchive(src_dir, [masks]))
            splits[split] = pair(img_src, IMAGE_PATTERN, mask_src,
                                 MASK_PATTERN)
        write_dataset(out_dir, splits, overwrite, max_pixels)
    return {split: len(samples) for split, samples in splits.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    counts = run_conversion(lambda: convert(
        args.src_dir, args.out_dir, args.overwrite, args.max_pixels))
    if counts is None:
        return 1
    print(f'ISIC 2017 written to {args.out_dir} (official split): '
          + ', '.join(f'{n} {split}' for split, n in counts.items())
          + ' images (the full dataset has 2000 / 150 / 600)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
