"""Native MTP heads (--mode mtp): Qwen3.5 ``mtp.*`` tensors read from a model folder (mlx-lm's
loader drops them) or an MLX sidecar, the head's forward against a NumPy reference, the final-norm
tap, lossless greedy and sampled output through the one verify loop, full blocks when every draft
is right, and every refusal with its reason."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from engine import modes
from engine.drafters import formats
from engine.drafters.mtp import MTPDrafter
from engine.errors import TandemError
from engine.generate import Engine
from engine.sampling import Sampler, SamplingParams, target_probs
from engine.target import FINAL
from tests import drafter_ckpt as ck
from tests.lossless import assert_same_greedy
from tests.test_sampling import VOCAB, assert_exact, sample_paths
from tests.test_block_drafters import bigram_engine, feed_in_rounds, first_draft_q, greedy_matches_baseline, prompts, rms
from tests.tiny import make_tiny_engine, make_tokenizer

GREEDY = Sampler(SamplingParams())


def qwen3_5_model(tc: dict, seed: int = 0):
    from mlx_lm.models import qwen3_5 as mod

    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": tc}))
    mx.eval(model.parameters())
    model.eval()
    return model


def qwen3_5_folder(path: Path, *, seed: int = 0, mtp: bool = True, **kw) -> Path:
    """An original-checkpoint-like Qwen3.5 folder: trunk weights plus HF-layout ``mtp.*`` tensors."""

    tc = ck.qwen3_5_text_config(**kw)
    model = qwen3_5_model(tc, seed)
    extra = ck.mtp_tensors(tc, seed=seed + 1) if mtp else None
    ck.write_model_folder(path, model, {"model_type": "qwen3_5", "text_config": tc}, make_tokenizer(tc["vocab_size"]), extra)
    return path


def sidecar_config(engine: Engine) -> dict:
    """An mlx-vlm-style sidecar config describing a tiny Qwen3.5 trunk shaped like ``engine``'s."""
    a = engine.model.args
    tc = ck.qwen3_5_text_config(hidden=a.hidden_size, layers=a.num_hidden_layers, vocab=a.vocab_size)
    return {"model_type": "qwen3_5_mtp", "text_config": tc, "block_size": 3, "tie_word_embeddings": False}


def write_sidecar(path: Path, engine: Engine, weights: dict[str, np.ndarray], config: dict | None = None) -> Path:
    return ck.write(path, config or sidecar_config(engine), weights)


def is_norm(key: str) -> bool:
    """norm, pre_fc_norm_embedding, pre_fc_norm_hidden, input_layernorm, q_norm ... weights."""
    return "norm" in key.split(".")[-2]


def exact_head(engine: Engine, *, sharpen: float = 1.0, noise: float = 0.0, seed: int = 0) -> dict[str, np.ndarray]:
    """MLX-layout head weights that reproduce a bigram target: fc keeps the normed embedding, the
    layer adds nothing, ``norm`` is the target's final norm (times ``sharpen``), so the head's
    logits after token x are the target's own (scaled)."""
    tc = sidecar_config(engine)["text_config"]
    h = tc["hidden_size"]
    w = {k: v for k, v in ck.mtp_tensors(tc, seed=seed, prefix="").items()}
    for k in w:
        if is_norm(k):
            w[k] = np.ones_like(w[k])
    w["fc.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(np.float32)
    w["norm.weight"] = sharpen * np.array(engine.model.model.norm.weight, dtype=np.float32)
    w["layers.0.self_attn.o_proj.weight"] *= 0
    w["layers.0.mlp.down_proj.weight"] *= 0
    if noise:
        rng = np.random.default_rng(seed)
        w["fc.weight"] = w["fc.weight"] + noise * rng.standard_normal(w["fc.weight"].shape).astype(np.float32)
    return w


# ----------------------------------------------------------------------------------------
# NumPy reference of the Qwen3.5 MTP head (HF layout: zero-centred norms)
# ----------------------------------------------------------------------------------------
def partial_rope(x: np.ndarray, pos: np.ndarray, theta: float, dims: int) -> np.ndarray:
    half = dims // 2
    freq = theta ** (-np.arange(0, dims, 2) / dims)
    ang = pos[:, None, None] * freq[None, None, :]
    x1, x2 = x[..., :half], x[..., half:dims]
    rot = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)
    return np.concatenate([rot, x[..., dims:]], axis=-1)


