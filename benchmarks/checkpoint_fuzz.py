"""Damaged checkpoints, many cases: what loading each gives (issue #32, deliverable 3).

The cases and the oracle are ``tests/checkpoint/ckpt_fuzz_cases.py``'s (the suite's seeded
Hypothesis run, ``tests/checkpoint/test_ckpt_fuzz.py``, draws from the same space): a copy of
a frozen checkpoint of each layout (``tests/data/legacy/``: one file, an FSDP DCP directory
of 2 ranks, a DeepSpeed ZeRO-2 directory of 2 ranks) is damaged (a bit flipped, truncated,
junk appended, a block zeroed, its manifest cut, emptied, deleted or one digest changed, a
file deleted; or a byte mutation with the manifest re-signed to match, ``*_resigned``, so that
the bytes reach the parsers) and loaded through ``load_checkpoint``, ``resume`` (one process)
and ``convert_checkpoint``. It prints the cases per layout and mutation and their outcomes:
``exact`` (the original weights), ``named`` (one of our documented errors naming the file),
``other weights`` (only acceptable when re-signed: a changed tensor byte nothing can detect),
``escaped`` (any other exception: a bug). Exit status 1 if any case failed.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_fuzz.py [--cases 5000] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'tests' / 'checkpoint'))
import ckpt_fuzz_cases as F  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--cases', type=int, default=5000)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--layouts', nargs='+', default=list(F.LAYOUTS), choices=F.LAYOUTS)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    rng = random.Random(args.seed)
    counts: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    failures = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix='ckpt_fuzz_') as tmp:
        for _ in range(args.cases):
            layout = rng.choice(args.layouts)
            mutation = rng.choice(F.MUTATIONS)
            case = (
                layout,
                mutation,
                rng.choice(F.files(layout)),
                rng.randrange(1 << 20),
                rng.randrange(4096),
                rng.randrange(256),
            )
            entry = rng.choice([e for e in F.ENTRIES if e != 'resume' or layout in F.RESUMABLE])
            with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's reader prints
                outcome, detail = F.run_case(case, Path(tmp) / 'case', entry)
            if outcome == 'other weights' and mutation.endswith('_resigned'):
                outcome = 'other weights (re-signed)'
            counts[layout, mutation, outcome] += 1
            if outcome == 'named':
                errors[detail] += 1
            elif outcome not in ('exact', 'other weights (re-signed)'):
                failures.append((case, entry, outcome, detail))
    seconds = time.perf_counter() - start
    outcomes = sorted({k[2] for k in counts})
    print(f'{args.cases} cases in {seconds:.1f} s (seed {args.seed})')
    print('| layout | mutation | ' + ' | '.join(outcomes) + ' |')
    print('|---|---|' + '---|' * len(outcomes))
    for layout in args.layouts:
        for mutation in F.MUTATIONS:
            row = [counts[layout, mutation, o] for o in outcomes]
            if any(row):
                print(f'| {layout} | {mutation} | ' + ' | '.join(map(str, row)) + ' |')
    print('named errors: ' + ', '.join(f'{k} {v}' for k, v in errors.most_common()))
    for case, entry, outcome, detail in failures:
        print(f'FAILED {case} via {entry}: {outcome}: {detail[:300]}')
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
