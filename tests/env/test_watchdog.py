"""The watchdog's verdicts from its heartbeat thread, on a store of our own (no processes):
a rank that got a termination signal while a peer is silent ends at once, naming the peer;
without the signal it waits for the process group's timeout plus the grace period."""

import threading
import time

import stratagem.env.watchdog as watchdog_module
from stratagem.env.watchdog import Watchdog


class _Store:
    """The calls the watchdog makes on a c10d store; rank 1 posted one beat, then nothing."""

    def __init__(self):
        self.values = {'stratagem/watchdog/1': b'1 8 forward, backward, update'}

    def set(self, key, value):
        self.values[key] = value.encode()

    def check(self, keys):
        return all(k in self.values for k in keys)

    def multi_get(self, keys):
        return [self.values[k] for k in keys]

    def get(self, key):
        return self.values[key]


def _run(signalled, monkeypatch, seconds, grace=30.0):
    ended = []
    monkeypatch.setattr(
        watchdog_module, '_hard_exit', lambda verdict, signalled=False: ended.append(verdict)
    )
    dog = Watchdog(1.0, grace=grace, signalled=signalled)  # beat 0.1 s, silent after 0.5 s
    dog.rank, dog.world_size, dog._store = 0, 2, _Store()
    dog.at(9, 'saving a checkpoint')
    thread = threading.Thread(target=dog._run, daemon=True)
    start = time.monotonic()
    thread.start()
    while not ended and time.monotonic() - start < seconds:
        time.sleep(0.02)
    dog._stop.set()
    thread.join()
    return ended, time.monotonic() - start


def test_a_signal_while_a_peer_is_silent_ends_the_rank_at_once(monkeypatch):
    ended, took = _run(lambda: 'SIGTERM', monkeypatch, 10)
    assert ended and took < 5, (ended, took)
    assert ended[0].startswith('SIGTERM received while rank 1 (no heartbeat for ')
    assert 'rank 0 was waiting in iteration 9 (saving a checkpoint)' in ended[0]
    assert ended[0].endswith('no checkpoint can be committed without it')


def test_without_a_signal_a_silent_peer_is_waited_for_until_timeout_plus_grace(monkeypatch):
    # timeout 1 s + grace 1 s: the rank ends only once the peer has been silent (and this
    # rank's main thread has not moved) for 2 s, and then within a few beats (0.1 s each)
    ended, took = _run(lambda: None, monkeypatch, 10, grace=1.0)
    assert ended, took
    assert 2.0 <= took < 3.5, took
    assert ended[0].startswith('rank 1 (no heartbeat for ')
    assert ended[0].endswith(
        'rank 0 was waiting in iteration 9 (saving a checkpoint), which needs it'
    )
