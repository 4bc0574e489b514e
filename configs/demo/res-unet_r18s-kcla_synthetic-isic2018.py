# The segmentation demo (tools/seg_demo.py): the ISIC 2018 ResNet-UNet with
# a KCLA encoder, trained briefly from scratch on CPU on synthetic lesion
# images (tools/dataset_converters/make_synthetic_lesions.py, converted by
# tools/dataset_converters/isic2018.py) with mmseg's own tools. 128x128
# input instead of 256x256 and an iteration-based schedule of the authors'
# optimiser (AdamW, lr 1e-3, wd 1e-2) with one cosine decay.
_base_ = '../segmentation/res-unet_r18s-kcla_300e_isic2018-256x256.py'

data_root = 'data/synthetic_isic2018/'
crop_size = (128, 128)
max_iters = 300

model = dict(data_preprocessor=dict(size=crop_size))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='Resize', scale=crop_size, keep_ratio=False),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='RandomFlip', prob=0.5, direction='vertical'),
    dict(type='RandomRotate', prob=0.5, degree=180),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=crop_size, keep_ratio=False),
    dict(type='LoadAnnotations'),
    dict(type='PackSegInputs')
]
train_dataloader = dict(
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(
    num_workers=0,
    persistent_workers=False,
    dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = dict(
    num_workers=0,
    persistent_workers=False,
    dataset=dict(data_root=data_root, pipeline=test_pipeline))

train_cfg = dict(
    _delete_=True,
    type='IterBasedTrainLoop',
    max_iters=max_iters,
    val_interval=max_iters)
param_scheduler = [
    dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=max_iters,
         T_max=max_iters, eta_min=1e-5)
]
default_hooks = dict(
    logger=dict(interval=25, log_metric_by_epoch=False),
    checkpoint=dict(by_epoch=False, interval=max_iters, save_best=None))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
