"""Check 1 of ``stratagem doctor``: unknown or misspelt config keys.

Every place the config is read is checked by its own key set or by the signatures along the
named class's ``__init__`` chain (or the registered function's signature), importing the
module, building nothing; a ``type`` that no registry knows, or whose package is missing, is
reported too. The top-level keys are judged by the function ``stratagem train`` judges them
with (``schema.read_top_level_keys``, as ``loop.plan`` and the FlexibleRunner path call it).
What the doctor builds (the model on the meta device, the datasets) is judged by building
it: a signature finding there is held (:attr:`KeyChecks.pending`) and reported only when the
build fails (:meth:`KeyChecks.settle`): a class whose ``**kwargs`` reach a parent, or a
function, accepts what its build accepts.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from stratagem.schema import (
    ENV_KEYS,
    LOOP_TOP_KEYS,
    RANDOMNESS_KEYS,
    RUNNER_TOP_KEYS,
    TRAIN_CFG_KEYS,
    TRAIN_DATALOADER_KEYS,
    VAL_CFG_KEYS,
    VAL_DATALOADER_KEYS,
    read_top_level_keys,
    runner_reasons,
)

__all__ = ['KeyChecks']


class KeyChecks:
    """The key checks of ``checks.Doctor`` (which provides ``cfg`` and ``add``)."""

    cfg: Mapping
    add: Callable[[str, str, str], None]  # (where, problem, fix): records a finding
    notes: list[str]
    findings: list
    # where -> the signature findings of a section the doctor builds, until the build says
    pending: dict[str, list[tuple[str, str, str]]]

    def check_keys(self) -> None:
        cfg = self.cfg
        under_runner = self._under_runner()
        self._top_level_keys(under_runner)
        if not under_runner:  # mmengine's loops read these sections there
            self._keys(cfg.get('train_cfg') or {}, TRAIN_CFG_KEYS, 'train_cfg')
            loader = cfg.get('train_dataloader') or {}
            self._keys(loader, TRAIN_DATALOADER_KEYS, 'train_dataloader')
            if isinstance(loader.get('dataset'), Mapping):
                self._typed(loader['dataset'], 'DATASETS', 'train_dataloader.dataset', built=True)
            val_loader = cfg.get('val_dataloader') or {}
            self._keys(val_loader, VAL_DATALOADER_KEYS, 'val_dataloader')
            if isinstance(val_loader.get('dataset'), Mapping):
                self._typed(val_loader['dataset'], 'DATASETS', 'val_dataloader.dataset', built=True)
            self._keys(cfg.get('val_cfg') or {}, VAL_CFG_KEYS, 'val_cfg')
        strategy = dict(cfg.get('strategy') or {})
        if strategy.get('type', 'auto') != 'auto':
            self._typed(strategy, 'STRATEGIES', 'strategy')
        env_kwargs = strategy.get('env_kwargs') or {}
        self._keys(env_kwargs, ENV_KEYS, 'strategy.env_kwargs')
        self._keys(
            env_kwargs.get('randomness') or {}, RANDOMNESS_KEYS, 'strategy.env_kwargs.randomness'
        )
        self._keys(cfg.get('randomness') or {}, RANDOMNESS_KEYS, 'randomness')
        if isinstance(cfg.get('model'), Mapping):
            self._typed(cfg['model'], 'MODELS', 'model', built=True)
        self._check_optim_wrapper(cfg.get('optim_wrapper'))
        for i, sched in enumerate(self._schedulers()):
            self._typed(
                sched,
                'PARAM_SCHEDULERS',
                f'param_scheduler[{i}]',
                drop=('optimizer', 'convert_to_iter_based'),
            )
        top, own = cfg.get('auto_scale_lr'), strategy.get('auto_scale_lr')
        if top is not None and own is not None and dict(top) != dict(own):
            self.add(
                'auto_scale_lr',
                f"given twice, differently: top level {dict(top)} (mmengine's place) and "
                f"strategy.auto_scale_lr {dict(own)}; the strategy's wins",
                'keep one of them',
            )

    def _top_level_keys(self, under_runner: bool) -> None:
        """The top-level keys nothing reads, judged by ``stratagem train``'s own decision
        (``schema.read_top_level_keys``, which the reference loop and the FlexibleRunner route
        both ask): a known key's typo or an older config's key is a finding; the config file's
        helper variables and the objects its code imports are no keys."""
        known = LOOP_TOP_KEYS | RUNNER_TOP_KEYS if under_runner else LOOP_TOP_KEYS
        for key, hint in read_top_level_keys(self.cfg, known).unknown.items():
            self.add(
                key,
                f'unknown top-level key {key!r} (nothing reads it)',
                f'{hint} rename it' if hint.startswith('did you mean') else hint,
            )

    def settle(self, where: str, problem: str | None, fix: str = '') -> None:
        """The build of the section at ``where`` is done: without a ``problem`` its held
        signature findings are dropped (the build accepted every key); with one they are
        reported, or, when none is held, the problem itself (``fix``: what to do) unless a
        finding already names the section (its unknown ``type``)."""
        held = self.pending.pop(where, [])
        if problem is None:
            return
        for finding in held:
            self.add(*finding)
        if not held and not any(f.where.startswith(where) for f in self.findings):
            self.add(where, problem, fix)

    def _under_runner(self) -> bool:
        """Whether ``stratagem train`` runs this config under mmengine's FlexibleRunner
        (``schema.runner_reasons``); then, as there, stratagem's registries fall back to
        mmengine's. Without mmengine, the finding ``train`` stops with."""
        import importlib.util

        try:
            reasons = runner_reasons(self.cfg)
        except ValueError as err:
            self.add('runner_type', str(err), "set runner_type='FlexibleRunner' or remove it")
            return False
        if not reasons:
            return False
        if importlib.util.find_spec('mmengine') is None:
            self.add(
                reasons[0],
                f"{', '.join(reasons)} are read only by mmengine's runner, which is not installed",
                'pip install "stratagem[mmengine]", or remove those keys',
            )
            return True
        import stratagem.integrations.mmengine  # noqa: F401  (the registry fallback)

        return True

    def _check_optim_wrapper(self, ow: Any) -> None:
        if not isinstance(ow, Mapping):
            return
        from stratagem.optim.default_constructor import DefaultOptimWrapperConstructor

        if not any(k in ow for k in ('type', 'optimizer', 'constructor')):
            for name, sub in ow.items():  # several optimizers: one wrapper cfg per submodule
                self._check_optim_wrapper(
                    {**sub, '_where': f'optim_wrapper.{name}'} if isinstance(sub, Mapping) else None
                )
            return
        where = ow.get('_where', 'optim_wrapper')
        wrapper = {
            k: v for k, v in ow.items() if k not in ('constructor', 'paramwise_cfg', '_where')
        }
        wrapper.setdefault('type', 'OptimWrapper')
        self._typed(wrapper, 'OPTIM_WRAPPERS', where, drop=('optimizer',))
        if isinstance(ow.get('optimizer'), Mapping):
            self._typed(ow['optimizer'], 'OPTIMIZERS', f'{where}.optimizer', drop=('params',))
        self._keys(
            ow.get('paramwise_cfg') or {},
            DefaultOptimWrapperConstructor.PARAMWISE_KEYS,
            f'{where}.paramwise_cfg',
        )

    def _keys(self, given: Mapping, allowed: Any, where: str) -> None:
        for key in given:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                self.add(
                    f'{where}.{key}',
                    f'unknown key {key!r}',
                    (f'did you mean {close[0]!r}? ' if close else '')
                    + f'valid keys: {", ".join(sorted(allowed))}',
                )

    def _typed(
        self, cfg: Mapping, registry_name: str, where: str, drop: tuple = (), built: bool = False
    ) -> Any:
        """Look ``cfg['type']`` up (importing its module, building nothing); check its keys
        against the signatures along the class's ``__init__`` chain, or the function's.
        ``built``: the doctor builds this section later, and a signature finding waits for
        it (:meth:`settle`). Returns the class or function."""
        import stratagem.registry as registries

        registry = getattr(registries, registry_name)
        name = cfg.get('type')
        if not isinstance(name, str):
            return name if isinstance(name, type) else None
        try:
            cls = registry.get(name)
        except ImportError as err:
            self.add(
                f'{where}.type',
                f'{name!r} needs a package that is not installed: {err}',
                'install the package the message names (its module imports it)',
            )
            return None
        if cls is None:
            self.add(
                f'{where}.type',
                str(registry.unknown_name_error(name)),
                'use one of the registered names above',
            )
            return None
        accepted = _accepted_chain(cls)
        if accepted is None:  # takes arbitrary keywords: nothing to check
            return cls
        held = self.pending.setdefault(where, []) if built else None
        for key in cfg:
            if key != 'type' and key not in drop and key not in accepted:
                close = difflib.get_close_matches(str(key), sorted(accepted), n=1)
                finding = (
                    f'{where}.{key}',
                    f'{name} has no argument {key!r}',
                    (f'did you mean {close[0]!r}? ' if close else '')
                    + f'accepted: {", ".join(sorted(accepted - {"self"}))}',
                )
                if held is None:
                    self.add(*finding)
                else:
                    held.append(finding)
        return cls

    def _schedulers(self) -> list[Mapping]:
        scheds = self.cfg.get('param_scheduler') or []
        if isinstance(scheds, Mapping):
            scheds = (
                [scheds]
                if 'type' in scheds
                else [s for v in scheds.values() for s in (v if isinstance(v, list) else [v])]
            )
        return [s for s in scheds if isinstance(s, Mapping)]


def _accepted_chain(cls: Any) -> set[str] | None:
    """Keyword names ``cls(...)`` accepts, following ``**kwargs`` up the ``__init__`` chain
    (``DDPStrategy(**kwargs)`` -> ``BaseStrategy``), or a registered function's; None if the
    chain accepts anything."""
    names: set[str] = set()
    if not isinstance(cls, type):  # a function (or another callable) a registry builds with
        try:
            params = inspect.signature(cls).parameters.values()
        except (TypeError, ValueError):
            return None
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for klass in cls.__mro__:
        init = klass.__dict__.get('__init__')
        if init is None:
            continue
        if klass is object:
            return names
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None
        names.update(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return None
