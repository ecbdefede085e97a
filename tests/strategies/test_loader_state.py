"""A loader's state in the checkpoint (``loaders=``, ``parts.LoaderPart``): a user's loop with
torchdata's ``StatefulDataLoader`` stopped mid-epoch resumes on the samples and to the weights
of an uninterrupted run, on 1 process and on 2 (gloo; one spawn for the module,
tests/scenarios.py), through the strategy API and Fabric's ``save``/``load``; at another
data-parallel size a sample position over our sampler converts, and any other state is refused
naming the loader.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, Subset

pytest.importorskip('torchdata')

from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from scenarios import Scenarios
from stratagem.checkpoint import load_checkpoint_file
from stratagem.checkpoint.checkpointer import LoadContext
from stratagem.data import ResumableSampler
from stratagem.strategies.loader_state import loader_record, loader_state_for_rank
from stratagem.strategies.parts import LoaderPart
from stratagem.strategies.world_change import WorldSizeChangeError

SAMPLES = 48
GLOBAL_BATCH = 8  # per step, all ranks together: 6 steps an epoch
EPOCHS = 2
STOP = 9  # mid-way through the second epoch
SCENARIOS = Scenarios(ranks=dict(nproc=2, timeout=180), fabric=dict(nproc=2, timeout=240))


class Indexed(Dataset):
    """Samples that say which they are: ``(index, features, target)``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=g)
        self.y = torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def _strategy(work_dir):
    from stratagem.strategies import build_strategy

    return build_strategy(
        dict(type='auto', work_dir=str(work_dir), env_kwargs=dict(randomness=dict(seed=3)))
    )


