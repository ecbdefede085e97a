"""Every private torch API stratagem uses, in one place: one name or function per API, each
saying why torch offers no public equivalent (in the torch versions ``pyproject.toml``
allows). The rest of the package imports these and never a ``torch._...`` name, a
``torch.distributed._...`` module or a private attribute of a torch object; where a public API
exists it is used instead, directly.

A torch upgrade that breaks one of these breaks it here: ``tests/test_torch_compat.py``
exercises each one against the installed torch.

Importing this module imports ``torch`` and ``torch.nn`` only; the rest is imported on first
use (``torch.distributed.fsdp``, DCP and the memory trackers take seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = [
    'BatchNormBase',
    'InstanceNormBase',
    'WRAPPER_PREFIXES',
    'REBUILD_TENSOR',
    'non_persistent_buffers',
    'state_dict_metadata',
    'set_state_dict_metadata',
    'compiled_inner',
    'foreach_mul_',
    'unscale_and_check_',
    'grad_scaler_found_inf',
    'default_store',
    'dtensor_like',
    'load_whole_dcp',
    'storage_dtypes',
    'zip_archive_reader',
    'apply_activation_checkpointing',
    'checkpoint_wrapped',
    'fsdp1_policy_type',
    'run_fsdp1_policy',
    'fsdp_params',
    'unsharded_param',
    'fake_tensor_mode',
    'tree_map',
    'memory_tracker',
]

# ------------------------------------------------------------------------- nn.Module
# The base class of BatchNorm1d/2d/3d and SyncBatchNorm: torch exports only the concrete
# classes. mmengine's parameter-group rules select norms by it, and our any-rank BatchNorm
# subclasses it (implementing its ``_check_input_dim`` hook, as torch's own subclasses do).
BatchNormBase = _BatchNorm
# The base class of InstanceNorm1d/2d/3d (exported concrete classes only, as above).
InstanceNormBase = _InstanceNorm

# What the activation-checkpoint wrapper (its ``_checkpoint_wrapped_module`` attribute) and
# ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``) insert into parameter names; torch
# keeps these names private (``checkpoint_wrapper._CHECKPOINT_PREFIX``).
WRAPPER_PREFIXES = ('_checkpoint_wrapped_module.', '_orig_mod.')

# The pickle global ``torch.save`` writes for each tensor (``torch._utils``'s rebuild
# function): a reader that only records tensors must recognise the name, not call it.
REBUILD_TENSOR = ('torch._utils', '_rebuild_tensor_v2')


def non_persistent_buffers(module: nn.Module) -> list[str]:
    """The names (FQNs) of ``module``'s buffers registered with ``persistent=False``.

    ``nn.Module`` has no public query (``_non_persistent_buffers_set``); the alternative,
    buffers missing from ``state_dict()``, runs the state-dict hooks (FSDP's, the checkpoint
    wrapper's, which renames keys)."""
    return [
        f'{name}.{buffer}' if name else buffer
        for name, sub in module.named_modules()
        for buffer in sub._non_persistent_buffers_set
    ]


def state_dict_metadata(state_dict: Mapping) -> Any:
    """The ``_metadata`` (module versions by prefix) ``nn.Module.state_dict`` attaches to its
    result and ``load_state_dict`` reads; None when absent. torch has no accessor."""
    return getattr(state_dict, '_metadata', None)


def set_state_dict_metadata(state_dict: Mapping, metadata: Any) -> None:
    """Attach ``metadata`` as :func:`state_dict_metadata` reads it."""
    state_dict._metadata = metadata  # type: ignore[attr-defined]


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), or None when
    ``module`` is not a compiled module: torch has no public accessor, and the class lives
    in ``torch._dynamo`` (checked by name, so ``torch._dynamo`` is never imported here)."""
    if type(module).__name__ == 'OptimizedModule':
        return getattr(module, '_orig_mod', None)
    return None


# ----------------------------------------------------------------------- optimizers
def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """``torch._foreach_mul_``: one kernel for many tensors. The public
    ``clip_grads_with_norm_`` scales parameters' ``.grad``; these are the local pieces of
    DTensor gradients (a DTensor times a plain tensor raises)."""
    torch._foreach_mul_(tensors, scalar)


def unscale_and_check_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: multiply ``grads`` (one device)
    by ``inv_scale`` in place and set ``found_inf`` to 1 if any is inf or nan. The public
    ``GradScaler.unscale_`` does it only with the scaler's own scale, for an optimizer;
    mmengine's float16 master-weight wrapper keeps its own scale."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def grad_scaler_found_inf(scaler: Any, optimizer: Any) -> list[torch.Tensor]:
    """The ``found_inf`` tensors (one per device) ``GradScaler`` recorded for ``optimizer``
    this step, until ``update()`` (``_per_optimizer_states``). Public alternatives (the scale
    before and after ``update``) cost a host sync each step."""
    state = getattr(scaler, '_per_optimizer_states', {}).get(id(optimizer), {})
    return list(state.get('found_inf_per_device', {}).values())


# ---------------------------------------------------------------------- distributed
def default_store() -> Any:
    """The default process group's store (``distributed_c10d._get_default_store``): torch
    has no public accessor, and the checkpoint vote and the background threads need clients
    of that very store (its prefixes: torchrun's per-attempt keys)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def dtensor_like(template: Any, local: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``template``'s (a DTensor's) sharding: mesh, placements, global shape
    and stride, around ``local`` as this rank's piece, left where it is (the private
    constructor over ``template._spec``). The public ``DTensor.from_local`` moves ``local`` to
    the mesh's device: a staged CPU copy of a CUDA shard must stay on the CPU."""
    return type(template)(local, template._spec, requires_grad=False)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` if it is a DTensor (its ``_local_tensor``), else
    ``tensor``: for sizing a state's bytes, where the public ``to_local()`` runs an autograd
    function per tensor (17 us each, a state's thousands of them on every save)."""
    return getattr(tensor, '_local_tensor', tensor)


def load_whole_dcp(storage_reader: Any) -> dict:
    """Every entry of a DCP checkpoint, read by ``storage_reader`` in this process alone. The
    public ``dcp.load`` fills only the keys of the state dict it is given; torch's own
    ``format_utils.dcp_to_torch_save`` reads a whole checkpoint through these private names."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return state


# -------------------------------------------------------------------- serialization
def storage_dtypes() -> dict[str, torch.dtype]:
    """``{'FloatStorage': torch.float32, ...}``: the typed storage names ``torch.save``
    writes (``torch.storage._dtype_to_storage_type_map``; the public typed storage classes
    are deprecated and warn when touched). Quantized ones left out (rebuilt another way)."""
    from torch.storage import _dtype_to_storage_type_map

    return {
        name: dtype
        for dtype, name in _dtype_to_storage_type_map().items()
        if not name.startswith('Q')
    }


def zip_archive_reader(file: Any) -> Any:
    """The reader ``torch.load`` opens its zip format with (``torch._C.PyTorchFileReader``:
    records, offsets), without unpickling anything; torch has no public one."""
    return torch._C.PyTorchFileReader(file)


# ------------------------------------------------------------------------------ FSDP
def apply_activation_checkpointing(
    model: nn.Module, check_fn: Callable[[nn.Module], bool], wrapper_fn: Callable | None = None
) -> None:
    """Wrap each submodule for which ``check_fn`` holds in torch's activation-checkpoint
    wrapper (``wrapper_fn``: a ``checkpoint_wrapper_fn``, default torch's). Module-level
    activation checkpointing, the recipe FSDP2's documentation and torchtitan use, exists
    only in ``torch.distributed.algorithms._checkpoint`` (``torch.utils.checkpoint`` wraps a
    function call)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as apply,
    )

    extra = {} if wrapper_fn is None else {'checkpoint_wrapper_fn': wrapper_fn}
    apply(model, check_fn=check_fn, **extra)


def checkpoint_wrapped(module: nn.Module) -> nn.Module | None:
    """The module inside an activation-checkpoint wrapper (``_checkpoint_wrapped_module``),
    or None when ``module`` is no such wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    if isinstance(module, ActivationWrapper):
        return module._checkpoint_wrapped_module
    return None


def fsdp1_policy_type() -> type:
    """The base class of FSDP1's policy objects (``ModuleWrapPolicy``, ``CustomPolicy``):
    ``torch.distributed.fsdp.wrap._Policy``, not exported."""
    from torch.distributed.fsdp.wrap import _Policy

    return _Policy


def run_fsdp1_policy(
    policy: Any, model: nn.Module, ignored: set[nn.Module]
) -> dict[nn.Module, dict]:
    """The modules an FSDP1 policy object picks, each with its FSDP keyword overrides:
    ``_Policy._run_policy``, the only interface FSDP1 itself calls."""
    return policy._run_policy(model, ignored, {})


def fsdp_params(module: nn.Module) -> list[Any]:
    """The ``FSDPParam`` objects of ``module``'s own FSDP2 parameter group (none when
    ``fully_shard`` was not applied to it): ``module._get_fsdp_state()._fsdp_param_group``.
    FSDP2 has no public API for the gradients it accumulates unsharded while gradient sync is
    off (``set_requires_gradient_sync(False)``); a checkpoint inside an accumulation window
    reads and restores them through these objects (``sharded_param``, ``reduce_dtype``,
    ``unsharded_accumulated_grad``)."""
    state = getattr(module, '_get_fsdp_state', None)
    group = state()._fsdp_param_group if state is not None else None
    return list(group.fsdp_params) if group is not None else []


def unsharded_param(fsdp_param: Any) -> torch.Tensor | None:
    """An ``FSDPParam``'s unsharded parameter (``_unsharded_param``), None before FSDP2 first
    created it (lazily, at the first all-gather)."""
    return getattr(fsdp_param, '_unsharded_param', None)


# ---------------------------------------------------- fake tensors, memory trackers
def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (``torch._subclasses``: tensors with shapes and dtypes and no
    storage) that also accepts real and meta tensors as inputs (``to_empty`` of a meta
    model); fake tensors have no public API."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of nested containers (``torch.utils._pytree``, the
    registry of the containers torch knows, namedtuples included); torch 2.13 has no public
    pytree module."""
    from torch.utils._pytree import tree_map as _tree_map

    return _tree_map(fn, tree)


def memory_tracker(model: nn.Module, optimizers: Iterable[Any], *, fsdp: bool) -> Any:
    """torch's memory tracker over ``model`` and ``optimizers`` (a context manager; peak
    bytes per category from ``get_tracker_snapshot('peak')``): ``FSDPMemTracker`` for an FSDP2
    model (all-gather and reduce-scatter buffers too), else ``MemTracker``. Both live only in
    ``torch.distributed._tools``."""
    optimizers = list(optimizers)
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker: Any = FSDPMemTracker(model, optimizers[0])
        tracker.track_external(*optimizers[1:])
        return tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *optimizers)
    return tracker
