"""The parameter-scheduler base class: windows, chaining, state and epoch→iter conversion.

A scheduler owns one hyper-parameter (``lr``, ``momentum``, ...) of every param
group of one optimizer. Each :meth:`_ParamScheduler.step` it writes a new value
computed from the *current* value (the chainable form), so several schedulers
on the same parameter compose by multiplication step by step, exactly as
mmengine's ``mmengine.optim.scheduler`` do: that is the user contract.

Call sequence (what a training loop does):

1. Build the optimizer (or optim wrapper), then the schedulers, in config order.
   Building records ``initial_<param>`` in each param group (first builder
   wins) and applies step 0 at once.
2. After each optimizer step (``by_epoch=False``) or after each epoch
   (``by_epoch=True``), call ``scheduler.step()`` on every scheduler, in order.
3. To resume: build as in 1, load the optimizer state (it carries the param
   group values), then ``scheduler.load_state_dict(saved)``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

from .helpers import _plain, check_optimizer, raw_optimizer
from .step_order import _ORDER_CHECK, _ORDER_DOC, _WATCHED, _count_step, _step_func

__all__ = [
    'INF',
    '_ParamScheduler',
    'SchedulerArgumentError',
]

#: mmengine's "no end" value; an int so that state dicts stay plain
INF = int(1e9)


class SchedulerArgumentError(ValueError, AssertionError):
    """A scheduler argument outside its domain (our message says which and why).

    A ``ValueError``, and an ``AssertionError`` too because mmengine checks these arguments
    with ``assert``: code written against mmengine (its own tests included) catches that.
    """


class _ParamScheduler:
    """Base class of the schedulers of one parameter of every param group.

    Subclasses set their own attributes, then call ``super().__init__`` (which
    applies step 0), and implement :meth:`_get_value` in chainable form.

    Args:
        optimizer: A ``torch.optim.Optimizer`` or an optim wrapper.
        param_name: The param-group key to schedule, e.g. ``'lr'``, ``'momentum'``.
        begin: First step (inclusive) at which this scheduler changes the value.
            Steps are epochs if ``by_epoch`` else iterations. Defaults to 0.
        end: Step (exclusive) at which it stops. Defaults to :data:`INF`.
        last_step: Index of the last step taken; -1 (default) for a fresh start.
            Any other value needs ``initial_<param_name>`` in every param group.
        by_epoch: Whether :meth:`step` is called once per epoch (True, the
            default) or once per iteration.
        verbose: Print every value change. Defaults to False.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        name = type(self).__name__
        check_optimizer(optimizer, name)
        check_window(name, begin, end, last_step)
        self.optimizer = optimizer
        self.param_name = param_name
        self.begin = begin
        self.end = end
        self.by_epoch = by_epoch
        self.verbose = verbose
        groups = optimizer.param_groups
        for i, group in enumerate(groups):
            if param_name not in group:
                raise KeyError(
                    f'{name}: param_groups[{i}] has no {param_name!r}; keys: '
                    f'{sorted(k for k in group if k != "params")}'
                )
        key = f'initial_{param_name}'
        if last_step == -1:
            for group in groups:
                # the first scheduler of this parameter records the value it starts from
                group.setdefault(key, group[param_name])
        else:
            check_initial_values(name, groups, param_name, last_step)
        self.base_values = [group[key] for group in groups]
        self.last_step = last_step
        # steps seen so far, counted from the first (-1: none yet); compared with [begin, end)
        self._global_step = -1
        self._watch_optimizer_steps()
        self.step()

    #: whether ``end`` was fitted to the run's length by the builder (the config gave none);
    #: not part of the state dict: it describes this run's config, not the saved position
    end_fitted: bool = False

    @classmethod
    def build_iter_from_epoch(
        cls,
        *args: Any,
        begin: float = 0,
        end: float = INF,
        by_epoch: bool = True,
        epoch_length: int | None = None,
        **kwargs: Any,
    ) -> _ParamScheduler:
        """Build an iteration-based instance from an epoch-based config.

        ``begin``/``end`` and the scheduler's own lengths (``step_size``,
        ``milestones``, ``T_max``, ``periods``, ``total_steps``) are multiplied by
        ``epoch_length`` (iterations per epoch); ``end=INF`` stays INF. This is
        what ``convert_to_iter_based=True`` in a config means.
        """
        name = cls.__name__
        if not by_epoch:
            raise SchedulerArgumentError(
                f'{name}: convert_to_iter_based needs an epoch-based '
                'config (by_epoch=True), got by_epoch=False'
            )
        if epoch_length is None or not isinstance(epoch_length, int) or epoch_length <= 0:
            raise SchedulerArgumentError(
                f'{name}: convert_to_iter_based=True needs epoch_length, the number '
                f'of iterations per epoch (a positive int), got {epoch_length!r}; '
                'pass epoch_length= (e.g. len(train_dataloader))'
            )
        begin = int(begin * epoch_length)
        if end != INF:
            end = int(end * epoch_length)
        kwargs = cls._epoch_args_to_iters(kwargs, epoch_length)
        return cls(*args, begin=begin, end=end, by_epoch=False, **kwargs)  # type: ignore[misc, arg-type]

    #: names of this scheduler's arguments counted in epochs (a number or a list of
    #: numbers), multiplied by the epoch length by ``build_iter_from_epoch``
    _epoch_args: tuple[str, ...] = ()

    @classmethod
    def _epoch_args_to_iters(cls, kwargs: dict, epoch_length: int) -> dict:
        """Convert the arguments named in ``_epoch_args`` from epochs to iterations."""
        for name in cls._epoch_args:
            value = kwargs.get(name)
            if value is None:
                continue
            kwargs[name] = (
                [v * epoch_length for v in value]
                if isinstance(value, (list, tuple))
                else value * epoch_length
            )
        return kwargs

    @property
    def step_args(self) -> tuple[str, ...]:
        """Names of this scheduler's own arguments counted in steps as ``begin`` and ``end``
        are (``step_size``, ``milestones``, ``T_max``, ``periods``, ``total_steps``):
        converted by :meth:`build_iter_from_epoch`, rescaled by :meth:`rescaled_state_dict`."""
        return self._epoch_args

    def rescaled_state_dict(self, state: dict, ratio: Any, done_iters: int) -> dict:
        """``state`` (this class's :meth:`state_dict`) moved to iterations of another length.

        Used when a run resumes at another world size: an iteration then holds another
        number of samples, so every step count of an iteration-based scheduler (``begin``,
        ``end``, the lengths in ``_epoch_args``) is multiplied by ``ratio`` (new iterations per
        old iteration, a ``fractions.Fraction``) and the position becomes ``done_iters``;
        ``last_step`` and derived tables follow. Epoch-based states are returned unchanged.
        Raises ``ValueError`` naming the field when a count does not convert to a whole
        number of iterations (the schedule could not continue exactly).
        """
        if state.get('by_epoch', self.by_epoch):
            return state
        name = type(self).__name__
        out = dict(state)

        def convert(field: str, value: Any) -> int:
            if value == INF:
                return value
            new = value * ratio
            if new.denominator != 1:
                raise ValueError(
                    f'{name}.{field}={value} iterations is {float(new):g} '
                    'iterations at the new world size, not a whole number'
                )
            return int(new)

        out['begin'] = convert('begin', state['begin'])
        out['end'] = convert('end', state['end'])
        for field in self._epoch_args:
            value = state.get(field)
            if isinstance(value, dict):  # milestones: {iteration: count}
                out[field] = {convert(field, k): v for k, v in value.items()}
            elif isinstance(value, (list, tuple)):
                out[field] = [convert(field, v) for v in value]
            elif value is not None:
                out[field] = convert(field, value)
        if 'total_iters' in state:  # Linear / Poly / Constant: end - begin - 1, mmengine's
            out['total_iters'] = out['end'] - out['begin'] - 1
        out['_global_step'] = done_iters
        out['last_step'] = min(max(done_iters - out['begin'] + 1, 0), out['end'] - out['begin']) - 1
        return self._rescale_derived(out, ratio)

    def _rescale_derived(self, state: dict, ratio: Any) -> dict:
        """Recompute tables derived from the rescaled lengths (subclasses that keep any)."""
        return state

    def _get_value(self) -> list:
        """The new value of every param group, from the current ones (chainable form)."""
        raise NotImplementedError

    def restart(self) -> None:
        """Go back to before the first step: the next :meth:`step` is the one a scheduler
        takes when it is built. The param groups keep their values (``replay_schedulers``
        sets them back to ``initial_<param>`` first)."""
        self.last_step = -1
        self._global_step = -1

    def step(self) -> None:
        """Advance one step (an epoch or an iteration) and write the new values.

        Outside ``[begin, end)`` the values are left as they are. The first call after
        construction warns (``UserWarning``, as torch and mmengine do) if the optimizer has not
        stepped since the scheduler was built, or if its ``step`` was replaced since.
        """
        if self._global_step == 0:
            self._check_step_order()
        self._global_step += 1
        if self.begin <= self._global_step < self.end:
            self.last_step += 1
            values = self._get_value()
            for i, (group, value) in enumerate(zip(self.optimizer.param_groups, values)):
                group[self.param_name] = value
                self.print_value(self.verbose, i, value)
        self._last_value = [group[self.param_name] for group in self.optimizer.param_groups]

    def _watch_optimizer_steps(self) -> None:
        """Start counting the optimizer's steps (from now: the newest scheduler resets the
        count, as in mmengine); see ``_check_step_order``."""
        raw = raw_optimizer(self.optimizer)
        hook = (_WATCHED.get(raw) or {}).get('hook')
        if hook is None:
            hook = raw.register_step_post_hook(_count_step)
        _WATCHED[raw] = {
            'steps': 0,
            'inner_count': getattr(self.optimizer, 'inner_count', None),
            'step': _step_func(self.optimizer),
            'hook': hook,
        }

    def _check_step_order(self) -> None:
        entry = _WATCHED.get(raw_optimizer(self.optimizer))
        if entry is None or not _ORDER_CHECK['on']:  # restored without its constructor; replay
            return
        name = type(self).__name__
        if _step_func(self.optimizer) is not entry['step']:
            warnings.warn(
                f'{name}: optimizer.step() was replaced after the scheduler was built, '
                'so it cannot check that the optimizer stepped first; make sure to '
                f'call optimizer.step() before scheduler.step(). See {_ORDER_DOC}',
                UserWarning,
                stacklevel=3,
            )
            return
        inner = getattr(self.optimizer, 'inner_count', None)
        updated = (
            inner is not None and entry['inner_count'] is not None and inner > entry['inner_count']
        )
        if entry['steps'] == 0 and not updated:
            warnings.warn(
                f'{name}.step() was called before optimizer.step(), which skips the '
                'first value of the schedule; call optimizer.step() (or '
                'optim_wrapper.update_params(loss)) before scheduler.step(). '
                f'See {_ORDER_DOC}',
                UserWarning,
                stacklevel=3,
            )

    def get_last_value(self) -> list:
        """The values of every param group after the last :meth:`step`."""
        return self._last_value

    def print_value(self, is_verbose: bool, group: int, value: float) -> None:
        """Print the new value of ``group`` when ``is_verbose``."""
        if is_verbose:
            print(
                f'{type(self).__name__}: adjusting {self.param_name} of group {group} '
                f'to {value:.4e}.'
            )

    def state_dict(self) -> dict:
        """Every attribute but the optimizer, as tensors and plain Python values.

        The result loads with ``torch.load(weights_only=True)``.
        """
        return {
            key: _plain(copy.deepcopy(value))
            for key, value in self.__dict__.items()
            if key not in ('optimizer', 'end_fitted') and not callable(value)
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the attributes saved by :meth:`state_dict`."""
        self.__dict__.update(
            {k: v for k, v in state_dict.items() if k not in ('optimizer', 'end_fitted')}
        )

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(param_name={self.param_name!r}, begin={self.begin}, '
            f'end={self.end}, by_epoch={self.by_epoch}, last_step={self.last_step})'
        )


def check_window(name: str, begin: Any, end: Any, last_step: Any) -> None:
    """``begin < end`` (``ValueError``, mmengine's phrase), ``last_step`` an int >= -1."""
    if end <= begin:
        raise ValueError(
            f'{name}: end ({end}) must be greater than begin ({begin}) (end '
            'should be larger than begin): the scheduler acts on steps in '
            '[begin, end)'
        )
    if type(last_step) is not int or last_step < -1:
        raise SchedulerArgumentError(
            f'{name}: last_step must be an int >= -1 (-1: a fresh start), got {last_step!r}'
        )


def check_initial_values(
    name: str, groups: Sequence[dict], param_name: str, last_step: int
) -> None:
    """Resuming with ``last_step`` needs ``initial_<param_name>`` in every param group."""
    key = f'initial_{param_name}'
    for i, group in enumerate(groups):
        if key not in group:
            raise KeyError(
                f'{name}: param {key!r} is not specified in param_groups[{i}], '
                f'which resuming with last_step={last_step} needs; load the '
                'optimizer state first or pass last_step=-1'
            )
