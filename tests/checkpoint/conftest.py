"""Fixtures for the checkpoint tests (files under tmp_path only)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_helpers import make_state  # noqa: E402


@pytest.fixture
def state() -> dict:
    return make_state()
