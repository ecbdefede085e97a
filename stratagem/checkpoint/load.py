"""Loading one checkpoint file: verify the bytes, then ``torch.load(weights_only=True)``.

1. The file must exist (``FileNotFoundError`` naming it).
2. If a manifest covers it, check size and digest (xxh3_128, or sha256 for older manifests)
   before anything is unpickled, hashing through a memory map of the file
   (``CheckpointCorruptError``). Without one, warn ``UnverifiedCheckpointWarning`` and go on:
   mmengine and plain ``torch.save`` checkpoints load as before.
3. Check the first bytes: a zip archive (torch >= 1.6) or a pickle stream (legacy format);
   anything else is ``NotACheckpointError``.
4. ``torch.load(weights_only=True)``, memory-mapped for zip files (the bytes were just read to
   hash them, so mapping them is cheaper than copying them again). A refusal by the
   weights-only unpickler becomes ``UnsafeCheckpointError`` naming the globals (when the
   manifest lists them as allow-listed at save, the error says which import or
   ``add_safe_globals`` call this process lacks); ``trust_pickled_code=True`` loads with
   ``weights_only=False`` instead.
"""

from __future__ import annotations

import errno
import importlib.util
import io
import os
import pickle
import re
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from .content import SAFE_GLOBALS_KEY, get_safe_globals
from .errors import (
    CheckpointCorruptError,
    NotACheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)
from .location import is_url
from .manifest import DIR_MANIFEST, find_manifest, read_manifest, verify_checkpoint, verify_file

_ZIP_MAGIC = b'PK\x03\x04'
_PICKLE_PROTO = 0x80
_GLOBAL_RE = re.compile(r'GLOBAL (\S+)')
_READ_ERROR_RE = re.compile(
    r'PytorchStreamReader|zip archive|central directory|magic number|'
    r'load key|EOF',
    re.I,
)
_DEVICE_ERROR_RE = re.compile(r'cuda|device|map_location|out of memory', re.I)
_FUNC_RE = re.compile(r'unrecognized function (.+?)(?: which belongs|$)', re.M)
# top-level package -> the stratagem module that allow-lists what it stores in checkpoints
_INTEGRATIONS = {
    'mmengine': 'stratagem.integrations.mmengine',
    'numpy': 'stratagem.integrations.mmengine',
}


def load_checkpoint_file(
    filename: str | os.PathLike,
    map_location: Any = 'cpu',
    *,
    verify: bool = True,
    trust_pickled_code: bool = False,
    mmap: bool | None = None,
) -> Any:
    """Load a checkpoint file safely; see the module docstring for the sequence.

    Args:
        filename: a single-file checkpoint, or one file inside a directory checkpoint (it is
            checked against that directory's manifest entry); or an fsspec URL of a file
            (``location.load_file``: read once, verified, loaded from memory).
        map_location: anything ``torch.load`` accepts (str, ``torch.device``, dict, callable,
            None). Default ``'cpu'``.
        verify: check size and digest against the manifest (default True). With False only the
            size is checked (free) and a missing manifest is not reported.
        trust_pickled_code: unpickle with ``weights_only=False``, which can run arbitrary code
            from the file. Only for files you trust; default False.
        mmap: memory-map tensor storages (zip files only). None (default) maps whenever the
            file is a zip archive. Mapped tensors are copy-on-write views of the file.

    Returns:
        What was saved, usually a dict.
    """
    if type(trust_pickled_code) is not bool:  # 'false' from a config must not mean True
        raise TypeError(f'trust_pickled_code must be True or False, got {trust_pickled_code!r}')
    if is_url(os.fspath(filename)):  # read from its store, verified (location.py)
        from .location import load_file

        return load_file(os.fspath(filename), map_location, trust_pickled_code=trust_pickled_code)
    path = Path(os.fspath(filename)).absolute()
    if not path.exists():
        raise FileNotFoundError(f'checkpoint not found: {path}')
    if path.is_dir():
        if _our_directory(path):  # a file it lists is gone: say which, not 'a directory'
            verify_checkpoint(path, hash_bytes=False)
        raise IsADirectoryError(_directory_message(path))
    _verify_before_load(path, verify)
    is_zip = _sniff(path)
    use_mmap = is_zip if mmap is None else bool(mmap and is_zip)
    return _torch_load(path, map_location, trust_pickled_code, use_mmap, is_zip)


def _our_directory(path: Path) -> bool:
    """True if ``path`` holds a stratagem directory manifest (not a project's manifest.json)."""
    try:
        return read_manifest(path / DIR_MANIFEST) is not None
    except CheckpointCorruptError:
        return False


