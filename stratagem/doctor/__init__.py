"""Pre-flight checks of a config against this machine (``stratagem doctor CONFIG [--nproc N]``).

Runs no training and builds nothing heavy: no real process group, no real weights. The
model is instantiated on the ``meta`` device (no memory, no weights) to count parameters, list
module classes and run validation's first batch (only when a data-dependent operation stops
that there is a model of at most 256 MiB of parameters built on the CPU for it); a model that
cannot be built is reported and those checks skipped. Each check reads the config (and the
machine: devices, packages, free disk, one 32 MiB write to time the disk) and adds findings,
each with its fix:

1. keys (``keys.py``): unknown or misspelt keys anywhere the config is read (top
   level as ``train`` judges it, ``train_cfg``, ``train_dataloader``, ``strategy`` and its
   ``env_kwargs``/``randomness``, the model, dataset, optimizer, optim wrapper and scheduler
   arguments, by their signatures; the model's and the datasets' only when they fail to
   build), and ``type`` names no registry knows;
2. batch: world size × micro batch × accumulation against ``auto_scale_lr.base_batch_size``
   and DeepSpeed's ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
   ``gradient_accumulation_steps``; after the dataset is built, a rank's share of it against
   the micro batch (``loop.batches.batch_problem``), and validation as ``train`` checks it
   before its first step: the val loader, one forward of the meta model on its first batch,
   ``save_best`` against the names returned (``loop.validation``);
3. precision: bf16 with a GradScaler (``loss_scale``), fp16 or bf16 on a device without it;
4. sharding (``sharding.py``, by the strategies' own parsers): FSDP's
   ``model_wrapper`` (every ``auto_wrap_policy`` / ``ignored_modules`` form, refused keys),
   ``activation_checkpointing`` and ``state_dict_cfg``, the modules each selects on the meta
   model; activation checkpointing without a wrap policy; FSDP's ``mesh`` against the world
   size and its ``tensor_parallel_plan`` against the model (``mesh.py``); DeepSpeed's
   config (a dict or a JSON file, with the keyword sections) and ``gradient_clipping``;
   FSDP's ``pipeline`` against the mesh, the model (split points, a forward that skips a
   deleted module, every stage run on meta tensors) and the batch (``pipeline.py``; after
   the dataset gives one batch);
5. schedulers (``schedulers.py``, each built as a run builds it): ``begin``, ``end``,
   ``T_max``, ``milestones``, ``step_size``, ``periods``, ``total_steps`` against the run's
   length, ``convert_to_iter_based`` included; windows of two absolute schedules of the same
   parameter and optimizer that overlap (mmengine multiplies them; a warmup over a main
   schedule is the expected overlap and not reported);
6. checkpoints: the estimated save stall against the run (synchronous saves), free disk for
   ``max_keep_ckpts`` (+1 being written) checkpoints; then ``default_hooks.checkpoint.out_dir``
   (``location.py``): written to (a probe object, removed) and, at a URL, the debris of
   interrupted uploads there listed;
7. packages the chosen strategy needs but this environment lacks;
8. memory (``memory.py``): the peak per device of one training step at the world size
   (fake tensors, torch's fake process group, torch's memory trackers; under a pipeline,
   the largest of the pipeline ranks' stages), a finding when it exceeds
   ``device_memory``. This builds the dataset for one micro batch (its shapes).

:func:`diagnose` runs them in this order over one ``checks.Doctor`` (checks 2, 3, 6 and 7 and
the sharding check's glue are ``checks.py``'s; each other module holds one check) and returns
the findings; :func:`format_table` lays them out; the command
(``stratagem.cli.doctor``) exits 0 when there is no finding, 1 otherwise (2 for a config that
cannot be read).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping

from .checks import Doctor, Finding

__all__ = ['diagnose', 'format_table']


def diagnose(
    cfg: Mapping,
    nproc: int = 1,
    *,
    probe_disk: bool = True,
    device_memory: int | None = None,
    memory: bool = True,
) -> tuple[list[Finding], list[str]]:
    """All findings for ``cfg`` run on ``nproc`` processes, and informational notes.
    ``device_memory``: bytes per device; an estimated peak above it is a finding.
    ``memory=False`` skips the memory estimate."""
    doctor = Doctor(cfg, nproc, probe_disk, device_memory)
    doctor.check_keys()
    doctor.check_batch()
    doctor.check_precision()
    doctor.build_meta_model()
    doctor.check_builds()
    doctor.check_sharding()
    doctor.load_batch()
    doctor.check_data_size()
    doctor.check_validation()
    doctor.check_pipeline()
    doctor.run_length()
    doctor.check_schedulers()
    doctor.check_checkpoints()
    doctor.check_location()
    doctor.check_packages()
    if memory or device_memory is not None:
        doctor.check_memory()
    for where in list(doctor.pending):  # a section never built: its signature findings stand
        doctor.settle(where, 'not built')
    return doctor.findings, doctor.notes


def format_table(findings: list[Finding]) -> str:
    """Findings as a plain-text table: #, where, problem, fix (long cells wrap)."""
    import textwrap

    width = max(80, min(shutil.get_terminal_size((120, 20)).columns, 160))
    cols = [3, 28, (width - 38) // 2, (width - 38) - (width - 38) // 2]
    head = ('#', 'where', 'problem', 'fix')
    rows = [head] + [(str(i), f.where, f.problem, f.fix) for i, f in enumerate(findings, 1)]
    lines = []
    for n, row in enumerate(rows):
        # words are never split: a dotted key breaks after a '.', and a longer part
        # overflows its column rather than wrap mid-word
        cells = [
            _wrap_key(row[1], cols[1]),
            *(
                textwrap.wrap(c, w, break_long_words=False, break_on_hyphens=False) or ['']
                for c, w in zip(row[2:], cols[2:])
            ),
        ]
        cells.insert(0, [row[0]])
        for k in range(max(len(c) for c in cells)):
            lines.append(
                '  '.join(
                    (c[k] if k < len(c) else '').ljust(w) for c, w in zip(cells, cols)
                ).rstrip()
            )
        if n == 0:
            lines.append('  '.join('-' * w for w in cols))
    return '\n'.join(lines)


def _wrap_key(key: str, width: int) -> list[str]:
    """A dotted key in lines of at most ``width`` characters, broken only after a '.' or a
    space (a part longer than ``width`` keeps its own line, overflowing)."""
    import re

    lines: list[str] = []
    line = ''
    for part in re.split(r'(?<=[. ])', key):
        if line and len(line.rstrip()) + len(part.rstrip()) > width:
            lines.append(line.rstrip())
            line = ''
        line += part
    lines.append(line.rstrip())
    return lines
