"""ShardedDDPStrategy (fairscale OSS + ShardedDataParallel) and the OSS optimizer.

2 gloo ranks on CPU, started once for the module, run the scenarios the selected tests name
(tests/scenarios.py); the assertions run here.
DDPStrategy with a plain optimizer is the oracle: each rank trains on its half of a global
batch, and a single process on the whole batch continues a 2-rank checkpoint. Equal to one
process (accumulation, clipping), the exact resume mid window, the async save and the
weights crossing to every backend are its row of the conformance table (test_conformance.py).
"""

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from scenarios import Scenarios

pytest.importorskip('fairscale', reason='fairscale is not installed (stratagem[fairscale])')

STOP, END = 5, 8  # checkpoint after STOP steps, runs end at END
ADAM = dict(type='Adam', lr=0.01)
SCENARIOS = Scenarios(ranks=dict(nproc=2, timeout=240))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )


def _batch(i, rank=None):
    """Global batch ``i`` (8 samples); with ``rank``, that rank's half."""
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if rank is None:
        return x, y
    return x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]


def _train(model, ow, start, stop, rank=None, scheds=()):
    """Wrapper-driven steps; returns each update's clipping norm (None without clipping)."""
    norms = []
    for i in range(start, stop):
        x, y = _batch(i, rank)
        with ow.optim_context(model):
            loss = F.mse_loss(model(x), y)
        ow.update_params(loss)
        for sch in scheds:
            sch.step()
        norm = getattr(ow, 'last_grad_norm', None)
        norms.append(None if norm is None else float(norm))
    return norms


def _build(kind, work_dir, optimizer=ADAM, sched=False, strategy=None, **wrapper):
    """A strategy (extra ``strategy`` options) and its prepared model and wrapper (+ a warmup
    scheduler with ``sched``, kept in ``s.param_schedulers``)."""
    from stratagem.strategies import build_strategy

    s = build_strategy(
        dict(
            type=kind,
            work_dir=str(work_dir),
            log_kwargs=dict(log_level='WARNING'),
            env_kwargs=dict(randomness=dict(seed=1)),
            **(strategy or {}),
        )
    )
    warmup = [dict(type='LinearLR', start_factor=0.2, by_epoch=False, end=4)] if sched else None
    model, ow, *_ = s.prepare(
        _model(),
        optim_wrapper=dict(optimizer=dict(optimizer), **wrapper),
        param_scheduler=warmup,
        dispatch_kwargs=dict(max_iters=END),
    )
    return s, model, ow


def _scheds(s):
    return s.param_schedulers or ()


def _weights(s):
    return {k: v.detach().clone() for k, v in s.model_state_dict().items()}


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


_CASES = {  # the equal-to-DDP cases: Adam, bf16 autocast
    'adam': {},
    'bf16': dict(type='AmpOptimWrapper', dtype='bfloat16'),
}
_ACC2 = dict(accumulative_counts=2, sched=True)  # the mid-window roll-back's runs


def _rank():
    return int(os.environ['RANK'])


def _training_equals_ddp(tmp, out, rank, name, extra):
    """Case ``name``: STOP steps of SDP equal DDP's; returns both (strategy, model, wrapper)."""
    ddp = _build('DDPStrategy', os.path.join(tmp, f'ddp_{name}'), **extra)
    sdp = _build('ShardedDDPStrategy', os.path.join(tmp, f'sdp_{name}'), **extra)
    (ds, dm, dow), (ss, sm, sow) = ddp, sdp
    out[f'{name}_norms'] = (
        _train(dm, dow, 0, STOP, rank, _scheds(ds)),
        _train(sm, sow, 0, STOP, rank, _scheds(ss)),
    )
    out[f'{name}_diff'] = _max_diff(_weights(ds), _weights(ss))
    return ddp, sdp


@SCENARIOS.add('ranks')
def train_adam(tmp):
    """The adam case; its runs also save at STOP (the checks below), then go on to END."""
    out, rank = {}, _rank()
    ddp, sdp = _training_equals_ddp(tmp, out, rank, 'adam', _CASES['adam'])
    out['ddp_at_stop'] = _adam_runs_at_stop(out, ddp, sdp)
    _adam_runs_continue_to_end(out, rank, ddp, sdp)
    return out


