"""What a checkpoint may hold: tensors, plain Python values and instances of allow-listed classes.

``validate_checkpoint_content`` walks the object before anything is written, so a state that
``torch.load(weights_only=True)`` could not read back fails the save with the key path, and the
previous checkpoint is untouched. Tensors, plain scalars and plain containers are accepted as
they are met (the weights-only unpickler of torch >= 2.4 reads them without any allow-list;
checked against torch 2.13). Any other object is accepted only if the weights-only unpickler
itself reads it back: it is saved into memory and loaded with ``weights_only=True`` under the
allow-list in force, so validation accepts exactly what loading accepts, never more.

The allow-list is torch's (``torch.serialization.add_safe_globals``); :func:`add_safe_globals`
adds to it and remembers what it added, so a save records in the manifest which allow-listed
globals the file references (``safe_globals``), and a loader that lacks one can name it.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import pickletools
import re
import types
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_SCALARS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    torch.dtype,
    torch.device,
    torch.Size,
)
_SCALAR_TYPES = frozenset(_SCALARS)
_CONTAINERS = frozenset((dict, OrderedDict, list, tuple, set))
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))

_RULE = (
    'checkpoints hold only tensors, plain values and allow-listed classes so they load '
    'with weights_only=True'
)
# Modules whose functions can run commands, import or evaluate code, or unpickle: allowing
# one of them would make "weights_only" meaningless, so add_safe_globals refuses them.
_NEVER_SAFE_MODULES = (
    'builtins',
    'os',
    'posix',
    'nt',
    'subprocess',
    'sys',
    'importlib',
    'pickle',
    '_pickle',
    'marshal',
    'shutil',
    'runpy',
    'code',
    'codeop',
    'ctypes',
    'socket',
    'pty',
    'webbrowser',
    'io',
    '_io',
    'pathlib',
    # these run a string of code or a command given as an argument
    'timeit',
    'cProfile',
    'profile',
    'pdb',
    'bdb',
    'trace',
    'pydoc',
    'doctest',
    '_posixsubprocess',
    'multiprocessing',
    'zipimport',
)
# builtins classes that build code, functions, methods or modules, or reach any attribute
# (types.FunctionType / CodeType are 'builtins.function' / 'builtins.code'): allowed, a
# pickle could build a function from bytecode and plant it where trusted code calls it
_NEVER_SAFE_TYPES = frozenset(
    (
        type,
        object,
        super,
        property,
        classmethod,
        staticmethod,
        types.FunctionType,
        types.CodeType,
        types.MethodType,
        types.BuiltinFunctionType,
        types.ModuleType,
        types.MethodWrapperType,
        types.WrapperDescriptorType,
        types.MethodDescriptorType,
        types.ClassMethodDescriptorType,
        types.CellType,
        types.FrameType,
        types.TracebackType,
    )
)
_REFUSED_GLOBAL_RE = re.compile(
    r'GLOBAL (\S+) was not|unrecognized function (\S+)|'
    r'allowlisted via `add_safe_globals`,? but got (<[^>]+>)'
)

SAFE_GLOBALS_KEY = 'safe_globals'  # the manifest key listing them
# Full name ('module.qualname') -> object, for what this process allow-listed through us.
_ADDED: dict[str, Any] = {}


def add_safe_globals(safe_globals: Iterable[Callable | tuple[Callable, str]]) -> None:
    """Allow checkpoints to hold instances of these classes (and calls of these functions).

    Mirrors ``torch.serialization.add_safe_globals`` (same argument: classes or functions,
    or ``(obj, 'module.name')`` pairs for an object pickled under another name, e.g. a class
    that moved between versions) and registers them with torch too, so
    ``torch.load(weights_only=True)`` reads such files, and :func:`validate_checkpoint_content`
    accepts them on save. Loading such a file needs the same call in the loading process
    (the manifest records the names; the load error lists any missing).

    Only allow-list classes whose construction from pickled state runs no code you do not
    trust. Builtins and the standard library's process, import, file and pickle modules
    are refused (``getattr``, ``eval``, ``os.system``, ... would make weights_only
    meaningless). Arbitrary pickles stay refused either way.
    """
    if isinstance(safe_globals, (str, bytes)) or not isinstance(safe_globals, Iterable):
        raise TypeError(
            f'add_safe_globals expects a list of classes or functions, got '
            f'{safe_globals!r}; e.g. add_safe_globals([MyClass])'
        )
    entries = list(safe_globals)
    named = [(_global_name(item), item) for item in entries]  # all checked before any is added
    torch.serialization.add_safe_globals(entries)
    for name, item in named:
        _ADDED[name] = item


def get_safe_globals() -> list[str]:
    """The full names of every global allow-listed in this process (ours and torch's), sorted."""
    return sorted(_allowed_names())


@contextlib.contextmanager
def safe_globals(safe_globals: Iterable[Callable | tuple[Callable, str]]) -> Iterator[None]:
    """``add_safe_globals`` for the duration of a ``with`` block; what was allow-listed before
    stays allow-listed afterwards."""
    entries = list(safe_globals)
    before_torch = list(torch.serialization.get_safe_globals())
    before_ours = dict(_ADDED)
    add_safe_globals(entries)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before_torch)
        _ADDED.clear()
        _ADDED.update(before_ours)


