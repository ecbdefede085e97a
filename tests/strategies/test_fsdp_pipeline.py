"""FSDPStrategy with a pipeline (``mesh.pipeline``): GPipe, 1F1B and Interleaved1F1B on 2 gloo
processes and ``pipeline=2 × shard=2`` on 4 train as one process does on the whole batch
(float64, SGD with momentum and AdamW with accumulation and clipping, 10 steps); the loss
``train_step`` returns is the reference's on every rank; a checkpoint saved at pipeline=2
resumes bit-exactly at pipeline=2, and with its weights and optimizer state exactly with
``mesh=dict(shard=2)`` and on one process; ``stratagem convert`` reads it. The peer copies
(written in the background) kept at the same iteration restore every stage's weights and
AdamW state bit for bit, and are not used at another cut of the stages. The refusals run
in the test process, and on every rank where they need the batch. In the slow tier: the same
checkpoint resumed at another stage count (``pipeline=4``) and at ``pipeline=2 × shard=2``,
on 4 processes.

Processes are started twice for the module (tests/scenarios.py): 2 ranks, then 4.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from scenarios import Scenarios

STEPS, SAVE_AT, BATCH, MICRO = 10, 4, 8, 4
MODEL = dict(vocab_size=16, dim=16, depth=4, heads=2, max_len=8)
OPTIMS = {
    'sgd': dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
    # accumulation (windows of 2 train_step calls) and clipping reduced over the stages
    'adamw': dict(
        optimizer=dict(type='AdamW', lr=0.01, weight_decay=0.01),
        accumulative_counts=2,
        clip_grad=dict(type='norm', max_norm=0.5),
    ),
}
SPLITS = {
    'GPipe': ['blocks.2'],
    '1F1B': ['blocks.2'],
    'Interleaved1F1B': ['blocks.1', 'blocks.2', 'blocks.3'],
}
SCENARIOS = Scenarios(two=dict(nproc=2, timeout=240), four=dict(nproc=4, timeout=300))


def _model():
    from stratagem.models import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(**MODEL).double()


def _batch(it):
    g = torch.Generator().manual_seed(1000 + it)
    seq = torch.randint(MODEL['vocab_size'], (BATCH, MODEL['max_len'] + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _strategy(work_dir, mesh, schedule='1F1B', splits=None, **extra):
    from stratagem.strategies import build_strategy

    pipeline = None
    if mesh.get('tensor', 1) > 1:
        from stratagem.models import TENSOR_PARALLEL_PLAN

        extra['tensor_parallel_plan'] = TENSOR_PARALLEL_PLAN  # each stage takes its share
    if mesh.get('pipeline', 1) > 1:
        splits = splits or SPLITS[schedule]
        pipeline = dict(schedule=schedule, microbatches=MICRO, split_points=splits)
    return build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=str(work_dir),
            mesh=mesh,
            pipeline=pipeline,
            model_wrapper=dict(auto_wrap_policy=['TransformerBlock']),
            env_kwargs=dict(randomness=dict(seed=5)),
            **extra,
        )
    )


def _reference(optim):
    """One process, the whole batch, the optim wrapper's own loop: the oracle."""
    from stratagem.models import TransformerLM
    from stratagem.optim import build_optim_wrapper

    model = _model()
    torch.manual_seed(1)
    model.init_weights()
    ow = build_optim_wrapper(model, OPTIMS[optim])
    losses = []
    for it in range(STEPS):
        x, y = _batch(it)
        loss = TransformerLM.loss(model(x), y)
        ow.update_params(loss)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _whole(s):
    """The whole model's weights and optimizer state, gathered from every stage."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    model = {k: v.detach().clone() for k, v in get_model_state_dict(s.model, options=opts).items()}
    optim = get_optimizer_state_dict(s.model, s.optim_wrapper.optimizer, options=opts)
    state = {
        k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
        for k, v in optim['state'].items()
    }
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (model, state))
    return {k: v for m, _ in parts for k, v in m.items()}, {
        k: v for _, o in parts for k, v in o.items()
    }


def _peer(s, root):
    """The run's peer copies under ``root``, as the loop keeps them: written in the
    background over a gloo group of their own, every rank on this node."""
    import torch.distributed as dist

    from stratagem.checkpoint.peer import PeerCopies

    group = dist.new_group(backend='gloo')
    return PeerCopies(root, s.rank, s.world_size, group=group, same_node=True, background=True)


def _train(s, ow, start, stop, save=None, peer=None):
    from stratagem.models import TransformerLM

    losses = []
    for it in range(start, stop):
        x, y = _batch(it)
        dp, n = s.data_parallel_rank, s.data_parallel_size
        x, y = x.chunk(n)[dp], y.chunk(n)[dp]
        losses.append(s.train_step(x, y, TransformerLM.loss).item())
        if save and it + 1 == SAVE_AT:
            s.save_checkpoint(save, extra_ckpt={'meta': {'iter': SAVE_AT}})
            if peer is not None:  # each stage rank's own state, its shards and their layout
                s.save_peer_copy(peer, extra_ckpt={'meta': {'iter': SAVE_AT}})
    return losses


def _run(work, mesh, schedule, optim, save=False):
    name = f'{schedule}_{optim}'
    s = _strategy(Path(work) / name, mesh, schedule)
    model = _model()
    torch.manual_seed(1)  # prepare's init_weights draws as the reference's does
    _, ow = s.prepare(model, optim_wrapper=OPTIMS[optim], dispatch_kwargs=dict(max_iters=STEPS))
    saved = str(Path(work) / f'{name}_saved') if save else None
    peer = _peer(s, Path(work) / f'{name}_peer') if save else None
    losses = _train(s, ow, 0, SAVE_AT, save=saved, peer=peer)
    at_save = _whole(s) if save else None
    losses += _train(s, ow, SAVE_AT, STEPS)
    if peer is not None:
        peer.close()
    return {
        'final': _whole(s),
        'at_save': at_save,
        'saved': saved,
        'losses': losses,
        'dp': (s.data_parallel_rank, s.data_parallel_size),
        'stage': s.mesh_spec.pipeline_rank(s.rank),
        'params': sorted(n for n, _ in s.model.named_parameters()),
        'reference': _reference(optim),
    }


for _schedule, _optim in [
    ('GPipe', 'sgd'),
    ('1F1B', 'sgd'),
    ('1F1B', 'adamw'),
    ('Interleaved1F1B', 'adamw'),
]:
    SCENARIOS.add('two', name=f'pp2_{_schedule}_{_optim}')(
        functools.partial(
            _run, mesh=dict(pipeline=2), schedule=_schedule, optim=_optim, save=_optim == 'adamw'
        )
    )
for _optim in OPTIMS:
    SCENARIOS.add('four', name=f'pp2_shard2_{_optim}')(
        functools.partial(_run, mesh=dict(pipeline=2, shard=2), schedule='1F1B', optim=_optim)
    )
SCENARIOS.add('four', name='pp2_tensor2_sgd')(
    functools.partial(_run, mesh=dict(pipeline=2, tensor=2), schedule='1F1B', optim='sgd')
)


def _resume(work, mesh, name, splits=None):
    s = _strategy(Path(work) / f'resume_{name}', mesh, splits=splits)
    torch.manual_seed(7)  # another init: everything must come from the checkpoint
    _, ow = s.prepare(
        _model(), optim_wrapper=OPTIMS['adamw'], dispatch_kwargs=dict(max_iters=STEPS)
    )
    ckpt = s.resume(str(Path(work) / '1F1B_adamw_saved'))
    loaded = _whole(s)
    losses = _train(s, ow, ckpt['meta']['iter'], STEPS)
    return {
        'loaded': loaded,
        'final': _whole(s),
        'losses': losses,
        'dp': (s.data_parallel_rank, s.data_parallel_size),
        'stage': s.mesh_spec.pipeline_rank(s.rank),
    }


@SCENARIOS.add('two', needs=['pp2_1F1B_adamw'])
def resume_pp2(work, pp2_1F1B_adamw):
    result = _resume(work, dict(pipeline=2), 'pp2')
    # then a restart's resume from the peer copies the saving run kept at SAVE_AT (its work_dir
    # holds no storage checkpoint): each stage rank restores its own stage from its own copy
    s = _strategy(Path(work) / 'resume_peer_pp2', dict(pipeline=2))
    torch.manual_seed(7)
    s.prepare(_model(), optim_wrapper=OPTIMS['adamw'], dispatch_kwargs=dict(max_iters=STEPS))
    peer = _peer(s, Path(work) / '1F1B_adamw_peer')
    ckpt = s.load_or_resume(resume=True, peer=peer)
    peer.close()
    result['peer'] = (ckpt['meta']['iter'], _whole(s))
    # a restart that cuts the stages elsewhere: each rank holds other tensors, copies not used
    s = _strategy(Path(work) / 'resume_peer_cut', dict(pipeline=2), splits=['blocks.1'])
    s.prepare(_model(), optim_wrapper=OPTIMS['adamw'], dispatch_kwargs=dict(max_iters=STEPS))
    peer = _peer(s, Path(work) / '1F1B_adamw_peer')
    choice = peer.plan(None, *s.checkpointer.shard_layout({'state_dict': s.model_part()}))
    peer.close()
    result['other_cut'] = (choice.step, choice.reason)
    return result


@SCENARIOS.add('two', needs=['pp2_1F1B_adamw'])
def resume_shard2(work, pp2_1F1B_adamw):
    return _resume(work, dict(shard=2), 'shard2')


# slow tier: the pipeline=2 checkpoint at another stage count, and sharded within the stages
@SCENARIOS.add('four', needs=['pp2_1F1B_adamw'])
def resume_pp4(work, pp2_1F1B_adamw):
    return _resume(work, dict(pipeline=4), 'pp4', splits=['blocks.1', 'blocks.2', 'blocks.3'])


@SCENARIOS.add('four', needs=['pp2_1F1B_adamw'])
def resume_pp2_shard2(work, pp2_1F1B_adamw):
    return _resume(work, dict(pipeline=2, shard=2), 'pp2_shard2')


@SCENARIOS.add('two')
def refusals_on_every_rank(work):
    """Refused on every rank alike, before any communication: a batch microbatches does not
    divide, a save inside an accumulation window; the optim wrapper's own step."""
    from stratagem.models import TransformerLM

    s = _strategy(Path(work) / 'refusals', dict(pipeline=2))
    model, ow = s.prepare(
        _model(), optim_wrapper=OPTIMS['adamw'], dispatch_kwargs=dict(max_iters=STEPS)
    )
    said = {}
    x, y = _batch(0)
    try:
        s.train_step(x[:6], y[:6], TransformerLM.loss)
    except ValueError as exc:
        said['microbatches'] = str(exc)
    try:
        ow.optim_context(model)  # refused when called, before any context is entered
    except RuntimeError as exc:
        said['optim_context'] = str(exc)
    s.train_step(x, y, TransformerLM.loss)  # the first of a window of 2
    try:
        s.save_checkpoint(str(Path(work) / 'mid_window'))
    except ValueError as exc:
        said['mid_window'] = str(exc)
    said['saved'] = (Path(work) / 'mid_window').exists()
    return said


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('fsdp_pipeline'))


