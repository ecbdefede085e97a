"""get_logger: rank-aware levels, no duplicate handlers, file handlers; print_log; messages
printed once (rank 0) or naming their rank."""

import contextlib
import logging
import uuid
import warnings

import pytest

from stratagem.env import (
    get_logger,
    log_rank_zero,
    print_log,
    rank_prefix,
    warn_per_rank,
    warn_rank_zero,
)


@pytest.fixture
def name():
    """A fresh logger name per test; its handlers are closed afterwards."""
    name = f'stratagem_test_{uuid.uuid4().hex[:8]}'
    yield name
    for logger in (logging.getLogger(name), logging.getLogger(f'{name}.child')):
        for handler in list(logger.handlers):
            handler.close()
            logger.removeHandler(handler)


@contextlib.contextmanager
def bare_root():
    """An unconfigured root logger: pytest's capture handlers set aside for the block.

    A context manager used inside the test, because pytest adds its handlers to the root
    when the test's call phase starts, after fixtures ran.
    """
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = saved


def test_no_duplicate_handlers(clean_env, name, tmp_path):
    with bare_root():
        root_level = logging.getLogger().level
        logger = get_logger(name, log_file=tmp_path / 'a.log')
        assert get_logger(name, log_file=tmp_path / 'a.log') is logger
        get_logger(name)
        console, file = logger.handlers
        assert type(console) is logging.StreamHandler and isinstance(file, logging.FileHandler)
        assert not logger.propagate  # root has no handlers: ours print, nothing twice
        get_logger(name, log_file=tmp_path / 'b.log')
        assert len(logger.handlers) == 3
        child = get_logger(f'{name}.child')  # the parent prints its records: no second copy
        assert child.handlers == [] and child.propagate
        assert logging.getLogger().handlers == [] and logging.getLogger().level == root_level


def test_configured_root_gets_the_records(clean_env, name, caplog):
    # pytest's caplog handler sits on the root: an application that configured logging.
    logger = get_logger(name)
    assert logger.handlers == [] and logger.propagate
    logger.info('hello %s', 'there')
    assert 'hello there' in caplog.text


@pytest.mark.parametrize(
    'env, level',
    [
        ({}, logging.INFO),
        ({'RANK': '0'}, logging.INFO),
        ({'RANK': '1'}, logging.WARNING),
        ({'SLURM_PROCID': '3'}, logging.WARNING),
        ({'OMPI_COMM_WORLD_RANK': '2'}, logging.WARNING),
    ],
)
def test_rank_aware_level(clean_env, name, env, level):
    clean_env.update(env)
    assert get_logger(name).level == level


def test_explicit_level_wins_and_sticks(clean_env, name):
    clean_env['RANK'] = '1'
    assert get_logger(name, log_level='debug').level == logging.DEBUG
    assert get_logger(name).level == logging.DEBUG  # a later plain call keeps it
    assert get_logger(name, log_level=logging.ERROR).level == logging.ERROR
    with pytest.raises(ValueError, match="unknown log_level 'LOUD'"):
        get_logger(name, log_level='LOUD')
    with pytest.raises(ValueError, match="file_mode must be 'w' or 'a', got 'x'"):
        get_logger(name, file_mode='x')


def test_file_handler_writes_rank0_file_and_rank_suffix(clean_env, name, tmp_path):
    log_file = tmp_path / 'logs' / 'run.log'
    logger = get_logger(name, log_file=log_file)
    logger.info('step %d', 7)
    logger.debug('hidden')
    for handler in logger.handlers:
        handler.flush()
    text = log_file.read_text()
    assert 'step 7' in text and 'INFO' in text and 'hidden' not in text

    other = f'{name}.rank1'
    clean_env['RANK'] = '1'
    rank1 = get_logger(other, log_file=log_file)
    rank1.info('quiet')
    assert not (tmp_path / 'logs' / 'run_rank1.log').exists()  # created on the first record
    rank1.warning('loud')
    for handler in rank1.handlers:
        handler.flush()
    assert '[rank 1]' in (tmp_path / 'logs' / 'run_rank1.log').read_text()
    for handler in list(rank1.handlers):
        handler.close()
        rank1.removeHandler(handler)


def test_file_mode_append(clean_env, name, tmp_path):
    log_file = tmp_path / 'run.log'
    log_file.write_text('old line\n')
    logger = get_logger(name, log_file=log_file, file_mode='a')
    logger.warning('new line')
    for handler in logger.handlers:
        handler.flush()
    assert log_file.read_text().startswith('old line\n') and 'new line' in log_file.read_text()


def test_print_log(clean_env, name, capsys, caplog):
    print_log('to stdout')
    assert capsys.readouterr().out == 'to stdout\n'
    print_log('dropped', logger='silent')
    print_log('by name', logger=name, level=logging.WARNING)
    print_log('by logger', logger=logging.getLogger(name))
    assert 'by name' in caplog.text and 'by logger' in caplog.text
    assert 'dropped' not in caplog.text + capsys.readouterr().out
    with pytest.raises(TypeError, match='logger must be a logging.Logger, a logger name'):
        print_log('x', logger=3)


