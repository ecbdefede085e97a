"""``StepGuard``: whether an update goes ahead, decided alike on every rank, before the
optimizer step.

An optim wrapper with a guard (``OptimWrapper.set_step_guard``) calls, per call of
``update_params``:

1. ``guard.observe(loss)`` with the micro-batch's loss, before any scaling (on the device:
   no host sync);
2. after the backward that completes an accumulation window (so under DDP the gradients
   are already reduced), ``guard.allow(wrapper)``:

   a. one ``torch._amp_foreach_non_finite_check_and_unscale_`` over this rank's gradients
      (its shards' under FSDP) and the sum of its losses sets a flag on the device when any
      value is not finite (the loss scaler's own kernel, with a scale of 1: every value is
      written back unchanged); a device or layout it does not take (sparse gradients,
      tensors on several devices) gets the gradients' 2-norm instead;
   b. with more than one rank, this rank's loss sum, loss count and flag go into its row of
      a ``world x 3`` tensor, and **one** ``all_reduce`` (a sum: every row but one is zero
      on each rank) gives every rank every rank's figures;
   c. **one** host sync (a skip must not call ``optimizer.step``): the figures' read (in
      one process the flag's, and with a spike rule then the loss's, nothing queued
      between the two). From them each rank computes the same
      verdict: a non-finite loss or gradient on any rank, or (with a spike rule) the mean
      loss over the ranks more than ``zscore`` standard deviations above the mean of the
      last ``window`` accepted updates' losses, a window kept on the host, since the loss
      arrives there in the read the verdict needs anyway (no device work, no other sync).

   False: the wrapper drops the update (no ``optimizer.step``, the gradients zeroed) and
   :attr:`StepGuard.last` describes why; only then are the gradients' norms computed (and
   gathered with a second ``all_reduce``, which every rank reaches, since all refused).

Under float16 with a loss scaler the gradients are the scaler's to check: a step it skips
for inf/nan gradients stays its own (counted in ``skipped_steps``, with its back-off), and
the guard looks at the loss only, so no skip is counted twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem._torch import unscale_and_check_
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
    """The 2-norm of ``grads`` (and of ``more``, 0-d tensors), as float32 (a sparse
    gradient's: of its values, duplicates summed)."""
    tensors = [t.coalesce().values() if t.is_sparse else t for t in (*grads, *more)]
    if not tensors:
        return torch.zeros(())
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        # torch's get_total_norm groups by device and dtype in Python first: twice the cost
        # of the norm itself on a small model
        norms = torch._foreach_norm(tensors)  # noqa: SLF001
        return torch.linalg.vector_norm(torch.stack(norms).float())
    return torch.nn.utils.get_total_norm(tensors).float()


def _local(grad: torch.Tensor) -> torch.Tensor:
    to_local = getattr(grad, 'to_local', None)
    return to_local() if callable(to_local) else grad


def _ranks(found: list[tuple[int, float]]) -> str:
    return ', '.join(f'rank {r} ({v})' for r, v in found)


class StepGuard:
    """The decision of :mod:`stratagem.optim.anomaly`'s sequence.

    Args:
        nonfinite: refuse an update on a non-finite loss or gradient value on any rank
            (a gradient norm is non-finite exactly when one of its values is, unless the
            norm itself overflows: finite values near the dtype's limit, which the next
            update's loss shows).
        window: the spike rule's number of recent losses (None: no spike rule).
        zscore: the spike rule's threshold, in standard deviations above their mean.
        grads: check the gradients (default True; the loss alone when False).
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
        self._flags: dict[torch.device, _Flag | None] = {}  # None: no kernel there
        self._window = _Window(window) if window is not None else None
        self._simple = nonfinite and window is None and self.world == 1

    def observe(self, loss: torch.Tensor) -> None:
        """Keep one micro-batch's loss (a reference, used after its backward: added up at
        the update)."""
        self._losses.append(loss)

    def allow(self, wrapper: Any) -> bool:
        """Whether this update goes ahead: the same answer on every rank (one all_reduce,
        one host read). ``wrapper``: its gradients (``grad_holders``) and its loss scaler
        (a float16 scaler checks the gradients itself)."""
        checks = self._checks_grads(wrapper)
        grads = self._local_grads(wrapper) if checks else []
        losses, self._losses = self._losses, []
        if self._simple and len(losses) == 1:
            # the common case, and the one a tiny step feels: one kernel, one read
            grads.append(losses[0])
            flag = self._flag(grads)
            grads.pop()
            assert flag is not None  # the loss at least was checked
            if not flag.read():
                self.last = None
                return True
            flag.tensor.zero_()
            rows = [[losses[0].item(), 1, 1.0]]
            self.last = self._describe(1, rows, grads if checks else None, None)
            return False
        loss_sum = None
        if losses:
            loss_sum = (losses[0] if len(losses) == 1 else torch.stack(losses).sum()).detach()
            loss_sum = loss_sum.float()
        flag = None
        if self.nonfinite:
            flag = self._flag(grads if loss_sum is None else [*grads, loss_sum])
        rows = self._figures(loss_sum, len(losses), flag, grads)
        if flag is not None and rows[self.rank][2]:
            flag.tensor.zero_()
        total, count = sum(r[0] for r in rows), sum(r[1] for r in rows)
        loss = total / max(1, count)
        code = 0
        if self.nonfinite and any(r[2] or not math.isfinite(r[0]) for r in rows):
            code = 1
        z = None
        if self._window is not None:
            z = self._window.zscore(loss)
            if z is not None and z > self.zscore:
                code |= 2
        if code == 0:
            if self._window is not None:
                self._window.add(loss, finite_only=not self.nonfinite)
            self.last = None
            return True
        self.last = self._describe(code, rows, grads if checks else None, z)
        return False

    def _figures(
        self,
        loss_sum: torch.Tensor | None,
        count: int,
        flag: _Flag | None,
        grads: list[torch.Tensor],
    ) -> list[list[float]]:
        """Every rank's ``[loss sum, loss count, flag]``: one all_reduce, one host read."""
        if self.world == 1:  # two reads, the first the one sync: no device work between
            return [[0.0 if loss_sum is None else loss_sum.item(), float(count),
                     0.0 if flag is None else flag.read()]]  # fmt: skip
        if loss_sum is not None:
            device = loss_sum.device
        else:
            device = flag.tensor.device if flag is not None else self._device(grads)
        zero = torch.zeros((), device=device)
        mine = torch.stack([loss_sum.to(device) if loss_sum is not None else zero,
                            torch.full((), float(count), device=device),
                            flag.tensor[0].to(device) if flag is not None else zero])  # fmt: skip
        figures = torch.zeros(self.world, 3, device=device)
        figures[self.rank] = mine
        all_reduce(figures)
        return figures.tolist()

    def _flag(self, tensors: list[torch.Tensor]) -> _Flag | None:
        """A flag, non-zero when one of ``tensors`` holds a non-finite value (None: nothing
        to check)."""
        if not tensors:
            return None
        device = tensors[0].device
        flag = self._flags.get(device, _UNSET)
        if flag is _UNSET:
            flag = self._flags[device] = _Flag(torch.zeros(1, device=device))
        if flag is not None:
            try:
                unscale_and_check_(tensors, flag.tensor, flag.one)
                return flag
            except (RuntimeError, NotImplementedError):
                # several devices, sparse gradients, a device without the kernel: the norm
                # decides, from now on (the gradients stay of one kind through a run)
                flag.tensor.zero_()
                self._flags[device] = None
        with torch.no_grad():
            return _Flag((~_norm(tensors).isfinite()).float().view(1))

    def _checks_grads(self, wrapper: Any) -> bool:
        return self.grads and self.nonfinite and getattr(wrapper, 'loss_scaler', None) is None

    @staticmethod
    def _local_grads(wrapper: Any) -> list[torch.Tensor]:
        """This rank's gradients (a DTensor's local shard: the ranks' checks together cover
        the whole)."""
        return [
            g if type(g) is torch.Tensor else _local(g)
            for p in wrapper.grad_holders()
            if (g := p.grad) is not None
        ]

    @staticmethod
    def _device(grads: list[torch.Tensor] | None) -> torch.device:
        return grads[0].device if grads else torch.device('cpu')

    def _norms(self, grads: list[torch.Tensor] | None) -> list[float | None]:
        """Every rank's gradient norm (None each, unchecked), for a refused update only:
        every rank is here, since every rank refused it."""
        if grads is None:
            return [None] * self.world
        norm = _norm(grads)
        if self.world == 1:
            return [norm.item()]
        norms = torch.zeros(self.world, device=norm.device)
        norms[self.rank] = norm
        all_reduce(norms)
        return norms.tolist()

    def _describe(
        self, code: int, rows: list[list[float]], grads: list[torch.Tensor] | None, z: Any
    ) -> Anomaly:
        losses = [s / c if c else None for s, c, _ in rows]
        norms = self._norms(grads)
        total, count = sum(r[0] for r in rows), sum(r[1] for r in rows)
        loss = total / max(1, count)
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
        return Anomaly(kind, losses, norms, float(loss), None if z is None else float(z), ranks)

    def state_dict(self) -> dict:
        """The spike window (plain values), for a checkpoint's meta."""
        if self._window is None:
            return {'recent': [], 'filled': 0}
        return self._window.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._window is not None:
            self._window.load_state_dict(state)


