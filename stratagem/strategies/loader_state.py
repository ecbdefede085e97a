"""A data loader's state in a checkpoint: saved per rank, and at another data-parallel degree
converted where it is a sample position, else refused naming the loader.

A loader here is anything with ``state_dict()`` / ``load_state_dict()`` (torchdata's
``StatefulDataLoader``, or the user's own). Its state is this rank's: at the same
data-parallel degree each rank loads its own state back as it was saved. At another degree
the state is converted only when it is a **sample position**:

1. the state says nothing but how many samples this rank has read in the current epoch:
   torchdata's ``StatefulDataLoader`` state whose sampler iterator holds ``samples_yielded``
   alone (or with a ``StatefulDistributedSampler``'s equal ``yielded``), no dataset state,
   no steps since its last snapshot (``snapshot_every_n_steps=1``, the default);
2. the sampler deals one global order out to the ranks in turn (rank ``r`` reads every
   ``world``-th sample from ``r``): stratagem's ``ResumableSampler`` or torch's
   ``DistributedSampler`` (and its subclasses), with the same seed, shuffle, ``drop_last``
   and dataset length as the saving run's;
3. every saved rank stands at the same count ``k``; the run has read the first
   ``k × old degree`` samples of that order, so each rank of this run continues after
   ``k × old / new`` of its own shard: a whole number of its batches (or the epoch's end,
   when every real sample of the epoch was read).

Anything else (a dataset's own state, a user's loader, another sampler) only resumes at the
degree that saved it; at another one :func:`loader_state_for_rank` raises
``WorldSizeChangeError`` naming the loader before anything is loaded.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DistributedSampler

from stratagem.data import ResumableSampler

from .world_change import WorldSizeChangeError

__all__ = [
    'check_loader',
    'describe_loader',
    'loader_record',
    'loader_state_for_rank',
    'sample_position',
    'with_sample_position',
]

_GLOBAL_ORDER = (ResumableSampler, DistributedSampler)
_POSITION = 'samples_yielded'  # torchdata's BatchSampler iterator: samples this epoch


def describe_loader(name: str, loader: Any) -> str:
    """``loader 'train' (StatefulDataLoader)``: how every message names a loader."""
    return f'loader {name!r} ({type(loader).__name__})'


def check_loader(name: Any, loader: Any) -> None:
    """Raise ``TypeError`` naming the loader unless it can be saved and restored."""
    if not isinstance(name, str) or not name:
        raise TypeError(f'loaders: a name is a non-empty str, got {name!r}')
    if not (
        callable(getattr(loader, 'state_dict', None))
        and callable(getattr(loader, 'load_state_dict', None))
    ):
        raise TypeError(
            f'{describe_loader(name, loader)} has no state_dict()/load_state_dict(), so its '
            'position cannot be saved; use torchdata.stateful_dataloader.StatefulDataLoader '
            '(pip install "stratagem[torchdata]"), a drop-in for torch\'s DataLoader, or '
            'give your loader those two methods'
        )


def _sampler_of(loader: Any) -> Any:
    return getattr(loader, 'sampler', None)


def loader_record(loader: Any) -> dict:
    """What a conversion needs to know of the loader that saved: its batch size and
    workers, and its sampler's kind, seed, shuffle, ``drop_last``, dataset length and epoch
    (None where the loader has no such sampler)."""
    sampler = _sampler_of(loader)
    record: dict[str, Any] = {
        'batch_size': getattr(loader, 'batch_size', None),
        'num_workers': getattr(loader, 'num_workers', None),
        'sampler': None,
    }
    if isinstance(sampler, _GLOBAL_ORDER):
        record['sampler'] = _sampler_facts(sampler)
    return record


def _sampler_facts(sampler: Any) -> dict:
    if isinstance(sampler, ResumableSampler):
        length = sampler.dataset_len
    else:
        length = len(sampler.dataset)
    return {
        'type': type(sampler).__name__,
        'seed': int(sampler.seed),
        'shuffle': bool(sampler.shuffle),
        'drop_last': bool(sampler.drop_last),
        'dataset_len': int(length),
        'epoch': int(sampler.epoch),
    }


def _main_snapshot(state: Any) -> Any:
    """The part of a StatefulDataLoader state that holds the sampler's position (under
    workers, the main process's snapshot)."""
    if isinstance(state, Mapping) and isinstance(state.get('_snapshot'), Mapping):
        return state['_snapshot'].get('_main_snapshot')
    return state


def sample_position(state: Any) -> int | None:
    """The samples this rank has read in the current epoch, when ``state`` holds nothing
    else that a resume would need (rule 1 of the module's doc); else None."""
    main = _main_snapshot(state)
    if not isinstance(main, Mapping) or not isinstance(state, Mapping):
        return None
    position = main.get('_sampler_iter_state')
    if not isinstance(position, Mapping) or type(position.get(_POSITION)) is not int:
        return None
    count = position[_POSITION]
    if set(position) - {_POSITION, 'sampler_state'}:
        return None
    if 'sampler_state' in position and position['sampler_state'] != {'yielded': count}:
        return None
    if main.get('_index_sampler_state') is not None or state.get('_steps_since_snapshot', 0):
        return None
    holders = [state, main, *(state.get('_snapshot', {}).get('_worker_snapshots') or {}).values()]
    for holder in holders:
        if isinstance(holder, Mapping) and any(
            holder.get(k) is not None for k in ('dataset_state', 'fetcher_state')
        ):
            return None
    return count