def reference_mtp(w: dict, tc: dict, embeds: np.ndarray, feats: np.ndarray) -> np.ndarray:
    """Rows (embedding of x_{t+1}, feature h_t) at positions 0..L-1, causal -> normed outputs."""
    g = {k.removeprefix("mtp."): np.array(v, dtype=np.float64) for k, v in w.items()}
    for k in g:  # the HF layout stores norm weights zero-centred
        if is_norm(k):
            g[k] = g[k] + 1.0
    eps, nh, nkv, d = tc["rms_norm_eps"], tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    rope = tc["rope_parameters"]
    dims = int(d * rope["partial_rotary_factor"])
    n = embeds.shape[0]
    x = np.concatenate([rms(embeds, g["pre_fc_norm_embedding.weight"], eps), rms(feats, g["pre_fc_norm_hidden.weight"], eps)], -1)
    x = x @ g["fc.weight"].T
    p = "layers.0."
    h = rms(x, g[p + "input_layernorm.weight"], eps)
    qg = (h @ g[p + "self_attn.q_proj.weight"].T).reshape(n, nh, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(n, nh * d)
    k = (h @ g[p + "self_attn.k_proj.weight"].T).reshape(n, nkv, d)
    v = (h @ g[p + "self_attn.v_proj.weight"].T).reshape(n, nkv, d)
    q, k = rms(q, g[p + "self_attn.q_norm.weight"], eps), rms(k, g[p + "self_attn.k_norm.weight"], eps)
    pos = np.arange(n)
    q, k = partial_rope(q, pos, rope["rope_theta"], dims), partial_rope(k, pos, rope["rope_theta"], dims)
    out = np.zeros((n, nh, d))
    for j in range(nh):
        s = q[:, j] @ k[:, j // (nh // nkv)].T / math.sqrt(d)
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        out[:, j] = (s / s.sum(-1, keepdims=True)) @ v[:, j // (nh // nkv)]
    x = x + (out.reshape(n, nh * d) * (1 / (1 + np.exp(-gate)))) @ g[p + "self_attn.o_proj.weight"].T
    h2 = rms(x, g[p + "post_attention_layernorm.weight"], eps)
    a = h2 @ g[p + "mlp.gate_proj.weight"].T
    x = x + ((a / (1 + np.exp(-a))) * (h2 @ g[p + "mlp.up_proj.weight"].T)) @ g[p + "mlp.down_proj.weight"].T
    return rms(x, g["norm.weight"], eps)


# ----------------------------------------------------------------------------------------
# layout, tap, forward
# ----------------------------------------------------------------------------------------
def test_head_has_the_published_layout():
    # Qwen3.5-9B-like: 15 dense tensors, gated q_proj [2*nq*hd, H]
    tc = dict(ck.qwen3_5_text_config(hidden=4096, layers=32, vocab=248320), num_attention_heads=16, num_key_value_heads=4,
              head_dim=256, intermediate_size=12288)
    head = formats.new_mtp_head({"model_type": "qwen3_5", "text_config": tc})
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(head.parameters())}
    assert shapes == {k.removeprefix("mtp."): s for k, s in ck.mtp_keys(tc).items()} and len(shapes) == 15
    assert shapes["layers.0.self_attn.q_proj.weight"] == (8192, 4096) and shapes["fc.weight"] == (4096, 8192)
    # MoE (35B-A3B-like, fused experts in the HF files): converted to mlx-lm's switch_mlp.
    moe = ck.qwen3_5_text_config(experts=4)
    head = formats.new_mtp_head({"model_type": "qwen3_5_moe", "text_config": moe})
    tensors = {k: mx.array(v) for k, v in ck.mtp_tensors(moe).items()}
    formats.check_weights(head, formats._mtp_weights(tensors, "moe"), "moe")
    # Per-expert tensors (the other HF export) give the same stacked weights.
    fused = formats._mtp_weights(tensors, "moe")
    per_expert = {k: v for k, v in tensors.items() if ".experts." not in k}
    gate_up, down = tensors["mtp.layers.0.mlp.experts.gate_up_proj"], tensors["mtp.layers.0.mlp.experts.down_proj"]
    for e in range(4):
        gate, up = mx.split(gate_up[e], 2, axis=0)
        per_expert.update({f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight": gate,
                           f"mtp.layers.0.mlp.experts.{e}.up_proj.weight": up,
                           f"mtp.layers.0.mlp.experts.{e}.down_proj.weight": down[e]})
    split = formats._mtp_weights(per_expert, "moe")
    assert set(split) == set(fused) and all(mx.array_equal(split[k], fused[k]).item() for k in fused)


def test_final_norm_tap_is_the_lm_head_input(tmp_path):
    engine = make_tiny_engine("qwen3", seed=1)
    target = engine.target
    target.set_taps([1, FINAL])
    ids = mx.array([[4, 8, 15, 16, 23]])
    logits, hidden = target.forward(ids, target.new_cache(), tap=True)
    final = hidden[:, 64:]
    assert mx.allclose(target.head(final), logits, atol=1e-4).item()
    assert mx.allclose(final, engine.model.model(ids)[0], atol=1e-5).item()  # the trunk's normed output
    assert mx.allclose(logits[None], engine.model(ids), atol=1e-4).item()  # logits unchanged by the tap
    target.clear_taps()
    assert isinstance(engine.model.model.norm, nn.RMSNorm)  # no tap proxy left (CPU: compiled in place)


def test_forward_matches_numpy_with_rows_fed_as_the_loop_commits(tmp_path):
    from engine.api import load

    engine = load(str(qwen3_5_folder(tmp_path / "q35")))
    drafter = engine.drafter("mtp")
    assert isinstance(drafter, MTPDrafter) and drafter.tap_layers == (FINAL,)
    target = engine.target
    target.set_taps(drafter.tap_layers)
    ids = [5, 9, 17, 4, 33, 60, 2, 8, 71, 13, 40, 41, 42, 7, 19]
    done = feed_in_rounds(target, drafter, ids)  # rows 0..done-1: the last pairs h_{done-1} with the anchor
    draft = drafter.propose(ids[: done + 1], 3, GREEDY)
    assert [c.offset for c in drafter._caches] == [done]  # chain rows trimmed, committed rows kept
    # Reference: every row from scratch, then the chain on its own outputs.
    weights = {k: np.array(v) for k, v in mx.load(str(tmp_path / "q35" / "model.safetensors")).items() if k.startswith("mtp.")}
    tc = engine.loaded.config["text_config"]
    table = np.array(engine.model.language_model.model.embed_tokens.weight, dtype=np.float64)
    _, feats = target.forward(mx.array([ids[:done]]), target.new_cache(), tap=True)
    embeds, feats = table[ids[1 : done + 1]], np.array(feats, dtype=np.float64)
    head_w = np.array(engine.model.language_model.lm_head.weight, dtype=np.float64)
    tokens = []
    for _ in range(3):
        out = reference_mtp(weights, tc, embeds, feats)
        tokens.append(int(np.argmax(head_w @ out[-1])))
        embeds, feats = np.concatenate([embeds, table[tokens[-1]][None]]), np.concatenate([feats, out[-1][None]])
    assert draft.tokens.tolist() == tokens
    seed = np.array(drafter._seed, dtype=np.float64)
    want = reference_mtp(weights, tc, table[ids[1 : done + 1]], np.array(target.forward(
        mx.array([ids[:done]]), target.new_cache(), tap=True)[1], dtype=np.float64))[-1]
    assert np.abs(seed - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    with pytest.raises(RuntimeError, match="out of step"):
        drafter.propose(ids[: done + 1] + [3, 4], 2, GREEDY)


def test_norm_layout_is_read_from_the_values(tmp_path):
    """``mtp.*`` tensors with zero-centred norms (HF) and the same head with its norms stored
    shifted (an MLX folder keeping the HF key names) draft with the same logits; a head whose
    norms disagree is refused with its reason, never guessed; ``tandem doctor`` says which."""
    from engine.api import load
    from engine.doctor import model_rows

    hf = qwen3_5_folder(tmp_path / "hf")
    shifted = qwen3_5_folder(tmp_path / "shifted")
    w = {k: np.array(v) for k, v in mx.load(str(shifted / "model.safetensors")).items()}
    norms = [k for k in w if k.startswith("mtp.") and is_norm(k)]
    assert len(norms) == 7

    def store(tensors: dict[str, np.ndarray]) -> None:
        mx.save_safetensors(str(shifted / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()},
                            metadata={"format": "mlx"})

    store({k: v + 1.0 if k in norms else v for k, v in w.items()})
    ids = [5, 9, 17, 4, 33, 60, 2, 8, 71, 13, 40, 41]
    logits = []
    for folder in (hf, shifted):
        engine = load(str(folder))
        drafter = engine.drafter("mtp")
        engine.target.set_taps(drafter.tap_layers)
        _, hidden = engine.target.forward(mx.array([ids]), engine.target.new_cache(), tap=True)
        drafter._caches = drafter.new_cache()
        logits.append(drafter.logits(drafter.run(mx.array(ids[1:], dtype=mx.uint32), drafter.context_features(hidden[:-1]))))
        rows = dict(model_rows(engine))
        assert rows["MTP norms"] == ("7 norms stored zero-centred (HF layout): applied as 1 + w" if folder == hf
                                     else "7 norms stored shifted (MLX layout): applied as stored")
    assert mx.abs(logits[0] - logits[1]).max().item() < 1e-4
    # Half the norms shifted: either reading changes the numbers, so the head is refused.
    mixed = {k: v + 1.0 if k in norms[::2] else v for k, v in w.items()}
    with pytest.raises(TandemError, match="cannot tell whether the MTP head's norm weights are stored zero-centred"):
        formats.load_mtp_head(engine.target, engine.loaded.config,
                              {k: mx.array(v) for k, v in mixed.items() if k.startswith("mtp.")}, where="mixed head")
    store(mixed)
    engine = load(str(shifted))
    assert dict(model_rows(engine))["MTP norms"].startswith("refused: ")
    assert "cannot tell whether" in _refused(engine)


# ----------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------
def test_greedy_output_identical_to_baseline(tmp_path):
    """A head in Qwen3.5's layout on a non-hybrid target: random (rejections at once) and a
    noisy exact head (partial acceptance, multi-token)."""
    random_engine = make_tiny_engine("qwen3", seed=6)
    random_head = formats.load_mtp_head(random_engine.target, sidecar_config(random_engine),
                                        {k: mx.array(v) for k, v in ck.mtp_tensors(
                                            sidecar_config(random_engine)["text_config"], seed=3, scale=0.3).items()},
                                        where="test head")
    random_engine.set_drafter("mtp", MTPDrafter(random_head, random_engine.target))
    near = bigram_engine(seed=8, vocab=48, scale=1.5)
    near.drafter_path = str(write_sidecar(tmp_path / "near", near, exact_head(near, noise=0.05, seed=2)))
    for engine in (random_engine, near):
        drafted, accepted = greedy_matches_baseline(engine, "mtp", (1, 2, 3))
        assert drafted > 0
    assert 0 < accepted < drafted  # the near head: both accepted and rejected drafts


def test_an_exact_head_has_every_draft_accepted_in_full_blocks(tmp_path):
    engine = bigram_engine(seed=5)
    engine.drafter_path = str(write_sidecar(tmp_path / "exact", engine, exact_head(engine)))
    for ids in ([3, 4, 5], [17], [9, 9, 30, 2]):
        base = engine.generate(ids, mode="baseline", max_new_tokens=40)
        res = engine.generate(ids, mode="mtp", max_new_tokens=40, max_draft=3)
        assert res.token_ids == base.token_ids
        assert res.drafted > 0 and res.accepted == res.drafted
        assert all(d == 3 for d, _ in res.rounds[1:-1])  # full depth every round but the length-cut last
        assert res.target_forwards <= 1 + -(-(base.generated - 1) // 4)  # 3 drafts + 1 per forward
    drafter = engine.drafter("mtp")
    assert drafter.context_len == len(ids) + sum(a + 1 for _, a in res.rounds[1:])


def test_sampled_tokens_are_exact_samples_of_the_target(tmp_path):
    """Through the real loop (tests/test_sampling.py's check: every token against the target's
    exact conditional, by draft position and previous token): the head's q is sharper than p (its
    norm scaled 1.3x), so drafts are rejected at every depth and full chains earn the bonus."""
    engine = bigram_engine(seed=5, vocab=VOCAB, scale=2.0)
    engine.drafter_path = str(write_sidecar(tmp_path / "sharp", engine, exact_head(engine, sharpen=1.3)))
    drafter = engine.drafter("mtp")
    params = SamplingParams(temperature=1.0, top_p=0.95)
    assert_exact(sample_paths(engine.model, drafter, params, target=engine.target), cap=3)
    q = first_draft_q(engine.target, drafter, [3, 4], params)
    p = np.array(target_probs(engine.model(mx.array([[4]]))[0, -1], params))
    assert abs(q.sum() - 1) < 1e-5 and 0.5 * np.abs(q - p).sum() > 0.03


# ----------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------
def _refused(engine: Engine) -> str:
    with pytest.raises(TandemError) as err:
        engine.generate([5, 6, 7], mode="mtp", max_new_tokens=3)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_every_bad_head_or_sidecar_is_refused_with_its_reason(tmp_path):
    from engine.api import load

    engine = bigram_engine(seed=5)  # qwen3, H=64, 3 layers, vocab 32
    good = exact_head(engine)

    def sidecar(name, weights=None, **config_changes):
        cfg = sidecar_config(engine)
        cfg["text_config"].update(config_changes)
        engine.drafter_path = str(write_sidecar(tmp_path / name, engine, weights if weights is not None else dict(good), cfg))
        return engine

    assert "hidden size mismatch" in _refused(sidecar("h", hidden_size=128))
    assert "vocab mismatch" in _refused(sidecar("v", vocab_size=64))
    assert "layer count mismatch" in _refused(sidecar("l", num_hidden_layers=36))
    random = {k: v for k, v in ck.mtp_tensors(sidecar_config(engine)["text_config"], seed=4, scale=0.5, prefix="").items()}
    msg = _refused(sidecar("random", random))
    assert "does not fit" in msg and "probe positions" in msg
    missing = dict(good)
    del missing["layers.0.mlp.up_proj.weight"]
    assert "required keys missing: layers.0.mlp.up_proj.weight" in _refused(sidecar("missing", missing))
    wrong = dict(good, **{"layers.0.self_attn.q_proj.weight": good["layers.0.self_attn.q_proj.weight"][:64]})
    assert "wrong shape for layers.0.self_attn.q_proj.weight" in _refused(sidecar("shape", wrong))
    assert "MTP heads with 2 layers" in _refused(sidecar("two", mtp_num_hidden_layers=2))
    fp8 = dict(good, **{"layers.0.mlp.up_proj.weight_scale_inv": np.ones((1,), np.float32)})
    assert "FP8" in _refused(sidecar("fp8", fp8))
    # A target without a head of its own: an mlx-community-style conversion, and other families.
    stripped = load(str(qwen3_5_folder(tmp_path / "stripped", mtp=False)))
    assert "ships no MTP head" in _refused(stripped) and "ships no MTP head" in modes.mode_support(stripped, ("mtp",))["mtp"]
    plain = make_tiny_engine("qwen3", seed=1)
    assert "has no MTP head we can run" in _refused(plain)
    plain.loaded = SimpleNamespace(config={"model_type": "deepseek_v4", "num_nextn_predict_layers": 1}, path=tmp_path,
                                   source=f"folder:{tmp_path}")
    assert "deepseek_v4 MTP heads are not supported" in plain.mode_support()["mtp"]
    plain.loaded.config = {"model_type": "glm4_moe", "num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    assert "ships no MTP head" in plain.mode_support()["mtp"]  # model.layers.2.* is not in the folder
    assert plain.mode_support()["eagle3"].startswith("--mode eagle3 needs an EAGLE-3 drafter")
    # --drafter naming another kind of checkpoint.
    from tests.test_block_drafters import write_dspark

    plain.loaded = None
    plain.drafter_path = str(write_dspark(tmp_path / "dspark", plain, taps=[0, 2]))
    assert "is a DSpark checkpoint (--mode dspark)" in plain.mode_support()["mtp"]


# ----------------------------------------------------------------------------------------
# a hybrid Qwen3.5 target (GatedDeltaNet + attention): the cache transaction keeps its state exact
# ----------------------------------------------------------------------------------------
def near_bigram_qwen3_5_folder(path: Path, seed: int = 4) -> Path:
    """A Qwen3.5 model folder whose layers add little (their outputs scaled 0.05), so the next token
    mostly follows the current one, with its own MTP head drafting exactly that (HF layout:
    ``mtp.`` prefix, zero-centred norms). Context still matters a little: drafts are accepted
    often, rejected sometimes, and the recurrent state must be rolled back exactly."""
    tc = ck.qwen3_5_text_config(vocab=48)
    model = qwen3_5_model(tc, seed)
    lm = model.language_model
    for layer in lm.model.layers:
        mixer = layer.linear_attn.out_proj if layer.is_linear else layer.self_attn.o_proj
        mixer.weight = 0.05 * mixer.weight
        layer.mlp.down_proj.weight = 0.05 * layer.mlp.down_proj.weight
    lm.lm_head.weight = 4.0 * lm.lm_head.weight
    mx.eval(model.parameters())
    h = tc["hidden_size"]
    head = {k: v for k, v in ck.mtp_tensors(tc, seed=seed).items()}
    for k in head:
        if is_norm(k):
            head[k] = np.zeros_like(head[k])  # 1 + 0
    head["mtp.fc.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(np.float32)
    head["mtp.norm.weight"] = np.array(lm.model.norm.weight, dtype=np.float32) - 1.0
    head["mtp.layers.0.self_attn.o_proj.weight"] *= 0
    head["mtp.layers.0.mlp.down_proj.weight"] *= 0
    return ck.write_model_folder(path, model, {"model_type": "qwen3_5", "text_config": tc}, make_tokenizer(48), head)


def test_hybrid_target_greedy_identical_to_baseline_and_auto_picks_the_head(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from engine.api import load

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # no registered drafter on disk
    engines = (load(str(qwen3_5_folder(tmp_path / "Qwen3.5-4B"))),  # a random head: rejections at once
               load(str(near_bigram_qwen3_5_folder(tmp_path / "near"))))
    assert engines[0].resolve_mode("auto") == "mtp" and engines[0].mode_support()["mtp"] is None
    from app.worker import _auto_choice  # the chat header names the registry row's drafter

    assert _auto_choice(engines[0]) == {"auto_mode": "mtp", "auto_drafter": "model:mtp"}
    for engine in engines:
        vocab = engine.loaded.config["text_config"]["vocab_size"]
        drafted = accepted = partial = 0
        for i, ids in enumerate(prompts(8, vocab, seed=13)):
            n = [2, 5, 12, 20][i % 4]
            base = engine.generate(ids, mode="baseline", max_new_tokens=n)
            for cap in (1, 3):
                res = engine.generate(ids, mode="mtp", max_new_tokens=n, max_draft=cap)
                assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"{engine.name}/prompt {i}/cap {cap}")
                drafted, accepted = drafted + res.drafted, accepted + res.accepted
                partial += sum(1 for d, a in res.rounds[1:] if 1 <= a < d)
        assert drafted > 0
    assert 0 < accepted < drafted and partial > 5  # some drafts kept, the rest rolled back out of the state