def _close(a, b, tol):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=tol), (k, (a[k] - b[k]).abs().max())


@pytest.mark.parametrize(
    'name',
    [
        'pp2_GPipe_sgd',
        'pp2_1F1B_sgd',
        'pp2_1F1B_adamw',
        'pp2_Interleaved1F1B_adamw',
        'pp2_shard2_sgd',
        'pp2_shard2_adamw',
        'pp2_tensor2_sgd',
    ],
)
@pytest.mark.scenario('{name}')
def test_pipeline_trains_as_one_process(scenario, name):
    for r in scenario:
        weights, _ = r['final']
        ref_weights, ref_losses = r['reference']
        _close(weights, ref_weights, 1e-9)
        # this data-parallel rank's loss, the same on its stages; their mean: the batch's
        same_batch = [q['losses'] for q in scenario if q['dp'] == r['dp']]
        assert all(q == r['losses'] for q in same_batch)
        per_dp = {q['dp'][0]: q['losses'] for q in scenario}
        mean = [sum(v[i] for v in per_dp.values()) / len(per_dp) for i in range(STEPS)]
        assert mean == pytest.approx(ref_losses, abs=1e-12)
    # each rank holds its stage's parameters under the model's own names; together, all
    stages = {r['stage']: set(r['params']) for r in scenario}
    assert set.union(*stages.values()) == set(scenario[0]['reference'][0])
    assert not set.intersection(*stages.values())
    if name == 'pp2_1F1B_sgd':
        assert 'blocks.2.k.weight' in stages[1] and 'tok.weight' in stages[0]


