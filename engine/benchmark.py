"""The benchmark behind ``tandem benchmark``: modes side by side on chat, code and math prompts.

Every (mode, cap) arm runs on every prompt in every trial, arms interleaved and rotated (and
reversed every other trial: ``arm_order``), so a busy machine slows all arms alike instead of
whichever ran during the burst. Reported per arm:
decode tok/s (median over trials of total tokens / total decode seconds), its ratio to baseline
(median of per-trial ratios), committed tokens per verify round, the share of the memory
roofline, and the lossless check: every arm's tokens must equal baseline's. A divergence is
reported with the top-2 logit margin of a clean re-run of baseline's prefix, which tells an
exact floating-point near-tie (acceptable) from a bug.

The prompt sets ship with the product (``engine/prompts.py``: the chat/code/math classes and
Spec-Bench's categories); a multi-turn prompt's first turn is answered by the target's own greedy
output (untimed) and every arm is timed on the last turn of that same conversation.

``--multi-turn`` (``run_multi_turn``) measures the prefix cache instead: the later turns of
mt-bench conversations, time to first token with the earlier turns restored vs prefilled.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine.errors import TandemError
from engine.prompts import CLASSES, Turns, load_prompts, load_spec_bench, prompts_dir  # noqa: F401 (re-exported)
from engine.warmup import tokens_for

if TYPE_CHECKING:
    from engine.generate import Engine, GenerationResult

PLAIN_REANCHORS = 2  # drifts of a plain-decoding reference the lossless check re-anchors past, in a row
TIE_MARGIN = 1e-3  # top-2 logit gap (relative to max(1, |top-1|)) below which a flip is a near-tie


# ===================================================================== arms
@dataclass(frozen=True)
class Arm:
    mode: str
    cap: int | str | None = None  # None: the mode's default cap

    @property
    def name(self) -> str:
        if self.mode == "baseline":
            return "baseline" if self.cap is None else NOISE_ARM
        return self.mode if self.cap is None else f"{self.mode}@{self.cap}"


NOISE_ARM = "baseline-2"  # plain decoding again, as its own arm: its ratio to baseline is the noise floor


def make_arms(modes: Sequence[str], caps: Sequence[int | str | None] = (None,), *,
              noise_floor: bool = False) -> list[Arm]:
    """Baseline first (always: it is the reference), with ``noise_floor`` a second baseline arm
    (an A/A comparison: how far two identical arms drift apart on this machine), then every
    speculative mode at every cap."""
    arms = [Arm("baseline")] + ([Arm("baseline", 2)] if noise_floor else [])
    for mode in modes:
        if mode == "baseline":
            continue
        for cap in caps or (None,):
            if Arm(mode, cap) not in arms:
                arms.append(Arm(mode, cap))
    return arms


def parse_caps(text: str | None) -> list[int | str | None]:
    if not text:
        return [None]
    caps: list[int | str | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "auto":
            caps.append("auto")
        else:
            try:
                caps.append(int(part))
            except ValueError:
                raise TandemError(f"--max-draft takes integers or 'auto', comma-separated; got '{part}'")
    return caps


def arm_order(n_arms: int, trial: int, prompt: int, n_prompts: int) -> list[int]:
    """The order the arms run in on one prompt of one trial: rotated, so each arm takes every
    position in turn, and reversed on odd trials, so no arm always runs right after the same
    one (a heavy arm's after-effects on the allocator or the device clocks would otherwise land
    on one neighbour every time)."""
    shift = (trial * n_prompts + prompt) % n_arms
    order = list(range(shift, n_arms)) + list(range(shift))
    return order[::-1] if trial % 2 else order


# ===================================================================== the lossless check
def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first differing token; None when equal or one is a prefix of the other
    (a length difference alone is not a divergence)."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None


def clean_top(engine: "Engine", ids: Sequence[int], k: int = 2) -> tuple[list[tuple[int, float]], Any]:
    """The target's ``k`` highest next-token logits after ``ids`` (as float32), from a clean
    cache, and the dtype the target computed them in."""
    import mlx.core as mx

    target = engine.target
    with target.uncounted():
        logits, _ = target.prefill(list(ids), target.new_cache())
    native, logits = logits.dtype, logits.astype(mx.float32)
    return [(int(t), logits[t].item()) for t in mx.argsort(-logits)[:k].tolist()], native


def divergence_margin(engine: "Engine", prompt_ids: Sequence[int], prefix: Sequence[int]) -> dict:
    """The target's top-2 at the position after ``prompt_ids + prefix``, from a clean cache."""
    ((t1, v1), (t2, v2)), native = clean_top(engine, list(prompt_ids) + list(prefix))
    return {"top1": t1, "top2": t2, "logit1": v1, "logit2": v2, "margin": v1 - v2,
            "near_tie": is_near_tie(v1, v2, native), "logit_dtype": str(native).replace("mlx.core.", "")}


