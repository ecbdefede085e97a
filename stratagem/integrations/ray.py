"""Any stratagem config under Ray Train: ``TorchTrainer(train_loop_per_worker, ...)``.

::

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from stratagem.integrations.ray import train_loop_per_worker

    TorchTrainer(
        train_loop_per_worker,
        train_loop_config=dict(config='cfg.py', work_dir='/shared/run', cfg_options={}),
        scaling_config=ScalingConfig(num_workers=2),           # or (min, max): elastic
        run_config=RunConfig(failure_config=FailureConfig(max_failures=3)),
    ).fit()

Each Ray worker runs the reference loop (:func:`stratagem.loop.train`, as ``stratagem
train`` does) in the process group Ray initialised (our strategies reuse it; Ray sets the
variables torchrun would: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, so the
launcher is ``'pytorch'``). The sequence, on every worker:

1. The config: a path (``Config.fromfile``), a dict or a :class:`~stratagem.config.Config`,
   ``cfg_options`` merged as ``--cfg-options`` are (a dict of dotted keys, or ``KEY=VALUE``
   strings), ``work_dir`` set (absolute: a worker's directory is not the driver's).
2. The checkpoint to resume from: the newer of Ray's (``ray.train.get_checkpoint()``) and
   the newest committed one in ``work_dir`` (our ``last_checkpoint`` pointer). A worker
   killed after our commit and before Ray's report leaves Ray none, or an older one: ours
   wins. Ray's wins where ``work_dir`` lost it (a new node without the old disk): rank 0
   copies it into ``work_dir`` under its own name, verifies it against its manifest, and
   points ``last_checkpoint`` at it. The loop then resumes from ``work_dir`` as ``stratagem
   train --resume`` does, at this run's world size: a restart at another size (Ray's
   elastic ``num_workers=(min, max)``) converts the position so that exactly the samples
   left are read (``world_change.py``).
3. Every checkpoint the loop commits (periodic, last, a preemption's) is reported, after its
   commit and never before: ``ray.train.report({'iter', 'checkpoint', 'world_size'},
   checkpoint=Checkpoint.from_directory(d))`` on every rank (Ray's report is a barrier),
   ``d`` holding the committed file (or directory) and its manifest, on rank 0 only.
4. Ray's node-drain notice is the preemption path: every ``drain_check_interval``
   iterations (default 10; ``ray.train.get_preemption_info()`` is a barrier, so every rank
   asks at the same iteration) a drain of a node of the run makes the loop stop as a
   preemption signal would: every rank after the same iteration, one committed checkpoint,
   reported; the worker then raises :class:`RayPreemptedError` (a worker that returned
   would end Ray's run as finished), and Ray starts the run again from that checkpoint,
   counting it against ``FailureConfig.max_preemption_failures``. Ray runs this function in a thread
   of its worker, where Python allows no signal handler: a ``SIGTERM`` to a worker is Ray's
   (the worker process ends) and no preemption signal of ours.

The work_dir lock (``work_dir/.stratagem.lock``) is the driver's to hold (``stratagem train
--ray N`` takes it); the workers take none, as torchrun's workers under ``--nproc`` do.
Importing this module imports ray (``pip install "stratagem[ray]"``); nothing else of
stratagem imports it but ``stratagem train --ray``, on use.
"""

from __future__ import annotations

import contextlib
import copy
import os
import os.path as osp
import shutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import ray
    import ray.train
except ImportError as err:  # pragma: no cover - exercised only without ray
    raise ImportError(
        'stratagem.integrations.ray needs Ray Train: pip install "stratagem[ray]"'
    ) from err

from stratagem import checkpoint as ckpt
from stratagem.checkpoint.latest import update_pointer
from stratagem.checkpoint.manifest import SIDECAR_SUFFIX, manifest_path
from stratagem.config import Config, parse_cfg_options
from stratagem.config.overrides import check_overrides
from stratagem.env.preemption import Preemption, PreemptionConfig

__all__ = ['RayPreemptedError', 'RayPreemption', 'fit', 'train_loop_per_worker']

_KEYS = ('config', 'work_dir', 'cfg_options', 'load_from', 'drain_check_interval')
_STAGING = '.ray_report'  # where a committed checkpoint is linked for Ray's upload


def train_loop_per_worker(config: Mapping[str, Any]) -> None:
    """Ray Train's per-worker function: the config's run, resumed and reported (module doc).

    ``config``: ``config`` (a path, dict or Config), ``work_dir`` (default: the config's,
    else ``work_dirs/<config name>``), ``cfg_options`` (a dict or ``KEY=VALUE`` strings),
    ``load_from`` (weights to start from when there is nothing to resume),
    ``drain_check_interval`` (iterations between two checks of Ray's drain notice)."""
    from stratagem.loop import train

    settings = _settings(config)
    cfg = load_config(config['config'], settings['work_dir'], settings['cfg_options'])
    work_dir = cfg['work_dir']
    rank = ray.train.get_context().get_world_rank()
    if rank == 0:
        restore_ray_checkpoint(ray.train.get_checkpoint(), work_dir)
    reporter = _Reporter(work_dir, rank)
    interval = settings['drain_check_interval']
    result = train(
        cfg,
        resume=True,
        load_from=settings['load_from'],
        progress=False,
        on_checkpoint=reporter,
        preemption=lambda cfg: RayPreemption.from_config(cfg, check_every=interval),
    )
    if result['preempted'] is not None:
        # a worker that returned would end Ray's run as finished; an error while a node
        # drains is Ray's preemption: the run starts again from the reported checkpoint
        raise RayPreemptedError(
            f'preempted ({result["preempted"]}) after iteration {result["iter"]}: checkpoint '
            f'iter_{result["iter"]}.pth committed in {work_dir} and reported to Ray, which '
            'starts the run again from it'
        )


