"""Block-drafter checkpoints: find, read, check, load, quantize, build and save them.

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

    save_drafter(model, config: dict, out_dir, *, dtype: str | None = None, extra=None) -> Path
        Writes ``config.json`` + ``model.safetensors`` (DeepSpec-native names, ``[out, in]``
        weights); ``dtype="bfloat16"`` casts floating weights on the way out; ``extra`` tensors
        are added as they are (``vocab_tensors(ids, V)``'s ``d2t``/``t2d`` only beside a head
        stored over those rows: other engines read ``d2t`` as "the head is a reduced draft space").

    new_dflash_model(target_config: dict, *, num_layers=1, block_size=16, tap_layers=None,
                     mask_token_id, seed=None) -> DFlashModel   (z-lab layout, for tests)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.drafters.block import (BlockBackbone, BlockConfig, DFlashModel, DSparkModel, build_model,
                                   check_compatible, expected_shapes, parse_config)
from engine.errors import TandemError
from engine.paths import resources_dir

if TYPE_CHECKING:
    from engine.target import Target

QUANT_GROUP = 64
VALID_BITS = (2, 3, 4, 5, 6, 8)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Buffers some exporters write that carry no weights.
_IGNORED_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


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
    current = model.cfg.draft_vocab
    if current and tuple(int(i) for i in ids) == tuple(current):
        return  # already over exactly these rows (a head stored over d2t, no narrower --draft-vocab)
    if current:  # already restricted: pick rows by their place in the current list
        where = {t: i for i, t in enumerate(current)}
        idx = mx.array([where[int(i)] for i in ids], dtype=mx.uint32)
    else:
        idx = mx.array([int(i) for i in ids], dtype=mx.uint32)
    full = model.embed_tokens.weight if model.cfg.tie_word_embeddings and not current else model.lm_head.weight
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


def compute_dtype(target: "Target") -> mx.Dtype:
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

    ``draft_vocab`` (DSpark): None drafts from every token the folder lists (``d2t``, else
    ``draft_vocab.json``; the full vocabulary without either), 0 from the full vocabulary, N from
    the first N listed."""
    where = f"drafter {path}"
    raw = read_config(path)
    cfg = parse_config(raw, where)
    if mode is not None and cfg.kind != mode:
        label = {"dspark": "DSpark", "dflash": "DFlash"}
        raise TandemError(f"{where} is a {label[cfg.kind]} checkpoint; use --mode {cfg.kind} (not --mode {mode})")
    check_compatible(cfg, target, where)
    if draft_vocab is not None and draft_vocab < 0:
        raise TandemError(f"draft vocabulary size must be >= 0 (0: the full vocabulary), got {draft_vocab}")
    weights = read_weights(path)
    if cfg.dflash2:  # ports that load codebooks as embeddings store them with ".weight"
        for name in CODEBOOKS:
            if name + ".weight" in weights and name not in weights:
                weights[name] = weights.pop(name + ".weight")
    listed, reduced = _listed_vocab(cfg, raw, weights, path, where, read_file=draft_vocab != 0)
    model = build_drafter_model(cfg)
    shared = tuple(k for k in TARGET_EMBEDDING_KEYS if k not in weights) \
        if cfg.kind == "dspark" and cfg.use_target_embeddings else ()
    check_weights(model, weights, where, skip=shared + tuple(reduced))
    dtype = dtype or compute_dtype(target)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    reduced = {k: v.astype(dtype) for k, v in reduced.items()}
    if shared:  # use_target_embeddings: the target's embedding and head, as at training
        copy_target_embeddings(model, target, dtype)
    model.load_weights(list(weights.items()), strict=not (shared or reduced))
    if listed is not None and reduced:  # the head is stored over the listed tokens only
        if draft_vocab == 0:
            raise TandemError(f"{where} drafts from its {len(listed)}-token vocabulary (d2t): it cannot draft "
                              f"from the full vocabulary (--draft-vocab 0)")
        restrict_vocab(model, listed)
        model.load_weights(list(reduced.items()), strict=False)
    if listed is not None and draft_vocab != 0:
        restrict_vocab(model, listed[:draft_vocab] if draft_vocab else listed)
    if bits:
        quantize_drafter(model, bits)
    model.eval()
    mx.eval(model.parameters())
    return model, cfg


def build_drafter_model(cfg: BlockConfig) -> BlockBackbone:
    """DSpark, DFlash or DFlash 2 model for a parsed config (lazy)."""
    if cfg.dflash2:
        from engine.drafters.dflash2 import DFlash2Model

        return DFlash2Model(cfg)
    return build_model(cfg)


REDUCED_KEYS = ("lm_head.weight", "markov_head.markov_w2.weight")
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")  # rows over the draft vocabulary


