"""#42: the kill-during-upload soak (slow tier). A process saving an 8 MiB checkpoint to the
real local S3 server after every iteration is SIGKILLed at a random moment, again and
again, until at least 20 kills fell inside a save (between its ``saving N`` and ``saved N``
lines: the local commit, the upload, the manifest, the pointer, the retention). After every
kill: the pointer names a checkpoint whose manifest lists it, every committed checkpoint
loads and verifies, the automatic resume picks the pointed one. Each restart resumes from
the bucket; the last one runs to the end, and its final state equals the uninterrupted
run's byte for byte; no upload debris is left."""

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stratagem.checkpoint import location
from stratagem.checkpoint.store_debris import find_debris

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / 'tests' / 'soak_upload_child.py'
MID_SAVE_KILLS = 20


def _start(prefix, max_iters, work_dir, out):
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'OMP_NUM_THREADS': '1'}
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), prefix, str(max_iters), str(work_dir), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip('\n'))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, lines, reader


def _wait_for(lines, proc, prefix, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(line.startswith(prefix) for line in lines):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    raise AssertionError(f'no {prefix!r} line from the child: {lines[-20:]}')


def _protocol(lines):
    """The child's own lines (its log lines share the pipe)."""
    return [line for line in lines if line.split(' ')[0] in {'resumed', 'saving', 'saved', 'done'}]


def _check_untorn(prefix):
    """The pointer on a committed checkpoint; every committed one verifies and loads."""
    committed = [c.url for c in location.list_checkpoints(prefix)]
    pointer = location.read_pointer(prefix)
    if pointer is not None:
        assert pointer in committed, (pointer, committed)
        assert location.find_latest(prefix) == pointer
    for url in committed:
        assert location.load_file(url)['meta']['iter'] == int(url.rsplit('_', 1)[1][:-4])
    return pointer


@pytest.mark.slow
def test_sigkill_at_random_points_of_uploads_never_tears_a_checkpoint(s3, tmp_path):
    from soak_upload_child import run

    prefix = f'{s3}/soak'
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    work_dir, out = tmp_path / 'work', tmp_path / 'final.bin'
    mid_save, kills, positions = 0, 0, []
    while mid_save < MID_SAVE_KILLS:
        assert kills < 4 * MID_SAVE_KILLS, f'seed {seed}: too few kills inside a save {positions}'
        proc, lines, reader = _start(prefix, 10_000, work_dir, out)
        try:
            _wait_for(lines, proc, 'resumed')
            time.sleep(rng.uniform(0.0, 2.0))
        finally:
            proc.kill()
            proc.wait()
            reader.join(timeout=10)
        assert proc.returncode == -9, lines[-20:]
        kills += 1
        said = _protocol(lines)
        last = said[-1] if said else ''
        positions.append(last)
        mid_save += last.startswith('saving')
        _check_untorn(prefix)

    pointer = _check_untorn(prefix)
    assert pointer is not None, f'seed {seed}: nothing was ever committed: {positions}'
    end = int(pointer.rsplit('_', 1)[1][:-4]) + 3
    proc, lines, reader = _start(prefix, end, work_dir, out)
    assert proc.wait(timeout=300) == 0, lines[-30:]
    reader.join(timeout=10)
    said = _protocol(lines)
    assert said[0] == f'resumed {end - 3}' and said[-1] == 'done', lines
    assert out.read_bytes() == run(None, end, str(tmp_path / 'reference'))
    assert location.read_pointer(prefix) == f'{prefix}/iter_{end}.pth'
    assert find_debris(prefix) == []
    print(f'soak: {kills} SIGKILLs, {mid_save} inside a save, 0 torn (seed {seed}): {positions}')
