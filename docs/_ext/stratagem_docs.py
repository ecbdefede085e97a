"""The site's own Sphinx extension: figures and reference pages generated at build time, and a
check that the API reference covers every public name.

- ``builder-inited``: every config in ``docs/schedules/`` is drawn by ``stratagem plot-schedule``
  (the command itself, in this process) into ``docs/_generated/schedules/<name>.png``, and
  ``docs/benchmarks.csv`` (the figures of the benchmark scripts' recorded runs) into
  ``docs/_generated/benchmarks/<group>.png``. Nothing drawn is committed, so no figure can
  drift from the code that draws it.
- ``builder-inited`` too: the CLI reference and the config-key reference
  (``stratagem_reference.py``: from the parsers of ``stratagem.cli`` and the key sets of
  ``stratagem.schema``) into ``docs/_generated/reference/{cli,config}.rst``, which
  ``docs/reference/*.md`` include.
- ``env-check-consistency``: every name in the ``__all__`` of the public modules (and
  ``stratagem``'s lazy names) must be documented by autodoc somewhere in the site; a missing
  one is a warning, so ``sphinx-build -W`` fails.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
from pathlib import Path
from typing import Any

from sphinx.util import logging

log = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parents[1]
GENERATED = DOCS / '_generated'
# the modules whose __all__ is the public API (``stratagem`` itself: its lazy names)
PUBLIC_MODULES = (
    'stratagem',
    'stratagem.strategies',
    'stratagem.optim',
    'stratagem.scheduler',
    'stratagem.checkpoint',
    'stratagem.env',
    'stratagem.config',
    'stratagem.registry',
    'stratagem.metrics',
    'stratagem.throughput',
)
# extra ``plot-schedule`` arguments per schedule config (by file stem); the schedulers page
# shows the same commands, and tests/test_docs.py runs them
SCHEDULE_ARGS = {'multistep': ['--epoch-length', '50']}


def draw_schedules() -> list[Path]:
    """Draw every ``docs/schedules/*.py`` with ``stratagem plot-schedule``; the PNGs written."""
    from stratagem.cli import main as stratagem_main

    out_dir = GENERATED / 'schedules'
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for cfg in sorted((DOCS / 'schedules').glob('*.py')):
        png = out_dir / f'{cfg.stem}.png'
        argv = ['plot-schedule', str(cfg), '--out', str(png), *SCHEDULE_ARGS.get(cfg.stem, [])]
        with contextlib.redirect_stdout(io.StringIO()):
            code = stratagem_main(argv)
        if code != 0 or not png.exists():
            raise RuntimeError(f'stratagem {" ".join(argv)} failed with exit status {code}')
        written.append(png)
    return written


def read_benchmarks(path: Path) -> dict[str, list[dict[str, str]]]:
    """``docs/benchmarks.csv`` grouped by its ``figure`` column, rows in file order."""
    groups: dict[str, list[dict[str, str]]] = {}
    with path.open(newline='') as f:
        for row in csv.DictReader(line for line in f if not line.startswith('#')):
            groups.setdefault(row['figure'], []).append(row)
    return groups


def draw_benchmarks() -> list[Path]:
    """One horizontal bar chart per figure of ``docs/benchmarks.csv``: stratagem / raw, with the
    goal as a tick and 1.0 (the raw loop) as a line."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    out_dir = GENERATED / 'benchmarks'
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in read_benchmarks(DOCS / 'benchmarks.csv').items():
        ratios = [float(r['ratio']) for r in rows]
        labels = [r['case'] for r in rows]
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
        ys = range(len(rows))[::-1]
        ax.barh(list(ys), ratios, color='#4c72b0')
        for y, r, ratio in zip(ys, rows, ratios):
            ax.text(ratio, y, f' {ratio:.2f}×', va='center', fontsize=8)
            if r['goal']:
                ax.plot([float(r['goal'])] * 2, [y - 0.4, y + 0.4], color='#c44e52', lw=2)
        ax.axvline(1.0, color='black', lw=0.8)
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.set_xlabel('stratagem / raw PyTorch (lower is faster; red tick: the goal)')
        ax.set_title(rows[0]['title'], fontsize=10)
        ax.set_xlim(0, max(max(ratios), 1.0) * 1.2)
        fig.tight_layout()
        png = out_dir / f'{name}.png'
        fig.savefig(png, dpi=100)
        plt.close(fig)
        written.append(png)
    return written


def write_references() -> list[Path]:
    """The generated reference pages' bodies (reST), written into ``_generated/reference/``."""
    import stratagem_reference

    out_dir = GENERATED / 'reference'
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in (
        ('cli', stratagem_reference.cli_reference),
        ('config', stratagem_reference.config_reference),
    ):
        path = out_dir / f'{name}.rst'
        path.write_text(make())
        written.append(path)
    return written


def _draw(app: Any) -> None:
    draw_schedules()
    draw_benchmarks()
    write_references()


def undocumented_names(documented: set[str]) -> list[str]:
    """Public names (``module.name``) that no autodoc directive of the site documents.

    A name re-exported by ``stratagem`` (its lazy names) counts as documented when the object
    it resolves to is documented under its home module."""
    missing = []
    for mod_name in PUBLIC_MODULES:
        mod = importlib.import_module(mod_name)
        for name in getattr(mod, '__all__', []):
            if name.startswith('__'):
                continue
            full = f'{mod_name}.{name}'
            if full in documented:
                continue
            obj = getattr(mod, name)
            home = f'{getattr(obj, "__module__", "")}.{getattr(obj, "__qualname__", "")}'
            if mod_name == 'stratagem' and any(
                d.endswith(f'.{name}') and _resolves_to(d, obj) for d in documented
            ):
                continue
            if home not in documented:
                missing.append(full)
    return missing


def _resolves_to(dotted: str, obj: Any) -> bool:
    mod_name, _, attr = dotted.rpartition('.')
    try:
        return getattr(importlib.import_module(mod_name), attr) is obj
    except (ImportError, AttributeError):
        return False


def _check_api(app: Any, env: Any) -> None:
    documented = set(env.get_domain('py').objects)
    for full in undocumented_names(documented):
        log.warning(f'public name {full} is not documented in the API reference (docs/api/)')


def setup(app: Any) -> dict[str, Any]:
    app.connect('builder-inited', _draw)
    app.connect('env-check-consistency', _check_api)
    return {'version': '1', 'parallel_read_safe': True, 'parallel_write_safe': True}
