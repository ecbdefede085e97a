"""Peer checkpoints: each rank's last state kept in memory, a tier below storage.

Every ``peer_interval`` iterations each rank's checkpoint content (what ``save_checkpoint``
holds for it, captured by the same parts: ``Checkpointer.save_peer``) is committed twice:

1. into this node's ``/dev/shm`` (a tmpfs: it survives the death of the process, not the loss
   of the node), as ``<root>/own/rank{r}/iter_{N}.pth``, by the file commit of
   ``single_file.py`` (the file whole under a temporary name, its manifest with the digest,
   then the rename);
2. at its holder, rank ``(r + stride) % world`` (``stride``: the processes per node, so the
   holder is on another node when the job has several; else 1, the next rank of this node),
   under ``<root>/held/rank{r}/`` on the holder's node, in the same order: the bytes whole
   under a temporary name, the manifest, the rename. Across nodes the bytes travel over the
   process group (a gloo one), mapped, not read, and are checked against the manifest's
   digest before they are kept; on one node the holder copies the committed file through
   the filesystem (the kernel's copy).

The ranks agree after each of the two commits (one small all-gather); a copy that cannot be
written (``/dev/shm`` full) is a warning on every rank and the older copies stay. Once a copy
is committed the older ones of its directory are removed. ``<root>`` is
``/dev/shm/stratagem-peer-<uid>-<hash of the work_dir>`` (``STRATAGEM_PEER_DIR`` replaces
``/dev/shm``): the same for every restart of one run, another for each work_dir.

Sharded state (FSDP's DTensors) is kept as each rank's local shards: :func:`split_shards`
replaces every DTensor of the content by its local tensor and records, under
``content['peer_layout']``, where it was and how it was laid out (global shape, stride,
placements, mesh shape and dimension names, this rank's mesh coordinate); the manifest names
the meshes (``meshes``) and which of the model's tensors the rank holds shards of
(``shards``, :func:`shard_digest`: a pipeline's ranks hold their stage's). A restart uses
such a copy only on the same world size, the same meshes and the same shards per rank
(:meth:`PeerCopies.plan`'s ``meshes`` and ``shards``; else storage, the log line saying why:
another pipeline cut, another model), and
:func:`join_shards` puts each shard back around the live DTensor at the same place, checked
against the record.

With ``background=True`` (the loop's) :meth:`PeerCopies.save` copies the content into CPU
staging buffers on the calling thread (``async_writer.AsyncCheckpointWriter.snapshot``, the
one blocking part), and the write to ``/dev/shm``, the exchange with the holder and the
commit run on the writer's thread, over a process group of their own (``group``: gloo
collectives of two threads must not share one). At most one copy is in flight: the next
``save`` waits for the previous one (a skip would have to be agreed by every rank, a
collective on the training thread, or the writers' collectives would pair copies of
different iterations), and raises its error, if it had one. ``wait`` / ``close`` at the end;
a process killed while a copy is written leaves a temporary name or a file without its
manifest, which is never used.

A restart of the whole job (``resume=True``) asks :meth:`PeerCopies.plan` (collective): every
rank hashes its own copies against their manifests and checks the size of the ones it holds
(a copy without a manifest, or whose bytes do not match it, is never used), and
:func:`choose` takes the newest iteration of which every rank has a copy, its own or its
holder's. That copy is used when it is at least as new as the newest storage checkpoint;
otherwise the load falls back to storage. :meth:`PeerCopies.fetch` then gives each rank whose
own copy is gone its holder's, verified before it is kept (one that fails: every rank falls
back to storage), and every rank loads its own file through the usual load sequence. A fresh
start, or a fall back to storage, removes the copies (:meth:`PeerCopies.clear`): a later
restart must never find a copy of another timeline.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import _fs
from .async_writer import AsyncCheckpointWriter
from .digest import entry_digest, new_hasher
from .errors import CheckpointCorruptError, CheckpointWarning
from .manifest import (
    SIDECAR_SUFFIX,
    _identity,
    parse_manifest,
    remember_verified,
    verify_checkpoint,
)
from .single_file import save_checkpoint

__all__ = [
    'LAYOUT_KEY',
    'PEER_DIR_ENV',
    'PeerChoice',
    'PeerCopies',
    'choose',
    'commit_bytes',
    'copy_committed',
    'describe_meshes',
    'join_shards',
    'peer_root',
    'scan_copies',
    'shard_digest',
    'shard_meshes',
    'split_shards',
]

#: the directory under which peer copies go instead of ``/dev/shm``
PEER_DIR_ENV = 'STRATAGEM_PEER_DIR'
_PREFIX, _SUFFIX = 'iter_', '.pth'
#: the content key of a copy's DTensor records (:func:`split_shards`)
LAYOUT_KEY = 'peer_layout'


def peer_root(work_dir: str | os.PathLike) -> Path:
    """Where one run's peer copies live on this node: a directory of ``/dev/shm`` (or of
    ``$STRATAGEM_PEER_DIR``; the temporary directory where there is no ``/dev/shm``) named
    by the user and the run's work_dir, so a restart finds them and another run does not."""
    base = os.environ.get(PEER_DIR_ENV) or (
        '/dev/shm' if os.path.isdir('/dev/shm') else tempfile.gettempdir()
    )
    key = hashlib.sha256(os.path.realpath(os.fspath(work_dir)).encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, 'getuid') else 0
    return Path(base) / f'stratagem-peer-{uid}-{key}'


