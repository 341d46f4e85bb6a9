"""Write tiny random drafter checkpoints in the exact on-disk format of the released ones
(DeepSpec ``deepseek-ai/dspark_*_block7``, z-lab ``*-DFlash-b16`` and DFlash 2, vLLM speculators
EAGLE-3 and SafeAILab EAGLE-3, Qwen3.5 ``mtp.*`` tensors in a model folder or an MLX sidecar):
``config.json`` plus ``model.safetensors`` with the real key names, ``[out, in]`` weights.

The key layout is written out here by hand from the published checkpoints (spec/drafters.md),
independently of ``engine/drafters/block.py``, so loading these files with the engine's strict
checks proves the engine's modules use the real names and shapes.

As a script (a drafter shaped for the starter model, H=576, 30 layers, vocab 49152)::

    .venv/bin/python -m tests.drafter_ckpt --kind dspark --out /tmp/smollm2-dspark
    .venv/bin/python -m tests.drafter_ckpt --kind dflash --out /tmp/smollm2-dflash
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import numpy as np


def target_config_of(model) -> dict:
    """The HF-style config of an mlx-lm model (e.g. one from tests/tiny.py)."""
    a = model.args
    heads = a.num_attention_heads
    return {
        "model_type": a.model_type,
        "hidden_size": a.hidden_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(a, "num_key_value_heads", None) or heads,
        "head_dim": getattr(a, "head_dim", None) or a.hidden_size // heads,
        "intermediate_size": a.intermediate_size,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": getattr(a, "rope_theta", 10000.0),
        "max_position_embeddings": getattr(a, "max_position_embeddings", None) or 4096,
    }


def default_taps(n_layers: int) -> list[int]:
    """Five ids evenly spaced from 1 to N-3 (z-lab's rule), deduplicated."""
    end = max(1, n_layers - 3)
    return sorted({int(round(1 + i * (end - 1) / 4)) for i in range(5)})


def _config(target: dict, *, layers: int, taps: Sequence[int]) -> dict:
    cfg = {k: v for k, v in target.items() if k not in ("architectures", "quantization", "quantization_config")}
    cfg.update(
        model_type="qwen3", hidden_act="silu", attention_bias=False, num_hidden_layers=layers,
        num_target_layers=target["num_hidden_layers"], layer_types=["full_attention"] * layers,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    return cfg


def layer_keys(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, f = cfg["head_dim"], cfg["intermediate_size"]
    keys = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        keys.update({
            p + "self_attn.q_proj.weight": (nh * d, h),
            p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h),
            p + "self_attn.o_proj.weight": (h, nh * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    return keys


def dspark_keys(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The DeepSpec Qwen3DSparkModel state dict: name -> shape."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    n_tap = len(cfg["target_layer_ids"])
    keys = {"embed_tokens.weight": (v, h), **layer_keys(cfg), "norm.weight": (h,),
            "fc.weight": (h, n_tap * h), "hidden_norm.weight": (h,), "lm_head.weight": (v, h)}
    r = cfg.get("markov_rank", 0)
    if r:
        keys["markov_head.markov_w1.weight"] = (v, r)
        keys["markov_head.markov_w2.weight"] = (v, r)
        kind = cfg.get("markov_head_type", "vanilla")
        if kind == "gated":
            keys["markov_head.gate_proj.weight"] = (r, h + r)
            keys["markov_head.gate_proj.bias"] = (r,)
        elif kind == "rnn":
            keys["markov_head.joint_proj.weight"] = (3 * r, 2 * r + h)
            keys["markov_head.joint_proj.bias"] = (3 * r,)
    if cfg.get("enable_confidence_head"):
        extra = r if cfg.get("confidence_head_with_markov") else 0
        keys["confidence_head.proj.weight"] = (1, h + extra)
        keys["confidence_head.proj.bias"] = (1,)
    return keys


def dflash_keys(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The z-lab DFlashDraftModel state dict: no embedding, no head."""
    h = cfg["hidden_size"]
    n_tap = len(cfg["dflash_config"]["target_layer_ids"])
    return {**layer_keys(cfg), "norm.weight": (h,), "fc.weight": (h, n_tap * h), "hidden_norm.weight": (h,)}


def random_weights(keys: dict[str, tuple[int, ...]], seed: int, scale: float = 0.02) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in keys.items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype=np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, dtype=np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def write(out: str | Path, config: dict, weights: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def dspark_checkpoint(target: dict, *, layers: int = 1, block_size: int = 7, markov_rank: int = 16,
                      markov_head_type: str = "vanilla", confidence: bool = True, with_markov: bool = True,
                      taps: Sequence[int] | None = None, mask_token_id: int = 1, seed: int = 0,
                      scale: float = 0.02) -> tuple[dict, dict[str, np.ndarray]]:
    cfg = _config(target, layers=layers, taps=taps)
    cfg.update(architectures=["Qwen3DSparkModel"], block_size=block_size,
               target_layer_ids=list(taps) if taps is not None else default_taps(target["num_hidden_layers"]),
               mask_token_id=mask_token_id, num_anchors=512, markov_rank=markov_rank,
               enable_confidence_head=confidence)
    if markov_rank:
        cfg["markov_head_type"] = markov_head_type
    if confidence:
        cfg["confidence_head_with_markov"] = bool(with_markov and markov_rank)
    return cfg, random_weights(dspark_keys(cfg), seed, scale)


def dflash_checkpoint(target: dict, *, layers: int = 1, block_size: int = 16, taps: Sequence[int] | None = None,
                      mask_token_id: int = 1, seed: int = 0, scale: float = 0.02) -> tuple[dict, dict[str, np.ndarray]]:
    cfg = _config(target, layers=layers, taps=taps)
    cfg.update(architectures=["DFlashDraftModel"], block_size=block_size,
               dflash_config={"mask_token_id": mask_token_id,
                              "target_layer_ids": list(taps) if taps is not None else default_taps(target["num_hidden_layers"])})
    return cfg, random_weights(dflash_keys(cfg), seed, scale)


def dflash2_keys(cfg: dict) -> dict[str, tuple[int, ...]]:
    """DFlash 2 (incoai/z-lab ``DFlash2DraftModel``): DFlash plus two dynamic convolutions per layer
    and the candidate selector (codebooks stored without ``.weight``)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    d = cfg["dflash_config"]
    k, g, r = d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"]
    keys = dflash_keys(cfg)
    for i in range(cfg["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            keys[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
            keys[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * h // g, h)
    keys.update({"candidate_selector.predecessor_codebook": (v, r), "candidate_selector.successor_codebook": (v, r),
                 "candidate_selector.hidden_projection.weight": (r, h)})
    return keys


def dflash2_checkpoint(target: dict, *, layers: int = 1, block_size: int = 8, taps: Sequence[int] | None = None,
                       mask_token_id: int = 1, rank: int = 16, top_k: int = 8, group: int = 16, window: int = 2048,
                       seed: int = 0, scale: float = 0.02) -> tuple[dict, dict[str, np.ndarray]]:
    """The published DFlash 2 config: every layer ``sliding_attention``, ``is_causal: false``."""
    cfg = _config(target, layers=layers, taps=taps)
    cfg.update(architectures=["DFlash2DraftModel"], is_causal=False, sliding_window=window, use_sliding_window=True,
               layer_types=["sliding_attention"] * layers,
               dflash_config={"block_size": block_size, "mask_token_id": mask_token_id, "conv_kernel_size": 2,
                              "conv_group_size": group, "selector_rank": rank, "selector_top_k": top_k,
                              "target_layer_ids": list(taps) if taps is not None else default_taps(target["num_hidden_layers"])})
    return cfg, random_weights(dflash2_keys(cfg), seed, scale)


# -- EAGLE-3 ---------------------------------------------------------------------------------
def eagle3_keys(layer: dict, *, target_hidden: int, n_aux: int = 3, draft_vocab: int, midlayer: bool = False,
                own_embedding: bool = False, fc_bias: bool = False) -> dict[str, tuple[int, ...]]:
    """A speculators ``Eagle3Speculator`` state dict (``midlayer.*`` for SafeAILab/SpecForge)."""
    h, nh, nkv, f = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["intermediate_size"]
    d = layer.get("head_dim") or h // nh
    p = "midlayer." if midlayer else "layers.0."
    keys = {"fc.weight": (h, n_aux * target_hidden), "norm.weight": (h,), "lm_head.weight": (draft_vocab, h),
            p + "hidden_norm.weight": (h,), p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * d, 2 * h), p + "self_attn.k_proj.weight": (nkv * d, 2 * h),
            p + "self_attn.v_proj.weight": (nkv * d, 2 * h), p + "self_attn.o_proj.weight": (h, nh * d),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    if fc_bias:
        keys["fc.bias"] = (h,)
    if own_embedding:
        keys["embed_tokens.weight"] = (layer["vocab_size"], h)
    return keys


def eagle3_config(target: dict, *, draft_vocab: int, aux: Sequence[int] | None = None, norm_before_residual: bool = True,
                  layout: str = "speculators", speculative_tokens: int = 5) -> dict:
    """A speculators EAGLE-3 config.json (one Llama layer), or SafeAILab's flat one."""
    v = target["vocab_size"]
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": target["hidden_size"],
             "intermediate_size": target["intermediate_size"], "num_attention_heads": target["num_attention_heads"],
             "num_key_value_heads": target["num_key_value_heads"], "head_dim": target["head_dim"], "num_hidden_layers": 1,
             "hidden_act": "silu", "rms_norm_eps": target["rms_norm_eps"], "rope_theta": 10000.0, "rope_scaling": None,
             "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False, "vocab_size": v}
    if layout == "speculators":
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": draft_vocab,
                "norm_before_residual": norm_before_residual, "target_hidden_size": None,
                "eagle_aux_hidden_state_layer_ids": list(aux) if aux is not None else None,
                "transformer_layer_config": layer, "speculators_version": "0.2.0",
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                                             "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                       "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}}}
    cfg = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    return cfg


def eagle3_checkpoint(target: dict, *, draft_tokens: Sequence[int] | None = None, aux: Sequence[int] | None = None,
                      norm_before_residual: bool = True, layout: str = "speculators", speculative_tokens: int = 5,
                      seed: int = 0, scale: float = 0.02, own_embedding: bool = False,
                      fc_bias: bool = False) -> tuple[dict, dict[str, np.ndarray]]:
    """An EAGLE-3 folder for ``target`` with a reduced draft vocabulary listing ``draft_tokens``
    (``d2t``/``t2d``); ``layout="safeailab"``: flat config, ``midlayer.*``."""
    v = target["vocab_size"]
    tokens = list(draft_tokens) if draft_tokens is not None else list(range(v))
    cfg = eagle3_config(target, draft_vocab=len(tokens), aux=aux, norm_before_residual=norm_before_residual,
                        layout=layout, speculative_tokens=speculative_tokens)
    layer = cfg.get("transformer_layer_config", cfg)
    keys = eagle3_keys(layer, target_hidden=target["hidden_size"], n_aux=len(aux) if aux is not None else 3,
                       draft_vocab=len(tokens), midlayer=layout != "speculators", own_embedding=own_embedding, fc_bias=fc_bias)
    w = random_weights(keys, seed, scale)
    w["d2t"] = np.array([t - i for i, t in enumerate(tokens)], dtype=np.int64)
    t2d = np.zeros(v, dtype=bool)
    t2d[tokens] = True
    w["t2d"] = t2d
    return cfg, w


# -- native MTP heads (Qwen3.5) -----------------------------------------------------------------
def qwen3_5_text_config(*, hidden: int = 64, layers: int = 4, vocab: int = 96, experts: int = 0) -> dict:
    """A tiny Qwen3.5 ``text_config`` (hybrid: every second layer full attention) with one MTP layer."""
    cfg = {"model_type": "qwen3_5_text", "hidden_size": hidden, "num_hidden_layers": layers,
           "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
           "vocab_size": vocab, "rms_norm_eps": 1e-6, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
           "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
           "full_attention_interval": 2, "tie_word_embeddings": False, "max_position_embeddings": 4096,
           "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1]}}
    if experts:
        cfg.update(model_type="qwen3_5_moe_text", num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, decoder_sparse_step=1, norm_topk_prob=True)
    return cfg


def mtp_keys(tc: dict, *, prefix: str = "mtp.") -> dict[str, tuple[int, ...]]:
    """Qwen3.5's ``mtp.*`` tensors (HF layout; MoE experts fused as ``experts.gate_up_proj``)."""
    h, nh, nkv, d = tc["hidden_size"], tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    p = prefix + "layers.0."
    keys = {prefix + "fc.weight": (h, 2 * h), prefix + "pre_fc_norm_embedding.weight": (h,),
            prefix + "pre_fc_norm_hidden.weight": (h,), prefix + "norm.weight": (h,),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (2 * nh * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    e = tc.get("num_experts", 0)
    if e:
        fm, fs = tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
        keys.update({p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * fm, h),
                     p + "mlp.experts.down_proj": (e, h, fm), p + "mlp.shared_expert.gate_proj.weight": (fs, h),
                     p + "mlp.shared_expert.up_proj.weight": (fs, h), p + "mlp.shared_expert.down_proj.weight": (h, fs),
                     p + "mlp.shared_expert_gate.weight": (1, h)})
    else:
        f = tc["intermediate_size"]
        keys.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
    return keys


def mtp_tensors(tc: dict, *, seed: int = 0, scale: float = 0.05, prefix: str = "mtp.") -> dict[str, np.ndarray]:
    """Random HF-layout MTP tensors: norms zero-centred (stored w, applied as 1 + w)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in mtp_keys(tc, prefix=prefix).items():
        std = 0.1 if "norm" in name.split(".")[-2] else scale
        out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out


def write_model_folder(out: str | Path, model, config: dict, tokenizer, extra: dict[str, np.ndarray] | None = None) -> Path:
    """An mlx-lm model folder for ``model`` (its weights, config.json, tokenizer files) plus ``extra``
    tensors (e.g. ``mtp.*``, which mlx-lm's loader drops) in the same safetensors."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    weights.update(extra or {})
    write(out, config, weights)
    tokenizer._tokenizer.save_pretrained(str(out))
    return out


def copy_target_head(weights: dict[str, np.ndarray], model) -> None:
    """Give a DSpark checkpoint the target's embedding and head, as DeepSpec does."""
    weights["embed_tokens.weight"] = np.array(model.model.embed_tokens.weight, dtype=np.float32)
    head = getattr(model, "lm_head", None)
    w = head.weight if head is not None else model.model.embed_tokens.weight
    weights["lm_head.weight"] = np.array(w, dtype=np.float32)


def _starter_config() -> dict:
    import engine  # noqa: F401  (OpenBLAS before mlx)
    from engine.loading import resolve_model_path

    return json.loads((resolve_model_path(None) / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["dspark", "dflash"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--target-config", default="starter",
                   help="'starter' (the built-in SmolLM2-135M) or a target's config.json")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--mask-token-id", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    target = _starter_config() if args.target_config == "starter" else json.loads(Path(args.target_config).read_text())
    if args.kind == "dspark":
        cfg, w = dspark_checkpoint(target, layers=args.layers, block_size=args.block_size or 7,
                                   markov_rank=args.markov_rank, mask_token_id=args.mask_token_id, seed=args.seed)
    else:
        cfg, w = dflash_checkpoint(target, layers=args.layers, block_size=args.block_size or 16,
                                   mask_token_id=args.mask_token_id, seed=args.seed)
    out = write(args.out, cfg, w)
    print(f"{args.kind} drafter for a {target['num_hidden_layers']}-layer H={target['hidden_size']} "
          f"V={target['vocab_size']} target -> {out} ({len(w)} tensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
