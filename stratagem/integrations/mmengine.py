"""stratagem inside mmengine's ``FlexibleRunner``: ``import stratagem.integrations.mmengine``.

Importing this module (the only one in stratagem that imports mmengine) does three things:

1. **Allow-lists what mmengine's runner puts in a checkpoint**, so stratagem saves it and
   loads it back with ``torch.load(weights_only=True)``: the message hub's
   ``HistoryBuffer`` and the numpy arrays, scalars and dtypes it and the runtime info hold
   (``stratagem.checkpoint.add_safe_globals``). ``HistoryBuffer.__getstate__`` stores its
   class's statistics methods, which pickle as calls of ``builtins.getattr``, a global the
   weights-only unpickler rightly never allows; a ``copyreg`` reducer pickles a buffer as
   its constructor call with its arrays instead (custom statistics are registered on the
   class at import, so nothing is lost). mmengine's own strategies cannot resume on
   torch >= 2.6 for this reason; checkpoints written with this module imported can.
2. **Registers stratagem's strategies, optim wrappers and parameter schedulers in
   mmengine's registries** under the scope ``stratagem`` (a child registry, mmengine's
   mechanism for other packages' names), so a config names them without clashing with
   mmengine's own: ``strategy=dict(type='stratagem.DDPStrategy')``,
   ``optim_wrapper=dict(type='stratagem.AmpOptimWrapper', ...)``. stratagem's own
   registries accept the ``stratagem.`` prefix too. Strategies that stratagem registers
   lazily (heavy backends) are registered as builder functions, imported on first build.
3. **Registers ``stratagem.PreemptionHook``** in mmengine's HOOKS (``custom_hooks``): a
   preemption signal ends the run in one committed checkpoint (``mmengine_preemption.py``);
   and ``stratagem.CheckpointDebrisHook``, which sweeps the manifest of a checkpoint
   mmengine's ``CheckpointHook`` deleted (``mmengine_debris.py``); and
   ``stratagem.FsspecCheckpointHook`` with mmengine's file backend ``'stratagem_fsspec'``,
   mmengine's ``CheckpointHook`` with its ``out_dir`` at an fsspec URL
   (``mmengine_storage.py``).
4. **Falls back to mmengine's registries** for what stratagem's do not hold
   (``Registry.add_fallback``): a model, dataset, optimizer, optim wrapper (constructor) or
   parameter scheduler registered in mmengine's ``MODELS``, ``DATASETS``, ``OPTIMIZERS``, ...
   (a user's package, or an OpenMMLab one under the ``default_scope``) builds through a
   stratagem strategy under ``FlexibleRunner``, which builds a config's ``model`` through
   stratagem's ``MODELS``. Metrics, hooks, visualizers and samplers are built by mmengine
   itself, from its own registries.
5. **Lends stratagem's names to mmengine's builders** for a config its runner builds
   (:func:`share_registered_types`, called by ``mmengine_runner.runner_config``): a dataset
   registered in stratagem's ``DATASETS`` (as the own-model guide teaches) builds under
   ``FlexibleRunner`` too, and a name neither registry holds is refused before mmengine
   builds (or prints) anything, naming both registries and the closest names of both.
6. Nothing else: a strategy's wrapped model already carries the inner module's
   ``train_step`` / ``val_step`` / ``test_step`` (``stratagem.strategies.model_api``),
   which mmengine's loops call.

Switching an mmengine config to stratagem: ``import stratagem.integrations.mmengine`` (or
``custom_imports=dict(imports=['stratagem.integrations.mmengine'])`` in the config), build a
``FlexibleRunner`` and set ``strategy=dict(type='stratagem.SingleDeviceStrategy')`` (or
``'stratagem.DDPStrategy'``, ...); ``optim_wrapper`` and ``param_scheduler`` keep mmengine's
keys. FlexibleRunner's default ``env_cfg`` (``backend='nccl'``) works on a CPU-only machine,
however the strategy is named (``'stratagem.DDPStrategy'``, or the class object of mmengine's
pure-Python configs): a CUDA backend the user did not choose becomes gloo there, said once
(the strategy's constructor fits it: ``env.backend.fit_runner_env_kwargs``); a backend written
into the strategy's own ``env_kwargs`` is the user's, and nccl there without CUDA is an error.
"""

from __future__ import annotations

import copyreg
import importlib
from collections.abc import Mapping
from typing import Any

