"""Import overhead of ``import stratagem`` over ``import torch``.

Runs fresh interpreters, interleaving ``import torch`` and
``import torch; import stratagem`` so that disk-cache and load drift hit both
alike, and prints the medians and their difference.

    python benchmarks/import_time.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

SNIPPET = 'import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)'


def time_import(stmt: str) -> float:
    """Seconds a fresh interpreter spends executing ``stmt``."""
    out = subprocess.run(
        [sys.executable, '-c', SNIPPET.format(stmt=stmt)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


def measure(runs: int) -> tuple[float, float]:
    """Medians (torch alone, torch + stratagem) over ``runs`` interleaved pairs."""
    base, both = [], []
    time_import('import torch')  # warm the page cache once
    for _ in range(runs):
        base.append(time_import('import torch'))
        both.append(time_import('import torch; import stratagem'))
    return statistics.median(base), statistics.median(both)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=15)
    args = parser.parse_args()
    base, both = measure(args.runs)
    print(f'import torch              median {base * 1e3:8.1f} ms  ({args.runs} runs)')
    print(f'import torch, stratagem   median {both * 1e3:8.1f} ms')
    print(
        f'overhead of stratagem            {(both - base) * 1e3:8.1f} ms (ratio {both / base:.3f}x)'
    )


if __name__ == '__main__':
    main()
