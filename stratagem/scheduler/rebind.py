"""Learning-rate schedulers moved onto another optimizer, their state kept.

A sharding backend steps an optimizer it builds after wrapping (FSDP's, over the sharded
parameters; fairscale's ``OSS``, from a cfg), while a host trainer's scheduler (Lightning's,
from ``configure_optimizers``) was built over the optimizer the host returned and holds it.
:func:`rebind_schedulers` points every reference a scheduler keeps to the old optimizer (its
``optimizer``; the children of ``SequentialLR`` and ``ChainedScheduler``; the optimizer's
``param_groups`` or one of its groups) at the new one, and gives the new optimizer's param
groups the values a scheduler keeps there that they lack (``initial_lr``, OneCycleLR's
``max_lr`` / ``min_lr``, ...). The rest of a scheduler's state stays where it is, in the
scheduler (``base_lrs``, ``last_epoch``, ``lr_lambdas``, a plateau's counters), so the lr
sequence continues as it would have over the old optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

__all__ = ['References', 'rebind_schedulers', 'scheduler_references', 'unmovable']


def _is_scheduler(value: Any) -> bool:
    return (
        callable(getattr(value, 'step', None))
        and hasattr(value, '__dict__')
        and not isinstance(value, (Optimizer, Tensor, type))
    )


def _refers_to(value: Any, optimizer: Optimizer) -> bool:
    groups = optimizer.param_groups
    return value is optimizer or value is groups or any(value is group for group in groups)


def _hidden_in(value: Any, optimizer: Optimizer) -> bool:
    """``value`` is a function whose closure holds ``optimizer`` (or its groups), or a method
    bound to it: a reference that cannot be moved."""
    if _refers_to(getattr(value, '__self__', None), optimizer):
        return True
    cells = getattr(value, '__closure__', None) or ()
    return any(_refers_to(cell.cell_contents, optimizer) for cell in cells)


@dataclass
class References:
    """Where a scheduler refers to ``optimizer`` (:func:`scheduler_references`).

    Attributes:
        optimizer: the optimizer looked for (its ``param_groups`` and groups too).
        movable: ``(holder, key)``: an attribute of an object, or an item of a list or dict
            the scheduler holds, that is the optimizer, its ``param_groups`` or a group.
        hidden: where it is held so that it cannot be moved (a closure, a bound method, a
            tuple), for the error.
    """

    optimizer: Optimizer
    movable: list[tuple[Any, Any]] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)

    def look_at(self, value: Any, holder: Any, key: Any, where: str) -> list[Any]:
        """Record what ``value`` (``holder[key]``, described as ``where``) refers to; return
        the schedulers it holds, to be looked into next."""
        if _refers_to(value, self.optimizer):
            self.movable.append((holder, key))
        elif _hidden_in(value, self.optimizer):
            self.hidden.append(f'{where} (a closure or bound method)')
        elif isinstance(value, (list, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            found = []
            for k, item in items:
                found += self.look_at(item, value, k, f'{where}[{k!r}]')
            return found
        elif isinstance(value, tuple):
            if any(_refers_to(item, self.optimizer) for item in value):
                self.hidden.append(f'{where} (a tuple)')
            return [item for item in value if _is_scheduler(item)]
        elif _is_scheduler(value):
            return [value]
        return []


def scheduler_references(scheduler: Any, optimizer: Optimizer) -> References:
    """Where ``scheduler`` refers to ``optimizer``, its ``param_groups`` or one of its
    groups: its attributes, the lists and dicts they hold, and the schedulers it holds
    (``SequentialLR``'s, ``ChainedScheduler``'s), looked into the same way."""
    refs = References(optimizer=optimizer)
    pending, seen = [scheduler], set()
    while pending:
        holder = pending.pop()
        if id(holder) in seen or not hasattr(holder, '__dict__'):
            continue
        seen.add(id(holder))
        for name, value in vars(holder).items():
            pending += refs.look_at(value, holder, name, f'{type(holder).__name__}.{name}')
    return refs


def _name(scheduler: Any) -> str:
    cls = type(scheduler)
    return f'{cls.__module__}.{cls.__qualname__}'


def _put(holder: Any, key: Any, value: Any) -> None:
    if isinstance(holder, (list, dict)):
        holder[key] = value
    else:
        setattr(holder, key, value)


def _get(holder: Any, key: Any) -> Any:
    return holder[key] if isinstance(holder, (list, dict)) else getattr(holder, key)


def unmovable(scheduler: Any, optimizer: Optimizer) -> str | None:
    """Why ``scheduler`` cannot be moved off ``optimizer`` (None: it can), for an error
    that names it."""
    refs = scheduler_references(scheduler, optimizer)
    if refs.hidden:
        return (
            f'the lr scheduler {_name(scheduler)} holds its optimizer in '
            f'{", ".join(refs.hidden)}, which cannot be pointed at another optimizer'
        )
    if not refs.movable:
        return (
            f'the lr scheduler {_name(scheduler)} refers to its optimizer through no '
            'attribute, so it cannot be pointed at another optimizer'
        )
    return None


def _moved(value: Any, old: Optimizer, new: Optimizer) -> Any:
    if value is old:
        return new
    if value is old.param_groups:
        return new.param_groups
    for index, group in enumerate(old.param_groups):
        if value is group:
            return new.param_groups[index]
    return value  # moved already: a scheduler given twice, or also as another's child


def rebind_schedulers(schedulers: Sequence[Any], old: Optimizer, new: Optimizer) -> None:
    """Move ``schedulers``, built over ``old``, onto ``new`` in place (see the module doc).

    ``new`` must have ``old``'s param groups in the same order (a rebuilt optimizer, or one
    group each). Refused, before anything changes, for a scheduler that holds ``old`` in a
    closure or a bound method, or refers to it through no attribute (:func:`unmovable`):
    the error names its class."""
    for scheduler in schedulers:
        why = unmovable(scheduler, old)
        if why:
            raise ValueError(
                f"{why}; keep the optimizer in an attribute, as torch's schedulers do "
                '(self.optimizer)'
            )
    places = [p for s in schedulers for p in scheduler_references(s, old).movable]
    if len(new.param_groups) != len(old.param_groups):
        raise ValueError(
            f'the optimizer that steps ({type(new).__name__}) has {len(new.param_groups)} '
            f'param group(s), the one the schedulers were built over {len(old.param_groups)}: '
            'the schedulers cannot be moved onto it'
        )
    for theirs, mine in zip(old.param_groups, new.param_groups):
        for key, value in theirs.items():
            if key != 'params':
                mine.setdefault(key, value)
    for holder, key in places:
        _put(holder, key, _moved(_get(holder, key), old, new))
    if any(isinstance(s, LRScheduler) for s in schedulers):
        _count_steps(new)


def _count_steps(optimizer: Optimizer) -> None:
    """What an ``LRScheduler`` does to the optimizer it is built over: its ``step`` counted,
    so the scheduler's first step can tell whether the optimizer stepped before it (without
    it, torch warns that ``optimizer.step()`` was overridden). A throwaway scheduler installs
    it; the values its own first step writes into the param groups are put back."""
    saved = [
        {k: v.clone() if isinstance(v, Tensor) else v for k, v in group.items() if k != 'params'}
        for group in optimizer.param_groups
    ]
    LambdaLR(optimizer, lambda _: 1.0)
    for group, values in zip(optimizer.param_groups, saved):
        for key in [k for k in group if k != 'params' and k not in values]:
            del group[key]
        for key, value in values.items():
            if isinstance(group[key], Tensor) and isinstance(value, Tensor):
                group[key].copy_(value)  # in place: torch updates a tensor lr in place
            else:
                group[key] = value
