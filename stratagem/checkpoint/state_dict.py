"""Putting a state dict into a module: key revision and one readable mismatch report.

Semantics follow mmengine's ``_load_checkpoint_to_model`` and ``load_state_dict``: keys are
revised by regex substitution in order (default: strip a leading ``module.``), parameters whose
shapes differ are skipped and reported, and missing / unexpected keys are reported together.
"""
from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import nn

DEFAULT_REVISE_KEYS = ((r'^module\.', ''),)


def revise_keys(state_dict: Mapping[str, torch.Tensor],
                revise_keys: Iterable[tuple[str, str]] = DEFAULT_REVISE_KEYS) -> OrderedDict:
    """Return a new OrderedDict with ``re.sub(pattern, repl, key)`` applied to every key, for
    each ``(pattern, repl)`` in order. ``_metadata`` (module versions) is kept, its keys
    revised the same way. Raises ValueError if two keys become one."""
    rules = []
    for rule in revise_keys:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2
                and all(isinstance(x, str) for x in rule)):
            raise TypeError(f'revise_keys must be (pattern, replacement) string pairs, e.g. '
                            f"[(r'^module\\.', '')]; got {rule!r}")
        try:
            rules.append((re.compile(rule[0]), rule[1]))
        except re.error as err:
            raise ValueError(f'revise_keys pattern {rule[0]!r} is not a valid regex: {err}') \
                from None

    def revise(key: str) -> str:
        for pattern, repl in rules:
            key = pattern.sub(repl, key)
        return key

    revised: OrderedDict = OrderedDict()
    origin = {}
    for key, value in state_dict.items():
        new = revise(key)
        if new in revised:
            raise ValueError(f'revise_keys maps both {origin[new]!r} and {key!r} to {new!r}; '
                             f'make the patterns more specific')
        revised[new] = value
        origin[new] = key
    metadata = getattr(state_dict, '_metadata', None)
    if metadata is not None:
        revised._metadata = OrderedDict((revise(k) if k else k, v) for k, v in metadata.items())
    return revised


@dataclass
class LoadReport:
    """What ``load_state_dict`` could not load. Empty lists mean a perfect match."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    # (key, shape in the checkpoint, shape in the model)
    shape_mismatches: list[tuple[str, tuple, tuple]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing_keys or self.unexpected_keys or self.shape_mismatches)

    def __str__(self) -> str:
        if self.ok:
            return 'all keys matched'
        lines = []
        if self.shape_mismatches:
            lines.append(f'{len(self.shape_mismatches)} shape mismatch(es), not loaded '
                         f'(checkpoint -> model):')
            lines += [f'  {k}: {tuple(a)} -> {tuple(b)}' for k, a, b in self.shape_mismatches]
        if self.missing_keys:
            lines.append(f'{len(self.missing_keys)} missing key(s) (in the model, not in the '
                         f'checkpoint): {_clip(self.missing_keys)}')
        if self.unexpected_keys:
            lines.append(f'{len(self.unexpected_keys)} unexpected key(s) (in the checkpoint, '
                         f'not in the model): {_clip(self.unexpected_keys)}')
        hint = _prefix_hint(self.missing_keys, self.unexpected_keys)
        if hint:
            lines.append(hint)
        return '\n'.join(lines)


def unwrap_model(module: nn.Module) -> nn.Module:
    """The module inside DataParallel / DistributedDataParallel / ``torch.compile`` wrappers."""
    while True:
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
        elif type(module).__name__ == 'OptimizedModule' and hasattr(module, '_orig_mod'):
            module = module._orig_mod
        else:
            return module


def load_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor],
                    strict: bool = False, logger: logging.Logger | None = None) -> LoadReport:
    """Load ``state_dict`` into ``module`` (unwrapped from DDP/DP/compile), skipping tensors
    whose shape differs, and return a ``LoadReport``.

    With ``strict=True`` any mismatch raises ``RuntimeError`` with the report; the matching
    tensors have been loaded by then, as with ``nn.Module.load_state_dict``. Otherwise a
    non-empty report is logged as a warning to ``logger`` (default: the
    ``stratagem.checkpoint`` logger).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f'module must be an nn.Module, got {type(module).__name__}')
    if not isinstance(state_dict, Mapping):
        raise TypeError(f'state_dict must be a mapping of names to tensors, got '
                        f'{type(state_dict).__name__}; pass checkpoint["state_dict"]?')
    module = unwrap_model(module)
    own = module.state_dict()
    loadable: OrderedDict = OrderedDict()
    mismatches = []
    for key, value in state_dict.items():
        mine = own.get(key)
        if isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor) \
                and mine.shape != value.shape:
            mismatches.append((key, tuple(value.shape), tuple(mine.shape)))
        else:
            loadable[key] = value
    metadata = getattr(state_dict, '_metadata', None)
    if metadata is not None:
        loadable._metadata = metadata
    result = module.load_state_dict(loadable, strict=False)
    skipped = {key for key, _, _ in mismatches}
    report = LoadReport(missing_keys=[k for k in result.missing_keys if k not in skipped],
                        unexpected_keys=list(result.unexpected_keys),
                        shape_mismatches=mismatches)
    if report.ok:
        return report
    message = f'the state dict does not match {type(module).__name__}:\n{report}'
    if strict:
        raise RuntimeError(message)
    from stratagem.env.logging import log_rank_zero  # every rank loads the same state
    log_rank_zero(logger or logging.getLogger('stratagem.checkpoint'), logging.WARNING, '%s',
                  message)
    return report


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
                prefix = key[:-len(candidate)]
                hits = sum(k.startswith(prefix) and k[len(prefix):] in miss for k in unexpected)
                if hits * 2 >= len(unexpected):
                    return (f'hint: the checkpoint keys carry an extra prefix {prefix!r}; pass '
                            f'revise_keys=[(r"^{re.escape(prefix)}", "")]')
            if candidate.endswith('.' + key):
                prefix = candidate[:-len(key)]
                return (f'hint: the model keys carry a prefix {prefix!r} the checkpoint lacks; '
                        f'pass revise_keys=[(r"^", "{prefix}")]')
    return None
