"""Checkpoints of the drafters people already have: native MTP heads (in the model's own folder
or a sidecar) and EAGLE-3 heads; which kind of drafter a folder holds.

* ``drafter_kind``: "dspark", "dflash", "eagle3" or "mtp" from a config.json, or a one-line
  refusal naming a format we do not run.
* MTP (Qwen3.5 / 3.6 / 3.8, Qwen3-Next): the model folder's ``mtp.*`` tensors (mlx-lm's
  ``sanitize`` drops them when it loads the model, so they are read here, selectively, from the
  safetensors the index names), or a sidecar (``mlx_vlm.split_mtp`` writes one: ``model_type``
  ``qwen3_5_mtp``, the source's ``text_config``, keys without the ``mtp.`` prefix). HF
  checkpoints store the seven norm weights zero-centred (applied as 1 + w, as mlx-lm does for the
  trunk); MLX sidecars, and some MLX folders that keep the ``mtp.*`` tensors, store them shifted.
  Which one a head holds is read from the values (``mtp_norm_layout``), and a head whose norms
  disagree is refused. A sidecar must match the
  trunk (hidden size, vocabulary, layer count) and agree with the target on a probe text well
  above chance.
* DeepSeek-V3 / GLM-4.5 "nextn" heads: ``model.layers.{N}.*`` (N = the trunk's layer count),
  whose decoder layer goes through mlx-lm's own sanitize for that family (experts stacked, MLA's
  ``kv_b_proj`` split, FP8 dequantized); later layouts (DeepSeek-V4, GLM-4.7-Flash ...) are
  refused by name.
* EAGLE-3 (vLLM speculators ``Eagle3Speculator``; SafeAILab / SpecForge
  ``LlamaForCausalLMEagle3`` with ``midlayer.*``): see ``engine/drafters/eagle3.py``.

Every problem is a one-line ``TandemError`` before anything runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.drafters.block import checkpoint_kind, is_eagle3, is_mtp_sidecar
from engine.drafters.checkpoint import check_weights, draft_vocab_ids, read_config
from engine.errors import TandemError

if TYPE_CHECKING:
    from engine.drafters.eagle3 import Eagle3Config, Eagle3Model
    from engine.drafters.mtp import MTPDrafter, MTPHead, NextNHead
    from engine.target import Target


# ----------------------------------------------------------------------------------------
# Which drafter a folder holds
# ----------------------------------------------------------------------------------------
def drafter_kind(raw: dict, where: str = "drafter") -> str:
    """'dspark', 'dflash', 'eagle3' or 'mtp' for a drafter's config.json (refusals in one line)."""
    if is_eagle3(raw):
        return "eagle3"
    if is_mtp_sidecar(raw):
        return "mtp"
    return checkpoint_kind(raw, where)


def safetensors_keys(file: Path) -> list[str]:
    """Tensor names in a .safetensors file, from its header only."""
    from engine.loading import safetensors_header

    try:
        header, _ = safetensors_header(file)
    except (OSError, ValueError):
        raise TandemError(f"{file}: unreadable safetensors header") from None
    return [k for k in header if k != "__metadata__"]


