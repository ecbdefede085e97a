"""FSDPStrategy's config boundary: our keys and mmengine's FSDP1 keys → FSDP2 values.

``model_wrapper`` is parsed here; ``state_dict_cfg`` and ``activation_checkpointing`` in
``options.py``. Every key is either mapped to its FSDP2 meaning or refused with a message
naming the key and what to use instead, before anything is built. Module choices
(``auto_wrap_policy``, ``ignored_modules``, activation checkpointing) are checked against
the model in ``prepare``, before anything is sharded. Where mmengine takes a function by name
(its ``FUNCTIONS`` registry), a name resolves as there: registered in mmengine's
``FUNCTIONS`` (looked up when mmengine is already imported) or a dotted import path
(``wrap_policy.resolve_name``).
"""

from __future__ import annotations

import difflib
import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from stratagem._torch import fsdp1_policy_type
from stratagem.optim.amp_optim_wrapper import resolve_dtype

from .wrap_policy import (
    AUTO,
    Fsdp1Policy,
    ModuleMatcher,
    NoSplitModules,
    PolicyObject,
    as_selector,
    resolve_name,
)

_SIZE_POLICIES = (
    'size_based',
    'torch.distributed.fsdp.wrap.size_based_auto_wrap_policy',
    'size_based_auto_wrap_policy',
)
_CLASS_POLICIES = (
    'module_classes',
    'torch.distributed.fsdp.wrap.transformer_auto_wrap_policy',
    'transformer_auto_wrap_policy',
    'torch.distributed.fsdp.wrap.ModuleWrapPolicy',
    'ModuleWrapPolicy',
)
_WRAPPER_TYPES = (None, 'fully_shard', 'FullyShardedDataParallel', 'MMFullyShardedDataParallel')
_SHARDING = {'FULL_SHARD': True, 'SHARD_GRAD_OP': False}
_HYBRID = "hybrid sharding needs a 2-D mesh, which FSDPStrategy does not build; use 'FULL_SHARD'"
_SHARDING_REFUSED = {
    'NO_SHARD': 'use DDPStrategy',
    'HYBRID_SHARD': _HYBRID,
    '_HYBRID_SHARD_ZERO2': _HYBRID,
}
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
# FSDP2's MixedPrecisionPolicy keys, then FSDP1's MixedPrecision fields that map to them
_MP_KEYS = ('param_dtype', 'reduce_dtype', 'output_dtype', 'cast_forward_inputs')
_MP_FSDP1 = ('buffer_dtype', 'keep_low_precision_grads', 'cast_root_forward_inputs')


@dataclass
class WrapConfig:
    """Validated ``model_wrapper``."""

    policy: ModuleMatcher | Fsdp1Policy | PolicyObject | NoSplitModules | None
    reshard_after_forward: bool | int
    mp_policy: Any
    buffer_dtype: torch.dtype | None
    cpu_offload: bool
    ignored: ModuleMatcher | None
    sync_module_states: bool

    def targets(self, model: nn.Module) -> list[nn.Module]:
        """Modules to shard before the root, in pre-order (parents before children); none
        inside an ignored module."""
        if self.policy is None:
            return []
        return self.policy.select(model, self.ignored_modules(model))

    def ignored_modules(self, model: nn.Module) -> set[nn.Module]:
        """The modules ``ignored_modules`` names and everything inside them (as FSDP1)."""
        if self.ignored is None:
            return set()
        match = self.ignored.bind(model)
        roots = [m for m in model.modules() if match(m)]
        if any(m is model for m in roots):
            raise ValueError(
                'ignored_modules: it matches the root module, so nothing would be '
                'sharded; name submodules (or use DDPStrategy)'
            )
        return {sub for m in roots for sub in m.modules()}

    def ignored_params(self, model: nn.Module) -> set[nn.Parameter]:
        return {p for m in self.ignored_modules(model) for p in m.parameters(recurse=False)}

    @property
    def casts_precision(self) -> bool:
        """Whether ``mixed_precision`` casts anything (then an AmpOptimWrapper leaves
        precision to FSDP)."""
        mp = self.mp_policy
        return any(
            getattr(mp, f, None) is not None
            for f in ('param_dtype', 'reduce_dtype', 'output_dtype')
        )

    def cast_buffers(self, model: nn.Module) -> None:
        """FSDP1's ``buffer_dtype``: floating-point buffers take that dtype (before sharding)."""
        if self.buffer_dtype is None:
            return
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                if buf.is_floating_point() and buf.dtype != self.buffer_dtype:
                    setattr(module, name, buf.to(self.buffer_dtype))  # a buffer stays one

    def shard_kwargs(self, mesh: Any, device: torch.device) -> dict:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        offload = (
            CPUOffloadPolicy(pin_memory=device.type == 'cuda')
            if self.cpu_offload
            else OffloadPolicy()
        )
        return dict(
            mesh=mesh,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.mp_policy,
            offload_policy=offload,
        )


