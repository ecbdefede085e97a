# The GPT-style language model of transformer_fsdp.py on a 2-D mesh: FSDP over `shard`, tensor
# parallelism over `tensor` (Megatron's split: q, k, v and the MLP's first Linear column-wise,
# the attention output and the MLP's second Linear row-wise; each rank of a tensor group holds
# 2 of the 4 heads). Run it with 4 processes:
#   stratagem train examples/configs/transformer_2d.py --nproc 4
# The two ranks of a tensor group read the same batch, so the real batch is
# 2 (shard) x 16 x 2 (accumulation). Check the mesh and the plan first, without a process:
#   stratagem doctor examples/configs/transformer_2d.py --nproc 4
# Checkpoints are DCP directories that resume on any mesh: dict(shard=4), dict(replicate=2,
# shard=2), 2 processes, or one (`stratagem convert` makes one file or .safetensors).
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
    mesh=dict(shard=2, tensor=2),  # HSDP instead: mesh=dict(replicate=2, shard=2), no plan
    tensor_parallel_plan={
        'blocks.*.[qkv]': 'colwise',
        'blocks.*.proj': 'rowwise',
        'blocks.*.mlp.0': 'colwise',
        'blocks.*.mlp.2': 'rowwise',
        # 'blocks.*.norm[12]': 'sequence',  # sequence parallelism for the norms
    },
    model_wrapper=dict(auto_wrap_policy=['TransformerBlock']),
)

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=3e-3, weight_decay=0.01),
    accumulative_counts=2,
    clip_grad=dict(type='norm', max_norm=1.0),  # the norm over every shard and tensor slice
)

param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=8),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, T_max=2, convert_to_iter_based=True),
]

train_cfg = dict(max_epochs=2, checkpoint_interval=16, max_keep_ckpts=2, log_interval=8)

randomness = dict(seed=42, deterministic=False)
work_dir = 'work_dirs/transformer_2d'
