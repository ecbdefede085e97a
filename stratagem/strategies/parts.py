"""A strategy's checkpoint parts: one class per part, owning what it saves, what it checks
before anything of a resume loads, and how it restores.

Each part follows the ``Checkpointer``'s protocol (``checkpoint/checkpointer.py``):
``state_dict()`` (None: nothing to save at this moment), ``check(value, context)`` (raise to
refuse, or ``context.replace`` the value), ``restore(value, context)``, ``load_state_dict``
(a restore without a context) and ``required``. A part takes what it needs explicitly (the
strategy's public state-dict methods, the optim wrapper, the run environment), never the
strategy. ``BaseStrategy.checkpoint_state()`` builds them in the order a resume restores them:

==================== ========================= ==========================================
key                  part                      a backend's own
==================== ========================= ==========================================
``state_dict``       :class:`ModelPart`        ``fsdp/parts.py``: the mesh change said
``optimizer``        :class:`OptimizerPart`    ``fsdp/parts.py``: a pipeline stage's groups
``partial_grads``    :class:`PendingGradsPart` ``fsdp/parts.py`` (sharded gradients),
                                               fairscale's (buckets rebound)
``meta``             :class:`PositionPart`
``param_schedulers`` :class:`SchedulersPart`
``loaders``          :class:`LoaderPart`       (the caller's loaders, every rank's state)
``rng_states``       :class:`RandomnessPart`
==================== ========================= ==========================================

A backend supplies its own part through the strategy's factory for it (``model_part``,
``optimizer_part``, ``pending_grads_part``), a subclass of the part here.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem import env
from stratagem.checkpoint.checkpointer import LoadContext
from stratagem.checkpoint.errors import CheckpointCorruptError

from .environment import RunEnvironment, initialize_accumulation
from .loader_state import check_loader, describe_loader, loader_record, loader_state_for_rank
from .resume_checks import check_model_fits, check_optimizer_fits, check_scheduler_count
from .world_change import WorldSizeChange, plan_world_size_change

__all__ = [
    'CheckpointPart',
    'LoaderPart',
    'ModelPart',
    'OptimizerPart',
    'PendingGradsPart',
    'PositionPart',
    'SchedulersPart',
    'RandomnessPart',
    'upgrade_partial_grads',
    'wrappers_of',
]


def wrappers_of(optim_wrapper: Any) -> list[Any]:
    """The optim wrappers of ``optim_wrapper`` (an OptimWrapperDict's, or it alone; none for
    None)."""
    from stratagem.optim import OptimWrapperDict

    if optim_wrapper is None:
        return []
    if isinstance(optim_wrapper, OptimWrapperDict):
        return list(optim_wrapper.values())
    return [optim_wrapper]


class CheckpointPart(ABC):
    """The protocol's defaults: required, no check, ``load_state_dict`` is a restore without
    a context (no path, no ``meta``). A part supplies ``state_dict`` and ``restore``."""

    required = True

    @abstractmethod
    def state_dict(self) -> Any:
        """The part's value as saved (collective where the part gathers across ranks)."""

    def check(self, value: Any, context: LoadContext) -> None:  # noqa: B027 (a part may check nothing)
        """Before anything loads: raise to refuse, or ``context.replace`` the value."""

    @abstractmethod
    def restore(self, value: Any, context: LoadContext) -> None:
        """Put ``value`` back; ``context`` is the load's (path, ``meta``, the checks' notes)."""

    def load_state_dict(self, state_dict: Any) -> None:
        self.restore(state_dict, LoadContext('', {}))


