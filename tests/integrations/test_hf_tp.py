"""Hugging Face models on FSDPStrategy's mesh: ``tensor_parallel_plan='auto'`` (the plan a
``transformers`` model declares, its style names mapped onto torch's) and
``auto_wrap_policy='auto'`` (its ``_no_split_modules``).

A tiny ``LlamaForCausalLM`` (float64) on ``mesh=dict(shard=2, tensor=2)`` (4 gloo processes,
one spawn for the module) trains 5 AdamW steps as one process does on the whole batch, with
untied and with tied input and output embeddings; what 'auto' reads from a real Llama is
checked in rank 0 of that spawn (which has transformers imported), the style mapping and the
refusals on duck-typed models in this process.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from scenarios import Scenarios
from stratagem.strategies.fsdp.config import parse_model_wrapper
from stratagem.strategies.fsdp.tensor_parallel import (
    HF_STYLES,
    declared_plan,
    parse_tensor_parallel_plan,
    torch_style,
)

pytest.importorskip('transformers', reason='transformers is an optional extra (stratagem[hf])')

STEPS, MICRO, SEQ, LR = 5, 2, 8, 0.01
LLAMA = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=32,
)
SCENARIOS = Scenarios(four=dict(nproc=4, timeout=300))


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # float64: the comparison with one process shows the maths, not float32 rounding
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **kw})).double()


def _batch(it, dp_rank=None, dp_size=2):
    g = torch.Generator().manual_seed(100 + it)
    ids = torch.randint(LLAMA['vocab_size'], (dp_size * MICRO, SEQ), generator=g)
    return ids if dp_rank is None else ids[dp_rank * MICRO : (dp_rank + 1) * MICRO]


def _loss(model, ids):
    """Next-token cross entropy in float64 (transformers' own loss upcasts the logits to
    float32, whose rounding would be all the comparison sees)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _reference(tied):
    """One process, the whole batch, a hand-written loop: the oracle."""
    model = _llama(tie_word_embeddings=tied)
    torch.manual_seed(1)  # prepare's init_weights draws as this one does
    model.init_weights()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for it in range(STEPS):
        ids = _batch(it)
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # how far the least-moved tensor went: an update that did nothing would also "match"
    moved = min((final[k] - v).abs().max().item() for k, v in start.items())
    return losses, final, moved


def _on_tensor(weight):
    """The weight's placement on the mesh's 'tensor' dimension (None: not split there)."""
    names = weight.device_mesh.mesh_dim_names
    return str(weight.placements[names.index('tensor')]) if 'tensor' in names else None