def with_sample_position(state: Mapping, samples: int, batches: int) -> dict:
    """A copy of a StatefulDataLoader ``state`` (a :func:`sample_position`) standing
    ``samples`` samples, ``batches`` batches into its epoch."""
    copied: dict[str, Any] = copy.deepcopy(dict(state))
    main = _main_snapshot(copied)
    position = main['_sampler_iter_state']
    position[_POSITION] = samples
    if 'sampler_state' in position:
        position['sampler_state'] = {'yielded': samples}
    main['_sampler_iter_yielded'] = batches
    if '_snapshot' in copied:
        snapshot = copied['_snapshot']
        workers = int(main.get('_num_workers') or 1)
        snapshot['_snapshot_step'] = batches
        snapshot['_last_yielded_worker_id'] = (batches - 1) % workers
    else:
        copied['_num_yielded'] = batches
    return copied


def _saved_workers(state: Any) -> int | None:
    """A StatefulDataLoader state's worker count (torchdata restores only the same)."""
    if not isinstance(state, Mapping):
        return None
    if isinstance(state.get('_snapshot'), Mapping):
        main = state['_snapshot'].get('_main_snapshot')
        return int(main['_num_workers']) if isinstance(main, Mapping) else None
    return 0 if '_num_yielded' in state else None


def loader_state_for_rank(
    name: str,
    loader: Any,
    saved: Mapping,
    *,
    rank: int,
    world_size: int,
    data_parallel_size: int,
    path: str,
) -> Any:
    """The state this rank's ``loader`` loads from ``saved`` (the checkpoint's record of the
    loader: ``world_size``, ``data_parallel_size``, per rank ``states`` and ``records``):
    its own at the same degree, else the converted sample position (module doc), else
    ``WorldSizeChangeError`` naming the loader."""
    states, records = list(saved['states']), list(saved['records'])
    old_world = int(saved['world_size'])
    old_dp = int(saved.get('data_parallel_size', old_world))
    label = describe_loader(name, loader)
    if old_world == world_size and old_dp == data_parallel_size:
        state = states[rank]
    else:
        state = _converted(label, loader, states, records, old_dp, data_parallel_size, rank, path)
    workers = _saved_workers(state)
    if workers is not None and workers != getattr(loader, 'num_workers', workers):
        raise ValueError(
            f'cannot resume {label} from {path}: its state was saved with num_workers='
            f'{workers}, this loader has num_workers={loader.num_workers}; StatefulDataLoader '
            f'restores a state only into as many workers. Build it with num_workers={workers}'
        )
    return state


def _converted(
    label: str,
    loader: Any,
    states: list,
    records: list,
    old_dp: int,
    new_dp: int,
    rank: int,
    path: str,
) -> Any:
    """Rules 2-3 of the module's doc: this rank's state at ``new_dp``, or the refusal."""
    where = f'cannot resume {label} from {path} at data-parallel size {new_dp} (saved at {old_dp})'
    same = f'resume at data-parallel size {old_dp}'
    positions = [sample_position(s) for s in states]
    sampler = _sampler_of(loader)
    saved_sampler = records[0].get('sampler') if records else None
    if any(p is None for p in positions) or saved_sampler is None:
        raise WorldSizeChangeError(
            f'{where}: its state is not a sample position that converts (a StatefulDataLoader '
            'state holding only the samples read, over a sampler that deals one global order '
            'out to the ranks: ResumableSampler or DistributedSampler), so it continues only '
            f'on as many ranks as saved it; {same}, or save with such a loader'
        )
    if not isinstance(sampler, _GLOBAL_ORDER):
        raise WorldSizeChangeError(
            f'{where}: its sampler is a {type(sampler).__name__}, not a ResumableSampler or '
            'DistributedSampler, so the samples already read cannot be found in its order; '
            f'{same}, or give it the sampler it was saved with ({saved_sampler["type"]})'
        )
    facts = _sampler_facts(sampler)
    differ = [
        f'{k} {saved_sampler[k]!r} -> {facts[k]!r}'
        for k in ('type', 'seed', 'shuffle', 'drop_last', 'dataset_len')
        if saved_sampler.get(k) != facts[k]
    ]
    if differ:
        raise WorldSizeChangeError(
            f"{where}: its sampler differs from the saving run's ({', '.join(differ)}), so "
            f'its order differs; build the sampler as it was saved, or {same}'
        )
    if len(set(positions)) != 1:
        raise WorldSizeChangeError(
            f'{where}: the saved ranks stood at different positions {positions} (samples '
            f'read per rank); {same}, or save where every rank has read as many batches'
        )
    count = int(positions[0])  # type: ignore[arg-type]
    read = count * old_dp
    per_rank = len(sampler)
    batch = int(getattr(loader, 'batch_size', None) or 1)
    if read >= facts['dataset_len'] or read >= per_rank * new_dp:
        mine = per_rank  # every real sample of the epoch was read (the rest is padding)
    elif read % new_dp or (read // new_dp) % batch:
        raise WorldSizeChangeError(
            f'{where}: the run had read {read} samples of the epoch ({old_dp} ranks × '
            f'{count}), which is no whole number of batches of {batch} on each of {new_dp} '
            f'ranks; {same}, or choose a batch size that divides it'
        )
    else:
        mine = read // new_dp
    drop_last = bool(getattr(loader, 'drop_last', False))
    batches = mine // batch if drop_last else math.ceil(mine / batch)
    template = states[rank % len(states)]
    return with_sample_position(template, mine, batches)