def _files_with(folder: Path, wanted) -> dict[Path, list[str]]:
    """{file: its keys that ``wanted(key)``} over a folder's safetensors (the index when there is one)."""
    index = folder / "model.safetensors.index.json"
    found: dict[Path, list[str]] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            items = list(weight_map.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise TandemError(f"{index}: unreadable shard index") from None
        for key, name in items:
            if wanted(key):
                found.setdefault(folder / str(name), []).append(key)
        return found
    for file in sorted(folder.glob("*.safetensors")):
        keys = [k for k in safetensors_keys(file) if wanted(k)]
        if keys:
            found[file] = keys
    return found


def _read_tensors(files: dict[Path, list[str]], where: str) -> dict[str, mx.array]:
    from engine.loading import check_safetensors

    out: dict[str, mx.array] = {}
    for file, keys in files.items():
        if not file.is_file():
            raise TandemError(f"{where}: shard {file.name} is missing")
        if problem := check_safetensors(file):
            raise TandemError(f"{where}: {file.name} is corrupt: {problem}")
        try:
            part = mx.load(str(file))  # lazy: only the tensors used are read
        except Exception as e:
            raise TandemError(f"{where}: {file.name} is corrupt ({type(e).__name__})") from None
        out.update({k: part[k] for k in keys})
    return out


# ----------------------------------------------------------------------------------------
# Native MTP heads
# ----------------------------------------------------------------------------------------
MTP_KEY = re.compile(r"^(?:model\.|language_model\.)*mtp\.")
MTP_FAMILIES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
NEXTN_FAMILIES = ("deepseek_v3", "glm4_moe")  # model.layers.{N}.{enorm, hnorm, eh_proj, shared_head, ...}
OTHER_MTP_FAMILIES = ("deepseek_v32", "deepseek_v4", "glm4_moe_lite", "glm5_next", "glm_moe_dsa", "kimi_k2", "mimo")
# Zero-centred norms in the HF layout (weight stored as w, applied as 1 + w).
_HF_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
             "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def text_config(config: dict) -> dict:
    sub = config.get("text_config")
    return sub if isinstance(sub, dict) else config


def family(config: dict) -> str:
    tc = text_config(config)
    kind = str(tc.get("model_type") or config.get("model_type") or "")
    outer = str(config.get("model_type") or "")
    return next((k for k in (kind, outer) if k in MTP_FAMILIES + NEXTN_FAMILIES + OTHER_MTP_FAMILIES), kind)


def nextn_prefix(config: dict) -> str:
    return f"model.layers.{int(text_config(config).get('num_hidden_layers', -1))}."


def _is_head_key(config: dict | None):
    """Which tensor names hold the MTP head in this model's checkpoints."""
    if config is not None and family(config) in NEXTN_FAMILIES:
        prefix = nextn_prefix(config)
        return lambda k: k.startswith(prefix)
    return lambda k: bool(MTP_KEY.match(k))


def mtp_files(folder: Path | None, config: dict | None = None) -> dict[Path, list[str]]:
    """The model folder's MTP tensors by file (empty when it has none, e.g. an mlx-lm conversion)."""
    if folder is None or not Path(folder).is_dir():
        return {}
    return _files_with(Path(folder), _is_head_key(config))


def mtp_layout_problem(config: dict, where: str) -> str | None:
    """Why this model's MTP head is not one we run, or None (config checks only)."""
    tc = text_config(config)
    kind = family(config)
    if kind in OTHER_MTP_FAMILIES:
        return f"{where}: {kind} MTP heads are not supported (Qwen3.5 / Qwen3-Next, DeepSeek-V3 and GLM-4.5 heads are)"
    if kind not in MTP_FAMILIES + NEXTN_FAMILIES:
        return (f"{where}: {kind or 'this model'} has no MTP head we can run (Qwen3.5 / 3.6 / 3.8, Qwen3-Next, "
                f"DeepSeek-V3 and GLM-4.5 carry one)")
    if kind in NEXTN_FAMILIES:
        layers = tc.get("num_nextn_predict_layers", 1)
        if layers != 1:
            return f"{where}: {kind} with {layers} MTP layers (num_nextn_predict_layers) is not supported (1 is)"
        return None
    layers = tc.get("mtp_num_hidden_layers", tc.get("num_nextn_predict_layers", 1))
    if layers != 1:
        return f"{where}: MTP heads with {layers} layers are not supported (the published Qwen heads have 1)"
    if tc.get("mtp_use_dedicated_embeddings"):
        return f"{where}: MTP heads with their own embeddings (mtp_use_dedicated_embeddings) are not supported"
    return None


def _nextn_model(config: dict) -> tuple[Any, Any, type]:
    """(mlx-lm module, its ModelArgs for this config, its decoder layer class) of a nextn family."""
    from mlx_lm.models import deepseek_v3, glm4_moe

    if family(config) == "deepseek_v3":
        return deepseek_v3, deepseek_v3.ModelArgs.from_dict(text_config(config)), deepseek_v3.DeepseekV3DecoderLayer
    return glm4_moe, glm4_moe.ModelArgs.from_dict(text_config(config)), glm4_moe.DecoderLayer


def new_mtp_head(config: dict, where: str = "MTP head") -> "MTPHead | NextNHead":
    """A random-initialised head of this model's layout (lazy; weights are loaded after)."""
    from mlx_lm.models import qwen3_5, qwen3_next

    from engine.drafters.mtp import MTPHead, NextNHead

    if problem := mtp_layout_problem(config, where):
        raise TandemError(problem)
    tc = dict(text_config(config))
    if family(config) in NEXTN_FAMILIES:
        try:
            _, args, layer_class = _nextn_model(config)
            layer = layer_class(args, args.num_hidden_layers)  # past the trunk: a MoE layer
        except (TypeError, ValueError, KeyError, AssertionError) as e:
            raise TandemError(f"{where}: config.json does not describe a {family(config)} layer ({e})") from None
        return NextNHead(int(args.hidden_size), float(args.rms_norm_eps), [layer])
    try:
        if "qwen3_next" in (tc.get("model_type"), config.get("model_type")):
            args = qwen3_next.ModelArgs.from_dict({**tc, "full_attention_interval": 1, "mlp_only_layers": []})
            layer = qwen3_next.Qwen3NextDecoderLayer(args, layer_idx=0)
        else:
            args = replace(qwen3_5.TextModelArgs.from_dict(tc), full_attention_interval=1)
            layer = qwen3_5.DecoderLayer(args, layer_idx=0)
    except (TypeError, ValueError, KeyError) as e:
        raise TandemError(f"{where}: config.json does not describe a Qwen3.5 / Qwen3-Next layer ({e})") from None
    return MTPHead(int(args.hidden_size), float(args.rms_norm_eps), [layer])


NEXTN_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
NEXTN_TARGETS = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the target's: its own are used


def _nextn_weights(raw: dict[str, mx.array], config: dict, where: str) -> dict[str, mx.array]:
    """``model.layers.{N}.*`` -> the head's names; the decoder layer's tensors go through mlx-lm's
    own sanitize for that family (expert stacking, MLA's kv_b_proj split, FP8 dequantization)."""
    from types import SimpleNamespace

    prefix = nextn_prefix(config)
    names = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in raw.items()}
    own = {k: v for k, v in names.items() if k in NEXTN_OWN}
    block = {f"model.layers.0.{k}": v for k, v in names.items()
             if k not in NEXTN_OWN and not k.startswith(NEXTN_TARGETS)}
    module, args, _ = _nextn_model(config)
    shim = SimpleNamespace(args=replace(args, num_hidden_layers=1))
    try:
        block = module.Model.sanitize(shim, block)
    except (KeyError, ValueError) as e:
        raise TandemError(f"{where}: the MTP layer's tensors are incomplete ({type(e).__name__}: {e})") from None
    own.update({"layers.0." + k[len("model.layers.0."):]: v for k, v in block.items()})
    return own


