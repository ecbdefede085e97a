"""FSDPStrategy on a device mesh, 4 gloo processes (CPU): HSDP ``(replicate 2, shard 2)`` and
2-D ``(shard 2, tensor 2)`` (with and without sequence parallelism) train a small transformer
as one process does; a resume mid-run is bit-exact; sharded checkpoints reshard across mesh
shapes (2-D / HSDP → flat 4, flat 4 → 2-D, → 2 processes, → 1 process, → one file and
safetensors); peer copies of the shards resume bit-exact on the same HSDP and 2-D meshes.

Processes are started at most twice for the module, for the scenarios the selected tests name
(tests/scenarios.py): 4 ranks (training, resumes, reshards on 4), then 2 ranks
(``dict(shard=2)`` resumes); the 1-process loads run in the test process.

The first tier resumes and reshards from 2-D and HSDP at least once each way, and to another
world size (2-D → 1 process), starting 4 ranks only; the repetitions (the same checks from
the other meshes: ``SLOW``) and the 2-rank resumes are the slow tier's.
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path

import pytest
import torch

from scenarios import Scenarios

# 2 accumulation windows (clipped AdamW updates) before the save and 2 after it: enough for
# a wrong split, sync or reshard to show; more steps only cost time (4 ranks on the CI's 2 cores)
STEPS, SAVE_AT, MICRO, ACC = 8, 4, 2, 2
MODEL = dict(vocab_size=16, dim=16, depth=2, heads=4, max_len=8)
OPTIM = dict(
    optimizer=dict(type='AdamW', lr=0.01, weight_decay=0.01),
    accumulative_counts=ACC,
    clip_grad=dict(type='norm', max_norm=0.5),
)
MESHES = {
    'hsdp': (dict(replicate=2, shard=2), False),
    '2d': (dict(shard=2, tensor=2), False),
    '2d_sp': (dict(shard=2, tensor=2), True),
    'flat': (None, False),
}
# checkpoints saved at SAVE_AT on 4 ranks, resharded on 4 ranks: (source, mesh to resume on)
RESHARDS = {
    'hsdp_to_flat': ('hsdp', None),
    '2d_to_flat': ('2d', None),
    'flat_to_2d': ('flat', dict(shard=2, tensor=2)),
    '2d_to_hsdp': ('2d', dict(replicate=2, shard=2)),
    '2d_ac_to_flat': ('2d_ac', None),
}
SCENARIOS = Scenarios(four=dict(nproc=4, timeout=400), two=dict(nproc=2, timeout=200))
SLOW = pytest.mark.slow  # a repetition of a first-tier check from another mesh


def _plan(sequence):
    from stratagem.models import TENSOR_PARALLEL_PLAN

    plan = dict(TENSOR_PARALLEL_PLAN)
    if sequence:
        plan['blocks.*.norm[12]'] = 'sequence'
    return plan


def _strategy(work_dir, mesh, sequence=False, **extra):
    from stratagem.strategies import build_strategy

    if mesh is not None and mesh.get('tensor', 1) > 1:
        extra['tensor_parallel_plan'] = _plan(sequence)
    return build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=str(work_dir),
            mesh=mesh,
            model_wrapper=dict(auto_wrap_policy=['TransformerBlock']),
            env_kwargs=dict(randomness=dict(seed=5)),
            **extra,
        )
    )


def _model():
    from stratagem.models import TransformerLM

    # float64: the comparison with one process then shows the maths, not float32 rounding
    # that Adam's normalisation amplifies in near-zero gradients (measured ~3e-5 relative
    # after 10 float32 AdamW updates, for flat FSDP as for the meshes)
    torch.manual_seed(0)
    return TransformerLM(**MODEL).double()


def _batch(it, dp_rank=None, dp_size=1):
    g = torch.Generator().manual_seed(1000 + it)
    seq = torch.randint(MODEL['vocab_size'], (dp_size * MICRO, MODEL['max_len'] + 1), generator=g)
    if dp_rank is not None:
        seq = seq[dp_rank * MICRO : (dp_rank + 1) * MICRO]
    return seq[:, :-1], seq[:, 1:]


def _reference(dp_size):
    """One process, the whole batch, a hand-written loop: the oracle."""
    model = _model()
    torch.manual_seed(1)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    for it in range(STEPS):
        x, y = _batch(it, None, dp_size)
        (model(x, y)['loss'] / ACC).backward()
        if (it + 1) % ACC == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full_state(s):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    model = {k: v.detach().clone() for k, v in get_model_state_dict(s.model, options=opts).items()}
    optim = get_optimizer_state_dict(s.model, s.optim_wrapper.optimizer, options=opts)
    return model, {
        k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
        for k, v in optim['state'].items()
    }


def _train(s, model, ow, start, stop, save=None):
    for it in range(start, stop):
        x, y = _batch(it, s.data_parallel_rank, s.data_parallel_size)
        with ow.optim_context(model):
            loss = model(x, y)['loss']
        ow.update_params(loss)
        if save and it + 1 == SAVE_AT:
            s.save_checkpoint(save, extra_ckpt={'meta': {'iter': SAVE_AT}})


class _Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _resume(work, name, mesh, sequence=False, train_to=None):
    s = _strategy(Path(work) / f'resume_{name}', mesh, sequence)
    model, ow = s.prepare(_model(), optim_wrapper=OPTIM, dispatch_kwargs=dict(max_iters=STEPS))
    said = _Said()
    s.logger.addHandler(said)
    ckpt = s.resume(str(Path(work) / name))
    s.logger.removeHandler(said)
    out = {'loaded': _full_state(s), 'iter': ckpt['meta']['iter'], 'said': said.lines}
    if train_to:
        _train(s, model, ow, ckpt['meta']['iter'], train_to)
        out['final'] = _full_state(s)
    return out


def _train_mesh(work, name):
    """Train on mesh ``name`` (saved at SAVE_AT as ``<name>_saved``) against one process."""
    mesh, sequence = MESHES[name]
    s = _strategy(Path(work) / name, mesh, sequence)
    model = _model()
    torch.manual_seed(1)  # prepare's init_weights draws as the reference's does
    model, ow = s.prepare(model, optim_wrapper=OPTIM, dispatch_kwargs=dict(max_iters=STEPS))
    _train(s, model, ow, 0, SAVE_AT, save=str(Path(work) / f'{name}_saved'))
    at_save = _full_state(s)
    _train(s, model, ow, SAVE_AT, STEPS)
    result = {
        'final': _full_state(s),
        'at_save': at_save,
        'dp': (s.data_parallel_rank, s.data_parallel_size),
        'reference': _reference(s.data_parallel_size),
    }
    s.wait_for_checkpoints()
    return result


for _name in MESHES:
    SCENARIOS.add('four', name=f'train_{_name}')(functools.partial(_train_mesh, name=_name))


@SCENARIOS.add('four', name='2d_ac')
def two_d_ac(work):
    """2-D with activation checkpointing and an asynchronous save (saved as 2d_ac_saved)."""
    s = _strategy(
        Path(work) / '2d_ac',
        MESHES['2d'][0],
        activation_checkpointing=['TransformerBlock'],
        async_checkpoint=True,
    )
    model = _model()
    torch.manual_seed(1)
    model, ow = s.prepare(model, optim_wrapper=OPTIM, dispatch_kwargs=dict(max_iters=STEPS))
    _train(s, model, ow, 0, SAVE_AT, save=str(Path(work) / '2d_ac_saved'))
    for p in model.parameters():  # after the call: must not reach the checkpoint
        p.data.fill_(7.0)
    s.wait_for_checkpoints()


@SCENARIOS.add('four')
def amp(work):
    """bf16 autocast (of a float32 model) on the 2-D mesh: float32's losses within bf16
    rounding."""
    amp = {**OPTIM, 'type': 'AmpOptimWrapper', 'dtype': 'bfloat16'}
    losses = {}
    for kind, optim in (('fp', OPTIM), ('amp', amp)):
        s = _strategy(Path(work) / f'2d_{kind}', MESHES['2d'][0])
        model, ow = s.prepare(
            _model().float(), optim_wrapper=optim, dispatch_kwargs=dict(max_iters=4)
        )
        losses[kind] = []
        for it in range(4):
            x, y = _batch(it, s.data_parallel_rank, s.data_parallel_size)
            with ow.optim_context(model):
                loss = model(x, y)['loss']
            ow.update_params(loss)
            losses[kind].append(float(loss))
    return losses


def _resume_same_mesh(work, name, **needs):
    """Resume ``<name>_saved`` on its own mesh (``needs``: its run, which saved it)."""
    mesh, sequence = MESHES[name]
    return _resume(work, f'{name}_saved', mesh, sequence, STEPS)


for _name in MESHES:
    SCENARIOS.add('four', name=f'resume_{_name}', needs=[f'train_{_name}'])(
        functools.partial(_resume_same_mesh, name=_name)
    )


def _reshard(work, case, **needs):
    """Across mesh shapes on 4 ranks (``needs``: the runs that saved and compare)."""
    source, mesh = RESHARDS[case]
    return _resume(work, f'{source}_saved', mesh)


def _reshard_needs(source):
    """The checkpoint's run, and the run whose state at the save it must hold: 2d_ac's is
    the plain 2-D run's."""
    return ['train_2d', '2d_ac'] if source == '2d_ac' else [f'train_{source}']


