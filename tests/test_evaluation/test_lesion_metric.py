"""LesionMetric: hand-counted IoU/Dice/Sensitivity/Specificity, the
empty-image convention, ignore_index, and mmseg's IoUMetric on mIoU/mDice."""
import math

import numpy as np
import pytest
import torch

from kcla_mm.evaluation import LesionMetric

# 4x4 case A: TP = 3, FP = 1 (row 1, col 3), FN = 1 (row 2, col 2), TN = 11
GT_A = [[0, 0, 0, 0],
        [0, 1, 1, 0],
        [0, 1, 1, 0],
        [0, 0, 0, 0]]
PRED_A = [[0, 0, 0, 0],
          [0, 1, 1, 1],
          [0, 1, 0, 0],
          [0, 0, 0, 0]]
# 4x4 case B: the lesion pixel missed, a neighbour predicted instead:
# TP = 0, FP = 1, FN = 1, TN = 14
GT_B = [[1, 0, 0, 0]] + [[0] * 4] * 3
PRED_B = [[0, 1, 0, 0]] + [[0] * 4] * 3
EMPTY = [[0] * 4] * 4


def pct(fraction: float) -> float:
    """A fraction in percent, rounded to 2 decimals as mmseg does."""
    return float(np.round(fraction * 100, 2))


def sample(pred, gt, pred_dtype=torch.long) -> dict:
    """A data sample as mmseg's evaluator passes it (SegDataSample.to_dict)."""
    return dict(
        pred_sem_seg=dict(data=torch.tensor(pred, dtype=pred_dtype)[None]),
        gt_sem_seg=dict(data=torch.tensor(gt, dtype=torch.long)[None]))


def evaluate(pairs, metric=None, **kwargs) -> dict:
    metric = metric or LesionMetric(**kwargs)
    for pred, gt in pairs:
        metric.process({}, [sample(pred, gt)])
    return metric.evaluate(len(pairs))


def test_one_image_by_hand():
    m = evaluate([(PRED_A, GT_A)])
    assert m['lesion_IoU'] == pct(3 / 5)  # TP / (TP + FP + FN)
    assert m['lesion_Dice'] == pct(6 / 8)  # 2TP / (2TP + FP + FN)
    assert m['Sensitivity'] == pct(3 / 4)  # TP / (TP + FN)
    assert m['Specificity'] == pct(11 / 12)  # TN / (TN + FP)
    assert m['Acc'] == pct(14 / 16)
    assert m['mean_image_IoU'] == m['lesion_IoU']
    assert m['mean_image_Dice'] == m['lesion_Dice']
    # background: intersection TN = 11, union 11 + 1 + 1, areas 12 and 12
    assert m['mIoU'] == pct((3 / 5 + 11 / 13) / 2)
    assert m['mDice'] == pct((6 / 8 + 22 / 24) / 2)


def test_dataset_level_pools_pixels_per_image_mean_averages_images():
    m = evaluate([(PRED_A, GT_A), (PRED_B, GT_B)])
    # pooled: TP = 3, FP = 2, FN = 2, TN = 25
    assert m['lesion_IoU'] == pct(3 / 7)
    assert m['lesion_Dice'] == pct(6 / 10)
    assert m['Sensitivity'] == pct(3 / 5)
    assert m['Specificity'] == pct(25 / 27)
    assert m['Acc'] == pct(28 / 32)
    # per image: A has IoU 3/5, Dice 3/4; B has 0 and 0
    assert m['mean_image_IoU'] == pct((3 / 5 + 0) / 2)
    assert m['mean_image_Dice'] == pct((3 / 4 + 0) / 2)


def test_batches_and_images_are_equivalent():
    """One process() call with two samples = two calls with one each."""
    metric = LesionMetric()
    metric.process({}, [sample(PRED_A, GT_A), sample(PRED_B, GT_B)])
    assert metric.evaluate(2) == evaluate(
        [(PRED_A, GT_A), (PRED_B, GT_B)])


def test_image_without_lesion_counts_as_perfect():
    m = evaluate([(PRED_A, GT_A), (EMPTY, EMPTY)])
    assert m['lesion_IoU'] == pct(3 / 5)  # pooled counts unchanged
    assert m['mean_image_IoU'] == pct((3 / 5 + 1) / 2)
    assert m['mean_image_Dice'] == pct((3 / 4 + 1) / 2)
    # a false positive on a lesion-free image is not empty: IoU = 0
    m = evaluate([(PRED_A, GT_A), (PRED_B[:1] + EMPTY[1:], EMPTY)])
    assert m['mean_image_IoU'] == pct((3 / 5 + 0) / 2)


def test_set_without_lesion():
    m = evaluate([(EMPTY, EMPTY)])
    assert m['lesion_IoU'] == m['lesion_Dice'] == 100.
    assert m['mean_image_IoU'] == m['mean_image_Dice'] == 100.
    assert math.isnan(m['Sensitivity'])  # no lesion pixel: TP + FN = 0
    assert m['Specificity'] == m['Acc'] == 100.
    # like mmseg, the absent lesion class is left out of mIoU's average
    assert m['mIoU'] == m['mDice'] == 100.


