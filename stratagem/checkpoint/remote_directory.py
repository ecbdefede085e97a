"""Directory checkpoints (FSDP's DCP directory, DeepSpeed's, a converted one) at an fsspec URL:
the directory commit on a store without rename, and reading back.

A directory checkpoint at ``URL`` is the objects ``URL/<file>`` and ``URL/manifest.json``
listing every one of them (size, digest, the writing rank). The save (``directory.py``'s three
steps, the same vote) on such a store:

1. Rank 0 checks the target: a committed checkpoint of that name (its ``manifest.json`` is
   there) that ``last_checkpoint`` names is refused (without rename nothing could replace
   it whole: a kill half-way would lose it); one the pointer does not name (a run resumed
   from an earlier checkpoint saves that iteration again) is deleted first, with a warning;
   an object of that name is refused; objects under the name that no manifest lists (an
   upload that died) are removed. Every rank gets a local staging directory of
   its own (nodes need not share a filesystem).
2. Every rank writes its files there, hashed as written (the local protocol's writers,
   unchanged), then uploads each under its final name (``transfer.put_file``: one PUT, or
   a multipart upload visible only once completed, so a kill leaves no part under a final
   name), and posts the entries through the vote.
3. Rank 0 checks that every file is there at its size (one listing), then writes
   ``manifest.json``: now the checkpoint exists. Then the ``last_checkpoint`` pointer beside
   it, then the work_dir's (``also_point``). Every rank removes its staging directory.

A reader trusts nothing no manifest lists (``verify_remote_directory``): the manifest read
once, every listed file's size from one listing on every rank, each file's digest by one
rank (the rank that wrote it at the same world size, else round-robin) read once and kept in
memory for the read that follows (``ShardReader`` over the store: a rank reads only the byte
ranges of its own pieces, and the files it verified from memory); or, where the caller knows
which files each rank reads (``reads=``: DeepSpeed's engine), each rank verifies and keeps
exactly those. A reader of local files only (a Hugging Face directory, DeepSpeed's
consolidation and universal conversion) gets a download, each file hashed as it arrives,
into a local temporary directory (``download_directory``).

Retention deletes a directory's ``manifest.json`` first (it is then no checkpoint), then its
files.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from . import transfer
from .digest import entry_digest, new_hasher
from .errors import CheckpointCorruptError, CheckpointWarning
from .location import (
    POINTER_NAME,
    RemoteCheckpoint,
    _read_hashed,
    _read_small,
    absolute,
    entry_name,
    filesystem,
    is_url,
    join,
    parent,
    store_errors,
    write_local_pointer,
)
from .manifest import DIR_MANIFEST, SIDECAR_SUFFIX, build_manifest, dump_manifest, parse_manifest
from .rank_errors import all_ok, describe_error, raise_first
from .store_retry import call

__all__ = [
    'RemoteDirectory',
    'commit_remote_directory',
    'delete_directory',
    'directory_format',
    'download_directory',
    'list_directories',
    'prepare_remote_target',
    'read_remote_manifest',
    'remote_detect',
    'remove_directory',
    'remote_identity',
    'upload_directory',
    'upload_directory_files',
    'verify_remote_directory',
]

_CHUNK = 16 << 20


def _root(url: str, backend_args: Mapping | None) -> tuple[Any, str]:
    fs, path = filesystem(url, backend_args)
    return fs, path.rstrip('/')


def _listing(fs: Any, root: str) -> dict[str, int]:
    """``{relative path: size}`` of every object under ``root`` (fresh: not a cached list)."""
    fs.invalidate_cache(root)
    try:
        found = call(fs.find, root, detail=True)
    except FileNotFoundError:
        return {}
    finally:
        fs.invalidate_cache(root)
    sizes = {}
    for name, info in found.items():
        if info.get('type', 'file') != 'file':
            continue
        rel = name[len(root) :].lstrip('/')
        if rel:
            sizes[rel] = int(info.get('size') or 0)
    return sizes


# ------------------------------------------------------------------------------- save
def prepare_remote_target(url: str, backend_args: Mapping | None = None) -> None:
    """Step 1 at a URL (rank 0): refuse a name that holds the committed checkpoint the
    pointer names, or an object; delete another committed one of that name
    (``_replace_committed``); remove the objects an interrupted upload left under it (no
    manifest lists them)."""
    from .names import check_final_name

    check_final_name(url.rsplit('/', 1)[-1])
    fs, root = _root(url, backend_args)
    with store_errors(url, 'saving'):
        committed = call(fs.exists, f'{root}/{DIR_MANIFEST}')
        a_file = not committed and (call(fs.isfile, root) or call(fs.exists, root + SIDECAR_SUFFIX))
    if committed:
        _replace_committed(url, backend_args)
    if a_file:
        raise FileExistsError(
            f'{url} is a single-file checkpoint; a directory checkpoint cannot take its '
            'name: save under a new name'
        )
    with store_errors(url, 'saving'):
        if _listing(fs, root):  # an upload that died before its manifest: never a checkpoint
            call(fs.rm, root, recursive=True)
            fs.invalidate_cache(root)


def _replace_committed(url: str, backend_args: Mapping | None) -> None:
    """A committed directory of the target's name: refused when ``last_checkpoint`` names it
    (replacing it could lose the checkpoint a resume would use); otherwise (a run resumed
    from an older one saves that iteration again) deleted first, manifest first, with a
    warning: until the new one commits, the pointer still names a complete checkpoint."""
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    from .location import read_pointer

    try:
        pointed = read_pointer(parent(url), backend_args)
    except ValueError:
        pointed = None
    if pointed == url:
        raise FileExistsError(
            f'{url} holds a committed checkpoint that {parent(url)}/{POINTER_NAME} names; a '
            'directory checkpoint at a URL cannot be replaced whole (the store has no rename: '
            'a failure half-way would lose it). Save under a new name (iter_N), or delete it '
            'first (stratagem.checkpoint.location.delete_checkpoint)'
        )
    env.warn_rank_zero(
        f'{url} holds a committed checkpoint, which this save replaces (it is not the one '
        f'{POINTER_NAME} names: a run resumed from an earlier one saves that iteration '
        'again); it is deleted first, so until the new one commits that name holds none',
        CheckpointWarning,
        stacklevel=4,
    )
    delete_directory(url, backend_args)


def upload_directory_files(
    staging: Path, url: str, entries: list[dict], backend_args: Mapping | None = None
) -> None:
    """Step 2 at a URL (every rank): each of this rank's files (``entries``, paths relative
    to ``staging``) goes up under its final name."""
    fs, root = _root(url, backend_args)
    with store_errors(url, 'saving'):
        for entry in entries:
            transfer.put_file(fs, staging / entry['path'], f'{root}/{entry["path"]}')


def _check_uploaded(fs: Any, root: str, url: str, files: list[dict]) -> None:
    """Every file of ``files`` is in the store at its size (one listing), before the manifest
    that lists them goes up."""
    sizes = _listing(fs, root)
    for entry in files:
        if sizes.get(entry['path']) != entry['size']:
            raise CheckpointCorruptError(
                f'{url}/{entry["path"]} is {sizes.get(entry["path"], "missing")} bytes in the '
                f'store after its upload, {entry["size"]} were written; nothing was committed'
            )


def commit_remote_directory(
    url: str,
    per_rank: list[list[dict]],
    *,
    world: int | None,
    step: int | None,
    extra_manifest: dict | None,
    backend_args: Mapping | None = None,
    update_pointer: bool = True,
    also_point: str | os.PathLike | None = None,
) -> str:
    """Step 3 at a URL (rank 0): every file there at its size, then ``manifest.json``,
    then the pointer(s). Returns ``url``."""
    files = [{**entry, 'rank': r} for r, entries in enumerate(per_rank) for entry in entries]
    if not files:
        raise ValueError(f'no rank wrote a file; nothing to commit for {url}')
    extra = extra_manifest if world is None else {'world_size': world, **(extra_manifest or {})}
    fs, root = _root(url, backend_args)
    name = url.rsplit('/', 1)[-1]
    with store_errors(url, 'saving'):
        _check_uploaded(fs, root, url, files)
        manifest = build_manifest('directory', name, files, step, extra)
        call(fs.pipe_file, f'{root}/{DIR_MANIFEST}', dump_manifest(manifest))
        if update_pointer:
            call(fs.pipe_file, f'{parent(root)}/{POINTER_NAME}', url.encode())
    if also_point is not None:
        write_local_pointer(also_point, url)
    return url


def upload_directory(
    local: str | os.PathLike, url: str, *, backend_args: Mapping | None = None
) -> str:
    """Upload a directory checkpoint committed locally (its ``manifest.json`` lists every
    file: ``stratagem convert --to hf``) to ``url`` by the steps above, in this process:
    the target checked, every file under its final name, then the manifest. No pointer
    moves. Returns ``url``."""
    from .manifest import read_manifest

    local = Path(local)
    manifest = read_manifest(local / DIR_MANIFEST)
    if manifest is None or manifest.get('kind') != 'directory':
        raise CheckpointCorruptError(f'{local} has no directory {DIR_MANIFEST}; nothing to upload')
    prepare_remote_target(url, backend_args)
    upload_directory_files(local, url, manifest['files'], backend_args)
    fs, root = _root(url, backend_args)
    with store_errors(url, 'saving'):
        _check_uploaded(fs, root, url, manifest['files'])
        manifest['name'] = url.rsplit('/', 1)[-1]
        call(fs.pipe_file, f'{root}/{DIR_MANIFEST}', dump_manifest(manifest))
    return url


# ------------------------------------------------------------------------------- read
def read_remote_manifest(url: str, backend_args: Mapping | None = None) -> tuple[dict, str] | None:
    """The directory manifest at ``url`` and the sha256 of its bytes; None without one."""
    fs, root = _root(url, backend_args)
    with store_errors(url, 'reading'):
        try:
            raw = call(_read_small, fs, f'{root}/{DIR_MANIFEST}')
        except FileNotFoundError:
            return None
    manifest = parse_manifest(raw, f'{url}/{DIR_MANIFEST}')
    if manifest.get('kind') != 'directory':
        raise CheckpointCorruptError(
            f'{url}/{DIR_MANIFEST} describes a {manifest.get("kind")!r} checkpoint, not a directory'
        )
    return manifest, hashlib.sha256(raw).hexdigest()


class RemoteDirectory:
    """A verified directory checkpoint at a URL: its ``manifest``, and the bytes of the files
    this rank verified (``cache``, by relative path), which reads take from memory."""

    def __init__(
        self,
        url: str,
        manifest: dict,
        cache: dict[str, bytes | bytearray],
        backend_args: Mapping | None,
    ) -> None:
        self.url, self.manifest, self.cache = url, manifest, cache
        self.backend_args = backend_args
        self.fs, self.root = _root(url, backend_args)
        self.entries = {e['path']: e for e in manifest['files']}
        #: DCP's metadata, once read (``sharded.read_sharded_header``)
        self.dcp_metadata: Any = None

    def has(self, relative: str) -> bool:
        return relative in self.entries

    def size(self, relative: str) -> int:
        return int(self.entries[relative]['size'])

    def read(self, relative: str) -> bytes | bytearray:
        """A listed file's bytes, verified against the manifest (from memory when this rank
        verified it)."""
        if relative in self.cache:
            return self.cache[relative]
        entry = self.entries[relative]
        where = f'{self.url}/{relative}'
        with store_errors(where, 'reading'):
            return _read_hashed(self.fs, f'{self.root}/{relative}', entry['size'], [entry], where)

    @contextlib.contextmanager
    def open(self, relative: str) -> Iterator[Any]:
        """A readable, seekable stream over a listed file: from memory, or ranged reads of
        the store (the reader then reads only the byte ranges it needs)."""
        if relative in self.cache:
            from .location import _BufferReader

            with _BufferReader(self.cache[relative]) as stream:
                yield stream
            return
        where = f'{self.url}/{relative}'
        with (
            store_errors(where, 'reading'),
            self.fs.open(f'{self.root}/{relative}', 'rb', block_size=_CHUNK) as stream,
        ):
            yield stream

    @contextlib.contextmanager
    def open_verified(self, relative: str) -> Iterator[Any]:
        """A readable, seekable stream over a listed file's verified bytes (``read``: from
        memory when this rank verified it), for a reader that unpickles it (DeepSpeed's)."""
        with _verified_stream(self.read(relative)) as stream:
            yield stream

    def load(self, relative: str) -> Any:
        """``torch.load(weights_only=True)`` of a listed file, verified first."""
        from .load import _sniff_bytes, _torch_load

        data = self.read(relative)
        where = f'{self.url}/{relative}'
        is_zip = _sniff_bytes(bytes(data[:4]), where)
        with _verified_stream(data) as source:
            return _torch_load(where, 'cpu', False, False, is_zip, source)


def _verified_stream(data: bytes | bytearray) -> io.BufferedReader:
    """A stream over ``data`` itself: a copy would double the memory while tensors build."""
    from .location import _BufferReader

    return io.BufferedReader(_BufferReader(data), buffer_size=1 << 16)


def verify_remote_directory(
    url: str,
    *,
    backend_args: Mapping | None = None,
    collective: bool = True,
    keep: bool = True,
    hash_bytes: bool = True,
    progress: Callable[[int, int], None] | None = None,
    found: tuple[dict, str] | None = None,
    reads: Callable[[str], bool] | None = None,
    check: Callable[[str, Any], None] | None = None,
) -> RemoteDirectory:
    """``directory.verify_directory`` at a URL: every listed file present at its size (one
    listing, every rank), each digest checked by one rank (reading the file once; ``keep``:
    its bytes kept for the read), the same manifest on every rank; any failure raises the
    same error on every rank, naming the file. Objects no manifest lists are ignored (a
    ``CheckpointWarning`` names them). ``hash_bytes=False``: sizes and manifest only (a
    caller that hashes every byte as it reads them: ``download_directory``).

    ``found``: ``read_remote_manifest``'s answer, when the caller read it already (it is not
    read again). ``reads(path)``: whether this rank will read that file; then each rank
    hashes (and keeps) exactly the files it reads, and a file no rank reads is checked by
    its size only (DeepSpeed's load: each rank fetches its own files, and the model states
    every rank reads). ``check(path, stream)``: a further check of
    each file this rank read (``stream``: over its verified bytes), raising to refuse the
    checkpoint (on every rank, like a digest)."""
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    url = absolute(url)
    rank, world = env.get_dist_info() if collective else (0, 1)
    manifest, digest, error = None, None, None
    cache: dict[str, bytes | bytearray] = {}
    sizes: dict[str, int] = {}
    try:
        if found is None:
            found = read_remote_manifest(url, backend_args)
        if found is None:
            fs, root = _root(url, backend_args)
            with store_errors(url, 'reading'):
                exists = bool(_listing(fs, root))
            if not exists:
                raise FileNotFoundError(f'checkpoint directory not found: {url}')
            raise CheckpointCorruptError(
                f'{url} has no {DIR_MANIFEST}: it is not a committed checkpoint (an upload '
                'that died before its commit, or written by another tool); it was not loaded'
            )
        manifest, digest = found
        fs, root = _root(url, backend_args)
        with store_errors(url, 'reading'):
            sizes = _listing(fs, root)
        own = manifest.get('world_size') == world
        total = len(manifest['files'])
        for i, entry in enumerate(manifest['files']):
            where = f'{url}/{entry["path"]}'
            if entry['path'] not in sizes:
                raise FileNotFoundError(
                    f'{where} is missing: its manifest {url}/{DIR_MANIFEST} lists it; the '
                    'checkpoint was not loaded'
                )
            if sizes[entry['path']] != entry['size']:
                raise CheckpointCorruptError(
                    f'{where} is damaged: it is {sizes[entry["path"]]} bytes, its manifest '
                    f'says {entry["size"]} (truncated or overwritten); it was not loaded'
                )
            owner = entry.get('rank', i) if own else i
            mine = owner % world == rank if reads is None else reads(entry['path'])
            if hash_bytes and mine:
                with store_errors(where, 'reading'):
                    data = _read_hashed(
                        fs, f'{root}/{entry["path"]}', entry['size'], [entry], where
                    )
                if check is not None:
                    with _verified_stream(data) as stream:
                        check(entry['path'], stream)
                if keep:
                    cache[entry['path']] = data
            if progress is not None:
                progress(i + 1, total)
    except Exception as err:  # noqa: BLE001 - exchanged, raised on every rank
        error = err
    verdict = (digest, None if error is None else describe_error(error))
    outcomes = [verdict]
    if collective and not all_ok(error is not None, digest):
        outcomes = env.all_gather_object(verdict)
    raise_first([m for _, m in outcomes], error, f'verifying {url}', CheckpointCorruptError)
    if len({d for d, _ in outcomes}) > 1:
        raise CheckpointCorruptError(
            f'ranks read different manifests at {url} (the checkpoint changed while loading); '
            'it was not loaded'
        )
    assert manifest is not None
    unlisted = sorted(set(sizes) - {e['path'] for e in manifest['files']} - {DIR_MANIFEST})
    if unlisted and rank == 0:
        env.warn_rank_zero(
            f'{url} holds objects its manifest does not list: {unlisted[:5]}'
            f'{" ..." if len(unlisted) > 5 else ""}; they are ignored',
            CheckpointWarning,
            stacklevel=3,
        )
    return RemoteDirectory(url, manifest, cache, backend_args)


def download_directory(
    url: str,
    *,
    backend_args: Mapping | None = None,
    collective: bool = False,
    progress: Callable[[int, int], None] | None = None,
    found: tuple[dict, str] | None = None,
) -> Path:
    """A local copy of the directory checkpoint at ``url`` for readers of local files only
    (a Hugging Face directory; DeepSpeed's consolidation and universal conversion): verified
    (``verify_remote_directory``, ``found`` passed on; ``collective``: every rank calls it
    and each downloads), each file written to a new temporary directory as it is hashed,
    with the manifest; a failure on any rank raises on every rank. The caller removes it."""
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    remote = verify_remote_directory(
        url,
        backend_args=backend_args,
        collective=collective,
        hash_bytes=False,  # each byte is hashed below, as it arrives
        progress=progress,
        found=found,
    )
    local = Path(tempfile.mkdtemp(prefix='stratagem-download-'))
    error = None
    try:
        _download(remote, local)
    except Exception as err:  # noqa: BLE001 - exchanged, raised on every rank
        error = err
    except BaseException:  # an interrupt: no half copy left behind
        shutil.rmtree(local, ignore_errors=True)
        raise
    outcomes = [None if error is None else describe_error(error)]
    if collective and not all_ok(error is not None):
        outcomes = env.all_gather_object(outcomes[0])
    if any(o is not None for o in outcomes):
        shutil.rmtree(local, ignore_errors=True)
        raise_first(outcomes, error, f'downloading {url}', CheckpointCorruptError)
    return local


def _download(remote: RemoteDirectory, local: Path) -> None:
    """Every file of ``remote`` into ``local``, each hashed as it arrives and checked against
    the manifest, then the manifest itself."""
    from .manifest import _identity, remember_verified

    url = remote.url
    for relative, entry in remote.entries.items():
        target = local / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        algo, expected = entry_digest(entry)
        hasher = new_hasher(algo)
        with remote.open(relative) as stream, open(target, 'wb') as out:
            while chunk := stream.read(_CHUNK):
                hasher.update(chunk)
                out.write(chunk)
        if hasher.hexdigest() != expected or target.stat().st_size != entry['size']:
            raise CheckpointCorruptError(
                f'{url}/{relative} is damaged: its {algo} is {hasher.hexdigest()}, its '
                f'manifest says {expected}; it was not loaded'
            )
        remember_verified(target, expected, _identity(target), algo)
    (local / DIR_MANIFEST).write_bytes(dump_manifest(remote.manifest))


def remote_detect(
    url: str, backend_args: Mapping | None = None
) -> tuple[str | None, tuple[dict, str] | None]:
    """The format of the checkpoint at ``url`` (``formats.FORMATS``' names): ``'file'`` for
    an object, a directory's from its manifest's files (``'sharded'``: DCP metadata,
    ``'zero'``: DeepSpeed's, ``'hf'``: safetensors weights), None when nothing is there; and
    a directory's manifest it read with that manifest's sha256 (None for an object or
    nothing): passed on as ``found=`` to the verification, one load reads the manifest once."""
    fs, root = _root(url, backend_args)
    found = read_remote_manifest(url, backend_args)
    if found is None:
        with store_errors(url, 'reading'):
            return ('file' if call(fs.isfile, root) else None), None
    return directory_format(found[0]), found


def directory_format(manifest: dict) -> str:
    """A directory manifest's format, from the files it lists (``remote_detect``)."""
    paths = {e['path'] for e in manifest['files']}
    if any(p.startswith('deepspeed/') for p in paths):
        return 'zero'
    if '.metadata' in paths:
        return 'sharded'
    if any(p.endswith('.safetensors') for p in paths):
        return 'hf'
    return 'directory'


def remote_identity(url: str, backend_args: Mapping | None = None) -> dict:
    """``location.identity`` that also knows directories: the sha256 of ``manifest.json``."""
    from .location import identity

    found = read_remote_manifest(url, backend_args)
    if found is not None:
        return {'kind': 'directory', 'digest': found[1]}
    return identity(url, backend_args)


# --------------------------------------------------------------------------- list, delete
def list_directories(
    fs: Any, root: str, directory: str, entries: list[dict]
) -> list[RemoteCheckpoint]:
    """The committed directory checkpoints among ``entries`` (a listing of ``directory``):
    those holding a ``manifest.json`` of kind directory (written after every file it lists;
    their size: the files' total)."""
    found = []
    for entry in entries:
        if entry.get('type') != 'directory':
            continue
        name = entry_name(entry)
        if name.startswith('.'):
            continue
        try:
            manifest = parse_manifest(
                call(_read_small, fs, f'{root}/{name}/{DIR_MANIFEST}'),
                join(directory, f'{name}/manifest'),
            )
        except (CheckpointCorruptError, FileNotFoundError):
            continue
        if manifest.get('kind') == 'directory':
            size = sum(int(e.get('size') or 0) for e in manifest['files'])
            found.append(RemoteCheckpoint(join(directory, name), manifest, size))
    return found


def delete_directory(url: str, backend_args: Mapping | None = None) -> bool:
    """Delete the directory checkpoint at ``url`` (``remove_directory``) when its manifest
    is there; False when ``url`` is no directory."""
    fs, root = _root(url, backend_args)
    with store_errors(url, 'deleting'):
        if not call(fs.exists, f'{root}/{DIR_MANIFEST}'):
            return False
    remove_directory(url, backend_args)
    return True


def remove_directory(url: str, backend_args: Mapping | None = None) -> None:
    """Delete the directory checkpoint at ``url``, known to be one (retention has its
    manifest in hand): its manifest first (then it is no checkpoint: a kill part-way leaves
    unlisted objects, never a damaged checkpoint), then its files."""
    fs, root = _root(url, backend_args)
    with store_errors(url, 'deleting'):
        with contextlib.suppress(FileNotFoundError):
            call(fs.rm_file, f'{root}/{DIR_MANIFEST}')
        with contextlib.suppress(FileNotFoundError):
            call(fs.rm, root, recursive=True)
        fs.invalidate_cache(root)


def is_remote_directory(url: str, backend_args: Mapping | None = None) -> bool:
    """Whether ``url`` holds a committed directory checkpoint (its ``manifest.json``)."""
    if not is_url(url):
        return False
    fs, root = _root(url, backend_args)
    with store_errors(url, 'reading'):
        return bool(call(fs.exists, f'{root}/{DIR_MANIFEST}'))
