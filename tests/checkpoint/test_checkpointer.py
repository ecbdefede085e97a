"""The extension points a backend author builds on, tested through fakes, in one process:
``Checkpointer``'s save and load sequences (docs/architecture.md, "Save" and "Load and
resume") over fake parts (``StatePart`` and plain ``Stateful`` objects) and a fake
``CheckpointStorage`` that records every hook it is called through."""

import pickle
import threading

import pytest
import torch

from stratagem.checkpoint.checkpointer import Checkpointer, LoadContext, Stateful, StatePart
from stratagem.checkpoint.storage import CheckpointStorage


class FakeStorage(CheckpointStorage):
    """Records each hook in ``calls`` (shared with the parts); keeps what it wrote in memory,
    beside a small file (the load's agreement checks that the path exists)."""

    def __init__(self, calls, holds=frozenset(), refuse=None):
        super().__init__()
        self.calls, self.holds, self.refuse = calls, frozenset(holds), refuse
        self.written = {}
        self.gate = None  # an Event the write waits for (the writer thread, async saves)
        self.fail_write = None

    def check_savable(self, path):
        self.calls.append(('check_savable', path))
        if self.refuse:
            raise ValueError(self.refuse)

    def validate(self, checkpoint):
        self.calls.append(('validate', sorted(checkpoint)))
        return super().validate(checkpoint)

    def stage(self, checkpoint, path, commit, writer):
        self.calls.append(('stage', writer is not None))
        return super().stage(checkpoint, path, commit, writer)  # the default: snapshots

    def write(self, checkpoint, path, commit):
        if self.gate is not None:
            self.gate.wait(30)
        self.calls.append(('write', list(checkpoint)))
        if self.fail_write:
            raise OSError(self.fail_write)
        commit.gate()
        self.written[path] = pickle.loads(pickle.dumps(checkpoint))  # a copy, as on disk
        with open(path, 'wb') as f:
            f.write(b'fake')

    def open(self, path, map_location, *, optimizer=False, editable=True):
        self.calls.append(('open', optimizer, editable))
        return pickle.loads(pickle.dumps(self.written[path])), 'opened-token'

    def read(self, path, map_location):
        self.calls.append(('read',))
        return self.written[path]

    def restore(self, path, checkpoint, opened, *, optimizer):
        self.calls.append(('restore', opened, optimizer))


class Part:
    """A plain ``Stateful`` (no check, no restore): the minimum a part is."""

    def __init__(self, key, calls, value):
        self.key, self.calls, self.value = key, calls, value

    def state_dict(self):
        self.calls.append(('state_dict', self.key))
        return self.value

    def load_state_dict(self, state_dict):
        self.calls.append(('load_state_dict', self.key))
        self.value = state_dict


def part(key, calls, value, check=None, required=True):
    """A ``StatePart`` that records its steps; ``.live`` is what it restored."""
    box = {'live': value}

    def save():
        calls.append(('state_dict', key))
        return box['live']

    def load(value, context):
        calls.append(('restore', key))
        box['live'] = value
        box['context'] = context

    def checked(value, context):
        calls.append(('check', key))
        if check is not None:
            check(value, context)

    made = StatePart(save, load, check=checked, required=required)
    made.box = box
    return made


@pytest.fixture
def calls():
    return []


def _saved_state(calls):
    return {
        'state_dict': part('state_dict', calls, {'w': torch.arange(3.0)}),
        'optimizer': Part('optimizer', calls, {'lr': 0.1}),
        'meta': part('meta', calls, {'iter': 4}),
    }


def test_save_runs_the_documented_sequence(tmp_path, calls):
    storage = FakeStorage(calls)
    path = Checkpointer(storage).save(str(tmp_path / 'a.pth'), _saved_state(calls))
    assert path == str(tmp_path / 'a.pth')
    assert calls == [
        ('check_savable', path),  # 2. refuse a moment the storage cannot hold
        ('state_dict', 'state_dict'),  # 3. each part, in the mapping's order
        ('state_dict', 'optimizer'),
        ('state_dict', 'meta'),
        ('validate', ['meta', 'optimizer', 'state_dict']),  # 4. every rank validates
        ('stage', False),  # 5. on the training thread
        ('write', ['meta', 'state_dict', 'optimizer']),  # 6. meta first (mmengine's order)
    ]
    assert storage.written[path]['state_dict']['w'].tolist() == [0.0, 1.0, 2.0]


def test_save_leaves_out_none_and_the_keys_the_storage_holds(tmp_path, calls):
    storage = FakeStorage(calls, holds={'state_dict'})
    state = _saved_state(calls)
    state['partial_grads'] = part('partial_grads', calls, None)  # nothing at this moment
    path = Checkpointer(storage).save(str(tmp_path / 'a.pth'), state)
    assert ('state_dict', 'state_dict') not in calls  # the storage's own files hold it
    assert ('state_dict', 'partial_grads') in calls
    assert sorted(storage.written[path]) == ['meta', 'optimizer']


