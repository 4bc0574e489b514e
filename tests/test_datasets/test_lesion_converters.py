"""ISIC 2017/2018 and Kvasir-SEG converters: splits, masks, bad input."""
import io
import os
import os.path as osp
import shutil
import zipfile

import numpy as np
import pytest
from PIL import Image

from .helpers import COUNTS, IMG_SIZE, files_of

import isic2017  # isort:skip (path set by helpers)
import isic2018  # isort:skip
import kvasir_seg  # isort:skip
import lesion_seg_utils as utils  # isort:skip
import make_synthetic_lesions as gen  # isort:skip

SPLITS = ('train', 'val', 'test')


def check_output(out, expected_counts):
    """Every split holds ``n`` JPEG images, each with a 0/1 PNG mask of its
    size; return {split: sorted ids}."""
    assert sorted(os.listdir(osp.join(out, 'img_dir'))) == sorted(
        expected_counts)
    ids = {}
    for split, n in expected_counts.items():
        imgs = sorted(os.listdir(osp.join(out, 'img_dir', split)))
        masks = sorted(os.listdir(osp.join(out, 'ann_dir', split)))
        assert len(imgs) == n
        assert [m[:-4] for m in masks] == [i[:-4] for i in imgs]
        assert all(i.endswith('.jpg') for i in imgs)
        for name in imgs:
            img = Image.open(osp.join(out, 'img_dir', split, name))
            mask = Image.open(
                osp.join(out, 'ann_dir', split, name[:-4] + '.png'))
            assert (img.format, mask.format, mask.mode) == ('JPEG', 'PNG',
                                                            'L')
            assert img.size == mask.size == (IMG_SIZE, IMG_SIZE)
            values = set(np.unique(np.asarray(mask)))
            assert values <= {0, 1} and 1 in values
        ids[split] = [i[:-4] for i in imgs]
    return ids


def raw_image(raw, name):
    """Bytes of the raw image ``name`` (any split, folder layout)."""
    files = files_of(raw)
    [path] = [p for p in files
              if osp.basename(p) == name + '.jpg' and 'mask' not in p]
    return files[path]


@pytest.mark.parametrize('as_zip', [False, True], ids=['folders', 'zip'])
def test_isic2017_official_split(raw_copy, tmp_path, as_zip):
    raw = raw_copy('isic2017', as_zip)
    counts = isic2017.convert(raw, str(tmp_path / 'o'))
    assert counts == COUNTS['isic2017']
    ids = check_output(str(tmp_path / 'o'), counts)
    # the official folders decide the split; images are copied as they are
    assert ids['train'] == [f'ISIC_{i:07d}' for i in range(6)]
    assert ids['test'] == [f'ISIC_{i:07d}' for i in range(9, 13)]
    name = ids['val'][0]
    with open(tmp_path / 'o' / 'img_dir' / 'val' / f'{name}.jpg', 'rb') as f:
        assert f.read() == raw_image(raw_copy('isic2017'), name)


@pytest.mark.parametrize('as_zip', [False, True], ids=['folders', 'zip'])
def test_isic2018_random_and_official_splits(raw_copy, tmp_path, as_zip):
    raw = raw_copy('isic2018', as_zip)
    counts = isic2018.convert(raw, str(tmp_path / 'r'), split='random')
    assert counts == {'train': 7, 'val': 1, 'test': 2}  # 70/10/20 of 10
    ids = check_output(str(tmp_path / 'r'), counts)
    all_ids = sorted(sum(ids.values(), []))
    assert all_ids == [f'ISIC_{i:07d}' for i in range(10)]  # training only

    counts = isic2018.convert(raw, str(tmp_path / 'o'), split='official')
    assert counts == COUNTS['isic2018']
    ids = check_output(str(tmp_path / 'o'), counts)
    assert ids['val'] == ['ISIC_0000010', 'ISIC_0000011']


