"""Every file under a directory, to assert a failed command changed none of them."""

from __future__ import annotations

import re
from pathlib import Path

# the run's log: <stamp>/<stamp>.log, where a run of the same second gets <stamp>_1, _2, ...
_LOG = re.compile(r'^(?P<stamp>\d{8}_\d{6}(_\d+)?)/(?P=stamp)\.log$')


def snapshot(directory: str | Path) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file under ``directory`` (empty if it is absent)."""
    root = Path(directory)
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob('*'))
        if p.is_file()
    }


def assert_unchanged(
    directory: str | Path, before: dict[str, bytes], *, allow_log: bool = True
) -> None:
    """Every file of ``before`` is still there, byte for byte, and nothing was added except,
    with ``allow_log``, the failed run's own log file (``<stamp>/<stamp>.log``, its own
    folder also for a run of the same second: ``<stamp>_1``)."""
    after = snapshot(directory)
    for name, data in before.items():
        assert name in after, f'{name} was removed'
        if not (allow_log and _LOG.match(name)):
            assert after[name] == data, f'{name} was changed'
    added = sorted(set(after) - set(before))
    assert all(allow_log and _LOG.match(name) for name in added), f'files were added: {added}'