try:
    from mmengine.logging import HistoryBuffer
    from mmengine.registry import DATASETS as MM_DATASETS
    from mmengine.registry import HOOKS as MM_HOOKS
    from mmengine.registry import MODELS as MM_MODELS
    from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS as MM_OPTIM_WRAPPER_CONSTRUCTORS
    from mmengine.registry import OPTIM_WRAPPERS as MM_OPTIM_WRAPPERS
    from mmengine.registry import OPTIMIZERS as MM_OPTIMIZERS
    from mmengine.registry import PARAM_SCHEDULERS as MM_PARAM_SCHEDULERS
    from mmengine.registry import STRATEGIES as MM_STRATEGIES
    from mmengine.registry import Registry as MMRegistry
except ImportError as err:  # pragma: no cover - exercised only without mmengine
    raise ImportError(
        'stratagem.integrations.mmengine needs mmengine: pip install '
        '"stratagem[mmengine]" (mmengine>=0.10.7)'
    ) from err
import numpy as np

from stratagem import registry as ours
from stratagem.checkpoint import add_safe_globals
from stratagem.config import ConfigError

from .mmengine_debris import CheckpointDebrisHook
from .mmengine_preemption import PreemptionHook
from .mmengine_storage import FsspecCheckpointHook

__all__ = [
    'SCOPE',
    'numpy_safe_globals',
    'share_registered_types',
    'mmengine_safe_globals',
    'STRATEGIES',
    'OPTIM_WRAPPERS',
    'PARAM_SCHEDULERS',
    'HOOKS',
]

SCOPE = 'stratagem'


# ---------------------------------------------------------------- 1. the allow-list
def _reduce_history_buffer(buffer: HistoryBuffer) -> tuple:
    # the constructor copies the arrays and restores the default statistics methods
    return HistoryBuffer, (*buffer.data, buffer.max_length)


_HISTORY_BUFFER_NAME = f'{HistoryBuffer.__module__}.{HistoryBuffer.__qualname__}'


class _LoadedHistoryBuffer(HistoryBuffer):
    """What a checkpoint's ``HistoryBuffer`` loads as (allow-listed under mmengine's name).

    ``HistoryBuffer.__setstate__`` merges a pickled ``statistics_methods`` dict into the
    *class-level* method table, and the weights-only unpickler calls ``__setstate__`` for
    any allow-listed class: a crafted file could replace ``mean`` / ``max`` ... of every
    buffer in the process with another allow-listed callable. Our files never carry a state
    (the reducer pickles the constructor call); a state given anyway may set the arrays
    only.
    """

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise TypeError('HistoryBuffer state must be a dict')
        HistoryBuffer.__init__(
            self,
            state.get('_log_history', []),
            state.get('_count_history', []),
            state.get('max_length', 1000000),
        )

    def __reduce__(self) -> tuple:
        return _reduce_history_buffer(self)


def numpy_safe_globals() -> list:
    """What a numpy array, scalar or dtype pickles as (torch's documented numpy set), also
    under the other numpy major's module names, so a file from numpy 1 loads under numpy 2
    and back."""
    # the functions an array and a scalar pickle as live in a private module in numpy 2
    # (numpy._core.multiarray): asked of an array and a scalar instead
    reconstruct: Any = np.zeros(1).__reduce__()[0]
    scalar: Any = np.float64(0).__reduce__()[0]
    entries: list[Any] = [np.ndarray, np.dtype, reconstruct, scalar]
    entries += sorted(
        {type(np.dtype(code)) for code in np.typecodes['All']}, key=lambda t: t.__qualname__
    )
    for other in ('numpy.core.multiarray', 'numpy._core.multiarray'):
        for func in (reconstruct, scalar):
            if func.__module__ != other:
                entries.append((func, f'{other}.{func.__name__}'))
    return entries


def mmengine_safe_globals() -> list:
    """mmengine's classes that its runner stores in a checkpoint (the message hub's);
    ``HistoryBuffer`` loads as a subclass whose ``__setstate__`` cannot touch the class."""
    return [(_LoadedHistoryBuffer, _HISTORY_BUFFER_NAME)]


copyreg.pickle(HistoryBuffer, _reduce_history_buffer)
copyreg.pickle(_LoadedHistoryBuffer, _reduce_history_buffer)
add_safe_globals(numpy_safe_globals() + mmengine_safe_globals())