def _train(work, tied):
    """5 AdamW steps on ``mesh=dict(shard=2, tensor=2)`` with both ``'auto'`` s."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from stratagem.strategies import build_strategy

    s = build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=str(Path(work) / f'llama_{tied}'),
            mesh=dict(shard=2, tensor=2),
            tensor_parallel_plan='auto',
            model_wrapper=dict(auto_wrap_policy='auto'),
            env_kwargs=dict(randomness=dict(seed=5)),
        )
    )
    model = _llama(tie_word_embeddings=tied)
    torch.manual_seed(1)
    model, ow = s.prepare(model, optim_wrapper=dict(optimizer=dict(type='AdamW', lr=LR)))
    inner = model.model.layers[0]
    weights = {
        'q_proj': inner.self_attn.q_proj.weight,
        'o_proj': inner.self_attn.o_proj.weight,
        'norm': inner.input_layernorm.weight,
        'embed': model.model.embed_tokens.weight,
        'lm_head': model.lm_head.weight,
    }
    split = {
        **{k: (tuple(w.to_local().shape), _on_tensor(w)) for k, w in weights.items()},
        'mesh': s.device_mesh.mesh_dim_names,
        'sharded_blocks': sum(type(m).__name__ == 'FSDPLlamaDecoderLayer' for m in model.modules()),
        'tied': model.lm_head.weight is model.model.embed_tokens.weight,
    }
    losses = []
    for it in range(STEPS):
        ids = _batch(it, s.data_parallel_rank, s.data_parallel_size)
        with ow.optim_context(model):
            loss = _loss(model, ids)
        ow.update_params(loss)
        losses.append(loss.item())
    opts = StateDictOptions(full_state_dict=True)
    final = {k: v.detach().clone() for k, v in get_model_state_dict(model, options=opts).items()}
    return {
        'dp': s.data_parallel_rank,
        'losses': losses,
        'final': final,
        'split': split,
        'reference': _reference(tied) if s.rank == 0 else None,
    }


# untied (Llama's default) and tied: the head and the embedding share one weight, which the
# plan splits twice (colwise_gather_output, embedding_rowwise) and the strategy ties again
SCENARIOS.add('four', name='llama_2d')(functools.partial(_train, tied=False))
SCENARIOS.add('four', name='llama_2d_tied')(functools.partial(_train, tied=True))


@SCENARIOS.add('four')
def llama_plan(work):
    """What 'auto' reads from a real LlamaForCausalLM, and what it refuses, without a mesh:
    in rank 0, which has imported transformers already (the import costs this process
    seconds)."""
    if torch.distributed.get_rank():
        return None
    model = _llama()
    try:
        parse_tensor_parallel_plan('auto').check(model, 4, [])
        heads = None
    except ValueError as err:
        heads = str(err)
    blocks = parse_model_wrapper(dict(auto_wrap_policy='auto')).targets(model)
    linear, embedding = nn.Linear(4, 4), nn.Embedding(8, 4)
    cases = {
        'colwise': ('colwise', linear, False),
        'rowwise': ('rowwise', linear, False),
        'colwise_rep': ('colwise_rep', linear, False),
        'rowwise_rep': ('rowwise_rep', linear, False),
        'rowwise_rep Embedding': ('rowwise_rep', embedding, False),
        'rowwise Embedding': ('rowwise', embedding, False),
        'sequence': ('sequence', linear, False),
        'colwise in a split block': ('colwise', linear, True),
        'rowwise in a split block': ('rowwise', linear, True),
    }
    styles = {}
    for case, (style, module, split) in cases.items():
        got = torch_style(style, module, sequence_split=split)
        styles[case] = (type(got).__name__,)
        if hasattr(got, 'output_layouts'):
            styles[case] += (
                tuple(map(str, got.input_layouts)),
                tuple(map(str, got.output_layouts)),
                got.use_local_output,
            )
    return {
        'styles': styles,
        'declared': declared_plan(model),
        'tp_plan': dict(model._tp_plan),
        'chosen': parse_tensor_parallel_plan('auto').resolve(model, 2),
        'heads': heads,
        'blocks': [n for n, m in model.named_modules() if any(m is b for b in blocks)],
    }


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('hf_tp'))


@pytest.mark.parametrize('name, tied', [('llama_2d', False), ('llama_2d_tied', True)])
@pytest.mark.scenario('{name}')
def test_llama_on_shard_2_tensor_2_equals_one_process(scenario, name, tied):
    ref_losses, ref, moved = scenario[0]['reference']
    assert moved > 1e-3  # every tensor of the oracle was updated
    assert [r['dp'] for r in scenario] == [0, 0, 1, 1]  # a tensor group reads one batch
    # each data-parallel half's mean loss; the whole batch's is their mean (equal tokens)
    losses = [(a + b) / 2 for a, b in zip(scenario[0]['losses'], scenario[2]['losses'])]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-6, (losses, ref_losses)
    assert scenario[1]['losses'] == scenario[0]['losses']  # the tensor ranks agree
    for r in scenario:
        assert r['split']['tied'] is tied
        assert r['final'].keys() == ref.keys()
        worst = max((r['final'][k] - ref[k]).abs().max().item() for k in ref)
        assert worst < 1e-6, worst


@pytest.mark.scenario('llama_2d')
def test_llama_auto_plan_splits_the_declared_modules(scenario):
    # hidden 16, 4 heads of 4, 2 kv heads, vocab 32: (local shape, placement on 'tensor');
    # FSDP then halves dimension 0 over 'shard'
    for r in scenario:
        assert r['split'] == {
            'q_proj': ((4, 16), 'S(0)'),  # colwise: 2 of 4 heads (8 rows) per tensor rank
            'o_proj': ((8, 8), 'S(1)'),  # rowwise: half the input features
            'norm': ((8,), None),  # not in the plan: sharded by FSDP only
            'embed': ((8, 16), 'S(0)'),  # embedding_rowwise: half the vocabulary
            'lm_head': ((8, 16), 'S(0)'),  # colwise_gather_output: half the vocabulary
            'mesh': ('shard', 'tensor'),
            'sharded_blocks': 2,  # auto_wrap_policy='auto': both LlamaDecoderLayers
            'tied': False,
        }


@pytest.mark.scenario('llama_plan')
def test_declared_plan_of_llama_is_its_tp_plan(scenario):
    llama = scenario[0]
    plan = llama['declared']
    assert plan == llama['tp_plan']  # transformers 5 merges the base model's plan into it
    assert plan['lm_head'] == 'colwise_gather_output'
    assert plan['model.embed_tokens'] == 'embedding_rowwise'
    assert plan['model.layers.*.self_attn.q_proj'] == 'colwise'
    assert llama['chosen'] == {
        'lm_head': 'colwise_rep',
        'model.embed_tokens': 'rowwise_rep',
        **{
            f'model.layers.{i}.{n}': 'colwise'
            for i in range(2)
            for n in ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj')
        },
        **{
            f'model.layers.{i}.{n}': 'colwise'
            for i in range(2)
            for n in ('mlp.gate_proj', 'mlp.up_proj')
        },
        **{
            f'model.layers.{i}.{n}': 'rowwise'
            for i in range(2)
            for n in ('self_attn.o_proj', 'mlp.down_proj')
        },
    }


class _Config:
    base_model_tp_plan = {'layers.*.fc': 'colwise', 'layers.*.out': 'rowwise'}


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 8), nn.Linear(8, 4)


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])


class _ForTask(nn.Module):
    """A duck-typed transformers model: its base model under base_model_prefix."""

    base_model_prefix = 'backbone'
    _no_split_modules = ['_Layer', 'AbsentLayer']

    def __init__(self, tp_plan=None):
        super().__init__()
        self.config = _Config()
        self.backbone = _Base()
        self.head = nn.Linear(4, 10)
        if tp_plan is not None:
            self._tp_plan = tp_plan


def test_base_model_tp_plan_is_prefixed_and_tp_plan_is_taken_as_is():
    assert declared_plan(_ForTask()) == {
        'backbone.layers.*.fc': 'colwise',
        'backbone.layers.*.out': 'rowwise',
    }
    # _tp_plan is prefixed already; it wins where both name a pattern
    plan = declared_plan(_ForTask({'head': 'colwise_rep', 'backbone.layers.*.out': 'rowwise_rep'}))
    assert plan == {
        'backbone.layers.*.fc': 'colwise',
        'backbone.layers.*.out': 'rowwise_rep',
        'head': 'colwise_rep',
    }
    # the base model itself: no prefix (it does not hold itself under base_model_prefix)
    base = _Base()
    base.config, base.base_model_prefix = _Config(), 'backbone'
    assert declared_plan(base) == dict(_Config.base_model_tp_plan)
    # a head gathered whole still splits its output features: 10 does not divide by 4
    with pytest.raises(ValueError, match=r"'head' \(Linear\): out_features=10 is not divisib"):
        parse_tensor_parallel_plan('auto').resolve(_ForTask({'head': 'colwise_gather_output'}), 4)
    # '*' is one layer index, as transformers matches it (fnmatch's would cross dots)
    chosen = parse_tensor_parallel_plan('auto').resolve(_ForTask({'head': 'colwise'}), 2)
    assert chosen == {
        'backbone.layers.0.fc': 'colwise',
        'backbone.layers.1.fc': 'colwise',
        'backbone.layers.0.out': 'rowwise',
        'backbone.layers.1.out': 'rowwise',
        'head': 'colwise',
    }


def test_transformers_styles_map_onto_torch_styles():
    assert HF_STYLES == {
        'colwise': 'colwise',
        'rowwise': 'rowwise',
        'colwise_rep': 'colwise_rep',
        'colwise_gather_output': 'colwise_rep',
        'embedding_colwise': 'colwise_rep',
        'rowwise_rep': 'rowwise_rep',
        'rowwise_split_input': 'rowwise_rep',
        'embedding_rowwise': 'rowwise_rep',
        'sequence_parallel': 'sequence',
    }


@pytest.mark.scenario('llama_plan')
def test_our_styles_are_torch_styles(scenario):
    # (class, input layouts, output layouts, local output); R: Replicate, S(d): Shard(d)
    assert scenario[0]['styles'] == {
        'colwise': ('ColwiseParallel', ('R',), ('S(-1)',), True),
        'rowwise': ('RowwiseParallel', ('S(-1)',), ('R',), True),
        'colwise_rep': ('ColwiseParallel', ('R',), ('R',), True),
        'rowwise_rep': ('RowwiseParallel', ('R',), ('R',), True),
        'rowwise_rep Embedding': ('RowwiseParallel', ('R',), ('R',), True),
        'rowwise Embedding': ('RowwiseParallel', ('R',), ('R',), True),  # whole token ids
        'sequence': ('SequenceParallel',),
        # inside a block that splits the sequence: gathered before, scattered after
        'colwise in a split block': ('ColwiseParallel', ('S(1)',), ('S(-1)',), True),
        'rowwise in a split block': ('RowwiseParallel', ('S(-1)',), ('S(1)',), True),
    }


@pytest.mark.parametrize('style', ['packed_colwise', 'moe_tp_experts', 'all_reduce'])
def test_unmapped_styles_are_refused_naming_module_and_style(style):
    model = _ForTask({'backbone.layers.*.fc': style})
    with pytest.raises(ValueError) as err:
        parse_tensor_parallel_plan('auto').check(model, 2, [])
    said = str(err.value)
    assert f"_ForTask declares 'backbone.layers.*.fc': '{style}'" in said
    assert "(module 'backbone.layers.0.fc', 'backbone.layers.1.fc')" in said
    assert "'colwise_gather_output'" in said  # what is mapped


def test_auto_plan_is_refused_before_anything_is_built():
    """doctor runs the strategy's own checks on a model, no process group, no mesh."""
    from stratagem.doctor.mesh import mesh_findings

    cfg = dict(type='FSDPStrategy', mesh=dict(shard=2, tensor=2), tensor_parallel_plan='auto')
    assert mesh_findings(cfg, 4, _ForTask()) == []
    ((where, problem, _),) = mesh_findings(cfg, 4, _ForTask({'head': 'moe_identity_expert'}))
    assert where == 'strategy.tensor_parallel_plan'
    assert "'head': 'moe_identity_expert' (module 'head')" in problem
    ((_, problem, _),) = mesh_findings(cfg, 4, nn.Linear(2, 2))
    assert 'Linear declares none; give the plan as a dict' in problem
    # a user's dict takes our names; transformers' is pointed to ours
    with pytest.raises(ValueError, match="'colwise_gather_output' is not a style; did you mean "):
        parse_tensor_parallel_plan({'head': 'colwise_gather_output'})