class ModelPart(CheckpointPart):
    """The model's weights.

    Args:
        save: the state dict (``strategy.model_state_dict``).
        load: ``load(state_dict, path)`` loads non-strictly, mismatches in one report
            (``loading.load_weights``).
        module: the plain module behind the wrapper (``strategy.unwrap_model``).
    """

    def __init__(
        self,
        save: Callable[[], Any],
        load: Callable[[Mapping, str], None],
        module: Callable[[], nn.Module],
    ) -> None:
        self.save, self.load, self.module = save, load, module

    def state_dict(self) -> Any:
        return self.save()

    def check(self, value: Any, context: LoadContext) -> None:
        check_model_fits(self.module(), value, context.path)

    def restore(self, value: Any, context: LoadContext) -> None:
        self.load(value, context.path)


class OptimizerPart(CheckpointPart):
    """The optim wrapper's state (optimizer, counters, loss scale).

    Args:
        optim_wrapper: the prepared optim wrapper (or OptimWrapperDict).
        save: its state dict (``strategy.optim_state_dict``).
        load: loads one (``strategy.load_optim_state_dict``).
    """

    def __init__(
        self, optim_wrapper: Any, save: Callable[[], Any], load: Callable[[Mapping], None]
    ) -> None:
        self.optim_wrapper, self.save, self.load = optim_wrapper, save, load

    def state_dict(self) -> Any:
        return self.save()

    def check(self, value: Any, context: LoadContext) -> None:
        """Param groups of the same sizes, no hyperparameter the built optimizer lacks."""
        check_optimizer_fits(self.optim_wrapper, value, context.path)

    def restore(self, value: Any, context: LoadContext) -> None:
        self.load(value)


