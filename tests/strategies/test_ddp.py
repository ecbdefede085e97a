"""DDPStrategy on 2 gloo processes (CPU): no_sync, sync_bn, ZeroRedundancyOptimizer, per-rank
seeds and partial gradients in checkpoints. Equal to one process, the exact resume mid window,
the async save and the cross-backend loads are its row of the conformance table
(test_conformance.py).

Processes are started once for the module (tests/scenarios.py), for the scenarios the
selected tests name.
"""

import os

import pytest
import torch
from torch import nn

from dist_harness import RankFailure, run_distributed
from scenarios import Scenarios
from stratagem.strategies import SingleDeviceStrategy

MAX_ITERS = 10
# accumulation 3, clipping, warmup then cosine by iteration: the resume run's components
_RESUME_COMPONENTS = dict(
    optim_wrapper=dict(
        optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
        accumulative_counts=3,
        clip_grad=dict(type='norm', max_norm=1.0),
    ),
    param_scheduler=[
        dict(type='LinearLR', start_factor=0.2, by_epoch=False, end=4),
        dict(type='CosineAnnealingLR', by_epoch=False, begin=4, T_max=6),
    ],
    dispatch_kwargs=dict(max_iters=MAX_ITERS),
)
STOP = 5  # mid accumulation window (windows of 3: [0,3), [3,6), ...)
SCENARIOS = Scenarios(ranks=dict(nproc=2, timeout=180))


def _net(dropout: float = 0.0) -> nn.Module:
    layers = [nn.Linear(6, 16), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(16, 2))


def _strategy(work_dir, **kwargs):
    from stratagem.strategies import build_strategy

    kwargs.setdefault('env_kwargs', dict(randomness=dict(seed=11)))
    return build_strategy(dict(type='auto', work_dir=str(work_dir), **kwargs))


def _run_to_stop(work_dir):
    """Accumulation 3, dropout, per-rank seeds, per-rank batches from the global RNG, saved
    at STOP (mid window); returns (the checkpoint, (this rank's seed, the configured one))."""
    from torch.nn import functional as F

    s = _strategy(work_dir, env_kwargs=dict(randomness=dict(seed=5, diff_rank_seed=True)))
    model, ow, scheds = s.prepare(_net(dropout=0.25), **_RESUME_COMPONENTS)
    for _ in range(STOP):
        x, y = torch.randn(4, 6), torch.randint(2, (4,))
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        ow.update_params(loss)
        for sch in scheds:
            sch.step()
    path = s.save_checkpoint(f'iter_{STOP}.pth', extra_ckpt={'meta': {'iter': STOP}})
    return path, (s.seed, s.randomness['seed'])


@SCENARIOS.add('ranks')
def auto_builds_ddp(tmp):
    """type='auto' under torchrun: a DDPStrategy, seed and timestamp agreed by the ranks."""
    s = _strategy(os.path.join(tmp, 'auto'))
    return {'type': type(s).__name__, 'seed': s.seed, 'timestamp': s.timestamp}


def _trained(work_dir):
    """DDP on each rank's half of 4 batches (SGD with momentum); returns the strategy."""
    from torch.nn import functional as F

    s = _strategy(work_dir)
    rank = s.rank
    torch.manual_seed(0)
    model, ow = s.prepare(
        _net(), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.5, momentum=0.9))
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=g), torch.randint(2, (8,), generator=g)
        half = slice(rank * 4, rank * 4 + 4)
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x[half]), y[half])
        ow.update_params(loss)
    return s


@SCENARIOS.add('ranks')
def no_sync(tmp):
    """no_sync accumulation: the all-reduces of each iteration, counted."""
    import torch.distributed as dist

    s2 = _strategy(os.path.join(tmp, 'acc'), model_wrapper=dict(bucket_cap_mb=100))
    world = s2.world_size
    model, ow = s2.prepare(
        _net(),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1), accumulative_counts=2),
        dispatch_kwargs=dict(max_iters=6),
    )
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    model.register_comm_hook(None, counting_hook)
    per_iter = []
    for _ in range(6):
        before = len(calls)
        with ow.optim_context(model):
            loss = model(torch.randn(3, 6)).sum()
        ow.update_params(loss)
        per_iter.append(len(calls) - before)
    return {'allreduce_per_iter': per_iter}


