"""One summary of a ``make gpu`` run: ``summary.md`` (Markdown tables) and ``summary.csv``.

Reads, in ``OUT``: ``meta.json`` (the machine, written by run.sh), ``parts.tsv`` (each part's
name, exit status and seconds; 124 = cut by its timeout), ``tests.xml`` (pytest's JUnit file
of the gpu-marked tests; ``tests.log``, its ``-v`` output, where pytest was killed before
writing it) and ``rows.jsonl`` (bench.py's figures). Anything missing is reported as missing,
never as passed.

    python benchmarks/gpu/summary.py OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path
from typing import Any

_TEST = re.compile(r'^(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b\s*(.*)$')
CSV_FIELDS = ('kind', 'part', 'case', 'world', 'ours', 'raw', 'unit', 'ratio', 'goal', 'met')
CSV_FIELDS += ('tokens_per_s', 'mfu', 'spread', 'note')


def read_tests(log: Path) -> list[dict[str, str]]:
    """``[{'test', 'outcome', 'detail', 'seconds'}]``: from pytest's JUnit file beside the
    log (whole skip reasons and failure messages, durations), else, when pytest was killed
    before writing it, from its verbose output, in order."""
    junit = log.with_suffix('.xml')
    if junit.is_file():
        return _read_junit(junit)
    if not log.is_file():
        return []
    out = []
    for line in log.read_text(errors='replace').splitlines():
        m = _TEST.match(line.strip())
        if m:
            detail = re.sub(r'\s*\[\s*\d+%\]\s*$', '', m.group(3)).strip()
            out.append(dict(test=m.group(1), outcome=m.group(2), detail=detail, seconds=''))
    return out


def _read_junit(path: Path) -> list[dict[str, str]]:
    import xml.etree.ElementTree as ET

    out = []
    for case in ET.parse(path).getroot().iter('testcase'):
        module = case.get('classname', '').replace('.', '/')
        test = f'{module}.py::{case.get("name")}'
        outcome, detail = 'PASSED', ''
        for tag, name in (('failure', 'FAILED'), ('error', 'ERROR'), ('skipped', 'SKIPPED')):
            found = case.find(tag)
            if found is not None:
                outcome = name
                detail = (
                    (found.get('message') or '').splitlines()[0][:300]
                    if found.get('message')
                    else ''
                )
                break
        out.append(dict(test=test, outcome=outcome, detail=detail, seconds=case.get('time', '')))
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def met(row: dict[str, Any]) -> str:
    """'yes' / 'no' against the row's goal ('' when it has none or no ratio)."""
    goal, ratio = row.get('goal'), row.get('ratio')
    if goal is None or ratio is None:
        return ''
    if isinstance(goal, str):  # a range 'low-high'
        low, high = (float(x) for x in goal.split('-'))
        return 'yes' if low <= ratio <= high else 'no'
    return 'yes' if ratio <= goal else 'no'


def scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each backend measured on 1 and N GPUs: tokens/s at N over N × tokens/s at 1."""
    by = {(r.get('case'), r.get('world')): r for r in rows if r.get('part') == 'steps'}
    out = []
    for (case, world), row in by.items():
        one = by.get((case, 1))
        if world and world > 1 and one and one.get('tokens_per_s') and row.get('tokens_per_s'):
            eff = row['tokens_per_s'] / (world * one['tokens_per_s'])
            out.append(
                dict(
                    part='scaling',
                    case=f'{case}: {world} GPUs',
                    world=world,
                    ours=row['tokens_per_s'],
                    raw=world * one['tokens_per_s'],
                    unit='tokens/s',
                    ratio=eff,
                    note='efficiency vs N × 1 GPU',
                )
            )
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return ''
    if isinstance(v, float):
        return f'{v:.4g}' if abs(v) < 1e4 else f'{v:,.0f}'
    return str(v)


def write(out: Path) -> tuple[Path, Path]:
    meta = json.loads((out / 'meta.json').read_text()) if (out / 'meta.json').is_file() else {}
    parts = []
    if (out / 'parts.tsv').is_file():
        for line in (out / 'parts.tsv').read_text().splitlines():
            name, rc, secs = (line.split('\t') + ['', ''])[:3]
            parts.append((name, rc, secs))
    tests = read_tests(out / 'tests.log')
    rows = read_rows(out / 'rows.jsonl')
    rows += scaling(rows)
    md = ['# `make gpu`: summary', '']
    for key in ('date', 'device', 'gpus', 'torch', 'cuda', 'python', 'commit'):
        if key in meta:
            md.append(f'- {key}: {meta[key]}')
    md += ['', '## Parts', '', '| part | exit | seconds |', '|---|---|---|']
    for name, rc, secs in parts:
        status = {'0': '0 (ok)', '124': '124 (timed out)', 'skip': 'not run: budget spent'}
        md.append(f'| {name} | {status.get(rc, rc)} | {secs} |')
    counts: dict[str, int] = {}
    for t in tests:
        counts[t['outcome']] = counts.get(t['outcome'], 0) + 1
    md += ['', '## gpu-marked tests', '']
    md.append(', '.join(f'{k.lower()} {v}' for k, v in sorted(counts.items())) or 'no results')
    md += ['', '| test | outcome | seconds | detail |', '|---|---|---|---|']
    md += [
        f'| `{t["test"]}` | {t["outcome"]} | {t["seconds"]} | {t["detail"].replace("|", "/")} |'
        for t in tests
    ]
    md += ['', '## Figures (ours against the raw PyTorch loop of the same run)', '']
    md += [
        '| part | case | world | ours | raw | unit | ratio | goal | met | tokens/s | MFU | note |'
    ]
    md += ['|' + '---|' * 12]
    for r in rows:
        mfu = f'{r["mfu"]:.1%}' if r.get('mfu') is not None else ''
        md.append(
            '| '
            + ' | '.join(
                [
                    _fmt(r.get(k))
                    for k in ('part', 'case', 'world', 'ours', 'raw', 'unit', 'ratio', 'goal')
                ]
                + [met(r), _fmt(r.get('tokens_per_s')), mfu, _fmt(r.get('note'))]
            )
            + ' |'
        )
    md_path, csv_path = out / 'summary.md', out / 'summary.csv'
    md_path.write_text('\n'.join(md) + '\n')
    with open(csv_path, 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction='ignore')
        w.writeheader()
        for name, rc, secs in parts:
            w.writerow(dict(kind='part', case=name, ours=secs, unit='s', note=f'exit {rc}'))
        for t in tests:
            w.writerow(
                dict(kind='test', case=t['test'], note=f'{t["outcome"]} {t["detail"]}'.strip())
            )
        for r in rows:
            w.writerow(dict(r, kind='figure', met=met(r)))
    return md_path, csv_path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('out', type=Path, help='the folder run.sh wrote into')
    md, _ = write(p.parse_args(argv).out)
    print(md.read_text())


if __name__ == '__main__':
    main()