class _Flag:
    """A flag the non-finite kernel sets (a device's is kept, and zeroed only after it was
    found set: a clean step costs no fill), read on the host (on a CPU through a view of
    its memory: no torch call)."""

    __slots__ = ('one', 'tensor', 'view')

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.one = torch.ones(1, device=tensor.device)  # the kernel's scale
        self.view = tensor.numpy().data if tensor.device.type == 'cpu' else None

    def read(self) -> float:
        return self.view[0] if self.view is not None else self.tensor.item()


_UNSET: Any = object()


class _Window:
    """The spike rule's last ``size`` accepted losses: a ring (position ``filled % size``)
    with their sum and sum of squares kept as each loss comes (recomputed whole each time
    the ring comes round, so rounding does not build up): the z-score in O(1)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ring = [0.0] * size
        self.filled = 0  # how many losses were added (the real ones in the ring: min(size, .))
        self.shift = 0.0  # the sums are of (x - shift): no cancellation for a large mean
        self.s1 = self.s2 = 0.0

    def zscore(self, loss: float) -> float | None:
        """``loss``'s z-score against the window, or None until it is full."""
        if self.filled < self.size:
            return None
        n = self.size
        mean = self.s1 / n
        var = max(0.0, self.s2 / n - mean * mean)
        return (loss - (mean + self.shift)) / max(math.sqrt(var), 1e-12)

    def add(self, loss: float, finite_only: bool) -> None:
        if finite_only and not math.isfinite(loss):
            # a nan loss went ahead (no non-finite check), but must not poison the window
            loss = self.s1 / self.size + self.shift if self.filled >= self.size else 0.0
        i = self.filled % self.size
        old = self.ring[i] - self.shift
        self.ring[i] = loss
        self.filled += 1
        if self.filled % self.size == 0:  # come round: the sums afresh, about the mean
            self._resum()
            return
        x = loss - self.shift
        self.s1 += x - old
        self.s2 += x * x - old * old

    def _resum(self) -> None:
        real = self.ring if self.filled >= self.size else self.ring[: self.filled]
        self.shift = math.fsum(real) / len(real) if real else 0.0
        self.s1 = math.fsum(x - self.shift for x in self.ring)
        self.s2 = math.fsum((x - self.shift) ** 2 for x in self.ring)

    def state_dict(self) -> dict:
        return {'recent': list(self.ring) if self.filled else [], 'filled': self.filled}

    def load_state_dict(self, state: dict) -> None:
        recent = [float(x) for x in state.get('recent') or []]
        filled = int(state.get('filled', 0))
        if recent and len(recent) != self.size:  # saved with another window: the newest
            at = filled % len(recent)
            ordered = recent[at:] + recent[:at] if filled >= len(recent) else recent[:filled]
            recent = ordered[-self.size :]
            filled = len(recent)
            recent += [0.0] * (self.size - filled)
        self.ring = recent or [0.0] * self.size
        self.filled = filled if recent else 0
        self._resum()
