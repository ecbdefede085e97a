"""The reference pages generated from the code: the ``stratagem`` command's options and the
config keys. Plain functions returning reStructuredText, so that ``stratagem_docs`` writes them
into ``docs/_generated/`` at build time and ``tests/test_docs.py`` checks the same text.

- :func:`cli_reference`: every sub-command of ``stratagem.cli.COMMANDS``, its parser built as
  ``stratagem <command>`` builds it (``add_arguments``), each argument with its default,
  choices and help; the top-level options, ``--debug`` (handled before argparse) included.
- :func:`config_reference`: every public key set of ``stratagem.schema`` (its ``__all__``, so a
  set added there shows without a change here) with its attribute docstring, and the
  constructor arguments of every registered strategy.

No Sphinx import here: the test imports this module by path.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# what ``--debug`` does; the CLI reads it from the raw command line, so no parser holds it
DEBUG_HELP = (
    'show the full traceback of an error instead of the one-line message; accepted anywhere '
    'on the command line, for every sub-command (the environment variable ``{env}=1`` does '
    'the same)'
)


# a command-line option in a help text (``--to``): shown as code, which also keeps its dashes
# from becoming an en dash
OPTION = re.compile(r'(?<![\w-])(--?[A-Za-z][\w-]*)')


def rst_escape(text: str) -> str:
    """``text`` as reST prose: options as literals, characters reST reads as markup escaped."""
    parts = OPTION.split(text)
    return ''.join(
        f'``{part}``' if i % 2 else re.sub(r'([\\*`|_<>])', r'\\\1', part)
        for i, part in enumerate(parts)
    )


def title(text: str, char: str) -> list[str]:
    return [text, char * len(text), '']


def cli_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """``(program, parser)`` for ``stratagem`` and each sub-command, built as the CLI builds
    them (``stratagem.cli._dispatch``): ``prog`` ``stratagem <name>``, its one-line help as the
    description, the module's ``add_arguments``."""
    from stratagem import cli

    out = [('stratagem', cli.build_parser())]
    for name, (module_name, help_) in sorted(cli.COMMANDS.items()):
        parser = argparse.ArgumentParser(prog=f'stratagem {name}', description=help_)
        importlib.import_module(module_name).add_arguments(parser)
        out.append((f'stratagem {name}', parser))
    return out


# argparse has no public API for a parser's actions or its help formatter: what --help prints
# comes from these same private members (SLF001 below)
def _actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:  # noqa: SLF001
        if action.help is not argparse.SUPPRESS:
            yield action


def _option_block(parser: argparse.ArgumentParser, action: argparse.Action) -> list[str]:
    formatter = parser._get_formatter()  # noqa: SLF001
    if action.option_strings:
        invocation = formatter._format_action_invocation(action)  # noqa: SLF001
    else:  # a positional: its name as a reader types it
        invocation = action.metavar if isinstance(action.metavar, str) else action.dest
    help_ = formatter._expand_help(action) if action.help else ''  # noqa: SLF001
    facts = []
    if action.choices is not None and not isinstance(action.choices, dict):
        facts.append('One of ' + ', '.join(f'``{c}``' for c in action.choices) + '.')
    default = action.default
    # a help text that states its default says it better (and not as this machine's path)
    if (
        action.option_strings
        and not (
            default is None or default is False or default == [] or default is argparse.SUPPRESS
        )
        and 'default' not in help_
    ):
        facts.append(f'Default: ``{default}``.')
    body = [f'   {rst_escape(help_)}', '']
    if facts:
        body += [f'   {" ".join(facts)}', '']
    return [f'.. option:: {invocation}', '', *body]


def cli_reference() -> str:
    """The CLI reference page's body (reST): one section per program, one ``.. option::``
    per argument, usage lines as argparse prints them."""
    from stratagem import cli

    lines: list[str] = []
    for prog, parser in cli_parsers():
        lines += title(f'``{prog}``', '-')
        if prog != 'stratagem' and parser.description:  # the top level's is this page's intro
            lines += [rst_escape(parser.description), '']
        usage = parser.format_usage().strip()
        lines += ['.. code-block:: text', '', *[f'   {u}' for u in usage.splitlines()], '']
        lines += [f'.. program:: {prog}', '']
        for action in _actions(parser):
            lines += _option_block(parser, action)
        if prog == 'stratagem':
            if not any(cli.DEBUG_FLAG in a.option_strings for a in _actions(parser)):
                help_ = DEBUG_HELP.format(env=cli.DEBUG_ENV)  # reST already
                lines += [f'.. option:: {cli.DEBUG_FLAG}', '', f'   {help_}', '']
            lines += ['Sub-commands:', '']
            for name, (_, help_) in sorted(cli.COMMANDS.items()):
                lines += [f'- ``{name}``: {rst_escape(help_)}']
            lines += ['']
    return '\n'.join(lines)