def test_save_adds_extra_then_the_callback_sees_and_edits_what_is_written(tmp_path, calls):
    storage = FakeStorage(calls)
    seen = []

    def callback(checkpoint):
        seen.append(sorted(checkpoint))
        calls.append(('callback',))
        checkpoint['added_by_callback'] = 1

    path = Checkpointer(storage).save(
        str(tmp_path / 'a.pth'),
        _saved_state(calls),
        extra={'message_hub': {'x': 1}, 'meta': {'iter': 9}},
        callback=callback,
    )
    assert seen == [['message_hub', 'meta', 'optimizer', 'state_dict']]
    assert calls.index(('callback',)) < [c[0] for c in calls].index('validate')
    written = storage.written[path]
    assert written['added_by_callback'] == 1 and written['message_hub'] == {'x': 1}
    assert written['meta'] == {'iter': 9}  # extra wins over the part's value


def test_a_refused_or_invalid_save_writes_nothing(tmp_path, calls):
    refused = FakeStorage(calls, refuse='inside an accumulation window')
    with pytest.raises(ValueError, match='inside an accumulation window'):
        Checkpointer(refused).save(str(tmp_path / 'a.pth'), _saved_state(calls))
    assert [c[0] for c in calls] == ['check_savable']  # no part was even asked
    calls.clear()
    storage = FakeStorage(calls)
    state = _saved_state(calls)
    state['meta'] = part('meta', calls, {'fn': lambda: 1})
    with pytest.raises(TypeError, match=r"checkpoint\['meta'\]\['fn'\] is a function"):
        Checkpointer(storage).save(str(tmp_path / 'b.pth'), state)
    assert [c[0] for c in calls][-1] == 'validate' and storage.written == {}
    assert not (tmp_path / 'b.pth').exists()


def test_async_save_is_the_state_at_the_call(tmp_path, calls):
    """The write waits until the program has changed every value after the call."""
    storage = FakeStorage(calls)
    storage.gate = threading.Event()
    weight, moments = torch.zeros(4), {'step': torch.tensor(3.0)}
    state = {
        'state_dict': part('state_dict', calls, {'w': weight}),
        'optimizer': Part('optimizer', calls, {'state': moments, 'lr': 0.1}),
    }
    checkpointer = Checkpointer(storage, async_checkpoint=True)
    path = checkpointer.save(str(tmp_path / 'a.pth'), state)
    assert ('stage', True) in calls and checkpointer.writer.pending
    weight.add_(5.0)  # in place, after the call
    moments['step'].fill_(99.0)
    state['optimizer'].value['lr'] = 7.0
    state['state_dict'].box['live'] = {'w': torch.ones(1)}
    assert path not in storage.written  # nothing written yet
    storage.gate.set()
    checkpointer.wait()
    written = storage.written[path]
    assert torch.equal(written['state_dict']['w'], torch.zeros(4))
    assert written['optimizer']['state']['step'].item() == 3.0
    assert written['optimizer']['lr'] == 0.1


def test_an_async_write_error_is_raised_at_the_next_wait_or_save(tmp_path, calls):
    storage = FakeStorage(calls)
    storage.fail_write = 'injected: disk full'
    checkpointer = Checkpointer(storage, async_checkpoint=True)
    checkpointer.save(str(tmp_path / 'a.pth'), _saved_state(calls))
    with pytest.raises(OSError, match='injected: disk full'):
        checkpointer.save(str(tmp_path / 'b.pth'), _saved_state(calls))  # 0. waits first
    storage.fail_write = None
    path = checkpointer.save(str(tmp_path / 'c.pth'), _saved_state(calls))
    checkpointer.wait()  # the writer goes on after a failed save
    assert list(storage.written) == [path]


def _saved(tmp_path, calls, holds=frozenset(), **parts):
    """A checkpoint with ``parts`` (key: value) written through a fake storage."""
    storage = FakeStorage(calls, holds=holds)
    state = {k: Part(k, [], v) for k, v in parts.items()}
    path = Checkpointer(storage).save(str(tmp_path / 'saved.pth'), state)
    calls.clear()
    return storage, path