def _assert_equal(got, want):
    """(weights, optimizer state) pairs, bit for bit."""
    (weights, optim), (want_weights, want_optim) = got, want
    assert weights.keys() == want_weights.keys() and optim.keys() == want_optim.keys()
    for k in weights:
        assert torch.equal(weights[k], want_weights[k]), k
    for k in optim:
        assert optim[k].keys() == want_optim[k].keys()
        for n in optim[k]:
            assert torch.equal(torch.as_tensor(optim[k][n]), torch.as_tensor(want_optim[k][n]))


@pytest.mark.scenario('resume_pp2')
def test_resume_at_the_same_stage_count_is_bit_exact(scenario):
    saving = scenario.needs['pp2_1F1B_adamw'][0]
    for r in scenario:
        _assert_equal(r['loaded'], saving['at_save'])
        _assert_equal(r['final'], saving['final'])
        # and from the peer copies: every stage's weights and AdamW state, bit for bit
        step, loaded = r['peer']
        assert step == SAVE_AT
        _assert_equal(loaded, saving['at_save'])
        # not at another cut of the stages: storage instead, saying why
        step, reason = r['other_cut']
        assert step is None and 'other model tensors than rank 0 holds' in reason, reason
        assert 'other model tensors than rank 1 holds' in reason, reason


