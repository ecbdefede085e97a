# A small classifier on the synthetic dataset: trains in a few seconds on 2 CPU cores.
# Run it with `stratagem train examples/configs/classifier.py` (or `make demo`).
model = dict(
    type='MLPClassifier', in_features=16, num_classes=4, hidden=64, num_layers=2, dropout=0.1
)

train_dataloader = dict(
    dataset=dict(
        type='SyntheticClassification',
        num_samples=2048,
        num_features=16,
        num_classes=4,
        noise=5.0,
        seed=0,
    ),
    batch_size=32,
    shuffle=True,
    num_workers=0,
)

strategy = dict(type='auto')

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=1e-4),
    clip_grad=dict(type='norm', max_norm=5.0),
)

param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=20),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, T_max=4, convert_to_iter_based=True),
]

train_cfg = dict(max_epochs=4, checkpoint_interval=64, max_keep_ckpts=2, log_interval=16)

randomness = dict(seed=42, deterministic=False)
work_dir = 'work_dirs/classifier'
