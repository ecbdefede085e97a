"""Checkpoints at an fsspec URL (``s3://bucket/prefix``, ``gs://``, ``memory://``, any
protocol fsspec knows): the commit protocol on a store without rename, and reading back.

A location is a local path (the protocol of ``single_file.py``, unchanged) or a URL;
``file://`` URLs are local paths. ``backend_args`` are the filesystem's storage options
(``s3fs.S3FileSystem(**backend_args)``: ``key``, ``secret``, ``endpoint_url``,
``client_kwargs``, ...); without them the client library reads the environment as it always
does (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ...).

Save (``upload_file``), after the local protocol committed the file and its manifest into a
local staging directory (``storage.py``; the async snapshot path is the same):

1. If an object already has the final name and a manifest that lists it, the new manifest
   with ``replaces: <that manifest>`` goes up first, so the object there verifies whichever
   of the two bytes it holds while step 2 runs (the same-name save of ``single_file.py``).
2. The file goes up under its final name: one PUT, or a multipart upload with several parts
   in flight that becomes visible only when completed, and is aborted on a failure
   (``transfer.put_file``); a process killed meanwhile leaves the previous object, or none,
   never a part.
3. The manifest (``NAME.manifest.json``) goes up: now the checkpoint exists.
4. The ``last_checkpoint`` pointer beside it names the checkpoint's URL; then, when given,
   the local work directory's pointer.

A reader trusts nothing that no manifest lists: the pointer's target is used only when its
manifest is there and lists its size; a scan (no pointer, or a stale one) considers only
objects with a manifest; loading (``load_file``) reads the object once into memory (on S3 by
parallel ranged GETs, ``transfer.read_into``), hashes it, and unpickles it
(``torch.load(weights_only=True)`` from memory) only when size and digest match: no
temporary copy on local disk.

Retention (``apply_retention``) deletes a checkpoint's object, then its manifest (a kill
between leaves a manifest that lists a missing object: never listed, never loaded), never
the newest, the pointed-to one, or a protected one; then the debris of interrupted uploads
older than the newest commit (``store_debris.py``).

Every failure of the store becomes one ``CheckpointLocationError`` naming the URL and what
to do (a missing bucket, refused credentials or a permission denied, a store that kept
throttling or failing after the retries of ``store_retry.py``, an unreachable endpoint); a
failed save changes nothing the previous checkpoint needs.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import io
import os
import os.path as osp
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import transfer
from .digest import entry_digest, new_hasher
from .errors import CheckpointCorruptError, CheckpointLocationError
from .manifest import SIDECAR_SUFFIX, ManifestOrder, dump_manifest, parse_manifest
from .store_retry import call as _call

__all__ = [
    'Listing',
    'RemoteCheckpoint',
    'absolute',
    'apply_retention',
    'delete_checkpoint',
    'filesystem',
    'find_latest',
    'is_url',
    'join',
    'list_checkpoints',
    'load_file',
    'read_pointer',
    'survey',
    'upload_file',
]

POINTER_NAME = 'last_checkpoint'  # latest.POINTER_NAME, mmengine's name
_URL_RE = re.compile(r'^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+)://')
# protocol -> the extra that installs its filesystem
_EXTRAS = {'s3': 's3', 's3a': 's3', 'gs': 'gcs', 'gcs': 'gcs'}


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL of a store (``s3://...``); ``file://`` URLs and local paths
    are not (they take the local protocol)."""
    if not isinstance(path, str):
        return False
    match = _URL_RE.match(path)
    return match is not None and match['scheme'].lower() != 'file'


def absolute(path: str | os.PathLike) -> str:
    """A URL as given (without a trailing ``/``); a ``file://`` URL or a local path made
    absolute."""
    text = os.fspath(path)
    if is_url(text):
        return text.rstrip('/')
    if text.lower().startswith('file://'):
        text = text[len('file://') :]
    return osp.abspath(text)


def join(base: str, name: str) -> str:
    """``base/name`` for a URL or a local path."""
    return f'{base.rstrip("/")}/{name}' if is_url(base) else osp.join(base, name)


def parent(url: str) -> str:
    """The URL of the "directory" holding ``url``."""
    return url.rstrip('/').rsplit('/', 1)[0]


