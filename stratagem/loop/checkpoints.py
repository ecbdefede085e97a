"""Periodic checkpoints and their retention, and the one save every checkpoint of the loop
goes through (the periodic ones, the last one, a preemption's, the best).

``iter_{N}.pth`` every ``checkpoint_interval`` iterations (or ``default_hooks.checkpoint``'s
interval), at the end and at a preemption stop; then ``max_keep_ckpts`` keeps the newest,
never the one resumed from nor the best (the protected files). Each save's ``meta`` holds the
position (``iter``, ``epoch``), the metrics' folder relative to work_dir (``metrics_dir``: a
resume appends there) and save_best's best so far, and its time on the loop's thread is
the meter's stall. ``on_commit(path, iteration)`` (a host's, e.g. Ray's report) hears of each
save once it is committed: a synchronous save when it returns (every rank knows the vote's
outcome), an asynchronous one when the next save or the end has waited for it.

``default_hooks.checkpoint.peer_interval``: every that many iterations each rank's state,
with the same ``meta``, is committed as a peer copy (``checkpoint/peer.py``), which a
restart of the whole job prefers to an older checkpoint; in the background: the loop's
thread copies the state into CPU memory, a writer thread commits it (``close_peer`` waits
for the last one).
"""

from __future__ import annotations

import os.path as osp
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stratagem import checkpoint as ckpt
from stratagem.checkpoint import location
from stratagem.checkpoint.location import is_url, join

if TYPE_CHECKING:
    from stratagem.checkpoint.peer import PeerCopies

    from .meter import Meter
    from .validation import BestCheckpoint

__all__ = ['Checkpoints']


