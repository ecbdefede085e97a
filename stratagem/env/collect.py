"""``collect_env()``: what ``stratagem env`` prints and bug reports quote.

Versions come from package metadata, so reporting deepspeed's version does not import
deepspeed. External tools (nvcc, gcc) run with a timeout and their absence is no error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from importlib import metadata

import torch

_OPTIONAL = ('deepspeed', 'fairscale', 'torchvision', 'mmengine')


def collect_env(details: bool = False) -> OrderedDict[str, str]:
    """Describe the environment as ``{name: text}``, in print order.

    Keys: 'sys.platform', 'Python', 'CUDA available', 'numpy', then (CUDA only) one
    'GPU <ids>' per device name, 'CUDA_HOME'; 'NVCC' and 'GCC' when found; 'PyTorch',
    'PyTorch CUDA', 'cuDNN'; 'deepspeed', 'fairscale', 'torchvision', 'mmengine' when
    installed; 'stratagem'. ``details=True`` adds 'PyTorch compiling details'.
    """
    env: OrderedDict[str, str] = OrderedDict()
    env['sys.platform'] = sys.platform
    env['Python'] = sys.version.replace('\n', '')
    cuda_available = torch.cuda.is_available()
    env['CUDA available'] = str(cuda_available)
    env['numpy'] = _version('numpy') or 'not installed'
    if cuda_available:
        by_name: OrderedDict[str, list[str]] = OrderedDict()
        for index in range(torch.cuda.device_count()):
            by_name.setdefault(torch.cuda.get_device_name(index), []).append(str(index))
        for name, ids in by_name.items():
            env[f'GPU {",".join(ids)}'] = name
    cuda_home = os.environ.get('CUDA_HOME') or os.environ.get('CUDA_PATH')
    if cuda_available:
        env['CUDA_HOME'] = cuda_home or 'not set'
    nvcc = _find_nvcc(cuda_home)
    if nvcc:
        out = _run([nvcc, '-V'])
        release = _first_line(out, 'release') or _last_line(out)
        if release:
            env['NVCC'] = release
    gcc = _first_line(_run(['gcc', '--version']))
    if gcc:
        env['GCC'] = gcc
    env['PyTorch'] = torch.__version__
    env['PyTorch CUDA'] = torch.version.cuda or 'not built with CUDA'
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env['cuDNN'] = str(cudnn) if cudnn else 'not available'
    if details:
        env['PyTorch compiling details'] = torch.__config__.show()
    for dist_name in _OPTIONAL:
        version = _version(dist_name)
        if version:
            env[dist_name] = version
    env['stratagem'] = _version('stratagem') or _own_version()
    return env


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _own_version() -> str:
    from ..version import __version__

    return __version__


def _find_nvcc(cuda_home: str | None) -> str | None:
    if cuda_home:
        candidate = os.path.join(cuda_home, 'bin', 'nvcc')
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which('nvcc')


def _run(cmd: list[str], timeout: float = 10.0) -> str:
    """stdout of ``cmd``, or '' if it is missing, fails or hangs (a broken toolchain)."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ''


def _first_line(text: str, containing: str = '') -> str:
    return next(
        (line.strip() for line in text.splitlines() if line.strip() and containing in line), ''
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ''
