"""Non-finite and spiking steps (``train_cfg.anomaly``), decided on every rank alike.

``train_cfg.anomaly=dict(nonfinite='skip' | 'rollback' | 'stop', spike=dict(window=100,
zscore=6.0, action='skip' | 'rollback' | 'stop'))``; off by default (None, as an absent
``anomaly``): a run without it is the run it always was, with no check and no host sync.

The decision is the optim wrapper's step guard's (``stratagem.optim.anomaly.StepGuard``):
one ``all_reduce`` of each rank's loss and gradient norm after the backward (and the
gradients' all-reduce), before the optimizer step, and one host read of the verdict. A
refused update is dropped on every rank (no parameter, optimizer-state or scale change; the
gradients zeroed); then this module acts, the same on every rank, after the iteration:

- ``skip``: the iteration counts as read (the batch is consumed), the iteration-based
  schedulers do not step (epoch-based ones still step at an epoch's end);
- ``stop``: a checkpoint ``iter_{N}.pth`` of the state before the refused update (resuming
  it continues after the offending batch, as ``skip`` would have), then
  :class:`AnomalyStop` (``stratagem train`` exits 1) naming the iteration, the rank(s) and
  the value;
- ``rollback``: the last committed checkpoint is resumed (``strategy.resume``) and the
  iterations after it replayed, the offending batches (the accumulation window's) read but
  never trained on, so the run ends where a run without those batches would. The skipped
  batches are in every later checkpoint's ``meta['anomaly']``, so a restarted run skips them
  too. It needs periodic checkpoints (refused at the start without them); a fresh run saves
  ``iter_0.pth`` first, so there is always one to go back to.

Every event is one warning line and one metrics row (``anomaly/<kind>``, ``anomaly/<action>``,
``anomaly/loss``, ``anomaly/zscore``; ``metrics.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stratagem.config import check_keys
from stratagem.optim.anomaly import Anomaly, StepGuard

if TYPE_CHECKING:
    from .checkpoints import Checkpoints
    from .meter import Meter

__all__ = [
    'ACTIONS',
    'AnomalyPlan',
    'AnomalyStop',
    'Anomalies',
    'anomaly_config',
    'check_anomaly_checkpoints',
    'check_anomaly_strategy',
]

ACTIONS = ('skip', 'rollback', 'stop')
ANOMALY_KEYS = frozenset({'nonfinite', 'spike'})
SPIKE_KEYS = frozenset({'window', 'zscore', 'action'})


class AnomalyStop(RuntimeError):
    """``train_cfg.anomaly``'s ``stop``: the run ended at a refused update (the message names
    the iteration, the rank(s) and the value, and the checkpoint it saved)."""


@dataclass(frozen=True)
class AnomalyPlan:
    """``train_cfg.anomaly`` read: ``nonfinite``'s action (None: not checked), the spike
    rule's ``window`` (None: none), ``zscore`` and action."""

    nonfinite: str | None
    window: int | None = None
    zscore: float = 6.0
    spike: str | None = None

    @property
    def actions(self) -> set[str]:
        return {a for a in (self.nonfinite, self.spike) if a is not None}


