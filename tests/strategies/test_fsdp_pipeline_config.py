"""FSDPStrategy's pipeline config, in process: the mesh's pipeline dimension, the schedule,
the split points against a model, the forward check, the stages cut from a model and the
refusals, each naming the key and what would fit, before the model is touched. A top-level
``nn.Sequential`` is a split point (its first entry begins the stage), and a model that is an
``nn.Sequential`` splits at its entries; a split point that names nothing gets a did-you-mean
at the level it was written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.models import TransformerLM
from stratagem.strategies.fsdp.mesh import MeshSpec, parse_mesh
from stratagem.strategies.fsdp.pipeline import (
    meta_skeleton,
    model_units,
    parse_pipeline,
    split_positions,
)


def _lm(depth=4):
    torch.manual_seed(0)
    return TransformerLM(vocab_size=16, dim=16, depth=depth, heads=2, max_len=8)


def test_the_pipeline_dimension_is_outermost():
    spec = parse_mesh(dict(pipeline=2, shard=2, tensor=2), 8)
    assert spec == MeshSpec(replicate=1, shard=2, tensor=2, pipeline=2)
    assert spec.data_parallel_size == 2
    # rank = p·(R·S·T) + d·T + t
    assert [spec.pipeline_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [spec.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert spec.describe() == 'pipeline 2 × shard 2 × tensor 2'
    assert spec.as_dict() == {'pipeline': 2, 'replicate': 1, 'shard': 2, 'tensor': 2}
    assert parse_mesh(dict(pp=2), 4) == MeshSpec(shard=2, pipeline=2)  # shard: what remains
    assert 'pipeline' not in parse_mesh(None, 4).as_dict()  # meta without a pipeline: as before


def test_parse_pipeline_defaults_and_names():
    mesh = MeshSpec(shard=1, pipeline=2)
    spec = parse_pipeline(dict(split_points='blocks.2'), mesh)
    assert (spec.schedule, spec.microbatches, spec.split_points, spec.stages) == (
        '1F1B',
        2,
        ('blocks.2',),
        2,
    )
    assert (
        parse_pipeline(dict(schedule='ScheduleGPipe', split_points=['head']), mesh).schedule
        == 'GPipe'
    )
    inter = parse_pipeline(
        dict(
            schedule='interleaved1f1b',
            n_microbatches=4,
            split_points=['blocks.1', 'blocks.2', 'blocks.3'],
        ),
        mesh,
    )
    assert inter.stage_indices(0) == [0, 2] and inter.stage_indices(1) == [1, 3]
    assert inter.stage_rank(3) == 1 and inter.microbatches == 4
    assert parse_pipeline(None, MeshSpec(shard=4)) is None


@pytest.mark.parametrize(
    'cfg, mesh, message',
    [
        (None, MeshSpec(pipeline=2), 'mesh.pipeline=2 needs the stages'),
        (dict(split_points=['head']), MeshSpec(shard=2), 'needs a pipeline dimension in the mesh'),
        (
            dict(splits=['head']),
            MeshSpec(pipeline=2),
            "unknown key(s) ['splits']; did you mean 'split_points'?",
        ),
        (
            dict(schedule='Zig', split_points=['head']),
            MeshSpec(pipeline=2),
            "schedule='Zig': unknown; valid: GPipe, 1F1B",
        ),
        (
            dict(schedule='ZBVZeroBubble', split_points=['head']),
            MeshSpec(pipeline=2),
            'gradients that differ',
        ),
        (dict(split_points=[]), MeshSpec(pipeline=2), 'split_points=[]: give the names'),
        (dict(split_points=['a', 'a']), MeshSpec(pipeline=2), 'a split point is given twice'),
        (
            dict(microbatches=0, split_points=['head']),
            MeshSpec(pipeline=2),
            'microbatches=0: an int >= 1',
        ),
        (
            dict(split_points=['blocks.1', 'blocks.2']),
            MeshSpec(pipeline=2),
            "schedule '1F1B' runs exactly one stage per pipeline rank; mesh.pipeline=2 with 2 "
            'split point(s) gives 3 stages, which do not divide into the ranks so: give 1 split '
            "point(s) (2 stages), or schedule='Interleaved1F1B'",
        ),
        (
            dict(schedule='Interleaved1F1B', split_points=['blocks.1', 'blocks.2']),
            MeshSpec(pipeline=2),
            'gives 3 stages, which do not divide into the ranks so: give 3 split point(s) (4 '
            "stages) or a multiple of 2 stages, or schedule='1F1B'",
        ),
    ],
)
def test_pipeline_refusals_name_the_key(cfg, mesh, message):
    with pytest.raises(ValueError) as err:
        parse_pipeline(cfg, mesh)
    assert message in str(err.value)


def _spec(*splits, schedule='1F1B', ranks=2):
    return parse_pipeline(
        dict(schedule=schedule, split_points=list(splits)), MeshSpec(pipeline=ranks)
    )


def test_stages_follow_the_model_order():
    model = _lm()
    assert model_units(model) == [
        'tok', 'pos', 'blocks.0', 'blocks.1', 'blocks.2', 'blocks.3', 'norm', 'head'
    ]  # fmt: skip
    assert _spec('blocks.2').stage_modules(model) == [
        ['tok', 'pos', 'blocks.0', 'blocks.1'],
        ['blocks.2', 'blocks.3', 'norm', 'head'],
    ]


@pytest.mark.parametrize(
    'splits, message',
    [
        (
            ['blocks.9'],
            "'blocks.9' names no module TransformerLM splits at; did you mean 'blocks.3'?",
        ),
        (['blocks.2.q'], "did you mean 'blocks.2'?"),
        (
            ['blocks.2.q'],
            'candidates pos, blocks, blocks.0, blocks.1, blocks.2, blocks.3, norm, head',
        ),
        (
            ['tok'],
            "in TransformerLM (and not be its first module, 'tok')",
        ),
    ],
)
def test_split_points_refused_before_the_model_is_touched(splits, message):
    model = _lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        _spec(*splits).stage_modules(model)
    assert message in str(err.value)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_out_of_order_split_points():
    with pytest.raises(ValueError, match='each must come after the previous one'):
        _spec('blocks.3', 'blocks.1', 'blocks.2', schedule='Interleaved1F1B').stage_modules(_lm())


class _Unguarded(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Indexing(_Unguarded):
    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        x = self.layers[0](x)
        x = self.layers[1](x)
        return self.head(x) if self.head is not None else x


def test_a_forward_that_cannot_skip_a_deleted_module_is_refused_naming_it():
    model = _Unguarded()
    spec = _spec('layers.1')
    with pytest.raises(ValueError, match=r'_Unguarded.forward calls self.head without skipping'):
        spec.check_forward(model, spec.stage_modules(model))
    model = _Indexing()
    with pytest.raises(ValueError, match=r'indexes self.layers\[...\].*for block in self.layers'):
        spec.check_forward(model, spec.stage_modules(model))
    # a split that keeps layers whole: indexing it is fine
    spec.check_forward(model, _spec('head').stage_modules(model))
    lm = _lm()
    _spec('blocks.2').check_forward(lm, _spec('blocks.2').stage_modules(lm))


def test_root_parameters_belong_to_no_stage():
    model = _Unguarded()
    model.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r'has parameters of its own \(scale\)'):
        _spec('head').stage_modules(model)


def test_a_stage_keeps_the_model_names_and_runs_on_its_own():
    model = _lm().double()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(16, (2, 8))
    want = model(x)
    spec = _spec('blocks.2')
    first = spec.keep_stages(_lm().double().requires_grad_(False), [0])
    second = spec.keep_stages(_lm().double(), [1])
    assert (
        first.head is None
        and first.norm is None
        and list(first.blocks)
        == [
            first.blocks.get_submodule('0'),
            first.blocks.get_submodule('1'),
        ]
    )
    names = set(first.state_dict()) | set(second.state_dict())
    assert names == set(full) and not set(first.state_dict()) & set(second.state_dict())
    assert 'blocks.2.k.weight' in second.state_dict()
    assert torch.equal(second(first(x)), want)
    # several stages per rank: views sharing the modules
    inter = _spec('blocks.1', 'blocks.2', 'blocks.3', schedule='Interleaved1F1B')
    lm = _lm().double()
    stages = inter.stage_modules(lm)
    inter.keep_stages(lm, [0, 2])
    views = [inter.stage_view(lm, i, stages) for i in (0, 2)]
    assert views[0].blocks.get_submodule('0') is lm.blocks.get_submodule('0')
    assert [n for n, _ in views[1].named_children()] == ['blocks']  # tok, pos, norm, head: None
    assert set(dict(views[1].blocks.named_children())) == {'2'}


def test_the_dry_run_refuses_a_stage_that_fails_and_a_loss_that_is_not_a_scalar():
    spec = _spec('layers.1')
    model = _Unguarded()
    skeleton = meta_skeleton(model)
    assert all(p.is_meta for p in skeleton.parameters()) and not any(
        p.is_meta for p in model.parameters()
    )
    x, y = torch.randn(2, 4), torch.randint(2, (2,))
    with pytest.raises(
        ValueError, match=r'stage 0 \(embed, layers.0\) of _Unguarded fails on its own: TypeError'
    ):
        spec.dry_run(skeleton, (x,), y, nn.functional.cross_entropy)
    lm = meta_skeleton(_lm())
    ids = torch.randint(16, (2, 8))
    ok = _spec('blocks.2').dry_run(lm, (ids,), ids, TransformerLM.loss)
    assert ok == torch.float32
    with pytest.raises(ValueError, match=r'must return a scalar tensor .* of shape \(2, 8, 16\)'):
        _spec('blocks.2').dry_run(lm, (ids,), ids, lambda out, t: out)


class _Net(nn.Module):
    """A stem, a body that is an ``nn.Sequential`` its forward calls whole, and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x)
        x = self.body(x)  # an empty Sequential (a stage without the body) passes x through
        return self.head(x) if self.head is not None else x


