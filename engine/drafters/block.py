"""Block drafters (DSpark and DFlash): config, the shared backbone and the drafter base class.

Both drafters read the target's hidden states at a few *tap layers*, project them with
``fc`` + ``hidden_norm`` into context rows, and run N Qwen3-style layers over one block
``[anchor, MASK, ...]``: queries come from the block rows only, keys/values are the context
rows followed by the block rows, RoPE is applied at absolute positions (context 0..p-1, block
p..p+B-1 where p is the anchor's position). The block sees the whole committed context and
itself bidirectionally. DFlash layers follow z-lab's reference: no layer is causal unless the
config's ``is_causal`` says so (the reference runs every layer with ``is_causal=False``), and a
``sliding_attention`` layer sees keys within ``sliding_window`` positions on either side, the
symmetric non-causal window flash-attention applies (the reference's sdpa path ignores the
window; the two agree whenever the context fits in it).

* DSpark (DeepSpec ``Qwen3DSparkModel``): own ``embed_tokens``/``lm_head``, the anchor is
  prediction slot 0 (B drafts from B inputs), optional Markov head (vanilla / gated / rnn)
  and confidence head. See ``engine/drafters/dspark.py``.
* DFlash (z-lab ``DFlashDraftModel``, ``*-DFlash-b16``): no embedding or head of its own (it
  uses the target's), drafts from slots 1..B-1. See ``engine/drafters/dflash.py``; DFlash 2
  (dynamic convolutions, candidate selector): ``engine/drafters/dflash2.py``.

The context cache holds one K/V row per committed token whose hidden state the target has
produced (``ids[:-1]``). ``commit`` appends the rows the target just committed; nothing is ever
rolled back, because the loop only hands over accepted rows. Each proposal writes the block's
K/V after the context and attends over both, without advancing the context offset.

Reading, checking, loading and saving checkpoints: ``engine/drafters/checkpoint.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3 import MLP

from engine.drafters.base import Drafter, DrafterState
from engine.errors import TandemError
from engine.shapes import capacity, capacity_mask, pieces

if TYPE_CHECKING:
    from engine.shapes import ShapePolicy
    from engine.target import Target

CONTEXT_CHUNK = 512  # prompt rows projected per eval in begin(): bounded memory
MAX_BLOCK = 64


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
    is_causal: bool | None = None  # DFlash: true makes every layer causal (z-lab's default: none is)
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
    # DFlash 2 (dflash_config): dynamic convolutions and the candidate selector; 0 = DFlash 1
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
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

    @property
    def dflash2(self) -> bool:
        return self.selector_top_k > 0

    def layer_attention(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) for drafter layer i: causal only when the config says so; a sliding
        layer's window is symmetric unless causal (see the module docstring)."""
        layer_type = self.layer_types[i] if self.layer_types else "full_attention"
        sliding = layer_type == "sliding_attention"
        causal = self.kind == "dflash" and bool(self.is_causal)
        return causal, (self.sliding_window if sliding else None)


def _drafter_value(raw: dict, name: str, default: Any = None) -> Any:
    """z-lab reads DFlash fields from ``dflash_config`` first, then the top level."""
    sub = raw.get("dflash_config")
    if isinstance(sub, dict) and name in sub:
        return sub[name]
    return raw.get(name, default)


def is_eagle3(raw: dict) -> bool:
    archs = [str(a).lower() for a in (raw.get("architectures") or [])]
    return raw.get("speculators_model_type") == "eagle3" or any("eagle3" in a for a in archs)


def is_mtp_sidecar(raw: dict) -> bool:
    return "mtp" in str(raw.get("model_type", "")).lower()


def checkpoint_kind(raw: dict, where: str = "drafter") -> str:
    """'dspark' or 'dflash' (DFlash 2 included) from a config.json, or a one-line refusal naming
    what the folder holds instead."""
    archs = [str(a) for a in (raw.get("architectures") or [])]
    if is_eagle3(raw):
        raise TandemError(f"{where} is an EAGLE-3 checkpoint; use --mode eagle3")
    if is_mtp_sidecar(raw):
        raise TandemError(f"{where} is an MTP head (sidecar); use --mode mtp")
    if "speculators_config" in raw or "speculators_model_type" in raw:
        kind = raw.get("speculators_model_type", "?")
        raise TandemError(f"{where}: the vLLM speculators '{kind}' packaging is not supported (EAGLE-3 is: --mode eagle3)")
    if any("eagle" in a.lower() for a in archs):
        raise TandemError(f"{where}: EAGLE-1/2 drafters ({', '.join(archs)}) are not supported; EAGLE-3 is (--mode eagle3)")
    if isinstance(raw.get("dflash_config"), dict):
        if _drafter_value(raw, "draft_window_size") is not None:
            raise TandemError(f"{where}: DFlash 'draft_window_size' is not supported")
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
        if _drafter_value(raw, "selector_top_k") is not None or _drafter_value(raw, "conv_kernel_size") is not None:
            _parse_dflash2(cfg, raw, where)
    return cfg