@SCENARIOS.add('ranks')
def sync_bn_running_mean(tmp):
    """sync_bn: running statistics over both ranks' data."""
    from stratagem.strategies import DDPStrategy

    s3 = DDPStrategy(work_dir=os.path.join(tmp, 'bn'), sync_bn='torch')
    bn_model = s3.prepare(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    out = {'sync_bn_type': type(s3.model.module[1]).__name__}
    with torch.no_grad():
        s3.model.module[0].weight.copy_(torch.eye(3))
        s3.model.module[0].bias.zero_()
    data = torch.full((4, 3), float(s3.rank + 1))  # rank 0: ones, rank 1: twos -> mean 1.5
    bn_model(data)
    out['bn_running_mean'] = s3.model.module[1].running_mean.tolist()
    out['buffers_resynced'] = s3.model.will_sync_module_buffers()
    return out


@SCENARIOS.add('ranks')
def sync_bn_gradients(tmp):
    """sync_bn: gradients through the global statistics equal one process on the whole
    batch; far from zero mean, statistics in float32 do not cancel."""
    from stratagem.strategies import DDPStrategy

    s4 = DDPStrategy(work_dir=os.path.join(tmp, 'bn2'), sync_bn='torch')
    rank = s4.rank
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ref = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ref.load_state_dict(plain.state_dict())
    bn2 = s4.prepare(plain)
    g = torch.Generator().manual_seed(4)
    full, target = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
    half = slice(rank * 4, rank * 4 + 4)
    (bn2(full[half]) * target[half]).mean().backward()
    (ref(full) * target).mean().backward()
    out = {
        'sync_bn_grad_diff': max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(s4.model.module.parameters(), ref.parameters())
        )
    }
    # far from zero mean, statistics in float32 must not cancel: compare with float64
    s5 = DDPStrategy(work_dir=os.path.join(tmp, 'bn3'), sync_bn='torch')
    bn3 = s5.prepare(nn.BatchNorm1d(3))  # weight 1, bias 0: the plain normalisation
    far = torch.randn(8, 3, generator=g) * 0.5 + 1000.0
    x64 = far.double()
    want = (x64 - x64.mean(0)) / (x64.var(0, unbiased=False) + 1e-5).sqrt()
    out['sync_bn_far_diff'] = (bn3(far[half]).double() - want[half]).abs().max().item()
    return out


@SCENARIOS.add('ranks')
def prewrapped_model_kept(tmp):
    """A model a host trainer already wrapped is used as it is."""
    from torch.nn.parallel import DistributedDataParallel

    from stratagem.env import init_dist
    from stratagem.strategies import DDPStrategy

    init_dist('pytorch')  # the host trainer's group (a no-op when a scenario made it)
    pre = DistributedDataParallel(nn.Linear(2, 2))
    return {'prewrapped_kept': DDPStrategy(work_dir=os.path.join(tmp, 'pre')).prepare(pre) is pre}


@SCENARIOS.add('ranks')
def checkpoint_from_rank0(tmp):
    """A checkpoint of the trained DDP model, written by rank 0, loadable on every rank."""
    s = _trained(os.path.join(tmp, 'ckpt'))
    path = s.save_checkpoint('ddp.pth', extra_ckpt={'meta': {'iter': 4}})
    ck = torch.load(path, weights_only=True)
    return {
        'path': path,
        'ckpt_world_size': ck['meta']['world_size'],
        'n_rng_states': len(ck['rng_states']),
        'state_keys_plain': all(not k.startswith('module.') for k in ck['state_dict']),
    }


@SCENARIOS.add('ranks')
def zero_redundancy(tmp):
    """ZeroRedundancyOptimizer from config: three steps equal a plain Adam's under DDP."""
    sz = _strategy(os.path.join(tmp, 'zero'))
    rank = sz.rank
    zmodel, zow = sz.prepare(
        _net(),
        optim_wrapper=dict(
            optimizer=dict(type='ZeroRedundancyOptimizer', optimizer_type='Adam', lr=0.01)
        ),
    )
    sp = _strategy(os.path.join(tmp, 'plain'))
    pmodel, pow_ = sp.prepare(_net(), optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.01)))
    sp.model.module.load_state_dict(sz.model.module.state_dict())
    for i in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * i + rank))
        for m, o in ((zmodel, zow), (pmodel, pow_)):
            with o.optim_context(m):
                loss = m(x).square().mean()
            o.update_params(loss)
    out = {'zero_type': type(zow.optimizer).__name__}
    out['zero_max_diff'] = max(
        (a - b).abs().max().item()
        for a, b in zip(sz.model.module.parameters(), sp.model.module.parameters())
    )
    zpath = sz.save_checkpoint('zero.pth')  # consolidates the shards: a collective
    out['zero_ckpt_has_state'] = bool(torch.load(zpath, weights_only=True)['optimizer']['state'])
    return out


