"""An import alias under which mmengine's optimizer and scheduler tests run against stratagem.

``install()`` puts a stand-in ``mmengine`` package into ``sys.modules`` whose submodules are:

- ``mmengine.optim``: stratagem's ``stratagem.optim`` names, plus ``scheduler``;
- ``mmengine.optim.scheduler``: ``stratagem.scheduler`` itself;
- ``mmengine.testing``: ``assert_allclose``, the torch function mmengine's wraps;
- ``mmengine.utils``: ``digit_version`` (a comparable version from a version string).

Nothing of the real mmengine is imported, so every class and function the tests exercise is
stratagem's (the real ``mmengine.testing`` would import mmengine's runner, hooks and its own
``optim``). Call it before the tests are imported (a ``conftest.py`` does), in a process of
its own: it replaces whatever ``mmengine`` would have been.
"""

from __future__ import annotations

import sys
import types
import warnings

from packaging.version import Version

__all__ = ['install', 'ALIASED']

ALIASED = (
    'mmengine',
    'mmengine.optim',
    'mmengine.optim.scheduler',
    'mmengine.testing',
    'mmengine.utils',
)


def digit_version(version_str: str, length: int = 4) -> tuple:
    """mmengine's ``digit_version`` contract: a tuple that orders versions; pre-releases
    before their release."""
    version = Version(version_str)
    release = list(version.release[:length]) + [0] * (length - len(version.release[:length]))
    if version.pre is not None:  # rc1 < final: mmengine maps a/b/rc to -3/-2/-1
        release += [{'a': -3, 'b': -2, 'rc': -1}[version.pre[0]], version.pre[1]]
    elif version.is_prerelease:  # a dev release
        release += [-4, 0]
    elif version.is_postrelease:
        release += [1, version.post]
    else:
        release += [0, 0]
    return tuple(release)


def assert_allclose(actual, expected, rtol=None, atol=None, equal_nan=True, msg=''):
    """``torch.testing.assert_allclose`` (which mmengine's wraps), without its
    deprecation warning."""
    from torch import testing

    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)
        testing.assert_allclose(
            actual, expected, rtol=rtol, atol=atol, equal_nan=equal_nan, msg=msg
        )


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name, f'stratagem stand-in for {name} (tests/compat)')
    module.__dict__.update(attrs)
    module.__path__ = []  # a package, so submodule imports resolve through sys.modules
    return module


def install() -> None:
    """Put the stand-in ``mmengine`` into ``sys.modules``; refuse if a real one is loaded."""
    real = [
        n
        for n in ALIASED
        if n in sys.modules
        and not getattr(sys.modules[n], '__doc__', '').startswith('stratagem stand-in')
    ]
    if real:
        raise RuntimeError(
            f'the real {real[0]} is already imported in this process; install '
            'the alias first, in a process of its own'
        )
    import stratagem.optim as optim
    import stratagem.scheduler as scheduler

    names = {n: getattr(optim, n) for n in optim.__all__}
    modules = {
        'mmengine': _module('mmengine'),
        'mmengine.optim': _module('mmengine.optim', **names, scheduler=scheduler),
        'mmengine.testing': _module('mmengine.testing', assert_allclose=assert_allclose),
        'mmengine.utils': _module('mmengine.utils', digit_version=digit_version),
    }
    for name, module in modules.items():
        sys.modules[name] = module
    sys.modules['mmengine.optim.scheduler'] = scheduler
    for name in ('optim', 'testing', 'utils'):
        setattr(modules['mmengine'], name, modules[f'mmengine.{name}'])