ZERO_CENTRED, SHIFTED = "zero-centred", "shifted"
NORM_BAND = 0.3  # a norm whose mean is below 0.3 reads zero-centred, above 0.7 stored shifted


def is_mtp_norm(name: str) -> bool:
    """One of the head's seven RMSNorm weights (a key with or without the ``mtp.`` prefix)."""
    name = MTP_KEY.sub("", name)
    return name == "norm.weight" or name.endswith(_HF_NORMS)


def mtp_norm_layout(norms: dict[str, mx.array], where: str) -> str:
    """``ZERO_CENTRED`` (stored w, applied as 1 + w: HF checkpoints) or ``SHIFTED`` (stored 1 + w:
    MLX sidecars, and some MLX folders that keep the ``mtp.*`` tensors) by what the weights say,
    not by their key names or metadata: a zero-centred norm sits near 0, a shifted one near 1.
    Norms that do not all say the same are refused: either reading changes every logit."""
    if not norms:
        return SHIFTED
    means = {k: mx.mean(v.astype(mx.float32)).item() for k, v in sorted(norms.items())}
    if all(m < NORM_BAND for m in means.values()):
        return ZERO_CENTRED
    if all(m > 1 - NORM_BAND for m in means.values()):
        return SHIFTED
    listed = ", ".join(f"{k} {m:.2f}" for k, m in means.items())
    raise TandemError(f"{where}: cannot tell whether the MTP head's norm weights are stored zero-centred (mean near 0, "
                      f"applied as 1 + w) or shifted (mean near 1); their means: {listed}")


