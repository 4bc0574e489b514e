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

Every download is treated as possibly hostile: only regular files inside
it are read (no FIFOs, devices or symlinks leading out of an extracted
download), each read is bounded (:data:`MAX_FILE_BYTES`), every image and
mask is decoded in full within a pixel limit (``--max-pixels``), and the
output may not be, hold or lie inside any download it reads.

The output is built in a temporary folder next to ``<out>`` and renamed into
place at the end, with the permissions the umask gives; bad input (a missing
download, an image without a mask, a mask without an image, an unreadable
file) raises :class:`ConversionError` before anything is left on disk, no
temporary or parent folder included, and so does SIGTERM
(:func:`run_conversion`).
"""
import argparse
import contextlib
import io
import os
import os.path as osp
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import warnings
import zipfile
from typing import (Callable, Dict, Iterator, List, NamedTuple, Optional,
                    Sequence)
from zlib import error as zlib_error

import numpy as np
from PIL import Image

MASK_THRESHOLD = 128
NUM_NAMED = 5  # file names an error message lists before the count
# the largest file (zip member or extracted file) read: ISIC's largest
# images are about 10 MB
MAX_FILE_BYTES = 256 * 2**20
READ_CHUNK = 2**20
# default --max-pixels: 8192 x 8192 (ISIC's largest images hold about 30 M)
MAX_PIXELS = 2**26
# PIL refuses images over twice its MAX_IMAGE_PIXELS whatever is asked
PIL_PIXEL_LIMIT = 2 * Image.MAX_IMAGE_PIXELS


class ConversionError(Exception):
    """Bad input: a missing download, unpaired or unreadable files."""


def add_max_pixels_option(parser: argparse.ArgumentParser) -> None:
    """``--max-pixels``: the largest image or mask accepted, in pixels."""
    parser.add_argument(
        '--max-pixels', type=int, default=MAX_PIXELS,
        help=f'refuse an image or mask of more pixels (default '
        f'{MAX_PIXELS} = 8192 x 8192; at most {PIL_PIXEL_LIMIT}); files '
        f'over {MAX_FILE_BYTES} bytes are refused too')


def check_max_pixels(parser: argparse.ArgumentParser, value: int) -> None:
    """``parser.error`` (exit code 2) unless 1 <= ``value`` <= PIL's own
    limit."""
    if not 1 <= value <= PIL_PIXEL_LIMIT:
        parser.error(f'argument --max-pixels: must be an int in [1, '
                     f'{PIL_PIXEL_LIMIT}], got {value}')


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
        self._real = osp.realpath(self.path)
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
        """The bytes of one file, given its path inside the download.

        Raises:
            ConversionError: Naming the file, if it is over
                :data:`MAX_FILE_BYTES`, not a regular file, a symlink out
                of the extracted download, an encrypted, broken or
                unsupported zip member, or unreadable.
        """
        where = f'{member} in {self.path}'
        try:
            if self._zip is not None:
                return self._read_member(member, where)
            return self._read_file(member, where)
        except (OSError, EOFError, RuntimeError, NotImplementedError,
                zipfile.BadZipFile, zlib_error) as e:
            raise ConversionError(f'cannot read {where}: {e}') from e

    def _read_member(self, member: str, where: str) -> bytes:
        info = self._zip.getinfo(member)
        if info.flag_bits & 0x1:
            raise ConversionError(f'{where} is encrypted')
        _check_size(info.file_size, where)
        with self._zip.open(info) as f:
            return _read_bounded(f, where)

    def _read_file(self, member: str, where: str) -> bytes:
        real = osp.realpath(osp.join(self.path, member))
        if not _is_within(real, self._real):
            raise ConversionError(
                f'{where} is a link to {real}, outside the download')
        if not stat.S_ISREG(os.stat(real).st_mode):  # before opening it
            raise ConversionError(f'{where} is not a regular file')
        # O_NONBLOCK: should it become a FIFO meanwhile, opening it does
        # not wait for a writer
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, 'rb') as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConversionError(f'{where} is not a regular file')
            _check_size(st.st_size, where)
            return _read_bounded(f, where)

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

    def overlaps(self, path: str) -> bool:
        """Whether ``path`` (resolved) is this download, holds it or lies
        inside it."""
        real = osp.realpath(path)
        return _is_within(real, self._real) or _is_within(self._real, real)

    def __enter__(self) -> 'RawArchive':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_within(path: str, folder: str) -> bool:
    """Whether the resolved ``path`` is ``folder`` or lies inside it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_size(size: int, where: str) -> None:
    if size > MAX_FILE_BYTES:
        raise ConversionError(f'{where} holds {size} bytes; the limit is '
                              f'{MAX_FILE_BYTES}')


