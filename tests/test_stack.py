"""The installed OpenMMLab stack is complete: mmcv has its compiled ops."""
import torch


def test_versions_pinned():
    import mmcv
    import mmdet
    import mmengine
    import mmseg
    assert mmcv.__version__ == '2.1.0'
    assert mmdet.__version__ == '3.3.0'
    assert mmseg.__version__ == '1.2.2'
    assert mmengine.__version__ == '0.10.7'


def test_mmcv_nms_runs():
    from mmcv.ops import nms
    boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.],
                          [50., 50., 60., 60.]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    dets, keep = nms(boxes, scores, iou_threshold=0.5)
    # box 1 overlaps box 0 with IoU 81/119 = 0.68 > 0.5 and is suppressed
    assert keep.tolist() == [0, 2]
    assert torch.allclose(dets[:, 4], torch.tensor([0.9, 0.7]))


def test_mmcv_roi_align_runs():
    from mmcv.ops import RoIAlign
    feat = torch.arange(16.).view(1, 1, 4, 4)
    rois = torch.tensor([[0., 0., 0., 4., 4.]])
    out = RoIAlign((2, 2), spatial_scale=1.0, sampling_ratio=1,
                   aligned=False)(feat, rois)
    # one sample at the centre of each 2x2 bin: (1, 1), (3, 1), (1, 3), (3, 3)
    # bilinear on the 4x4 ramp gives 5, 7, 13, 15
    assert out.shape == (1, 1, 2, 2)
    assert out.flatten().tolist() == [5., 7., 13., 15.]


def test_kcla_ext_imports():
    import kcla_mm._ext as ext
    assert 'cpu' in ext.device_types()
