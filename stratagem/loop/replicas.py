"""The reference loop's side of a replica group (``strategy.fault_tolerance``,
``strategies/replica_groups.py``): the batches read from the job's sample stream, the loop's
position and the schedulers shipped with a heal, the first quorum before any resume, the
checkpoints written by one group, and each heal's log line and metrics row.

The first quorum decides where a group starts: a live peer ahead of it (at step > 0) gives
it the state in memory and the loop continues at the peer's iteration, no checkpoint read;
otherwise (every group at step 0: a fresh job, or a whole job restarted) each group resumes
from storage as a run without replica groups does, and the job's progress (committed steps,
the sample cursor) comes back from the checkpoint's ``meta['replica_group']``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ['Replicas']


class Replicas:
    """One group's loop glue. ``next_iter``: the iteration the loop is about to run (a
    peer that heals from this group continues there); :meth:`iteration` after each
    iteration: the loop's next iteration, the peer's after a heal."""

    def __init__(self, strategy: Any, batches: Any, optim_wrapper: Any, seed: int | None) -> None:
        group = strategy.replica_group
        if seed is None:
            raise ValueError(
                f'replica group {group.replica_id}: strategy.fault_tolerance needs a seed every '
                'group shares (randomness=dict(seed=N) or --seed N): the groups read one '
                'sample order, drawn from it'
            )
        self.group, self.strategy = group, strategy
        self.next_iter = 0
        self.jump: int | None = None
        self.rows: list[tuple[int, dict[str, float]]] = []  # heals not yet written
        self.meter: Any = None
        batches.follow(group, optim_wrapper, seed)
        group.share('loop', self._state, self._load)
        group.on_heal.append(self._healed)

    def first_quorum(self) -> int | None:
        """Join the job; the peer's iteration when this group healed from one, else None
        (resume from storage, or start)."""
        self.group.begin_step()
        if any(h.step > 0 for h in self.group.heals):
            return self.jump
        # torchft's initial sync (every group at step 0) shipped a peer's start: the
        # position is this group's own, or the checkpoint's it resumes next
        self.jump = None
        return None

    def resumed(self, checkpoint: Mapping | None) -> None:
        """After a resume from storage: the job's progress from its ``meta``."""
        meta = (checkpoint or {}).get('meta') or {}
        position = meta.get('replica_group')
        if position is not None:
            self.group.restore(position)

    def iteration(self, it: int) -> int:
        """The loop's next iteration after iteration ``it - 1`` ran: ``it``, or after a heal
        during it, the one after the peer's."""
        if self.jump is not None:
            it, self.jump = self.jump + 1, None
        self.flush(it)
        return it

    def finish(self, it: int) -> None:
        """The run's last line of the group: its step and its state's digest (every group
        of a job ends with the same)."""
        group = self.group
        self.strategy.logger.info(
            f'replica group {group.replica_id}: finished at iteration {it}, step {group.step}; '
            f'state digest {group.digest()}'
        )
        group.shutdown()

    def writes_checkpoints(self) -> bool:
        """Whether this group saves the job's checkpoints (the lowest live one)."""
        return bool(self.group.writes_checkpoints())

    def flush(self, it: int) -> None:
        """Write the heals' rows once the meter is there."""
        if self.meter is None or not self.rows:
            return
        rows, self.rows = self.rows, []
        if self.meter.main:
            epoch = max(it - 1, 0) // self.meter.epoch_length + 1
            for at, values in rows:
                self.meter.metrics.write_scalars(max(at, it), epoch, values)

    # ---- what a heal ships and receives ---------------------------------------------------
    def _state(self) -> dict[str, Any]:
        schedulers = self.strategy.param_schedulers
        return {
            'iter': self.next_iter,
            'schedulers': None if schedulers is None else self.strategy.scheduler_state_dict(),
        }

    def _load(self, state: Mapping[str, Any]) -> None:
        self.jump = int(state['iter'])
        if state.get('schedulers') is not None and self.strategy.param_schedulers is not None:
            self.strategy.load_scheduler_state_dict(state['schedulers'])

    def _healed(self, heal: Any) -> None:
        if heal.step > 0:
            self.rows.append(
                (
                    int(self.jump or 0),
                    {
                        'replica/healed_from': float(heal.peer),
                        'replica/heal_step': float(heal.step),
                        'replica/heal_seconds': float(heal.seconds),
                    },
                )
            )
