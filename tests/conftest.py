"""Fixtures for every test: ``clean_env``; the ``scenario`` mark and fixture (scenarios.py)."""

import os

import pytest

from launcher_env import is_launcher_variable
from scenarios import pytest_configure, pytest_itemcollected, scenario  # noqa: F401


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
