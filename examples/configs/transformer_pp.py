# The GPT-style language model of transformer_fsdp.py cut into 2 pipeline stages: stage 0 runs
# the embeddings and blocks 0-1, stage 1 blocks 2-3, the final norm and the head. Run it with
# 2 processes (one stage each):
#   stratagem train examples/configs/transformer_pp.py --nproc 2
# or on 4: the shard size is the ranks that remain (2), so each stage is sharded over 2
# processes and 2 data-parallel ranks read their own batches.
# Check the stages, the mesh and the memory of one stage first, without a process:
#   stratagem doctor examples/configs/transformer_pp.py --nproc 2
# Every step, the 1F1B schedule runs the batch of 16 sequences as 4 microbatches of 4; the
# gradients are the mean over the microbatches, the batch's own. Checkpoints are DCP
# directories under the model's own parameter names, whichever stage holds them: they resume
# on this mesh, without a pipeline (mesh=dict(shard=2)) or on one process.
_base_ = ['transformer_fsdp.py']

model = dict(depth=4)  # 4 blocks: 2 a stage

strategy = dict(
    mesh=dict(pipeline=2),  # shard=-1 left out: world size / 2 (1 on 2 processes, 2 on 4)
    pipeline=dict(
        schedule='1F1B',  # or 'GPipe'; 'Interleaved1F1B' runs 2+ stages a rank
        microbatches=4,  # divides the batch of 16 each data-parallel rank reads
        split_points=['blocks.2'],  # stage 1 begins at block 2
    ),
)

train_dataloader = dict(
    dataset=dict(num_samples=256),
    drop_last=True,  # every step's batch splits into the same microbatches
)

# no accumulation here (transformer_fsdp.py accumulates 2); clipping takes the norm over both
# stages' gradients
optim_wrapper = dict(accumulative_counts=1)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=4),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, T_max=2, convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=2, checkpoint_interval=8, max_keep_ckpts=2, log_interval=4)

work_dir = 'work_dirs/transformer_pp'
