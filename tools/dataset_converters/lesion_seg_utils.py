"""Shared pieces of the lesion-segmentation converters (ISIC, Kvasir-SEG).

The converters read an official download as distributed, either its zip
files or the folders they extract to, pair every image with its mask, split
the pairs and write mmsegmentation's layout::

    <out>/img_dir/{train,val,test}/<id>.jpg
    <out>/ann_dir/{train,val,test}/<id>.png

Images are copied byte for byte when they already are JPEG (re-encoded as
JPEG otherwise). Masks are written as single-channel PNGs holding 0
(background) and 1 (lesion): a mask is converted to grey first (RGB masks
included) and a pixel is lesion when its grey value is >= ``MASK_THRESHOLD``
(128). This keeps 0/255 masks exact, binarises ISIC masks that hold other
values and removes the compression noise of Kvasir-SEG's JPEG masks.

The output is built in a temporary folder next to ``<out>`` and renamed into
place at the end; bad input (a missing download, an image without a mask, a
mask without an image, an unreadable file) raises :class:`ConversionError`
before anything is left on disk.
"""
import io
import os
import os.path as osp
import re
import shutil
import tempfile
import zipfile
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

MASK_THRESHOLD = 128
NUM_NAMED = 5  # file names an error message lists before the count


class ConversionError(Exception):
    """Bad input: a missing download, unpaired or unreadable files."""


def name_files(paths: Sequence[str]) -> str:
    """``'a, b, c, ... (12 files)'``: the first few names and the count."""
    shown = ', '.join(paths[:NUM_NAMED])
    more = ', ...' if len(paths) > NUM_NAMED else ''
    noun = 'file' if len(paths) == 1 else 'files'
    return f'{shown}{more} ({len(paths)} {noun})'


class RawArchive:
    """One official download, read from its zip file or extracted folder.

    ``<root>/<name>/`` (the extracted folder) is used when it exists, else
    ``<root>/<name>.zip``; the names are tried in order. Files are listed
    recursively, so a folder extracted one level deeper works too; macOS
    metadata (``__MACOSX/``, ``._*``) is skipped.

    Args:
        root (str): Folder holding the downloads.
        names (Sequence[str]): Accepted names of the download, without
            ``.zip``.

    Raises:
        ConversionError: If none of the folders or zip files exists, or a
            zip file cannot be read.
    """

    def __init__(self, root: str, names: Sequence[str]) -> None:
        self._zip: Optional[zipfile.ZipFile] = None
        candidates = [osp.join(root, n) for n in names] + [
            osp.join(root, n + '.zip') for n in names
        ]
        found = [p for p in candidates if osp.isdir(p) or osp.isfile(p)]
        if not found:
            raise ConversionError(
                f'missing download in src_dir {root}: none of '
                f'{", ".join(candidates)} exists')
        self.path = found[0]
        if osp.isdir(self.path):
            members = [
                osp.relpath(osp.join(d, f), self.path).replace(os.sep, '/')
                for d, _, files in os.walk(self.path) for f in files
            ]
        else:
            try:
                self._zip = zipfile.ZipFile(self.path)
            except (zipfile.BadZipFile, OSError) as e:
                raise ConversionError(f'cannot read {self.path}: {e}') from e
            members = [m for m in self._zip.namelist() if not m.endswith('/')]
        self.members = sorted(
            m for m in members if '__MACOSX/' not in m
            and not osp.basename(m).startswith('._'))

    def read(self, member: str) -> bytes:
        """The bytes of one file, given its path inside the download."""
        if self._zip is not None:
            return self._zip.read(member)
        with open(osp.join(self.path, member), 'rb') as f:
            return f.read()

    def match(self, pattern: str) -> Dict[str, str]:
        """Map sample id -> file path for the files matching ``pattern``.

        Args:
            pattern (str): Regular expression searched in each file's path
                inside the download; its first group is the sample id.

        Raises:
            ConversionError: If no file matches or an id appears twice.
        """
        regex = re.compile(pattern)
        found: Dict[str, str] = {}
        duplicates = []
        for member in self.members:
            m = regex.search(member)
            if m is None:
                continue
            if m.group(1) in found:
                duplicates.append(member)
            found[m.group(1)] = member
        if duplicates:
            raise ConversionError(
                f'{self.path}: duplicate sample ids in '
                f'{name_files(duplicates)}')
        if not found:
            raise ConversionError(
                f'{self.path}: no file matches {pattern!r}')
        return found

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def __enter__(self) -> 'RawArchive':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sample(NamedTuple):
    """An image and its mask, each a file inside a download."""
    name: str
    images: RawArchive
    image: str
    masks: RawArchive
    mask: str


