"""The documentation's examples run: every ``python`` and ``bash`` block of every page in docs/.

Every ``python`` block runs on its own, as a reader who copies just that block would run it:
in a fresh namespace (so it holds its own imports and names) and its own empty working
directory holding links to the checkout's ``examples/``, ``docs/`` and ``benchmarks/``; all
blocks share one interpreter, so torch is imported once; README.md's python blocks too. Every
python block, also one that does not run, is checked for names it uses but never defines
(ruff's F821). A
page's ``bash`` blocks run in order in one such directory (a shell session: a command may read
what an earlier one wrote), each as one script under ``set -euo pipefail`` with the venv's
``stratagem`` on ``PATH``; a page whose blocks are the first blocks of another page's, word
for word, is checked by that page's run (the same commands from the same empty directory).
The pages' runs and the python blocks' run are independent
processes, so they run two at a time (``PARALLEL``; the suite's pytest uses one core of
CI's two), each test asserting on its own run. A block that must not run starts with
``# not run: <reason>``, and the reason shows in the page. Only ``python``, ``bash`` and
``text`` fences are allowed (besides MyST directives such as ``{toctree}``), so code cannot
hide under another tag.

The reference pages generated from the code (``docs/_ext/stratagem_reference.py``) are checked
against the parsers and key sets they are generated from, and must be in the site's toctree.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / 'docs'
LANGUAGES = {'python', 'bash', 'text'}
NOT_RUN = re.compile(r'#\s*not run:\s*(.*)')
FENCE = re.compile(r'^(\s*)(`{3,})(.*)$')


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    @property
    def not_run_reason(self) -> str | None:
        first = self.code.lstrip('\n').split('\n', 1)[0]
        m = NOT_RUN.match(first.strip())
        return m.group(1).strip() if m else None


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page (MyST directives excluded)."""
    lines = path.read_text().split('\n')
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m.groups()
        j = i + 1
        while j < len(lines) and not re.match(rf'^\s*{ticks}\s*$', lines[j]):
            j += 1
        if j == len(lines):
            raise AssertionError(f'{path}:{i + 1}: code fence never closed')
        info = info.strip()
        if not info.startswith('{'):  # a MyST directive ({toctree}, {eval-rst}, ...)
            body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j]]
            out.append(Block(str(path.relative_to(ROOT)), i + 1, info, '\n'.join(body)))
        i = j + 1
    return out


PAGES = sorted(
    p for p in DOCS.rglob('*.md') if not {'_build', '_generated'} & set(p.relative_to(DOCS).parts)
)
ALL_BLOCKS = [b for p in PAGES for b in blocks_of(p)]
README_BLOCKS = blocks_of(ROOT / 'README.md')


def _runnable(page: str, lang: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.page == page and b.lang == lang and not b.not_run_reason]


def _pages_with(lang: str) -> list[str]:
    return sorted({b.page for b in ALL_BLOCKS if b.lang == lang and not b.not_run_reason})


# ruff (the test extra) beside the interpreter: its F821, an undefined name, as pyflakes reads
# a module; also a name used before the line that defines it
RUFF = Path(sys.executable).with_name('ruff')


