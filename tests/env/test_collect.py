"""collect_env and the `stratagem env` command."""

import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from stratagem.env import collect
from stratagem.env.collect import collect_env

REPO = Path(__file__).resolve().parents[2]


def test_collect_env_keys_and_values():
    env = collect_env()
    assert isinstance(env, OrderedDict)
    assert list(env)[:4] == ['sys.platform', 'Python', 'CUDA available', 'numpy']
    assert env['sys.platform'] == sys.platform
    assert env['CUDA available'] == str(torch.cuda.is_available())
    assert env['PyTorch'] == torch.__version__
    assert {'PyTorch CUDA', 'cuDNN', 'stratagem'} <= set(env)
    assert all(isinstance(v, str) for v in env.values())
    gpu_keys = [k for k in env if k.startswith('GPU ')]
    assert bool(gpu_keys) == torch.cuda.is_available()
    assert 'PyTorch compiling details' in collect_env(details=True)


def test_collect_env_tolerates_missing_tools(monkeypatch):
    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(collect.subprocess, 'run', missing)
    env = collect_env()
    assert 'GCC' not in env and 'NVCC' not in env


def test_collect_env_reports_installed_extras_without_importing_them(monkeypatch):
    monkeypatch.delitem(sys.modules, 'deepspeed', raising=False)
    monkeypatch.setattr(collect, '_version', lambda name: {'deepspeed': '9.9'}.get(name))
    env = collect_env()
    assert env['deepspeed'] == '9.9' and 'fairscale' not in env
    assert 'deepspeed' not in sys.modules


def test_stratagem_env_cli():
    out = subprocess.run(
        [sys.executable, '-m', 'stratagem', 'env'],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    lines = dict(line.split(': ', 1) for line in out.splitlines() if ': ' in line)
    assert lines['PyTorch'] == torch.__version__
    assert lines['sys.platform'] == sys.platform and 'stratagem' in lines