def _global_name(item: Any) -> str:
    if isinstance(item, tuple):
        if len(item) != 2 or not isinstance(item[1], str) or not callable(item[0]):
            raise TypeError(
                f'add_safe_globals: {item!r} should be a class or function, or a '
                "(class_or_function, 'module.name') pair"
            )
        obj, name = item
    else:
        if not callable(item) or not hasattr(item, '__qualname__'):
            raise TypeError(
                f'add_safe_globals: {item!r} is a {type(item).__name__}, not a '
                'class or function; pass the class itself, e.g. [type(obj)]'
            )
        obj, name = item, f'{item.__module__}.{item.__qualname__}'
    module = getattr(obj, '__module__', None) or ''
    if module.split('.')[0] in _NEVER_SAFE_MODULES and not (
        isinstance(obj, type) and module == 'builtins' and obj not in _NEVER_SAFE_TYPES
    ):
        raise ValueError(
            f'add_safe_globals refuses {name}: a pickle allowed to call it could '
            'run arbitrary code, which weights_only exists to prevent'
        )
    return name


def _allowed_names() -> set[str]:
    names = set(_ADDED)
    for item in torch.serialization.get_safe_globals():
        if isinstance(item, tuple):
            names.add(item[1])
        else:
            names.add(f'{item.__module__}.{item.__qualname__}')
    return names


def validate_checkpoint_content(
    obj: Any, root: str = 'checkpoint', *, tensor_types: tuple[type, ...] = ()
) -> list[str]:
    """Raise ``TypeError`` naming the first key path whose value ``weights_only`` cannot load.

    ``tensor_types``: tensor subclasses also met (DTensors, which DCP saves shard by shard,
    never pickled whole).

    Accepted as met: ``torch.Tensor`` / ``nn.Parameter`` (any dtype, layout, device),
    ``None``, bool, int, float, complex, str, bytes, bytearray, ``torch.dtype``,
    ``torch.device``, ``torch.Size``; and dict / OrderedDict / list / tuple / set of those,
    nested. Dict keys and set items must be scalars or tuples of scalars. Anything else
    (an allow-listed class's instance, a numpy array once numpy is allow-listed, a
    ``Counter``) is accepted only if the weights-only unpickler reads it back under the
    current allow-list; namedtuples, ``ConfigDict``, ``defaultdict``, enums, functions and
    tensor subclasses are refused unless their globals were allow-listed.

    Returns:
        The sorted full names of the allow-listed globals the content references (empty
        for tensors and plain values only); a save records them in its manifest.
    """
    foreign: list[tuple[str, Any]] = []
    _walk(obj, root, set(), foreign, _TENSOR_TYPES.union(tensor_types))
    if not foreign:
        return []
    try:  # one round trip for all of them; only a refusal pays for finding the culprit
        referenced = _round_trip([value for _, value in foreign])
    except _Refused as together:
        for path, value in foreign:
            try:
                _round_trip(value)
            except _Refused as refusal:
                raise TypeError(_message(path, value, refusal)) from None
        # each loads alone but not together (objects sharing state): report them all
        raise TypeError(
            f'{", ".join(p for p, _ in foreign)} together: {_RULE} ({together.reason})'
        ) from None
    allowed = _allowed_names()
    return sorted(name for name in referenced if name in allowed)


def _walk(
    obj: Any, path: str, on_path: set[int], foreign: list[tuple[str, Any]], tensors: frozenset
) -> None:
    kind = type(obj)
    if kind in tensors or kind in _SCALAR_TYPES:
        return
    if kind not in _CONTAINERS:
        foreign.append((path, obj))
        return
    if id(obj) in on_path:
        raise TypeError(f'{path} contains itself (a reference cycle); {_RULE}')
    on_path.add(id(obj))
    if kind in (dict, OrderedDict):
        for key, value in obj.items():
            if not _is_plain_key(key):
                raise TypeError(
                    f'{path} has a key {_describe(key)}; dict keys in a checkpoint '
                    f'must be str, int, float, bool, None or tuples of those'
                )
            _walk(value, f'{path}[{key!r}]', on_path, foreign, tensors)
    elif kind is set:
        for item in obj:
            if not _is_plain_key(item):
                raise TypeError(f'{path} holds {_describe(item)}; {_RULE}')
    else:
        for index, value in enumerate(obj):
            _walk(value, f'{path}[{index}]', on_path, foreign, tensors)
    on_path.discard(id(obj))


