#!/usr/bin/env bash
# `make gpu`: every gpu-marked test and the GPU benchmarks in one call, then one summary.
#
# On a machine with CUDA, from the repository alone (no network): picks the first Python whose
# torch sees CUDA ($GPU_PYTHON, .venv/bin/python, python3, python), makes this checkout
# importable through PYTHONPATH (no pip install of it; a missing dependency of it or pytest comes
# from .gpu-wheels/ if that was carried along: `make gpu-wheels`, 7 MB), runs the gpu tests, then
# bench.py's parts, each under its own timeout, and writes summary.md + summary.csv
# (benchmarks/gpu/summary.py) into $OUT if set, else benchmarks/gpu/results/; exits 1 when a
# part failed, timed out or was not run (the summary says which), 0 when all passed.
#
# The budget (8 minutes of a 10-minute command; a device loan is ~15 minutes in all): setup
# ~15 s; the gpu tests 180 s; bench.py steps 100 s (+60 s with several GPUs: the same pairs
# over all of them), memory 35 s, checkpoint 65 s, compile 70 s (last: inductor's compile
# time is the least predictable). GPU_DEADLINE_S moves the 480 s (a 10-minute command allows
# ~560). A part gets what is left of the 480 s if that is less, and
# is not started under 15 s; a part cut short keeps the rows it finished.
#
# Without CUDA: the dry part (this script's syntax, bench.py and summary.py's arguments, the
# collection of the gpu tests, bench.py --dry: every part on the CPU with a toy model), then
# one line, exit 0; any failure of the dry part exits non-zero (CI runs it).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/benchmarks/gpu"
DEADLINE=${GPU_DEADLINE_S:-480}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
has_cuda() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; }

candidates=()
[ -n "${GPU_PYTHON:-}" ] && candidates+=("$GPU_PYTHON")
[ -x "$ROOT/.venv/bin/python" ] && candidates+=("$ROOT/.venv/bin/python")
for name in python3 python; do command -v "$name" >/dev/null 2>&1 && candidates+=("$(command -v "$name")"); done
PY=""
for py in "${candidates[@]}"; do has_cuda "$py" && { PY="$py"; break; }; done
# GPU_RUN_ON_CPU=1: the whole CUDA path on a CPU (the tests skip, bench.py runs --dry), to check
# this script's own orchestration without a GPU
ON_CPU=()
if [ -z "$PY" ] && [ "${GPU_RUN_ON_CPU:-0}" = 1 ]; then
  for py in "${candidates[@]}"; do has_torch "$py" && { PY="$py"; break; }; done
  ON_CPU=(--dry)
fi

# the files that hold gpu-marked tests (collecting only these keeps the dry run to seconds)
gpu_test_files() { grep -rlE 'mark\.gpu\b' "$ROOT/tests" --include='test_*.py' | sort; }

if [ -z "$PY" ]; then
  for py in "${candidates[@]}"; do has_torch "$py" && { PY="$py"; break; }; done
  [ -n "$PY" ] || { echo "gpu: no CUDA device here and no Python with torch (tried: ${candidates[*]:-none}); nothing to check"; exit 0; }
  dry=$(mktemp -d)
  trap 'rm -rf "$dry"' EXIT
  fail() { echo "gpu: no CUDA device here; the dry run FAILED at $1 (output: $dry/log)"; tail -40 "$dry/log"; exit 1; }
  bash -n "$0" >"$dry/log" 2>&1 || fail 'bash -n run.sh'
  "$PY" "$HERE/bench.py" --help >>"$dry/log" 2>&1 || fail 'bench.py --help'
  "$PY" "$HERE/summary.py" --help >>"$dry/log" 2>&1 || fail 'summary.py --help'
  mapfile -t files < <(gpu_test_files)
  # the collection beside the benchmark's dry run: two processes, mostly imports
  (cd "$ROOT" && timeout 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only -m gpu "${files[@]}") >"$dry/collect" 2>&1 &
  collecting=$!
  OMP_NUM_THREADS=1 timeout 300 "$PY" "$HERE/bench.py" --part all --dry --out "$dry/out" >>"$dry/log" 2>&1 || fail 'bench.py --part all --dry'
  wait "$collecting" || { cat "$dry/collect" >>"$dry/log"; fail 'pytest --collect-only -m gpu'; }
  collected=$(grep -Eo '^[0-9]+(/[0-9]+)? tests? collected' "$dry/collect" | grep -Eo '^[0-9]+' | head -1)
  "$PY" "$HERE/summary.py" "$dry/out" >>"$dry/log" 2>&1 || fail 'summary.py'
  rows=$(wc -l <"$dry/out/rows.jsonl")
  echo "gpu: no CUDA device here ($("$PY" -c 'import torch; print("torch", torch.__version__)')): nothing measured; dry run ok (run.sh syntax, ${collected:-0} gpu tests collected from ${#files[@]} files, bench.py's $rows rows and the summary on the CPU)"
  exit 0
fi