@pytest.mark.scenario('resume_shard2')
def test_resume_without_a_pipeline_loads_weights_and_optimizer_exactly(scenario):
    saving = scenario.needs['pp2_1F1B_adamw'][0]
    for r in scenario:
        _assert_equal(r['loaded'], saving['at_save'])
        weights, _ = r['final']  # trained on: the same maths, other reduction orders
        _close(weights, saving['final'][0], 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(
    ('name', 'stages', 'dp_size'), [('resume_pp4', 4, 1), ('resume_pp2_shard2', 2, 2)]
)
@pytest.mark.scenario('{name}')
def test_resume_at_another_stage_count_or_shard_count(scenario, name, stages, dp_size):
    """Saved at pipeline=2 on 2 processes, resumed on 4: the weights and AdamW state load bit
    for bit; the resumed steps' losses are the saving run's, the same on every stage of a
    data-parallel rank; trained on, the weights reach the saving run's (other stage cuts
    and shards reduce the clipping norm in another order: 1e-9)."""
    saving = scenario.needs['pp2_1F1B_adamw']
    saved_losses = saving[0]['losses'][SAVE_AT:]
    assert {r['stage'] for r in scenario} == set(range(stages))
    assert {r['dp'][1] for r in scenario} == {dp_size}
    for r in scenario:
        _assert_equal(r['loaded'], saving[0]['at_save'])
        _close(r['final'][0], saving[0]['final'][0], 1e-9)
        same_batch = [q['losses'] for q in scenario if q['dp'] == r['dp']]
        assert all(q == r['losses'] for q in same_batch)
    per_dp = {r['dp'][0]: r['losses'] for r in scenario}
    mean = [sum(v[i] for v in per_dp.values()) / dp_size for i in range(STEPS - SAVE_AT)]
    assert mean == pytest.approx(saved_losses, abs=1e-12)


@pytest.mark.scenario('pp2_1F1B_adamw')
def test_one_process_resumes_and_convert_reads_a_pipelined_checkpoint(scenario, tmp_path):
    from stratagem.checkpoint.convert import convert_checkpoint
    from stratagem.strategies import build_strategy

    saved = scenario[0]['saved']
    weights, optim = scenario[0]['at_save']
    s = build_strategy(dict(type='SingleDeviceStrategy', work_dir=str(tmp_path / 'one')))
    torch.manual_seed(7)
    model, ow = s.prepare(
        _model(), optim_wrapper=OPTIMS['adamw'], dispatch_kwargs=dict(max_iters=STEPS)
    )
    s.resume(str(saved))
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)
    names = [n for n, _ in model.named_parameters()]
    state = ow.optimizer.state_dict()['state']
    for i, n in enumerate(names):
        for key in ('exp_avg', 'exp_avg_sq', 'step'):
            assert torch.equal(state[i][key], optim[n][key]), (n, key)
    assert len(ow.optimizer.param_groups) == 1
    assert ow.optimizer.param_groups[0]['lr'] == 0.01
    convert_checkpoint(str(saved), str(tmp_path / 'one.pth'), to='file')
    convert_checkpoint(str(saved), str(tmp_path / 'one.safetensors'), to='safetensors')
    one = torch.load(tmp_path / 'one.pth', weights_only=True)['state_dict']
    assert all(torch.equal(one[k], weights[k]) for k in weights)


