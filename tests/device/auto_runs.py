"""Read a benchmark report's run traces (``run_benchmark(..., trace=True)``, as
``tests/device/bench_device.py`` writes them) and say where ``--max-draft auto`` spent its time.

    python3 tests/device/auto_runs.py tests/device/results/h200-auto3-starter-bfloat16.json
    python3 tests/device/auto_runs.py tests/device/results/h200-pair3-bfloat16.json

Per arm and class, four estimates of the ratio to plain decoding, from noisiest to least:

* ``median``: the benchmark's own figure (median over trials of class tok/s / baseline's);
* ``paired``: the median over (trial, prompt) of the arm's run against baseline's run of the
  same prompt in the same trial (the two ran seconds apart);
* ``best``: each prompt's fastest trial against baseline's fastest (contention only adds time);
* ``in-run``: each run against its own parked plain steps (runs of >= 20): what the rounds and
  probes cost against plain steps taken by the same process in the same seconds. Only for runs
  that parked; this isolates the controller's overhead from the machine's drift.

Then what rounds cost in plain steps (a request's first round apart: it pays for the drafter's
catch-up on the prompt), and how many rounds a request ran.
"""

from __future__ import annotations

import json
import statistics as st
import sys

MIN_RUN = 20  # plain steps in a row that price this run's plain step


def plain_step_ms(rows: list) -> float | None:
    prev, steps, ms = 0.0, 0, 0.0
    for cap, n, _, end in rows:
        if cap == 0 and n >= MIN_RUN:
            steps, ms = steps + n, ms + end - prev
        prev = end
    return ms / steps if steps else None


def main(path: str) -> None:
    data = json.load(open(path))
    part = next((data[k] for k in ("starter", "pair") if isinstance(data.get(k), dict)), {})
    report = part.get("benchmark", data)  # bench_device.py's starter or pair part, or a bare report
    runs, prompts = report["runs"], report["prompts"]
    classes = list(dict.fromkeys(p["class"] for p in prompts))
    trials = len(runs["baseline"])
    print(f"{report['model']} {report['precision']} on {report['device']}: {len(prompts)} prompts x {trials} trials")
    for arm, per_trial in runs.items():
        if arm == "baseline":
            continue
        cells = []
        for cls in classes:
            idx = [j for j, p in enumerate(prompts) if p["class"] == cls]
            entry = report["arms"][arm]["classes"][cls]["ratio"]
            paired = [runs["baseline"][t][j]["decode_s"] / per_trial[t][j]["decode_s"]
                      * (per_trial[t][j]["tokens"] - 1) / (runs["baseline"][t][j]["tokens"] - 1)
                      for t in range(trials) for j in idx]
            best = sum(min(runs["baseline"][t][j]["decode_s"] for t in range(trials)) for j in idx) / \
                sum(min(per_trial[t][j]["decode_s"] for t in range(trials)) for j in idx)
            in_run = []
            for t in range(trials):
                for j in idx:
                    r = per_trial[t][j]
                    step = plain_step_ms(r["rounds"])
                    if step:
                        in_run.append((r["tokens"] - 1) * step / (1000.0 * r["decode_s"]))
            cells.append(f"{cls} {entry:.2f}/{st.median(paired):.2f}/{best:.2f}/"
                         + (f"{st.median(in_run):.2f}" if in_run else "-"))
        first, later, rounds = [], [], []
        for rs in per_trial:
            for r in rs:
                step = plain_step_ms(r["rounds"])
                spec = 0
                prev = 0.0
                for cap, _, _, end in r["rounds"]:
                    if cap > 0:
                        if step:
                            (later if spec else first).append((end - prev) / step)
                        spec += 1
                    prev = end
                rounds.append(spec)
        cost = (f"round = {st.median(first):.2f} plain steps first, {st.median(later):.2f} later"
                if first and later else "")
        print(f"  {arm:<12} median/paired/best/in-run: " + "  ".join(cells)
              + f" | rounds/request {st.mean(rounds):.1f} {cost}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
