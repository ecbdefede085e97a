"""A watchdog that names the rank that stopped answering, instead of waiting forever.

A collective with a stopped peer (``SIGSTOP``, a stuck data loader, a machine that froze)
either waits forever (NCCL without error handling, a store wait) or fails after the process
group's timeout with a transport error that does not say which peer it waited for (gloo's
"Timed out waiting ... for recv"). So every rank runs a thread that, every ``beat`` s:

1. posts ``"<count> <iteration> <what>"`` under its own key of the process group's store:
   ``count`` proves the process lives, ``iteration`` and ``what`` (set by the loop through
   ``at``, two attribute writes per step, no formatting) say where its main thread is;
2. reads every other rank's key: a rank whose count stood still for ``stale`` s is
   *silent* (stopped or dead), one whose count moves but whose position stood still is
   *stuck* (alive, its main thread blocked, e.g. in its data loader);
3. when a peer has been silent for ``timeout + grace`` s while this rank's main thread made
   no progress either, logs the verdict and ends the process (``os._exit(1)``; a blocked
   collective cannot be interrupted otherwise), so every rank ends within ``timeout`` + a
   few seconds; torchrun's agent then restarts the group (``--max-restarts``).

When the main thread fails first (gloo's timeout), ``Watchdog.__exit__`` raises
``RankUnresponsiveError`` from it, naming the rank, its last position, and what this rank
was waiting in; with ``hard_exit`` the process ends ``grace`` s later if something (a
process group's teardown) still blocks its exit.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

__all__ = ['Watchdog', 'RankUnresponsiveError']

log = logging.getLogger('stratagem')


class RankUnresponsiveError(RuntimeError):
    """A peer stopped answering (silent or stuck); the message names it."""


class Watchdog:
    """Heartbeats through the store (see module doc). ``timeout``: the process group's
    timeout in seconds (``dist_cfg.timeout``); ``grace``: seconds past it before this rank
    ends itself. A no-op without a process group of two or more ranks."""

    def __init__(self, timeout: float, *, grace: float = 10.0, hard_exit: bool = True) -> None:
        if not timeout > 0:
            raise ValueError(f'Watchdog timeout should be > 0 seconds, got {timeout!r}')
        self.timeout, self.grace, self.hard_exit = float(timeout), float(grace), hard_exit
        self.beat = max(0.05, min(1.0, self.timeout / 10))
        self.stale = min(self.timeout / 2, max(3.0, 5 * self.beat))
        self.iteration, self.doing = 0, 'starting'
        self.rank, self.world_size = 0, 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, list[Any]] = {}  # rank -> [value, beat seen at, moved at]
        self._mine: tuple[int, str] = (0, 'starting')
        self._mine_moved = time.monotonic()
        self._store_lost: float | None = None

    def at(self, iteration: int, doing: str) -> None:
        """Where the main thread is: ``iteration`` (1-based, the one running) and a constant
        string saying what it does (``'forward, backward, update'``, ``'loading data'``)."""
        self.iteration, self.doing = iteration, doing

    def __enter__(self) -> Watchdog:
        from stratagem.env.dist import get_rank, get_world_size

        self.rank, self.world_size = get_rank(), get_world_size()
        if self.world_size > 1:
            from stratagem.env.store import store_client

            self._store = store_client()
            self._thread = threading.Thread(
                target=self._run, daemon=True, name='stratagem-watchdog'
            )
            self._thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.beat + 1)
        if exc is None or not isinstance(exc, Exception):
            return
        verdict = self.verdict()
        if verdict is None:
            return
        if self.hard_exit:  # the process group's teardown may block on the stopped peer
            timer = threading.Timer(self.grace, _hard_exit, (verdict,))
            timer.daemon = True
            timer.start()
        raise RankUnresponsiveError(verdict) from exc

    # --------------------------------------------------------------------- thread
    def _key(self, rank: int) -> str:
        return f'stratagem/watchdog/{rank}'

    def _run(self) -> None:
        count = 0
        keys = [self._key(r) for r in range(self.world_size)]
        while not self._stop.wait(self.beat):
            count += 1
            now = time.monotonic()
            mine = (self.iteration, self.doing)
            if mine != self._mine:
                self._mine, self._mine_moved = mine, now
            try:
                self._store.set(keys[self.rank], f'{count} {mine[0]} {mine[1]}')
            except Exception:  # noqa: BLE001 - the store is gone
                self._store_lost = self._store_lost or now
                continue
            polled = self._poll_each(keys)
            if polled is None:
                self._store_lost = self._store_lost or now
                continue
            self._store_lost = None
            values = polled
            peers = [r for r in range(self.world_size) if r != self.rank]
            for r, value in zip(peers, values):
                self._see(r, value, now)
            silent = self._silent(now, self.timeout + self.grace)
            if silent and now - self._mine_moved >= self.timeout + self.grace:
                _hard_exit(self.verdict() or '')

    def _poll_each(self, keys: list[str]) -> list[str] | None:
        others = [k for r, k in enumerate(keys) if r != self.rank]
        try:  # a get of a key not posted yet would block: check first
            if self._store.check(others):
                return [v.decode() for v in self._store.multi_get(others)]
            return [self._store.get(k).decode() if self._store.check([k]) else '' for k in others]
        except Exception:  # noqa: BLE001 - the store itself stopped answering
            return None

    def _see(self, rank: int, value: str, now: float) -> None:
        count, _, rest = value.partition(' ')
        position = rest
        seen = self._peers.get(rank)
        if seen is None:
            self._peers[rank] = [count, now, position, now]
            return
        if count != seen[0]:
            seen[0], seen[1] = count, now
        if position != seen[2]:
            seen[2], seen[3] = position, now

    def _silent(self, now: float, after: float) -> list[int]:
        return sorted(r for r, s in self._peers.items() if now - s[1] >= after)

    # -------------------------------------------------------------------- verdict
    def verdict(self) -> str | None:
        """Which ranks stopped answering and what this rank waited in; None if all answer."""
        now = time.monotonic()
        waiting = f'rank {self.rank} was waiting in iteration {self.iteration} ({self.doing})'
        if self._store_lost is not None and now - self._store_lost >= self.stale:
            return (
                f'the process group store stopped answering {now - self._store_lost:.0f} s ago '
                f'(its host: the launcher, or rank 0 without torchrun); {waiting}'
            )
        silent = self._silent(now, self.stale)
        if silent:
            parts = [
                f'rank {r} (no heartbeat for {now - self._peers[r][1]:.0f} s; last at '
                f'iteration {self._peers[r][2]})'
                for r in silent
            ]
            return (
                f'{", ".join(parts)} stopped answering (stopped or dead): {waiting}, '
                f'which needs {"them" if len(silent) > 1 else "it"}'
            )
        here = f'{self.iteration} {self.doing}'
        stuck = sorted(
            r for r, s in self._peers.items() if now - s[3] >= self.stale and s[2] != here
        )
        if stuck:
            parts = [
                f'rank {r} (alive, but at iteration {self._peers[r][2]} for '
                f'{now - self._peers[r][3]:.0f} s)'
                for r in stuck
            ]
            return f'{", ".join(parts)} stopped making progress: {waiting}'
        return None


def _hard_exit(verdict: str) -> None:
    message = (
        f'stratagem watchdog: {verdict}; ending this process (exit status 1) instead of '
        'waiting forever'
    )
    log.error(message)
    sys.stderr.write(message + '\n')
    sys.stderr.flush()
    os._exit(1)
