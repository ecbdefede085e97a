"""Manifests: what a committed checkpoint holds, and how to check its bytes before unpickling.

Where a manifest lives:
- a single-file checkpoint ``DIR/NAME`` has a sidecar ``DIR/NAME.manifest.json``; the
  checkpoint itself stays a plain ``torch.save`` file any tool can read;
- a directory checkpoint ``DIR/NAME/`` holds ``DIR/NAME/manifest.json``.

A manifest is a JSON object::

    {"format": "stratagem-checkpoint", "format_version": 1, "kind": "file" | "directory",
     "name": "epoch_3.pth", "step": 3 | null, "created": "2025-01-01T00:00:00Z",
     "created_unix": 1735689600.0, "stratagem_version": "...", "torch_version": "...",
     "python_version": "3.11.9",
     "files": [{"path": "epoch_3.pth", "size": 123, "xxh3_128": "..."}],
     ...extra_manifest keys (e.g. "world_size", "strategy")}

Each ``files`` entry carries one digest, ``xxh3_128`` or ``sha256``: the algorithms, and hashing
a file or the bytes on their way to disk, are ``digest.py``'s. This module
owns the manifest file itself: where it lives, building, reading and checking it, and verifying
a checkpoint's files against it (``verify_file``, which keeps the verified-file cache).

``files[*].path`` is relative to the checkpoint's parent directory for a file checkpoint and
relative to the checkpoint directory for a directory checkpoint. While a single-file checkpoint
replaces one of the same name, its manifest also carries ``"replaces": <the old manifest>`` so
the old file still verifies if the process dies between the manifest and the file rename.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import OrderedDict
from pathlib import Path

import torch

from ..version import __version__
from .digest import HASH_ALGO, HASH_ALGOS, entry_digest, hash_file
from .errors import CheckpointCorruptError


class ManifestOrder:
    """A found checkpoint's place in its run, from its manifest (``self.manifest``): its
    ``step`` and creation time, and ``sort_key`` (newest last; a checkpoint with no step
    before any with one). Shared by the scans of a directory and of a URL."""

    manifest: dict

    @property
    def step(self) -> int | None:
        return self.manifest.get('step')

    @property
    def created(self) -> float:
        return float(self.manifest.get('created_unix') or 0.0)

    def sort_key(self) -> tuple:
        step = self.step
        return (-float('inf') if step is None else step, self.created)


FORMAT = 'stratagem-checkpoint'
FORMAT_VERSION = 2
SIDECAR_SUFFIX = '.manifest.json'
DIR_MANIFEST = 'manifest.json'
RESERVED_KEYS = frozenset(
    (
        'format',
        'format_version',
        'kind',
        'name',
        'step',
        'created',
        'created_unix',
        'stratagem_version',
        'torch_version',
        'python_version',
        'files',
        'replaces',
    )
)


def manifest_path(checkpoint: Path) -> Path:
    """Where the manifest of ``checkpoint`` lives (it may not exist)."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir():
        return checkpoint / DIR_MANIFEST
    return checkpoint.with_name(checkpoint.name + SIDECAR_SUFFIX)


def build_manifest(
    kind: str, name: str, files: list[dict], step: int | None, extra: dict | None
) -> dict:
    now = time.time()
    manifest = {
        'format': FORMAT,
        'format_version': FORMAT_VERSION,
        'kind': kind,
        'name': name,
        'step': step,
        'created': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now)),
        'created_unix': now,
        'stratagem_version': __version__,
        'torch_version': torch.__version__,
        'python_version': platform.python_version(),
        'files': files,
    }
    manifest.update(extra or {})
    return manifest


def check_extra_manifest(extra: dict | None) -> None:
    """Precondition for ``extra_manifest``: str keys, not reserved, JSON-serialisable."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise TypeError(f'extra_manifest must be a dict or None, got {type(extra).__name__}')
    clash = sorted(k for k in extra if k in RESERVED_KEYS)
    if clash:
        raise ValueError(
            f'extra_manifest keys {clash} are reserved by the manifest; '
            f'reserved: {sorted(RESERVED_KEYS)}'
        )
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f'extra_manifest must be JSON-serialisable (str keys, plain values): {err}'
        ) from None


def dump_manifest(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=False) + '\n').encode()


def read_manifest(path: Path) -> dict | None:
    """The manifest at ``path``; None if absent. Raises CheckpointCorruptError if unreadable."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    return parse_manifest(raw, path)


def parse_manifest(raw: bytes, path: str | os.PathLike) -> dict:
    """The manifest in ``raw`` (the bytes of the manifest file ``path``, named in errors).
    Raises CheckpointCorruptError if it is not one."""
    try:
        manifest = json.loads(raw)
    except ValueError as err:
        raise CheckpointCorruptError(
            f'manifest {path} is not valid JSON ({err}); '
            f'the checkpoint it describes cannot be verified'
        ) from None
    if not isinstance(manifest, dict) or manifest.get('format') != FORMAT:
        raise CheckpointCorruptError(
            f'{path} is not a stratagem manifest (expected "format": "{FORMAT}")'
        )
    if not isinstance(manifest.get('files'), list) or not all(
        isinstance(f, dict)
        and {'path', 'size'} <= f.keys()
        and any(isinstance(f.get(a), str) for a in HASH_ALGOS)
        for f in manifest['files']
    ):
        raise CheckpointCorruptError(
            f'manifest {path} has no valid "files" list (each entry '
            f'needs "path", "size" and one of {list(HASH_ALGOS)})'
        )
    return manifest


