"""Which modules FSDPStrategy shards, ignores or checkpoints: the module choices of its config.

Every choice has ``select(model, ignored)``: the chosen submodules (never the root, none inside
an ``ignored`` module) in pre-order. Four kinds:

- :class:`ModuleMatcher`: module classes (names or types), a predicate ``module -> bool``, or
  (``ignored_modules``, as mmengine) submodule names and module objects;
- :class:`Fsdp1Policy`: an FSDP1 auto-wrap policy function ``(module, recurse,
  nonwrapped_numel) -> bool`` (``size_based_auto_wrap_policy``, a ``partial`` of
  ``transformer_auto_wrap_policy``, one of your own), decided as FSDP1's recursive wrap does;
- :class:`PolicyObject`: an FSDP1 policy object (``ModuleWrapPolicy``, ``CustomPolicy``);
- :class:`NoSplitModules` (``auto_wrap_policy='auto'``): the module classes the model
  declares in ``_no_split_modules`` (a ``transformers`` model: its decoder layer), as
  Accelerate's transformer-based FSDP wrap takes them by default.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from stratagem._torch import fsdp1_policy_type, run_fsdp1_policy

_NUMEL_ARGS = ('nonwrapped_numel', 'unwrapped_params')  # torch's name, then torch < 1.13's
_HOW = (
    "give a list of module class names, dict(type='size_based_auto_wrap_policy', "
    "min_num_params=N), a policy function's dotted import path or the callable itself"
)


def resolve_name(name: str) -> tuple[Any, str]:
    """The function or class ``name`` names, as mmengine's ``FUNCTIONS.get`` finds it: a name
    registered there (looked up only when mmengine is already imported: stratagem never
    imports it) or a dotted import path. Returns ``(object, '')`` or ``(None, why not)``."""
    registry = sys.modules.get('mmengine.registry')
    if registry is not None:
        try:
            with registry.FUNCTIONS.switch_scope_and_registry(None) as functions:
                found = functions.get(name)
        except Exception:  # noqa: BLE001 - a failed lookup is "not registered"
            found = None
        if found is not None:
            return found, ''
    where = (
        "registered in mmengine's FUNCTIONS"
        if registry is not None
        else 'registered (mmengine is not imported)'
    )
    if '.' not in name:
        return None, f'not a dotted import path, nor {where}'
    module_name, attrs = name, list[str]()
    while '.' in module_name:
        module_name, attr = module_name.rsplit('.', 1)
        attrs.insert(0, attr)
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:  # a shorter prefix may be the module
            if err.name and (module_name == err.name or module_name.startswith(err.name + '.')):
                continue
            return None, f'importing {module_name!r} failed: {err}'
        except Exception as err:  # noqa: BLE001 - reported to the user with the key
            return None, f'importing {module_name!r} failed: {type(err).__name__}: {err}'
        for attr in attrs:
            if not hasattr(obj, attr):
                return None, f'{module_name!r} has no attribute {".".join(attrs)!r}'
            obj = getattr(obj, attr)
        return obj, ''
    return None, f'no module of {name!r} can be imported, nor is it {where}'


def _numel_arg(fn: Callable, key: str, label: str) -> str | None:
    """The numel keyword of an FSDP1 policy (it takes ``recurse``), or None for a predicate
    ``module -> bool``; other signatures are refused here, not deep inside ``prepare``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): a predicate
        return None
    params = sig.parameters
    if 'recurse' not in params:
        required = [
            n
            for n, p in params.items()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(required) > 1:
            raise TypeError(
                f'{key}: {label} takes {required}; a policy is a predicate '
                f'module -> bool or an FSDP1 policy (module, recurse, '
                f'nonwrapped_numel)'
            )
        return None
    numel = next((n for n in _NUMEL_ARGS if n in params), None)
    if numel is None and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        numel = _NUMEL_ARGS[0]
    try:
        if numel is None:
            raise TypeError('it has no nonwrapped_numel argument')
        sig.bind(module=None, recurse=True, **{numel: 0})
    except TypeError as err:
        raise TypeError(
            f'{key}: {label} looks like an FSDP1 policy (module, recurse, '
            f'nonwrapped_numel) but cannot be called as one: {err}; give its other '
            f'arguments: dict(type=..., ARG=...) or functools.partial'
        ) from None
    return numel


def as_selector(obj: Any, key: str, label: str | None = None) -> Any:
    """A resolved policy object → a module choice; anything else is refused naming ``key``."""
    label = label or repr(obj)
    if isinstance(obj, fsdp1_policy_type()):
        return PolicyObject(obj, key)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return ModuleMatcher(obj, key)
    if isinstance(obj, type) or not callable(obj):
        if not isinstance(obj, (list, tuple, set, frozenset)):
            raise TypeError(f'{key}: {label} is {type(obj).__name__} {obj!r}, not a policy; {_HOW}')
        return ModuleMatcher(obj, key)
    numel = _numel_arg(obj, key, label)
    return ModuleMatcher(obj, key) if numel is None else Fsdp1Policy(obj, key, numel)


class ModuleMatcher:
    """Module classes (names or types) and/or a predicate; names are checked against a model.
    With ``paths`` (mmengine's ``ignored_modules``) a string is first a submodule name
    (``model.get_submodule``), and module objects are accepted."""

    def __init__(self, spec: Any, key: str, *, paths: bool = False, hint: str = '') -> None:
        self.key, self.paths, self.hint = key, paths, hint
        self.names: list[str] = []
        self.types: tuple[type, ...] = ()
        self.objects: list[nn.Module] = []
        self.fn: Callable | None = None
        if callable(spec) and not isinstance(spec, (type, nn.Module)):
            self.fn = spec
            return
        items = [spec] if isinstance(spec, (str, type, nn.Module)) else list(spec)
        for item in items:
            if isinstance(item, str):
                self.names.append(item)
            elif isinstance(item, type) and issubclass(item, nn.Module):
                self.types += (item,)
            elif paths and isinstance(item, nn.Module):
                self.objects.append(item)
            else:
                what = (
                    'a submodule name, module, module class or class name'
                    if paths
                    else 'a module class or class name'
                )
                raise TypeError(f'{key}: {item!r} is not {what}')

    def bind(self, model: nn.Module) -> Callable[[nn.Module], bool]:
        if self.fn is not None:
            return self.fn
        present = {type(m).__name__ for m in model.modules()}
        chosen = {id(m) for m in self.objects}
        if len(chosen & {id(m) for m in model.modules()}) != len(chosen):
            raise ValueError(f'{self.key}: a module object given is not part of the model')
        classes: set[str] = set()
        unknown: list[str] = []
        for name in self.names:
            if self.paths and name:
                try:
                    chosen.add(id(model.get_submodule(name)))
                    continue
                except AttributeError:
                    pass
            (classes.add if name in present else unknown.append)(name)
        if unknown:
            raise ValueError(self._unknown(model, unknown, present))
        types = self.types
        return lambda m: id(m) in chosen or type(m).__name__ in classes or isinstance(m, types)

    def _unknown(self, model: nn.Module, unknown: list[str], present: set[str]) -> str:
        classes = sorted(present)
        if not self.paths:
            hint = f' ({unknown[0]!r}: {self.hint})' if self.hint else ''
            return (
                f'{self.key}: module class(es) {unknown} are not in the model{hint}; its '
                f'module classes are {classes}; to pass a policy function, {_HOW}'
            )
        names = [n for n, _ in model.named_modules() if n]
        close = difflib.get_close_matches(unknown[0], names + classes, n=1)
        shown = names[:30] + ([f'... ({len(names) - 30} more)'] if len(names) > 30 else [])
        return (
            f'{self.key}: {unknown} name neither a submodule nor a module class of the '
            f'model'
            + (f' (did you mean {close[0]!r}?)' if close else '')
            + f'; submodule names: {shown}; module classes: {classes}'
        )

    def select(self, model: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
        match = self.bind(model)
        return [m for m in model.modules() if m is not model and m not in ignored and match(m)]


class Fsdp1Policy:
    """An FSDP1 auto-wrap policy function, asked as FSDP1's recursive wrap asks it: from the
    root down, ``recurse=True`` with the subtree's parameter count decides whether to look
    inside; after the children, ``recurse=False`` with the count not yet claimed by a chosen
    descendant decides whether the module itself is wrapped. The root is never chosen (FSDP1
    wraps only its children; the root is always sharded last); ignored modules and their
    parameters are skipped and not counted, as FSDP1 does."""

    def __init__(self, fn: Callable, key: str, numel_arg: str = _NUMEL_ARGS[0]) -> None:
        self.fn, self.key, self.numel_arg = fn, key, numel_arg

    def _ask(self, module: nn.Module, recurse: bool, numel: int) -> bool:
        return bool(self.fn(module=module, recurse=recurse, **{self.numel_arg: numel}))

    def select(self, model: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
        skipped = {id(p) for m in ignored for p in m.parameters(recurse=False)}
        picked: set[int] = set()

        def visit(module: nn.Module) -> int:  # the parameter count this subtree had wrapped
            total = sum(p.numel() for p in module.parameters() if id(p) not in skipped)
            if not self._ask(module, True, total):
                return 0
            wrapped = sum(visit(c) for c in module.children() if c not in ignored)
            if module is not model and self._ask(module, False, total - wrapped):
                picked.add(id(module))
                return total
            return wrapped

        visit(model)
        return [m for m in model.modules() if id(m) in picked]


class PolicyObject:
    """An FSDP1 policy object (``ModuleWrapPolicy``, ``CustomPolicy``): the modules it
    picks as FSDP1 asks it (``_torch.run_fsdp1_policy``). A per-module kwargs override that
    ``CustomPolicy`` may return has no meaning here and is refused."""

    def __init__(self, policy: Any, key: str) -> None:
        self.policy, self.key = policy, key

    def select(self, model: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
        chosen = run_fsdp1_policy(self.policy, model, ignored)
        extra = {type(m).__name__: kw for m, kw in chosen.items() if kw}
        if extra:
            raise ValueError(
                f'{self.key}: the policy gives per-module FSDP arguments {extra}; '
                f"FSDPStrategy shards every block with model_wrapper's settings, "
                f'so return True/False'
            )
        return [m for m in model.modules() if m is not model and m in chosen and m not in ignored]


AUTO = 'auto'


def declared_no_split_modules(model: nn.Module) -> list[str]:
    """The class names in the ``_no_split_modules`` of ``model`` and of every submodule
    (transformers gathers a composite model's from its parts in ``post_init``; a submodule's
    own list counts here too, for a model built without it), sorted. Duck-typed: transformers
    is not imported."""
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, '_no_split_modules', None)
        if isinstance(declared, str):
            declared = [declared]
        names.update(n for n in declared or () if isinstance(n, str))
    return sorted(names)


class NoSplitModules:
    """``auto_wrap_policy='auto'``: the modules whose class the model declares in
    ``_no_split_modules`` (the blocks a ``transformers`` model keeps on one device: its decoder
    layers). Classes it declares that the model does not hold are skipped (a composite model
    may list its parts' alternatives); declaring none, or none present, is an error."""

    def __init__(self, key: str) -> None:
        self.key = key

    def select(self, model: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
        declared = declared_no_split_modules(model)
        present = {type(m).__name__ for m in model.modules()}
        classes = [n for n in declared if n in present]
        if not classes:
            said = (
                f'its _no_split_modules {declared} name no module class of the model '
                f'(classes: {sorted(present)})'
                if declared
                else 'it declares no _no_split_modules (a transformers PreTrainedModel does)'
            )
            raise ValueError(
                f"{self.key}='auto' shards the module classes the model declares in "
                f'_no_split_modules, but {type(model).__name__}: {said}; give the block '
                "classes instead, e.g. ['DecoderLayer']"
            )
        return ModuleMatcher(classes, self.key).select(model, ignored)
