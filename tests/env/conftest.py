"""Fixtures for tests of stratagem.env."""

import os
import re

import pytest

_LAUNCHER_VAR = re.compile(
    r'^(SLURM_|OMPI_|PMI_|MV2_|MPI_LOCAL|TORCHELASTIC_)|'
    r'^(RANK|WORLD_SIZE|LOCAL_RANK|'
    r'LOCAL_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|GROUP_RANK)$'
)


@pytest.fixture
def clean_env():
    """No launcher variables during the test; the whole environment restored afterwards.

    A full snapshot, not monkeypatch.delenv: init_dist sets variables that were absent,
    and monkeypatch only restores the ones it touched.
    """
    saved = dict(os.environ)
    for key in [k for k in os.environ if _LAUNCHER_VAR.search(k)]:
        del os.environ[key]
    try:
        yield os.environ
    finally:
        os.environ.clear()
        os.environ.update(saved)
