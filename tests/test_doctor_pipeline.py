"""`stratagem doctor` under a pipeline (stratagem/doctor/pipeline.py, and the memory estimate
of a stage): FSDPStrategy's own checks as findings at their keys, the batch a pipeline
needs, and the estimate of the largest pipeline rank's stages (in-process, fake tensors)."""

import copy
import re

import torch
from torch import nn
from torch.utils.data import default_collate

from stratagem import doctor
from stratagem.doctor.memory import estimate_memory

LM = dict(type='TransformerLM', vocab_size=16, dim=16, depth=2, heads=4, max_len=8)
CFG = dict(
    model=LM,
    train_dataloader=dict(
        dataset=dict(type='SyntheticLanguageModeling', num_samples=256, seq_len=8, vocab_size=16),
        batch_size=8,
        shuffle=True,
    ),
    optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
    train_cfg=dict(max_epochs=1, checkpoint_interval=16),
    strategy=dict(
        type='FSDPStrategy',
        mesh=dict(pipeline=2),
        pipeline=dict(schedule='1F1B', microbatches=4, split_points=['blocks.1']),
        model_wrapper=dict(auto_wrap_policy=['TransformerBlock']),
    ),
)


class Unskipping(nn.Module):
    """A model whose forward calls its head even when a stage deleted it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, inputs, targets=None):
        return self.head(self.emb(inputs))


class LossLess(Unskipping):
    """Stages that run on their own, but no ``loss`` method for stratagem train to call."""

    def forward(self, inputs, targets=None):
        x = inputs
        if self.emb is not None:
            x = self.emb(x)
        if self.head is not None:
            x = self.head(x)
        return x


class SequentialBody(nn.Module):
    """A body that is a top-level ``nn.Sequential`` the forward calls whole."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16)

    def forward(self, inputs, targets=None):
        x = self.emb(inputs) if self.emb is not None else inputs
        x = self.body(x)
        return self.head(x) if self.head is not None else x

    @staticmethod
    def loss(logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _cfg(tmp_path, **changes):
    cfg = copy.deepcopy(CFG)
    cfg['work_dir'] = str(tmp_path)
    for dotted, value in changes.items():
        *parents, last = dotted.split('__')
        node = cfg
        for key in parents:
            node = node[key]
        node[last] = value
    return cfg


def _diagnose(tmp_path, nproc=2, memory=False, **changes):
    findings, notes = doctor.diagnose(
        _cfg(tmp_path, **changes), nproc, probe_disk=False, memory=memory
    )
    return {f.where: f for f in findings}, notes


def test_a_pipeline_that_fits_and_its_batch(tmp_path):
    f, notes = _diagnose(tmp_path)
    assert f == {}
    # the two stages of one data-parallel index read one batch
    assert 'real batch = 1 data-parallel rank(s) x 8 micro batch x 1 accumulation = 8' in notes
    f, notes = _diagnose(tmp_path, 4)  # pipeline 2 x shard 2 (shard: the ranks that remain)
    assert f == {}
    assert 'real batch = 2 data-parallel rank(s) x 8 micro batch x 1 accumulation = 16' in notes


def test_what_the_strategy_refuses_is_a_finding_at_its_key(tmp_path):
    f, _ = _diagnose(tmp_path, strategy__pipeline__split_points=['blocks.5'])
    problem = f['strategy.pipeline.split_points'].problem
    assert "'blocks.5' names no module" in problem and 'candidates pos, blocks, blocks.0' in problem
    f, _ = _diagnose(tmp_path, strategy__pipeline__split_points=['blocks.1', 'norm'])
    assert 'give 1 split point(s) (2 stages)' in f['strategy.pipeline'].problem
    f, _ = _diagnose(tmp_path, strategy__pipeline__schedule='ZBVZeroBubble')
    assert 'is not offered' in f['strategy.pipeline.schedule'].problem
    f, _ = _diagnose(tmp_path, strategy__pipeline__microbatch=4)
    assert "did you mean 'microbatches'?" in f['strategy.pipeline'].problem
    f, _ = _diagnose(tmp_path, strategy__mesh=dict(shard=2))
    assert 'needs a pipeline dimension in the mesh' in f['strategy.mesh'].problem
    f, _ = _diagnose(tmp_path, strategy__pipeline=None)
    assert 'mesh.pipeline=2 needs the stages' in f['strategy.pipeline'].problem
    # the mesh at this world size is the mesh check's finding, and only its
    f, _ = _diagnose(tmp_path, 3)
    assert list(f) == ['strategy.mesh']


def test_a_top_level_sequential_split_point_as_the_strategy_reads_it(tmp_path):
    cfg = dict(
        model=dict(type='test_doctor_pipeline.SequentialBody'),
        strategy__model_wrapper__auto_wrap_policy=['Linear'],  # the config's: TransformerLM's
    )
    f, _ = _diagnose(tmp_path, strategy__pipeline__split_points=['body'], **cfg)
    assert f == {}
    f, _ = _diagnose(tmp_path, strategy__pipeline__split_points=['bdy'], **cfg)
    problem = f['strategy.pipeline.split_points'].problem
    assert "'bdy' names no module SequentialBody splits at; did you mean 'body'?" in problem


def test_the_batch_a_pipeline_needs(tmp_path):
    f, _ = _diagnose(tmp_path, strategy__pipeline__microbatches=3)
    assert f['strategy.pipeline.microbatches'].problem.startswith(
        'microbatches=3 does not divide train_dataloader.batch_size=8'
    )
    assert 'use microbatches in [1, 2, 4, 8]' in f['strategy.pipeline.microbatches'].fix
    # 252 samples: the last batch of each epoch holds 4, which train_step refuses
    f, _ = _diagnose(tmp_path, train_dataloader__dataset__num_samples=252)
    assert 'its last batch holds 4, not 8' in f['train_dataloader.drop_last'].problem
    f, _ = _diagnose(
        tmp_path, train_dataloader__dataset__num_samples=252, train_dataloader__drop_last=True
    )
    assert f == {}


def test_a_forward_that_cannot_run_a_stage(tmp_path):
    f, _ = _diagnose(
        tmp_path,
        model=dict(type='test_doctor_pipeline.Unskipping'),
        strategy__pipeline__split_points=['head'],
    )
    assert 'Unskipping.forward calls self.emb without skipping it when it is None' in (
        f['model'].problem
    )


def test_what_stratagem_train_refuses_under_a_pipeline(tmp_path):
    val = copy.deepcopy(CFG['train_dataloader'])
    f, _ = _diagnose(tmp_path, val_dataloader=val)
    assert f == {}  # validation runs under a pipeline (strategy.eval_step)
    # under a pipeline validation averages the model's loss alone, whatever forward returns
    best = dict(type='CheckpointHook', save_best='acc')
    f, _ = _diagnose(tmp_path, val_dataloader=val, default_hooks=dict(checkpoint=best))
    assert "'acc'" in f['default_hooks.checkpoint.save_best'].problem
    assert "['loss']" in f['default_hooks.checkpoint.save_best'].problem
    f, _ = _diagnose(
        tmp_path, val_dataloader=val, default_hooks=dict(checkpoint={**best, 'save_best': 'loss'})
    )
    assert f == {}
    f, _ = _diagnose(
        tmp_path,
        model=dict(type='test_doctor_pipeline.LossLess'),
        strategy__pipeline__split_points=['head'],
    )
    assert "needs the model's loss as a method: LossLess.loss(outputs, targets)" in (
        f['model'].problem
    )


def _estimate(tmp_path, nproc, **changes):
    from stratagem.registry import DATASETS

    # one block: stage 0 runs the embeddings and it, stage 1 the final norm and the head
    cfg = _cfg(tmp_path, model__depth=1, strategy__pipeline__split_points=['norm'], **changes)
    dataset = DATASETS.build(dict(cfg['train_dataloader']['dataset']))
    batch = default_collate([dataset[i] for i in range(8)])
    return estimate_memory(cfg, nproc, batch)


def _stage_parameters(method: str) -> list[torch.Tensor]:
    """The parameters of the pipeline rank the estimate's ``method`` names."""
    from stratagem.models import TransformerLM

    rank = int(re.search(r'pipeline rank (\d)', method).group(1))
    model = TransformerLM(**{**{k: v for k, v in LM.items() if k != 'type'}, 'depth': 1})
    names = ('tok', 'pos', 'blocks.0') if rank == 0 else ('norm', 'head')
    return [p for n, p in model.named_parameters() if n.startswith(names)]


def _adamw_bytes(params: list[torch.Tensor], shards: int = 1) -> int:
    """AdamW's state of ``params`` split over ``shards`` ranks: two fp32 copies, and a 4-byte
    step per parameter tensor (every dimension 0 here divides by 2)."""
    return 2 * 4 * sum(p.numel() for p in params) // shards + 4 * len(params)


def test_memory_estimate_covers_the_largest_pipeline_rank(tmp_path):
    one_f_one_b = _estimate(tmp_path, 2)
    assert re.search(
        r'pipeline rank \d \(stage \d, [12] of 4 microbatches in flight under 1F1B\), the '
        'largest of the 2 pipeline ranks; FSDP over a fake process group of 2',
        one_f_one_b.method,
    ), one_f_one_b.method
    assert one_f_one_b.parts['optimizer'] == _adamw_bytes(_stage_parameters(one_f_one_b.method))
    # pipeline 2 x shard 2: the stage's state in halves; GPipe holds every microbatch's
    # activations, 1F1B at most as many as there are stages from this one to the last
    gpipe = _estimate(tmp_path, 4, strategy__pipeline__schedule='GPipe')
    assert '4 of 4 microbatches in flight under GPipe' in gpipe.method
    assert gpipe.parts['optimizer'] == _adamw_bytes(_stage_parameters(gpipe.method), 2)
    assert gpipe.parts['activations'] > one_f_one_b.parts['activations']