def describe_mtp_norms(folder: Path | None, config: dict) -> str | None:
    """How the model folder's own MTP head stores its norms (for ``tandem doctor``), or None
    when it has no Qwen-style head; reads the norm tensors only."""
    if family(config) not in MTP_FAMILIES:
        return None
    files = {f: [k for k in keys if is_mtp_norm(k)] for f, keys in mtp_files(folder, config).items()}
    try:
        norms = {k: v for k, v in _read_tensors(files, str(folder)).items() if v.ndim == 1}
        layout = mtp_norm_layout(norms, str(folder))
    except TandemError as e:
        return f"refused: {e}"
    if not norms:
        return None
    return (f"{len(norms)} norms stored zero-centred (HF layout): applied as 1 + w" if layout == ZERO_CENTRED
            else f"{len(norms)} norms stored shifted (MLX layout): applied as stored")


def _mtp_weights(raw: dict[str, mx.array], where: str, config: dict | None = None) -> dict[str, mx.array]:
    """HF (``mtp.`` prefix, zero-centred norms, per-expert or fused experts) or MLX sidecar keys
    -> the head's parameter names (a nextn family's: see ``_nextn_weights``)."""
    if config is not None and family(config) in NEXTN_FAMILIES:
        return _nextn_weights(raw, config, where)
    if any(k.endswith("weight_scale_inv") for k in raw):
        raise TandemError(f"{where}: FP8 MTP tensors are not supported (use the bf16 checkpoint or an MLX sidecar)")
    out = {MTP_KEY.sub("", key): value for key, value in raw.items()}
    norms = {k: v for k, v in out.items() if v.ndim == 1 and is_mtp_norm(k)}
    if mtp_norm_layout(norms, where) == ZERO_CENTRED:
        out.update({k: v.astype(mx.float32) + 1.0 for k, v in norms.items()})
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:  # fused experts [E, 2F, H]
        base = key[: -len(".experts.gate_up_proj")]
        gate, up = mx.split(out.pop(key), 2, axis=-2)
        out[f"{base}.switch_mlp.gate_proj.weight"], out[f"{base}.switch_mlp.up_proj.weight"] = gate, up
        if f"{base}.experts.down_proj" in out:
            out[f"{base}.switch_mlp.down_proj.weight"] = out.pop(f"{base}.experts.down_proj")
    per_expert = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in out:
        if m := per_expert.match(key):
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = key
    for (base, proj), keys in groups.items():
        if sorted(keys) != list(range(len(keys))):
            raise TandemError(f"{where}: expert tensors of {base} are not numbered 0..{len(keys) - 1}")
        out[f"{base}.switch_mlp.{proj}.weight"] = mx.stack([out.pop(keys[i]) for i in range(len(keys))])
    return out


