"""``OptimWrapper``: gradient accumulation and clipping around a ``torch.optim.Optimizer``.

mmengine-compatible (``mmengine.optim.OptimWrapper``): same constructor, methods and
call sequence. ``update_params(loss)`` is, per call:

1. ``scale_loss(loss)``: divide by the length of the current accumulation window (only when
   that length is > 1, so no ``loss / 1`` is ever computed),
2. ``backward(loss)``: ``loss.backward()``, then ``inner_count += 1``,
3. if ``should_update()``: ``step()`` (clip first, if configured) and ``zero_grad()``.

With a step guard (:meth:`OptimWrapper.set_step_guard`, ``train_cfg.anomaly``): the guard
is shown each loss before 1 (``observe``), and at 3 ``allow(wrapper)`` decides, on every
rank alike, whether ``step()`` runs; a refused update only zeroes the gradients.

Accumulation windows are aligned to absolute iteration counts: window ``j`` covers
iterations ``[j*k, (j+1)*k)``. After ``initialize_count_status(model, init_counts,
max_counts)`` the last, incomplete window ``[max_counts // k * k, max_counts)`` is averaged
over its real length. The boundary is computed from absolute counts only, so a run resumed
anywhere — on a window boundary or inside a window — scales every loss exactly as the
uninterrupted run did. (mmengine versions that derive the tail from ``max_counts -
init_counts`` agree on a boundary but mis-size the tail after a mid-window resume.)

Resume in the middle of a window: ``state_dict()`` holds, next to the optimizer's own
``state`` and ``param_groups``, a key ``'optim_wrapper'`` with plain values
(``inner_count``, ``max_counts``, ``accumulative_counts``) and, only while a window is open
(``inner_count`` not on a window boundary), ``'pending_grads'``: ``{flat param index:
grad tensor}`` in the optimizer's parameter order (the order ``Optimizer.state_dict`` numbers
parameters in). ``load_state_dict`` restores the counters and those gradients, so the next
``update_params`` continues the window exactly. The same gradients are available on their
own through :meth:`OptimWrapper.grad_state_dict` / :meth:`OptimWrapper.load_grad_state_dict`.
Under DDP with ``no_sync`` the pending gradients are rank-local: an exact resume then needs
each rank's own ``grad_state_dict()``. Only tensors and plain Python values are stored, so a
checkpoint loads with ``torch.load(weights_only=True)``; ``torch.optim`` and mmengine ignore
the extra keys, so the dict stays loadable by a bare optimizer.

Hot path: no host sync; the last clipping norm is kept as a tensor in ``last_grad_norm``.
``zero_grad`` sets the gradients to ``None`` at the end of the update, as mmengine does, but
the memory of CPU gradients is released at the start of the next step (``optim_context``,
else ``backward``), where a hand-written loop calling ``zero_grad()`` first releases it. With
glibc's dynamic trim threshold, releasing ~tens of MB at the end of a step returns them to the
OS and the next backward page-faults them back (measured on a 4×Linear(1024) MLP: ~4,000
minor faults and +10-20% per step against 0 for the raw loop, ``benchmarks/overhead.py``);
released at the raw loop's point, the allocator sees the raw loop's sequence. Nothing a
caller can observe changes: ``p.grad`` is ``None`` after the update either way.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from stratagem._torch import BatchNormBase
from stratagem.registry import OPTIM_WRAPPERS

from .base import BaseOptimWrapper

__all__ = ['OptimWrapper', 'parse_clip_grad', 'has_no_sync']

_NULL_CONTEXT = contextlib.nullcontext()


@OPTIM_WRAPPERS.register_module()
class OptimWrapper(BaseOptimWrapper):
    """Optimizer wrapper with gradient accumulation and clipping.

    Args:
        optimizer: The optimizer to drive.
        accumulative_counts: Micro-batches per parameter update (default 1: no accumulation).
        clip_grad: ``None`` (default), ``dict(type='norm', max_norm, norm_type=2,
            error_if_nonfinite=False)`` or ``dict(type='value', clip_value)``.
            ``type`` defaults to ``'norm'``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulative_counts: int = 1,
        clip_grad: dict | None = None,
    ) -> None:
        super().__init__(optimizer)
        self._accumulative_counts = _check_count(accumulative_counts, 'accumulative_counts', 1)
        self._clip_func, self.grad_name, self.clip_grad_kwargs = parse_clip_grad(clip_grad)
        self._no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self._inner_count = 0
        self._max_counts = -1
        self._tail_start = -1  # first count of the last, incomplete window (absolute)
        self._tail_len = 0
        self._restored_count: int | None = None  # inner_count whose pending grads were loaded
        # gradients set to None by zero_grad whose memory is released at the next step's start
        self._stale_grads: list[torch.Tensor] | None = None
        self._step_owner: str | None = None  # set_step_owner: who runs backward instead
        self._guard: Any = None  # set_step_guard: decides whether an update goes ahead
        cls = type(self)
        self._plain_step = accumulative_counts == 1 and all(
            getattr(cls, name) is getattr(OptimWrapper, name)
            for name in ('scale_loss', 'backward', 'step', 'zero_grad', 'should_update')
        )

    # ---- the training step -------------------------------------------------------------
    def update_params(
        self, loss: torch.Tensor, step_kwargs: dict | None = None, zero_kwargs: dict | None = None
    ) -> None:
        """Scale and backward ``loss``; when the window is complete, step and zero_grad."""
        if self._step_owner is not None:
            raise RuntimeError(self._step_owner)
        if self._plain_step and not step_kwargs and not zero_kwargs:
            # no accumulation, methods not overridden: what the calls below do, inlined (the
            # hot path of most runs; each call layer costs a hand-written loop nothing)
            self._stale_grads = None
            guard = self._guard
            if guard is not None:
                guard.observe(loss)
            loss.backward()
            self._inner_count += 1
            optimizer = self.optimizer
            if guard is None or guard.allow(self):
                if self._clip_func is not None:
                    self._clip_grad()
                optimizer.step()
            self._stale_grads = [
                p.grad
                for group in optimizer.param_groups
                for p in group['params']
                if p.grad is not None and p.grad.is_cpu
            ]
            optimizer.zero_grad()
            return
        if self._guard is not None:
            self._guard.observe(loss)
        loss = self.scale_loss(loss)
        self.backward(loss)
        if self.should_update():
            if self._guard is not None and not self._guard.allow(self):
                pass  # dropped on every rank alike; the gradients go below
            elif step_kwargs:
                self.step(**step_kwargs)
            else:
                self.step()
            if zero_kwargs:
                self.zero_grad(**zero_kwargs)
            else:
                self.zero_grad()

    def after_backward(
        self,
        step_kwargs: dict | None = None,
        zero_kwargs: dict | None = None,
        loss: torch.Tensor | None = None,
    ) -> None:
        """The rest of :meth:`update_params` when the backward ran elsewhere (a pipeline
        schedule runs it per microbatch, on losses scaled by :meth:`scale_loss`): count it;
        when the window is complete, step and zero_grad. ``loss``: the unscaled loss, where
        this rank has one, for a step guard."""
        self._stale_grads = None
        self._inner_count += 1
        if self._guard is not None and loss is not None:
            self._guard.observe(loss)
        if self.should_update():
            if self._guard is None or self._guard.allow(self):
                self.step(**(step_kwargs or {}))
            self.zero_grad(**(zero_kwargs or {}))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the current window's length; ``loss`` itself when that is 1."""
        k = self._accumulative_counts
        if k == 1:
            return loss
        if self._max_counts != -1 and self._inner_count >= self._tail_start:
            if self._inner_count >= self._max_counts:
                raise ValueError(
                    f'inner_count {self._inner_count} reached max_counts {self._max_counts} '
                    f'set by initialize_count_status; call it with the real number of '
                    f'iterations of this run'
                )
            k = self._tail_len
            if k == 1:
                return loss
        return loss / k

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, then count the micro-batch."""
        self._stale_grads = None  # a loop without optim_context: release before backward
        loss.backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs: Any) -> None:
        """Clip the gradients (if configured), then ``optimizer.step(**kwargs)``."""
        if self._clip_func is not None:
            self._clip_grad()
        self.optimizer.step(**kwargs)

    def zero_grad(self, **kwargs: Any) -> None:
        """``optimizer.zero_grad(**kwargs)`` (``set_to_none=True`` by torch's default).

        With ``set_to_none``, the CPU gradients' memory is kept until the next step starts
        (see the module docstring: it keeps page faults at a hand-written loop's level).
        """
        if kwargs.get('set_to_none', True):
            self._stale_grads = [
                p.grad
                for group in self.optimizer.param_groups
                for p in group['params']
                if p.grad is not None and p.grad.is_cpu
            ]
        self.optimizer.zero_grad(**kwargs)

    def _clip_grad(self) -> None:
        params = [
            p
            for group in self.optimizer.param_groups
            for p in group['params']
            if p.grad is not None
        ]
        if params:
            self.last_grad_norm = self._clip_func(params, **self.clip_grad_kwargs)

    # ---- accumulation bookkeeping -------------------------------------------------------
    def should_update(self) -> bool:
        """True after the backward that completes a window (or reaches ``max_counts``)."""
        return (
            self._inner_count % self._accumulative_counts == 0
            or self._inner_count == self._max_counts
        )

    def should_sync(self) -> bool:
        """True when the coming backward completes a window, so gradients must be synced."""
        nxt = self._inner_count + 1
        return nxt % self._accumulative_counts == 0 or nxt == self._max_counts

    def optim_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The gradient-sync control on iterations that do not update, else a no-op."""
        if self._step_owner is not None:
            raise RuntimeError(self._step_owner)
        self._stale_grads = None  # the step starts: release the last update's gradients
        return _NULL_CONTEXT if self.should_sync() else self._sync_off(model)

    # ---- collaborators a strategy supplies ------------------------------------------------
    def set_grad_sync(
        self, no_sync: Callable[[], contextlib.AbstractContextManager] | None
    ) -> None:
        """The gradient-sync control: ``no_sync()`` returns a context in which backward does
        not synchronise gradients; ``optim_context`` enters it on iterations that do not
        update. None (the default): ``model.no_sync()`` when the model has one (DDP)."""
        self._no_sync = no_sync

    def set_step_guard(self, guard: Any) -> None:
        """A step guard (:class:`stratagem.optim.anomaly.StepGuard`, or anything with its
        ``observe(loss)`` and ``allow(wrapper) -> bool``): told each micro-batch's loss, and
        asked before each update whether it goes ahead; a refused update is dropped (no
        ``step``; the gradients zeroed). None (the default) removes it."""
        self._guard = guard

    @property
    def step_guard(self) -> Any:
        """The guard :meth:`set_step_guard` set, or None."""
        return self._guard

    def set_step_owner(self, message: str | None) -> None:
        """Refuse :meth:`optim_context` and :meth:`update_params` with ``message`` (a
        ``RuntimeError``): a strategy whose steps only it can run (a pipeline schedule)
        says here what to call instead. None lifts the refusal."""
        self._step_owner = message

    def _sync_off(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if self._no_sync is not None:
            return self._no_sync()
        if has_no_sync(model):
            return model.no_sync()  # type: ignore[operator]
        return _NULL_CONTEXT

    @property
    def clip_func(self) -> Callable[..., Any] | None:
        """The function that clips: ``clip_func(params, **clip_grad_kwargs)`` returns the
        total norm (None without ``clip_grad``)."""
        return self._clip_func

    def set_clip_func(self, func: Callable[..., Any]) -> None:
        """Replace the clip function (same call as :attr:`clip_func`): a sharding strategy
        supplies one that reduces the norm over its shards. Needs ``clip_grad``."""
        if self._clip_func is None:
            raise ValueError(f'{type(self).__name__} has no clip_grad: nothing to clip with {func}')
        self._clip_func = func

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Set the counters at the start (or resume) of training.

        Args:
            model: The trained model (checked for BatchNorm, which accumulation changes).
            init_counts: Iterations already done (0 for a fresh run).
            max_counts: Total iterations of the run; the last window ends there.
        """
        _check_count(init_counts, 'init_counts', 0)
        _check_count(max_counts, 'max_counts', 1)
        if init_counts > max_counts:
            raise ValueError(f'init_counts ({init_counts}) must be <= max_counts ({max_counts})')
        self._inner_count = init_counts
        self._set_max_counts(max_counts)
        k = self._accumulative_counts
        if init_counts % k != 0 and self._restored_count != init_counts:
            warnings.warn(
                f'resuming at iteration {init_counts}, inside an accumulation window of '
                f'{k}: the gradients of its first {init_counts % k} micro-batches are lost. '
                f'Load a state_dict saved at that iteration (it holds them) for an exact resume.',
                stacklevel=2,
            )
        _warn_batchnorm_accumulation(model, k)

    def pass_over(self, counts: int = 1) -> None:
        """Count ``counts`` micro-batches read but never trained on (the batches a rollback
        takes out, whole windows), so the windows stay aligned to the loop's iterations."""
        _check_count(counts, 'counts', 0)
        self._inner_count += counts

    def _set_max_counts(self, max_counts: int) -> None:
        k = self._accumulative_counts
        self._max_counts = max_counts
        self._tail_start = max_counts // k * k
        self._tail_len = max_counts - self._tail_start

    @property
    def inner_count(self) -> int:
        """Micro-batches backpropagated so far (absolute, counted from the start of training)."""
        return self._inner_count

    @property
    def max_counts(self) -> int:
        """Total iterations set by :meth:`initialize_count_status` (``-1``: not set)."""
        return self._max_counts

    @property
    def accumulative_counts(self) -> int:
        return self._accumulative_counts

    def _window_open(self) -> bool:
        return not self.should_update()

    # ---- state ---------------------------------------------------------------------------
    def grad_holders(self) -> list[torch.Tensor]:
        """Tensors whose ``.grad`` accumulates, in the optimizer's flat parameter order."""
        return [p for group in self.optimizer.param_groups for p in group['params']]

    def grad_state_dict(self) -> dict:
        """``{'inner_count': int, 'grads': {flat index: grad}, 'scale': float}`` (references,
        not copies); ``scale`` is the loss scale the gradients carry (1 without one)."""
        grads = {
            i: p.grad.detach() for i, p in enumerate(self.grad_holders()) if p.grad is not None
        }
        return {
            'inner_count': self._inner_count,
            'grads': grads,
            'scale': self._grad_scale() if grads else 1.0,
        }

    def load_grad_state_dict(self, state_dict: Mapping) -> None:
        """Restore gradients (and ``inner_count``) saved by :meth:`grad_state_dict`."""
        holders = self.grad_holders()
        grads = state_dict['grads']
        bad = [i for i in grads if not (isinstance(i, int) and 0 <= i < len(holders))]
        if bad:
            raise ValueError(
                f'grad state_dict has indices {bad} but the optimizer has '
                f'{len(holders)} parameters; it was saved for another model/optimizer'
            )
        for i, g in grads.items():
            if tuple(g.shape) != tuple(holders[i].shape):
                raise ValueError(
                    f'grad state_dict entry {i} has shape {tuple(g.shape)} but '
                    f'parameter {i} has shape {tuple(holders[i].shape)}'
                )
        # gradients saved under another loss scale (or none) are brought to this one
        factor = self._grad_scale() / float(state_dict.get('scale', 1.0)) if grads else 1.0
        for i, p in enumerate(holders):
            g = grads.get(i)
            if g is None:
                p.grad = None
                continue
            p.grad = g.to(device=p.device, dtype=p.dtype, copy=True)
            if factor != 1.0:
                p.grad.mul_(factor)
        self._inner_count = int(state_dict['inner_count'])
        self._restored_count = self._inner_count

    def state_dict(self) -> dict:
        """Optimizer state + ``'optim_wrapper'`` counters (+ pending grads mid-window)."""
        state_dict = self.optimizer.state_dict()
        wrapper_state = {
            'inner_count': self._inner_count,
            'max_counts': self._max_counts,
            'accumulative_counts': self._accumulative_counts,
        }
        if self._window_open():
            pending = self.grad_state_dict()
            wrapper_state['pending_grads'] = pending['grads']
            wrapper_state['pending_grads_scale'] = pending['scale']
        state_dict['optim_wrapper'] = wrapper_state
        return state_dict

    def load_state_dict(
        self, state_dict: dict, *, load_optimizer: Callable[[dict], None] | None = None
    ) -> None:
        """Load :meth:`state_dict` output (or an mmengine / bare optimizer state_dict).

        ``load_optimizer(optimizer_state)`` loads the optimizer's part (default:
        ``optimizer.load_state_dict``); a sharding strategy supplies its own (DCP's)."""
        state_dict = dict(state_dict)
        wrapper_state = state_dict.pop('optim_wrapper', None)
        state_dict.pop('base_param_settings', None)  # mmengine's placeholder group
        (load_optimizer or self._load_optimizer_state)(state_dict)
        if wrapper_state is None:
            return
        saved_k = wrapper_state.get('accumulative_counts', self._accumulative_counts)
        if saved_k != self._accumulative_counts and 'pending_grads' in wrapper_state:
            raise ValueError(
                f'the state_dict was saved inside an accumulation window with '
                f'accumulative_counts={saved_k}, but this wrapper has '
                f'accumulative_counts={self._accumulative_counts}; resume with {saved_k}'
            )
        max_counts = wrapper_state.get('max_counts', -1)
        if max_counts != -1:
            self._set_max_counts(max_counts)
        self._inner_count = wrapper_state.get('inner_count', 0)
        # saved between windows, the state has no gradients: clear any this wrapper holds
        # (a roll-back in the same process), or they would leak into the next window
        self.load_grad_state_dict(
            {
                'inner_count': self._inner_count,
                'grads': wrapper_state.get('pending_grads', {}),
                'scale': wrapper_state.get('pending_grads_scale', 1.0),
            }
        )

    def _grad_scale(self) -> float:
        """The factor the gradients carry (a loss scaler's scale under AMP float16; else 1)."""
        return 1.0

    def _load_optimizer_state(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        extra = f', accumulative_counts={self._accumulative_counts}'
        if self._clip_func is not None:
            extra += f', clip_grad={self.clip_grad_kwargs}'
        return f'{type(self).__name__}(optimizer={self.optimizer!r}{extra})'


# ------------------------------------------------- what the wrapper checks and parses
# type -> (function, log name, required keys, optional keys)
_CLIP_TYPES = {
    'norm': (
        torch.nn.utils.clip_grad_norm_,
        'grad_norm',
        ('max_norm',),
        ('norm_type', 'error_if_nonfinite', 'foreach'),
    ),
    'value': (torch.nn.utils.clip_grad_value_, 'grad_value', ('clip_value',), ('foreach',)),
}


def parse_clip_grad(clip_grad: Mapping | None) -> tuple[Any, str, dict]:
    """Validate ``clip_grad`` → ``(clip function or None, log name, kwargs)``; never mutates it."""
    if clip_grad is None:
        return None, 'grad_norm', {}
    if not isinstance(clip_grad, Mapping) or not clip_grad:
        raise TypeError(
            f'clip_grad must be None or a non-empty dict, got {clip_grad!r}; use '
            f"dict(type='norm', max_norm=1.0[, norm_type=2]) or dict(type='value', clip_value=1.0)"
        )
    kwargs = dict(clip_grad)
    clip_type = kwargs.pop('type', 'norm')
    if clip_type not in _CLIP_TYPES:
        raise ValueError(
            f'clip_grad type {clip_type!r} is unknown (clip_grad={dict(clip_grad)!r}); type must '
            f"be 'norm' (torch.nn.utils.clip_grad_norm_, needs max_norm) or 'value' "
            f'(torch.nn.utils.clip_grad_value_, needs clip_value)'
        )
    func, name, required, optional = _CLIP_TYPES[clip_type]
    missing = [k for k in required if k not in kwargs]
    unexpected = [k for k in kwargs if k not in required + optional]
    if missing or unexpected:
        raise ValueError(
            f"clip_grad={dict(clip_grad)!r}: type '{clip_type}' takes "
            f'{", ".join(required + optional)} ({", ".join(required)} required); '
            + (
                f'missing {", ".join(missing)}'
                if missing
                else f'unexpected {", ".join(unexpected)}'
            )
        )
    for key in required:
        value = kwargs[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(
                f'clip_grad={dict(clip_grad)!r}: {key} must be a positive number, got {value!r}'
            )
    return func, name, kwargs


def has_no_sync(model: nn.Module) -> bool:
    """Whether ``model`` has a ``no_sync`` method (DDP, FSDP), without ``hasattr(model, ...)``:
    a missing attribute on an ``nn.Module`` goes through ``Module.__getattr__``, which builds
    an error message, ~1 µs per accumulation step."""
    return hasattr(type(model), 'no_sync') or 'no_sync' in vars(model)


def _check_count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{name} must be an int >= {minimum}, got {value!r}')
    return value


def _warn_batchnorm_accumulation(model: nn.Module, accumulative_counts: int) -> None:
    """Warn (at the caller of ``initialize_count_status``) when accumulating over BatchNorm."""
    if accumulative_counts > 1 and any(isinstance(m, BatchNormBase) for m in model.modules()):
        warnings.warn(
            'gradient accumulation with BatchNorm layers: the running statistics '
            'see micro-batches, not the accumulated batch',
            stacklevel=3,
        )
