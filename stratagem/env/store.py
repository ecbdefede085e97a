"""Store clients of our own for background threads (preemption, watchdog).

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
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    clone = getattr(store, 'clone', None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception:  # noqa: BLE001 - a store type without clone support: share it
        return store