# ------------------------------------------------------------ 2. mmengine registries
def _child(parent: MMRegistry, name: str) -> MMRegistry:
    existing = parent.children.get(SCOPE)  # a reload of this module keeps the first one
    return existing if existing is not None else MMRegistry(name, parent=parent, scope=SCOPE)


def _builder(registry: ours.Registry, name: str):
    def build(**kwargs: Any) -> Any:
        return registry.build(dict(type=name, **kwargs))

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"Builds stratagem's {name} (imported on first use)."
    return build


def _mirror(source: ours.Registry, target: MMRegistry) -> None:
    loaded = source.module_dict  # eager entries: the classes themselves
    for name in source.names():
        obj = loaded.get(name)
        if obj is None:
            obj = _builder(source, name)
        target.register_module(name=name, module=obj, force=True)


STRATEGIES = _child(MM_STRATEGIES, 'strategy')
OPTIM_WRAPPERS = _child(MM_OPTIM_WRAPPERS, 'optim_wrapper')
PARAM_SCHEDULERS = _child(MM_PARAM_SCHEDULERS, 'parameter scheduler')
_mirror(ours.STRATEGIES, STRATEGIES)
_mirror(ours.OPTIM_WRAPPERS, OPTIM_WRAPPERS)
_mirror(ours.PARAM_SCHEDULERS, PARAM_SCHEDULERS)

# preemption for mmengine's loops: custom_hooks=[dict(type='stratagem.PreemptionHook')]
HOOKS = _child(MM_HOOKS, 'hook')
HOOKS.register_module(name='PreemptionHook', module=PreemptionHook, force=True)
HOOKS.register_module(name='CheckpointDebrisHook', module=CheckpointDebrisHook, force=True)
HOOKS.register_module(name='FsspecCheckpointHook', module=FsspecCheckpointHook, force=True)


# ------------------------------------------------------- 4. fall back to mmengine's
def _scope_node(registry: MMRegistry, scope: str | None) -> MMRegistry:
    """The node of mmengine's registry tree that a build under ``scope`` starts from (the
    scope's child registry, its ``<scope>.registry`` module imported as mmengine does;
    else the root), found without mmengine's messages."""
    root = registry
    while root.parent is not None:
        root = root.parent
    if scope is None or scope == root.scope:
        return root
    if scope not in root.children:
        try:
            importlib.import_module(f'{scope}.registry')
        except ImportError:
            return root
    return root.children.get(scope, root)


def _chain(registry: MMRegistry, scope: str | None = None):
    """The nodes a build under ``scope`` (None: the current ``default_scope``) searches for
    a name without a scope: the scope's node, then its parents."""
    if scope is None:
        with registry.switch_scope_and_registry(None) as node:
            start = node
    else:
        start = _scope_node(registry, scope)
    node = start
    while node is not None:
        node.import_from_location()
        yield node
        node = node.parent


def _find(registry: MMRegistry, name: str, scope: str | None = None) -> Any:
    """``name`` in mmengine's registry as its ``build`` finds it under ``scope`` (None: the
    current ``default_scope``); a scoped ``'mmdet.X'`` in that scope's registry. Registered
    names only: an import path is stratagem's to import (mmengine's ``get`` would import it
    and turn its errors into 'Failed to get')."""
    prefix, key = registry.split_scope_key(name)
    if prefix is not None:
        root = _scope_node(registry, None)
        node = root if prefix == root.scope else root.children.get(prefix)
        return None if node is None else node.module_dict.get(key)
    for node in _chain(registry, scope):
        if key in node.module_dict:
            return node.module_dict[key]
    return None


def _lookup(registry: MMRegistry):
    def lookup(name: str) -> Any:
        return _find(registry, name)

    return lookup


def _names(registry: MMRegistry):
    def names() -> list[str]:
        return sorted({key for node in _chain(registry) for key in node.module_dict})

    return names


_PAIRS = {
    'model': (ours.MODELS, MM_MODELS),
    'dataset': (ours.DATASETS, MM_DATASETS),
    'optimizer': (ours.OPTIMIZERS, MM_OPTIMIZERS),
    'optim_wrapper': (ours.OPTIM_WRAPPERS, MM_OPTIM_WRAPPERS),
    'optim_wrapper_constructor': (ours.OPTIM_WRAPPER_CONSTRUCTORS, MM_OPTIM_WRAPPER_CONSTRUCTORS),
    'parameter scheduler': (ours.PARAM_SCHEDULERS, MM_PARAM_SCHEDULERS),
}
for _ours, _theirs in _PAIRS.values():
    _ours.add_fallback(_lookup(_theirs), f"mmengine's {_theirs.name!r} registry", _names(_theirs))