@SCENARIOS.add('ranks')
def two_optim_wrappers_mid_window(tmp):
    """Two optim wrappers, saved after one micro-batch of a 2-iteration window: every rank's
    own gradients come back."""

    def two_heads():
        torch.manual_seed(9)
        return nn.ModuleDict(dict(a=nn.Linear(3, 1), b=nn.Linear(3, 1)))

    def build_two(sub):
        st = _strategy(os.path.join(tmp, sub))
        m, o = st.prepare(
            two_heads(),
            optim_wrapper=dict(
                a=dict(optimizer=dict(type='SGD', lr=0.1), accumulative_counts=2),
                b=dict(optimizer=dict(type='SGD', lr=0.1), accumulative_counts=2),
            ),
            dispatch_kwargs=dict(max_iters=4),
        )
        return st, m, o

    st, m, o = build_two('two')
    x = torch.full((2, 3), float(st.rank + 1))
    with m.no_sync():
        (m.module['a'](x).sum() + m.module['b'](x).sum()).backward()
    for w in o.values():
        w._inner_count = 1  # one micro-batch of the window done (the loop's update_params)
    own = {k: [p.grad.clone() for p in m.module[k].parameters()] for k in 'ab'}
    two_path = st.save_checkpoint('two.pth', extra_ckpt={'meta': {'iter': 1}})
    st2, m2, o2 = build_two('two')
    st2.resume(two_path)
    return {
        'two_grads_restored': all(
            torch.equal(p.grad, g) for k in 'ab' for p, g in zip(m2.module[k].parameters(), own[k])
        ),
        'two_inner': [w.inner_count for w in o2.values()],
        'two_path': two_path,
    }


@SCENARIOS.add('ranks')
def resume_first_half(tmp):
    """A run saved mid window (its resume: the conformance table's ddp row)."""
    path, seeds = _run_to_stop(os.path.join(tmp, 'resume'))
    return {'resume_ckpt': path, 'diff_rank_seeds': seeds}


def _resume_with_peer(work, peer):
    """A new strategy's ``load_or_resume(resume=True, peer=)``: the checkpoint, rank 0's
    'resume tier' lines, the strategy."""
    import logging

    again = _strategy(work)
    again.prepare(_net(), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.5, momentum=0.9)))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    again.logger.addHandler(handler)
    try:
        checkpoint = again.load_or_resume(resume=True, peer=peer)
    finally:
        again.logger.removeHandler(handler)
    return checkpoint, [line for line in lines if 'resume tier' in line], again


@SCENARIOS.add('ranks')
def peer_copies(tmp):
    """Peer copies on 2 ranks, sent over the process group and copied on one node: each
    rank's state committed in its own directory and at its holder (the other rank); a
    storage checkpoint older; rank 0's own copy removed. ``load_or_resume(resume=True,
    peer=)`` takes the peer tier, rank 0 getting its copy from its holder. Then (one node)
    rank 0's copy lost again and the one rank 1 holds torn: storage."""
    import shutil

    from stratagem.checkpoint.manifest import forget_verified
    from stratagem.checkpoint.peer import PeerCopies

    out = {}
    for same_node in (False, True):
        work = os.path.join(tmp, f'peer-{same_node}')
        s = _trained(work)
        root = os.path.join(tmp, f'peer-shm-{same_node}')
        peer = PeerCopies(root, s.rank, s.world_size, same_node=same_node)
        s.save_checkpoint('iter_3.pth', extra_ckpt={'meta': {'iter': 3}})
        s.save_peer_copy(peer, extra_ckpt={'meta': {'iter': 4}})
        want = [p.detach().clone() for p in s.model.parameters()]
        held = sorted(os.listdir(peer.held_dir))
        if s.rank == 0:
            shutil.rmtree(peer.own_dir)
        torch.distributed.barrier()
        checkpoint, tier, again = _resume_with_peer(work, peer)
        out[same_node] = {
            'held': held,
            'iter': checkpoint['meta']['iter'],
            'equal': all(torch.equal(a, b) for a, b in zip(want, again.model.parameters())),
            'tier': tier,
            'own': sorted(os.listdir(peer.own_dir)),
        }
    # one node, rank 0's own copy gone again and the copy rank 1 holds torn
    if s.rank == 0:
        shutil.rmtree(peer.own_dir)
    else:
        copy = peer.held_dir / 'iter_4.pth'
        data = bytearray(copy.read_bytes())
        data[-40] ^= 0xFF
        copy.write_bytes(bytes(data))
    forget_verified()
    torch.distributed.barrier()
    checkpoint, tier, _ = _resume_with_peer(work, peer)
    out['torn'] = {'iter': checkpoint['meta']['iter'], 'tier': tier}
    return out


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('ddp'))