# in place (a save renames a new inode over it), so this identity changing means the content may
# have changed; it lets `find_latest_checkpoint` + `load_checkpoint_file` hash a file once.
_VERIFIED: OrderedDict[tuple, str] = OrderedDict()
_VERIFIED_MAX = 32


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def remember_verified(
    path: Path, digest: str, identity: tuple | None = None, algo: str = HASH_ALGO
) -> None:
    """Record that ``path`` (or the file whose ``_identity`` is ``identity``) hashes to
    ``digest`` with ``algo``. A writer passes the identity of its temp file taken before the
    rename (a rename keeps it), so a concurrent writer's file can never be recorded under our
    hash."""
    identity = _identity(path) if identity is None else identity
    _VERIFIED[identity] = f'{algo}:{digest}'
    _VERIFIED.move_to_end(identity)
    while len(_VERIFIED) > _VERIFIED_MAX:
        _VERIFIED.popitem(last=False)


def forget_verified() -> None:
    """Forget every file this process verified or wrote: the next verification hashes every
    byte again, as a new process does (a cold load, measured by the benchmarks)."""
    _VERIFIED.clear()


def verify_file(path: Path, entry: dict, manifest_file: Path, *, hash_bytes: bool = True) -> None:
    """Check ``path`` against one ``files`` entry; raise CheckpointCorruptError naming both."""
    try:
        identity = _identity(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f'checkpoint file {path} listed in {manifest_file} is missing'
        ) from None
    size = identity[2]
    if size != entry['size']:
        raise CheckpointCorruptError(
            f'checkpoint {path} is damaged: size is {size} bytes, its manifest {manifest_file} '
            f'says {entry["size"]} (truncated or overwritten); it was not loaded'
        )
    algo, expected = entry_digest(entry)
    if not hash_bytes or _VERIFIED.get(identity) == f'{algo}:{expected}':
        return
    _, actual = hash_file(path, algo=algo)
    if actual != expected:
        raise CheckpointCorruptError(
            f'checkpoint {path} is damaged: {algo} is {actual}, its manifest {manifest_file} '
            f'says {expected}; it was not loaded'
        )
    remember_verified(path, actual, identity, algo)


def find_manifest(path: Path) -> tuple[dict, dict, Path] | None:
    """(manifest, the entry for ``path``, manifest file) that covers the file ``path``; None
    if no manifest does (a foreign checkpoint). Looks at the sidecar, then at the manifest of a
    directory checkpoint up to three levels above (a shard inside a sharded checkpoint)."""
    path = Path(path).absolute()
    sidecar = path.with_name(path.name + SIDECAR_SUFFIX)
    manifest = read_manifest(sidecar)
    if manifest is not None:
        entry = next((f for f in manifest['files'] if f['path'] == path.name), None)
        if entry is None:
            raise CheckpointCorruptError(f'manifest {sidecar} does not list {path.name}')
        return manifest, entry, sidecar
    for parent in list(path.parents)[:3]:
        try:
            manifest = read_manifest(parent / DIR_MANIFEST)
        except CheckpointCorruptError:
            continue  # someone else's manifest.json (a project file): not ours, not a shard's
        if manifest is not None and manifest.get('kind') == 'directory':
            rel = path.relative_to(parent).as_posix()
            entry = next((f for f in manifest['files'] if f['path'] == rel), None)
            if entry is not None:
                return manifest, entry, parent / DIR_MANIFEST
    return None


def verify_checkpoint(checkpoint: str | os.PathLike, *, hash_bytes: bool = True) -> dict | None:
    """Verify a committed checkpoint (file or directory) against its manifest.

    Returns the manifest that the bytes on disk match, or None if ``checkpoint`` has no
    manifest (foreign: mmengine, plain ``torch.save``). Raises ``FileNotFoundError`` if it does
    not exist and ``CheckpointCorruptError`` (naming the file, expected vs actual size/digest)
    if a byte differs. ``hash_bytes=False`` checks sizes only (no read).
    """
    checkpoint = Path(checkpoint).absolute()
    if not checkpoint.exists():
        raise FileNotFoundError(f'checkpoint not found: {checkpoint}')
    if checkpoint.is_dir():
        mfile = checkpoint / DIR_MANIFEST
        manifest = read_manifest(mfile)
        if manifest is None:
            return None
        for entry in manifest['files']:
            verify_file(checkpoint / entry['path'], entry, mfile, hash_bytes=hash_bytes)
        return manifest
    found = find_manifest(checkpoint)
    if found is None:
        return None
    manifest, entry, mfile = found
    try:
        verify_file(checkpoint, entry, mfile, hash_bytes=hash_bytes)
        return manifest
    except CheckpointCorruptError:
        # A save of the same name died between writing the new manifest and renaming the new
        # file into place: the old file is intact and matches the manifest it replaces.
        old = manifest.get('replaces')
        if not isinstance(old, dict) or not old.get('files'):
            raise
        try:
            verify_file(checkpoint, old['files'][0], mfile, hash_bytes=hash_bytes)
        except CheckpointCorruptError:
            pass
        else:
            return old
        raise
