"""``tandem train-drafter``: train a DSpark drafter for a target on this machine (MLX: Metal,
CUDA or CPU), in DeepSpec's recipe, and write it in DeepSpec's on-disk format.

Stages (each skipped when its output already exists in ``--out``, so a run resumes):

1. ``encode``: tokenize the prompt files with the target's chat template.
2. ``generate``: the target's own greedy answers (self-distillation), batched.
3. ``train``: the drafter learns the frozen target's next-token distributions from its tapped
   hidden states, both computed on the fly each step (nothing large is stored).
4. ``report``: acceptance per content class on held-out prompts through the real engine loop
   (``--mode dspark``, greedy) and the speed-up from ``engine.benchmark``.

Training follows DeepSpec's ``Qwen3DSparkModel.forward`` and ``dspark/loss.py``: per sequence,
``--anchors`` random answer positions p each get a block ``[x_p, MASK...]`` at positions
p..p+B-1; the block's queries see the context rows strictly before p (the target's tapped states
through ``fc`` + ``hidden_norm``) and their own block bidirectionally, exactly what the engine's
drafter sees at inference when p is the anchor. Slot k predicts x_{p+k+1}; its logits are
``lm_head(h_k) + W2·W1[x_{p+k}]`` (teacher-forced Markov head). Loss, with position weights
``exp(-k/gamma)``: ``ce·CE(label) + tv·‖p_d − p_t‖₁ + bce·BCE(c_k, c*_k)`` where
``c*_k = 1 − ½‖p_d − p_t‖₁`` (DeepSpec's ``l1_loss`` term is the full L1 distance, twice the TV
distance). ``embed_tokens`` and ``lm_head`` are copies of the target's and stay frozen.

The exported drafter sets ``use_target_embeddings: true`` in its config.json: the frozen
embedding and head are left out of ``model.safetensors`` (they are the target's, 2·V·H floats)
and the loader fills them from the target (``engine/drafters/block.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from engine.errors import TandemError
from engine.train_data import (Batch, Example, batch_at, batches_per_epoch, content_class, draft_vocabulary,
                               encode_prompts, load_examples, make_batch, save_examples, usable)

NEG = -1e9  # masked attention score (every block row always sees its own block, so no row is all-masked)


# ========================================================================================
# Configuration
# ========================================================================================
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


def default_mask_token(tokenizer: Any, vocab_size: int) -> int:
    """The tokenizer's mask token, else its highest-id added token outside the special set
    (SmolLM2: ``<empty_output>``, never produced in chat), else a special token that is not
    BOS/EOS/pad, else the last vocab id. The mask's embedding is the frozen target's, so any
    id the model does not emit in use will do."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    mid = getattr(tok, "mask_token_id", None)
    if isinstance(mid, int) and 0 <= mid < vocab_size:
        return mid
    reserved = {getattr(tok, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    reserved |= set(getattr(tokenizer, "eos_token_ids", None) or [])
    in_use = set(getattr(tok, "all_special_ids", None) or [])  # chat markers, EOS...
    try:
        added = set((tok.get_added_vocab() or {}).values())
    except Exception:
        added = set()
    for pool in (added - in_use, in_use):
        ids = [i for i in pool if i not in reserved and 0 <= i < vocab_size]
        if ids:
            return max(ids)
    return vocab_size - 1


def target_config_of(engine: Any) -> dict:
    """The target's HF-style config (the loaded config.json, else the mlx-lm model's args)."""
    loaded = getattr(engine, "loaded", None)
    if loaded is not None and getattr(loaded, "config", None):
        return dict(loaded.config)
    a = engine.model.args
    heads = a.num_attention_heads
    return {
        "model_type": a.model_type, "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": heads, "num_key_value_heads": getattr(a, "num_key_value_heads", None) or heads,
        "head_dim": getattr(a, "head_dim", None) or a.hidden_size // heads, "intermediate_size": a.intermediate_size,
        "vocab_size": a.vocab_size, "rms_norm_eps": a.rms_norm_eps, "rope_theta": getattr(a, "rope_theta", 10000.0),
        "rope_scaling": getattr(a, "rope_scaling", None),
        "max_position_embeddings": getattr(a, "max_position_embeddings", None) or 4096,
    }


def new_drafter(engine: Any, cfg: TrainConfig):
    """A fresh DSpark model shaped for ``engine``'s target, embedding/head copied from it and frozen."""
    from engine.drafters import block

    tconf = target_config_of(engine)
    if cfg.intermediate_size:
        tconf["intermediate_size"] = int(cfg.intermediate_size)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token(engine.tokenizer, engine.target.vocab_size)
    model = block.new_dspark_model(tconf, num_layers=cfg.layers, block_size=cfg.block_size, markov_rank=cfg.markov_rank,
                                   tap_layers=cfg.tap_layers, mask_token_id=mask, markov_head_type=cfg.markov_head_type,
                                   confidence_head=True, confidence_head_with_markov=cfg.markov_rank > 0,
                                   seed=cfg.seed, target=engine.target)
    model.config["num_anchors"] = cfg.anchors
    model.config["use_target_embeddings"] = True
    freeze_target_parts(model)
    return model


def freeze_target_parts(model: Any) -> None:
    model.embed_tokens.freeze()
    if hasattr(model, "lm_head"):
        model.lm_head.freeze()


# ========================================================================================
# Forward passes
# ========================================================================================
def target_states(target: Any, ids: Any, taps: Sequence[int]) -> tuple[Any, Any]:
    """Batched frozen-target forward over right-padded ``ids`` [S, T]: the tapped residual rows
    [S, T, n_taps*H] (decoder-layer outputs, as the engine's tap) and the final normed rows
    [S, T, H] (the head's input). Causal attention, so padding never reaches a real row."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    trunk = target.trunk
    h = trunk.embed_tokens(ids)
    mask = create_attention_mask(h, None)
    want = {int(t): None for t in taps}
    for i, layer in enumerate(trunk.layers):
        h = layer(h, mask, None)
        if i in want:
            want[i] = h
    feats = mx.concatenate([want[int(t)] for t in taps], axis=-1)
    return mx.stop_gradient(feats), mx.stop_gradient(trunk.norm(h))


def check_target_states(target: Any, taps: Sequence[int], ids: Sequence[int], tol: float = 2e-2) -> None:
    """Refuse to train when the batched forward does not reproduce the engine's own tap and
    logits for this architecture (it replicates embed -> layers -> norm). The tolerance only
    has to catch a structural difference (an embedding scale, a missing layer), which is O(1);
    GPU matmuls may run float32 in a reduced-precision mode, so it is not tight."""
    import mlx.core as mx

    target.set_taps(taps)
    seq = mx.array([[int(t) for t in ids]], dtype=mx.int32)
    logits, hidden = target.forward(seq, target.new_cache(), tap=True)
    target.forwards -= 1
    feats, final = target_states(target, seq, taps)
    mine = target.head(final)[0]
    scale = max(1.0, mx.abs(logits).max().item())
    d_logits = mx.abs(mine - logits).max().item() / scale
    d_feats = (mx.abs(feats[0] - hidden).max() / mx.maximum(mx.abs(hidden).max(), 1.0)).item()
    if not (d_logits <= tol and d_feats <= tol):
        raise TandemError(f"train-drafter: the batched target forward does not reproduce the engine's tap for "
                          f"{target.name} (logits off by {d_logits:.3g}, tapped states by {d_feats:.3g})")


def _block_attention(attn: Any, x: Any, ctx: Any, anchors: Any, ctx_visible: Any, A: int, B: int) -> Any:
    """Block self-attention of one drafter layer, for S sequences x A anchors at once.

    x [S, A*B, H] block rows (normed), ctx [S, T, H] projected context rows, anchors [S, A],
    ctx_visible [S, A, T] (key j visible to anchor a iff j < p_a). Same projections, norms,
    RoPE and scale as ``block.Attention`` at inference."""
    import mlx.core as mx

    S, _, _ = x.shape
    T = ctx.shape[1]
    nh, nkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    rep = nh // nkv
    offs = anchors.reshape(-1)  # RoPE offset of each block: its anchor's position

    q = attn.q_norm(attn.q_proj(x).reshape(S, A, B, nh, d)).transpose(0, 1, 3, 2, 4).reshape(S * A, nh, B, d)
    q = attn.rope(q, offset=offs).reshape(S, A, nkv, rep, B, d) * attn.scale
    kb = attn.k_norm(attn.k_proj(x).reshape(S, A, B, nkv, d)).transpose(0, 1, 3, 2, 4).reshape(S * A, nkv, B, d)
    kb = attn.rope(kb, offset=offs).reshape(S, A, nkv, 1, B, d)
    vb = attn.v_proj(x).reshape(S, A, B, nkv, d).transpose(0, 3, 1, 2, 4)[:, :, :, None]  # [S, nkv, A, 1, B, d]
    kc = attn.rope(attn.k_norm(attn.k_proj(ctx).reshape(S, T, nkv, d)).transpose(0, 2, 1, 3), offset=0)
    vc = attn.v_proj(ctx).reshape(S, T, nkv, d).transpose(0, 2, 1, 3)  # [S, nkv, T, d]

    qc = q.transpose(0, 2, 1, 3, 4, 5)  # [S, nkv, A, rep, B, d]
    sc = (qc.reshape(S, nkv, A * rep * B, d) @ kc.swapaxes(-1, -2)).reshape(S, nkv, A, rep, B, T)
    sc = mx.where(ctx_visible[:, None, :, None, None, :], sc, NEG)
    sb = (q @ kb.swapaxes(-1, -2)).transpose(0, 2, 1, 3, 4, 5)  # [S, nkv, A, rep, B, B]
    p = mx.softmax(mx.concatenate([sc, sb], axis=-1), axis=-1, precise=True)
    out = (p[..., :T].reshape(S, nkv, A * rep * B, T) @ vc).reshape(S, nkv, A, rep, B, d) + p[..., T:] @ vb
    out = out.transpose(0, 2, 4, 1, 3, 5).reshape(S, A * B, nh * d)  # head h = kv*rep + r, as SDPA's GQA
    return attn.o_proj(out)


def block_forward(model: Any, feats: Any, anchors: Any, block_ids: Any) -> Any:
    """Training forward of the DSpark backbone: final-normed block states [S, A, B, H].

    feats [S, T, n_taps*H] tapped target rows; anchors [S, A]; block_ids [S, A, B] =
    [x_p, MASK...] per anchor."""
    import mlx.core as mx

    S, T, _ = feats.shape
    _, A, B = block_ids.shape
    ctx = model.hidden_norm(model.fc(feats))
    x = model.embed_tokens(block_ids).reshape(S, A * B, -1)
    visible = mx.arange(T)[None, None, :] < anchors[:, :, None]
    for layer in model.layers:
        x = x + _block_attention(layer.self_attn, layer.input_layernorm(x), ctx, anchors, visible, A, B)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).reshape(S, A, B, -1)


def markov_bias(model: Any, prev: Any, h: Any) -> tuple[Any, Any]:
    """(bias [..., B, V], W1[prev] [..., B, r]) of the Markov head, teacher-forced on ``prev``
    [..., B] (the token before each slot); the same maths as ``MarkovHead.step`` slot by slot."""
    import mlx.core as mx

    head = model.markov_head
    e = head.markov_w1(prev)
    if head.kind == "vanilla":
        return head.markov_w2(e), e
    if head.kind == "gated":
        return head.markov_w2(mx.sigmoid(head.gate_proj(mx.concatenate([h, e], axis=-1))) * e), e
    state = mx.zeros(e.shape[:-2] + (head.rank,), dtype=e.dtype)  # rnn: unrolled over the block
    outs = []
    for k in range(e.shape[-2]):
        gate, cand, out = mx.split(head.joint_proj(mx.concatenate([state, e[..., k, :], h[..., k, :]], axis=-1)), 3, axis=-1)
        gate = mx.sigmoid(gate)
        state = gate * state + (1.0 - gate) * mx.tanh(cand)
        outs.append(mx.tanh(out))
    return head.markov_w2(mx.stack(outs, axis=-2)), e


def draft_outputs(model: Any, feats: Any, arrays: dict) -> tuple[Any, Any, Any]:
    """Drafter logits [S, A, B, V], confidence logits [S, A, B] (or None) and block states."""
    import mlx.core as mx

    h = block_forward(model, feats, arrays["anchors"], arrays["block_ids"])
    logits = model.logits(h)
    e = None
    if getattr(model, "markov_head", None) is not None:
        bias, e = markov_bias(model, arrays["prev"], h)
        logits = logits + bias
    conf = None
    if getattr(model, "confidence_head", None) is not None:
        f = mx.concatenate([h, e.astype(h.dtype)], axis=-1) if model.cfg.confidence_head_with_markov else h
        conf = model.confidence_head.proj(f)[..., 0]
    return logits, conf, h


def dspark_loss(model: Any, feats: Any, target_logits: Any, arrays: dict, cfg: TrainConfig) -> tuple[Any, dict]:
    """DeepSpec's DSpark loss and its metrics (see the module doc)."""
    import mlx.core as mx

    logits, conf, _ = draft_outputs(model, feats, arrays)
    S, A, B, V = logits.shape
    logits = logits.reshape(S, A * B, V).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p_d = mx.exp(logp)
    p_t = mx.stop_gradient(mx.softmax(target_logits.astype(mx.float32), axis=-1, precise=True))
    labels = arrays["labels"].reshape(S, A * B)
    valid = arrays["valid"].reshape(S, A * B).astype(mx.float32)
    w = valid * mx.tile(mx.exp(-mx.arange(B, dtype=mx.float32) / cfg.gamma), (A,))[None]
    den = w.sum() + 1e-6
    ce = -mx.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    l1 = mx.abs(p_d - p_t).sum(axis=-1)
    accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))  # c*: the probability this slot is accepted
    ce_loss, l1_loss = (ce * w).sum() / den, (l1 * w).sum() / den
    loss = cfg.ce_weight * ce_loss + cfg.tv_weight * l1_loss
    bce_loss = mx.array(0.0)
    if conf is not None:
        z = conf.reshape(S, A * B).astype(mx.float32)
        bce = mx.maximum(z, 0) - z * accept + mx.log1p(mx.exp(-mx.abs(z)))
        bce_loss = (bce * w).sum() / den
        loss = loss + cfg.bce_weight * bce_loss
    # Greedy acceptance, teacher-forced: slot k is accepted iff the drafter's argmax is the
    # target's argmax and every earlier slot was (the Markov input is then the true token).
    match = (mx.argmax(logits, axis=-1) == mx.argmax(target_logits, axis=-1)).astype(mx.float32) * valid
    full = valid.reshape(S, A, B)[..., -1]  # blocks whose B labels all exist
    run = mx.cumprod(match.reshape(S, A, B), axis=-1)
    tau = 1.0 + run.sum(axis=-1)  # tokens per round with the full block: accepted drafts + the bonus
    prob_run = mx.cumprod((accept * valid).reshape(S, A, B), axis=-1)
    metrics = {
        "loss": loss, "ce": ce_loss, "l1": l1_loss, "bce": bce_loss,
        "tau_sum": (tau * full).sum(axis=-1), "tau_prob_sum": ((1.0 + prob_run.sum(axis=-1)) * full).sum(axis=-1),
        "blocks": full.sum(axis=-1),  # per sequence [S], so metrics split by content class
        "acc_k": (match.reshape(S, A, B) * valid.reshape(S, A, B)).sum(axis=(0, 1)),
        "n_k": valid.reshape(S, A, B).sum(axis=(0, 1)),
    }
    return loss, metrics