def filesystem(url: str, backend_args: Mapping | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path in it)`` for ``url``, its storage options ``backend_args``.
    Raises ImportError naming the extra to install when the protocol's package is absent."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - s3fs and gcsfs bring it
        raise ImportError(
            f'checkpoint location {url} needs fsspec: pip install "stratagem[s3]" (S3) or '
            '"stratagem[gcs]" (GCS)'
        ) from None
    scheme = url.split('://', 1)[0].lower()
    try:
        return fsspec.core.url_to_fs(url, **dict(backend_args or {}))
    except ImportError as err:
        extra = _EXTRAS.get(scheme)
        fix = (
            f'pip install "stratagem[{extra}]"'
            if extra
            else f'install the fsspec filesystem for {scheme}:// ({err})'
        )
        raise ImportError(f'checkpoint location {url} needs a package: {fix}') from None
    except ValueError as err:  # an unknown protocol
        raise ValueError(f'checkpoint location {url}: {err}') from None


@contextlib.contextmanager
def store_errors(url: str, doing: str) -> Iterator[None]:
    """A failure of the store while ``doing`` (e.g. ``'saving'``) ``url`` becomes one
    ``CheckpointLocationError`` naming the URL, the store's answer and the fix: refused
    credentials, a permission denied, a missing bucket, a store that kept throttling or
    failing after the retries (``store_retry.py``), an unreachable endpoint."""
    try:
        yield
    except (CheckpointCorruptError, CheckpointLocationError):
        raise
    except PermissionError as err:
        raise _error(err, f'{doing} {url}: {_refusal(err, doing)}', doing) from None
    except FileNotFoundError as err:
        if 'bucket' in str(err).lower():
            raise _error(
                err,
                f'{doing} {url}: the bucket does not exist ({err}); create it, or fix the '
                'URL (default_hooks.checkpoint.out_dir)',
                doing,
            ) from None
        raise
    except Exception as err:
        message = _transient_message(err, url, doing)
        if message is not None:
            raise _error(err, message, doing) from None
        name = type(err).__name__
        if isinstance(err, OSError) or 'Connection' in name or 'Endpoint' in name:
            raise _error(
                err,
                f'{doing} {url} failed: {name}: {err}; check the endpoint (AWS_ENDPOINT_URL '
                'or backend_args endpoint_url) and the network',
                doing,
            ) from None
        raise


#: the store's codes for credentials it does not accept (any other refusal is a permission)
_BAD_CREDENTIALS = (
    'InvalidAccessKeyId',
    'SignatureDoesNotMatch',
    'ExpiredToken',
    'InvalidToken',
    'TokenRefreshRequired',
    'InvalidClientTokenId',
)


def _refusal(err: PermissionError, doing: str) -> str:
    """Why the store refused: credentials it does not accept, a permission they lack, or
    (a bare ``403`` with no code: the answer to a HEAD request) either."""
    from .store_retry import codes

    found = codes(err)
    action = {
        'saving': 'write (s3:PutObject)',
        'probing': 'write and delete (s3:PutObject, s3:DeleteObject)',
        'deleting': 'delete (s3:DeleteObject)',
    }
    may = action.get(doing, 'read and list (s3:GetObject, s3:ListBucket)')
    if 'AccessDenied' in found:
        return (
            f'permission denied ({err}): the credentials were accepted but may not {may} '
            'here; grant that to them (the bucket policy or their IAM policy), or use '
            'credentials that may (AWS_PROFILE, AWS_ACCESS_KEY_ID, or backend_args)'
        )
    either = '' if any(c in found for c in _BAD_CREDENTIALS) else f', or they may not {may} here'
    return (
        f'the store refused the request ({err}); check the credentials '
        f'(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or backend_args){either}'
    )