def pair(images: RawArchive, image_pattern: str, masks: RawArchive,
         mask_pattern: str) -> List[Sample]:
    """Pair images with masks by sample id; sorted by id.

    Args:
        images (RawArchive): Download holding the images.
        image_pattern (str): Regex for image paths; group 1 is the id.
        masks (RawArchive): Download holding the masks (may be ``images``).
        mask_pattern (str): Regex for mask paths; group 1 is the id.

    Raises:
        ConversionError: Naming the images without a mask and the masks
            without an image, if any.
    """
    img_files = images.match(image_pattern)
    mask_files = masks.match(mask_pattern)
    problems = []
    lonely = sorted(img_files.keys() - mask_files.keys())
    if lonely:
        problems.append(f'images without a mask in {images.path}: '
                        f'{name_files([img_files[i] for i in lonely])}')
    lonely = sorted(mask_files.keys() - img_files.keys())
    if lonely:
        problems.append(f'masks without an image in {masks.path}: '
                        f'{name_files([mask_files[i] for i in lonely])}')
    if problems:
        raise ConversionError('; '.join(problems))
    return [
        Sample(name, images, img_files[name], masks, mask_files[name])
        for name in sorted(img_files)
    ]


def split_counts(total: int, fractions: Sequence[float]) -> List[int]:
    """Sizes of the splits: ``round(total * f)`` each, the first takes the
    rest (so 2594 images at 0.7/0.1/0.2 give 1816/259/519).

    Raises:
        ConversionError: If a split would be empty.
    """
    rest = [int(round(total * f)) for f in fractions[1:]]
    counts = [total - sum(rest)] + rest
    if min(counts) < 1:
        raise ConversionError(
            f'cannot split {total} images into fractions {list(fractions)}: '
            f'a split would be empty ({counts})')
    return counts


def random_split(samples: Sequence[Sample], splits: Sequence[str],
                 fractions: Sequence[float],
                 seed: int) -> Dict[str, List[Sample]]:
    """Split samples at random, deterministically in ``seed``.

    The samples are sorted by name, permuted by
    ``numpy.random.default_rng(seed)`` and cut into consecutive pieces of
    :func:`split_counts` sizes; each piece is sorted by name again.

    Args:
        samples (Sequence[Sample]): All samples.
        splits (Sequence[str]): Split names, e.g. ``('train', 'val')``.
        fractions (Sequence[float]): One fraction per split.
        seed (int): Seed of the permutation.
    """
    ordered = sorted(samples, key=lambda s: s.name)
    order = np.random.default_rng(seed).permutation(len(ordered))
    result, start = {}, 0
    for split, count in zip(splits, split_counts(len(ordered), fractions)):
        picked = [ordered[i] for i in order[start:start + count]]
        result[split] = sorted(picked, key=lambda s: s.name)
        start += count
    return result


def binarize_mask(mask: Image.Image) -> np.ndarray:
    """Lesion mask as 0/1: grey value >= ``MASK_THRESHOLD`` is lesion.

    Args:
        mask (PIL.Image.Image): A mask of any mode; RGB and others are
            converted to grey (``'L'``) first.

    Returns:
        np.ndarray: Shape (H, W), dtype uint8, values in {0, 1}.
    """
    if mask.mode != 'L':
        mask = mask.convert('L')
    return (np.asarray(mask) >= MASK_THRESHOLD).astype(np.uint8)


def _decode(data: bytes, member: str, archive: RawArchive,
            load: bool) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        if load:
            img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ConversionError(
            f'cannot read {member} in {archive.path}: {e}') from e
    return img


