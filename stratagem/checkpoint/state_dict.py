"""Putting a state dict into a module: key revision, finding the weights in a foreign file,
and one readable mismatch report.

Semantics follow mmengine's ``_load_checkpoint_to_model`` and ``load_state_dict``: keys are
revised by regex substitution in order (default: strip a leading ``module.``), parameters whose
shapes differ are skipped and reported, and missing / unexpected keys are reported together.
Two mmengine (and ``nn.Module.load_state_dict``) behaviours are fixed: a strict load that fails
has already copied the matching tensors (here everything is checked first, and a failed load
changes nothing), and a non-strict load that matches no key "succeeds" having loaded nothing
(here it is an error).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from stratagem._torch import (
    BatchNormBase,
    compiled_inner,
    set_state_dict_metadata,
    state_dict_metadata,
)

from .errors import StateDictMismatchError

DEFAULT_REVISE_KEYS = ((r'^module\.', ''),)
#: where checkpoints written by other tools keep the model's weights, in the order tried:
#: mmengine / stratagem, the PyTorch tutorials, plain "{'model': ...}", DeepSpeed
WEIGHT_ENTRIES = ('state_dict', 'model_state_dict', 'model', 'module')


def find_model_weights(checkpoint: Mapping) -> tuple[Mapping, str]:
    """The model's state dict inside a loaded checkpoint, and where it was found.

    Tries the entries in ``WEIGHT_ENTRIES`` (a mapping holding at least one tensor), then the
    checkpoint itself as a bare state dict (most values tensors). Returns ``(state_dict,
    description)``, e.g. ``(..., "its 'model_state_dict' entry")``. Raises
    ``StateDictMismatchError`` listing the top-level keys and their types when neither fits.
    """
    for key in WEIGHT_ENTRIES:
        value = checkpoint.get(key)
        if isinstance(value, Mapping) and _count_tensors(value) > 0:
            return value, f'its {key!r} entry'
    if checkpoint and _count_tensors(checkpoint) * 2 >= len(checkpoint):
        return checkpoint, 'a bare state dict'
    raise StateDictMismatchError(
        f'holds no model weights in a layout stratagem recognises: top-level keys '
        f'{describe_keys(checkpoint)}. Expected an entry {", ".join(map(repr, WEIGHT_ENTRIES))} '
        f'holding tensors, or a bare state dict (names -> tensors). If the weights are under '
        f'another key, pass callback=lambda ckpt: ckpt.update(state_dict=ckpt["<key>"])'
    )


def describe_keys(mapping: Mapping, limit: int = 12) -> str:
    """``'a' (Tensor), 'b' (dict of 5), ...``: what a checkpoint holds, for messages."""
    parts = []
    for key, value in list(mapping.items())[:limit]:
        if isinstance(value, torch.Tensor):
            kind = f'Tensor{list(value.shape)}'
        elif isinstance(value, Mapping):
            kind = f'dict of {len(value)}'
        else:
            kind = type(value).__name__
        parts.append(f'{key!r} ({kind})')
    more = f', ... ({len(mapping) - limit} more)' if len(mapping) > limit else ''
    return '[' + ', '.join(parts) + more + ']' if parts else '[] (empty)'


def _count_tensors(mapping: Mapping) -> int:
    return sum(isinstance(v, torch.Tensor) for v in mapping.values())


def revise_keys(
    state_dict: Mapping[str, torch.Tensor],
    revise_keys: Iterable[tuple[str, str]] = DEFAULT_REVISE_KEYS,
) -> OrderedDict:
    """Return a new OrderedDict with ``re.sub(pattern, repl, key)`` applied to every key, for
    each ``(pattern, repl)`` in order. ``_metadata`` (module versions) is kept, its keys
    revised the same way. Raises ValueError if two keys become one."""
    rules = []
    for rule in revise_keys:
        if not (
            isinstance(rule, (tuple, list))
            and len(rule) == 2
            and all(isinstance(x, str) for x in rule)
        ):
            raise TypeError(
                f'revise_keys must be (pattern, replacement) string pairs, e.g. '
                f"[(r'^module\\.', '')]; got {rule!r}"
            )
        try:
            rules.append((re.compile(rule[0]), rule[1]))
        except re.error as err:
            raise ValueError(
                f'revise_keys pattern {rule[0]!r} is not a valid regex: {err}'
            ) from None

    def revise(key: str) -> str:
        for pattern, repl in rules:
            key = pattern.sub(repl, key)
        return key

    revised: OrderedDict = OrderedDict()
    origin: dict[str, str] = {}
    for key, value in state_dict.items():
        new = revise(key)
        if new in revised:
            raise ValueError(
                f'revise_keys maps both {origin[new]!r} and {key!r} to {new!r}; '
                f'make the patterns more specific'
            )
        revised[new] = value
        origin[new] = key
    metadata = state_dict_metadata(state_dict)
    if metadata is not None:
        set_state_dict_metadata(
            revised, OrderedDict((revise(k) if k else k, v) for k, v in metadata.items())
        )
    return revised


@dataclass
class LoadReport:
    """What ``load_state_dict`` could not load. Empty lists mean a perfect match."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    # (key, shape in the checkpoint, shape in the model)
    shape_mismatches: list[tuple[str, tuple, tuple]] = field(default_factory=list)
    # (key, type in the checkpoint) where the model holds a tensor
    type_mismatches: list[tuple[str, str]] = field(default_factory=list)
    loaded: int = 0  # entries of the module's state dict that were loaded
    total: int = 0  # entries of the module's state dict

    @property
    def ok(self) -> bool:
        return not (
            self.missing_keys
            or self.unexpected_keys
            or self.shape_mismatches
            or self.type_mismatches
        )

    def __str__(self) -> str:
        if self.ok:
            return 'all keys matched'
        lines = []
        if self.shape_mismatches:
            lines.append(
                f'{len(self.shape_mismatches)} shape mismatch(es), not loaded '
                f'(checkpoint -> model):'
            )
            lines += [f'  {k}: {tuple(a)} -> {tuple(b)}' for k, a, b in self.shape_mismatches]
        if self.type_mismatches:
            lines.append(
                f'{len(self.type_mismatches)} value(s) that are not tensors, not '
                f'loaded: ' + ', '.join(f'{k} ({t})' for k, t in self.type_mismatches)
            )
        if self.missing_keys:
            lines.append(
                f'{len(self.missing_keys)} missing key(s) (in the model, not in the '
                f'checkpoint): {_clip(self.missing_keys)}'
            )
        if self.unexpected_keys:
            lines.append(
                f'{len(self.unexpected_keys)} unexpected key(s) (in the checkpoint, '
                f'not in the model): {_clip(self.unexpected_keys)}'
            )
        hint = _prefix_hint(self.missing_keys, self.unexpected_keys)
        if hint:
            lines.append(hint)
        if self.total:
            lines.append(f"{self.loaded} of the model's {self.total} tensors matched")
        return '\n'.join(lines)