def ring_stride(world_size: int, local_world_size: int) -> int:
    """How far a rank's holder is: the processes per node when the job spans several nodes
    of equal size (the holder is then on the next node), else 1."""
    if 0 < local_world_size < world_size and world_size % local_world_size == 0:
        return local_world_size
    return 1


@dataclass(frozen=True)
class Scan:
    """The verified copies of one rank's state in one directory, ``{iteration: path}``, and
    why the others there were not taken."""

    steps: dict[int, str] = field(default_factory=dict)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (path, why)


def scan_copies(
    directory: Path,
    rank: int,
    world_size: int,
    *,
    hash_bytes: bool = True,
    meshes: list | None = None,
    shards: str | None = None,
) -> Scan:
    """Every committed copy of rank ``rank``'s state in ``directory`` whose bytes match its
    manifest (``hash_bytes=False``: its size) and whose manifest says it is that rank's at
    this world size, its shards on ``meshes`` (:func:`shard_meshes`; None: not checked; a
    manifest without them: none, an unsharded state's), of the model tensors ``shards`` says
    (:func:`shard_digest` of what that rank holds now; None: not checked)."""
    steps: dict[int, str] = {}
    refused: list[tuple[str, str]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return Scan()
    for name in names:
        if name.startswith('.') or not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
            continue  # temporary names: a copy whose commit did not finish
        path = directory / name
        try:
            manifest = verify_checkpoint(path, hash_bytes=hash_bytes)
        except (CheckpointCorruptError, OSError, ValueError) as err:
            refused.append((str(path), str(err)))
            continue
        if manifest is None:
            refused.append((str(path), 'no manifest (its commit did not finish)'))
            continue
        whose = (manifest.get('peer_rank'), manifest.get('world_size'))
        if whose != (rank, world_size) or type(manifest.get('step')) is not int:
            refused.append(
                (
                    str(path),
                    f'a copy of rank {whose[0]} at world size {whose[1]}, not of rank {rank} '
                    f'at world size {world_size}',
                )
            )
            continue
        saved = manifest.get('meshes') or []
        if meshes is not None and saved != meshes:
            refused.append(
                (
                    str(path),
                    f'a copy of the shards on {describe_meshes(saved)}; this run lays them '
                    f'out on {describe_meshes(meshes)} (a copy restores only its own layout)',
                )
            )
            continue
        if shards is not None and manifest.get('shards', shards) != shards:
            refused.append(
                (
                    str(path),
                    f'a copy of the shards of other model tensors than rank {rank} holds in '
                    'this run (another pipeline cut or another model: a copy restores only '
                    'the tensors it holds)',
                )
            )
            continue
        steps[manifest['step']] = str(path)
    return Scan(steps, refused)


# ------------------------------------------------------------------- sharded state
def split_shards(content: dict) -> tuple[dict, list]:
    """``content`` with every DTensor replaced by its local shard, and one record per DTensor:
    ``[key path, global shape, stride, placements, mesh shape, mesh dimension names, this
    rank's mesh coordinate]`` (plain values: what a restart checks before it puts the shard
    back, :func:`join_shards`). Tensors are not copied."""
    from torch.distributed.tensor import DTensor

    records: list = []

    def walk(obj: Any, path: list) -> Any:
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            records.append(
                [
                    path,
                    list(obj.shape),
                    list(obj.stride()),
                    [repr(p) for p in obj.placements],
                    list(mesh.shape),
                    list(mesh.mesh_dim_names or ()),
                    list(mesh.get_coordinate() or ()),
                ]
            )
            return obj.to_local()
        if isinstance(obj, dict):
            return type(obj)((k, walk(v, [*path, k])) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, [*path, i]) for i, v in enumerate(obj))
        return obj

    return walk(content, []), records


