# The KCLA authors' medical segmentation schedule: AdamW (lr 1e-3, weight
# decay 1e-2), 300 epochs, batch 8, and torch's CosineAnnealingLR stepped per
# epoch with T_max=50 and eta_min=1e-5 (periodic: the rate falls to 1e-5
# over 50 epochs, climbs back over the next 50, and so on, as in their code).
# Runtime: mmseg's default, logged by epoch.
_base_ = 'mmseg::_base_/default_runtime.py'
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(
        type='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2))
param_scheduler = [
    dict(
        type='CosineAnnealingLR',
        T_max=50,
        eta_min=1e-5,
        by_epoch=True,
        begin=0,
        end=300)
]
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=300, val_interval=10)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=True),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(
        type='CheckpointHook',
        by_epoch=True,
        interval=10,
        max_keep_ckpts=3,
        save_best='lesion_Dice',
        rule='greater'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
log_processor = dict(by_epoch=True)
# torch's generator in checkpoints: --resume continues exactly; --resume,
# load_from and test.py's checkpoint load with torch's weights_only=True
# (mmengine's own types allowed only while the runner loads)
custom_hooks = [dict(type='TorchRNGStateHook'), dict(type='SafeLoadHook')]
