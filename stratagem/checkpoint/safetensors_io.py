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
from .errors import CheckpointCorruptError

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
    """(tensors, metadata) of a safetensors file; raises ``CheckpointCorruptError`` (a
    ``ValueError``) naming the file when it is not one: a header size past the file's end,
    a header that is no JSON object of well-formed entries (a known dtype, a shape of
    non-negative integers, offsets whose span is exactly the shape's bytes), offsets that
    overlap, leave gaps or run past the end. Every claim is checked against the file's size
    before a tensor is made, so a header claiming huge tensors allocates nothing."""
    path = Path(path)
    with open(path, 'rb') as file:
        size = os.fstat(file.fileno()).st_size
        head = file.read(8)
        if len(head) < 8:
            raise CheckpointCorruptError(
                f'{path}: not a safetensors file (shorter than its 8-byte header size)'
            )
        (n,) = struct.unpack('<Q', head)
        if n > size - 8:
            raise CheckpointCorruptError(
                f'{path}: not a safetensors file (header size {n} > file size {size})'
            )
        raw = file.read(n)
        try:
            header = json.loads(raw)
        except ValueError as err:  # UnicodeDecodeError included
            raise CheckpointCorruptError(
                f'{path}: not a safetensors file (header is not JSON: {err})'
            ) from None
        if not isinstance(header, dict):
            raise CheckpointCorruptError(
                f'{path}: not a safetensors file (header is a {type(header).__name__}, '
                'not a JSON object)'
            )
        metadata = header.pop('__metadata__', None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise CheckpointCorruptError(
                f'{path}: "__metadata__" must map strings to strings, got {metadata!r:.200}'
            )
        body_size = size - 8 - n
        entries = [(name, _entry(path, name, info, body_size)) for name, info in header.items()]
        entries.sort(key=lambda e: e[1][2])
        end = 0
        for name, (_, _, begin, stop) in entries:
            if begin != end:
                raise CheckpointCorruptError(
                    f'{path}: tensor {name!r} starts at byte {begin} of the data, expected '
                    f'{end} (offsets overlap or leave a gap)'
                )
            end = stop
        if end != body_size:
            raise CheckpointCorruptError(f'{path}: {body_size - end} bytes after the last tensor')
        body = bytearray(file.read(body_size))
    if len(body) != body_size:
        raise CheckpointCorruptError(f'{path}: changed while it was read')
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, begin, stop) in entries:
        if stop == begin:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            raw_bytes = torch.frombuffer(body, dtype=torch.uint8, offset=begin, count=stop - begin)
            out[name] = raw_bytes.clone().view(dtype).reshape(shape)
    return out, metadata


def _entry(path: Path, name: str, info: object, body_size: int) -> tuple:
    """(dtype, shape, begin, end) of one header entry, checked against the data's size."""
    bad = f'{path}: tensor {name!r} has a bad entry {info!r:.200}'
    if not isinstance(info, dict):
        raise CheckpointCorruptError(bad)
    name_of_dtype = info.get('dtype')
    dtype = _NAMES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
    shape, offsets = info.get('shape'), info.get('data_offsets')
    if (
        dtype is None
        or not isinstance(shape, list)
        or not all(type(d) is int and d >= 0 for d in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
    ):
        raise CheckpointCorruptError(bad + f' (dtypes: {", ".join(_NAMES)})')
    begin, stop = offsets
    if not 0 <= begin <= stop <= body_size:
        raise CheckpointCorruptError(f'{bad}: the data is {body_size} bytes')
    numel = 1
    for d in shape:
        numel *= d
    if numel * torch.empty((), dtype=dtype).element_size() != stop - begin:
        raise CheckpointCorruptError(f'{bad}: its shape needs another number of bytes')
    return dtype, shape, begin, stop
