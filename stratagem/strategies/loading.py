"""Loading into a prepared strategy: the weights only (:func:`load_checkpoint`), an exact
resume (:func:`resume`), and mmengine's runner logic over both (:func:`load_or_resume`).

``BaseStrategy.load_checkpoint`` / ``resume`` / ``load_or_resume`` are these functions, one
line each. They use the strategy's public API only: its ``checkpointer`` (the load sequence,
``checkpoint/checkpointer.py``), its ``checkpoint_state()`` parts (``parts.py``: what each
checks and restores), ``load_model_state_dict`` and ``unwrap_model``. The sequences are told
in ``docs/architecture.md`` ("Load and resume").
"""

from __future__ import annotations

import functools
import os.path as osp
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.location import absolute, find_latest, is_url, list_checkpoints, parent
from stratagem.checkpoint.peer import PeerCopies
from stratagem.checkpoint.state_dict import describe_keys, find_model_weights

from .resume_checks import previous_run_traces, resume_newest
from .world_change import WorldSizeChange

if TYPE_CHECKING:
    from .base import BaseStrategy

__all__ = [
    'MIN_LOADED_SHARE',
    'check_same_step',
    'load_checkpoint',
    'load_or_resume',
    'load_weights',
    'resolve_map_location',
    'resume',
]

#: below this share of the model's tensors found in the file, a load warns loudly
MIN_LOADED_SHARE = 0.5

_REVISE_KEYS: Sequence[tuple[str, str]] = ((r'^module\.', ''),)


def resolve_map_location(strategy: BaseStrategy, location: Any) -> Any:
    """mmengine's ``'default'``: the strategy's device (CUDA's current one, else cpu)."""
    return str(strategy.device) if location == 'default' else location


def load_checkpoint(
    strategy: BaseStrategy,
    filename: str,
    *,
    map_location: Any = 'cpu',
    strict: bool = False,
    revise_keys: Sequence[tuple[str, str]] = _REVISE_KEYS,
    callback: Callable[[dict], None] | None = None,
) -> dict:
    """Load model weights from ``filename``; returns the whole checkpoint dict.

    ``callback(checkpoint)`` runs after reading and before loading, and may edit the dict in
    place. Foreign layouts are recognised: the weights are taken from ``state_dict``,
    ``model_state_dict``, ``model`` or ``module``, else the file is read as a bare state
    dict (``module.`` prefixes are stripped by the default ``revise_keys``). A file whose
    weights match none of the model's keys is an error even when not ``strict`` (mmengine
    loads nothing and goes on); a failed load leaves the model unchanged.
    """
    location = resolve_map_location(strategy, map_location)
    path, checkpoint = strategy.checkpointer.read(filename, location)
    if callback is not None:
        callback(checkpoint)
    load_weights(strategy, checkpoint, path, strict=strict, revise_keys=revise_keys)
    return checkpoint


def load_weights(
    strategy: BaseStrategy,
    checkpoint: Mapping,
    filename: str,
    *,
    strict: bool,
    revise_keys: Sequence[tuple[str, str]] = _REVISE_KEYS,
) -> None:
    """Find the weights (``state_dict``, or a foreign layout: ``model_state_dict``,
    ``model``, ``module``, a bare state dict) and load them; nothing changes on an error.

    No layout found, no key matching, or a strict mismatch raises
    ``StateDictMismatchError`` naming the file and what it holds; fewer than
    ``MIN_LOADED_SHARE`` of the model's tensors loaded warns ``PartialLoadWarning``.
    """
    where = None
    try:
        state_dict, where = find_model_weights(checkpoint)
        report = strategy.load_model_state_dict(state_dict, strict=strict, revise_keys=revise_keys)
    except ckpt.StateDictMismatchError as err:
        raise ckpt.StateDictMismatchError(
            f'{filename} {err}'
            if where is None
            else f'{filename} ({where}): {err}\nthe file holds {describe_keys(checkpoint)}'
        ) from None
    counts = ''
    if isinstance(report, ckpt.LoadReport) and report.total:
        counts = f', {report.loaded} of {report.total} tensors'
        if report.loaded < MIN_LOADED_SHARE * report.total:
            left_out = report.missing_keys + [
                k for k, *_ in report.shape_mismatches + report.type_mismatches
            ]
            env.warn_rank_zero(  # every rank loads the same file: said once
                f'{filename} ({where}): only {report.loaded} of the {report.total} '
                f'tensors of {type(strategy.unwrap_model()).__name__} were found and '
                f'loaded; not loaded: {", ".join(left_out[:10])}'
                f'{", ..." if len(left_out) > 10 else ""}. The file holds '
                f'{describe_keys(checkpoint)}. Fine for a partial (e.g. backbone) '
                'load; otherwise check the checkpoint and revise_keys',
                ckpt.PartialLoadWarning,
                stacklevel=4,
            )
    strategy.logger.info(f'loaded weights from {filename} ({where}{counts})')