OUT="${OUT:-$HERE/results}"
mkdir -p "$OUT"
rm -f "$OUT"/{rows.jsonl,parts.tsv,tests.log,tests.xml,meta.json,summary.md,summary.csv}
echo "gpu: $PY; results in $OUT"

# dependencies: the package's and pytest, from this machine or from carried wheels
missing=$("$PY" - <<'EOF'
import importlib.util
need = {'addict': 'addict', 'numpy': 'numpy', 'packaging': 'packaging', 'yaml': 'pyyaml',
        'tqdm': 'tqdm', 'typing_extensions': 'typing_extensions', 'xxhash': 'xxhash',
        'pytest': 'pytest', 'pytest_timeout': 'pytest-timeout'}
print(' '.join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ] && [ -d "$ROOT/.gpu-wheels" ]; then
  # --target: no write into the machine's environment (it may be read-only or PEP 668's)
  echo "gpu: installing $missing from .gpu-wheels/ into .gpu-wheels/site"
  timeout 60 "$PY" -m pip install -q --no-index --find-links "$ROOT/.gpu-wheels" --target "$ROOT/.gpu-wheels/site" $missing || true
  export PYTHONPATH="$PYTHONPATH:$ROOT/.gpu-wheels/site"
fi
"$PY" -c 'import stratagem.strategies, pytest' || { echo "gpu: cannot import stratagem and pytest with $PY (missing: $missing); run 'make gpu-wheels' where there is a network and carry .gpu-wheels"; exit 1; }

"$PY" - "$OUT/meta.json" <<'EOF'
import datetime, json, platform, subprocess, sys, torch
try:  # the device machine may have no git, or a copy of the tree without .git
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, timeout=10).stdout.strip()
except (OSError, subprocess.SubprocessError):
    commit = ''
json.dump(dict(
    date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
    device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu (GPU_RUN_ON_CPU)',
    gpus=torch.cuda.device_count(),
    torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
    commit=commit or 'unknown'), open(sys.argv[1], 'w'), indent=1)
EOF
cat "$OUT/meta.json"
# stratagem/_torch.py wraps private torch APIs of the one release pyproject.toml allows: another
# release may fail for that reason alone, which the summary should not hide
"$PY" - "$ROOT/pyproject.toml" <<'EOF' || true
import re, sys, torch
pin = re.search(r'"torch>=([\d.]+),<([\d.]+)"', open(sys.argv[1]).read())
have = tuple(int(x) for x in re.findall(r'\d+', torch.__version__)[:2])
if pin and not tuple(map(int, pin[1].split('.')[:2])) <= have < tuple(map(int, pin[2].split('.')[:2])):
    print(f'gpu: WARNING torch {torch.__version__} is outside pyproject.toml\'s >={pin[1]},<{pin[2]}: '
          'a failure of a private-API wrapper (stratagem/_torch.py) may be that alone')
EOF
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

# run NAME BUDGET_S CMD...: under min(budget, what is left of the deadline); one parts.tsv line
run() {
  local name=$1 budget=$2 left=$((DEADLINE - SECONDS - 5)); shift 2
  [ "$left" -lt "$budget" ] && budget=$left
  if [ "$budget" -lt 15 ]; then printf '%s\tskip\t0\n' "$name" >>"$OUT/parts.tsv"; echo "gpu: $name not run (budget spent)"; return; fi
  echo "gpu: $name (at most ${budget} s)"
  local start=$SECONDS
  (cd "$ROOT" && timeout -k 10 "$budget" "$@")
  printf '%s\t%s\t%s\n' "$name" "$?" "$((SECONDS - start))" >>"$OUT/parts.tsv"
}

mapfile -t files < <(gpu_test_files)
# -o timeout: pytest-timeout (if installed) ends one hung test, so the rest still run
run tests 180 bash -o pipefail -c 'py=$1 log=$2; shift 2; "$py" -m pytest -v -rs -p no:cacheprovider -m gpu -o timeout=120 --junitxml="${log%.log}.xml" "$@" 2>&1 | tee "$log"' _ "$PY" "$OUT/tests.log" "${files[@]}"
BENCH=("$PY" "$HERE/bench.py" --out "$OUT" "${ON_CPU[@]}")
run 'bench: steps' 100 "${BENCH[@]}" --part steps
[ "$GPUS" -gt 1 ] && run "bench: steps on $GPUS GPUs" 60 "${BENCH[@]}" --part steps --world "$GPUS" --cases DDP FSDP2 'DeepSpeed ZeRO-2'
run 'bench: memory' 35 "${BENCH[@]}" --part memory
run 'bench: checkpoint' 65 "${BENCH[@]}" --part checkpoint
run 'bench: compile' 70 "${BENCH[@]}" --part compile
"$PY" "$HERE/summary.py" "$OUT"
failed=$(awk -F'\t' '$2 != "0" {print $1}' "$OUT/parts.tsv" | paste -sd, -)
echo "gpu: done in ${SECONDS} s; $OUT/summary.md, $OUT/summary.csv${failed:+; not ok: $failed}"
[ -z "$failed" ]