def _directory_message(path: Path) -> str:
    """Why a directory cannot be loaded as one file, and what to pass instead."""
    from .latest import POINTER_NAME, list_checkpoints, read_pointer

    if (path / DIR_MANIFEST).is_file():
        return (
            f'{path} is a directory checkpoint; verify it with verify_checkpoint() and '
            'load its files one by one'
        )
    try:
        pointed = read_pointer(path)
    except (ValueError, OSError):
        pointed = None
    newest = list_checkpoints(path)
    example = (
        pointed
        if pointed is not None and pointed.exists()
        else (newest[0].path if newest else None)
    )
    if example is None and not (path / POINTER_NAME).exists():
        return (
            f'{path} is a directory, not a checkpoint file, and holds no checkpoint; '
            'give the path of a .pth file'
        )
    return (
        f'{path} is a work directory, not a checkpoint file. Give a checkpoint file'
        + (f' (e.g. {example})' if example else '')
        + '; to resume the newest checkpoint '
        f'of this work dir, resume without a path: --work-dir {path} --resume on the '
        f'command line, resume=True with work_dir={str(path)!r} in the API'
    )


def _verify_before_load(path: Path, verify: bool) -> None:
    found = find_manifest(path)
    if found is None:
        if verify:  # every rank loads the same file: warn once
            from stratagem import env  # imported on use: see checkpoint/__init__.py

            env.warn_rank_zero(
                f'{path} has no stratagem manifest (written by mmengine or plain '
                f'torch.save?), so its integrity cannot be verified; loading it '
                'anyway',
                UnverifiedCheckpointWarning,
                stacklevel=3,
            )
        return
    manifest, entry, mfile = found
    try:
        verify_file(path, entry, mfile, hash_bytes=verify)
    except CheckpointCorruptError:
        old = manifest.get('replaces')  # a same-name save died before its rename
        if not (isinstance(old, dict) and old.get('files')):
            raise
        verify_file(path, old['files'][0], mfile, hash_bytes=verify)


def _sniff(path: Path) -> bool:
    """True for a zip checkpoint, False for a legacy pickle one; raise if neither."""
    with open(path, 'rb') as file:
        head = file.read(4)
    return _sniff_bytes(head, path)


def _sniff_bytes(head: bytes, path: Path | str) -> bool:
    """``_sniff`` of a file's first 4 bytes ``head``."""
    if head == _ZIP_MAGIC:
        return True
    if head[:1] and head[0] == _PICKLE_PROTO:
        return False
    raise NotACheckpointError(
        f'{path} is not a PyTorch checkpoint: it starts with {head!r}, not a zip archive '
        f'(torch.save) or a pickle stream. Is it a text file, a log, or a partial download?'
    )


