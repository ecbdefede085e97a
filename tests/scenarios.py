"""Scenarios: the checks of a distributed test module, spawned together, run and failed apart.

Starting ranks costs seconds (DeepSpeed's more), so a module starts its processes once and
runs its checks inside them. Each check is a *scenario*: a module-level function that runs
in every rank and returns the values its test asserts on. Each scenario's outcome is
recorded on its own: one that raises records its traceback and the next ones still run;
each test names the one scenario whose values it asserts on, so a failure names that
scenario; and a session spawns only the scenarios its selected tests name
(``pytest -k no_sync`` runs ``no_sync`` alone, and what it needs).

In a test module::

    SCENARIOS = Scenarios(ranks=dict(nproc=2, timeout=180))  # one spawn, called 'ranks'

    @SCENARIOS.add('ranks')
    def no_sync(tmp):                  # in every rank; tmp: the module's folder (a str)
        ...
        return {'per_iter': per_iter}  # this rank's values (they must pickle)

    @SCENARIOS.add('ranks', needs=['no_sync'])
    def after(tmp, no_sync):           # runs after its need, with the need's value here
        ...

    @pytest.fixture(scope='module')
    def scenarios(request, tmp_path_factory):
        return SCENARIOS.run(request, tmp_path_factory.mktemp('ddp'))

    @pytest.mark.scenario('no_sync')
    def test_no_sync(scenario):        # the scenario's values, by rank (tests/conftest.py)
        for r in scenario:
            assert r['per_iter'] == [0, 1, 0, 1]

The protocol, in order:

1. ``Scenarios.run`` (the module fixture) takes the scenarios that the session's selected
   tests of the module name (``@pytest.mark.scenario(name)``; a ``{param}`` in the name is
   filled from the test's parameters) and, before them, what they need. It runs the spawns
   in the order the constructor lists them, each once if it has a scenario to run, and in
   each the scenarios in the order they were added. A spawn of ``nproc=0`` runs in the test
   process; the others run through :func:`dist_harness.run_distributed`.
2. In each rank a scenario's outcome, its value or its traceback, is written to
   ``<tmp>/.scenarios/<name>.rank<r>.pkl`` as soon as it ends; a scenario whose need failed
   is not run and records that. The rank then waits until every rank has recorded the
   scenario (``checkin`` s at most): a rank that raised early must not enter the next
   scenario's collectives while another rank still waits in this one's.
3. When the ranks do not all record a scenario (a rank stayed in a collective with a rank
   that raised, or died), the processes are ended; that scenario fails with what the
   harness reported, and the spawn starts again in new processes from the next scenario.
4. A test's ``scenario`` fixture is the scenario's values by rank (a :class:`Ranks`, with
   its needs' values in ``.needs``), or the test fails with the scenario's tracebacks.

``tests/conftest.py`` imports the mark, its ``-k`` keyword and the ``scenario`` fixture from
here (``pytest_configure``, ``pytest_itemcollected``, ``scenario``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from dist_harness import RankFailure, run_distributed

__all__ = ['Scenarios', 'Results', 'Ranks', 'scenario_name', 'scenario']

_NAME = re.compile(r'^[A-Za-z0-9_.\-]+$')  # a scenario's name is part of file names
_RECORDS = '.scenarios'


class Ranks(list):
    """A scenario's values by rank, plus ``name``, ``tmp`` (the module's folder) and ``needs``
    (each needed scenario's :class:`Ranks`, by name)."""

    def __init__(self, name: str, values: Iterable[Any], tmp: Path, needs: dict[str, Ranks]):
        super().__init__(values)
        self.name, self.tmp, self.needs = name, tmp, needs


class _Scenario:
    def __init__(self, name: str, fn: Callable[..., Any], spawn: str, needs: tuple[str, ...]):
        self.name, self.fn, self.spawn, self.needs = name, fn, spawn, needs


class Scenarios:
    """The scenarios of one test module and the spawns they run in.

    Args:
        checkin: seconds a rank that recorded a scenario waits for the other ranks to record
            it too, before it ends its processes (protocol, step 2). Too short costs only a
            new spawn: a rank that was merely late still records the scenario.
        **spawns: ``name=dict(nproc=N, timeout=seconds)``, in the order they run: ``nproc``
            processes started once for the scenarios added to this spawn (0: the test
            process), ``timeout`` for all of them together.
    """

    def __init__(self, checkin: float = 20.0, **spawns: dict[str, Any]) -> None:
        for spawn, options in spawns.items():
            unknown = set(options) - {'nproc', 'timeout'}
            if unknown or 'nproc' not in options:
                raise ValueError(f'spawn {spawn!r}: give nproc (and timeout), got {options}')
        self.spawns = {k: dict(dict(timeout=120.0), **v) for k, v in spawns.items()}
        self.checkin = checkin
        self.scenarios: dict[str, _Scenario] = {}

    def add(
        self, spawn: str, name: str | None = None, needs: Iterable[str] = ()
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: the function is the scenario ``name`` (default: its own name) of
        ``spawn``, called as ``fn(tmp, **{need: that need's value on this rank})``. A need
        is added before (in this spawn or an earlier one). A need of one rank (or of the test
        process) gives its value to every rank; a rank that a need's spawn did not have (a
        4-rank scenario needing a 2-rank one) gets None, once the need succeeded on all of
        its ranks. Returns the function."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            key = name or fn.__name__.lstrip('_')
            if spawn not in self.spawns:
                raise ValueError(f'scenario {key!r}: unknown spawn {spawn!r}: {list(self.spawns)}')
            if not _NAME.match(key) or key in self.scenarios:
                raise ValueError(f'scenario name {key!r} is taken or not [A-Za-z0-9_.-]+')
            order = list(self.spawns)
            for need in needs:
                before = self.scenarios.get(need)
                if before is None or order.index(before.spawn) > order.index(spawn):
                    raise ValueError(f'scenario {key!r} needs {need!r}: add that one first')
            self.scenarios[key] = _Scenario(key, fn, spawn, tuple(needs))
            return fn

        return register

    # ------------------------------------------------------------------ the test process
    def run(self, request: pytest.FixtureRequest, tmp: Path) -> Results:
        """Run the scenarios that the session's selected tests of ``request.module`` name,
        with their needs (protocol, steps 1 and 3); the module fixture returns this."""
        wanted = set()
        for item in request.session.items:
            name = scenario_name(item)
            if name is None or getattr(item, 'module', None) is not request.module:
                continue
            if name not in self.scenarios:
                raise ValueError(
                    f'{item.nodeid} names scenario {name!r}, which is not one of '
                    f'{request.module.__name__}: {sorted(self.scenarios)}'
                )
            wanted.add(name)
        for name in reversed(list(self.scenarios)):  # needs were added before their users
            if name in wanted:
                wanted.update(self.scenarios[name].needs)
        results = Results(self, Path(tmp))
        (results.tmp / _RECORDS).mkdir(exist_ok=True)
        for spawn, options in self.spawns.items():
            names = [n for n in self.scenarios if n in wanted and self.scenarios[n].spawn == spawn]
            if not names:
                continue
            if options['nproc'] == 0:
                for name in names:
                    _run_one(self, name, str(tmp), rank=0)
            else:
                self._spawn(request.module, spawn, names, results)
        return results

    def _spawn(self, module: Any, spawn: str, names: list[str], results: Results) -> None:
        nproc, timeout = self.spawns[spawn]['nproc'], self.spawns[spawn]['timeout']
        attribute = next(k for k, v in vars(module).items() if v is self)
        for attempt in range(len(names)):  # each attempt ends at least one scenario
            failure = None
            try:
                run_distributed(
                    _run_in_rank,
                    nproc=nproc,
                    args=(
                        module.__name__,
                        module.__file__,
                        attribute,
                        names,
                        str(results.tmp),
                        f'{spawn}.{attempt}',
                    ),
                    timeout=timeout,
                )
            except (RankFailure, TimeoutError) as err:
                failure = err
            rest = [n for n in names if not results.recorded(n, nproc)]
            if not rest:
                return
            said = str(failure) if failure else 'the processes ended without recording it'
            if isinstance(failure, RankFailure):
                said += f'\n--- output of rank {failure.rank} (tail) ---\n' + failure.output[-3000:]
            if results.started(rest[0]):  # the processes failed in it: it fails, alone
                results.failed[rest[0]] = f'the processes of spawn {spawn!r} failed in it:\n{said}'
                rest = rest[1:]
            elif not any(results.started(n) for n in names):  # the spawn itself failed
                for name in rest:
                    results.failed[name] = f'spawn {spawn!r} failed before any scenario:\n{said}'
                return
            names = rest  # in new processes
            if not names:
                return


class Results:
    """What ``Scenarios.run`` found: ``results[name]`` is the scenario's :class:`Ranks`, or
    the test fails with the scenario's error. ``tmp``: the module's folder."""

    def __init__(self, scenarios: Scenarios, tmp: Path) -> None:
        self.scenarios, self.tmp = scenarios, tmp
        self.failed: dict[str, str] = {}  # scenario -> what the harness said
        self._read: dict[str, Ranks] = {}  # each record is unpickled once

    def _nproc(self, name: str) -> int:
        return max(1, self.scenarios.spawns[self.scenarios.scenarios[name].spawn]['nproc'])

    def recorded(self, name: str, nproc: int) -> bool:
        return all(_record_path(str(self.tmp), name, r).exists() for r in range(nproc))

    def started(self, name: str) -> bool:
        return any(
            _record_path(str(self.tmp), name, r, 'started').exists()
            for r in range(self._nproc(name))
        )

    def __getitem__(self, name: str) -> Ranks:
        if name not in self.scenarios.scenarios:
            raise KeyError(f'no scenario {name!r}: {sorted(self.scenarios.scenarios)}')
        if name in self._read:
            return self._read[name]
        outcomes = [_read(str(self.tmp), name, r) for r in range(self._nproc(name))]
        errors = [
            f'--- rank {r} ---\n{detail}'
            for r, (status, detail) in enumerate(outcomes)
            if status != 'ok'
        ]
        if name in self.failed or errors:
            said = self.failed.get(name, '')
            pytest.fail(
                f'scenario {name!r} failed:\n' + '\n'.join(errors) + (f'\n{said}' if said else ''),
                pytrace=False,
            )
        needs = {n: self[n] for n in self.scenarios.scenarios[name].needs}
        self._read[name] = Ranks(name, [value for _, value in outcomes], self.tmp, needs)
        return self._read[name]


def scenario_name(item: pytest.Item) -> str | None:
    """The scenario a test names with ``@pytest.mark.scenario(name)``, its ``{param}``s
    filled from the test's parameters; None without the mark."""
    mark = item.get_closest_marker('scenario')
    if mark is None:
        return None
    callspec = getattr(item, 'callspec', None)
    return mark.args[0].format(**callspec.params) if callspec else mark.args[0]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        'markers',
        'scenario(name): the scenario of the module (tests/scenarios.py) whose values the test '
        "asserts on; '{param}' in the name is the test's parameter",
    )


def pytest_itemcollected(item: pytest.Item) -> None:
    name = scenario_name(item)
    if name is not None:  # `pytest -k <scenario>` selects the tests of that scenario
        item.extra_keyword_matches.add(name)


@pytest.fixture
def scenario(request: pytest.FixtureRequest, scenarios: Results) -> Ranks:
    """The values by rank of the scenario the test names with ``@pytest.mark.scenario``,
    from the module's ``scenarios`` fixture (``Scenarios.run``); fails the test with the
    scenario's error instead when it raised."""
    name = scenario_name(request.node)
    if name is None:
        raise ValueError(f'{request.node.nodeid}: mark it with @pytest.mark.scenario(name)')
    return scenarios[name]


# ------------------------------------------------------------------------ every rank
def _record_path(tmp: str, name: str, rank: int, kind: str = 'pkl') -> Path:
    return Path(tmp, _RECORDS, f'{name}.rank{rank}.{kind}')


def _write(tmp: str, name: str, rank: int, outcome: tuple[str, Any]) -> None:
    path = _record_path(tmp, name, rank)
    try:
        blob = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - a value that does not pickle is the scenario's error
        blob = pickle.dumps(('error', f'its value does not pickle:\n{traceback.format_exc()}'))
    path.with_suffix('.tmp').write_bytes(blob)
    os.replace(path.with_suffix('.tmp'), path)  # a reader sees a whole record or none


def _read(tmp: str, name: str, rank: int) -> tuple[str, Any]:
    path = _record_path(tmp, name, rank)
    if not path.exists():
        return 'missing', 'no record: the rank did not finish the scenario'
    return pickle.loads(path.read_bytes())


def _run_one(scenarios: Scenarios, name: str, tmp: str, rank: int) -> None:
    """Run scenario ``name`` in this process as ``rank``; record its outcome."""
    _record_path(tmp, name, rank, 'started').touch()
    scenario = scenarios.scenarios[name]
    values, missing = {}, []
    for need in scenario.needs:
        nproc = max(1, scenarios.spawns[scenarios.scenarios[need].spawn]['nproc'])
        if nproc == 1 or rank < nproc:
            status, value = _read(tmp, need, rank if nproc > 1 else 0)
        else:  # the need ran on fewer ranks: this rank has no value of it
            failed = [r for r in range(nproc) if _read(tmp, need, r)[0] != 'ok']
            status, value = ('error' if failed else 'ok'), None
        if status != 'ok':
            missing.append(need)
        values[need] = value
    if missing:
        outcome = ('error', f'not run: it needs {missing}, which failed')
    else:
        try:
            outcome = ('ok', scenario.fn(tmp, **values))
        except Exception:  # noqa: BLE001 - recorded; the test of the scenario reports it
            outcome = ('error', traceback.format_exc())
    _write(tmp, name, rank, outcome)


def _run_in_rank(
    module_name: str, file: str, attribute: str, names: list[str], tmp: str, attempt: str
) -> None:
    """A spawn's ranks (through run_distributed): each scenario, then the check-in. A rank
    that gives up on the check-in marks these processes abandoned: the other ranks start no
    further scenario, which the test process runs again in new processes."""
    scenarios = getattr(_import(module_name, file), attribute)
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    abandoned = Path(tmp, _RECORDS, f'{attempt}.abandoned')
    for name in names:
        if abandoned.exists():
            return
        _run_one(scenarios, name, tmp, rank)
        deadline = time.monotonic() + scenarios.checkin
        while not all(_record_path(tmp, name, r).exists() for r in range(world)):
            if abandoned.exists():
                return
            if time.monotonic() > deadline:
                late = [r for r in range(world) if not _record_path(tmp, name, r).exists()]
                abandoned.touch()  # before the group goes: the others must not go on in it
                raise RuntimeError(
                    f'scenario {name!r}: ranks {late} did not record it within '
                    f'{scenarios.checkin:g} s of rank {rank} (waiting in a collective with a '
                    'rank that raised?); the next scenarios run in new processes'
                )
            time.sleep(0.01)


def _import(module_name: str, file: str) -> Any:
    """The test module, as run_distributed finds a function's module in a rank."""
    try:
        return importlib.import_module(module_name)
    except ImportError:
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        return module