def _quantize_like(head: nn.Module, weights: dict[str, mx.array], config: dict, where: str) -> None:
    """Quantize the layers a (mlx-vlm) sidecar stores quantized, as its config says."""
    if not any(k.endswith(".scales") for k in weights):
        return
    q = config.get("quantization") or config.get("quantization_config") or {}
    try:
        bits, group = int(q["bits"]), int(q.get("group_size", 64))
    except (KeyError, TypeError, ValueError):
        raise TandemError(f"{where}: quantized tensors but no 'quantization' {{bits, group_size}} in config.json") from None
    nn.quantize(head, group_size=group, bits=bits, class_predicate=lambda p, m: f"{p}.scales" in weights)


def load_mtp_head(target: "Target", config: dict, tensors: dict[str, mx.array], *, where: str,
                  dtype: mx.Dtype | None = None, bits: int | None = None) -> "MTPHead":
    """Build the head for ``config`` (a model or sidecar config.json), check ``tensors`` against it
    (keys, shapes, the target's hidden size) and load them; ``bits``: quantize a float head."""
    from engine import platform
    from engine.drafters.checkpoint import compute_dtype
    from engine.loading import make_dense_float32

    head = new_mtp_head(config, where)
    weights = _mtp_weights(tensors, where, config)
    fc = weights.get("fc.weight", weights.get("eh_proj.weight"))
    hidden = int(target.hidden_size)
    if fc is not None and fc.dtype != mx.uint32 and tuple(fc.shape) != (hidden, 2 * hidden):
        raise TandemError(f"{where}: hidden size mismatch: the MTP head's fc is {list(fc.shape)}, {target.name} has "
                          f"hidden size {hidden}")
    _quantize_like(head, weights, config, where)
    check_weights(head, weights, where)
    dtype = dtype or compute_dtype(target)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases"))
               else v for k, v in weights.items()}
    head.load_weights(list(weights.items()))
    if platform.prefers_dense_float32():
        make_dense_float32(head)
    elif bits and not any(k.endswith(".scales") for k in weights):
        from engine.drafters.checkpoint import quantize_drafter

        quantize_drafter(head, bits)
    head.eval()
    mx.eval(head.parameters())
    return head


def mtp_from_model(target: "Target", folder: Path | None, config: dict, *, where: str, bits: int | None = None) -> "MTPHead":
    """The model's own MTP head, from its folder's safetensors."""
    if problem := mtp_layout_problem(config, where):
        raise TandemError(problem)
    files = mtp_files(folder, config)
    if not files:
        raise TandemError(f"{where} ships no MTP head: mlx-community conversions strip it; load the original "
                          f"checkpoint, or pass its MTP tensors as a sidecar (--drafter)")
    return load_mtp_head(target, config, _read_tensors(files, where), where=where, bits=bits)


def mtp_drafter(head: "MTPHead | NextNHead", target: "Target") -> "MTPDrafter":
    from engine.drafters.mtp import MTPDrafter, NextNDrafter, NextNHead

    return (NextNDrafter if isinstance(head, NextNHead) else MTPDrafter)(head, target)


def mtp_drafter_from_model(target: "Target", folder: Path | None, config: dict, *, where: str,
                           bits: int | None = None) -> "MTPDrafter":
    return mtp_drafter(mtp_from_model(target, folder, config, where=where, bits=bits), target)


def mtp_drafter_from_sidecar(target: "Target", path: Path, model_config: dict, tokenizer: Any = None,
                             bits: int | None = None) -> "MTPDrafter":
    """A sidecar's head, checked against the trunk (config, shapes, and the probe)."""
    where = f"MTP sidecar {path}"
    config, files = read_mtp_sidecar(path)
    if config is not None:
        check_sidecar_config(config, target, where)
    head = load_mtp_head(target, config or model_config, _read_tensors(files, where), where=where, bits=bits)
    drafter = mtp_drafter(head, target)
    check_agreement(drafter, probe_ids(tokenizer, target.vocab_size), where)
    return drafter


