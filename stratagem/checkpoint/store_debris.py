"""What an interrupted upload leaves at a checkpoint URL, its removal, and the write probe.

A save at a URL (``location.py``, ``remote_directory.py``) uploads the objects, then the
manifest, then the pointer; a process killed or refused between leaves **debris**, which no
reader trusts (nothing no manifest lists is ever loaded) but which costs storage:

* an **unlisted object**: a file directly under the prefix that no manifest lists (its
  manifest never went up), or a probe object of a killed ``stratagem doctor``;
* an **orphan manifest**: a manifest whose object is gone (a deletion killed between the
  object and its manifest);
* an **unlisted directory**: a "directory" under the prefix holding objects but no
  ``manifest.json`` (a directory save, FSDP's or DeepSpeed's, that died before its commit,
  or a deletion killed after the manifest went);
* an **incomplete multipart upload** (S3): parts stored, never completed, invisible to a
  listing, billed until aborted; directly under the prefix or under one of its
  directories.

:func:`find_debris` lists them (``stratagem doctor`` shows them); :func:`remove_debris`
(retention at a URL runs it) deletes those that **began before the newest committed
checkpoint's manifest was written**, by the store's own clock (``LastModified``; a directory's
newest object; a multipart upload's newest part, or its ``Initiated`` without parts; the
newest commit: the newest manifest beside the objects, and the ``manifest.json`` of the
newest directory checkpoint by step), and **never anything under a name in** ``keep`` (the
checkpoint a save is writing now: retention's ``protect``). The rule keeps every live
upload, on any rank: a run's saves at a URL upload one after another (a save, on every rank,
begins after the previous one committed), so an upload still running began after the newest
commit; what began before it belongs to a save that ended without committing. A save in
flight under the name of older debris (a run rolled back, saving an iteration again) is
kept by ``keep``: deleting that debris could delete its new objects of the same names. An
unlisted directory is removed object by object, the objects it held when listed, never by
a fresh listing of its name.
Two runs writing into one prefix at once break the rule (keep one run per prefix, as the
work_dir name does). Nothing is removed while the prefix holds no committed checkpoint, and
only debris of the checkpoint series: a name matching retention's ``pattern`` (without one:
a single file's checkpoint suffix; an unlisted directory is then only listed), so another
file or folder kept in the prefix (logs a logger copies there) is listed, never removed.

:func:`probe_writable` writes a small object beside the checkpoints and removes it: a
location that cannot be written is named before a run trains toward its first save.
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .location import (
    POINTER_NAME,
    Listing,
    absolute,
    entry_name,
    filesystem,
    join,
    store_errors,
    survey,
)
from .manifest import DIR_MANIFEST, SIDECAR_SUFFIX
from .store_retry import call

__all__ = ['PROBE_PREFIX', 'Debris', 'find_debris', 'probe_writable', 'remove_debris']

#: the name of the write probe's object (hidden: never a checkpoint)
PROBE_PREFIX = '.stratagem-probe-'


@dataclass(frozen=True)
class Debris:
    """One piece of debris: its URL, what it is, when it began (seconds since the epoch by
    the store's clock: a directory's newest object, a multipart upload's newest part; None
    when the store does not say), its size (None: unknown; a multipart upload's: its parts';
    a directory's: its objects'), for a multipart upload its id, and for a directory the
    paths of its objects in the filesystem (what removing it deletes)."""

    url: str
    #: 'unlisted object', 'orphan manifest', 'unlisted directory', 'incomplete multipart upload'
    kind: str
    began: float | None
    size: int | None
    upload_id: str | None = None
    objects: tuple[str, ...] = ()

    def describe(self) -> str:
        n = len(self.objects)
        count = f', {n} object{"s" * (n != 1)}' if self.kind == 'unlisted directory' else ''
        size = '' if self.size is None else f', {self.size} bytes'
        return f'{self.url} ({self.kind}{count}{size})'


def _seconds(value: Any) -> float | None:
    """A listing's time (a datetime, an ISO string, or seconds) as seconds; None if absent."""
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return _seconds(datetime.datetime.fromisoformat(value.replace('Z', '+00:00')))
    return None


def _began(entry: Mapping) -> float | None:
    for key in ('LastModified', 'last_modified', 'updated', 'mtime', 'created'):
        if entry.get(key) is not None:
            return _seconds(entry[key])
    return None


def find_debris(directory: str, backend_args: Mapping | None = None) -> list[Debris]:
    """The debris under ``directory`` (the module docstring), oldest first: one listing of
    the prefix, one of each unlisted directory, one of the multipart uploads."""
    return _debris(survey(directory, backend_args))