class RayPreemptedError(RuntimeError):
    """A worker stopped by a preemption, its checkpoint committed and reported."""


def _settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """``train_loop_config`` checked: its keys, and a config to run."""
    if not isinstance(config, Mapping) or 'config' not in config:
        raise ValueError(
            'train_loop_config should be a dict with a "config" key (a config path, dict or '
            f'Config), e.g. dict(config="cfg.py", work_dir="/shared/run"); got {config!r}'
        )
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(f'unknown key(s) {unknown} in train_loop_config; valid keys: {_KEYS}')
    interval = config.get('drain_check_interval', 10)
    if type(interval) is not int or interval < 1:
        raise ValueError(
            f'train_loop_config.drain_check_interval should be an int >= 1 (iterations), '
            f'got {interval!r}'
        )
    return dict(
        work_dir=config.get('work_dir'),
        cfg_options=config.get('cfg_options'),
        load_from=config.get('load_from'),
        drain_check_interval=interval,
    )


def load_config(
    config: str | os.PathLike | Mapping | Config,
    work_dir: str | os.PathLike | None = None,
    cfg_options: Mapping[str, Any] | Sequence[str] | None = None,
) -> Config:
    """The run's config: ``config`` read (a path) or copied, ``cfg_options`` merged as
    ``stratagem train --cfg-options`` merges them, ``work_dir`` set and made absolute."""
    if isinstance(config, (str, os.PathLike)):
        cfg = Config.fromfile(str(config))
        name = osp.splitext(osp.basename(str(config)))[0]
    else:
        cfg = copy.deepcopy(config) if isinstance(config, Config) else Config(dict(config))
        name = 'ray'
    if cfg_options:
        options = (
            parse_cfg_options(list(cfg_options))
            if not isinstance(cfg_options, Mapping)
            else dict(cfg_options)
        )
        check_overrides(cfg, options)
        cfg.merge_from_dict(options)
    if work_dir is not None:
        cfg['work_dir'] = str(work_dir)
    elif 'work_dir' not in cfg:
        cfg['work_dir'] = osp.join('work_dirs', name)
    cfg['work_dir'] = osp.abspath(cfg['work_dir'])
    return cfg


# --------------------------------------------------------------------------- resume
def restore_ray_checkpoint(handed: Any, work_dir: str | os.PathLike) -> Path | None:
    """Rank 0: when Ray's checkpoint ``handed`` is newer than the newest committed one in
    ``work_dir`` (or work_dir has none), copy it there, verified against its manifest, and
    point ``last_checkpoint`` at it; returns the copy's path, else None (ours is as new)."""
    if handed is None:
        return None
    work_dir = Path(work_dir)
    with handed.as_directory() as d:
        found = [Path(d) / n for n in sorted(os.listdir(d)) if _is_checkpoint(Path(d) / n)]
        if len(found) != 1:
            raise ValueError(
                f"Ray's checkpoint {handed.path} should hold one stratagem checkpoint and its "
                f'manifest; found {[p.name for p in found] or "none"}: it was not reported '
                'by stratagem.integrations.ray'
            )
        source = found[0]
        theirs = ckpt.verify_checkpoint(source)
        assert theirs is not None  # _is_checkpoint: it has a manifest
        latest = ckpt.find_latest_checkpoint(work_dir)
        ours = ckpt.verify_checkpoint(latest, hash_bytes=False) if latest is not None else None
        if ours is not None and (ours.get('step') or 0) >= (theirs.get('step') or 0):
            return None
        target = work_dir / source.name
        _copy_committed(source, target)
    ckpt.verify_checkpoint(target)
    update_pointer(work_dir, target)
    return target


def _is_checkpoint(path: Path) -> bool:
    """A committed stratagem checkpoint: a file with its sidecar manifest, or a directory
    holding ``manifest.json``."""
    return not path.name.endswith(SIDECAR_SUFFIX) and manifest_path(path).is_file()