def read_mtp_sidecar(path: Path) -> tuple[dict | None, dict[Path, list[str]]]:
    """A sidecar folder (config.json + safetensors) or one .safetensors file -> (config or None,
    its tensors by file)."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise TandemError(f"MTP sidecar {path}: expected a folder or a .safetensors file")
        return None, {path: safetensors_keys(path)}
    config = read_config(path) if (path / "config.json").is_file() else None
    files = _files_with(path, lambda k: True)
    if not files:
        raise TandemError(f"MTP sidecar {path}: no safetensors in the folder")
    return config, files


def check_sidecar_config(sidecar: dict, target: "Target", where: str) -> None:
    """A sidecar's own config must describe this trunk."""
    tc = text_config(sidecar)
    checks = (("hidden_size", int(target.hidden_size), "hidden size"), ("vocab_size", int(target.vocab_size), "vocab"),
              ("num_hidden_layers", int(target.num_layers), "layer count"))
    for field, want, label in checks:
        got = tc.get(field)
        if got is not None and got != want:
            raise TandemError(f"{where}: {label} mismatch: the sidecar was made for {got}, {target.name} has {want}")


PROBE_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion about "
    "rising costs, the members agreed to postpone the new library until the spring, and to spend the savings "
    "on repairs to the school roof. In a short statement, the chair thanked the volunteers and said that the "
    "town would publish the full report next week."
)
PROBE_MIN_AGREEMENT = 0.1  # an unrelated head agrees at about 1/V; a matched one on most tokens


def probe_ids(tokenizer: Any, vocab: int) -> list[int]:
    """A probe text's tokens, or (a tokenizer that cannot spell it) a fixed spread of ids."""
    ids: list[int] = []
    if tokenizer is not None:
        try:
            ids = [int(t) for t in tokenizer.encode(PROBE_TEXT)]
        except Exception:  # a tokenizer that cannot take plain text
            ids = []
    if len(set(ids)) < 16:
        ids = [(37 * i * i + 11 * i + 5) % vocab for i in range(64)]
    return ids[:96]


def check_agreement(drafter: "MTPDrafter | Any", ids: Sequence[int], where: str) -> float:
    """Refuse a head whose first draft agrees with the target's own next token on (almost) none of
    the probe's positions. Returns the agreement."""
    agree, total = drafter.agreement(ids)
    rate = agree / max(total, 1)
    if rate < PROBE_MIN_AGREEMENT:
        raise TandemError(f"{where} does not fit {drafter.target.name}: its first draft matched the target on "
                          f"{agree} of {total} probe positions (a matched head gets most; chance is about "
                          f"1/{drafter.target.vocab_size})")
    return rate


# ----------------------------------------------------------------------------------------
# EAGLE-3
# ----------------------------------------------------------------------------------------
def _count(raw: dict, name: str, where: str, default: Any = None, minimum: int = 1) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        raise TandemError(f"{where}: config.json '{name}' must be an integer >= {minimum}, got {value!r}")
    return int(value)