@pytest.mark.parametrize('as_zip', [False, True], ids=['folders', 'zip'])
def test_kvasir_splits(raw_copy, tmp_path, as_zip):
    raw = raw_copy('kvasir', as_zip)
    counts = kvasir_seg.convert(raw, str(tmp_path / 'a'))
    assert counts == {'train': 9, 'val': 1}  # 880/120 of 10, no test
    two = check_output(str(tmp_path / 'a'), counts)
    counts = kvasir_seg.convert(raw, str(tmp_path / 'b'), '800-100-100')
    assert counts == {'train': 8, 'val': 1, 'test': 1}
    three = check_output(str(tmp_path / 'b'), counts)
    assert sorted(sum(two.values(), [])) == sorted(sum(three.values(), []))
    names = sorted(n[:-4] for n in os.listdir(
        osp.join(raw_copy('kvasir'), 'Kvasir-SEG', 'images')))
    assert sorted(sum(two.values(), [])) == names


def test_split_counts_of_the_full_datasets():
    assert utils.split_counts(2594, (0.7, 0.1, 0.2)) == [1816, 259, 519]
    assert utils.split_counts(1000, (0.88, 0.12)) == [880, 120]
    assert utils.split_counts(1000, (0.8, 0.1, 0.1)) == [800, 100, 100]
    with pytest.raises(utils.ConversionError, match='a split would be empty'):
        utils.split_counts(4, (0.8, 0.1, 0.1))


@pytest.mark.parametrize('convert', [
    lambda raw, out, seed: isic2018.convert(raw('isic2018'), out, seed=seed),
    lambda raw, out, seed: kvasir_seg.convert(
        raw('kvasir'), out, '800-100-100', seed=seed),
], ids=['isic2018', 'kvasir'])
def test_random_split_is_seeded_and_disjoint(raw_copy, tmp_path, convert):

    def split_ids(seed, name):
        out = tmp_path / name
        convert(raw_copy, str(out), seed)
        return {s: sorted(os.listdir(out / 'img_dir' / s)) for s in SPLITS}

    a, b, c = split_ids(0, 'a'), split_ids(0, 'b'), split_ids(1, 'c')
    assert a == b
    assert a != c
    for ids in (a, c):
        union = set().union(*ids.values())
        assert len(union) == sum(len(v) for v in ids.values())  # disjoint
        assert union == set().union(*a.values())  # same images


def test_threshold_at_128_grey():
    mask = Image.fromarray(
        np.array([[0, 1, 127, 128], [200, 255, 0, 128]], np.uint8))
    assert utils.binarize_mask(mask).tolist() == [[0, 0, 0, 1], [1, 1, 0, 1]]
    # RGB masks go through grey: (128, 128, 128) -> 128, (255, 0, 0) -> 76
    rgb = np.array([[[128, 128, 128], [255, 0, 0], [0, 0, 0]]], np.uint8)
    out = utils.binarize_mask(Image.fromarray(rgb))
    assert out.tolist() == [[1, 0, 0]] and out.dtype == np.uint8


def test_kvasir_jpeg_mask_recovers_the_drawn_mask():
    rng = np.random.default_rng(0)
    _, drawn = gen.make_image(rng, 96, 'mucosa')
    buf = io.BytesIO()
    Image.fromarray(np.repeat(drawn[..., None] * np.uint8(255), 3, 2)).save(
        buf, format='JPEG', quality=75)
    noisy = Image.open(buf)
    grey = np.asarray(noisy.convert('L'))
    assert len(np.unique(grey)) > 2  # JPEG noise
    out = utils.binarize_mask(noisy)
    assert np.array_equal(out, (grey >= 128).astype(np.uint8))
    assert np.mean(out == drawn) > 0.99


def make_raw(tmp_path, layout, counts, as_zip=False):
    return gen.make_dataset(str(tmp_path / 'raw'), layout, counts,
                            img_size=32, as_zip=as_zip)


def assert_fails(main, argv, capsys, *messages):
    """``main(argv)`` exits 1 naming ``messages``; nothing is written."""
    out = argv[1]
    assert main(argv) == 1
    err = capsys.readouterr().err
    for message in messages:
        assert message in err
    assert not osp.exists(out)
    assert [p for p in os.listdir(osp.dirname(out))
            if p.startswith('.')] == []


def test_image_without_mask_names_it(tmp_path, capsys):
    raw = make_raw(tmp_path, 'isic2017', {'train': 7, 'val': 1, 'test': 1})
    gt = osp.join(raw, 'ISIC-2017_Training_Part1_GroundTruth')
    for i in range(6):
        os.remove(osp.join(gt, f'ISIC_{i:07d}_segmentation.png'))
    assert_fails(isic2017.main, [raw, str(tmp_path / 'out')], capsys,
                 'images without a mask in', 'ISIC_0000000.jpg',
                 'ISIC_0000004.jpg, ...', '(6 files)')


