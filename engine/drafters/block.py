"""Block drafters (DSpark and DFlash): the shared backbone, checkpoint loading and the
append-only context cache.

Both drafters read the target's hidden states at a few *tap layers*, project them with
``fc`` + ``hidden_norm`` into context rows, and run N Qwen3-style layers over one block
``[anchor, MASK, ...]``: queries come from the block rows only, keys/values are the context
rows followed by the block rows, RoPE is applied at absolute positions (context 0..p-1, block
p..p+B-1 where p is the anchor's position). The block sees the whole committed context and
itself bidirectionally (DFlash ``sliding_attention`` layers are causal and windowed).

* DSpark (DeepSpec ``Qwen3DSparkModel``): own ``embed_tokens``/``lm_head``, the anchor is
  prediction slot 0 (B drafts from B inputs), optional Markov head (vanilla / gated / rnn)
  and confidence head. See ``engine/drafters/dspark.py``.
* DFlash (z-lab ``DFlashDraftModel``, ``*-DFlash-b16``): no embedding or head of its own (it
  uses the target's), drafts from slots 1..B-1. See ``engine/drafters/dflash.py``.

The context cache holds one K/V row per committed token whose hidden state the target has
produced (``ids[:-1]``). ``commit`` appends the rows the target just committed; nothing is ever
rolled back, because the loop only hands over accepted rows. Each proposal writes the block's
K/V after the context and attends over both, without advancing the context offset.

Checkpoints load with strict key and shape checks in the real on-disk names
(``layers.0.self_attn.q_proj.weight``, ``fc.weight``, ``markov_head.markov_w1.weight``,
``confidence_head.proj.weight`` ...). Every incompatibility is refused, before use, with a
one-line ``TandemError`` naming it. A DSpark config.json with ``"use_target_embeddings": true``
(drafters from ``tandem train-drafter``) leaves ``embed_tokens``/``lm_head`` out of the
safetensors: they are frozen copies of the target's, so the loader takes them from the target.

Public API for building and saving DSpark drafters (used by training)::

    dspark_config(target_config: dict, *, num_layers: int = 1, block_size: int = 7,
                  markov_rank: int = 256, tap_layers: Sequence[int] | None = None,
                  mask_token_id: int, markov_head_type: str = "vanilla",
                  confidence_head: bool = True, confidence_head_with_markov: bool = True,
                  num_anchors: int = 512) -> dict
        The DeepSpec-style config: a copy of the target's config plus the drafter fields.
        ``tap_layers=None`` picks 5 ids evenly spaced from 1 to N-3 (z-lab's rule).

    new_dspark_model(target_config: dict, *, num_layers: int, block_size: int,
                     markov_rank: int, tap_layers: Sequence[int] | None, mask_token_id: int,
                     markov_head_type: str = "vanilla", confidence_head: bool = True,
                     confidence_head_with_markov: bool = True, seed: int | None = None,
                     target: Target | None = None) -> DSparkModel
        A fresh random float32 model; ``model.config`` holds its config dict. With
        ``target`` its ``embed_tokens``/``lm_head`` start as copies of the target's (as
        DeepSpec trains them, frozen).

    save_drafter(model, config: dict, out_dir, *, dtype: str | None = None) -> Path
        Writes ``config.json`` + ``model.safetensors`` (DeepSpec-native names, ``[out, in]``
        weights); ``dtype="bfloat16"`` casts floating weights on the way out.

    new_dflash_model(target_config: dict, *, num_layers=1, block_size=16, tap_layers=None,
                     mask_token_id, seed=None) -> DFlashModel   (z-lab layout, for tests)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.drafters.base import Drafter
from engine.errors import TandemError

if TYPE_CHECKING:
    from engine.generate import Engine
    from engine.target import Target

CONTEXT_CHUNK = 512  # prompt rows projected per eval in begin(): bounded memory
MAX_BLOCK = 64
QUANT_GROUP = 64
VALID_BITS = (2, 3, 4, 5, 6, 8)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Buffers some exporters write that carry no weights.
_IGNORED_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


# ----------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------
@dataclass
class BlockConfig:
    """What the engine needs from a drafter's config.json, validated."""

    kind: str  # "dspark" | "dflash"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    tap_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None
    attention_bias: bool = False
    num_target_layers: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None  # DFlash override of the per-layer rule
    tie_word_embeddings: bool = False
    # DSpark heads
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = False
    # DFlash output/input scaling (z-lab dflash_config extras)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DSpark: embed_tokens/lm_head are the target's (frozen copies in DeepSpec), so the
    # checkpoint leaves them out and the loader takes them from the target (tandem train-drafter)
    use_target_embeddings: bool = False
    # DSpark: token ids the head was restricted to (restrict_vocab); empty = the full vocabulary
    draft_vocab: tuple[int, ...] = field(default=(), repr=False)
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def logits_start(self) -> int:
        """First block slot that yields a draft: DSpark predicts from the anchor slot too."""
        return 0 if self.kind == "dspark" else 1

    @property
    def max_draft(self) -> int:
        return self.block_size - self.logits_start

    def layer_attention(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) for drafter layer i."""
        layer_type = self.layer_types[i] if self.layer_types else "full_attention"
        sliding = layer_type == "sliding_attention"
        if self.kind == "dflash":
            causal = sliding if self.is_causal is None else bool(self.is_causal)
        else:
            causal = False
        return causal, (self.sliding_window if sliding else None)


def _drafter_value(raw: dict, name: str, default: Any = None) -> Any:
    """z-lab reads DFlash fields from ``dflash_config`` first, then the top level."""
    sub = raw.get("dflash_config")
    if isinstance(sub, dict) and name in sub:
        return sub[name]
    return raw.get(name, default)


def checkpoint_kind(raw: dict, where: str = "drafter") -> str:
    """'dspark' or 'dflash' from a config.json, or a one-line refusal for formats we don't run."""
    archs = [str(a) for a in (raw.get("architectures") or [])]
    if "speculators_config" in raw or "draft_vocab_size" in raw:
        raise TandemError(f"{where}: reduced-vocabulary 'speculators' drafters are not supported")
    if any("eagle" in a.lower() for a in archs):
        raise TandemError(f"{where}: EAGLE drafters ({', '.join(archs)}) are not supported; use a DSpark or DFlash drafter")
    if isinstance(raw.get("dflash_config"), dict):
        sub = raw["dflash_config"]
        if any(k in sub or k in raw for k in ("selector_rank", "selector_top_k", "conv_kernel_size")):
            raise TandemError(f"{where}: DFlash 2 drafters (candidate selector, dynamic convolutions) are not supported")
        if int(raw.get("markov_rank", 0) or 0) > 0:
            raise TandemError(f"{where}: DFlash drafters with a Markov head are not supported")
        return "dflash"
    dspark = "markov_rank" in raw or "enable_confidence_head" in raw or any("dspark" in a.lower() for a in archs)
    if dspark:
        if str(raw.get("model_type", "")).startswith("gemma") or any("gemma" in a.lower() for a in archs):
            raise TandemError(f"{where}: Gemma-4 DSpark drafters (k_eq_v attention, sandwich norms) are not supported yet")
        return "dspark"
    raise TandemError(f"{where}: not a DSpark or DFlash checkpoint (config.json has neither 'dflash_config' nor 'markov_rank')")


