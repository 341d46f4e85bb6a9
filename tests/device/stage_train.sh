#!/usr/bin/env bash
# Stage `tandem train-drafter` for the starter model (SmolLM2-135M-Instruct) on the H200 device
# machine, which has no package registry and no network. Run here, in the project root.
#
# What travels, in back-to-back calls (the machine is released after ~30 s idle; each
# call carries < 64 MiB with the working tree):
#   MLX 0.32.4 + mlx-cuda-13 + mlx-lm (../shared/device/stage-mlx-cuda.sh makes .devA/.devB),
#   the gguf wheel (pure Python; the device has numpy/pyyaml/tqdm/requests),
#   the starter's GGUF (Q4_1, 98 MB; xz-compressed and split over the three calls: on the device
#   engine/gguf.py converts it exactly as here), and the encoded prompts (train: gsm8k + mbpp +
#   arena-hard-v2; held out: mt-bench + humaneval + math500, first 64 of each).
#
#   call 1: carry [".devA"]  command: bash .devA/keep_all.sh
#   call 2: carry [".devB"]  command: bash .devB/install.sh && bash .devB/smoke.sh
#           (installs; the train tests on a tiny random target, on the GPU; SMOKE=0 skips them)
#   (when the script made .devD: carry [".devD"]  command: bash .devD/keep.sh, before call 3)
#   call 3: carry [".devC"]  command: bash .devC/run.sh      (generate the answers; ~9 min)
#           (GEN_SECONDS, default 500, bounds the generation itself: the call takes ~60 s more for
#           the model load and the wave running at the deadline; a shorter call timeout loses it all)
#   call 4: carry [".devC"]  command: bash .devC/train.sh    (train; ~9.5 min)
#   call 5 (optional, warm): carry [".devC"]  command: RUN_SECONDS=... bash .devC/extend.sh   (more training)
#
# run.sh sends the answers back ($OUT/{train,eval,extra}.jsonl.gz, ~4 MB a session): ANSWERS=<that
# folder> stages them in .devC. Without call 3, call 4 trains on them; after it, their extras
# join the new ones (a new SEED samples new ones), so each session's data adds to the last.
#
# AFTER_BENCH=1: the same warm hold as a starter benchmark staged by tests/device/stage_bench.sh
# (PARTS=starter), whose calls already installed the wheels into /root/site and unpacked the
# GGUF into /root/work: only .devC travels (calls 3-5). Generation knobs: SELF_PROMPTS, SAMPLES,
# OPENINGS (--self-prompt-openings: none, builtin, or a file such as tests/device/openings.txt),
# MAX_NEW (the answers' length cap, default 512), SEED; INIT_FROM (--init-from, e.g.
# resources:drafters/smollm2-135m-dspark) trains the shipped drafter further on the new answers.
# Results land in $OUT: drafter-model.safetensors (in 15 MB parts when larger), drafter-config.json,
# drafter-draft_vocab.json, train.log, log.jsonl,
# train.jsonl.gz / eval.jsonl.gz (the answers) and run.log.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
PY=${PYTHON:-$root/.venv/bin/python}
PROMPTS=${PROMPTS:-$root/../shared/data/prompts}
GGUF_VERSION=${GGUF_VERSION:-0.19.0}
LIMIT=67108864   # one call's working tree + carried folders
MARGIN=1500000   # room for files others add to the tree before the calls

for d in /.devA/ /.devB/ /.devC/ /.stage-cache/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
after_bench=${AFTER_BENCH:-0}
[ "$after_bench" = 1 ] || bash "$root/../shared/device/stage-mlx-cuda.sh" >/dev/null
rm -rf .devC && mkdir -p .devC .stage-cache

# The gguf wheel and the compressed starter GGUF (cached between stagings).
gguf=$("$PY" -c "import engine; from engine import starter; print(starter.gguf_sources('starter'))")
if [ "$after_bench" != 1 ]; then
  ls .stage-cache/gguf-*.whl >/dev/null 2>&1 || \
    python3 -m pip download -q --no-deps --only-binary=:all: -d .stage-cache "gguf==$GGUF_VERSION"
  cp .stage-cache/gguf-*.whl .devB/
fi
if [ "$after_bench" != 1 ] && [ ! -s .stage-cache/starter.gguf.xz ]; then
  xz -T0 -6 -c "$gguf" > .stage-cache/starter.gguf.xz.tmp && mv .stage-cache/starter.gguf.xz.tmp .stage-cache/starter.gguf.xz
fi
gguf_sum=$(sha256sum "$gguf" | cut -d' ' -f1)

# Encoded prompts (the starter's chat template, here): the device only generates and trains.
"$PY" -m engine.cli train-drafter --stages encode --out .devC/run \
  --data "$PROMPTS/gsm8k.jsonl" "$PROMPTS/mbpp.jsonl" "$PROMPTS/arena-hard-v2.jsonl" \
  --eval-data "$PROMPTS/mt-bench.jsonl" "$PROMPTS/humaneval.jsonl" "$PROMPTS/math500.jsonl" \
  --eval-prompts-per-file 64 --max-prompt-tokens 1024 >/dev/null