def anomaly_config(cfg: Any) -> AnomalyPlan | None:
    """``train_cfg.anomaly`` as an :class:`AnomalyPlan` (None: off); a ValueError or
    TypeError naming the key, the value and what is accepted."""
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping):
        raise TypeError(
            "train_cfg.anomaly must be a dict like dict(nonfinite='skip', "
            f"spike=dict(window=100, zscore=6.0, action='skip')) or None, got {cfg!r}"
        )
    cfg = dict(cfg)
    check_keys(cfg, ANOMALY_KEYS, 'train_cfg.anomaly')
    nonfinite = _action(cfg.get('nonfinite'), 'train_cfg.anomaly.nonfinite', allow_none=True)
    spike = cfg.get('spike')
    if spike is None:
        return AnomalyPlan(nonfinite) if nonfinite else None
    if not isinstance(spike, Mapping):
        raise TypeError(
            'train_cfg.anomaly.spike must be a dict like dict(window=100, zscore=6.0, '
            f"action='skip') or None, got {spike!r}"
        )
    spike = dict(spike)
    check_keys(spike, SPIKE_KEYS, 'train_cfg.anomaly.spike')
    window = spike.get('window', 100)
    if type(window) is not int or window < 2:
        raise ValueError(
            f'train_cfg.anomaly.spike.window must be an int >= 2 (recent losses), got {window!r}'
        )
    zscore = spike.get('zscore', 6.0)
    if isinstance(zscore, bool) or not isinstance(zscore, (int, float)) or not zscore > 0:
        raise ValueError(
            'train_cfg.anomaly.spike.zscore must be a positive number (standard deviations '
            f'above the recent mean), got {zscore!r}'
        )
    action = _action(spike.get('action', 'skip'), 'train_cfg.anomaly.spike.action')
    return AnomalyPlan(nonfinite, window, float(zscore), action)


