#!/usr/bin/env bash
# One device call of the staged speed benchmark (tests/device/stage_bench.sh stages the calls and
# prints them): bash tests/device/bench_step.sh .benchN
#
# Keeps this call's parts in $KEEP (the machine keeps files between back-to-back calls while it
# stays warm), assembles every file whose parts are complete (sha256 checked), installs the
# wheels once they all are (MLX CUDA, mlx-lm, gguf), then runs the call's action:
#   keep      nothing more
#   random8b  tests/device/bench_device.py random8b (Qwen3-8B shapes, random weights, bf16 + 4-bit)
#   starter   tests/device/bench_device.py starter (the starter GGUF + its drafter, bf16 + fp16;
#             STARTER_BENCH=0 only unpacks the GGUF, e.g. for --peer; STARTER_BENCH=concurrent runs
#             bench_device.py concurrent instead: --concurrent N requests batched vs one after
#             another, CONCURRENT_ARGS e.g. "--concurrent 4 --caps auto --trials 1")
#   pair      tests/device/bench_device.py pair (Qwen2.5-Coder-1.5B target + 0.5B draft model;
#             BUDGET_PAIR seconds, PAIR_ARGS e.g. "--dtypes bfloat16,float16 --trials 3";
#             PAIR_BENCH=0 only keeps, PAIR_BENCH=concurrent runs the concurrent part on the pair)
#   coder     tests/device/bench_device.py concurrent on Qwen2.5-Coder-1.5B alone (no draft model:
#             baseline and lookup), CONCURRENT_ARGS as for the starter, BUDGET_PAIR seconds
#   --peer    (no folder: a call of its own once the starter's has run) tests/peer/compare.py:
#             Tandem beside mlx-dspark on the starter, PEER_ARGS e.g. "--dtype float16"
# Results land in $OUT (JSON + logs). DRY=1: a CPU dry run here (KEEP/SITE/WORK/OUT under a temp
# folder, the local Python, toy sizes).
set -uo pipefail
dir=${1:?usage: bench_step.sh .benchN | --peer}
KEEP=${KEEP:-/root/keep}; SITE=${SITE:-/root/site}; WORK=${WORK:-/root/work}; OUT=${OUT:-$WORK/out}
PY=${PYTHON:-python3}
mkdir -p "$KEEP" "$SITE" "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=$WORK/cache
t0=$SECONDS
say() { echo "[$(date +%H:%M:%S) +$((SECONDS - t0))s] $*"; }
gguf=$WORK/SmolLM2-135M-Instruct.Q4_1.gguf
unpack_starter() {
  [ -s "$gguf" ] && return 0
  say "decompressing the starter GGUF"
  "$PY" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "$KEEP/starter.gguf.xz" "$gguf" || exit 6
}

if [ "$dir" = --peer ]; then
  [ -e "$KEEP/starter.gguf.xz" ] && [ -e "$KEEP/.installed" ] || { echo "bench_step --peer: run the starter's call first" >&2; exit 3; }
  unpack_starter
  export PYTHONPATH=$SITE:$PWD
  tiny=(); [ "${DRY:-0}" = 1 ] && tiny=(--trials 1 --per-class 1 --max-new-tokens 12)
  say "Tandem beside mlx-dspark on the starter"
  "$PY" tests/peer/compare.py --gguf "$gguf" --peer-python "$PY" --peer-path "$SITE" --max-draft auto \
    --json "$OUT/peer.json" ${PEER_ARGS:---dtype bfloat16 --trials 3 --per-class 2} "${tiny[@]}" 2>&1 | tee -a "$OUT/peer.log"
  exit "${PIPESTATUS[0]}"
fi

manifest=$dir/manifest.json
action=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['action'])" "$manifest") || exit 3
say "call $("$PY" -c "import json,sys; m=json.load(open(sys.argv[1])); print(m['call'], 'of', m['calls'])" "$manifest"): $action"
"$PY" tests/device/stage_parts.py keep "$dir" "$KEEP" || exit 3

wheels=$(ls "$KEEP"/*.whl 2>/dev/null | wc -l)
want=$("$PY" -c "import json,sys; print(sum(n.endswith('.whl') for n in json.load(open(sys.argv[1]))['files']))" "$manifest")
if [ "$wheels" -gt 0 ] && [ "$wheels" = "$want" ] && [ ! -e "$KEEP/.installed" ]; then
  say "installing $wheels wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$KEEP"/*.whl || exit 4
  touch "$KEEP/.installed"
fi
export PYTHONPATH=$SITE:$PWD
if [ ! -e "$KEEP/.installed" ]; then  # an early keep call: its parts are kept, no wheels to check yet
  [ "$action" = keep ] || { echo "bench_step: '$action' needs the wheels, which earlier calls did not complete" >&2; exit 4; }
  say "kept; the wheels are not complete yet"; exit 0
fi
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" || exit 5
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader

tiny=()
[ "${DRY:-0}" = 1 ] && tiny=(--tiny --trials 1 --max-new-tokens 12 --prompts-per-class 1)
run() { "$PY" tests/device/bench_device.py "$@" "${tiny[@]}" --out "$OUT" 2>&1 | tee -a "$OUT/$1.log"; }

case "$action" in
  *random8b*) say "random 8B-shaped targets"; run random8b --budget "${BUDGET_8B:-200}" ${R8B_ARGS:-} ;;
esac
case "$action" in
  *starter*)
    unpack_starter
    case "${STARTER_BENCH:-1}" in
      0) say "starter staged (STARTER_BENCH=0: no benchmark)" ;;
      concurrent) say "starter, concurrent requests"
        run concurrent --gguf "$gguf" --budget "${BUDGET_STARTER:-360}" ${CONCURRENT_ARGS:-} ;;
      *) say "starter benchmarks"; run starter --gguf "$gguf" --budget "${BUDGET_STARTER:-360}" ${STARTER_ARGS:-} ;;
    esac ;;
esac
case "$action" in
  *pair*)
    pair=(--target "$KEEP/qwen2.5-coder-1.5b.gguf" --draft "$KEEP/qwen2.5-coder-0.5b.gguf" --budget "${BUDGET_PAIR:-480}")
    case "${PAIR_BENCH:-1}" in
      0) say "pair staged (PAIR_BENCH=0: no benchmark)" ;;
      concurrent) say "pair, concurrent requests"; run concurrent "${pair[@]}" ${CONCURRENT_ARGS:-} ;;
      *) say "pair benchmarks"; run pair "${pair[@]}" ${PAIR_ARGS:-} ;;
    esac ;;
esac
case "$action" in
  *coder*) say "Qwen2.5-Coder-1.5B, concurrent requests"
    run concurrent --target "$KEEP/qwen2.5-coder-1.5b.gguf" --budget "${BUDGET_PAIR:-480}" ${CONCURRENT_ARGS:-} ;;
esac
say "done; files in $OUT:"; ls -la "$OUT"