def _transient_message(err: BaseException, url: str, doing: str) -> str | None:
    """The message for a store that kept throttling, failing or dropping the connection
    after every retry; None for another error."""
    from .store_retry import kind, retried

    what = kind(err)
    if what is None:
        return None
    spent = retried(err)
    tries = (
        f'after {spent[0]} attempt(s) over {spent[1]:.1f} s (each retried by the client too)'
        if spent
        else "after the client's retries"
    )
    if what == 'throttled':
        return (
            f'{doing} {url}: the store kept throttling the requests (SlowDown: {err}) {tries}; '
            'save less often (the checkpoint interval), spread runs over other prefixes, or '
            'let the client retry longer (AWS_MAX_ATTEMPTS, or backend_args '
            "config_kwargs=dict(retries=dict(mode='adaptive', max_attempts=10)))"
        )
    if what == 'server':
        return (
            f'{doing} {url}: the store kept failing ({type(err).__name__}: {err}) {tries}; '
            "it is the store's own error: check its status, then run again"
        )
    return (
        f'{doing} {url}: the connection kept breaking ({type(err).__name__}: {err}) {tries}; '
        'check the network and the endpoint (AWS_ENDPOINT_URL or backend_args endpoint_url)'
    )


def _size(fs: Any, path: str) -> int:
    """The object's size as the store says now: fsspec filesystems answer from a listing
    they cached (another process may have written since), so that is dropped first."""
    fs.invalidate_cache(path)
    return int(_call(fs.size, path))


def _error(err: BaseException, message: str, doing: str) -> CheckpointLocationError:
    code = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
    if isinstance(err, PermissionError):
        code = errno.EACCES
    if doing == 'saving':
        message += '; the previous checkpoint is unchanged'
    return CheckpointLocationError(code, message)


# ------------------------------------------------------------------------------- save
def upload_file(
    local: str | os.PathLike,
    url: str,
    *,
    backend_args: Mapping | None = None,
    update_pointer: bool = True,
    also_point: str | os.PathLike | None = None,
) -> str:
    """Upload the committed local checkpoint ``local`` (with its sidecar manifest) to
    ``url``, by the steps of the module docstring; returns ``url``.

    Args:
        local: a file committed by ``single_file.save_checkpoint`` (its manifest beside it).
        url: the checkpoint's final URL.
        backend_args: the filesystem's storage options.
        update_pointer: write ``last_checkpoint`` beside ``url`` after the manifest.
        also_point: a local directory whose ``last_checkpoint`` then names ``url`` too
            (the run's work_dir, as mmengine's CheckpointHook does with ``out_dir``).
    """
    local = Path(local)
    url = absolute(url)
    manifest = parse_manifest(
        local.with_name(local.name + SIDECAR_SUFFIX).read_bytes(), f'{local}{SIDECAR_SUFFIX}'
    )
    name = url.rsplit('/', 1)[-1]
    manifest['name'] = name
    for entry in manifest['files']:
        entry['path'] = name
    fs, path = filesystem(url, backend_args)
    with store_errors(url, 'saving'):
        old = _listed_manifest(fs, path, url)
        if old is not None:  # step 1
            _call(fs.pipe_file, path + SIDECAR_SUFFIX, dump_manifest({**manifest, 'replaces': old}))
        transfer.put_file(fs, local, path)  # step 2
        _call(fs.pipe_file, path + SIDECAR_SUFFIX, dump_manifest(manifest))  # step 3
        if update_pointer:  # step 4
            _call(fs.pipe_file, f'{parent(path)}/{POINTER_NAME}', url.encode())
    if also_point is not None:
        write_local_pointer(also_point, url)
    return url


def write_local_pointer(directory: str | os.PathLike, url: str) -> None:
    """``directory/last_checkpoint`` names ``url`` (temp + rename, as ``latest.py`` does)."""
    from . import _fs

    pointer = Path(directory).absolute() / POINTER_NAME
    pointer.parent.mkdir(parents=True, exist_ok=True)
    _fs.write_atomic(pointer, url.encode())