def _seq():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 2))
    )


def _run_stages(spec, make, x):
    """The stages cut from fresh copies of ``make()``, run one after the other on ``x``."""
    for index in range(spec.stages):
        x = spec.keep_stages(make(), [index])(x)
    return x


def test_a_top_level_sequential_is_a_split_point():
    model = _Net()
    assert split_positions(model) == {
        'stem': 0, 'body': 1, 'body.0': 1, 'body.1': 2, 'body.2': 3, 'head': 4
    }  # fmt: skip
    spec = _spec('body')
    assert spec.stage_modules(model) == [['stem'], ['body.0', 'body.1', 'body.2', 'head']]
    spec.check_forward(model, spec.stage_modules(model))
    first = spec.keep_stages(_Net(), [0])
    assert first.head is None and len(first.body) == 0
    x = torch.randn(3, 4)
    assert torch.equal(_run_stages(spec, _Net, x), model(x))
    # the same stages as its first entry; a later entry splits the body
    assert _spec('body.0').stage_modules(model) == spec.stage_modules(model)
    assert torch.equal(_run_stages(_spec('body.2'), _Net, x), model(x))


def test_a_model_that_is_a_sequential_splits_at_its_entries():
    model = _seq()
    assert model_units(model) == ['0', '1', '2', '3.0', '3.1']
    spec = _spec('2', '3', ranks=3)
    assert spec.stage_modules(model) == [['0', '1'], ['2'], ['3.0', '3.1']]
    last = spec.keep_stages(_seq(), [2])
    assert [n for n, _ in last.named_children()] == ['3']  # removed, not None: it iterates
    assert set(last.state_dict()) == {'3.1.weight', '3.1.bias'}
    x = torch.randn(3, 4)
    assert torch.equal(_run_stages(spec, _seq, x), model(x))
    # several stages a rank: views that share the modules
    inter = _spec('1', '2', '3', schedule='Interleaved1F1B')
    stages = inter.stage_modules(model)
    held = inter.keep_stages(_seq(), [0, 2])
    views = [inter.stage_view(held, i, stages) for i in (0, 2)]
    assert views[1].get_submodule('2') is held.get_submodule('2')
    assert [n for n, _ in views[0].named_children()] == ['0', '3']  # '3' empty: x as it is
    assert torch.equal(views[0](x), held.get_submodule('0')(x))


@pytest.mark.parametrize(
    'point, meant',
    [
        ('bdy', 'body'),  # a top-level name: a top-level one
        ('body.7', 'body.2'),  # an entry: an entry of the same container
        ('body.1.weight', 'body.1'),  # inside a unit: the unit
        ('stm', 'stem'),
    ],
)
def test_the_did_you_mean_is_at_the_level_written(point, meant):
    with pytest.raises(ValueError) as err:
        _spec(point).stage_modules(_Net())
    assert f"'{point}' names no module _Net splits at; did you mean '{meant}'?" in str(err.value)
    assert 'candidates body, body.0, body.1, body.2, head' in str(err.value)


def test_split_points_at_one_module_are_refused_saying_where_each_begins():
    with pytest.raises(ValueError) as err:
        _spec('body', 'body.0', 'head', schedule='Interleaved1F1B').stage_modules(_Net())
    assert "'body' begins at 'body.0'; the model runs stem, body.0" in str(err.value)