def _debris(listing: Listing, explore: Callable[[str], bool] = lambda name: True) -> list[Debris]:
    """The debris in ``listing`` (its committed checkpoints are never debris: a checkpoint
    committed after the listing has no listed manifest, so it neither is debris nor moves
    the cutoff). A folder without a manifest is listed (one request) only if ``explore``
    says so of its name (retention: only one it may remove)."""
    directory, fs, path = listing.directory, listing.fs, listing.path
    listed, files = listing.committed_names, listing.files
    found = []
    for name, entry in files.items():
        if name == POINTER_NAME or name in listed:
            continue
        if name.endswith(SIDECAR_SUFFIX):
            if name[: -len(SIDECAR_SUFFIX)] in files:  # beside its object: a checkpoint, or damaged
                continue
            kind = 'orphan manifest'
        else:
            kind = 'unlisted object'
        found.append(Debris(join(directory, name), kind, _began(entry), entry.get('size')))
    for entry in listing.entries:
        name = entry_name(entry)
        if (
            entry.get('type') == 'directory'
            and name not in listed
            and not name.startswith('.')
            and explore(name)
        ):
            found.extend(_unlisted_directory(fs, f'{path}/{name}', join(directory, name)))
    found.extend(_incomplete_uploads(fs, path, directory))
    found.sort(key=lambda d: (d.began is None, d.began or 0.0, d.url))
    return found


def _unlisted_directory(fs: Any, root: str, url: str) -> list[Debris]:
    """The "directory" ``root`` as debris when it holds objects and no ``manifest.json`` (one
    that does is a checkpoint, damaged, or another tool's: never debris)."""
    fs.invalidate_cache(root)
    with store_errors(url, 'listing'):
        try:
            objects = call(fs.find, root, detail=True)
        except FileNotFoundError:
            return []
        finally:
            fs.invalidate_cache(root)
    objects = {k: v for k, v in objects.items() if v.get('type', 'file') == 'file'}
    if not objects or any(k.rsplit('/', 1)[-1] == DIR_MANIFEST for k in objects):
        return []
    times = [_began(e) for e in objects.values()]
    return [
        Debris(
            url,
            'unlisted directory',
            None if None in times else max(t for t in times if t is not None),
            sum(int(e.get('size') or 0) for e in objects.values()),
            objects=tuple(sorted(objects)),
        )
    ]


def _incomplete_uploads(fs: Any, path: str, directory: str) -> list[Debris]:
    """S3's multipart uploads begun under ``path`` (directly, or under one of its
    directories) and never completed (other stores: none; a GCS resumable upload expires by
    itself within a week)."""
    if not hasattr(fs, 'call_s3') or not hasattr(fs, 'split_path'):
        return []
    bucket, key, _ = fs.split_path(path)
    prefix = f'{key.rstrip("/")}/' if key else ''
    found = []
    with store_errors(directory, 'listing'):
        marker: dict[str, str] = {}
        while True:
            answer = call(
                fs.call_s3, 'list_multipart_uploads', Bucket=bucket, Prefix=prefix, **marker
            )
            for upload in answer.get('Uploads') or []:
                parts = (
                    call(
                        fs.call_s3,
                        'list_parts',
                        Bucket=bucket,
                        Key=upload['Key'],
                        UploadId=upload['UploadId'],
                    ).get('Parts')
                    or []
                )
                times = [_seconds(p.get('LastModified')) for p in parts]
                times.append(_seconds(upload.get('Initiated')))
                known = [t for t in times if t is not None]
                found.append(
                    Debris(
                        join(directory, upload['Key'][len(prefix) :]),
                        'incomplete multipart upload',
                        max(known) if known else None,
                        sum(int(p.get('Size') or 0) for p in parts),
                        upload['UploadId'],
                    )
                )
            if not answer.get('IsTruncated'):
                return found
            marker = {
                'KeyMarker': answer.get('NextKeyMarker', ''),
                'UploadIdMarker': answer.get('NextUploadIdMarker', ''),
            }


