"""``tandem benchmark --context 512,2048,8192``: each mode's speed-up against the context length.

Agent and retrieval requests carry thousands of tokens before the question, and a forward's
cost grows with the K/V it reads (a verify's more than a plain step's: each of its rows reads
the whole context), so speculation's gain shrinks as the context grows. For each length N,
every prompt of the chosen suite gets a preamble of exactly N tokens of real text in its user
turn (``corpus.token_prefix``: the engine's own source for code prompts, the shipped Spec-Bench
articles for the rest), then the prompt as the task; the whole benchmark (``run_benchmark``:
arms interleaved, prefill excluded from decode tok/s, the lossless check) runs on those.
Reported: per arm and length, decode tok/s and the ratio to baseline, plus every per-length
report in full. ``--max-draft auto`` prices each round at the sequence's length
(``Calibration.at_context``), which is what this table checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine.benchmark import Arm, divergence_line, lossless_label, run_benchmark, stamp
from engine.corpus import token_prefix
from engine.errors import TandemError

if TYPE_CHECKING:
    from engine.generate import Engine

LEAD = "Here is some material to keep in mind, then a task.\n\n"
TASK = "\n\nTask: "
_SLOT = "\u2063PREAMBLE\u2063"  # where the preamble's ids go in the rendered chat turn
CODE_CLASSES = ("code",)  # classes whose preamble starts with source code, not prose


def parse_contexts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TandemError(f"--context takes token counts, comma-separated (e.g. 512,2048,8192); got '{text}'")
    if not values or any(v < 0 for v in values):
        raise TandemError(f"--context takes token counts >= 0, comma-separated; got '{text}'")
    return list(dict.fromkeys(values))


def check_single_turn(prompts: Sequence[tuple[str, Any]]) -> None:
    bad = next((cls for cls, p in prompts if not isinstance(p, str)), None)
    if bad is not None:
        raise TandemError(f"--context puts its preamble before single-turn text prompts; '{bad}' has other "
                          f"prompts: leave it out (--classes)")


def with_preamble(engine: "Engine", prompt: str, tokens: int, code_first: bool = False) -> list[int]:
    """``prompt``'s token ids with exactly ``tokens`` tokens of shipped text before it, in the
    same user turn (through the chat template when there is one): lead line, material, task."""
    tok = engine.tokenizer
    material = token_prefix(tok, tokens, code_first)
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": f"{LEAD}{_SLOT}{TASK}{prompt}"}],
                                       tokenize=False, add_generation_prompt=True)
        head, tail = text.split(_SLOT)
        return list(tok.encode(head, add_special_tokens=False)) + material + \
            list(tok.encode(tail, add_special_tokens=False))
    return list(tok.encode(LEAD)) + material + list(tok.encode(f"{TASK}{prompt}", add_special_tokens=False))


def run_context(engine: "Engine", prompts: Sequence[tuple[str, Any]], arms: Sequence[Arm], contexts: Sequence[int],
                *, trials: int = 3, max_new_tokens: int = 128, progress: Callable[[int, int, str], None] | None = None,
                **benchmark: Any) -> dict:
    """``run_benchmark`` once per context length on the prompts with that preamble; the report
    has each length's full report (``by_context``) and, per arm, its figures as lists in the
    order of ``contexts``."""
    if not contexts:
        raise TandemError("--context needs at least one length")
    check_single_turn(prompts)
    reports = []
    for k, n in enumerate(contexts):
        def step(done: int, total: int, label: str, k: int = k, n: int = n) -> None:
            if progress is not None:  # every length runs the same number of steps
                progress(k * total + done, total * len(contexts), f"{n} tokens: {label}")

        built = [(cls, with_preamble(engine, p, n, cls in CODE_CLASSES)) for cls, p in prompts]
        report = run_benchmark(engine, built, arms, trials=trials, max_new_tokens=max_new_tokens, progress=step,
                               **benchmark)
        report.update(context=n, prompts=[dict(p, prompt=text[:80]) for p, (_, text) in zip(report["prompts"], prompts)])
        reports.append(report)
    arms_out = {}
    for name, first in reports[0]["arms"].items():
        entries = [r["arms"][name] for r in reports]
        arms_out[name] = {"mode": first["mode"], "cap": first["cap"],
                          **{key: [e[key] for e in entries] for key in ("tok_s", "ratio", "best_ratio", "accept_per_round")},
                          "lossless": all(e["lossless"] for e in entries), "ties": sum(e["ties"] for e in entries)}
    divergences = [dict(d, context=r["context"]) for r in reports for d in r["divergences"]]
    shared = {**stamp(engine), "trials": trials, "max_new_tokens": max_new_tokens}
    return {**shared, "contexts": list(contexts), "prompts": reports[0]["prompts"], "arms": arms_out,
            "calibrations": reports[0]["calibrations"], "lossless": all(r["lossless"] for r in reports),
            "divergences": divergences,
            "by_context": [{k: v for k, v in r.items() if k not in shared and k != "calibrations"} for r in reports]}


def format_context(report: dict) -> str:
    contexts = report["contexts"]
    prompt_tokens = [round(sum(p["prompt_tokens"] for p in r["prompts"]) / len(r["prompts"]))
                     for r in report["by_context"]]
    lines = [f"{report['model']} on {report['device']} ({report['backend']}, MLX {report['mlx']}, "
             f"{report['precision']}) | {len(report['prompts'])} prompts x {report['trials']} trials, "
             f"{report['max_new_tokens']} new tokens, a preamble of N tokens before each prompt",
             f"{'arm':<14}" + "".join(f"{f'N={n} tok/s (x)':>22}" for n in contexts) + "  lossless",
             f"{'prompt tokens':<14}" + "".join(f"{t:>22}" for t in prompt_tokens)]
    for name, a in report["arms"].items():
        cells = "".join(f"{t:>15.1f} ({r:.2f})" if r is not None else f"{t:>15.1f}{'':7}"
                        for t, r in zip(a["tok_s"], a["ratio"]))
        lines.append(f"{name:<14}{cells}  {lossless_label(a)}")
    lines.append("decode tok/s, median over trials (prefill excluded); (x): ratio to baseline at the same length")
    lines += [divergence_line(d, f"at {d['context']} tokens, trial {d['trial']} prompt {d['prompt']} ({d['cls']})")
              for d in report["divergences"]]
    return "\n".join(lines)
