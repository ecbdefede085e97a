"""``make gpu``'s machinery on the CPU (benchmarks/gpu/): the script parses, bench.py's step
comparison runs with the toy model, and summary.py turns rows, parts and test results into
the tables, so a typo fails here and not on the first GPU. CI runs the whole dry part
(``make gpu`` without CUDA: every part, the gpu tests' collection)."""

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

GPU = Path(__file__).resolve().parents[1] / 'benchmarks' / 'gpu'


def _load(name, monkeypatch):
    monkeypatch.syspath_prepend(str(GPU.parent))  # bench.py imports benchmarks/_spawn.py
    spec = importlib.util.spec_from_file_location(f'gpu_{name}', GPU / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def test_run_sh_parses():
    subprocess.run(['bash', '-n', str(GPU / 'run.sh')], check=True, timeout=30)


def test_step_comparison_and_summary_on_the_cpu(tmp_path, monkeypatch, clean_env):
    bench, summary = _load('bench', monkeypatch), _load('summary', monkeypatch)
    threads = torch.get_num_threads()
    try:  # the single-device pair, 1 round of 2 steps, gloo in this process
        bench.main(
            [
                '--part',
                'steps',
                '--dry',
                '--no-flops',
                '--cases',
                'SingleDevice',
                '--out',
                str(tmp_path),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (tmp_path / 'rows.jsonl').read_text().splitlines()]
    assert [r['case'] for r in rows] == ['SingleDevice', 'SingleDevice: control']
    ours = rows[0]
    assert ours['unit'] == 'ms/step' and ours['ours'] > 0 and ours['raw'] > 0
    assert ours['ratio'] == ours['ratio'] > 0 and ours['goal'] == 1.02
    # 2 sequences of 16 tokens per step; no peak known for a CPU, so no MFU
    assert abs(ours['tokens_per_s'] - 32 / ours['ours'] * 1e3) < 1e-3 * ours['tokens_per_s']
    assert ours['mfu'] is None and ours['device'] == 'cpu'

    (tmp_path / 'parts.tsv').write_text('tests\t0\t61\nbench: compile\t124\t70\n')
    (tmp_path / 'tests.log').write_text(
        'tests/a.py::test_x PASSED                     [ 50%]\n'
        'tests/b.py::test_y SKIPPED (needs a CUDA device) [100%]\n'
    )
    md, table = summary.write(tmp_path)
    text = md.read_text()
    assert '| bench: compile | 124 (timed out) | 70 |' in text
    assert '| `tests/b.py::test_y` | SKIPPED |  | (needs a CUDA device) |' in text
    assert 'passed 1, skipped 1' in text and '| steps | SingleDevice | 1 |' in text
    kinds = [r['kind'] for r in csv.DictReader(table.open())]
    assert kinds == ['part', 'part', 'test', 'test', 'figure', 'figure']


def test_goals_scaling_and_junit(monkeypatch, tmp_path):
    summary = _load('summary', monkeypatch)
    (tmp_path / 'tests.xml').write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.env.test_x" name="test_a" time="1.5"/>'
        '<testcase classname="tests.env.test_x" name="test_b" time="0.1">'
        '<failure message="assert 1 == 2&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.test_y" name="test_c" time="0">'
        '<skipped message="needs a CUDA device"/></testcase>'
        '</testsuite></testsuites>'
    )
    assert [tuple(t.values()) for t in summary.read_tests(tmp_path / 'tests.log')] == [
        ('tests/env/test_x.py::test_a', 'PASSED', '', '1.5'),
        ('tests/env/test_x.py::test_b', 'FAILED', 'assert 1 == 2', '0.1'),
        ('tests/test_y.py::test_c', 'SKIPPED', 'needs a CUDA device', '0'),
    ]
    assert summary.met(dict(ratio=1.01, goal=1.02)) == 'yes'
    assert summary.met(dict(ratio=1.03, goal=1.02)) == 'no'
    assert summary.met(dict(ratio=1.12, goal='0.90-1.10')) == 'no'
    assert summary.met(dict(ratio=0.95, goal='0.90-1.10')) == 'yes'
    assert summary.met(dict(ratio=None, goal=1.02)) == ''
    one = dict(part='steps', case='DDP', world=1, tokens_per_s=100.0)
    four = dict(part='steps', case='DDP', world=4, tokens_per_s=360.0)
    (row,) = summary.scaling([one, four])
    assert row['case'] == 'DDP: 4 GPUs' and row['ratio'] == 0.9