rm -f .devC/run/train.log
if [ -n "${ANSWERS:-}" ]; then
  # Answers from an earlier session (run.sh sends them back): train.sh trains on them when no
  # run.sh call came first; after one, run.sh adds their extras to the new ones.
  mkdir -p .devC/answers
  for f in train eval extra; do
    test -s "$ANSWERS/$f.jsonl.gz" || { [ $f = extra ] && continue; echo "stage_train: no $ANSWERS/$f.jsonl.gz" >&2; exit 2; }
    cp "$ANSWERS/$f.jsonl.gz" .devC/answers/
  done
fi

tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
if [ "$after_bench" = 1 ]; then rm -rf .devA .devB .devD; else
# Split the compressed GGUF to fill what calls 1 and 2 leave free; what .devC cannot take as
# well (a large tree, e.g. once the shipped drafter is in it) goes to .devD, one more call.
rm -rf .devD
# Room a call has left for its GGUF part, never below 0 (a large tree leaves none; .devD can
# take at most one call's room on its own).
room() { local r=$(( LIMIT - tree - MARGIN - $(du -cb "$1" | tail -1 | cut -f1) )); echo $(( r > 0 ? r : 0 )); }
xzf=.stage-cache/starter.gguf.xz
r1=$(room .devA); r2=$(room .devB); r3=$(room .devC); r3=$(( r3 > 8192 ? r3 - 8192 : 0 ))
rd=$(( LIMIT - tree - MARGIN - 8192 )); rd=$(( rd > 0 ? rd : 0 ))
for d in .devA .devB; do
  if [ $(( tree + $(du -cb $d | tail -1 | cut -f1) )) -ge "$LIMIT" ]; then
    echo "stage_train: the working tree ($(( tree / 1048576 )) MiB) and $d ($(du -sh $d | cut -f1)) exceed one call's 64 MiB;" \
         "shrink the tree (untracked files count) or stage the wheels and GGUF with tests/device/stage_bench.sh" \
         "(PARTS=starter, its calls run with STARTER_BENCH=0) and this script with AFTER_BENCH=1" >&2
    exit 1
  fi
done
python3 - "$xzf" "$r1" "$r2" "$r3" "$rd" <<'EOP'
import os, sys
data, a, b, c, room_d = open(sys.argv[1], "rb").read(), *map(int, sys.argv[2:6])
d = max(0, len(data) - a - b - c)  # overflow for .devD
if d > room_d:
    sys.exit(f"stage_train: the compressed GGUF ({len(data) >> 20} MiB) does not fit in the room the calls leave beside "
             f"the tree ({(a + b + c + room_d) >> 20} MiB over four calls); shrink the tree")
parts = [(".devA/g.aa", data[:a]), (".devB/g.ab", data[a:a + b]), (".devC/g.ac", data[a + b + d:])]
if d:
    os.makedirs(".devD", exist_ok=True)
    parts.append((".devD/g.ad", data[a + b:a + b + d]))
for path, part in parts:
    open(path, "wb").write(part)
EOP
test "$(cat .devA/g.aa .devB/g.ab $(ls .devD/g.ad 2>/dev/null) .devC/g.ac | sha256sum | cut -d' ' -f1)" = "$(sha256sum "$xzf" | cut -d' ' -f1)"
if [ -d .devD ]; then
  grep -qxF "/.devD/" .git/info/exclude || echo "/.devD/" >> .git/info/exclude
  printf 'set -e\ncp .devD/g.ad /root/keep/ && echo "gguf part d kept"\n' > .devD/keep.sh
fi

cat > .devA/keep_all.sh <<'EOS'
set -e
bash .devA/keep.sh
cp .devA/g.aa /root/keep/ && echo "gguf part a kept"
EOS

cat > .devB/smoke.sh <<'EOS'
# After install.sh: keep this call's GGUF part, install gguf, and check the training code on the GPU.
set -e
cp .devB/g.ab /root/keep/ && echo "gguf part b kept"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .devB/gguf-*.whl
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
[ "${SMOKE:-1}" = 0 ] || timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k "engine_drafter or reduce_the_loss or reloads" 2>&1 | tail -15 || true
EOS
fi