class PendingGradsPart(CheckpointPart):
    """Every rank's gradients inside an accumulation window, by parameter name
    (``partial_grads``: a list over ranks of ``{name: gradient}``, format 2), so a resume
    continues the window; absent between windows.

    Args:
        optim_wrapper: the prepared optim wrapper (or OptimWrapperDict); each wrapper that
            accumulates holds its window's gradients (``grad_state_dict``).
        module: the plain module, whose parameter names key the gradients.
    """

    required = False

    def __init__(self, optim_wrapper: Any, module: Callable[[], nn.Module]) -> None:
        self.optim_wrapper, self.module = optim_wrapper, module

    # ------------------------------------------------------------- this rank's
    def pending(self) -> dict[str, torch.Tensor] | None:
        """This rank's gradients inside a window, by parameter name (references, on their
        device); None between windows."""
        named = self._parameter_names()
        grads: dict[str, torch.Tensor] = {}
        open_window = False
        for wrapper in wrappers_of(self.optim_wrapper):
            if not hasattr(wrapper, 'grad_state_dict') or wrapper.should_update():
                continue
            open_window = True
            holders = wrapper.grad_holders()
            for index, grad in wrapper.grad_state_dict()['grads'].items():
                grads[named[id(holders[index])]] = grad
        return grads if open_window else None

    def put(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Put back gradients read by :meth:`pending` (each wrapper keeps its counters and
        loss scale, restored with the optimizer state first)."""
        named = self._parameter_names()
        for wrapper in wrappers_of(self.optim_wrapper):
            if not hasattr(wrapper, 'grad_state_dict'):
                continue
            state = wrapper.grad_state_dict()
            state['grads'] = {
                i: grads[named[id(p)]]
                for i, p in enumerate(wrapper.grad_holders())
                if named.get(id(p)) in grads
            }
            wrapper.load_grad_state_dict(state)

    # ---------------------------------------------------------------- the part
    def state_dict(self) -> list | dict | None:
        """Every rank's :meth:`pending` on CPU (collective; the window is open on all ranks
        alike). One process: None, the optimizer state holds them."""
        if env.get_world_size() == 1:
            return None
        mine = self.pending()
        if mine is None:
            return None
        return env.all_gather_object({k: g.cpu() for k, g in mine.items()})

    def restore(self, value: Any, context: LoadContext) -> None:
        """This rank's partial gradients; at another world size the mean of the saved
        ranks' (what DDP would have averaged at the window's end)."""
        per_rank = upgrade_partial_grads(
            value,
            context.checkpoint.get('partial_grads_fqn'),
            lambda: self.holder_names(_saved_wrapper_order(context.checkpoint.get('optimizer'))),
        )
        if not per_rank:
            return
        rank, world_size = env.get_rank(), env.get_world_size()
        world = int(context.meta.get('world_size', len(per_rank)))
        if world == world_size:
            mine = per_rank[rank]
        else:
            mine = {k: sum(g[k] for g in per_rank) / len(per_rank) for k in per_rank[0]}
        self.put(mine)
        if world != world_size:
            env.warn_rank_zero(
                f'the checkpoint was taken mid accumulation window with world '
                f'size {world}; this run has {world_size}, so every rank '
                f"continues the window from the mean of the {world} ranks' "
                'partial gradients',
                stacklevel=3,
            )

    def holder_names(self, saved_order: Sequence[str] | None = None) -> list[list[str]]:
        """Per optim wrapper, the names of the parameters its gradient indices count (format
        1's keys). With an OptimWrapperDict, ``saved_order`` (the saved optimizer state's
        keys) orders them as the saving run did, so a resume whose cfg lists them in another
        order pairs each saved wrapper with its namesake."""
        named = self._parameter_names()
        wrappers = wrappers_of(self.optim_wrapper)
        keys = list(getattr(self.optim_wrapper, 'keys', lambda: [])())
        if saved_order is not None and keys and sorted(saved_order) == sorted(keys):
            wrappers = [self.optim_wrapper[k] for k in saved_order]
        return [
            [named[id(p)] for p in w.grad_holders()] if hasattr(w, 'grad_holders') else []
            for w in wrappers
        ]

    def _parameter_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.module().named_parameters()}


class PositionPart(CheckpointPart):
    """Where training stands (``meta``: ``iter``, ``epoch``, what a resume at another world
    size needs): a world-size change planned before anything loads, then the accumulation
    counters put where the resumed run stands.

    Args:
        save: the ``meta`` to save (``strategy.checkpoint_meta`` with the caller's keys).
        dispatch_kwargs: this run's ``max_iters`` / ``max_epochs`` / ``epoch_length`` /
            ``train_micro_batch_size_per_gpu`` (read, never written).
        optim_wrapper: the prepared optim wrapper, or None.
        model: the prepared (wrapped) model, for the accumulation counters.
        world_size, data_parallel_size: this run's.
    """

    required = False

    def __init__(
        self,
        save: Callable[[], dict],
        *,
        dispatch_kwargs: Mapping[str, Any],
        optim_wrapper: Any,
        model: nn.Module,
        world_size: int,
        data_parallel_size: int,
    ) -> None:
        self.save = save
        self.dispatch_kwargs = dispatch_kwargs
        self.optim_wrapper = optim_wrapper
        self.model = model
        self.world_size = world_size
        self.data_parallel_size = data_parallel_size

    def state_dict(self) -> dict:
        return self.save()

    def check(self, value: Any, context: LoadContext) -> None:
        """A world-size change: positions converted in samples, or refused naming both world
        sizes, before anything is loaded (``context.notes['world_size_change']``)."""
        wrappers = wrappers_of(self.optim_wrapper)
        accumulation = max([getattr(w, 'accumulative_counts', 1) for w in wrappers] or [1])
        context.notes['world_size_change'] = plan_world_size_change(
            value or {},
            self.dispatch_kwargs,
            self.world_size,
            accumulation,
            context.path,
            self.data_parallel_size,
        )

    def restore(self, value: Any, context: LoadContext) -> None:
        """The accumulation counters at the resumed iteration, towards this run's end (its
        ``max_iters``, converted to this world size when a change converted it: that value is
        in the returned ``meta['world_size_change']['max_iters']``)."""
        change: WorldSizeChange | None = context.notes.get('world_size_change')
        done = (value or {}).get('iter')
        dispatch = self.dispatch_kwargs
        if change is not None and change.new_iter is not None:
            done = change.new_iter
            if change.max_iters is not None:
                dispatch = {**dispatch, 'max_iters': change.max_iters[1]}
        wrappers = wrappers_of(self.optim_wrapper)
        if wrappers:
            initialize_accumulation(wrappers, self.model, done, dispatch)


class SchedulersPart(CheckpointPart):
    """The parameter schedulers' states.

    Args:
        schedulers: the prepared ``param_schedulers`` (a list, or a dict of lists).
        save: their state dicts (``strategy.scheduler_state_dict``).
        load: loads them (``strategy.load_scheduler_state_dict``).
        epoch_length: iterations per epoch (``dispatch_kwargs``), for replays.
        refit: a scheduler whose ``end`` was fitted to the saving run's length (its cfg has
            none) and this run's differs is built for this run and replayed to the resumed
            iteration, instead of kept as saved with one warning
            (``resume(refit_schedulers=)``).
        logger: where the refit is said (rank 0).
    """

    def __init__(
        self,
        schedulers: Any,
        save: Callable[[], Any],
        load: Callable[[Any], None],
        *,
        epoch_length: int | None,
        refit: bool = False,
        logger: Any = None,
    ) -> None:
        self.schedulers, self.save, self.load = schedulers, save, load
        self.epoch_length = epoch_length
        self.refit = refit
        self.logger = logger

    def state_dict(self) -> Any:
        return self.save()

    def check(self, value: Any, context: LoadContext) -> None:
        """The same number of schedulers; at another world size their counts converted."""
        check_scheduler_count(self.save(), value, context.path)
        change: WorldSizeChange | None = context.notes.get('world_size_change')
        if change is not None and change.new_iter is not None:
            context.replace(
                'param_schedulers',
                change.rescale_schedulers(self.schedulers, value, self.epoch_length, context.path),
            )

    def restore(self, value: Any, context: LoadContext) -> None:
        """The saved schedulers; those whose ``end`` was fitted to the saving run's length and
        this run's differs: kept as saved with one warning, or, with ``refit``, as this run
        built them, replayed from the first iteration to the resumed one (the values a fresh
        run of this length has)."""
        from stratagem.scheduler.replay import fitted_length_changes, replay_schedulers

        change: WorldSizeChange | None = context.notes.get('world_size_change')
        scheds = self.schedulers
        lists = list(scheds.values()) if isinstance(scheds, Mapping) else [scheds]
        saved = [value.get(k, []) for k in scheds] if isinstance(scheds, Mapping) else [value]
        refit = [c for own, st in zip(lists, saved) for c in fitted_length_changes(own, st)]
        if refit and self.refit:
            done = (context.meta or {}).get('iter') or 0
            if change is not None and change.new_iter is not None:
                done = change.new_iter
            for own in lists:
                replay_schedulers(own, int(done), self.epoch_length)
            if env.get_rank() == 0 and self.logger is not None:
                self.logger.info('param schedulers refitted to this run: ' + '; '.join(refit))
            return
        self.load(value)
        if refit and env.get_rank() == 0:  # the same on every rank: said once
            warnings.warn(
                f'resuming {context.path} into a run of another length: '
                + '; '.join(refit)
                + '. These schedulers keep the saved length (their value stops changing '
                'after it); to refit them to this run, resume with '
                'train_cfg.refit_schedulers=True (--cfg-options '
                'train_cfg.refit_schedulers=True; API: strategy.resume(..., '
                'refit_schedulers=True))',
                UserWarning,
                stacklevel=2,
            )
        if change is not None and change.new_iter is not None:
            change.replay_schedulers(self.schedulers, self.epoch_length)


class LoaderPart(CheckpointPart):
    """Every rank's state of the data loaders the caller names (``loaders``: ``{name:
    {'world_size', 'data_parallel_size', 'states': [per rank], 'records': [per rank]}}``),
    so a loop of its own resumes mid-epoch on the samples an uninterrupted run reads next;
    at another data-parallel degree converted where it is a sample position, else refused
    naming the loader (``loader_state.py``).

    Args:
        loaders: ``{name: loader}``, each with ``state_dict`` / ``load_state_dict``
            (torchdata's ``StatefulDataLoader``, or one's own).
        world_size, data_parallel_size: this run's.
    """

    required = False

    def __init__(
        self, loaders: Mapping[str, Any], *, world_size: int, data_parallel_size: int
    ) -> None:
        if not isinstance(loaders, Mapping):
            raise TypeError(
                f'loaders= takes a dict of named loaders, e.g. loaders={{"train": loader}}; got '
                f'a {type(loaders).__name__}'
            )
        for name, loader in loaders.items():
            check_loader(name, loader)
        self.loaders = dict(loaders)
        self.world_size, self.data_parallel_size = world_size, data_parallel_size

    def state_dict(self) -> dict:
        """Every rank's loader states (collective). A state that a ``weights_only`` load
        could not read back fails the save on every rank, naming the loader and the rank."""
        from stratagem.checkpoint.content import validate_checkpoint_content

        mine: dict[str, Any] = {}
        problem = None
        for name, loader in self.loaders.items():
            try:
                state = loader.state_dict()
                validate_checkpoint_content(state, root=f'loaders[{name!r}]')
            except Exception as err:  # noqa: BLE001 - told to every rank below
                problem = f'{describe_loader(name, loader)}: {type(err).__name__}: {err}'
                break
            mine[name] = (state, loader_record(loader))
        # a rank whose state cannot be saved sends its reason instead: every rank raises
        gathered = env.all_gather_object(problem if problem is not None else mine)
        for rank, got in enumerate(gathered):
            if isinstance(got, str):
                raise TypeError(f'cannot save the loader state of rank {rank}: {got}')
        return {
            name: {
                'world_size': self.world_size,
                'data_parallel_size': self.data_parallel_size,
                'states': [got[name][0] for got in gathered],
                'records': [got[name][1] for got in gathered],
            }
            for name in self.loaders
        }

    def check(self, value: Any, context: LoadContext) -> None:
        """Each loader's saved state, for this rank (converted or refused at another
        degree), before anything loads (``context.notes['loaders']``)."""
        context.notes['loaders'] = self._for_this_rank(value, context.path)

    def restore(self, value: Any, context: LoadContext) -> None:
        """Each loader's state; a sampler that counts epochs is set to the saved epoch."""
        chosen = context.notes.get('loaders')
        if chosen is None:
            chosen = self._for_this_rank(value, context.path)
        for name, loader in self.loaders.items():
            state, record = chosen[name]
            loader.load_state_dict(state)
            epoch = (record.get('sampler') or {}).get('epoch')
            set_epoch = getattr(getattr(loader, 'sampler', None), 'set_epoch', None)
            if epoch is not None and callable(set_epoch):
                set_epoch(epoch)

    def _for_this_rank(self, value: Any, path: str) -> dict[str, tuple[Any, dict]]:
        saved = value if isinstance(value, Mapping) else {}
        rank = env.get_rank()
        chosen = {}
        for name, loader in self.loaders.items():
            if name not in saved:
                raise KeyError(
                    f'cannot resume {describe_loader(name, loader)} from {path}: it holds no '
                    f'state for it (loaders saved: {sorted(saved)}); resume without that '
                    'loader, or from a checkpoint saved with loaders={' + repr(name) + ': ...}'
                )
            record = saved[name]
            state = loader_state_for_rank(
                name,
                loader,
                record,
                rank=rank,
                world_size=self.world_size,
                data_parallel_size=self.data_parallel_size,
                path=path,
            )
            records = record['records']
            chosen[name] = (state, records[rank % len(records)])
        return chosen


