"""The layers (docs/architecture.md, "What each place owns"): the library's core packages
never import the places built on top of them.

``strategies/``, ``checkpoint/``, ``env/``, ``optim/``, ``scheduler/`` and ``config/`` are
what a program embeds; ``integrations/`` (host trainers), ``loop`` (``stratagem train``'s
loop, a module or a package), ``cli/`` and ``doctor/`` stand on them. Every import is read
from the source with ``ast``: at module level and inside functions, absolute and relative,
``from stratagem import loop`` as well as ``import stratagem.loop.x``, a lazy registry entry
(``'stratagem.x.y:Name'``) and ``importlib.import_module('stratagem.x')``. A module named
in a message (``"Fix: import stratagem.integrations.mmengine"``) is no import.
"""

import ast
import re
from pathlib import Path

import stratagem

ROOT = Path(stratagem.__file__).parent
CORE = ('strategies', 'checkpoint', 'env', 'optim', 'scheduler', 'config')
ABOVE = ('integrations', 'loop', 'cli', 'doctor')
_LAZY_RE = re.compile(r'stratagem(\.\w+)+:\w+')


def _is_above(module: str) -> bool:
    parts = module.split('.')
    return len(parts) > 1 and parts[0] == 'stratagem' and parts[1] in ABOVE


def _package_parts(path: Path) -> list[str]:
    """The package a module's relative imports start from (``from . import``), as parts."""
    return ['stratagem', *path.relative_to(ROOT).parent.parts]


def upward_imports(source: str, path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of a module above the core in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_parts(path)
                base = package[: len(package) - (node.level - 1)]
                module = '.'.join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ''
            if _is_above(module):
                found.append((node.lineno, module))
            else:  # `from stratagem import loop` imports the module stratagem.loop
                found += [(node.lineno, f'{module}.{alias.name}') for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _LAZY_RE.fullmatch(node.value):
                found.append((node.lineno, node.value.split(':')[0]))
        elif isinstance(node, ast.Call) and _imports_by_name(node):
            found.append((node.lineno, node.args[0].value))  # type: ignore[attr-defined]
    return sorted({(line, m) for line, m in found if _is_above(m)})


def _imports_by_name(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, 'id', None)
    return (
        name in ('import_module', '__import__')
        and bool(call.args)
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    )


def _core_modules() -> list[Path]:
    files = []
    for name in CORE:
        files += sorted((ROOT / name).rglob('*.py'))
    return files


def test_core_packages_never_import_the_layers_above():
    files = _core_modules()
    assert len(files) > 50, files  # the walk found the packages
    violations = [
        f'{path.relative_to(ROOT.parent)}:{line}: imports {module}'
        for path in files
        for line, module in upward_imports(path.read_text(), path)
    ]
    assert not violations, (
        'a core package imports a layer above it (move the shared code down into the core, '
        'or the import up into the caller):\n' + '\n'.join(violations)
    )


def test_every_form_of_an_upward_import_is_caught():
    """The checker itself: each form below is one violation, and the legal ones are none."""
    path = ROOT / 'checkpoint' / 'example.py'
    source = '\n'.join(
        [
            'import stratagem.loop',  # 1
            'import stratagem.doctor.checks as checks',  # 2
            'from stratagem.integrations.mmengine import X',  # 3
            'from stratagem import cli',  # 4
            'from .. import loop',  # 5
            'from ..loop.plan import RunPlan',  # 6
            'def f():',  # 7
            '    from stratagem.cli import main',  # 8
            "LAZY = {'A': 'stratagem.integrations.fabric:A'}",  # 9
            "importlib.import_module('stratagem.doctor')",  # 10
            'import stratagem.env',  # legal below
            'from . import vote',
            'from ..strategies import model_api',
            'from stratagem import checkpoint',
            "HINT = 'Fix: import stratagem.integrations.mmengine before loading'",
        ]
    )
    lines = sorted({line for line, _ in upward_imports(source, path)})
    assert lines == [1, 2, 3, 4, 5, 6, 8, 9, 10]
    modules = dict(upward_imports(source, path))
    assert modules[5] == 'stratagem.loop' and modules[6] == 'stratagem.loop.plan'
    # a package's __init__ resolves `from .. import` from the package itself
    init = ROOT / 'checkpoint' / '__init__.py'
    assert upward_imports('from .. import doctor', init) == [(1, 'stratagem.doctor')]
    assert upward_imports('from . import doctor', init) == []
