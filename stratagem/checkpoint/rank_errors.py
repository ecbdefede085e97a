"""One error exchange across ranks, for the directory protocol and DCP reads: whether every
rank succeeded (one small all-gather of keys), the first failure raised on every rank naming
its rank, and DCP's ``CheckpointException`` unwrapped to each rank's own cause."""

from __future__ import annotations

from typing import Any

from .errors import CheckpointVoteError, RankError

__all__ = [
    'NOTHING_COMMITTED',
    'all_ok',
    'dcp_failures',
    'describe_error',
    'failed_on',
    'raise_first',
    'raised_here',
]

#: what a save's failure on a rank adds when it ended the save before any commit
NOTHING_COMMITTED = '; nothing was committed'


def all_ok(failed: bool, *values: Any) -> bool:
    """True on every rank when no rank ``failed`` and every rank holds the same ``values``:
    one small collective (``all_gather_keys``); callers exchange the details (messages,
    which rank) with ``env.all_gather_object`` only when it is False, on every rank alike."""
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    views = env.all_gather_keys([int(failed), *map(env.key_of, values)])
    return all(view == (0, *views[0][1:]) for view in views)


def dcp_failures(error: BaseException) -> dict[int, BaseException]:
    """The ranks' own errors inside DCP's ``CheckpointException`` (``{rank: error}``); {}
    for any other error."""
    failures = getattr(error, 'failures', None)
    if not isinstance(failures, dict):
        return {}
    # each value is (exception, traceback) or the exception
    return {
        rank: cause[0] if isinstance(cause, tuple) else cause
        for rank, cause in sorted(failures.items())
    }


def raised_here(
    error: BaseException, own: BaseException | None, rank: int, what: str
) -> BaseException:
    """What this rank (``rank``) raises when DCP's save raised ``error``: the error of its
    own step as it raised it (``own``, which DCP carried to the others as a ``RankError``),
    its own cause inside DCP's ``CheckpointException``, or, where only other ranks failed, a
    ``CheckpointVoteError`` naming the first as the vote says it (``what``; that nothing was
    committed, but for rank 0's failure, which may be its commit's, after the rename); else
    ``error``. DCP's wrapper is left out of what it shows (its cause is kept)."""
    failures = dcp_failures(error)
    raised: BaseException
    if own is None and failures and rank not in failures:
        other, cause = next(iter(failures.items()))
        after = '' if other == 0 else NOTHING_COMMITTED
        raised = failed_on(what, other, describe_error(cause), CheckpointVoteError, after)
        raised.__cause__ = cause
    else:
        raised = own if own is not None else failures.get(rank, error)
    if raised is not error:
        raised.__suppress_context__ = True
    return raised


def failed_on(
    what: str,
    rank: int,
    message: str,
    error_type: type[Exception] = RuntimeError,
    after: str = '',
) -> Exception:
    """The error the other ranks raise for ``rank``'s failure (``message``, then ``after``,
    e.g. ``NOTHING_COMMITTED``)."""
    return error_type(f'{what} failed on rank {rank}: {message}{after}')


def describe_error(error: BaseException) -> str:
    """``Type: message``; DCP's ``CheckpointException`` (whose message lists only rank
    numbers) with its first rank's own error."""
    failures = dcp_failures(error)
    if failures:
        rank, cause = next(iter(failures.items()))
        more = f' (ranks {list(failures)})' if len(failures) > 1 else ''
        return f'{type(error).__name__}: rank {rank}: {describe_error(cause)}{more}'
    if isinstance(error, RankError):
        return str(error)
    return f'{type(error).__name__}: {error}'


def raise_first(
    outcomes: list[str | None],
    mine: BaseException | None,
    what: str,
    error_type: type[Exception] = RuntimeError,
    after: str = '',
) -> None:
    """Raise on every rank if any rank failed: this rank's own error, else one naming the
    rank (``failed_on``)."""
    failed = [(rank, msg) for rank, msg in enumerate(outcomes) if msg is not None]
    if not failed:
        return
    if isinstance(mine, Exception):
        raise mine
    rank, msg = failed[0]
    # a BaseException (DCP's CheckpointException) becomes an Exception, so that callers'
    # `except Exception` error exchange sees it on this rank as on the others
    raise failed_on(what, rank, msg, error_type, after) from mine