def undefined_names(codes: list[str], tmp_path: Path) -> dict[int, list[str]]:
    """For each code string (a module of its own), the ``F821`` findings of ruff, by index."""
    for i, code in enumerate(codes):
        (tmp_path / f'block{i}.py').write_text(code)
    proc = subprocess.run(
        [str(RUFF), 'check', '--isolated', '--select', 'F821', '--output-format', 'concise', '.'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    found: dict[int, list[str]] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r'block(\d+)\.py:(\d+):\d+: F821 (.*)', line)
        if m:
            found.setdefault(int(m.group(1)), []).append(f'line {m.group(2)}: {m.group(3)}')
    assert proc.returncode in (0, 1) and (proc.returncode == 0) == (not found), proc.stderr
    return found


def test_python_blocks_define_what_they_use(tmp_path):
    """Every python block of docs/ and the README holds its imports and names, run or not:
    copied alone, it has no NameError (the run test below also runs each one alone)."""
    blocks = [b for b in [*ALL_BLOCKS, *README_BLOCKS] if b.lang == 'python']
    assert len(blocks) >= 25
    assert undefined_names(['y = model(x)', 'import torch\ntorch.ones(1)'], tmp_path) == {
        0: ['line 1: Undefined name `model`', 'line 1: Undefined name `x`']
    }
    found = undefined_names([b.code for b in blocks], tmp_path)
    bad = [f'{blocks[i].page}:{blocks[i].line}: {msgs}' for i, msgs in sorted(found.items())]
    assert not bad, 'python blocks that do not define what they use:\n' + '\n'.join(bad)


def test_every_block_is_runnable_or_says_why():
    assert len(PAGES) >= 20, [str(p) for p in PAGES]
    bad_lang = [f'{b.page}:{b.line} ```{b.lang}' for b in ALL_BLOCKS if b.lang not in LANGUAGES]
    assert not bad_lang, f'fences must be one of {sorted(LANGUAGES)}: {bad_lang}'
    vague = [
        f'{b.page}:{b.line}'
        for b in ALL_BLOCKS
        if b.not_run_reason is not None and len(b.not_run_reason) < 15
    ]
    assert not vague, f'a "# not run:" marker needs a reason a reader can act on: {vague}'
    ran = [b for b in ALL_BLOCKS if b.lang in ('python', 'bash') and not b.not_run_reason]
    assert len(ran) >= 25, f'only {len(ran)} blocks run'


def _workdir(tmp_path: Path) -> dict[str, str]:
    for name in ('examples', 'docs', 'benchmarks'):
        (tmp_path / name).symlink_to(ROOT / name)
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')]).rstrip(os.pathsep)
    env['PATH'] = os.pathsep.join([str(Path(sys.executable).parent), env.get('PATH', '')])
    env.update(OMP_NUM_THREADS='1', MPLBACKEND='Agg', PYTHONUNBUFFERED='1')
    return env


# every python block in one interpreter (torch is imported once), each in a fresh namespace
# and its own working directory; a failing block does not stop the others
RUNNER = """
import os, sys, traceback
blocks = {blocks!r}
failed = []
for where, workdir, code in blocks:
    os.chdir(workdir)
    try:
        exec(compile(code, where, 'exec'), {{'__name__': '__main__'}})
    except BaseException:
        failed.append(where)
        print(f'=== {{where}} failed:', file=sys.stderr)
        traceback.print_exc()
print('FAILED BLOCKS:', failed, file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def _python_blocks_run(tmp_path: Path) -> str | None:
    """Every python block of docs/ and the README, each alone in an empty directory under
    ``tmp_path``; what failed, or None."""
    runnable = [b for page in _pages_with('python') for b in _runnable(page, 'python')]
    runnable += [b for b in README_BLOCKS if b.lang == 'python' and not b.not_run_reason]
    blocks = []
    env = {}
    for b in runnable:
        workdir = tmp_path / f'block{len(blocks)}'
        workdir.mkdir()
        env = _workdir(workdir)
        blocks.append((f'{b.page}:{b.line}', str(workdir), b.code))
    assert len(blocks) >= 15, blocks
    assert any(where.startswith('README.md') for where, _, _ in blocks)
    proc = subprocess.run(
        [sys.executable, '-c', RUNNER.format(blocks=blocks)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return None if proc.returncode == 0 else proc.stderr[-8000:]


def _bash_blocks_run(page: str, tmp_path: Path) -> tuple[int, str] | None:
    """``page``'s bash blocks in order in ``tmp_path``; the first failure (its index among
    them, what it said), or None."""
    env = _workdir(tmp_path)
    for i, b in enumerate(_runnable(page, 'bash')):
        proc = subprocess.run(
            ['bash', '-euo', 'pipefail', '-c', b.code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        if proc.returncode != 0:
            out = f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
            return i, f'{b.page}:{b.line}: exit status {proc.returncode}\n{b.code}\n{out}'
    return None


def _opened_by(page: str, pages: list[str]) -> str | None:
    """The page of ``pages`` whose bash blocks begin with all of ``page``'s, word for word
    (its run runs them from the same empty directory first), or None."""
    codes = [b.code for b in _runnable(page, 'bash')]
    for other in pages:
        theirs = [b.code for b in _runnable(other, 'bash')]
        if other != page and len(theirs) > len(codes) and theirs[: len(codes)] == codes:
            return other
    return None


PYTHON_RUN = 'python blocks'  # the key of the python blocks' run among the runs
PARALLEL = 2  # runs at a time: CI has 2 cores


@pytest.fixture(scope='module')
def runs(request, tmp_path_factory):
    """``{page or PYTHON_RUN: future of its failure or None}``, for the runs that the
    session's selected tests of this module need, started ``PARALLEL`` at a time."""
    wanted = []
    for item in request.session.items:
        if getattr(item, 'module', None) is not request.module:
            continue
        if item.originalname == 'test_python_blocks_run':
            wanted.append(PYTHON_RUN)
        elif item.originalname == 'test_bash_blocks_run':
            wanted.append(item.callspec.params['page'])
    # a page whose blocks open another page's is checked by that page's run: the same
    # commands from the same empty directory (docs/backends/fsdp.md's doctor command opens
    # docs/guides/doctor.md), one start-up less
    pages = [k for k in dict.fromkeys(wanted) if k != PYTHON_RUN]
    opened = {p: host for p in pages if (host := _opened_by(p, pages)) is not None}
    # the longest first (python blocks, then the pages by their number of bash lines): the
    # two workers end together
    order = sorted(
        (k for k in dict.fromkeys(wanted) if k not in opened),
        key=lambda k: (
            float('-inf')
            if k == PYTHON_RUN
            else -sum(b.code.count('\n') + 1 for b in _runnable(k, 'bash'))
        ),
    )
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        futures = {}
        for key in order:
            tmp = tmp_path_factory.mktemp(re.sub(r'\W+', '-', key))
            if key == PYTHON_RUN:
                futures[key] = pool.submit(_python_blocks_run, tmp)
            else:
                futures[key] = pool.submit(_bash_blocks_run, key, tmp)
        for page, host in opened.items():
            futures[page] = futures[host]
        yield futures


