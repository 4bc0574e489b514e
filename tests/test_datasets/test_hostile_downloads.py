"""The lesion converters given careless or hostile downloads: each stops with
one ``error: <what>, <which file>`` line and exit code 1, without a
traceback, and leaves the file system as it was (inputs untouched, no output,
no temporary or parent folders), also when stopped by SIGTERM or Ctrl-C.

Covered for every converter (ISIC 2017, ISIC 2018, Kvasir-SEG): an output
that is, or lies inside, a download (``--overwrite`` included); images cut
after their JPEG scan header; headers claiming 50000x50000 pixels; a zip
member over the size limit; FIFOs, devices and symlinks leaving the
download; broken, encrypted and unsupported zip members; undecodable files
named by their path; failures under missing parent folders; SIGTERM and
SIGINT mid-conversion; output permissions from the umask. ISIC 2017's
official splits must not share an image.
"""
import os
import os.path as osp
import shutil
import signal
import stat
import struct
import subprocess
import sys
import zipfile
import zlib

import pytest

from ..test_tools.helpers import tree_snapshot
from .helpers import ROOT

import isic2017  # isort:skip (path set by helpers)
import isic2018  # isort:skip
import kvasir_seg  # isort:skip
import lesion_seg_utils as utils  # isort:skip
import make_synthetic_lesions as gen  # isort:skip

# layout -> (tool, counts, images download, masks download, mask suffix)
LAYOUTS = {
    'isic2017': (isic2017, {'train': 2, 'val': 1, 'test': 1},
                 'ISIC-2017_Training_Data',
                 'ISIC-2017_Training_Part1_GroundTruth', '.png'),
    'isic2018': (isic2018, {'train': 6, 'val': 0, 'test': 0},
                 'ISIC2018_Task1-2_Training_Input',
                 'ISIC2018_Task1_Training_GroundTruth', '.png'),
    'kvasir': (kvasir_seg, {'all': 6}, 'Kvasir-SEG/images',
               'Kvasir-SEG/masks', '.jpg'),
}
# the zip file each layout's train images and masks are in
ZIPS = {
    'isic2017': ('ISIC-2017_Training_Data.zip',
                 'ISIC-2017_Training_Part1_GroundTruth.zip'),
    'isic2018': ('ISIC2018_Task1-2_Training_Input.zip',
                 'ISIC2018_Task1_Training_GroundTruth.zip'),
    'kvasir': ('kvasir-seg.zip', 'kvasir-seg.zip'),
}
all_layouts = pytest.mark.parametrize('layout', list(LAYOUTS))


def make_raw(tmp_path, layout, as_zip=False):
    return gen.make_dataset(str(tmp_path / 'raw'), layout,
                            LAYOUTS[layout][1], img_size=32, as_zip=as_zip)


def first(raw, layout, which):
    """Path of the first image (``which=2``) or mask (3) of the train
    download, extracted layout."""
    folder = osp.join(raw, LAYOUTS[layout][which])
    suffix = '.jpg' if which == 2 else LAYOUTS[layout][4]
    return osp.join(folder, sorted(n for n in os.listdir(folder)
                                   if n.endswith(suffix))[0])


def first_member(raw, layout, which):
    """(zip path, first image (``which=2``) or mask (3) member) of the
    train download, zip layout."""
    path = osp.join(raw, ZIPS[layout][which - 2])
    folder = LAYOUTS[layout][which] + '/'
    suffix = '.jpg' if which == 2 else LAYOUTS[layout][4]
    with zipfile.ZipFile(path) as zf:
        return path, sorted(m for m in zf.namelist() if folder in m
                            and m.endswith(suffix))[0]


def run_main(tool, argv):
    """``tool.main(argv)`` as the command line runs it: its exit code, and
    SystemExit (argparse) turned into one."""
    try:
        return tool.main(argv)
    except SystemExit as e:
        return e.code


