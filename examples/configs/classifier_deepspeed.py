# The example classifier under DeepSpeed ZeRO-2 (CPU: gloo and DeepSpeed's CPU accelerator).
# Run it with `stratagem train examples/configs/classifier_deepspeed.py --nproc 2`
# (needs `pip install "stratagem[deepspeed]"`; the first run JIT-builds a DeepSpeed op, ~1 min).
# The strategy takes mmengine's DeepSpeedStrategy arguments. Accumulation and clipping are the
# optim wrapper's: DeepSpeed's gradient_accumulation_steps / gradient_clipping are derived from
# them (a different value given here would be an error), and the micro batch is the loader's.
_base_ = './classifier.py'

strategy = dict(
    _delete_=True,
    type='DeepSpeedStrategy',
    zero_optimization=dict(stage=2, overlap_comm=False, contiguous_gradients=True),
    # bf16=dict(enabled=True),  # runs on CPU too; fp16 needs CUDA
)

optim_wrapper = dict(
    _delete_=True,
    type='DeepSpeedOptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-3, weight_decay=1e-4),
    accumulative_counts=2,
    clip_grad=dict(type='norm', max_norm=5.0),
)

# the base's cosine spans its 4 epochs; this run has 2 (stratagem doctor: the lr would never
# reach its minimum)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=20),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, T_max=2, convert_to_iter_based=True),
]

# checkpoints are directories (DeepSpeed's files + stratagem's manifest), taken on window
# boundaries: the interval is a multiple of accumulative_counts
train_cfg = dict(max_epochs=2, checkpoint_interval=16, max_keep_ckpts=2, log_interval=8)
work_dir = 'work_dirs/classifier_deepspeed'