def _torch_load(
    path: Path | str,
    map_location: Any,
    trust: bool,
    mmap: bool,
    is_zip: bool,
    source: io.BufferedReader[Any] | str | None = None,
) -> Any:
    """``torch.load`` of ``path`` (or of ``source``, the verified bytes of ``path`` read from
    a store: ``location.py``; a str names the memory they were read into), its errors named
    as the module docstring says."""
    try:
        return torch.load(
            path if source is None else source,
            map_location=map_location,
            weights_only=not trust,
            mmap=mmap,
        )
    except pickle.UnpicklingError as err:
        message = str(err)
        if 'Weights only load failed' not in message:
            raise NotACheckpointError(
                f'{path} is not a readable PyTorch checkpoint: {_last_line(message)}'
            ) from err
        names = tuple(dict.fromkeys(_GLOBAL_RE.findall(message) + _FUNC_RE.findall(message)))
        absent = sorted({n.split('.')[0] for n in names if not _package_installed(n)})
        if absent:  # e.g. an mmengine checkpoint read where mmengine is not installed
            ours = [n for n in names if n.split('.')[0] in _INTEGRATIONS]
            raise UnsafeCheckpointError(
                f'cannot load {path}: it holds {", ".join(names)}, and package(s) '
                f'{", ".join(absent)} are not installed here (were the name no package at '
                f'all, the file would be damaged); nothing was loaded. Install '
                f'{", ".join(absent)}' + (f'; then {_allow_hint(ours)}' if ours else '.'),
                names,
            ) from None
        missing = [n for n in names if not _importable(n)]
        if missing:  # a flipped byte in a global's name, not a hostile file
            raise CheckpointCorruptError(
                f'{path} is damaged: it references {", ".join(missing)}, which does not '
                'exist (or the file comes from another version of its package); it was not '
                'loaded'
            ) from None
        lacking = _allow_listed_when_saved(path, names)
        if lacking:
            raise UnsafeCheckpointError(
                f'cannot load {path} in this process yet: it holds {", ".join(lacking)}, '
                f'allow-listed by the process that saved it (its manifest lists '
                f'{SAFE_GLOBALS_KEY}) but not here. {_allow_hint(lacking)}',
                names,
            ) from None
        what = (
            f'references {", ".join(names)}'
            if names
            else f'uses pickle features the safe loader refuses ({_last_line(message)})'
        )
        raise UnsafeCheckpointError(
            f'refusing to load {path}: it {what}, which torch.load(weights_only=True) does not '
            f'allow because unpickling it can run code. Load it with trust_pickled_code=True '
            f'only if you trust its source, or allow-list a class you trust with '
            f'stratagem.checkpoint.add_safe_globals([...]).',
            names,
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        if (
            isinstance(err, RuntimeError)
            and _DEVICE_ERROR_RE.search(str(err))
            and not _READ_ERROR_RE.search(str(err))
        ):
            raise  # e.g. a map_location to a device this machine lacks: not about the file
        if isinstance(err, OSError) and err.errno != errno.EINVAL:
            raise  # a real I/O error (permissions, EIO); a truncated zip gives EINVAL (seek)
        # a str source: the file the bytes were read into (location.py's memory file)
        where = source if isinstance(source, str) else path
        held = None if isinstance(source, str) else source
        if is_zip and not _has_zip_end(where, held):
            size = os.stat(where).st_size if held is None else len(_buffer(held))
            raise CheckpointCorruptError(
                f'{path} is truncated: it is {size} bytes and lacks the '
                'end-of-archive record every complete torch.save file ends with (an '
                'interrupted copy, download or save). Copy it again, or use an earlier '
                'checkpoint'
            ) from err
        kind = (
            'looks like a zip checkpoint but is damaged or truncated'
            if is_zip
            else 'is not a readable PyTorch checkpoint'
        )
        error = CheckpointCorruptError if is_zip else NotACheckpointError
        raise error(f'{path} {kind}: {_last_line(str(err))}') from err
    except (
        UnicodeDecodeError,
        struct.error,
        IndexError,
        KeyError,
        AssertionError,
        ValueError,
        TypeError,
        AttributeError,
        MemoryError,
        OverflowError,
    ) as err:
        # what a damaged pickle stream makes the unpickler raise: always name the file
        raise CheckpointCorruptError(
            f'{path} is damaged or not a PyTorch checkpoint: '
            f'{type(err).__name__}: {_last_line(str(err))}'
        ) from err


def _allow_listed_when_saved(path: Path | str, refused: tuple[str, ...]) -> list[str]:
    """The manifest's allow-listed globals that this process lacks (the refused ones first)."""
    if not isinstance(path, Path):  # a URL's manifest was read with its bytes: not kept
        return []
    try:
        found = find_manifest(path)
    except (OSError, ValueError):
        return []
    held = found[0].get(SAFE_GLOBALS_KEY) if found else None
    if not isinstance(held, list) or not all(isinstance(n, str) for n in held):
        return []
    allowed = set(get_safe_globals())
    lacking = [n for n in held if n not in allowed]
    if refused and not set(refused) & set(lacking):
        return []  # refused for a global nobody allow-listed: not a missing import
    return sorted(lacking, key=lambda n: (n not in refused, n))


def _allow_hint(names: list[str]) -> str:
    """Which import allow-lists ``names`` (an integration we ship), else the generic call."""
    imports = sorted(
        {_INTEGRATIONS[n.split('.')[0]] for n in names if n.split('.')[0] in _INTEGRATIONS}
    )
    call = (
        f'stratagem.checkpoint.add_safe_globals([...]) with '
        f'{", ".join(n.rsplit(".", 1)[-1] for n in names)}'
    )
    if imports:
        return f'Fix: import {" and ".join(imports)} before loading, or call {call}.'
    return f'Fix: call {call} (the classes you trust) before loading.'


def _has_zip_end(path: Path | str, source: io.BufferedReader[Any] | None = None) -> bool:
    """Whether the file's tail holds a zip end-of-central-directory record (a complete
    archive has one within its last 64 KiB + 22 bytes)."""
    if source is not None:
        return b'PK\x05\x06' in _buffer(source)[-(1 << 16) - 22 :].tobytes()
    with open(path, 'rb') as file:
        file.seek(max(0, os.stat(path).st_size - (1 << 16) - 22))
        return b'PK\x05\x06' in file.read()


def _buffer(source: io.BufferedReader[Any]) -> memoryview:
    """The whole content behind ``source`` (``location._BufferReader``'s bytes)."""
    return source.raw.getbuffer()


def _package_installed(dotted: str) -> bool:
    """Whether the top-level package of ``module.attr`` is loaded or installed (nothing
    the file names is imported)."""
    top = dotted.split('.')[0]
    if not top or top in sys.modules:
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return True  # cannot tell: let _importable decide


def _importable(dotted: str) -> bool:
    """Whether ``module.attr`` could name something real, without importing anything the
    file names (an import runs code): a loaded module must have the attribute; otherwise
    the top-level package must be installed."""
    module, _, attr = dotted.rpartition('.')
    if not module or not attr:
        return False
    loaded = sys.modules.get(module)
    if loaded is not None:
        return hasattr(loaded, attr)
    try:
        return importlib.util.find_spec(module.split('.')[0]) is not None
    except (ImportError, ValueError):
        return False


def _last_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith('Check the documentation')]
    return (useful or lines or [''])[-1][:300]
