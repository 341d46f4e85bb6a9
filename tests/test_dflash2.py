"""DFlash 2 drafters (dynamic convolutions + candidate selector) in the published key layout and
config (every layer sliding_attention, is_causal false): strict loading, the block forward and the
selector's chain against NumPy, lossless greedy and sampled output through the one verify loop
(q over the K candidates, widened with zeros), and every malformed checkpoint refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.drafters import block
from engine.drafters.checkpoint import build_drafter_model, load_checkpoint
from engine.drafters.dflash2 import DFlash2Drafter
from engine.errors import TandemError
from engine.generate import Engine
from engine.sampling import Sampler, SamplingParams, sample_from, target_probs
from tests import drafter_ckpt as ck
from tests.test_sampling import VOCAB, assert_exact, sample_paths
from tests.test_block_drafters import _refusal, bigram_engine, first_draft_q, greedy_matches_baseline, rms, rope, tapped_hidden
from tests.tiny import make_tiny_engine

GREEDY = Sampler(SamplingParams())


def write_dflash2(path: Path, engine: Engine, *, extra: dict | None = None, silent: bool = False,
                  codebook_scale: float = 1.0, **kw) -> Path:
    cfg, w = ck.dflash2_checkpoint(ck.target_config_of(engine.model), **kw)
    cfg["dflash_config"].update(extra or {})
    for k in w:
        if silent and k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = np.zeros_like(w[k])
        if "codebook" in k or "hidden_projection" in k:
            w[k] = w[k] * codebook_scale
    return ck.write(path, cfg, w)


def exact_selector(path: Path, engine: Engine, *, sharpen: float = 1.0, top_k: int = 6) -> Path:
    """A DFlash 2 drafter whose walk proposes what a bigram target says after each token: silent
    layers (every draft slot's state is the normed MASK embedding), a near-zero unary (it only
    picks the top_k candidates), and an edge score equal to the target's logits after the previous
    token (predecessor codebook = those logits times ``sharpen``, successor codebook = identity,
    hidden projection = ones on the slot state)."""
    model = engine.model
    vocab, mask = model.args.vocab_size, 1
    cfg, w = ck.dflash2_checkpoint(ck.target_config_of(model), taps=[0], rank=vocab, top_k=top_k, mask_token_id=mask)
    cfg["dflash_config"]["output_multiplier"] = 1e-3
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = np.zeros_like(w[k])
    table = np.array(model.model.embed_tokens.weight, dtype=np.float64)
    eps = model.args.rms_norm_eps
    bigram = np.array(model(mx.array([[t] for t in range(vocab)]))[:, -1], dtype=np.float64)
    h = rms(table[mask], np.ones(table.shape[1]), eps)
    w["candidate_selector.predecessor_codebook"] = (sharpen * bigram).astype(np.float32)
    w["candidate_selector.successor_codebook"] = np.eye(vocab, dtype=np.float32)
    w["candidate_selector.hidden_projection.weight"] = np.outer(np.ones(vocab), h / (h @ h)).astype(np.float32)
    return ck.write(path, cfg, w)


# ----------------------------------------------------------------------------------------
# NumPy reference
# ----------------------------------------------------------------------------------------
def conv(x: np.ndarray, dyn: np.ndarray, base: np.ndarray, group: int) -> np.ndarray:
    """out_t = sum_o (base[o] + dyn[t, o] per channel group) * x_{t-o}, zeros before slot 0."""
    b, h = x.shape
    out = np.zeros_like(x)
    for o in range(base.shape[0]):
        shifted = np.concatenate([np.zeros((o, h)), x[: b - o]]) if o else x
        out += (base[o][None] + np.repeat(dyn[:, o], group, axis=-1)) * shifted
    return out


def reference_dflash2_block(w: dict, cfg: dict, ctx_hidden: np.ndarray, block_ids: list[int], embed: np.ndarray) -> np.ndarray:
    g = {k: np.array(v, dtype=np.float64) for k, v in w.items()}
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dc = cfg["dflash_config"]
    k_size, group = dc["conv_kernel_size"], dc["conv_group_size"]
    m, b = ctx_hidden.shape[0], len(block_ids)
    groups = cfg["hidden_size"] // group
    ctx = rms(ctx_hidden.astype(np.float64) @ g["fc.weight"].T, g["hidden_norm.weight"], eps)
    x = embed[block_ids].astype(np.float64)
    pos_ctx, pos_blk = np.arange(m), np.arange(m, m + b)
    causal = bool(dc.get("is_causal", cfg.get("is_causal")))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, g[p + "input_layernorm.weight"], eps)
        dyn = (h @ g[p + "attention_conv.kernel_projection.weight"].T).reshape(b, 2, k_size, groups)
        a_in = conv(h, dyn[:, 0], g[p + "attention_conv.base_kernel"][0], group)
        q = rms((a_in @ g[p + "self_attn.q_proj.weight"].T).reshape(b, nh, d), g[p + "self_attn.q_norm.weight"], eps)
        src = np.concatenate([ctx, a_in])
        k = rms((src @ g[p + "self_attn.k_proj.weight"].T).reshape(m + b, nkv, d), g[p + "self_attn.k_norm.weight"], eps)
        v = (src @ g[p + "self_attn.v_proj.weight"].T).reshape(m + b, nkv, d)
        q, k = rope(q, pos_blk, theta), rope(k, np.concatenate([pos_ctx, pos_blk]), theta)
        q_pos, k_pos = pos_blk[:, None], np.arange(m + b)[None, :]
        visible = np.abs(q_pos - k_pos) < cfg["sliding_window"]  # every DFlash 2 layer is sliding
        if causal:
            visible &= k_pos <= q_pos
        out = np.zeros((b, nh, d))
        for j in range(nh):
            s = q[:, j] @ k[:, j // (nh // nkv)].T / math.sqrt(d)
            s = np.where(visible, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, j] = (s / s.sum(-1, keepdims=True)) @ v[:, j // (nh // nkv)]
        a = out.reshape(b, nh * d) @ g[p + "self_attn.o_proj.weight"].T
        x = x + conv(a, dyn[:, 1], g[p + "attention_conv.base_kernel"][1], group)
        h2 = rms(x, g[p + "post_attention_layernorm.weight"], eps)
        dyn = (h2 @ g[p + "mlp_conv.kernel_projection.weight"].T).reshape(b, 2, k_size, groups)
        m_in = conv(h2, dyn[:, 0], g[p + "mlp_conv.base_kernel"][0], group)
        gate = m_in @ g[p + "mlp.gate_proj.weight"].T
        mlp = ((gate / (1 + np.exp(-gate))) * (m_in @ g[p + "mlp.up_proj.weight"].T)) @ g[p + "mlp.down_proj.weight"].T
        x = x + conv(mlp, dyn[:, 1], g[p + "mlp_conv.base_kernel"][1], group)
    return rms(x, g["norm.weight"], eps)


def reference_chain(w: dict, cfg: dict, h: np.ndarray, head: np.ndarray, anchor: int, pick) -> tuple[list, list]:
    """The selector's walk: (tokens, candidate scores per slot); ``pick(k, scores)`` chooses."""
    dc = cfg["dflash_config"]
    logits = (h @ head.T) * dc.get("output_multiplier", 1.0)
    cap = dc.get("final_logit_softcapping")
    if cap:
        logits = np.tanh(logits / cap) * cap
    a = np.array(w["candidate_selector.predecessor_codebook"], np.float64)
    bb = np.array(w["candidate_selector.successor_codebook"], np.float64)
    proj = h @ np.array(w["candidate_selector.hidden_projection.weight"], np.float64).T
    prev, tokens, rows = anchor, [], []
    for k in range(h.shape[0]):
        cands = np.argsort(-logits[k], kind="stable")[: dc["selector_top_k"]]
        scores = logits[k][cands] + bb[cands] @ (a[prev] * proj[k])
        prev = int(cands[pick(k, scores)])
        tokens.append(prev)
        rows.append((cands, scores))
    return tokens, rows