def batch_arrays(batch: Batch, mask_token_id: int) -> dict:
    import mlx.core as mx

    S, A, B = batch.labels.shape
    block = np.full((S, A, B), mask_token_id, dtype=np.int32)
    block[:, :, 0] = np.take_along_axis(batch.ids, batch.anchors, axis=1)
    return {"ids": mx.array(batch.ids), "anchors": mx.array(batch.anchors), "block_ids": mx.array(block),
            "labels": mx.array(batch.labels), "prev": mx.array(batch.prev), "valid": mx.array(batch.valid),
            "rows": mx.array(batch.rows.reshape(S, A * B))}


def target_side(target: Any, arrays: dict, taps: Sequence[int]) -> tuple[Any, Any]:
    """Tapped features [S, T, nH] and the target's logits at each slot's row [S, A*B, V]."""
    import mlx.core as mx

    feats, final = target_states(target, arrays["ids"], taps)
    rows = arrays["rows"]
    picked = mx.take_along_axis(final, rows[..., None], axis=1)
    return feats, mx.stop_gradient(target.head(picked))


# ========================================================================================
# Trainer
# ========================================================================================
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


@dataclass
class TrainState:
    step: int = 0
    total_steps: int = 0
    elapsed: float = 0.0  # training seconds over all sessions
    restart_step: int = 0  # where an --extend run restarted the schedule
    restart_lr: float | None = None
    history: list[dict] = field(default_factory=list)


