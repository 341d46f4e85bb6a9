"""GGUF -> mlx-lm folder converter for the ``llama`` and ``qwen2`` architectures.

Writes ``config.json``, ``model.safetensors`` (dense), ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json`` and ``tandem.json`` (provenance).
Facts behind the choices are in spec/models.md §2.2–2.3. Pure numpy + gguf + tokenizers:
no MLX import here, so a conversion can run anywhere.

Every tensor type is dequantized with ``gguf.quants.dequantize`` (numpy, K-quants included).
An ``mx.load`` fast path for Q4_0/Q4_1/Q8_0 was measured and not taken: on the CPU backend
``mx.dequantize`` with the GGUF's fp16 scales (2.5 s) is slower than numpy (2.2 s) for SmolLM2.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from engine.errors import TandemError
from engine.paths import cache_root

try:
    import fcntl
except ImportError:  # Windows: conversions there are not guarded against a concurrent process
    fcntl = None  # type: ignore[assignment]

CONVERTER_VERSION = 2  # bump when the output changes: old cache entries are then ignored
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
PathLike = Union[str, os.PathLike]

# GGUF block-level names -> HF/mlx-lm names (the ".weight"/".bias" suffix is kept).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# Pre-tokenizer regexes, as in the HF tokenizer.json files of these model families.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> pre-tokenizer family (names as written by llama.cpp's converter).
_PRE_FAMILIES = {
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
}
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


def _fail(path: PathLike, problem: str) -> TandemError:
    return TandemError(f"{path}: {problem}")


# --------------------------------------------------------------------------- reading


def read_gguf(path: PathLike):
    """Open a GGUF with ``gguf.GGUFReader``; any parse failure or truncation -> TandemError."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise _fail(path, "no such GGUF file")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on bad bytes
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _fail(path, f"not a valid GGUF file (truncated or corrupt: {msg})") from None
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise _fail(path, f"truncated GGUF: tensor data needs {end} bytes, file has {size}")
    return reader


def gguf_metadata(reader) -> dict[str, Any]:
    """All key/value fields (except the GGUF.* header fields) as Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _require(meta: dict, key: str, path: PathLike) -> Any:
    if key not in meta:
        raise _fail(path, f"missing GGUF metadata key '{key}'")
    return meta[key]


# --------------------------------------------------------------------------- weights


def hf_tensor_name(gguf_name: str) -> Optional[str]:
    """Map a GGUF tensor name to its mlx-lm name; None if it is not part of the model."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (done so it can use interleaved RoPE).

    llama.cpp applies ``reshape(n_head, 2, rows//n_head//2, ...).swapaxes(1, 2)``; this is the
    inverse. It acts on output rows only, so it works on weights and biases alike.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor) -> np.ndarray:
    """Dense float32 numpy array, HF layout (out_features, in_features), for any GGML type."""
    from gguf import quants

    w = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF dims are ne0-first
    return np.asarray(w, dtype=np.float32).reshape(shape)


def storage_dtype(reader) -> np.dtype:
    """float16 when every matrix is quantized or F16 (no precision to lose; half the disk),
    float32 when any matrix is stored as F32/BF16/F64 in the GGUF."""
    from gguf import GGMLQuantizationType as T

    wide = {T.F32, T.BF16, T.F64}
    if any(len(t.shape) >= 2 and t.tensor_type in wide for t in reader.tensors):
        return np.dtype(np.float32)
    return np.dtype(np.float16)


def _to_storage(w: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype == np.float16:
        with np.errstate(over="ignore"):
            w16 = w.astype(np.float16)
        if np.isfinite(w16).all():
            return w16
    return w.astype(np.float32, copy=False)  # keep float32 where float16 would overflow


def convert_weights(reader, config: dict, path: PathLike = "") -> dict[str, np.ndarray]:
    """All model tensors, renamed, Q/K un-permuted for llama, in the storage dtype."""
    dtype = storage_dtype(reader)
    arch = config["model_type"]
    jobs = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # folded into config["rope_scaling"]
            continue
        name = hf_tensor_name(t.name)
        if name is None:
            raise _fail(path, f"unsupported tensor '{t.name}' for architecture '{arch}'")
        n_head = None
        if arch == "llama" and ".self_attn.q_proj." in name:
            n_head = config["num_attention_heads"]
        elif arch == "llama" and ".self_attn.k_proj." in name:
            n_head = config["num_key_value_heads"]
        jobs.append((name, t, n_head))

    def one(job):
        name, t, n_head = job
        w = dequantize_tensor(t)
        return name, _to_storage(w if n_head is None else unpermute_qk(w, n_head), dtype)

    # numpy releases the GIL in the dequant kernels: threads cut SmolLM2 from 1.9 s to 1.2 s.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return dict(pool.map(one, jobs))


# --------------------------------------------------------------------------- config


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float, path: PathLike) -> dict:
    """Recover HF's llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor.

    GGUF keeps only the per-dimension factors; the four HF parameters are recovered by
    checking the (universal in Llama 3.x) defaults against the stored factors.
    """
    factor = float(freqs.max())
    low, high, orig = 1.0, 4.0, 8192
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth))
    )
    if expected.shape != freqs.shape or not np.allclose(expected, freqs, rtol=1e-3):
        raise _fail(path, "unsupported rope_freqs tensor (not llama3-style RoPE scaling)")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


