"""DeepSpeedStrategy's checkpoint storage: DeepSpeed's files on stratagem's directory protocol.

``save_checkpoint(filename)``: the strategy's ``Checkpointer`` (``checkpoint/checkpointer.py``)
runs the sequence; :class:`ZeroStorage` is this backend's part of it:
    1. ``check_savable``: refused inside an accumulation window (DeepSpeed's files cannot
       hold the partial gradients: a resume would be off by them), before anything is
       written.
    2. The checkpointer gathers the strategy's parts (meta with ``zero_stage``, schedulers,
       wrapper counters, every rank's RNG, ``extra_ckpt``; the ``state_dict`` part is left
       out: DeepSpeed's files hold the model) and validates them (tensors and plain values).
    3. ``stage``: the directory protocol (``checkpoint/directory.py``; the save's store
       vote): rank 0 creates a fresh staging directory beside ``filename``.
    4. DeepSpeed's ``save_checkpoint(staging, tag='deepspeed', save_latest=False)`` runs on
       every rank in the foreground (its collectives stay on the training thread), with
       ``engine.checkpoint_engine`` swapped for a capturing one (``capture.py``):
       each file is written at once (hashed as written, fsynced) or, with
       ``async_checkpoint``, copied to CPU staging buffers; rank 0 adds
       ``stratagem_state.pth`` the same way. No ``latest`` file, nothing outside staging.
    5. The write job (with ``async_checkpoint``: on the writer thread, no collective):
       staged files are written; the ranks post success or their error through the vote;
       rank 0 hashes what DeepSpeed wrote itself (``zero_to_fp32.py``), writes
       ``manifest.json``, renames the directory to ``filename``, updates
       ``last_checkpoint``. Before that rename no checkpoint has that name.

``resume`` / ``load_checkpoint`` of a directory
    1. ``checkpoint.verify_directory``: every size on every rank, every digest on one rank,
       the same manifest everywhere (DeepSpeed unpickles with ``weights_only=False``: a
       tampered or foreign file must be refused before that). Any failure raises on all.
       A resume from a URL at the world size that saved it: every size on every rank, and
       each rank reads into memory, verified (digest, torch archive), the files DeepSpeed
       reads on it (``files.rank_reads``); its engine loads them from there in step 4
       (``streaming.py``). Anything else at a URL is downloaded first, verified.
    2. ``stratagem_state.pth`` loads with ``weights_only=True``; the keys asked for are
       checked before anything is restored.
    3. Another world size: BaseStrategy's plan (``world_change.py``) converts iteration
       counts and schedulers, or refuses, before anything is loaded.
    4. ``restore``: same world size, or without the optimizer (the weights alone load at
       any world size), ``engine.load_checkpoint`` (model, optimizer partitions, engine
       counters); another world size with the optimizer, the checkpoint is converted to
       DeepSpeed's universal format beside it and loaded from there (resharding the
       optimizer state). ZeRO-3 without the optimizer: DeepSpeed consolidates the weights
       from every rank's files, finding them by a ``latest`` file that our checkpoints do
       not have (the commit is our pointer); it is given a new local directory holding
       ``latest`` and a link to the checkpoint's ``deepspeed/`` (``_latest_view``), and
       nothing is written into the checkpoint.
    5. The strategy's parts: counters, schedulers, then RNG states last.
``load_checkpoint`` loads weights only: a directory is consolidated to full fp32 weights
(``files.py``), a file is read safely; both go through ``load_model_state_dict``,
which refreshes DeepSpeed's fp32 master copy so the next update starts from them.
"""

from __future__ import annotations

import contextlib
import functools
import os.path as osp
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.content import SAFE_GLOBALS_KEY
from stratagem.checkpoint.directory import (
    begin_directory_save,
    finish_directory_save,
    new_staging_dir,
    verify_directory,
    write_directory_files,
)
from stratagem.checkpoint.formats import detect
from stratagem.checkpoint.location import is_url
from stratagem.checkpoint.remote_directory import (
    RemoteDirectory,
    download_directory,
    verify_remote_directory,
)
from stratagem.checkpoint.storage import CheckpointStorage, SaveCommit

from .capture import CapturingCheckpointEngine
from .files import (
    DEEPSPEED_TAG,
    STATE_FILE,
    check_zero_archive,
    check_zero_archives,
    check_zero_layout,
    rank_reads,
    zero_to_state_dict,
)
from .streaming import StreamingCheckpointEngine, file_names

if TYPE_CHECKING:
    import logging

__all__ = ['ZeroStorage']


