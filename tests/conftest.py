"""Fixtures for every test: ``clean_env``; the ``scenario`` mark and fixture (scenarios.py)."""

import logging
import os

import pytest

from launcher_env import is_launcher_variable
from scenarios import pytest_configure, pytest_itemcollected, scenario  # noqa: F401


@pytest.fixture(autouse=True)
def _stratagem_log_level():
    """The 'stratagem' logger's level as it was: a run whose config sets ``log_level`` (kept
    for the process, as ``get_logger`` documents) must not silence the next test's logs."""
    logger = logging.getLogger('stratagem')
    level, chosen = logger.level, getattr(logger, '_stratagem_level_set', None)
    yield
    logger.setLevel(level)
    if chosen is None:
        logger.__dict__.pop('_stratagem_level_set', None)
    else:
        logger._stratagem_level_set = chosen


@pytest.fixture
def clean_env():
    """No launcher variables during the test; the whole environment restored afterwards.

    A full snapshot, not monkeypatch.delenv: init_dist sets variables that were absent,
    and monkeypatch only restores the ones it touched.
    """
    saved = dict(os.environ)
    for key in [k for k in os.environ if is_launcher_variable(k)]:
        del os.environ[key]
    try:
        yield os.environ
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope='session')
def uninterrupted_run(tmp_path_factory):
    """``(config, final state)`` of one uninterrupted ``stratagem train --nproc 2`` run of
    failure_helpers' CONFIG: the reference that the failure, lock and signal tests compare
    their interrupted runs with, and test_ddp's check of a ``--nproc 2`` launch, made once
    per session (it releases its work_dir lock; its work_dir: ``config.parent / 'work'``)."""
    from failure_helpers import final_state, finish, start, write_config
    from stratagem.env.workdir_lock import LOCK_NAME

    tmp = tmp_path_factory.mktemp('reference')
    cfg = write_config(tmp)
    code, out = finish(start(cfg, tmp / 'work', '--nproc', '2'))
    assert code == 0, out[-4000:]
    assert not (tmp / 'work' / LOCK_NAME).exists()  # released at the end
    return cfg, final_state(tmp / 'work')
