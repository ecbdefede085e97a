# optimizer
base_lr = 0.1
optim_wrapper = dict(optimizer=dict(type='SGD', lr=base_lr, momentum=0.9, weight_decay=0.0001))

# learning policy
max_epochs = 4
param_scheduler = dict(type='MultiStepLR', by_epoch=True, milestones=[2, 3], gamma=0.1)

# train, val, test setting
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
val_cfg = dict(type='ValLoop')

# NOTE: `auto_scale_lr` is for automatically scaling LR,
# based on the actual training batch size.
auto_scale_lr = dict(enable=False, base_batch_size=32)