def resume(
    strategy: BaseStrategy,
    filename: str,
    *,
    resume_optimizer: bool = True,
    resume_param_scheduler: bool = True,
    map_location: Any = 'default',
    callback: Callable[[dict], None] | None = None,
    refit_schedulers: bool = False,
    loaders: Mapping[str, Any] | None = None,
    own_copy: bool = False,
) -> dict:
    """Continue exactly where ``filename`` stopped; returns the checkpoint (``meta`` has iter).

    Restores model, optimizer (with counters, scaler, partial gradients), schedulers, each
    rank's state of ``loaders`` (``{name: loader}`` as saved: ``parts.LoaderPart``; at
    another data-parallel size a sample position converted, any other state refused naming
    the loader), then every rank's RNG state last; every check runs before anything is
    loaded, so a refused resume changes nothing. Call after ``prepare``. A world-size change
    puts ``world_size_change`` (with the converted ``max_iters``, when the run is counted in
    iterations) and the converted ``iter`` into the returned ``meta``. The sequence:
    :meth:`~stratagem.checkpoint.Checkpointer.load`.

    A scheduler whose ``end`` was fitted to the saving run's length (its cfg has no ``end``:
    it got ``max_epochs`` / ``max_iters``) keeps the saved length, as mmengine's resume
    does, with one warning naming it when this run's length differs;
    ``refit_schedulers=True`` gives it this run's length instead (``T_max`` and other
    lengths derived from ``end`` follow), its values replayed from the first iteration to
    the resumed one, so they are those of a fresh run of this length.

    ``own_copy``: ``filename`` is this rank's own peer copy (``checkpoint/peer.py``), the
    ranks agreed on its iteration before (every rank loads its own file; the iteration is
    still checked to be the same on every rank after).
    """
    if not strategy.prepared:
        raise RuntimeError(
            'resume() needs the prepared components: call strategy.prepare('
            'model, optim_wrapper=..., param_scheduler=...) first'
        )
    state = strategy.checkpoint_state(
        optimizer=resume_optimizer,
        schedulers=resume_param_scheduler,
        refit_schedulers=refit_schedulers,
        loaders=loaders,
    )
    context = strategy.checkpointer.load(
        filename,
        state,
        map_location=resolve_map_location(strategy, map_location),
        optimizer='optimizer' in state,
        callback=callback,
        own_copy=own_copy,
    )
    path, checkpoint = context.path, context.checkpoint
    meta = context.meta
    change: WorldSizeChange | None = context.notes.get('world_size_change')
    if change is not None:
        done = change.new_iter if change.new_iter is not None else meta.get('iter')
        checkpoint['meta'] = meta = {**meta, 'iter': done, 'world_size_change': change.as_meta()}
        if strategy.rank == 0:  # the same on every rank: said once
            enabled = bool((strategy.auto_scale_lr or {}).get('enable'))
            strategy.logger.warning(change.describe(path, auto_scale_lr=enabled))
    check_same_step(meta.get('iter'), path)
    strategy.resumed_from = absolute(path)
    strategy.logger.info(f'resumed from {path} (iter {meta.get("iter")})')
    return checkpoint


