"""The commit vote of a distributed save: every rank alive and done before rank 0 commits.

Runs on the process group's key-value store under its own prefix, never as a collective on a
process group: a background writer that issued collectives on the training group would
interleave with the training loop's collectives and deadlock (DCP's thread mode does), and a
collective with a dead peer fails without saying which peer. With the store:

The vote talks to the group's store server over connections of its own (``_own_store``),
so it never shares a socket with the training thread. Waits block on the store
(``store.wait``), so each step starts as soon as the previous one is posted: the vote adds a
few store round trips (well under a millisecond each) to a save, no polling delay.

1. Every rank starts a heartbeat (a counter it bumps every ``timeout / 8`` s, at most 1 s)
   for as long as it takes part in the save.
2. Every rank posts ``ready/{rank}``: ``ok`` once its files are written (with a payload for
   rank 0, e.g. the manifest entries of its files), or its error. A directory save also
   uses ``publish``/``receive`` first, for rank 0 to hand the staging directory out.
3. Rank 0, before committing (``wait_ready``): waits for every ``ready``; a rank whose
   heartbeat stood still for ``timeout`` s without posting is named as dead or stuck, a rank
   that posted an error is named with it. Either way rank 0 does not commit.
4. Rank 0 posts ``outcome``: ``ok`` or its error. The other ranks wait for it
   (``wait_outcome``) under the same heartbeat rule for rank 0, post ``read/{rank}`` and
   raise rank 0's error; rank 0 returns once every live rank has read it (its process hosts
   the store and may exit right after the last save).

So an error on any rank, or a rank that died, ends the save on every surviving rank within
about ``timeout`` s of the last sign of life, with the rank named, and nothing is committed.
Once every rank has the outcome, each deletes its keys (rank 0 the shared ones), after the
save returns, on a helper thread (``_tidy``; every save's keys have a prefix of their own,
so no later save reads them): the store's server, in rank 0's process, keeps nothing of the
saves of a long run, and no save waits for the deletions' round trips.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import CheckpointVoteError
from .rank_errors import NOTHING_COMMITTED, failed_on

__all__ = ['SaveVote']

_OK = 'ok'
_OK_MARK, _ERROR_MARK = '+', '-'  # a ready value: '+payload' or '-error'
_SAVES = itertools.count()  # every rank saves in the same order, so the ids agree


_STORES: tuple[Any, _LockedStore, _LockedStore | Any] | None = None  # (inner, rw, waiter)
_STORE_LOCK = threading.Lock()
_TIDY: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # closed votes' cleanups
_TIDIER: threading.Thread | None = None


def _tidy(job: Callable[[], None]) -> None:
    """Run ``job`` (a closed vote's cleanup) on the helper thread, in the order given. The
    process waits for what is pending when it exits (``_drain``, at most 10 s): a daemon
    thread still inside a store request while the interpreter tears the stores down aborts
    the process ("terminate called without an active exception", seen after a run's last
    save)."""
    global _TIDIER
    with _STORE_LOCK:
        if _TIDIER is None or not _TIDIER.is_alive():
            if _TIDIER is None:
                atexit.register(_drain)
            _TIDIER = threading.Thread(target=_tidy_loop, daemon=True, name='stratagem-vote-tidy')
            _TIDIER.start()
    _TIDY.put(job)


def _drain() -> None:
    wait_tidied(10.0)


def _tidy_loop() -> None:
    while True:
        job = _TIDY.get()
        try:
            job()
        except Exception:  # noqa: BLE001 - best effort: a key left costs a few bytes
            pass


def wait_tidied(timeout: float = 30.0) -> bool:
    """Wait until the cleanups of every vote closed so far ran (tests count the store's
    keys); False if that took longer than ``timeout`` s."""
    done = threading.Event()
    _tidy(done.set)
    return done.wait(timeout)


# The heartbeats of this process's open votes, all on one thread (``_beat_loop``), so that
# opening a vote starts no thread: a vote's first beat is due at once, the next every
# ``vote.beat`` s. Beats are sent outside the lock (a slow store holds up no vote's opening
# or closing); a closed vote's keys are deleted only once no beat of it is in flight
# (``_beaten``), which would post ``alive`` again.
_BEATING: dict[SaveVote, float] = {}  # open vote -> when its next beat is due
_IN_FLIGHT: set[SaveVote] = set()
_BEAT = threading.Condition()
_BEATER: threading.Thread | None = None


def _beat(vote: SaveVote) -> None:
    global _BEATER
    with _BEAT:
        _BEATING[vote] = 0.0
        if _BEATER is None or not _BEATER.is_alive():  # the first, or a forked child's
            _BEATER = threading.Thread(
                target=_beat_loop, daemon=True, name='stratagem-ckpt-heartbeat'
            )
            _BEATER.start()
        _BEAT.notify_all()


def _unbeat(vote: SaveVote) -> None:
    with _BEAT:
        _BEATING.pop(vote, None)


def _beaten(vote: SaveVote) -> None:
    """Return once no beat of ``vote`` (closed) is in flight."""
    with _BEAT:
        _BEAT.wait_for(lambda: vote not in _IN_FLIGHT)


def _beat_loop() -> None:
    while True:
        with _BEAT:
            now = time.monotonic()
            due = [vote for vote, when in _BEATING.items() if when <= now]
            _IN_FLIGHT.update(due)
        for vote in due:
            alive = vote.heartbeat()
            with _BEAT:
                _IN_FLIGHT.discard(vote)
                if vote in _BEATING:
                    if alive:
                        _BEATING[vote] = time.monotonic() + vote.beat
                    else:  # the store is gone: the waits report it
                        del _BEATING[vote]
                _BEAT.notify_all()
        with _BEAT:
            if not any(when <= time.monotonic() for when in _BEATING.values()):
                nearest = min(_BEATING.values(), default=None)
                _BEAT.wait(None if nearest is None else max(0.0, nearest - time.monotonic()))


def _after_fork() -> None:  # the parent's beater (and a lock it held) are not in the child
    global _BEAT, _BEATER
    _BEAT, _BEATER = threading.Condition(), None
    _BEATING.clear()
    _IN_FLIGHT.clear()


os.register_at_fork(after_in_child=_after_fork)


class _LockedStore:
    """One store client shared by this process's vote threads, one request at a time (a
    store client is a single socket: requests from two threads must not interleave)."""

    def __init__(self, store: Any) -> None:
        self._store, self._lock = store, threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def locked(*args: Any) -> Any:
            with self._lock:
                return method(*args)

        return locked


def _own_store() -> tuple[_LockedStore, Any]:
    """Two clients of the process group's store that are ours alone: new connections to the
    same TCPStore server (the training thread may use the default client meanwhile), one
    for requests (heartbeats, posts) and one for the blocking waits, so a wait never holds
    up a heartbeat; or the default store itself when it is not a TCPStore (FileStore,
    HashStore: thread-safe, no socket to share)."""
    global _STORES
    import torch.distributed as dist

    from stratagem._torch import default_store

    with _STORE_LOCK:
        base = default_store()
        rw: _LockedStore
        waiter: Any
        inner = base
        while hasattr(inner, 'underlying_store'):  # PrefixStore layers
            inner = inner.underlying_store
        # the default store object itself is the key (held, so its id is never reused): a
        # process group destroyed and created again gets clients of the new server
        if _STORES is None or _STORES[0] is not inner:
            if isinstance(inner, dist.TCPStore) and hasattr(base, 'clone'):
                # clones keep the default store's prefixes (torchrun's ``/worker/attempt_N``):
                # a restarted group shares the launcher's store with the attempt it replaces,
                # whose unfinished saves left keys that an unprefixed vote would read as its own
                rw, waiter = _LockedStore(base.clone()), _LockedStore(base.clone())
            elif isinstance(inner, dist.TCPStore):
                rw, waiter = (
                    _LockedStore(
                        dist.TCPStore(
                            inner.host,
                            inner.port,
                            is_master=False,
                            wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=300),
                        )
                    )
                    for _ in range(2)
                )
            else:
                rw, waiter = _LockedStore(base), base
            _STORES = (inner, rw, waiter)
        return _STORES[1], _STORES[2]


class SaveVote:
    """One distributed save's vote (see module doc). ``open`` returns None without a
    process group, so callers need no branch for a single process.

    Every wait blocks on the store (``store.wait``), so it returns as soon as the awaited key
    is posted (no polling delay on the save's critical path); it checks the peers'
    heartbeats every ``timeout / 4`` s (at most 30 s) meanwhile.
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        timeout: float,
        what: str,
        waiter: Any | None = None,
    ) -> None:
        self._store, self._prefix = store, prefix
        self._waiter = waiter if waiter is not None else store
        self.rank, self.world_size, self.timeout, self.what = rank, world_size, timeout, what
        self.beat = max(0.05, min(1.0, timeout / 8))  # s between heartbeats
        # a blocking wait returns the moment its key is posted; it times out (and c10d logs
        # a warning) only after this long, to check the peers' heartbeats: a quarter of the
        # timeout, at most 30 s (so a rank that died is named within timeout + 30 s)
        self._chunk = max(self.beat, min(timeout / 4, 30.0))
        self._seen: dict[int, tuple[int | None, float]] = {}  # rank -> (beats, when seen)
        self._dead: set[int] = set()  # ranks found dead: nobody waits for them again
        self._settled = False  # the outcome reached every rank: the keys can go
        self._posted: list[str] = []  # this rank's keys, deleted once settled
        self.ready_posted = False  # step 2 done on this rank
        self.concluded = False  # step 4 done on this rank: the outcome is known (or posted)
        _beat(self)

    @classmethod
    def open(cls, timeout: float, what: str) -> SaveVote | None:
        """Start the vote of the next save (every rank, same order); None outside a group."""
        from stratagem import env  # imported on use: see checkpoint/__init__.py

        if env.get_world_size() == 1:  # 1 also when there is no process group
            return None
        prefix = f'stratagem/ckpt/{next(_SAVES)}/'
        store, waiter = _own_store()
        return cls(
            store, prefix, env.get_rank(), env.get_world_size(), float(timeout), what, waiter
        )

    # ------------------------------------------------------------------ steps
    def publish(self, name: str, value: str) -> None:
        """Rank 0 shares ``value`` (e.g. the staging directory) with the other ranks."""
        self._set(f'share/{name}', value)

    def receive(self, name: str) -> str:
        """Another rank: the value rank 0 gave to ``publish`` (waits for it, watching rank 0)."""
        self._await([f'share/{name}'], {0}, f'share {name}')
        return self._get(f'share/{name}')

    def ready(self, error: str | None = None, payload: str | None = None) -> None:
        """Step 2: this rank's files are written (``error`` None; ``payload``, e.g. their
        manifest entries, goes to rank 0) or it failed."""
        self._set(
            f'ready/{self.rank}',
            _OK_MARK + (payload or '') if error is None else _ERROR_MARK + error,
        )
        self.ready_posted = True

    def wait_ready(self) -> list[str]:
        """Step 3 (rank 0): every rank's ``ready`` payload, in rank order; raise
        ``CheckpointVoteError`` naming the first rank that failed, died or stalled."""
        keys = [f'ready/{r}' for r in range(self.world_size)]
        self._await(keys, set(range(self.world_size)), 'finish writing')
        payloads = []
        for rank, key in enumerate(keys):
            value = self._get(key)
            if value.startswith(_ERROR_MARK):
                raise failed_on(
                    self.what,
                    rank,
                    value[len(_ERROR_MARK) :],
                    CheckpointVoteError,
                    NOTHING_COMMITTED,
                )
            payloads.append(value[len(_OK_MARK) :])
        return payloads

    def wait_others(self) -> None:
        """A rank whose own part failed: wait until every other rank posted ``ready`` (ok or
        its error); raise ``CheckpointVoteError`` naming those that died or stalled instead
        (e.g. a peer killed in the middle of a collective write, which made this rank's part
        fail first with a bare connection error)."""
        others = set(range(self.world_size)) - {self.rank}
        self._await([f'ready/{r}' for r in sorted(others)], others, 'finish writing')

    def post_outcome(self, error: str | None, *, wait: bool = True) -> None:
        """Step 4 (rank 0): the commit happened (``error`` None) or not. Returns once every
        live rank has read it: the store's server runs in rank 0's process, which may exit
        right after the save, and a rank still polling would lose the outcome with it.
        ``wait=False``: at once (rank 0 was interrupted: the others may be in a collective
        it leaves, and learn it there when its process ends)."""
        self.concluded = True
        self._set('outcome', _OK if error is None else error)
        if not wait:
            return
        pending = set(range(1, self.world_size)) - self._dead
        try:
            self._await([f'read/{r}' for r in sorted(pending)], pending, 'read the outcome')
        except CheckpointVoteError:
            return  # a rank died meanwhile: nobody is left to tell
        self._settled = not self._dead  # every rank has the outcome: close() may clean up

    def wait_outcome(self) -> None:
        """Step 4 (other ranks): return once rank 0 committed; raise its error otherwise."""
        self.concluded = True
        self._await(['outcome'], {0}, 'commit')
        value = self._get('outcome')
        self._set(f'read/{self.rank}', _OK)
        self._settled = True  # rank 0 has this rank's ready; only the read flag must stay
        if value != _OK:
            raise CheckpointVoteError(
                value if value.startswith(self.what) else f'{self.what} failed on rank 0: {value}'
            )

    def settle(self) -> None:
        """Steps 2-4 happened elsewhere: the save's writer carried every rank's result and
        rank 0's outcome in collectives of its own (``directory.CollectiveCommit``: DCP's),
        so every rank has the outcome and no key of steps 2-4 was posted."""
        self.concluded = self._settled = True

    def close(self) -> None:
        """Leave the vote: a rank other than 0 marks the outcome read (also when it failed on
        its own and never waited for it), then this rank's heartbeat stops."""
        self.concluded = True
        _unbeat(self)
        if self.rank != 0 and not self._settled:
            _beaten(self)  # rank 0 deletes this rank's keys once it has read: none after
            try:
                self._set(f'read/{self.rank}', _OK)
            except Exception:  # noqa: BLE001 - the store is gone: rank 0 is not waiting
                pass
        keys = []
        if self._settled:  # nobody reads these keys again: the store server keeps no trace
            # (a rank's ``read`` flag is rank 0's to delete: it may still be waiting for it)
            keys = [k for k in self._posted if not k.startswith('read/')]
            keys.append(f'alive/{self.rank}')
            if 'outcome' in self._posted:  # rank 0, after every rank read it: theirs too
                keys += [
                    f'{key}/{r}'
                    for r in range(1, self.world_size)
                    for key in ('read', 'ready', 'alive')
                ]
        _tidy(lambda: self._delete(keys))

    def _delete(self, keys: list[str]) -> None:
        """After the heartbeat stopped (it would post ``alive`` again), ``keys`` go."""
        _beaten(self)
        for key in keys:
            try:
                self._store.delete_key(self._prefix + key)
            except Exception:  # noqa: BLE001 - best effort: a key left costs a few bytes
                pass

    # --------------------------------------------------------------- internals
    def heartbeat(self) -> bool:
        """One beat (the beater's thread); False once the store is gone (the waits report
        it)."""
        try:
            self._store.add(f'{self._prefix}alive/{self.rank}', 1)
        except Exception:  # noqa: BLE001 - the store went away: the waits report it
            return False
        return True

    def _await(self, keys: list[str], watch: set, doing: str) -> None:
        """Block until every key in ``keys`` is posted. Between blocking waits (``_chunk``
        s each): raise if a rank in ``watch`` that has not posted its key stalled for
        ``timeout`` s; a non-zero rank also stops early on an error outcome of rank 0's
        (it gave up on this save, e.g. before publishing)."""
        if not keys:
            return
        full = [self._prefix + k for k in keys]
        while True:
            try:
                self._waiter.wait(full, datetime.timedelta(seconds=self._chunk))
                return
            except Exception:  # noqa: BLE001 - a timeout; a lost store fails in the checks below
                pass
            missing = {k for k, f in zip(keys, full) if not self._store.check([f])}
            if not missing:
                return
            if (
                self.rank != 0
                and 'outcome' not in keys
                and self._store.check([self._prefix + 'outcome'])
            ):
                value = self._get('outcome')
                if value != _OK:
                    raise CheckpointVoteError(
                        value
                        if value.startswith(self.what)
                        else f'{self.what} failed on rank 0: {value}'
                    )
            # the rank that owes a key is its last part (ready/3, read/1); rank 0 owes the rest
            owing = {
                int(k.rsplit('/', 1)[1]) if k.rsplit('/', 1)[1].isdigit() else 0 for k in missing
            }
            self._check_alive(owing & watch or watch, doing)

    def _check_alive(self, ranks: set, doing: str) -> None:
        """Raise naming the ranks among ``ranks`` whose heartbeat stood still for timeout s."""
        now = time.monotonic()
        seen = self._seen
        for rank in ranks:
            count = self._store.add(f'{self._prefix}alive/{rank}', 0)
            if count != seen.get(rank, (None, now))[0]:
                seen[rank] = (count, now)
        stalled = sorted(r for r in ranks if now - seen[r][1] >= self.timeout)
        if stalled:
            self._dead.update(stalled)
            names = ', '.join(f'rank {r}' for r in stalled)
            raise CheckpointVoteError(
                f'{self.what} failed: {names} did not {doing} and showed no sign of life for '
                f'{self.timeout:g} s (dead or stuck); nothing was committed. Raise '
                'checkpoint_timeout if saves are this slow; otherwise resume from the previous '
                'checkpoint'
            )

    def _set(self, key: str, value: str) -> None:
        self._store.set(self._prefix + key, value)
        self._posted.append(key)

    def _get(self, key: str) -> str:
        return self._store.get(self._prefix + key).decode()