def _parse_dflash2(cfg: BlockConfig, raw: dict, where: str) -> None:
    """DFlash 2's selector and convolution sizes, checked against the backbone."""
    def positive(name: str) -> int:
        value = _int(raw, name, where, value=_drafter_value(raw, name))
        if value <= 0:
            raise TandemError(f"{where}: DFlash 2 '{name}' must be positive, got {value}")
        return value

    cfg.conv_kernel_size, cfg.conv_group_size = positive("conv_kernel_size"), positive("conv_group_size")
    cfg.selector_rank, cfg.selector_top_k = positive("selector_rank"), positive("selector_top_k")
    if cfg.hidden_size % cfg.conv_group_size:
        raise TandemError(f"{where}: conv_group_size {cfg.conv_group_size} does not divide hidden_size {cfg.hidden_size}")
    if cfg.selector_top_k > cfg.vocab_size:
        raise TandemError(f"{where}: selector_top_k {cfg.selector_top_k} is larger than the vocabulary")


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
    """One layer's K/V for the committed context, in a buffer that grows in ``step`` rows.

    ``append`` keeps rows (context); ``with_block`` writes the block's rows after them and
    returns keys/values over both, leaving the offset where it was (the block is discarded).
    ``stable``: hand attention the whole buffer (rows past the block are masked by the caller),
    so its shape changes once per ``step`` rows instead of every round (``engine/shapes.py``)."""

    def __init__(self, step: int = 256, stable: bool = False) -> None:
        self.step, self.stable = step, stable
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _fit(self, need: int, k: mx.array, v: mx.array) -> None:
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        size = capacity(need, self.step)
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
        if self.stable:
            return self.keys, self.values
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
        k, v = self._project_kv(x)
        return self.rope(k, offset=offset), v

    def _project_kv(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Keys (before rope) and values of x [rows, n, H], each [rows, kv heads, n, head dim]."""
        rows, n = x.shape[0], x.shape[1]
        k = self.k_norm(self.k_proj(x).reshape(rows, n, self.n_kv, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(rows, n, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        return k, v

    def mask(self, p: int, n: int, keys: int) -> mx.array | None:
        """Which of ``keys`` rows the block rows (positions p..p+n-1) see: the context and the
        block (causal and windowed for DFlash sliding layers), nothing past them. None: all."""
        if keys == p + n and not (self.causal or self.window):
            return None

        return capacity_mask(p, n, keys, self.window, self.causal)

    def append_context(self, ctx: mx.array, kv: ContextKV) -> None:
        """K/V of new context rows (the same projected target states feed every layer)."""
        k, v = self._kv(ctx, kv.offset)
        kv.append(k, v)

    def __call__(self, x: mx.array, kv: ContextKV | list[ContextKV]) -> mx.array:
        """The block of one sequence [1, n, H] over its context ``kv``, or the blocks of B
        sequences [B, n, H] over theirs (``kv`` a list): the projections run once over every row,
        attention per row (its own context length and anchor position)."""
        kvs = kv if isinstance(kv, list) else [kv]
        rows, n = x.shape[0], x.shape[1]
        q = self.q_norm(self.q_proj(x).reshape(rows, n, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        k, v = self._project_kv(x)
        out = []
        for b, kv in enumerate(kvs):
            p = kv.offset  # the anchor's absolute position
            keys, values = kv.with_block(self.rope(k[b : b + 1], offset=p), v[b : b + 1])
            out.append(mx.fast.scaled_dot_product_attention(self.rope(q[b : b + 1], offset=p), keys, values,
                                                             scale=self.scale, mask=self.mask(p, n, keys.shape[2])))
        out = out[0] if rows == 1 else mx.concatenate(out, axis=0)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(rows, n, -1))


class DecoderLayer(nn.Module):  # MLP: mlx-lm's SwiGLU, gate/up/down_proj as checkpoints name them
    def __init__(self, cfg: BlockConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, index)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, kv: ContextKV | list[ContextKV]) -> mx.array:
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

    def new_cache(self, policy: "ShapePolicy | None" = None) -> list[ContextKV]:
        if policy is None:
            return [ContextKV() for _ in self.layers]
        return [ContextKV(policy.step, stable=True) for _ in self.layers]

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

    def block_rows(self, x: mx.array, row_caches: Sequence[list[ContextKV]]) -> mx.array:
        """``block`` for R sequences at once: x [R, B, H], each row over its own context caches."""
        for i, layer in enumerate(self.layers):
            x = layer(x, [caches[i] for caches in row_caches])
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
        """Bias [V] for one slot given the previous token (scalar) and the slot's state h [H];
        for B sequences at once: prev [B], h [B, H], state [B, rank] -> bias [B, V]."""
        # (a quantized embedding wants an index array)
        e = self.markov_w1(prev.reshape(-1)).reshape(*prev.shape, self.rank)
        if self.kind == "gated":
            e = mx.sigmoid(self.gate_proj(mx.concatenate([h, e], axis=-1))) * e
        elif self.kind == "rnn":
            gate, cand, out = mx.split(self.joint_proj(mx.concatenate([state, e, h], axis=-1)), 3, axis=-1)
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
        self._caches: list[ContextKV] = model.new_cache(target.shapes)
        self.context_len = 0  # committed rows: in the context cache, then the pending ones
        self._pending: list[mx.array] = []  # committed rows not projected yet
        self._drafting = False  # a proposal came since the last commit (speculative rounds)

    # -- context ------------------------------------------------------------------------
    def _append(self, hidden: mx.array) -> None:
        self.model.append_context(hidden.astype(self.dtype), self._caches)

    def _cache_state(self) -> list[mx.array]:
        return [a for kv in self._caches for a in kv.state]

    def _flush(self) -> None:
        """Project the pending rows into the context cache, in bounded chunks."""
        if not self._pending:
            return
        rows = mx.concatenate(self._pending, axis=0) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        total = int(rows.shape[0])
        start = 0
        for size in pieces(total, self.target.shapes is not None, CONTEXT_CHUNK):
            self._append(rows[start : start + size])
            start += size
            if total > CONTEXT_CHUNK:
                mx.eval(self._cache_state())

    def begin(self, prompt_ids: Sequence[int], hidden: mx.array | None) -> None:
        if hidden is None:
            raise TandemError(f"{self.name}: the target produced no tapped hidden states")
        self._caches = self.model.new_cache(self.target.shapes)
        self._pending, self._drafting = [hidden], False
        self.context_len = int(hidden.shape[0])
        self._flush()
        mx.eval(self._cache_state())

    def state(self) -> DrafterState | None:
        """The context K/V rows per layer (views: a later write reallocates or copies the buffer)."""
        if not self.context_len:
            return None
        self._flush()  # rows committed during plain steps wait in _pending until needed
        n = self.context_len
        return DrafterState(n, [[kv.keys[..., :n, :], kv.values[..., :n, :]] for kv in self._caches])

    def resume(self, prompt_ids: Sequence[int], cached: int, state: DrafterState | None,
               hidden: mx.array | None) -> None:
        if not cached:
            self.begin(prompt_ids, hidden)
            return
        if state is None or state.tokens < cached:
            raise RuntimeError(f"{self.name} drafter: no stored context for the {cached} restored tokens")
        self._caches = self.model.new_cache(self.target.shapes)
        for kv, (keys, values) in zip(self._caches, state.tree):
            kv.append(keys[..., :cached, :], values[..., :cached, :])  # into a new buffer
        self._pending, self._drafting = ([] if hidden is None else [hidden]), False
        self.context_len = cached + (0 if hidden is None else int(hidden.shape[0]))
        self._flush()
        mx.eval(self._cache_state())

    def commit(self, ids: Sequence[int], n_new: int, hidden: mx.array | None) -> None:
        # Rows for the previous anchor and the accepted drafts: context only ever grows. Between
        # proposals (speculative rounds) they are projected now, overlapping the loop's own work;
        # during plain steps they wait until the next proposal needs them, as one batch.
        if hidden is None or hidden.shape[0] == 0:
            return
        self._pending.append(hidden)
        self.context_len += int(hidden.shape[0])
        if self._drafting:
            self._drafting = False
            self._flush()
            mx.async_eval(self._cache_state())

    def reserve(self, rows: int) -> None:
        """Grow the context buffers to hold ``rows`` now (the warm-up builds later shapes)."""
        self._flush()
        for kv in self._caches:
            if kv.keys is not None:
                kv._fit(rows, kv.keys, kv.values)

    # -- block --------------------------------------------------------------------------
    def embed(self, ids: mx.array) -> mx.array:
        raise NotImplementedError

    def block_states(self, ids: Sequence[int]) -> mx.array:
        """Final-normed states [B, H] of the block [anchor, MASK...] at the anchor's position."""
        return self.model.block(self._block_input(ids)[None], self._caches)[0]

    @staticmethod
    def block_states_rows(requests: Sequence[tuple["BlockDrafter", Sequence[int]]]) -> mx.array:
        """``block_states`` of several drafters sharing one model (a batch's rows) in one block
        forward: [R, B, H]. Each row attends to its own context; its states may differ from its
        lone forward's in the last bits (the projections sum over R rows' products)."""
        x = mx.stack([d._block_input(ids) for d, ids in requests])
        return requests[0][0].model.block_rows(x, [d._caches for d, _ in requests])

    def _block_input(self, ids: Sequence[int]) -> mx.array:
        """The block's embeddings [B, H], the context brought up to the anchor first."""
        anchor_pos = len(ids) - 1
        if anchor_pos != self.context_len:
            raise RuntimeError(f"{self.name} drafter out of step: {self.context_len} context rows for an anchor at {anchor_pos}")
        self._flush()
        self._drafting = True
        block = mx.array([int(ids[-1])] + [self.cfg.mask_token_id] * (self.block_size - 1), dtype=mx.uint32)
        return self.embed(block).astype(self.dtype)