def parse_model_wrapper(cfg: Mapping | None) -> WrapConfig:
    cfg = dict(cfg or {})
    kind = cfg.pop('type', None)
    if kind not in _WRAPPER_TYPES:
        raise ValueError(
            f'FSDPStrategy: model_wrapper type {kind!r} is not supported; leave type '
            f"out (FSDP2 fully_shard) or use 'MMFullyShardedDataParallel'"
        )
    for key, fix in _REFUSED.items():
        if key in cfg:
            value = cfg.pop(key)
            if key == 'use_orig_params' and value:
                continue
            raise ValueError(
                f'FSDPStrategy: model_wrapper.{key}={value!r} has no FSDP2 meaning; '
                f'{fix or "FSDP2 always uses the original parameters; remove it"}'
            )
    reshard = _parse_reshard(
        cfg.pop('reshard_after_forward', None), cfg.pop('sharding_strategy', None)
    )
    policy = parse_policy(cfg.pop('auto_wrap_policy', None), 'model_wrapper.auto_wrap_policy')
    offload = cfg.pop('cpu_offload', False)
    if isinstance(offload, Mapping):
        offload = bool(dict(offload).get('offload_params', False))
    elif hasattr(offload, 'offload_params'):  # an FSDP1 CPUOffload object
        offload = bool(offload.offload_params)
    ignored = cfg.pop('ignored_modules', None)
    mp_policy, buffer_dtype = _parse_mp(cfg.pop('mixed_precision', None))
    config = WrapConfig(
        policy,
        reshard,
        mp_policy,
        buffer_dtype,
        bool(offload),
        None
        if ignored is None
        else ModuleMatcher(ignored, 'model_wrapper.ignored_modules', paths=True),
        bool(cfg.pop('sync_module_states', False)),
    )
    if cfg:
        raise ValueError(
            f'FSDPStrategy: unknown model_wrapper key(s) {sorted(cfg)}; valid: '
            'auto_wrap_policy, reshard_after_forward, mixed_precision, cpu_offload, '
            'ignored_modules, sync_module_states (mmengine: sharding_strategy, '
            'use_orig_params)'
        )
    return config


def _parse_reshard(reshard: Any, strategy: Any) -> bool | int:
    """``reshard_after_forward`` or FSDP1's ``sharding_strategy`` (a name or the enum)."""
    if strategy is not None:
        name = strategy.name if isinstance(strategy, enum.Enum) else strategy
        if name in _SHARDING_REFUSED:
            raise ValueError(
                f'FSDPStrategy: model_wrapper.sharding_strategy={name!r} is not '
                f'supported; {_SHARDING_REFUSED[name]} (supported: '
                "'FULL_SHARD', 'SHARD_GRAD_OP')"
            )
        if name not in _SHARDING:
            close = difflib.get_close_matches(str(name), [*_SHARDING, *_SHARDING_REFUSED], n=1)
            hint = f'did you mean {close[0]!r}? ' if close else ''
            raise ValueError(
                f'FSDPStrategy: unknown model_wrapper.sharding_strategy {strategy!r}'
                f"; {hint}valid: 'FULL_SHARD' (reshard_after_forward=True), "
                "'SHARD_GRAD_OP' (False); FSDP1's 'NO_SHARD', 'HYBRID_SHARD', "
                "'_HYBRID_SHARD_ZERO2' are refused (DDPStrategy / one mesh axis)"
            )
        if reshard is not None and reshard != _SHARDING[name]:
            raise ValueError(
                f'FSDPStrategy: sharding_strategy={name!r} and '
                f'reshard_after_forward={reshard!r} disagree; give one of them'
            )
        reshard = _SHARDING[name]
    if reshard is None:
        return True
    if isinstance(reshard, bool) is False and (not isinstance(reshard, int) or reshard < 1):
        raise ValueError(
            f'FSDPStrategy: reshard_after_forward must be a bool or an int >= 1 '
            f'(reshard to that many ranks), got {reshard!r}'
        )
    return reshard


