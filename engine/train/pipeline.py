"""``tandem train-drafter``: train a DSpark drafter for a target on this machine (MLX: Metal,
CUDA or CPU), in DeepSpec's recipe, and write it in DeepSpec's on-disk format.

Stages (each skipped when its output already exists in ``--out``, so a run resumes):

1. ``encode``: tokenize the prompt files with the target's chat template.
2. ``generate``: the target's own greedy answers (self-distillation), batched.
3. ``train``: the drafter learns the frozen target's next-token distributions from its tapped
   hidden states, both computed on the fly each step (nothing large is stored).
4. ``report``: acceptance per content class on held-out prompts through the real engine loop
   (``--mode dspark``, greedy) and the speed-up from ``engine.benchmark``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from engine.errors import TandemError
from engine.train.config import TrainConfig
from engine.train.data import (Example, content_class, encode_prompts, load_examples, save_examples,
                               self_prompt_openings)
from engine.train.trainer import Trainer, acceptance_report

STAGES = ("encode", "generate", "train", "report")


def _log_to(path: Path) -> Callable[[str], None]:
    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    return log


def _load_target(args: argparse.Namespace):
    import mlx.core as mx

    from engine.generate import Engine
    from engine.loading import load_model

    loaded = load_model(args.model, dense=True)
    if args.target_dtype != "float32":
        loaded.model.set_dtype(getattr(mx, args.target_dtype))
    mx.eval(loaded.model.parameters())
    return Engine(loaded.model, loaded.tokenizer, name=loaded.name, loaded=loaded)


def run_stages(args: argparse.Namespace) -> int:
    """Run the stages ``args.stages`` names (see the module docstring); each skips work already done."""
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise TandemError(f"unknown stage(s) {', '.join(bad)}: choose from {', '.join(STAGES)}")
    if getattr(args, "grow_layers", 0) < 0:
        raise TandemError(f"--grow-layers must be 0 or more, not {args.grow_layers}")
    if getattr(args, "grow_layers", 0) and not getattr(args, "init_from", None):
        raise TandemError("--grow-layers adds layers to the drafter --init-from names: give --init-from too")
    t0 = time.time()
    deadline = t0 + args.time_limit if args.time_limit else None
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    log = _log_to(out / "train.log")
    if args.fresh:
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
    for f in args.data + args.eval_data:
        if not Path(f).is_file():
            raise TandemError(f"prompt file {f} not found")
    engine = _load_target(args)
    log(f"target {engine.name}: {engine.target.num_layers} layers, hidden {engine.target.hidden_size}, "
        f"vocab {engine.target.vocab_size}; backend {_backend()}")

    # 1. encode
    p_train, p_eval = data / "prompts-train.jsonl", data / "prompts-eval.jsonl"
    if "encode" in stages:
        for files, path, limit in ((args.data, p_train, args.prompts_per_file), (args.eval_data, p_eval, args.eval_prompts_per_file)):
            if path.is_file() or not files:
                continue
            exs = encode_prompts(files, engine.encode, max_prompt_tokens=args.max_prompt_tokens, limit_per_file=limit)
            save_examples(path, exs)
            log(f"encoded {len(exs)} prompts -> {path}")

    # 2. generate (the target's answers: greedy for every prompt, then the optional extras)
    a_train, a_eval, a_extra = data / "train.jsonl.gz", data / "eval.jsonl.gz", data / "extra.jsonl.gz"
    if "generate" in stages and not a_train.is_file():
        if not p_train.is_file():
            raise TandemError(f"no encoded prompts in {data}: run the encode stage with --data")
        generate_stage(engine, args, data, log)

    # 3. train
    cfg = TrainConfig.from_args(args)
    cfg._steps_given = args.steps is not None
    cfg._fit_steps_to_time = deadline is not None  # at most --steps, as many as the time allows
    if args.steps is None and deadline is not None:
        cfg.steps = 10**9
    cfg._extend = bool(args.extend)
    if args.intermediate_size == 0:
        cfg.intermediate_size = None
    mirror = _mirror(out, Path(args.mirror), log) if args.mirror else None
    if "train" in stages:
        if not a_train.is_file():
            raise TandemError(f"no answers in {data}: run the generate stage first")
        train_ex = load_examples(a_train) + (load_examples(a_extra) if a_extra.is_file() else [])
        trainer = Trainer(engine, train_ex, load_examples(a_eval) if a_eval.is_file() else [], out, cfg,
                          log=log, export_dir=args.export_dir, mirror=mirror)
        train_deadline = deadline - 30 if deadline else None  # room for the last eval + checkpoint
        state = trainer.fit(deadline=train_deadline)
        (out / "log.jsonl").write_text("".join(json.dumps(h) + "\n" for h in state.history))
        if mirror is not None:
            mirror()
        log(f"drafter written to {trainer.export_dir} (step {state.step}, {state.elapsed:.0f}s of training)")

    # 4. report
    if "report" in stages:
        report(engine, args, out, log)
    return 0


def chat_frame(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """Token ids before and after the user's text in the chat template (system prompt
    included), or None without a template: the frame of self-generated prompts."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\u2063TANDEM\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False)
    if text.count(marker) != 1:
        return None
    before, after = text.split(marker)
    enc = getattr(tokenizer, "_tokenizer", tokenizer)
    return list(enc.encode(before, add_special_tokens=False)), list(enc.encode(after, add_special_tokens=False))


