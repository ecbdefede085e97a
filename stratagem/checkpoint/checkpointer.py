"""The checkpoint sequences, written once, over explicit state: :class:`Checkpointer`.

``Checkpointer.save(path, state)`` and ``Checkpointer.load(path, state)`` take the state as
a mapping of named parts, each a torch ``Stateful`` (``state_dict()`` /
``load_state_dict()``); the key is where the part's state lives in the checkpoint
(mmengine's layout: ``state_dict``, ``optimizer``, ``param_schedulers``, ``meta``, plus ours:
``partial_grads``, ``rng_states``). Where the content goes on disk is the
``CheckpointStorage`` it was made with (``storage.py``). A strategy builds the parts from
its own state (``BaseStrategy.checkpoint_state``); the checkpointer holds no strategy and
knows no backend.

A part may do more than a plain ``Stateful`` (:class:`StatePart` does all of it):
``check(value, context)`` runs before anything is loaded and may refuse (raise) or convert
(``context.replace``); ``restore(value, context)`` loads with the context (the saved
``meta``, the path) instead of ``load_state_dict(value)``; ``required = False`` parts are
also restored when the checkpoint lacks their key (with ``None``).

``save(path, state, extra=, callback=)`` (every rank calls it): rank 0's path for every
rank, each part's state, the content validated, staged (copied, under ``async_checkpoint``),
then written and committed once every rank's files are there, the outcome known on every
rank. ``load(path, state, ...)``: the ranks agree on the file, every part's check before
anything loads, then every part's restore in order. Both sequences are told once, step by
step, in docs/architecture.md ('Save', 'Load and resume'); the methods below cite its
step numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .agree import agree_on_checkpoint
from .async_writer import AsyncCheckpointWriter
from .location import absolute, is_url
from .storage import CheckpointStorage, SaveCommit
from .vote import SaveVote

if TYPE_CHECKING:  # only an annotation: the module loads when a run makes peer copies
    from .peer import PeerCopies

__all__ = ['Checkpointer', 'LoadContext', 'StatePart', 'Stateful']


@runtime_checkable
class Stateful(Protocol):
    """torch DCP's protocol: what a part of a checkpoint's state offers."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state_dict: Any) -> None: ...


class LoadContext:
    """What one load knows, shared by its parts: the agreed ``path``, the ``checkpoint`` as
    read (``meta`` is its ``meta``), and what each part will be handed (``value``, which a
    part's ``check`` may ``replace``, e.g. scheduler states converted to this world size).
    ``notes`` carries what a part's check found for a later part (e.g. a world-size change);
    ``opened`` is what the storage's ``open`` kept for its ``restore`` (DCP's metadata)."""

    def __init__(self, path: str, checkpoint: dict, opened: Any = None) -> None:
        self.path = path
        self.checkpoint = checkpoint
        self.opened = opened
        self.notes: dict[str, Any] = {}
        self._values: dict[str, Any] = {}

    @property
    def meta(self) -> dict:
        meta = self.checkpoint.get('meta')
        return meta if isinstance(meta, dict) else {}

    def value(self, key: str) -> Any:
        """What the part under ``key`` will load: the checkpoint's, or as replaced."""
        return self._values[key] if key in self._values else self.checkpoint.get(key)

    def replace(self, key: str, value: Any) -> None:
        """Hand the part under ``key`` ``value`` instead of the checkpoint's (the checkpoint
        dict the caller gets back is unchanged)."""
        self._values[key] = value