# ----------------------------------------------------------------------------------------
# format and forward
# ----------------------------------------------------------------------------------------
def test_modules_use_the_published_names_and_shapes():
    # z-lab's DFlash 2 test fixture: H 6656, 5 sliding layers, block 16, rank 256, top 16, group 16.
    target = {"model_type": "qwen3", "hidden_size": 6656, "num_hidden_layers": 52, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 19968, "vocab_size": 202048,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
    cfg = ck._config(target, layers=5, taps=[1, 13, 25, 37, 49])
    cfg.update(architectures=["DFlash2DraftModel"], is_causal=False, sliding_window=2048, layer_types=["sliding_attention"] * 5,
               dflash_config={"block_size": 16, "mask_token_id": 201818, "conv_kernel_size": 2, "conv_group_size": 16,
                              "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49],
                              "final_logit_softcapping": 20.0, "output_multiplier": 0.196})
    parsed = block.parse_config(cfg)
    assert parsed.kind == "dflash" and parsed.dflash2 and parsed.max_draft == 15
    assert parsed.layer_attention(0) == (False, 2048)  # non-causal, symmetric window
    shapes = block.expected_shapes(build_drafter_model(parsed))
    assert shapes == ck.dflash2_keys(cfg)
    assert shapes["layers.0.attention_conv.kernel_projection.weight"] == (1664, 6656)  # as in the published header
    assert shapes["layers.0.mlp_conv.base_kernel"] == (2, 2, 6656)
    assert shapes["candidate_selector.predecessor_codebook"] == (202048, 256)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 6656)