def generate_stage(engine: Any, args: argparse.Namespace, data: Path, log: Callable[[str], None]) -> None:
    """Greedy answers to the training and held-out prompts, then, time permitting, the extras:
    ``--self-prompts`` user turns sampled from the target itself (its chat frame, temperature
    1, each started from the next of ``--self-prompt-openings``) and answered greedily, and
    ``--samples-per-prompt`` answers sampled at ``--sample-temperature`` to the training
    prompts. All of it is the target's own text."""
    from engine.train.data import decode_all

    train_ex = load_examples(data / "prompts-train.jsonl")
    p_eval = data / "prompts-eval.jsonl"
    eval_ex = load_examples(p_eval) if p_eval.is_file() else []
    deadline = time.time() + args.gen_time_limit if args.gen_time_limit else None
    eos = sorted(int(e) for e in (getattr(engine.tokenizer, "eos_token_ids", None) or []))
    t0 = time.time()

    def progress(what: str) -> Callable[[int, int, int], None]:
        t = time.time()
        return lambda done, total, tokens: log(f"generate {what}: {done}/{total}, {tokens} tokens, "
                                                f"{tokens / max(1e-9, time.time() - t):.0f} tok/s")

    def answer(prompts: list[list[int]], what: str, temperature: float = 0.0, max_new: int | None = None,
               seed: int = 0) -> list[list[int] | None]:
        return decode_all(engine.model, prompts, batch_size=args.gen_batch, deadline=deadline,
                          progress=progress(what), max_new_tokens=max_new or args.max_new_tokens, eos_ids=eos,
                          temperature=temperature, seed=args.seed * 1000 + seed)

    everything = eval_ex + train_ex
    for ex, ans in zip(everything, answer([e.prompt for e in everything], "greedy")):
        ex.answer = ans or []
    save_examples(data / "train.jsonl.gz", train_ex)
    if eval_ex:
        save_examples(data / "eval.jsonl.gz", eval_ex)
    log(f"greedy answers: {sum(len(e.answer) for e in everything)} tokens in {time.time() - t0:.0f}s")

    extra: list[Example] = []

    def save_extra() -> None:  # after every phase: a stopped run keeps what it finished
        if extra:
            save_examples(data / "extra.jsonl.gz", extra)
            log(f"extra answers so far: {len(extra)} sequences, {sum(len(e.answer) for e in extra)} tokens")

    frame = chat_frame(engine.tokenizer)
    if args.self_prompts and frame is None:
        log("self-prompts skipped: the target has no chat template")
    elif args.self_prompts:
        before, after = frame
        enc = getattr(engine.tokenizer, "_tokenizer", engine.tokenizer)
        openings = [before + list(enc.encode(o, add_special_tokens=False)) if o else before
                    for o in self_prompt_openings(getattr(args, "self_prompt_openings", "none"))]
        heads = [openings[i % len(openings)] for i in range(args.self_prompts)]
        queries = answer(heads, "self-prompts", temperature=1.0, max_new=args.self_prompt_tokens, seed=1)
        prompts = [h + q[:-1] + after for h, q in zip(heads, queries) if q and q[-1] in eos and len(q) > 3]
        for p, ans in zip(prompts, answer(prompts, "self-prompt answers", seed=2)):
            if ans:
                extra.append(Example("self", p, ans))
        save_extra()
    for k in range(args.samples_per_prompt):
        if deadline is not None and time.time() > deadline:
            break
        answers = answer([e.prompt for e in train_ex], f"samples {k + 1}/{args.samples_per_prompt}",
                         temperature=args.sample_temperature, seed=10 + k)
        extra += [Example(e.source, e.prompt, a) for e, a in zip(train_ex, answers) if a]
        save_extra()
    log(f"generate stage: {time.time() - t0:.0f}s")