def unwrap_model(module: nn.Module) -> nn.Module:
    """The module inside DataParallel / DistributedDataParallel / ``torch.compile`` wrappers."""
    while True:
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
        elif (inner := compiled_inner(module)) is not None:
            module = inner
        else:
            return module


def load_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    strict: bool = False,
    logger: logging.Logger | None = None,
) -> LoadReport:
    """Load ``state_dict`` into ``module`` (unwrapped from DDP/DP/compile), skipping tensors
    whose shape differs, and return a ``LoadReport``.

    Everything is compared before anything is copied. With ``strict=True`` any mismatch
    raises :class:`StateDictMismatchError` (a ``RuntimeError``) with the report, and the
    module is unchanged (``nn.Module.load_state_dict`` and mmengine copy the matching tensors
    first). A state dict that matches none of the module's entries raises it too, strict or
    not, naming keys on both sides. Otherwise a non-empty report is logged as a warning to
    ``logger`` (default: the ``stratagem.checkpoint`` logger) and the matching tensors load.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f'module must be an nn.Module, got {type(module).__name__}')
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f'state_dict must be a mapping of names to tensors, got '
            f'{type(state_dict).__name__}; pass checkpoint["state_dict"]?'
        )
    module = unwrap_model(module)
    report, loadable, own = _compare(module, state_dict)
    name = type(module).__name__
    if strict and not report.ok:
        raise StateDictMismatchError(
            f'the state dict does not match {name} (strict load; nothing was loaded):\n{report}'
        )
    if own and not report.loaded:
        hint = _prefix_hint(report.missing_keys, report.unexpected_keys)
        raise StateDictMismatchError(
            f'none of its {len(state_dict)} entries matches {name}, so nothing was loaded: '
            f'the model has {_clip(list(own), 5)}; the state dict has '
            f'{_clip(list(state_dict), 5)}.'
            + (f' {hint}' if hint else ' Is it the weights of another model?')
        )
    result = module.load_state_dict(loadable, strict=False)
    # torch's own accounting is the truth for what was left out (e.g. modules that fill keys)
    skipped = {key for key, *_ in report.shape_mismatches + report.type_mismatches}
    report.missing_keys = [k for k in result.missing_keys if k not in skipped]
    report.unexpected_keys = list(result.unexpected_keys)
    if not report.ok:
        from stratagem import env  # imported on use: see checkpoint/__init__.py

        env.log_rank_zero(  # every rank loads the same state
            logger or logging.getLogger('stratagem.checkpoint'),
            logging.WARNING,
            'the state dict does not match %s:\n%s',
            name,
            report,
        )
    return report


def check_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> LoadReport:
    """What :func:`load_state_dict` would report, without changing ``module``."""
    return _compare(unwrap_model(module), state_dict)[0]


def _compare(module: nn.Module, state_dict: Mapping) -> tuple[LoadReport, OrderedDict, dict]:
    """(report, the entries that fit, the module's own state dict); nothing is copied."""
    own = module.state_dict()
    metadata = state_dict_metadata(state_dict)
    loadable: OrderedDict = OrderedDict()
    shapes, types = [], []
    for key, value in state_dict.items():
        mine = own.get(key)
        if isinstance(mine, torch.Tensor) and not isinstance(value, torch.Tensor):
            types.append((key, type(value).__name__))
        elif isinstance(mine, torch.Tensor) and mine.shape != value.shape:
            shapes.append((key, tuple(value.shape), tuple(mine.shape)))
        else:
            loadable[key] = value
    if metadata is not None:
        set_state_dict_metadata(loadable, metadata)
    skipped = {key for key, *_ in shapes + types}
    report = LoadReport(
        missing_keys=[
            k
            for k in own
            if k not in state_dict and k not in skipped and not _filled_on_load(module, k, metadata)
        ],
        unexpected_keys=[k for k in state_dict if k not in own],
        shape_mismatches=shapes,
        type_mismatches=types,
        loaded=sum(k in loadable for k in own),
        total=len(own),
    )
    return report, loadable, own


def _filled_on_load(module: nn.Module, key: str, metadata: Mapping | None) -> bool:
    """Whether ``module`` supplies ``key`` itself when a state dict lacks it: BatchNorm fills
    ``num_batches_tracked`` for state dicts saved before it existed (version < 2)."""
    prefix, _, leaf = key.rpartition('.')
    if leaf != 'num_batches_tracked':
        return False
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return False
    if not isinstance(owner, BatchNormBase):
        return False
    version = ((metadata or {}).get(prefix) or {}).get('version')
    return version is None or version < 2


def _clip(keys: list[str], limit: int = 20) -> str:
    shown = ', '.join(keys[:limit])
    return shown + (f', ... ({len(keys) - limit} more)' if len(keys) > limit else '')


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """Suggest revise_keys when the checkpoint's keys are the model's plus/minus a prefix."""
    if not missing or not unexpected:
        return None
    miss = set(missing)
    for key in unexpected[:5]:  # a few samples keep this linear in the number of keys
        for candidate in miss:
            if key.endswith('.' + candidate):
                prefix = key[: -len(candidate)]
                hits = sum(k.startswith(prefix) and k[len(prefix) :] in miss for k in unexpected)
                if hits * 2 >= len(unexpected):
                    return (
                        f'hint: the checkpoint keys carry an extra prefix {prefix!r}; pass '
                        f'revise_keys=[(r"^{re.escape(prefix)}", "")]'
                    )
            if candidate.endswith('.' + key):
                prefix = candidate[: -len(key)]
                return (
                    f'hint: the model keys carry a prefix {prefix!r} the checkpoint lacks; '
                    f'pass revise_keys=[(r"^", "{prefix}")]'
                )
    return None