def _read_bounded(f, where: str) -> bytes:
    """All of ``f``, in chunks, refusing more than :data:`MAX_FILE_BYTES`
    (a zip member's or a file's stated size may be wrong)."""
    chunks, size = [], 0
    while True:
        chunk = f.read(READ_CHUNK)
        if not chunk:
            return b''.join(chunks)
        size += len(chunk)
        _check_size(size, where)
        chunks.append(chunk)


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


def decode(data: bytes, member: str, archive: RawArchive,
           max_pixels: int) -> Image.Image:
    """Decode an image or mask in full (a file cut short fails here).

    Raises:
        ConversionError: Naming the file, if it is over ``max_pixels`` or
            cannot be decoded.
    """
    where = f'{member} in {archive.path}'
    try:
        with warnings.catch_warnings():
            # the pixel limit below is the one that applies
            warnings.simplefilter('ignore', Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > max_pixels:
                raise ConversionError(
                    f'{where} is {img.width}x{img.height} = '
                    f'{img.width * img.height} pixels, over --max-pixels '
                    f'{max_pixels}')
            img.load()
    except ConversionError:
        raise
    except Image.DecompressionBombError as e:
        raise ConversionError(
            f'{where} is over --max-pixels {max_pixels}: {e}') from e
    except Exception as e:  # noqa: BLE001 (PIL's decoders raise many types)
        reason = 'not an image that PIL can decode' if isinstance(
            e, Image.UnidentifiedImageError) else f'{type(e).__name__}: {e}'
        raise ConversionError(f'cannot read {where}: {reason}') from e
    return img


def write_sample(sample: Sample, img_path: str, mask_path: str,
                 max_pixels: int = MAX_PIXELS) -> None:
    """Write one image (JPEG) and its 0/1 mask (PNG).

    Raises:
        ConversionError: If a file cannot be read or decoded in full, is
            over ``max_pixels``, or the mask's size differs from the
            image's.
    """
    data = sample.images.read(sample.image)
    img = decode(data, sample.image, sample.images, max_pixels)
    mask = binarize_mask(
        decode(sample.masks.read(sample.mask), sample.mask, sample.masks,
               max_pixels))
    if mask.shape != (img.height, img.width):
        raise ConversionError(
            f'{sample.mask} is {mask.shape[1]}x{mask.shape[0]} but '
            f'{sample.image} is {img.width}x{img.height}')
    if img.format == 'JPEG':  # a JPEG is copied as it is
        with open(img_path, 'wb') as f:
            f.write(data)
    else:
        img.convert('RGB').save(img_path, format='JPEG', quality=95)
    Image.fromarray(mask).save(mask_path, format='PNG')


def check_out_dir(src_dir: str, out_dir: str, overwrite: bool) -> None:
    """Check ``out_dir`` before reading anything: refuse one that is
    ``src_dir`` or holds it (writing the dataset replaces ``out_dir``,
    downloads included), and an existing non-empty one without
    ``overwrite`` (:func:`check_destination`). :func:`write_dataset` checks
    it against each download read as well.

    Raises:
        ConversionError: Naming both folders.
        FileExistsError: Naming ``out_dir`` and ``--overwrite``.
    """
    if _is_within(osp.realpath(src_dir), osp.realpath(out_dir)):
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


def missing_folders(folder: str) -> List[str]:
    """The folders ``os.makedirs(folder)`` would create, outermost first."""
    missing = []
    while not osp.isdir(folder) and folder != osp.dirname(folder):
        missing.append(folder)
        folder = osp.dirname(folder)
    return missing[::-1]


def remove_folders(folders: Sequence[str]) -> None:
    """Remove those of ``folders`` that exist, innermost first, while they
    are empty."""
    for path in reversed(folders):
        if not osp.isdir(path):
            continue
        try:
            os.rmdir(path)
        except OSError:  # something else put a file there meanwhile
            return


def check_inputs(out_dir: str, splits: Dict[str, Sequence[Sample]]) -> None:
    """Refuse an ``out_dir`` that is, holds or lies inside a download the
    samples come from, and a sample id in more than one split.

    Raises:
        ConversionError: Naming the download, or the ids and their splits.
    """
    archives = {a.path: a for samples in splits.values() for s in samples
                for a in (s.images, s.masks)}
    for path, archive in archives.items():
        if archive.overlaps(out_dir):
            raise ConversionError(
                f'out_dir {out_dir} is, holds or lies inside the download '
                f'{path}: writing the dataset would replace it; allowed: a '
                'folder outside the downloads')
    seen: Dict[str, List[str]] = {}
    for split, samples in splits.items():
        for sample in samples:
            seen.setdefault(sample.name, []).append(split)
    shared = [f'{name} ({", ".join(where)})' for name, where in seen.items()
              if len(where) > 1]
    if shared:
        raise ConversionError(
            f'sample ids in more than one split (the splits would share '
            f'images): {name_files(shared)}')


def write_dataset(out_dir: str, splits: Dict[str, Sequence[Sample]],
                  overwrite: bool = False,
                  max_pixels: int = MAX_PIXELS) -> str:
    """Write the mmseg layout atomically; return the absolute ``out_dir``.

    Args:
        out_dir (str): Dataset root to create.
        splits (dict[str, Sequence[Sample]]): Samples per split name.
        overwrite (bool): Replace an existing non-empty ``out_dir``.
            Defaults to False.
        max_pixels (int): Largest image or mask accepted, in pixels.
            Defaults to :data:`MAX_PIXELS`.

    Raises:
        FileExistsError: If ``out_dir`` is not empty and not ``overwrite``.
        ConversionError: If ``out_dir`` overlaps a download, a sample id is
            in two splits or a file cannot be converted (nothing is
            written, no folder created).
    """
    check_inputs(out_dir, splits)
    out_dir = osp.abspath(out_dir)
    check_destination(out_dir, overwrite)
    with atomic_output(out_dir) as tmp:
        for split, samples in splits.items():
            img_dir = osp.join(tmp, 'img_dir', split)
            ann_dir = osp.join(tmp, 'ann_dir', split)
            os.makedirs(img_dir)
            os.makedirs(ann_dir)
            for sample in samples:
                write_sample(sample, osp.join(img_dir, sample.name + '.jpg'),
                             osp.join(ann_dir, sample.name + '.png'),
                             max_pixels)
    return out_dir


@contextlib.contextmanager
def atomic_output(out_dir: str) -> Iterator[str]:
    """Yield a temporary folder next to the absolute ``out_dir`` to write
    into; on success it replaces ``out_dir`` with the permissions the umask
    gives, on any error (SIGTERM and Ctrl-C included) it is removed with
    the parent folders made for it."""
    missing = missing_folders(osp.dirname(out_dir))
    tmp = None
    try:
        for folder in missing:
            os.mkdir(folder)
        tmp = tempfile.mkdtemp(prefix=f'.{osp.basename(out_dir)}.',
                               dir=osp.dirname(out_dir))
        yield tmp
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0700
        publish(tmp, out_dir)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_folders(missing)
        raise


def current_umask() -> int:
    """The process's umask (reading it means setting it: set it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


class Interrupted(ConversionError):
    """SIGTERM during a conversion (Ctrl-C raises KeyboardInterrupt)."""


def _interrupt(signum, frame) -> None:
    raise Interrupted(f'interrupted by {signal.Signals(signum).name}; '
                      'nothing written')


def run_conversion(convert: Callable[[], Dict[str, int]]
                   ) -> Optional[Dict[str, int]]:
    """Run ``convert()`` as a command does: SIGTERM and Ctrl-C stop it as
    an error does (the partial output removed); every failure prints one
    ``error: ...`` line. Returns ``convert()``'s counts, or None on
    failure."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return convert()
    except KeyboardInterrupt:
        print('error: interrupted by SIGINT; nothing written',
              file=sys.stderr)
    except (ConversionError, FileExistsError, OSError) as e:
        print(f'error: {e}', file=sys.stderr)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return None