def _train_case(tmp, case):
    """Case ``case`` (not adam): STOP steps of SDP against DDP's."""
    out = {}
    _training_equals_ddp(tmp, out, _rank(), case, _CASES[case])
    return out


for _case in ('bf16',):
    SCENARIOS.add('ranks', name=f'train_{_case}')(functools.partial(_train_case, case=_case))


def _adam_runs_at_stop(out, ddp, sdp):
    """The adam runs at STOP (the checks below); returns DDP's weights there."""
    (ds, _, dow), (ss, sm, sow) = ddp, sdp
    _builds_oss_and_sharded_data_parallel(out, sm, sow)
    ddp_at_stop = _weights(ds)
    _per_rank_optimizer_state(out, sow, dow)
    # checkpoints after STOP steps; both runs then continue to END
    out['sdp_ckpt'] = ss.save_checkpoint('sdp.pth', extra_ckpt={'meta': {'iter': STOP}})
    out['ddp_ckpt'] = ds.save_checkpoint('ddp.pth', extra_ckpt={'meta': {'iter': STOP}})
    _consolidation_keeps_no_copy(out, sow)
    return ddp_at_stop


def _builds_oss_and_sharded_data_parallel(out, sm, sow):
    """ShardedDDPStrategy wraps in fairscale's ShardedDataParallel and our OSS over Adam."""
    from fairscale.nn.data_parallel import ShardedDataParallel

    out['types'] = (
        isinstance(sm, ShardedDataParallel),
        type(sow.optimizer).__name__,
        type(sow.optimizer.optim).__name__,
    )


def _per_rank_optimizer_state(out, sow, dow):
    """This rank's shard of the optimizer state against DDP's whole state, in bytes."""
    from stratagem.strategies.fairscale.oss import optimizer_state_bytes

    out['state_bytes'] = (
        optimizer_state_bytes(sow.optimizer),
        optimizer_state_bytes(dow.optimizer),
    )


def _consolidation_keeps_no_copy(out, sow):
    """After the save: no states kept; rank 0's copy makes only the other ranks' shards new."""
    from stratagem.strategies.fairscale.oss import optimizer_state_bytes

    out['all_states_kept'] = len(sow.optimizer._all_states)
    live = {
        t.untyped_storage().data_ptr()
        for st in sow.optimizer.optim.state.values()
        for t in st.values()
        if torch.is_tensor(t)
    }
    full = sow.optimizer.state_dict()
    out['new_bytes'] = sum(
        t.untyped_storage().nbytes()
        for st in full.get('state', {}).values()
        for t in st.values()
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in live
    )
    out['shard_bytes'] = [None, None]
    dist.all_gather_object(out['shard_bytes'], optimizer_state_bytes(sow.optimizer))


def _adam_runs_continue_to_end(out, rank, ddp, sdp):
    """Both adam runs go on to END: the weights that resumes of their checkpoints must reach."""
    (ds, dm, dow), (ss, sm, sow) = ddp, sdp
    _train(dm, dow, STOP, END, rank)
    _train(sm, sow, STOP, END, rank)
    out['ddp_end'], out['sdp_end'] = _weights(ds), _weights(ss)


@SCENARIOS.add('ranks', needs=['train_adam'])
def zero_grad_trap(tmp, train_adam):
    """fairscale's OSS.zero_grad() (set_to_none) under its ShardedDataParallel, against ours
    (both against DDP's adam run at STOP)."""
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS as FairscaleOSS

    out, rank, ddp_at_stop = {}, _rank(), train_adam['ddp_at_stop']
    for name, oss_cls in (('trap_fairscale', FairscaleOSS), ('trap_ours', None)):
        model = _model()
        if oss_cls is None:  # ours, driven the same raw way
            _, model, ow = _build('ShardedDDPStrategy', os.path.join(tmp, name))
            opt = ow.optimizer
        else:
            opt = oss_cls(model.parameters(), optim=torch.optim.Adam, lr=0.01)
            model = ShardedDataParallel(model, opt, broadcast_buffers=False)
        for i in range(STOP):
            x, y = _batch(i, rank)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        got = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        out[name] = _max_diff(got, ddp_at_stop)
    return out


