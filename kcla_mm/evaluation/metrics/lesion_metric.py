"""Lesion-level IoU/Dice for binary medical segmentation (mmseg evaluator)."""
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mmengine.evaluator import BaseMetric
from mmengine.logging import MMLogger, print_log

DEFAULT_CLASSES = ('background', 'lesion')
# the devices of mmengine's collect_results
COLLECT_DEVICES = ('cpu', 'gpu', 'npu')


def _ratio(num: torch.Tensor, den: torch.Tensor,
           empty: float = float('nan')) -> torch.Tensor:
    """``num / den`` in float64, ``empty`` where ``den == 0``."""
    num, den = num.double(), den.double()
    return torch.where(den > 0, num / den.clamp(min=1), den.new_tensor(empty))


def _percent(value: torch.Tensor) -> float:
    """A ratio as a percentage rounded to 2 decimals, as mmseg reports."""
    return float(np.round(float(value) * 100, 2))


def _format_table(metrics: Dict[str, float]) -> str:
    """A two-row plain-text table: metric names over their values."""
    names = list(metrics)
    values = [f'{metrics[name]:.2f}' for name in names]
    widths = [max(len(n), len(v)) for n, v in zip(names, values)]
    rule = '+' + '+'.join('-' * (w + 2) for w in widths) + '+'

    def row(cells: List[str]) -> str:
        return '| ' + ' | '.join(
            c.rjust(w) for c, w in zip(cells, widths)) + ' |'

    return '\n'.join([rule, row(names), rule, row(values), rule])


