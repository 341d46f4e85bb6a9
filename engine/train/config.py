"""Training settings for ``tandem train-drafter`` and the learning-rate schedule."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass
class TrainConfig:
    # architecture
    layers: int = 2
    block_size: int = 7
    markov_rank: int = 16
    markov_head_type: str = "vanilla"
    intermediate_size: int | None = 896  # None: the target's
    tap_layers: list[int] | None = None  # None: z-lab's rule (5 ids from 1 to N-3)
    mask_token_id: int | None = None  # None: the tokenizer's mask token, else its last special token
    init_from: str | None = None  # an exported drafter to start from (its architecture wins over the fields above)
    grow_layers: int = 0  # with init_from: layers added on top, starting as the identity
    # optimisation
    steps: int = 2000
    batch_seqs: int = 16
    anchors: int = 128
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float = 4.0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    bce_weight: float = 1.0
    max_len: int = 1536
    seed: int = 0
    # bookkeeping
    log_every: int = 10
    eval_every: int = 200
    checkpoint_every: int = 200
    val_seqs: int = 64
    export_dtype: str = "float16"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        cfg = cls()
        for name in cfg.__dataclass_fields__:
            v = getattr(args, name, None)
            if v is not None:
                setattr(cfg, name, v)
        return cfg


def lr_at(step: int, total: int, cfg: TrainConfig, restart_step: int = 0, restart_lr: float | None = None) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak. An extended run
    (``--extend``) decays again from ``restart_lr`` at ``restart_step`` (a warm restart)."""
    floor = cfg.lr * cfg.min_lr_ratio
    if restart_lr is not None:
        t = min(1.0, (step - restart_step) / max(1, total - restart_step))
        return floor + (restart_lr - floor) * 0.5 * (1 + math.cos(math.pi * t))
    warm = max(1, int(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
