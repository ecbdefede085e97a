"""Damaged copies of the frozen checkpoints in ``tests/data/legacy/`` and what loading them
gives: the case maker and the oracle that ``test_ckpt_fuzz.py`` and
``benchmarks/checkpoint_fuzz.py`` share.

A case is ``(layout, mutation, target, offset, length, value)``; it is applied to a fresh copy
of the layout's checkpoint and loaded through the public API (``load_checkpoint`` of a
``SingleDeviceStrategy``, ``resume`` for the layouts one process resumes, and
``convert_checkpoint``). The outcome is ``'exact'`` (the original weights), ``'named'`` (one of
our documented errors naming the checkpoint), or a failure: ``'escaped'`` (any other
exception) or ``'other weights'``.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1] / 'data' / 'legacy'
EXPECTED = json.loads((ROOT / 'expected.json').read_text())
LAYOUTS = ('single', 'fsdp', 'deepspeed')
BYTE_MUTATIONS = ('flip', 'truncate', 'append', 'zero')
MANIFEST_MUTATIONS = ('manifest_cut', 'manifest_empty', 'manifest_digest', 'manifest_delete')
# a byte mutation with its manifest entry re-signed: the bytes reach the parsers (what a
# writer's bug, or a checkpoint without a manifest, would hand them)
RESIGNED = tuple(m + '_resigned' for m in BYTE_MUTATIONS)
MUTATIONS = BYTE_MUTATIONS + MANIFEST_MUTATIONS + ('delete',) + RESIGNED
ENTRIES = ('load_checkpoint', 'resume', 'convert')
RESUMABLE = ('single', 'fsdp')  # in one process, as a world of 1


def files(layout: str) -> list[str]:
    """The files of ``layout``'s checkpoint, relative to its folder (manifest included)."""
    src = ROOT / EXPECTED[layout]['checkpoint']
    if src.is_file():
        return [src.name, src.name + '.manifest.json']
    return sorted(p.relative_to(src).as_posix() for p in src.rglob('*') if p.is_file())


def manifest_name(layout: str) -> str:
    src = ROOT / EXPECTED[layout]['checkpoint']
    return src.name + '.manifest.json' if src.is_file() else 'manifest.json'


def copy(layout: str, dst: Path) -> Path:
    """A fresh copy of ``layout``'s checkpoint under ``dst``; returns the checkpoint's path."""
    src = ROOT / EXPECTED[layout]['checkpoint']
    dst.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        for name in files(layout):
            shutil.copy2(src.parent / name, dst / name)
        return dst / src.name
    shutil.copytree(src, dst / src.name)
    return dst / src.name


def mutate(
    ckpt: Path, layout: str, mutation: str, target: str, offset: int, length: int, value: int
) -> Path:
    """Damage the copy at ``ckpt``; returns the file changed. ``offset`` and ``length`` are
    taken modulo the file's size; ``value`` is a byte (a bit index for 'flip')."""
    folder = ckpt.parent if ckpt.is_file() else ckpt
    if mutation.endswith('_resigned'):
        changed = mutate(ckpt, layout, mutation[: -len('_resigned')], target, offset, length, value)
        resign(folder / manifest_name(layout), changed)
        return changed
    if mutation.startswith('manifest_'):
        target = manifest_name(layout)
    path = folder / target
    data = bytearray(path.read_bytes())
    size = max(len(data), 1)
    offset %= size
    if mutation == 'flip':
        data[offset] ^= 1 << (value % 8)
    elif mutation == 'truncate':
        del data[offset:]
    elif mutation == 'append':
        data += bytes([value]) * (length % 4096 + 1)
    elif mutation == 'zero':
        data[offset : offset + length % 4096 + 1] = bytes(
            len(data[offset : offset + length % 4096 + 1])
        )
    elif mutation == 'manifest_cut':
        del data[offset:]
    elif mutation == 'manifest_empty':
        data = bytearray()
    elif mutation == 'manifest_digest':
        manifest = json.loads(data)
        entry = manifest['files'][offset % len(manifest['files'])]
        digest = entry['xxh3_128']
        entry['xxh3_128'] = digest[:-1] + ('0' if digest[-1] != '0' else '1')
        data = bytearray(json.dumps(manifest).encode())
    elif mutation in ('delete', 'manifest_delete'):
        path.unlink()
        return path
    else:
        raise ValueError(mutation)
    path.write_bytes(bytes(data))
    return path


def resign(manifest_file: Path, changed: Path) -> None:
    """Make ``manifest_file``'s entry for ``changed`` match its bytes (size and digest)."""
    from stratagem.checkpoint.digest import hash_file

    if changed == manifest_file:
        return
    manifest = json.loads(manifest_file.read_bytes())
    rel = changed.relative_to(manifest_file.parent).as_posix()
    for entry in manifest['files']:
        if entry['path'] == rel:
            entry['size'], entry['xxh3_128'] = hash_file(changed, algo='xxh3_128')
    manifest_file.write_text(json.dumps(manifest))


def net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def expected_weights(layout: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, e in EXPECTED[layout]['weights'].items():
        out[k] = torch.tensor(e['data'], dtype=getattr(torch, e['dtype'])).reshape(e['shape'])
    return out


def _named() -> tuple[type[BaseException], ...]:
    from stratagem.checkpoint.errors import (
        CheckpointCorruptError,
        NotACheckpointError,
        UnsafeCheckpointError,
    )

    return (CheckpointCorruptError, NotACheckpointError, UnsafeCheckpointError, FileNotFoundError)


def _same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(
        isinstance(got[k], torch.Tensor)
        and got[k].dtype == want[k].dtype
        and got[k].shape == want[k].shape
        and torch.equal(got[k], want[k])
        for k in want
    )


def load(entry: str, layout: str, ckpt: Path, work: Path) -> dict[str, torch.Tensor]:
    """The weights that ``entry`` gives for the checkpoint at ``ckpt``."""
    from stratagem.checkpoint.convert import convert_checkpoint
    from stratagem.checkpoint.load import load_checkpoint_file
    from stratagem.strategies import build_strategy

    if entry == 'convert':
        out = convert_checkpoint(ckpt, work / 'converted.pth')
        state = load_checkpoint_file(out, map_location='cpu')['state_dict']
        return {k: v for k, v in state.items()}
    s = build_strategy(
        dict(
            type='SingleDeviceStrategy',
            device='cpu',
            work_dir=str(work),
            env_kwargs=dict(randomness=dict(seed=7)),
        )
    )
    if entry == 'load_checkpoint':
        model = s.prepare(net())
        s.load_checkpoint(str(ckpt))
    else:
        model, _, _ = s.prepare(net(), **EXPECTED[layout]['components'])
        s.resume(str(ckpt))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_case(case: tuple, tmp: Path, entry: str) -> tuple[str, str]:
    """(outcome, detail) of loading ``case``'s damaged copy through ``entry``."""
    layout, mutation, target, offset, length, value = case
    if tmp.exists():
        shutil.rmtree(tmp)
    ckpt = copy(layout, tmp / 'ckpt')
    changed = mutate(ckpt, layout, mutation, target, offset, length, value)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            got = load(entry, layout, ckpt, tmp / 'work')
    except _named() as err:
        message = str(err)
        if ckpt.name not in message and changed.name not in message:
            return 'unnamed', f'{type(err).__name__}: {message}'
        return 'named', type(err).__name__
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - the oracle classifies every escape (DCP raises BaseException)
        return 'escaped', f'{type(err).__name__}: {err}'
    if _same(got, expected_weights(layout)):
        return 'exact', ''
    return 'other weights', ''
