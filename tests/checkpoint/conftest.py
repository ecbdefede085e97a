"""Fixtures for the checkpoint tests (files under tmp_path only)."""

import pytest

from ckpt_helpers import make_state


@pytest.fixture
def state() -> dict:
    return make_state()
