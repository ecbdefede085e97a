"""DeepSpeedStrategy: ZeRO 0–3 through ``deepspeed.initialize``, one source of truth per setting.

mmengine's keyword arguments build unchanged. Differences from ``mmengine._strategy.
DeepSpeedStrategy``, each a fix:

- Accumulation and clipping come from the optim wrapper (:class:`~stratagem.optim.
  DeepSpeedOptimWrapper`); DeepSpeed's ``gradient_accumulation_steps`` and
  ``gradient_clipping`` are derived from it and a disagreeing value is an error naming both
  (mmengine's keyword silently wins, and DeepSpeed's default ``gradient_clipping`` is 1.0, so
  an unset value clips; ours is written explicitly, 0 without ``clip_grad``).
- The micro batch is ``dispatch_kwargs['train_micro_batch_size_per_gpu']`` (the data
  loader's); the strategy keyword is accepted when it agrees, and feeds ``auto_scale_lr``,
  which mmengine's DeepSpeedStrategy never applies.
- Schedulers are ours, built on the client optimizer whose ``param_groups`` the ZeRO
  optimizer shares; they step as the loop steps them and the engine reads the lr at each
  update only (DeepSpeed-config ``optimizer`` / ``scheduler`` sections are refused).
- Checkpoints follow stratagem's directory protocol (``checkpoint.py``),
  asynchronously too (``async_checkpoint=True``).

Prepare sequence: build model → ``init_weights`` → device → (compile ``forward`` in place) →
build the optim wrapper over the plain module → derive and check the DeepSpeed config →
``deepspeed.initialize`` with the torch optimizer → ``auto_scale_lr`` (the ZeRO optimizer
shares the torch optimizer's ``param_groups``) → schedulers.
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.storage import CheckpointStorage

from ..base import BaseStrategy
from ..capabilities import Capabilities
from .checkpoint import ZeroStorage
from .config import CONFIG_KEYWORDS, agree, check_config, parse_config

__all__ = ['DeepSpeedStrategy', 'import_deepspeed']

_INSTALL = 'pip install "stratagem[deepspeed]"'
_ADAM_FAMILY = ('Adam', 'AdamW', 'Adagrad', 'Lamb', 'FusedAdam', 'DeepSpeedCPUAdam')


def import_deepspeed() -> Any:
    """``import deepspeed``, or an ImportError naming the extra to install."""
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError(
            f'DeepSpeedStrategy needs DeepSpeed, which is not installed ({err}); '
            f'install it with: {_INSTALL}'
        ) from err
    return deepspeed


class DeepSpeedStrategy(BaseStrategy):
    """Train with DeepSpeed (ZeRO stages 0–3, bf16; fp16 on CUDA), mmengine's arguments.

    Args:
        config: A DeepSpeed config dict or the path of a JSON file holding one. The
            keyword arguments below set the key of the same name; a key given both ways
            with different values is an error.
        zero_optimization: e.g. ``dict(stage=2)``.
        gradient_clipping: Must equal ``optim_wrapper.clip_grad.max_norm`` (0 / None
            without ``clip_grad``); derived from it when left out.
        gradient_accumulation_steps: Must equal ``optim_wrapper.accumulative_counts``;
            derived from it when left out.
        train_micro_batch_size_per_gpu: Must equal the loader's batch size
            (``dispatch_kwargs``); used when the loop gives none. Default 1 (it only sets
            DeepSpeed's sample accounting, never the maths).
        fp16, bf16, amp, activation_checkpointing, aio: DeepSpeed's sections, as they are.
            fp16 needs CUDA (DeepSpeed refuses it on CPU).
        inputs_to_half: Positions (int) or keyword names (str) of the model's inputs to
            cast to the engine's half dtype before ``forward`` (nested lists/dicts too).
        steps_per_print: DeepSpeed's progress print interval (default: never).
        exclude_frozen_parameters: Leave parameters with ``requires_grad=False`` out of
            checkpoints (and load non-strictly).
        **kwargs: BaseStrategy's (``work_dir``, ``env_kwargs``, ``auto_scale_lr``, ...).
            Without a launcher a one-process group is created (DeepSpeed needs one).
    """

    capabilities = Capabilities(engine_steps=True, deepspeed_config=True, requires=('deepspeed',))

    model: Any  # the DeepSpeedEngine, once prepared

    def __init__(
        self,
        *,
        config: str | Mapping | None = None,
        zero_optimization: Mapping | None = None,
        gradient_clipping: float | None = None,
        fp16: Mapping | None = None,
        inputs_to_half: Sequence[int | str] | None = None,
        bf16: Mapping | None = None,
        amp: Mapping | None = None,
        activation_checkpointing: Mapping | None = None,
        aio: Mapping | None = None,
        train_micro_batch_size_per_gpu: int | None = None,
        gradient_accumulation_steps: int | None = None,
        steps_per_print: int | None = None,
        exclude_frozen_parameters: bool | None = None,
        **kwargs: Any,
    ) -> None:
        import_deepspeed()  # before anything changes
        cfg = parse_config(config)
        given = dict(
            zero_optimization=zero_optimization,
            gradient_clipping=gradient_clipping,
            fp16=fp16,
            bf16=bf16,
            amp=amp,
            activation_checkpointing=activation_checkpointing,
            aio=aio,
            train_micro_batch_size_per_gpu=train_micro_batch_size_per_gpu,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        for key in CONFIG_KEYWORDS:
            value = given[key]
            if value is None:
                continue
            if key in cfg and cfg[key] != value:
                raise ValueError(
                    f'DeepSpeedStrategy: {key}={value!r} disagrees with the '
                    f"DeepSpeed config's {key}={cfg[key]!r}; give it once"
                )
            cfg[key] = copy.deepcopy(value)
        cfg['steps_per_print'] = (
            steps_per_print if steps_per_print is not None else cfg.get('steps_per_print', 10**13)
        )
        check_config(cfg)
        self.config = cfg
        self._inputs_to_half = list(inputs_to_half) if inputs_to_half is not None else None
        self.exclude_frozen_parameters = bool(exclude_frozen_parameters)
        env_kwargs = dict(kwargs.pop('env_kwargs', None) or {})
        if env_kwargs.get('launcher') in (None, 'none') and not env.is_distributed():
            env_kwargs['launcher'] = _launcher_or_single_process()
        super().__init__(env_kwargs=env_kwargs, **kwargs)

    # --------------------------------------------------------------------- prepare
    @override
    def check_prepare_args(
        self,
        optim_wrapper: Any,
        param_scheduler: Any,
        dispatch_kwargs: Mapping | None,
        compile: bool | Mapping,
    ) -> None:
        """BaseStrategy's checks, then the micro batch agreed with the data loader's."""
        super().check_prepare_args(optim_wrapper, param_scheduler, dispatch_kwargs, compile)
        self._agree_micro_batch()

    @override
    def setup_module_and_optimizers(
        self, model: nn.Module, optim_wrapper: Any, compile: bool | Mapping = False
    ) -> tuple[nn.Module, Any]:
        """The model returned is the ``DeepSpeedEngine``, built over the module and the
        optimizer together.

        ``optim_wrapper``: a DeepSpeedOptimWrapper cfg (``type`` may be left out) whose
        ``optimizer`` is a torch optimizer cfg. ``compile=True`` compiles ``forward`` in
        place (DeepSpeed wraps the module, not a compiled wrapper of it). ``prepare`` then
        scales the lr (``auto_scale_lr``, ``attach_optim_wrapper``) through the optimizer's
        ``param_groups``, which DeepSpeed's optimizer shares.
        """
        module = self._wrap_model(model)
        if compile:
            target = (
                {'target': 'forward'} if compile is True else {'target': 'forward', **dict(compile)}
            )
            module = self.compile_model(module, compile=target)
        wrapper = None
        if optim_wrapper is not None:
            wrapper = self.build_optim_wrapper(_deepspeed_wrapper_cfg(optim_wrapper), module)
            from stratagem.optim import DeepSpeedOptimWrapper

            if not isinstance(wrapper, DeepSpeedOptimWrapper):
                raise TypeError(
                    f'DeepSpeedStrategy needs a DeepSpeedOptimWrapper, got '
                    f'{type(wrapper).__name__}; use optim_wrapper=dict(type='
                    f"'DeepSpeedOptimWrapper', optimizer=...)"
                )
        config = self._engine_config(wrapper)  # every check before DeepSpeed starts
        deepspeed = import_deepspeed()
        engine, *_ = deepspeed.initialize(
            model=module, optimizer=None if wrapper is None else wrapper.optimizer, config=config
        )
        if wrapper is not None:
            wrapper.attach(engine)
        if self._inputs_to_half:
            engine.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
        return engine, wrapper

    @override
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """Place the module on the device; ``deepspeed.initialize`` wraps it in ``prepare``."""
        return model.to(self.device)

    @override
    def unwrap_model(self) -> nn.Module:
        return self.model.module

    @property
    def zero_stage(self) -> int:
        """The configured ZeRO stage (0: none)."""
        return int((self.config.get('zero_optimization') or {}).get('stage', 0))

    def _agree_micro_batch(self) -> None:
        mine = self.config.get('train_micro_batch_size_per_gpu')
        loader = self.dispatch_kwargs.get('train_micro_batch_size_per_gpu')
        if mine is not None and loader is not None and int(mine) != int(loader):
            raise ValueError(
                f'DeepSpeedStrategy: train_micro_batch_size_per_gpu={mine} disagrees with the '
                f"data loader's batch size {loader} (dispatch_kwargs); the loader decides: "
                'remove train_micro_batch_size_per_gpu from the strategy'
            )
        if loader is None and mine is not None:
            self.dispatch_kwargs['train_micro_batch_size_per_gpu'] = int(mine)

    def _engine_config(self, wrapper: Any) -> dict:
        """DeepSpeed's config, with the wrapper's accumulation and clipping written in."""
        cfg = copy.deepcopy(self.config)
        if wrapper is not None:
            agree(
                cfg,
                'gradient_accumulation_steps',
                wrapper.accumulative_counts,
                'optim_wrapper.accumulative_counts',
            )
            agree(
                cfg,
                'gradient_clipping',
                wrapper.max_norm,
                'optim_wrapper.clip_grad.max_norm (0 without clip_grad)',
            )
            if wrapper.accumulative_counts > 1:
                # the wrapper owns the boundary: backward accumulates, step() reduces and
                # updates, so the last window can be shorter (with 1 every step is a
                # boundary, and DeepSpeed's default mode is the one its own loop runs)
                cfg['managed_gradient_accumulation'] = False
            if self.zero_stage > 0 and type(wrapper.optimizer).__name__ not in _ADAM_FAMILY:
                # DeepSpeed's guard against optimizers it has not tested with ZeRO; torch's
                # optimizers only see the flat fp32 partitions, which is what ZeRO tests
                cfg.setdefault('zero_allow_untested_optimizer', True)
        else:
            cfg.setdefault('gradient_accumulation_steps', 1)
            cfg.setdefault('gradient_clipping', 0.0)
        micro = int(self.dispatch_kwargs.get('train_micro_batch_size_per_gpu') or 1)
        cfg['train_micro_batch_size_per_gpu'] = micro
        total = micro * int(cfg['gradient_accumulation_steps']) * self.world_size
        if cfg.get('train_batch_size') not in (None, total):
            raise ValueError(
                f'DeepSpeedStrategy: train_batch_size={cfg["train_batch_size"]} disagrees with '
                f'micro batch {micro} x accumulation {cfg["gradient_accumulation_steps"]} x '
                f'world size {self.world_size} = {total}; remove train_batch_size (derived)'
            )
        cfg['train_batch_size'] = total
        return cfg

    def _cast_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        dtype = (
            torch.bfloat16
            if self.model.bfloat16_enabled()
            else torch.float16
            if self.model.fp16_enabled()
            else None
        )
        if dtype is None:
            return args, kwargs
        wanted = set(self._inputs_to_half)  # type: ignore[arg-type]
        args = tuple(_cast(a, dtype) if i in wanted else a for i, a in enumerate(args))
        kwargs = {k: _cast(v, dtype) if k in wanted else v for k, v in kwargs.items()}
        return args, kwargs

    # ----------------------------------------------------------------- checkpoints
    @override
    def model_state_dict(self) -> dict:
        """The full model state dict. Under ZeRO-3 the parameters are gathered first, so
        every rank must call it."""
        module = self.unwrap_model()
        if self.zero_stage != 3:
            return module.state_dict()
        from deepspeed import zero

        with zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    @override
    def load_model_state_dict(
        self,
        state_dict: Mapping,
        *,
        strict: bool = False,
        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),),
    ) -> Any:
        """Load full weights into the engine's module (every rank, same ``state_dict``) and
        refresh DeepSpeed's fp32 master weights from them."""
        state_dict = ckpt.revise_keys(state_dict, list(revise_keys))
        module = self.unwrap_model()
        if self.zero_stage == 3:
            from deepspeed import zero

            with zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                report = ckpt.load_state_dict(module, state_dict, strict=strict, logger=self.logger)
        else:
            report = ckpt.load_state_dict(module, state_dict, strict=strict, logger=self.logger)
        refresh = getattr(self.model.optimizer, 'refresh_fp32_params', None)
        if callable(refresh):  # ZeRO / bf16 optimizers update from their fp32 copies
            refresh()
        return report

    @override
    def optim_state_dict(self) -> dict:
        """The wrapper's counters; the optimizer's tensors are in DeepSpeed's files."""
        return self.optim_wrapper.state_dict()

    @override
    def checkpoint_meta(self, extra_meta: Mapping | None = None) -> dict:
        return {**super().checkpoint_meta(extra_meta), 'zero_stage': self.zero_stage}

    @override
    def checkpoint_storage(self) -> CheckpointStorage:
        return ZeroStorage(
            engine=lambda: self.model,
            optim_wrapper=lambda: self.optim_wrapper,
            exclude_frozen_parameters=self.exclude_frozen_parameters,
            extra_manifest=lambda: {'strategy': type(self).__name__, 'zero_stage': self.zero_stage},
            logger=self.logger,
        )


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, Mapping):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _launcher_or_single_process() -> str:
    """The inferred launcher; without one, this process becomes a world of one (DeepSpeed
    needs ``LOCAL_RANK`` and a process group, and would otherwise try mpi4py)."""
    launcher = env.infer_launcher()
    if launcher != 'none':
        return launcher
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK='0',
        WORLD_SIZE='1',
        LOCAL_RANK='0',
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=os.environ.get('MASTER_PORT', str(port)),
    )
    return 'pytorch'


def _deepspeed_wrapper_cfg(cfg: Any) -> Any:
    if isinstance(cfg, Mapping):
        cfg = dict(cfg)
        kind = cfg.setdefault('type', 'DeepSpeedOptimWrapper')
        if kind != 'DeepSpeedOptimWrapper':
            raise ValueError(
                f'DeepSpeedStrategy: optim_wrapper type {kind!r} is not supported; '
                "use 'DeepSpeedOptimWrapper' (or leave type out). Precision is "
                "the strategy's bf16 / fp16 setting, not an AMP wrapper"
            )
    return cfg
