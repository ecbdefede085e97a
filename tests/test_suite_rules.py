"""Rules of the test suite itself, held by parsing its files.

The two tiers are the make targets CI runs (docs/architecture.md, Tooling). No test edits
``sys.path`` by hand: an insert whose removal a failing assertion skips leaks into every
later test of the session; ``monkeypatch.syspath_prepend`` (undone after the test) is the
way, or a fixture built on it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
EDITS = {'insert', 'append', 'extend', 'remove', 'pop', 'clear'}


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines that call a mutating method of ``sys.path`` or assign to it."""

    def is_sys_path(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == 'path'
            and isinstance(node.value, ast.Name)
            and node.value.id == 'sys'
        )

    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in EDITS
            and is_sys_path(node.func.value)
        ):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [node.lineno for t in targets if is_sys_path(t)]
    return sorted(lines)


def test_no_test_edits_sys_path():
    found = []
    for path in sorted(TESTS.rglob('*.py')):
        if 'data' in path.relative_to(TESTS).parts:
            continue  # frozen checkpoints: DeepSpeed's own scripts
        lines = _sys_path_edits(ast.parse(path.read_text(), str(path)))
        found += [f'{path.relative_to(TESTS.parent)}:{line}' for line in lines]
    assert found == [], (
        f'sys.path edited by hand at {found}: use monkeypatch.syspath_prepend(path), which '
        'pytest undoes after the test'
    )


def test_the_rule_finds_an_edit():
    code = 'import sys\nsys.path.insert(0, "x")\nsys.path += ["y"]\nprint(sys.path[0])\n'
    assert _sys_path_edits(ast.parse(code)) == [2, 3]


def _recipe(makefile: str, target: str) -> str:
    """The recipe lines of ``target`` in ``makefile``, joined."""
    m = re.search(rf'^{re.escape(target)}:.*\n((?:\t.*\n)+)', makefile, re.M)
    assert m, f'Makefile has no target {target!r}'
    return m.group(1)


def test_the_two_tiers_are_the_make_targets_ci_runs():
    """``make test`` is the first tier (not ``slow``), ``make test-slow`` the second,
    ``make test-all`` both; ``.ci/run`` runs lint, ``make gpu``'s dry part (no GPU in CI), the
    first tier, the second, then the docs; the marker is declared, with its meaning."""
    tomllib = pytest.importorskip('tomllib')
    root = TESTS.parent
    makefile = (root / 'Makefile').read_text()
    pytest_line = re.search(r'^PYTEST := (.*)$', makefile, re.M).group(1)
    assert '-m pytest' in pytest_line and ' -m ' not in pytest_line.replace('-m pytest', '')
    assert '$(PYTEST) -m "not slow" tests' in _recipe(makefile, 'test')
    assert '$(PYTEST) -m slow tests' in _recipe(makefile, 'test-slow')
    assert _recipe(makefile, 'test-all').strip() == '$(PYTEST) tests'
    steps = [ln for ln in (root / '.ci' / 'run').read_text().splitlines() if ln.startswith('make')]
    assert steps == ['make lint', 'make gpu', 'make test', 'make test-slow', 'make docs']
    assert _recipe(makefile, 'gpu').strip() == 'bash benchmarks/gpu/run.sh'
    pyproject = tomllib.loads((root / 'pyproject.toml').read_text())
    markers = pyproject['tool']['pytest']['ini_options']['markers']
    assert any(m.startswith('slow: ') for m in markers)
