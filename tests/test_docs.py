"""The documentation's examples run: every ``python`` and ``bash`` block of every page in docs/.

A page's ``python`` blocks run in order in one namespace (a page reads as one session), every
page in its own temporary working directory holding links to the checkout's ``examples/``,
``docs/`` and ``benchmarks/``; all pages share one interpreter, so torch is imported once. A
page's ``bash`` blocks run in such a directory too, each as one script under
``set -euo pipefail`` with the venv's ``stratagem`` on ``PATH``. A block that must not run starts
with ``# not run: <reason>``, and the reason shows in the page. Only ``python``, ``bash`` and
``text`` fences are allowed (besides MyST directives such as ``{toctree}``), so code cannot hide
under another tag.
"""

from __future__ import annotations

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


PAGES = sorted(p for p in DOCS.rglob('*.md') if '_build' not in p.parts)
ALL_BLOCKS = [b for p in PAGES for b in blocks_of(p)]


def _runnable(page: str, lang: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.page == page and b.lang == lang and not b.not_run_reason]


def _pages_with(lang: str) -> list[str]:
    return sorted({b.page for b in ALL_BLOCKS if b.lang == lang and not b.not_run_reason})


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


# every page's python blocks in one interpreter (torch is imported once): each page in a fresh
# namespace and its own working directory; a failing page does not stop the others
RUNNER = """
import os, sys, traceback
pages = {pages!r}
failed = []
for page, workdir, blocks in pages:
    os.chdir(workdir)
    ns = {{'__name__': '__main__'}}
    try:
        for where, code in blocks:
            exec(compile(code, where, 'exec'), ns)
    except BaseException:
        failed.append(page)
        print(f'=== {{page}} failed:', file=sys.stderr)
        traceback.print_exc()
print('FAILED PAGES:', failed, file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_python_blocks_run(tmp_path):
    pages = []
    env = {}
    for i, page in enumerate(_pages_with('python')):
        workdir = tmp_path / f'page{i}'
        workdir.mkdir()
        env = _workdir(workdir)
        blocks = [(f'{b.page}:{b.line}', b.code) for b in _runnable(page, 'python')]
        pages.append((page, str(workdir), blocks))
    assert len(pages) >= 10, pages
    proc = subprocess.run(
        [sys.executable, '-c', RUNNER.format(pages=pages)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]


@pytest.mark.parametrize('page', _pages_with('bash'))
def test_bash_blocks_run(page, tmp_path):
    env = _workdir(tmp_path)
    for b in _runnable(page, 'bash'):
        proc = subprocess.run(
            ['bash', '-euo', 'pipefail', '-c', b.code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        out = f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
        assert proc.returncode == 0, f'{b.page}:{b.line}:\n{b.code}\n{out}'