def _listed_manifest(fs: Any, path: str, url: str) -> dict | None:
    """The manifest that describes the object now at ``path`` (the one a same-name save
    replaces), without its own ``replaces``; None when no manifest lists it.

    Of the manifest and the one it replaces (a same-name save that died between its
    manifest and its object), the one whose size matches; when both do, the object's bytes
    decide (read once, only in that case)."""
    try:
        raw = _call(_read_small, fs, path + SIDECAR_SUFFIX)
        size = _size(fs, path)
    except FileNotFoundError:
        return None
    try:
        manifest = parse_manifest(raw, url + SIDECAR_SUFFIX)
    except CheckpointCorruptError:
        return None
    candidates = [{k: v for k, v in manifest.items() if k != 'replaces'}]
    old = manifest.get('replaces')
    if isinstance(old, dict) and old.get('files'):
        candidates.append(old)
    matching = [m for m in candidates if m['files'] and m['files'][0].get('size') == size]
    if len(matching) <= 1:
        return matching[0] if matching else None
    for candidate in matching:
        try:
            _read_hashed(fs, path, size, [candidate['files'][0]], url)
        except CheckpointCorruptError:
            continue
        return candidate
    return None


def _lists(manifest: dict, size: int | None) -> bool:
    """Whether ``manifest`` (or the one it replaces) lists an object of ``size`` bytes."""
    return any(e.get('size') == size for e in _entries(manifest))


# ------------------------------------------------------------------------------- read
@dataclass(frozen=True)
class RemoteCheckpoint(ManifestOrder):
    """A checkpoint at a URL whose manifest is present and lists its object's size."""

    url: str
    manifest: dict
    size: int


def read_manifest_at(url: str, backend_args: Mapping | None = None) -> dict | None:
    """The manifest of the checkpoint at ``url``; None when it has none."""
    fs, path = filesystem(url, backend_args)
    with store_errors(url, 'reading'):
        try:
            raw = _call(_read_small, fs, path + SIDECAR_SUFFIX)
        except FileNotFoundError:
            return None
    return parse_manifest(raw, url + SIDECAR_SUFFIX)


def _read_small(fs: Any, path: str) -> bytes:
    """A small object's bytes (a manifest) in one request: a read from offset 0 spares
    s3fs's size lookup first (a HEAD, and a listing when the object is missing)."""
    try:
        return bytes(fs.cat_file(path, start=0))
    except FileNotFoundError:
        raise
    except OSError:  # an empty object has no range to read (S3: 416); read it plainly
        return bytes(fs.cat_file(path))


def load_file(
    url: str,
    map_location: Any = 'cpu',
    *,
    backend_args: Mapping | None = None,
    trust_pickled_code: bool = False,
) -> Any:
    """Read the checkpoint at ``url`` once, verify it against its manifest (size, digest),
    and ``torch.load(weights_only=True)`` it from memory. Without a manifest it warns
    ``UnverifiedCheckpointWarning`` and loads (an mmengine or plain ``torch.save`` object),
    as ``load_checkpoint_file`` does for a local file."""
    from .load import _sniff_bytes, _torch_load

    if type(trust_pickled_code) is not bool:
        raise TypeError(f'trust_pickled_code must be True or False, got {trust_pickled_code!r}')
    url = absolute(url)
    fs, path, manifest, size = _found(url, backend_args)
    memory = transfer.MemoryFile(size)
    try:
        with store_errors(url, 'reading'):
            entries = _entries(manifest)
            if manifest is not None and not any(e['size'] == size for e in entries):
                raise CheckpointCorruptError(
                    f'checkpoint {url} is damaged: it is {size} bytes, its manifest '
                    f'{url}{SIDECAR_SUFFIX} says {entries[0]["size"]} (truncated or '
                    'overwritten); it was not loaded'
                )
            _read_hashed(fs, path, size, entries, url, into=memory.data)
        if manifest is None:
            from stratagem import env

            from .errors import UnverifiedCheckpointWarning

            env.warn_rank_zero(
                f'{url} has no stratagem manifest (written by mmengine or plain torch.save?), '
                'so its integrity cannot be verified; loading it anyway',
                UnverifiedCheckpointWarning,
                stacklevel=3,
            )
        is_zip = _sniff_bytes(bytes(memory.data[:4]), url)
        if is_zip and memory.path is not None and _to_device(map_location):
            # mapped, then copied to the device: one copy in host memory, not two, and no
            # mapping outlives the load (on CPU the tensors would keep the whole memfd)
            return _torch_load(url, map_location, trust_pickled_code, True, is_zip, memory.path)
        raw = _BufferReader(memory.data)
        try:
            source = io.BufferedReader(raw, buffer_size=1 << 16)
            return _torch_load(url, map_location, trust_pickled_code, False, is_zip, source)
        finally:
            raw.close()
    finally:
        memory.close()


