# Step decay by epoch: the lr is multiplied by 0.1 at epochs 6 and 9 of 12 (50 iterations each).
# Drawn in the docs by `stratagem plot-schedule docs/schedules/multistep.py --epoch-length 50`.
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
param_scheduler = dict(type='MultiStepLR', by_epoch=True, milestones=[6, 9], gamma=0.1)
train_cfg = dict(by_epoch=True, max_epochs=12)
