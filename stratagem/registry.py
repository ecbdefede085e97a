"""Registries: build objects from config dicts by name.

An mmengine-style :class:`Registry` maps names to classes (or functions).
``build(cfg)`` pops ``type`` from a copy of ``cfg`` and calls the registered
object with the remaining keys. Names can also be registered *lazily* as
``"module.path:Attr"`` strings, so heavy backends (DeepSpeed, fairscale) are
imported only when someone builds them. A name no registry holds that is an import path
(``type='mypkg.models.TinyNet'``, ``type='torch.optim.SGD'``) builds the object it names, in
every registry, without a registration (:func:`import_dotted`).

This module is a leaf: it imports nothing else from ``stratagem``. The root
registries' contents live in the modules named by their ``locations``, which
are imported the first time a registry is searched or listed.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    'Registry',
    'RegistryError',
    'build_from_cfg',
    'import_dotted',
    'MODELS',
    'STRATEGIES',
    'OPTIMIZERS',
    'OPTIM_WRAPPERS',
    'OPTIM_WRAPPER_CONSTRUCTORS',
    'PARAM_SCHEDULERS',
    'DATASETS',
]


SCOPE = 'stratagem.'  # names may carry it, as mmengine's scoped names do ('stratagem.DDPStrategy')


class RegistryError(KeyError):
    """An unknown name or a cfg that cannot be built; a KeyError with a readable message."""

    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all
        return str(self.args[0]) if self.args else ''


def _signature_problems(obj: Callable, kwargs: Mapping[str, Any]) -> str:
    """Say which cfg keys ``obj`` does not accept or which required ones are missing."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ''
    params = sig.parameters
    takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    accepted = [
        n
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != 'self'
    ]
    parts = []
    if not takes_var_kw:
        unexpected = [k for k in kwargs if k not in accepted]
        if unexpected:
            hints = []
            for k in unexpected:
                close = difflib.get_close_matches(k, accepted, n=1)
                hints.append(f"'{k}'" + (f" (did you mean '{close[0]}'?)" if close else ''))
            parts.append('unexpected key(s) ' + ', '.join(hints))
    missing = [
        n
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and n != 'self'
        and p.default is p.empty
        and n not in kwargs
    ]
    if missing:
        parts.append('missing required key(s) ' + ', '.join(f"'{m}'" for m in missing))
    if parts:
        parts.append('accepted: ' + (', '.join(accepted) if accepted else '(none)'))
    return '; '.join(parts)


def build_from_cfg(
    cfg: Mapping[str, Any], registry: Registry, default_args: Mapping[str, Any] | None = None
) -> Any:
    """Build an object from ``cfg`` (a mapping with ``type``) looked up in ``registry``.

    ``type`` may be a registered name or a class/callable. ``default_args`` fill
    keys that ``cfg`` lacks. ``cfg`` is never mutated.
    """
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f'cfg to build from the {registry.name!r} registry must be a dict, '
            f'got {type(cfg).__name__}: {cfg!r}'
        )
    if 'type' not in cfg and (default_args is None or 'type' not in default_args):
        raise RegistryError(
            f"cfg for the {registry.name!r} registry has no 'type' key: {dict(cfg)!r}; "
            f"add type='<name>' with one of: {', '.join(registry.names()) or '(none registered)'}"
        )
    args = dict(default_args or {})
    args.update({k: v for k, v in cfg.items()})
    obj_type = args.pop('type')
    if isinstance(obj_type, str):
        obj_cls = registry.get(obj_type)
        if obj_cls is None:
            raise registry.unknown_name_error(obj_type)
    elif callable(obj_type):
        obj_cls = obj_type
    else:
        raise TypeError(
            f"'type' in cfg for the {registry.name!r} registry must be a str or a "
            f'class, got {type(obj_type).__name__}: {obj_type!r}'
        )
    try:
        return obj_cls(**args)
    except TypeError as e:
        problems = _signature_problems(obj_cls, args)
        name = getattr(obj_cls, '__name__', repr(obj_cls))
        if problems:
            raise TypeError(
                f'cannot build {name!r} from the {registry.name!r} registry with cfg '
                f'keys {sorted(args)}: {problems}'
            ) from e
        raise TypeError(f'{name}({", ".join(sorted(args))}) raised: {e}') from e


