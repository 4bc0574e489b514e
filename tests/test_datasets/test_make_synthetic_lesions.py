"""The synthetic lesion downloads: official naming, masks, determinism."""
import io
import os
import os.path as osp
import re
import zipfile

import numpy as np
import pytest
from PIL import Image

from .helpers import COUNTS, IMG_SIZE, files_of

import make_synthetic_lesions as gen  # isort:skip (path set by helpers)


def read(data, mode=None):
    img = Image.open(io.BytesIO(data))
    return np.asarray(img.convert(mode) if mode else img)


@pytest.mark.parametrize('layout', ['isic2017', 'isic2018'])
def test_isic_layout_names_and_binary_masks(raw_copy, layout):
    files = files_of(raw_copy(layout))
    tops = sorted({p.split('/')[0] for p in files})
    expected = {
        'isic2017': [
            'ISIC-2017_Test_v2_Data', 'ISIC-2017_Test_v2_Part1_GroundTruth',
            'ISIC-2017_Training_Data', 'ISIC-2017_Training_Part1_GroundTruth',
            'ISIC-2017_Validation_Data',
            'ISIC-2017_Validation_Part1_GroundTruth'
        ],
        'isic2018': [
            'ISIC2018_Task1-2_Test_Input', 'ISIC2018_Task1-2_Training_Input',
            'ISIC2018_Task1-2_Validation_Input',
            'ISIC2018_Task1_Test_GroundTruth',
            'ISIC2018_Task1_Training_GroundTruth',
            'ISIC2018_Task1_Validation_GroundTruth'
        ],
    }[layout]
    assert tops == expected
    images = [p for p in files if re.fullmatch(r'[^/]+/ISIC_\d{7}\.jpg', p)]
    masks = [p for p in files
             if re.fullmatch(r'[^/]+/ISIC_\d{7}_segmentation\.png', p)]
    assert len(images) == len(masks) == sum(COUNTS[layout].values())
    train = [p for p in images if 'Training' in p]
    assert len(train) == COUNTS[layout]['train']
    for path in masks:
        mask = read(files[path])
        assert mask.shape == (IMG_SIZE, IMG_SIZE)
        assert set(np.unique(mask)) <= {0, 255}
        assert mask.max() == 255  # every image has a lesion
    extras = [p for p in files if p not in images and p not in masks]
    if layout == 'isic2017':  # superpixels and one metadata CSV per split
        assert len(extras) == COUNTS[layout]['train'] + COUNTS[layout][
            'val'] + COUNTS[layout]['test'] + 3
    else:  # LICENSE.txt + ATTRIBUTION.txt in each of the six downloads
        assert len(extras) == 12


def test_kvasir_layout_and_noisy_jpeg_masks(raw_copy):
    files = files_of(raw_copy('kvasir'))
    images = sorted(p for p in files if p.startswith('Kvasir-SEG/images/'))
    masks = sorted(p for p in files if p.startswith('Kvasir-SEG/masks/'))
    assert len(images) == len(masks) == COUNTS['kvasir']['all']
    assert [osp.basename(p) for p in images] == [
        osp.basename(p) for p in masks]
    assert all(re.fullmatch(r'cju[a-z0-9]{22}\.jpg', osp.basename(p))
               for p in images)
    assert set(files) - set(images) - set(masks) == {
        'Kvasir-SEG/kavsir_bboxes.json'}
    values = np.concatenate([read(files[p], 'L').ravel() for p in masks])
    # JPEG noise: values besides 0 and 255, but most pixels stay near them
    assert len(np.unique(values)) > 2
    assert np.mean((values < 30) | (values > 225)) > 0.97


def test_lesions_differ_in_colour_and_some_are_small(tmp_path):
    root = gen.make_dataset(str(tmp_path / 'k'), 'kvasir', {'all': 40})
    files = files_of(root)
    fractions, gaps = [], []
    for path in sorted(p for p in files if '/images/' in p):
        img = read(files[path]).astype(float)
        mask = read(files[path.replace('/images/', '/masks/')], 'L') >= 128
        fractions.append(mask.mean())
        gaps.append(np.abs(img[mask].mean(0) - img[~mask].mean(0)).max())
    assert min(gaps) > 25  # clear colour contrast, learnable
    assert min(fractions) < 0.03 < max(fractions)


