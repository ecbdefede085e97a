_base_ = [
    '_base_/models/mlp.py',
    '_base_/datasets/blobs_repeat.py',
    '_base_/default_runtime.py',
]

base_lr = 0.05
max_iters = 6
optim_wrapper = dict(optimizer=dict(type='SGD', lr=base_lr))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.5, by_epoch=False, begin=0, end=2),
    dict(type='MultiStepLR', by_epoch=False, milestones=[4], gamma=0.1),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=3)
val_cfg = dict(type='ValLoop')
default_hooks = dict(checkpoint=dict(by_epoch=False, interval=3))
train_pipeline = {{_base_.test_pipeline}}