def attribute_docstrings(path: Path) -> dict[str, str]:
    """The docstrings that follow module-level assignments in ``path`` (``NAME = ...`` then a
    string literal), by name; what Sphinx's autodoc reads as an attribute's docstring."""
    tree = ast.parse(path.read_text())
    out = {}
    body = tree.body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if (
            isinstance(target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[target.id] = inspect.cleandoc(nxt.value.value)
    return out


def schema_sets() -> list[tuple[str, frozenset[str] | dict[str, Any], str]]:
    """``(name, keys, docstring)`` for every key set (a set, or a dict by key) in
    ``stratagem.schema.__all__``, in the module's source order (its author's, not ``__all__``'s
    alphabetical one); the docstring is '' when it has none."""
    schema = importlib.import_module('stratagem.schema')
    docs = attribute_docstrings(Path(schema.__file__))  # in source order
    order = {name: i for i, name in enumerate(docs)}
    names = [n for n in schema.__all__ if isinstance(getattr(schema, n), (frozenset, set, dict))]
    return [
        (name, getattr(schema, name), docs.get(name, ''))
        for name in sorted(names, key=lambda n: order.get(n, len(order)))
    ]


def schema_functions() -> list[str]:
    """The functions in ``stratagem.schema.__all__`` (the checks built on the key sets)."""
    schema = importlib.import_module('stratagem.schema')
    return [n for n in schema.__all__ if inspect.isfunction(getattr(schema, n))]


def section_name(name: str, doc: str) -> str:
    """The config section a key set is for: the first literal of its docstring
    (``strategy.env_kwargs``), else the set's own name."""
    m = re.match(r'\s*``([^`]+)``', doc)
    return m.group(1) if m else name


def constructor_arguments(cls: type) -> list[inspect.Parameter]:
    """The keyword arguments ``cls(**cfg)`` takes: its ``__init__``'s, then those of each base
    its ``**kwargs`` passes on to, in method resolution order, each name once."""
    out: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get('__init__')
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                out.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(out.values())


def _default(p: inspect.Parameter) -> str:
    return 'required' if p.default is p.empty else f'``{p.default!r}``'


def registry_classes(registry: Any) -> list[tuple[str, type]]:
    """``(name, class)`` for each name of a registry (lazy ones imported), scoped aliases and
    functions left out."""
    out = []
    for name in registry.names():
        obj = registry.get(name)
        if isinstance(obj, type) and name == obj.__name__:
            out.append((name, obj))
    return out


def _argument_table(params: list[inspect.Parameter]) -> list[str]:
    lines = ['.. list-table::', '   :header-rows: 1', '', '   * - key', '     - default']
    for p in params:
        lines += [f'   * - ``{p.name}``', f'     - {_default(p)}']
    return [*lines, '']


def config_reference() -> str:
    """The config-key reference page's body (reST): each key set of ``stratagem.schema`` as a
    ``py:data`` entry (its docstring, then its keys), then each strategy's arguments."""
    from stratagem.registry import STRATEGIES

    lines = ['.. py:currentmodule:: stratagem.schema', '']
    for name, keys, doc in schema_sets():
        lines += title(f'``{section_name(name, doc)}``', '-')
        kind = 'frozenset[str]' if not isinstance(keys, dict) else 'dict'
        lines += [f'.. py:data:: {name}', f'   :type: {kind}', '']
        lines += [f'   {ln}' if ln else '' for ln in (doc or '(no docstring)').splitlines()]
        listed = [
            f'``{k}``' + (f' (``{keys[k]}``)' if isinstance(keys, dict) else '')
            for k in sorted(keys)
        ]
        lines += ['', '   Keys: ' + ', '.join(listed), '']
    functions = schema_functions()
    if functions:
        lines += title('Checks on these keys', '-')
        lines += [f'.. autofunction:: stratagem.schema.{n}\n' for n in functions]
    schema = importlib.import_module('stratagem.schema')
    lines += [  # what the checks return
        f'.. autoclass:: stratagem.schema.{n}\n   :members:\n'
        for n in schema.__all__
        if inspect.isclass(getattr(schema, n))
    ]
    lines += title('``strategy``', '-')
    lines += [
        "``strategy=dict(type=NAME, ...)``: ``type`` is one of the names below (or ``'auto'``:",
        'SingleDeviceStrategy for one process, DDPStrategy under a distributed launcher); the',
        "other keys are the class's constructor arguments, described on its API page.",
        '',
    ]
    from stratagem.strategies import BaseStrategy

    common = constructor_arguments(BaseStrategy)
    lines += title('Every strategy', '~')
    lines += [":class:`stratagem.strategies.BaseStrategy`'s arguments, taken by each one:", '']
    lines += _argument_table(common)
    names = {p.name for p in common}
    for name, cls in registry_classes(STRATEGIES):
        path = f'{cls.__module__}.{cls.__qualname__}'
        # the API reference documents a strategy under the package that exports it
        lines += title(f'``{name}``', '~')
        lines += [f':class:`stratagem.strategies.{name}` (``{path}``); its own arguments:', '']
        own = [p for p in constructor_arguments(cls) if p.name not in names]
        lines += _argument_table(own) if own else ['(none)', '']
    return '\n'.join(lines)
