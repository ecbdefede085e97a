"""`import stratagem` is cheap and has no side effects (DESIGN.md, style rule 6)."""
import json
import subprocess
import sys

PROBE = r'''
import json, logging, os, sys
env_before = dict(os.environ)
root_handlers = list(logging.getLogger().handlers)
root_level = logging.getLogger().level
import stratagem
heavy = [m for m in ('deepspeed', 'fairscale', 'matplotlib', 'mmengine') if m in sys.modules]
print(json.dumps({
    'heavy': heavy,
    'env_changed': sorted(set(os.environ.items()) ^ set(env_before.items())),
    'root_handlers_changed': list(logging.getLogger().handlers) != root_handlers,
    'root_level_changed': logging.getLogger().level != root_level,
    'version': stratagem.__version__,
}))
'''


def test_import_has_no_side_effects():
    out = subprocess.run([sys.executable, '-c', PROBE], check=True, capture_output=True,
                         text=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {'heavy': [], 'env_changed': [], 'root_handlers_changed': False,
                      'root_level_changed': False, 'version': report['version']}


def test_public_names_resolve_lazily():
    out = subprocess.run([sys.executable, '-c', (
        'import sys, stratagem; a = "stratagem.config" in sys.modules; '
        'stratagem.Config; print(a, "stratagem.config" in sys.modules)')],
        check=True, capture_output=True, text=True).stdout
    assert out.split() == ['False', 'True']


def test_import_overhead_over_torch_is_small():
    # The goal is < 0.1 s (benchmarks/import_time.py measures it against fresh interpreters).
    # Here: the time `import stratagem` takes once torch is loaded, in the same process, so
    # the variance of torch's own import does not enter; the margin absorbs a busy machine.
    probe = ('import time, torch; t = time.perf_counter(); import stratagem; '
             'print(time.perf_counter() - t)')
    times = sorted(float(subprocess.run([sys.executable, '-c', probe], check=True,
                                        capture_output=True, text=True).stdout.split()[-1])
                   for _ in range(3))
    assert times[1] < 0.25, f'import stratagem after torch takes {times[1]:.3f}s (median of 3)'
