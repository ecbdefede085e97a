"""Checks a resume makes before it changes anything, so a failed one loses nothing.

``check_model_fits``, ``check_optimizer_fits`` and ``check_scheduler_count`` compare a
loaded checkpoint with the prepared components (model shapes, optimizer param groups,
scheduler count: the checks of a strategy's checkpoint parts); ``previous_run_traces`` tells a work
dir that never held a checkpoint from one whose checkpoints cannot be resumed. Both only
read; the strategy raises before it loads, writes or re-seeds anything. ``resume_newest``
is the automatic resume (``resume=True``): the newest checkpoint this world size can
continue from exactly.
"""

from __future__ import annotations

import logging
import os
import os.path as osp
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from stratagem import checkpoint as ckpt
from stratagem.checkpoint.latest import read_pointer
from stratagem.checkpoint.state_dict import check_state_dict

__all__ = [
    'check_model_fits',
    'check_optimizer_fits',
    'check_scheduler_count',
    'previous_run_traces',
    'resume_newest',
]

_CHECKPOINT_SUFFIXES = ('.pth', '.pt', '.ckpt', '.bin', '.safetensors', '.manifest.json')


def previous_run_traces(work_dir: str) -> str | None:
    """What in ``work_dir`` shows that an earlier run left checkpoints (a ``last_checkpoint``
    pointer, checkpoint files or manifests), worded for an error; None when nothing does."""
    if osp.isfile(osp.join(work_dir, ckpt.POINTER_NAME)):
        try:
            target = read_pointer(work_dir)
        except (ValueError, OSError) as err:
            return f'its {ckpt.POINTER_NAME} is unreadable ({err})'
        state = 'is damaged' if target is not None and osp.exists(target) else 'does not exist'
        return f'its {ckpt.POINTER_NAME} points to {target}, which {state}'
    try:
        names = sorted(os.listdir(work_dir))
    except OSError:
        return None
    found = [n for n in names if n.endswith(_CHECKPOINT_SUFFIXES) and not n.startswith('.')]
    if found:
        return (
            'it holds checkpoint file(s) '
            + ', '.join(found[:5])
            + (', ...' if len(found) > 5 else '')
        )
    return None


def resume_newest(
    resume: Callable[[str], dict], latest: str, work_dir: str, logger: logging.Logger
) -> dict:
    """``resume(latest)``; when this world size cannot continue from it exactly (an elastic
    round of another size left it mid accumulation window, or at a position that is no
    whole number of its iterations), the newest older checkpoint in ``work_dir`` it can,
    with a warning: a restarted or re-formed run goes on by itself, reading again the
    samples after that one. Rank 0 picks (by creation time: steps of other sizes do not
    compare)."""
    from stratagem import env

    from .world_change import WorldSizeChangeError

    tried = [latest]
    while True:
        try:
            return resume(tried[-1])
        except WorldSizeChangeError as err:
            older = None
            if env.get_rank() == 0:
                found = ckpt.list_checkpoints(work_dir)
                found.sort(key=lambda c: c.created, reverse=True)
                older = next((str(c.path) for c in found if str(c.path) not in tried), None)
            older = env.broadcast_object(older)
            if older is None:
                raise
            logger.warning(f'{err}; resuming from {older} instead')
            tried.append(older)


def check_model_fits(model: nn.Module, state_dict: Mapping, filename: str) -> None:
    """Raise ``StateDictMismatchError`` naming ``filename`` when the saved weights cannot
    continue ``model``: tensors of another shape or dtype, or none matching. Missing or
    extra keys only warn later, as in mmengine."""
    report = check_state_dict(model, ckpt.revise_keys(state_dict))
    if report.shape_mismatches or report.type_mismatches or (report.total and not report.loaded):
        raise ckpt.StateDictMismatchError(
            f'cannot resume {filename}: its weights do not fit {type(model).__name__} (it is '
            f'from another model or config); nothing was changed:\n{report}'
        )


