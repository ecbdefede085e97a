"""FSDPStrategy's config boundary: our keys and mmengine's FSDP1 keys → FSDP2 values.

Every key is either mapped to its FSDP2 meaning or refused with a message naming the key and
what to use instead, before anything is built.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem.optim.amp_optim_wrapper import resolve_dtype

_SIZE_POLICIES = ('size_based', 'torch.distributed.fsdp.wrap.size_based_auto_wrap_policy',
                  'size_based_auto_wrap_policy')
_CLASS_POLICIES = ('module_classes', 'torch.distributed.fsdp.wrap.transformer_auto_wrap_policy',
                   'transformer_auto_wrap_policy', 'torch.distributed.fsdp.wrap.ModuleWrapPolicy',
                   'ModuleWrapPolicy')
_WRAPPER_TYPES = (None, 'fully_shard', 'FullyShardedDataParallel', 'MMFullyShardedDataParallel')
_SHARDING = {'FULL_SHARD': True, 'SHARD_GRAD_OP': False}
_REFUSED = {
    'device_id': 'FSDPStrategy places the model on cuda:LOCAL_RANK, or cpu; remove device_id',
    'limit_all_gathers': 'FSDP2 bounds all-gathers itself; remove it',
    'forward_prefetch': 'FSDP2 prefetches the next block by default; remove it (explicit '
                        'prefetching: module.set_modules_to_forward_prefetch)',
    'backward_prefetch': 'FSDP2 prefetches in backward by default; remove it',
    'param_init_fn': 'use skip_init_weights=True (meta-device build, shards allocated after '
                     'sharding) and load a checkpoint',
    'ignored_states': 'use ignored_modules',
    'process_group': 'FSDPStrategy shards over all ranks of the default process group',
    'device_mesh': 'FSDPStrategy shards over all ranks of the default process group',
    'use_orig_params': None,  # refused only when False (FSDP2 always keeps them)
}
_MP_KEYS = ('param_dtype', 'reduce_dtype', 'output_dtype', 'cast_forward_inputs')
_MP_REFUSED = {'buffer_dtype': 'FSDP2 leaves buffers in their dtype; cast them in the model',
               'keep_low_precision_grads': 'FSDP2 gives gradients in the parameter dtype; '
                                           'remove it',
               'cast_root_forward_inputs': 'use cast_forward_inputs'}


class ModuleMatcher:
    """Module classes (names or types) and/or a predicate; names are checked against a model."""

    def __init__(self, spec: Any, key: str) -> None:
        self.key, self.names, self.types, self.fn = key, set(), (), None
        if callable(spec) and not isinstance(spec, type):
            self.fn = spec
            return
        items = [spec] if isinstance(spec, (str, type)) else list(spec)
        for item in items:
            if isinstance(item, str):
                self.names.add(item)
            elif isinstance(item, type) and issubclass(item, nn.Module):
                self.types += (item,)
            else:
                raise TypeError(f'{key}: {item!r} is not a module class or class name')

    def bind(self, model: nn.Module) -> Callable[[nn.Module], bool]:
        present = {type(m).__name__ for m in model.modules()}
        unknown = sorted(self.names - present)
        if unknown:
            raise ValueError(f'{self.key}: module class(es) {unknown} are not in the '
                             f'model; its module classes are {sorted(present)}')
        if self.fn is not None:
            return self.fn
        return lambda m: type(m).__name__ in self.names or isinstance(m, self.types)


@dataclass
class WrapConfig:
    """Validated ``model_wrapper``."""

    matcher: ModuleMatcher | None
    min_num_params: int | None
    reshard_after_forward: bool | int
    mp_policy: Any
    cpu_offload: bool
    ignored: ModuleMatcher | None
    sync_module_states: bool

    def targets(self, model: nn.Module) -> list[nn.Module]:
        """Modules to shard before the root, in pre-order (parents before children)."""
        if self.matcher is not None:
            match = self.matcher.bind(model)
            return [m for m in model.modules() if m is not model and match(m)]
        if self.min_num_params is None:
            return []
        picked: list[nn.Module] = []

        def visit(module: nn.Module) -> int:  # params not yet in a picked descendant
            left = sum(visit(c) for c in module.children())
            left += sum(p.numel() for p in module.parameters(recurse=False))
            if module is not model and left >= self.min_num_params:
                picked.append(module)
                return 0
            return left
        visit(model)
        order = {id(m): i for i, m in enumerate(model.modules())}
        return sorted(picked, key=lambda m: order[id(m)])

    def ignored_params(self, model: nn.Module) -> set[nn.Parameter]:
        if self.ignored is None:
            return set()
        match = self.ignored.bind(model)
        return {p for m in model.modules() if match(m) for p in m.parameters()}

    def shard_kwargs(self, mesh: Any, device: torch.device) -> dict:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
        offload = CPUOffloadPolicy(pin_memory=device.type == 'cuda') if self.cpu_offload \
            else OffloadPolicy()
        return dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                    mp_policy=self.mp_policy, offload_policy=offload)


def parse_model_wrapper(cfg: Mapping | None) -> WrapConfig:
    cfg = dict(cfg or {})
    kind = cfg.pop('type', None)
    if kind not in _WRAPPER_TYPES:
        raise ValueError(f'FSDPStrategy: model_wrapper type {kind!r} is not supported; leave type '
                         f"out (FSDP2 fully_shard) or use 'MMFullyShardedDataParallel'")
    for key, fix in _REFUSED.items():
        if key in cfg:
            value = cfg.pop(key)
            if key == 'use_orig_params' and value:
                continue
            raise ValueError(f'FSDPStrategy: model_wrapper.{key}={value!r} has no FSDP2 meaning; '
                             f'{fix or "FSDP2 always uses the original parameters; remove it"}')
    reshard = cfg.pop('reshard_after_forward', None)
    if 'sharding_strategy' in cfg:
        strategy = cfg.pop('sharding_strategy')
        name = getattr(strategy, 'name', strategy)
        if name not in _SHARDING:
            fix = ('use DDPStrategy' if name == 'NO_SHARD' else 'hybrid sharding needs a 2-D '
                   "mesh, which FSDPStrategy does not build; use 'FULL_SHARD'")
            raise ValueError(f'FSDPStrategy: model_wrapper.sharding_strategy={name!r} is not '
                             f"supported; {fix} (supported: 'FULL_SHARD', 'SHARD_GRAD_OP')")
        if reshard is not None and reshard != _SHARDING[name]:
            raise ValueError(f'FSDPStrategy: sharding_strategy={name!r} and '
                             f'reshard_after_forward={reshard!r} disagree; give one of them')
        reshard = _SHARDING[name]
    if reshard is None:
        reshard = True
    if isinstance(reshard, bool) is False and (not isinstance(reshard, int) or reshard < 1):
        raise ValueError(f'FSDPStrategy: reshard_after_forward must be a bool or an int >= 1 '
                         f'(reshard to that many ranks), got {reshard!r}')
    matcher, min_params = _parse_policy(cfg.pop('auto_wrap_policy', None))
    offload = cfg.pop('cpu_offload', False)
    if isinstance(offload, Mapping):
        offload = bool(dict(offload).get('offload_params', False))
    elif hasattr(offload, 'offload_params'):  # an FSDP1 CPUOffload object
        offload = bool(offload.offload_params)
    ignored = cfg.pop('ignored_modules', None)
    config = WrapConfig(matcher, min_params, reshard, _parse_mp(cfg.pop('mixed_precision', None)),
                        bool(offload),
                        None if ignored is None else ModuleMatcher(ignored, 'ignored_modules'),
                        bool(cfg.pop('sync_module_states', False)))
    if cfg:
        raise ValueError(f'FSDPStrategy: unknown model_wrapper key(s) {sorted(cfg)}; valid: '
                         "auto_wrap_policy, reshard_after_forward, mixed_precision, cpu_offload, "
                         'ignored_modules, sync_module_states (mmengine: sharding_strategy, '
                         'use_orig_params)')
    return config


def _parse_policy(policy: Any) -> tuple[ModuleMatcher | None, int | None]:
    key = 'model_wrapper.auto_wrap_policy'
    if policy is None:
        return None, None
    if isinstance(policy, Mapping):
        policy = dict(policy)
        kind = policy.pop('type', 'size_based')
        if kind in _SIZE_POLICIES:
            n = policy.pop('min_num_params', int(1e8))
            if policy or isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f'{key}: size_based takes min_num_params (an int >= 1) only, got '
                                 f'{dict(policy, min_num_params=n)!r}')
            return None, n
        if kind in _CLASS_POLICIES:
            classes = policy.pop('transformer_layer_cls', None) or policy.pop('module_classes',
                                                                               None)
            if classes is None or policy:
                raise ValueError(f'{key}: {kind} takes transformer_layer_cls (module classes or '
                                 f'names) only, got {policy!r}')
            return ModuleMatcher(classes, key), None
        raise ValueError(f'{key}: unknown type {kind!r}; use a list of module class names, '
                         f"dict(type='size_based', min_num_params=N) or a callable module -> bool")
    return ModuleMatcher(policy, key), None


def _parse_mp(mp: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if mp is None:
        return MixedPrecisionPolicy()
    if isinstance(mp, MixedPrecisionPolicy):
        return mp
    if isinstance(mp, str):  # mmengine accepts a dtype name: cast params, reduce in float32
        return MixedPrecisionPolicy(param_dtype=resolve_dtype(mp), reduce_dtype=torch.float32)
    mp = dict(mp)
    for key, fix in _MP_REFUSED.items():
        if key in mp:
            raise ValueError(f'FSDPStrategy: model_wrapper.mixed_precision.{key} has no FSDP2 '
                             f'meaning; {fix}')
    unknown = sorted(set(mp) - set(_MP_KEYS))
    if unknown:
        raise ValueError(f'FSDPStrategy: unknown model_wrapper.mixed_precision key(s) {unknown}; '
                         f'valid: {list(_MP_KEYS)}')
    kwargs = {k: resolve_dtype(mp[k]) for k in _MP_KEYS[:3] if k in mp}
    if 'cast_forward_inputs' in mp:
        kwargs['cast_forward_inputs'] = bool(mp['cast_forward_inputs'])
    return MixedPrecisionPolicy(**kwargs)


def parse_state_dict_cfg(state_dict_type: str | None, state_dict_cfg: Any) -> str:
    """Ours (``'sharded'``/``'full'``) or mmengine's ``state_dict_cfg`` → ``'sharded'``/``'full'``."""
    mm = {'local': 'sharded', 'sharded': 'sharded', 'full': 'full',
          'LOCAL_STATE_DICT': 'sharded', 'SHARDED_STATE_DICT': 'sharded',
          'FULL_STATE_DICT': 'full'}
    if state_dict_cfg is not None:
        raw = state_dict_cfg
        if isinstance(raw, Mapping):
            raw = dict(raw).get('state_dict_type')
            raw = getattr(raw, 'name', raw)
        if raw not in mm:
            raise ValueError(f"FSDPStrategy: state_dict_cfg={state_dict_cfg!r} is not supported; "
                             f"use 'local' / 'full' or dict(state_dict_type='SHARDED_STATE_DICT' "
                             f"| 'FULL_STATE_DICT'), or state_dict_type='sharded' | 'full'")
        mapped = mm[raw]
        if state_dict_type is not None and state_dict_type != mapped:
            raise ValueError(f'FSDPStrategy: state_dict_type={state_dict_type!r} and '
                             f'state_dict_cfg={state_dict_cfg!r} disagree; give one of them')
        return mapped
    state_dict_type = state_dict_type or 'sharded'
    if state_dict_type not in ('sharded', 'full'):
        raise ValueError(f"FSDPStrategy: state_dict_type={state_dict_type!r}; use 'sharded' "
                         f"(a directory of DCP shards) or 'full' (one consolidated file)")
    return state_dict_type


def parse_activation_checkpointing(cfg: Any) -> ModuleMatcher | None:
    """Classes / names, a callable, or mmengine's ``dict(check_fn=...)``."""
    if cfg is None or cfg is False:
        return None
    if isinstance(cfg, Mapping):
        cfg = dict(cfg)
        spec = cfg.pop('check_fn', None) or cfg.pop('module_classes', None)
        if spec is None or cfg:
            raise ValueError(f'FSDPStrategy: activation_checkpointing takes check_fn (a callable '
                             f'module -> bool, or module class names) or module_classes; got '
                             f'extra keys {sorted(cfg)}' if cfg else
                             'FSDPStrategy: activation_checkpointing needs check_fn or '
                             'module_classes')
        cfg = spec
    return ModuleMatcher(cfg, 'activation_checkpointing')
