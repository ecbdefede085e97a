"""Which ``torch.distributed`` backend a run uses.

``resolve_backend``: the user's choice, checked (nccl needs CUDA), or nccl / gloo by the
machine. ``mmengine_env_kwargs``: an mmengine ``env_cfg`` whose backend the user did not choose
(FlexibleRunner's default and mmengine's config templates say nccl) fitted to this machine.
``fit_runner_env_kwargs``: the same for the ``env_kwargs`` that mmengine's FlexibleRunner hands
a strategy it builds, recognised by their shape (so it works however the strategy is named).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ['fit_runner_env_kwargs', 'mmengine_env_kwargs', 'resolve_backend']

_SAID_BACKEND_FALLBACK: set[str] = set()


def mmengine_env_kwargs(env_cfg: Any, where: str = 'env_cfg') -> dict:
    """An mmengine ``env_cfg`` as strategy ``env_kwargs``, with its backend fitted to this
    machine.

    mmengine's ``FlexibleRunner`` passes ``env_cfg=dict(dist_cfg=dict(backend='nccl'))`` when
    the user gives none, and its config templates write the same: a backend the user did not
    choose. On a machine without CUDA, where nccl cannot run, it becomes gloo and the process
    says so once (a warning naming the key). A backend given to a strategy directly
    (``env_kwargs``) is the user's choice and is never replaced (nccl without CUDA stays an
    error there).
    """
    kwargs = dict(env_cfg or {})
    dist_cfg = dict(kwargs.get('dist_cfg') or {})
    backend = dist_cfg.get('backend')
    if isinstance(backend, str) and 'nccl' in backend.lower() and not torch.cuda.is_available():
        dist_cfg['backend'] = 'gloo'
        kwargs['dist_cfg'] = dist_cfg
        if where not in _SAID_BACKEND_FALLBACK:
            _SAID_BACKEND_FALLBACK.add(where)
            import warnings

            warnings.warn(
                f"{where}.dist_cfg.backend={backend!r} (mmengine's default) needs CUDA, which "
                "this machine lacks: using 'gloo'. Set "
                f"{where}=dict(dist_cfg=dict(backend='gloo')) to say so yourself",
                UserWarning,
                stacklevel=3,
            )
    return kwargs


def fit_runner_env_kwargs(env_kwargs: Any, log_kwargs: Any) -> dict:
    """A strategy's ``env_kwargs``, fitted (``mmengine_env_kwargs``) when mmengine's
    ``FlexibleRunner`` made them from its ``env_cfg``, else as given.

    ``FlexibleRunner.build_strategy`` fills a strategy dict that lacks them with
    ``env_kwargs=dict(launcher=..., randomness=..., **env_cfg)`` and
    ``log_kwargs=dict(log_level=...)``, then builds it, by registered name, scoped name
    (``'stratagem.DDPStrategy'``) or the class object itself (mmengine's pure-Python configs):
    the strategy's own constructor is the one place all three pass. That shape (``launcher``
    and ``randomness`` as the first two keys, and ``log_kwargs`` holding only ``log_level``) is
    what marks them as the runner's; ``env_kwargs`` the user wrote into the strategy dict (or
    passed to the strategy directly) keep their backend, and nccl without CUDA stays an error
    (``resolve_backend``).
    """
    kwargs = dict(env_kwargs or {})
    from_runner = (
        list(kwargs)[:2] == ['launcher', 'randomness']
        and isinstance(log_kwargs, Mapping)
        and list(log_kwargs) == ['log_level']
    )
    return mmengine_env_kwargs(kwargs, 'env_cfg') if from_runner else kwargs


def resolve_backend(backend: str | None) -> str:
    if backend is None:
        return 'nccl' if torch.cuda.is_available() else 'gloo'
    if not isinstance(backend, str) or not backend:
        raise TypeError(
            f'backend must be a non-empty str such as "gloo" or "nccl", got {backend!r}'
        )
    if 'nccl' in backend.lower() and not torch.cuda.is_available():
        raise ValueError(
            f'backend {backend!r} needs CUDA, which is not available here; '
            'use backend="gloo" (or leave backend=None to choose)'
        )
    return backend