class _Refused(Exception):
    """The weights-only unpickler (or pickle itself) refused an object; ``names`` are the
    globals it named."""

    def __init__(self, reason: str, names: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.reason, self.names = reason, names


def _round_trip(obj: Any) -> set[str]:
    """Save ``obj`` as ``torch.save`` would, load it with ``weights_only=True``; return the
    globals its pickle references. Raises ``_Refused`` with the reason."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise _Refused(f'it cannot be pickled at all ({err})') from None
    buffer.seek(0)
    try:
        torch.load(buffer, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as err:
        names = tuple(n for groups in _REFUSED_GLOBAL_RE.findall(str(err)) for n in groups if n)
        return_names = tuple(_builtin_name(n) for n in names)
        raise _Refused(
            'torch.load(weights_only=True) refuses '
            + (', '.join(return_names) if return_names else 'it'),
            return_names,
        ) from None
    return _referenced_globals(buffer.getvalue())


def _builtin_name(name: str) -> str:
    return name if '.' in name or name.startswith('<') else f'builtins.{name}'


def _referenced_globals(saved: bytes) -> set[str]:
    with zipfile.ZipFile(io.BytesIO(saved)) as archive:
        data = next(n for n in archive.namelist() if n.endswith('/data.pkl'))
        stream = archive.read(data)
    return {
        arg.replace(' ', '.')  # type: ignore[union-attr]
        for op, arg, _ in pickletools.genops(stream)
        if op.name == 'GLOBAL'
    }


def _message(path: str, obj: Any, refusal: _Refused) -> str:
    return f'{path} is {_describe(obj)}; {_RULE} ({refusal.reason}). {_fix(obj)}'


def _is_plain_key(key: Any) -> bool:
    if type(key) is tuple:
        return all(_is_plain_key(k) for k in key)
    return type(key) in (str, int, float, bool, type(None), bytes)


def _describe(obj: Any) -> str:
    kind = type(obj)
    qualname = f'{kind.__module__}.{kind.__qualname__}'
    if callable(obj) and hasattr(obj, '__qualname__') and not isinstance(obj, type):
        return f'a function ({getattr(obj, "__module__", "?")}.{obj.__qualname__})'
    if isinstance(obj, type):
        return f'a class ({obj.__module__}.{obj.__qualname__})'
    if isinstance(obj, torch.Tensor):
        return f'a tensor subclass ({qualname})'
    return f'a {qualname} ({_short_repr(obj)})'


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = '<unrepresentable>'
    return text if len(text) <= 60 else text[:57] + '...'


def _fix(obj: Any) -> str:
    module = type(obj).__module__.split('.')[0]
    allow = (
        f'or, if you trust {type(obj).__qualname__}, allow-list it with '
        f'stratagem.checkpoint.add_safe_globals([{type(obj).__qualname__}])'
    )
    if module == 'mmengine':
        return (
            'Fix: import stratagem.integrations.mmengine, which allow-lists what '
            "mmengine's runner stores."
        )
    if module == 'numpy':
        return (
            'Fix: convert numpy values with .item() / .tolist() or torch.from_numpy(...), '
            'or import stratagem.integrations.mmengine, which allow-lists numpy arrays, '
            'scalars and dtypes.'
        )
    if isinstance(obj, torch.Tensor):
        return (
            'Fix: store a plain tensor (e.g. tensor.as_subclass(torch.Tensor)) or the local shard.'
        )
    if hasattr(obj, 'state_dict') and callable(obj.state_dict):
        return 'Fix: store obj.state_dict() instead of the object.'
    if isinstance(obj, dict):
        return 'Fix: convert it to a plain dict (e.g. dict(x) or cfg.to_dict()).'
    if isinstance(obj, tuple):
        return 'Fix: convert it to a plain tuple or dict (e.g. tuple(x) or x._asdict()).'
    if callable(obj):
        return 'Fix: store its name (a str) and look it up when loading.'
    return f'Fix: convert it to a plain value or tensor, leave it out of the checkpoint, {allow}.'
