"""``DeepSpeedOptimWrapper``: the OptimWrapper interface over a DeepSpeed engine.

One source of truth: the wrapper's ``accumulative_counts`` and ``clip_grad`` decide
accumulation and clipping; :class:`~stratagem.strategies.DeepSpeedStrategy` writes them into
DeepSpeed's config (``gradient_accumulation_steps``, ``gradient_clipping`` — 0 when
``clip_grad`` is None, because DeepSpeed's own default 1.0 would clip silently) and refuses a
config value that disagrees. When accumulating, the engine runs with
``managed_gradient_accumulation: false``: this wrapper owns the accumulation boundary exactly
as :class:`OptimWrapper` does (without accumulation every step is a boundary and DeepSpeed's
default mode is kept), so

1. ``scale_loss``: the loss is divided by the length of the current window (the last,
   incomplete window by its real length, after ``initialize_count_status``),
2. ``backward``: ``engine.backward(loss, scale_wrt_gas=False)`` accumulates locally,
3. ``step`` on ``should_update()``: ``engine.step()`` reduces the gradients, clips them to
   ``max_norm`` (L2, over all ranks' full gradients) and updates; ``zero_grad`` then has
   nothing left to do (the engine cleared the gradients).

mmengine's ``DeepSpeedOptimWrapper`` refuses ``accumulative_counts`` and ``clip_grad`` and
lets DeepSpeed's config decide both behind its back; calling ``backward`` N times and ``step``
once with DeepSpeed's defaults is silently wrong under ZeRO-2. This wrapper fixes both.

``optimizer`` is the client torch optimizer: DeepSpeed's ZeRO optimizer shares its
``param_groups``, so schedulers and lr edits on this wrapper reach the update. The
optimizer's tensors (moments, fp32 master weights) live in DeepSpeed's partitions and are
saved by the strategy's checkpoint; :meth:`state_dict` holds the counters only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from stratagem.optim.optim_wrapper import OptimWrapper

__all__ = ['DeepSpeedOptimWrapper']

_NULL_CONTEXT = contextlib.nullcontext()


class DeepSpeedOptimWrapper(OptimWrapper):
    """Optimizer wrapper driving a ``deepspeed.DeepSpeedEngine`` (set by the strategy).

    Args:
        optimizer: A torch optimizer over the model's parameters (DeepSpeed-config
            optimizers are not used: they JIT-build fused kernels and would be a second
            source of truth).
        accumulative_counts: Micro-batches per update (default 1).
        clip_grad: ``None`` (no clipping; ``gradient_clipping`` 0) or
            ``dict(type='norm', max_norm=...)`` with ``norm_type`` 2 (DeepSpeed clips by the
            global L2 norm). Clipping by value is refused: DeepSpeed offers no hook between
            its gradient reduction and its update, so ``clip_grad_value_`` cannot be applied
            to the reduced (under ZeRO, partitioned) gradients.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulative_counts: int = 1,
        clip_grad: dict | None = None,
    ) -> None:
        if clip_grad is not None and isinstance(clip_grad, Mapping):
            kind = clip_grad.get('type', 'norm')
            if kind == 'value':
                raise ValueError(
                    f'DeepSpeedOptimWrapper: clip_grad={dict(clip_grad)!r} clips by value, which '
                    'DeepSpeed cannot do: it reduces, clips and updates inside engine.step() '
                    "with no hook in between; use clip_grad=dict(type='norm', max_norm=...)"
                )
            norm_type = clip_grad.get('norm_type', 2)
            if kind == 'norm' and float(norm_type) != 2.0:
                raise ValueError(
                    f'DeepSpeedOptimWrapper: clip_grad={dict(clip_grad)!r} has norm_type '
                    f'{norm_type!r}; DeepSpeed clips by the L2 norm only: use norm_type=2'
                )
            if clip_grad.get('error_if_nonfinite'):
                raise ValueError(
                    f'DeepSpeedOptimWrapper: clip_grad={dict(clip_grad)!r}: error_if_nonfinite '
                    'is not available under DeepSpeed (its fp16 loss scaler skips non-finite '
                    'steps instead); remove it'
                )
        super().__init__(optimizer, accumulative_counts=accumulative_counts, clip_grad=clip_grad)
        self._engine: Any = None
        self._clear = False  # the engine zeroed the gradients in its last step()
        self._own_norm: torch.Tensor | None = None  # recorded where DeepSpeed keeps none

    # ---- set-up by the strategy --------------------------------------------------------
    @property
    def max_norm(self) -> float:
        """The clipping threshold DeepSpeed gets as ``gradient_clipping`` (0.0: no clipping)."""
        return float(self.clip_grad_kwargs['max_norm']) if self.clip_func is not None else 0.0

    @property
    def engine(self) -> Any:
        """The ``DeepSpeedEngine`` this wrapper drives (set by ``DeepSpeedStrategy.prepare``)."""
        if self._engine is None:
            raise RuntimeError(
                'DeepSpeedOptimWrapper has no DeepSpeed engine yet: build it '
                'through DeepSpeedStrategy.prepare(model, optim_wrapper=dict('
                "type='DeepSpeedOptimWrapper', optimizer=...))"
            )
        return self._engine

    @property
    def model(self) -> Any:
        """mmengine's name for :attr:`engine`."""
        return self.engine

    def attach(self, engine: Any) -> None:
        """Drive ``engine``; called once by the strategy after ``deepspeed.initialize``."""
        self._engine = engine
        if self.clip_func is not None and not (
            engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled()
        ):
            # Without ZeRO or reduced precision DeepSpeed clips plain fp32 gradients and
            # throws the norm away; clip here instead (same call, same place in step()), so
            # last_grad_norm is known.
            engine.clip_fp32_gradients = self._clip_fp32

    def _clip_fp32(self) -> None:
        params = [p for p in self._engine.module.parameters() if p.grad is not None]
        if params:
            self._own_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)

    # ---- the training step -------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward(loss)`` (no division by DeepSpeed: the loss is already scaled
        by :meth:`scale_loss`), then count the micro-batch. ``kwargs``: ``retain_graph``."""
        self.engine.backward(loss, scale_wrt_gas=False, **kwargs)
        self._inner_count += 1
        self._clear = False

    def step(self, **kwargs: Any) -> None:
        """Reduce, clip (``gradient_clipping``) and update: ``engine.step()``.

        ``kwargs`` are refused (the engine's update takes none); ``lr_kwargs`` belong to
        DeepSpeed's own schedulers, which are not used.
        """
        if kwargs:
            raise TypeError(
                f'DeepSpeedOptimWrapper.step() takes no arguments, got '
                f'{sorted(kwargs)}; the update is engine.step()'
            )
        self.engine.step()
        self._clear = True

    def zero_grad(self, **kwargs: Any) -> None:
        """Clear the gradients. After :meth:`step` the engine already did (free).

        Dropping the gradients of an unfinished window works without ZeRO in fp32 (they are
        ``p.grad``); under ZeRO or reduced precision it raises: DeepSpeed keeps them in
        its own reduced buffers, which only its update clears (measured: ZeRO-2's
        ``optimizer.zero_grad()`` leaves them, and the next update uses them).
        """
        if self._clear:
            return
        engine = self.engine
        if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
            raise RuntimeError(
                f'DeepSpeedOptimWrapper.zero_grad() inside an accumulation window (iteration '
                f'{self._inner_count}) under ZeRO stage {engine.zero_optimization_stage()} / '
                'reduced precision: DeepSpeed holds the partial gradients in its own buffers '
                'and clears them only at the update; finish the window with update_params()'
            )
        engine.zero_grad()
        self._clear = True

    def optim_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A no-op: when accumulating, the engine reduces only in ``step()``
        (``managed_gradient_accumulation`` off), so there is no sync to suppress."""
        return _NULL_CONTEXT

    @property  # type: ignore[override]
    def last_grad_norm(self) -> torch.Tensor | float | None:
        """The global L2 gradient norm of the last update, before clipping (None before the
        first). A tensor where DeepSpeed keeps one (no host sync is added)."""
        if self._engine is None:
            return None
        norm = self._engine.get_global_grad_norm()
        return self._own_norm if norm is None else norm

    @last_grad_norm.setter
    def last_grad_norm(self, value: Any) -> None:
        # the value reported where the engine keeps no norm (OptimWrapper.__init__ sets None)
        self._own_norm = value

    # ---- state -------------------------------------------------------------------------
    def grad_state_dict(self) -> dict:
        """Refused: partial gradients live in DeepSpeed's buffers and partitions, not in
        ``p.grad``; checkpoints are taken between accumulation windows."""
        raise RuntimeError(
            'DeepSpeedOptimWrapper has no partial gradients to hand out: '
            'DeepSpeed accumulates them in its own buffers and partitions; '
            'checkpoints are taken between accumulation windows'
        )

    def load_grad_state_dict(self, state_dict: Mapping) -> None:
        """Refused: DeepSpeed's gradient buffers cannot be filled from outside."""
        raise RuntimeError(
            'DeepSpeedOptimWrapper cannot load partial gradients (DeepSpeed '
            'accumulates in its own buffers); resume from a window boundary'
        )

    def state_dict(self) -> dict:
        """``{'optim_wrapper': counters}``; the optimizer's tensors are in DeepSpeed's files.

        Refused inside an accumulation window: DeepSpeed's checkpoint cannot hold the
        partial gradients, so a resume would silently drop them.
        """
        if self._window_open():
            raise RuntimeError(self.mid_window_message())
        return {
            'optim_wrapper': {
                'inner_count': self._inner_count,
                'max_counts': self._max_counts,
                'accumulative_counts': self._accumulative_counts,
            }
        }

    def mid_window_message(self) -> str:
        """Why a state saved now could not resume exactly, and what to do instead."""
        k = self._accumulative_counts
        start = self._inner_count - self._inner_count % k
        return (
            f'cannot checkpoint at iteration {self._inner_count}: it is inside an '
            f'accumulation window of {k} (iterations {start}..{start + k - 1}), and '
            f"DeepSpeed's checkpoint does not hold the partial gradients of its first "
            f'{self._inner_count - start} micro-batch(es), so a resume would be off by '
            f'them. Save when the window is complete: at a multiple of '
            f'accumulative_counts={k} (e.g. checkpoint_interval={k}) or at max_iters'
        )

    def load_state_dict(
        self, state_dict: dict, *, load_optimizer: Callable[[dict], None] | None = None
    ) -> None:
        """Restore the counters saved by :meth:`state_dict` (the optimizer's tensors are in
        DeepSpeed's files, so ``load_optimizer`` is not called).

        An mmengine ``DeepSpeedOptimWrapper`` state (``{}`` or ``base_param_settings``
        only) restores nothing. A differing ``accumulative_counts`` is accepted (the saved
        state is between windows), as :class:`OptimWrapper` accepts it.
        """
        state = dict(state_dict or {}).get('optim_wrapper')
        if state is None:
            return
        if 'pending_grads' in state:
            raise ValueError(
                'this state_dict was saved inside an accumulation window by an '
                'OptimWrapper; DeepSpeed cannot take partial gradients: resume it '
                'with the strategy that saved it, or from a window boundary'
            )
        if state.get('max_counts', -1) != -1:
            self._set_max_counts(state['max_counts'])
        self._inner_count = int(state.get('inner_count', 0))
        self._restored_count = self._inner_count

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(optimizer={self.optimizer!r}, accumulative_counts='
            f'{self._accumulative_counts}, gradient_clipping={self.max_norm})'
        )