class LesionMetric(BaseMetric):
    """IoU, Dice, sensitivity and specificity of the lesion class.

    The numbers medical segmentation papers (ISIC, Kvasir-SEG) report, next
    to mmseg's class-averaged ``mIoU`` and ``mDice`` so results stay
    comparable with :class:`mmseg.evaluation.IoUMetric`. Use it in an mmseg
    config as ``val_evaluator = dict(type='LesionMetric')``.

    It reads ``pred_sem_seg`` (the predicted label map), so a binary decode
    head with ``out_channels=1`` (thresholded to 0/1 by mmseg) and one with
    two channels (argmax) are evaluated the same way. Pixels whose ground
    truth is ``ignore_index`` are left out of every count, as in mmseg.
    The classes are ``dataset_meta['classes']``, or ``('background',
    'lesion')`` when the metric has no dataset meta.

    Pixel counts are taken per image as a confusion matrix (rows: ground
    truth, columns: prediction) and reduced in :meth:`compute_metrics`.
    With TP, FP, FN, TN counted for the lesion class against all others:

    - dataset level (pixels pooled over all images): ``lesion_IoU`` =
      TP / (TP + FP + FN), ``lesion_Dice`` = 2TP / (2TP + FP + FN), ``Acc`` =
      (TP + TN) / all pixels (mmseg's ``aAcc`` when there are two classes),
      ``Sensitivity`` = TP / (TP + FN), ``Specificity`` = TN / (TN + FP);
    - per image, then averaged over images: ``mean_image_IoU`` and
      ``mean_image_Dice``;
    - mmseg's ``mIoU`` and ``mDice``: per-class IoU/Dice from the pooled
      counts, averaged over the classes present (background included).

    Empty-lesion convention: where neither the ground truth nor the
    prediction has a lesion pixel (TP + FP + FN = 0), IoU = Dice = 1, since
    the prediction is exactly right. This applies per image and to the pooled
    ``lesion_IoU``/``lesion_Dice``. An image whose pixels are all
    ``ignore_index`` is left out of the per-image means. ``Sensitivity``
    (no lesion pixel in the ground truth) and ``Specificity`` (no other
    pixel) are NaN when undefined, as mmseg leaves undefined ratios.

    All values are percentages rounded to 2 decimals, like mmseg's. Unlike
    ``IoUMetric`` there is no ``format_only``/``output_dir``: this metric
    only evaluates; use ``IoUMetric`` to write prediction PNGs.

    Args:
        lesion_index (int): Label of the lesion (foreground) class in the
            label maps. Defaults to 1.
        ignore_index (int): Ground-truth label excluded from evaluation.
            Defaults to 255.
        collect_device (str): Device used to collect results across ranks,
            ``'cpu'``, ``'gpu'`` or ``'npu'``. Defaults to ``'cpu'``.
        prefix (str, optional): Prefix added to the metric names. Defaults
            to None (names as listed above, like mmseg's ``mIoU``).

    """

    def __init__(self,
                 lesion_index: int = 1,
                 ignore_index: int = 255,
                 collect_device: str = 'cpu',
                 prefix: Optional[str] = None) -> None:
        if (not isinstance(lesion_index, int) or isinstance(lesion_index, bool)
                or lesion_index < 0):
            raise ValueError(
                'LesionMetric: lesion_index must be an int >= 0 (the lesion '
                f'label in the ground truth), got {lesion_index!r}')
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            raise ValueError(
                f'LesionMetric: ignore_index must be an int (e.g. 255), got '
                f'{ignore_index!r}')
        if ignore_index == lesion_index:
            raise ValueError(
                f'LesionMetric: ignore_index ({ignore_index}) must differ '
                f'from lesion_index ({lesion_index}): the lesion class would '
                'never be counted')
        if collect_device not in COLLECT_DEVICES:
            raise ValueError(
                f'LesionMetric: collect_device must be one of '
                f'{COLLECT_DEVICES}, got {collect_device!r}')
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(
                'LesionMetric: prefix must be a str (e.g. \'val\') or None, '
                f'got {prefix!r}')
        super().__init__(collect_device=collect_device, prefix=prefix)
        self.lesion_index = lesion_index
        self.ignore_index = ignore_index

    @property
    def class_names(self) -> Tuple[str, ...]:
        """The class names: ``dataset_meta['classes']`` or the defaults."""
        if self.dataset_meta and self.dataset_meta.get('classes'):
            return tuple(self.dataset_meta['classes'])
        return DEFAULT_CLASSES

    def _check_labels(self, labels: torch.Tensor, what: str,
                      data_sample: dict) -> None:
        """Raise if ``labels`` (already without ignored pixels) has a value
        outside ``0 .. num_classes - 1``."""
        num_classes = len(self.class_names)
        if labels.numel() == 0 or (int(labels.min()) >= 0
                                   and int(labels.max()) < num_classes):
            return
        bad = torch.unique(labels[(labels < 0) | (labels >= num_classes)])
        source = data_sample.get('img_path', 'a data sample')
        allowed = f'0..{num_classes - 1} (classes {self.class_names})'
        if what == 'gt_sem_seg':
            allowed += f' or ignore_index={self.ignore_index}'
        raise ValueError(
            f'{what} of {source} has label value(s) {bad[:5].tolist()}; '
            f'allowed: {allowed}. Does the dataset\'s classes / the decode '
            f'head\'s num_classes match the label maps?')

    def process(self, data_batch: dict, data_samples: Sequence[dict]) -> None:
        """Count one batch's pixels into per-image confusion matrices.

        Args:
            data_batch (dict): A batch from the dataloader (unused).
            data_samples (Sequence[dict]): Model outputs as dicts, each with
                ``pred_sem_seg.data`` and ``gt_sem_seg.data`` label maps of
                shape (1, H, W) or (H, W); ``img_path`` names the image in
                errors.
        """
        names = self.class_names
        num_classes = len(names)
        if self.lesion_index >= num_classes:
            raise ValueError(
                f'LesionMetric: lesion_index={self.lesion_index} is not a '
                'class index: '
                f'allowed 0..{num_classes - 1} for classes {names}')
        for data_sample in data_samples:
            pred = data_sample['pred_sem_seg']['data'].squeeze()
            label = data_sample['gt_sem_seg']['data'].squeeze().to(pred)
            if pred.shape != label.shape:
                raise ValueError(
                    f'pred_sem_seg {tuple(pred.shape)} and gt_sem_seg '
                    f'{tuple(label.shape)} of '
                    f'{data_sample.get("img_path", "a data sample")} differ '
                    f'in shape')
            valid = label != self.ignore_index
            pred, label = pred[valid].long(), label[valid].long()
            self._check_labels(label, 'gt_sem_seg', data_sample)
            self._check_labels(pred, 'pred_sem_seg', data_sample)
            confusion = torch.bincount(
                label * num_classes + pred, minlength=num_classes**2)
            self.results.append(
                confusion.reshape(num_classes, num_classes).cpu())

    def compute_metrics(self, results: List[torch.Tensor]) -> Dict[str, float]:
        """Reduce the per-image confusion matrices to the metrics.

        Args:
            results (list[Tensor]): One (C, C) confusion matrix per image
                (rows: ground truth, columns: prediction), as stored by
                :meth:`process`.

        Returns:
            dict[str, float]: ``lesion_IoU``, ``lesion_Dice``, ``Acc``,
            ``Sensitivity``, ``Specificity``, ``mean_image_IoU``,
            ``mean_image_Dice``, ``mIoU`` and ``mDice``, in percent.
        """
        confusion = torch.stack(results).long()  # (N, C, C)
        k = self.lesion_index
        tp = confusion[:, k, k]
        fn = confusion[:, k, :].sum(-1) - tp
        fp = confusion[:, :, k].sum(-1) - tp
        total = confusion.sum((1, 2))
        tn = total - tp - fp - fn

        def iou_dice(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor,
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
            # TP + FP + FN = 0: no lesion anywhere, IoU = Dice = 1
            return (_ratio(tp, tp + fp + fn, empty=1.),
                    _ratio(2 * tp, 2 * tp + fp + fn, empty=1.))

        lesion_iou, lesion_dice = iou_dice(tp.sum(), fp.sum(), fn.sum())
        image_iou, image_dice = iou_dice(tp, fp, fn)
        evaluated = total > 0  # images not entirely ignore_index

        pooled = confusion.sum(0)
        intersect = pooled.diag()
        area_label, area_pred = pooled.sum(1), pooled.sum(0)
        class_iou = _ratio(intersect, area_label + area_pred - intersect)
        class_dice = _ratio(2 * intersect, area_label + area_pred)

        metrics = {
            'lesion_IoU': lesion_iou,
            'lesion_Dice': lesion_dice,
            'Acc': _ratio(tp.sum() + tn.sum(), total.sum()),
            'Sensitivity': _ratio(tp.sum(), tp.sum() + fn.sum()),
            'Specificity': _ratio(tn.sum(), tn.sum() + fp.sum()),
            'mean_image_IoU': image_iou[evaluated].mean(),
            'mean_image_Dice': image_dice[evaluated].mean(),
            'mIoU': class_iou.nanmean(),
            'mDice': class_dice.nanmean(),
        }
        metrics = {name: _percent(value) for name, value in metrics.items()}

        logger: MMLogger = MMLogger.get_current_instance()
        print_log(
            f"lesion class '{self.class_names[k]}' (index {k}), "
            f'{len(results)} image(s):\n' + _format_table(metrics),
            logger=logger)
        return metrics
