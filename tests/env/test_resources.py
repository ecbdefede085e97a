"""set_resource_limit and setup_multi_processing."""

import logging
import os
import sys

import pytest
import torch.multiprocessing as mp

from stratagem.env import resources, set_resource_limit, setup_multi_processing

resource = pytest.importorskip('resource', reason='no resource module on this platform')


class FakeLimits:
    """Stands in for resource.getrlimit/setrlimit so every (soft, hard) case is testable."""

    def __init__(self, soft, hard):
        self.limits, self.calls = (soft, hard), []

    def getrlimit(self, which):
        return self.limits

    def setrlimit(self, which, limits):
        self.calls.append(limits)
        self.limits = limits


@pytest.mark.parametrize(
    'soft, hard, nofile, expected',
    [
        (1024, 4096, 2048, 2048),  # raised to what was asked
        (1024, 4096, 65536, 4096),  # never above the hard limit
        (4096, 8192, 1024, 4096),  # never lowered
        (1024, resource.RLIM_INFINITY, 65536, 65536),  # unlimited hard limit
        (resource.RLIM_INFINITY, resource.RLIM_INFINITY, 10, resource.RLIM_INFINITY),
    ],
)
def test_set_resource_limit_logic(monkeypatch, soft, hard, nofile, expected):
    fake = FakeLimits(soft, hard)
    monkeypatch.setattr(resource, 'getrlimit', fake.getrlimit)
    monkeypatch.setattr(resource, 'setrlimit', fake.setrlimit)
    assert set_resource_limit(nofile) == expected
    assert fake.limits == (expected, hard)
    assert len(fake.calls) == (1 if expected != soft else 0)


def test_set_resource_limit_real_process():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 256)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        assert set_resource_limit(low + 64) == low + 64
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (low + 64, hard)
        assert set_resource_limit(16) == low + 64  # never lowers
        if hard != resource.RLIM_INFINITY:
            assert set_resource_limit(hard + 1000) == hard
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_set_resource_limit_failure_is_logged_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(resource, 'getrlimit', lambda which: (1024, 4096))

    def refuse(which, limits):
        raise ValueError('not allowed')

    monkeypatch.setattr(resource, 'setrlimit', refuse)
    with caplog.at_level(logging.WARNING, logger='stratagem'):
        assert set_resource_limit(2048) == 1024
    assert 'could not raise RLIMIT_NOFILE from 1024 to 2048' in caplog.text


@pytest.mark.parametrize('bad', [0, -5, 1.5, True, '1024'])
def test_set_resource_limit_rejects(bad):
    with pytest.raises(ValueError, match='nofile must be a positive int'):
        set_resource_limit(bad)


def test_threads_set_only_when_unset_and_distributed(clean_env, caplog):
    clean_env.pop('OMP_NUM_THREADS', None)
    clean_env['MKL_NUM_THREADS'] = '4'  # the user's choice stays
    assert setup_multi_processing(opencv_num_threads=None) == {}
    assert 'OMP_NUM_THREADS' not in os.environ  # not distributed: nothing to do
    with caplog.at_level(logging.INFO, logger='stratagem'):
        changed = setup_multi_processing(opencv_num_threads=None, distributed=True)
    assert changed == {'OMP_NUM_THREADS': '1'}
    assert (os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS']) == ('1', '4')
    assert 'set OMP_NUM_THREADS=1' in caplog.text


def test_mp_start_method(monkeypatch, caplog):
    state = {'method': 'fork'}
    monkeypatch.setattr(mp, 'get_start_method', lambda allow_none=False: state['method'])
    monkeypatch.setattr(
        mp, 'set_start_method', lambda method, force=False: state.update(method=method)
    )
    assert setup_multi_processing('fork', opencv_num_threads=None) == {}
    with caplog.at_level(logging.WARNING, logger='stratagem'):
        changed = setup_multi_processing('spawn', opencv_num_threads=None)
    assert changed == {'mp_start_method': 'spawn'} and state['method'] == 'spawn'
    assert "start method was 'fork'; forcing it to 'spawn'" in caplog.text
    with pytest.raises(ValueError, match="unknown mp_start_method 'thread'; valid"):
        setup_multi_processing('thread')


@pytest.fixture
def fake_cv2(tmp_path, monkeypatch):
    """An importable ``cv2`` package that records its setNumThreads calls."""
    pkg = tmp_path / 'cv2'
    pkg.mkdir()
    (pkg / '__init__.py').write_text('calls = []\nsetNumThreads = calls.append\n')
    monkeypatch.delitem(sys.modules, 'cv2', raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield sys.modules
    sys.modules.pop('cv2', None)


def test_opencv_never_imported_by_default(fake_cv2):
    assert setup_multi_processing() == {}
    assert 'cv2' not in fake_cv2  # installed but unused: not imported, no 20-40 ms, ~25 MiB
    import cv2  # the user's code imports it: then its threads are set to 0

    assert setup_multi_processing() == {'opencv_num_threads': 0} and cv2.calls == [0]
    assert setup_multi_processing(opencv_num_threads=None) == {} and cv2.calls == [0]


def test_opencv_threads_when_the_config_asks(fake_cv2):
    assert setup_multi_processing(opencv_num_threads=2) == {'opencv_num_threads': 2}
    assert fake_cv2['cv2'].calls == [2]
    fake_cv2.pop('cv2')
    assert setup_multi_processing(opencv_num_threads=0) == {'opencv_num_threads': 0}
    assert fake_cv2['cv2'].calls == [0]  # explicit 0 (mmengine configs' mp_cfg) imports it too


def test_opencv_threads_explicit_without_opencv(monkeypatch):
    monkeypatch.delitem(sys.modules, 'cv2', raising=False)
    monkeypatch.setattr(resources.importlib.util, 'find_spec', lambda name: None)
    assert setup_multi_processing(opencv_num_threads=0) == {}


@pytest.mark.parametrize('bad', [-1, 1.5, True, '0'])
def test_opencv_threads_rejects(bad):
    with pytest.raises(ValueError, match='opencv_num_threads must be an int >= 0'):
        setup_multi_processing(opencv_num_threads=bad)
