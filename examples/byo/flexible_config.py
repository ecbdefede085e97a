# An mmengine runner config with your own model, data and metric (tinyproj_mm.py, beside this
# file): val_evaluator is read only by mmengine's runner, so `stratagem train` runs this config
# under mmengine's FlexibleRunner, on stratagem's strategies (no `strategy` key: stratagem's
# SingleDeviceStrategy in one process, its DDPStrategy under --nproc; DDPStrategy, FSDPStrategy
# and DeepSpeedStrategy name stratagem's).
#   pip install "stratagem[mmengine]"
#   stratagem train examples/byo/flexible_config.py              # one process
#   stratagem train examples/byo/flexible_config.py --nproc 2    # two
custom_imports = dict(imports=['tinyproj_mm'], allow_failed_imports=False)
runner_type = 'FlexibleRunner'

model = dict(type='TinyMMNet', in_features=8, hidden=32, num_classes=3)

train_dataloader = dict(
    dataset=dict(type='Blobs', num_samples=128, seed=0),
    batch_size=16,
    sampler=dict(type='DefaultSampler', shuffle=True),
    collate_fn=dict(type='default_collate'),
)
val_dataloader = dict(
    dataset=dict(type='Blobs', num_samples=50, seed=1),
    batch_size=8,
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='default_collate'),
)
val_evaluator = dict(type='TinyAccuracy')
val_cfg = dict(type='ValLoop')

optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
param_scheduler = [dict(type='CosineAnnealingLR', by_epoch=False, begin=0, eta_min=0.01)]
train_cfg = dict(by_epoch=True, max_epochs=2, val_interval=1)

default_hooks = dict(
    checkpoint=dict(type='CheckpointHook', interval=1),
    logger=dict(type='LoggerHook', interval=4),
)
randomness = dict(seed=0)
work_dir = 'work_dirs/byo_flexible'