@pytest.mark.parametrize("causal", [False, True])
def test_block_forward_and_selector_match_numpy(tmp_path, causal):
    engine = make_tiny_engine("qwen3", seed=2)
    path = write_dflash2(tmp_path / "d2", engine, layers=2, taps=[0, 2], block_size=6, window=4, top_k=8, scale=0.1,
                         extra={"output_multiplier": 0.5, "final_logit_softcapping": 8.0, "is_causal": causal or None})
    cfg = json.loads((path / "config.json").read_text())
    if not causal:
        del cfg["dflash_config"]["is_causal"]
    engine.drafter_path = str(path)
    drafter = engine.drafter("dflash")
    assert isinstance(drafter, DFlash2Drafter) and drafter.cfg.layer_attention(1) == (causal, 4)
    target = engine.target
    target.set_taps(drafter.tap_layers)
    ids = [5, 9, 17, 4, 33, 60, 2, 8, 71, 13, 40, 41, 42, 7]
    cache = target.new_cache()
    _, hidden = target.prefill(ids[:5], cache, tap=True)
    drafter.begin(ids[:5], hidden)
    done = 5
    for n in (3, 1, 4):
        _, hidden = target.forward(mx.array([ids[done : done + n]]), cache, tap=True)
        drafter.commit(ids[: done + n + 1], n, hidden)
        done += n
    got = np.array(drafter.block_states(ids[: done + 1]), dtype=np.float64)
    w = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    embed = np.array(engine.model.model.embed_tokens.weight)
    want = reference_dflash2_block(w, cfg, tapped_hidden(target, ids[:done]), [ids[done]] + [1] * 5, embed)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    # The selector's walk from the anchor over each slot's top-8 candidates.
    head = np.array(engine.model.lm_head.weight, dtype=np.float64)
    tokens, _ = reference_chain(w, cfg, want[1:], head, ids[done], lambda k, s: int(np.argmax(s)))
    assert drafter.propose(ids[: done + 1], 5, GREEDY).tokens.tolist() == tokens
    plain = np.argmax(want[1:] @ head.T, axis=-1).tolist()
    assert tokens != plain  # the edges changed the walk: the test has power
    # Sampled: each draft is the sampler's draw from q over that slot's candidates, given the
    # drafts drawn before it; q (zero off the candidates) is what the verify rule gets.
    params = SamplingParams(0.9, 0.95, 0, seed=3)
    draft = drafter.propose(ids[: done + 1], 5, Sampler(params))
    drawn, q_got = draft.tokens.tolist(), np.array(draft.probs)
    a = w["candidate_selector.predecessor_codebook"].astype(np.float64)
    bb = w["candidate_selector.successor_codebook"].astype(np.float64)
    proj = want[1:] @ w["candidate_selector.hidden_projection.weight"].astype(np.float64).T
    logits = np.tanh((want[1:] @ head.T) * 0.5 / 8.0) * 8.0
    replay, prev = Sampler(params), ids[done]
    for k in range(5):
        cands = np.argsort(-logits[k], kind="stable")[:8]
        q = np.array(target_probs(mx.array((logits[k][cands] + bb[cands] @ (a[prev] * proj[k])).astype(np.float32)), params))
        assert np.abs(q_got[k][cands] - q).max() < 1e-4 and abs(q_got[k].sum() - q_got[k][cands].sum()) < 1e-6
        assert drawn[k] == int(cands[sample_from(mx.array(q), replay.next_key()).item()])
        prev = drawn[k]