def test_package_child_logger_made_first_still_reaches_the_run_file(clean_env, tmp_path):
    child_name = f'stratagem.review_{uuid.uuid4().hex[:8]}'
    top = logging.getLogger('stratagem')
    saved = (top.handlers[:], top.propagate, top.level)
    try:
        with bare_root():
            child = get_logger(child_name)
            assert child.propagate and not child.handlers  # prints through 'stratagem'
            get_logger('stratagem', log_file=tmp_path / 'run.log')
            child.warning('from child')
        for handler in top.handlers:
            handler.flush()
        assert 'from child' in (tmp_path / 'run.log').read_text()
    finally:
        for handler in top.handlers[:]:
            if handler not in saved[0]:
                handler.close()
                top.removeHandler(handler)
        top.propagate, top.level = saved[1], saved[2]


@pytest.mark.parametrize(
    'env, rank_zero',
    [
        ({}, True),
        ({'RANK': '0', 'WORLD_SIZE': '2'}, True),
        ({'RANK': '1', 'WORLD_SIZE': '2'}, False),
        ({'PMI_RANK': '1', 'PMI_SIZE': '2'}, False),
        ({'MV2_COMM_WORLD_RANK': '1'}, False),
        # mpirun whose daemons srun started: SLURM_PROCID is the daemon's task, not the rank
        ({'SLURM_PROCID': '0', 'OMPI_COMM_WORLD_RANK': '3'}, False),
    ],
)
def test_rank_zero_messages(clean_env, name, env, rank_zero, caplog):
    clean_env.update(env)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        warn_rank_zero('same on every rank', DeprecationWarning)
    assert [(str(w.message), w.category, w.filename) for w in caught] == (
        [('same on every rank', DeprecationWarning, __file__)] if rank_zero else []
    )
    logger = logging.getLogger(name)
    with caplog.at_level(logging.INFO, logger=name):
        log_rank_zero(logger, logging.WARNING, 'set %s=1', 'X')
    assert caplog.messages == (['set X=1'] if rank_zero else [])


@pytest.mark.parametrize(
    'env, prefix',
    [
        ({}, ''),
        ({'RANK': '0', 'WORLD_SIZE': '1'}, ''),
        ({'RANK': '0', 'WORLD_SIZE': '2'}, '[rank 0] '),
        ({'SLURM_PROCID': '3', 'SLURM_STEP_NUM_TASKS': '4'}, '[rank 3] '),
        ({'OMPI_COMM_WORLD_RANK': '1', 'OMPI_COMM_WORLD_SIZE': '2'}, '[rank 1] '),
    ],
)
def test_per_rank_messages_name_the_rank(clean_env, env, prefix):
    clean_env.update(env)
    assert rank_prefix() == prefix
    with pytest.warns(UserWarning) as caught:
        warn_per_rank('cannot read /nfs/ckpt')
    assert str(caught[0].message) == f'{prefix}cannot read /nfs/ckpt'


def test_rank_prefix_is_not_doubled(clean_env, name, tmp_path):
    clean_env.update(RANK='2', WORLD_SIZE='4')
    with bare_root():
        logger = get_logger(name, log_file=tmp_path / 'run.log')
        logger.warning('plain')
        logger.warning('%shost-specific', rank_prefix())
    for handler in logger.handlers:
        handler.flush()
    lines = (tmp_path / 'run_rank2.log').read_text().splitlines()
    assert lines[0].startswith('[rank 2] ') and lines[0].endswith('WARNING: plain')
    assert lines[1].endswith('WARNING: [rank 2] host-specific') and lines[1].count('[rank') == 1


def test_a_level_given_to_every_rank_prints_rank_zeros_lines_once(
    clean_env, name, tmp_path, capsys
):
    """mmengine's runner gives every rank log_level='INFO': its banner (config, hook table)
    prints on rank 0's console only; a rank > 0 writes it to its own file and prints its
    warnings."""
    clean_env.update(RANK='1', WORLD_SIZE='2')
    log_file = tmp_path / 'run.log'
    with bare_root():
        logger = get_logger(name, log_file=log_file, log_level='INFO')
        logger.info('Config: ...')
        logger.warning('about rank 1')
    for handler in logger.handlers:
        handler.flush()
    err = capsys.readouterr().err
    assert 'Config' not in err and '[rank 1]' in err and 'about rank 1' in err
    assert 'Config: ...' in (tmp_path / 'run_rank1.log').read_text()


def test_the_log_directory_is_made_with_the_first_record(clean_env, name, tmp_path):
    from stratagem.env.logging import log_to_files

    log_file = tmp_path / 'logs' / 'run.log'
    with bare_root():
        logger = get_logger(name, log_file=log_file)
        assert not log_file.parent.exists()  # a run that fails before it logs leaves nothing
        log_to_files(logger, logging.INFO, 'run ended: finished')
        logger.debug('below the level')
    for handler in logger.handlers:
        handler.flush()
    assert log_file.read_text().splitlines()[-1].endswith('INFO: run ended: finished')


def test_the_run_end_goes_to_the_files_the_run_opened(clean_env, name, tmp_path):
    """The error line of a run goes to its own log file, not to one a run before it in the
    process left open, nor to the console."""
    from stratagem.env.logging import run_end_logged

    with bare_root():
        logger = get_logger(name, log_file=tmp_path / 'before.log')
        logger.info('the run before')
        with pytest.raises(ValueError), run_end_logged(logger):
            get_logger(name, log_file=tmp_path / 'run.log').info('this run')
            raise ValueError('a bad\n  value')
    for handler in logger.handlers:
        handler.flush()
    assert 'run ended' not in (tmp_path / 'before.log').read_text()
    last = (tmp_path / 'run.log').read_text().splitlines()[-1]
    assert last.endswith('ERROR: run ended: error: ValueError: a bad value')
