"""``tandem benchmark --concurrent N``: many requests at once, batched against one after another.

Each group of N prompts (one group per class, so a class's figures are its own) runs per arm:

* **sequential**: the requests one after another through ``Engine.generate``, as a one-request
  server answers them; request i may not start before it arrives (``arrival_ms`` apart).
* **batched**: the same requests through a ``Batcher`` of width N (continuous batching, each row
  speculating on its own); request i joins at its arrival.

Each run starts with the engine's suffix index emptied (``forget_earlier_requests``): the same
prompts run again and again, and lookup must not draft an answer from an earlier run of it.
Reported per arm and class: aggregate tok/s (tokens / wall time from the first arrival to the
last answer), per-request latency and time to first token (p50/p95, from arrival), each request's
stream rate once its first token is out (p50: what a reader sees, prefill left out), batched /
sequential, and batched speculation / batched baseline (aggregate and stream rate). Every batched
answer is checked against the same request's sequential answer (greedy: equal, or different only
at a proven near-tie).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine.benchmark import Arm, check_lossless, forget_earlier_requests, is_mismatch, stamp
from engine.errors import TandemError
from engine.warmup import tokens_for

if TYPE_CHECKING:
    from engine.generate import Engine, GenerationResult


AGENT = "agent"  # --classes agent: requests of the replayed agent session (engine/agent_session.py)


def agent_prompts(n: int) -> list[tuple[str, list[dict]]]:
    """``n`` requests of the replayed agent session, spread over it (the last is its last, the
    reviewer sub-agent's): as from ``n`` agents at different stages of the same task, each request
    its conversation so far (tool results, files read, the edits), 0.6-6k tokens on the starter.
    A class of its own."""
    from engine.agent_session import build_session

    requests = build_session().requests
    if n > len(requests):
        raise TandemError(f"--concurrent {n}: the agent session has {len(requests)} requests")
    picks = [len(requests) * (i + 1) // n - 1 for i in range(n)]
    return [(AGENT, requests[i]) for i in picks]


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary(tokens: int, wall: float, latency: list[float], ttft: list[float], streams: list[float]) -> dict:
    """``streams``: each request's tokens after its first, per second after its first."""
    return {"tok_s": tokens / wall if wall > 0 else 0.0, "wall_s": wall, "tokens": tokens,
            "latency_p50_s": _percentile(latency, 0.5), "latency_p95_s": _percentile(latency, 0.95),
            "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p95_s": _percentile(ttft, 0.95),
            "stream_tok_s_p50": _percentile(streams, 0.5)}


def _stream_rate(generated: int, seconds: float) -> float:
    return (generated - 1) / seconds if seconds > 0 and generated > 1 else 0.0


def _kwargs(arm: Arm, max_new_tokens: int, prefix_cache: bool) -> dict:
    return dict(mode=arm.mode, max_new_tokens=max_new_tokens, prefix_cache=prefix_cache,
                max_draft=None if arm.mode == "baseline" else arm.cap)


def _forget(engine: "Engine", prefix_cache: bool) -> None:
    """Nothing of an earlier pass helps this one: the suffix index emptied, and the prefix cache
    where requests use it (``shared_prefix``: they share only with each other)."""
    forget_earlier_requests(engine)
    if prefix_cache:
        engine.clear_prefix_cache()


def run_sequential(engine: "Engine", group: Sequence[list[int]], arm: Arm, max_new_tokens: int,
                   arrival_s: float, prefix_cache: bool = False) -> tuple[dict, list["GenerationResult"]]:
    _forget(engine, prefix_cache)
    results, latency, ttft = [], [], []
    t0 = time.perf_counter()
    for i, ids in enumerate(group):
        arrive = t0 + i * arrival_s
        time.sleep(max(0.0, arrive - time.perf_counter()))
        r = engine.generate(ids, **_kwargs(arm, max_new_tokens, prefix_cache))
        end = time.perf_counter()
        results.append(r)
        latency.append(end - arrive)
        ttft.append(end - arrive - r.decode_s)  # waiting + prefill: the first token comes with prefill
    summary = _summary(sum(r.generated for r in results), time.perf_counter() - t0, latency, ttft,
                       [_stream_rate(r.generated, r.decode_s) for r in results])
    summary["cached_tokens"] = sum(r.cached_tokens for r in results)
    return summary, results


def run_batched(engine: "Engine", group: Sequence[list[int]], arm: Arm, max_new_tokens: int, arrival_s: float,
                width: int, prefix_cache: bool = False) -> tuple[dict, list["GenerationResult"]]:
    from engine.batching import Batcher

    _forget(engine, prefix_cache)
    batcher = Batcher(engine, width)
    tickets: list[Any] = [None] * len(group)
    arrived: list[float] = [0.0] * len(group)
    first: list[float | None] = [None] * len(group)
    ended: list[float] = [0.0] * len(group)
    ticks: list[float] = []
    t0 = time.perf_counter()
    pending = list(range(len(group)))
    while pending or batcher.busy:
        now = time.perf_counter()
        while pending and now >= t0 + pending[0] * arrival_s:
            i = pending.pop(0)
            arrived[i] = t0 + i * arrival_s

            def on_chunk(chunk: Any, i: int = i) -> None:
                if chunk.token_ids and first[i] is None:
                    first[i] = time.perf_counter()
                if chunk.result is not None:
                    ended[i] = time.perf_counter()

            tickets[i] = batcher.submit(group[i], on_chunk=on_chunk, **_kwargs(arm, max_new_tokens, prefix_cache))
        if batcher.busy:
            t_tick = time.perf_counter()
            batcher.step()
            if batcher.loop.last_width:  # a tick that ran a round (not only a prefill chunk)
                ticks.append(time.perf_counter() - t_tick)
        elif pending:
            time.sleep(max(0.0, t0 + pending[0] * arrival_s - time.perf_counter()))
    results = [t.result for t in tickets]
    latency = [e - a for e, a in zip(ended, arrived)]
    ttft = [(f or e) - a for f, e, a in zip(first, ended, arrived)]
    streams = [_stream_rate(r.generated, e - (f or e)) for r, f, e in zip(results, first, ended)]
    summary = _summary(sum(r.generated for r in results), time.perf_counter() - t0, latency, ttft, streams)
    summary["batch_width"] = max(r.batch_width for r in results)
    summary["cached_tokens"] = sum(r.cached_tokens for r in results)
    summary["round_p50_s"] = _percentile(ticks, 0.5)
    summary["ttft_s"] = ttft
    return summary, results


def late_arrival(sequential: list["GenerationResult"], batched: dict) -> dict:
    """The last request joins others already decoding: its first token should come within its
    own prefill time (alone) plus two of the batch's rounds."""
    budget = sequential[-1].prefill_s + 2 * batched["round_p50_s"]
    ttft = batched["ttft_s"][-1]
    return {"ttft_s": ttft, "prefill_alone_s": sequential[-1].prefill_s, "round_p50_s": batched["round_p50_s"],
            "within_prefill_plus_two_rounds": ttft <= budget}


def run_concurrent(engine: "Engine", prompts: Sequence[tuple[str, Any]], arms: Sequence[Arm], *, concurrent: int,
                   arrival_ms: float = 0.0, max_new_tokens: int = 128, trials: int = 1, shared_prefix: bool = False,
                   progress: Callable[[int, int, str], None] | None = None) -> dict:
    """The report (JSON-ready): per arm and class, sequential vs batched figures (best of
    ``trials`` by wall time; every arm's passes of a class and trial run back to back), the
    batched ratio to the baseline both from those bests and paired (the median over trials of
    each trial's ratio), with the lossless check of every batched answer. ``shared_prefix``:
    requests use the prefix cache, emptied before each pass (a later request restores what an
    earlier one, or in a batch the rows before it, prefilled); else none does."""
    if concurrent < 1 or trials < 1 or max_new_tokens < 2:
        raise TandemError("--concurrent and --trials must be at least 1 and --max-new-tokens at least 2")
    arms = list(arms)
    if not arms or arms[0] != Arm("baseline"):
        arms = [Arm("baseline")] + [a for a in arms if a.mode != "baseline"]
    classes = list(dict.fromkeys(c for c, _ in prompts))
    groups = {c: [engine.encode(p) for k, p in prompts if k == c][:concurrent] for c in classes}
    arrival_s = arrival_ms / 1000.0
    total, done = len(arms) * len(classes) * trials * 2 + len(arms), 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    # every batch shape the arms will meet, compiled before any timing: up to the longest context
    # the run reaches (a serving process meets each once; the agent class's prompts pass 4k tokens)
    warm_tokens = tokens_for((len(ids) for g in groups.values() for ids in g), max_new_tokens)
    if engine.target.shapes is not None:
        from engine.batching import warm_up

        warm_up(engine, list(dict.fromkeys(a.mode for a in arms)), concurrent, tokens=warm_tokens)
    for arm in arms:  # warm-up: first-call allocations, both paths
        run_batched(engine, [groups[classes[0]][0]] * 2, arm, 8, 0.0, 2)
        tick(f"warm-up {arm.name}")
    # class by class, trial by trial, every arm back to back: a machine's pace drifts over minutes
    # (a shared VM's by 10-20 %), and arms timed minutes apart would carry that into their ratios
    best: dict[tuple[str, str, str], tuple[dict, list]] = {}
    per_trial: dict[tuple[str, str], list[float]] = {}  # batched tok/s by trial, for the paired ratio
    for cls in classes:
        for _ in range(trials):
            for arm in arms:
                for way in ("sequential", "batched"):
                    if way == "sequential":
                        summary, results = run_sequential(engine, groups[cls], arm, max_new_tokens, arrival_s,
                                                          shared_prefix)
                    else:
                        summary, results = run_batched(engine, groups[cls], arm, max_new_tokens, arrival_s, concurrent,
                                                       shared_prefix)
                        per_trial.setdefault((arm.name, cls), []).append(summary["tok_s"])
                    key = (arm.name, cls, way)
                    if key not in best or summary["wall_s"] < best[key][0]["wall_s"]:
                        best[key] = (summary, results)
                    tick(f"{arm.name} {cls} {way} {summary['tok_s']:.1f} tok/s")
    report_arms: dict[str, dict] = {}
    divergences = []
    for arm in arms:
        entry: dict[str, Any] = {"mode": arm.mode, "cap": arm.cap, "classes": {}}
        for cls in classes:
            (seq, seq_results), (bat, bat_results) = best[(arm.name, cls, "sequential")], best[(arm.name, cls, "batched")]
            for j, (ids, a, b) in enumerate(zip(groups[cls], seq_results, bat_results)):
                bad = check_lossless(engine, ids, a.token_ids, b.token_ids, f"{arm.name} batched")
                if bad is not None:
                    divergences.append({**bad, "cls": cls, "prompt": j})
            entry["classes"][cls] = {"sequential": seq, "batched": bat,
                                     "batched_vs_sequential": bat["tok_s"] / seq["tok_s"] if seq["tok_s"] else None}
            if arrival_s > 0:
                entry["classes"][cls]["late_arrival"] = late_arrival(seq_results, bat)
        entry["tok_s"] = statistics.mean(c["batched"]["tok_s"] for c in entry["classes"].values())
        entry["sequential_tok_s"] = statistics.mean(c["sequential"]["tok_s"] for c in entry["classes"].values())
        entry["batched_vs_sequential"] = entry["tok_s"] / entry["sequential_tok_s"] if entry["sequential_tok_s"] else None
        report_arms[arm.name] = entry
    base = report_arms["baseline"]
    for name, entry in report_arms.items():  # batched speculation against batched plain decoding
        entry["vs_batched_baseline"] = {c: v["batched"]["tok_s"] / base["classes"][c]["batched"]["tok_s"]
                                        for c, v in entry["classes"].items()}
        entry["paired_vs_batched_baseline"] = {  # median of each trial's ratio to the baseline timed beside it
            c: statistics.median(a / b for a, b in zip(per_trial[(name, c)], per_trial[("baseline", c)]))
            for c in entry["classes"]}
        entry["stream_vs_batched_baseline"] = {  # prefill left out: the decode speed-up a reader sees
            c: _ratio(v["batched"]["stream_tok_s_p50"], base["classes"][c]["batched"]["stream_tok_s_p50"])
            for c, v in entry["classes"].items()}
    return {**stamp(engine), "concurrent": concurrent, "arrival_ms": arrival_ms, "trials": trials,
            "shared_prefix": shared_prefix, "warm_tokens": warm_tokens if engine.target.shapes is not None else 0,
            "max_new_tokens": max_new_tokens, "classes": classes, "arms": report_arms,
            "lossless": not any(is_mismatch(d) for d in divergences), "divergences": divergences}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def format_concurrent(report: dict) -> str:
    width = max([8] + [len(c) + 1 for c in report["classes"]])
    lines = [f"{report['model']} on {report['device']} ({report['backend']}): {report['concurrent']} concurrent "
             f"requests, arrivals {report['arrival_ms']:g} ms apart, {report['max_new_tokens']} new tokens each",
             f"{'arm':<16}{'class':<{width}}{'seq tok/s':>10}{'batch tok/s':>12}{'x seq':>7}{'x batched base':>15}"
             f"{'p50 lat':>9}{'p95 lat':>9}{'p95 ttft':>10}{'p50 stream':>11}{'x base':>7}"]
    for name, arm in report["arms"].items():
        for cls, c in arm["classes"].items():
            seq, bat = c["sequential"], c["batched"]
            lines.append(f"{name:<16}{cls:<{width}}{seq['tok_s']:>10.1f}{bat['tok_s']:>12.1f}"
                         f"{c['batched_vs_sequential']:>7.2f}{arm['vs_batched_baseline'][cls]:>15.2f}"
                         f"{bat['latency_p50_s']:>8.2f}s{bat['latency_p95_s']:>8.2f}s{bat['ttft_p95_s']:>9.2f}s"
                         f"{bat['stream_tok_s_p50']:>11.1f}{arm['stream_vs_batched_baseline'][cls] or 0:>7.2f}")
    late = [(name, cls, c["late_arrival"]) for name, arm in report["arms"].items()
            for cls, c in arm["classes"].items() if "late_arrival" in c]
    if late:
        lines.append("last arrival's first token (its prefill alone + 2 rounds): " + ", ".join(
            f"{name} {cls} {x['ttft_s']:.2f}s ({x['prefill_alone_s']:.2f}+2x{x['round_p50_s']:.3f}s: "
            f"{'ok' if x['within_prefill_plus_two_rounds'] else 'late'})" for name, cls, x in late))
    if report.get("shared_prefix"):
        lines.append("prompt tokens restored from the prefix cache, one after another / batched: " + ", ".join(
            f"{name} {cls} {c['sequential']['cached_tokens']} / {c['batched']['cached_tokens']}"
            for name, arm in report["arms"].items() for cls, c in arm["classes"].items()))
    lines.append("lossless: " + ("yes" if report["lossless"] else "NO: " + "; ".join(
        f"{d['arm']} {d['cls']}#{d['prompt']}" for d in report["divergences"] if is_mismatch(d))))
    return "\n".join(lines)
