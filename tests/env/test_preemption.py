"""Preemption in one process: the settings' errors, ``stratagem train`` stopping inside an
accumulation window (sync and async saves) with exit status 75 and resuming bit-exact, a
hand-written loop with the ``Preemption`` context manager, and mmengine's FlexibleRunner with
``stratagem.PreemptionHook``."""

import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch

from failure_helpers import CONFIG, equal, write_config
from stratagem import checkpoint as ckpt
from stratagem.cli import main
from stratagem.env.preemption import Preemption, preemption_config

ONE_PROC = CONFIG.replace(
    "strategy = dict(type='auto'", "strategy = dict(type='SingleDeviceStrategy'"
)
ITERS_1 = 64  # 4 epochs of 64 samples / batch 4 on one process


@pytest.mark.parametrize(
    'value, message',
    [
        ('SIGTERM', 'train_cfg.preemption should be a dict'),
        (dict(signal=['SIGTERM']), r"unknown key\(s\) \['signal'\] in train_cfg.preemption"),
        (dict(signals=['SIGFOO']), "train_cfg.preemption.signals: unknown signal 'SIGFOO'"),
        (dict(signals=['SIGKILL']), 'SIGKILL cannot be caught'),
        (dict(requeue='yes'), 'train_cfg.preemption.requeue should be True or False'),
        (dict(exit_code=300), r'train_cfg.preemption.exit_code should be an int in 0..255'),
    ],
)
def test_preemption_settings_errors_name_the_key(value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        preemption_config(value)
    assert preemption_config(None) is None
    assert preemption_config(dict(signals='usr1')).signals == ('SIGUSR1',)


@pytest.fixture(scope='module', autouse=True)
def hook_run_started(request, tmp_path_factory):
    """``hook_run`` in a process of its own (mmengine's runner changes process-wide logging
    state), started at the module's first test when the session selected
    test_flexible_runner_preemption_hook (the last of the module): it runs on the other core
    while this process runs the module's other tests. ``(process, folder)``, or None."""
    wanted = importlib.util.find_spec('mmengine') is not None and any(
        getattr(item, 'module', None) is request.module
        and item.originalname == 'test_flexible_runner_preemption_hook'
        for item in request.session.items
    )
    if not wanted:
        yield None
        return
    tmp = tmp_path_factory.mktemp('hook')
    code = f'import test_preemption as t; t.hook_run({str(tmp)!r}); print("HOOK-OK")'
    # this module, tests/ (failure_helpers) and tests/integrations/ (the runner's toy model)
    here = os.path.dirname(__file__)
    tests = os.path.dirname(here)
    path = [here, tests, os.path.join(tests, 'integrations'), os.environ.get('PYTHONPATH', '')]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.Popen(
        [sys.executable, '-c', code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('straight')
    cfg = write_config(tmp, ONE_PROC)
    assert main(['train', str(cfg), '--work-dir', str(tmp / 'w')]) == 0
    return cfg, _final(tmp / 'w')


def _final(work):
    c = torch.load(work / f'iter_{ITERS_1}.pth', weights_only=True)
    return [c['state_dict'], c['optimizer'], c['param_schedulers']]


@pytest.mark.parametrize('mode', ['sync', 'async'])
def test_train_stops_on_a_signal_inside_a_window_and_resumes_exactly(
    straight, tmp_path, monkeypatch, mode
):
    cfg, want = straight
    work = tmp_path / 'w'
    opts = ['--cfg-options', 'strategy.async_checkpoint=True'] if mode == 'async' else []
    # read 43 is in iteration 11: one process stops right after it, inside a window of 2,
    # while the (async) save of iteration 10 may still be written
    monkeypatch.setenv('SIGNAL_AT', '43')
    monkeypatch.setenv('SIGNAL', 'SIGTERM')
    assert main(['train', str(cfg), '--work-dir', str(work), *opts]) == 75
    assert ckpt.find_latest_checkpoint(work).name == 'iter_11.pth'
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    monkeypatch.delenv('SIGNAL_AT')
    assert main(['train', str(cfg), '--work-dir', str(work), '--resume']) == 0
    assert equal(_final(work), want)


def _hand_loop(work, stop_signal_at=None, resume=False):
    """A hand-written loop: Preemption around it, should_stop after each step."""
    from stratagem.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(work_dir=str(work), env_kwargs=dict(randomness=dict(seed=1)))
    torch.manual_seed(0)
    model, optim = strategy.prepare(
        torch.nn.Linear(4, 2), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
    )
    start = 0
    if resume:
        start = strategy.load_or_resume(resume=True)['meta']['iter']
    data = torch.randn(20, 4, generator=torch.Generator().manual_seed(2))
    with Preemption(['SIGUSR1']) as preemption:
        for it in range(start, 20):
            optim.update_params(model(data[it : it + 1]).square().mean())
            if it + 1 == stop_signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            if preemption.should_stop(it + 1) or it + 1 == 20:
                strategy.save_checkpoint(
                    f'iter_{it + 1}.pth', extra_ckpt={'meta': {'iter': it + 1}}
                )
                if it + 1 < 20:
                    return it + 1, preemption.received
    return 20, None


def test_a_hand_written_loop_with_the_context_manager(tmp_path):
    assert _hand_loop(tmp_path / 'a') == (20, None)
    assert _hand_loop(tmp_path / 'b', stop_signal_at=7) == (7, 'SIGUSR1')
    assert _hand_loop(tmp_path / 'b', resume=True) == (20, None)
    a = torch.load(tmp_path / 'a' / 'iter_20.pth', weights_only=True)
    b = torch.load(tmp_path / 'b' / 'iter_20.pth', weights_only=True)
    assert equal([a['state_dict'], a['optimizer']], [b['state_dict'], b['optimizer']])


def hook_run(root):
    """FlexibleRunner + PreemptionHook: SIGUSR1 at iteration 5 -> iter_5.pth, SystemExit(75);
    a resumed runner ends where an uninterrupted one does."""
    from pathlib import Path

    tmp_path = Path(root)
    sys.modules.setdefault('deepspeed', None)  # mmengine imports it when installed (slow)
    from mmengine.hooks import Hook
    from mmengine.runner import FlexibleRunner
    from test_flexible_runner_hook_model import dataset, model  # tests/integrations/

    import stratagem.integrations.mmengine  # noqa: F401

    class SignalAt(Hook):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            if runner.iter + 1 == 5 and runner.signal_me:
                os.kill(os.getpid(), signal.SIGUSR1)

    def runner(work, resume=False):
        loader = dict(
            dataset=dataset(),
            batch_size=4,
            collate_fn=dict(type='default_collate'),
            sampler=dict(type='InfiniteSampler', shuffle=True),
        )
        return FlexibleRunner(
            model=model(),
            work_dir=str(work),
            strategy=dict(type='stratagem.SingleDeviceStrategy'),
            train_dataloader=loader,
            optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
            train_cfg=dict(by_epoch=False, max_iters=12),
            randomness=dict(seed=3),
            default_hooks=dict(
                checkpoint=dict(type='CheckpointHook', interval=100, by_epoch=False)
            ),
            custom_hooks=[dict(type='stratagem.PreemptionHook', signals=['SIGUSR1']), SignalAt()],
            resume=resume,
            log_level='WARNING',
        )

    FlexibleRunner.signal_me = False
    first = runner(tmp_path / 'split')
    first.signal_me = True
    with pytest.raises(SystemExit) as stopped:
        first.train()
    assert stopped.value.code == 75
    assert ckpt.find_latest_checkpoint(tmp_path / 'split').name == 'iter_5.pth'
    r = runner(tmp_path / 'split', resume=True)
    r.train()
    s = runner(tmp_path / 'straight')
    s.train()
    assert r.iter == s.iter == 12
    got, want = r.strategy.model_state_dict(), s.strategy.model_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_signal_is_known_to_other_threads_while_the_main_thread_waits_in_c():
    """The watchdog asks ``pending()`` from its thread: it learns the signal while the main
    thread is blocked in a store wait (C++, where Python runs no handler) instead of after."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)
    seen = []

    def watch(p):
        os.kill(os.getpid(), signal.SIGUSR1)
        start = time.monotonic()
        while p.pending() is None and time.monotonic() - start < 5:
            time.sleep(0.01)
        seen.append((p.pending(), time.monotonic() - start))

    with Preemption(['SIGUSR1']) as p:
        thread = threading.Thread(target=watch, args=(p,))
        before = time.monotonic()
        thread.start()
        with pytest.raises(Exception):  # noqa: B017 - the store's timeout, whatever its type
            store.wait(['never'], datetime.timedelta(seconds=3))
        blocked = time.monotonic() - before
        thread.join()
    assert blocked >= 2.5  # the main thread sat in C meanwhile
    assert seen[0][0] == 'SIGUSR1' and seen[0][1] < 1.5, seen
    assert p.received == 'SIGUSR1'


@pytest.mark.skipif(importlib.util.find_spec('mmengine') is None, reason='needs mmengine')
def test_flexible_runner_preemption_hook(hook_run_started):
    out, err = hook_run_started.communicate(timeout=300)
    assert hook_run_started.returncode == 0 and 'HOOK-OK' in out, err[-3000:]