@SCENARIOS.add('ranks')
def accumulating_run(tmp):
    """Accumulation 2 and a warmup, to END without a break: returns the resumes' oracle."""
    fs, fm, fow = _build('ShardedDDPStrategy', os.path.join(tmp, 'acc_full'), **_ACC2)
    _train(fm, fow, 0, END, _rank(), _scheds(fs))
    return {k: v.detach().clone() for k, v in fm.module.state_dict().items()}


@SCENARIOS.add('ranks', needs=['accumulating_run'])
def rollback_mid_window(tmp, accumulating_run):
    """A roll-back in the same process to a checkpoint saved mid window, after forwards built
    the reduce buckets and a window is open: exact (a fresh strategy's resume is the
    conformance table's)."""
    rank, full_w = _rank(), accumulating_run
    ps, pm, pow_ = _build('ShardedDDPStrategy', os.path.join(tmp, 'acc_part'), **_ACC2)
    _train(pm, pow_, 0, 3, rank, _scheds(ps))  # windows [0,2), [2,4): 3 is inside one
    mid = ps.save_checkpoint('iter_3.pth', extra_ckpt={'meta': {'iter': 3}})
    rs2, rm2, row2 = _build('ShardedDDPStrategy', os.path.join(tmp, 'acc_part'), **_ACC2)
    _train(rm2, row2, 0, 3, rank, _scheds(rs2))  # buckets built, a window open: replaced
    rs2.resume(mid)
    _train(rm2, row2, 3, END, rank, _scheds(rs2))
    exact = all(torch.equal(v, full_w[k]) for k, v in _weights(rs2).items())
    return {'rollback_resume_equal': exact}


@SCENARIOS.add('ranks', needs=['train_adam'])
def cross_ddp(tmp, train_adam):
    """SDP's checkpoint resumed by DDP, DDP's by SDP: each reaches the other run's END."""
    out, adam = {}, train_adam
    for name, kind, path, want in (
        ('sdp_to_ddp', 'DDPStrategy', adam['sdp_ckpt'], 'sdp_end'),
        ('ddp_to_sdp', 'ShardedDDPStrategy', adam['ddp_ckpt'], 'ddp_end'),
    ):
        s, m, o = _build(kind, os.path.join(tmp, name))
        s.resume(path)
        _train(m, o, STOP, END, _rank())
        out[name] = _max_diff(_weights(s), adam[want])
    return out


@SCENARIOS.add('ranks', needs=['train_adam'])
def cross_fsdp(tmp, train_adam):
    """FSDP resumes SDP's checkpoint and saves a directory that SDP resumes: both reach END."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out, rank, adam = {}, _rank(), train_adam
    fs, fm, fow = _build('FSDPStrategy', os.path.join(tmp, 'sdp_to_fsdp'))
    fs.resume(adam['sdp_ckpt'])
    fsdp_dir = fs.save_checkpoint('fsdp_5', extra_ckpt={'meta': {'iter': STOP}})
    _train(fm, fow, STOP, END, rank)
    full = get_model_state_dict(fm, options=StateDictOptions(full_state_dict=True))
    out['sdp_to_fsdp'] = _max_diff({k: v.detach() for k, v in full.items()}, adam['sdp_end'])
    s, m, o = _build('ShardedDDPStrategy', os.path.join(tmp, 'fsdp_to_sdp'))
    s.resume(fsdp_dir)
    _train(m, o, STOP, END, rank)
    out['fsdp_to_sdp'] = _max_diff(_weights(s), adam['sdp_end'])
    out['fsdp_is_dir'] = os.path.isdir(fsdp_dir)
    return out


@SCENARIOS.add('ranks')
def oss_under_ddp(tmp):
    """OSS in an optim wrapper cfg under DDPStrategy trains as AdamW does; saves a checkpoint."""
    out, rank = {}, _rank()
    oss, adamw = dict(type='OSS', optim='AdamW', lr=0.01), dict(type='AdamW', lr=0.01)
    ds, dm, dow = _build('DDPStrategy', os.path.join(tmp, 'oss_ddp'), oss)
    ps, pm, pow_ = _build('DDPStrategy', os.path.join(tmp, 'adamw_ddp'), adamw)
    _train(dm, dow, 0, STOP, rank)
    _train(pm, pow_, 0, STOP, rank)
    out['oss_ddp_type'] = type(dow.optimizer).__name__
    out['oss_ddp_diff'] = _max_diff(_weights(ds), _weights(ps))
    out['oss_ddp_ckpt'] = ds.save_checkpoint('oss.pth', extra_ckpt={'meta': {'iter': STOP}})
    out['adamw_ddp_state'] = pow_.optimizer.state_dict()['state']
    return out


@SCENARIOS.add('ranks')
def sync_bn(tmp):
    """sync_bn: statistics over both ranks' samples, as under DDPStrategy."""
    from stratagem.strategies import ShardedDDPStrategy

    bs = ShardedDDPStrategy(work_dir=os.path.join(tmp, 'bn'), sync_bn='torch')
    bn_model, _ = bs.prepare(
        nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
    )
    with torch.no_grad():
        bn_model.module[0].weight.copy_(torch.eye(3))
        bn_model.module[0].bias.zero_()
    bn_model(torch.full((4, 3), float(_rank() + 1)))  # rank 0: ones, rank 1: twos
    return {'bn': (type(bn_model.module[1]).__name__, bn_model.module[1].running_mean.tolist())}


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('sdp'))