def _copy_committed(source: Path, target: Path) -> None:
    """``source`` and its manifest to ``target``, committed as our saves are: a temporary
    name, then a rename, the manifest (of a file) after the file it lists."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f'.{target.name}.ray_restore')
    if tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    if source.is_dir():
        shutil.copytree(source, tmp)
        if target.exists():  # an uncommitted leftover of ours under the name (no manifest)
            shutil.rmtree(target)
        os.replace(tmp, target)
        return
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)
    manifest = manifest_path(source)
    shutil.copyfile(manifest, tmp)
    os.replace(tmp, manifest_path(target))


# --------------------------------------------------------------------------- report
class _Reporter:
    """``on_checkpoint`` of the loop: each committed checkpoint reported to Ray (module doc,
    step 3). Rank 0 hands Ray a directory of hard links to the checkpoint and its manifest
    (no copy of the bytes; nothing ever writes into a committed checkpoint), removed once
    Ray's synchronous upload returned."""

    def __init__(self, work_dir: str, rank: int) -> None:
        self.work_dir, self.rank = Path(work_dir), rank

    def __call__(self, path: str, iteration: int) -> None:
        from ray.train import get_context

        metrics = {
            'iter': iteration,
            'checkpoint': osp.basename(path),
            'world_size': get_context().get_world_size(),
        }
        if self.rank != 0:
            ray.train.report(metrics, checkpoint=None)
            return
        with self._linked(Path(path)) as d:
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(str(d)),
                checkpoint_dir_name=f'checkpoint_iter_{iteration:09d}',
            )

    @contextlib.contextmanager
    def _linked(self, path: Path) -> Iterator[Path]:
        staging = self.work_dir / _STAGING / path.name
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        try:
            if path.is_dir():
                shutil.copytree(path, staging / path.name, copy_function=_link)
            else:
                _link(path, staging / path.name)
                manifest = manifest_path(path)
                _link(manifest, staging / manifest.name)
            yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):
                staging.parent.rmdir()


def _link(source: Any, target: Any) -> Any:
    """A hard link, a copy where the filesystem has none."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
    return target


# ------------------------------------------------------------------------ preemption
class RayPreemption(Preemption):
    """The loop's preemption under Ray: Ray's node-drain notice (``ray.train.
    get_preemption_info()``, asked every ``check_every`` iterations on every rank) requests
    the stop, which the ranks then agree on as for a signal. Signal handlers only where
    Python allows them (the main thread; Ray's training thread is not)."""

    def __init__(self, *args: Any, check_every: int = 10, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.check_every = check_every

    @classmethod
    def from_config(
        cls, cfg: PreemptionConfig, lead: int = 2, check_every: int = 10
    ) -> RayPreemption:
        return cls(
            cfg.signals,
            requeue=cfg.requeue,
            exit_code=cfg.exit_code,
            lead=lead,
            check_every=check_every,
        )

    def __enter__(self) -> RayPreemption:
        if threading.current_thread() is threading.main_thread():
            super().__enter__()
        return self

    def should_stop(self, done: int) -> bool:
        if self.received is None and done % self.check_every == 0:
            info = ray.train.get_preemption_info()
            if info is not None:
                self.request(f'ray node drain (nodes {", ".join(info.preempted_node_ids)})')
        return super().should_stop(done)


# --------------------------------------------------------------------------- driver
def fit(
    cfg: Config,
    num_workers: int | tuple[int, int],
    *,
    max_failures: int = 3,
    use_gpu: bool | None = None,
    storage_path: str | None = None,
    name: str | None = None,
    load_from: str | None = None,
) -> Any:
    """``stratagem train CFG --ray N`` (or ``MIN:MAX``, Ray's elastic ``(MIN, MAX)``):
    ``cfg`` under a ``TorchTrainer`` of ``num_workers`` workers (GPU ones when this machine
    has a GPU, unless ``use_gpu`` says), on the cluster at ``RAY_ADDRESS``, else a local one
    started here; Ray's checkpoints under ``storage_path`` (default ``work_dir/ray``), its
    run named ``name`` (default: the work_dir's name). Returns Ray's ``Result``; a failed
    run raises ``RuntimeError`` with Ray's message (the workers' error), once Ray gave up
    (``max_failures``)."""
    import torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    work_dir = osp.abspath(cfg['work_dir'])
    storage_path = storage_path or osp.join(work_dir, 'ray')
    if use_gpu is None:
        use_gpu = torch.cuda.is_available()
    if not ray.is_initialized():
        # RAY_ADDRESS set: that cluster; else a local one of this machine's CPUs
        ray.init(include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=dict(config=cfg, work_dir=work_dir, load_from=load_from),
        # ray.train's annotations are Train V1's; V2 (2.60's default) takes (min, max)
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),  # type: ignore[arg-type]
        run_config=RunConfig(
            name=trainer_name(work_dir, name),
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    try:
        return trainer.fit()
    except ray.train.TrainingFailedError as err:
        raise RuntimeError(
            f'the Ray Train run of {cfg.filename or "the config"} failed after '
            f"{max_failures} restart(s) at most: {_last_line(err)} (the workers' log is above; "
            f"Ray's run: {trainer_name(work_dir, name)} under {storage_path})"
        ) from err


def trainer_name(work_dir: str, name: str | None) -> str:
    return name or osp.basename(work_dir.rstrip(os.sep)) or 'stratagem'


def _last_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
