"""``tandem train-drafter``: the flags; the stages live in ``engine.train.pipeline``."""

from __future__ import annotations

import argparse

from engine import platform
from engine.train.config import TrainConfig
from engine.train.pipeline import STAGES, run_stages


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--model", default=None, help="target: HF repo id, mlx-lm folder, .gguf or built-in name (default: the starter)")
    p.add_argument("--out", required=True, help="work folder: data, checkpoint/, drafter/ (the result), log.jsonl, report.json")
    p.add_argument("--data", nargs="+", default=[], metavar="JSONL",
                   help="training prompt files (JSON lines with 'turns', 'prompt', 'messages' or 'text')")
    p.add_argument("--eval-data", nargs="+", default=[], metavar="JSONL", help="held-out prompt files (validation + report)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    g = p.add_argument_group("data")
    g.add_argument("--max-prompt-tokens", type=int, default=1024)
    g.add_argument("--max-new-tokens", type=int, default=512, help="answer length cap when generating")
    g.add_argument("--prompts-per-file", type=int, default=None, help="use at most this many prompts of each training file")
    g.add_argument("--eval-prompts-per-file", type=int, default=64)
    g.add_argument("--gen-batch", type=int, default=64, help="sequences decoded together")
    g.add_argument("--gen-time-limit", type=float, default=None,
                   help="seconds for the generate stage; what is not done by then is left out")
    g.add_argument("--self-prompts", type=int, default=0,
                   help="also train on N user turns sampled from the target itself, answered greedily")
    g.add_argument("--self-prompt-tokens", type=int, default=96, help="longest self-generated user turn")
    g.add_argument("--self-prompt-openings", default="none", metavar="none|builtin|FILE",
                   help="start self-prompts from these openings in turn (builtin: code- and chat-heavy requests; "
                        "FILE: one opening per line); none: the target writes the whole turn")
    g.add_argument("--samples-per-prompt", type=int, default=0,
                   help="also train on this many sampled answers per training prompt")
    g.add_argument("--sample-temperature", type=float, default=0.7)
    g = p.add_argument_group("drafter")
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--markov-rank", type=int, default=d.markov_rank)
    g.add_argument("--markov-head-type", choices=("vanilla", "gated", "rnn"), default=d.markov_head_type)
    g.add_argument("--intermediate-size", type=int, default=d.intermediate_size, help="drafter MLP width (0: the target's)")
    g.add_argument("--tap-layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated target layer ids (default: 5 evenly spaced from 1 to N-3)")
    g.add_argument("--mask-token-id", type=int, default=None)
    g.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="start from this exported DSpark drafter (folder or resources:...): its architecture and "
                        "weights, a fresh optimizer; e.g. more training on new answers for the shipped drafter")
    g.add_argument("--grow-layers", type=int, default=0, metavar="N",
                   help="with --init-from: add N layers on top that start as the identity (the drafter drafts as "
                        "before until training gives them a use): more depth without starting over")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {d.steps}, or what --time-limit allows)")
    g.add_argument("--batch-seqs", type=int, default=d.batch_seqs)
    g.add_argument("--anchors", type=int, default=d.anchors, help="blocks per sequence per step")
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip)
    g.add_argument("--gamma", type=float, default=d.gamma, help="position weight exp(-k/gamma)")
    g.add_argument("--max-len", type=int, default=d.max_len, help="tokens per training sequence (prompt + answer)")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--val-seqs", type=int, default=d.val_seqs, help="held-out answers used for validation")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    g.add_argument("--log-every", type=int, default=d.log_every)
    g.add_argument("--target-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the frozen target's compute dtype while training")
    g.add_argument("--time-limit", type=float, default=None,
                   help="seconds for this whole invocation; training stops (checkpointed) in time")
    g.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint in --out")
    g.add_argument("--extend", action="store_true",
                   help="continue a finished run: --steps more steps (or what --time-limit allows), the learning "
                        "rate restarting at half the peak")
    g.add_argument("--export-dir", default=None, help="where the drafter is written (default: OUT/drafter)")
    g.add_argument("--mirror", default=None, help="copy the drafter, logs and answers here at every checkpoint")
    g = p.add_argument_group("report")
    g.add_argument("--report-prompts", type=int, default=8, help="held-out prompts per file for the report")
    g.add_argument("--report-max-new-tokens", type=int, default=128)
    g.add_argument("--benchmark-trials", type=int, default=1, help="0 skips the speed benchmark")
    g.add_argument("--report-caps", default="none,auto",
                   help="draft caps benchmarked against baseline: integers, 'auto', 'none' (the default cap)")


def run(args: argparse.Namespace) -> int:
    platform.batch_defaults()  # before any GPU work
    return run_stages(args)