@pytest.mark.scenario('auto_builds_ddp')
def test_auto_builds_ddp_with_agreed_seed_and_timestamp(scenario):
    r0, r1 = scenario
    assert r0['type'] == r1['type'] == 'DDPStrategy'
    assert r0['seed'] == r1['seed'] == 11 and r0['timestamp'] == r1['timestamp']


@pytest.mark.scenario('no_sync')
def test_no_sync_accumulation_one_allreduce_per_update(scenario):
    for r in scenario:
        assert r['allreduce_per_iter'] == [0, 1, 0, 1, 0, 1]


@pytest.mark.scenario('sync_bn_running_mean')
def test_sync_bn_uses_both_ranks(scenario):
    for r in scenario:
        assert r['sync_bn_type'] == 'CPUSyncBatchNorm'  # torch's refuses CPU tensors
        # momentum 0.1: 0.9 * 0 + 0.1 * 1.5
        assert r['bn_running_mean'] == pytest.approx([0.15] * 3)
        assert r['buffers_resynced'] is False  # mmengine's runner default


@pytest.mark.scenario('sync_bn_gradients')
def test_sync_bn_gradients_match_one_process_and_stay_exact_far_from_zero(scenario):
    for r in scenario:
        assert r['sync_bn_grad_diff'] < 1e-6
        assert r['sync_bn_far_diff'] < 1e-3  # E[x^2]-mean^2 in float32 is off by > 1 here


@pytest.mark.scenario('prewrapped_model_kept')
def test_a_model_a_host_trainer_wrapped_is_kept(scenario):
    for r in scenario:
        assert r['prewrapped_kept']


@pytest.mark.scenario('two_optim_wrappers_mid_window')
def test_two_optim_wrappers_mid_window_restore_each_ranks_grads(scenario):
    ranks = scenario
    for r in ranks:
        assert r['two_grads_restored'] and r['two_inner'] == [1, 1]
    ck = torch.load(ranks[0]['two_path'], weights_only=True)
    grads = ck['partial_grads']  # [rank] -> {parameter name: gradient}, both wrappers'
    assert ck['meta']['format_version'] == 2
    assert len(grads) == 2 and sorted(grads[0]) == ['a.bias', 'a.weight', 'b.bias', 'b.weight']
    assert sorted(grads[1]) == sorted(grads[0])
    assert not torch.equal(grads[0]['a.weight'], grads[1]['a.weight'])


@pytest.mark.scenario('resume_first_half')
def test_diff_rank_seed_keeps_a_shared_configured_seed(scenario):
    r0, r1 = scenario
    assert r0['diff_rank_seeds'] == (5, 5) and r1['diff_rank_seeds'] == (6, 5)


@pytest.mark.scenario('resume_first_half')
def test_world_size_change_mid_window_continues_from_mean_grads(scenario, tmp_path):
    from stratagem.optim import OptimWrapper

    r0, _ = scenario
    ck = torch.load(r0['resume_ckpt'], weights_only=True)
    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    model, ow, _ = s.prepare(_net(dropout=0.25), **_RESUME_COMPONENTS)
    assert isinstance(ow, OptimWrapper)
    with pytest.warns(UserWarning, match='mean of the 2 ranks'):
        s.resume(r0['resume_ckpt'])
    per_rank = ck['partial_grads']  # [rank] -> {parameter name: gradient}
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, (per_rank[0][name] + per_rank[1][name]) / 2)
    assert ow.inner_count == STOP


def test_mmengine_wrapper_type_is_refused_with_a_reason():
    from stratagem.strategies import DDPStrategy

    with pytest.raises(ValueError, match='MMDistributedDataParallel.*train_step'):
        DDPStrategy(model_wrapper=dict(type='MMDistributedDataParallel'))