def parse_policy(
    policy: Any, key: str
) -> ModuleMatcher | Fsdp1Policy | PolicyObject | NoSplitModules | None:
    """An ``auto_wrap_policy`` in any of its forms → something with ``select(model, ignored)``:
    ``'auto'`` (the model's ``_no_split_modules``); module class names / classes; a callable
    ``module -> bool``; an FSDP1 policy (a function ``(module, recurse, nonwrapped_numel)``, a
    partial of one, ``ModuleWrapPolicy`` /
    ``CustomPolicy``); a name of one (mmengine's ``FUNCTIONS`` or a dotted path); or a dict
    ``type=<one of those>`` plus its arguments (``min_num_params``, ``transformer_layer_cls``)."""
    if policy is None:
        return None
    if isinstance(policy, Mapping):
        return _policy_from_dict(dict(policy), key)
    if isinstance(policy, str):
        if policy == AUTO:
            return NoSplitModules(key)
        if policy in _SIZE_POLICIES:
            return _size_policy({}, key)
        if policy in _CLASS_POLICIES:
            raise ValueError(
                f'{key}: {policy!r} needs the classes to wrap: dict(type={policy!r}, '
                "transformer_layer_cls=['Block']) or the list ['Block']"
            )
        obj, why = resolve_name(policy)
        if obj is None:  # a module class name, as before; checked against the model
            return ModuleMatcher([policy], key, hint=why)
        return as_selector(obj, key, policy)
    return as_selector(policy, key)


