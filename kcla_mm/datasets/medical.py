"""Binary lesion-segmentation datasets: ISIC 2017, ISIC 2018, Kvasir-SEG.

All three read the mmseg layout written by the converters in
``tools/dataset_converters/`` (``isic2017.py``, ``isic2018.py``,
``kvasir_seg.py``)::

    <data_root>/img_dir/{train,val,test}/<id>.jpg
    <data_root>/ann_dir/{train,val,test}/<id>.png   (uint8: 0 or 1)

Label 0 is background, 1 the lesion (polyp for Kvasir-SEG); there is no
ignored label. Point ``data_prefix`` at one split, e.g.
``dict(img_path='img_dir/train', seg_map_path='ann_dir/train')``. A missing
image folder raises mmseg's ``FileNotFoundError`` naming the folder; a
folder without an image ending in ``img_suffix`` raises one too.
"""
import os.path as osp
from typing import List

from mmseg.datasets.basesegdataset import BaseSegDataset


class BinaryLesionDataset(BaseSegDataset):
    """Base of the binary lesion datasets: JPEG images, 0/1 PNG masks.

    Args:
        img_suffix (str): Suffix of images. Defaults to '.jpg'.
        seg_map_suffix (str): Suffix of masks. Defaults to '.png'.
        reduce_zero_label (bool): Whether to ignore label 0. Defaults to
            False (background is a class).
        **kwargs: Other arguments of mmseg's ``BaseSegDataset``
            (``data_root``, ``data_prefix``, ``pipeline``, ...).
    """

    def __init__(self,
                 img_suffix: str = '.jpg',
                 seg_map_suffix: str = '.png',
                 reduce_zero_label: bool = False,
                 **kwargs) -> None:
        owner = type(self).__name__
        for name, suffix, example in (('img_suffix', img_suffix, '.jpg'),
                                      ('seg_map_suffix', seg_map_suffix,
                                       '.png')):
            if not isinstance(suffix, str) or not suffix:
                raise TypeError(f'{owner}: {name} must be a non-empty str '
                                f'such as {example!r}, got {suffix!r}')
        if not isinstance(reduce_zero_label, bool):
            raise TypeError(f'{owner}: reduce_zero_label must be a bool, got '
                            f'{reduce_zero_label!r}')
        super().__init__(
            img_suffix=img_suffix,
            seg_map_suffix=seg_map_suffix,
            reduce_zero_label=reduce_zero_label,
            **kwargs)

    def load_data_list(self) -> List[dict]:
        """mmseg's listing; an empty one raises FileNotFoundError naming the
        folder and ``img_suffix`` (mmengine would fail later, unnamed)."""
        data_list = super().load_data_list()
        if not data_list:
            img_dir = self.data_prefix.get('img_path')
            where = f'ann_file {self.ann_file} lists no images' if (
                self.ann_file and not osp.isdir(self.ann_file)) else \
                f'no file in {img_dir} ends in img_suffix=' \
                f'{self.img_suffix!r}'
            raise FileNotFoundError(
                f'{type(self).__name__}: {where}; expected the layout of '
                'tools/dataset_converters (img_dir/<split>/<id>.jpg); check '
                'data_root, data_prefix and img_suffix')
        return data_list


class ISIC2017Dataset(BinaryLesionDataset):
    """ISIC 2017 Task 1 skin-lesion segmentation (dermoscopy), binary.

    Official split, kept by ``tools/dataset_converters/isic2017.py``: 2000
    train / 150 val / 600 test images, ``ISIC_xxxxxxx.jpg`` with masks
    ``ann_dir/<split>/ISIC_xxxxxxx.png`` (0 background, 1 lesion).

    Args:
        **kwargs: Arguments of :class:`BinaryLesionDataset`.
    """
    METAINFO = dict(
        classes=('background', 'lesion'), palette=[[0, 0, 0], [255, 0, 0]])


class ISIC2018Dataset(BinaryLesionDataset):
    """ISIC 2018 Task 1 skin-lesion segmentation (dermoscopy), binary.

    ``tools/dataset_converters/isic2018.py`` writes train/val/test either as
    a random 70/10/20 split of the 2594 training images (1816 / 259 / 519,
    seeded; the default) or as the official 2594 / 100 / 1000 split.
    Masks ``ann_dir/<split>/ISIC_xxxxxxx.png`` hold 0 (background) and 1
    (lesion).

    Args:
        **kwargs: Arguments of :class:`BinaryLesionDataset`.
    """
    METAINFO = dict(
        classes=('background', 'lesion'), palette=[[0, 0, 0], [255, 0, 0]])


class KvasirSEGDataset(BinaryLesionDataset):
    """Kvasir-SEG polyp segmentation (colonoscopy), binary.

    No official split: ``tools/dataset_converters/kvasir_seg.py`` splits the
    1000 images at random (seeded) into 880 train / 120 val (the default;
    test configs then evaluate on val) or 800 / 100 / 100 train/val/test.
    Masks ``ann_dir/<split>/<name>.png`` hold 0 (background) and 1 (polyp).

    Args:
        **kwargs: Arguments of :class:`BinaryLesionDataset`.
    """
    METAINFO = dict(
        classes=('background', 'polyp'), palette=[[0, 0, 0], [0, 255, 0]])
