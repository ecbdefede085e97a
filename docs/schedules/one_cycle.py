# One cycle (Smith, 2018): the lr rises to 0.1 and anneals; momentum moves the other way.
# Drawn in the docs by `stratagem plot-schedule docs/schedules/one_cycle.py`.
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
param_scheduler = dict(type='OneCycleLR', eta_max=0.1, total_steps=300, by_epoch=False)
train_cfg = dict(by_epoch=False, max_iters=300)