def _rope_scaling(meta: dict, arch: str, path: PathLike) -> Optional[dict]:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(_require(meta, f"{arch}.rope.scaling.factor", path))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        orig = int(_require(meta, f"{arch}.rope.scaling.original_context_length", path))
        return {"type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    raise _fail(path, f"unsupported RoPE scaling type '{kind}'")


def hf_config(meta: dict, reader, path: PathLike = "") -> dict:
    """mlx-lm ``config.json`` from the ``{arch}.*`` keys and the tensor list."""
    arch = _require(meta, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _fail(path, f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    get = lambda key: _require(meta, f"{arch}.{key}", path)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or None
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": False,  # Q/K rows are un-permuted instead
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    head_dim = int(meta.get(f"{arch}.rope.dimension_count", hidden // n_heads))
    if arch == "llama":
        config["head_dim"] = head_dim
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    elif head_dim != hidden // n_heads:
        raise _fail(path, f"qwen2 head_dim {head_dim} != hidden/heads; not supported by mlx-lm qwen2")
    scaling = _rope_scaling(meta, arch, path)
    if "rope_freqs.weight" in tensors:
        freqs = dequantize_tensor(tensors["rope_freqs.weight"]).reshape(-1)
        scaling = _llama3_rope_scaling(freqs, head_dim, config["rope_theta"], path)
    if scaling:
        config["rope_scaling"] = scaling
    for key in ("bos", "eos", "padding"):
        if (tid := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(tid)
    eos = _stop_token_ids(meta)
    if len(eos) > 1:
        config["eos_token_id"] = eos
    return config


# Control tokens that llama.cpp treats as end-of-generation by their text (llama-vocab.cpp).
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"}


def _stop_token_ids(meta: dict) -> list[int]:
    """eos first, then eot/eom, then control tokens llama.cpp also stops at (e.g. Qwen's
    <|endoftext|> next to <|im_end|>, as in HF's generation_config)."""
    ids = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom") if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type") or []
    ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_CONTROL and t in _EOG_TEXTS]
    return list(dict.fromkeys(ids))


# --------------------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre: str, path: PathLike):
    from tokenizers import Regex, pre_tokenizers as pt

    family = _PRE_FAMILIES.get(pre)
    if family == "digits":  # HF SmolLM2/StarCoder: each digit is its own pre-token
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if family in ("qwen2", "llama3"):
        regex = _QWEN2_REGEX if family == "qwen2" else _LLAMA3_REGEX
        return pt.Sequence(
            [
                pt.Split(Regex(regex), behavior="isolated", invert=False),
                pt.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if family == "gpt2":
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    raise _fail(path, f"unsupported tokenizer pre-tokenizer '{pre}' (supported: {', '.join(sorted(_PRE_FAMILIES))})")


def build_tokenizer(meta: dict, path: PathLike = ""):
    """A byte-level BPE ``tokenizers.Tokenizer`` equivalent to the GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        raise _fail(path, "missing tokenizer metadata (tokenizer.ggml.model / tokens)")
    if model != "gpt2":
        raise _fail(path, f"unsupported tokenizer model '{model}' (only byte-level BPE 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise _fail(path, "missing tokenizer metadata (tokenizer.ggml.merges)")
    pre = str(meta.get("tokenizer.ggml.pre", "gpt2"))
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=_PRE_FAMILIES.get(pre) == "llama3",  # as llama.cpp does for llama3
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre, path)
    tok.decoder = decoders.ByteLevel()
    # Ids are preserved: these tokens already exist in the vocab.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    )
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[int(bos_id)]
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    return tok


def tokenizer_configs(meta: dict, context_length: int) -> tuple[dict, dict]:
    """(tokenizer_config.json, special_tokens_map.json) contents."""
    tokens = meta["tokenizer.ggml.tokens"]
    special = {}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= int(tid) < len(tokens):
            special[name] = tokens[int(tid)]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context_length),
        **special,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config, special


# --------------------------------------------------------------------------- conversion


def convert_gguf(gguf_path: PathLike, out_dir: PathLike, *, sources: Optional[list[str]] = None) -> Path:
    """Convert one GGUF file into an mlx-lm folder at ``out_dir`` (created; not atomic).

    ``sources`` names the original files in tandem.json when ``gguf_path`` is an assembled copy.
    """
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = read_gguf(gguf_path)
    meta = gguf_metadata(reader)
    config = hf_config(meta, reader, gguf_path)
    tokenizer = build_tokenizer(meta, gguf_path)  # before the slow part: fail fast
    weights = convert_weights(reader, config, gguf_path)
    dtypes = {str(w.dtype) for w in weights.values()}
    config["torch_dtype"] = "float16" if dtypes == {"float16"} else "float32"

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "mlx"})
    del weights
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tok_config, special_map = tokenizer_configs(meta, config["max_position_embeddings"])
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    _write_json(
        out_dir / "tandem.json",
        {
            "converter_version": CONVERTER_VERSION,
            "sources": sources or [str(gguf_path.resolve())],
            "name": meta.get("general.name") or gguf_path.stem,
            "gguf_file_type": meta.get("general.file_type"),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )
    return out_dir


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def assemble_parts(parts: Sequence[PathLike], dest: PathLike, expected_size: Optional[int] = None) -> Path:
    """Concatenate split-GGUF part files in order into ``dest`` (atomically)."""
    parts = [Path(p) for p in parts]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise TandemError(f"{missing[0]}: GGUF part file not found")
    total = sum(p.stat().st_size for p in parts)
    if expected_size is not None and total != expected_size:
        raise TandemError(
            f"{parts[0].parent}: GGUF parts add up to {total} bytes, expected {expected_size} (incomplete install?)"
        )
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, length=16 << 20)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


# --------------------------------------------------------------------------- cache


def converted_root() -> Path:
    return cache_root() / "converted"


def _cache_key(files: Iterable[Path]) -> str:
    # Stat-based identity: instant, and a replaced/updated file gets a new key.
    h = hashlib.sha256(f"tandem-gguf-v{CONVERTER_VERSION}".encode())
    for p in files:
        st = p.stat()
        h.update(f"\0{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def converted_path(source: Union[PathLike, Sequence[PathLike]], name: Optional[str] = None) -> Path:
    """Where the conversion of ``source`` (one GGUF or an ordered list of parts) is cached."""
    files = [Path(source)] if isinstance(source, (str, os.PathLike)) else [Path(p) for p in source]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise TandemError(f"{missing[0]}: no such GGUF file")
    stem = name or files[0].name.removesuffix(".gguf")
    return converted_root() / f"{_safe_name(stem)}-{_cache_key(files)}"


def is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def ensure_converted(
    source: Union[PathLike, Sequence[PathLike]],
    *,
    name: Optional[str] = None,
    expected_size: Optional[int] = None,
) -> Path:
    """The cached mlx-lm folder for a GGUF (or ordered split parts), converting on first use.

    The conversion is built in a temp folder next to the cache and renamed into place, so an
    interrupted run never leaves a half folder; a second call returns at once. Conversions of one
    model hold a file lock, so a process that finds no conversion waits for one that is making it
    and takes its result, and a finished conversion is never taken for a damaged one and deleted.
    """
    target = converted_path(source, name)
    files = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    sources = [str(Path(p).resolve()) for p in files]
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target):
        if is_converted(target):  # another process finished it while we looked or waited
            return target
        if target.exists():  # damaged by hand (or by a crash); rebuild
            shutil.rmtree(target, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            if isinstance(source, (str, os.PathLike)):
                gguf_file = Path(source)
            else:  # assembled only for the conversion; the parts stay the source of truth
                gguf_file = assemble_parts(source, work / "assembled.gguf", expected_size)
            out = convert_gguf(gguf_file, work / "model", sources=sources)
            if gguf_file.parent == work:
                gguf_file.unlink()
            try:
                os.rename(out, target)
            except OSError:
                if not is_converted(target):  # an unlocked process (no flock) won the race
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _prune_stale(target, sources)
    return target


@contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` for the conversions of ``target``'s model (every cache key of
    its name, so pruning stale siblings is covered too). Without fcntl (Windows) or where the
    filesystem refuses locks, go on unlocked: a lost race then costs a second conversion."""
    if fcntl is None:
        yield
        return
    locks = target.parent / ".locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{target.name.rsplit('-', 1)[0]}.lock", "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            locked = True
        except OSError:  # ENOLCK / EOPNOTSUPP on some network filesystems
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _prune_stale(target: Path, sources: list[str]) -> None:
    """Delete older conversions of the same source files (changed file, older converter)."""
    for old in target.parent.glob(f"{target.name.rsplit('-', 1)[0]}-*"):
        if old == target or old.name.startswith(".") or not old.is_dir():
            continue
        try:
            info = json.loads((old / "tandem.json").read_text())
            same = (info.get("sources") or [info.get("source")]) == sources  # v1 wrote "source"
        except (OSError, ValueError):
            continue
        if same:
            shutil.rmtree(old, ignore_errors=True)
