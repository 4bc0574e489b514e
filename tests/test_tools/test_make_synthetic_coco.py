"""The synthetic COCO generator: deterministic, valid for mmdet, atomic."""
import json
import os
import os.path as osp
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
sys.path.insert(0, osp.join(ROOT, 'tools', 'dataset_converters'))
import make_synthetic_coco as gen  # noqa: E402


def read(root, split):
    with open(osp.join(root, 'annotations',
                       f'instances_{split}2017.json')) as f:
        return json.load(f)


def test_deterministic_and_read_by_mmdet_coco_dataset(tmp_path):
    a = gen.make_dataset(str(tmp_path / 'a'), num_train=6, num_val=3, seed=3)
    b = gen.make_dataset(str(tmp_path / 'b'), num_train=6, num_val=3, seed=3)
    assert read(a, 'train') == read(b, 'train')
    coco = read(a, 'val')
    assert len(coco['images']) == 3
    assert [c['name'] for c in coco['categories']] == list(gen.CLASSES)
    for ann in coco['annotations']:
        x, y, w, h = ann['bbox']
        xs, ys = ann['segmentation'][0][::2], ann['segmentation'][0][1::2]
        assert min(xs) >= x - 0.01 and max(xs) <= x + w + 0.01
        assert min(ys) >= y - 0.01 and max(ys) <= y + h + 0.01
        assert 0 < ann['area'] <= w * h + 0.01

    from mmdet.datasets import CocoDataset
    ds = CocoDataset(
        data_root=a,
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        metainfo=dict(classes=gen.CLASSES),
        pipeline=[dict(type='LoadImageFromFile')],
        filter_cfg=dict(filter_empty_gt=False))
    assert len(ds) == 6
    item = ds[0]
    assert item['img'].shape == (128, 128, 3)
    assert all(0 <= inst['bbox_label'] < 3 for inst in item['instances'])


def test_existing_output_and_failures_leave_nothing_partial(tmp_path,
                                                            monkeypatch):
    out = tmp_path / 'data'
    gen.make_dataset(str(out), num_train=2, num_val=1)
    with pytest.raises(FileExistsError, match='pass --overwrite'):
        gen.make_dataset(str(out), num_train=2, num_val=1)
    assert gen.main([str(out), '--num-train', '2']) == 1

    def broken(*args, **kwargs):
        raise OSError('disk full')

    monkeypatch.setattr(gen, 'write_split', broken)
    target = tmp_path / 'new'
    with pytest.raises(OSError, match='disk full'):
        gen.make_dataset(str(target))
    assert not target.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith('.')] == []


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        gen.parse_args(['out', '--num-train', '0'])
    assert '--num-train must be >= 1, got 0' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gen.parse_args(['out', '--img-size', '32'])
    assert '--img-size must be >= 64, got 32' in capsys.readouterr().err