def shard_meshes(records_or_state: Any) -> list:
    """The meshes a state's DTensors lie on, ``[[shape, dimension names], ...]`` sorted (the
    manifest's ``meshes``; ``[]``: none): from :func:`split_shards`' records, or of a live
    state."""
    records = records_or_state
    if not isinstance(records_or_state, list):
        records = split_shards({'state': records_or_state})[1]
    found = sorted({(tuple(r[4]), tuple(r[5])) for r in records})
    return [[list(shape), list(names)] for shape, names in found]


def shard_digest(records_or_state: Any) -> str | None:
    """Which of the model's tensors (the content's ``state_dict``) a rank holds shards of,
    and their global shapes, as a short digest (the manifest's ``shards``; None: no shard):
    from :func:`split_shards`' records, or of a live state. Under a pipeline each rank's
    names its stage's tensors, so a copy taken at another cut is told apart before a load."""
    records = records_or_state
    if not isinstance(records_or_state, list):
        records = split_shards(records_or_state)[1]
    held = sorted(
        ('.'.join(str(k) for k in r[0][1:]), r[1]) for r in records if r[0][:1] == ['state_dict']
    )
    if not held:
        return None
    return hashlib.sha256(repr(held).encode()).hexdigest()[:16]


def describe_meshes(meshes: list) -> str:
    """``the mesh (replicate=2, shard=1)``, or ``no mesh`` (an unsharded state)."""
    if not meshes:
        return 'no mesh (an unsharded state)'
    shown = []
    for shape, names in meshes:
        if names:
            shown.append('(' + ', '.join(f'{n}={s}' for n, s in zip(names, shape)) + ')')
        else:
            shown.append('(' + ' × '.join(str(s) for s in shape) + ')')
    return ('the mesh ' if len(shown) == 1 else 'the meshes ') + ', '.join(shown)


def join_shards(content: dict, records: list, live: Mapping[str, Any], where: str) -> dict:
    """``content`` (a copy read back) with each local shard :func:`split_shards` recorded put
    back around the live DTensor at the same key path in ``live`` (the same parts' state
    now: mesh, placements, sharding), moved to that DTensor's device. ValueError naming
    ``where`` and the key path when the live state has no DTensor there, or one laid out
    otherwise (another model, or another sharding of it)."""
    from torch.distributed.tensor import DTensor

    from stratagem._torch import dtensor_like

    wanted = {tuple(r[0]): r for r in records}

    def find(path: tuple) -> Any:
        obj: Any = live
        for key in path:
            obj = obj[key]
        return obj

    def walk(obj: Any, path: tuple) -> Any:
        record = wanted.get(path)
        if record is not None:
            try:
                template = find(path)
            except (KeyError, IndexError, TypeError):
                template = None
            saved = (record[1], record[3], record[4], record[5], record[6])
            now = None
            if isinstance(template, DTensor):
                mesh = template.device_mesh
                now = (
                    list(template.shape),
                    [repr(p) for p in template.placements],
                    list(mesh.shape),
                    list(mesh.mesh_dim_names or ()),
                    list(mesh.get_coordinate() or ()),
                )
                local = template.to_local()
                if now == saved and tuple(local.shape) == tuple(obj.shape):
                    return dtensor_like(template, obj.to(local.device))
            label = '.'.join(str(k) for k in path)
            raise ValueError(
                f'{where}: {label} is a shard of {saved[0]} over placements {saved[1]} on the '
                f'mesh {saved[2]} {saved[3]} at {saved[4]}, local shape {list(obj.shape)}; '
                f'this run has {"no DTensor there" if now is None else now}: the copy is of '
                'another model or sharding; resume from a storage checkpoint'
            )
        if isinstance(obj, dict):
            return type(obj)((k, walk(v, (*path, k))) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, (*path, i)) for i, v in enumerate(obj))
        return obj

    return walk(content, ())