def test_load_runs_the_documented_sequence(tmp_path, calls):
    storage, path = _saved(
        tmp_path, calls, state_dict={'w': 1}, optimizer={'lr': 0.2}, meta={'iter': 4}
    )
    state = {
        'state_dict': part('state_dict', calls, None),
        'optimizer': part('optimizer', calls, None),
        'meta': Part('meta', calls, None),  # a plain Stateful: load_state_dict
    }
    context = Checkpointer(storage).load(path, state, optimizer=True)
    assert calls == [
        ('open', True, False),  # 2. what the checks need (no callback: not editable)
        ('check', 'state_dict'),  # 4. every check, in order, before any load
        ('check', 'optimizer'),
        ('restore', 'opened-token', True),  # 5. the storage's in-place reads
        ('restore', 'state_dict'),  # 6. every part, in the mapping's order
        ('restore', 'optimizer'),
        ('load_state_dict', 'meta'),
    ]
    assert state['state_dict'].box['live'] == {'w': 1} and state['meta'].value == {'iter': 4}
    assert (context.path, context.opened, context.meta) == (path, 'opened-token', {'iter': 4})
    assert state['optimizer'].box['context'] is context  # one context, shared by the parts


def test_load_callback_sees_the_checkpoint_before_the_checks(tmp_path, calls):
    storage, path = _saved(tmp_path, calls, state_dict={'w': 1})

    def callback(checkpoint):
        calls.append(('callback', sorted(checkpoint)))
        checkpoint['state_dict'] = {'w': 2}  # a host trainer's edit: what the parts load

    state = {'state_dict': part('state_dict', calls, None)}
    Checkpointer(storage).load(path, state, callback=callback)
    assert calls[:3] == [
        ('open', False, True),
        ('callback', ['state_dict']),
        ('check', 'state_dict'),
    ]
    assert state['state_dict'].box['live'] == {'w': 2}


def test_a_missing_required_part_is_refused_before_anything_loads(tmp_path, calls):
    storage, path = _saved(tmp_path, calls, state_dict={'w': 1}, meta={'iter': 1})
    state = {
        'state_dict': part('state_dict', calls, 'live'),
        'optimizer': part('optimizer', calls, 'live'),
    }
    with pytest.raises(KeyError, match=r"saved.pth cannot be resumed: it has no \['optimizer'\]"):
        Checkpointer(storage).load(path, state)
    assert [c[0] for c in calls] == ['open']  # no check, no restore
    assert state['state_dict'].box['live'] == 'live'


def test_an_optional_part_gets_none_and_a_held_key_is_the_storages(tmp_path, calls):
    storage, path = _saved(tmp_path, calls, holds={'state_dict'}, state_dict={'w': 1}, meta={})
    state = {
        'state_dict': part('state_dict', calls, 'live'),  # held: the storage restores it
        'meta': part('meta', calls, 'live'),
        'partial_grads': part('partial_grads', calls, 'live', required=False),
    }
    Checkpointer(storage).load(path, state)
    assert ('check', 'state_dict') not in calls and ('restore', 'state_dict') not in calls
    assert state['state_dict'].box['live'] == 'live'
    assert state['partial_grads'].box['live'] is None  # absent and optional: None
    assert ('restore', 'partial_grads') in calls


def test_every_check_runs_before_any_load_so_a_refused_load_changes_nothing(tmp_path, calls):
    storage, path = _saved(
        tmp_path, calls, state_dict={'w': 1}, optimizer={'lr': 0.2}, param_schedulers=[1]
    )

    def refuse(value, context):
        raise ValueError('param scheduler count differs; nothing was changed')

    state = {
        'state_dict': part('state_dict', calls, 'live'),
        'optimizer': part('optimizer', calls, 'live'),
        'param_schedulers': part('param_schedulers', calls, 'live', check=refuse),
    }
    with pytest.raises(ValueError, match='nothing was changed'):
        Checkpointer(storage).load(path, state)
    assert [c for c in calls if c[0] != 'open'] == [
        ('check', 'state_dict'),
        ('check', 'optimizer'),
        ('check', 'param_schedulers'),
    ]  # neither the storage's restore nor any part's
    assert all(p.box['live'] == 'live' for p in state.values())


def test_a_check_notes_and_replaces_for_a_later_part(tmp_path, calls):
    storage, path = _saved(tmp_path, calls, meta={'world_size': 2}, param_schedulers=['saved'])

    def plan(meta, context):
        context.notes['world_size_change'] = (meta['world_size'], 1)

    def convert(value, context):
        old, new = context.notes['world_size_change']
        context.replace('param_schedulers', [f'{value[0]} at {old} -> {new}'])

    state = {
        'meta': part('meta', calls, None, check=plan),
        'param_schedulers': part('param_schedulers', calls, None, check=convert),
    }
    context = Checkpointer(storage).load(path, state)
    assert state['param_schedulers'].box['live'] == ['saved at 2 -> 1']
    assert context.value('param_schedulers') == ['saved at 2 -> 1']
    assert context.checkpoint['param_schedulers'] == ['saved']  # the caller's dict: unchanged
    assert context.notes == {'world_size_change': (2, 1)}