for _case, (_source, _) in RESHARDS.items():
    SCENARIOS.add('four', name=_case, needs=_reshard_needs(_source))(
        functools.partial(_reshard, case=_case)
    )


@SCENARIOS.add('four', needs=['train_hsdp', 'train_2d'])
def peer_copies(work, **needs):
    """Peer copies (checkpoint/peer.py) on HSDP and on the 2-D mesh: ``<name>_saved`` resumed
    from storage, a copy of that state at SAVE_AT in the background, then a restart on the
    same mesh resumes from the copy and trains on to STEPS."""
    import torch.distributed as dist

    from stratagem.checkpoint.peer import PeerCopies

    group = dist.new_group(backend='gloo')  # the background writer's own
    out = {}
    for name in ('hsdp', '2d'):
        mesh, sequence = MESHES[name]
        root = Path(work) / f'peer_shm_{name}'
        peer = PeerCopies(root, dist.get_rank(), 4, group=group, same_node=True, background=True)
        s = _strategy(Path(work) / f'peer_{name}', mesh, sequence)
        s.prepare(_model(), optim_wrapper=OPTIM, dispatch_kwargs=dict(max_iters=STEPS))
        s.resume(str(Path(work) / f'{name}_saved'))
        s.save_peer_copy(peer, extra_ckpt={'meta': {'iter': SAVE_AT}})
        peer.close()
        again = _strategy(Path(work) / f'peer_{name}_again', mesh, sequence)
        model, ow = again.prepare(
            _model(), optim_wrapper=OPTIM, dispatch_kwargs=dict(max_iters=STEPS)
        )
        said = _Said()
        again.logger.addHandler(said)
        again.load_or_resume(resume=True, peer=PeerCopies(root, dist.get_rank(), 4, group=group))
        again.logger.removeHandler(said)
        loaded = _full_state(again)
        _train(again, model, ow, SAVE_AT, STEPS)
        out[name] = {
            'loaded': loaded,
            'final': _full_state(again),
            'tier': [x for x in said.lines if 'resume tier' in x],
        }
    return out