def assert_refused(tool, argv, capsys, tmp_path, *fragments):
    """Exit code 1, one ``error:`` message naming ``fragments``, no
    traceback, and nothing under ``tmp_path`` changed; returns the
    message."""
    before = tree_snapshot(tmp_path)
    assert run_main(tool, argv) == 1
    err = capsys.readouterr().err
    assert err.startswith('error: ') and 'Traceback' not in err, err
    for fragment in fragments:
        assert fragment in err, err
    assert tree_snapshot(tmp_path) == before
    return err


def write_zip_member(path, member, data=None, stream=None,
                     compress_type=zipfile.ZIP_DEFLATED):
    """Rewrite the zip at ``path`` with ``member`` replaced by ``data``
    (or written from the ``stream`` generator of chunks)."""
    with zipfile.ZipFile(path) as zf:
        kept = [(i, zf.read(i)) for i in zf.infolist() if i.filename != member]
    with zipfile.ZipFile(path, 'w') as zf:
        for info, content in kept:
            zf.writestr(info, content)
        if stream is None:
            zf.writestr(member, data, compress_type=compress_type)
        else:
            with zf.open(zipfile.ZipInfo(member), 'w',
                         force_zip64=True) as f:
                for chunk in stream:
                    f.write(chunk)


def patch_central_entry(path, member, offset, value_format, value):
    """Overwrite a field at ``offset`` of ``member``'s central directory
    entry."""
    with open(path, 'rb') as f:
        data = bytearray(f.read())
    name = member.encode()
    start = 0
    while True:
        start = data.index(b'PK\x01\x02', start)
        name_len = struct.unpack_from('<H', data, start + 28)[0]
        if data[start + 46:start + 46 + name_len] == name:
            break
        start += 4
    struct.pack_into(value_format, data, start + offset, value)
    with open(path, 'wb') as f:
        f.write(data)


def cut_after_scan_header(jpeg):
    """A JPEG cut a few bytes after its start-of-scan marker."""
    return jpeg[:jpeg.index(b'\xff\xda') + 20]


def png_header(width, height):
    """A PNG whose header claims ``width`` x ``height`` grey pixels."""
    def chunk(kind, body):
        return (struct.pack('>I', len(body)) + kind + body +
                struct.pack('>I', zlib.crc32(kind + body)))
    return (b'\x89PNG\r\n\x1a\n' +
            chunk(b'IHDR', struct.pack('>IIBBBBB', width, height, 8, 0, 0,
                                       0, 0)) +
            chunk(b'IDAT', zlib.compress(b'\x00' * 16)) + chunk(b'IEND', b''))


def jpeg_claiming(jpeg, width, height):
    """``jpeg`` with its frame header claiming ``width`` x ``height``."""
    data = bytearray(jpeg)
    sof = data.index(b'\xff\xc0')
    struct.pack_into('>HH', data, sof + 5, height, width)
    return bytes(data)


def read(path):
    with open(path, 'rb') as f:
        return f.read()


def write(path, data):
    with open(path, 'wb') as f:
        f.write(data)


# --------------------------------------------------------------------------
# outputs that would reach an input
# --------------------------------------------------------------------------
@all_layouts
@pytest.mark.parametrize('how', [
    'is the download', 'lies inside the download', 'is the zip download',
    'is a symlink to the download'
])
def test_output_reaching_a_download_is_refused(layout, how, tmp_path,
                                               capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout, as_zip=how == 'is the zip download')
    download = osp.join(raw, LAYOUTS[layout][2].split('/')[0])
    out = {
        'is the download': download,
        'lies inside the download': osp.join(raw, LAYOUTS[layout][2], 'new'),
        'is the zip download': osp.join(raw, ZIPS[layout][0]),
        'is a symlink to the download': str(tmp_path / 'link'),
    }[how]
    if how == 'is a symlink to the download':
        os.symlink(download, out)
    assert_refused(tool, [raw, out, '--overwrite'], capsys, tmp_path,
                   f'out_dir {out}', 'download')