def _to_device(map_location: Any) -> bool:
    """Whether ``map_location`` names one device other than the CPU (``'cuda:0'``)."""
    import torch

    if not isinstance(map_location, (str, torch.device)):
        return False
    try:
        return torch.device(map_location).type != 'cpu'
    except (RuntimeError, ValueError):
        return False


class _BufferReader(io.RawIOBase):
    """A read-only, seekable file over the verified bytes, without copying them (a
    ``BytesIO`` would hold a second copy while ``torch.load`` builds the tensors)."""

    def __init__(self, data: Any) -> None:
        super().__init__()
        self._view = memoryview(data)
        self._pos = 0

    def close(self) -> None:
        if not self.closed:
            self._view.release()  # so a mapped buffer can be unmapped
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._pos)
        if n <= 0:
            return 0
        memoryview(buffer).cast('B')[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getbuffer(self) -> memoryview:
        """The bytes (``load._has_zip_end`` reads the tail of a truncated archive)."""
        return self._view


def _entries(manifest: dict | None) -> list[dict]:
    """The ``files`` entries the object may match: the manifest's, then the one it
    replaces (a same-name save that died between its manifest and its object)."""
    if manifest is None:
        return []
    entries = list(manifest['files'][:1])
    old = manifest.get('replaces')
    if isinstance(old, dict) and isinstance(old.get('files'), list) and old['files']:
        entries.append(old['files'][0])
    return entries


def _read_hashed(
    fs: Any, path: str, size: int, entries: list[dict], url: str, *, into: Any = None
) -> Any:
    """The object's bytes, read once (into ``into``, a writable buffer of ``size`` bytes,
    else a new bytearray); checked against one of ``entries`` (any, when empty)."""
    algos = {entry_digest(e)[0] for e in entries}
    hashers = {algo: new_hasher(algo) for algo in algos}
    data = bytearray(size) if into is None else into
    with memoryview(data) as view:
        # parallel ranged GETs on S3 (transfer.py), each into its place; hashed once complete
        done = transfer.read_into(fs, path, view)
        for hasher in hashers.values():
            hasher.update(view[:done])
    if done != size:
        raise CheckpointCorruptError(
            f'checkpoint {url} is damaged: reading it gave {done} of its {size} bytes; it was '
            'not loaded'
        )
    if entries and not any(
        hashers[entry_digest(e)[0]].hexdigest() == entry_digest(e)[1] and e['size'] == size
        for e in entries
    ):
        algo, expected = entry_digest(entries[0])
        raise CheckpointCorruptError(
            f'checkpoint {url} is damaged: {algo} is {hashers[algo].hexdigest()}, its manifest '
            f'{url}{SIDECAR_SUFFIX} says {expected}; it was not loaded'
        )
    return data


def _found(url: str, backend_args: Mapping | None) -> tuple[Any, str, dict | None, int]:
    """The checkpoint object at ``url``: its filesystem and path, its manifest (None
    without one) and its size; a FileNotFoundError naming ``url`` when it is not there."""
    fs, path = filesystem(url, backend_args)
    manifest = read_manifest_at(url, backend_args)
    with store_errors(url, 'reading'):
        try:
            return fs, path, manifest, _size(fs, path)
        except FileNotFoundError:
            raise FileNotFoundError(f'checkpoint not found: {url}') from None


def identity(url: str, backend_args: Mapping | None = None) -> dict:
    """What makes ``url`` the same checkpoint for every rank (``agree.checkpoint_identity``):
    its size and its manifest's digest (none: its size and ETag-like info)."""
    _, _, manifest, size = _found(url, backend_args)
    if manifest is not None:
        return {
            'kind': 'file',
            'size': size,
            'digest': ':'.join(entry_digest(manifest['files'][0])),
        }
    return {'kind': 'file', 'size': size}


def read_pointer(directory: str, backend_args: Mapping | None = None) -> str | None:
    """The URL in ``directory/last_checkpoint``; None without a pointer. A pointer naming a
    bare name or path is taken relative to ``directory``."""
    fs, path = filesystem(directory, backend_args)
    with store_errors(directory, 'reading'):
        try:
            raw = _call(_read_small, fs, f'{path.rstrip("/")}/{POINTER_NAME}')
        except FileNotFoundError:
            return None
    text = raw[:4097].decode('utf-8', errors='replace').strip()
    if not text or '\n' in text or len(raw) > 4096:
        raise ValueError(
            f'{directory}/{POINTER_NAME} does not hold a checkpoint URL: {text[:80]!r}'
        )
    return text if is_url(text) else join(directory, text.rsplit('/', 1)[-1])


def list_checkpoints(directory: str, backend_args: Mapping | None = None) -> list[RemoteCheckpoint]:
    """Checkpoints directly under ``directory`` whose manifest is present and lists their
    object's size, newest first (by manifest step, then creation time); nothing is hashed,
    and an object no manifest lists is never one."""
    return survey(directory, backend_args).committed


@dataclass(frozen=True)
class Listing:
    """One listing of a checkpoint location ``directory`` (``fs``, ``path`` in it): the
    ``entries`` directly under it (``fs.ls(detail=True)``: objects and "directories") and the
    ``committed`` checkpoints among them, newest first. Retention deletes and looks for
    debris from the same listing (``store_debris.remove_debris``): a store charges each
    listing and each manifest read."""

    directory: str
    fs: Any
    path: str
    entries: list[dict]
    committed: list[RemoteCheckpoint]

    @functools.cached_property
    def files(self) -> dict[str, dict]:
        """The objects directly under the location (not its "directories"), by name."""
        return {entry_name(e): e for e in self.entries if e.get('type', 'file') == 'file'}

    @functools.cached_property
    def committed_names(self) -> set[str]:
        """The names of the ``committed`` checkpoints."""
        return {c.url.rsplit('/', 1)[-1] for c in self.committed}


def entry_name(entry: Mapping) -> str:
    """The last part of a listing entry's name (an object's, or a "directory"'s)."""
    return str(entry['name']).rstrip('/').rsplit('/', 1)[-1]


def survey(directory: str, backend_args: Mapping | None = None) -> Listing:
    """One listing of ``directory`` and its committed checkpoints (``list_checkpoints``):
    one LIST request, then one GET per manifest (a sidecar, or a directory's
    ``manifest.json``)."""
    directory = absolute(directory)
    fs, path = filesystem(directory, backend_args)
    path = path.rstrip('/')
    with store_errors(directory, 'listing'):
        try:
            entries = _call(fs.ls, path, detail=True, refresh=True)
            fs.invalidate_cache(path)  # see _size
        except FileNotFoundError as err:
            if 'bucket' in str(err).lower():
                raise
            return Listing(directory, fs, path, [], [])
        sizes = {entry_name(e): e.get('size') for e in entries}
        from .remote_directory import list_directories

        found = list_directories(fs, path, directory, entries)
        for name in sorted(sizes):
            if not name.endswith(SIDECAR_SUFFIX):
                continue
            target = name[: -len(SIDECAR_SUFFIX)]
            if target not in sizes or target.startswith('.'):
                continue
            try:
                manifest = parse_manifest(
                    _call(_read_small, fs, f'{path}/{name}'), join(directory, name)
                )
            except (CheckpointCorruptError, FileNotFoundError):
                continue
            if _lists(manifest, sizes[target]):
                found.append(RemoteCheckpoint(join(directory, target), manifest, sizes[target]))
    found.sort(key=RemoteCheckpoint.sort_key, reverse=True)
    return Listing(directory, fs, path, entries, found)


def find_latest(directory: str, backend_args: Mapping | None = None) -> str | None:
    """The checkpoint to resume from at ``directory`` (``latest.find_latest_checkpoint`` for
    a URL): the pointer's target when its manifest lists it (its bytes are verified when
    loaded), else, with a ``CheckpointWarning``, the newest checkpoint a manifest lists;
    None when there is none."""
    from stratagem import env

    from .errors import CheckpointWarning

    directory = absolute(directory)
    reason = None
    try:
        target = read_pointer(directory, backend_args)
    except ValueError as err:
        target, reason = None, str(err)
    committed = list_checkpoints(directory, backend_args)
    if target is not None:
        if any(c.url == target for c in committed) or _listed_elsewhere(target, backend_args):
            return target
        reason = (
            f'{directory}/{POINTER_NAME} points to {target}, which no manifest lists (missing, '
            'or an upload that never completed)'
        )
    if not committed:
        if reason is not None:
            env.warn_rank_zero(
                f'{reason}, and {directory} holds no other committed checkpoint',
                CheckpointWarning,
                stacklevel=2,
            )
        return None
    newest = committed[0]
    env.warn_rank_zero(
        f'{reason or f"{directory}/{POINTER_NAME} is missing"}; resuming from the newest '
        f'committed checkpoint {newest.url} (step {newest.step})',
        CheckpointWarning,
        stacklevel=2,
    )
    return newest.url


def _listed_elsewhere(target: str, backend_args: Mapping | None) -> bool:
    """Whether ``target`` (a pointer naming another prefix) has a manifest listing it."""
    try:
        manifest = read_manifest_at(target, backend_args)
        if manifest is None:
            return False
        fs, path = filesystem(target, backend_args)
        size = _size(fs, path)
    except (OSError, ValueError):
        return False
    return _lists(manifest, size)


# --------------------------------------------------------------------------- retention
def apply_retention(
    directory: str,
    max_keep_ckpts: int,
    *,
    protect: Iterable[str] = (),
    pattern: str | None = None,
    backend_args: Mapping | None = None,
) -> list[str]:
    """Delete checkpoints at ``directory`` beyond the newest ``max_keep_ckpts``
    (``retention.apply_retention`` for a URL; ``<= 0`` keeps all): never the newest ones, the
    pointed-to one, or one in ``protect``. Then the debris of interrupted uploads of that
    series (``store_debris.remove_debris``: never anything a live upload may be writing, nor
    anything under a name in ``protect``: pass a save still in flight there). One listing
    serves both. Returns the checkpoints' URLs removed. Call it after the newest checkpoint's
    pointer moved."""
    if type(max_keep_ckpts) is not int:
        raise TypeError(f'max_keep_ckpts must be an int (<= 0 keeps all), got {max_keep_ckpts!r}')
    listing = survey(directory, backend_args)
    kept = {absolute(p) for p in protect if p}
    removed = []
    if max_keep_ckpts > 0:
        series = [
            c
            for c in listing.committed
            if pattern is None or fnmatch.fnmatch(c.url.rsplit('/', 1)[-1], pattern)
        ]
        keep = {c.url for c in series[:max_keep_ckpts]} | kept
        try:
            pointed = read_pointer(listing.directory, backend_args)
        except ValueError:
            pointed = None
        if pointed is not None:
            keep.add(pointed)
        for info in series[max_keep_ckpts:]:
            if info.url not in keep:
                _delete(info, backend_args)
                removed.append(info.url)
    from .store_debris import remove_debris  # it reads this module's listings

    remove_debris(listing.directory, backend_args, pattern=pattern, keep=kept, listing=listing)
    return removed


def delete_checkpoint(
    url: str, *, protect: Iterable[str] = (), backend_args: Mapping | None = None
) -> bool:
    """Delete the checkpoint at ``url`` (a replaced best one); refused (False) when no
    manifest lists it, when the pointer names it, or when it is in ``protect``."""
    url = absolute(url)
    directory = parent(url)
    found = [c for c in list_checkpoints(directory, backend_args) if c.url == url]
    if not found:
        return False
    try:
        pointed = read_pointer(directory, backend_args)
    except ValueError:
        pointed = None
    if url == pointed or url in {absolute(p) for p in protect if p}:
        return False
    _delete(found[0], backend_args)
    return True


def _delete(info: RemoteCheckpoint, backend_args: Mapping | None) -> None:
    """Delete a listed checkpoint, routed by the manifest in hand (no request to ask)."""
    if info.manifest.get('kind') == 'directory':
        from .remote_directory import remove_directory

        remove_directory(info.url, backend_args)
        return
    # the object first: a kill before the manifest goes leaves a manifest listing nothing
    fs, path = filesystem(info.url, backend_args)
    with store_errors(info.url, 'deleting'):
        for target in (path, path + SIDECAR_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                _call(fs.rm_file, target)
