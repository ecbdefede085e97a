"""Our safetensors writer and reader: round trips for every dtype and shape, the reference
reader (the ``safetensors`` package) reads what we write, and bad files are refused naming
the file."""

from __future__ import annotations

import struct

import pytest
import torch

from stratagem.checkpoint.safetensors_io import load_safetensors, save_safetensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        'w': torch.randn(3, 5, generator=g),
        'wt': torch.randn(5, 3, generator=g).t(),  # not contiguous
        'd': torch.randn(4, generator=g, dtype=torch.float64),
        'h': torch.randn(2, 2, generator=g).half(),
        'b': torch.randn(7, generator=g).bfloat16(),
        'i': torch.arange(6, dtype=torch.int64).reshape(2, 3),
        'u': torch.arange(5, dtype=torch.uint8),
        'flag': torch.tensor([True, False, True]),
        'scalar': torch.tensor(2.5),
        'empty': torch.zeros(0, 4),
    }


def test_round_trip_bit_exact(tmp_path):
    tensors = _tensors()
    path = save_safetensors(tensors, tmp_path / 'm.safetensors', metadata={'format': 'pt'})
    back, meta = load_safetensors(path)
    assert meta == {'format': 'pt'}
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k], t), k
    (n,) = struct.unpack('<Q', path.read_bytes()[:8])
    assert n % 8 == 0  # the header is padded to 8 bytes
    assert [p.name for p in tmp_path.iterdir()] == ['m.safetensors']  # no temp file left


def test_reference_reader_agrees(tmp_path):
    official = pytest.importorskip('safetensors.torch')
    tensors = _tensors()
    path = save_safetensors(tensors, tmp_path / 'm.safetensors', metadata={'a': 'b'})
    theirs = official.load_file(str(path))
    assert all(torch.equal(theirs[k], t) for k, t in tensors.items())
    # and we read what the reference writer wrote
    official.save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp_path / 'o'))
    ours, _ = load_safetensors(tmp_path / 'o')
    assert all(torch.equal(ours[k], t) for k, t in tensors.items())


def test_refusals(tmp_path):
    with pytest.raises(TypeError, match='metadata values must be strings'):
        save_safetensors({'w': torch.ones(1)}, tmp_path / 'x', metadata={'iter': 3})
    with pytest.raises(TypeError, match='w: list is not a plain tensor'):
        save_safetensors({'w': [1.0]}, tmp_path / 'x')
    assert not (tmp_path / 'x').exists()
    bad = tmp_path / 'bad.safetensors'
    bad.write_bytes(b'\x01')
    with pytest.raises(ValueError, match='bad.safetensors: not a safetensors file'):
        load_safetensors(bad)
    good = save_safetensors({'w': torch.ones(4)}, tmp_path / 'g.safetensors')
    bad.write_bytes(good.read_bytes()[:-3])  # truncated
    with pytest.raises(ValueError, match="tensor 'w' has a bad entry"):
        load_safetensors(bad)