def parse_eagle3_config(raw: dict, num_target_layers: int, where: str = "EAGLE-3 drafter") -> "Eagle3Config":
    """An EAGLE-3 config.json (speculators: the layer config nested in ``transformer_layer_config``;
    SafeAILab / SpecForge: Llama fields at the top) -> ``Eagle3Config`` (weights not read yet)."""
    from engine.drafters.eagle3 import Eagle3Config

    layer = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else raw
    act = layer.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise TandemError(f"{where}: hidden_act '{act}' is not supported (EAGLE-3 layers use silu)")
    hidden = _count(layer, "hidden_size", where)
    heads = _count(layer, "num_attention_heads", where)
    kv = _count(layer, "num_key_value_heads", where, heads)
    if heads % kv:
        raise TandemError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    vocab = _count(layer, "vocab_size", where)
    draft_vocab = _count(raw, "draft_vocab_size", where, vocab)
    if draft_vocab > vocab:
        raise TandemError(f"{where}: draft_vocab_size {draft_vocab} is larger than the vocabulary ({vocab})")
    nested = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    n = num_target_layers
    if aux is None:
        aux = [2, n // 2, n - 3]  # vLLM's and speculators' default
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        raise TandemError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {aux!r}")
    bad = [i for i in aux if not 1 <= i <= n - 1]
    if bad:
        raise TandemError(f"{where}: aux hidden-state layer ids {bad} out of range for a {n}-layer target "
                          f"(inputs of layers 1..{n - 1} can be tapped)")
    if len(set(aux)) != len(aux):
        raise TandemError(f"{where}: aux hidden-state layer ids {aux} repeat a layer")
    spec = raw.get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    tokens = 3
    if isinstance(methods, list) and methods and isinstance(methods[0], dict):
        tokens = methods[0].get("speculative_tokens", 3)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 16:
        raise TandemError(f"{where}: speculative_tokens must be an integer in 1..16, got {tokens!r}")
    target_hidden = raw.get("target_hidden_size") or hidden
    return Eagle3Config(
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=_count(layer, "head_dim", where, hidden // heads),
        intermediate_size=_count(layer, "intermediate_size", where), num_layers=_count(layer, "num_hidden_layers", where, 1),
        vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=int(target_hidden),
        aux_layer_ids=tuple(aux), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=layer.get("rope_scaling"), max_position_embeddings=layer.get("max_position_embeddings"),
        attention_bias=bool(layer.get("attention_bias", False)),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        norm_before_fc=bool(raw.get("norm_before_fc", False)), speculative_tokens=tokens, raw=raw)


def check_eagle3_compatible(cfg: "Eagle3Config", target: "Target", where: str) -> None:
    from engine.drafters.block import target_hidden_size

    hidden = target_hidden_size(target)
    if cfg.target_hidden_size != hidden:
        raise TandemError(f"{where}: hidden size mismatch: made for a target with {cfg.target_hidden_size}, "
                          f"{target.name} has {hidden}")
    if cfg.vocab_size != target.vocab_size:
        raise TandemError(f"{where}: vocab mismatch: the drafter has {cfg.vocab_size} tokens, "
                          f"{target.name} has {target.vocab_size}")
    if not cfg.own_embedding and cfg.hidden_size != hidden:
        raise TandemError(f"{where}: no embed_tokens of its own and a hidden size ({cfg.hidden_size}) unlike the "
                          f"target's ({hidden}), so it cannot share the target's embedding")


_VERIFIER = re.compile(r"^verifier[._]")  # the verifier's norm/head some exports keep: not the drafter's


def load_eagle3(path: Path, target: "Target", *, bits: int | None = None, dtype: mx.Dtype | None = None
                ) -> tuple["Eagle3Model", mx.array | None]:
    """Read, check and load an EAGLE-3 folder -> (model, target id of each draft column or None)."""
    from engine.drafters.checkpoint import compute_dtype, quantize_drafter, read_weights
    from engine.drafters.eagle3 import Eagle3Model

    where = f"EAGLE-3 drafter {path}"
    raw = read_config(path)
    if not is_eagle3(raw):
        kind = drafter_kind(raw, f"drafter {path}")
        raise TandemError(f"drafter {path} is a {kind} checkpoint; use --mode {kind} (not --mode eagle3)")
    cfg = parse_eagle3_config(raw, target.num_layers, where)
    weights = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v
               for k, v in read_weights(path).items() if not _VERIFIER.match(k)}
    cfg.fc_bias = "fc.bias" in weights
    cfg.own_embedding = "embed_tokens.weight" in weights
    check_eagle3_compatible(cfg, target, where)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    vocab_ids = draft_vocab_ids(d2t, t2d, cfg.draft_vocab_size, cfg.vocab_size, where)
    model = Eagle3Model(cfg)
    check_weights(model, weights, where)
    dtype = dtype or compute_dtype(target)
    model.load_weights([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()])
    if bits:
        quantize_drafter(model, bits)
    model.eval()
    mx.eval(model.parameters())
    return model, vocab_ids
