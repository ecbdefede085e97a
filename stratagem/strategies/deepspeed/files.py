"""DeepSpeed (ZeRO) directory checkpoints: verify, consolidate, convert to one file.

A DeepSpeed checkpoint written by :class:`~stratagem.strategies.DeepSpeedStrategy` is a
directory committed by stratagem's protocol::

    iter_100.pth/
        manifest.json            stratagem's: each file's size and digest, world size, stage
        stratagem_state.pth      meta, schedulers, counters, every rank's RNG (weights_only)
        deepspeed/               DeepSpeed's own files (tag 'deepspeed'): model states and,
            mp_rank_00_model_states.pt, *_optim_states.pt   under ZeRO, the optimizer shards
        zero_to_fp32.py ...      DeepSpeed's recovery scripts

DeepSpeed reads its files with ``torch.load(weights_only=False)``, which runs any code a
file carries. Every function here therefore verifies the manifest (sizes and digests of every
file) *before* DeepSpeed unpickles anything; a directory without a manifest, or with a
changed byte, is refused.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import BinaryIO

import torch

from stratagem.checkpoint.directory import verify_directory
from stratagem.checkpoint.errors import CheckpointCorruptError
from stratagem.checkpoint.load import load_checkpoint_file
from stratagem.checkpoint.single_file import save_checkpoint

__all__ = [
    'DEEPSPEED_TAG',
    'STATE_FILE',
    'verify_zero_checkpoint',
    'check_zero_layout',
    'check_zero_archive',
    'check_zero_archives',
    'rank_reads',
    'zero_to_state_dict',
    'read_zero_checkpoint',
    'convert_zero_checkpoint',
    'is_zero_checkpoint',
]

DEEPSPEED_TAG = 'deepspeed'
STATE_FILE = 'stratagem_state.pth'


def is_zero_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory laid out as above (manifest not checked)."""
    path = Path(path)
    return path.is_dir() and (path / STATE_FILE).is_file() and (path / DEEPSPEED_TAG).is_dir()


def check_zero_layout(path: str | os.PathLike, listed: set[str] | None = None) -> None:
    """Raise ``CheckpointCorruptError`` unless the committed directory ``path`` is laid out as
    a DeepSpeedStrategy checkpoint (at a URL: its manifest's ``listed`` file paths)."""
    if listed is None:
        laid_out = is_zero_checkpoint(path)
    else:
        laid_out = STATE_FILE in listed and any(p.startswith(f'{DEEPSPEED_TAG}/') for p in listed)
    if not laid_out:
        raise CheckpointCorruptError(
            f'{path} is a stratagem checkpoint but not a DeepSpeed one '
            f'(no {STATE_FILE} and {DEEPSPEED_TAG}/)'
        )


def check_zero_archives(path: str | os.PathLike) -> None:
    """Raise ``CheckpointCorruptError`` naming the file unless every DeepSpeed file of ``path``
    opens as a torch zip archive (its central directory and record names read; no byte of a
    tensor, nothing unpickled). Every rank checks every file, so all ranks reach the same
    verdict without a collective: DeepSpeed's load reads each rank's own files between
    collectives, and a rank failing there leaves the others waiting in the next one."""
    for file in sorted((Path(path) / DEEPSPEED_TAG).glob('*.pt')):
        with open(file, 'rb') as stream:
            check_zero_archive(file, stream)


def check_zero_archive(where: str | os.PathLike, stream: BinaryIO) -> None:
    """Raise ``CheckpointCorruptError`` naming ``where`` unless ``stream`` (a DeepSpeed file's
    bytes) opens as a torch zip archive; nothing unpickled (``check_zero_archives``)."""
    from stratagem._torch import zip_archive_reader

    try:
        zip_archive_reader(stream).get_all_records()
    except (RuntimeError, OSError, ValueError) as err:
        raise CheckpointCorruptError(
            f'{where} is damaged: it is no complete torch archive ({str(err).splitlines()[0]})'
            '; it was not loaded'
        ) from None


_RANK_FILE = re.compile(r'(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:model|optim)_states\.pt')
_SHARED_FILE = re.compile(r'mp_rank_\d+_model_states\.pt')


def rank_reads(path: str, rank: int, *, optimizer: bool) -> bool:
    """Whether DeepSpeed's ``engine.load_checkpoint`` reads the file ``path`` (relative to a
    checkpoint directory) on data-parallel rank ``rank`` of the world size that saved it, as
    DeepSpeed 0.19 names them: our ``stratagem_state.pth`` and the model states every rank
    reads (``mp_rank_00_model_states.pt``), and the rank's own ZeRO files
    (``[bf16_]zero_pp_rank_<rank>_mp_rank_00_{model,optim}_states.pt``; its optimizer
    partition only when ``optimizer``). A file it reads beyond these is read when it asks."""
    if path == STATE_FILE:
        return True
    folder, _, name = path.rpartition('/')
    if folder != DEEPSPEED_TAG:
        return False
    if _SHARED_FILE.fullmatch(name):
        return True
    own = _RANK_FILE.fullmatch(name)
    return own is not None and int(own.group(1)) == rank and (optimizer or 'optim' not in name)


