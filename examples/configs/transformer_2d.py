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
# The model, data, optimizer, schedules and run length are transformer_fsdp.py's.
_base_ = ['transformer_fsdp.py']

strategy = dict(
    mesh=dict(shard=2, tensor=2),  # HSDP instead: mesh=dict(replicate=2, shard=2), no plan
    tensor_parallel_plan={
        'blocks.*.[qkv]': 'colwise',
        'blocks.*.proj': 'rowwise',
        'blocks.*.mlp.0': 'colwise',
        'blocks.*.mlp.2': 'rowwise',
        # 'blocks.*.norm[12]': 'sequence',  # sequence parallelism for the norms
    },
)

work_dir = 'work_dirs/transformer_2d'
