"""stratagem: a pluggable training-strategy engine for PyTorch.

Importing this package is cheap and has no side effects: public names are
resolved lazily on first attribute access.
"""

from importlib import import_module
from typing import Any

from .version import __version__

_LAZY = {
    'Config': 'stratagem.config',
    'ConfigDict': 'stratagem.config',
    'Registry': 'stratagem.registry',
    'MODELS': 'stratagem.registry',
    'STRATEGIES': 'stratagem.registry',
    'OPTIMIZERS': 'stratagem.registry',
    'OPTIM_WRAPPERS': 'stratagem.registry',
    'OPTIM_WRAPPER_CONSTRUCTORS': 'stratagem.registry',
    'PARAM_SCHEDULERS': 'stratagem.registry',
    'DATASETS': 'stratagem.registry',
    'build_strategy': 'stratagem.strategies',
    'BaseStrategy': 'stratagem.strategies',
    'SingleDeviceStrategy': 'stratagem.strategies',
    'DDPStrategy': 'stratagem.strategies',
}
__all__ = ['__version__', *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list:
    return sorted(__all__)
