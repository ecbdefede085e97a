"""The backend conformance table (conformance.py): one test per row and column, so a failure
names the backend and the check (``pytest -k 'resume and fsdp'`` runs that cell and what it
needs)."""

import json
import subprocess
import sys

import pytest
import torch
from conformance import (
    BACKENDS,
    FLEXIBLE,
    PAIRS,
    SCENARIOS,
    STOP,
    manifest_of,
    reference,
)

# the module's spawns run in the setup of its first test: all of the table's rows at once
pytestmark = pytest.mark.timeout(2400)


def _rows(names):
    """The rows as parameters, those of more than 2 processes in the slow tier (the first
    tier then never starts the 4-process spawn)."""
    return [pytest.param(n, marks=pytest.mark.slow) if BACKENDS[n].slow else n for n in names]


def _pairs():
    return [
        pytest.param(
            a,
            b,
            name,
            id=f'{a}->{b}',
            marks=[pytest.mark.slow] if BACKENDS[a].slow or BACKENDS[b].slow else [],
        )
        for a, b, name in PAIRS
    ]


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('conformance'))


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize('backend', _rows(BACKENDS))
@pytest.mark.scenario('equal.{backend}')
def test_equals_one_process(scenario, backend):
    ref, tol = reference(), BACKENDS[backend].equal_tol
    assert [r['world'] for r in scenario] == [BACKENDS[backend].nproc] * len(scenario)
    for r in scenario:
        assert _max_diff(r['weights'], ref['weights']) <= tol
        # what each update saw: the pre-clip norm of the whole batch, the scheduled lr
        assert r['norms'] == pytest.approx(ref['norms'], rel=1e-5)
        assert r['lrs'] == pytest.approx(ref['lrs'], rel=1e-12)
        assert len(r['lrs']) == 4  # the tail window [6, 7) updated too
        assert max(r['norms']) > 0.5  # clipping was active
    # each rank's loss is its share's mean: their mean is the whole batch's
    losses = [sum(values) / len(values) for values in zip(*(r['losses'] for r in scenario))]
    assert losses == pytest.approx(ref['losses'], rel=1e-6)
    assert _max_diff(scenario[0]['weights'], ref['init']) > 1e-2  # it trained


@pytest.mark.parametrize('backend', _rows(BACKENDS))
@pytest.mark.scenario('resume.{backend}')
def test_resume_mid_accumulation_window_is_exact(scenario, backend):
    row = BACKENDS[backend]
    for r in scenario:
        if row.saves_mid_window:
            assert r['save_at'] == STOP and r['refused'] is None
        else:  # refused before anything is written; saved at the window's end instead
            assert f'iteration {STOP}' in r['refused'] and 'accumulative_counts=2' in r['refused']
            assert r['after_refusal'] == [] and r['save_at'] == STOP + 1
        resumed = r['resumed']
        assert resumed['iter'] == r['save_at']
        assert torch.equal(resumed['probe'], r['probe'])  # the global RNG came back
        assert _same(resumed['final'], r['final']) and resumed['lr'] == r['lr']
        assert not _same(r['final'], r['at_save'])  # it trained after the save
    if row.nproc > 1:  # per-rank seeds: the ranks drew their own batches
        assert not torch.equal(scenario[0]['probe'], scenario[1]['probe'])


@pytest.mark.parametrize('backend', _rows(BACKENDS))
@pytest.mark.scenario('async.{backend}')
def test_async_save_is_the_state_at_the_call(scenario, backend):
    for rank, r in enumerate(scenario):
        run = scenario.needs[f'resume.{backend}'][rank]
        # the write waited while the run trained on and overwrote its weights
        assert r['pending'] and not r['exists_meanwhile']
        assert r['iter'] == run['save_at']
        # resumed, it ends where the uninterrupted run ended: weights, optimizer, schedulers,
        # counters and RNG were those at the call
        assert torch.equal(r['probe'], run['probe'])
        assert _same(r['final'], run['final'])


@pytest.mark.parametrize('source, target, load', _pairs())
@pytest.mark.scenario('{load}')
def test_loads_weights_of(scenario, source, target, load):
    for r in scenario:
        got = r[source]
        assert got['reset'] and got['moved'] and got['equal'], got


