"""The checks of ``stratagem doctor`` that need no module of their own (the package docstring
lists them all, in the order :func:`stratagem.doctor.diagnose` runs them): 2. batch,
3. precision, 4. sharding (the glue over ``sharding.py``), 6. checkpoints, 7. packages; and
:class:`Doctor`, which composes them with the key, scheduler and memory checks.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .keys import KeyChecks
from .location import LocationChecks
from .memory import MemoryChecks
from .mesh import data_parallel_size
from .pipeline import pipeline_findings, pipeline_spec
from .schedulers import SchedulerChecks
from .sharding import deepspeed_config, sharding_findings

__all__ = ['Doctor', 'Finding']

_OPTIM_STATE_COPIES = {
    'SGD': 1,
    'Adam': 2,
    'AdamW': 2,
    'Adamax': 2,
    'NAdam': 2,
    'RAdam': 2,
    'Adagrad': 1,
    'RMSprop': 1,
    'Adadelta': 2,
    'Lion': 1,
    'Adafactor': 1,
}
_PROBE_BYTES = 32 << 20
_find_spec = importlib.util.find_spec  # looks a package up without importing it


@dataclass(frozen=True)
class Finding:
    """One problem: where in the config, what is wrong, and how to fix it."""

    where: str
    problem: str
    fix: str


def key_named(section: Any, message: str, prefix: str) -> str:
    """The deepest dotted key of a dict in ``section`` (under ``prefix``) whose name the
    error ``message`` mentions as a word, e.g. ``optim_wrapper.clip_grad`` for an error
    about ``clip_grad`` (the message names the argument in it); ``prefix`` when it mentions
    none."""
    import re

    best = prefix
    if isinstance(section, Mapping):
        for key, value in section.items():
            if not isinstance(value, Mapping):
                continue
            inner = key_named(value, message, f'{prefix}.{key}')
            if inner == f'{prefix}.{key}' and not re.search(
                rf'(?<![\w.]){re.escape(str(key))}(?!\w)', message
            ):
                continue
            best = max(best, inner, key=len)
    return best


class Doctor(KeyChecks, SchedulerChecks, MemoryChecks, LocationChecks):
    """One diagnosis: the config, the world size, the model built on the meta device, and the
    findings and notes the checks add."""

    def __init__(
        self, cfg: Mapping, nproc: int, probe_disk: bool = True, device_memory: int | None = None
    ) -> None:
        self.cfg, self.nproc, self.probe_disk = cfg, nproc, probe_disk
        self.device_memory = device_memory
        self.batch: Any = None
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self.model = None
        self.max_iters: int | None = None
        self.max_epochs: int | None = None
        self.epoch_length: int | None = None
        self.dataset_length: int | None = None
        self.data_parallel = nproc
        self.pending: dict[str, list[tuple[str, str, str]]] = {}
        self.plan: Any = None  # the loop's RunPlan, once check_train_config read it

    def add(self, where: str, problem: str, fix: str) -> None:
        self.findings.append(Finding(where, problem, fix))

    # ---------------------------------------------------------------- 2. batch
    def check_batch(self) -> None:
        cfg, strategy = self.cfg, dict(self.cfg.get('strategy') or {})
        micro = int((cfg.get('train_dataloader') or {}).get('batch_size', 1))
        acc = max([int(w.get('accumulative_counts', 1)) for _, w in self.optim_wrappers()] or [1])
        # the pipeline and tensor ranks of one data-parallel index read one batch
        data = self.data_parallel = data_parallel_size(strategy, self.nproc)
        real = data * micro * acc
        self.notes.append(
            f'real batch = {data} data-parallel rank(s) x {micro} micro batch x '
            f'{acc} accumulation = {real}'
        )
        scale = strategy.get('auto_scale_lr') or cfg.get('auto_scale_lr') or {}
        base = scale.get('base_batch_size')
        if base and real != base and not scale.get('enable', False):
            self.add(
                'auto_scale_lr',
                f'the lr was tuned for base_batch_size={base} but the '
                f'real batch is {real}; auto_scale_lr is off, so the lr is not scaled',
                f'set auto_scale_lr.enable=True (lr x {real / base:g}) or tune the lr',
            )
        elif base and real != base:
            self.notes.append(f'auto_scale_lr scales every lr by {real}/{base} = {real / base:g}')
        ds, _ = deepspeed_config(strategy)  # a dict or a JSON file, with the keyword sections
        for key, ours in (
            ('train_batch_size', real),
            ('train_micro_batch_size_per_gpu', micro),
            ('gradient_accumulation_steps', acc),
        ):
            if ds.get(key) not in (None, 'auto') and int(ds[key]) != ours:
                self.add(
                    f'strategy.config.{key}',
                    f'DeepSpeed {key}={ds[key]} disagrees with '
                    f'the config: {ours} (data-parallel {data} x micro {micro} x '
                    f'accumulation {acc})',
                    f'remove it (stratagem derives it) or set it to {ours}',
                )

    # ------------------------------------------------------------ 3. precision
    def check_precision(self) -> None:
        import torch

        for where, ow in self.optim_wrappers():
            if ow.get('type') in ('AmpOptimWrapper', 'DeepSpeedAmpOptimWrapper'):
                self._check_amp(where, ow)
        from stratagem.strategies.capabilities import capabilities_of

        strategy = self.cfg.get('strategy') or {}
        if capabilities_of(strategy.get('type'), self.nproc).deepspeed_config:
            ds, _ = deepspeed_config(strategy)
            if (ds.get('fp16') or {}).get('enabled') and not torch.cuda.is_available():
                self.add(
                    'strategy.fp16',
                    "DeepSpeed fp16 on a machine without CUDA (DeepSpeed's CPU accelerator "
                    'refuses it)',
                    'use bf16=dict(enabled=True) on CPU',
                )

    def _check_amp(self, where: str, ow: Mapping) -> None:
        import torch

        from stratagem.optim.amp_optim_wrapper import resolve_dtype

        cuda = torch.cuda.is_available()
        try:  # None: the device's autocast default (fp16 on CUDA, bf16 on CPU)
            default = 'float16' if cuda else 'bfloat16'
            dtype = str(resolve_dtype(ow.get('dtype') or default)).replace('torch.', '')
        except (TypeError, ValueError) as err:
            self.add(f'{where}.dtype', str(err), "use 'bfloat16' or 'float16'")
            return
        if dtype == 'bfloat16' and ow.get('loss_scale') is not None:
            self.add(
                f'{where}.loss_scale',
                "bf16 with a GradScaler: bf16 has fp32's range, so loss scaling only costs time",
                'remove loss_scale',
            )
        if dtype == 'float16' and not cuda:
            self.add(
                f'{where}.dtype',
                'fp16 autocast on a machine without CUDA (CPU '
                'fp16 autocast is slow and loss scaling is CUDA-only)',
                "use dtype='bfloat16' on CPU, or run on a CUDA device",
            )
        if dtype == 'bfloat16' and cuda and not torch.cuda.is_bf16_supported():
            self.add(
                f'{where}.dtype',
                f'bf16 on {torch.cuda.get_device_name()}, which lacks native bf16',
                "use dtype='float16' with loss_scale='dynamic'",
            )

    # ------------------------------------------------------------- 4. sharding
    def build_meta_model(self) -> None:
        model_cfg = self.cfg.get('model')
        if not isinstance(model_cfg, Mapping):
            return
        import torch

        from stratagem.registry import MODELS

        try:
            with torch.device('meta'):
                self.model = MODELS.build(dict(model_cfg))
        except Exception as err:  # noqa: BLE001 - a finding of its own, checks go on
            self.settle(
                'model',
                'cannot instantiate the model on the meta device to count its parameters: '
                f'{type(err).__name__}: {err}',
                'fix the model config; the checks that need the parameter count were skipped',
            )
            return
        self.settle('model', None)  # it builds: the keys its signature hides are fine

    def check_builds(self) -> None:
        """What ``stratagem train`` checks and builds before its first iteration, through
        the functions it uses: the loop's config checks (``loop.check_train_config``) and
        the optim wrapper over the meta model (``optim.build_optim_wrapper``, as
        ``BaseStrategy.prepare`` builds it); each error is a finding at the key it names."""
        from stratagem.loop import check_train_config
        from stratagem.schema import runner_reasons

        try:
            routed = bool(runner_reasons(self.cfg))
        except ValueError:
            routed = True  # a runner_type train refuses: the key check's finding
        try:
            if not routed:  # mmengine's runner reads such a config, with its own checks
                self.plan = check_train_config(self.cfg, top_level=False)  # keys.py: each key
                self._check_top_level()
            elif _find_spec('mmengine') is not None:
                self._check_runner_config()
        except (ValueError, TypeError, KeyError) as err:
            message = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
            where = next((k for k in ('train_dataloader', 'train_cfg') if k in message), 'config')
            if not any(f.where.startswith(where) for f in self.findings):
                self.add(where, message, 'stratagem train stops here: fix the key named')
        ow = self.cfg.get('optim_wrapper')
        if self.model is None or not isinstance(ow, Mapping):
            return
        from stratagem.optim import build_optim_wrapper

        try:
            build_optim_wrapper(self.model, dict(ow))
        except Exception as err:  # noqa: BLE001 - the run would fail the same way
            where = key_named(ow, str(err), 'optim_wrapper')
            if not any(f.where == where for f in self.findings):
                self.add(
                    where,
                    f'cannot build the optim wrapper: {type(err).__name__}: {err}',
                    'stratagem train fails here: fix the key named',
                )

    def _check_top_level(self) -> None:
        """The loop's own top-level refusal, when ``keys.py`` found no top-level key: the two
        read the same function, and this keeps them from disagreeing if it changes."""
        import warnings

        from stratagem.loop import check_train_config

        if any(f.where in self.cfg for f in self.findings):
            return
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # said once already, by the first reading
            check_train_config(self.cfg)

    def _check_runner_config(self) -> None:
        """``train``'s reading of a config it runs under FlexibleRunner
        (``integrations.mmengine_runner.runner_config``), when ``keys.py`` found no
        top-level key."""
        import warnings

        from stratagem.integrations.mmengine_runner import runner_config

        if any(f.where in self.cfg for f in self.findings):
            return
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # keys.py noted the keys it warns about
            runner_config(self.cfg, launcher='none')

    def check_data_size(self) -> None:
        """The real batch against the dataset (``loop.batches.batch_problem``, the check
        ``train`` stops with when it builds its batches, before the first step)."""
        if self.dataset_length is None:
            return
        from stratagem.loop.batches import batch_problem

        loader = self.cfg.get('train_dataloader') or {}
        problem = batch_problem(
            self.dataset_length,
            int(loader.get('batch_size', 1)),
            self.data_parallel,
            bool(loader.get('drop_last', False)),
        )
        if problem is not None:
            self.add('train_dataloader.batch_size', problem, 'stratagem train stops here')

    def check_validation(self) -> None:
        """What ``train`` runs before its first step when the config validates: the val
        loader built (``loop.validation.Validation``, as data-parallel rank 0), one forward
        of the model on its first batch (the meta model; the model on the CPU when a
        data-dependent operation stops that and it is small), and ``save_best`` checked
        against the names it returns (``BestCheckpoint.check``)."""
        plan = self.plan
        if plan is None or plan.validation is None:
            return
        from types import SimpleNamespace

        import torch

        from stratagem.loop.validation import BestCheckpoint, Validation

        ranks = SimpleNamespace(data_parallel_rank=0, data_parallel_size=self.data_parallel)
        cpu = torch.device('cpu')
        try:
            validation = Validation(plan.validation, ranks, 0, cpu, 1, 1, plan.by_epoch)
            batch = next(iter(validation.loader))
        except Exception as err:  # noqa: BLE001 - the run would fail the same way
            self.settle(
                'val_dataloader.dataset',
                f'the validation loader cannot be built: {type(err).__name__}: {err}',
                'stratagem train fails here, before its first step: fix val_dataloader',
            )
            return
        self.settle('val_dataloader.dataset', None)
        names = self._validation_names(batch)
        if names is None:
            return
        fix = 'stratagem train stops here, before its first step: name one of them'
        if plan.best is not None:
            try:
                BestCheckpoint(plan.best).check(names)
            except ValueError as err:
                self.add('default_hooks.checkpoint.save_best', str(err), fix)
        self._check_monitors(names, fix)

    def _check_monitors(self, names: list[str], fix: str) -> None:
        """Each metric-driven scheduler's ``monitor`` (``need_val_args``; its default when
        not given) against the validation's names (``loop.schedulers.monitor_problem``)."""
        import inspect

        from stratagem.loop.schedulers import monitor_problem
        from stratagem.registry import PARAM_SCHEDULERS

        for i, sched in enumerate(self._schedulers()):
            kind = sched.get('type')
            try:
                cls = PARAM_SCHEDULERS.get(kind) if isinstance(kind, str) else kind
            except ImportError:  # the key check's finding
                continue
            if cls is None or not getattr(cls, 'need_val_args', False):
                continue
            default = inspect.signature(cls).parameters.get('monitor')
            monitor = sched.get('monitor', default.default if default is not None else None)
            problem = monitor_problem(cls.__name__, monitor, names)
            if problem is not None:
                self.add(f'param_scheduler[{i}].monitor', problem, fix)

    def _validation_names(self, batch: Any) -> list[str] | None:
        """The names of the model's validation scalars for ``batch`` (``loop.validation
        .batch_scalars``, eval mode, no grad): on the meta model, else (a data-dependent
        operation stops it there) on a CPU copy of a model of at most 256 MiB of parameters.
        None when neither tells (a note), or with a finding when the forward fails as it
        would at the start of ``train``."""
        if self.model is None:
            return None
        if pipeline_spec(dict(self.cfg.get('strategy') or {}), self.nproc) is not None:
            # the stages return outputs: validation averages the model's loss alone
            # (``loop.step.eval_values``)
            return ['loss']
        import torch

        from stratagem.registry import MODELS

        try:
            return _scalar_names(self.model, batch, torch.device('meta'))
        except _NoScalar as err:
            self.add('model', str(err), 'return a loss tensor or a dict of scalars such as acc')
            return None
        except Exception as err:  # noqa: BLE001 - data-dependent on meta: try the CPU
            on_meta = err
        if sum(p.numel() * p.element_size() for p in self.model.parameters()) > 256 << 20:
            self.notes.append(
                "validation's first batch did not run on the meta model "
                f'({type(on_meta).__name__}: {on_meta}); stratagem train runs it (and checks '
                'save_best) before its first step'
            )
            return None
        try:
            return _scalar_names(MODELS.build(dict(self.cfg['model'])), batch, torch.device('cpu'))
        except _NoScalar as err:
            self.add('model', str(err), 'return a loss tensor or a dict of scalars such as acc')
        except Exception as err:  # noqa: BLE001 - the run fails the same way, at its start
            self.add(
                'val_dataloader',
                "the model's validation forward on the first batch fails: "
                f'{type(err).__name__}: {err}',
                'stratagem train fails here, before its first step: fix the model or the data',
            )
        return None

    def check_sharding(self) -> None:
        strategy = dict(self.cfg.get('strategy') or {})
        ow = self.cfg.get('optim_wrapper')
        for where, problem, fix in sharding_findings(strategy, ow, self.nproc, self.model):
            self.add(where, problem, fix)

    def check_pipeline(self) -> None:
        """FSDP's ``pipeline`` against the mesh, the model and one batch (``pipeline.py``)."""
        strategy = dict(self.cfg.get('strategy') or {})
        loader = self.cfg.get('train_dataloader') or {}
        for finding in pipeline_findings(
            strategy,
            self.nproc,
            self.model,
            self.batch,
            loader,
            self.dataset_length,
        ):
            self.add(*finding)

    def optim_wrappers(self) -> list[tuple[str, Mapping]]:
        """``(where, wrapper cfg)`` for one wrapper or each of an ``OptimWrapperDict``'s
        (``optim_wrapper=dict(generator=dict(...), discriminator=dict(...))``, with or
        without mmengine's ``constructor``)."""
        ow = self.cfg.get('optim_wrapper')
        if not isinstance(ow, Mapping):
            return []
        if any(k in ow for k in ('type', 'optimizer')) or not ow:
            return [('optim_wrapper', ow)]
        return [
            (f'optim_wrapper.{k}', v)
            for k, v in ow.items()
            if k not in ('constructor', 'paramwise_cfg') and isinstance(v, Mapping)
        ]

    # ----------------------------------------------------------- 5. schedulers
    def run_length(self) -> None:
        """The run's ``max_iters`` / ``max_epochs`` and iterations per epoch, as the loop
        computes them (the dataset's length when it builds, else ``num_samples``)."""
        train = self.cfg.get('train_cfg') or {}
        self.max_epochs, self.max_iters = train.get('max_epochs'), train.get('max_iters')
        loader = self.cfg.get('train_dataloader') or {}
        samples = self.dataset_length or (loader.get('dataset') or {}).get('num_samples')
        if samples and loader.get('batch_size'):
            per_rank = -(-int(samples) // self.data_parallel)
            batch = int(loader['batch_size'])
            batches = per_rank // batch if loader.get('drop_last') else -(-per_rank // batch)
            self.epoch_length = max(1, batches)
        if self.max_iters is not None:
            self.max_epochs = None  # the loop: max_iters wins
        elif self.max_epochs and self.epoch_length:
            self.max_iters = int(self.max_epochs) * self.epoch_length
        if self.plan is not None and self.epoch_length:
            try:  # the settings train reads once it knows the epoch length
                self.plan.checkpoints.every(self.epoch_length)
            except ValueError as err:
                self.add('default_hooks.checkpoint.interval', str(err), 'keep one of them')

    # ---------------------------------------------------------- 6. checkpoints
    def check_checkpoints(self) -> None:
        if self.model is None:
            return
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in self.model.buffers())
        opt = (self.cfg.get('optim_wrapper') or {}).get('optimizer') or {}
        copies = _OPTIM_STATE_COPIES.get(str(opt.get('type')), 2)
        if opt.get('type') == 'SGD' and not opt.get('momentum'):
            copies = 0
        size = params * (1 + copies) + buffers + (1 << 20)
        self.notes.append(
            f'estimated checkpoint: {size / 2**20:.0f} MiB ({params // 4:,} '
            f'fp32 parameters, {copies} optimizer state copies)'
        )
        train = self.cfg.get('train_cfg') or {}
        interval, keep = train.get('checkpoint_interval') or 0, train.get('max_keep_ckpts')
        saves = 1 + (self.max_iters // interval if interval and self.max_iters else 0)
        work_dir = Path(self.cfg.get('work_dir') or 'work_dirs').absolute()
        existing = next(p for p in [work_dir, *work_dir.parents] if p.exists())
        free = shutil.disk_usage(existing).free
        kept = min(saves, keep + 1) if keep and keep > 0 else saves
        if free < kept * size:
            self.add(
                'train_cfg.max_keep_ckpts',
                f'{kept} checkpoint(s) of ~{size / 2**20:.0f}'
                f' MiB need {kept * size / 2**30:.1f} GiB; {existing} has '
                f'{free / 2**30:.1f} GiB free',
                'free disk space, lower max_keep_ckpts, or set work_dir on a larger filesystem',
            )
        async_on = bool((self.cfg.get('strategy') or {}).get('async_checkpoint'))
        if not self.probe_disk or saves < 2 or async_on:
            return
        speed = _disk_write_speed(existing)
        stall = size / speed
        self.notes.append(
            f'disk writes ~{speed / 2**20:.0f} MiB/s: a save stalls training '
            f'~{stall:.1f} s, {saves} saves ~{saves * stall:.0f} s'
        )
        if saves * stall > 60:
            self.add(
                'train_cfg.checkpoint_interval',
                f'{saves} synchronous saves stall '
                f'training ~{saves * stall:.0f} s in total (~{stall:.1f} s each at '
                f'{speed / 2**20:.0f} MiB/s)',
                'set strategy.async_checkpoint=True (blocks '
                'only for a copy to memory) or raise checkpoint_interval',
            )

    # ------------------------------------------------------------ 7. packages
    def check_packages(self) -> None:
        from stratagem.strategies.capabilities import capabilities_of

        stype = (self.cfg.get('strategy') or {}).get('type', 'auto')
        needs = list(capabilities_of(stype, self.nproc).requires)
        needs.append('xxhash')  # checkpoint digests (sha256 fallback is ~10x slower)
        if self.cfg.get('optim_wrapper', {}).get('type') == 'ZeroRedundancyOptimizer':
            needs.append('torch.distributed.optim')
        for package in needs:
            if _find_spec(package.split('.')[0]) is None:
                self.add(
                    'strategy.type' if package != 'xxhash' else 'environment',
                    f'{stype if package != "xxhash" else "checkpoints"} need(s) the '
                    f'{package!r} package, which is not installed',
                    f'pip install {package} (or "stratagem[{package}]")',
                )


class _NoScalar(ValueError):
    """The model returned no scalar in validation (``loop.validation.batch_scalars``)."""


def _scalar_names(model: Any, batch: Any, device: Any) -> list[str]:
    """The names of ``model``'s validation scalars for ``batch`` on ``device``, as the loop's
    validation reads them; the model is left in train mode."""
    import torch

    from stratagem.loop.validation import batch_scalars

    model.eval()
    try:
        with torch.no_grad():
            return list(batch_scalars(model, batch, device))
    except ValueError as err:
        if 'returned no scalar' in str(err):
            raise _NoScalar(str(err)) from None
        raise
    finally:
        model.train()


def _disk_write_speed(directory: Path) -> float:
    """Bytes/s of one 32 MiB write + fsync into ``directory`` (removed afterwards)."""
    data = os.urandom(1 << 20)
    fd, name = tempfile.mkstemp(prefix='.stratagem-doctor-', dir=directory)
    try:
        start = time.perf_counter()
        for _ in range(_PROBE_BYTES >> 20):
            os.write(fd, data)
        os.fsync(fd)
        return _PROBE_BYTES / max(time.perf_counter() - start, 1e-6)
    finally:
        os.close(fd)
        os.unlink(name)
