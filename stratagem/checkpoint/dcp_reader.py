"""A DCP storage reader that reads the files DCP writes, without one ``torch.load`` per tensor.

DCP's ``FileSystemWriter`` stores each tensor as its own small ``torch.save`` archive inside a
rank's ``.distcp`` file, and its ``FileSystemReader`` reads each back with ``torch.load(...,
weights_only=True)``. That call costs about 0.3 ms per tensor, most of it in the pure-Python
weights-only unpickler: on a 4-layer MLP with AdamW (32 tensors per rank) it is half of the
whole load. ``ShardReader`` reads the same files into the same tensors:

- each archive is opened with torch's own zip reader (``PyTorchFileReader``);
- its ``data.pkl`` is read by a restricted unpickler (C ``pickle``, whose ``find_class`` only
  ever returns recorders of our own, so nothing in the file can run code) that accepts
  exactly the pickle ``torch.save`` writes for one plain tensor: its dtype, storage size,
  offset, shape and stride;
- the tensor is then a view of the bytes read, checked against its record's size, and is
  copied into the target as DCP does.

An item it does not recognise (a byte item, a DCP storage transform, a tensor with hooks or a
subclass, a big-endian archive, anything unexpected) is read by ``FileSystemReader`` itself,
so any directory ``dcp.load`` reads, this reads, with the same result. The format on disk is
DCP's: nothing here writes.

``metadata=`` passes DCP metadata already read (``read_sharded_header`` reads it for its
checks), so a load does not read ``.metadata`` twice.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
import warnings
from typing import Any

import torch

__all__ = ['ShardReader', 'tensor_from_archive']


class _Storage:
    """What the pickle's storage class stands for: just its dtype."""

    __slots__ = ('dtype',)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Recipe:
    """``torch._utils._rebuild_tensor_v2``'s arguments, recorded, never acted on."""

    __slots__ = ('storage', 'offset', 'size', 'stride', 'plain')

    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any,
                 requires_grad: Any = False, hooks: Any = None, *rest: Any) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        # DCP saves detached tensors with no hooks (torch.save writes an empty OrderedDict)
        self.plain = (requires_grad is False and isinstance(hooks, dict) and not hooks and
                      all(isinstance(r, dict) and not r for r in rest))


def _empty_mapping(*args: Any) -> dict:
    if args:
        raise pickle.UnpicklingError('expected an empty OrderedDict')
    return {}


def _storage_dtypes() -> dict[str, torch.dtype]:
    """``{'FloatStorage': torch.float32, ...}``: the typed storage names ``torch.save`` writes."""
    from torch.storage import _dtype_to_storage_type_map
    return {name: dtype for dtype, name in _dtype_to_storage_type_map().items()
            if not name.startswith('Q')}  # quantized tensors are rebuilt another way


_STORAGE_DTYPES = _storage_dtypes()


def _storage_class(name: str) -> _Storage:
    if name not in _STORAGE_DTYPES:
        raise pickle.UnpicklingError(f'not a storage class: torch.{name}')
    return _Storage(_STORAGE_DTYPES[name])


class _TensorUnpickler(pickle.Unpickler):
    """Reads one ``torch.save``-d tensor's ``data.pkl`` into a ``_Recipe``: only
    ``_rebuild_tensor_v2``, a typed storage class and ``OrderedDict`` are known names, and
    each maps to a harmless recorder above."""

    def find_class(self, module: str, name: str) -> Any:
        if module == 'torch._utils' and name == '_rebuild_tensor_v2':
            return _Recipe
        if module == 'collections' and name == 'OrderedDict':
            return _empty_mapping
        if module == 'torch':
            return _storage_class(name)
        raise pickle.UnpicklingError(f'{module}.{name} is not part of a plain tensor')

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == 'storage'
                and isinstance(pid[1], _Storage) and isinstance(pid[2], str)
                and isinstance(pid[4], int)):
            raise pickle.UnpicklingError(f'unexpected storage reference {pid!r}')
        return pid


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def tensor_from_archive(blob: bytes) -> torch.Tensor | None:
    """The tensor ``torch.save`` wrote into ``blob`` (a CPU view of ``blob``'s bytes), or
    None when ``blob`` is anything but one plain little-endian tensor (read it with
    ``torch.load`` then)."""
    try:
        archive = torch._C.PyTorchFileReader(io.BytesIO(blob))
        recipe = _TensorUnpickler(io.BytesIO(archive.get_record('data.pkl'))).load()
    except (RuntimeError, pickle.UnpicklingError, TypeError, ValueError, EOFError,
            AttributeError, IndexError):
        return None
    if not (isinstance(recipe, _Recipe) and recipe.plain and isinstance(recipe.storage, tuple)
            and type(recipe.offset) is int and recipe.offset >= 0
            and _ints(recipe.size) and _ints(recipe.stride)
            and len(recipe.size) == len(recipe.stride)):
        return None
    _, storage, key, _, numel = recipe.storage
    name = f'data/{key}'
    dtype = storage.dtype
    nbytes = numel * dtype.itemsize
    if nbytes == 0:  # nothing to read: an empty tensor of the saved shape, or not ours
        return torch.empty(recipe.size, dtype=dtype) if 0 in recipe.size else None
    if not (archive.has_record('byteorder') and archive.has_record(name)
            and archive.get_record('byteorder') == sys.byteorder.encode()
            and archive.get_record_size(name) == nbytes):
        return None
    extent = recipe.offset + sum((n - 1) * s for n, s in zip(recipe.size, recipe.stride))
    if min(recipe.size, default=1) > 0 and extent >= numel:
        return None
    start = archive.get_record_offset(name)
    if start + nbytes > len(blob):
        return None
    with warnings.catch_warnings():  # a view of read-only bytes: we only ever copy from it
        warnings.simplefilter('ignore', UserWarning)
        flat = torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=start)
    return flat.view(dtype).as_strided(recipe.size, recipe.stride, recipe.offset)


def _reader_base() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader


class ShardReader(_reader_base()):
    """``FileSystemReader`` with a faster read of plain tensors (see the module docstring)
    and, optionally, the metadata already read."""

    def __init__(self, path: str | os.PathLike, *, metadata: Any = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None or kwargs.get('rank') is not None:
            return super().read_metadata(*args, **kwargs)
        metadata, self._metadata = self._metadata, None  # once: a reused reader reads again
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint.planner import LoadItemType
        per_file: dict[str, list] = {}
        others = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                others.append(req)
            else:
                per_file.setdefault(info.relative_path, []).append(req)
        for relative, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            with open(os.path.join(self.path, relative), 'rb') as stream:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    stream.seek(info.offset)
                    blob = stream.read(info.length)
                    if len(blob) != info.length:
                        raise OSError(f'{os.path.join(self.path, relative)} ends at byte '
                                      f'{info.offset + len(blob)}: {req.storage_index.fqn} '
                                      f'needs bytes {info.offset}-{info.offset + info.length}')
                    tensor = tensor_from_archive(blob)
                    if tensor is None:
                        others.append(req)
                        continue
                    for dim, (start, length) in enumerate(zip(req.storage_offsets,
                                                              req.lengths)):
                        if start or length != tensor.size(dim):  # the part this rank reads
                            tensor = tensor.narrow(dim, start, length)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise ValueError(f'{req.storage_index.fqn} in {relative}: the '
                                         f'checkpoint holds {tuple(tensor.size())} where '
                                         f'{tuple(target.size())} is read')
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        if others:
            return super().read_data(dataclasses.replace(plan, items=others), planner)
        from torch.futures import Future
        done: Future = Future()
        done.set_result(None)
        return done
