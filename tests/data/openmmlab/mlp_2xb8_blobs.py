# the mmpretrain way: four bases, then what this experiment changes
_base_ = [
    '_base_/models/mlp.py',
    '_base_/datasets/blobs.py',
    '_base_/schedules/sgd_4e.py',
    '_base_/default_runtime.py',
]

# a base's value by mmengine's placeholder, and by the pure-python reference
max_epochs = 1
num_classes = {{_base_.num_classes}}
model = dict(num_classes=num_classes, hidden=_base_.model.hidden * 2)
train_cfg = dict(max_epochs=max_epochs)
train_dataloader = dict(batch_size=4, dataset=dict(num_classes=num_classes))
val_dataloader = dict(dataset=dict(num_classes={{_base_.num_classes}}))
optim_wrapper = dict(optimizer=dict(lr=_base_.base_lr / 2))