def _listed_vocab(cfg: BlockConfig, raw: dict, weights: dict[str, mx.array], path: Path, where: str,
                  read_file: bool = True) -> tuple[list[int] | None, dict[str, mx.array]]:
    """A DSpark folder's draft vocabulary (``d2t`` in the weights, as vLLM speculators checkpoints
    store it, else ``draft_vocab.json``) and the tensors stored over it only (popped from
    ``weights``; a head or Markov output of the full size is restricted to it at load)."""
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    if cfg.kind != "dspark":
        if d2t is not None or "draft_vocab_size" in raw:
            raise TandemError(f"{where}: a reduced draft vocabulary (d2t) is only supported for DSpark drafters")
        return None, {}
    size = raw.get("draft_vocab_size", cfg.vocab_size if d2t is None else int(d2t.shape[0]))
    ids = draft_vocab_ids(d2t, t2d, size, cfg.vocab_size, where)
    from_file = read_draft_vocab(path, cfg.vocab_size, where) if read_file else None
    listed = [int(i) for i in ids.tolist()] if ids is not None else from_file
    if ids is not None and from_file is not None and set(from_file) != set(listed):
        raise TandemError(f"{where}: {DRAFT_VOCAB_FILE} and d2t list different tokens")
    reduced = {}  # stored over the listed tokens only (vLLM speculators); full-size ones are restricted at load
    for key in REDUCED_KEYS:
        w = weights.get(key)
        if listed is not None and w is not None and w.shape[0] == len(listed) != cfg.vocab_size:
            reduced[key] = weights.pop(key)
    if cfg.markov_rank and "markov_head.markov_w1.weight" in weights and weights["markov_head.markov_w1.weight"].shape[0] != cfg.vocab_size:
        raise TandemError(f"{where}: a Markov head whose input embedding covers the draft vocabulary only "
                          f"(markov_w1 over draft ids) is not supported")
    return listed, reduced


def draft_vocab_ids(d2t: mx.array | None, t2d: mx.array | None, draft_vocab: int, vocab: int,
                    where: str) -> mx.array | None:
    """The target token of each draft column (``i + d2t[i]``), checked, or None when there is no
    ``d2t`` and the draft vocabulary is the target's own. ``t2d``, when present, must mark
    exactly those tokens."""
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 0 < draft_vocab <= vocab:
        raise TandemError(f"{where}: draft_vocab_size must be an integer in 1..{vocab}, got {draft_vocab!r}")
    if d2t is None:
        if draft_vocab != vocab:
            raise TandemError(f"{where}: a reduced draft vocabulary ({draft_vocab} of {vocab} tokens) needs a 'd2t' tensor")
        return None
    if d2t.ndim != 1 or d2t.shape[0] != draft_vocab or not mx.issubdtype(d2t.dtype, mx.integer):
        raise TandemError(f"{where}: d2t must be {draft_vocab} integer offsets, got {d2t.dtype} {list(d2t.shape)}")
    ids = mx.arange(draft_vocab, dtype=mx.int64) + d2t.astype(mx.int64)
    lo, hi = mx.min(ids).item(), mx.max(ids).item()
    if lo < 0 or hi >= vocab:
        raise TandemError(f"{where}: d2t maps draft tokens outside the vocabulary (0..{vocab - 1}): {lo}..{hi}")
    listed = mx.zeros((vocab,), dtype=mx.int32).at[ids].add(1)
    if mx.max(listed).item() > 1:
        raise TandemError(f"{where}: d2t maps two draft tokens to the same token")
    if t2d is not None and (tuple(t2d.shape) != (vocab,) or not mx.array_equal(t2d.astype(mx.int32), listed).item()):
        raise TandemError(f"{where}: t2d does not mark the tokens d2t lists")
    return ids.astype(mx.uint32)


def vocab_tensors(ids: Sequence[int], vocab: int) -> dict[str, mx.array]:
    """``d2t`` (int64 offsets, in the order listed) and ``t2d`` (bool mask) for a draft vocabulary,
    as vLLM speculators checkpoints store it."""
    ids = [int(i) for i in ids]
    d2t = mx.array([t - i for i, t in enumerate(ids)], dtype=mx.int64)
    t2d = mx.zeros((vocab,), dtype=mx.bool_)
    t2d[mx.array(ids)] = True
    return {"d2t": d2t, "t2d": t2d}


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


def save_drafter(model: nn.Module, config: dict, out_dir: str | Path, *, dtype: str | None = None,
                 extra: dict[str, mx.array] | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the DeepSpec/z-lab on-disk format
    (``extra``: tensors saved as they are, e.g. ``d2t``/``t2d``)."""
    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
        raise TandemError("save the drafter before quantizing it: checkpoints hold float weights")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cast = getattr(mx, dtype) if dtype else None
    skip = TARGET_EMBEDDING_KEYS if config.get("use_target_embeddings") else ()
    weights = {k: (v.astype(cast) if cast is not None and mx.issubdtype(v.dtype, mx.floating) else v)
               for k, v in tree_flatten(model.parameters()) if k not in skip}
    weights.update(extra or {})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    saved = dict(config)
    saved["torch_dtype"] = dtype or str(next(v for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)).dtype
                                        ).removeprefix("mlx.core.")
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
    return out