@pytest.mark.scenario('train_adam')
def test_sharded_ddp_builds_oss_and_sharded_data_parallel(scenario):
    for r in scenario:
        assert r['types'] == (True, 'OSS', 'Adam')


@pytest.mark.parametrize('case', ['adam', 'bf16'])
@pytest.mark.scenario('train_{case}')
def test_training_equals_ddp(scenario, case):
    for r in scenario:
        assert r[f'{case}_diff'] < 1e-6, r[f'{case}_diff']


@pytest.mark.scenario('zero_grad_trap')
def test_wrapper_never_hits_the_zero_grad_trap(scenario):
    for r in scenario:
        assert r['trap_fairscale'] > 1e-3  # fairscale's OSS.zero_grad(): wrong from step 2
        assert r['trap_ours'] < 1e-6  # ours, zeroed the same raw way, equals DDP


@pytest.mark.scenario('train_adam')
def test_per_rank_optimizer_state_is_about_half_of_ddps(scenario):
    results = scenario
    shards = [r['state_bytes'][0] for r in results]
    ddp = results[0]['state_bytes'][1]
    assert sum(shards) == ddp  # every state tensor lives on exactly one rank
    for shard in shards:
        assert 0.4 < shard / ddp < 0.6, (shard, ddp)


@pytest.mark.scenario('train_adam')
def test_consolidation_keeps_no_copy_and_makes_at_most_one(scenario):
    r0, r1 = scenario
    assert r0['all_states_kept'] == r1['all_states_kept'] == 0
    # rank 0's state dict aliases its own shard; only rank 1's shard was copied
    assert r0['new_bytes'] == r0['shard_bytes'][1] < r0['state_bytes'][1]


@pytest.mark.scenario('rollback_mid_window')
def test_rollback_to_a_mid_window_checkpoint_is_exact(scenario):
    for r in scenario:
        assert r['rollback_resume_equal']


@pytest.mark.scenario('cross_ddp')
def test_checkpoints_cross_between_ddp_and_sharded_ddp(scenario):
    for r in scenario:
        assert r['sdp_to_ddp'] < 1e-6 and r['ddp_to_sdp'] < 1e-6


@pytest.mark.scenario('cross_fsdp')
def test_checkpoints_cross_between_fsdp_and_sharded_ddp(scenario):
    for r in scenario:
        assert r['fsdp_is_dir']  # FSDP's sharded directory layout, read back by ShardedDDP
        assert r['sdp_to_fsdp'] < 1e-6 and r['fsdp_to_sdp'] < 1e-6