# Assemble the starter GGUF on the device (run.sh and train.sh, whichever comes first).
cat > .devC/gguf.sh <<EOS
mkdir -p /root/work
check() { echo "$gguf_sum  /root/work/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet - 2>/dev/null; }
check || cat /root/keep/g.aa /root/keep/g.ab \$(ls /root/keep/g.ad 2>/dev/null) .devC/g.ac | python3 -c "import lzma, sys, shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), open('/root/work/SmolLM2-135M-Instruct.Q4_1.gguf', 'wb'))"
check || { echo "the starter GGUF is not complete in /root/work" >&2; exit 3; }
[ -d /root/work/run ] || cp -r .devC/run /root/work/run
EOS

cat > .devC/run.sh <<EOS
# Generate the training answers within this call's 600 s (bfloat16 target and KV cache:
# about twice the tokens of float32; float32 if that fails).
set -uo pipefail
export PYTHONPATH=/root/site:\$PWD PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/root/work/cache
bash .devC/gguf.sh || exit 3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gen() {
  python3 -m engine.cli train-drafter --model /root/work/SmolLM2-135M-Instruct.Q4_1.gguf --out /root/work/run \\
    --stages generate --max-new-tokens \${MAX_NEW:-512} --gen-batch \${GEN_BATCH:-1024} --target-dtype \$1 \\
    --gen-time-limit \$(( \${GEN_SECONDS:-500} - SECONDS )) --self-prompts \${SELF_PROMPTS:-8192} \\
    --samples-per-prompt \${SAMPLES:-3} --sample-temperature 0.7 --self-prompt-openings \${OPENINGS:-none} \\
    --seed \${SEED:-0} --mirror \$OUT 2>&1 | tee -a \$OUT/run.log
}
gen bfloat16 || { rm -f /root/work/run/data/train.jsonl.gz; gen float32; }
d=/root/work/run/data
if [ -d .devC/answers ]; then
  # An earlier session's answers: its extras join the new ones (gzip members concatenate); its
  # greedy answers are the new ones' (same prompts), used only where this call made none.
  [ -s \$d/train.jsonl.gz ] || cp .devC/answers/train.jsonl.gz .devC/answers/eval.jsonl.gz \$d/
  [ -s .devC/answers/extra.jsonl.gz ] && cat .devC/answers/extra.jsonl.gz >> \$d/extra.jsonl.gz
fi
ls -la \$d
# The answers come back (a later session can train on them with ANSWERS=..., no generation).
cp /root/work/run/data/train.jsonl.gz /root/work/run/data/eval.jsonl.gz \$OUT/ 2>/dev/null
[ -f /root/work/run/data/extra.jsonl.gz ] && cp /root/work/run/data/extra.jsonl.gz \$OUT/
EOS

# Files come back from $OUT at most 16 MiB each: a larger drafter comes back in parts
# (here: cat drafter-model.safetensors.part* > model.safetensors).
cat > .devC/split.sh <<'EOS'
cd "$OUT" && f=drafter-model.safetensors
if [ -f $f ] && [ "$(stat -c%s $f)" -gt 15000000 ]; then
  sha256sum $f && split -b 15000000 -d $f $f.part && rm $f
fi
EOS

# Train (float32 target, as the engine runs it on a CPU), then optionally extend, each within a call.
cat > .devC/train.sh <<'EOS'
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/root/work/cache
TL=$(( ${RUN_SECONDS:-575} - SECONDS ))
bash .devC/gguf.sh || exit 3
# ANSWERS=... and no run.sh call before: train on the earlier session's answers.
[ -s /root/work/run/data/train.jsonl.gz ] || cp .devC/answers/*.jsonl.gz /root/work/run/data/
python3 -m engine.cli train-drafter --model /root/work/SmolLM2-135M-Instruct.Q4_1.gguf --out /root/work/run \
  --stages train --layers 2 --block-size 7 --markov-rank 16 --intermediate-size ${INTER:-0} \
  --batch-seqs ${BATCH:-32} --anchors ${ANCHORS:-128} --lr ${LR:-6e-4} --val-seqs 96 --eval-every 500 \
  --checkpoint-every 500 --log-every 50 --time-limit $TL --seed ${SEED:-0} ${INIT_FROM:+--init-from $INIT_FROM} \
  --mirror $OUT ${EXTRA_ARGS:-} 2>&1 | tee $OUT/run.log
bash .devC/split.sh
EOS

cat > .devC/extend.sh <<'EOS'
# A later call on the same warm machine: more training from the checkpoint (warm restart).
# The batch, the peak learning rate (restarting at half of it) and the validation set are
# train.sh's: flags, not kept in the checkpoint.
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/root/work/cache
TL=$(( ${RUN_SECONDS:-280} - SECONDS ))
python3 -m engine.cli train-drafter --model /root/work/SmolLM2-135M-Instruct.Q4_1.gguf --out /root/work/run \
  --stages train --extend --log-every 50 --eval-every 500 --checkpoint-every 500 \
  --batch-seqs ${BATCH:-32} --anchors ${ANCHORS:-128} --lr ${LR:-6e-4} --val-seqs 96 \
  --time-limit $TL --mirror $OUT ${EXTRA_ARGS:-} 2>&1 | tee $OUT/run.log
bash .devC/split.sh
EOS

for d in $(ls -d .devA .devB .devD 2>/dev/null) .devC; do
  size=$(( tree + $(du -cb $d | tail -1 | cut -f1) ))
  echo "$d: $(du -sh $d | cut -f1) (call total $(( size / 1048576 )) MiB of 64)"
  test "$size" -lt "$LIMIT"
done
