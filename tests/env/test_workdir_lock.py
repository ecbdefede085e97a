"""``work_dir/.stratagem.lock``: one run at a time, a dead holder taken over with a warning,
another host's claim refused unless forced, the same run let in."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

from stratagem.env import workdir_lock
from stratagem.env.workdir_lock import LOCK_NAME, TOKEN_ENV, WorkDirBusyError, WorkDirLock

HOLD = """
import sys
import time
from stratagem.env.workdir_lock import WorkDirLock
lock = WorkDirLock(sys.argv[1]).acquire()
print('held', flush=True)
sys.stdin.readline()
lock.release()
"""


@pytest.fixture()
def holder(tmp_path):
    """A child process holding the lock on ``tmp_path / 'w'`` until its stdin closes."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, 'SLURM_JOB_ID')}
    proc = subprocess.Popen(
        [sys.executable, '-c', HOLD, str(tmp_path / 'w')],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == 'held'
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture(autouse=True)
def no_run_ids(monkeypatch):
    for name in (TOKEN_ENV, 'SLURM_JOB_ID', 'SLURM_RESTART_COUNT', 'TORCHELASTIC_RUN_ID'):
        monkeypatch.delenv(name, raising=False)


def _read(path):
    with open(path) as f:
        return json.load(f)


def _claim(work_dir, **fields):
    os.makedirs(work_dir, exist_ok=True)
    claim = dict(host='other-node', pid=4242, started=0.0, token='x', **fields)
    with open(os.path.join(work_dir, LOCK_NAME), 'w') as f:
        json.dump(claim, f)


def test_a_second_process_is_refused_naming_the_holder_then_gets_it(tmp_path, holder):
    work_dir = str(tmp_path / 'w')
    with pytest.raises(WorkDirBusyError) as err:
        WorkDirLock(work_dir).acquire()
    message = str(err.value)
    assert f'pid {holder.pid}' in message and socket.gethostname() in message
    assert '--work-dir' in message and '--force-unlock' in message
    assert os.listdir(work_dir) == [LOCK_NAME]  # the refused run wrote nothing
    # --force-unlock never breaks a live holder on this host
    with pytest.raises(WorkDirBusyError):
        WorkDirLock(work_dir, force=True).acquire()
    holder.communicate('\n')  # released at its end: the next one takes it without a word
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with WorkDirLock(work_dir) as lock:
            claim = _read(lock.path)
            assert (claim['pid'], claim['host']) == (os.getpid(), socket.gethostname())
    assert not os.path.exists(lock.path)  # released: no claim left


def test_a_killed_holder_is_taken_over_with_a_warning_naming_it(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with pytest.warns(UserWarning, match=f'ended without releasing it: host .* pid {holder.pid}'):
        WorkDirLock(str(tmp_path / 'w')).acquire().release()


def test_another_hosts_claim_is_refused_unless_forced(tmp_path):
    work_dir = str(tmp_path / 'w')
    _claim(work_dir)
    with pytest.raises(WorkDirBusyError, match='host other-node pid 4242.*another host'):
        WorkDirLock(work_dir).acquire()
    with pytest.warns(UserWarning, match='may still run on another host.*other-node pid 4242'):
        lock = WorkDirLock(work_dir, force=True).acquire()
    assert _read(lock.path)['pid'] == os.getpid()
    lock.release()


def test_the_same_run_is_let_in(tmp_path, monkeypatch, holder):
    work_dir = str(tmp_path / 'w')
    # a worker of the run whose parent holds it: shared, releases nothing
    token = _read(os.path.join(work_dir, LOCK_NAME))['token']
    monkeypatch.setenv(TOKEN_ENV, token)
    lock = WorkDirLock(work_dir).acquire()
    assert lock.shared
    lock.release()
    assert _read(lock.path)['pid'] == holder.pid
    monkeypatch.delenv(TOKEN_ENV)
    # a requeued Slurm job takes its own claim over, from another host, without a warning
    other = str(tmp_path / 'slurm')
    _claim(other, slurm_job_id='77', slurm_restart_count='0')
    monkeypatch.setenv('SLURM_JOB_ID', '77')
    monkeypatch.setenv('SLURM_RESTART_COUNT', '1')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        WorkDirLock(other).acquire().release()
    monkeypatch.delenv('SLURM_JOB_ID')
    # a torchrun restart (same run id, this host) takes its dead attempt's claim silently
    _claim(other, torchrun_run_id='r1')
    with open(os.path.join(other, LOCK_NAME), 'r+') as f:
        claim = json.load(f)
        claim['host'] = socket.gethostname()
        f.seek(0), f.truncate(), json.dump(claim, f)
    monkeypatch.setenv('TORCHELASTIC_RUN_ID', 'r1')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        WorkDirLock(other).acquire().release()


def test_without_flock_the_claim_decides(tmp_path, monkeypatch, holder):
    """NFS/Lustre mounts that refuse flock: the O_EXCL file is the claim, a pid alive on
    this host holds it, a dead one is taken over, another host's is refused."""

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, 'No locks available')

    monkeypatch.setattr(workdir_lock.fcntl, 'flock', no_flock)
    work_dir = str(tmp_path / 'w')
    with pytest.raises(WorkDirBusyError, match=f'pid {holder.pid}.*running on this host'):
        WorkDirLock(work_dir).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with pytest.warns(UserWarning, match=f'pid {holder.pid}'):
        lock = WorkDirLock(work_dir).acquire()
    assert not lock.shared and _read(lock.path)['pid'] == os.getpid()
    lock.release()
    assert not os.path.exists(lock.path)  # released: the claim removed
    other = str(tmp_path / 'nfs')
    _claim(other)
    with pytest.raises(WorkDirBusyError, match='other-node'):
        WorkDirLock(other).acquire()
    with pytest.warns(UserWarning, match='other-node'):
        WorkDirLock(other, force=True).acquire().release()


def test_a_run_that_wrote_nothing_leaves_no_work_dir(tmp_path):
    WorkDirLock(str(tmp_path / 'a' / 'b')).acquire().release()
    assert not (tmp_path / 'a').exists()
    _claim(str(tmp_path / 'busy'))
    with pytest.raises(WorkDirBusyError):
        WorkDirLock(str(tmp_path / 'busy')).acquire()
    assert (tmp_path / 'busy' / LOCK_NAME).exists()  # a refusal leaves the claim alone


def test_a_claim_written_just_after_the_flock_is_waited_for(tmp_path):
    """Two elastic agents of one run start together: the second finds the file locked but its
    claim not written yet (empty, then half-written). It waits for the claim and, seeing its
    run's token, shares the lock instead of refusing a blank as another run's."""
    import fcntl
    import threading

    work_dir = tmp_path / 'w'
    work_dir.mkdir()
    path = work_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first agent: locked, nothing written
    claim = json.dumps({'host': socket.gethostname(), 'pid': os.getpid(), 'token': 'rdzv:x'})

    def write_late():
        time.sleep(0.2)
        os.write(fd, claim[:10].encode())  # half a claim first
        time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, claim.encode())

    writer = threading.Thread(target=write_late)
    writer.start()
    started = time.monotonic()
    try:
        lock = WorkDirLock(str(work_dir), run_token='rdzv:x').acquire()
        waited = time.monotonic() - started
        assert lock.shared and 0.35 < waited < 5.0, waited
        lock.release()
        assert json.loads(path.read_text())['token'] == 'rdzv:x'  # the holder's claim stays
        # another run's token is still refused, naming the holder
        with pytest.raises(WorkDirBusyError, match=str(os.getpid())):
            WorkDirLock(str(work_dir), run_token='rdzv:other').acquire()
    finally:
        writer.join()
        os.close(fd)