def remove_debris(
    directory: str,
    backend_args: Mapping | None = None,
    *,
    pattern: str | None = None,
    keep: Iterable[str] = (),
    listing: Listing | None = None,
) -> list[Debris]:
    """Delete the debris under ``directory`` that began before its newest committed
    checkpoint's manifest was written and lies under no name in ``keep`` (URLs or names:
    the checkpoint a save is writing now), and only the debris of checkpoints: an incomplete
    multipart upload directly under ``directory``, a probe object, or an object, directory or
    upload under a directory whose name matches ``pattern`` (e.g. ``'iter_*'``; an orphan
    manifest: its object's name); without ``pattern``, an object with a checkpoint's suffix
    (``.pth``, ``.pt``, ``.ckpt``, ``.bin``, ``.safetensors``) and an upload under a
    committed directory checkpoint; so that another file kept in the prefix is listed,
    never removed (the module docstring). ``listing``: this directory's, when the caller
    has one (``location.apply_retention``), spares listing it again. Returns what was
    removed."""
    listing = survey(directory, backend_args) if listing is None else listing
    directory, fs, path = listing.directory, listing.fs, listing.path
    kept = {str(k).rstrip('/').rsplit('/', 1)[-1] for k in keep if k}
    committed = listing.committed_names
    candidates = []

    def removable(name: str) -> bool:  # an unlisted folder retention may remove
        return name not in kept and pattern is not None and fnmatch.fnmatch(name, pattern)

    for debris in _debris(listing, removable):
        relative = debris.url[len(directory) :].lstrip('/')
        top = relative.split('/', 1)[0]
        if debris.kind == 'orphan manifest':
            top = top[: -len(SIDECAR_SUFFIX)]
        mine = debris.began is not None and top not in kept
        if mine and _ours(debris, top, '/' in relative, pattern, committed):
            candidates.append((debris, f'{path}/{relative}'))
    cutoff = _newest_commit(listing) if candidates else None
    if cutoff is None:
        return []
    removed = []
    for debris, target in candidates:
        if debris.began is None or debris.began >= cutoff:
            continue
        with store_errors(debris.url, 'deleting'):
            if debris.upload_id is not None:
                bucket, key, _ = fs.split_path(target)
                call(
                    fs.call_s3,
                    'abort_multipart_upload',
                    Bucket=bucket,
                    Key=key,
                    UploadId=debris.upload_id,
                )
            elif debris.objects:  # exactly what was listed, all older than the cutoff
                with contextlib.suppress(FileNotFoundError):
                    call(fs.rm, list(debris.objects))
                fs.invalidate_cache(target)
            else:
                with contextlib.suppress(FileNotFoundError):
                    call(fs.rm_file, target)
        removed.append(debris)
    return removed


def _newest_commit(listing: Listing) -> float | None:
    """When the newest committed checkpoint's manifest was written, by the store's clock:
    the newest sidecar manifest in the listing, and (one request) the ``manifest.json`` of
    the newest directory checkpoint by step. None without a committed checkpoint."""
    files = listing.files
    times = []
    for info in listing.committed:
        name = info.url.rsplit('/', 1)[-1]
        if info.manifest.get('kind') != 'directory':
            times.append(_began(files.get(name + SIDECAR_SUFFIX, {})))
    newest_directory = next(
        (c for c in listing.committed if c.manifest.get('kind') == 'directory'), None
    )
    if newest_directory is not None:
        name = newest_directory.url.rsplit('/', 1)[-1]
        where = f'{listing.path}/{name}/{DIR_MANIFEST}'
        # (a FileNotFoundError: deleted since it was listed)
        with store_errors(newest_directory.url, 'listing'), contextlib.suppress(FileNotFoundError):
            times.append(_began(call(listing.fs.info, where)))
    known = [t for t in times if t is not None]
    return max(known) if known else None


_CHECKPOINT_SUFFIXES = ('.pth', '.pt', '.ckpt', '.bin', '.safetensors')


def _ours(debris: Debris, top: str, nested: bool, pattern: str | None, committed: set) -> bool:
    """Whether ``debris`` (under the name ``top`` directly under the prefix; ``nested``:
    deeper) is a checkpoint's, which retention may remove (:func:`remove_debris`)."""
    nested = nested or debris.kind == 'unlisted directory'
    if not nested and (debris.upload_id is not None or top.startswith(PROBE_PREFIX)):
        return True
    if pattern is not None:
        return fnmatch.fnmatch(top, pattern)
    if nested:
        return debris.upload_id is not None and top in committed
    return top.endswith(_CHECKPOINT_SUFFIXES)


def probe_writable(directory: str, backend_args: Mapping | None = None) -> str:
    """Write a small object into ``directory`` and remove it: a location the credentials
    may not write raises ``CheckpointLocationError`` naming it (and the fix) now. Returns
    the probe's URL."""
    directory = absolute(directory)
    fs, path = filesystem(directory, backend_args)
    name = f'{PROBE_PREFIX}{secrets.token_hex(6)}'
    url = join(directory, name)
    target = f'{path.rstrip("/")}/{name}'
    with store_errors(url, 'probing'):
        call(fs.pipe_file, target, b'stratagem doctor: may this location be written?\n')
        call(fs.rm_file, target)
    return url