class Trainer:
    """One drafter being trained: model, optimizer, data, checkpoints. ``out`` layout:
    ``checkpoint/`` (state.json, config.json, weights + optimizer state, float32) and
    ``drafter/`` (the exported DeepSpec-format drafter)."""

    def __init__(self, engine: Any, train: list[Example], val: list[Example], out: str | Path, cfg: TrainConfig,
                 *, log: Callable[[str], None] = print, export_dir: str | Path | None = None,
                 mirror: Callable[[], None] | None = None):
        import mlx.core as mx
        import mlx.nn as nn
        import mlx.optimizers as optim

        self.engine, self.target, self.cfg, self.log = engine, engine.target, cfg, log
        self.out = Path(out)
        self.ckpt = self.out / "checkpoint"
        self.export_dir = Path(export_dir) if export_dir else self.out / "drafter"
        self.mirror = mirror
        self.train = usable(train, block_size=cfg.block_size, max_len=cfg.max_len)
        self.val = _interleave(usable(val, block_size=cfg.block_size, max_len=cfg.max_len))[: cfg.val_seqs]
        if not self.train:
            raise TandemError("train-drafter: no usable training example (answers of at least 2 tokens)")
        self.lengths = [len(e.prompt) + len(e.answer) for e in self.train]
        eos = getattr(engine.tokenizer, "eos_token_ids", None) or []
        self.draft_vocab = draft_vocabulary(self.train, engine.target.vocab_size, always=sorted(int(e) for e in eos))
        self.state = TrainState(total_steps=cfg.steps)
        old = self.out / "checkpoint.old"
        if not self.ckpt.exists() and (old / "state.json").is_file():  # stopped while swapping checkpoints
            old.rename(self.ckpt)
        if (self.ckpt / "state.json").is_file():
            self.model = self._load_checkpoint()
        else:
            self.model = new_drafter(engine, cfg)
        self.taps = list(self.model.config["target_layer_ids"])
        self.mask_token_id = int(self.model.config["mask_token_id"])
        self.target.set_taps(self.taps)
        check_target_states(self.target, self.taps, self.train[0].ids[:64])
        self.optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
        self.optimizer.init(self.model.trainable_parameters())
        if self._opt_state is not None:
            from mlx.utils import tree_unflatten

            self.optimizer.state = tree_unflatten(list(self._opt_state.items()))
        self._loss_and_grad = nn.value_and_grad(self.model, lambda m, f, t, a: dspark_loss(m, f, t, a, cfg))
        mx.eval(self.model.parameters())

    # -- checkpoints --------------------------------------------------------------------
    _opt_state: dict | None = None

    def _load_checkpoint(self):
        import mlx.core as mx

        from engine.drafters import block

        state = json.loads((self.ckpt / "state.json").read_text())
        config = json.loads((self.ckpt / "config.json").read_text())
        model = block.DSparkModel(block.parse_config(config, f"checkpoint {self.ckpt}"))
        block.copy_target_embeddings(model, self.target)
        model.load_weights(list(mx.load(str(self.ckpt / "weights.safetensors")).items()), strict=False)
        model.config = config
        freeze_target_parts(model)
        self._opt_state = mx.load(str(self.ckpt / "optimizer.safetensors"))
        self.state = TrainState(**{k: v for k, v in state.items() if k in TrainState.__dataclass_fields__})
        if getattr(self.cfg, "_extend", False):  # more steps after a finished schedule: warm restart
            st = self.state
            st.restart_step, st.restart_lr = st.step, self.cfg.lr * 0.5
            st.total_steps = st.step + (self.cfg.steps if getattr(self.cfg, "_steps_given", False) else 10**9)
            self.log(f"extending from step {st.step}: learning rate restarts at {st.restart_lr:.2e}")
        elif self.cfg.steps != self.state.total_steps and getattr(self.cfg, "_steps_given", False):
            self.log(f"resume: total steps {self.state.total_steps} -> {self.cfg.steps}")
            self.state.total_steps = self.cfg.steps
        self.log(f"resumed from {self.ckpt} at step {self.state.step}/{self.state.total_steps}")
        return model

    def save_checkpoint(self) -> None:
        """Weights + optimizer + step, written to a temp folder and swapped in (an interrupted
        save leaves the previous checkpoint intact); then the exported drafter."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        tmp = self.out / "checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(self.model.trainable_parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        (tmp / "config.json").write_text(json.dumps(self.model.config, indent=2))
        (tmp / "state.json").write_text(json.dumps(self.state.__dict__))
        old = self.out / "checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if self.ckpt.exists():
            self.ckpt.rename(old)
        tmp.rename(self.ckpt)
        shutil.rmtree(old, ignore_errors=True)
        self.export()
        if self.mirror is not None:
            self.mirror()

    def export(self) -> Path:
        from engine.drafters import block

        config = dict(self.model.config)
        config["tandem"] = {"trained_by": "tandem train-drafter", "step": self.state.step,
                            "train_examples": len(self.train), "anchors": self.cfg.anchors,
                            "loss": "0.1*CE + 0.9*L1 + 1.0*BCE, exp(-k/4)"}
        tmp = self.export_dir.with_name(self.export_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        block.save_drafter(self.model, config, tmp, dtype=self.cfg.export_dtype)
        (tmp / block.DRAFT_VOCAB_FILE).write_text(json.dumps(self.draft_vocab) + "\n", encoding="utf-8")
        self.export_dir.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            f.replace(self.export_dir / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
        return self.export_dir

    # -- steps ----------------------------------------------------------------------------
    def _batch(self, examples: list[Example], rng: np.random.Generator) -> dict:
        b = make_batch(examples, block_size=self.cfg.block_size, num_anchors=self.cfg.anchors, rng=rng, pad_to=64)
        a = batch_arrays(b, self.mask_token_id)
        a["sources"] = b.sources
        return a

    def train_step(self) -> dict:
        import mlx.core as mx
        import mlx.optimizers as optim

        step = self.state.step
        idx = batch_at(self.lengths, self.cfg.batch_seqs, self.cfg.seed, step)
        arrays = self._batch([self.train[i] for i in idx], np.random.default_rng([self.cfg.seed, step, 7]))
        feats, tlogits = target_side(self.target, arrays, self.taps)
        (loss, metrics), grads = self._loss_and_grad(self.model, feats, tlogits, arrays)
        if self.cfg.grad_clip > 0:
            grads, gnorm = optim.clip_grad_norm(grads, self.cfg.grad_clip)
        else:
            gnorm = mx.array(0.0)
        self.optimizer.learning_rate = mx.array(self._lr(step), dtype=mx.float32)
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state, metrics, gnorm)
        self.state.step += 1
        out = _summarise(metrics)
        out["grad_norm"] = gnorm.item()
        return out

    def _lr(self, step: int) -> float:
        st = self.state
        return lr_at(step, st.total_steps, self.cfg, st.restart_step, st.restart_lr)

    def evaluate(self) -> dict:
        """Loss and teacher-forced greedy acceptance on the held-out answers, by content class
        (fixed anchors, so successive evaluations compare)."""
        import mlx.core as mx

        if not self.val:
            return {}
        rng = np.random.default_rng([self.cfg.seed, 99])
        tot: dict[str, list[float]] = {}
        sums = {"loss": 0.0, "ce": 0.0, "l1": 0.0, "bce": 0.0}
        nb = 0
        S = self.cfg.batch_seqs
        for i in range(0, len(self.val), S):
            exs = self.val[i : i + S]
            arrays = self._batch(exs, rng)
            feats, tlogits = target_side(self.target, arrays, self.taps)
            _, m = dspark_loss(self.model, feats, tlogits, arrays, self.cfg)
            mx.eval(m)
            for k in sums:
                sums[k] += m[k].item()
            nb += 1
            tau, blocks = np.array(m["tau_sum"]), np.array(m["blocks"])
            for s, src in enumerate(arrays["sources"]):
                t = tot.setdefault(content_class(src), [0.0, 0.0])
                t[0] += float(tau[s])
                t[1] += float(blocks[s])
        res = {f"val_{k}": v / nb for k, v in sums.items()}
        res.update({f"val_tau_{c}": t[0] / t[1] for c, t in sorted(tot.items()) if t[1] > 0})
        all_t = sum(t[0] for t in tot.values()), sum(t[1] for t in tot.values())
        if all_t[1]:
            res["val_tau"] = all_t[0] / all_t[1]
        return res

    def fit(self, *, deadline: float | None = None) -> TrainState:
        """Train to ``total_steps`` or until ``deadline`` (time.time()); checkpoints on the way
        and at the end. With a deadline and no explicit step count, the step count is fixed
        after a few timed steps so the learning-rate schedule ends when time does."""
        cfg, st = self.cfg, self.state
        self.log(f"training: {len(self.train)} sequences ({batches_per_epoch(len(self.train), cfg.batch_seqs)} "
                 f"batches/epoch), {len(self.val)} held out; drafter {cfg.layers} layers, block {cfg.block_size}, "
                 f"markov rank {cfg.markov_rank}, taps {self.taps}, mask {self.mask_token_id}; "
                 f"{_count(self.model)/1e6:.2f}M trainable parameters")
        t_start = time.time()
        t_last = time.time()
        last_ckpt = time.time()
        window: list[dict] = []
        fitted = not (deadline is not None and getattr(cfg, "_fit_steps_to_time", False))
        first = st.step
        while st.step < st.total_steps:
            if deadline is not None and time.time() >= deadline:
                self.log(f"time budget reached at step {st.step}")
                break
            t0 = time.time()
            m = self.train_step()
            dt = time.time() - t0
            st.elapsed += dt
            m["lr"] = self._lr(st.step - 1)
            window.append(m)
            if st.step == first + 3:
                t_start = time.time()  # the first steps include kernel compilation: time the next 8
            if not fitted and st.step >= first + 11 and deadline is not None:
                per = (time.time() - t_start) / 8
                fit = st.step + int(max(0.0, deadline - time.time()) / per * 0.93)  # evals, checkpoints
                st.total_steps = max(st.step + 1, min(st.total_steps, fit))
                fitted = True
                self.log(f"{per:.3f} s/step: planning {st.total_steps} steps for the time budget")
            if st.step % cfg.log_every == 0 or st.step == st.total_steps:
                avg = {k: float(np.mean([w[k] for w in window])) for k in window[0]}
                rate = len(window) / max(1e-9, time.time() - t_last)
                eta = (st.total_steps - st.step) / max(rate, 1e-9)
                self.log(f"step {st.step}/{st.total_steps} loss {avg['loss']:.4f} ce {avg['ce']:.3f} "
                         f"l1 {avg['l1']:.3f} bce {avg['bce']:.4f} tau {avg['tau']:.2f} "
                         f"acc0 {avg['acc_0']:.3f} lr {avg['lr']:.2e} | {rate:.2f} step/s eta {_hms(eta)}")
                st.history.append({"step": st.step, "t": round(st.elapsed, 1), **{k: round(v, 5) for k, v in avg.items()}})
                window, t_last = [], time.time()
            if cfg.eval_every and st.step % cfg.eval_every == 0 and st.step < st.total_steps:
                self._eval_and_log()
            if st.step % cfg.checkpoint_every == 0 or time.time() - last_ckpt > 120:
                self.save_checkpoint()
                last_ckpt = time.time()
        self._eval_and_log()
        self.save_checkpoint()
        return st

    def _eval_and_log(self) -> None:
        ev = self.evaluate()
        if ev:
            self.log("eval step {}: ".format(self.state.step) + " ".join(f"{k} {v:.4f}" for k, v in ev.items()))
            self.state.history.append({"step": self.state.step, **{k: round(v, 5) for k, v in ev.items()}})


def _interleave(examples: list[Example]) -> list[Example]:
    """Round-robin over prompt sets, so a held-out subset covers every content class."""
    groups: dict[str, list[Example]] = {}
    for ex in examples:
        groups.setdefault(ex.source, []).append(ex)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def _summarise(metrics: dict) -> dict:
    blocks = float(np.array(metrics["blocks"]).sum())
    out = {k: metrics[k].item() for k in ("loss", "ce", "l1", "bce")}
    out["tau"] = float(np.array(metrics["tau_sum"]).sum()) / blocks if blocks else 1.0
    out["tau_prob"] = float(np.array(metrics["tau_prob_sum"]).sum()) / blocks if blocks else 1.0
    acc, n = np.array(metrics["acc_k"]), np.array(metrics["n_k"])
    for k in range(len(acc)):
        out[f"acc_{k}"] = float(acc[k] / n[k]) if n[k] else 0.0
    return out


def _count(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.trainable_parameters()))


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# ========================================================================================
# Report: acceptance through the real engine loop, and the benchmark's speed-up
# ========================================================================================
def acceptance_report(engine: Any, prompts: Sequence[tuple[str, str]], *, max_new_tokens: int,
                      log: Callable[[str], None] = print) -> dict:
    """Mean tokens per verify round (accepted drafts + the target's own) per content class,
    greedy, full block (--mode dspark --max-draft 0), and whether every output equals plain
    greedy decoding."""
    per: dict[str, list[tuple[int, int]]] = {}
    mismatches = 0
    for i, (cls, text) in enumerate(prompts):
        r = engine.generate(text, mode="dspark", max_new_tokens=max_new_tokens, max_draft=0)
        b = engine.generate(text, mode="baseline", max_new_tokens=max_new_tokens)
        mismatches += r.token_ids != b.token_ids
        rounds = r.rounds[1:]
        per.setdefault(cls, []).append((sum(a for _, a in rounds) + len(rounds), len(rounds)))
        log(f"  [{i + 1}/{len(prompts)}] {cls}: {r.mean_accepted:.2f} tokens/round over {len(rounds)} rounds")
    out = {c: round(sum(t for t, _ in v) / max(1, sum(n for _, n in v)), 3) for c, v in per.items()}
    return {"tokens_per_round": out, "prompts": {c: len(v) for c, v in per.items()},
            "max_new_tokens": max_new_tokens, "identical_to_baseline": mismatches == 0, "mismatches": mismatches}


# ========================================================================================
# CLI
# ========================================================================================
STAGES = ("encode", "generate", "train", "report")


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


def run(args: argparse.Namespace) -> int:
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise TandemError(f"unknown stage(s) {', '.join(bad)}: choose from {', '.join(STAGES)}")
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
    1) and answered greedily, and ``--samples-per-prompt`` answers sampled at
    ``--sample-temperature`` to the training prompts. All of it is the target's own text."""
    from engine.train_data import decode_all

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
        queries = answer([before] * args.self_prompts, "self-prompts", temperature=1.0, max_new=args.self_prompt_tokens, seed=1)
        prompts = [before + q[:-1] + after for q in queries if q and q[-1] in eos and len(q) > 3]
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
    from engine.train_data import read_prompts, source_name

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