# ----------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------
def test_greedy_output_identical_to_baseline(tmp_path):
    random_engine = make_tiny_engine("qwen3", seed=6)
    random_engine.drafter_path = str(write_dflash2(tmp_path / "r", random_engine, layers=2, taps=[1, 2], top_k=8))
    near = bigram_engine(seed=8, vocab=48, scale=1.5)
    near.drafter_path = str(write_dflash2(tmp_path / "n", near, taps=[0, 1], silent=True, codebook_scale=5.0))
    for engine in (random_engine, near):
        drafted, _ = greedy_matches_baseline(engine, "dflash", (0, 3))  # 0 = the full block (7 drafts)
        assert drafted > 0 and isinstance(engine.drafter("dflash"), DFlash2Drafter)


def test_sampled_tokens_are_exact_samples_of_the_target(tmp_path):
    """Through the real loop (tests/test_sampling.py's check: every token against the target's
    exact conditional, by draft position and previous token): drafts are draws from q over each
    slot's 6 candidates, sharper than p; the other tokens come only from rejections."""
    engine = bigram_engine(seed=5, vocab=VOCAB, scale=2.0)
    engine.drafter_path = str(exact_selector(tmp_path / "d2", engine, sharpen=1.3, top_k=6))
    drafter = engine.drafter("dflash")
    params = SamplingParams(temperature=1.0, top_p=0.95)
    assert_exact(sample_paths(engine.model, drafter, params, target=engine.target))
    q = first_draft_q(engine.target, drafter, [3, 4], params)
    p = np.array(target_probs(engine.model(mx.array([[4]]))[0, -1], params))
    assert (q > 0).sum() <= 6 and abs(q.sum() - 1) < 1e-5 and 0.5 * np.abs(q - p).sum() > 0.03


# ----------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------
def test_every_malformed_checkpoint_is_refused_with_its_reason(tmp_path):
    engine = make_tiny_engine("qwen3", seed=9)  # H=64, vocab 96
    ok = lambda name, **kw: write_dflash2(tmp_path / name, engine, taps=[0, 2], **kw)  # noqa: E731

    def config(name, **dflash):
        p = ok(name)
        cfg = json.loads((p / "config.json").read_text())
        cfg["dflash_config"].update(dflash)
        (p / "config.json").write_text(json.dumps(cfg))
        return p

    assert "conv_group_size 24 does not divide hidden_size 64" in _refusal(engine, config("group", conv_group_size=24), "dflash")
    assert "selector_top_k 500 is larger than the vocabulary" in _refusal(engine, config("topk", selector_top_k=500), "dflash")
    assert "'selector_rank' must be positive" in _refusal(engine, config("rank", selector_rank=0), "dflash")
    assert "'draft_window_size' is not supported" in _refusal(engine, config("window", draft_window_size=512), "dflash")
    cfg, w = ck.dflash2_checkpoint(ck.target_config_of(engine.model), taps=[0, 2])
    del w["layers.0.mlp_conv.base_kernel"]
    missing = _refusal(engine, ck.write(tmp_path / "miss", cfg, w), "dflash")
    assert "required keys missing: layers.0.mlp_conv.base_kernel" in missing
    cfg, w = ck.dflash2_checkpoint(ck.target_config_of(engine.model), taps=[0, 2])
    w["candidate_selector.successor_codebook"] = w["candidate_selector.successor_codebook"][:, :8]
    shape = _refusal(engine, ck.write(tmp_path / "cb", cfg, w), "dflash")
    assert "wrong shape for candidate_selector.successor_codebook" in shape
    # Codebooks as the ports save them (".weight" added) load the same.
    cfg, w = ck.dflash2_checkpoint(ck.target_config_of(engine.model), taps=[0, 2])
    as_published, _ = load_checkpoint(ck.write(tmp_path / "pub", cfg, w), engine.target)
    for name in ("predecessor_codebook", "successor_codebook"):
        w[f"candidate_selector.{name}.weight"] = w.pop(f"candidate_selector.{name}")
    renamed, _ = load_checkpoint(ck.write(tmp_path / "named", cfg, w), engine.target)
    books = renamed.candidate_selector, as_published.candidate_selector
    assert mx.array_equal(books[0].successor_codebook, books[1].successor_codebook).item()
    assert "is a DFlash checkpoint; use --mode dflash" in _refusal(engine, ok("mode"), "dspark")
    with pytest.raises(TandemError, match="use --mode dflash"):
        load_checkpoint(ok("direct"), engine.target, mode="dspark")