@pytest.mark.scenario('refusals_on_every_rank')
def test_refusals_on_every_rank(scenario):
    for r in scenario:
        assert 'pipeline.microbatches=4 must divide' in r['microbatches']
        assert '[6] samples' in r['microbatches']
        assert 'strategy.train_step(inputs, targets, loss_fn)' in r['optim_context']
        assert 'saves at an update boundary' in r['mid_window']
        assert not r['saved']


class _Net(torch.nn.Module):
    """A body that is a top-level ``nn.Sequential``, called whole: split at ``'body'``."""

    def __init__(self):
        super().__init__()
        lin = torch.nn.Linear
        self.stem = lin(4, 16)
        self.body = torch.nn.Sequential(lin(16, 16), torch.nn.Tanh(), lin(16, 16))
        self.head = lin(16, 2)

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x)
        x = self.body(x)  # empty on the first stage: x as it is
        return self.head(x) if self.head is not None else x


def _net():
    torch.manual_seed(0)
    return _Net().double()


def _sequential():
    torch.manual_seed(0)
    lin = torch.nn.Linear
    return torch.nn.Sequential(lin(4, 16), torch.nn.Tanh(), lin(16, 16), lin(16, 2)).double()


def _regression(it, n=BATCH):
    g = torch.Generator().manual_seed(2000 + it)
    return torch.randn(n, 4, generator=g).double(), torch.randn(n, 2, generator=g).double()


def _eval_losses(step, model, batches, loss_fn):
    """``step(x, y, loss_fn)`` in eval mode on each batch (one of 8, one of 5: cut into 4
    microbatches and into 1, the most up to 4 that divide it)."""
    model.eval()
    try:
        return [step(x, y, loss_fn).item() for x, y in batches]
    finally:
        model.train()