def _to_two(work, source, **needs):
    """``<source>_saved`` on 2 ranks, ``dict(shard=2)`` (``needs``: the run that saved it)."""
    return _resume(work, f'{source}_saved', None)


for _name in ('hsdp', '2d', '2d_sp'):
    SCENARIOS.add('two', name=f'two_ranks_{_name}', needs=[f'train_{_name}'])(
        functools.partial(_to_two, source=_name)
    )


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('mesh'))


def _max_rel(a, b):
    """(largest relative difference over the parameters, which one)."""
    return max(
        (((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item(), k) for k in b
    )


def _assert_equal(a, b):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert oa.keys() == ob.keys()
    for k in oa:
        for n in oa[k]:
            assert torch.equal(torch.as_tensor(oa[k][n]), torch.as_tensor(ob[k][n])), (k, n)


@pytest.mark.parametrize('name', list(MESHES))
@pytest.mark.scenario('train_{name}')
def test_mesh_training_equals_one_process(scenario, name):
    for res in scenario:
        model = res['final'][0]
        assert model.keys() == res['reference'].keys()
        assert _max_rel(model, res['reference'])[0] < 1e-5, _max_rel(model, res['reference'])
        # the weights moved: an update that did nothing would also "match" a bad oracle
        assert _max_rel(model, _reference_init())[0] > 1e-2


def _reference_init():
    model = _model()
    torch.manual_seed(1)
    model.init_weights()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.scenario('amp')
def test_bf16_autocast_on_the_2d_mesh(scenario):
    for out in scenario:
        fp, amp = out['fp'], out['amp']
        assert amp[0] != fp[0] and abs(amp[0] - fp[0]) < 1e-2 * fp[0]  # autocast ran
        assert all(abs(a - f) < 5e-2 * f for a, f in zip(amp, fp))  # and it trains alike


_SPLITS = {
    'hsdp': [(0, 4), (1, 4), (2, 4), (3, 4)],
    '2d': [(0, 2), (0, 2), (1, 2), (1, 2)],  # a tensor group: one batch
    '2d_sp': [(0, 2), (0, 2), (1, 2), (1, 2)],
    'flat': [(0, 4), (1, 4), (2, 4), (3, 4)],  # as hsdp's
}


@pytest.mark.parametrize('name', list(MESHES))
@pytest.mark.scenario('train_{name}')
def test_data_split_over_replicate_and_shard(scenario, name):
    assert [res['dp'] for res in scenario] == _SPLITS[name]


@pytest.mark.parametrize(
    'name',
    ['hsdp', '2d', pytest.param('2d_sp', marks=SLOW), pytest.param('flat', marks=SLOW)],
)
@pytest.mark.scenario('resume_{name}')
def test_resume_same_mesh_bit_exact(scenario, name):
    for rank, resumed in enumerate(scenario):
        res = scenario.needs[f'train_{name}'][rank]
        _assert_equal(resumed['loaded'], res['at_save'])
        _assert_equal(resumed['final'], res['final'])
        assert not any('was saved on the mesh' in x for x in resumed['said'])


@pytest.mark.scenario('peer_copies')
def test_peer_copies_on_hsdp_and_2d_meshes_resume_bit_exact(scenario):
    for rank, out in enumerate(scenario):
        for name in ('hsdp', '2d'):
            res = scenario.needs[f'train_{name}'][rank]
            _assert_equal(out[name]['loaded'], res['at_save'])
            _assert_equal(out[name]['final'], res['final'])
    for name in ('hsdp', '2d'):
        (tier,) = scenario[0][name]['tier']
        assert tier.startswith(
            f'resume tier: peer (peer copies of iteration {SAVE_AT}: no storage checkpoint)'
        ), tier


@pytest.mark.parametrize(
    'case, source',
    [
        # the first tier's reshard from HSDP: on these 4 ranks, so that it starts no
        # 2-process spawn (HSDP → 2 processes is the slow tier's)
        ('hsdp_to_flat', 'hsdp'),
        ('2d_to_flat', '2d'),
        ('flat_to_2d', 'flat'),
        pytest.param('2d_to_hsdp', '2d', marks=SLOW),
        # activation checkpointing and an async save (the weights overwritten after the
        # call): the state of the plain 2-D run, bit for bit
        ('2d_ac_to_flat', '2d'),
    ],
)
@pytest.mark.scenario('{case}')
def test_reshard_across_meshes_on_four(scenario, case, source):
    for rank, out in enumerate(scenario):
        _assert_equal(out['loaded'], scenario.needs[f'train_{source}'][rank]['at_save'])
        assert out['iter'] == SAVE_AT
        said = [x for x in out['said'] if 'was saved on the mesh' in x]
        assert len(said) == (rank == 0)  # once, on rank 0
    if case == '2d_to_flat':
        first = [x for x in scenario[0]['said'] if 'mesh' in x][0]
        assert 'shard 2 × tensor 2' in first and 'this run has shard 4' in first


@pytest.mark.parametrize('source', [pytest.param(n, marks=SLOW) for n in ('hsdp', '2d', '2d_sp')])
@pytest.mark.scenario('two_ranks_{source}')
def test_reshard_to_two_processes(scenario, source):
    for out in scenario:
        _assert_equal(out['loaded'], scenario.needs[f'train_{source}'][0]['at_save'])


@pytest.mark.parametrize('source', [pytest.param('hsdp', marks=SLOW), '2d'])
@pytest.mark.scenario('train_{source}')
def test_reshard_to_one_process_and_convert(scenario, source, tmp_path):
    from stratagem.checkpoint.convert import convert_checkpoint
    from stratagem.strategies import SingleDeviceStrategy

    model_ref, optim_ref = scenario[0]['at_save']
    src = str(scenario.tmp / f'{source}_saved')
    s = SingleDeviceStrategy(work_dir=str(tmp_path / 'one'))
    s.prepare(_model(), optim_wrapper=OPTIM, dispatch_kwargs=dict(max_iters=STEPS))
    ckpt = s.resume(src)
    assert ckpt['meta']['mesh'] == MESHES[source][0] | {
        k: 1 for k in ('replicate', 'tensor') if k not in MESHES[source][0]
    }
    sd = s.model.state_dict()
    assert all(torch.equal(sd[k], model_ref[k]) for k in model_ref)
    names = [n for n, _ in s.model.named_parameters()]
    state = s.optim_wrapper.optimizer.state_dict()['state']
    for i, name in enumerate(names):
        for key, value in optim_ref[name].items():
            assert torch.equal(torch.as_tensor(state[i][key]), torch.as_tensor(value))
    # one file that SingleDeviceStrategy loads
    one = convert_checkpoint(src, str(tmp_path / 'one.pth'))
    t = SingleDeviceStrategy(work_dir=str(tmp_path / 'two'))
    t.prepare(_model(), optim_wrapper=copy.deepcopy(OPTIM), dispatch_kwargs=dict(max_iters=STEPS))
    t.load_checkpoint(one)
    assert all(torch.equal(t.model.state_dict()[k], model_ref[k]) for k in model_ref)
    # the full weights as one safetensors file, by the command line
    pytest.importorskip('safetensors')
    from stratagem.checkpoint.huggingface import read_safetensors
    from stratagem.cli import main

    dst = tmp_path / 'weights.safetensors'
    assert main(['convert', src, str(dst)]) == 0
    weights, meta = read_safetensors(dst)
    assert weights.keys() == model_ref.keys()
    assert all(torch.equal(weights[k], model_ref[k]) for k in model_ref)
    assert meta['format'] == 'pt' and meta['iter'] == str(SAVE_AT)