def _action(value: Any, where: str, allow_none: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if value not in ACTIONS:
        import difflib

        close = difflib.get_close_matches(str(value), ACTIONS, n=1)
        raise ValueError(
            f'{where}={value!r}: must be one of {", ".join(map(repr, ACTIONS))}'
            + (' or None (off)' if allow_none else '')
            + (f'; did you mean {close[0]!r}?' if close else '')
        )
    return value


def check_anomaly_checkpoints(plan: AnomalyPlan | None, saves_periodically: bool) -> None:
    """``rollback`` goes back to a periodic checkpoint: refused without them."""
    if plan is not None and 'rollback' in plan.actions and not saves_periodically:
        raise ValueError(
            "train_cfg.anomaly: 'rollback' restores the last periodic checkpoint, but this "
            'run saves none before its end: set train_cfg.checkpoint_interval (iterations) '
            "or default_hooks.checkpoint.interval, or use 'skip' or 'stop'"
        )


def check_anomaly_strategy(plan: AnomalyPlan | None, strategy_type: Any) -> None:
    """A backend whose engine steps the optimizer (DeepSpeed's) decides the update itself:
    refused, by its declared capabilities (``strategy.type``: a name, a class or 'auto')."""
    from stratagem.strategies.capabilities import capabilities_of

    if plan is not None and capabilities_of(strategy_type).engine_steps:
        _refuse_engine(strategy_type if isinstance(strategy_type, str) else strategy_type.__name__)


def _refuse_engine(name: str) -> None:
    raise ValueError(
        f'train_cfg.anomaly: {name} steps the optimizer through its engine, which decides the '
        'update itself (its fp16 loss scaling skips inf/nan steps); the step guard has no '
        'seam there: remove train_cfg.anomaly, or use DDPStrategy or FSDPStrategy'
    )


class Anomalies:
    """The loop's side of ``train_cfg.anomaly``: the guard on the optim wrapper, the action
    after a refused update, the batches a rollback skips."""

    def __init__(self, plan: AnomalyPlan, strategy: Any, optim_wrapper: Any) -> None:
        if strategy.capabilities.engine_steps:
            _refuse_engine(type(strategy).__name__)
        if not hasattr(optim_wrapper, 'set_step_guard'):
            raise TypeError(
                f'train_cfg.anomaly needs an OptimWrapper (set_step_guard), got '
                f'{type(optim_wrapper).__name__}'
            )
        self.plan, self.strategy, self.optim_wrapper = plan, strategy, optim_wrapper
        self.guard = StepGuard(
            nonfinite=plan.nonfinite is not None, window=plan.window, zscore=plan.zscore
        )
        optim_wrapper.set_step_guard(self.guard)
        self.skipped: set[int] = set()  # batches (0-based iterations) a rollback never trains on
        self.events = 0

    # ---- per iteration ---------------------------------------------------------------------
    def found(self) -> Anomaly | None:
        """The update just refused, or None (host state: no sync)."""
        event, self.guard.last = self.guard.last, None
        return event

    def skips(self, it: int) -> bool:
        """Whether batch ``it`` (0-based) is one a rollback took out."""
        return it in self.skipped

    def pass_over(self, it: int, batches: Any) -> None:
        """Batch ``it`` is read (the data stays in step) but never trained on; the wrapper
        counts it, so its windows stay where the loop's iterations are."""
        batches.at(it)
        self.optim_wrapper.pass_over(1)

    def act(self, event: Anomaly, it: int, meter: Meter, checkpoints: Checkpoints) -> int | None:
        """After iteration ``it`` (1-based) whose update was refused: the row and the line,
        then the action. Returns the iteration to continue after (a rollback's), or None."""
        action = self.plan.nonfinite if event.kind == 'nonfinite' else self.plan.spike
        assert action is not None
        self.events += 1
        message = f'iteration {it}: {event.describe()}'
        values: dict[str, float] = {event.kind: 1.0, action: 1.0, 'loss': event.loss}
        if event.zscore is not None:
            values['zscore'] = event.zscore
        norms = [n for n in event.grad_norms if n is not None]
        if norms:
            values['grad_norm'] = max(norms, key=lambda n: math.inf if not math.isfinite(n) else n)
        meter.write_anomaly(it, values)
        if action == 'skip':
            self.strategy.logger.warning(f'{message}; update skipped on every rank')
            return None
        if action == 'stop':
            path = checkpoints.save(f'iter_{it}.pth', it)
            self.strategy.wait_for_checkpoints()
            self.strategy.logger.warning(f'{message}; stopping: {path} saved')
            raise AnomalyStop(
                f'train_cfg.anomaly: stopped at {message}. {path} holds the state before that '
                "update (resuming it continues after the batch, as 'skip' would)"
            )
        return self._rollback(message, it, checkpoints)

    def _rollback(self, message: str, it: int, checkpoints: Checkpoints) -> int:
        k = getattr(self.optim_wrapper, 'accumulative_counts', 1)
        window = range((it - 1) // k * k, it)  # the refused update's batches
        self.skipped.update(window)
        self.strategy.wait_for_checkpoints()
        path = checkpoints.last_path
        assert path is not None  # a fresh run saves iter_0 first (Anomalies.before_first)
        checkpoint = self.strategy.resume(path)
        meta = checkpoint.get('meta') or {}
        back = int(meta.get('iter', 0))
        if checkpoints.best is not None:
            checkpoints.best.restore(meta)
        self.guard.load_state_dict(dict(meta.get('anomaly') or {}).get('guard') or {})
        self.strategy.logger.warning(
            f'{message}; rolled back to {path} (iteration {back}); batches '
            f'{", ".join(str(b) for b in window)} (0-based) will be skipped'
        )
        return back

    # ---- the checkpoints ---------------------------------------------------------------------
    def meta(self) -> dict:
        """What a checkpoint keeps: the batches skipped and the spike window."""
        return {'anomaly': {'skipped': sorted(self.skipped), 'guard': self.guard.state_dict()}}

    def restore(self, meta: Mapping) -> None:
        """A resumed checkpoint's :meth:`meta`."""
        saved = dict(meta.get('anomaly') or {})
        self.skipped = set(saved.get('skipped') or [])
        self.guard.load_state_dict(saved.get('guard') or {})

    def before_first(self, start_iter: int, checkpoints: Checkpoints) -> None:
        """With ``rollback``, a run with no checkpoint yet saves ``iter_{start}.pth``: an
        anomaly before the first periodic save has one to go back to."""
        if 'rollback' in self.plan.actions and checkpoints.last_path is None:
            checkpoints.save(f'iter_{start_iter}.pth', start_iter)