def _policy_from_dict(policy: dict, key: str) -> Any:
    from torch.distributed.fsdp.wrap import (
        ModuleWrapPolicy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    kind = policy.pop('type', 'size_based')
    if kind in _SIZE_POLICIES or kind is size_based_auto_wrap_policy:
        return _size_policy(policy, key)
    if kind in _CLASS_POLICIES or kind in (transformer_auto_wrap_policy, ModuleWrapPolicy):
        classes = policy.pop('transformer_layer_cls', None) or policy.pop('module_classes', None)
        if classes is None or policy:
            raise ValueError(
                f'{key}: {kind} takes transformer_layer_cls (module classes or '
                f'names) only, got {policy!r}'
            )
        return ModuleMatcher(classes, key)
    fn, why = (
        (kind, '')
        if callable(kind)
        else resolve_name(kind)
        if isinstance(kind, str)
        else (None, 'not a name or a callable')
    )
    if fn is None:
        raise ValueError(
            f'{key}: unknown type {kind!r} ({why}); use a list of module class '
            "names, dict(type='size_based_auto_wrap_policy', min_num_params=N), "
            "dict(type='transformer_auto_wrap_policy', transformer_layer_cls=[...]), "
            "a policy function's dotted import path or the callable itself"
        )
    if isinstance(fn, type) and issubclass(fn, nn.Module) and not policy:
        return ModuleMatcher(fn, key)
    if isinstance(fn, type):  # a policy class (CustomPolicy(lambda_fn=...)): built with the args
        if not issubclass(fn, fsdp1_policy_type()):
            raise TypeError(
                f'{key}: type {kind!r} is the class {fn.__name__}, not a policy '
                f'class (ModuleWrapPolicy, CustomPolicy) or function'
            )
        return as_selector(fn(**policy), key, kind)
    return as_selector(functools.partial(fn, **policy) if policy else fn, key, kind)


def _size_policy(args: dict, key: str) -> Fsdp1Policy:
    """torch's ``size_based_auto_wrap_policy`` (mmengine's meaning), decided as FSDP1 does."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    n = args.pop('min_num_params', int(1e8))
    whole = isinstance(n, int) or (isinstance(n, float) and n.is_integer())
    if isinstance(n, bool) or not whole or n < 1:
        raise ValueError(
            f'{key}: min_num_params must be a whole number >= 1 (an int, or a float '
            f'such as 1e7), got {n!r}'
        )
    unknown = sorted(set(args) - {'force_leaf_modules', 'exclude_wrap_modules'})
    if unknown:
        raise ValueError(
            f'{key}: size_based_auto_wrap_policy takes min_num_params, '
            f'force_leaf_modules, exclude_wrap_modules; unknown: {unknown}'
        )
    return Fsdp1Policy(
        functools.partial(size_based_auto_wrap_policy, min_num_params=int(n), **args), key
    )


def _parse_mp(mp: Any) -> tuple[Any, torch.dtype | None]:
    """``mixed_precision`` → (FSDP2 ``MixedPrecisionPolicy``, FSDP1's ``buffer_dtype``).

    Accepted: a ``MixedPrecisionPolicy``; a dtype name (cast params, reduce in float32); a
    dict of FSDP2's keys; FSDP1's ``MixedPrecision`` or a dict of its fields (mmengine's
    form): ``param_dtype``/``reduce_dtype`` map as they are; ``cast_forward_inputs`` or
    ``cast_root_forward_inputs`` casts the inputs (FSDP2 casts each sharded module's);
    ``buffer_dtype`` None or float32 makes floating buffers float32 before sharding (FSDP1
    casts buffers to it), a low-precision one is refused (FSDP2 casts only parameters; cast
    those buffers in the model); ``keep_low_precision_grads=True`` is refused. FSDP1's
    ``_module_classes_to_ignore`` (BatchNorm kept in float32) has no FSDP2 counterpart here:
    such modules run in ``param_dtype`` too.
    """
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    if mp is None:
        return MixedPrecisionPolicy(), None
    if isinstance(mp, MixedPrecisionPolicy):
        return mp, None
    if isinstance(mp, str):  # mmengine accepts a dtype name: cast params, reduce in float32
        return MixedPrecisionPolicy(param_dtype=resolve_dtype(mp), reduce_dtype=torch.float32), None
    if isinstance(mp, MixedPrecision):
        mp = {f.name: getattr(mp, f.name) for f in fields(mp) if not f.name.startswith('_')}
    if not isinstance(mp, Mapping):
        raise TypeError(
            f'FSDPStrategy: model_wrapper.mixed_precision={mp!r}; give a dict '
            f'(param_dtype, reduce_dtype, ...), a dtype name, FSDP2 '
            f'MixedPrecisionPolicy or FSDP1 MixedPrecision'
        )
    mp = dict(mp)
    unknown = sorted(set(mp) - set(_MP_KEYS) - set(_MP_FSDP1))
    if unknown:
        raise ValueError(
            f'FSDPStrategy: unknown model_wrapper.mixed_precision key(s) {unknown}; '
            f'valid: {list(_MP_KEYS)} (FSDP1: {list(_MP_FSDP1)})'
        )
    if mp.get('keep_low_precision_grads'):
        raise ValueError(
            'FSDPStrategy: model_wrapper.mixed_precision.keep_low_precision_grads='
            'True has no FSDP2 meaning (gradients come in the parameter dtype); '
            'remove it'
        )
    buffer_dtype = mp.get('buffer_dtype')
    buffer_dtype = None if buffer_dtype is None else resolve_dtype(buffer_dtype)
    if buffer_dtype not in (None, torch.float32):
        raise ValueError(
            f'FSDPStrategy: model_wrapper.mixed_precision.buffer_dtype='
            f'{mp["buffer_dtype"]!r} has no FSDP2 meaning: FSDP2 casts only '
            f'parameters and leaves buffers in their dtype; remove it (or give '
            f'float32) and cast those buffers in the model'
        )
    kwargs: dict[str, Any] = {
        k: resolve_dtype(mp[k]) for k in _MP_KEYS[:3] if mp.get(k) is not None
    }
    if 'cast_root_forward_inputs' in mp:  # FSDP1: the root casts unless both are off
        kwargs['cast_forward_inputs'] = bool(mp.get('cast_forward_inputs')) or bool(
            mp['cast_root_forward_inputs']
        )
    elif 'cast_forward_inputs' in mp:
        kwargs['cast_forward_inputs'] = bool(mp['cast_forward_inputs'])
    return MixedPrecisionPolicy(**kwargs), buffer_dtype