def test_load_context_and_state_part_alone():
    context = LoadContext('p.pth', {'meta': 'not a dict', 'a': 1})
    assert context.meta == {} and context.value('a') == 1 and context.value('b') is None
    context.replace('b', 2)
    assert context.value('b') == 2 and 'b' not in context.checkpoint
    loaded = []
    plain = StatePart(lambda: {'x': 1}, lambda value, ctx: loaded.append((value, ctx.path)))
    assert isinstance(plain, Stateful) and plain.required
    assert plain.state_dict() == {'x': 1}
    plain.load_state_dict({'x': 2})  # as a plain Stateful: an empty context
    plain.check({'x': 3}, context)  # no check given: nothing to refuse
    assert loaded == [({'x': 2}, '')]
    assert not StatePart(dict, lambda v, c: None, required=False).required


def test_read_agrees_then_reads_whole_and_refuses_what_is_no_dict(tmp_path, calls):
    storage, path = _saved(tmp_path, calls, state_dict={'w': 1})
    checkpointer = Checkpointer(storage)
    assert checkpointer.read(path) == (path, {'state_dict': {'w': 1}})
    assert calls == [('read',)]
    storage.written[path] = ['not', 'a', 'dict']
    with pytest.raises(ValueError, match='saved.pth holds a list, not a checkpoint dict'):
        checkpointer.read(path)
    with pytest.raises(FileNotFoundError):
        checkpointer.load(str(tmp_path / 'absent.pth'), {})


def test_checkpointer_arguments_are_checked():
    with pytest.raises(TypeError, match='async_checkpoint must be True or False'):
        Checkpointer(async_checkpoint='yes')
    with pytest.raises(ValueError, match='checkpoint_timeout must be a positive number'):
        Checkpointer(timeout=0)
    assert type(Checkpointer().storage) is CheckpointStorage  # one file, by rank 0


class ShardedFake(FakeStorage):
    """Every rank writes (``all_ranks_write``): the default ``stage`` ends with the ranks'
    arrival; ``skip_arrive``: a storage whose own ``stage`` forgets it."""

    def __init__(self, calls, skip_arrive=False):
        super().__init__(calls)
        self.skip_arrive = skip_arrive

    def all_ranks_write(self):
        return True

    def stage(self, checkpoint, path, commit, writer):
        if self.skip_arrive:
            return lambda: None
        return super().stage(checkpoint, path, commit, writer)

    def write(self, checkpoint, path, commit):
        torch.distributed.barrier()  # a write in collectives of its own, as DCP's
        super().write(checkpoint, path, commit)


def _arrival_checks(root):
    """2 ranks, a storage every rank writes to: a save that fails on rank 1 before its write
    (its callback) raises in the call on both ranks, rank 1 named on rank 0, nothing
    written; the next save writes on both; a storage whose ``stage`` skips the arrival is
    refused on both ranks, naming it."""
    from stratagem.env import init_dist

    init_dist('pytorch')
    import torch.distributed as dist

    rank, out, calls = dist.get_rank(), {}, []
    storage = ShardedFake(calls)
    saver = Checkpointer(storage, timeout=30)

    def refuse(checkpoint):
        if rank == 1:
            raise ValueError('refused on rank 1')

    state = {'meta': Part('meta', calls, {'iter': 1})}
    try:
        saver.save(f'{root}/a_{rank}.pth', state, callback=refuse)
    except Exception as err:  # noqa: BLE001 - reported to the test
        out['refused'] = f'{type(err).__name__}: {err}'
    out['written'] = sorted(storage.written)
    saver.save(f'{root}/b_{rank}.pth', state)
    out['after'] = len(storage.written)
    try:
        Checkpointer(ShardedFake([], skip_arrive=True), timeout=30).save(f'{root}/c.pth', state)
    except Exception as err:  # noqa: BLE001 - reported to the test
        out['no_arrival'] = f'{type(err).__name__}: {err}'
    dist.barrier()
    return out


def test_a_rank_failing_before_its_write_meets_the_others_at_their_arrival(tmp_path):
    from dist_harness import run_distributed

    zero, one = run_distributed(_arrival_checks, nproc=2, args=(str(tmp_path),), timeout=120)
    assert one['refused'] == 'ValueError: refused on rank 1'
    # rank 0's path is every rank's (the vote hands it out)
    assert zero['refused'] == (
        f'CheckpointVoteError: saving {tmp_path}/a_0.pth failed on rank 1: ValueError: '
        'refused on rank 1; nothing was committed'
    )
    for out in (zero, one):
        assert out['written'] == [] and out['after'] == 1
        assert out['no_arrival'] == (
            'TypeError: ShardedFake.stage must call commit.arrive() before the '
            "write's collectives (its all_ranks_write() is True): a rank that failed "
            'before would leave the others waiting in them'
        )
