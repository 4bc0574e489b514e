# ISIC 2017 lesion segmentation (Task 1), converted by
# tools/dataset_converters/isic2017.py into <data_root>/{img_dir,ann_dir}/
# {train,val,test} (official split: 2000 / 150 / 600 images; masks 0/1).
# Pipeline as in the KCLA authors' recipe: 256x256 input, random horizontal
# and vertical flips and rotations. Images are normalised by the model's
# data_preprocessor (ImageNet mean/std; the authors use per-dataset
# statistics). Evaluation at the original resolution (mmseg's convention;
# the authors score the 256x256 resized masks).
dataset_type = 'ISIC2017Dataset'
data_root = 'data/isic2017/'
crop_size = (256, 256)
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
    batch_size=8,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=True),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(
            img_path='img_dir/train', seg_map_path='ann_dir/train'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path='img_dir/val', seg_map_path='ann_dir/val'),
        pipeline=test_pipeline))
test_dataloader = dict(
    batch_size=1,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(
            img_path='img_dir/test', seg_map_path='ann_dir/test'),
        pipeline=test_pipeline))
val_evaluator = dict(type='LesionMetric')
test_evaluator = val_evaluator