@SCENARIOS.add('two')
def sequential_splits(work):
    """A model split at its top-level Sequential (``'body'``) and a model that is a Sequential
    split at an entry (``'2'``), each trained 4 SGD steps by 1F1B, then validated with
    ``eval_step``; the same on one process with the whole batch, the oracle."""
    from stratagem.optim import build_optim_wrapper
    from stratagem.strategies import build_strategy

    mse = torch.nn.functional.mse_loss
    tests = [_regression(99, BATCH), _regression(99, 5)]
    out = {}
    for name, make, splits in (('net', _net, ['body']), ('sequential', _sequential, ['2'])):
        s = build_strategy(
            dict(
                type='FSDPStrategy',
                work_dir=str(Path(work) / name),
                mesh=dict(pipeline=2),
                pipeline=dict(schedule='1F1B', microbatches=MICRO, split_points=splits),
            )
        )
        model, _ = s.prepare(make(), optim_wrapper=OPTIMS['sgd'])
        losses = [s.train_step(*_regression(it), mse).item() for it in range(4)]
        evals = _eval_losses(s.eval_step, model, tests, mse)
        ref = make()
        ow = build_optim_wrapper(ref, OPTIMS['sgd'])
        ref_losses = []
        for it in range(4):
            x, y = _regression(it)
            loss = mse(ref(x), y)
            ow.update_params(loss)
            ref_losses.append(loss.item())
        with torch.no_grad():
            ref_evals = [mse(ref(x), y).item() for x, y in tests]
        out[name] = {
            'losses': losses,
            'evals': evals,
            'weights': _whole(s)[0],
            'reference': (ref_losses, ref_evals, dict(ref.state_dict())),
        }
    return out


@SCENARIOS.add('two')
def eval_schedules(work):
    """``eval_step`` under GPipe and Interleaved1F1B (4 stages on 2 ranks), before and after
    2 training steps, against the whole model with the same weights."""
    from stratagem.models import TransformerLM

    x, y = _batch(99)
    tests = [(x, y), (x[:5], y[:5])]
    out = {}
    for schedule in ('GPipe', 'Interleaved1F1B'):
        s = _strategy(Path(work) / f'eval_{schedule}', dict(pipeline=2), schedule)
        model, _ = s.prepare(_model(), optim_wrapper=OPTIMS['sgd'])
        before = _eval_losses(s.eval_step, model, tests, TransformerLM.loss)
        for it in range(2):
            s.train_step(*_batch(it), TransformerLM.loss)
        after = _eval_losses(s.eval_step, model, tests, TransformerLM.loss)
        whole = _model()
        whole.load_state_dict(_whole(s)[0])
        whole.eval()
        with torch.no_grad():
            ref = [TransformerLM.loss(whole(a), b).item() for a, b in tests]
        out[schedule] = {'before': before, 'after': after, 'reference': ref}
    return out


@SCENARIOS.add('four')
def eval_shard2(work):
    """``eval_step`` at ``pipeline=2 × shard=2``: each data-parallel rank's half of a batch
    (4 and 4, then 3 and 2 of 5) against the whole model with the same weights."""
    from stratagem.models import TransformerLM

    s = _strategy(Path(work) / 'eval_shard2', dict(pipeline=2, shard=2))
    model, ow = s.prepare(_model(), optim_wrapper=OPTIMS['sgd'])
    _train(s, ow, 0, 2)
    x, y = _batch(99)
    dp, n = s.data_parallel_rank, s.data_parallel_size
    tests = [(x.chunk(n)[dp], y.chunk(n)[dp]), (x[:5].chunk(n)[dp], y[:5].chunk(n)[dp])]
    evals = _eval_losses(s.eval_step, model, tests, TransformerLM.loss)
    whole = _model()
    whole.load_state_dict(_whole(s)[0])
    with torch.no_grad():
        ref = [TransformerLM.loss(whole.eval()(a), b).item() for a, b in tests]
    return {'evals': evals, 'reference': ref, 'dp': dp}


@pytest.mark.slow
@pytest.mark.scenario('sequential_splits')
def test_a_sequential_split_point_trains_and_validates_as_one_process(scenario):
    for r in scenario:
        for name in ('net', 'sequential'):
            got = r[name]
            ref_losses, ref_evals, ref_weights = got['reference']
            assert got['losses'] == pytest.approx(ref_losses, abs=1e-12), name
            assert got['evals'] == pytest.approx(ref_evals, abs=1e-12), name
            _close(got['weights'], ref_weights, 1e-9)
    assert scenario[0]['net']['evals'] == scenario[1]['net']['evals']


@pytest.mark.slow
@pytest.mark.scenario('eval_schedules')
def test_eval_step_under_every_placement_is_the_whole_models(scenario):
    for r in scenario:
        for schedule, got in r.items():
            assert got['after'] == pytest.approx(got['reference'], abs=1e-12), schedule
            assert got['before'] != got['after']  # trained in between
    assert scenario[0] == scenario[1]  # the last stage's values on both ranks