@dataclass(frozen=True)
class PeerChoice:
    """What a restart loads: ``step``, the iteration of the peer copies every rank loads
    (None: storage), ``reason`` (for the log line), ``fetch``: ``{rank: holder}`` for each
    rank whose own copy of ``step`` is gone or torn and that gets its holder's."""

    step: int | None
    reason: str
    fetch: dict[int, int] = field(default_factory=dict)

    @property
    def tier(self) -> str:
        return 'storage' if self.step is None else 'peer'


def choose(
    own: list[list[int]],
    held: list[list[int]],
    holders: list[int],
    storage: tuple[str, int | None] | None,
) -> PeerChoice:
    """The rule (a pure function of what every rank found).

    ``own[r]``: the iterations of rank r's verified own copies; ``held[h]``: those of the
    copies rank h holds (of the rank whose holder it is); ``holders[r]``: rank r's holder;
    ``storage``: the newest committed storage checkpoint and its iteration (None: none).
    The peer copies win when every rank has a verified copy of one iteration (its own or
    its holder's) and the newest such iteration is at least the storage checkpoint's; a
    storage checkpoint of unknown iteration wins.
    """
    world = len(own)
    if not any(own) and not any(held):
        return PeerChoice(None, 'no peer copies')
    available = [set(own[r]) | set(held[holders[r]]) for r in range(world)]
    for r in range(world):
        if not available[r]:
            return PeerChoice(
                None,
                f'no verified peer copy of rank {r} (its own and the one rank {holders[r]} '
                'holds are gone or torn)',
            )
    common = set.intersection(*available)
    if not common:
        found = ', '.join(f'rank {r}: {sorted(a)}' for r, a in enumerate(available))
        return PeerChoice(None, f'the ranks have peer copies of no common iteration ({found})')
    step = max(common)
    if storage is not None:
        name, stored = storage
        if stored is None:
            return PeerChoice(
                None, f'the newest storage checkpoint {name} has no iteration to compare'
            )
        if stored > step:
            return PeerChoice(
                None,
                f'the newest peer copies (iteration {step}) are older than the newest '
                f'storage checkpoint {name} (iteration {stored})',
            )
        than = f'at least as new as the newest storage checkpoint {name} (iteration {stored})'
    else:
        than = 'no storage checkpoint'
    fetch = {r: holders[r] for r in range(world) if step not in own[r]}
    fetched = f'; rank(s) {sorted(fetch)} from their holder' if fetch else ''
    return PeerChoice(step, f'peer copies of iteration {step}: {than}{fetched}', fetch)