class StatePart:
    """A ``Stateful`` made of functions, with the steps a resume adds.

    Args:
        save: returns the part's state (None: nothing to save at this moment).
        load: ``load(value, context)`` restores it.
        check: ``check(value, context)`` before anything loads: raise to refuse, or
            ``context.replace`` the value.
        required: a load needs the key (else the part gets ``None`` when it is absent).
    """

    def __init__(
        self,
        save: Callable[[], Any],
        load: Callable[[Any, LoadContext], None],
        *,
        check: Callable[[Any, LoadContext], None] | None = None,
        required: bool = True,
    ) -> None:
        self._save, self._load, self._check = save, load, check
        self.required = required

    def state_dict(self) -> Any:
        return self._save()

    def load_state_dict(self, state_dict: Any) -> None:
        self._load(state_dict, LoadContext('', {}))

    def check(self, value: Any, context: LoadContext) -> None:
        if self._check is not None:
            self._check(value, context)

    def restore(self, value: Any, context: LoadContext) -> None:
        self._load(value, context)


class Checkpointer:
    """The save and load sequences (docs/architecture.md) over one storage, and the background
    writer of asynchronous saves.

    Args:
        storage: where the content goes (default: one file written by rank 0).
        async_checkpoint: write on a background thread after copying the state.
        timeout: seconds a rank may show no sign of life during a distributed save
            before the others give up on it, naming it, without committing.
    """

    def __init__(
        self,
        storage: CheckpointStorage | None = None,
        *,
        async_checkpoint: bool = False,
        timeout: float = 600.0,
    ) -> None:
        if type(async_checkpoint) is not bool:
            raise TypeError(f'async_checkpoint must be True or False, got {async_checkpoint!r}')
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(
                f'checkpoint_timeout must be a positive number of seconds, got {timeout!r}'
            )
        self.storage = storage if storage is not None else CheckpointStorage()
        #: storage options of the filesystem of a URL location (``location.py``), e.g.
        #: ``dict(endpoint_url=..., key=..., secret=...)`` for S3; None: the client library
        #: reads the environment
        self.backend_args: dict | None = None
        #: a local directory whose ``last_checkpoint`` also names each committed checkpoint
        #: (a run's work_dir when its checkpoints go to ``out_dir``, as mmengine's
        #: CheckpointHook does); None: only the pointer beside the checkpoint
        self.also_point: str | None = None
        self.async_checkpoint = async_checkpoint
        self.timeout = float(timeout)
        self.writer: AsyncCheckpointWriter | None = None
        #: True while a peer copy's state is captured (``save_peer``, and its restore's live
        #: templates): each rank's own shards, whatever a save to storage gathers (FSDP's
        #: ``state_dict_type='full'`` asks it)
        self.capturing_local = False

    def wait(self) -> None:
        """Block until the pending (asynchronous) save is committed; raise its error if it
        failed, on every rank. A no-op when nothing is pending."""
        if self.writer is not None:
            self.writer.wait()

    # ------------------------------------------------------------------------ save
    def save(
        self,
        path: str,
        state: Mapping[str, Stateful],
        *,
        extra: Mapping | None = None,
        callback: Callable[[dict], None] | None = None,
    ) -> str:
        """Steps 0-7 of docs/architecture.md, 'Save'; returns rank 0's absolute path or URL
        (with ``async_checkpoint``, where the checkpoint will be once committed)."""
        from stratagem import env  # see the package doc: env only when a checkpoint is written

        self.wait()
        path = absolute(path)
        storage = self.storage
        vote = SaveVote.open(self.timeout, f'saving {path}')
        commit = SaveCommit(
            vote,
            env.get_rank(),
            None,
            [],
            backend_args=self.backend_args,
            also_point=None if self.also_point is None else absolute(self.also_point),
        )
        writer = None
        if self.async_checkpoint:
            if self.writer is None:
                self.writer = AsyncCheckpointWriter()
            writer = self.writer
        try:
            path = _rank0_path(path, vote)
            self.check_location(path)
            storage.check_savable(path)
            commit.own_keys = frozenset(
                k for k in storage.own_keys() if hasattr(state.get(k), 'own_state_dict')
            )
            checkpoint, commit.held, commit.step = self._capture(
                state, extra, callback, commit.own_keys
            )
            job = storage.stage(checkpoint, path, commit, writer)
            if storage.all_ranks_write() and vote is not None and not commit.arrived:
                raise TypeError(
                    f'{type(storage).__name__}.stage must call commit.arrive() before the '
                    "write's collectives (its all_ranks_write() is True): a rank that failed "
                    'before would leave the others waiting in them'
                )
        except BaseException as err:
            commit.abandon(err, arrive=storage.all_ranks_write())
            raise
        del checkpoint  # the live tensors may change from here on: async has a copy
        if writer is None:
            commit.run(job)
        else:
            writer.submit(commit.run, job)
        return path

    def _capture(
        self,
        state: Mapping[str, Stateful],
        extra: Mapping | None,
        callback: Callable[[dict], None] | None,
        own: frozenset[str] = frozenset(),
    ) -> tuple[dict, list[str], int | None]:
        """Steps 3-4 of 'Save': each part's state in order (but the keys the storage's own
        files hold; this rank's own value, ``own_state_dict``, for the keys of ``own``),
        ``extra``, ``callback``, the content validated; returns the content, the
        allow-listed classes it holds and its iteration (``meta['iter']``, or None)."""
        content: dict[str, Any] = {}
        for key, part in state.items():
            if key in self.storage.holds:  # the storage's own files hold it (DeepSpeed's model)
                continue
            value = part.own_state_dict() if key in own else part.state_dict()  # type: ignore[attr-defined]
            if value is not None:
                content[key] = value
        # mmengine's order: meta first
        checkpoint = {k: content[k] for k in sorted(content, key=lambda k: k != 'meta')}
        checkpoint.update(extra or {})
        if callback is not None:
            callback(checkpoint)
        held = self.storage.validate(checkpoint)
        meta = checkpoint.get('meta')
        step = meta.get('iter') if isinstance(meta, Mapping) else None
        return checkpoint, held, step if type(step) is int else None

    def save_peer(
        self, peer: PeerCopies, state: Mapping[str, Stateful], *, extra: Mapping | None = None
    ) -> str | None:
        """Commit this rank's content of ``state`` (steps 3-4 of 'Save', as ``save``
        captures it) as a peer copy, here and at its holder (``peer.py``; collective:
        every rank calls it at the same iteration, ``meta['iter']``); returns this rank's
        own copy (None: not kept, a warning said why). A pending asynchronous save goes
        on: the copy is another file."""
        with self.local_capture():
            checkpoint, _, step = self._capture(state, extra, None)
        if step is None:
            raise ValueError(
                "a peer copy needs its iteration: pass extra_ckpt={'meta': {'iter': N}}"
            )
        own = peer.save(checkpoint, step)
        return None if own is None else str(own)

    @contextmanager
    def local_capture(self) -> Iterator[None]:
        """Within: :attr:`capturing_local` (a peer copy's capture)."""
        self.capturing_local = True
        try:
            yield
        finally:
            self.capturing_local = False

    def shard_layout(self, state: Mapping[str, Stateful]) -> tuple[list, str | None]:
        """The meshes the DTensors of ``state``'s parts lie on and which tensors this rank
        holds shards of, as a peer copy captures them (``peer.shard_meshes``, ``[]``: none;
        ``peer.shard_digest``, None: none): what a restart compares its copies' with."""
        from .peer import shard_digest, shard_meshes, split_shards

        with self.local_capture():
            live = {key: part.state_dict() for key, part in state.items()}
        records = split_shards(live)[1]
        return shard_meshes(records), shard_digest(records)

    # ------------------------------------------------------------------------ load
    def agree(self, filename: str) -> str:
        """Rank 0's ``filename``, verified to be the same bytes on every rank (collective).
        A pending asynchronous save is committed first (it may be that very file)."""
        self.wait()
        self.check_location(filename)
        self.storage.backend_args = self.backend_args
        return str(agree_on_checkpoint(filename, backend_args=self.backend_args))

    def check_location(self, path: str) -> None:
        """Raise NotImplementedError, before anything is written, when ``path`` is a URL
        and this storage cannot save there."""
        if is_url(path) and not self.storage.urls:
            raise NotImplementedError(
                f'{path}: checkpoints of {type(self.storage).__name__} cannot be saved to or '
                'read from a URL yet; save to a local or shared path'
            )

    def read(self, filename: str, map_location: Any = 'cpu') -> tuple[str, dict]:
        """Agree on ``filename`` and read it whole; returns (the agreed path, the dict)."""
        path = self.agree(filename)
        return path, self._as_dict(path, self.storage.read(path, map_location))

    def load(
        self,
        filename: str,
        state: Mapping[str, Stateful],
        *,
        map_location: Any = 'cpu',
        optimizer: bool = False,
        callback: Callable[[dict], None] | None = None,
        own_copy: bool = False,
    ) -> LoadContext:
        """Steps 1-6 of docs/architecture.md, 'Load and resume'; returns the load's context
        (the agreed ``path``, the ``checkpoint`` as read, what the parts' checks noted).
        ``optimizer``: ``state`` restores an optimizer (the storage reads its state too).
        ``own_copy``: ``filename`` is this rank's own file, a peer copy the ranks agreed
        on by its iteration (``peer.py``), so step 2's agreement on one file is skipped;
        the file is verified against its manifest as it is read."""
        if own_copy:
            self.wait()
            path = str(absolute(filename))
        else:
            path = self.agree(filename)
        storage = self.storage
        checkpoint, opened = storage.open(
            path, map_location, optimizer=optimizer, editable=callback is not None
        )
        checkpoint = self._as_dict(path, checkpoint)
        if own_copy:
            checkpoint = self._join_shards(path, checkpoint, state)
        if callback is not None:
            callback(checkpoint)
        missing = [
            key
            for key, part in state.items()
            if getattr(part, 'required', True)
            and key not in checkpoint
            and key not in storage.holds
        ]
        if missing:
            raise KeyError(
                f'{path} cannot be resumed: it has no {missing} (keys: {sorted(checkpoint)}); '
                'load weights only with load_checkpoint(), or pass resume_optimizer=False / '
                'resume_param_scheduler=False'
            )
        context = LoadContext(path, checkpoint, opened)
        loading = [k for k in state if k in checkpoint or not getattr(state[k], 'required', True)]
        for key in loading:
            check = getattr(state[key], 'check', None)
            if check is not None:
                check(context.value(key), context)
        storage.restore(path, checkpoint, opened, optimizer=optimizer)
        for key in loading:
            part = state[key]
            restore = getattr(part, 'restore', None)
            if restore is not None:
                restore(context.value(key), context)
            else:
                part.load_state_dict(context.value(key))
        return context

    def _join_shards(self, path: str, checkpoint: dict, state: Mapping[str, Stateful]) -> dict:
        """A sharded peer copy's local shards put back around the live DTensors of the parts
        that held them (``peer.join_shards``), captured as the copy was; an unsharded one
        as it is."""
        from .peer import LAYOUT_KEY, join_shards

        if LAYOUT_KEY not in checkpoint:
            return checkpoint
        records = checkpoint.pop(LAYOUT_KEY)
        keys = {r[0][0] for r in records if r[0] and r[0][0] in state}
        with self.local_capture():
            live = {key: state[key].state_dict() for key in keys}
        return join_shards(checkpoint, records, live, path)

    @staticmethod
    def _as_dict(path: str, checkpoint: Any) -> dict:
        if not isinstance(checkpoint, dict):
            raise ValueError(
                f'{path} holds a {type(checkpoint).__name__}, not a checkpoint '
                "dict (expected keys like 'state_dict', 'meta', 'optimizer')"
            )
        return checkpoint


def _rank0_path(path: str, vote: SaveVote | None) -> str:
    """Rank 0's ``path`` on every rank (step 1: rank 0 decides), handed out through the
    save's vote (one key in the store: no collective, and rank 0 does not wait)."""
    if vote is None:
        return path
    if vote.rank == 0:
        vote.publish('path', path)
        return path
    path = vote.receive('path')
    vote.what = f'saving {path}'
    return path