def write_sample(sample: Sample, img_path: str, mask_path: str) -> None:
    """Write one image (JPEG) and its 0/1 mask (PNG).

    Raises:
        ConversionError: If a file cannot be decoded or the mask's size
            differs from the image's.
    """
    data = sample.images.read(sample.image)
    # a JPEG is only parsed up to its size, then copied as it is
    img = _decode(data, sample.image, sample.images, load=False)
    mask = binarize_mask(
        _decode(sample.masks.read(sample.mask), sample.mask, sample.masks,
                load=True))
    if mask.shape != (img.height, img.width):
        raise ConversionError(
            f'{sample.mask} is {mask.shape[1]}x{mask.shape[0]} but '
            f'{sample.image} is {img.width}x{img.height}')
    if img.format == 'JPEG':
        with open(img_path, 'wb') as f:
            f.write(data)
    else:
        img.convert('RGB').save(img_path, format='JPEG', quality=95)
    Image.fromarray(mask).save(mask_path, format='PNG')


def check_out_dir(src_dir: str, out_dir: str, overwrite: bool) -> None:
    """Check ``out_dir`` before reading anything: refuse one that is
    ``src_dir`` or holds it (writing the dataset replaces ``out_dir``,
    downloads included), and an existing non-empty one without
    ``overwrite`` (:func:`check_destination`).

    Raises:
        ConversionError: Naming both folders.
        FileExistsError: Naming ``out_dir`` and ``--overwrite``.
    """
    src, out = osp.realpath(src_dir), osp.realpath(out_dir)
    if src == out or src.startswith(out.rstrip(os.sep) + os.sep):
        raise ConversionError(
            f'out_dir {out_dir} must not be src_dir {src_dir} or a folder '
            'containing it: the converted dataset replaces out_dir; '
            'allowed: a folder outside the downloads')
    check_destination(osp.abspath(out_dir), overwrite)


def check_seed(parser, seed: int) -> None:
    """``parser.error`` (exit code 2) unless ``--seed`` is >= 0, as
    ``numpy.random.default_rng`` requires."""
    if seed < 0:
        parser.error(f'argument --seed: must be an int >= 0, got {seed}')


def check_destination(out_dir: str, overwrite: bool) -> None:
    """Refuse an existing non-empty ``out_dir`` unless ``overwrite``.

    Raises:
        FileExistsError: Naming ``out_dir`` and ``--overwrite``.
    """
    if osp.lexists(out_dir) and not overwrite and not (
            osp.isdir(out_dir) and not os.listdir(out_dir)):
        raise FileExistsError(
            f'out_dir {out_dir} exists and is not empty; pass --overwrite '
            'to replace it')


def publish(tmp_dir: str, out_dir: str) -> None:
    """Move the finished ``tmp_dir`` to ``out_dir``, replacing it."""
    if osp.lexists(out_dir):
        old = tmp_dir + '.old'
        os.replace(out_dir, old)
        os.replace(tmp_dir, out_dir)
        if osp.isdir(old) and not osp.islink(old):
            shutil.rmtree(old)
        else:
            os.remove(old)
    else:
        os.replace(tmp_dir, out_dir)


def write_dataset(out_dir: str, splits: Dict[str, Sequence[Sample]],
                  overwrite: bool = False) -> str:
    """Write the mmseg layout atomically; return the absolute ``out_dir``.

    Args:
        out_dir (str): Dataset root to create.
        splits (dict[str, Sequence[Sample]]): Samples per split name.
        overwrite (bool): Replace an existing non-empty ``out_dir``.
            Defaults to False.

    Raises:
        FileExistsError: If ``out_dir`` is not empty and not ``overwrite``.
        ConversionError: If a file cannot be converted (nothing is written).
    """
    out_dir = osp.abspath(out_dir)
    check_destination(out_dir, overwrite)
    parent = osp.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{osp.basename(out_dir)}.', dir=parent)
    try:
        for split, samples in splits.items():
            img_dir = osp.join(tmp, 'img_dir', split)
            ann_dir = osp.join(tmp, 'ann_dir', split)
            os.makedirs(img_dir)
            os.makedirs(ann_dir)
            for sample in samples:
                write_sample(sample, osp.join(img_dir, sample.name + '.jpg'),
                             osp.join(ann_dir, sample.name + '.png'))
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
