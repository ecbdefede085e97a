"""tests/scenarios.py: a failing scenario fails its own tests only; ``-k`` runs only the
selected scenarios and what they need.

A small test module (written to a temporary folder) is run by pytest in a new process; its
scenarios fail on purpose in each way a scenario can: raising on every rank, raising on one
rank while the other waits in a collective, a rank that dies, a need that failed. The two
pytest runs (all tests; ``-k``) are independent processes: they run at the same time (CI has
2 cores).
"""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
MODULE = textwrap.dedent("""
    import os

    import pytest

    from scenarios import Scenarios

    SCENARIOS = Scenarios(checkin=1, ranks=dict(nproc=2, timeout=60), here=dict(nproc=0))


    def _barrier():
        import torch.distributed as dist

        from stratagem.env import init_dist

        init_dist('pytorch')  # once per process
        dist.barrier()


    @SCENARIOS.add('ranks')
    def ok_first(tmp):
        _barrier()
        return int(os.environ['RANK'])


    @SCENARIOS.add('ranks')
    def both_raise(tmp):
        raise ValueError('both ranks broke on purpose')


    @SCENARIOS.add('ranks', needs=['both_raise'])
    def needs_broken(tmp, both_raise):
        return 'unreachable'


    @SCENARIOS.add('ranks')
    def desync(tmp):
        if os.environ['RANK'] == '1':
            raise ValueError('rank 1 broke before the barrier')
        _barrier()  # rank 0 waits in it for rank 1


    @SCENARIOS.add('ranks')
    def after_desync(tmp):
        _barrier()  # new processes: the group of the others broke
        return 'fine'


    @SCENARIOS.add('ranks')
    def dies(tmp):
        if os.environ['RANK'] == '0':
            os._exit(3)


    @SCENARIOS.add('ranks')
    def after_death(tmp):
        return 'alive'


    @SCENARIOS.add('here', needs=['ok_first'])
    def in_process(tmp, ok_first):
        return ok_first + 100


    @pytest.fixture(scope='module')
    def scenarios(request, tmp_path_factory):
        return SCENARIOS.run(request, tmp_path_factory.mktemp('demo'))


    @pytest.mark.parametrize('name', ['ok_first', 'after_desync', 'after_death', 'in_process'])
    @pytest.mark.scenario('{name}')
    def test_passes(scenario, name):
        want = {'ok_first': [0, 1], 'after_desync': ['fine'] * 2, 'after_death': ['alive'] * 2}
        assert list(scenario) == want.get(name, [100])


    @pytest.mark.parametrize('name', ['both_raise', 'needs_broken', 'desync', 'dies'])
    @pytest.mark.scenario('{name}')
    def test_fails(scenario, name):
        pass  # never reached: the scenario's failure errors this test at its fixture
""")


def _start(tmp_path, *args):
    """The module under pytest in a new process, started: (process, its junit report)."""
    (tmp_path / 'test_demo.py').write_text(MODULE)
    (tmp_path / 'conftest.py').write_text(
        'from scenarios import pytest_configure, pytest_itemcollected, scenario  # noqa: F401\n'
    )
    (tmp_path / 'pytest.ini').write_text('[pytest]\n')
    report = tmp_path / 'report.xml'
    path = [str(TESTS), str(TESTS.parent), os.environ.get('PYTHONPATH', '')]
    proc = subprocess.Popen(
        [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '--junitxml', str(report)]
        + ['--basetemp', str(tmp_path / 'base'), str(tmp_path / 'test_demo.py'), *args],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS='1'),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, report


def _outcomes(started):
    """{test id: (outcome, message)} of a run that ``_start`` started."""
    proc, report = started
    proc.wait(timeout=240)
    outcomes = {}
    for case in ET.parse(report).getroot().iter('testcase'):
        bad = [e for e in case if e.tag in ('error', 'failure', 'skipped')]
        outcomes[case.get('name')] = (bad[0].tag, bad[0].get('message', '')) if bad else ('ok', '')
    return outcomes


RUNS = {  # test: pytest's arguments
    'test_a_failing_scenario_fails_only_its_own_tests': (),
    'test_k_runs_only_the_selected_scenarios_and_their_needs': ('-k', 'in_process'),
}


@pytest.fixture(scope='module')
def runs(request, tmp_path_factory):
    """``{test name: (folder, started run)}`` for the session's selected tests of this module,
    started together."""
    started = {}
    for item in request.session.items:
        name = getattr(item, 'originalname', None)
        if getattr(item, 'module', None) is request.module and name in RUNS:
            tmp = tmp_path_factory.mktemp(name[5:20])
            started[name] = (tmp, _start(tmp, *RUNS[name]))
    yield started
    for _, (proc, _) in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_failing_scenario_fails_only_its_own_tests(runs):
    outcomes = _outcomes(runs['test_a_failing_scenario_fails_only_its_own_tests'][1])
    assert {k: v[0] for k, v in outcomes.items()} == {
        'test_passes[ok_first]': 'ok',
        'test_passes[after_desync]': 'ok',  # run again in new processes
        'test_passes[after_death]': 'ok',
        'test_passes[in_process]': 'ok',
        'test_fails[both_raise]': 'error',
        'test_fails[needs_broken]': 'error',
        'test_fails[desync]': 'error',
        'test_fails[dies]': 'error',
    }
    assert "scenario 'both_raise' failed" in outcomes['test_fails[both_raise]'][1]
    assert "needs ['both_raise'], which failed" in outcomes['test_fails[needs_broken]'][1]
    assert "scenario 'desync' failed" in outcomes['test_fails[desync]'][1]
    assert "scenario 'dies' failed" in outcomes['test_fails[dies]'][1]


def test_k_runs_only_the_selected_scenarios_and_their_needs(runs):
    tmp_path, started = runs['test_k_runs_only_the_selected_scenarios_and_their_needs']
    outcomes = _outcomes(started)
    assert outcomes == {'test_passes[in_process]': ('ok', '')}
    records = tmp_path / 'base' / 'demo0' / '.scenarios'
    ran = {p.name.split('.')[0] for p in records.glob('*.pkl')}
    assert ran == {'ok_first', 'in_process'}


def test_a_rank_beyond_a_needs_spawn_gets_none_once_the_need_succeeded(tmp_path):
    """A 4-rank scenario needing a 2-rank one (in the test process: the records only)."""
    from scenarios import Scenarios, _read, _record_path, _run_one, _write

    s = Scenarios(two=dict(nproc=2), four=dict(nproc=4))
    s.add('two', name='saved')(lambda tmp: None)
    s.add('four', name='user', needs=['saved'])(lambda tmp, saved: saved)
    _record_path(str(tmp_path), 'x', 0).parent.mkdir()
    for rank in (0, 1):
        _write(str(tmp_path), 'saved', rank, ('ok', f'rank {rank}'))
    _run_one(s, 'user', str(tmp_path), rank=1)  # a rank the need had: its own value
    assert _read(str(tmp_path), 'user', 1) == ('ok', 'rank 1')
    _run_one(s, 'user', str(tmp_path), rank=3)  # beyond the need's ranks: None
    assert _read(str(tmp_path), 'user', 3) == ('ok', None)
    _write(str(tmp_path), 'saved', 1, ('error', 'broke'))
    _run_one(s, 'user', str(tmp_path), rank=2)  # one of the need's ranks failed: not run
    assert _read(str(tmp_path), 'user', 2) == ('error', "not run: it needs ['saved'], which failed")