def test_deterministic_and_zip_holds_the_same_files(tmp_path):
    counts = {'train': 3, 'val': 1, 'test': 1}
    a = gen.make_dataset(str(tmp_path / 'a'), 'isic2017', counts, seed=4)
    b = gen.make_dataset(str(tmp_path / 'b'), 'isic2017', counts, seed=4)
    c = gen.make_dataset(str(tmp_path / 'c'), 'isic2017', counts, seed=5)
    z = gen.make_dataset(str(tmp_path / 'z'), 'isic2017', counts, seed=4,
                         as_zip=True)
    z2 = gen.make_dataset(str(tmp_path / 'z2'), 'isic2017', counts, seed=4,
                          as_zip=True)
    assert files_of(a) == files_of(b)
    assert files_of(a) != files_of(c)
    assert files_of(z) == files_of(z2)  # zip files are byte-identical
    zipped = {}
    for name in os.listdir(z):
        with zipfile.ZipFile(osp.join(z, name)) as zf:
            zipped.update({m: zf.read(m) for m in zf.namelist()})
    assert zipped == files_of(a)

    k = gen.make_dataset(str(tmp_path / 'k'), 'kvasir', {'all': 2},
                         as_zip=True)
    assert os.listdir(k) == ['kvasir-seg.zip']


def test_isic2018_without_official_val_test(tmp_path):
    root = gen.make_dataset(str(tmp_path / 'r'), 'isic2018',
                            {'train': 2, 'val': 0, 'test': 0})
    assert sorted(os.listdir(root)) == [
        'ISIC2018_Task1-2_Training_Input',
        'ISIC2018_Task1_Training_GroundTruth'
    ]


def test_existing_output_refused_and_failures_leave_nothing(
        tmp_path, monkeypatch, capsys):
    out = tmp_path / 'data'
    gen.make_dataset(str(out), 'kvasir', {'all': 1})
    with pytest.raises(FileExistsError, match='pass --overwrite'):
        gen.make_dataset(str(out), 'kvasir', {'all': 1})
    assert gen.main([str(out), '--layout', 'kvasir', '--num', '1']) == 1
    assert 'pass --overwrite' in capsys.readouterr().err
    assert gen.main([str(out), '--layout', 'kvasir', '--num', '2',
                     '--overwrite']) == 0
    assert len(os.listdir(out / 'Kvasir-SEG' / 'images')) == 2

    def broken(*args, **kwargs):
        raise OSError('disk full')

    monkeypatch.setattr(gen, 'write_files', broken)
    with pytest.raises(OSError, match='disk full'):
        gen.make_dataset(str(tmp_path / 'new'), 'isic2017')
    assert sorted(os.listdir(tmp_path)) == ['data']


@pytest.mark.parametrize('argv, message', [
    (['--layout', 'isic2017', '--num', '5'],
     '--num applies to --layout kvasir only, not isic2017'),
    (['--layout', 'kvasir', '--num-train', '5'],
     '--num-train do not apply to --layout kvasir'),
    (['--layout', 'isic2017', '--num-val', '0'],
     '--num-val must be >= 1 for layout isic2017, got 0'),
    (['--layout', 'isic2018', '--num-train', '0'],
     '--num-train must be >= 1 for layout isic2018, got 0'),
    (['--layout', 'kvasir', '--num', '0'],
     '--num must be >= 1 for layout kvasir, got 0'),
    (['--layout', 'kvasir', '--img-size', '16'],
     '--img-size must be >= 32, got 16'),
    (['--layout', 'isic2019'], "invalid choice: 'isic2019'"),
])
def test_bad_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit):
        gen.parse_args(['out'] + argv)
    assert message in capsys.readouterr().err


def test_bad_counts_raise():
    with pytest.raises(ValueError, match=r"need the keys \('all',\)"):
        gen.check_counts('kvasir', {'train': 3})
    with pytest.raises(ValueError, match='layout must be one of'):
        gen.check_counts('isic2016', {'all': 3})
