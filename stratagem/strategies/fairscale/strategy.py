"""ShardedDDPStrategy: fairscale's ZeRO-2 data parallelism (OSS + ShardedDataParallel).

Each rank keeps the optimizer state of its own share of the parameters (``OSS``) and
receives, at the end of backward, only the reduced gradients of that share
(``ShardedDataParallel``); after the step the updated shares are broadcast. Training
equals DDP's. fairscale is in maintenance: FSDPStrategy (torch FSDP) is the recommended
sharded backend; this one is for fairscale users and CPU (gloo) runs.

How ``prepare`` differs from BaseStrategy's sequence (see ``base.py``): the backend wraps
model and optimizer together, so it overrides step 4, ``setup_module_and_optimizers``:
    - ``_wrap_model`` only places the model (and converts norms for ``sync_bn``):
      ShardedDataParallel needs the sharded optimizer, which is built next;
    - ``build_optim_wrapper`` builds the wrapper from the same cfg as under DDP, its
      ``optimizer`` turned into ``dict(type='OSS', optim=<type>, ...)``;
    - the model is wrapped in ShardedDataParallel (the model ``prepare`` returns), and the
      optim wrapper is tied to it:
       zero_grad goes through the wrapper's buckets (torch's ``set_to_none`` default breaks
       them: wrong results from step 2), norm clipping through ``OSS.clip_grad_norm`` (each
       rank holds only its share of the gradients), float16 loss scaling through fairscale's
       ``ShardedGradScaler`` (CUDA; on CPU use bfloat16, which needs no scaler).

Checkpoints: the optimizer state is gathered on rank 0 into the usual single file (a plain
torch optimizer state), so it loads in SingleDeviceStrategy, DDPStrategy and FSDPStrategy,
and theirs (FSDP's sharded directories too) load here; ``OSS.load_state_dict`` re-shards
for any world size.

Fixed against fairscale 0.4.13 (see :mod:`stratagem.strategies.fairscale.oss` for OSS's own):
``ShardedDataParallel.no_sync`` only holds while its context is open, so mmengine's loop
order (forward inside ``optim_context``, backward after it) reduced every micro-batch and
accumulation was wrong (4e-2 off DDP after 5 steps); here the forward decides, as in torch
DDP. After a resume in a process that already ran forwards, the reduce buckets are rebuilt
around the restored gradients.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from stratagem.checkpoint.checkpointer import LoadContext
from stratagem.checkpoint.state_dict import unwrap_model
from stratagem.config import check_keys
from stratagem.registry import STRATEGIES

from ..base import BaseStrategy
from ..capabilities import Capabilities
from ..environment import distributed_env_kwargs
from ..parts import PendingGradsPart
from ..sync_bn import convert_sync_batchnorm

__all__ = ['ShardedDDPStrategy']

_SDP_KEYS = (
    'broadcast_buffers',
    'sync_models_at_startup',
    'reduce_buffer_size',
    'auto_refresh_trainable',
    'reduce_fp16',
    'warn_on_trainable_params_changed',
)
_INSTALL = 'pip install "stratagem[fairscale]"'
_FSDP_REFUSED = (
    "ShardedDDPStrategy: model_wrapper type 'FullyShardedDataParallel' (fairscale's FSDP) is "
    'not offered: {reason}. Use FSDPStrategy (torch FSDP), the recommended sharded backend'
)


@functools.cache
def _sharded_data_parallel() -> type:
    """ShardedDataParallel whose ``no_sync`` acts as torch DDP's; an ImportError naming the
    extra when fairscale is absent."""
    try:
        from fairscale.nn.data_parallel import ShardedDataParallel
    except ImportError as e:
        raise ImportError(
            f'ShardedDDPStrategy needs fairscale: {_INSTALL} (import failed: {e})'
        ) from e

    class ForwardScopedShardedDataParallel(ShardedDataParallel):
        """fairscale's ``no_sync`` holds only while the context is open, so a loop that runs
        the forward inside it and the backward after (``optim_context`` then
        ``update_params``, mmengine's order) would reduce every micro-batch and lose the
        accumulated gradients. Here, as in torch DDP, a forward run inside ``no_sync``
        decides that its backward accumulates, wherever that backward runs."""

        _in_no_sync = False

        @contextlib.contextmanager
        def no_sync(self) -> Iterator[None]:
            previous, self._in_no_sync = self._in_no_sync, True
            try:
                yield
            finally:
                self._in_no_sync = previous

        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            self._should_accumulate_grads = self._in_no_sync
            return super().forward(*inputs, **kwargs)

        def rebind_grads(self) -> None:
            """Rebuild the reduce buckets around the current ``.grad`` tensors, after a
            load replaced them (a stale bucket would reduce the gradients of before)."""
            if self._grad_hooks:  # no buckets before the first forward: nothing to rebind
                self._grad_to_be_reduced = [False] * len(self._grad_to_be_reduced)  # type: ignore[has-type]
                self.refresh_trainable()

    return ForwardScopedShardedDataParallel


def _clip_norm_sharded(
    oss: Any,
    params: list,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Any = None,
) -> torch.Tensor:
    """``clip_grad_norm_``'s signature over OSS's collective norm (``params`` is unused:
    each rank holds only its share of the gradients, OSS knows which)."""
    norm = oss.clip_grad_norm(max_norm, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f'the total {norm_type}-norm of the gradients is {float(norm)} '
            '(clip_grad error_if_nonfinite=True)'
        )
    return norm


@STRATEGIES.register_module()
class ShardedDDPStrategy(BaseStrategy):
    """Data-parallel training with sharded optimizer state and gradients (fairscale).

    The optim wrapper cfg is the one you would give DDPStrategy
    (``optimizer=dict(type='AdamW', lr=...)``, ``accumulative_counts``, ``clip_grad``,
    ``type='AmpOptimWrapper'``, ``paramwise_cfg``); ``type='OSS', optim='AdamW'`` is
    accepted too. One optimizer (no dict of wrappers), built from a cfg.

    Args:
        model_wrapper: kwargs for fairscale's ``ShardedDataParallel``
            (``reduce_buffer_size`` in elements, default 2**23; ``broadcast_buffers``,
            default False as DDPStrategy's; ``sync_models_at_startup``, ``reduce_fp16``,
            ``auto_refresh_trainable``, ``warn_on_trainable_params_changed``). ``type``
            may be ``'ShardedDataParallel'`` or left out; ``'FullyShardedDataParallel'``
            is refused (on CPU it fails in fairscale's CUDA streams).
        sync_bn: ``'torch'`` converts BatchNorm layers as DDPStrategy does.
        **kwargs: BaseStrategy's (``work_dir``, ``env_kwargs``, ...). The launcher
            defaults to the inferred one; a distributed launch is required.
    """

    capabilities = Capabilities(optimizer_from_cfg=True, zero_stage=2, requires=('fairscale',))

    def __init__(
        self, *, model_wrapper: Mapping | None = None, sync_bn: str | None = None, **kwargs: Any
    ) -> None:
        wrapper = dict(model_wrapper or {})
        wrapper_type = wrapper.pop('type', 'ShardedDataParallel')
        if wrapper_type == 'FullyShardedDataParallel':
            reason = (
                'fairscale is in maintenance and its FSDP is not verified with this torch'
                if torch.cuda.is_available()
                else "it needs CUDA (on CPU it fails with KeyError: 'all_gather' from its "
                'CUDA streams)'
            )
            raise ValueError(_FSDP_REFUSED.format(reason=reason))
        if wrapper_type != 'ShardedDataParallel':
            raise ValueError(
                f'ShardedDDPStrategy: model_wrapper type {wrapper_type!r} is not '
                "supported; use type='ShardedDataParallel' or leave type out"
            )
        check_keys(wrapper, _SDP_KEYS, 'ShardedDDPStrategy model_wrapper')
        wrapper.setdefault('broadcast_buffers', False)
        if sync_bn not in (None, 'torch'):
            raise ValueError(
                f"ShardedDDPStrategy: sync_bn={sync_bn!r} is not supported; use 'torch' or None"
            )
        _sharded_data_parallel()  # fail now, before any process group, when fairscale is absent
        self.model_wrapper = wrapper
        self.sync_bn = sync_bn
        env_kwargs = distributed_env_kwargs(kwargs, 'ShardedDDPStrategy')
        super().__init__(env_kwargs=env_kwargs, **kwargs)

    # ------------------------------------------------------------------ prepare
    @override
    def check_prepare_args(
        self,
        optim_wrapper: Any,
        param_scheduler: Any,
        dispatch_kwargs: Mapping | None,
        compile: bool | Mapping,
    ) -> None:
        """BaseStrategy's checks; ``optim_wrapper`` is required (a cfg dict)."""
        super().check_prepare_args(optim_wrapper, param_scheduler, dispatch_kwargs, compile)
        self._check_optim_cfg(optim_wrapper)

    @override
    def setup_module_and_optimizers(
        self, model: nn.Module, optim_wrapper: Any, compile: bool | Mapping = False
    ) -> tuple[nn.Module, Any]:
        """Place (and compile) the model, build the wrapper over an OSS optimizer, then wrap
        the model in ShardedDataParallel, which needs the sharded optimizer, and tie zero_grad,
        clipping and loss scaling to it. The ShardedDataParallel wrapper is the model."""
        module, wrapper = super().setup_module_and_optimizers(model, optim_wrapper, compile)
        sdp = _sharded_data_parallel()(module, wrapper.optimizer, **self.model_wrapper)
        wrapper.optimizer.attach_sharded_ddp(sdp)
        if getattr(wrapper, 'clip_func', None) is torch.nn.utils.clip_grad_norm_:
            wrapper.set_clip_func(functools.partial(_clip_norm_sharded, wrapper.optimizer))
        self._shard_loss_scaler(wrapper)
        return sdp, wrapper

    def _check_optim_cfg(self, cfg: Any) -> None:
        """Refuse, before anything is built, what OSS + ShardedDataParallel cannot run."""
        if cfg is None:
            raise ValueError(
                'ShardedDDPStrategy shards the optimizer, so prepare() needs '
                "optim_wrapper=dict(optimizer=dict(type='AdamW', lr=...)); for a "
                'model without training use DDPStrategy or SingleDeviceStrategy'
            )
        if not isinstance(cfg, Mapping):
            raise TypeError(
                'ShardedDDPStrategy builds the optimizer itself (over the sharded '
                'model), so optim_wrapper must be a cfg dict, got a built '
                f'{type(cfg).__name__}; pass dict(optimizer=dict(type=..., lr=...))'
            )
        optimizer = cfg.get('optimizer')
        if not isinstance(optimizer, Mapping):
            what = (
                'a dict of named wrappers'
                if optimizer is None
                else f'a built {type(optimizer).__name__}'
            )
            raise ValueError(
                f'ShardedDDPStrategy needs one optimizer given as a cfg dict in '
                f'optim_wrapper.optimizer, got {what}; e.g. '
                "optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3))"
            )
        if optimizer.get('type') == 'ZeroRedundancyOptimizer':
            raise ValueError(
                "optim_wrapper.optimizer type 'ZeroRedundancyOptimizer' under "
                'ShardedDDPStrategy: the strategy already shards the state with '
                "OSS; give the plain optimizer, e.g. type='AdamW'"
            )
        from stratagem.optim import AmpOptimWrapper, Fp16MasterWeightsOptimWrapper
        from stratagem.optim.amp_optim_wrapper import resolve_dtype
        from stratagem.registry import OPTIM_WRAPPERS

        wrapper_type = cfg.get('type', 'OptimWrapper')
        cls = OPTIM_WRAPPERS.get(wrapper_type) if isinstance(wrapper_type, str) else wrapper_type
        if isinstance(cls, type) and issubclass(cls, Fp16MasterWeightsOptimWrapper):
            raise TypeError(
                f'optim_wrapper type {cls.__name__!r} under ShardedDDPStrategy: its '
                'optimizer updates fp32 master copies, not the parameters whose '
                'gradients ShardedDataParallel reduces; use OptimWrapper or '
                "AmpOptimWrapper (dtype='bfloat16' on CPU)"
            )
        if (
            isinstance(cls, type)
            and issubclass(cls, AmpOptimWrapper)
            and resolve_dtype(cfg.get('dtype')) == torch.float16
            and self.device.type != 'cuda'
        ):
            raise ValueError(
                "AmpOptimWrapper dtype='float16' under ShardedDDPStrategy needs "
                "CUDA (fairscale's ShardedGradScaler); on CPU use "
                "dtype='bfloat16' (or leave dtype out: bfloat16 is CPU's default)"
            )

    @override
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """Place the model; ShardedDataParallel wraps it once the optimizer exists."""
        if self.device.type == 'cuda':
            torch.cuda.set_device(self.device)  # fairscale's NCCL calls use the current device
        if self.sync_bn == 'torch':
            model, n = convert_sync_batchnorm(model, self.device.type)
            self.logger.info(
                f'ShardedDDPStrategy: {n} BatchNorm layer(s) synchronised across ranks'
            )
        return model.to(self.device)

    @override
    def build_optim_wrapper(self, optim_wrapper: Any, model: nn.Module | None = None) -> Any:
        """The wrapper from the same cfg as under DDP, its ``optimizer`` turned into
        ``dict(type='OSS', optim=<type>, ...)`` over ``model``'s own parameters."""
        self._check_optim_cfg(optim_wrapper)
        model = self.model if model is None else model
        cfg = dict(optim_wrapper)
        optimizer = dict(cfg['optimizer'])
        if optimizer.get('type') != 'OSS':
            optimizer = {'type': 'OSS', 'optim': optimizer.pop('type', None), **optimizer}
        cfg['optimizer'] = optimizer
        wrapper = super().build_optim_wrapper(cfg, model)
        oss = wrapper.optimizer
        from .oss import OSS

        owned = {id(p) for p in model.parameters()}
        if not isinstance(oss, OSS) or any(
            id(p) not in owned for g in oss.param_groups for p in g['params']
        ):
            raise TypeError(
                f'ShardedDDPStrategy: the optim wrapper {type(wrapper).__name__} '
                f"built a {type(oss).__name__} that is not an OSS over the model's "
                'own parameters (a master-weights or custom wrapper?); use '
                'OptimWrapper or AmpOptimWrapper'
            )
        return wrapper

    def _shard_loss_scaler(self, wrapper: Any) -> None:
        """float16: each rank sees only its share of the gradients, so inf/nan must be
        agreed across ranks (fairscale's ShardedGradScaler), else the ranks' steps diverge."""
        scaler = getattr(wrapper, 'loss_scaler', None)
        if scaler is None:
            return
        if self.device.type != 'cuda':
            raise ValueError(
                'float16 loss scaling under ShardedDDPStrategy needs CUDA; on CPU '
                "use AmpOptimWrapper dtype='bfloat16'"
            )
        from fairscale.optim.grad_scaler import ShardedGradScaler

        sharded = ShardedGradScaler()
        sharded.load_state_dict(scaler.state_dict())  # same init scale, growth and backoff
        wrapper.loss_scaler = sharded

    @override
    def unwrap_model(self) -> nn.Module:
        """The plain module inside ShardedDataParallel (and ``torch.compile``)."""
        model = self.model
        if isinstance(model, _sharded_data_parallel()):
            model = model.module  # type: ignore[assignment]
        return unwrap_model(model)

    # -------------------------------------------------------------- checkpoints
    @override
    def pending_grads_part(self) -> PendingGradsPart:
        return ShardedPendingGradsPart(self.optim_wrapper, self.unwrap_model, self.model)


class ShardedPendingGradsPart(PendingGradsPart):
    """The default pending-gradients part; its restore ends by rebuilding
    ShardedDataParallel's reduce buckets around the restored gradients, which replace
    tensors the buckets may already view (after a forward in this process, e.g. a
    roll-back).

    Args:
        optim_wrapper, module: ``PendingGradsPart``'s.
        model: the ShardedDataParallel model.
    """

    def __init__(self, optim_wrapper: Any, module: Callable[[], nn.Module], model: Any) -> None:
        super().__init__(optim_wrapper, module)
        self.model = model

    @override
    def restore(self, value: Any, context: LoadContext) -> None:
        super().restore(value, context)
        if isinstance(self.model, _sharded_data_parallel()):
            self.model.rebind_grads()  # type: ignore[attr-defined]
