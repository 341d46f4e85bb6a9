"""``tandem benchmark --agent-replay``: a coding agent's session replayed, request by request.

The session (``engine/agent_session.py``: a rename across Tandem's own source, 15 requests of a
growing conversation and a reviewer sub-agent's one; or, ``delegating``, the agent handing each
module's edit to a sub-agent in a fresh conversation) is sent as an agent sends it: each request
is the whole conversation so far, so the prefix cache restores what the last request prefilled,
and the suffix index holds what the earlier requests read and wrote. Arms:

* ``baseline``: plain decoding;
* ``<lookup arm> (in-context)``: n-gram lookup in the request's own context alone: the suffix
  index emptied before every request;
* ``<lookup arm> (+suffix)``: the index kept across the session's requests, as ``tandem serve``
  keeps it (what issue 43 asks to pay: >= 1.5x the in-context arm);
* every other mode asked for (``dspark@auto`` ...), the index kept as served.

Each arm replays the whole session from an empty prefix cache and suffix index (arm order
rotated between trials, so a busy machine slows all alike). Reported per arm: decode tok/s over
the session (prefill excluded), its ratio to baseline, tokens per round, prefill and session
seconds; each lookup arm's suffix/in-context ratio; and the lossless check: every request's
greedy tokens in every arm equal baseline's (or differ only at a proven near-tie).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from engine.agent_session import Session, build_delegating_session, build_session
from engine.benchmark import (
    PLAIN_REANCHORS,
    Arm,
    _accept_per_round,
    _tps,
    arm_order,
    calibrate_arms,
    check_lossless,
    divergence_line,
    forget_earlier_requests,
    is_mismatch,
    lossless_label,
    stamp,
)
from engine.errors import TandemError
from engine.warmup import tokens_for

if TYPE_CHECKING:
    from engine.generate import Engine, GenerationResult

IN_CONTEXT = " (in-context)"
SUFFIX = " (+suffix)"
TARGET = 1.5  # issue 43: suffix drafts >= 1.5x in-context lookup alone


@dataclass(frozen=True)
class ReplayArm:
    arm: Arm
    keep_index: bool = True  # the suffix index kept across the session's requests

    @property
    def name(self) -> str:
        if self.arm.mode != "lookup":
            return self.arm.name
        return self.arm.name + (SUFFIX if self.keep_index else IN_CONTEXT)


def replay_arms(arms: Sequence[Arm]) -> list[ReplayArm]:
    """Baseline first, each lookup arm twice (in-context, +suffix), every other arm once."""
    out = [ReplayArm(Arm("baseline"))]
    for arm in arms:
        if arm.mode == "lookup":
            out += [ReplayArm(arm, keep_index=False), ReplayArm(arm)]
        elif arm.mode != "baseline":
            out.append(ReplayArm(arm))
    return out


def render(engine: "Engine", messages: list[dict]) -> list[int]:
    """A request's token ids: through the chat template, or (a model without one) its turns as text."""
    if getattr(engine.tokenizer, "chat_template", None):
        return engine.encode(messages)
    return engine.encode("\n\n".join(f"{m['role']}: {m['content']}" for m in messages), chat_template=False)


def replay(engine: "Engine", requests: Sequence[list[int]], arm: ReplayArm,
           max_new_tokens: int) -> Iterator["GenerationResult"]:
    """One run of the session, request by request, from an empty prefix cache and suffix index."""
    engine.clear_prefix_cache()
    forget_earlier_requests(engine)
    for ids in requests:
        if not arm.keep_index:
            forget_earlier_requests(engine)
        yield engine.generate(ids, mode=arm.arm.mode, max_new_tokens=max_new_tokens, prefix_cache=True,
                              max_draft=None if arm.arm.mode == "baseline" else arm.arm.cap)


def best_tps(runs: Sequence[Sequence["GenerationResult"]]) -> float:
    """Decode tok/s with each request's fastest trial (contention only ever adds time)."""
    tokens = sum(max(0, r.generated - 1) for r in runs[0])
    seconds = sum(min(rs[j].decode_s for rs in runs) for j in range(len(runs[0])))
    return tokens / seconds if seconds > 0 else 0.0