class PeerCopies:
    """One run's peer copies for this rank (see the module's docstring).

    Args:
        root: :func:`peer_root` of the run's work_dir.
        rank, world_size: this process's place in the process group.
        local_world_size: processes per node (``LOCAL_WORLD_SIZE``); picks the holder.
        group: the process group the copies travel over (a gloo one: the bytes are on the
            CPU; None: the default group).
        same_node: every rank runs on this node (one ``/dev/shm``): a holder copies the
            committed file through the filesystem (the kernel's copy) instead of receiving
            its bytes over the process group. Every rank must pass the same value.
        background: :meth:`save` snapshots on the calling thread and writes, exchanges and
            commits on a writer thread (``group`` must then be a group no other thread
            uses); False: :meth:`save` is :meth:`commit`.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        rank: int = 0,
        world_size: int = 1,
        *,
        local_world_size: int | None = None,
        group: Any = None,
        same_node: bool = False,
        background: bool = False,
    ) -> None:
        self.root = Path(root)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.same_node = same_node
        stride = ring_stride(world_size, local_world_size or world_size)
        self.holders = [(r + stride) % world_size for r in range(world_size)]
        self.holder = self.holders[rank]
        #: the rank whose copy this rank holds
        self.keeps = self.holders.index(rank)
        self.own_dir = self._own(rank)
        self.held_dir = self._held(self.keeps)
        self.writer: AsyncCheckpointWriter | None = AsyncCheckpointWriter() if background else None
        _wait_for_earlier(self.root)
        if self.writer is not None:
            _WRITERS[self.root] = self.writer

    def _own(self, rank: int) -> Path:
        return self.root / 'own' / f'rank{rank}'

    def _held(self, rank: int) -> Path:
        return self.root / 'held' / f'rank{rank}'

    # ----------------------------------------------------------------------- save
    def save(self, content: dict, step: int) -> Path | None:
        """Keep this rank's ``content`` of iteration ``step`` (collective: every rank calls
        it at the same iteration): :meth:`commit` now, or in the background (``background``):
        the previous copy waited for (its error raised here), ``content`` copied into the
        writer's staging buffers before this returns, the commit submitted. Returns where
        this rank's own copy is (in the background: will be, once committed)."""
        if self.writer is None:
            return self.commit(content, step)
        self.writer.wait()
        staged = self.writer.snapshot(content, key='peer')
        self.writer.submit(self.commit, staged, step)
        return self.own_dir / f'{_PREFIX}{step}{_SUFFIX}'

    def wait(self) -> None:
        """Block until the copy in flight (``background``) is committed or given up; raise
        its error, if it had one. A no-op when none is."""
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        """:meth:`wait`, then free the staging buffers (the end of a run)."""
        if self.writer is not None:
            self.writer.release()

    def commit(self, content: dict, step: int) -> Path | None:
        """Commit this rank's ``content`` of iteration ``step`` here and at its holder
        (collective: every rank calls it at the same iteration); returns the own copy.

        A copy that cannot be written (``/dev/shm`` full: ``CheckpointWriteError``) is a
        warning on every rank, naming it, and the run goes on with the copies it has (the
        tier is a shortcut; storage stays); returns None then."""
        from stratagem import env  # see the package doc: env only when a checkpoint is written

        name = f'{_PREFIX}{step}{_SUFFIX}'
        content, records = split_shards(content)
        whose: dict[str, Any] = {'peer_rank': self.rank, 'world_size': self.world_size}
        if records:  # sharded: the shards, where they go, and the layout a restart checks
            content[LAYOUT_KEY] = records
            whose['meshes'] = shard_meshes(records)
            whose['shards'] = shard_digest(records)
        own, failed = None, ''
        try:
            own = save_checkpoint(
                content, self.own_dir / name, step=step, extra_manifest=whose, update_pointer=False
            )
        except OSError as err:  # CheckpointWriteError too: it is an OSError
            failed = f'rank {self.rank}: {err}'
        if self.world_size > 1:  # every rank's own copy committed, or why not
            failures = [f for f in env.all_gather_object(failed, self.group) if f]
        else:
            failures = [failed] if failed else []
        if not failures:
            try:
                self._hold(name)
            except (OSError, CheckpointCorruptError) as err:
                failed = f'rank {self.rank} holding the copy of rank {self.keeps}: {err}'
            if self.world_size > 1:
                failures = [f for f in env.all_gather_object(failed, self.group) if f]
        if failures:
            env.warn_rank_zero(
                f'peer copies of iteration {step} not kept ({"; ".join(failures)}); the '
                'newest copies that were committed stay, storage checkpoints go on',
                CheckpointWarning,
                stacklevel=3,
            )
            return None
        assert own is not None
        _prune(self.own_dir, keep=name)
        _prune(self.held_dir, keep=name)
        return own

    def _hold(self, name: str) -> None:
        """The holder's copy of the rank it keeps (collective where it is sent)."""
        if self.world_size == 1:
            return
        if self.same_node:
            copy_committed(self._own(self.keeps) / name, self.held_dir / name)
        else:
            received = self._exchange(self.own_dir / name, self.holder, self.keeps)
            assert received is not None
            commit_bytes(self.held_dir / name, *received)

    # ----------------------------------------------------------------------- load
    def plan(
        self,
        storage: tuple[str, int | None] | None,
        meshes: list | None = None,
        shards: str | None = None,
    ) -> PeerChoice:
        """What a restart loads (collective): see :func:`choose`; ``storage``: the newest
        storage checkpoint and its iteration, the same on every rank (None: none);
        ``meshes``: this run's (:func:`shard_meshes` of its model's state; None: not
        checked): a copy of shards on other meshes is not used; ``shards``: this rank's
        :func:`shard_digest` of its model's state (None: not checked): a copy of other
        tensors' shards (another pipeline cut) is not used. Own copies are
        hashed here (the load then reads verified bytes); a held copy only when it is fetched
        (:meth:`fetch`), its size checked here. The copies refused on any rank are in the
        returned reason."""
        from stratagem import env  # see the package doc: env only when a checkpoint is read

        self.wait()  # this process's copy in flight (an API caller's): committed first
        kept = shards  # the shards of the rank whose copy this one holds: that rank's now
        if self.world_size > 1:
            kept = env.all_gather_object(shards, self.group)[self.keeps]
        own = scan_copies(self.own_dir, self.rank, self.world_size, meshes=meshes, shards=shards)
        held = scan_copies(
            self.held_dir,
            self.keeps,
            self.world_size,
            hash_bytes=False,
            meshes=meshes,
            shards=kept,
        )
        found = env.all_gather_object(
            (sorted(own.steps), sorted(held.steps), own.refused + held.refused), self.group
        )
        choice = choose([f[0] for f in found], [f[1] for f in found], self.holders, storage)
        refused: dict[str, list[str]] = {}  # why: the copies, so a reason shared is said once
        for f in found:
            for path, why in f[2]:
                refused.setdefault(why, []).append(os.path.relpath(path, self.root))
        if refused:
            said = '; '.join(f'{why} ({", ".join(paths)})' for why, paths in refused.items())
            head = 'no usable peer copy' if choice.reason == 'no peer copies' else choice.reason
            return PeerChoice(choice.step, f'{head}; not used: {said}', choice.fetch)
        return choice

    def fetch(self, choice: PeerChoice) -> tuple[str | None, str]:
        """This rank's own verified copy of ``choice.step`` (collective): the ranks of
        ``choice.fetch`` get their holder's first, verified against its manifest and
        committed into their own directory. Returns ``(path, '')``, or ``(None, why)`` on
        every rank when a fetched copy did not verify (the load then falls back)."""
        from stratagem import env  # see the package doc: env only when a checkpoint is read

        assert choice.step is not None
        name = f'{_PREFIX}{choice.step}{_SUFFIX}'
        failed = ''
        if choice.fetch:
            gets = self.rank in choice.fetch
            try:
                if self.same_node:
                    if gets:
                        copy_committed(self._held(self.rank) / name, self.own_dir / name)
                        verify_checkpoint(self.own_dir / name)
                else:
                    sends = choice.fetch.get(self.keeps) == self.rank and self.keeps != self.rank
                    received = self._exchange(
                        self.held_dir / name if sends else None,
                        self.keeps if sends else None,
                        self.holder if gets else None,
                    )
                    if received is not None:
                        commit_bytes(self.own_dir / name, *received)
            except (CheckpointCorruptError, OSError, ValueError) as err:
                _fs.unlink_quietly(self.own_dir / name)  # a torn copy is never left to load
                _fs.unlink_quietly(self.own_dir / (name + SIDECAR_SUFFIX))
                failed = f'the copy of rank {self.rank} that rank {self.holder} holds: {err}'
            failures = [f for f in env.all_gather_object(failed, self.group) if f]
            if failures:
                return None, '; '.join(failures)
        return str(self.own_dir / name), ''

    def clear(self) -> None:
        """Remove this rank's copies (its own and those it holds): a fresh start, or a
        restart that fell back to storage, must never find them later. The copy in flight
        is waited for first."""
        self.wait()
        for directory in (self.own_dir, self.held_dir):
            shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------- transport
    def _exchange(
        self, copy: Path | None, to: int | None, source: int | None
    ) -> tuple[bytes, memoryview] | None:
        """Send the committed ``copy`` (its manifest, then its bytes, mapped, not read) to
        rank ``to`` and receive one from rank ``source`` (either may be None), both at once:
        every rank of a ring sends and receives, and blocking sends in a ring would wait for
        each other. Returns the manifest and the bytes received."""
        import torch.distributed as dist

        manifest, mapped, data = b'', None, torch.empty(0, dtype=torch.uint8)
        if to is not None:
            assert copy is not None
            manifest = copy.with_name(copy.name + SIDECAR_SUFFIX).read_bytes()
            with open(copy, 'rb') as file:  # a private mapping: writable for torch, no copy
                mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
            data = torch.frombuffer(mapped, dtype=torch.uint8)
        try:
            sizes = torch.tensor([len(manifest), data.numel()], dtype=torch.int64)
            got = torch.zeros(2, dtype=torch.int64)
            _wait(
                ([dist.isend(sizes, to, self.group)] if to is not None else [])
                + ([dist.irecv(got, source, self.group)] if source is not None else [])
            )
            incoming = torch.empty(int(got.sum()), dtype=torch.uint8)
            requests = []
            if to is not None:
                head = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
                requests += [dist.isend(head, to, self.group), dist.isend(data, to, self.group)]
            if source is not None:
                cut = int(got[0])
                requests += [
                    dist.irecv(incoming[:cut], source, self.group),
                    dist.irecv(incoming[cut:], source, self.group),
                ]
            _wait(requests)
        finally:
            del data
            if mapped is not None:
                mapped.close()
        if source is None:
            return None
        view = memoryview(incoming.numpy().data)  # the received bytes, not copied
        return bytes(view[: int(got[0])]), view[int(got[0]) :]


