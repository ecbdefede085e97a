"""What a store's failure is, and the bounded retry of an idempotent request to it.

The client libraries already retry, each request on its own, and the policy here adds to
them only what they leave:

* botocore (under s3fs) retries throttling (``SlowDown``, ``503``), ``500``/``502``/``504``
  and connection errors with exponential backoff and jitter: its ``legacy`` mode by default,
  5 attempts; ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` or
  ``backend_args=dict(config_kwargs=dict(retries=dict(mode='standard', max_attempts=N)))``
  change it.
* s3fs repeats a request that botocore gave up on when the answer is ``SlowDown`` or a
  broken transport (5 tries, 0.1 s x 1.7^n apart), not a ``500 InternalError`` nor a
  ``503 ServiceUnavailable``.
* gcsfs retries 429 and 5xx answers itself; other fsspec filesystems mostly do not.

:func:`call` repeats a request whose error :func:`kind` calls transient (``throttled``,
``server``, ``reset``) up to ``POLICY.attempts`` times, ``uniform(0, min(cap, base *
2**n))`` seconds apart ("full jitter": many ranks or runs throttled together do not retry in
step), never past ``POLICY.deadline`` seconds; then the last error goes on with the number
of attempts and the seconds spent (:func:`retried`), for ``location.store_errors`` to name.
Only requests that may run twice go through it: a PUT of a complete small object, a read,
a listing, a delete. An unreachable endpoint is not retried here (botocore already tried it
again; a wrong endpoint must be named quickly), nor refused credentials, nor a missing
object.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ['POLICY', 'RetryPolicy', 'call', 'codes', 'kind', 'retried']

T = TypeVar('T')

_THROTTLED_WORDS = ('SlowDown', 'reduce your request rate', 'Throttl', 'TooManyRequests', '429')
_RESET_NAMES = ('ConnectionClosed', 'ReadTimeout', 'ConnectTimeout', 'ResponseStreamingError')
_RESET_ERRNOS = {errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT}
_REMOTE_IO = getattr(errno, 'EREMOTEIO', 121)


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all (1: no retry) of one request, ``uniform(0, min(cap, base *
    2**n))`` s after the n-th failure, none starting after ``deadline`` s."""

    attempts: int = 4
    base: float = 1.0
    cap: float = 16.0
    deadline: float = 120.0

    def delay(self, failures: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap, self.base * 2 ** (failures - 1)))


#: the policy of :func:`call`; the client's own retries are configured through it
#: (``backend_args``' ``config_kwargs``, ``AWS_MAX_ATTEMPTS``)
POLICY = RetryPolicy()
_RNG = random.Random()


def codes(err: BaseException) -> str:
    """The store's error code and HTTP status of ``err`` or its causes, as text."""
    parts = []
    seen = 0
    while err is not None and seen < 5:
        response = getattr(err, 'response', None)
        if isinstance(response, dict):
            parts.append(str(response.get('Error', {}).get('Code', '')))
            parts.append(str(response.get('ResponseMetadata', {}).get('HTTPStatusCode', '')))
        code = getattr(err, 'code', None)  # gcsfs's HttpError, aiohttp's errors
        if isinstance(code, int):
            parts.append(str(code))
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
        seen += 1
    return ' '.join(p for p in parts if p)


def kind(err: BaseException) -> str | None:
    """``'throttled'`` (SlowDown, 503, 429), ``'server'`` (500, 502, 504), ``'reset'`` (a
    connection closed or timed out mid-request), or None (not transient: refused
    credentials, a missing bucket or object, an unreachable endpoint, damaged bytes)."""
    if isinstance(err, (PermissionError, FileNotFoundError, FileExistsError)):
        return None
    name = type(err).__name__
    if 'EndpointConnection' in name or isinstance(err, ConnectionRefusedError):
        return None
    text = f'{err} {codes(err)}'
    if any(word in text for word in _THROTTLED_WORDS) or ' 503' in f' {codes(err)}':
        return 'throttled'
    number = err.errno if isinstance(err, OSError) else None
    if number == errno.EBUSY:  # s3fs's SlowDown and ServiceUnavailable
        return 'throttled'
    if number == _REMOTE_IO or any(f' {s}' in f' {codes(err)}' for s in ('500', '502', '504')):
        return 'server'
    if (
        isinstance(err, (ConnectionResetError, ConnectionAbortedError, TimeoutError))
        or number in _RESET_ERRNOS
        or any(n in name for n in _RESET_NAMES)
    ):
        return 'reset'
    return None


def retried(err: BaseException) -> tuple[int, float] | None:
    """``(attempts, seconds)`` :func:`call` spent before it let ``err`` go; None when it did
    not retry it."""
    return getattr(err, 'stratagem_retried', None)


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, repeated by :data:`POLICY` while it fails transiently."""
    policy = POLICY
    start = time.monotonic()
    failures = 0
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            failures += 1
            if kind(err) is None:
                raise
            pause = policy.delay(failures, _RNG)
            spent = time.monotonic() - start
            if failures >= policy.attempts or spent + pause > policy.deadline:
                err.stratagem_retried = (failures, spent)  # type: ignore[attr-defined]
                raise
            time.sleep(pause)
