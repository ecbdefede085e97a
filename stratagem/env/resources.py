"""Process resources: the open-file limit and multi-processing / thread settings."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import platform
import sys
from typing import Any

from .logging import log_rank_zero, rank_prefix

logger = logging.getLogger(__name__)

_THREAD_VARS = ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')


class _IfImported(int):
    """The default of ``opencv_num_threads``: 0, applied only if cv2 is already imported."""

    def __repr__(self) -> str:
        return '0 (if cv2 is already imported)'


OPENCV_THREADS_IF_IMPORTED = _IfImported(0)


def set_resource_limit(nofile: int) -> int | None:
    """Raise the soft ``RLIMIT_NOFILE`` (open files) to ``min(nofile, hard limit)``.

    Data loaders that share tensors through file descriptors exhaust the usual soft
    limit of 1024. Never lowers the limit. Returns the soft limit in effect afterwards,
    or ``None`` where the ``resource`` module does not exist (Windows).
    """
    if isinstance(nofile, bool) or not isinstance(nofile, int) or nofile <= 0:
        raise ValueError(f'nofile must be a positive int (number of open files), got {nofile!r}')
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited:
        return soft
    target = nofile if hard == unlimited else min(nofile, hard)
    if target <= soft:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        # macOS caps below the reported hard limit (kern.maxfilesperproc); keep going.
        logger.warning(
            '%scould not raise RLIMIT_NOFILE from %d to %d: %s', rank_prefix(), soft, target, exc
        )
        return soft
    logger.info(
        'raised RLIMIT_NOFILE soft limit from %d to %d (hard %s)',
        soft,
        target,
        'unlimited' if hard == unlimited else hard,
    )
    return target


def setup_multi_processing(
    mp_start_method: str | None = None,
    opencv_num_threads: int | None = OPENCV_THREADS_IF_IMPORTED,
    distributed: bool = False,
) -> dict[str, object]:
    """Set the multi-processing start method and thread counts (mmengine's semantics).

    Args:
        mp_start_method: 'fork', 'spawn' or 'forkserver' for torch.multiprocessing (data
            loader workers); changed, with a warning, if another one is already set.
            Default ``None``: leave it. Ignored on Windows (only 'spawn' exists there).
        opencv_num_threads: threads for OpenCV (0: no extra threads, so data loader
            workers do not oversubscribe the cores). ``None``: leave OpenCV alone. Given
            explicitly (as mmengine configs do: ``mp_cfg=dict(opencv_num_threads=0)``),
            ``cv2`` is imported if installed and set. By default it is set to 0 only when
            the user's code has already imported ``cv2``: importing it costs 20-40 ms and
            ~25 MiB of RSS, which a run that never uses OpenCV should not pay (mmengine
            imports it unconditionally).
        distributed: when true, set ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` to 1 if
            unset, as torchrun does, so N processes on a node do not each start one thread
            per core. The variables reach child processes (loader workers) and libraries that
            read them late; a value the user set is never changed.

    Returns what changed: ``{name: new value}``, with names 'mp_start_method',
    'opencv_num_threads', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'.
    """
    if opencv_num_threads is not None and (
        isinstance(opencv_num_threads, bool)
        or not isinstance(opencv_num_threads, int)
        or opencv_num_threads < 0
    ):
        raise ValueError(
            f'opencv_num_threads must be an int >= 0 (threads for OpenCV; 0: none '
            f'extra) or None (leave OpenCV alone), got {opencv_num_threads!r}'
        )
    changed: dict[str, object] = {}
    if mp_start_method is not None and platform.system() != 'Windows':
        import torch.multiprocessing as mp

        valid = mp.get_all_start_methods()
        if mp_start_method not in valid:
            raise ValueError(
                f'unknown mp_start_method {mp_start_method!r}; valid on this '
                f'platform: {", ".join(map(repr, valid))}'
            )
        current = mp.get_start_method(allow_none=True)
        if current != mp_start_method:
            if current is not None:
                log_rank_zero(
                    logger,
                    logging.WARNING,
                    'multi-processing start method was %r; forcing it to %r (mp_start_method)',
                    current,
                    mp_start_method,
                )
            mp.set_start_method(mp_start_method, force=True)
            changed['mp_start_method'] = mp_start_method
    if (
        opencv_num_threads is not None
        and (cv2 := _opencv(explicit=type(opencv_num_threads) is not _IfImported)) is not None
    ):
        cv2.setNumThreads(int(opencv_num_threads))
        changed['opencv_num_threads'] = int(opencv_num_threads)
    if distributed:
        for name in _THREAD_VARS:
            if name not in os.environ:
                os.environ[name] = '1'
                changed[name] = '1'
        unset = [name for name in _THREAD_VARS if name in changed]
        if unset:  # the same on every rank: printed once
            log_rank_zero(
                logger,
                logging.WARNING,
                'set %s=1 in each process to avoid '
                'overloading the machine; set it yourself to tune',
                '=1 and '.join(unset),
            )
    if changed:
        log_rank_zero(logger, logging.INFO, 'multi-processing setup changed: %s', changed)
    return changed


def _opencv(explicit: bool) -> Any:
    """The ``cv2`` module if already imported; if ``explicit``, also import it when installed."""
    module = sys.modules.get('cv2')
    if module is not None or not explicit or importlib.util.find_spec('cv2') is None:
        return module
    return importlib.import_module('cv2')