#: the last background writer of each root in this process: a run that ended by an error left
#: its copy in flight, which a later run over the same root (its restart in this process) waits
#: for before it looks at, or removes, the copies
_WRITERS: weakref.WeakValueDictionary[Path, AsyncCheckpointWriter] = weakref.WeakValueDictionary()


def _wait_for_earlier(root: Path) -> None:
    writer = _WRITERS.pop(root, None)
    if writer is None:
        return
    try:
        writer.wait()
    except (OSError, RuntimeError, ValueError) as err:  # that run's, uncollected: said
        warnings.warn(
            f'an earlier peer copy under {root} failed: {type(err).__name__}: {err}; its '
            'commit did not finish, so it is never used',
            CheckpointWarning,
            stacklevel=3,
        )


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def copy_committed(source: Path, final: Path) -> Path:
    """Copy the committed copy ``source`` (and its manifest) to ``final`` on this node, in
    the commit's order: the file whole under a temporary name (the kernel's copy), the
    manifest, the rename. Its bytes are verified when it is loaded, as every copy's."""
    manifest = source.with_name(source.name + SIDECAR_SUFFIX).read_bytes()

    def write(tmp: Path) -> None:
        shutil.copyfile(source, tmp)
        _fs.fsync_file(tmp)

    return _commit_copy(final, manifest, write)