@pytest.mark.scenario('zero_redundancy')
def test_zero_redundancy_optimizer_matches_plain_adam(scenario):
    ranks = scenario
    for r in ranks:
        assert r['zero_type'] == 'ZeroRedundancyOptimizer'
        assert r['zero_max_diff'] < 1e-6
    assert ranks[0]['zero_ckpt_has_state']


@pytest.mark.scenario('checkpoint_from_rank0')
def test_checkpoint_from_rank0_holds_every_ranks_rng(scenario):
    r0, r1 = scenario
    assert r0['path'] == r1['path'] and os.path.isfile(r0['path'])
    assert r0['ckpt_world_size'] == 2 and r0['n_rng_states'] == 2 and r0['state_keys_plain']


@pytest.mark.scenario('checkpoint_from_rank0')
def test_ddp_checkpoint_loads_in_single_device_with_world_size_warning(scenario, tmp_path):
    r0, _ = scenario
    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    s.prepare(_net(), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.5, momentum=0.9)))
    with pytest.warns(UserWarning, match='world size 2.*has 1'):
        ck = s.resume(r0['path'])
    want = torch.load(r0['path'], weights_only=True)['state_dict']
    for k, v in s.model.state_dict().items():
        assert torch.equal(v, want[k])
    assert ck['meta']['iter'] == 4


def _raise_on_rank1():
    from stratagem import env

    env.init_dist('pytorch')
    if env.get_rank() == 1:
        raise ValueError('rank 1 broke on purpose')
    env.barrier()  # rank 0 would wait here forever without the harness
    return 'unreachable'


# the slow tier's: the first tier ends a rank waiting for a raised one in the harness's own
# tests (tests/env/test_dist_harness.py) and in a real gloo barrier (the desync scenario of
# tests/env/test_scenarios.py)
@pytest.mark.slow
def test_a_failing_rank_ends_all_ranks_and_shows_its_error():
    with pytest.raises(RankFailure, match='^rank 1 raised') as info:
        run_distributed(_raise_on_rank1, nproc=2, timeout=60, grace=2)
    assert 'rank 1 broke on purpose' in str(info.value) + info.value.output


def test_stratagem_train_nproc_2(uninterrupted_run):
    """``stratagem train --nproc 2`` of an 'auto' strategy: DDP on 2 ranks, each rank's RNG
    state in the checkpoints it commits. The run is the session's reference run
    (tests/conftest.py), which the failure tests launch anyway: a launch less; the example
    config under ``--nproc 2 --cfg-options`` runs in docs/backends/ddp.md (tests/test_docs.py)."""
    from failure_helpers import ITERS_2

    cfg, _ = uninterrupted_run
    work = cfg.parent / 'work'
    ck = torch.load(work / f'iter_{ITERS_2}.pth', weights_only=True)
    assert ck['meta']['world_size'] == 2 and ck['meta']['strategy'] == 'DDPStrategy'
    assert ck['meta']['iter'] == ITERS_2
    assert len(ck['rng_states']) == 2 and (work / 'iter_5.pth').is_file()


@pytest.mark.scenario('peer_copies')
@pytest.mark.parametrize('same_node', [False, True], ids=['sent', 'copied'])
def test_peer_copies_reach_the_holder_and_come_back_for_a_lost_own_copy(scenario, same_node):
    for r in scenario:
        r = r[same_node]
        assert r['held'] == ['iter_4.pth', 'iter_4.pth.manifest.json']
        assert r['own'] == ['iter_4.pth', 'iter_4.pth.manifest.json']  # rank 0's: fetched
        assert (r['iter'], r['equal']) == (4, True)
    (tier,) = scenario[0][same_node]['tier']  # rank 0's log (the others log warnings only)
    assert tier.startswith(
        'resume tier: peer (peer copies of iteration 4: at least as new as the newest '
        'storage checkpoint iter_3.pth (iteration 3); rank(s) [0] from their holder)'
    )


@pytest.mark.scenario('peer_copies')
def test_a_torn_copy_from_the_holder_falls_back_to_storage(scenario):
    assert [r['torn']['iter'] for r in scenario] == [3, 3]
    (tier,) = scenario[0]['torn']['tier']
    assert tier.startswith(
        'resume tier: storage (peer copies of iteration 4: at least as new as the newest '
        'storage checkpoint iter_3.pth (iteration 3); rank(s) [0] from their holder; but the '
        'copy of rank 0 that rank 1 holds: checkpoint '
    )
    assert 'is damaged' in tier
