"""Key checks: :func:`check_keys` (unknown keys of a section), every dotted key path of a
config, and the "did you mean" hint for an override naming a key the config lacks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def _dotted_keys(obj: Any, prefix: str = '') -> set[str]:
    """Every dotted path in a config (dict keys and list indices), e.g. 'a', 'a.b', 'a.0'."""
    out: set[str] = set()
    items = (
        obj.items()
        if isinstance(obj, Mapping)
        else enumerate(obj)
        if isinstance(obj, (list, tuple))
        else ()
    )
    for k, v in items:
        path = f'{prefix}{k}'
        out.add(path)
        out |= _dotted_keys(v, path + '.')
    return out


def _did_you_mean(key: str, known: set[str]) -> str:
    """Existing keys ``key`` was probably meant to be: the same last name elsewhere
    (``lr`` for ``optim_wrapper.optimizer.lr``), else a near spelling beside it."""
    import difflib

    parent, _, leaf = key.rpartition('.')
    close = sorted(k for k in known if k.rsplit('.', 1)[-1] == leaf)
    if not close:
        siblings = {k.rsplit('.', 1)[-1]: k for k in known if k.rpartition('.')[0] == parent}
        close = [
            siblings[n] for n in difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.75)
        ]
    return f'did you mean {" or ".join(repr(k) for k in close[:3])}?' if close else ''


def check_keys(given: Mapping, allowed: Iterable[str], where: str) -> None:
    """Raise ValueError naming ``where``, the unknown keys of ``given`` and the valid ones."""
    import difflib

    allowed = set(allowed)
    unknown = sorted(set(given) - allowed, key=str)
    if unknown:
        close = [
            f'{k!r} -> {c[0]!r}'
            for k in unknown
            if (c := difflib.get_close_matches(str(k), sorted(allowed), n=1, cutoff=0.75))
        ]
        raise ValueError(
            f'unknown key(s) {unknown} in {where}; valid keys: {sorted(allowed)}'
            + (f'; did you mean {", ".join(close)}?' if close else '')
        )
