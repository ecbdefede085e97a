"""FSDPStrategy's ``mesh`` and ``tensor_parallel_plan``, checked before anything is built (one
process, no process group): arithmetic, aliases, patterns, styles and divisibility."""

from __future__ import annotations

import pytest
from torch import nn

from stratagem.models import TENSOR_PARALLEL_PLAN, TransformerLM
from stratagem.strategies.fsdp.mesh import MeshSpec, parse_mesh
from stratagem.strategies.fsdp.tensor_parallel import (
    check_plan_fits_mesh,
    parse_tensor_parallel_plan,
)


def test_default_is_flat_over_the_world():
    spec = parse_mesh(None, 8)
    assert spec == MeshSpec(shard=8) and spec.flat
    assert (spec.data_parallel_size, spec.describe()) == (8, 'shard 8')


def test_sizes_layout_and_data_ranks():
    spec = parse_mesh(dict(replicate=2, shard=2, tensor=2), 8)
    assert spec.as_dict() == {'replicate': 2, 'shard': 2, 'tensor': 2}
    assert spec.data_parallel_size == 4
    # consecutive ranks form a tensor group and read one batch
    assert [spec.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert spec.describe() == 'replicate 2 × shard 2 × tensor 2'


@pytest.mark.parametrize(
    'cfg, expected',
    [
        (dict(replicate=2), MeshSpec(2, 4, 1)),  # shard: the ranks that remain
        (dict(tensor=4, shard=-1), MeshSpec(1, 2, 4)),
        (dict(dp_replicate=2, dp_shard=2, tp=2), MeshSpec(2, 2, 2)),
        (dict(data_parallel_replicate_degree=4, tensor_parallel_degree=2), MeshSpec(4, 1, 2)),
    ],
)
def test_aliases_and_the_rest(cfg, expected):
    assert parse_mesh(cfg, 8) == expected


@pytest.mark.parametrize(
    'cfg, message',
    [
        (
            dict(replicate=2, shard=3),
            'pipeline × replicate × shard × tensor = 1 × 2 × 3 × 1 = 6, but the world '
            'size is 8; meshes that fit: dict(shard=8), dict(replicate=2, shard=4)',
        ),
        (dict(replicate=3), 'replicate × tensor = 3 does not divide the world size 8'),
        (dict(shard=0), 'mesh.shard=0: a mesh size is an int >= 1'),
        (dict(tensor=2.0), 'mesh.tensor=2.0: a mesh size is an int >= 1'),
        (dict(tensor=-1), 'mesh.tensor=-1'),
        (dict(shards=8), "unknown key(s) ['shards']; valid: pipeline, replicate, shard, tensor"),
        (dict(tp=2, tensor=2), "'tensor' and 'tp' both set the tensor size"),
    ],
)
def test_mesh_errors_name_the_key_and_what_fits(cfg, message):
    with pytest.raises(ValueError) as err:
        parse_mesh(cfg, 8)
    assert message in str(err.value)


def test_mesh_must_be_a_dict():
    with pytest.raises(TypeError, match=r'mesh=\(2, 2\): give a dict of sizes'):
        parse_mesh((2, 2), 4)


def test_plan_and_tensor_go_together():
    plan = parse_tensor_parallel_plan({'fc': 'colwise'})
    with pytest.raises(ValueError, match='has no tensor dimension'):
        check_plan_fits_mesh(plan, MeshSpec(shard=4), dict(shard=4))
    with pytest.raises(ValueError, match='has tensor=2 but no tensor_parallel_plan'):
        check_plan_fits_mesh(None, MeshSpec(shard=2, tensor=2), dict(shard=2, tensor=2))
    check_plan_fits_mesh(plan, MeshSpec(shard=2, tensor=2), {})


def _lm(**kw):
    return TransformerLM(**{**dict(vocab_size=16, dim=16, depth=2, heads=4, max_len=8), **kw})


def test_plan_resolves_patterns_over_the_model():
    plan = parse_tensor_parallel_plan(TENSOR_PARALLEL_PLAN)
    chosen = plan.resolve(_lm(), 2)
    assert chosen == {
        **{f'blocks.{i}.{n}': 'colwise' for i in range(2) for n in ('q', 'k', 'v', 'mlp.0')},
        **{f'blocks.{i}.{n}': 'rowwise' for i in range(2) for n in ('proj', 'mlp.2')},
    }


def test_plan_errors():
    model = _lm()
    with pytest.raises(ValueError) as err:
        parse_tensor_parallel_plan({'blocks.*.fc1': 'colwise'}).resolve(model, 2)
    assert "pattern 'blocks.*.fc1' matches no module of TransformerLM" in str(err.value)
    assert 'blocks.0.mlp' in str(err.value)  # the names there are
    with pytest.raises(ValueError, match=r"'colwsie' is not a style; did you mean 'colwise'"):
        parse_tensor_parallel_plan({'blocks.*.q': 'colwsie'})
    with pytest.raises(ValueError, match='split nn.Linear or nn.Embedding modules'):
        parse_tensor_parallel_plan({'blocks.0': 'colwise'}).resolve(model, 2)
    with pytest.raises(ValueError, match='is matched with .colwise. and by .* with .rowwise.'):
        parse_tensor_parallel_plan({'blocks.*.q': 'colwise', 'blocks.0.[qk]': 'rowwise'}).resolve(
            model, 2
        )
    # a dimension the tensor size does not divide: 3 × 16 = 48 hidden; 16 % 3
    with pytest.raises(ValueError) as err:
        parse_tensor_parallel_plan({'blocks.*.proj': 'rowwise'}).resolve(model, 3)
    assert (
        "module 'blocks.0.proj' (Linear): in_features=16 is not divisible by the tensor "
        'size 3' in str(err.value)
    )
    assert '[2, 4, 8, 16]' in str(err.value)
    with pytest.raises(TypeError, match='give a dict of module-name patterns'):
        parse_tensor_parallel_plan(['blocks.*.q'])


def test_sequence_needs_a_wrapped_block():
    model = _lm()
    plan = parse_tensor_parallel_plan({**TENSOR_PARALLEL_PLAN, 'blocks.*.norm[12]': 'sequence'})
    blocks = list(model.blocks)
    plan.check(model, 2, blocks)  # inside the sharded blocks: fine
    assert plan.blocks_needing_sequence_split(plan.resolve(model, 2), model, blocks) == blocks
    with pytest.raises(
        ValueError,
        match="'blocks.0.norm1' is 'sequence' but is not inside a "
        'block of model_wrapper.auto_wrap_policy',
    ):
        plan.check(model, 2, [])


def test_callable_plan_is_taken_as_is():
    calls = []
    plan = parse_tensor_parallel_plan(lambda model, mesh: calls.append((model, mesh)))
    model = nn.Linear(2, 2)
    plan.apply(model, 'mesh', [])
    assert calls == [(model, 'mesh')] and plan.resolve(model, 2) == {}
