# Your own model, dataset and validation with `stratagem train`: the package `tinyproj` beside
# this file is imported first (custom_imports), in every process, and registers its classes.
#   stratagem train examples/byo/config.py              # one process
#   stratagem train examples/byo/config.py --nproc 2    # two
custom_imports = dict(imports=['tinyproj'], allow_failed_imports=False)

model = dict(type='TinyNet', in_features=8, hidden=32, num_classes=3)

train_dataloader = dict(
    dataset=dict(type='Blobs', num_samples=256, seed=0), batch_size=16, shuffle=True
)
val_dataloader = dict(
    dataset=dict(type='Blobs', num_samples=50, seed=1), batch_size=8, shuffle=False
)
val_cfg = dict(type='ValLoop')

optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
param_scheduler = [dict(type='CosineAnnealingLR', by_epoch=False, begin=0, eta_min=0.01)]

train_cfg = dict(by_epoch=True, max_epochs=3, val_interval=1, log_interval=8)
default_hooks = dict(
    checkpoint=dict(
        type='CheckpointHook', interval=1, max_keep_ckpts=2, save_best='acc', rule='greater'
    ),
    logger=dict(type='LoggerHook', interval=8),
)
randomness = dict(seed=0)
work_dir = 'work_dirs/byo'