# ------------------------------------------ 5. stratagem's names seen by mmengine's builders
def share_registered_types(cfg: Mapping) -> None:
    """One registry space for a config that mmengine's runner builds: each ``type`` name at
    a place mmengine builds from a registry stratagem has too (``model`` and its
    ``data_preprocessor``, the dataloaders' ``dataset`` and the datasets a wrapper holds,
    ``optim_wrapper`` with its ``optimizer`` and ``constructor``, ``param_scheduler``) that
    only stratagem's registry holds (``stratagem.registry.DATASETS.register_module()``) is
    registered, as that object, in mmengine's root registry, where its build under any
    ``default_scope`` finds it. A name neither holds is a ConfigError naming the place, both
    registries and the closest names of both, raised before mmengine builds anything
    (one error listing them all). Scoped and dotted names are left to the registry they name."""
    scope = cfg.get('default_scope') or 'mmengine'
    missing = []
    for where, name, kind in _typed_places(cfg):
        mine, theirs = _PAIRS[kind]
        if '.' in name or _find(theirs, name, scope) is not None:
            continue
        found = mine.get(name)
        if found is None:
            missing.append(f'{where}: {mine.unknown_name_error(name)}')
        else:
            _scope_node(theirs, None).register_module(name=name, module=found, force=True)
    if missing:
        raise ConfigError(
            "neither stratagem's registries nor mmengine's "
            f'(default_scope {scope!r}) hold: ' + '\n'.join(missing)
        )


def _typed_places(cfg: Mapping):
    """``(where, type name, registry kind)`` for each place :func:`share_registered_types`
    checks."""
    model = cfg.get('model')
    if isinstance(model, Mapping):
        yield from _typed('model', model, 'model')
        yield from _typed('model.data_preprocessor', model.get('data_preprocessor'), 'model')
    yield from _typed('data_preprocessor', cfg.get('data_preprocessor'), 'model')
    for split in ('train', 'val', 'test'):
        loader = cfg.get(f'{split}_dataloader')
        if isinstance(loader, Mapping):
            yield from _datasets(f'{split}_dataloader.dataset', loader.get('dataset'))
    yield from _optim_wrappers('optim_wrapper', cfg.get('optim_wrapper'))
    schedulers = cfg.get('param_scheduler')
    if isinstance(schedulers, Mapping) and 'type' not in schedulers:  # one list per optimizer
        schedulers = [(f'param_scheduler.{k}', v) for k, v in schedulers.items()]
    else:
        schedulers = [('param_scheduler', schedulers)]
    for where, entries in schedulers:
        entries = entries if isinstance(entries, (list, tuple)) else [entries]
        for i, entry in enumerate(entries):
            yield from _typed(f'{where}[{i}]', entry, 'parameter scheduler')


def _typed(where: str, section: Any, kind: str):
    if isinstance(section, Mapping) and isinstance(section.get('type'), str):
        yield f'{where}.type', section['type'], kind


def _datasets(where: str, dataset: Any):
    """A dataset cfg and those a wrapper holds (mmengine's ``ConcatDataset(datasets=[...])``,
    ``RepeatDataset(dataset=...)``)."""
    if not isinstance(dataset, Mapping):
        return
    yield from _typed(where, dataset, 'dataset')
    yield from _datasets(f'{where}.dataset', dataset.get('dataset'))
    inner = dataset.get('datasets')
    for i, each in enumerate(inner if isinstance(inner, (list, tuple)) else []):
        yield from _datasets(f'{where}.datasets[{i}]', each)


def _optim_wrappers(where: str, wrapper: Any):
    if not isinstance(wrapper, Mapping):
        return
    if not any(k in wrapper for k in ('type', 'optimizer', 'constructor')):
        for name, each in wrapper.items():  # several optimizers: one wrapper per submodule
            yield from _optim_wrappers(f'{where}.{name}', each)
        return
    yield from _typed(where, wrapper, 'optim_wrapper')
    yield from _typed(f'{where}.optimizer', wrapper.get('optimizer'), 'optimizer')
    constructor = wrapper.get('constructor')
    if isinstance(constructor, str):
        yield f'{where}.constructor', constructor, 'optim_wrapper_constructor'