@pytest.mark.scenario('train_adam')
def test_checkpoint_loads_in_single_device_equal_to_ddps_state(scenario, tmp_path):
    from stratagem.strategies import SingleDeviceStrategy

    r0 = scenario[0]
    sdp_ck = torch.load(r0['sdp_ckpt'], weights_only=True)
    ddp_ck = torch.load(r0['ddp_ckpt'], weights_only=True)
    assert sdp_ck['meta']['strategy'] == 'ShardedDDPStrategy'
    assert sorted(sdp_ck['optimizer']['state']) == sorted(ddp_ck['optimizer']['state'])
    for i, st in ddp_ck['optimizer']['state'].items():
        for key, value in st.items():
            torch.testing.assert_close(
                sdp_ck['optimizer']['state'][i][key], value, rtol=0, atol=1e-6
            )
    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    model, ow = s.prepare(_model(), optim_wrapper=dict(optimizer=dict(ADAM)))
    with pytest.warns(UserWarning, match='world size 2'):
        s.resume(r0['sdp_ckpt'])
    for k, v in model.state_dict().items():
        assert torch.equal(v, sdp_ck['state_dict'][k])
    loaded = ow.optimizer.state_dict()['state']
    for i, st in sdp_ck['optimizer']['state'].items():
        for key, value in st.items():
            assert torch.equal(loaded[i][key], value)


@pytest.mark.scenario('train_adam')
def test_two_to_one_resume_continues_the_two_rank_run(scenario, tmp_path):
    from stratagem.strategies import SingleDeviceStrategy

    r0 = scenario[0]
    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    model, ow = s.prepare(_model(), optim_wrapper=dict(optimizer=dict(ADAM)))
    with pytest.warns(UserWarning, match='world size 2'):
        s.resume(r0['sdp_ckpt'])
    _train(model, ow, STOP, END)  # whole batches: the mean of the two halves' losses
    assert _max_diff(_weights(s), r0['sdp_end']) < 1e-6


@pytest.mark.scenario('oss_under_ddp')
def test_oss_optimizer_cfg_under_ddp(scenario, tmp_path):
    from stratagem.strategies import SingleDeviceStrategy

    results = scenario
    for r in results:
        assert r['oss_ddp_type'] == 'OSS' and r['oss_ddp_diff'] < 1e-6
    ck = torch.load(results[0]['oss_ddp_ckpt'], weights_only=True)
    want = results[0]['adamw_ddp_state']
    assert len(ck['optimizer']['state']) == len(want) == 8
    for i, st in want.items():
        torch.testing.assert_close(
            ck['optimizer']['state'][i]['exp_avg'], st['exp_avg'], rtol=0, atol=1e-6
        )
    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    s.prepare(_model(), optim_wrapper=dict(optimizer=dict(type='AdamW', lr=0.01)))
    with pytest.warns(UserWarning, match='world size 2'):
        s.resume(results[0]['oss_ddp_ckpt'])


@pytest.mark.scenario('sync_bn')
def test_sync_bn_uses_both_ranks(scenario):
    for r in scenario:
        name, mean = r['bn']
        assert name == 'CPUSyncBatchNorm' and mean == pytest.approx([0.15] * 3)  # 0.1 * 1.5


# ---------------------------------------------------------------- single process
@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    store = dist.FileStore(str(tmp_path / 'store'), 1)
    dist.init_process_group('gloo', store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bad_configs_are_refused_before_anything_is_built(one_rank_group, tmp_path):
    from stratagem.strategies import ShardedDDPStrategy

    with pytest.raises(ValueError, match="KeyError: 'all_gather'.*FSDPStrategy"):
        ShardedDDPStrategy(model_wrapper=dict(type='FullyShardedDataParallel'))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bucket_cap_mb'\]"):
        ShardedDDPStrategy(model_wrapper=dict(bucket_cap_mb=25))
    s = ShardedDDPStrategy(work_dir=str(tmp_path))
    model = _model()
    bad = [
        (None, ValueError, 'needs optim_wrapper'),
        (dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1)), ValueError, 'built SGD'),
        (dict(a=dict(optimizer=dict(ADAM))), ValueError, 'dict of named wrappers'),
        (
            dict(optimizer=dict(type='ZeroRedundancyOptimizer', optimizer_type='Adam')),
            ValueError,
            'already shards',
        ),
        (
            dict(type='AmpOptimWrapper', dtype='float16', optimizer=dict(ADAM)),
            ValueError,
            "dtype='bfloat16'",
        ),
        (
            dict(type='Fp16MasterWeightsOptimWrapper', optimizer=dict(ADAM)),
            TypeError,
            'master copies',
        ),
    ]
    for cfg, exc, match in bad:
        with pytest.raises(exc, match=match):
            s.prepare(model, optim_wrapper=cfg)
        assert not s.prepared
    m, ow = s.prepare(model, optim_wrapper=dict(optimizer=dict(ADAM)))  # one rank works too
    x, y = _batch(0)
    with ow.optim_context(m):
        loss = F.mse_loss(m(x), y)
    ow.update_params(loss)
    assert ow.optimizer.state_dict()['state'][0]['step'] == 1