def check_optimizer_fits(wrapper: Any, state: Any, filename: str) -> None:
    """Raise ``ValueError`` naming ``filename`` when the saved optimizer state cannot continue
    ``wrapper``'s optimizer(s): param groups of other sizes, or hyperparameters it lacks."""
    want = _current_sizes(wrapper)
    have = _saved_sizes(state, want)
    if _differs(want, have):
        raise ValueError(
            f'cannot resume {filename}: its optimizer has param groups of '
            f'sizes {have}, this run builds {want} (the model or '
            f'optim_wrapper.paramwise_cfg changed); nothing was changed'
        )
    lacking = _lacking_hyperparameters(wrapper, state)
    if lacking:
        raise ValueError(
            f'cannot resume {filename}: its optimizer param groups lack '
            f"{lacking}, which this run's optimizer needs: it was saved with "
            'another optimizer type; nothing was changed. Load the weights '
            'only (load_checkpoint, load_from) or pass resume_optimizer=False'
        )


def check_scheduler_count(current: Any, saved: Any, filename: str) -> None:
    """Raise ``ValueError`` naming ``filename`` when it holds another number of scheduler
    states than this run builds (``current``: this run's, same shape)."""
    want, have = _count(current), _count(saved)
    if want != have:
        raise ValueError(
            f'cannot resume {filename}: it holds {have} param scheduler '
            f'state(s), this run builds {want} (the param_scheduler config '
            'changed); nothing was changed'
        )


def _current_sizes(wrapper: Any) -> Any:
    """Param-group sizes of the built optimizer(s): a list, a dict of them for an
    OptimWrapperDict, None where they cannot be compared (a sharded optimizer)."""
    if hasattr(wrapper, 'optim_wrappers'):
        return {k: _current_sizes(v) for k, v in wrapper.optim_wrappers.items()}
    optimizer = getattr(wrapper, 'optimizer', None)
    if optimizer is None or type(optimizer).__name__ == 'ZeroRedundancyOptimizer':
        return None
    return [len(g['params']) for g in optimizer.param_groups]


def _lacking_hyperparameters(wrapper: Any, state: Any) -> list[str]:
    """Hyperparameters the built torch optimizer needs that the saved param groups lack even
    after the optimizer's own ``__setstate__`` filled its defaults (SGD saved, AdamW built:
    'betas', 'eps'); torch would load them and fail at the first step with KeyError."""
    if hasattr(wrapper, 'optim_wrappers'):
        return sorted(
            {
                k
                for name, w in wrapper.optim_wrappers.items()
                for k in _lacking_hyperparameters(
                    w, state.get(name) if isinstance(state, Mapping) else None
                )
            }
        )
    optimizer = getattr(wrapper, 'optimizer', None)
    cls = type(optimizer)
    if (
        optimizer is None
        or not cls.__module__.startswith('torch.optim')
        or not isinstance(state, Mapping)
        or not isinstance(state.get('param_groups'), list)
    ):
        return []
    groups = [dict(g) for g in state['param_groups'] if isinstance(g, Mapping)]
    try:  # a bare instance: only __setstate__'s defaulting runs, nothing is built
        probe = cls.__new__(cls)  # type: ignore[call-overload]
        cls.__setstate__(  # type: ignore[union-attr]
            probe,
            {
                'defaults': dict(optimizer.defaults),
                'state': {},
                'param_groups': groups,
            },
        )
    except Exception:  # noqa: BLE001 - cannot tell: torch's own load decides
        return []
    return sorted({k for g in probe.param_groups for k in optimizer.defaults if k not in g})


def _saved_sizes(state: Any, like: Any) -> Any:
    """The same shape as ``like``, read from a saved optimizer state dict."""
    if isinstance(like, dict):
        return {
            k: _saved_sizes(state.get(k) if isinstance(state, Mapping) else None, v)
            for k, v in like.items()
        }
    if (
        like is None
        or not isinstance(state, Mapping)
        or not isinstance(state.get('param_groups'), list)
    ):
        return None
    return [
        len(g.get('params', ())) if isinstance(g, Mapping) else 0 for g in state['param_groups']
    ]


def _differs(want: Any, have: Any) -> bool:
    if isinstance(want, dict):
        return any(_differs(v, have.get(k)) for k, v in want.items())
    return want is not None and have is not None and want != have


def _count(states: Any) -> Any:
    if isinstance(states, Mapping):
        return {k: len(v) for k, v in states.items()}
    return len(states) if isinstance(states, (list, tuple)) else None