def run_agent_replay(engine: "Engine", arms: Sequence[Arm], *, session: Session | None = None, shape: str = "single",
                     trials: int = 1, max_new_tokens: int = 128,
                     progress: Callable[[int, int, str], None] | None = None,
                     calibration_progress: Callable | None = None,
                     warmup_progress: Callable | None = None) -> dict:
    """Replay ``session`` (default: the ``shape`` session, ``single`` or ``delegating``) in every arm
    ``trials`` times; returns the report (JSON-ready)."""
    if getattr(engine, "suffix_index", None) is None:
        raise TandemError("--agent-replay compares lookup with and without the suffix index: the engine has none "
                          "(drop --no-suffix-drafts)")
    if trials < 1 or max_new_tokens < 2:
        raise TandemError("benchmark needs --trials >= 1 and --max-new-tokens >= 2")
    if session is None:
        builders = {"single": build_session, "delegating": build_delegating_session}
        if shape not in builders:
            raise TandemError(f"unknown agent session '{shape}': choose from {', '.join(builders)}")
        session = builders[shape]()
    rarms = replay_arms(arms)
    requests = [render(engine, messages) for messages in session.requests]
    calibrations = calibrate_arms(engine, [a.arm for a in rarms], calibration_progress)
    if engine.target.shapes is not None:  # the shapes every arm will use, compiled before any timing
        engine.warm_up(list(dict.fromkeys(a.arm.mode for a in rarms)), progress=warmup_progress,
                       tokens=tokens_for((len(r) for r in requests), max_new_tokens))
    for a in rarms:  # first-call allocations, kernel selection
        list(replay(engine, requests[:1], a, 8))
    total, done = trials * len(rarms) * len(requests), 0
    results: dict[str, list[list["GenerationResult"]]] = {a.name: [] for a in rarms}
    for trial in range(trials):
        for a in (rarms[i] for i in arm_order(len(rarms), trial, 0, 1)):
            got = []
            for r in replay(engine, requests, a, max_new_tokens):
                got.append(r)
                done += 1
                if progress is not None:
                    progress(done, total, f"{a.name} request {len(got)}: {got[-1].decode_tps:.1f} tok/s")
            results[a.name].append(got)

    reference = [r.token_ids for r in results["baseline"][0]]
    divergences = []
    for a in rarms:
        for trial, runs in enumerate(results[a.name]):
            for j, r in enumerate(runs):
                bad = None if a.name == "baseline" and trial == 0 else \
                    check_lossless(engine, requests[j], reference[j], r.token_ids, a.name, reanchors=PLAIN_REANCHORS)
                if bad is not None:
                    bad.update(trial=trial, prompt=j, cls=session.labels[j])
                    divergences.append(bad)
    base = [_tps(runs) for runs in results["baseline"]]
    report_arms = {}
    for a in rarms:
        runs = results[a.name]
        tps = [_tps(rs) for rs in runs]
        report_arms[a.name] = {
            "mode": a.arm.mode, "cap": a.arm.cap if a.arm.cap is not None else runs[0][0].cap,
            "suffix_index": a.keep_index, "tok_s": statistics.median(tps), "tok_s_trials": tps,
            "ratio": statistics.median(t / b for t, b in zip(tps, base)) if all(base) else None,
            "best_tok_s": best_tps(runs), "best_ratio": best_tps(runs) / best_tps(results["baseline"]),
            "accept_per_round": _accept_per_round([r for rs in runs for r in rs]),
            "prefill_s": statistics.median(sum(r.prefill_s for r in rs) for rs in runs),
            "session_s": statistics.median(sum(r.prefill_s + r.decode_s for r in rs) for rs in runs),
            "cached_tokens": sum(r.cached_tokens for r in runs[0]),
            "tokens": sum(r.generated for r in runs[0]),
            "requests_tok_s": [round(r.decode_tps, 2) for r in runs[0]],
            "lossless": not any(d["arm"] == a.name and is_mismatch(d) for d in divergences),
            "ties": sum(1 for d in divergences if d["arm"] == a.name and not is_mismatch(d)),
        }
    suffix_vs_context = {}
    for a in rarms:
        if a.arm.mode == "lookup" and a.keep_index:
            kept, alone = results[a.name], results[ReplayArm(a.arm, keep_index=False).name]
            suffix_vs_context[a.arm.name] = {"ratio": statistics.median(_tps(k) / _tps(c) for k, c in zip(kept, alone)),
                                             "best_ratio": best_tps(kept) / best_tps(alone)}
    return {
        **stamp(engine), "trials": trials, "max_new_tokens": max_new_tokens,
        "session": {"task": f"rename {session.symbol} to {session.new_name}", "shape": session.shape,
                    "requests": [{"after": label, "prompt_tokens": len(ids)}
                                 for label, ids in zip(session.labels, requests)]},
        "arms": report_arms, "suffix_vs_context": suffix_vs_context, "target": TARGET,
        "calibrations": {m: c.to_dict() for m, c in calibrations.items()},
        "lossless": not any(is_mismatch(d) for d in divergences), "divergences": divergences,
    }


def format_agent_replay(report: dict) -> str:
    reqs = report["session"]["requests"]
    lines = [f"{report['model']} on {report['device']} ({report['backend']}, MLX {report['mlx']}, "
             f"{report['precision']}) | agent session ({report['session']['task']}, "
             f"{report['session'].get('shape', 'single')}): {len(reqs)} requests of "
             f"{min(r['prompt_tokens'] for r in reqs)}-{max(r['prompt_tokens'] for r in reqs)} prompt tokens, "
             f"{report['trials']} trial(s), up to {report['max_new_tokens']} new tokens each",
             f"{'arm':<26}{'tok/s':>8}{'x base':>8}{'best':>8}{'x base':>8}{'acc/rnd':>9}{'prefill s':>11}"
             f"{'session s':>11}  lossless"]
    for name, a in report["arms"].items():
        ratio = f"{a['ratio']:8.2f}" if a["ratio"] is not None else f"{'-':>8}"
        lines.append(f"{name:<26}{a['tok_s']:8.1f}{ratio}{a['best_tok_s']:8.1f}{a['best_ratio']:8.2f}"
                     f"{a['accept_per_round']:9.2f}{a['prefill_s']:11.2f}{a['session_s']:11.2f}  {lossless_label(a)}")
    lines.append("tok/s: decode tokens per second over the session's requests (prefill excluded), median of trials; "
                 "best: each request's fastest trial; each request is the whole conversation so far (prefix cache on)")
    for name, r in report["suffix_vs_context"].items():
        lines.append(f"suffix drafts vs in-context lookup alone ({name}): {r['ratio']:.2f}x, best of trials "
                     f"{r['best_ratio']:.2f}x (issue 43's target: >= {report['target']:.1f}x)")
    lines += [divergence_line(d, f"trial {d['trial']} request {d['prompt']} ({d['cls']})") for d in report["divergences"]]
    if not report["divergences"]:
        lines.append("lossless: every arm reproduced baseline's tokens on every request")
    return "\n".join(lines)