def test_oss_arguments_are_checked(one_rank_group):
    from stratagem.strategies.fairscale.oss import OSS

    params = list(_model().parameters())
    with pytest.raises(ValueError, match="optim='AdamW'"):
        OSS(params, lr=0.1)
    with pytest.raises(KeyError, match="did you mean 'AdamW'"):
        OSS(params, optim='AdamWW', lr=0.1)
    with pytest.raises(TypeError, match='not OSS itself'):
        OSS(params, optim=OSS)
    opt = OSS(params, optim='SGD', lr=0.1)
    with pytest.raises(ValueError, match='2 param group.*another model'):
        opt.load_state_dict({'state': {}, 'param_groups': [{'params': [0]}, {'params': [1]}]})
    with pytest.raises(ValueError, match='recipient_rank=3'):
        opt.consolidate_state_dict(recipient_rank=3)


def test_oss_needs_a_process_group():
    from stratagem.strategies.fairscale.oss import OSS

    if dist.is_initialized():
        pytest.skip('a process group is already initialised in this process')
    with pytest.raises(RuntimeError, match='initialised process group'):
        OSS(list(_model().parameters()), optim='SGD', lr=0.1)


# fairscale's laziness (OSS registered, not imported) and the missing extra's errors:
# tests/test_imports.py, in the one interpreter that checks every optional package


# ---------------------------------------------------------------- CUDA (run on a device)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
def test_fp16_uses_the_sharded_grad_scaler_on_cuda(tmp_path):
    """One NCCL rank: float16 AMP through ShardedGradScaler equals SingleDeviceStrategy's."""
    from fairscale.optim.grad_scaler import ShardedGradScaler

    from stratagem.strategies import ShardedDDPStrategy, SingleDeviceStrategy

    store = dist.FileStore(str(tmp_path / 'store'), 1)
    dist.init_process_group('nccl', store=store, rank=0, world_size=1)
    try:
        cfg = dict(
            type='AmpOptimWrapper',
            dtype='float16',
            optimizer=dict(ADAM),
            clip_grad=dict(max_norm=0.05),
            loss_scale=dict(init_scale=1024.0),
        )
        runs = []
        for cls in (SingleDeviceStrategy, ShardedDDPStrategy):
            s = cls(work_dir=str(tmp_path / cls.__name__), env_kwargs=dict(randomness=dict(seed=1)))
            model, ow = s.prepare(_model(), optim_wrapper=cfg)
            for i in range(STOP):
                x, y = (t.cuda() for t in _batch(i))
                with ow.optim_context(model):
                    loss = F.mse_loss(model(x).float(), y)
                ow.update_params(loss)
            runs.append((s, ow))
        (single, _), (sharded, sow) = runs
        assert isinstance(sow.loss_scaler, ShardedGradScaler)
        assert sow.loss_scaler.get_scale() == runs[0][1].loss_scaler.get_scale()
        assert _max_diff(_weights(single), _weights(sharded)) < 1e-5
        path = sharded.save_checkpoint('fp16.pth')
        assert torch.load(path, weights_only=True)['optimizer']['loss_scaler']['scale'] > 0
    finally:
        dist.destroy_process_group()
