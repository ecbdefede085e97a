"""Model weights as one safetensors file, written and read without the ``safetensors`` package.

The format (huggingface/safetensors, documented in its README): an 8-byte little-endian
header length ``N``; ``N`` bytes of UTF-8 JSON mapping each tensor name to ``dtype``,
``shape`` and ``data_offsets`` (begin, end: bytes into the data that follows) plus an optional
``"__metadata__"`` map of strings to strings, padded with spaces to a multiple of 8; then the
tensors' bytes, little-endian, C order, back to back with no gaps. The file is written under a
temporary name, flushed, fsynced and renamed: it exists whole or not at all.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from ._fs import fsync_dir, fsync_file, temp_name

__all__ = ['save_safetensors', 'load_safetensors']

_DTYPES = {
    torch.float64: 'F64',
    torch.float32: 'F32',
    torch.float16: 'F16',
    torch.bfloat16: 'BF16',
    torch.int64: 'I64',
    torch.int32: 'I32',
    torch.int16: 'I16',
    torch.int8: 'I8',
    torch.uint8: 'U8',
    torch.bool: 'BOOL',
    torch.float8_e4m3fn: 'F8_E4M3',
    torch.float8_e5m2: 'F8_E5M2',
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _raw(t: torch.Tensor) -> bytes:
    flat = t.detach().to('cpu').contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b''


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``tensors`` (name → tensor, any device; DTensors must be gathered first) to
    ``path`` atomically; ``metadata`` values must be strings. Returns the path."""
    path = Path(path).absolute()
    header: dict = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(v, str)}
        if bad:
            raise TypeError(f'safetensors metadata values must be strings, got {bad!r}')
        header['__metadata__'] = dict(metadata)
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
            raise TypeError(
                f'{name}: {type(t).__name__} is not a plain tensor; gather sharded tensors '
                '(DTensor.full_tensor()) before writing safetensors'
            )
        if t.dtype not in _DTYPES:
            raise TypeError(f'{name}: dtype {t.dtype} has no safetensors name')
        size = t.numel() * t.element_size()
        header[name] = {
            'dtype': _DTYPES[t.dtype],
            'shape': list(t.shape),
            'data_offsets': [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(',', ':')).encode()
    blob += b' ' * (-len(blob) % 8)
    tmp = temp_name(path)
    try:
        with open(tmp, 'wb') as f:
            f.write(struct.pack('<Q', len(blob)))
            f.write(blob)
            for name in sorted(tensors):
                f.write(_raw(tensors[name]))
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; raises ``ValueError`` naming the file when it
    is not one (a bad header, offsets that overlap, leave gaps or run past the end)."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f'{path}: not a safetensors file (shorter than its 8-byte header size)')
    (n,) = struct.unpack('<Q', data[:8])
    if n > len(data) - 8:
        raise ValueError(f'{path}: not a safetensors file (header size {n} > file size)')
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as err:
        raise ValueError(f'{path}: not a safetensors file (header is not JSON: {err})') from None
    metadata = header.pop('__metadata__', None) or {}
    body = memoryview(data)[8 + n :]
    out: dict[str, torch.Tensor] = {}
    end = 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]['data_offsets'][0]):
        begin, stop = info['data_offsets']
        if begin != end or stop > len(body) or info['dtype'] not in _NAMES:
            raise ValueError(f'{path}: tensor {name!r} has a bad entry {info!r}')
        dtype = _NAMES[info['dtype']]
        if stop == begin:
            out[name] = torch.empty(info['shape'], dtype=dtype)
        else:
            raw = torch.frombuffer(bytearray(body[begin:stop]), dtype=torch.uint8)
            out[name] = raw.view(dtype).reshape(info['shape'])
        end = stop
    if end != len(body):
        raise ValueError(f'{path}: {len(body) - end} bytes after the last tensor')
    return out, metadata
