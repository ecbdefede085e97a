# the mmdet way: a dataset wrapper, its pipeline a helper variable; yaml-free, all python
_base_ = './blobs.py'

train_dataset = dict(type='RepeatDataset', times=2, dataset=dict(type={{_base_.dataset_type}}))
