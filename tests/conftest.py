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


@pytest.fixture(scope='session')
def s3_server():
    """A local S3 server (``moto_server``, tests/s3_server.py) for the whole session; it
    checks credentials (a wrong key is refused, as on AWS). Skips when moto is absent."""
    pytest.importorskip('s3fs')
    from s3_server import S3Server, moto_server_command

    if moto_server_command() is None:
        pytest.skip('moto_server is not installed (the test extra: moto[server])')
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket on the session's S3 server, and this test's environment pointing at it
    the way a user's does (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...); the bucket's
    URL, ``s3://<bucket>``."""
    import secrets

    import s3fs

    for key in (
        'AWS_PROFILE',
        'AWS_SESSION_TOKEN',
        'AWS_CONFIG_FILE',
        'AWS_SHARED_CREDENTIALS_FILE',
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    bucket = f'ckpt-{secrets.token_hex(4)}'
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    return f's3://{bucket}'