def commit_bytes(final: Path, manifest: bytes, data: bytes | memoryview) -> Path:
    """Commit a copy received as bytes at ``final``: checked against ``manifest``'s size and
    digest (CheckpointCorruptError, nothing written, when they differ), the bytes whole
    under a temporary name, then the manifest, then the rename."""
    parsed = parse_manifest(manifest, final)
    entry = next((f for f in parsed['files'] if f['path'] == final.name), None)
    if entry is None:
        raise CheckpointCorruptError(f'the manifest sent for {final} does not list {final.name}')
    algo, expected = entry_digest(entry)
    hasher = new_hasher(algo)
    hasher.update(data)
    size, actual = len(data), hasher.hexdigest()
    if (size, actual) != (entry['size'], expected):
        raise CheckpointCorruptError(
            f'the copy received for {final} is damaged: {size} bytes with {algo} '
            f'{actual}, its manifest says {entry["size"]} bytes with {expected}; '
            'it was not kept'
        )

    def write(tmp: Path) -> None:
        with open(tmp, 'wb') as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        remember_verified(tmp, actual, _identity(tmp), algo)  # a rename keeps the identity

    return _commit_copy(final, manifest, write)


def _commit_copy(final: Path, manifest: bytes, write: Callable[[Path], None]) -> Path:
    """The copy's commit: ``write`` fills a temporary name whole and synced, then the
    manifest goes in place, then the rename."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fs.temp_name(final)
    try:
        write(tmp)
        _fs.write_atomic(final.with_name(final.name + SIDECAR_SUFFIX), manifest)
        _fs.fsync_dir(final.parent)
        os.replace(tmp, final)
    except BaseException:
        _fs.unlink_quietly(tmp)
        raise
    _fs.fsync_dir(final.parent)
    return final


def _prune(directory: Path, keep: str) -> None:
    """Remove the copies of ``directory`` but ``keep`` (after ``keep`` is committed): the
    file first, then its manifest, so nothing left is ever a manifest's wrong file."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX) and name != keep:
            _fs.unlink_quietly(directory / name)
            _fs.unlink_quietly(directory / (name + SIDECAR_SUFFIX))