def _int(raw: dict, name: str, where: str, value: Any = None, required: bool = True) -> int | None:
    v = raw.get(name) if value is None else value
    if v is None:
        if required:
            raise TandemError(f"{where}: config.json is missing '{name}'")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise TandemError(f"{where}: config.json '{name}' must be an integer, got {v!r}")
    return int(v)


def parse_config(raw: dict, where: str = "drafter") -> BlockConfig:
    """Validate a DSpark/DFlash config.json (architecture fields only; the target checks come
    from ``check_compatible``)."""
    kind = checkpoint_kind(raw, where)
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise TandemError(f"{where}: hidden_act '{act}' is not supported (Qwen3-style drafters use silu)")
    hidden = _int(raw, "hidden_size", where)
    heads = _int(raw, "num_attention_heads", where)
    if heads <= 0 or hidden <= 0:
        raise TandemError(f"{where}: hidden_size and num_attention_heads must be positive")
    kv_heads = _int(raw, "num_key_value_heads", where, required=False) or heads
    head_dim = _int(raw, "head_dim", where, required=False) or hidden // heads
    if heads % kv_heads:
        raise TandemError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    layers = _int(raw, "num_hidden_layers", where)
    if layers <= 0:
        raise TandemError(f"{where}: num_hidden_layers must be positive, got {layers}")
    block = _int(raw, "block_size", where, value=_drafter_value(raw, "block_size", 16 if kind == "dflash" else None))
    need = 2 if kind == "dflash" else 1
    if not need <= block <= MAX_BLOCK:
        raise TandemError(f"{where}: bad block size {block} (a {kind} block holds {need}..{MAX_BLOCK} slots)")
    mask = _int(raw, "mask_token_id", where, value=_drafter_value(raw, "mask_token_id"))
    taps = _drafter_value(raw, "target_layer_ids")
    if not isinstance(taps, (list, tuple)) or not taps or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps):
        raise TandemError(f"{where}: config.json needs 'target_layer_ids', a non-empty list of layer ids, got {taps!r}")
    layer_types = tuple(raw.get("layer_types") or ())
    if layer_types and len(layer_types) != layers:
        raise TandemError(f"{where}: layer_types has {len(layer_types)} entries for {layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise TandemError(f"{where}: unsupported layer types {unknown}")
    window = raw.get("sliding_window")
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        raise TandemError(f"{where}: sliding_attention layers need a positive 'sliding_window', got {window!r}")
    cfg = BlockConfig(
        kind=kind, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=_int(raw, "intermediate_size", where), vocab_size=_int(raw, "vocab_size", where),
        block_size=block, mask_token_id=mask, tap_layers=tuple(int(t) for t in taps),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(raw.get("rope_theta", 1_000_000.0)),
        rope_scaling=raw.get("rope_scaling"), max_position_embeddings=raw.get("max_position_embeddings"),
        attention_bias=bool(raw.get("attention_bias", False)),
        num_target_layers=_int(raw, "num_target_layers", where, required=False),
        layer_types=layer_types, sliding_window=window if isinstance(window, int) else None,
        is_causal=_drafter_value(raw, "is_causal"), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        raw=raw,
    )
    if kind == "dspark":
        cfg.markov_rank = _int(raw, "markov_rank", where, required=False) or 0
        if cfg.markov_rank < 0:
            raise TandemError(f"{where}: markov_rank must be >= 0, got {cfg.markov_rank}")
        cfg.markov_head_type = str(raw.get("markov_head_type", "vanilla")).lower()
        if cfg.markov_rank and cfg.markov_head_type not in ("vanilla", "gated", "rnn"):
            raise TandemError(f"{where}: unknown markov_head_type '{cfg.markov_head_type}' (vanilla, gated or rnn)")
        cfg.confidence_head = bool(raw.get("enable_confidence_head", False))
        cfg.confidence_head_with_markov = cfg.confidence_head and bool(raw.get("confidence_head_with_markov", False))
        if cfg.confidence_head_with_markov and not cfg.markov_rank:
            raise TandemError(f"{where}: confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        cfg.use_target_embeddings = bool(raw.get("use_target_embeddings", False))
    else:
        cfg.input_embedding_scale = float(_drafter_value(raw, "input_embedding_scale", 1.0) or 1.0)
        cfg.output_multiplier = float(_drafter_value(raw, "output_multiplier", 1.0) or 1.0)
        cap = _drafter_value(raw, "final_logit_softcapping")
        cfg.final_logit_softcapping = float(cap) if cap else None
    return cfg


def target_hidden_size(target: "Target") -> int:
    """The target's residual width (a quantized embedding packs its weight columns)."""
    embed = getattr(target.trunk, "embed_tokens", None)
    if isinstance(embed, nn.QuantizedEmbedding):
        return int(embed.weight.shape[-1]) * 32 // int(embed.bits)
    return int(target.hidden_size)


def check_compatible(cfg: BlockConfig, target: "Target", where: str = "drafter") -> None:
    """Refuse a drafter made for another target, before anything runs."""
    hidden = target_hidden_size(target)
    if cfg.hidden_size != hidden:
        raise TandemError(f"{where}: hidden size mismatch: the drafter has {cfg.hidden_size}, {target.name} has {hidden}")
    if cfg.vocab_size != target.vocab_size:
        raise TandemError(f"{where}: vocab mismatch: the drafter has {cfg.vocab_size} tokens, {target.name} has {target.vocab_size}")
    n = target.num_layers
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        raise TandemError(f"{where}: made for a {cfg.num_target_layers}-layer target, {target.name} has {n} layers")
    taps = cfg.tap_layers
    if len(set(taps)) != len(taps):
        raise TandemError(f"{where}: tap layer ids {list(taps)} repeat a layer")
    if n - 1 in taps:
        raise TandemError(f"{where}: tap layer id {n - 1} is the final layer of {target.name}, which cannot be tapped")
    bad = [t for t in taps if not 0 <= t < n - 1]
    if bad:
        raise TandemError(f"{where}: tap layer ids {bad} out of range for {target.name} ({n} layers: 0..{n - 2} can be tapped)")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise TandemError(f"{where}: mask token id {cfg.mask_token_id} is outside the vocabulary (0..{cfg.vocab_size - 1})")


# ----------------------------------------------------------------------------------------
# Modules (attribute names are the checkpoint key names)
# ----------------------------------------------------------------------------------------
class ContextKV:
    """One layer's K/V for the committed context, in a buffer that grows in steps.

    ``append`` keeps rows (context); ``with_block`` writes the block's rows after them and
    returns views over both, leaving the offset where it was (the block is discarded)."""

    STEP = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _fit(self, need: int, k: mx.array, v: mx.array) -> None:
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        size = ((need + self.STEP - 1) // self.STEP) * self.STEP
        new_k = mx.zeros((1, k.shape[1], size, k.shape[3]), dtype=k.dtype)
        new_v = mx.zeros((1, v.shape[1], size, v.shape[3]), dtype=v.dtype)
        if self.keys is not None and self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def append(self, k: mx.array, v: mx.array) -> None:
        n = k.shape[2]
        self._fit(self.offset + n, k, v)
        self.keys[..., self.offset : self.offset + n, :] = k
        self.values[..., self.offset : self.offset + n, :] = v
        self.offset += n

    def with_block(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        n = k.shape[2]
        self._fit(self.offset + n, k, v)
        self.keys[..., self.offset : self.offset + n, :] = k
        self.values[..., self.offset : self.offset + n, :] = v
        end = self.offset + n
        return self.keys[..., :end, :], self.values[..., :end, :]

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


class Attention(nn.Module):
    def __init__(self, cfg: BlockConfig, index: int):
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(d, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)
        self.causal, self.window = cfg.layer_attention(index)

    def _kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        n = x.shape[1]
        k = self.k_norm(self.k_proj(x).reshape(1, n, self.n_kv, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(1, n, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def append_context(self, ctx: mx.array, kv: ContextKV) -> None:
        """K/V of new context rows (the same projected target states feed every layer)."""
        k, v = self._kv(ctx, kv.offset)
        kv.append(k, v)

    def __call__(self, x: mx.array, kv: ContextKV) -> mx.array:
        n = x.shape[1]
        p = kv.offset  # the anchor's absolute position
        q = self.q_norm(self.q_proj(x).reshape(1, n, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=p)
        k, v = self._kv(x, p)
        keys, values = kv.with_block(k, v)
        mask = None
        if self.causal or self.window:
            q_pos = mx.arange(p, p + n)[:, None]
            k_pos = mx.arange(p + n)[None, :]
            mask = mx.ones((n, p + n), dtype=mx.bool_)
            if self.causal:
                mask = mask & (k_pos <= q_pos)
            if self.window:
                mask = mask & (q_pos - k_pos < self.window)
                if not self.causal:
                    mask = mask & (k_pos - q_pos < self.window)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, n, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: BlockConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, index)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, kv: ContextKV) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockBackbone(nn.Module):
    """fc + hidden_norm over tapped target states, N layers, final norm."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.tap_layers) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def new_cache(self) -> list[ContextKV]:
        return [ContextKV() for _ in self.layers]

    def append_context(self, hidden: mx.array, caches: list[ContextKV]) -> None:
        """hidden [m, n_taps*H]: tapped target rows of newly committed tokens."""
        ctx = self.hidden_norm(self.fc(hidden[None]))
        for layer, kv in zip(self.layers, caches):
            layer.self_attn.append_context(ctx, kv)

    def block(self, x: mx.array, caches: list[ContextKV]) -> mx.array:
        """x [1, B, H] block embeddings -> final-normed block states [1, B, H]."""
        for layer, kv in zip(self.layers, caches):
            x = layer(x, kv)
        return self.norm(x)


class MarkovHead(nn.Module):
    """logits_k += W2 . f(W1[x_{k-1}], h_k, state): vanilla f = W1[x]; gated scales it by
    sigmoid(gate_proj([h; W1[x]])); rnn runs a GRU-like state over [s; W1[x]; h]."""

    def __init__(self, vocab: int, rank: int, hidden: int, kind: str):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def initial_state(self, dtype: mx.Dtype) -> mx.array | None:
        return mx.zeros((self.rank,), dtype=dtype) if self.kind == "rnn" else None

    def step(self, prev: mx.array, h: mx.array, state: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """Bias [V] for one slot given the previous token (scalar) and the slot's state h [H]."""
        e = self.markov_w1(prev.reshape(1))[0]  # (a quantized embedding wants an index array)
        if self.kind == "gated":
            e = mx.sigmoid(self.gate_proj(mx.concatenate([h, e]))) * e
        elif self.kind == "rnn":
            gate, cand, out = mx.split(self.joint_proj(mx.concatenate([state, e, h])), 3)
            gate = mx.sigmoid(gate)
            state = gate * state + (1.0 - gate) * mx.tanh(cand)
            e = mx.tanh(out)
        return self.markov_w2(e), state


class ConfidenceHead(nn.Module):
    def __init__(self, dims: int):
        super().__init__()
        self.proj = nn.Linear(dims, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(features)[..., 0])


class DSparkModel(BlockBackbone):
    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.markov_rank:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.hidden_size, cfg.markov_head_type)
        if cfg.confidence_head:
            extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(cfg.hidden_size + extra)

    def logits(self, h: mx.array) -> mx.array:
        """[..., V] logits, or [..., N] over ``cfg.draft_vocab`` once ``restrict_vocab`` ran."""
        if self.cfg.tie_word_embeddings and not self.cfg.draft_vocab:
            return self.embed_tokens.as_linear(h)
        return self.lm_head(h)


class DFlashModel(BlockBackbone):
    """z-lab layout: the backbone only; embedding and head are the target's."""


def build_model(cfg: BlockConfig) -> BlockBackbone:
    return DSparkModel(cfg) if cfg.kind == "dspark" else DFlashModel(cfg)


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape the model needs (lazy: nothing is allocated)."""
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


# ----------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------
from engine.paths import resources_dir  # noqa: E402  (re-exported: the registry and tests use it)


def resolve_drafter_path(spec: str) -> Path:
    """A local folder, ``resources:<relative path>`` (bundled), or a Hugging Face repo id
    already in the local HF cache. Never downloads."""
    text = str(spec).strip()
    if text.startswith("resources:"):
        p = resources_dir() / text.split(":", 1)[1]
        if not p.is_dir():
            raise TandemError(f"bundled drafter '{text}' is missing ({p})")
        return p
    p = Path(text).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise TandemError(f"drafter {p}: expected a checkpoint folder (config.json + model.safetensors), got a file")
    if _REPO_ID.match(text):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        try:
            return Path(snapshot_download(text, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
        except LocalEntryNotFoundError:
            raise TandemError(f"drafter '{text}' is not in the local Hugging Face cache; download it first (hf download {text})") from None
        except HFValidationError as e:
            raise TandemError(f"drafter '{text}' is not a valid Hugging Face repo id ({str(e).splitlines()[0]})") from None
        except Exception as e:  # incomplete snapshot, cache corruption
            raise TandemError(f"drafter '{text}' could not be read from the local Hugging Face cache ({type(e).__name__})") from None
    raise TandemError(f"drafter '{text}' not found: not a folder or a Hugging Face repo id")


def read_config(path: Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise TandemError(f"drafter {path}: config.json is missing")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise TandemError(f"drafter {file}: unreadable config.json ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise TandemError(f"drafter {file}: config.json is not a JSON object")
    return raw


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise TandemError(f"drafter {index}: unreadable shard index") from None
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise TandemError(f"drafter {path}: shard files missing: {', '.join(missing[:3])}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise TandemError(f"drafter {path}: model.safetensors is missing")


def read_weights(path: Path) -> dict[str, mx.array]:
    from engine.loading import check_safetensors

    weights: dict[str, mx.array] = {}
    for f in _weight_files(Path(path)):
        problem = check_safetensors(f)
        if problem:
            raise TandemError(f"drafter {f}: safetensors file is corrupt: {problem}")
        try:
            part = mx.load(str(f))
        except Exception as e:
            raise TandemError(f"drafter {f}: safetensors file is corrupt ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        weights.update(part)
    return {k: v for k, v in weights.items() if not _IGNORED_KEYS.search(k)}


def _names(keys: Sequence[str]) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return ", ".join(keys[:3]) + more


def check_weights(model: nn.Module, weights: dict[str, mx.array], where: str = "drafter",
                  skip: Sequence[str] = ()) -> None:
    """Every key the model needs (but ``skip``), nothing else, each with the right shape."""
    want = {k: v for k, v in expected_shapes(model).items() if k not in skip}
    missing = set(want) - set(weights)
    if missing:
        raise TandemError(f"{where}: required keys missing: {_names(missing)}")
    unexpected = set(weights) - set(want)
    if unexpected:
        raise TandemError(f"{where}: unexpected keys: {_names(unexpected)}")
    for k, shape in sorted(want.items()):
        got = tuple(weights[k].shape)
        if got != shape:
            raise TandemError(f"{where}: wrong shape for {k}: {list(got)} in the checkpoint, expected {list(shape)}")


DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(path: Path, vocab_size: int, where: str = "drafter") -> list[int] | None:
    """The token ids a drafter folder's ``draft_vocab.json`` lists (most frequent first), or
    None without one. A damaged file is refused, never half-used."""
    f = Path(path) / DRAFT_VOCAB_FILE
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TandemError(f"{where}: unreadable {DRAFT_VOCAB_FILE} ({type(e).__name__}: {str(e)[:80]})") from None
    ids = data.get("token_ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TandemError(f"{where}: {DRAFT_VOCAB_FILE} needs 'token_ids', a non-empty list of token ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TandemError(f"{where}: {DRAFT_VOCAB_FILE} lists token ids outside the vocabulary (0..{vocab_size - 1}): {bad[:5]}")
    if len(set(ids)) != len(ids):
        raise TandemError(f"{where}: {DRAFT_VOCAB_FILE} lists a token id more than once")
    return ids


def restrict_vocab(model: "DSparkModel", ids: Sequence[int]) -> None:
    """FR-Spec: keep only these rows of the drafter's head and Markov output, so a proposal
    reads len(ids) x H head weights instead of V x H. Drafts can then only be these tokens;
    what the target accepts is unchanged (the verify rule sees the q drafts came from)."""
    idx = mx.array([int(i) for i in ids], dtype=mx.uint32)
    full = model.embed_tokens.weight if model.cfg.tie_word_embeddings else model.lm_head.weight
    head = nn.Linear(model.cfg.hidden_size, len(ids), bias=False)
    head.weight = full[idx]
    model.lm_head = head
    markov = getattr(model, "markov_head", None)
    if markov is not None:
        w2 = nn.Linear(markov.rank, len(ids), bias=False)
        w2.weight = markov.markov_w2.weight[idx]
        markov.markov_w2 = w2
    model.cfg.draft_vocab = tuple(int(i) for i in ids)


def quantize_drafter(model: nn.Module, bits: int, group_size: int = QUANT_GROUP) -> nn.Module:
    """Quantize Linear/Embedding layers in place (not the 1-output confidence head, whose
    threshold decision wants full precision)."""

    def wanted(_path: str, m: nn.Module) -> bool:
        w = getattr(m, "weight", None)
        return hasattr(m, "to_quantized") and w is not None and w.shape[-1] % group_size == 0 and w.shape[0] > 1

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=wanted)
    return model


def drafter_bits(engine: "Engine") -> int | None:
    """Bits to quantize the drafter to, or None to keep it float. Quantized matmul is only
    fast on Metal/CUDA; on the CPU backend the drafter stays float32 (spec/models.md)."""
    from engine import platform

    bits = getattr(engine, "drafter_bits", None)
    if bits is not None and bits not in VALID_BITS and bits not in (0, 16, 32):
        raise TandemError(f"drafter bits must be one of {', '.join(map(str, VALID_BITS))} (or 16/32 for none), got {bits}")
    if platform.backend() not in ("metal", "cuda"):
        return None
    if bits is None:
        return 4
    return bits if bits in VALID_BITS else None


def _compute_dtype(target: "Target") -> mx.Dtype:
    from engine import platform

    if platform.prefers_dense_float32():
        return mx.float32
    embed = getattr(target.trunk, "embed_tokens", None)
    w = getattr(embed, "scales", None) if isinstance(embed, nn.QuantizedEmbedding) else getattr(embed, "weight", None)
    if w is not None and mx.issubdtype(w.dtype, mx.floating):
        return w.dtype
    return mx.bfloat16


def load_checkpoint(path: Path, target: "Target", *, mode: str | None = None, bits: int | None = None,
                    dtype: mx.Dtype | None = None, draft_vocab: int | None = None) -> tuple[BlockBackbone, BlockConfig]:
    """Read, check (config, target compatibility, keys, shapes) and load a drafter folder.

    ``draft_vocab`` (DSpark): None drafts from every token the folder's ``draft_vocab.json``
    lists (the full vocabulary without one), 0 from the full vocabulary, N from its first N."""
    where = f"drafter {path}"
    raw = read_config(path)
    cfg = parse_config(raw, where)
    if mode is not None and cfg.kind != mode:
        label = {"dspark": "DSpark", "dflash": "DFlash"}
        raise TandemError(f"{where} is a {label[cfg.kind]} checkpoint; use --mode {cfg.kind} (not --mode {mode})")
    check_compatible(cfg, target, where)
    weights = read_weights(path)
    model = build_model(cfg)
    shared = TARGET_EMBEDDING_KEYS if cfg.kind == "dspark" and cfg.use_target_embeddings else ()
    check_weights(model, weights, where, skip=shared)
    dtype = dtype or _compute_dtype(target)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    if shared:  # use_target_embeddings: the target's embedding and head, as at training
        copy_target_embeddings(model, target, dtype)
    model.load_weights(list(weights.items()), strict=not shared)
    if cfg.kind == "dspark" and draft_vocab != 0:
        if draft_vocab is not None and draft_vocab < 0:
            raise TandemError(f"draft vocabulary size must be >= 0 (0: the full vocabulary), got {draft_vocab}")
        ids = read_draft_vocab(path, cfg.vocab_size, where)
        if ids is not None:
            restrict_vocab(model, ids[:draft_vocab] if draft_vocab else ids)
    if bits:
        quantize_drafter(model, bits)
    model.eval()
    mx.eval(model.parameters())
    return model, cfg


# ----------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------
class BlockDrafter(Drafter):
    """Shared state for DSpark/DFlash: the append-only context cache and the block forward.
    Subclasses turn the block's states into draft tokens."""

    has_model = True

    def __init__(self, model: BlockBackbone, cfg: BlockConfig, target: "Target"):
        self.model = model
        self.cfg = cfg
        self.target = target
        self.tap_layers = cfg.tap_layers
        self.block_size = cfg.block_size
        self.max_draft = cfg.max_draft
        self.dtype = model.fc.weight.dtype if not isinstance(model.fc, nn.QuantizedLinear) else model.fc.scales.dtype
        self._caches: list[ContextKV] = model.new_cache()
        self.context_len = 0  # committed rows in the context cache

    # -- context ------------------------------------------------------------------------
    def _append(self, hidden: mx.array) -> None:
        self.model.append_context(hidden.astype(self.dtype), self._caches)
        self.context_len += int(hidden.shape[0])

    def _cache_state(self) -> list[mx.array]:
        return [a for kv in self._caches for a in kv.state]

    def begin(self, prompt_ids: Sequence[int], hidden: mx.array | None) -> None:
        if hidden is None:
            raise TandemError(f"{self.name}: the target produced no tapped hidden states")
        self._caches = self.model.new_cache()
        self.context_len = 0
        for start in range(0, int(hidden.shape[0]), CONTEXT_CHUNK):
            self._append(hidden[start : start + CONTEXT_CHUNK])
            mx.eval(self._cache_state())

    def commit(self, ids: Sequence[int], n_new: int, hidden: mx.array | None) -> None:
        # Rows for the previous anchor and the accepted drafts: context only ever grows.
        if hidden is None or hidden.shape[0] == 0:
            return
        self._append(hidden)
        mx.async_eval(self._cache_state())

    # -- block --------------------------------------------------------------------------
    def embed(self, ids: mx.array) -> mx.array:
        raise NotImplementedError

    def block_states(self, ids: Sequence[int]) -> mx.array:
        """Final-normed states [B, H] of the block [anchor, MASK...] at the anchor's position."""
        anchor_pos = len(ids) - 1
        if anchor_pos != self.context_len:
            raise RuntimeError(f"{self.name} drafter out of step: {self.context_len} context rows for an anchor at {anchor_pos}")
        block = mx.array([int(ids[-1])] + [self.cfg.mask_token_id] * (self.block_size - 1), dtype=mx.uint32)
        return self.model.block(self.embed(block)[None].astype(self.dtype), self._caches)[0]


def load_block_drafter(engine: "Engine", mode: str) -> Drafter:
    """The DSpark/DFlash drafter for ``engine``: its --drafter, else the registry's locally
    available drafter for this target, behind n-gram lookup when ``engine.lookup_first`` (or,
    left unset, the registry row) asks. Refuses, in one line, anything it cannot run exactly."""
    from engine import registry

    spec, row = engine.drafter_path, None
    if not spec:
        row = registry.usable_row(engine, mode)
        if row is None:
            raise TandemError(registry.missing_drafter_message(engine, mode))
        spec = row["drafter"]
    path = resolve_drafter_path(spec)
    model, cfg = load_checkpoint(path, engine.target, mode=mode, bits=drafter_bits(engine),
                                 draft_vocab=getattr(engine, "draft_vocab", None))
    drafter: Drafter
    if cfg.kind == "dspark":
        from engine.drafters.dspark import DSparkDrafter

        drafter = DSparkDrafter(model, cfg, engine.target,
                                confidence_threshold=lambda: getattr(engine, "confidence_threshold", None))
    else:
        from engine.drafters.dflash import DFlashDrafter

        drafter = DFlashDrafter(model, cfg, engine.target)
    lookup_first = getattr(engine, "lookup_first", None)
    if lookup_first is None:  # the registry row's measured choice for this pair
        lookup_first = bool(row and row.get("lookup_first"))
    if lookup_first:
        from engine.drafters.lookup_first import LookupFirst

        return LookupFirst(drafter)
    return drafter


# ----------------------------------------------------------------------------------------
# Building and saving (training, tests)
# ----------------------------------------------------------------------------------------
def default_tap_layers(num_target_layers: int, count: int = 5) -> list[int]:
    """z-lab's rule: ``count`` ids evenly spaced from 1 to N-3 (never the final layer)."""
    if num_target_layers < 3:
        raise TandemError(f"a {num_target_layers}-layer target has no layer a drafter can tap")
    start, end = 1, max(1, num_target_layers - 3)
    if count <= 1:
        return [min(num_target_layers // 2, num_target_layers - 2)]
    ids = [int(round(start + i * (end - start) / (count - 1))) for i in range(count)]
    return sorted(set(ids))


_TARGET_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")


def _base_config(target_config: dict, num_layers: int, tap_layers: Sequence[int] | None) -> tuple[dict, list[int]]:
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
               if k not in target_config]
    if missing:
        raise TandemError(f"target config lacks {', '.join(missing)}")
    n_target = int(target_config["num_hidden_layers"])
    taps = list(tap_layers) if tap_layers is not None else default_tap_layers(n_target)
    cfg = {k: target_config[k] for k in _TARGET_FIELDS if target_config.get(k) is not None}
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.update(model_type="qwen3", hidden_act="silu", attention_bias=False, num_hidden_layers=int(num_layers),
               num_target_layers=n_target, layer_types=["full_attention"] * int(num_layers), tie_word_embeddings=False)
    return cfg, taps


def dspark_config(target_config: dict, *, num_layers: int = 1, block_size: int = 7, markov_rank: int = 256,
                  tap_layers: Sequence[int] | None = None, mask_token_id: int, markov_head_type: str = "vanilla",
                  confidence_head: bool = True, confidence_head_with_markov: bool = True,
                  num_anchors: int = 512) -> dict:
    cfg, taps = _base_config(target_config, num_layers, tap_layers)
    cfg.update(architectures=["Qwen3DSparkModel"], block_size=int(block_size), target_layer_ids=taps,
               mask_token_id=int(mask_token_id), num_anchors=int(num_anchors), markov_rank=int(markov_rank),
               enable_confidence_head=bool(confidence_head))
    if markov_rank:
        cfg["markov_head_type"] = markov_head_type
    if confidence_head:
        cfg["confidence_head_with_markov"] = bool(confidence_head_with_markov and markov_rank)
    return cfg


def dflash_config(target_config: dict, *, num_layers: int = 1, block_size: int = 16,
                  tap_layers: Sequence[int] | None = None, mask_token_id: int) -> dict:
    cfg, taps = _base_config(target_config, num_layers, tap_layers)
    cfg.update(architectures=["DFlashDraftModel"], block_size=int(block_size),
               dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": taps})
    return cfg


def _init_random(model: nn.Module, seed: int | None) -> None:
    """Small normal weights, unit norms (a trainable start; mlx defaults are uniform)."""
    if seed is not None:
        mx.random.seed(seed)
    new = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight"):
            new[k] = mx.ones(v.shape, dtype=mx.float32)
        elif k.endswith(".bias"):
            new[k] = mx.zeros(v.shape, dtype=mx.float32)
        else:
            new[k] = 0.02 * mx.random.normal(v.shape, dtype=mx.float32)
    model.load_weights(list(new.items()))


TARGET_EMBEDDING_KEYS = ("embed_tokens.weight", "lm_head.weight")


def copy_target_embeddings(model: DSparkModel, target: "Target", dtype: mx.Dtype = mx.float32) -> None:
    """DSpark starts from (and DeepSpec freezes) the target's embedding and head."""
    embed = target.trunk.embed_tokens
    table = mx.dequantize(embed.weight, embed.scales, embed.biases, embed.group_size, embed.bits) \
        if isinstance(embed, nn.QuantizedEmbedding) else embed.weight
    head = getattr(target.model, "lm_head", None)
    tied = head is None or getattr(getattr(target.model, "args", None), "tie_word_embeddings", False)
    if tied:
        out = table
    elif isinstance(head, nn.QuantizedLinear):
        out = mx.dequantize(head.weight, head.scales, head.biases, head.group_size, head.bits)
    else:
        out = head.weight
    if tuple(table.shape) != tuple(model.embed_tokens.weight.shape) or tuple(out.shape) != tuple(model.lm_head.weight.shape):
        raise TandemError("target embedding/head shapes do not match the drafter's")
    model.embed_tokens.weight = table.astype(dtype)
    model.lm_head.weight = out.astype(dtype)


def new_dspark_model(target_config: dict, *, num_layers: int, block_size: int, markov_rank: int,
                     tap_layers: Sequence[int] | None, mask_token_id: int, markov_head_type: str = "vanilla",
                     confidence_head: bool = True, confidence_head_with_markov: bool = True,
                     seed: int | None = None, target: "Target | None" = None) -> DSparkModel:
    config = dspark_config(target_config, num_layers=num_layers, block_size=block_size, markov_rank=markov_rank,
                           tap_layers=tap_layers, mask_token_id=mask_token_id, markov_head_type=markov_head_type,
                           confidence_head=confidence_head, confidence_head_with_markov=confidence_head_with_markov)
    model = DSparkModel(parse_config(config, "new DSpark model"))
    _init_random(model, seed)
    if target is not None:
        copy_target_embeddings(model, target)
    mx.eval(model.parameters())
    model.config = config
    return model


def new_dflash_model(target_config: dict, *, num_layers: int = 1, block_size: int = 16,
                     tap_layers: Sequence[int] | None = None, mask_token_id: int, seed: int | None = None) -> DFlashModel:
    config = dflash_config(target_config, num_layers=num_layers, block_size=block_size, tap_layers=tap_layers,
                           mask_token_id=mask_token_id)
    model = DFlashModel(parse_config(config, "new DFlash model"))
    _init_random(model, seed)
    mx.eval(model.parameters())
    model.config = config
    return model


def save_drafter(model: nn.Module, config: dict, out_dir: str | Path, *, dtype: str | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the DeepSpec/z-lab on-disk format."""
    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
        raise TandemError("save the drafter before quantizing it: checkpoints hold float weights")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cast = getattr(mx, dtype) if dtype else None
    skip = TARGET_EMBEDDING_KEYS if config.get("use_target_embeddings") else ()
    weights = {k: (v.astype(cast) if cast is not None and mx.issubdtype(v.dtype, mx.floating) else v)
               for k, v in tree_flatten(model.parameters()) if k not in skip}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    saved = dict(config)
    saved["torch_dtype"] = dtype or str(next(iter(weights.values())).dtype).removeprefix("mlx.core.")
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
    return out
