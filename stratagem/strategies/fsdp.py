"""FSDPStrategy: fully sharded data parallel on FSDP2 (``fully_shard``), CPU (gloo) or CUDA.

mmengine's FSDPStrategy is built on FSDP1 and fails on a CPU machine; this one runs on both and
writes directory checkpoints that resume on another world size. ``prepare`` sequence (hooks of
``base.py``): build → init weights (unless ``skip_init_weights``) → ``_wrap_model``:
activation checkpointing → per-block ``compile`` → ``fully_shard`` of the matched blocks
bottom-up, root last → optimizer built over the sharded parameters → schedulers.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stratagem import checkpoint as ckpt
from stratagem import env

from .base import BaseStrategy
from .fsdp_config import parse_activation_checkpointing, parse_model_wrapper, parse_state_dict_cfg

_PREFIXES = ('_checkpoint_wrapped_module.', '_orig_mod.')


class FSDPStrategy(BaseStrategy):
    """Fully sharded data parallel training with FSDP2 (registered lazily as
    ``'FSDPStrategy'`` in ``strategies/__init__.py``, so importing the package stays cheap).

    Args:
        model_wrapper: ``auto_wrap_policy`` (module class names or classes, ``dict(type=
            'size_based', min_num_params=N)`` or a callable ``module -> bool``; matched
            modules are sharded bottom-up, the root last), ``reshard_after_forward`` (bool or
            int, default True), ``mixed_precision=dict(param_dtype, reduce_dtype, output_dtype,
            cast_forward_inputs)`` (dtypes may be strings), ``cpu_offload`` (bool; unpinned
            memory on a machine without an accelerator), ``ignored_modules`` (modules or class
            names kept unsharded), ``sync_module_states`` (broadcast rank 0's weights first).
            mmengine's keys (``type='MMFullyShardedDataParallel'``, ``sharding_strategy``,
            ``auto_wrap_policy=dict(type='...size_based_auto_wrap_policy', ...)``) are mapped;
            keys with no FSDP2 meaning are errors naming the replacement (``fsdp_config.py``).
        state_dict_type: ``'sharded'`` (default; a directory, DCP shards, reshards across
            world sizes) or ``'full'`` (one consolidated file written by rank 0). mmengine's
            ``state_dict_cfg='local' | 'full' | dict(state_dict_type=...)`` is accepted.
        activation_checkpointing: module class names / classes, or ``dict(check_fn=...)``;
            applied before sharding.
        skip_init_weights: build a cfg model on the meta device, skip ``init_weights`` and
            allocate only this rank's shards (weights are uninitialised until a checkpoint is
            loaded: use it with ``load_checkpoint``/``resume``).
        **kwargs: BaseStrategy's.
    """

    def __init__(self, *, model_wrapper: Mapping | None = None,
                 state_dict_type: str | None = None, state_dict_cfg: Any = None,
                 activation_checkpointing: Any = None, skip_init_weights: bool = False,
                 **kwargs: Any) -> None:
        self.wrap_cfg = parse_model_wrapper(model_wrapper)
        self.state_dict_type = parse_state_dict_cfg(state_dict_type, state_dict_cfg)
        self.ac_check = parse_activation_checkpointing(activation_checkpointing)
        self.skip_init_weights = bool(skip_init_weights)
        self._block_compile: Any = False
        env_kwargs = dict(kwargs.pop('env_kwargs', None) or {})
        if env_kwargs.get('launcher') in (None, 'none') and not env.is_distributed():
            inferred = env.infer_launcher()
            if inferred == 'none':
                raise RuntimeError(
                    'FSDPStrategy needs a distributed launch (it shards across processes): start '
                    'with torchrun --nproc-per-node N, `stratagem train CONFIG --nproc N`, slurm '
                    'or mpirun, or initialise torch.distributed first; for one process use '
                    "SingleDeviceStrategy (type='auto')")
            env_kwargs['launcher'] = inferred
        super().__init__(env_kwargs=env_kwargs, **kwargs)

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device('cuda', env.get_local_rank())
        return torch.device('cpu')

    # ------------------------------------------------------------------------ prepare
    def prepare(self, model: Any, *, compile: bool | Mapping = False, **kwargs: Any) -> Any:
        """BaseStrategy's ``prepare``; ``compile`` compiles each sharded block (before
        sharding) instead of the whole model."""
        self._block_compile = compile
        return super().prepare(model, compile=False, **kwargs)

    def build_model(self, model: nn.Module | Mapping) -> nn.Module:
        if self.skip_init_weights and isinstance(model, Mapping):
            with torch.device('meta'):
                return super().build_model(model)
        return super().build_model(model)

    def _init_model_weights(self, model: nn.Module) -> nn.Module:
        return model if self.skip_init_weights else super()._init_model_weights(model)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
        if isinstance(model, FSDPModule):
            self.logger.info('FSDPStrategy: the model is already sharded; using it as it is')
            return _with_no_sync(model)
        cfg = self.wrap_cfg
        on_meta = any(p.is_meta for p in model.parameters())
        if not on_meta:
            model = model.to(self.device)
        if cfg.sync_module_states and not on_meta:
            for tensor in list(model.parameters()) + list(model.buffers()):
                env.broadcast(tensor.data, 0)
        targets = cfg.targets(model)
        ignored = cfg.ignored_params(model)
        if self.ac_check is not None:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointWrapper, apply_activation_checkpointing)
            apply_activation_checkpointing(model, check_fn=self.ac_check.bind(model))
            outer = {id(m._checkpoint_wrapped_module): m for m in model.modules()
                     if isinstance(m, CheckpointWrapper)}
            targets = [outer.get(id(m), m) for m in targets]
        if self._block_compile:
            kw = {} if self._block_compile is True else dict(self._block_compile)
            for block in targets or [model]:
                block.compile(**kw)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        kwargs = cfg.shard_kwargs(mesh, self.device)
        for block in reversed(targets):  # children before parents
            fully_shard(block, **kwargs, ignored_params=ignored & set(block.parameters()) or None)
        fully_shard(model, **kwargs, ignored_params=ignored or None)
        if on_meta:
            model.to_empty(device=self.device)
        self.logger.info(f'FSDPStrategy: {len(targets)} block(s) + root sharded over '
                         f'{self.world_size} ranks ({self.device.type})')
        return _with_no_sync(model)

    def build_optim_wrapper(self, optim_wrapper: Any, model: nn.Module | None = None) -> Any:
        """Refuse an optimizer built before sharding: it would hold the old parameters and
        silently update nothing."""
        model = self.model if model is None else model
        built = getattr(optim_wrapper, 'optimizer', None)
        if isinstance(optim_wrapper, Mapping):
            built = optim_wrapper.get('optimizer')
        if isinstance(built, torch.optim.Optimizer):
            own = {id(p) for p in model.parameters()}
            if any(id(p) not in own for g in built.param_groups for p in g['params']):
                raise ValueError(
                    'FSDPStrategy: the optimizer was built before prepare() sharded the model, '
                    'so it holds the old, unsharded parameters and would update nothing; pass '
                    "its cfg instead: optim_wrapper=dict(optimizer=dict(type='AdamW', lr=...))")
        wrapper = super().build_optim_wrapper(optim_wrapper, model)
        for w in (wrapper.values() if hasattr(wrapper, 'values') else [wrapper]):
            _adapt_amp(w)
        return wrapper

    def _unwrap_model(self) -> nn.Module:
        return self.model

    # -------------------------------------------------------------------- state dicts
    def _options(self, full: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(full_state_dict=full, cpu_offload=full)

    def model_state_dict(self) -> dict:
        """Sharded (DTensor) state dict, or the full one on rank 0 under ``'full'``."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(self.model, options=self._options(self._full))

    def optim_state_dict(self) -> dict:
        """FQN-keyed, sharded optimizer state (index-keyed and full under ``'full'``) plus
        the optim wrapper's counters."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        wrapper = self.optim_wrapper
        state = get_optimizer_state_dict(self.model, wrapper.optimizer,
                                         options=self._options(self._full))
        if self._full and state:  # rank 0 only: the others get {} (cpu_offload)
            state = ckpt.optim_state_to_index(state)
        extra = wrapper.state_dict()
        return {**{k: v for k, v in extra.items() if k not in ('state', 'param_groups')},
                'state': state.get('state', {}), 'param_groups': state.get('param_groups', [])}

    def load_model_state_dict(self, state_dict: Mapping, *, strict: bool = False,
                              revise_keys: Any = ((r'^module\.', ''),)) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor
        state_dict = ckpt.revise_keys(state_dict, list(revise_keys))
        full = not any(isinstance(v, DTensor) for v in state_dict.values())
        result = set_model_state_dict(self.model, dict(state_dict), options=StateDictOptions(
            full_state_dict=full, strict=strict))
        if result.missing_keys or result.unexpected_keys:
            self.logger.warning(f'loading weights: missing keys {list(result.missing_keys)}, '
                                f'unexpected keys {list(result.unexpected_keys)}')
        return result

    def load_optim_state_dict(self, state_dict: Mapping) -> None:
        """Load an FQN-keyed (sharded or full) or index-keyed (a single-file checkpoint of
        any strategy) optimizer state, then the optim wrapper's counters."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        from torch.distributed.tensor import DTensor
        wrapper = self.optim_wrapper
        state = dict(state_dict)
        groups = state.get('param_groups') or []
        if groups and groups[0]['params'] and not isinstance(groups[0]['params'][0], str):
            state = ckpt.optim_state_to_fqn(state, self._param_names())
        full = not any(isinstance(t, DTensor) for s in state.get('state', {}).values()
                       for t in s.values())

        def load(optim_state: dict) -> None:
            set_optimizer_state_dict(self.model, wrapper.optimizer,
                                     {'state': optim_state.get('state', {}),
                                      'param_groups': optim_state['param_groups']},
                                     options=StateDictOptions(full_state_dict=full))
        wrapper_state = dict(state.get('optim_wrapper') or {})
        wrapper_state.pop('pending_grads', None)  # sharded grads are None mid-window
        if wrapper_state:
            state['optim_wrapper'] = wrapper_state
        wrapper._load_optimizer_state = load  # the wrapper's sequence, DCP's loader
        try:
            wrapper.load_state_dict(state)
        finally:
            del wrapper._load_optimizer_state

    def _param_names(self) -> list[list[str]]:
        names = {id(p): _clean(n) for n, p in self.model.named_parameters()}
        return [[names[id(p)] for p in g['params']] for g in self.optim_wrapper.param_groups]

    @property
    def _full(self) -> bool:
        return self.state_dict_type == 'full'

    # -------------------------------------------------------------------- checkpoints
    def _validate_checkpoint(self, checkpoint: dict) -> None:
        ckpt.validate_checkpoint_content(_to_local(checkpoint))

    def _partial_grad_states(self) -> Any:
        """Mid accumulation window: this rank's unsynchronised (unsharded) gradients."""
        if all(w.should_update() for w in self._wrappers()):
            return None
        grads = _pending_grads(self.model)
        if self._full:
            return env.all_gather_object({k: v.cpu() for k, v in grads.items()})
        return grads

    def _async_capable(self) -> bool:
        """A full-state file saves asynchronously; a sharded directory (dcp.save and the
        directory helper run collectives on the default group) is saved synchronously."""
        if not self._full and not getattr(self, '_warned_async', False):
            self._warned_async = True
            self.logger.warning('FSDPStrategy: async_checkpoint applies to '
                                "state_dict_type='full' saves; sharded directory saves are "
                                'written synchronously (their writer issues collectives)')
        return self._full

    def _save_checkpoint_files(self, checkpoint: dict, filename: str) -> None:
        if self._full:  # one consolidated file through the base path (rank 0 holds it)
            if 'partial_grads' in checkpoint:  # every rank's, by FQN
                checkpoint['partial_grads_fqn'] = checkpoint.pop('partial_grads')
            super()._save_checkpoint_files(checkpoint, filename)
            return
        partial = checkpoint.pop('partial_grads', None)
        ckpt.save_sharded_checkpoint(filename, checkpoint, step=checkpoint['meta'].get('iter'),
                                     partial_grads=partial,
                                     extra_manifest={'strategy': type(self).__name__})

    def _load_checkpoint_files(self, filename: str, map_location: Any) -> dict:
        if not ckpt.is_sharded_checkpoint(filename):
            return super()._load_checkpoint_files(filename, map_location)
        manifest = ckpt.verify_directory(filename)
        if manifest.get('optimizer_keys', 'fqn') != 'fqn':
            return ckpt.read_sharded_checkpoint(filename)  # converted from a file: full load
        from torch.distributed.checkpoint.state_dict import get_state_dict
        want_optim = hasattr(self, 'optim_wrapper')
        model_sd, optim_sd = get_state_dict(self.model, [self.optim_wrapper.optimizer]
                                            if want_optim else [])
        state = {'state_dict': model_sd}
        if want_optim and 'optimizer' in _dcp_top_keys(filename):
            state['optimizer'] = optim_sd
        extra = ckpt.load_dcp_into(filename, state)
        checkpoint = {'meta': extra.pop('meta', {}), 'state_dict': state['state_dict']}
        if 'optimizer' in state:
            checkpoint['optimizer'] = {**state['optimizer'], **extra.pop('optimizer_extra', {})}
        partial = ckpt.read_partial_grads(filename)
        if partial:
            checkpoint['partial_grads_fqn'] = partial
        checkpoint.update(extra)
        return checkpoint

    def _load_partial_grads(self, checkpoint: Mapping, meta: Mapping) -> None:
        per_rank = checkpoint.get('partial_grads_fqn') or checkpoint.get('partial_grads')
        if not per_rank:
            return
        mine = per_rank[self.rank] if len(per_rank) == self.world_size else \
            {k: sum(g[k] for g in per_rank) / len(per_rank) for k in per_rank[0]}
        _set_pending_grads(self.model, mine)


