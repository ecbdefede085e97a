import io

import pytest
import torch


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture
def weights_only_roundtrip():
    """Save and load with torch.load(weights_only=True), as checkpoints are loaded."""
    return _roundtrip