def load_or_resume(
    strategy: BaseStrategy,
    load_from: str | None = None,
    resume: bool | str = False,
    *,
    refit_schedulers: bool = False,
    loaders: Mapping[str, Any] | None = None,
    checkpoint_dir: str | None = None,
    peer: PeerCopies | None = None,
) -> dict | None:
    """mmengine's runner logic: resume (latest in work_dir, or a path) or just load weights.

    ``resume=True`` with no ``load_from`` resumes from the newest committed checkpoint in
    ``work_dir`` (none, in a work dir that never held one: starts fresh, with a log line;
    none, in a work dir whose pointer or checkpoint files show an earlier run:
    ``FileNotFoundError``, before anything is written; one this world size cannot continue
    from exactly: the newest that it can, with a warning); ``resume='path'`` or
    ``resume=True`` with ``load_from`` resumes from that file; ``load_from`` alone loads
    weights only. Returns the checkpoint or None. ``refit_schedulers``, ``loaders``: see
    :func:`resume` (a fresh start leaves the loaders as they are).

    ``checkpoint_dir``: where the run's checkpoints go when not in ``work_dir`` (a local
    path, or a URL: mmengine's ``out_dir``); ``resume=True`` looks there first, then at the
    work_dir's ``last_checkpoint`` (which may name a URL), so a new machine with an empty
    work_dir resumes from the bucket alone.

    ``peer``: the run's peer copies (``checkpoint/peer.py``). ``resume=True`` without
    ``load_from`` loads them when every rank has a verified copy of one iteration at least as
    new as the newest storage checkpoint (:func:`_resume_from_peer`), else storage, with a
    log line naming the tier and why; any other start removes them.
    """
    resume_fn = functools.partial(
        strategy.resume, refit_schedulers=refit_schedulers, loaders=loaders
    )
    strategy.wait_for_checkpoints()
    if strategy.rank == 0:  # debris of a killed run: its orphan manifests and temp entries
        ckpt.sweep_debris(strategy.work_dir)
    if peer is not None and not (resume is True and load_from is None):
        peer.clear()  # another start: a later restart must not find an older timeline's copy
    if isinstance(resume, str):
        return resume_fn(resume)
    if resume and load_from is None:
        own_fn = functools.partial(
            _resume_own_copy, strategy, refit_schedulers=refit_schedulers, loaders=loaders
        )
        return _resume_latest(strategy, resume_fn, checkpoint_dir, (peer, own_fn) if peer else None)
    if resume and load_from is not None:  # resume=True with a file: that file
        return resume_fn(load_from)
    if load_from is not None:
        return strategy.load_checkpoint(load_from)
    return None


def _resume_latest(
    strategy: BaseStrategy,
    resume_fn: Callable[[str], dict],
    checkpoint_dir: str | None = None,
    peer: tuple[PeerCopies, Callable[[str], dict]] | None = None,
) -> dict | None:
    """The newest committed checkpoint in ``checkpoint_dir`` (when given), else in
    ``work_dir``: rank 0 decides (other ranks may not see this work_dir, or see another
    one); ``resume`` then checks every rank reads that same checkpoint. With ``peer`` (the
    copies, and the resume of a rank's own copy), the peer copies first when they win
    (:func:`_resume_from_peer`)."""
    work_dir = strategy.work_dir
    rank = strategy.rank
    if peer is not None:
        resumed = _resume_from_peer(strategy, *peer, _newest_stored(strategy, checkpoint_dir))
        if resumed is not None:
            return resumed
    latest = _find_latest(strategy, checkpoint_dir) if rank == 0 else None
    latest = env.broadcast_object(None if latest is None else str(latest))
    if latest is not None and is_url(latest):
        return _resume_from_store(strategy, resume_fn, latest)
    if latest is not None:
        return resume_newest(resume_fn, str(latest), work_dir, strategy.logger)
    # a previous run left traces but nothing resumable: starting fresh would overwrite its
    # files, so stop before anything is written
    traces = env.broadcast_object(previous_run_traces(work_dir) if rank == 0 else None)
    if traces:
        raise FileNotFoundError(
            f'cannot resume from work_dir {work_dir}: {traces}, but no '
            'committed checkpoint there verifies; nothing was changed. Resume '
            'from a file with --resume PATH (API: resume=PATH), or start from '
            f'scratch in a new --work-dir (or after removing {ckpt.POINTER_NAME})'
        )
    strategy.logger.info(
        f'no checkpoint in {work_dir} to resume from; training starts from scratch'
    )
    return None


def _resume_own_copy(strategy: BaseStrategy, path: str, **kwargs: Any) -> dict:
    """:func:`resume` of this rank's own peer copy (``load_or_resume``'s ``resume`` argument
    hides the function there)."""
    return resume(strategy, path, own_copy=True, **kwargs)


def _newest_stored(
    strategy: BaseStrategy, checkpoint_dir: str | None
) -> tuple[str, str, int | None] | None:
    """The newest committed checkpoint by the manifests (nothing hashed: a storage checkpoint
    is verified when it is loaded), in ``checkpoint_dir`` (when given), else in work_dir:
    ``(path, name, step)``, the same on every rank (rank 0 looks), or None."""
    found = None
    if strategy.rank == 0:
        backend_args = strategy.checkpointer.backend_args
        where = [checkpoint_dir] if checkpoint_dir is not None else []
        for directory in [*where, strategy.work_dir]:
            if is_url(directory):
                remote = list_checkpoints(directory, backend_args)
                if remote:
                    found = (remote[0].url, remote[0].url.rsplit('/', 1)[-1], remote[0].step)
            else:
                local = ckpt.list_checkpoints(directory)
                if local:
                    found = (str(local[0].path), local[0].path.name, local[0].step)
            if found is not None:
                break
    return env.broadcast_object(found)