def _to_universal(src: Path, dst: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` on a verified checkpoint, in this process."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(src),
        output_folder=str(dst),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        ds_to_universal.main(args)


class ZeroStorage(CheckpointStorage):
    """DeepSpeed's own files plus ``stratagem_state.pth`` in one directory, committed by the
    directory protocol (steps 1-5 of the module doc).

    With ``async_checkpoint`` the save returns once DeepSpeed's engine (in the foreground:
    its collectives need the training thread) has handed over its files and they are
    copied to CPU staging buffers; writing, hashing, fsync and the commit run on the writer
    thread. Peak extra memory: one CPU copy of this rank's files' tensors (its optimizer
    partition, rank 0's model states and our state), kept for the next save. No copy is
    deferred past the return (DeepSpeed's step writes its fp32 partitions in place).
    ``save_optimizer=False`` leaves the counters out of our state (a resume then needs
    ``resume_optimizer=False``); DeepSpeed still writes its optimizer partitions, since its
    layout has no weights-only form that every ZeRO stage reloads.

    Args:
        engine: returns the ``DeepSpeedEngine`` (built by ``prepare``).
        optim_wrapper: returns the DeepSpeedOptimWrapper, or None before ``prepare``.
        exclude_frozen_parameters: DeepSpeed's option (frozen weights left out of its files).
        extra_manifest: the manifest's extra fields (strategy, ZeRO stage).
        logger: where a resharded resume says so.
    """

    holds = frozenset({'state_dict'})  # DeepSpeed's files hold the module's weights

    def __init__(
        self,
        *,
        engine: Callable[[], Any],
        optim_wrapper: Callable[[], Any],
        exclude_frozen_parameters: bool,
        extra_manifest: Callable[[], dict],
        logger: logging.Logger,
    ) -> None:
        super().__init__(extra_manifest)
        self.engine = engine
        self.optim_wrapper = optim_wrapper
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.logger = logger
        # a checkpoint at a URL, downloaded (verified) for DeepSpeed's engine, which reads
        # only local files: {url: local copy}, removed once restored
        self._downloads: dict[str, Path] = {}

    # ------------------------------------------------------------------- save side
    @override
    def all_ranks_write(self) -> bool:
        """Every rank writes its ZeRO partition, in DeepSpeed's engine (collective)."""
        return True

    @override
    def check_savable(self, path: str) -> None:
        wrapper = self.optim_wrapper()
        if wrapper is not None and not wrapper.should_update():
            raise ValueError(f'{path}: {wrapper.mid_window_message()}')

    @override
    def stage(
        self, checkpoint: dict, path: str, commit: SaveCommit, writer: AsyncCheckpointWriter | None
    ) -> Callable[[], None]:
        # every rank here before DeepSpeed's collectives, or all raise naming one that failed
        commit.arrive()
        engine = self.engine()
        extra: dict[str, Any] = self.extra_manifest()
        if commit.held:
            extra[SAFE_GLOBALS_KEY] = commit.held
        final: Path | str = path if is_url(path) else Path(path)
        # raises on every rank
        staging = begin_directory_save(final, commit.vote, backend_args=commit.backend_args)
        if isinstance(final, str):  # each rank's own staging dir: DeepSpeed makes it on rank 0
            (staging / DEEPSPEED_TAG).mkdir(exist_ok=True)
        # from here on the vote ends in _finish, on every path
        capture = CapturingCheckpointEngine(engine.checkpoint_engine, staging, writer)
        try:
            with capture.installed_on(engine):
                engine.save_checkpoint(
                    str(staging),
                    tag=DEEPSPEED_TAG,
                    client_state={},
                    save_latest=False,
                    exclude_frozen_parameters=self.exclude_frozen_parameters,
                )
            if env.is_main_process():
                capture.save(checkpoint, staging / STATE_FILE)
        except BaseException as err:  # noqa: BLE001 - reported through the vote below
            capture.fail(err)
        finish = functools.partial(_finish, staging, final, capture, commit, extra)
        if capture.error is not None:  # failed before anything was handed to a writer
            finish()
        return finish

    # ------------------------------------------------------------------- read side
    def _streams(self, found: tuple[dict, str], optimizer: bool) -> bool:
        """Whether DeepSpeed's engine can load the checkpoint at a URL from memory: at the
        world size that saved it (another goes through DeepSpeed's universal conversion,
        which reads and writes local files), and unless ZeRO-3 leaves its optimizer out
        (DeepSpeed then consolidates the weights from every rank's files by their paths)."""
        world = env.get_world_size()
        if int(found[0].get('world_size', world)) != world:
            return False
        return not self._consolidates(optimizer)

    def _consolidates(self, optimizer: bool) -> bool:
        """DeepSpeed's load consolidates the weights from every rank's files (by their paths,
        found through a `latest` file): under ZeRO-3 when the optimizer is left out."""
        return not optimizer and self.engine().zero_optimization_partition_weights()

    def _verify_streamed(
        self, path: str, found: tuple[dict, str], optimizer: bool
    ) -> RemoteDirectory:
        """Collective, at a URL: every file's size on every rank (one listing), and each
        rank reads the files DeepSpeed's engine will read on it (``files.rank_reads``: our
        state, the model states, its own ZeRO partition) into memory, checks their digests
        and that they open as torch archives; the same manifest everywhere. Raises on every
        rank."""
        rank = env.get_rank()

        def archive(relative: str, stream: Any) -> None:
            if relative.startswith(f'{DEEPSPEED_TAG}/') and relative.endswith('.pt'):
                check_zero_archive(f'{path}/{relative}', stream)

        remote = verify_remote_directory(
            path,
            backend_args=self.backend_args,
            found=found,
            reads=functools.partial(rank_reads, rank=rank, optimizer=optimizer),
            check=archive,
        )
        check_zero_layout(path, set(remote.entries))
        return remote

    def _verify(self, path: str, found: tuple[dict, str] | None = None) -> tuple[Path, dict]:
        """Collective: every file's size on every rank, its digest on one rank, the same
        manifest everywhere; then the DeepSpeed layout. Raises on every rank. At a URL
        (where DeepSpeed reads every file by its path: ``_streams``) every rank downloads
        it, verified (``remote_directory.download_directory``; ``found``: its manifest, read
        already), and the local copy is what DeepSpeed reads."""
        if is_url(path):
            self._drop_download(path)
            directory = download_directory(
                path, backend_args=self.backend_args, collective=True, found=found
            )
            self._downloads[path] = directory
        else:
            directory = Path(env.broadcast_object(osp.abspath(path)))
        manifest = verify_directory(directory, collective=True)
        check_zero_layout(directory)
        check_zero_archives(directory)  # the same verdict on every rank, before DeepSpeed's
        return directory, manifest

    @staticmethod
    def _read_state(directory: Path) -> dict:
        # rank 0 just hashed it; the other ranks re-hash this small file on their own
        return ckpt.load_checkpoint_file(directory / STATE_FILE, map_location='cpu')

    @override
    def open(
        self, path: str, map_location: Any, *, optimizer: bool = False, editable: bool = True
    ) -> tuple[dict, Any]:
        """A DeepSpeed directory, every file verified on every rank (DeepSpeed unpickles
        freely); our state read, and the manifest kept for ``restore``. At a URL at the
        world size that saved it, each rank holds only the files it reads, verified, in
        memory (the ``RemoteDirectory`` kept for ``restore``). ``map_location`` is
        accepted for mmengine's signature: DeepSpeed places its tensors on the engine's
        device."""
        name, found = detect(path, self.backend_args)  # at a URL: the manifest, passed on
        if name != 'zero':
            raise ValueError(
                f'{path} is not a DeepSpeed checkpoint directory (written by '
                'DeepSpeedStrategy.save_checkpoint); load weights from other '
                'checkpoints with load_checkpoint()'
            )
        if found is not None and self._streams(found, optimizer):
            remote = self._verify_streamed(path, found, optimizer)
            return remote.load(STATE_FILE), remote
        directory, manifest = self._verify(path, found)
        return self._read_state(directory), manifest

    @override
    def read(self, path: str, map_location: Any) -> dict:
        """A DeepSpeed directory (verified on every rank): our state plus consolidated fp32
        weights (``state_dict``); any other format: the default read. At a URL it is
        downloaded first: DeepSpeed's consolidation reads every rank's files by path."""
        name, found = detect(path, self.backend_args)
        if name != 'zero':
            return super().read(path, map_location)
        try:
            directory, _ = self._verify(path, found)
            state = self._read_state(directory)
            state['state_dict'] = zero_to_state_dict(
                directory, verify=False, exclude_frozen_parameters=self.exclude_frozen_parameters
            )
        finally:
            self._drop_download(path)
        return state

    def _drop_download(self, path: str) -> None:
        local = self._downloads.pop(path, None)
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)

    @override
    def restore(self, path: str, checkpoint: dict, opened: Any, *, optimizer: bool) -> None:
        """Same world size, or the weights alone: ``engine.load_checkpoint`` (model,
        optimizer partitions, engine counters), at a URL from the verified bytes in memory
        (``streaming.py``); another world size with the optimizer: through DeepSpeed's
        universal checkpoint."""
        if isinstance(opened, RemoteDirectory):
            self._engine_load_streamed(opened, optimizer)
            return
        world = env.get_world_size()
        meta = checkpoint.get('meta') or {}
        saved_world = int((opened or {}).get('world_size', meta.get('world_size', world)))
        directory = self._downloads.get(path, Path(path))
        try:
            # the weights alone load at any world size (ZeRO-1/2: the full model states,
            # ZeRO-3: consolidated from every rank's files); only the optimizer reshards
            if saved_world == world or not optimizer:
                self._engine_load(directory, DEEPSPEED_TAG, optimizer)
            else:
                self._load_resharded(directory, saved_world, optimizer)
        finally:
            self._drop_download(path)

    def _engine_load_streamed(self, remote: RemoteDirectory, optimizer: bool) -> None:
        """``engine.load_checkpoint`` of the checkpoint at a URL: DeepSpeed gets a directory
        of empty names and the streaming checkpoint engine, which reads each file from
        ``remote``; its own checkpoint engine is back afterwards."""
        engine = self.engine()
        names = file_names(remote)
        try:
            streaming = StreamingCheckpointEngine(engine.checkpoint_engine, remote, names)
            with streaming.installed_on(engine):
                self._engine_load(names, DEEPSPEED_TAG, optimizer, shown=remote.url)
        finally:
            shutil.rmtree(names, ignore_errors=True)
            remote.cache.clear()

    def _engine_load(
        self, directory: Path, tag: str, optimizer: bool, shown: str | None = None
    ) -> None:
        engine = self.engine()
        # a consolidating load finds the files through a `latest` file, not through `tag`
        view = (
            _latest_view(directory, tag)
            if self._consolidates(optimizer)
            else contextlib.nullcontext(directory)
        )
        with view as load_dir:
            loaded, _ = engine.load_checkpoint(
                str(load_dir),
                tag=tag,
                load_optimizer_states=optimizer,
                load_lr_scheduler_states=False,
                load_module_strict=not self.exclude_frozen_parameters,
            )
        if loaded is None:  # DeepSpeed only warns when it finds nothing
            where = directory if shown is None else shown
            raise FileNotFoundError(f'DeepSpeed found no checkpoint in {where}/{tag}')

    def _load_resharded(self, path: Path, saved_world: int, optimizer: bool) -> None:
        """Resume a checkpoint of ``saved_world`` ranks in this world: rank 0 converts it to
        DeepSpeed's universal format (``ds_to_universal --inject_missing_state``) in a
        temporary directory beside it, every rank loads from there with
        ``load_universal``, the directory is removed. DeepSpeed refuses a plain load at
        another world size."""
        self.logger.info(
            f'{path} was saved by {saved_world} ranks, this run has '
            f'{env.get_world_size()}: resharding through a universal checkpoint'
        )
        universal, error = None, None
        if env.is_main_process():
            try:
                universal = new_staging_dir(path.with_name(path.name + '.universal'))
                _to_universal(path / DEEPSPEED_TAG, universal / DEEPSPEED_TAG)
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                error = e
        failures = env.all_gather_object(None if error is None else f'{error!r}')
        universal = env.broadcast_object(None if universal is None else str(universal))
        try:
            if error is not None:
                raise error
            if failures[0] is not None:
                raise RuntimeError(
                    f'converting {path} to a universal checkpoint failed on rank 0: {failures[0]}'
                )
            config = self.engine()._config  # noqa: SLF001 - DeepSpeed: the engine's config has no public handle
            # a config flag DeepSpeed reads at load time; the engine is built without it
            config.load_universal_checkpoint = True
            try:
                self._engine_load(Path(universal), DEEPSPEED_TAG, optimizer)
            finally:
                config.load_universal_checkpoint = False
            env.barrier()
        finally:
            if env.is_main_process() and universal is not None:
                shutil.rmtree(universal, ignore_errors=True)


@contextlib.contextmanager
def _latest_view(directory: Path, tag: str) -> Iterator[Path]:
    """``directory`` for a DeepSpeed load that reads its ``latest`` file: a new local
    directory holding ``latest`` (naming ``tag``) and ``tag``, a link to ``directory``'s.
    Nothing is written into ``directory``: a committed checkpoint is only what its manifest
    lists. Removed after the block (the link, not what it points to)."""
    view = Path(tempfile.mkdtemp(prefix='stratagem-latest-'))
    try:
        (view / 'latest').write_text(tag)
        (view / tag).symlink_to((directory / tag).absolute(), target_is_directory=True)
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def _finish(
    staging: Path,
    path: Path | str,
    capture: CapturingCheckpointEngine,
    commit: SaveCommit,
    extra: dict,
) -> None:
    """Step 5: write what was staged, agree, commit; the vote ends here (no collective)."""
    written = write_directory_files(staging, capture.write)
    finish_directory_save(
        staging,
        path,
        written,
        commit.vote,
        step=commit.step,
        extra_manifest=extra,
        backend_args=commit.backend_args,
        also_point=commit.also_point,
    )