def test_mask_without_image_names_it(tmp_path, capsys):
    raw = make_raw(tmp_path, 'kvasir', {'all': 3})
    images = osp.join(raw, 'Kvasir-SEG', 'images')
    name = sorted(os.listdir(images))[1]
    os.remove(osp.join(images, name))
    assert_fails(kvasir_seg.main, [raw, str(tmp_path / 'out')], capsys,
                 'masks without an image in', f'masks/{name} (1 file)')


def test_missing_mask_in_zip_names_it(tmp_path, capsys):
    raw = make_raw(tmp_path, 'isic2018', {'train': 3, 'val': 0, 'test': 0},
                   as_zip=True)
    path = osp.join(raw, 'ISIC2018_Task1_Training_GroundTruth.zip')
    with zipfile.ZipFile(path) as zf:
        kept = {m: zf.read(m) for m in zf.namelist()
                if not m.endswith('ISIC_0000002_segmentation.png')}
    with zipfile.ZipFile(path, 'w') as zf:
        for member, data in kept.items():
            zf.writestr(member, data)
    assert_fails(isic2018.main, [raw, str(tmp_path / 'out')], capsys,
                 'ISIC2018_Task1-2_Training_Input/ISIC_0000002.jpg (1 file)')


@pytest.mark.parametrize('main, layout, counts, missing', [
    (isic2017.main, 'isic2017', {'train': 1, 'val': 1, 'test': 1},
     'ISIC-2017_Test_v2_Part1_GroundTruth'),
    (isic2018.main, 'isic2018', {'train': 1, 'val': 1, 'test': 1},
     'ISIC2018_Task1-2_Training_Input'),
    (kvasir_seg.main, 'kvasir', {'all': 1}, 'Kvasir-SEG'),
])
def test_missing_download_is_named(tmp_path, capsys, main, layout, counts,
                                   missing):
    raw = make_raw(tmp_path, layout, counts)
    shutil.rmtree(osp.join(raw, missing))
    assert_fails(main, [raw, str(tmp_path / 'out')], capsys,
                 'missing download', osp.join(raw, missing + '.zip'))


def test_official_isic2018_needs_the_official_downloads(tmp_path, capsys):
    raw = make_raw(tmp_path, 'isic2018', {'train': 3, 'val': 0, 'test': 0})
    assert_fails(isic2018.main,
                 [raw, str(tmp_path / 'out'), '--split', 'official'], capsys,
                 'ISIC2018_Task1-2_Validation_Input.zip')
    with pytest.raises(ValueError, match=r"split must be one of \('random', "
                       r"'official'\), got 'offical'"):
        isic2018.convert(raw, str(tmp_path / 'out'), split='offical')


def test_size_mismatch_is_named(tmp_path, capsys):
    raw = make_raw(tmp_path, 'kvasir', {'all': 5})
    masks = osp.join(raw, 'Kvasir-SEG', 'masks')
    name = sorted(os.listdir(masks))[0]
    Image.new('L', (20, 32)).save(osp.join(masks, name), format='JPEG')
    assert_fails(kvasir_seg.main, [raw, str(tmp_path / 'out')], capsys,
                 f'masks/{name} is 20x32 but images/{name} is 32x32')


def test_existing_destination_needs_overwrite(raw_copy, tmp_path, capsys):
    raw = raw_copy('kvasir')
    out = tmp_path / 'out'
    out.mkdir()  # an empty folder is fine
    assert kvasir_seg.main([raw, str(out)]) == 0
    assert kvasir_seg.main([raw, str(out), '--split', '800-100-100']) == 1
    assert 'exists and is not empty; pass --overwrite' in (
        capsys.readouterr().err)
    assert sorted(os.listdir(out / 'img_dir')) == ['train', 'val']
    assert kvasir_seg.main(
        [raw, str(out), '--split', '800-100-100', '--overwrite']) == 0
    assert sorted(os.listdir(out / 'img_dir')) == ['test', 'train', 'val']
    assert sorted(os.listdir(tmp_path)) == ['out']