@pytest.mark.slow
@pytest.mark.scenario('eval_shard2')
def test_eval_step_with_sharded_stages_is_the_whole_models(scenario):
    by_dp: dict[int, list] = {}
    for r in scenario:
        assert r['evals'] == pytest.approx(r['reference'], abs=1e-12)
        by_dp.setdefault(r['dp'], []).append(r['evals'])
    # the two stages of a data-parallel rank give its loss; the two ranks, their own halves
    assert sorted(by_dp) == [0, 1] and all(a == b for a, b in by_dp.values())
    assert by_dp[0][0] != by_dp[1][0]


# examples/configs/transformer_pp.py, run by stratagem train's loop in the 2 ranks above
EXAMPLE = Path(__file__).resolve().parents[2] / 'examples' / 'configs' / 'transformer_pp.py'


@SCENARIOS.add('two')
def example_config(work):
    """The example pipeline config through the reference loop: 2 iterations, one save, and
    a validation at the end, whose last batch (6 of 38 samples) 4 microbatches do not cut
    evenly: it runs as 3."""
    from stratagem.config import Config
    from stratagem.loop import train

    cfg = Config.fromfile(str(EXAMPLE))
    out = Path(work) / 'example'
    cfg.merge_from_dict(
        dict(
            train_cfg=dict(max_iters=2, checkpoint_interval=2, log_interval=1, val_interval=2),
            work_dir=str(out),
            val_dataloader=dict(
                dataset={**cfg.train_dataloader.dataset.to_dict(), 'num_samples': 38},
                batch_size=16,
            ),
            val_cfg=dict(),
        )
    )
    result = train(cfg, progress=False)
    saved = sorted(p.name for p in out.glob('iter_*'))
    return {
        'iter': result['iter'],
        'losses': result['losses'],
        'saved': saved,
        'val': result['val'],
        'dir': str(out),
    }


@pytest.mark.scenario('example_config')
def test_example_config_trains(scenario):
    for rank in scenario:
        assert rank['iter'] == 2 and rank['saved'] == ['iter_2.pth']
    # the last stage's loss reaches the first stage's rank: both log the same values
    assert scenario[0]['losses'] == scenario[1]['losses']
    (_, first), (_, last) = scenario[0]['losses']
    assert 3.0 < first < 4.5 and last < first  # ln(64) = 4.16 at the start, then it learns


@pytest.mark.scenario('example_config')
def test_validation_under_a_pipeline_is_the_whole_models(scenario, tmp_path):
    """The validation the pipelined run logged, on every rank, is the one a single process
    computes with the whole model from the checkpoint saved at the same iteration."""
    from stratagem.config import Config
    from stratagem.data import validation_batches
    from stratagem.loop.batches import build_dataset
    from stratagem.loop.validation import validate
    from stratagem.registry import MODELS
    from stratagem.strategies import build_strategy

    (it, values), *more = scenario[0]['val']
    assert it == 2 and not more and list(values) == ['loss']
    assert scenario[1]['val'] == scenario[0]['val']  # every rank logs the same
    cfg = Config.fromfile(str(EXAMPLE))
    s = build_strategy(dict(type='SingleDeviceStrategy', work_dir=str(tmp_path)))
    model = s.prepare(MODELS.build(cfg.model.to_dict()))
    s.load_checkpoint(str(Path(scenario[0]['dir']) / 'iter_2.pth'))
    dataset = build_dataset({**cfg.train_dataloader.dataset.to_dict(), 'num_samples': 38})
    batches = validation_batches(len(dataset), batch_size=16)
    assert [w for _, w in batches] == [16, 16, 6]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[b for b, _ in batches])
    whole = validate(model, loader, [w for _, w in batches], torch.device('cpu'))
    assert list(whole) == ['loss']
    assert values['loss'] == pytest.approx(whole['loss'], rel=1e-6)
    assert 3.0 < whole['loss'] < 4.5
