"""Write tiny random DSpark / DFlash checkpoints in the exact on-disk format of the released
ones (DeepSpec ``deepseek-ai/dspark_*_block7``, z-lab ``*-DFlash-b16``): ``config.json`` plus
``model.safetensors`` with the real key names, ``[out, in]`` weights.

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
