# dataset settings
dataset_type = 'SyntheticClassification'
data_root = 'data/blobs/'
backend_args = None

train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='RandomResizedCrop', scale=224),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='ResizeEdge', scale=256, edge='short'),
    dict(type='CenterCrop', crop_size=224),
    dict(type='PackInputs'),
]

train_dataloader = dict(
    batch_size=8,
    num_workers=0,
    dataset=dict(type=dataset_type, num_samples=32, num_features=8, seed=0),
    sampler=dict(type='DefaultSampler', shuffle=True),
)
val_dataloader = dict(
    batch_size=8,
    num_workers=0,
    dataset=dict(type=dataset_type, num_samples=16, num_features=8, seed=1),
    sampler=dict(type='DefaultSampler', shuffle=False),
)
