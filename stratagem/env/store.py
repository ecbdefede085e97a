"""Store clients of our own for background threads (preemption, watchdog) and the loop's
straggler exchange.

A store client is one socket: a thread that blocks on it (``store.wait``) must not share it
with the training thread. ``clone()`` gives a new connection to the same server with the same
key prefixes (torchrun's ``/worker/attempt_N``), so keys of an earlier attempt that shared the
launcher's store are never read as this one's.
"""

from __future__ import annotations

from typing import Any

__all__ = ['store_client']


def store_client() -> Any:
    """A new client of the default process group's store (a clone; the store itself when it
    cannot be cloned, e.g. a FileStore, which has no socket to share)."""
    from stratagem._torch import default_store

    store = default_store()
    clone = getattr(store, 'clone', None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception:  # noqa: BLE001 - a store type without clone support: share it
        return store


def elastic_attempt_store(timeout: Any = None) -> Any | None:
    """Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``): a client of it
    whose keys live under this attempt's own prefix, for ``init_process_group(store=...)``.

    torch (2.13) keeps the agent's store across restarts without a per-attempt prefix, so a
    restarted worker read the previous attempt's gloo addresses and failed to connect
    ("connectFullMesh failed ... Connection refused"). The prefix names the restart count and
    the world size: a restart after a failure counts up, a scale-up changes the size. None
    outside torchrun's agent store."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    env = os.environ
    if env.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or 'MASTER_PORT' not in env:
        return None
    store = dist.TCPStore(
        env['MASTER_ADDR'],
        int(env['MASTER_PORT']),
        is_master=False,
        timeout=timeout if timeout is not None else timedelta(minutes=30),
    )
    attempt = env.get('TORCHELASTIC_RESTART_COUNT', '0')
    return dist.PrefixStore(f'stratagem/attempt_{attempt}_world_{env["WORLD_SIZE"]}', store)
