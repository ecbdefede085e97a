# Polynomial decay (power 1.0: linear) to eta_min, common for segmentation; AdamW has no momentum.
# Drawn in the docs by `stratagem plot-schedule docs/schedules/poly.py`.
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))
param_scheduler = dict(type='PolyLR', eta_min=1e-5, power=1.0, by_epoch=False, begin=0, end=400)
train_cfg = dict(by_epoch=False, max_iters=400)