class Checkpoints:
    """``every``: iterations between saves (0: only at the end and at a stop);
    ``max_keep``: None or <= 0 keeps all; ``best``: save_best's state, or None;
    ``directory``: where they go (default the work_dir; a path or URL for mmengine's
    ``out_dir``, ``checkpoint/location.py``)."""

    def __init__(
        self,
        strategy: Any,
        every: int,
        max_keep: int | None,
        epoch_length: int,
        max_iters: int,
        best: BestCheckpoint | None,
        meter: Meter,
        *,
        directory: str | None = None,
    ) -> None:
        self.strategy, self.every, self.max_keep = strategy, every, max_keep
        self.directory = strategy.work_dir if directory is None else directory
        self.epoch_length, self.max_iters = epoch_length, max_iters
        self.best, self.meter = best, meter
        self.main = strategy.rank == 0
        self.saved_at = -1
        self.on_commit: Callable[[str, int], None] | None = None
        self._uncommitted: tuple[str, int] | None = None  # an async save not yet waited for
        self.last_path: str | None = strategy.resumed_from  # a rollback's target
        self.anomalies: Any = None  # train_cfg.anomaly's state, kept in every save's meta
        #: ``default_hooks.checkpoint.peer_interval``'s copies (``checkpoint/peer.py``), and
        #: the iterations between them
        self.peer: PeerCopies | None = None
        self.peer_every = 0

    def meta(self, it: int) -> dict[str, Any]:
        """A save's ``meta`` after iteration ``it`` (a peer copy's too: the same state)."""
        meta: dict[str, Any] = {
            'iter': it,
            'epoch': it // self.epoch_length,
            # where a resume of this run appends its metrics (relative: the work_dir may move)
            'metrics_dir': osp.relpath(self.meter.metrics_dir, self.strategy.work_dir),
        }
        if self.best is not None:
            meta.update(self.best.meta())
        if self.anomalies is not None:
            meta.update(self.anomalies.meta())
        return meta

    def save(self, name: str, it: int) -> str:
        """Save ``directory/name`` after iteration ``it``; returns its path."""
        meta = self.meta(it)
        t_save = time.perf_counter()
        in_work_dir = self.directory == self.strategy.work_dir  # relative: under work_dir
        target = name if in_work_dir else join(self.directory, name)
        path = self.strategy.save_checkpoint(target, extra_ckpt={'meta': meta})
        self.meter.add_stall(time.perf_counter() - t_save)
        self.meter.flush()  # the rows on disk as far as the checkpoint goes
        self.last_path = path
        if self.on_commit is not None:
            # save_checkpoint waited for the previous asynchronous save: committed now
            committed, self._uncommitted = self._uncommitted, None
            if committed is not None:
                self.on_commit(*committed)
            if self.strategy.async_checkpoint:
                self._uncommitted = (path, it)
            else:
                self.on_commit(path, it)
        return path

    def due(self, it: int, stop: bool) -> bool:
        """After iteration ``it``: every ``every`` iterations, at the end, at a stop."""
        return bool(self.every and it % self.every == 0) or it == self.max_iters or stop

    def after_step(self, it: int) -> None:
        """Save ``iter_{it}.pth``, then apply the retention."""
        path = self.save(f'iter_{it}.pth', it)
        self.saved_at = it
        self.retain()
        self.strategy.logger.debug('saved %s', path)

    def peer_due(self, it: int) -> bool:
        """After iteration ``it``: every ``peer_every`` iterations, but at the end (the last
        checkpoint is saved there)."""
        return bool(self.peer is not None and self.peer_every and it % self.peer_every == 0) and (
            it < self.max_iters
        )

    def copy_to_peer(self, it: int) -> None:
        """Commit each rank's state after iteration ``it`` as a peer copy (here and at its
        holder; the previous copy waited for, this one snapshotted, then written in the
        background); its time on the loop's thread is the meter's stall."""
        assert self.peer is not None
        t_copy = time.perf_counter()
        self.strategy.save_peer_copy(self.peer, extra_ckpt={'meta': self.meta(it)})
        self.meter.add_stall(time.perf_counter() - t_copy)

    def close_peer(self) -> None:
        """At the end: the copy in flight committed (or its error raised), the peer
        writer's staging memory freed."""
        if self.peer is not None:
            self.peer.close()

    def forget_peer_copies(self) -> None:
        """After a rollback: the copies are of iterations the run no longer stands on."""
        if self.peer is not None:
            self.peer.clear()

    def retain(self) -> None:
        """``max_keep_ckpts`` (rank 0): the newest ``iter_*`` checkpoints, the protected kept."""
        if not (self.main and self.max_keep):
            return
        if is_url(self.directory):  # after the pointer moved: never the newest
            # an async save may still be uploading: its name's older debris is not touched
            location.apply_retention(
                self.directory,
                int(self.max_keep),
                protect=[*self.protected(), *([self.last_path] if self.last_path else [])],
                pattern='iter_*',
                backend_args=self.strategy.checkpointer.backend_args,
            )
        else:
            ckpt.apply_retention(
                self.directory, int(self.max_keep), protect=self.protected(), pattern='iter_*'
            )

    def delete(self, name: str) -> None:
        """Delete ``directory/name`` once every save started before is committed."""
        self.strategy.wait_for_checkpoints()
        if not self.main:
            return
        path = join(self.directory, name)
        if is_url(path):
            location.delete_checkpoint(
                path,
                protect=self.protected(),
                backend_args=self.strategy.checkpointer.backend_args,
            )
        else:
            ckpt.delete_checkpoint(path, protect=self.protected())

    def protected(self) -> list[str]:
        """The checkpoint resumed from and the best: never deleted."""
        kept = [self.strategy.resumed_from] if self.strategy.resumed_from else []
        if self.best is not None and self.best.filename:
            kept.append(join(self.directory, self.best.filename))
        return kept

    def finish(self) -> None:
        """Once the last save is committed: the retention an async save's ``after_step`` ran
        before its commit (it did not count that one yet)."""
        if self.strategy.async_checkpoint:
            self.retain()
        if self._uncommitted is not None and self.on_commit is not None:
            committed, self._uncommitted = self._uncommitted, None
            self.on_commit(*committed)