def logit_ulp(value: float, dtype) -> float:
    """One unit in the last place of ``value`` stored in ``dtype`` (bf16 logits are this coarse)."""
    import math

    import mlx.core as mx

    mantissa = {mx.bfloat16: 7, mx.float16: 10}.get(dtype, 23)
    exponent = math.frexp(max(abs(value), 1e-30))[1] - 1
    return 2.0 ** (exponent - mantissa)


def is_near_tie(v1: float, v2: float, dtype) -> bool:
    """Top-2 logits closer than the float rounding of the target's own compute precision: a
    width-1 and a width-k forward may order them either way (1e-3 relative in float32, two
    units in the last place in bfloat16/float16)."""
    return (v1 - v2) <= max(TIE_MARGIN * max(1.0, abs(v1)), 2 * logit_ulp(v1, dtype))


def clean_greedy(engine: "Engine", prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding of ``prompt_ids`` from a clean cache, outside the engine's request
    path (no prefix cache, no history, no learned state touched)."""
    from engine.sampling import Sampler, SamplingParams
    from engine.speculative import decode

    target = engine.target
    out: list[int] = []
    with target.uncounted():
        for new, _ in decode(target, None, list(prompt_ids), Sampler(SamplingParams()), max_new_tokens=max_new_tokens):
            out += new
    return out


def check_lossless(engine: "Engine", prompt_ids: Sequence[int], reference: Sequence[int], other: Sequence[int],
                   arm: str = "", *, reanchors: int = 0) -> dict | None:
    """None when ``other`` reproduces ``reference``; else a report of the first divergence.

    ``reanchors`` > 0, for a reference that is plain decoding: where the arm's token is the clean
    forward's first choice and the reference's is not, by more than a near-tie, it was the plain
    run that left the target's order (its own rounding: a restored prefix; bf16 on a GPU moves a
    logit a few units between two runs of the same request). Then the arm's remaining tokens are
    checked against clean greedy decoding from its token on (``reference_drift``; ``after``: that
    check's divergence, None when equal), at most ``reanchors`` times in a row. A reference that
    is itself a speculative run (the concurrent benchmark's one-at-a-time rows) is not excused so."""
    i = first_divergence(reference, other)
    if i is None:
        return None
    report = {"arm": arm, "index": i, "baseline_token": int(reference[i]), "arm_token": int(other[i])}
    report.update(divergence_margin(engine, prompt_ids, reference[:i]))
    report["arm_token_is_top2"] = report["arm_token"] in (report["top1"], report["top2"])
    if not report["near_tie"] and report["arm_token"] == report["top1"] and reanchors > 0:
        start = list(prompt_ids) + list(other[: i + 1])
        clean = clean_greedy(engine, start, len(other) - i - 1) if len(other) > i + 1 else []
        report["reference_drift"] = True
        report["after"] = check_lossless(engine, start, clean, other[i + 1:], arm, reanchors=reanchors - 1)
    return report


def is_mismatch(d: dict) -> bool:
    """Whether a divergence report shows the arm leaving the target: not a near-tie, and not the
    reference's own drift with the arm's rest equal to clean greedy decoding (or off it only at
    near-ties and further drifts)."""
    if d["near_tie"]:
        return False
    if d.get("reference_drift"):
        return d["after"] is not None and is_mismatch(d["after"])
    return True


def divergence_kind(d: dict) -> str:
    return "MISMATCH" if is_mismatch(d) else "reference drift" if d.get("reference_drift") else "near-tie"


# ===================================================================== running
def _tps(results: Sequence["GenerationResult"]) -> float:
    tokens = sum(max(0, r.generated - 1) for r in results)
    seconds = sum(r.decode_s for r in results)
    return tokens / seconds if seconds > 0 else 0.0


def _accept_per_round(results: Sequence["GenerationResult"]) -> float:
    rounds = [rd for r in results for rd in r.rounds[1:]]
    return (sum(a for _, a in rounds) + len(rounds)) / len(rounds) if rounds else 0.0


def modeled_seconds(cal: Any, result: "GenerationResult") -> float:
    """Decode time the calibrated cost model assigns to this generation's actual rounds: each
    round verify(drafted + 1) plus the drafter's and the loop's overhead. Free of the timing
    noise of a shared machine, it compares how well arms *choose* their rounds."""
    total = 0.0
    caps = result.caps or [0 if result.mode == "baseline" else max(1, d) for d, _ in result.rounds]
    for (drafted, _), cap in zip(result.rounds[1:], caps[1:]):  # round 0 is the prefill's token
        if cap == 0:  # a plain (pipelined) step
            total += cal.plain_step_ms()
        else:  # the drafter ran at the cap, whatever it proposed
            total += cal.verify(drafted + 1) + cal.draft(cap) + cal.overhead_ms
    return total / 1000.0


def _model_tps(cal: Any, results: Sequence["GenerationResult"]) -> float:
    tokens = sum(max(0, r.generated - 1) for r in results)
    seconds = sum(modeled_seconds(cal, r) for r in results)
    return tokens / seconds if seconds > 0 else 0.0


def forget_earlier_requests(engine: "Engine") -> None:
    """Empty the engine's suffix index: a benchmark runs the same prompts again and again, and
    lookup would otherwise draft each answer from an earlier run of it."""
    if getattr(engine, "suffix_index", None) is not None:
        engine.suffix_index.clear()


def calibrate_arms(engine: "Engine", arms: Sequence[Arm], progress: Callable | None = None) -> dict:
    """Each speculative mode's calibration, measured (or loaded) before any timing starts."""
    from engine.calibrate import calibrate

    return {mode: calibrate(engine, mode, engine.drafter(mode), progress=progress)
            for mode in dict.fromkeys(a.mode for a in arms if a.mode != "baseline")}


def stamp(engine: "Engine") -> dict:
    """What the figures depend on: machine, backend, MLX, model."""
    import mlx.core as mx

    from engine import platform
    from engine.calibrate import model_precision

    loaded = getattr(engine, "loaded", None)
    return {"device": platform.device_name(), "backend": platform.backend(), "mlx": mx.__version__,
            "model": engine.name, "model_path": str(getattr(loaded, "path", "") or ""),
            "precision": model_precision(engine.target.model), "drafter": engine.drafter_path,
            "draft_model": engine.draft_model_spec, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            # on CUDA, how many kernel graphs MLX keeps: a thrashing cache slows every arm (engine/platform.py)
            "cuda_graph_cache": os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE"),
            # whose matmuls a verify runs: Tandem's CUDA kernel ("skinny") or MLX's, and why (engine/cuda_skinny.py)
            "verify_matmuls": engine.target.skinny_off or "skinny"}


def run_benchmark(engine: "Engine", prompts: Sequence[tuple[str, Any]], arms: Sequence[Arm], *, trials: int = 3,
                  max_new_tokens: int = 128, progress: Callable[[int, int, str], None] | None = None,
                  bandwidth: float | None = None, calibration_progress: Callable | None = None,
                  warmup_progress: Callable | None = None, trace: bool = False) -> dict:
    """Run every arm on every prompt ``trials`` times; returns the report (JSON-ready).
    ``trace``: each run's rounds in the report too (``runs``: what the cap policy chose and got),
    for studying a controller offline.

    ``prompts``: (class, prompt) where prompt is text (chat-templated), chat messages, token
    ids or ``Turns`` (answered turn by turn by the target's greedy baseline, untimed)."""
    from engine.roofline import RooflineModel, measure_bandwidth

    if not prompts:
        raise TandemError("no prompts to benchmark")
    if trials < 1 or max_new_tokens < 2:
        raise TandemError("benchmark needs --trials >= 1 and --max-new-tokens >= 2")
    arms = list(arms)
    if not arms or arms[0] != Arm("baseline"):
        arms = [Arm("baseline")] + [a for a in arms if a.mode != "baseline"]
    calibrations = calibrate_arms(engine, arms, calibration_progress)
    if bandwidth is None:
        bandwidth = next((c.bandwidth for c in calibrations.values() if c.bandwidth), None) or measure_bandwidth()

    encoded = [engine.encode(conversation(engine, p, max_new_tokens) if isinstance(p, Turns) else p)
               for _, p in prompts]
    total = len(arms) + trials * len(prompts) * len(arms)
    done = 0

    def gen(arm: Arm, ids: list[int], n: int) -> "GenerationResult":
        # Every run prefills its prompt (the prefix cache would restore it from the arm before) and
        # drafts from its own context only (the suffix index holds the other arms' answers).
        forget_earlier_requests(engine)
        return engine.generate(ids, mode=arm.mode, max_new_tokens=n, prefix_cache=False,
                               max_draft=None if arm.mode == "baseline" else arm.cap)

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    if engine.target.shapes is not None:  # the shapes every arm will use, compiled before any timing
        engine.warm_up(list(dict.fromkeys(a.mode for a in arms)), progress=warmup_progress,
                       tokens=tokens_for((len(ids) for ids in encoded), max_new_tokens))
    for arm in arms:  # warm-up: first-call allocations, kernel selection
        gen(arm, encoded[0], 8)
        tick(f"warm-up {arm.name}")

    results: dict[str, list[list["GenerationResult"]]] = {a.name: [[None] * len(prompts) for _ in range(trials)]
                                                         for a in arms}
    for trial in range(trials):
        for j, ids in enumerate(encoded):
            for arm in (arms[i] for i in arm_order(len(arms), trial, j, len(prompts))):
                r = gen(arm, ids, max_new_tokens)
                results[arm.name][trial][j] = r
                tick(f"{arm.name} {r.decode_tps:.1f} tok/s")

    reference = [r.token_ids for r in results["baseline"][0]]
    divergences = []
    for arm in arms:
        for trial in range(trials):
            for j, r in enumerate(results[arm.name][trial]):
                if arm.name == "baseline" and trial == 0:
                    continue
                bad = check_lossless(engine, encoded[j], reference[j], r.token_ids, arm.name, reanchors=PLAIN_REANCHORS)
                if bad is not None:
                    bad.update(trial=trial, prompt=j, cls=prompts[j][0])
                    divergences.append(bad)

    roof = RooflineModel.from_engine(engine, bandwidth)
    any_cal = next(iter(calibrations.values()), None)
    classes = sorted({c for c, _ in prompts}, key=[c for c, _ in prompts].index)
    base_tps = [_tps(results["baseline"][t]) for t in range(trials)]
    report_arms = {}
    for arm in arms:
        per_trial = results[arm.name]
        tps = [_tps(rs) for rs in per_trial]
        flat = [r for rs in per_trial for r in rs]
        context = statistics.mean(r.prompt_tokens + r.generated / 2 for r in flat)
        entry = {
            "mode": arm.mode, "cap": arm.cap if arm.cap is not None else flat[0].cap,
            "tok_s": statistics.median(tps), "tok_s_trials": tps,
            "ratio": statistics.median(t / b for t, b in zip(tps, base_tps) if b > 0) if any(base_tps) else None,
            "accept_per_round": _accept_per_round(flat),
            "tokens": sum(r.generated for r in per_trial[0]),
            "target_forwards": sum(r.target_forwards for r in per_trial[0]),
            "x_roofline": roof.fraction(statistics.median(tps), int(context)),
            "lossless": not any(d["arm"] == arm.name and is_mismatch(d) for d in divergences),
            "ties": sum(1 for d in divergences if d["arm"] == arm.name and not is_mismatch(d)),
            "classes": {},
        }
        # best of trials per prompt: contention only ever adds time, so the fastest run of each
        # prompt is the least noisy estimate of what the arm costs
        best_s = sum(min(per_trial[t][j].decode_s for t in range(trials)) for j in range(len(prompts)))
        best_base_s = sum(min(results["baseline"][t][j].decode_s for t in range(trials)) for j in range(len(prompts)))
        tokens = sum(max(0, r.generated - 1) for r in per_trial[0])
        entry["best_tok_s"] = tokens / best_s if best_s > 0 else 0.0
        base_tokens = sum(max(0, r.generated - 1) for r in results["baseline"][0])
        entry["best_ratio"] = entry["best_tok_s"] / (base_tokens / best_base_s) if best_base_s > 0 else None
        cal = calibrations.get(arm.mode, any_cal)
        if cal is not None:  # the same rounds priced by the cost model (noise-free)
            model = [_model_tps(cal, rs) for rs in per_trial]
            model_base = [_model_tps(cal, rs) for rs in results["baseline"]]
            entry["model_tok_s"] = statistics.median(model)
            entry["model_ratio"] = statistics.median(a / b for a, b in zip(model, model_base))
        for cls in classes:
            idx = [j for j, (c, _) in enumerate(prompts) if c == cls]
            c_tps = [_tps([per_trial[t][j] for j in idx]) for t in range(trials)]
            b_tps = [_tps([results["baseline"][t][j] for j in idx]) for t in range(trials)]
            entry["classes"][cls] = {
                "tok_s": statistics.median(c_tps),
                "ratio": statistics.median(a / b for a, b in zip(c_tps, b_tps) if b > 0) if any(b_tps) else None,
                "accept_per_round": _accept_per_round([per_trial[t][j] for t in range(trials) for j in idx]),
            }
        report_arms[arm.name] = entry

    mean_context = int(statistics.mean(len(ids) + max_new_tokens / 2 for ids in encoded))
    return {
        **stamp(engine),
        "trials": trials, "max_new_tokens": max_new_tokens,
        "prompts": [{"class": c, "prompt": (p[:80] if isinstance(p, str) else f"<{len(p)} token ids>"),
                     "prompt_tokens": len(ids)} for (c, p), ids in zip(prompts, encoded)],
        "arms": report_arms,
        "roofline": roof.summary(mean_context, report_arms["baseline"]["tok_s"]),
        # the whole calibration (cost curves, the confidence cut it picked): what `auto` and the cut ran on
        "calibrations": {m: {**c.to_dict(), "default_cap": _static(c)} for m, c in calibrations.items()},
        "lossless": not any(is_mismatch(d) for d in divergences),
        "divergences": divergences,
        **({"runs": {a.name: [[run_trace(r) for r in rs] for rs in results[a.name]] for a in arms}} if trace else {}),
    }


def run_trace(result: "GenerationResult") -> dict:
    """One run, compactly: decode seconds, and per round after the prefill's token its cap,
    drafts, accepted drafts and end time in ms since decoding began (plain runs collapsed to
    [0, steps, 0, end ms])."""
    rows: list[list[float]] = []
    t_first = result.token_times[0] if result.token_times else 0.0
    done = 1
    for (drafted, accepted), cap in list(zip(result.rounds, result.caps))[1:]:
        done += accepted + 1 if cap else 1
        end = round(1000.0 * (result.token_times[min(done, len(result.token_times)) - 1] - t_first), 2) \
            if result.token_times else 0.0
        if cap == 0 and rows and rows[-1][0] == 0:
            rows[-1][1] += 1
            rows[-1][3] = end
        else:
            rows.append([cap, drafted if cap else 1, accepted, end])
    return {"decode_s": round(result.decode_s, 4), "tokens": result.generated, "rounds": rows}


def lossless_label(arm: dict) -> str:
    """'yes', 'yes, N ties' (every divergence a near-tie proven by its margin) or 'NO'."""
    if not arm["lossless"]:
        return "NO"
    ties = arm.get("ties", 0)
    return f"yes, {ties} tie{'s' if ties != 1 else ''}" if ties else "yes"


def divergence_line(d: dict, where: str) -> str:
    """One divergence of the lossless check, for a report's text: which arm, ``where`` (the
    prompt, trial ...), both tokens and the target's own top-2 margin there."""
    kind = divergence_kind(d)
    return (f"divergence ({kind}): {d['arm']} {where} at token {d['index']}: baseline {d['baseline_token']} vs "
            f"{d['arm_token']}; margin {d['margin']:.3g}")


def conversation(engine: "Engine", turns: Turns, max_new_tokens: int) -> list[dict] | str:
    """Chat messages for the last of ``turns``: each earlier turn answered by the target's own
    greedy baseline (the same for every arm). Without a chat template: the turns as one text."""
    if not getattr(engine.tokenizer, "chat_template", None):
        return "\n\n".join(turns.turns)
    messages: list[dict] = []
    for turn in turns.turns[:-1]:
        messages.append({"role": "user", "content": turn})
        answer = engine.generate(messages, mode="baseline", max_new_tokens=max_new_tokens).text
        messages.append({"role": "assistant", "content": answer})
    return messages + [{"role": "user", "content": turns.turns[-1]}]


# ===================================================================== multi-turn (prefix cache)
def run_multi_turn(engine: "Engine", conversations: Sequence[Sequence[str]], modes: Sequence[str], *,
                   trials: int = 3, max_new_tokens: int = 128,
                   progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Later turns of each conversation with the prefix cache (warm: the turns before were just
    answered) and without it (cold: prefilled from token 0). Reports time to first token, the
    prompt tokens restored, and whether both gave the same tokens (the lossless check)."""
    if not getattr(engine.tokenizer, "chat_template", None):
        raise TandemError(f"--multi-turn needs a chat model: {engine.name} has no chat template")
    if engine.prefix_cache is None:
        raise TandemError("--multi-turn compares runs with and without the prefix cache: drop --no-prefix-cache")
    if trials < 1 or max_new_tokens < 2:
        raise TandemError("benchmark needs --trials >= 1 and --max-new-tokens >= 2")
    total = len(modes) * len(conversations) * trials
    done = 0
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    divergences = []
    for trial in range(trials):
        for mode in modes:
            for j, turns in enumerate(conversations):
                engine.clear_prefix_cache()
                messages: list[dict] = []
                for t, text in enumerate(turns):
                    messages.append({"role": "user", "content": text})
                    ids = engine.encode(messages)
                    if t == 0:
                        answer = engine.generate(ids, mode=mode, max_new_tokens=max_new_tokens)
                    else:  # alternate which runs first: a busy machine slows both alike
                        order = (True, False) if (trial + j) % 2 == 0 else (False, True)
                        got = {use: engine.generate(ids, mode=mode, max_new_tokens=max_new_tokens, prefix_cache=use)
                               for use in order}
                        warm, cold = got[True], got[False]
                        runs[mode].append({"conversation": j, "turn": t + 1, "trial": trial, "prompt_tokens": len(ids),
                                           "cached_tokens": warm.cached_tokens, "ttft_warm_s": warm.ttft_s,
                                           "ttft_cold_s": cold.ttft_s, "same": warm.token_ids == cold.token_ids})
                        bad = check_lossless(engine, ids, cold.token_ids, warm.token_ids, mode)
                        if bad is not None:
                            bad.update(trial=trial, prompt=j, cls=f"turn {t + 1}")
                            divergences.append(bad)
                        answer = warm
                    messages.append({"role": "assistant", "content": answer.text})
                done += 1
                if progress is not None:
                    progress(done, total, f"{mode} conversation {j}")
    arms = {}
    for mode, rs in runs.items():
        arms[mode] = {
            "ttft_cold_s": statistics.median(r["ttft_cold_s"] for r in rs),
            "ttft_warm_s": statistics.median(r["ttft_warm_s"] for r in rs),
            "ratio": statistics.median(r["ttft_warm_s"] / r["ttft_cold_s"] for r in rs if r["ttft_cold_s"] > 0),
            "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rs),
            "cached_tokens": statistics.median(r["cached_tokens"] for r in rs),
            "lossless": not any(d["arm"] == mode for d in divergences), "runs": rs,
        }
    return {**stamp(engine), "trials": trials, "max_new_tokens": max_new_tokens, "conversations": len(conversations),
            "arms": arms, "lossless": not divergences, "divergences": divergences}


def format_multi_turn(report: dict) -> str:
    lines = [f"{report['model']} on {report['device']} ({report['backend']}, MLX {report['mlx']}) | "
             f"{report['conversations']} conversations x {report['trials']} trials, later turns, "
             f"{report['max_new_tokens']} new tokens",
             f"{'mode':<12}{'prompt tok':>11}{'cached':>8}{'TTFT cold':>11}{'TTFT warm':>11}{'warm/cold':>11}  lossless"]
    for mode, a in report["arms"].items():
        lines.append(f"{mode:<12}{a['prompt_tokens']:>11.0f}{a['cached_tokens']:>8.0f}{a['ttft_cold_s']:>10.3f}s"
                     f"{a['ttft_warm_s']:>10.3f}s{a['ratio']:>11.3f}  {'yes' if a['lossless'] else 'NO'}")
    lines.append("medians over runs; warm: the earlier turns restored from the prefix cache; cold: prefilled from token 0")
    for d in report["divergences"]:
        kind = divergence_kind(d)
        lines.append(f"divergence ({kind}): {d['arm']} conversation {d['prompt']} {d['cls']} trial {d['trial']} at token "
                     f"{d['index']}: cold {d['baseline_token']} vs warm {d['arm_token']}; margin {d['margin']:.3g}")
    return "\n".join(lines)


def _static(cal: Any) -> int:
    from engine.cost_model import static_cap

    return static_cap(cal)


def format_report(report: dict) -> str:
    classes = list(next(iter(report["arms"].values()))["classes"])
    head = f"{'arm':<14}{'tok/s':>8}{'x base':>8}{'best':>8}{'x base':>8}{'model':>8}{'x base':>8}{'acc/rnd':>9}{'x roof':>8}  " + "".join(
        f"{c + ' tok/s (x)':>20}" for c in classes) + "  lossless"
    graphs = (f", graph cache {report.get('cuda_graph_cache')}, verify matmuls {report.get('verify_matmuls')}"
              if report["backend"] == "cuda" else "")
    lines = [f"{report['model']} on {report['device']} ({report['backend']}, MLX {report['mlx']}, "
             f"{report['precision']}{graphs}) | {len(report['prompts'])} prompts x {report['trials']} trials, "
             f"{report['max_new_tokens']} new tokens", head]
    for name, a in report["arms"].items():
        per_class = "".join(f"{c['tok_s']:>12.1f} ({c['ratio']:.2f})" if c["ratio"] is not None else f"{c['tok_s']:>20.1f}"
                            for c in a["classes"].values())
        model = f"{a['model_tok_s']:8.1f}{a['model_ratio']:8.2f}" if "model_tok_s" in a else f"{'-':>8}{'-':>8}"
        lines.append(f"{name:<14}{a['tok_s']:8.1f}{a['ratio']:8.2f}{a['best_tok_s']:8.1f}{a['best_ratio']:8.2f}{model}{a['accept_per_round']:9.2f}{a['x_roofline']:8.2f}  "
                     f"{per_class}  {lossless_label(a)}")
    roof = report["roofline"]
    lines.append("tok/s: median over trials; best: each prompt's fastest trial (contention only adds time)")
    if NOISE_ARM in report["arms"]:
        ratios = [c["ratio"] for c in report["arms"][NOISE_ARM]["classes"].values() if c["ratio"] is not None]
        lines.append(f"{NOISE_ARM}: plain decoding again, as its own arm: its ratios ({min(ratios):.2f}-"
                     f"{max(ratios):.2f}) are this machine's noise floor")
    if any("model_tok_s" in a for a in report["arms"].values()):
        lines.append("model: the same rounds priced by this machine's calibrated cost curves (no timing noise)")
    lines.append(f"roofline: {roof['bytes_per_token'] / 1e6:.1f} MB/token at {roof['context']} tokens, "
                 f"{roof['bandwidth_gbs']:.1f} GB/s -> ceiling {roof['ceiling_tps']:.1f} tok/s; "
                 f"baseline reaches {roof.get('baseline_fraction', 0):.2f} of it")
    for d in report["divergences"]:
        kind = divergence_kind(d)
        lines.append(f"divergence ({kind}): {d['arm']} trial {d['trial']} prompt {d['prompt']} ({d['cls']}) at token "
                     f"{d['index']}: baseline {d['baseline_token']} vs {d['arm_token']}; clean re-run top-2 "
                     f"{d['top1']}/{d['top2']} margin {d['margin']:.3g}")
    if not report["divergences"]:
        lines.append("lossless: every arm reproduced baseline's tokens on every prompt and trial")
    elif report["lossless"]:
        lines.append("lossless: every divergence is a near-tie of the target's own logits (a flip within its float "
                     "rounding), not a wrong token")
    return "\n".join(lines)
