"""`import stratagem` is cheap and has no side effects (DESIGN.md, style rule 6)."""

import json
import subprocess
import sys

import pytest

# Optional or heavy packages that importing stratagem, or building a SingleDeviceStrategy and
# training a step, must not import: each costs tens of ms and MiB of RSS to users who never
# touch it. A backend that needs one imports it inside the strategy that uses it.
FORBIDDEN = (
    'deepspeed',
    'fairscale',
    'mmengine',
    'mmcv',
    'cv2',
    'matplotlib',
    'tqdm',
    'yaml',
    'accelerate',
    'lightning',
    'transformers',
    'ray',
)

PROBE = r"""
import json, logging, os, sys
env_before = dict(os.environ)
root_handlers = list(logging.getLogger().handlers)
root_level = logging.getLogger().level
import stratagem
heavy = [m for m in FORBIDDEN if m in sys.modules]
print(json.dumps({
    'heavy': heavy,
    'env_changed': sorted(set(os.environ.items()) ^ set(env_before.items())),
    'root_handlers_changed': list(logging.getLogger().handlers) != root_handlers,
    'root_level_changed': logging.getLogger().level != root_level,
    'version': stratagem.__version__,
}))
"""


def test_import_has_no_side_effects():
    out = subprocess.run(
        [sys.executable, '-c', f'FORBIDDEN = {FORBIDDEN!r}\n{PROBE}'],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {
        'heavy': [],
        'env_changed': [],
        'root_handlers_changed': False,
        'root_level_changed': False,
        'version': report['version'],
    }


def test_public_names_resolve_lazily():
    out = subprocess.run(
        [
            sys.executable,
            '-c',
            (
                'import sys, stratagem; a = "stratagem.config" in sys.modules; '
                'stratagem.Config; print(a, "stratagem.config" in sys.modules)'
            ),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out.split() == ['False', 'True']


def test_import_overhead_over_torch_is_small():
    # The goal is < 0.1 s (benchmarks/import_time.py measures it against fresh interpreters).
    # Here: the time `import stratagem` takes once torch is loaded, in the same process, so
    # the variance of torch's own import does not enter; the margin absorbs a busy machine.
    # Three forks of one interpreter that has imported torch (and not stratagem): each
    # imports stratagem from scratch, and torch's import is paid once instead of three times.
    probe = (
        'import os, time, torch\n'
        'for _ in range(3):\n'
        '    pid = os.fork()\n'
        '    if pid == 0:\n'
        '        t = time.perf_counter()\n'
        '        import stratagem\n'
        '        print(time.perf_counter() - t, flush=True)\n'
        '        os._exit(0)\n'
        '    assert os.waitpid(pid, 0)[1] == 0\n'
    )
    out = subprocess.run(
        [sys.executable, '-c', probe], check=True, capture_output=True, text=True
    ).stdout.split()
    times = sorted(float(t) for t in out)
    assert len(times) == 3
    assert times[1] < 0.25, f'import stratagem after torch takes {times[1]:.3f}s (median of 3)'


USE_PROBE = r"""
import json, sys, tempfile
loaded = lambda: {m for m in FORBIDDEN if m in sys.modules}
import torch
from_torch = loaded()  # what torch itself brings (tqdm, through torch.hub) is not ours
import stratagem.strategies, stratagem.optim, stratagem.scheduler, stratagem.checkpoint
import stratagem.env, stratagem.config, stratagem.checkpoint.sharded
after_import = loaded() - from_torch
# the URL side of checkpoints (fsspec behind it) loads when a URL is used
remote = 'stratagem.checkpoint.remote_directory' in sys.modules
from stratagem.strategies import SingleDeviceStrategy
with tempfile.TemporaryDirectory() as work_dir:
    strategy = SingleDeviceStrategy(work_dir=work_dir)
    model, optim_wrapper = strategy.prepare(
        torch.nn.Linear(4, 2), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    with optim_wrapper.optim_context(model):
        loss = model(torch.ones(3, 4)).sum()
    optim_wrapper.update_params(loss)
    strategy.save_checkpoint('one.pth')
    strategy.load_checkpoint(work_dir + '/one.pth')
print(json.dumps({'after_import': sorted(after_import),
                  'after_use': sorted(loaded() - from_torch), 'remote': remote}))
# then the optional backends: registered without their packages imported; built with their
# packages missing (hidden only now, after the checks above), an error naming the extra
import stratagem.strategies.deepspeed.files
from stratagem.registry import OPTIMIZERS, STRATEGIES
from stratagem.strategies import build_strategy
backends = {'imported': sorted(m for m in ('deepspeed', 'fairscale') if m in sys.modules),
            'registered': ['DeepSpeedStrategy' in STRATEGIES, 'OSS' in OPTIMIZERS],
            'errors': []}
sys.modules['deepspeed'] = sys.modules['fairscale'] = None
for make in (lambda: build_strategy(dict(type='DeepSpeedStrategy')),
             lambda: OPTIMIZERS.get('OSS'), lambda: stratagem.strategies.ShardedDDPStrategy()):
    try:
        make()
        backends['errors'].append(None)
    except ImportError as e:
        backends['errors'].append(str(e))
print(json.dumps(backends))
"""


@pytest.fixture(scope='module')
def use_probe():
    """The two JSON lines USE_PROBE prints, from one interpreter (torch's import is paid once
    for both tests of it)."""
    out = subprocess.run(
        [sys.executable, '-c', f'FORBIDDEN = {FORBIDDEN!r}\n{USE_PROBE}'],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.strip().splitlines()[-2:]]


def test_import_and_single_device_use_load_no_optional_package(use_probe):
    """`import stratagem.strategies` (and optim, scheduler, checkpoint, env, config), then a
    SingleDeviceStrategy's prepare, one step and a checkpoint round trip, import none of
    FORBIDDEN (cv2 included when OpenCV is installed; torch's own imports excepted)."""
    assert use_probe[0] == {
        'after_import': [],
        'after_use': [],
        'remote': False,
    }


def test_optional_backends_register_without_their_package_and_name_the_extra(use_probe):
    """DeepSpeedStrategy and fairscale's OSS are registered without importing DeepSpeed or
    fairscale (nor does DeepSpeed's file layout module); without the package, building one
    names the extra to install."""
    assert use_probe[1]['imported'] == [] and use_probe[1]['registered'] == [True, True]
    deepspeed, oss, sharded = use_probe[1]['errors']
    assert deepspeed is not None and 'pip install "stratagem[deepspeed]"' in deepspeed
    assert [e.split(' (')[0] for e in (oss, sharded)] == [
        'OSS and ShardedDDPStrategy need fairscale: pip install "stratagem[fairscale]"',
        'ShardedDDPStrategy needs fairscale: pip install "stratagem[fairscale]"',
    ]
