"""Rank-aware loggers on the standard ``logging`` module.

``get_logger()`` configures the ``'stratagem'`` logger that every module of the package
logs under (``logging.getLogger(__name__)``). The root logger is never touched: if the
application configured it (or any other ancestor; it has handlers), our records propagate
there and we add no console handler of our own; otherwise we add one and stop
propagation, so nothing prints twice.

Messages in a run of several processes are of two kinds. One that every rank would print
identically (a setting, a checkpoint's world size) is printed once, by global rank 0:
:func:`log_rank_zero`, :func:`warn_rank_zero`. One about this rank only (its host, its
files, its device) names the rank: records of ranks > 0 are prefixed ``[rank r]`` by our
handlers, and :func:`rank_prefix` / :func:`warn_per_rank` put it into a message that
leaves through another route (``warnings``, an exception, rank 0's own lines).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from .dist import get_rank, get_world_size, is_distributed

_FORMAT = '%(asctime)s %(name)s %(levelname)s: %(message)s'
_MARK = '_stratagem_handler'  # attribute naming the handlers this module added
# Before init_dist, the launcher's own variables tell the rank and the size (torchrun first;
# an MPI launcher's before SLURM_PROCID, which under an mpirun that Slurm started is the
# daemon's task id, not the rank).
_RANK_VARS = ('RANK', 'OMPI_COMM_WORLD_RANK', 'MV2_COMM_WORLD_RANK', 'PMI_RANK', 'SLURM_PROCID')
_SIZE_VARS = (
    'WORLD_SIZE',
    'OMPI_COMM_WORLD_SIZE',
    'MV2_COMM_WORLD_SIZE',
    'PMI_SIZE',
    'SLURM_STEP_NUM_TASKS',
)


def get_logger(
    name: str = 'stratagem',
    log_file: str | os.PathLike | None = None,
    log_level: int | str | None = None,
    file_mode: str = 'w',
) -> logging.Logger:
    """Return the logger ``name``, configured once however often it is called.

    Args:
        name: logger name. Default ``'stratagem'``, the parent of the package's loggers.
        log_file: also write to this file. Rank 0 writes ``log_file`` itself; rank r > 0
            writes ``<stem>_rank<r><suffix>`` next to it, at its own (by default WARNING)
            level. Files (and their directory) are created on the first record, so quiet
            ranks, and a run that fails before it logs, leave none.
        log_level: level name or number. Default ``None``: INFO on rank 0 and WARNING on
            the other ranks, unless an earlier call chose a level. On a rank > 0 the console
            shows WARNING and above whatever the level (as mmengine's ``MMLogger``: once per
            rank is for what concerns that rank); its file follows the level.
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
        setattr(logger, '_stratagem_level_set', True)  # noqa: B010 (not a Logger attribute)
    elif not getattr(logger, '_stratagem_level_set', False):
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    ours = [getattr(h, _MARK) for h in logger.handlers if hasattr(h, _MARK)]
    # A configured ancestor (the root, or 'stratagem' for 'stratagem.x') already prints.
    parent = logger.parent
    if 'console' not in ours and not (parent is not None and parent.hasHandlers()):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(_RankFormatter(rank))
        if rank != 0:
            # a level given to every rank alike (mmengine's runner passes its log_level,
            # INFO by default) must not print rank 0's lines once per rank: the console of a
            # rank > 0 shows its warnings and errors; its file has what the level lets in
            console.setLevel(logging.WARNING)
        setattr(console, _MARK, 'console')
        logger.addHandler(console)
        logger.propagate = False
    if log_file is not None:
        path = Path(log_file)
        if rank != 0:
            path = path.with_name(f'{path.stem}_rank{rank}{path.suffix}')
        path = path.resolve()
        if f'file:{path}' not in ours:
            handler = _LazyFileHandler(path, mode=file_mode, encoding='utf-8', delay=True)
            handler.setFormatter(_RankFormatter(rank))
            setattr(handler, _MARK, f'file:{path}')
            logger.addHandler(handler)
    return logger


def remove_file_handlers(logger: logging.Logger) -> None:
    """Close and remove the file handlers :func:`get_logger` added to ``logger`` (a new run
    writes its own file); its console handler and anyone else's handlers stay."""
    for handler in list(logger.handlers):
        if str(getattr(handler, _MARK, '')).startswith('file:'):
            logger.removeHandler(handler)
            handler.close()


