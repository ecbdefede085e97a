"""What an interrupted upload leaves at a checkpoint URL, its removal, and the write probe.

A save at a URL (``location.py``) uploads the object, then its manifest, then the pointer; a
process killed or refused between leaves **debris**, which no reader trusts (nothing no
manifest lists is ever loaded) but which costs storage:

* an **unlisted object**: a file directly under the prefix that no manifest lists (its
  manifest never went up), or a probe object of a killed ``stratagem doctor``;
* an **orphan manifest**: a manifest whose object is gone (a deletion killed between the
  object and its manifest);
* an **incomplete multipart upload** (S3): parts stored, never completed, invisible to a
  listing, billed until aborted.

:func:`find_debris` lists them (``stratagem doctor`` shows them); :func:`remove_debris`
(retention at a URL runs it) deletes those that **began before the newest committed
checkpoint's manifest was written**, by the store's own clock (``LastModified``; for a
multipart upload its newest part's, or its ``Initiated`` without parts). The rule keeps every
live upload: a run's saves at a URL upload one after another (a save waits for the previous
one), so an upload still running began after the newest commit; what began before it belongs
to a save that ended without committing.
Two runs writing into one prefix at once break the rule (keep one run per prefix, as the
work_dir name does). Nothing is removed while the prefix holds no committed checkpoint, and
"directories" (the sharded layouts' prefixes) are never looked into.

:func:`probe_writable` writes a small object beside the checkpoints and removes it: a
location that cannot be written is named before a run trains toward its first save.
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .location import (
    POINTER_NAME,
    absolute,
    filesystem,
    join,
    list_checkpoints,
    store_errors,
)
from .manifest import SIDECAR_SUFFIX
from .store_retry import call

__all__ = ['PROBE_PREFIX', 'Debris', 'find_debris', 'probe_writable', 'remove_debris']

#: the name of the write probe's object (hidden: never a checkpoint)
PROBE_PREFIX = '.stratagem-probe-'


@dataclass(frozen=True)
class Debris:
    """One piece of debris: its URL, what it is, when it began (seconds since the epoch by
    the store's clock: a multipart upload's newest part; None when the store does not say),
    its size (None: unknown; a multipart upload's: its parts') and, for a multipart upload,
    its id."""

    url: str
    kind: str  # 'unlisted object', 'orphan manifest', 'incomplete multipart upload'
    began: float | None
    size: int | None
    upload_id: str | None = None

    def describe(self) -> str:
        size = '' if self.size is None else f', {self.size} bytes'
        return f'{self.url} ({self.kind}{size})'


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


def _listing(directory: str, backend_args: Mapping | None) -> tuple[Any, str, dict[str, dict]]:
    fs, path = filesystem(directory, backend_args)
    with store_errors(directory, 'listing'):
        try:
            entries = call(fs.ls, path, detail=True, refresh=True)
        except FileNotFoundError as err:
            if 'bucket' in str(err).lower():
                raise
            entries = []
        fs.invalidate_cache(path)
    files = {
        e['name'].rstrip('/').rsplit('/', 1)[-1]: e
        for e in entries
        if e.get('type', 'file') == 'file'
    }
    return fs, path, files


def find_debris(directory: str, backend_args: Mapping | None = None) -> list[Debris]:
    """The debris directly under ``directory`` (the module docstring), oldest first."""
    directory = absolute(directory)
    return _debris(directory, *_survey(directory, backend_args))


def _survey(directory: str, backend_args: Mapping | None) -> tuple[Any, str, dict, list]:
    """The filesystem and path, the files directly under ``directory`` and the committed
    checkpoints there (the files listed first: a checkpoint committed in between has no
    listed manifest, so it neither is debris nor moves the cutoff)."""
    fs, path, files = _listing(directory, backend_args)
    return fs, path, files, list_checkpoints(directory, backend_args)


def _debris(directory: str, fs: Any, path: str, files: dict, committed: list) -> list[Debris]:
    listed = {c.url.rsplit('/', 1)[-1] for c in committed}
    found = []
    for name, entry in files.items():
        if name == POINTER_NAME or name in listed:
            continue
        if name.endswith(SIDECAR_SUFFIX):
            target = name[: -len(SIDECAR_SUFFIX)]
            if target in files:  # a manifest of a present object: a checkpoint, or damaged
                continue
            kind = 'orphan manifest'
        else:
            kind = 'unlisted object'
        found.append(Debris(join(directory, name), kind, _began(entry), entry.get('size')))
    found.extend(_incomplete_uploads(fs, path, directory))
    found.sort(key=lambda d: (d.began is None, d.began or 0.0, d.url))
    return found


def _incomplete_uploads(fs: Any, path: str, directory: str) -> list[Debris]:
    """S3's multipart uploads begun directly under ``path`` and never completed (other
    stores: none; a GCS resumable upload expires by itself within a week)."""
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
                rest = upload['Key'][len(prefix) :]
                if '/' in rest:  # under a deeper prefix: not this directory's
                    continue
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
                        join(directory, rest),
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
    directory: str, backend_args: Mapping | None = None, *, pattern: str | None = None
) -> list[Debris]:
    """Delete the debris under ``directory`` that began before its newest committed
    checkpoint's manifest was written (the module docstring's rule), and only the debris
    of checkpoints: an incomplete multipart upload, a probe object, or an object (an
    orphan manifest: its object) whose name matches ``pattern`` (e.g. ``'iter_*'``; without
    one, a checkpoint's suffix: ``.pth``, ``.pt``, ``.ckpt``, ``.bin``, ``.safetensors``),
    so that another file kept in the prefix is listed, never removed. Returns what was
    removed."""
    directory = absolute(directory)
    fs, path, files, committed = _survey(directory, backend_args)
    commits = [_began(files.get(c.url.rsplit('/', 1)[-1] + SIDECAR_SUFFIX, {})) for c in committed]
    known = [t for t in commits if t is not None]
    if not known:
        return []
    cutoff = max(known)
    removed = []
    for debris in _debris(directory, fs, path, files, committed):
        name = debris.url.rsplit('/', 1)[-1]
        base = name[: -len(SIDECAR_SUFFIX)] if debris.kind == 'orphan manifest' else name
        if debris.began is None or debris.began >= cutoff:
            continue
        if not _ours(debris, base, pattern):
            continue
        target = f'{path.rstrip("/")}/{name}'
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
            else:
                with contextlib.suppress(FileNotFoundError):
                    call(fs.rm_file, target)
        removed.append(debris)
    return removed


_CHECKPOINT_SUFFIXES = ('.pth', '.pt', '.ckpt', '.bin', '.safetensors')


def _ours(debris: Debris, base: str, pattern: str | None) -> bool:
    """Whether ``debris`` (of an object named ``base``) is a checkpoint's, which retention
    may remove (:func:`remove_debris`)."""
    if debris.upload_id is not None or base.startswith(PROBE_PREFIX):
        return True
    if pattern is None:
        return base.endswith(_CHECKPOINT_SUFFIXES)
    return fnmatch.fnmatch(base, pattern)


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