def user_loop(work_dir, *, save_at=None, resume=None, aux=True):
    """A hand-written loop over a StatefulDataLoader with our sampler, and beside it (``aux``)
    one over this rank's shard shuffled by a generator of its own, whose state differs per
    rank; ``save_at`` saves at that step (and goes on), ``resume`` continues a checkpoint.
    Returns, per step, the samples of this rank's batches, and the final weights."""
    strategy = _strategy(work_dir)
    torch.manual_seed(0)
    model, optim_wrapper = strategy.prepare(
        nn.Linear(4, 1), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9))
    )
    rank, world = strategy.data_parallel_rank, strategy.data_parallel_size
    sampler = ResumableSampler(SAMPLES, rank, world, seed=7)
    loaders = {
        'train': StatefulDataLoader(Indexed(), batch_size=GLOBAL_BATCH // world, sampler=sampler)
    }
    if aux:
        shard = Subset(Indexed(), range(rank, SAMPLES, world))
        generator = torch.Generator().manual_seed(100 + rank)
        loaders['aux'] = StatefulDataLoader(
            shard, batch_size=GLOBAL_BATCH // world, shuffle=True, generator=generator
        )
    step, first_epoch = 0, 0
    if resume is not None:
        meta = strategy.load_or_resume(resume=resume, loaders=loaders)['meta']
        step, first_epoch = meta['iter'], meta['epoch']
    seen = []
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        beside = iter(loaders['aux']) if aux else None  # as many batches an epoch as 'train'
        for index, x, y in loaders['train']:
            optim_wrapper.update_params(nn.functional.mse_loss(model(x), y))
            seen.append([index.tolist()])
            if beside is not None:
                seen[-1].append(next(beside)[0].tolist())
            step += 1
            if step == save_at:
                meta = dict(iter=step, epoch=epoch)
                strategy.save_checkpoint('stop.pth', extra_ckpt=dict(meta=meta), loaders=loaders)
    weights = {k: v.detach().clone() for k, v in strategy.unwrap_model().state_dict().items()}
    return seen, weights


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------- one process
def test_a_stopped_loop_resumes_on_the_same_samples_and_weights(tmp_path, clean_env):
    whole, weights = user_loop(tmp_path / 'whole', save_at=STOP)
    after, resumed = user_loop(tmp_path / 'again', resume=str(tmp_path / 'whole' / 'stop.pth'))
    assert after == whole[STOP:]
    assert len(after) == EPOCHS * SAMPLES // GLOBAL_BATCH - STOP
    assert _same(resumed, weights)
    saved = load_checkpoint_file(tmp_path / 'whole' / 'stop.pth')['loaders']
    assert (saved['train']['world_size'], len(saved['train']['states'])) == (1, 1)
    # 3 of the second epoch's 6 batches of 8
    assert saved['train']['states'][0]['_sampler_iter_state'] == {'samples_yielded': 24}
    assert saved['train']['records'][0]['sampler']['epoch'] == 1
    assert saved['aux']['states'][0]['_sampler_iter_state']['sampler_iter_state']['yielded'] == 24


def test_a_loader_state_that_would_not_load_fails_the_save_naming_it(tmp_path, clean_env):
    class Cursor:
        def __iter__(self):
            return iter(())

        def state_dict(self):
            return {'where': object()}

        def load_state_dict(self, state):
            pass

    strategy = _strategy(tmp_path)
    strategy.prepare(nn.Linear(2, 1), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    with pytest.raises(TypeError, match=r"rank 0: loader 'train' \(Cursor\).*loaders\['train'\]"):
        strategy.save_checkpoint('x.pth', loaders={'train': Cursor()})
    assert not (tmp_path / 'x.pth').exists()
    with pytest.raises(TypeError, match=r"loader 'plain' \(DataLoader\) has no state_dict"):
        strategy.save_checkpoint('y.pth', loaders={'plain': torch.utils.data.DataLoader([1])})
    with pytest.raises(TypeError, match=r'loaders= takes a dict of named loaders'):
        strategy.save_checkpoint('z.pth', loaders=[Cursor()])


def _saved(world, loaders, **kw):
    return dict(
        world_size=world,
        data_parallel_size=world,
        states=[loader.state_dict() for loader in loaders],
        records=[loader_record(loader) for loader in loaders],
        **kw,
    )


SAMPLERS = {
    'ours': lambda rank, world, seed: ResumableSampler(SAMPLES, rank, world, seed=seed),
    'torch': lambda rank, world, seed: DistributedSampler(Indexed(), world, rank, seed=seed),
    'torchdata': lambda rank, world, seed: StatefulDistributedSampler(
        Indexed(), world, rank, seed=seed
    ),
}


def _loaders(world, epoch=1, workers=0, seed=7, kind='ours'):
    out = []
    for rank in range(world):
        sampler = SAMPLERS[kind](rank, world, seed)
        sampler.set_epoch(epoch)
        out.append(
            StatefulDataLoader(
                Indexed(),
                batch_size=GLOBAL_BATCH // world,
                sampler=sampler,
                num_workers=workers,
            )
        )
    return out


def _steps(loaders):
    """Per step, the samples all ranks read together (as sets: the ranks' union)."""
    per_rank = [[set(index.tolist()) for index, _, _ in loader] for loader in loaders]
    return [set().union(*step) for step in zip(*per_rank, strict=True)]


@pytest.mark.parametrize(
    ('old', 'new', 'workers', 'kind'),
    [
        (2, 1, 0, 'ours'),
        (1, 4, 0, 'ours'),
        (4, 2, 0, 'torch'),
        (2, 4, 0, 'torchdata'),
        pytest.param(2, 4, 2, 'ours', marks=pytest.mark.slow),
        pytest.param(4, 1, 2, 'torchdata', marks=pytest.mark.slow),
    ],
)
def test_a_sample_position_converts_to_another_size(old, new, workers, kind):
    """Our sampler, torch's DistributedSampler, torchdata's StatefulDistributedSampler (whose
    own state is the same count); in one process, with workers."""
    saving = _loaders(old, workers=workers, kind=kind)
    iterators = [iter(loader) for loader in saving]
    for _ in range(2):  # 2 of the epoch's 6 steps
        for it in iterators:
            next(it)
    saved = _saved(old, saving)
    rest = [
        set().union(*(set(next(it)[0].tolist()) for it in iterators)) for _ in range(4)
    ]  # the uninterrupted run's next 4 steps
    resuming = _loaders(new, epoch=0, workers=workers, kind=kind)
    for rank, loader in enumerate(resuming):
        state = loader_state_for_rank(
            'train', loader, saved, rank=rank, world_size=new, data_parallel_size=new, path='p'
        )
        loader.load_state_dict(state)
        loader.sampler.set_epoch(1)
    assert _steps(resuming) == rest


def test_an_epoch_read_to_its_end_converts_to_its_end():
    saving = _loaders(2)
    for loader in saving:
        batches = iter(loader)
        for _ in range(6):  # all of them, without reaching StopIteration
            next(batches)
    resumed = _loaders(4)[3]
    state = loader_state_for_rank(
        'train', resumed, _saved(2, saving), rank=3, world_size=4, data_parallel_size=4, path='p'
    )
    assert state['_sampler_iter_state'] == {'samples_yielded': 12}
    resumed.load_state_dict(state)
    assert list(resumed) == []


def test_what_does_not_convert_is_refused_naming_the_loader():
    def refusal(saved, loader, new=1):
        with pytest.raises(WorldSizeChangeError) as err:
            loader_state_for_rank(
                'train', loader, saved, rank=0, world_size=new, data_parallel_size=new, path='p'
            )
        return str(err.value)

    class Own:  # a user's loader: its own state, no sample position
        def __init__(self):
            self.pos = 3

        def state_dict(self):
            return {'pos': self.pos}

        def load_state_dict(self, state):
            self.pos = state['pos']

    own = _saved(2, [Own(), Own()])
    message = refusal(own, Own())
    assert "cannot resume loader 'train' (Own) from p at data-parallel size 1 (saved at 2)" in (
        message
    )
    assert 'not a sample position' in message
    part = LoaderPart({'train': Own()}, world_size=1, data_parallel_size=1)
    with pytest.raises(WorldSizeChangeError, match=r"loader 'train' \(Own\)"):
        part.check({'train': own}, LoadContext('p', {}))
    with pytest.raises(KeyError, match=r"holds no state for it \(loaders saved: \['train'\]\)"):
        LoaderPart({'val': Own()}, world_size=1, data_parallel_size=1).check(
            {'train': own}, LoadContext('p', {})
        )
    # our sampler, but another seed: another order
    saving = _loaders(2)
    for loader in saving:
        next(iter(loader))
    assert 'seed 7 -> 8' in refusal(_saved(2, saving), _loaders(1, seed=8)[0])
    # 1 step of 4 per rank on 2 ranks is 8 samples: no whole batch of 3 on 1 rank
    odd = StatefulDataLoader(Indexed(), batch_size=3, sampler=ResumableSampler(SAMPLES, seed=7))
    assert 'no whole number of batches of 3' in refusal(_saved(2, saving), odd)
    # the same size: the rank's own state, whatever it is
    assert loader_state_for_rank(
        'train', Own(), own, rank=1, world_size=2, data_parallel_size=2, path='p'
    ) == {'pos': 3}


def test_fabric_saves_and_restores_a_loader_in_its_state(tmp_path, clean_env):
    pytest.importorskip('lightning')
    from lightning.fabric import Fabric

    from stratagem.integrations.fabric import StratagemStrategy

    def run(stop=None, resume=None):
        strategy = StratagemStrategy(dict(type='SingleDeviceStrategy', work_dir=str(tmp_path)))
        fabric = Fabric(accelerator='cpu', devices=1, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        sampler = ResumableSampler(SAMPLES, seed=7)
        loader = StatefulDataLoader(Indexed(), batch_size=GLOBAL_BATCH, sampler=sampler)
        state = {'model': model, 'optimizer': optimizer, 'train_loader': loader, 'step': 0}
        if resume:
            fabric.load(tmp_path / 'stop.ckpt', state)
        seen = []
        for index, x, y in loader:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            seen.append(index.tolist())
            state['step'] += 1
            if state['step'] == stop:
                fabric.save(tmp_path / 'stop.ckpt', state)
                return seen, None
        return seen, {k: v.detach().clone() for k, v in model.state_dict().items()}

    try:
        whole, weights = run()
        before, _ = run(stop=2)
        after, resumed = run(resume=True)
    finally:  # Fabric's launch made a one-process group: leave none to the next test
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert before + after == whole and len(after) == 4
    assert _same(resumed, weights)
    saved = load_checkpoint_file(tmp_path / 'stop.ckpt')
    assert saved['loaders']['train_loader']['states'][0]['_num_yielded'] == 2
    assert 'train_loader' not in saved


# ------------------------------------------------------------------- two processes
@SCENARIOS.add('ranks')
def two_ranks(tmp):
    import os

    whole, weights = user_loop(os.path.join(tmp, 'whole'), save_at=STOP)
    checkpoint = os.path.join(tmp, 'whole', 'stop.pth')
    after, resumed = user_loop(os.path.join(tmp, 'again'), resume=checkpoint)
    return dict(whole=whole, weights=weights, after=after, resumed=resumed, checkpoint=checkpoint)


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('loaders'))


@pytest.mark.scenario('two_ranks')
def test_two_ranks_resume_on_the_same_samples_and_weights(scenario):
    for rank, r in enumerate(scenario):
        assert r['after'] == r['whole'][STOP:], rank
        assert _same(r['resumed'], r['weights'])
    # each rank read its own share of the epoch, and its own shuffle beside it
    epoch = [{i for step in r['whole'][:6] for i in step[0]} for r in scenario]
    assert not epoch[0] & epoch[1] and len(epoch[0] | epoch[1]) == SAMPLES
    assert scenario[0]['whole'][STOP:] != scenario[1]['whole'][STOP:]
    assert _same(scenario[0]['weights'], scenario[1]['weights'])


@pytest.mark.scenario('two_ranks')
def test_two_ranks_checkpoint_resumes_on_one_process_converted(scenario, tmp_path, clean_env):
    """Saved by 2 ranks reading 4 samples a step, resumed by 1 reading 8: the same samples
    each step, and the weights up to the order of the batch's sum. (The 'aux' loader, a
    rank's own shuffle, is refused, naming it.)"""
    refused = r"cannot resume loader 'aux' \(StatefulDataLoader\) from .*stop\.pth at data-"
    with pytest.raises(WorldSizeChangeError, match=refused + r'parallel size 1 \(saved at 2\)'):
        user_loop(tmp_path / 'refused', resume=scenario[0]['checkpoint'])
    after, weights = user_loop(tmp_path, resume=scenario[0]['checkpoint'], aux=False)
    steps = zip(scenario[0]['after'], scenario[1]['after'], strict=True)
    assert [set(step[0]) for step in after] == [set(a[0]) | set(b[0]) for a, b in steps]
    for key, value in weights.items():
        torch.testing.assert_close(value, scenario[0]['weights'][key])


def fabric_loop(work_dir, *, save_at=None, resume=False, epochs=EPOCHS):
    """Fabric's own loop on our DDPStrategy, the StatefulDataLoader set up by Fabric (which
    sets its DistributedSampler's epoch) and an entry of ``fabric.save``'s state. Returns this
    rank's samples per step and the final weights. (Left to Fabric, the sampler of a
    ``shuffle=True`` StatefulDataLoader, torchdata's own RandomSampler, would become a
    DistributedSamplerWrapper around it, whose order a resume cannot find again.)"""
    from lightning.fabric import Fabric

    from stratagem.integrations.fabric import StratagemStrategy

    strategy = StratagemStrategy(dict(type='DDPStrategy', work_dir=str(work_dir)))
    fabric = Fabric(accelerator='cpu', devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    sampler = DistributedSampler(
        Indexed(), num_replicas=fabric.world_size, rank=fabric.global_rank, seed=5
    )
    loader = fabric.setup_dataloaders(
        StatefulDataLoader(Indexed(), batch_size=GLOBAL_BATCH // 2, sampler=sampler)
    )
    state = {'model': model, 'optimizer': optimizer, 'train_loader': loader, 'step': 0}
    path = f'{work_dir}/stop.ckpt'
    if resume:
        fabric.load(path, state)
    seen = []
    while state['step'] < epochs * SAMPLES // GLOBAL_BATCH:
        for index, x, y in loader:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            seen.append(index.tolist())
            state['step'] += 1
            if state['step'] == save_at:
                fabric.save(path, state)
    return seen, {k: v.detach().clone() for k, v in model.state_dict().items()}


@SCENARIOS.add('fabric')
def fabric_ranks(tmp):
    import os

    whole, weights = fabric_loop(os.path.join(tmp, 'fabric'), save_at=3, epochs=1)
    after, resumed = fabric_loop(os.path.join(tmp, 'fabric'), resume=True, epochs=1)
    return dict(whole=whole, weights=weights, after=after, resumed=resumed)


@pytest.mark.slow
@pytest.mark.scenario('fabric_ranks')
def test_fabric_two_ranks_resume_on_the_same_samples_and_weights(scenario):
    for rank, r in enumerate(scenario):
        assert r['after'] == r['whole'][3:], rank
        assert _same(r['resumed'], r['weights'])
    assert scenario[0]['whole'] != scenario[1]['whole']