def _resume_from_peer(
    strategy: BaseStrategy,
    peer: PeerCopies,
    resume_own: Callable[[str], dict],
    stored: tuple[str, str, int | None] | None,
) -> dict | None:
    """Resume from the run's peer copies when they win over ``stored``, the newest storage
    checkpoint (``peer.choose``: a verified copy of one iteration on every rank, at least as
    new, of shards on this run's meshes); returns None (the copies removed) when storage
    wins. Either way one log line says which tier and why."""
    storage = None if stored is None else (stored[1], stored[2])
    # a copy of shards restores only the layout it was taken on: the model's meshes now, and
    # which of its tensors this rank holds (a pipeline stage's)
    meshes, shards = strategy.checkpointer.shard_layout({'state_dict': strategy.model_part()})
    choice = peer.plan(storage, meshes, shards)
    if choice.step is None:
        if stored is not None or choice.reason != 'no peer copies':  # else: a fresh start
            strategy.logger.info(f'resume tier: storage ({choice.reason})')
        peer.clear()
        return None
    path, failed = peer.fetch(choice)
    if path is None:
        strategy.logger.info(f'resume tier: storage ({choice.reason}; but {failed})')
        peer.clear()
        return None
    strategy.logger.info(f'resume tier: peer ({choice.reason}): {path}')
    checkpoint = resume_own(path)
    # the storage checkpoint of that very state, if there is one, is what the run resumed
    # from (retention keeps it; the metrics append to its folder); a copy in memory is not
    same = stored is not None and stored[2] == choice.step
    strategy.resumed_from = absolute(stored[0]) if same and stored is not None else None
    return checkpoint


def _resume_from_store(
    strategy: BaseStrategy, resume_fn: Callable[[str], dict], latest: str
) -> dict:
    """``resume(latest)`` at a URL; when its bytes do not match its manifest (read while
    loading: choosing it read only the manifests), the newest other committed checkpoint
    there, with a warning, as ``find_latest_checkpoint`` does on disk. A refused resume has
    changed nothing, so the next one starts clean."""
    tried = [latest]
    while True:
        try:
            return resume_fn(tried[-1])
        except ckpt.CheckpointCorruptError as err:
            older = None
            if strategy.rank == 0:
                found = list_checkpoints(parent(latest), strategy.checkpointer.backend_args)
                older = next((c.url for c in found if c.url not in tried), None)
            older = env.broadcast_object(older)
            if older is None:
                raise
            env.warn_rank_zero(
                f'{err}; resuming from the newest other committed checkpoint {older}',
                ckpt.CheckpointWarning,
                stacklevel=3,
            )
            tried.append(older)


def _find_latest(strategy: BaseStrategy, checkpoint_dir: str | None) -> str | None:
    """Rank 0's choice for ``_resume_latest``: the newest at ``checkpoint_dir`` (a URL:
    ``location.find_latest``), else the work_dir's pointer (a URL it names: the newest at
    that URL's prefix), else the newest in work_dir."""
    backend_args = strategy.checkpointer.backend_args
    where = [checkpoint_dir] if checkpoint_dir is not None else []
    named = _pointer_text(strategy.work_dir)
    if named is not None and is_url(named):
        where.append(parent(named))
    for directory in where:
        found = (
            find_latest(directory, backend_args)
            if is_url(directory)
            else ckpt.find_latest_checkpoint(directory)
        )
        if found is not None:
            return str(found)
    latest = ckpt.find_latest_checkpoint(strategy.work_dir)
    return None if latest is None else str(latest)


def _pointer_text(work_dir: str) -> str | None:
    """What work_dir's ``last_checkpoint`` says, unchecked; None without one."""
    try:
        with open(osp.join(work_dir, ckpt.POINTER_NAME), 'rb') as file:
            return file.read(4097).decode('utf-8', errors='replace').strip()
    except OSError:
        return None


def check_same_step(step: Any, filename: str) -> None:
    """After a resume every rank must stand at the same iteration (collective)."""
    keys = env.all_gather_keys([env.key_of(step)])
    if any(key != keys[0] for key in keys):  # the steps themselves only to report them
        steps = env.all_gather_object(step)
        raise RuntimeError(
            f'after resuming {filename} the ranks disagree on the iteration: '
            f'{steps} (rank order); every rank must resume the same checkpoint'
        )
