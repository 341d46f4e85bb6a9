"""Which decode rounds are slow after ``Engine.warm_up`` (a kernel compiled for a new shape).

Not a pytest module: run on a GPU machine after staging (``tests/device/stage_bench.sh``)::

    PYTHONPATH=/root/site:. python3 tests/device/storm_diag.py SmolLM2-135M-Instruct.Q4_1.gguf float16

One fresh process: load, warm up baseline/lookup/dspark, then each shipped prompt (``PER_CLASS``
per class, default 2) in dspark@auto, dspark at its full block, lookup@auto and baseline. Prints one
JSON line per generation with its rounds over 80 ms (round index, drafted, cap, context, draft and
verify ms) and writes ``storm-diag-DTYPE.json`` to ``$OUT``.
"""

import json
import os
import sys
import time

sys.path.insert(0, ".")

from engine.api import load
from engine.prompts import load_prompts

SLOW_S = 0.08
ARMS = (("dspark", "auto"), ("dspark", None), ("lookup", "auto"), ("baseline", None))


def slow_rounds(engine, prompt: str, mode: str, cap) -> dict:
    last, slow = [0.0], []

    def on_round(ev) -> None:
        dt, last[0] = ev.t - last[0], ev.t
        if dt > SLOW_S:
            slow.append({"i": ev.index, "ms": round(dt * 1e3), "drafted": ev.drafted, "cap": ev.cap, "ctx": ev.context,
                             "d": round(ev.draft_s * 1e3), "v": round(ev.verify_s * 1e3), "by": ev.drafted_by})

    t = time.time()
    r = engine.generate(prompt, mode=mode, max_new_tokens=128, max_draft=cap, on_round=on_round)
    return {"mode": f"{mode}@{cap}", "tps": round(r.decode_tps, 1), "wall": round(time.time() - t, 2), "slow": slow[:8]}


def main() -> None:
    gguf, dtype = sys.argv[1], sys.argv[2]
    engine = load(gguf, dtype=dtype)
    t = time.time()
    engine.warm_up([m for m, _ in ARMS])
    print("warm_up s", round(time.time() - t, 1), flush=True)
    out = []
    for cls, prompt in load_prompts(["chat", "code", "math"], int(os.environ.get("PER_CLASS", "2"))):
        for mode, cap in ARMS:
            rec = dict(cls=cls, **slow_rounds(engine, prompt, mode, cap))
            out.append(rec)
            print(json.dumps(rec), flush=True)
    folder = os.environ.get("OUT", "out")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"storm-diag-{dtype}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