def test_python_blocks_run(runs):
    """Every python block of docs/ and the README, each alone in an empty directory."""
    failed = runs[PYTHON_RUN].result()
    assert failed is None, failed


@pytest.mark.parametrize('page', _pages_with('bash'))
def test_bash_blocks_run(page, runs):
    failed = runs[page].result()
    # a run of a page that this page's blocks open: a failure among them is this page's
    assert failed is None or failed[0] >= len(_runnable(page, 'bash')), failed[1]


def test_a_page_is_checked_by_the_page_its_blocks_open():
    """fsdp.md's doctor command opens doctor.md, which runs it first; a page does not open
    itself, nor a page it opens, nor one it only shares blocks with."""
    pages = _pages_with('bash')
    assert _opened_by('docs/backends/fsdp.md', pages) == 'docs/guides/doctor.md'
    assert _opened_by('docs/guides/doctor.md', pages) is None
    assert _opened_by('docs/backends/ddp.md', pages) is None


def _reference():
    """``docs/_ext/stratagem_reference.py``, the generator of the reference pages."""
    path = DOCS / '_ext' / 'stratagem_reference.py'
    spec = importlib.util.spec_from_file_location('stratagem_reference', path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _options_by_program(page: str) -> dict[str, list[str]]:
    """``.. program::`` name -> the words of its ``.. option::`` lines (names and metavars)."""
    out = {}
    for chunk in page.split('.. program:: ')[1:]:
        prog, _, body = chunk.partition('\n')
        lines = [
            ln[len('.. option:: ') :] for ln in body.splitlines() if ln.startswith('.. option::')
        ]
        out[prog.strip()] = [w for ln in lines for w in re.split(r'[\s,]+', ln) if w]
    return out


def test_cli_reference_lists_every_argument():
    """Every argument of ``stratagem`` and of each sub-command's parser (built here as the CLI
    builds it) has an entry under its program; ``--debug``, read before argparse, too."""
    from stratagem import cli

    programs = _options_by_program(_reference().cli_reference())
    parsers = {'stratagem': cli.build_parser()}
    for name, (module_name, _) in cli.COMMANDS.items():
        parsers[f'stratagem {name}'] = parser = argparse.ArgumentParser(prog=f'stratagem {name}')
        importlib.import_module(module_name).add_arguments(parser)
    assert sorted(programs) == sorted(parsers)
    assert len(parsers) >= 7
    missing = []
    for prog, parser in parsers.items():
        for action in parser._actions:
            names = action.option_strings or [action.metavar or action.dest]
            missing += [f'{prog} {n}' for n in names if n not in programs[prog]]
    assert not missing, f'not in the CLI reference: {missing}'
    assert cli.DEBUG_FLAG in programs['stratagem']
    assert {'--resume', '--cfg-options', '--nproc', 'config'} <= set(programs['stratagem train'])


def test_config_reference_lists_every_key():
    """Every key set of ``stratagem.schema`` (its ``__all__``) has an entry with its docstring
    and every key; every registered strategy has its constructor arguments."""
    import stratagem.schema as schema
    from stratagem.registry import STRATEGIES
    from stratagem.strategies import BaseStrategy

    ref = _reference()
    page = ref.config_reference()
    entries = {}
    for chunk in re.split(r'^\.\. py:data:: ', page, flags=re.M)[1:]:
        name, _, body = chunk.partition('\n')
        entries[name.strip()] = body.split('\n~~')[0].split('\n--')[0]
    sets = {
        n: getattr(schema, n)
        for n in schema.__all__
        if isinstance(getattr(schema, n), (frozenset, dict))
    }
    assert {'ENV_KEYS', 'RANDOMNESS_KEYS', 'TRAIN_CFG_KEYS', 'TRAIN_DATALOADER_KEYS'} <= set(sets)
    assert sorted(entries) == sorted(sets)
    # the entry's own list of keys (its docstring may name only some)
    listed = {n: re.findall(r'``([^`]+)``', entries[n].split('   Keys: ')[1]) for n in sets}
    missing = [f'{n}: {k}' for n, keys in sets.items() for k in keys if k not in listed[n]]
    assert not missing, f'not in the config-key reference: {missing}'
    docs = ref.attribute_docstrings(Path(schema.__file__))
    assert [n for n in sets if not docs.get(n)] == [], 'a key set of schema.py has no docstring'
    assert all(docs[n].split('\n')[0] in entries[n] for n in sets)
    # BaseStrategy's arguments once, then each strategy's own under its name
    sections = dict(re.findall(r'^``(\w+)``\n~+\n(.*?)(?=^[^\n]+\n~+\n|\Z)', page, re.M | re.S))
    assert 'Every strategy' in page
    strategies = [n for n in STRATEGIES.names() if getattr(STRATEGIES.get(n), '__name__', '') == n]
    assert {'SingleDeviceStrategy', 'DDPStrategy', 'FSDPStrategy', 'DeepSpeedStrategy'} <= set(
        strategies
    )
    missing = []
    for name in strategies:
        cls = STRATEGIES.get(name)
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and f'``{p.name}``' not in (
                sections[name] if cls is not BaseStrategy else page
            ):
                missing.append(f'{name}({p.name})')
    for p in list(inspect.signature(BaseStrategy.__init__).parameters.values())[1:]:
        if f'``{p.name}``' not in page.split('Every strategy')[1].split('\n~~')[1]:
            missing.append(f'BaseStrategy({p.name})')
    assert not missing, f'strategy arguments not in the config-key reference: {missing}'


def test_reference_pages_are_in_the_toctree():
    """The generated reference pages are reachable: in the index's toctree, each including the
    file ``docs/_ext/stratagem_docs.py`` writes."""
    index = (DOCS / 'index.md').read_text()
    toctrees = re.findall(r'```\{toctree\}\n(.*?)```', index, re.S)
    entries = {ln.strip() for t in toctrees for ln in t.splitlines() if ln.strip()[:1] not in ':'}
    ext = (DOCS / '_ext' / 'stratagem_docs.py').read_text()
    for name in ('cli', 'config'):
        assert f'reference/{name}' in entries
        assert (
            f'../_generated/reference/{name}.rst' in (DOCS / 'reference' / f'{name}.md').read_text()
        )
        assert f"('{name}', stratagem_reference." in ext


def test_readme_states_the_python_the_make_targets_install_on():
    """README's Python for ``make demo`` is the Makefile's MIN_PYTHON, which is what the docs
    extra's pins (as installed: their Requires-Python) need, no more; it states the library's
    own ``requires-python`` too."""
    tomllib = pytest.importorskip('tomllib')
    from importlib.metadata import PackageNotFoundError, metadata, version

    from packaging.requirements import Requirement
    from packaging.version import Version

    makefile = (ROOT / 'Makefile').read_text()
    readme = (ROOT / 'README.md').read_text()
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    min_python = re.search(r'^MIN_PYTHON := (\S+)$', makefile, re.M).group(1)
    assert f'On a fresh machine (Python ≥ {min_python}, `make`)' in readme
    lib_python = re.fullmatch(r'>=\s*(\S+)', project['requires-python']).group(1)
    assert f'runs on Python ≥ {lib_python}' in readme
    needed = []
    for spec in project['optional-dependencies']['docs']:
        req = Requirement(spec)
        pins = [s.version for s in req.specifier if s.operator == '==']
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue
        if pins and installed == pins[0]:
            requires = metadata(req.name)['Requires-Python'] or ''
            needed += [Version(m) for m in re.findall(r'>=\s*([\d.]+)', requires)]
    assert needed, 'no pinned docs package installed at its pin'
    assert max(needed) == Version(min_python), (needed, min_python)