# --------------------------------------------------------------------------
# images and masks: decoded in full, within a pixel limit
# --------------------------------------------------------------------------
@all_layouts
def test_image_cut_after_its_scan_header_is_refused(layout, tmp_path,
                                                    capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    image = first(raw, layout, 2)
    write(image, cut_after_scan_header(read(image)))
    assert_refused(tool, [raw, str(tmp_path / 'out')], capsys, tmp_path,
                   osp.relpath(image, raw).split('/', 1)[1])


@all_layouts
def test_mask_claiming_50000x50000_pixels_is_refused(layout, tmp_path,
                                                     capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    mask = first(raw, layout, 3)
    bomb = png_header(50000, 50000) if mask.endswith('.png') else \
        jpeg_claiming(read(mask), 50000, 50000)
    write(mask, bomb)
    assert_refused(tool, [raw, str(tmp_path / 'out')], capsys, tmp_path,
                   osp.basename(mask), '2500000000 pixels',
                   '--max-pixels 67108864')


@all_layouts
def test_image_over_max_pixels_is_refused(layout, tmp_path, capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    images = osp.join(raw, LAYOUTS[layout][2].split('/')[0])
    assert_refused(tool, [raw, str(tmp_path / 'out'), '--max-pixels', '1000'],
                   capsys, tmp_path, f'.jpg in {images} is 32x32 = 1024 '
                   'pixels, over --max-pixels 1000')


@all_layouts
def test_undecodable_image_is_named_by_its_path(layout, tmp_path, capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout, as_zip=True)
    path, member = first_member(raw, layout, 2)
    write_zip_member(path, member, b'not an image')
    err = assert_refused(tool, [raw, str(tmp_path / 'out')], capsys,
                         tmp_path, f'error: cannot read {member} in {path}')
    assert 'BytesIO' not in err


@pytest.mark.parametrize('value', ['0', '-5', str(2**40)])
def test_max_pixels_outside_its_range_is_an_option_error(value, tmp_path,
                                                         capsys):
    with pytest.raises(SystemExit) as e:
        kvasir_seg.main([str(tmp_path), str(tmp_path / 'out'),
                         '--max-pixels', value])
    assert e.value.code == 2
    assert 'argument --max-pixels: must be an int in [1, ' in \
        capsys.readouterr().err


# --------------------------------------------------------------------------
# zip members: bounded reads, every zipfile error as a message
# --------------------------------------------------------------------------
@all_layouts
def test_zip_member_over_the_size_limit_is_refused(layout, tmp_path, capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout, as_zip=True)
    path, member = first_member(raw, layout, 3)
    chunk = bytes(2**24)
    write_zip_member(path, member, stream=(chunk for _ in range(17)))
    assert_refused(tool, [raw, str(tmp_path / 'out')], capsys, tmp_path,
                   f'{member} in {path}', '285212672 bytes',
                   'limit is 268435456')


@all_layouts
def test_zip_member_with_a_bad_crc_is_refused(layout, tmp_path, capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout, as_zip=True)
    path, member = first_member(raw, layout, 2)
    with zipfile.ZipFile(path) as zf:
        data = zf.read(member)
    write_zip_member(path, member, data, compress_type=zipfile.ZIP_STORED)
    content = bytearray(read(path))
    at = content.index(data) + len(data) // 2
    content[at] ^= 0xFF
    write(path, bytes(content))
    assert_refused(tool, [raw, str(tmp_path / 'out')], capsys, tmp_path,
                   f'{member} in {path}', 'CRC')


@all_layouts
@pytest.mark.parametrize('field, offset, value, reason', [
    ('compression method', 10, 99, 'compression method is not supported'),
    ('encryption flag', 8, 0x1, 'is encrypted'),
])
def test_zip_member_that_zipfile_cannot_read_is_refused(
        layout, field, offset, value, reason, tmp_path, capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout, as_zip=True)
    path, member = first_member(raw, layout, 2)
    patch_central_entry(path, member, offset, '<H', value)
    assert_refused(tool, [raw, str(tmp_path / 'out')], capsys, tmp_path,
                   f'{member} in {path}', reason)


# --------------------------------------------------------------------------
# extracted downloads: only regular files inside the download
# --------------------------------------------------------------------------
@all_layouts
def test_symlink_to_a_device_is_refused(layout, tmp_path, capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    mask = first(raw, layout, 3)
    os.remove(mask)
    os.symlink('/dev/zero', mask)
    assert_refused(tool, [raw, str(tmp_path / 'out')], capsys, tmp_path,
                   osp.basename(mask), '/dev/zero')


@all_layouts
def test_symlink_leaving_the_download_is_refused(layout, tmp_path, capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    image = first(raw, layout, 2)
    outside = str(tmp_path / 'elsewhere.jpg')
    shutil.move(image, outside)
    os.symlink(outside, image)
    assert_refused(tool, [raw, str(tmp_path / 'out')], capsys, tmp_path,
                   osp.basename(image), 'outside the download')


@all_layouts
def test_fifo_in_place_of_a_mask_is_refused_without_waiting(layout,
                                                            tmp_path):
    """Run as a command, with a timeout: reading a FIFO blocks forever."""
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    mask = first(raw, layout, 3)
    os.remove(mask)
    os.mkfifo(mask)
    before = tree_snapshot(tmp_path)
    result = subprocess.run(
        [sys.executable, tool.__file__, raw, str(tmp_path / 'out')],
        capture_output=True, text=True, timeout=120,
        cwd=osp.join(ROOT, 'tools', 'dataset_converters'))
    assert result.returncode == 1
    assert result.stderr.startswith('error: ')
    assert osp.basename(mask) in result.stderr
    assert 'not a regular file' in result.stderr
    assert tree_snapshot(tmp_path) == before


# --------------------------------------------------------------------------
# nothing left behind; permissions
# --------------------------------------------------------------------------
@all_layouts
def test_failure_leaves_no_parent_folders(layout, tmp_path, capsys):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    image = first(raw, layout, 2)
    write(image, b'not an image')
    assert_refused(tool, [raw, str(tmp_path / 'a' / 'b' / 'out')], capsys,
                   tmp_path, osp.basename(image))


@all_layouts
@pytest.mark.parametrize('how', ['SIGTERM', 'SIGINT'])
def test_signal_mid_conversion_removes_the_partial_output(
        layout, how, tmp_path, capsys, monkeypatch):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    calls = []
    write_sample = utils.write_sample

    def interrupted_after_one(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            os.kill(os.getpid(), getattr(signal, how))
        return write_sample(*args, **kwargs)

    monkeypatch.setattr(utils, 'write_sample', interrupted_after_one)
    assert_refused(tool, [raw, str(tmp_path / 'a' / 'out')], capsys,
                   tmp_path, 'interrupted', 'nothing written')
    assert len(calls) == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@all_layouts
@pytest.mark.parametrize('umask', [0o022, 0o027])
def test_output_permissions_follow_the_umask(layout, umask, tmp_path):
    tool = LAYOUTS[layout][0]
    raw = make_raw(tmp_path, layout)
    out = str(tmp_path / 'out')
    old = os.umask(umask)
    try:
        assert tool.main([raw, out]) == 0
    finally:
        os.umask(old)
    for d, dirs, files in os.walk(out):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o777 & ~umask, d
        for name in files:
            mode = stat.S_IMODE(os.stat(osp.join(d, name)).st_mode)
            assert mode == 0o666 & ~umask, name


# --------------------------------------------------------------------------
# splits
# --------------------------------------------------------------------------
def test_isic2017_image_in_two_official_splits_is_refused(tmp_path, capsys):
    raw = make_raw(tmp_path, 'isic2017')
    for download, name in (('ISIC-2017_Validation_Data', 'ISIC_0000000.jpg'),
                           ('ISIC-2017_Validation_Part1_GroundTruth',
                            'ISIC_0000000_segmentation.png')):
        train = download.replace('Validation', 'Training')
        shutil.copy(osp.join(raw, train, name), osp.join(raw, download, name))
    assert_refused(isic2017, [raw, str(tmp_path / 'out')], capsys, tmp_path,
                   'ISIC_0000000', 'train', 'val')
