# A small GPT-style language model on synthetic token sequences, sharded with FSDP2.
# Run it with `stratagem train examples/configs/transformer_fsdp.py --nproc 2` (CPU: gloo;
# one GPU per process: nccl). Each TransformerBlock is sharded on its own (all-gathered just
# before its forward, freed after), the embeddings and head with the root. Checkpoints are
# directories of DCP shards plus a manifest; they resume on another number of processes.
model = dict(type='TransformerLM', vocab_size=64, dim=64, depth=4, heads=4, max_len=32)

train_dataloader = dict(
    dataset=dict(
        type='SyntheticLanguageModeling',
        num_samples=1024,
        seq_len=32,
        vocab_size=64,
        branching=2,
        seed=0,
    ),
    batch_size=16,
    shuffle=True,
    num_workers=0,
)

strategy = dict(
    type='FSDPStrategy',
    model_wrapper=dict(
        auto_wrap_policy=['TransformerBlock'],
        reshard_after_forward=True,
        # mixed_precision=dict(param_dtype='bfloat16', reduce_dtype='float32'),
    ),
    # activation_checkpointing=['TransformerBlock'],  # recompute blocks in backward
    state_dict_type='sharded',  # 'full': one consolidated file written by rank 0
)

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=3e-3, weight_decay=0.01),
    accumulative_counts=2,  # one reduce-scatter per update
    clip_grad=dict(type='norm', max_norm=1.0),  # the norm of the full (unsharded) gradient
)

param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=8),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, T_max=2, convert_to_iter_based=True),
]

# checkpoints on accumulation-window boundaries: the interval is a multiple of 2
train_cfg = dict(max_epochs=2, checkpoint_interval=16, max_keep_ckpts=2, log_interval=8)

randomness = dict(seed=42, deterministic=False)
work_dir = 'work_dirs/transformer_fsdp'