class Registry:
    """A name → class map with config building, parent lookup and lazy entries.

    Args:
        name: Registry name, used in messages.
        build_func: ``f(cfg, registry, default_args)`` used by :meth:`build`;
            defaults to the parent's, else :func:`build_from_cfg`.
        parent: Registry searched when a name is not found here.
        locations: Modules imported (once) before the first search, so that
            their ``register_module`` calls have run.
    """

    def __init__(
        self,
        name: str,
        build_func: Callable | None = None,
        parent: Registry | None = None,
        locations: Iterable[str] = (),
    ) -> None:
        self._name = name
        self._module_dict: dict[str, Any] = {}
        self._lazy: dict[str, str] = {}
        self._locations = list(locations)
        self._imported = False
        self.parent = parent
        self.children: dict[str, Registry] = {}
        self._fallbacks: list[tuple[str, Callable[[str], Any], Any]] = []
        if parent is not None:
            parent.children[name] = self
        self.build_func: Callable = build_func or (parent.build_func if parent else build_from_cfg)

    @property
    def name(self) -> str:
        return self._name

    @property
    def module_dict(self) -> dict[str, Any]:
        self._import_locations()
        return self._module_dict

    def _import_locations(self) -> None:
        if self._imported:
            return
        self._imported = True
        for loc in self._locations:
            importlib.import_module(loc)

    def names(self) -> list[str]:
        """All names reachable here (own, lazy, then parent's), sorted."""
        self._import_locations()
        own = set(self._module_dict) | set(self._lazy)
        if self.parent is not None:
            own |= set(self.parent.names())
        return sorted(own)

    def register_module(
        self, name: str | list[str] | None = None, force: bool = False, module: Any = None
    ) -> Any:
        """Register ``module`` under ``name`` (default: its ``__name__``).

        Used as a call (``register_module(module=Cls)``) or as a decorator
        (``@register_module()``). Re-registering an existing name raises unless
        ``force=True``.
        """
        if not isinstance(force, bool):
            raise TypeError(f'force must be a bool, got {type(force).__name__}')
        if not (
            name is None
            or isinstance(name, str)
            or (isinstance(name, list) and all(isinstance(n, str) for n in name))
        ):
            raise TypeError(f'name must be None, a str or a list of str, got {name!r}')
        if module is not None:
            self._register(module, name, force)
            return module

        def _decorator(obj: Any) -> Any:
            self._register(obj, name, force)
            return obj

        return _decorator

    def _register(self, module: Any, name: str | list[str] | None, force: bool) -> None:
        if not callable(module):
            raise TypeError(
                f'only a class or function can be registered in {self._name!r}, '
                f'got {type(module).__name__}'
            )
        names = [module.__name__] if name is None else ([name] if isinstance(name, str) else name)
        for n in names:
            if not force and (n in self._module_dict or n in self._lazy):
                existing = self._module_dict.get(n, self._lazy.get(n))
                if existing is module:
                    continue
                raise KeyError(
                    f'{n!r} is already registered in the {self._name!r} registry '
                    f'(as {existing!r}); pass force=True to replace it'
                )
            self._lazy.pop(n, None)
            self._module_dict[n] = module

    def register_lazy(self, name: str, target: str, force: bool = False) -> None:
        """Register ``name`` as ``"module.path:Attr"``, imported on first :meth:`get`."""
        if ':' not in target:
            raise ValueError(
                f"lazy target for {name!r} must look like 'module.path:Attr', got {target!r}"
            )
        if not force and (name in self._module_dict or name in self._lazy):
            raise KeyError(f'{name!r} is already registered in the {self._name!r} registry')
        self._lazy[name] = target

    def get(self, name: str) -> Any:
        """The object registered as ``name`` here or in a parent, or ``None``.

        A lazy entry is imported now; if its module cannot be imported the
        ImportError propagates (it usually says which extra to install).
        """
        self._import_locations()
        if name.startswith(SCOPE) and name not in self._module_dict and name not in self._lazy:
            name = name[len(SCOPE) :]  # 'stratagem.X', as mmengine's registries know it
        if name in self._module_dict:
            return self._module_dict[name]
        if name in self._lazy:
            mod_name, attr = self._lazy[name].split(':', 1)
            obj = getattr(importlib.import_module(mod_name), attr)
            # the import may have registered it already (decorator in the module)
            self._module_dict.setdefault(name, obj)
            self._lazy.pop(name, None)
            return obj
        if self.parent is not None:
            found = self.parent.get(name)
            if found is not None:
                return found
        for _, lookup, _ in self._fallbacks:
            found = lookup(name)
            if found is not None:
                return found
        return import_dotted(name) if '.' in name else None

    def add_fallback(
        self,
        lookup: Callable[[str], Any],
        label: str,
        names: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        """Search ``lookup(name)`` (an object, or None) for a name this registry and its
        parents do not hold, before a dotted name is imported; ``label`` names the place in
        the unknown-name error, and ``names()`` (optional) what it holds, for the error's
        close matches. A host framework's registry, added by its integration
        (``stratagem.integrations.mmengine``); adding the same ``label`` again replaces it."""
        self._fallbacks = [f for f in self._fallbacks if f[0] != label]
        self._fallbacks.append((label, lookup, names))

    def unknown_name_error(self, name: str) -> RegistryError:
        """A RegistryError naming the registry, ``name``, close matches (here and in the
        fallbacks) and the valid names; for a dotted name, why it did not import."""
        names = self.names()
        candidates = set(names)
        for _, _, more in self._fallbacks:
            candidates.update(more() if more is not None else ())
        close = difflib.get_close_matches(name, sorted(candidates), n=3, cutoff=0.6)
        lowered = [n for n in sorted(candidates) if n.lower() == name.lower() and n not in close]
        close = lowered + close
        parts = [f'unknown type {name!r} in the {self._name!r} registry']
        if '.' in name:
            parts.append(dotted_import_problem(name))
        if close:
            parts.append(f'did you mean {" or ".join(repr(c) for c in close)}?')
        parts.append(f'registered names: {", ".join(names) or "(none)"}')
        if self._fallbacks:
            parts.append('also searched: ' + ', '.join(f[0] for f in self._fallbacks))
        parts.append("or give a class by its import path: type='package.module.Class'")
        return RegistryError('; '.join(parts))

    def build(
        self, cfg: Mapping[str, Any], default_args: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """Build an object from ``cfg`` with this registry's ``build_func``."""
        return self.build_func(cfg, registry=self, default_args=default_args, **kwargs)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        names = self.names()
        return f'Registry(name={self._name!r}, items={len(names)}: {", ".join(names)})'

    def __deepcopy__(self, memo: dict) -> Registry:  # registries are singletons
        return self


def import_dotted(name: str) -> Any:
    """The object at import path ``name`` (``'pkg.module.Class'``, ``'pkg.module.Class.Inner'``),
    or None when no prefix of it is an importable module holding the rest.

    The longest importable module prefix wins. A module that exists but whose own code raises
    on import is an ImportError naming it and the cause; a module found without the attribute
    named after it, an ImportError naming both.
    """
    parts = name.split('.')
    for cut in range(len(parts) - 1, 0, -1):
        module_name = '.'.join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = err.name or ''
            if module_name == missing or module_name.startswith(f'{missing}.'):
                continue  # no such module: try a shorter prefix
            raise ImportError(  # the module exists; its own import of another one failed
                f'type {name!r}: importing module {module_name!r} failed: {err}'
            ) from err
        except Exception as err:
            raise ImportError(
                f'type {name!r}: importing module {module_name!r} failed in its own code: '
                f'{type(err).__name__}: {err}'
            ) from err
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                raise ImportError(
                    f'cannot import {name!r}: module {module_name!r} imports, but '
                    f'{".".join(parts[:i])!r} has no attribute {attr!r}'
                )
            obj = getattr(obj, attr)
        return obj
    return None


def dotted_import_problem(name: str) -> str:
    """Why the import path ``name`` gave nothing, for :meth:`Registry.unknown_name_error`."""
    top = name.split('.')[0]
    try:
        importlib.import_module(top)
    except ModuleNotFoundError:
        return (
            f"no module {top!r} on the import path: sys.path, the config's directory and the "
            'working directory are searched'
        )
    return f'no importable module among the prefixes of {name!r}'


MODELS = Registry('model', locations=['stratagem.models'])
DATASETS = Registry('dataset', locations=['stratagem.data'])
STRATEGIES = Registry('strategy', locations=['stratagem.strategies'])
OPTIMIZERS = Registry('optimizer', locations=['stratagem.optim.optimizers'])
OPTIM_WRAPPERS = Registry('optim_wrapper', locations=['stratagem.optim'])
OPTIM_WRAPPER_CONSTRUCTORS = Registry('optim_wrapper_constructor', locations=['stratagem.optim'])
PARAM_SCHEDULERS = Registry('parameter scheduler', locations=['stratagem.scheduler'])
