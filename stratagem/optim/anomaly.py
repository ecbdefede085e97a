"""``StepGuard``: whether an update goes ahead, decided alike on every rank, before the
optimizer step.

An optim wrapper with a guard (``OptimWrapper.set_step_guard``) calls, per call of
``update_params``:

1. ``guard.observe(loss)`` with the micro-batch's loss, before any scaling (on the device:
   no host sync);
2. after the backward that completes an accumulation window (so under DDP the gradients
   are already reduced), ``guard.allow(wrapper)``: this rank's figures, the sum of its
   losses, their count and its gradients' norm (its shards' under FSDP), go into its row
   of a ``world x 3`` tensor, and **one** ``all_reduce`` (a sum: every row but one is zero
   on each rank) gives every rank every rank's figures. From that same vector each rank
   computes the same verdict: a non-finite loss or gradient norm on any rank, or (with a
   spike rule) the mean loss over the ranks more than ``zscore`` standard deviations above
   the mean of the last ``window`` accepted updates' losses (kept on the device). The
   verdict is read on the host (the one host sync a check costs: a skip must not call
   ``optimizer.step``); False: the wrapper drops the update (no ``optimizer.step``, the
   gradients zeroed) and :attr:`StepGuard.last` describes why.

Under float16 with a loss scaler the gradients are the scaler's to check: a step it skips
for inf/nan gradients stays its own (counted in ``skipped_steps``, with its back-off), and
the guard looks at the loss only, so no skip is counted twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem.env.dist import all_reduce, get_dist_info

__all__ = ['Anomaly', 'StepGuard']


@dataclass
class Anomaly:
    """What a guard found at one update (the same on every rank).

    ``kind``: ``'nonfinite'`` or ``'spike'``; ``losses`` / ``grad_norms``: each rank's
    (its mean loss over the window's micro-batches, None where a rank saw no loss: a
    pipeline's first stages; its gradients' norm, None where not checked); ``loss``: the mean
    over the ranks; ``zscore``: the spike's (None for a non-finite value)."""

    kind: str
    losses: list[float | None]
    grad_norms: list[float | None]
    loss: float
    zscore: float | None = None
    ranks: list[int] = field(default_factory=list)

    def describe(self) -> str:
        """One phrase: what was found, on which rank(s), the value(s)."""
        if self.kind == 'spike':
            ranks = ', '.join(
                f'rank {r} {v:.6g}' for r, v in enumerate(self.losses) if v is not None
            )
            return (
                f'loss spike: mean loss {self.loss:.6g} is {self.zscore:.3g} standard '
                f'deviations above the recent window ({ranks})'
            )
        parts = []
        bad = [(r, v) for r, v in enumerate(self.losses) if v is not None and not math.isfinite(v)]
        if bad:
            parts.append('non-finite loss on ' + _ranks(bad))
        bad = [
            (r, v) for r, v in enumerate(self.grad_norms) if v is not None and not math.isfinite(v)
        ]
        if bad:
            parts.append('non-finite gradient norm on ' + _ranks(bad))
        return '; '.join(parts)


def _norm(grads: list[torch.Tensor], *more: torch.Tensor) -> torch.Tensor:
    """The 2-norm of ``grads`` (and of ``more``, 0-d tensors), as float32."""
    tensors = [*grads, *more]
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        # torch's get_total_norm groups by device and dtype in Python first: twice the cost
        # of the norm itself on a small model, paid every update
        norms = torch._foreach_norm(tensors)  # noqa: SLF001
        return torch.linalg.vector_norm(torch.stack(norms).float())
    return torch.nn.utils.get_total_norm(tensors).float()


def _ranks(found: list[tuple[int, float]]) -> str:
    return ', '.join(f'rank {r} ({v})' for r, v in found)