def test_ignore_index_pixels_are_excluded():
    gt = [row[:] for row in GT_A]
    gt[1][3] = 255  # the false positive
    gt[3][3] = 255  # a true negative
    pred = [row[:] for row in PRED_A]
    pred[3][3] = 1  # predictions on ignored pixels do not count
    m = evaluate([(pred, gt)])
    # TP = 3, FP = 0, FN = 1, TN = 10
    assert m['lesion_IoU'] == pct(3 / 4)
    assert m['lesion_Dice'] == pct(6 / 7)
    assert m['Specificity'] == 100.
    assert m['Acc'] == pct(13 / 14)
    # an image that is all ignore_index is left out of the per-image mean
    m = evaluate([(pred, gt), (EMPTY, [[255] * 4] * 4)])
    assert m['mean_image_IoU'] == pct(3 / 4)


def test_custom_ignore_and_lesion_index():
    swap = {0: 1, 1: 0}
    gt = [[swap[v] for v in row] for row in GT_A]
    pred = [[swap[v] for v in row] for row in PRED_A]
    m = evaluate([(pred, gt)], lesion_index=0, ignore_index=-1)
    assert m['lesion_IoU'] == pct(3 / 5)
    assert m['Specificity'] == pct(11 / 12)


def test_binary_head_float_prediction_equals_argmax_prediction():
    """mmseg's out_channels=1 mode gives pred_sem_seg as float 0./1. maps,
    the two-channel mode gives int64 argmax maps: same metrics."""
    metric = LesionMetric()
    metric.process({}, [sample(PRED_A, GT_A, pred_dtype=torch.float32),
                        sample(PRED_B, GT_B, pred_dtype=torch.float32)])
    assert metric.evaluate(2) == evaluate([(PRED_A, GT_A), (PRED_B, GT_B)])


def random_samples(seed: int, num_classes: int):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for h, w in [(7, 9), (16, 16), (5, 12)]:
        gt = torch.randint(num_classes, (1, h, w), generator=gen)
        gt[torch.rand((1, h, w), generator=gen) < 0.1] = 255
        # predictions agreeing with the ground truth about 70% of the time
        agree = (torch.rand((1, h, w), generator=gen) < 0.7) & (gt != 255)
        pred = torch.where(
            agree, gt, torch.randint(num_classes, (1, h, w), generator=gen))
        samples.append(dict(pred_sem_seg=dict(data=pred),
                            gt_sem_seg=dict(data=gt)))
    return samples


@pytest.mark.parametrize('num_classes', [2, 3])
@pytest.mark.parametrize('seed', range(5))
def test_miou_mdice_equal_mmseg_iou_metric(seed, num_classes):
    import kcla_mm  # noqa: F401 (registers LesionMetric)
    from mmengine.registry import DefaultScope
    from mmseg.evaluation import IoUMetric
    from mmseg.registry import METRICS

    meta = dict(classes=('background', 'lesion', 'other')[:num_classes])
    with DefaultScope.overwrite_default_scope('mmseg'):
        ours = METRICS.build(dict(type='LesionMetric'))
    assert isinstance(ours, LesionMetric)
    theirs = IoUMetric(iou_metrics=['mIoU', 'mDice'])
    samples = random_samples(seed, num_classes)
    for metric in (ours, theirs):
        metric.dataset_meta = meta
        metric.process({}, samples)
    ours, theirs = ours.evaluate(3), theirs.evaluate(3)
    assert ours['mIoU'] == theirs['mIoU']
    assert ours['mDice'] == theirs['mDice']
    if num_classes == 2:
        assert ours['Acc'] == theirs['aAcc']


@pytest.mark.parametrize('kwargs, option', [
    (dict(lesion_index=-1), 'lesion_index'),
    (dict(lesion_index=1.0), 'lesion_index'),
    (dict(lesion_index=True), 'lesion_index'),
    (dict(ignore_index='255'), 'ignore_index'),
    (dict(ignore_index=1), 'ignore_index'),  # equal to lesion_index
])
def test_bad_arguments_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        LesionMetric(**kwargs)


def test_lesion_index_beyond_the_classes():
    metric = LesionMetric(lesion_index=2)
    metric.dataset_meta = dict(classes=('background', 'lesion'))
    with pytest.raises(ValueError, match=r'lesion_index=2 .*0\.\.1'):
        metric.process({}, [sample(PRED_A, GT_A)])


def test_labels_outside_the_classes_are_named():
    gt = [row[:] for row in GT_A]
    gt[0][0] = 2  # e.g. a mask not mapped to {0, 1}
    bad = sample(PRED_A, gt)
    bad['img_path'] = 'ISIC_0000.jpg'
    with pytest.raises(ValueError,
                       match=r'gt_sem_seg of ISIC_0000.jpg .*\[2\].*0\.\.1'):
        LesionMetric().process({}, [bad])
    pred = [row[:] for row in PRED_A]
    pred[0][0] = 3
    with pytest.raises(ValueError, match=r'pred_sem_seg .*\[3\]'):
        LesionMetric().process({}, [sample(pred, GT_A)])


def test_shape_mismatch_is_named():
    bad = sample(PRED_A, [row[:3] for row in GT_A])
    with pytest.raises(ValueError, match=r'\(4, 4\) and gt_sem_seg \(4, 3\)'):
        LesionMetric().process({}, [bad])