def log_to_files(
    logger: logging.Logger, level: int, msg: str, *, skip: Iterable[logging.Handler] = ()
) -> None:
    """Log ``msg`` at ``level`` into the log files :func:`get_logger` opened for ``logger``
    (but those in ``skip``) only, not to the console: for a file's reader, what the console
    says its own way (the line saying why a run ended, where the command prints one error
    line)."""
    if not logger.isEnabledFor(level):
        return
    record = logger.makeRecord(logger.name, level, __file__, 0, msg, (), None)
    skipped = {id(h) for h in skip}
    for handler in logger.handlers:
        ours = str(getattr(handler, _MARK, '')).startswith('file:')
        if ours and id(handler) not in skipped and level >= handler.level:
            handler.handle(record)


@contextlib.contextmanager
def run_end_logged(logger: logging.Logger | None = None) -> Iterator[list[str]]:
    """A run's body (which builds its strategy, and so opens its log file), the last line of
    the log files opened inside it saying why the run ended: the line the body appends to
    the yielded list when it finishes (``'run ended: finished, ...'``), else ``run ended:
    interrupted (Ctrl-C, SIGINT)`` or ``run ended: error: <type>: <message on one line>``.
    ``logger``: default ``'stratagem'``, the strategies' own. Into those files only
    (:func:`log_to_files`): not a file a run before this one in the process left open, nor
    the console, which has the command's own line for an interrupt or an error."""
    logger = logger or logging.getLogger('stratagem')
    before = list(logger.handlers)
    ended: list[str] = []
    try:
        yield ended
    except KeyboardInterrupt:
        log_to_files(logger, logging.WARNING, 'run ended: interrupted (Ctrl-C, SIGINT)',
                     skip=before)  # fmt: skip
        raise
    except BaseException as err:
        message = ' '.join(str(err).split()) or repr(err)
        log_to_files(logger, logging.ERROR, f'run ended: error: {type(err).__name__}: {message}',
                     skip=before)  # fmt: skip
        raise
    for line in ended:
        log_to_files(logger, logging.INFO, line, skip=before)


def print_log(
    msg: object, logger: logging.Logger | str | None = None, level: int = logging.INFO
) -> None:
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
        raise TypeError(
            f"logger must be a logging.Logger, a logger name, 'silent' or None, "
            f'got {type(logger).__name__}'
        )


def log_rank_zero(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """Log ``msg % args`` on global rank 0 only: for a line every rank would print alike.

    Before ``init_dist`` the rank comes from the launcher's variables (``RANK``,
    ``OMPI_COMM_WORLD_RANK``, ``MV2_COMM_WORLD_RANK``, ``PMI_RANK``, ``SLURM_PROCID``).
    """
    if _rank() == 0:
        logger.log(level, msg, *args, stacklevel=2)


def warn_rank_zero(
    message: str, category: type[Warning] = UserWarning, stacklevel: int = 1
) -> None:
    """``warnings.warn`` on global rank 0 only: for a warning every rank would raise alike
    (the same checkpoint, the same world-size change). Same arguments as ``warnings.warn``;
    ``stacklevel`` counts from the caller, as there."""
    if _rank() == 0:
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def warn_per_rank(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` on this rank, the message prefixed ``'[rank r] '`` when several
    processes run: for a warning about this rank only."""
    warnings.warn(rank_prefix() + message, category, stacklevel=stacklevel + 1)


def rank_prefix() -> str:
    """``'[rank r] '`` in a run of several processes, ``''`` in a single process."""
    return f'[rank {_rank()}] ' if _world_size() > 1 else ''


class _LazyFileHandler(logging.FileHandler):
    """A file handler that makes the file's directory when it opens the file (the first
    record): a run that fails before it logs leaves no empty log directory."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


class _RankFormatter(logging.Formatter):
    """``[rank r] `` before every line of a rank > 0, unless the message names it already."""

    def __init__(self, rank: int) -> None:
        super().__init__(_FORMAT)
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.rank == 0 or record.getMessage().startswith('[rank '):
            return text
        return f'[rank {self.rank}] {text}'


def _level(level: int | str) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str) and isinstance(logging.getLevelName(level.upper()), int):
        return logging.getLevelName(level.upper())
    raise ValueError(
        f'unknown log_level {level!r}; valid: DEBUG, INFO, WARNING, ERROR, CRITICAL or an int'
    )


def _rank() -> int:
    """Global rank, also before init_dist: loggers are usually made before the group."""
    if is_distributed():
        return get_rank()
    for var in _RANK_VARS:
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def _world_size() -> int:
    """World size, also before init_dist (from the launcher's variables); 1 when unknown."""
    if is_distributed():
        return get_world_size()
    for var in _SIZE_VARS:
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 1
