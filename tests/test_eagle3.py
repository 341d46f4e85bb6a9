"""EAGLE-3 heads (--mode eagle3): speculators and SafeAILab/SpecForge folders in the published key
layout, with a reduced draft vocabulary (d2t), loaded strictly; the forward against a NumPy
reference; chain drafting through the one verify loop, lossless greedy and sampled output; full
blocks when every draft is right; every malformed checkpoint refused with its reason."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from engine.drafters import formats
from engine.drafters.eagle3 import Eagle3Drafter, Eagle3Model
from engine.errors import TandemError
from engine.generate import Engine
from engine.sampling import Sampler, SamplingParams, target_probs
from tests import drafter_ckpt as ck
from tests.lossless import assert_same_greedy
from tests.test_sampling import VOCAB, assert_exact, sample_paths
from tests.test_block_drafters import (_edit, bigram_engine, feed_in_rounds, first_draft_q, greedy_matches_baseline,
                                       prompts, rms, rope)
from tests.tiny import make_tiny_engine, make_tiny_model

GREEDY = Sampler(SamplingParams())
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "num_hidden_layers": 32, "vocab_size": 128256, "rms_norm_eps": 1e-5}


def write_eagle3(path: Path, engine: Engine, **kw) -> Path:
    return ck.write(path, *ck.eagle3_checkpoint(ck.target_config_of(engine.model), **kw))


def exact_eagle3(path: Path, engine: Engine, *, draft_tokens=None, sharpen: float = 1.0, **kw) -> Path:
    """A head that drafts what a bigram target would say after each token: queries and keys are
    one constant vector (q/k biases, so every row attends to itself), values pick the normed
    embedding, o_proj amplifies it over the residual, the MLP is silent, ``norm`` is the
    target's final norm (times ``sharpen``) and lm_head the target's rows for the draft tokens."""
    tc = ck.target_config_of(engine.model)
    tc.update(num_key_value_heads=tc["num_attention_heads"])  # values as wide as the hidden state
    cfg, w = ck.eagle3_checkpoint(tc, draft_tokens=draft_tokens, **kw)
    cfg["transformer_layer_config"]["attention_bias"] = True
    h, d, heads = tc["hidden_size"], tc["head_dim"], tc["num_attention_heads"]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w[f"layers.0.self_attn.{name}.weight"] *= 0
        w[f"layers.0.self_attn.{name}.bias"] = np.zeros(heads * d if name != "o_proj" else h, dtype=np.float32)
    w["layers.0.self_attn.q_proj.bias"][:] = 60.0 / math.sqrt(d)
    w["layers.0.self_attn.k_proj.bias"][:] = 60.0 / math.sqrt(d)
    w["layers.0.self_attn.v_proj.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(np.float32)
    w["layers.0.self_attn.o_proj.weight"] = 1000.0 * np.eye(h, dtype=np.float32)
    for k in w:
        if k.endswith(".weight") and "norm" in k.split(".")[-2]:
            w[k] = np.ones_like(w[k])
    w["layers.0.mlp.down_proj.weight"] *= 0
    w["fc.weight"] *= 0
    w["norm.weight"] = sharpen * np.array(engine.model.model.norm.weight, dtype=np.float32)
    tokens = draft_tokens if draft_tokens is not None else list(range(tc["vocab_size"]))
    w["lm_head.weight"] = np.array(engine.model.lm_head.weight, dtype=np.float32)[tokens]
    return ck.write(path, cfg, w)


def reference_eagle3(w: dict, cfg: dict, embeds: np.ndarray, feats: np.ndarray) -> np.ndarray:
    """Pre-norm outputs of rows (embedding of x_{t+1}, g_t) at positions 0..L-1, causal."""
    g = {k: np.array(v, dtype=np.float64) for k, v in w.items()}
    layer = cfg["transformer_layer_config"]
    eps, nh, nkv, d = layer["rms_norm_eps"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    p = "layers.0."
    normed = rms(feats, g[p + "hidden_norm.weight"], eps)
    residual = normed if cfg["norm_before_residual"] else feats
    x = np.concatenate([rms(embeds, g[p + "input_layernorm.weight"], eps), normed], axis=-1)
    n = x.shape[0]
    q = (x @ g[p + "self_attn.q_proj.weight"].T).reshape(n, nh, d)
    k = (x @ g[p + "self_attn.k_proj.weight"].T).reshape(n, nkv, d)
    v = (x @ g[p + "self_attn.v_proj.weight"].T).reshape(n, nkv, d)
    pos = np.arange(n)
    q, k = rope(q, pos, layer["rope_theta"]), rope(k, pos, layer["rope_theta"])
    out = np.zeros((n, nh, d))
    for j in range(nh):
        s = q[:, j] @ k[:, j // (nh // nkv)].T / math.sqrt(d)
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        out[:, j] = (s / s.sum(-1, keepdims=True)) @ v[:, j // (nh // nkv)]
    x = residual + out.reshape(n, nh * d) @ g[p + "self_attn.o_proj.weight"].T
    h2 = rms(x, g[p + "post_attention_layernorm.weight"], eps)
    a = h2 @ g[p + "mlp.gate_proj.weight"].T
    return x + ((a / (1 + np.exp(-a))) * (h2 @ g[p + "mlp.up_proj.weight"].T)) @ g[p + "mlp.down_proj.weight"].T


# ----------------------------------------------------------------------------------------
# format
# ----------------------------------------------------------------------------------------
def test_model_uses_the_published_names_and_both_layouts_load_alike(tmp_path):
    cfg = ck.eagle3_config(dict(LLAMA_8B), draft_vocab=32000)
    parsed = formats.parse_eagle3_config(cfg, 32)
    assert parsed.aux_layer_ids == (2, 16, 29) and parsed.tap_layers == (1, 15, 28)  # vLLM's default
    assert parsed.speculative_tokens == 5 and parsed.norm_before_residual
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(Eagle3Model(parsed).parameters())}
    assert shapes == ck.eagle3_keys(cfg["transformer_layer_config"], target_hidden=4096, draft_vocab=32000)
    assert shapes["fc.weight"] == (4096, 3 * 4096) and shapes["layers.0.self_attn.q_proj.weight"] == (4096, 8192)
    # The speculators folder and the same weights in SafeAILab's flat layout (midlayer.*).
    engine = make_tiny_engine("qwen3", seed=2)
    tc = ck.target_config_of(engine.model)
    spec = write_eagle3(tmp_path / "spec", engine, draft_tokens=range(0, 96, 2), aux=[1, 2, 3])
    weights = {k: v for k, v in mx.load(str(spec / "model.safetensors")).items()}
    weights["verifier_lm_head.weight"] = mx.zeros((96, 64))  # kept by some exports; not the drafter's
    mx.save_safetensors(str(spec / "model.safetensors"), weights)
    flat_cfg, _ = ck.eagle3_checkpoint(tc, draft_tokens=range(0, 96, 2), aux=[1, 2, 3], layout="safeailab")
    flat_cfg["norm_before_residual"] = True
    flat = ck.write(tmp_path / "flat", flat_cfg, {k.replace("layers.0.", "midlayer."): np.array(v)
                                                 for k, v in weights.items() if not k.startswith("verifier")})
    (a, ids_a), (b, ids_b) = (formats.load_eagle3(p, engine.target) for p in (spec, flat))
    assert ids_a.tolist() == ids_b.tolist() == list(range(0, 96, 2))
    for (ka, va), (kb, vb) in zip(sorted(tree_flatten(a.parameters())), sorted(tree_flatten(b.parameters()))):
        assert ka == kb and mx.array_equal(va, vb).item()


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_forward_matches_numpy_with_rows_fed_as_the_loop_commits(tmp_path, norm_before_residual):
    engine = make_tiny_engine("qwen3", seed=3)
    listed = [int(t) for t in np.random.default_rng(0).permutation(96)[:60]]
    path = write_eagle3(tmp_path / "e", engine, draft_tokens=listed, aux=[1, 2, 3], scale=0.2,
                        norm_before_residual=norm_before_residual)
    engine.drafter_path = str(path)
    drafter = engine.drafter("eagle3")
    assert isinstance(drafter, Eagle3Drafter) and drafter.tap_layers == (0, 1, 2)
    target = engine.target
    target.set_taps(drafter.tap_layers)
    ids = [5, 9, 17, 4, 33, 60, 2, 8, 71, 13, 40, 41, 42, 7, 19]
    done = feed_in_rounds(target, drafter, ids)
    draft = drafter.propose(ids[: done + 1], 4, GREEDY)
    assert [c.offset for c in drafter._caches] == [done]
    w = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    cfg = json.loads((path / "config.json").read_text())
    table = np.array(engine.model.model.embed_tokens.weight, dtype=np.float64)
    _, taps = target.forward(mx.array([ids[:done]]), target.new_cache(), tap=True)
    embeds = table[ids[1 : done + 1]]
    g = np.array(taps, dtype=np.float64) @ w["fc.weight"].astype(np.float64).T  # committed rows: fc(taps)
    tokens = []
    for _ in range(4):
        out = reference_eagle3(w, cfg, embeds, g)
        logits = rms(out[-1], w["norm.weight"].astype(np.float64), 1e-5) @ w["lm_head.weight"].astype(np.float64).T
        tokens.append(listed[int(np.argmax(logits))])  # draft id i is token i + d2t[i]
        embeds, g = np.concatenate([embeds, table[tokens[-1]][None]]), np.concatenate([g, out[-1][None]])  # chain: own output
    assert draft.tokens.tolist() == tokens and set(tokens) <= set(listed)


# ----------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------
def test_greedy_output_identical_to_baseline(tmp_path):
    random_engine = make_tiny_engine("llama", seed=6)
    random_engine.drafter_path = str(write_eagle3(tmp_path / "r", random_engine, aux=[1, 2, 3], scale=0.3,
                                                  draft_tokens=range(2, 90)))
    near = bigram_engine(seed=8, vocab=48, scale=1.5)
    near.drafter_path = str(exact_eagle3(tmp_path / "n", near, draft_tokens=list(range(47, 7, -1)), aux=[1, 2]))
    for engine in (random_engine, near):
        drafted, accepted = greedy_matches_baseline(engine, "eagle3", (1, 3, 5))
        assert drafted > 0
    assert 0 < accepted < drafted  # tokens outside the draft vocabulary are rejected


def test_an_exact_head_has_every_draft_accepted_in_full_blocks(tmp_path):
    engine = bigram_engine(seed=5)
    engine.drafter_path = str(exact_eagle3(tmp_path / "exact", engine, aux=[1, 2]))
    for ids in ([3, 4, 5], [17], [9, 30, 2]):
        base = engine.generate(ids, mode="baseline", max_new_tokens=40)
        res = engine.generate(ids, mode="eagle3", max_new_tokens=40, max_draft=0)  # 0: the head's own depth (5)
        assert res.token_ids == base.token_ids
        assert res.drafted > 0 and res.accepted == res.drafted
        assert all(d == 5 for d, _ in res.rounds[1:-1])
        assert res.target_forwards <= 1 + -(-(base.generated - 1) // 6)


def test_sampled_tokens_are_exact_samples_of_the_target(tmp_path):
    """Through the real loop (tests/test_sampling.py's check: every token against the target's
    exact conditional, by draft position and previous token); q is sharper than p and zero on the
    token outside the draft vocabulary, which the target still produces (rejections)."""
    engine = bigram_engine(seed=5, vocab=VOCAB, scale=2.0)
    listed, unlisted = [7, 6, 5, 4, 3, 2, 0], [1]
    engine.drafter_path = str(exact_eagle3(tmp_path / "sharp", engine, draft_tokens=listed, sharpen=1.2, aux=[1, 2]))
    drafter = engine.drafter("eagle3")
    params = SamplingParams(temperature=1.0, top_p=0.95)
    tally = sample_paths(engine.model, drafter, params, target=engine.target)
    assert_exact(tally)
    assert tally.observed[..., unlisted].sum() > 30  # produced through rejections only
    q = first_draft_q(engine.target, drafter, [3, 4], params)
    p = np.array(target_probs(engine.model(mx.array([[4]]))[0, -1], params))
    assert q[unlisted].sum() == 0 and abs(q.sum() - 1) < 1e-5 and 0.5 * np.abs(q - p).sum() > 0.03


# ----------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------
def _refusal(engine: Engine, path, mode: str = "eagle3") -> str:
    engine.drafter_path = str(path)
    with pytest.raises(TandemError) as err:
        engine.generate([5, 6, 7], mode=mode, max_new_tokens=3)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def _weights(path: Path, **changes) -> Path:
    w = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    for k, v in changes.items():
        if v is None:
            w.pop(k.replace("__", "."), None)
        else:
            w[k.replace("__", ".")] = v
    ck.write(path, json.loads((path / "config.json").read_text()), w)
    return path


def test_every_malformed_checkpoint_is_refused_with_its_reason(tmp_path):
    engine = make_tiny_engine("qwen3", seed=9)  # 4 layers, H=64, vocab 96
    ok = lambda name, **kw: write_eagle3(tmp_path / name, engine, aux=[1, 2, 3], draft_tokens=range(10, 74), **kw)  # noqa: E731
    other = make_tiny_model("qwen3", seed=1, hidden=32)
    assert "hidden size mismatch" in _refusal(engine, ck.write(tmp_path / "h", *ck.eagle3_checkpoint(
        ck.target_config_of(other), aux=[1, 2, 3])))
    small = make_tiny_model("qwen3", seed=1, vocab=64)
    assert "vocab mismatch" in _refusal(engine, ck.write(tmp_path / "v", *ck.eagle3_checkpoint(
        ck.target_config_of(small), aux=[1, 2, 3])))
    p = ok("range"); _edit(p, eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    assert "out of range for a 4-layer target" in _refusal(engine, p)
    p = ok("zero"); _edit(p, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    assert "out of range" in _refusal(engine, p)
    p = ok("repeat"); _edit(p, eagle_aux_hidden_state_layer_ids=[1, 1, 2])
    assert "repeat a layer" in _refusal(engine, p)
    p = ok("d2t_range"); _weights(p, d2t=np.full(64, 90, dtype=np.int64))
    assert "d2t maps draft tokens outside the vocabulary" in _refusal(engine, p)
    p = ok("d2t_dup"); _weights(p, d2t=-np.arange(64, dtype=np.int64))
    assert "same token" in _refusal(engine, p)
    p = ok("d2t_len"); _weights(p, d2t=np.zeros(10, dtype=np.int64))
    assert "d2t must be 64 integer offsets" in _refusal(engine, p)
    p = ok("t2d"); _weights(p, t2d=np.ones(96, dtype=bool))
    assert "t2d does not mark the tokens d2t lists" in _refusal(engine, p)
    p = ok("no_d2t"); _weights(p, d2t=None)
    assert "needs a 'd2t' tensor" in _refusal(engine, p)
    p = ok("missing"); _weights(p, layers__0__hidden_norm__weight=None)
    assert "required keys missing: layers.0.hidden_norm.weight" in _refusal(engine, p)
    p = ok("extra"); _weights(p, layers__0__self_attn__q_norm__weight=np.ones(16, np.float32))
    assert "unexpected keys: layers.0.self_attn.q_norm.weight" in _refusal(engine, p)
    p = ok("head"); _weights(p, lm_head__weight=np.zeros((60, 64), np.float32))
    assert "wrong shape for lm_head.weight" in _refusal(engine, p)
    p = ok("tokens"); _edit(p, speculators_config={"proposal_methods": [{"speculative_tokens": 0}]})
    assert "speculative_tokens must be an integer in 1..16" in _refusal(engine, p)
    # Formats and modes.
    p = ok("eagle1"); _edit(p, architectures=["LlamaForCausalLMEagle"], speculators_model_type=None, speculators_config=None)
    assert "EAGLE-1/2" in _refusal(engine, p)
    assert "is an EAGLE-3 checkpoint; use --mode eagle3" in _refusal(engine, ok("as_dspark"), mode="dspark")
    from tests.test_block_drafters import write_dspark

    assert "is a dspark checkpoint; use --mode dspark" in _refusal(engine, write_dspark(tmp_path / "ds", engine, taps=[0, 2]))
    engine.drafter_path = str(ok("auto"))
    assert engine.resolve_mode("auto") == "eagle3" and engine.mode_support()["eagle3"] is None
    assert "EAGLE-3 checkpoint (--mode eagle3)" in engine.mode_support()["dspark"]


def test_quantized_heads_stay_lossless(tmp_path, monkeypatch):
    """Metal/CUDA quantize the head (--drafter-bits): drafts change a little, output never."""
    import mlx.nn as nn

    from engine import modes, platform
    from tests.test_mtp import exact_head, write_sidecar

    engine = bigram_engine(seed=8, vocab=48, scale=1.5)
    monkeypatch.setattr(modes, "drafter_bits", lambda eng: 8)
    monkeypatch.setattr(platform, "prefers_dense_float32", lambda: False)
    for mode, path in (("eagle3", exact_eagle3(tmp_path / "e", engine, aux=[1, 2], draft_tokens=range(40))),
                       ("mtp", write_sidecar(tmp_path / "m", engine, exact_head(engine, noise=0.05)))):
        engine.drafter_path = str(path)
        drafter = engine.drafter(mode)
        assert isinstance(drafter.model.layers[0].mlp.gate_proj, nn.QuantizedLinear)
        for ids in prompts(4, 48, seed=3):
            base = engine.generate(ids, mode="baseline", max_new_tokens=12)
            res = engine.generate(ids, mode=mode, max_new_tokens=12)
            assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"quantized {mode}")


def test_auto_runs_a_registered_eagle3_head_found_in_the_hf_cache(tmp_path, monkeypatch):
    """The registry's EAGLE-3 row for Qwen3-8B, once the head is in the local HF cache (here a tiny
    one made for the tiny target that stands in for Qwen3-8B): --mode auto and --mode eagle3 use it."""
    from huggingface_hub import constants

    from engine import registry

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    engine = make_tiny_engine("qwen3", seed=2)
    engine.name = "mlx-community/Qwen3-8B-4bit"
    assert registry.auto_mode(engine) == "lookup" and "hf download RedHatAI/Qwen3-8B-speculator.eagle3" in \
        engine.mode_support()["eagle3"]
    repo = tmp_path / "hub" / "models--RedHatAI--Qwen3-8B-speculator.eagle3"
    write_eagle3(repo / "snapshots" / "abc", engine, aux=[1, 2, 3], draft_tokens=range(8, 88))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    assert registry.auto_mode(engine) == "eagle3" and engine.mode_support()["eagle3"] is None
    res = engine.generate([5, 6, 7], mode="auto", max_new_tokens=8)
    assert res.mode == "eagle3" and res.generated == 8 and res.drafted > 0