class RandomnessPart(CheckpointPart):
    """Every rank's RNG state (gathered; or each rank's own, ``own_state_dict``, where the
    storage writes each rank's to its own file and reads them back as the list over the
    ranks), restored last; at another world size every rank is re-seeded from the saved seed
    instead.

    Args:
        environment: the run's environment (its seed and randomness settings).
        reseed: ``reseed(seed)`` seeds every RNG from the configured ``seed`` (the rank added
            under ``diff_rank_seed``): the strategy's ``_set_randomness``.
    """

    required = False

    def __init__(self, environment: RunEnvironment, reseed: Callable[[int], None]) -> None:
        self.environment, self.reseed = environment, reseed

    def state_dict(self) -> list:
        return env.all_gather_object(env.get_rng_state())

    def own_state_dict(self) -> dict:
        """This rank's entry of ``state_dict()``, without the collective."""
        return env.get_rng_state()

    def check(self, value: Any, context: LoadContext) -> None:
        """The RNG state this rank will restore is one: tried here, before anything loads,
        and this process's own put back (a state the manifest's digests cannot vouch for,
        e.g. one written wrong, is a named error, not numpy's or torch's)."""
        world = context.meta.get('world_size', 1)
        rank = env.get_rank()
        if not value or world != env.get_world_size():
            return  # re-seeded from the saved seed
        own = env.get_rng_state()
        try:
            env.set_rng_state(value[rank])
        except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as err:
            raise CheckpointCorruptError(
                f'{context.path}: rng_states[{rank}] is not an RNG state this run can '
                f'restore ({type(err).__name__}: {err}); nothing was loaded. Resume it with '
                'another checkpoint, or load its weights only (load_checkpoint)'
            ) from None
        finally:
            env.set_rng_state(own)

    def restore(self, value: Any, context: LoadContext) -> None:
        """Every rank's RNG state (same world size), else a re-seed from the saved seed."""
        meta = context.meta
        world = meta.get('world_size', 1)
        world_size = env.get_world_size()
        base = meta.get('seed', self.environment.seed)  # rank 0's seed: the configured one
        if value and world == world_size:
            self.environment.adopt_seed(base)
            env.set_rng_state(value[env.get_rank()])
            return
        if value:
            env.warn_rank_zero(
                f'{context.path} was saved with world size {world}, this run has '
                f'{world_size}: per-rank RNG streams cannot be restored, so '
                f'every rank is re-seeded from seed {base}',
                stacklevel=3,
            )
        self.reseed(base)


