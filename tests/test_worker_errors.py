"""One failure message under ``stratagem train --nproc``: torchrun's report filtered out, the
ranks' identical messages merged (naming the ranks), different ones each once, the exit
status; ``--debug`` shows everything."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_env import without_launcher
from stratagem.cli.worker_errors import AgentReportFilter, _ranges, record, summarize

AGENT_REPORT = """\
W1125 18:13:46.728000 22356 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22369 closing signal SIGTERM
E1125 18:13:46.793000 22356 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 22368) of binary: python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
stratagem FAILED
------------------------------------------------------------
Failures:
  error_file: <N/A>
============================================================
"""  # noqa: E501

WORKER_BUG = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/stratagem/loop.py", line 10, in train
    1 / 0
ZeroDivisionError: division by zero
"""


def _filtered(text):
    out = io.StringIO()
    f = AgentReportFilter(out)
    for line in text.splitlines(keepends=True):
        f.feed(line)
    f.close()
    return out.getvalue()


def test_the_agents_report_is_dropped_the_workers_output_kept():
    logs = '2026-11-25 18:13:45,242 stratagem INFO: FSDPStrategy: world size 2\n'
    assert _filtered(logs + WORKER_BUG + AGENT_REPORT) == logs + WORKER_BUG
    assert _filtered(WORKER_BUG) == WORKER_BUG  # a traceback held to its end, then passed on


def test_identical_messages_merge_different_ones_stay(tmp_path, monkeypatch):
    monkeypatch.setenv('STRATAGEM_ERROR_DIR', str(tmp_path))
    for rank, message in [(0, 'bad key'), (1, 'bad key'), (2, 'peer closed'), (3, 'bad key')]:
        monkeypatch.setenv('RANK', str(rank))
        assert record(ValueError(message), message)
        os.utime(tmp_path / f'rank_{rank}.json', ns=(rank, rank))  # rank order = time order
    assert json.loads((tmp_path / 'rank_2.json').read_text()) == {
        'rank': 2,
        'type': 'ValueError',
        'message': 'peer closed',
    }
    text = summarize(str(tmp_path))
    assert text.splitlines()[:4] == [
        'stratagem: error (ranks 0, 1, 3): bad key',
        '(ValueError)',
        'stratagem: error (rank 2): peer closed',
        '(ValueError)',
    ]
    empty = tmp_path / 'empty'
    empty.mkdir()
    assert summarize(str(empty)) is None
    monkeypatch.delenv('STRATAGEM_ERROR_DIR')
    assert not record(ValueError('x'), 'x')  # no collecting parent: the worker prints


def test_rank_ranges():
    assert _ranges([0, 1, 2, 3, 5]) == '0-3, 5'
    assert _ranges([0, 2]) == '0, 2'
    assert _ranges([4, 5]) == '4, 5'


CFG = """
_base_ = {example!r}
strategy = dict(model_wrapper=dict(auto_wrap_policy=['Blok']))
train_cfg = dict(max_iters=4)
"""


@pytest.fixture(scope='module')
def failed_runs(request, tmp_path_factory):
    """``{debug: started 'stratagem train --nproc 2' of a config that fails on every rank}``
    for the ``debug`` values of the session's selected tests, started together: each run is
    mostly single-process start-up (the command, torchrun), so two overlap on CI's 2 cores."""
    wanted = {
        item.callspec.params['debug']
        for item in request.session.items
        if getattr(item, 'module', None) is request.module
        and item.originalname == 'test_nproc_failure_prints_one_message'
    }
    example = Path(__file__).resolve().parents[1] / 'examples' / 'configs' / 'transformer_fsdp.py'
    procs = {}
    for debug in sorted(wanted):
        tmp = tmp_path_factory.mktemp(f'debug{int(debug)}')
        cfg = tmp / 'blok.py'
        cfg.write_text(CFG.format(example=str(example)))
        cmd = [sys.executable, '-m', 'stratagem', 'train', str(cfg), '--nproc', '2']
        cmd += ['--work-dir', str(tmp / 'w')] + (['--debug'] if debug else [])
        procs[debug] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=without_launcher()
        )
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize('debug', [False, True])
def test_nproc_failure_prints_one_message(failed_runs, debug):
    proc = failed_runs[debug]
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1
    if debug:  # as torchrun prints it: every rank, the agent's report
        assert err.count("['Blok'] are not in the model") >= 2 and 'ChildFailedError' in err
        return
    assert err.count("['Blok'] are not in the model") == 1
    assert (
        "stratagem: error (ranks 0, 1): model_wrapper.auto_wrap_policy: module class(es) ['Blok']"
        in err
    )
    assert err.rstrip().endswith('stratagem train: exit status 1')
    for noise in ('Traceback', 'ChildFailedError', 'error_file', 'closing signal'):
        assert noise not in err, noise
