# Linear warm-up over 20 iterations, then a cosine over the rest of a 200-iteration run.
# Drawn in the docs by `stratagem plot-schedule docs/schedules/warmup_cosine.py`.
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=20),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=20, end=200, T_max=180),
]
train_cfg = dict(by_epoch=False, max_iters=200)