@pytest.mark.parametrize('backend', _rows(FLEXIBLE))
@pytest.mark.scenario('flexible.{backend}')
def test_flexible_runner_resume_equals_uninterrupted_run(scenario, backend, bare_load):
    nproc = BACKENDS[backend].nproc
    root = scenario.tmp / backend / 'flexible'
    iters_per_epoch = 32 // 4 // nproc
    for rank, result in enumerate(scenario):
        resumed, straight = result['resumed'], result['straight']
        assert (result['rank'], result['world']) == (rank, nproc)
        assert resumed['resumed_from'] == str(root / 'split' / 'epoch_3.pth')
        assert straight['resumed_from'] is None
        for run in (resumed, straight):
            assert run['step_on_wrapper'], 'step_on_wrapper'
            assert run['grads_left'] == [], 'grads_left'
        assert result['epoch_3_meta'] == {'epoch': 3, 'iter': 3 * iters_per_epoch}
        assert (resumed['iter'], resumed['epoch']) == (4 * iters_per_epoch, 4)
        # bit-exact: weights, momentum buffers, lr, scheduler states, counters
        for key in ('weights', 'momentum', 'lr', 'schedulers', 'iter', 'epoch'):
            assert resumed[key] == straight[key], key
        assert resumed['lr'] == [pytest.approx(0.05 * 0.1 * 0.1)]  # both milestones passed
        # the message hub's history came back through the checkpoint and went on
        assert len(result['epoch_3_lr_history']) == 3 * iters_per_epoch
        assert resumed['lr_history'] == straight['lr_history']
        assert resumed['lr_history'][: 3 * iters_per_epoch] == result['epoch_3_lr_history']
    for name in ('epoch_1.pth', 'epoch_4.pth'):
        manifest = manifest_of(root / 'split' / name)
        assert 'mmengine.logging.history_buffer.HistoryBuffer' in manifest['safe_globals']
        assert manifest['world_size'] == nproc
    final = root / 'split' / 'epoch_4.pth'
    if final.is_dir():  # our state's file inside a directory checkpoint (FSDP, DeepSpeed)
        final = next(
            final / name
            for name in ('extra.pth', 'stratagem_state.pth')
            if (final / name).is_file()
        )
    _check_load_without_integration(final, bare_load)


# loads checkpoints in a process that never imports the integration: one per module, not one
# per row (an interpreter's start-up costs seconds on 2 cores); a path per line in, a JSON
# line out: what the load raised, and whether the integration had been imported by then
BARE_LOADER = """
import json, sys
from stratagem.checkpoint import load_checkpoint_file
for line in sys.stdin:
    try:
        load_checkpoint_file(line.rstrip('\\n'))
        said = 'loaded'
    except Exception as e:
        said = f'{type(e).__name__} {e}'
    print(json.dumps([said, 'stratagem.integrations.mmengine' in sys.modules]), flush=True)
"""


@pytest.fixture(scope='module')
def bare_load():
    """``load(path)``: what loading ``path`` says in a process without the integration (this
    one, while it has not imported it; else one loader process for the module's rows)."""
    procs = []

    def load(path):
        from stratagem.checkpoint import get_safe_globals, load_checkpoint_file

        if 'mmengine.logging.history_buffer.HistoryBuffer' not in get_safe_globals():
            try:  # this process has not: check here, which saves starting an interpreter
                load_checkpoint_file(path)
            except Exception as e:  # noqa: BLE001 - the test reads what it raised
                return f'{type(e).__name__} {e}'
            return 'loaded'
        if not procs:
            procs.append(
                subprocess.Popen(
                    [sys.executable, '-c', BARE_LOADER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        proc = procs[0]
        proc.stdin.write(f'{path}\n')
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f'the loader process exited with {proc.wait()}'
        said, integrated = json.loads(line)
        assert not integrated, 'the loader process imported the integration'
        return said

    yield load
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=60)


def _check_load_without_integration(path, load):
    """A process that has not imported the integration names what it lacks."""
    out = load(path)
    assert out.startswith('UnsafeCheckpointError')
    assert 'holds mmengine.logging.history_buffer.HistoryBuffer' in out
    assert 'import stratagem.integrations.mmengine' in out
