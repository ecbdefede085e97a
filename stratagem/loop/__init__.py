"""The reference loop behind ``stratagem train``: small on purpose, not a framework.

``train`` (``run.py``) imports the config's ``custom_imports`` (``stratagem.config.imports``),
reads it once into a typed run plan (``plan.py``: ``model``, ``strategy``, ``optim_wrapper``,
``param_scheduler``, ``train_dataloader``, ``train_cfg``, ``randomness``, ``val_dataloader``,
``val_cfg`` and mmengine's ``default_hooks.checkpoint`` / ``default_hooks.logger``, checked
against ``stratagem.schema``; :func:`check_train_config` is every refusal, shared with
``stratagem doctor``), lets the strategy prepare everything, and runs iterations. Each
collaborator owns one trigger and its state; the loop calls them in this fixed order:

1. ``batches.py``: the iteration's batch (the rank's shard, per-epoch seeding, the skip to
   a resumed position);
2. ``step.py``: ``strategy.train_step`` (under a pipeline with the model's ``loss``; decided
   once; the first on rank 0 under the FLOP counter, for MFU), its loss and other scalars
   added up and the batch's tokens counted by ``meter.py`` (no host sync); with
   ``train_cfg.anomaly``, ``anomaly.py``'s action when the optim wrapper's step guard refused
   the update (skip, rollback to the last checkpoint, or stop with one);
3. ``schedulers.py``: iteration-based schedulers every iteration (not after a refused
   update), epoch-based ones at epoch ends, as mmengine's ParamSchedulerHook does;
4. the preemption's agreed stop (``train_cfg.preemption``, ``env/preemption.py``);
5. ``validation.py``: when due (every ``train_cfg.val_interval`` epochs or iterations, and at
   the end), whole-set means of the model's scalars across ranks (under a pipeline, ``loss``
   through ``strategy.eval_step``); metric-driven schedulers step with them; ``save_best``
   saves a new best, then deletes the old one;
6. ``checkpoints.py``: every ``checkpoint_interval`` iterations, at the end and at a stop,
   with ``max_keep_ckpts``' retention (the best and the checkpoint resumed from kept);
7. ``meter.py``: every ``log_interval`` iterations, one host sync, the row (log line,
   ``metrics.csv``, TensorBoard) and the progress bar;
8. ``stragglers.py``: on the step that ended a log interval (timed before its gradient
   all-reduce, hooks for that step only), the ranks' phases compared through the store and a
   rank slower than the others' median by ``train_cfg.straggler``'s factor, interval after
   interval, named; then the meter's validation rows and lines.

A resumed run continues from the same sample and the same RNG state, so it ends where an
uninterrupted run would.

Failures (``docs/architecture.md``, "Failures"): a preemption signal stops every rank after
the same iteration, in one committed checkpoint; in a process group a watchdog
(``env/watchdog.py``) names a rank that stops answering and ends this one within the process
group's timeout (``dist_cfg.timeout``) + 10 s.
"""

from .batches import build_dataset, epoch_length_from_config
from .plan import RunPlan, check_train_config, infer_rule
from .run import train
from .step import pipeline_batch, pipeline_loss_fn
from .validation import validate

__all__ = [
    'RunPlan',
    'build_dataset',
    'check_train_config',
    'epoch_length_from_config',
    'infer_rule',
    'pipeline_batch',
    'pipeline_loss_fn',
    'train',
    'validate',
]