def _dcp_top_keys(path: str) -> set[str]:
    import torch.distributed.checkpoint as dcp
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {key.split('.', 1)[0] for key in metadata.state_dict_metadata}


def _clean(name: str) -> str:
    for prefix in _PREFIXES:
        name = name.replace(prefix, '')
    return name


def _to_local(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):  # an OrderedDict stays one (validation checks the type)
        return type(obj)((k, _to_local(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _fsdp_params(model: nn.Module) -> list[tuple[str, Any]]:
    """(clean FQN, FSDPParam) of every sharded parameter."""
    names = {id(p): _clean(n) for n, p in model.named_parameters()}
    out = []
    for module in model.modules():
        state = getattr(module, '_get_fsdp_state', None)
        group = state()._fsdp_param_group if state is not None else None
        if group is not None:
            out += [(names[id(fp.sharded_param)], fp) for fp in group.fsdp_params]
    return out


def _pending_grads(model: nn.Module) -> dict:
    """This rank's gradients accumulated with sync off (FSDP2 keeps them unsharded)."""
    grads = {}
    for name, fp in _fsdp_params(model):
        g = fp.unsharded_accumulated_grad
        if g is None and hasattr(fp, '_unsharded_param'):
            g = fp._unsharded_param.grad
        if g is not None:
            grads[name] = g.detach().clone()
    return grads


def _set_pending_grads(model: nn.Module, grads: Mapping) -> None:
    from torch.distributed.fsdp import FSDPModule
    if any(not hasattr(fp, '_unsharded_param') for _, fp in _fsdp_params(model)):
        for module in model.modules():  # FSDP2 creates the unsharded parameters lazily
            if isinstance(module, FSDPModule):
                module.unshard()
                module.reshard()
    for name, fp in _fsdp_params(model):
        g = grads.get(name)
        if g is None:
            continue
        param = fp._unsharded_param
        if fp.reduce_dtype is not None and fp.reduce_dtype != param.dtype:
            fp.unsharded_accumulated_grad = g.to(param.device, fp.reduce_dtype, copy=True)
        else:
            param.grad = g.to(param.device, param.dtype, copy=True)


class _NoSync:
    """``model.no_sync()`` for FSDP2, so the optim wrapper's ``optim_context`` skips the
    reduce-scatter on non-update iterations. FSDP2 reads its flag during backward, which runs
    after the context exits, so the flag stays off until the next forward outside a
    ``no_sync`` block turns it back on (a forward pre-hook on the root)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._inside = False
        self._synced = True
        model.register_forward_pre_hook(self._pre_forward)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self._inside and not self._synced:
            self._model.set_requires_gradient_sync(True)
            self._synced = True

    @contextlib.contextmanager
    def __call__(self) -> Any:
        if self._synced:
            self._model.set_requires_gradient_sync(False)
            self._synced = False
        self._inside = True
        try:
            yield
        finally:
            self._inside = False


def _with_no_sync(model: nn.Module) -> nn.Module:
    if not hasattr(model, 'no_sync'):
        object.__setattr__(model, 'no_sync', _NoSync(model))
    return model


def _adapt_amp(wrapper: Any) -> None:
    """Precision comes from ``mixed_precision``: an AmpOptimWrapper does not autocast again
    (its GradScaler, float16 only, stays)."""
    if hasattr(wrapper, 'cast_dtype'):
        wrapper.optim_context = lambda model: (model.no_sync() if not wrapper.should_sync()
                                               else contextlib.nullcontext())
