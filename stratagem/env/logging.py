"""Rank-aware loggers on the standard ``logging`` module.

``get_logger()`` configures the ``'stratagem'`` logger that every module of the package
logs under (``logging.getLogger(__name__)``). The root logger is never touched: if the
application configured it (or any other ancestor; it has handlers), our records propagate
there and we add no console handler of our own; otherwise we add one and stop
propagation, so nothing prints twice.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from .dist import get_rank, is_distributed

_FORMAT = '%(asctime)s %(name)s %(levelname)s: %(message)s'
_MARK = '_stratagem_handler'  # attribute naming the handlers this module added


def get_logger(name: str = 'stratagem', log_file: str | os.PathLike | None = None,
               log_level: int | str | None = None, file_mode: str = 'w') -> logging.Logger:
    """Return the logger ``name``, configured once however often it is called.

    Args:
        name: logger name. Default ``'stratagem'``, the parent of the package's loggers.
        log_file: also write to this file. Rank 0 writes ``log_file`` itself; rank r > 0
            writes ``<stem>_rank<r><suffix>`` next to it, at its own (by default WARNING)
            level. Files are created on the first record, so quiet ranks leave none.
        log_level: level name or number. Default ``None``: INFO on rank 0 and WARNING on
            the other ranks, unless an earlier call chose a level.
        file_mode: 'w' (truncate) or 'a' (append), used when the file handler is added.
    """
    if file_mode not in ('w', 'a'):
        raise ValueError(f"file_mode must be 'w' or 'a', got {file_mode!r}")
    if name.startswith('stratagem.'):
        # the package's own loggers print through 'stratagem' (and its file handler, added
        # now or later): configure that one, and let the child propagate to it
        get_logger('stratagem')
    logger = logging.getLogger(name)
    rank = _rank()
    if log_level is not None:
        logger.setLevel(_level(log_level))
        setattr(logger, '_stratagem_level_set', True)
    elif not getattr(logger, '_stratagem_level_set', False):
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = _FORMAT if rank == 0 else f'[rank {rank}] {_FORMAT}'
    ours = [getattr(h, _MARK) for h in logger.handlers if hasattr(h, _MARK)]
    # A configured ancestor (the root, or 'stratagem' for 'stratagem.x') already prints.
    parent = logger.parent
    if 'console' not in ours and not (parent is not None and parent.hasHandlers()):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(fmt))
        setattr(console, _MARK, 'console')
        logger.addHandler(console)
        logger.propagate = False
    if log_file is not None:
        path = Path(log_file)
        if rank != 0:
            path = path.with_name(f'{path.stem}_rank{rank}{path.suffix}')
        path = path.resolve()
        if f'file:{path}' not in ours:
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(path, mode=file_mode, encoding='utf-8', delay=True)
            handler.setFormatter(logging.Formatter(fmt))
            setattr(handler, _MARK, f'file:{path}')
            logger.addHandler(handler)
    return logger


def print_log(msg: object, logger: logging.Logger | str | None = None,
              level: int = logging.INFO) -> None:
    """Log ``msg`` at ``level`` to ``logger`` (a Logger or a name).

    ``None`` prints ``msg`` with ``print``; ``'silent'`` drops it.
    """
    if logger is None:
        print(msg)
    elif isinstance(logger, logging.Logger):
        logger.log(level, msg)
    elif logger == 'silent':
        return
    elif isinstance(logger, str):
        get_logger(logger).log(level, msg)
    else:
        raise TypeError(f"logger must be a logging.Logger, a logger name, 'silent' or None, "
                        f'got {type(logger).__name__}')


def _level(level: int | str) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str) and isinstance(logging.getLevelName(level.upper()), int):
        return logging.getLevelName(level.upper())
    raise ValueError(f'unknown log_level {level!r}; valid: DEBUG, INFO, WARNING, ERROR, '
                     'CRITICAL or an int')


def _rank() -> int:
    """Global rank, also before init_dist: loggers are usually made before the group."""
    if is_distributed():
        return get_rank()
    for var in ('RANK', 'SLURM_PROCID', 'OMPI_COMM_WORLD_RANK'):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0
