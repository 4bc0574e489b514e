"""ISIC2017Dataset, ISIC2018Dataset, KvasirSEGDataset through mmseg."""
import re

import numpy as np
import pytest

from .helpers import IMG_SIZE

import isic2017  # isort:skip (path set by helpers)
import isic2018  # isort:skip
import kvasir_seg  # isort:skip

# built in mmseg's scope (as configs' default_scope='mmseg' does)
PIPELINE = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations')]
CASES = {  # dataset type -> (converter, layout, expected counts, classes)
    'ISIC2017Dataset': (isic2017.convert, 'isic2017',
                        dict(train=6, val=3, test=4), ('background',
                                                       'lesion')),
    'ISIC2018Dataset': (isic2018.convert, 'isic2018',
                        dict(train=7, val=1, test=2), ('background',
                                                       'lesion')),
    'KvasirSEGDataset': (kvasir_seg.convert, 'kvasir', dict(train=9, val=1),
                         ('background', 'polyp')),
}


def build(type_name, data_root, split, **kwargs):
    import kcla_mm  # noqa: F401  (registers the datasets)
    from mmengine.registry import DefaultScope
    from mmseg.registry import DATASETS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmseg'):
        return DATASETS.build(
            dict(
                type=type_name,
                data_root=data_root,
                data_prefix=dict(
                    img_path=f'img_dir/{split}',
                    seg_map_path=f'ann_dir/{split}'),
                pipeline=PIPELINE,
                **kwargs))


@pytest.mark.parametrize('type_name', list(CASES))
def test_dataset_reads_the_converted_layout(raw_copy, tmp_path, type_name):
    convert, layout, counts, classes = CASES[type_name]
    root = str(tmp_path / 'data')
    assert convert(raw_copy(layout), root) == counts
    for split, n in counts.items():
        ds = build(type_name, root, split, test_mode=split != 'train')
        assert type(ds).__name__ == type_name
        assert len(ds) == n
        assert ds.metainfo['classes'] == classes
        assert len(ds.metainfo['palette']) == 2
        assert ds.reduce_zero_label is False
        seg_values = set()
        for i in range(n):
            item = ds[i]
            assert item['img'].shape == (IMG_SIZE, IMG_SIZE, 3)
            assert item['gt_seg_map'].shape == (IMG_SIZE, IMG_SIZE)
            seg_values |= set(np.unique(item['gt_seg_map']).tolist())
        assert seg_values == {0, 1}


def test_missing_data_root_names_the_folder(tmp_path):
    missing = tmp_path / 'no_such_root'
    with pytest.raises(FileNotFoundError,
                       match=re.escape(str(missing / 'img_dir' / 'val'))):
        build('KvasirSEGDataset', str(missing), 'val')