def _backend() -> str:
    from engine import platform

    return platform.backend()


def _mirror(out: Path, dest: Path, log: Callable[[str], None]) -> Callable[[], None]:
    """Copy the small results (drafter, logs, answers) to ``dest``: on a device machine that is
    the folder that comes back even when the command is stopped at its time limit."""

    def copy() -> None:
        dest.mkdir(parents=True, exist_ok=True)
        for src in (out / "drafter" / "model.safetensors", out / "drafter" / "config.json",
                    out / "drafter" / "draft_vocab.json", out / "train.log",
                    out / "data" / "train.jsonl.gz", out / "data" / "eval.jsonl.gz", out / "log.jsonl"):
            if src.is_file():
                target = dest / (src.name if src.parent.name != "drafter" else f"drafter-{src.name}")
                if not target.exists() or target.stat().st_mtime < src.stat().st_mtime or src.suffix != ".gz":
                    shutil.copy2(src, target)

    return copy


def report(engine: Any, args: argparse.Namespace, out: Path, log: Callable[[str], None]) -> dict:
    """Acceptance per class on held-out prompts, then the benchmark's speed-up (CPU or GPU
    alike: whatever this machine is)."""
    from engine.train.data import read_prompts, source_name

    drafter = Path(args.export_dir) if args.export_dir else out / "drafter"
    if not (drafter / "config.json").is_file():
        raise TandemError(f"no drafter in {drafter}: run the train stage first")
    if not args.eval_data:
        raise TandemError("the report needs --eval-data (held-out prompt files)")
    engine.drafter_path = str(drafter)
    engine.target.clear_taps()
    if args.target_dtype != "float32" or _backend() == "cpu":
        from engine.loading import make_dense_float32

        make_dense_float32(engine.model)  # the engine's own dtype policy for the report
    prompts = [(content_class(source_name(f)), text) for f in args.eval_data
               for text in read_prompts(f, args.report_prompts)]
    log(f"report: acceptance on {len(prompts)} held-out prompts ({', '.join(source_name(f) for f in args.eval_data)})")
    res = {"drafter": str(drafter), "eval_data": [source_name(f) for f in args.eval_data]}
    res["acceptance"] = acceptance_report(engine, prompts, max_new_tokens=args.report_max_new_tokens, log=log)
    log("tokens per round (greedy, full block): " + ", ".join(f"{c} {v:.2f}" for c, v in res["acceptance"]["tokens_per_round"].items()))
    if args.benchmark_trials > 0:
        try:
            from engine.benchmark import make_arms, parse_caps, run_benchmark
        except ImportError:
            run_benchmark = None
        if run_benchmark is not None:
            caps = [None if c.strip() == "none" else parse_caps(c.strip())[0]
                    for c in args.report_caps.split(",") if c.strip()]
            arms = make_arms(["dspark"], caps)
            bench = run_benchmark(engine, prompts, arms, trials=args.benchmark_trials,
                                  max_new_tokens=args.report_max_new_tokens)
            res["benchmark"] = {name: {"tok_s": a["tok_s"], "ratio": a["ratio"], "accept_per_round": a["accept_per_round"],
                                       "lossless": a["lossless"],
                                       "classes": {c: {k: v[k] for k in ("tok_s", "ratio", "accept_per_round")}
                                                   for c, v in a["classes"].items()}}
                                for name, a in bench["arms"].items()}
            for name, a in res["benchmark"].items():
                log(f"benchmark {name}: {a['tok_s']:.1f} tok/s x{(a['ratio'] or 0):.2f} | " + ", ".join(
                    f"{c} x{(v['ratio'] or 0):.2f} ({v['accept_per_round']:.2f}/round)" for c, v in a["classes"].items()))
    (out / "report.json").write_text(json.dumps(res, indent=2) + "\n")
    log(f"report written to {out / 'report.json'}")
    return res