@pytest.mark.scenario('llama_plan')
def test_auto_plan_checks_the_heads(scenario):
    # 4 heads, 2 kv heads: the q/k/v widths 16 and 8 divide by 4, the kv heads do not
    assert (
        'config.num_key_value_heads=2 is not divisible by the tensor size 4'
        in (scenario[0]['heads'])
    )


@pytest.mark.scenario('llama_plan')
def test_auto_wrap_policy_takes_no_split_modules(scenario):
    assert scenario[0]['blocks'] == ['model.layers.0', 'model.layers.1']  # LlamaDecoderLayer
    policy = parse_model_wrapper(dict(auto_wrap_policy='auto'))
    task = _ForTask()  # 'AbsentLayer' is declared but not held: skipped
    assert policy.targets(task) == list(task.backbone.layers)
    with pytest.raises(ValueError) as err:
        policy.targets(nn.Sequential(nn.Linear(2, 2)))
    assert (
        "model_wrapper.auto_wrap_policy='auto' shards the module classes the model declares "
        'in _no_split_modules, but Sequential: it declares no _no_split_modules'
    ) in str(err.value)


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_split_one_way_are_tied_again_else_refused():
    from stratagem.strategies.fsdp.tensor_parallel import tied_parameters

    model = _TiedLM()
    plan = {'head': 'colwise_rep', 'emb': 'rowwise_rep'}  # both split the vocabulary (dim 0)
    assert tied_parameters(model, plan) == [[('emb', 'weight'), ('head', 'weight')]]
    assert tied_parameters(_ForTask(), {'head': 'colwise'}) == []  # nothing shared
    with pytest.raises(ValueError) as err:  # colwise Embedding: the hidden dimension
        tied_parameters(model, {'head': 'colwise', 'emb': 'colwise'})
    assert (
        'emb.weight (split on dim 1), head.weight (split on dim 0) are one parameter (tied '
        'weights)' in str(err.value)
    )
    with pytest.raises(ValueError, match=r'emb.weight \(not in the plan\), head.weight \(split'):
        parse_tensor_parallel_plan({'head': 'colwise'}).check(model, 2, [])