def _saved_wrapper_order(optimizer_state: Any) -> list[str] | None:
    """An OptimWrapperDict's state: its wrappers' names in the saving run's order."""
    if isinstance(optimizer_state, Mapping) and not {'state', 'param_groups'} & set(
        optimizer_state
    ):
        return [str(k) for k in optimizer_state]
    return None


def upgrade_partial_grads(
    per_rank: Any, fsdp_v1: Any, holder_names: Callable[[], list[list[str]]]
) -> list | None:
    """``partial_grads`` in this version's form (a list over ranks of ``{name: gradient}``)
    from any version's: FSDP's ``partial_grads_fqn`` (format 1, already by name), or the
    other backends' per rank and wrapper ``{'grads': {optimizer index: gradient}, ...}``
    (format 1), named by ``holder_names()`` (per wrapper, the names its indices count; the
    resume checks made sure the optimizer's parameters are the saved ones)."""
    if not per_rank:
        return fsdp_v1 or None
    if all(isinstance(entry, Mapping) for entry in per_rank):
        return list(per_rank)
    names = holder_names()
    upgraded = []
    for entry in per_rank:
        named: dict[str, torch.Tensor] = {}
        for wrapper_names, state in zip(names, entry):
            if state is not None:
                named.update({wrapper_names[i]: g for i, g in state['grads'].items()})
        upgraded.append(named)
    return upgraded
