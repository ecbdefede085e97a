"""FSDPStrategy: fully sharded data parallel on FSDP2 (``fully_shard``), CPU (gloo) or CUDA.

mmengine's FSDPStrategy is built on FSDP1 and fails on a CPU machine; this one runs on both and
writes directory checkpoints that resume on another world size. ``prepare`` sequence (hooks of
``base.py``): build → init weights (unless ``skip_init_weights``) → ``_wrap_model``
(``shard.py``'s ``shard_model``: tensor parallelism → activation checkpointing → per-block
``compile`` → ``fully_shard`` of the matched blocks bottom-up, root last) → optimizer built
over the sharded parameters → schedulers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem._torch import non_persistent_buffers
from stratagem.checkpoint.sharded import optim_state_to_fqn, optim_state_to_index
from stratagem.checkpoint.storage import CheckpointStorage

from ..base import BaseStrategy
from ..capabilities import Capabilities
from ..environment import distributed_env_kwargs
from ..replica_groups import FaultTolerance, ReplicaGroup
from .config import parse_model_wrapper
from .grad_sync import adapt_optim_wrapper, clean_name, keep_fresh, with_no_sync
from .mesh import parse_mesh
from .options import parse_activation_checkpointing, parse_state_dict_cfg
from .parts import FSDPModelPart, FSDPOptimizerPart, FSDPPendingGradsPart
from .pipeline import PipelineRun, meta_skeleton, parse_pipeline, shard_stages
from .shard import shard_model
from .storage import FSDPStorage
from .tensor_parallel import check_plan_fits_mesh, parse_tensor_parallel_plan


class FSDPStrategy(BaseStrategy):
    """Fully sharded data parallel training with FSDP2 (registered lazily as
    ``'FSDPStrategy'`` in ``strategies/__init__.py``, so importing the package stays cheap).

    Args:
        model_wrapper: ``auto_wrap_policy`` (module class names or classes, a callable
            ``module -> bool``, an FSDP1 policy or its name, ``dict(type='size_based',
            min_num_params=N)``, ``'auto'``: the classes in the model's
            ``_no_split_modules``; matched modules are sharded bottom-up, the root last),
            ``reshard_after_forward`` (bool or int, default True), ``mixed_precision=dict(
            param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)`` (dtypes may be
            strings), ``cpu_offload`` (bool; unpinned memory on a machine without an
            accelerator), ``ignored_modules`` (submodule names, modules, classes or class
            names kept unsharded), ``sync_module_states`` (broadcast rank 0's weights first).
            mmengine's keys and FSDP1's forms (``sharding_strategy``, ``MixedPrecision``,
            ``size_based_auto_wrap_policy``, ...) are mapped; keys with no FSDP2 meaning are
            errors naming the replacement (``config.py``, ``wrap_policy.py``).
        state_dict_type: ``'sharded'`` (default; a directory, DCP shards, reshards across
            world sizes) or ``'full'`` (one consolidated file written by rank 0). mmengine's
            ``state_dict_cfg='local' | 'full' | dict(state_dict_type=...)`` is accepted.
            With ``async_checkpoint=True`` (BaseStrategy) both kinds save in the background;
            a sharded save stages this rank's shards and runs DCP on a gloo group of its own.
        activation_checkpointing: module class names / classes, a callable, or mmengine's
            ``dict(check_fn=..., checkpoint_wrapper_fn=...)``; applied before sharding.
        skip_init_weights: build a cfg model on the meta device, skip ``init_weights`` and
            allocate only this rank's shards (weights are uninitialised until a checkpoint is
            loaded: use it with ``load_checkpoint``/``resume``).
        mesh: ``dict(replicate=R, shard=S, tensor=T)`` (product = world size; default
            ``dict(shard=world_size)``): HSDP, tensor parallelism; data is split over
            ``replicate × shard`` (``mesh.py``).
        tensor_parallel_plan: module-name patterns → ``'colwise'`` / ``'rowwise'`` /
            ``'sequence'`` / ``'colwise_rep'`` / ``'rowwise_rep'``, ``parallelize_fn(model,
            tensor_mesh)``, or ``'auto'``: the plan a ``transformers`` model declares
            (``tensor_parallel.py``).
        pipeline: with ``mesh=dict(pipeline=P, ...)``: ``dict(schedule='1F1B',
            microbatches=M, split_points=[...])`` (``pipeline.py``): ``prepare`` returns this
            rank's stage (the model with the other stages' modules deleted, parameters under
            the model's own names) and :meth:`train_step` runs the schedule.
        fault_tolerance: as DDPStrategy's (``replica_groups.py``): this run is one replica
            group of a fault-tolerant job over torchft, the model sharded over the group's
            processes and each shard's gradients averaged over the live groups each step
            (the mesh's replicate dimension across groups, torchft's all-reduce); a heal
            copies each rank's shards from the peer group's same rank, so every group runs
            the same number of processes and the same ``mesh``; tensor and pipeline
            meshes are refused. Its logs go to ``work_dir/<timestamp>_replica<I>``.
        **kwargs: BaseStrategy's.
    """

    capabilities = Capabilities(
        replaces_parameters=True, fully_shards=True, device_mesh=True, pipeline=True
    )

    def __init__(
        self,
        *,
        model_wrapper: Mapping | None = None,
        state_dict_type: str | None = None,
        state_dict_cfg: Any = None,
        activation_checkpointing: Any = None,
        skip_init_weights: bool = False,
        mesh: Mapping | None = None,
        tensor_parallel_plan: Any = None,
        pipeline: Mapping | None = None,
        fault_tolerance: Mapping | bool | None = None,
        **kwargs: Any,
    ) -> None:
        # checked, its id and lighthouse resolved, before the process group is set up
        self._fault_tolerance = FaultTolerance.option(fault_tolerance)
        self.wrap_cfg = parse_model_wrapper(model_wrapper)
        self.state_dict_type = parse_state_dict_cfg(state_dict_type, state_dict_cfg)
        self.ac_check = parse_activation_checkpointing(activation_checkpointing)
        self.skip_init_weights = bool(skip_init_weights)
        self._block_compile: dict | None = None
        env_kwargs = distributed_env_kwargs(
            kwargs, 'FSDPStrategy', "; for one process use SingleDeviceStrategy (type='auto')"
        )
        super().__init__(env_kwargs=env_kwargs, **kwargs)
        # checked once the world size is known, before any model is built
        self.mesh_spec = parse_mesh(mesh, self.world_size)
        self.tp_plan = parse_tensor_parallel_plan(tensor_parallel_plan)
        check_plan_fits_mesh(self.tp_plan, self.mesh_spec, mesh)
        self.pipeline_spec = parse_pipeline(pipeline, self.mesh_spec)
        if self.pipeline_spec is not None and self.state_dict_type == 'full':
            raise ValueError(
                "state_dict_type='full' writes one file from rank 0, which holds only its "
                "stages under a pipeline: use 'sharded' (each stage writes its shards), and "
                'stratagem convert for one file'
            )
        self.device_mesh: Any = None  # built in prepare
        self._pipeline: PipelineRun | None = None  # built in prepare, under a pipeline
        if self._fault_tolerance is not None:
            if self.mesh_spec.data_parallel_size != self.world_size:
                raise ValueError(
                    f'FSDPStrategy(fault_tolerance=...): mesh={self.mesh_spec.as_dict()} '
                    'splits the model over tensor or pipeline ranks; a replica group shards '
                    'data parallel only (mesh=dict(shard=N) or dict(replicate=R, shard=S))'
                )
            self.replica_group = ReplicaGroup(self._fault_tolerance, self.logger)

    @property
    @override
    def data_parallel_size(self) -> int:
        return self.mesh_spec.data_parallel_size

    @property
    @override
    def data_parallel_rank(self) -> int:
        return self.mesh_spec.data_parallel_rank(self.rank)

    # ------------------------------------------------------------------------ prepare
    @override
    def check_prepare_args(
        self,
        optim_wrapper: Any,
        param_scheduler: Any,
        dispatch_kwargs: Mapping | None,
        compile: bool | Mapping,
    ) -> None:
        """BaseStrategy's checks; ``compile`` compiles each sharded block's forward (before
        sharding) instead of the whole model, so another target is refused."""
        kw = None if not compile else {} if compile is True else dict(compile)
        if kw is not None and kw.pop('target', 'forward') != 'forward':
            raise ValueError(
                f"FSDPStrategy compiles each sharded block's forward; "
                f'compile={compile!r} names another target; leave target out'
            )
        super().check_prepare_args(optim_wrapper, param_scheduler, dispatch_kwargs, compile)
        self._block_compile = kw

    @override
    def setup_module_and_optimizers(
        self, model: nn.Module, optim_wrapper: Any, compile: bool | Mapping = False
    ) -> tuple[nn.Module, Any]:
        """BaseStrategy's, with ``compile`` applied per block inside ``_wrap_model``."""
        return super().setup_module_and_optimizers(model, optim_wrapper, compile=False)

    @override
    def build_model(self, model: nn.Module | Mapping) -> nn.Module:
        if self.skip_init_weights and isinstance(model, Mapping):
            with torch.device('meta'):
                return super().build_model(model)
        return super().build_model(model)

    @override
    def _init_model_weights(self, model: nn.Module) -> nn.Module:
        return model if self.skip_init_weights else super()._init_model_weights(model)

    @override
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            self.logger.info('FSDPStrategy: the model is already sharded; using it as it is')
            return with_no_sync(model)
        on_meta = any(p.is_meta for p in model.parameters())
        shard = functools.partial(
            shard_model,
            wrap_cfg=self.wrap_cfg,
            mesh_spec=self.mesh_spec,
            device=self.device,
            tp_plan=self.tp_plan,
            ac_check=self.ac_check,
            block_compile=self._block_compile,
        )
        if self.pipeline_spec is None:
            model, self.device_mesh, targets = shard(model)
        else:
            model, targets = self._wrap_stages(model, shard)
        if on_meta:
            model.to_empty(device=self.device)
            unsaved = non_persistent_buffers(model)
            if unsaved:  # a checkpoint will not fill them
                self.logger.warning(
                    f'skip_init_weights: non-persistent buffers {unsaved} are '
                    'uninitialised memory; set them after prepare()'
                )
        self.logger.info(
            f'FSDPStrategy: {len(targets)} block(s) + root sharded over '
            f'{self.world_size} ranks ({self.device.type}), mesh {self.mesh_spec.describe()}'
        )
        return model if self._pipeline is not None else with_no_sync(model)

    def _wrap_stages(self, model: nn.Module, shard: Any) -> tuple[nn.Module, list[nn.Module]]:
        """Under a pipeline: the model checked against the stages (before it is touched),
        cut to this rank's stages (``keep_stages``), each stage sharded over the data mesh;
        the schedule is built at the first ``train_step`` (it needs the batch)."""
        spec = self.pipeline_spec
        assert spec is not None
        stages = spec.stage_modules(model)
        spec.check_forward(model, stages)
        skeleton = meta_skeleton(model)
        local = spec.stage_indices(self.mesh_spec.pipeline_rank(self.rank))
        views, self.device_mesh, targets = shard_stages(
            model,
            spec,
            stages,
            local,
            wrap_cfg=self.wrap_cfg,
            tp_plan=self.tp_plan,
            tensor=self.mesh_spec.tensor,
            build_mesh=lambda: self.mesh_spec.build(self.device.type),
            shard=shard,
        )
        self._pipeline = PipelineRun(
            spec, skeleton, dict(zip(local, views, strict=True)), self.device_mesh, self.device
        )
        if self.rank == 0:
            self.logger.info(
                f'FSDPStrategy: pipeline {spec.describe()}; stage units: '
                + '; '.join(f'{i}: {", ".join(u)}' for i, u in enumerate(stages))
            )
        return model, targets

    @override
    def train_step(
        self,
        inputs: Any,
        targets: Any = None,
        loss_fn: Any = None,
        *,
        outputs: list | None = None,
    ) -> torch.Tensor:
        """BaseStrategy's; under a pipeline, the schedule runs this rank's stages on
        ``microbatches`` slices of the batch, ``loss_fn(outputs, targets)`` (a mean) on the
        last stage, gradients the mean over microbatches, then the optim wrapper's update;
        the returned loss (the mean over the microbatches) is the last stage's, on every
        pipeline rank. ``outputs`` is not available under a pipeline."""
        if self._pipeline is None:
            return super().train_step(inputs, targets, loss_fn, outputs=outputs)
        if outputs is not None:
            raise ValueError(
                "train_step(outputs=...): under a pipeline the model's outputs stay on the "
                'last stage; compute what you need in loss_fn'
            )
        return self._pipeline.step(self.model, self._step_wrapper(), inputs, targets, loss_fn)

    @override
    def eval_step(self, inputs: Any, targets: Any = None, loss_fn: Any = None) -> torch.Tensor:
        """BaseStrategy's; under a pipeline, torch's ``schedule.eval`` runs this rank's
        stages forward only on the batch cut into the most microbatches, up to
        ``microbatches``, that divide it evenly; ``loss_fn(outputs, targets)`` on the last
        stage, and their mean, the batch's, reaches every pipeline rank."""
        if self._pipeline is None:
            return super().eval_step(inputs, targets, loss_fn)
        return self._pipeline.evaluate(self.model, inputs, targets, loss_fn)

    @override
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
                    "its cfg instead: optim_wrapper=dict(optimizer=dict(type='AdamW', lr=...))"
                )
        wrapper = super().build_optim_wrapper(optim_wrapper, model)
        for w in wrapper.values() if hasattr(wrapper, 'values') else [wrapper]:
            adapt_optim_wrapper(
                w,
                model,
                mixed_precision=self.wrap_cfg.casts_precision,
                stages=self.mesh_spec.pipeline,
            )
        if self._pipeline is not None:
            self._pipeline.adopt(wrapper)
        return wrapper

    @override
    def unwrap_model(self) -> nn.Module:
        return self.model

    # -------------------------------------------------------------------- state dicts
    def _options(self, full: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=full, cpu_offload=full)

    @override
    def model_state_dict(self) -> dict:
        """Sharded (DTensor) state dict, or the full one on rank 0 under ``'full'``."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=self._options(self._full))

    @override
    def optim_state_dict(self) -> dict:
        """FQN-keyed, sharded optimizer state (index-keyed and full under ``'full'``) plus
        the optim wrapper's counters."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        wrapper = self.optim_wrapper
        with keep_fresh([wrapper.optimizer]):
            state = get_optimizer_state_dict(
                self.model, wrapper.optimizer, options=self._options(self._full)
            )
        if self._full and state:  # rank 0 only: the others get {} (cpu_offload)
            state = optim_state_to_index(state)
        extra = wrapper.state_dict()
        groups = state.get('param_groups', [])
        if self._pipeline is not None:  # every rank saves the whole model's groups
            groups = self._pipeline.merged_param_groups(list(groups))  # type: ignore[arg-type]
        return {
            **{k: v for k, v in extra.items() if k not in ('state', 'param_groups')},
            'state': state.get('state', {}),
            'param_groups': groups,
        }

    @override
    def load_model_state_dict(
        self, state_dict: Mapping, *, strict: bool = False, revise_keys: Any = ((r'^module\.', ''),)
    ) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor

        state_dict = ckpt.revise_keys(state_dict, list(revise_keys))
        full = not any(isinstance(v, DTensor) for v in state_dict.values())
        result = set_model_state_dict(
            self.model,
            dict(state_dict),
            options=StateDictOptions(full_state_dict=full, strict=strict),
        )
        if result.missing_keys or result.unexpected_keys:
            env.log_rank_zero(
                self.logger,
                logging.WARNING,
                'loading weights: missing keys %s, unexpected keys %s',
                list(result.missing_keys),
                list(result.unexpected_keys),
            )
        return result

    @override
    def load_optim_state_dict(self, state_dict: Mapping) -> None:
        """Load an FQN-keyed (sharded or full) or index-keyed (a single-file checkpoint of
        any strategy) optimizer state, then the optim wrapper's counters."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )
        from torch.distributed.tensor import DTensor

        wrapper = self.optim_wrapper
        state = dict(state_dict)
        groups = state.get('param_groups') or []
        if groups and groups[0]['params'] and not isinstance(groups[0]['params'][0], str):
            if self._pipeline is not None:
                raise ValueError(
                    'the optimizer state is keyed by parameter index (a one-file '
                    "checkpoint's), which names no parameter of a pipeline stage; resume a "
                    'pipelined run from a sharded directory an FSDPStrategy saved, or load '
                    'the weights only (load_checkpoint)'
                )
            state = optim_state_to_fqn(state, self._param_names())
        full = not any(
            isinstance(t, DTensor) for s in state.get('state', {}).values() for t in s.values()
        )

        def load(optim_state: dict) -> None:
            set_optimizer_state_dict(
                self.model,
                wrapper.optimizer,
                {
                    'state': optim_state.get('state', {}),
                    'param_groups': optim_state['param_groups'],
                },
                options=StateDictOptions(full_state_dict=full),
            )

        wrapper_state = dict(state.get('optim_wrapper') or {})
        wrapper_state.pop('pending_grads', None)  # sharded grads are None mid-window
        if wrapper_state:
            state['optim_wrapper'] = wrapper_state
        wrapper.load_state_dict(state, load_optimizer=load)  # the wrapper's sequence, DCP's loader

    def _param_names(self) -> list[list[str]]:
        names = {id(p): clean_name(n) for n, p in self.model.named_parameters()}
        return [[names[id(p)] for p in g['params']] for g in self.optim_wrapper.param_groups]

    @override
    def checkpoint_meta(self, extra_meta: Mapping | None = None) -> dict:
        """BaseStrategy's ``meta`` plus ``mesh`` (the sizes this run was sharded over)."""
        return {'mesh': self.mesh_spec.as_dict(), **super().checkpoint_meta(extra_meta)}

    @property
    def _full(self) -> bool:
        # a peer copy is this rank's shards, whatever a save to storage gathers
        return self.state_dict_type == 'full' and not self.checkpointer.capturing_local

    # -------------------------------------------------------------------- checkpoints
    @override
    def checkpoint_storage(self) -> CheckpointStorage:
        return FSDPStorage(
            full=lambda: self._full,
            live_state=self._live_state,
            extra_manifest=lambda: {
                'world_size': self.world_size,
                'strategy': type(self).__name__,
                'mesh': self.mesh_spec.as_dict(),
            },
        )

    def _live_state(self, optimizer: bool) -> tuple[dict, dict | None]:
        """The model's and (when ``optimizer`` and built) the optimizer's live state dicts,
        FQN-keyed DTensors: what DCP reads shards into."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        wrapper = self.optim_wrapper
        optimizers = [wrapper.optimizer] if optimizer and wrapper is not None else []
        with keep_fresh(optimizers):
            model_sd, optim_sd = get_state_dict(self.model, optimizers)
        return model_sd, optim_sd if optimizers else None

    @override
    def model_part(self) -> FSDPModelPart:
        part = super().model_part()
        return FSDPModelPart(
            part.save, part.load, part.module, mesh=self.mesh_spec, logger=self.logger
        )

    @override
    def optimizer_part(self) -> FSDPOptimizerPart:
        def stage_names() -> set[str]:
            return {n for names in self._param_names() for n in names}

        return FSDPOptimizerPart(
            self.optim_wrapper,
            self.optim_state_dict,
            self.load_optim_state_dict,
            stage_names=None if self._pipeline is None else stage_names,
        )

    @override
    def pending_grads_part(self) -> FSDPPendingGradsPart:
        return FSDPPendingGradsPart(
            self.optim_wrapper,
            self.model,
            full=lambda: self._full,
            tensor=self.mesh_spec.tensor,
            pipelined=self._pipeline is not None,
        )