class StepGuard:
    """The decision of :mod:`stratagem.optim.anomaly`'s sequence.

    Args:
        nonfinite: refuse an update on a non-finite loss or gradient norm on any rank.
        window: the spike rule's number of recent losses (None: no spike rule).
        zscore: the spike rule's threshold, in standard deviations above their mean.
        grads: check the gradients' norm (default True; the loss alone when False).
    """

    def __init__(
        self,
        *,
        nonfinite: bool = True,
        window: int | None = None,
        zscore: float = 6.0,
        grads: bool = True,
    ) -> None:
        self.nonfinite, self.window, self.zscore, self.grads = nonfinite, window, zscore, grads
        self.rank, self.world = get_dist_info()
        self.last: Anomaly | None = None
        self._losses: list[torch.Tensor] = []  # the window's micro-batch losses
        self._recent: torch.Tensor | None = None  # the last `window` accepted losses
        self._filled = 0  # how many of them are real (host-side: no sync)

    def observe(self, loss: torch.Tensor) -> None:
        """Keep one micro-batch's loss (a reference: added up at the update)."""
        self._losses.append(loss.detach())

    def allow(self, wrapper: Any) -> bool:
        """Whether this update goes ahead: the same answer on every rank (one all_reduce,
        one host read). ``wrapper``: its gradients (``grad_holders``) and its loss scaler
        (a float16 scaler checks the gradients itself)."""
        grads = self._local_grads(wrapper) if self._checks_grads(wrapper) else None
        losses, self._losses = self._losses, []
        device = losses[0].device if losses else self._device(grads)
        loss_sum = (
            (losses[0] if len(losses) == 1 else torch.stack(losses).sum()).float()
            if losses
            else torch.zeros((), device=device)
        )
        # one process, no spike rule: the norm of the losses' sum and the gradients is
        # non-finite when one of them is; the fewest operations, the one host sync
        if (
            self.world == 1
            and self.window is None
            and bool(_norm(grads or [], loss_sum).isfinite())
        ):
            self.last = None
            return True
        norm = _norm(grads) if grads else None
        mine = torch.stack([loss_sum.to(device), torch.full((), float(len(losses)), device=device),
                            norm.to(device) if norm is not None
                            else torch.zeros((), device=device)])  # fmt: skip
        if self.world > 1:
            figures = torch.zeros(self.world, 3, device=device)
            figures[self.rank] = mine
            all_reduce(figures)
        else:
            figures = mine.view(1, 3)
        if self.world == 1:
            loss = loss_sum / max(1, len(losses))
        else:
            loss = figures[:, 0].sum() / figures[:, 1].sum().clamp(min=1)
        verdict = (~figures.isfinite()).any() if self.nonfinite else None
        spike_z = self._spike(loss) if self.window is not None else None
        if spike_z is not None:
            spike = (spike_z > self.zscore) * 2
            verdict = spike if verdict is None else verdict + spike
        code = 0 if verdict is None else int(verdict.item())  # the one host sync of a check
        if code == 0:
            self._remember(loss)
            self.last = None
            return True
        self.last = self._describe(code, figures, loss, spike_z, grads is not None)
        return False

    def _checks_grads(self, wrapper: Any) -> bool:
        return self.grads and self.nonfinite and getattr(wrapper, 'loss_scaler', None) is None

    @staticmethod
    def _local_grads(wrapper: Any) -> list[torch.Tensor]:
        """This rank's gradients (a DTensor's local shard: the norm over all shards is the
        ranks' figures together)."""
        found = []
        for p in wrapper.grad_holders():
            g = p.grad
            if g is None:
                continue
            to_local = getattr(g, 'to_local', None)
            found.append(to_local() if callable(to_local) else g)
        return found

    @staticmethod
    def _device(grads: list[torch.Tensor] | None) -> torch.device:
        return grads[0].device if grads else torch.device('cpu')

    def _spike(self, loss: torch.Tensor) -> torch.Tensor | None:
        """The loss's z-score against the recent window, or None until it is full."""
        assert self.window is not None
        if self._filled < self.window or self._recent is None:
            return None
        std, mean = torch.std_mean(self._recent, correction=0)
        return (loss - mean) / std.clamp(min=1e-12)

    def _remember(self, loss: torch.Tensor) -> None:
        if self.window is None:
            return
        if self._recent is None:
            self._recent = torch.zeros(self.window, device=loss.device)
        elif self._recent.device != loss.device:  # restored from a checkpoint: on the CPU
            self._recent = self._recent.to(loss.device)
        if not self.nonfinite:  # a nan loss went ahead, but must not poison the window
            fallback = self._recent.mean() if self._filled >= self.window else loss.new_zeros(())
            loss = torch.where(loss.isfinite(), loss, fallback)
        self._recent[self._filled % self.window] = loss
        self._filled += 1

    def _describe(
        self, code: int, per_rank: torch.Tensor, loss: torch.Tensor, z: Any, checked: bool
    ) -> Anomaly:
        rows = per_rank.tolist()
        z_value = float(z) if z is not None else None
        losses = [s / c if c else None for s, c, _ in rows]
        norms = [n if checked else None for _, _, n in rows]
        if code & 1:
            kind = 'nonfinite'
            ranks = [
                r
                for r, (value, norm) in enumerate(zip(losses, norms, strict=True))
                if (value is not None and not math.isfinite(value))
                or (norm is not None and not math.isfinite(norm))
            ]
        else:
            kind, ranks = 'spike', list(range(self.world))
        return Anomaly(kind, losses, norms, float(loss), z_value, ranks)

    def state_dict(self) -> dict:
        """The spike window (plain values), for a checkpoint's meta."""
        recent = [] if self._recent is None else self._recent.tolist()
        return {'recent': recent, 'filled': self._filled}

    def load_state_dict(self, state: dict) -> None:
        recent = state.get('recent') or []
        self._filled = int(state.get('filled', 0))
        self._recent = torch.tensor(recent, dtype=torch.float32) if recent else None
