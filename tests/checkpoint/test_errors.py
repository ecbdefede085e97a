"""Every error and warning of ``stratagem.checkpoint`` lives in ``errors.py`` and is exported
by the package, so a program catches any of them with one import path."""

import ast
import inspect
from pathlib import Path

import stratagem.checkpoint as ckpt
from stratagem.checkpoint import errors

PACKAGE = Path(ckpt.__file__).parent


def _is_error(node: ast.ClassDef) -> bool:
    names = [getattr(b, 'id', getattr(b, 'attr', '')) for b in node.bases]
    return any(n.endswith(('Error', 'Exception', 'Warning')) for n in [node.name, *names])


def test_errors_are_defined_in_errors_py_only():
    elsewhere = [
        f'{path.name}:{node.lineno}: {node.name}'
        for path in sorted(PACKAGE.glob('*.py'))
        if path.name != 'errors.py'
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and _is_error(node) and not node.name.startswith('_')
    ]
    assert elsewhere == [], f'define these in checkpoint/errors.py: {elsewhere}'


def test_every_error_is_exported():
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
    }
    assert {'CheckpointVoteError', 'CheckpointNotShared', 'StateDictMismatchError'} <= defined
    assert defined <= set(ckpt.__all__), sorted(defined - set(ckpt.__all__))
    assert all(getattr(ckpt, name) is getattr(errors, name) for name in defined)
