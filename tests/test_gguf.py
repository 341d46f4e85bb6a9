"""GGUF -> mlx-lm conversion on tiny synthetic GGUFs written with gguf.GGUFWriter."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants

import engine.gguf as eg
from engine.errors import TandemError

# --------------------------------------------------------------------------- tiny models

H, F, N_HEAD, N_KV, LAYERS = 64, 128, 4, 2, 2
HEAD_DIM = H // N_HEAD
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ is", "l o", "lo w", "Ġ a"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_vocab(user_defined: tuple[str, ...] = ()) -> tuple[list[str], list[str], list[int]]:
    byte_tokens = [_bytes_to_unicode()[b] for b in range(256)]
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + byte_tokens + merged + list(user_defined)
    types = [3] * len(SPECIALS) + [1] * (len(byte_tokens) + len(merged)) + [4] * len(user_defined)
    return tokens, list(MERGES), types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation (forward direction), written out here."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q8_roundtrip(w: np.ndarray) -> np.ndarray:
    return quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)


def reference_weights(arch: str, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-layout float32 weights; the tensor that the GGUF stores as Q8_0 is pre-rounded."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": r(vocab, H), "model.norm.weight": 1 + r(H) * 0.1}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": r(N_HEAD * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": r(N_KV * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": r(N_KV * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": r(H, N_HEAD * HEAD_DIM),
            p + "mlp.gate_proj.weight": r(F, H),
            p + "mlp.up_proj.weight": r(F, H),
            p + "mlp.down_proj.weight": r(H, F),
            p + "input_layernorm.weight": 1 + r(H) * 0.1,
            p + "post_attention_layernorm.weight": 1 + r(H) * 0.1,
        }
        if arch == "qwen2":
            w |= {
                p + "self_attn.q_proj.bias": r(N_HEAD * HEAD_DIM),
                p + "self_attn.k_proj.bias": r(N_KV * HEAD_DIM),
                p + "self_attn.v_proj.bias": r(N_KV * HEAD_DIM),
            }
    if arch == "qwen2":
        w["lm_head.weight"] = r(vocab, H)
    w[_quantized_name(arch)] = q8_roundtrip(w[_quantized_name(arch)])
    return w


def _quantized_name(arch: str) -> str:
    # llama: a permuted Q matrix, so un-permuting quantized rows is covered too.
    return "model.layers.0.self_attn.q_proj.weight" if arch == "llama" else "model.layers.0.mlp.up_proj.weight"


_TO_GGUF = {v: k for k, v in eg._GLOBAL_NAMES.items()}
_TO_GGUF_BLOCK = {v: k for k, v in eg._BLOCK_NAMES.items()}


def gguf_name(hf: str) -> str:
    base, suffix = hf.rsplit(".", 1)
    if base in _TO_GGUF:
        return f"{_TO_GGUF[base]}.{suffix}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{_TO_GGUF_BLOCK[rest]}.{suffix}"


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    pre: str | None = None,
    tokenizer: bool = True,
    arch_name: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    rope_theta: float = 10000.0,
) -> dict[str, np.ndarray]:
    """Write a tiny llama/qwen2 GGUF; return the HF-layout weights it encodes."""
    tokens, merges, types = tiny_vocab(("<tool_call>",) if arch == "qwen2" else ())
    weights = reference_weights(arch, len(tokens), seed)
    a = arch_name or arch
    w = GGUFWriter(str(path), a)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(len(tokens))
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or ("qwen2" if arch == "qwen2" else "smollm"))
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for name, t in weights.items():
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, N_HEAD)
        elif arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, N_KV)
        if name == _quantized_name(arch):
            w.add_tensor(gguf_name(name), quants.quantize(t, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(t))
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def reference_config(arch: str, vocab: int) -> dict:
    """Written by hand (not taken from the converter) so config mistakes show up."""
    cfg = {
        "model_type": arch,
        "hidden_size": H,
        "num_hidden_layers": LAYERS,
        "intermediate_size": F,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": arch == "llama",
    }
    return cfg


def reference_logits(arch: str, weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    vocab = weights["model.embed_tokens.weight"].shape[0]
    model_cls, args_cls = _get_classes(reference_config(arch, vocab))
    model = model_cls(args_cls.from_dict(reference_config(arch, vocab)))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return np.array(model(mx.array([ids])))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tandem_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tandem-cache")


@pytest.fixture(scope="module", autouse=True)
def isolated_cache(tandem_cache):
    """Never touch the user's cache; module scope so module fixtures see it too."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TANDEM_CACHE_DIR", str(tandem_cache))
        yield tandem_cache


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_gguf(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    return path, write_tiny_gguf(path, "qwen2")


def one_line_error(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


# --------------------------------------------------------------------------- tests


def test_unpermute_is_inverse_of_llama_cpp_permute():
    rng = np.random.default_rng(1)
    for shape, n_head in (((64, 48), 4), ((576, 8), 9), ((192,), 3)):
        w = rng.standard_normal(shape).astype(np.float32)
        assert np.array_equal(eg.unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
        assert not np.array_equal(llama_cpp_permute(w, n_head), w)


def test_tensor_name_map():
    assert eg.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert eg.hf_tensor_name("output.weight") == "lm_head.weight"
    assert eg.hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert eg.hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert eg.hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert eg.hf_tensor_name("blk.0.ssm_a") is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_conversion_round_trips_weights_and_config(arch, tiny_llama_gguf, tiny_qwen2_gguf):
    from safetensors.numpy import load_file

    path, weights = tiny_llama_gguf if arch == "llama" else tiny_qwen2_gguf
    folder = eg.ensure_converted(path)
    stored = load_file(folder / "model.safetensors")
    assert set(stored) == set(weights)
    for name, w in weights.items():
        assert stored[name].dtype == np.float32  # F32 matrices in the source -> float32 storage
        assert np.array_equal(stored[name], w), name  # q/k un-permuted back to the originals

    config = json.loads((folder / "config.json").read_text())
    expected = reference_config(arch, weights["model.embed_tokens.weight"].shape[0])
    assert {k: config[k] for k in expected} == pytest.approx(expected)
    assert config["eos_token_id"] == [2, 0] and config["bos_token_id"] == 1  # <|im_end|>, then <|endoftext|>
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert json.loads((folder / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mlx_lm_load_gives_reference_logits(arch, tiny_llama_gguf, tiny_qwen2_gguf):
    import mlx.core as mx
    from mlx_lm.utils import load

    path, weights = tiny_llama_gguf if arch == "llama" else tiny_qwen2_gguf
    model, tokenizer = load(str(eg.ensure_converted(path)))
    ids = tokenizer.encode("the low lo is a test 42", add_special_tokens=False)
    assert len(ids) > 8
    got = np.array(model(mx.array([ids])))
    want = reference_logits(arch, weights, ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_forgetting_the_unpermute_would_change_logits(tiny_llama_gguf):
    """Guards the test above: with permuted Q/K the logits must differ (the bug is silent)."""
    _, weights = tiny_llama_gguf
    bad = dict(weights)
    for k in bad:
        if ".q_proj." in k:
            bad[k] = llama_cpp_permute(bad[k], N_HEAD)
        elif ".k_proj." in k:
            bad[k] = llama_cpp_permute(bad[k], N_KV)
    ids = [5, 60, 70, 80, 90, 100]
    assert not np.allclose(reference_logits("llama", bad, ids), reference_logits("llama", weights, ids), atol=1e-3)


def test_tokenizer_matches_gguf_vocabulary(tiny_llama_gguf, tiny_qwen2_gguf):
    from tokenizers import Tokenizer

    tokens, _, _ = tiny_vocab(("<tool_call>",))
    vocab = {t: i for i, t in enumerate(tokens)}
    smol = Tokenizer.from_file(str(eg.ensure_converted(tiny_llama_gguf[0]) / "tokenizer.json"))
    assert smol.encode("<|im_start|>hi<|im_end|>").ids == [1, vocab["h"], vocab["i"], 2]
    # smollm pre-tokenizer: every digit is its own pre-token.
    assert smol.encode("2024").ids == [vocab[c] for c in "2024"]
    assert smol.encode(" the low").ids == [vocab["Ġthe"], vocab["Ġ"], vocab["low"]]
    assert smol.decode(smol.encode(" the low 42!").ids) == " the low 42!"

    qwen = Tokenizer.from_file(str(eg.ensure_converted(tiny_qwen2_gguf[0]) / "tokenizer.json"))
    assert qwen.encode("<tool_call>").ids == [vocab["<tool_call>"]]
    assert qwen.encode("<|endoftext|>").ids == [0]
    added = {t.content: t.special for t in qwen.get_added_tokens_decoder().values()}
    assert added["<|im_end|>"] is True and added["<tool_call>"] is False
    assert qwen.decode(qwen.encode("x <tool_call> 12").ids, skip_special_tokens=False) == "x <tool_call> 12"


def test_second_conversion_hits_cache(tiny_llama_gguf, monkeypatch):
    folder = eg.ensure_converted(tiny_llama_gguf[0])

    def boom(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(eg, "convert_gguf", boom)
    start = time.perf_counter()
    assert eg.ensure_converted(tiny_llama_gguf[0]) == folder
    assert time.perf_counter() - start < 0.1
    assert folder.parent == eg.converted_root() and folder.name.startswith("tiny-llama-")


def test_changed_source_gets_a_new_cache_entry(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", seed=1)
    first = eg.ensure_converted(path)
    mtime = path.stat().st_mtime_ns
    write_tiny_gguf(path, "llama", seed=2)
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # same size; coarse clocks could repeat mtime
    second = eg.ensure_converted(path)
    assert second != first and eg.is_converted(second)
    assert not first.exists()  # the stale conversion of the same file is pruned
    assert json.loads((second / "tandem.json").read_text())["sources"] == [str(path.resolve())]


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "interrupted.gguf"
    write_tiny_gguf(path, "llama")

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(eg, "convert_weights", interrupt)
        with pytest.raises(KeyboardInterrupt):
            eg.ensure_converted(path)
    assert not [p for p in eg.converted_root().iterdir() if "interrupted" in p.name]
    assert eg.is_converted(eg.ensure_converted(path))


@pytest.mark.parametrize("keep", ["header", "data"])
def test_truncated_gguf_raises_one_line(tiny_llama_gguf, tmp_path, keep):
    data = tiny_llama_gguf[0].read_bytes()
    bad = tmp_path / f"truncated-{keep}.gguf"
    bad.write_bytes(data[:200] if keep == "header" else data[:-100])
    with pytest.raises(TandemError) as e:
        eg.ensure_converted(bad)
    one_line_error(e, str(bad), "truncated")


def test_not_a_gguf_raises(tmp_path):
    bad = tmp_path / "noise.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(TandemError) as e:
        eg.ensure_converted(bad)
    one_line_error(e, str(bad), "not a valid GGUF")


def test_unknown_architecture_raises(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_tiny_gguf(path, "llama", arch_name="gemma3")
    with pytest.raises(TandemError) as e:
        eg.ensure_converted(path)
    one_line_error(e, str(path), "unsupported architecture 'gemma3'")


def test_missing_tokenizer_metadata_raises(tmp_path):
    path = tmp_path / "notok.gguf"
    write_tiny_gguf(path, "llama", tokenizer=False)
    with pytest.raises(TandemError) as e:
        eg.ensure_converted(path)
    one_line_error(e, str(path), "missing tokenizer metadata")
    assert not [p for p in eg.converted_root().iterdir() if "notok" in p.name]


def test_unknown_pre_tokenizer_raises(tmp_path):
    path = tmp_path / "pre.gguf"
    write_tiny_gguf(path, "llama", pre="mystery-pre")
    with pytest.raises(TandemError) as e:
        eg.ensure_converted(path)
    one_line_error(e, "unsupported tokenizer pre-tokenizer 'mystery-pre'")


def test_split_parts_are_assembled_and_size_checked(tiny_qwen2_gguf, tmp_path):
    data = tiny_qwen2_gguf[0].read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for i in range(3):
        p = tmp_path / f"part{i + 1:02d}.bin"
        p.write_bytes(data[cuts[i] : cuts[i + 1]])
        parts.append(p)
    folder = eg.ensure_converted(parts, name="tiny-split", expected_size=len(data))
    assert folder.name.startswith("tiny-split-")
    assert (folder / "model.safetensors").read_bytes() == (eg.ensure_converted(tiny_qwen2_gguf[0]) / "model.safetensors").read_bytes()
    assert not list(folder.parent.glob("**/assembled.gguf"))  # the assembled copy is not kept

    with pytest.raises(TandemError) as e:
        eg.ensure_converted(parts[:2], name="tiny-split-short", expected_size=len(data))
    one_line_error(e, f"expected {len(data)}")
    with pytest.raises(TandemError) as e:
        eg.ensure_converted(list(reversed(parts)), name="tiny-split-reversed")
    one_line_error(e, "not a valid GGUF")


def llama3_rope_factors(theta: float, factor: float = 32.0) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.x (low 1, high 4, original context 8192), written out."""
    out = []
    for f in 1.0 / theta ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelen = 2 * np.pi / f
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, "llama", rope_theta=500000.0, extra_tensors={"rope_freqs.weight": llama3_rope_factors(500000.0)})
    config = json.loads((eg.ensure_converted(path) / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    odd = tmp_path / "odd-rope.gguf"
    write_tiny_gguf(odd, "llama", rope_theta=500000.0, extra_tensors={"rope_freqs.weight": np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32)})
    with pytest.raises(TandemError) as e:
        eg.ensure_converted(odd)
    one_line_error(e, str(odd), "rope_freqs")


def test_storage_is_float16_for_quantized_sources(tmp_path):
    """Real GGUFs (quantized matrices, F32 norms) are stored as float16: half the disk."""
    from safetensors.numpy import load_file

    tokens, merges, types = tiny_vocab()
    path = tmp_path / "allq.gguf"
    w = GGUFWriter(str(path), "llama")
    for fn, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, H),
                  (w.add_feed_forward_length, F), (w.add_head_count, N_HEAD), (w.add_head_count_kv, N_KV),
                  (w.add_layer_norm_rms_eps, 1e-5)):
        fn(v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((len(tokens), H)).astype(np.float32)
    w.add_tensor("token_embd.weight", quants.quantize(emb, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    stored = load_file(eg.ensure_converted(path) / "model.safetensors")
    assert {str(v.dtype) for v in stored.values()} == {"float16"}
    np.testing.assert_allclose(stored["model.embed_tokens.weight"], q8_roundtrip(emb), rtol=1e-3, atol=1e-3)


def test_concurrent_conversions_never_delete_a_finished_one(tmp_path, monkeypatch):
    """B finds no conversion, then A renames its finished one into place: B must take A's, not
    delete it as damaged (a third process may be loading it) and convert again."""
    import threading

    path = tmp_path / "raced.gguf"
    write_tiny_gguf(path, "llama")
    a_converting, b_checked, a_done = threading.Event(), threading.Event(), threading.Event()
    real_convert, real_is_converted = eg.convert_gguf, eg.is_converted
    converted_by, results = [], {}

    def convert(*args, **kw):
        converted_by.append(threading.current_thread().name)
        if threading.current_thread().name == "A":
            a_converting.set()
            b_checked.wait(5)
        return real_convert(*args, **kw)

    def is_converted(folder):
        done = real_is_converted(folder)
        if threading.current_thread().name == "B" and not b_checked.is_set():
            b_checked.set()
            a_done.wait(10)  # the forced interleaving: A finishes between B's look and B's next step
        return done

    def run(name):
        results[name] = eg.ensure_converted(path)
        if name == "A":
            a_done.set()

    monkeypatch.setattr(eg, "convert_gguf", convert)
    monkeypatch.setattr(eg, "is_converted", is_converted)
    a = threading.Thread(target=run, args=("A",), name="A")
    a.start()
    assert a_converting.wait(10)
    b = threading.Thread(target=run, args=("B",), name="B")
    b.start()
    a.join(30)
    b.join(30)
    assert results["A"] == results["B"] and real_is_converted(results["A"])
    assert converted_by == ["A"]


@pytest.mark.parametrize("flock", ["missing", "refused"])
def test_conversion_without_a_working_file_lock(tmp_path, monkeypatch, flock):
    """Windows has no fcntl, some network filesystems refuse flock: convert unlocked."""
    class Refusing:
        LOCK_EX, LOCK_UN = 2, 8

        @staticmethod
        def flock(fd, op):
            raise OSError(37, "No locks available")

    monkeypatch.setattr(eg, "fcntl", None if flock == "missing" else Refusing)
    path = tmp_path / f"unlocked-{flock}.gguf"
    write_tiny_gguf(path, "llama")
    assert eg.is_converted(eg.ensure_converted(path))