def verify_zero_checkpoint(path: str | os.PathLike) -> dict:
    """Verify a DeepSpeed checkpoint directory in this process (sizes and digests of every
    file, ``verify_directory(collective=False)``); return its manifest.

    Raises ``FileNotFoundError`` if it is missing, ``CheckpointCorruptError`` naming the file
    if a byte differs or no stratagem manifest covers the directory (a DeepSpeed checkpoint
    written by mmengine or DeepSpeed itself cannot be verified, and is not unpickled).
    """
    manifest = verify_directory(path, collective=False)
    check_zero_layout(path)
    check_zero_archives(path)
    return manifest


def zero_to_state_dict(
    path: str | os.PathLike, *, verify: bool = True, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The model's full fp32 state dict from a DeepSpeed checkpoint directory, on CPU.

    Needs no process group. ZeRO 1–3 (and bf16) shards are consolidated with DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``; a stage-0 fp32 checkpoint holds the full
    weights in its model-states file. ``verify`` hashes every file first (pass False only
    right after a verification of the same directory).
    """
    path = Path(path).absolute()
    if verify:
        verify_zero_checkpoint(path)
    try:
        state = _read_zero_weights(path, exclude_frozen_parameters)
    except CheckpointCorruptError:
        raise
    except Exception as err:  # noqa: BLE001 - DeepSpeed meets damaged bytes with anything
        raise CheckpointCorruptError(
            f'{path} is damaged: DeepSpeed could not read its files: {type(err).__name__}: '
            f'{err}; it was not loaded'
        ) from None
    return {k: v.detach().clone() for k, v in state.items()}


def _read_zero_weights(path: Path, exclude_frozen_parameters: bool) -> dict:
    tag_dir = path / DEEPSPEED_TAG
    if glob.glob(str(tag_dir / '*optim_states.pt')):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(
            str(path), tag=DEEPSPEED_TAG, exclude_frozen_parameters=exclude_frozen_parameters
        )
    else:
        files = sorted(glob.glob(str(tag_dir / 'mp_rank_*_model_states.pt')))
        if len(files) != 1:
            raise CheckpointCorruptError(
                f'{tag_dir} holds neither ZeRO optimizer shards nor '
                f'one model-states file (found {files})'
            )
        # verified above; DeepSpeed's file holds its config objects, hence not weights_only
        module = torch.load(files[0], map_location='cpu', weights_only=False)['module']
        state = {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
    return state


def read_zero_checkpoint(path: str | os.PathLike) -> dict:
    """A DeepSpeed checkpoint directory as one mmengine-layout dict, verified first:
    ``{'meta': <the run's meta + where it came from>, 'state_dict': <full fp32 weights>}``.

    The optimizer is not carried over: its sharded state has no single-process form that
    every backend reads (resume at another world size goes through DeepSpeedStrategy).
    """
    path = Path(path).absolute()
    manifest = verify_zero_checkpoint(path)
    ours = load_checkpoint_file(path / STATE_FILE)
    meta = dict(ours.get('meta') or {})
    meta.update(
        converted_from=str(path),
        converted_from_strategy=manifest.get('strategy'),
        converted_from_world_size=manifest.get('world_size'),
    )
    return {'meta': meta, 'state_dict': zero_to_state_dict(path, verify=False)}


def convert_zero_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, *, update_pointer: bool = False
) -> Path:
    """Convert a DeepSpeed checkpoint directory into one single-file stratagem checkpoint
    (:func:`read_zero_checkpoint`'s dict, committed atomically with its manifest), which
    SingleDeviceStrategy, DDPStrategy and FSDPStrategy load with ``load_checkpoint``.
    ``stratagem convert SRC DST`` does the same. Returns ``dst``."""
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if dst == src or src in dst.parents:
        raise ValueError(f'convert_zero_checkpoint: dst {dst} must lie outside src {src}')
    checkpoint = read_zero_checkpoint(src)
    step = checkpoint['meta'].get('iter')
    return save_checkpoint(
        checkpoint,
        dst,
        step=step if type(step) is int else None,
        extra_manifest={'world_size': 1, 'strategy': 'converted'},
        update_pointer=update_pointer,
    )
