"""DSpark and DFlash drafters on tiny random targets, loaded from checkpoints written in the
exact on-disk format (tests/drafter_ckpt.py): strict loading, the block forward against a
NumPy reference, the Markov and confidence heads, lossless greedy and sampled output through
the one verify loop, quantization, and every refusal."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine import modes
from engine.drafters import block, checkpoint
from engine.drafters.checkpoint import load_checkpoint, new_dspark_model, save_drafter
from engine.drafters.dflash import DFlashDrafter
from engine.drafters.dspark import DSparkDrafter, chain_tokens, confident_prefix, keep_count
from engine.errors import TandemError
from engine.generate import Engine
from engine.sampling import Sampler, SamplingParams, sample_from, target_probs
from engine.speculative import DecodeStats, FixedCap, decode
from engine.target import Target
from tests import drafter_ckpt as ck
from tests.lossless import assert_same_greedy
from tests.tiny import make_tiny_engine, make_tiny_model, make_tokenizer

GREEDY = Sampler(SamplingParams())


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(2, vocab) for _ in range(rng.choice([1, 3, 8, 17, 30]))]
        out.append(body + body[: len(body) // 2] if i % 3 == 0 else body)
    return out


def greedy_matches_baseline(engine: Engine, mode: str, caps, *, n_prompts: int = 8, seed: int = 11) -> tuple[int, int]:
    """Greedy ``mode`` at each cap == baseline on ``n_prompts`` prompts of uneven lengths (1 to 24
    new tokens); returns (drafted, accepted) over all runs."""
    drafted = accepted = 0
    for i, ids in enumerate(prompts(n_prompts, engine.model.args.vocab_size, seed=seed)):
        n = [1, 3, 9, 16, 24][i % 5]
        base = engine.generate(ids, mode="baseline", max_new_tokens=n)
        for cap in caps:
            res = engine.generate(ids, mode=mode, max_new_tokens=n, max_draft=cap)
            assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"{engine.name}/prompt {i}/cap {cap}")
            drafted, accepted = drafted + res.drafted, accepted + res.accepted
    return drafted, accepted


def feed_in_rounds(target: Target, drafter, ids: list[int], *, prefill: int = 5, rounds=(1, 3, 2, 1, 2)) -> int:
    """Prefill ``prefill`` tokens, then commit rows in uneven rounds as the loop makes them (the
    target's taps already set); returns how many tokens the drafter has seen."""
    cache = target.new_cache()
    _, hidden = target.prefill(ids[:prefill], cache, tap=True)
    drafter.begin(ids[:prefill], hidden)
    done = prefill
    for n in rounds:
        _, hidden = target.forward(mx.array([ids[done : done + n]]), cache, tap=True)
        drafter.commit(ids[: done + n + 1], n, hidden)
        done += n
        assert drafter.context_len == done
    return done


def first_draft_q(target: Target, drafter, ids: list[int], params: SamplingParams) -> np.ndarray:
    """The drafter's proposal distribution for its first slot after prefilling ``ids[:-1]``."""
    _, hidden = target.prefill(ids[:-1], target.new_cache(), tap=True)
    drafter.begin(ids[:-1], hidden)
    return np.array(drafter.propose(ids, 1, Sampler(params)).probs[0])


def write_dspark(path: Path, engine: Engine, *, copy_head: bool = True, markov_scale: float = 0.0, **kw) -> Path:
    cfg, w = ck.dspark_checkpoint(ck.target_config_of(engine.model), **kw)
    if copy_head:
        ck.copy_target_head(w, engine.model)
    if markov_scale:
        for k in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
            w[k] = w[k] * markov_scale
    return ck.write(path, cfg, w)


def write_dflash(path: Path, engine: Engine, **kw) -> Path:
    return ck.write(path, *ck.dflash_checkpoint(ck.target_config_of(engine.model), **kw))


def drafter_for(engine: Engine, path: Path, mode: str):
    engine.drafter_path = str(path)
    return engine.drafter(mode)


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Non-interleaved RoPE (Qwen3/HF layout) on [L, heads, D] at absolute positions."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None, None] * freq[None, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def reference_block(weights: dict, cfg: dict, ctx_hidden: np.ndarray, block_ids: list[int],
                    embed: np.ndarray) -> np.ndarray:
    """The DSpark/DFlash block forward written out in NumPy, with no cache: context rows at
    positions 0..m-1, block rows at m..m+B-1, block queries over [context; block] keys."""
    g = {k: np.array(v, dtype=np.float64) for k, v in weights.items()}
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    m, b = ctx_hidden.shape[0], len(block_ids)
    ctx = rms(ctx_hidden.astype(np.float64) @ g["fc.weight"].T, g["hidden_norm.weight"], eps)
    x = embed[block_ids].astype(np.float64)
    pos_ctx, pos_blk = np.arange(m), np.arange(m, m + b)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, g[p + "input_layernorm.weight"], eps)
        q = rms((h @ g[p + "self_attn.q_proj.weight"].T).reshape(b, nh, d), g[p + "self_attn.q_norm.weight"], eps)
        src = np.concatenate([ctx, h])
        k = rms((src @ g[p + "self_attn.k_proj.weight"].T).reshape(m + b, nkv, d), g[p + "self_attn.k_norm.weight"], eps)
        v = (src @ g[p + "self_attn.v_proj.weight"].T).reshape(m + b, nkv, d)
        q, k = rope(q, pos_blk, theta), rope(k, np.concatenate([pos_ctx, pos_blk]), theta)
        # z-lab's reference: no layer is causal unless the config says is_causal; a
        # sliding_attention layer sees keys less than sliding_window positions away on either
        # side (flash-attention's non-causal window), only on the past when causal.
        q_pos, k_pos = pos_blk[:, None], np.arange(m + b)[None, :]
        visible = np.ones((b, m + b), dtype=bool)
        causal = bool((cfg.get("dflash_config") or {}).get("is_causal", cfg.get("is_causal")))
        if causal:
            visible &= k_pos <= q_pos
        if (cfg.get("layer_types") or ["full_attention"] * (i + 1))[i] == "sliding_attention":
            visible &= np.abs(q_pos - k_pos) < cfg["sliding_window"]
        out = np.zeros((b, nh, d))
        for j in range(nh):
            kj = j // (nh // nkv)
            s = q[:, j] @ k[:, kj].T / np.sqrt(d)
            s = np.where(visible, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, j] = (s / s.sum(-1, keepdims=True)) @ v[:, kj]
        x = x + out.reshape(b, nh * d) @ g[p + "self_attn.o_proj.weight"].T
        h2 = rms(x, g[p + "post_attention_layernorm.weight"], eps)
        gate = h2 @ g[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h2 @ g[p + "mlp.up_proj.weight"].T)) @ g[p + "mlp.down_proj.weight"].T
    return rms(x, g["norm.weight"], eps)


def tapped_hidden(target: Target, ids: list[int]) -> np.ndarray:
    _, hidden = target.forward(mx.array([ids]), target.new_cache(), tap=True)
    return np.array(hidden, dtype=np.float64)


def bigram_engine(seed: int = 5, vocab: int = 32, scale: float = 4.0) -> Engine:
    """A target whose layers add nothing (o_proj = down_proj = 0): the next token depends on
    the current one only, logits = lm_head(norm(embed[x]))."""
    model = make_tiny_model("qwen3", seed=seed, vocab=vocab, layers=3, hidden=64, scale=scale)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    mx.eval(model.parameters())
    return Engine(model, make_tokenizer(vocab), name="bigram")


def exact_markov_dspark(path: Path, engine: Engine, *, noise: float = 0.0, seed: int = 0, taps=(0, 1), **kw) -> Path:
    """A DSpark drafter whose Markov head reproduces a bigram target exactly (W2·W1[x] = the
    target's logits after x) and whose own head says nothing (lm_head = 0)."""
    model = engine.model
    h = model.args.hidden_size
    cfg, w = ck.dspark_checkpoint(ck.target_config_of(model), markov_rank=h, taps=list(taps), **kw)
    table = np.array(model.model.embed_tokens.weight, dtype=np.float64)
    w["markov_head.markov_w1.weight"] = rms(table, np.array(model.model.norm.weight), model.args.rms_norm_eps).astype(np.float32)
    head = np.array(model.lm_head.weight, dtype=np.float32)
    rng = np.random.default_rng(seed)
    w["markov_head.markov_w2.weight"] = head + noise * rng.standard_normal(head.shape).astype(np.float32)
    w["lm_head.weight"] = np.zeros_like(w["lm_head.weight"])
    return ck.write(path, cfg, w)


# ----------------------------------------------------------------------------------------
# format
# ----------------------------------------------------------------------------------------
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960}


def test_modules_use_the_published_key_names_and_shapes():
    # The real deepseek-ai/dspark_qwen3_8b_block7 layout (spec/drafters.md), built lazily.
    cfg = ck._config(QWEN3_8B, layers=5, taps=[1, 9, 17, 25, 33])
    cfg.update(architectures=["Qwen3DSparkModel"], block_size=7, target_layer_ids=[1, 9, 17, 25, 33],
               mask_token_id=151669, markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
               confidence_head_with_markov=True)
    shapes = block.expected_shapes(block.build_model(block.parse_config(cfg)))
    assert shapes == ck.dspark_keys(cfg)
    assert shapes["fc.weight"] == (4096, 20480)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["layers.0.mlp.down_proj.weight"] == (4096, 12288)
    assert shapes["markov_head.markov_w1.weight"] == (151936, 256)
    assert shapes["markov_head.markov_w2.weight"] == (151936, 256)
    assert shapes["confidence_head.proj.weight"] == (1, 4096 + 256)
    assert shapes["confidence_head.proj.bias"] == (1,)
    assert sum(int(np.prod(s)) for s in shapes.values()) * 2 == pytest.approx(4_742_170_330, rel=0.01)
    # z-lab Qwen3-8B-DFlash-b16: no embedding, no head.
    dcfg = ck._config(QWEN3_8B, layers=5, taps=[1, 9, 17, 25, 33])
    dcfg.update(block_size=16, dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]})
    dshapes = block.expected_shapes(block.build_model(block.parse_config(dcfg)))
    assert dshapes == ck.dflash_keys(dcfg)
    assert "embed_tokens.weight" not in dshapes and "lm_head.weight" not in dshapes
    assert sum(int(np.prod(s)) for s in dshapes.values()) * 2 == pytest.approx(2_097_259_104, rel=0.01)
    for kind in ("gated", "rnn"):
        cfg.update(markov_head_type=kind)
        assert block.expected_shapes(block.build_model(block.parse_config(cfg))) == ck.dspark_keys(cfg)


def test_new_model_saves_in_the_same_format_and_reloads(tmp_path):
    engine = make_tiny_engine("qwen3", seed=1)
    tc = ck.target_config_of(engine.model)
    model = new_dspark_model(tc, num_layers=2, block_size=5, markov_rank=16, tap_layers=[0, 2], mask_token_id=3,
                             markov_head_type="gated", seed=0, target=engine.target)
    assert np.array_equal(np.array(model.embed_tokens.weight), np.array(engine.model.model.embed_tokens.weight))
    out = save_drafter(model, model.config, tmp_path / "d")
    saved = json.loads((out / "config.json").read_text())
    assert set(mx.load(str(out / "model.safetensors"))) == set(ck.dspark_keys(saved))
    loaded, cfg = load_checkpoint(out, engine.target)
    assert cfg.kind == "dspark" and cfg.block_size == 5 and cfg.markov_head_type == "gated"
    for (k, a), (_, b) in zip(sorted(block.tree_flatten(model.parameters())), sorted(block.tree_flatten(loaded.parameters()))):
        assert np.array_equal(np.array(a), np.array(b)), k
    # A tied target (like the starter): the head starts as the embedding table.
    from mlx_lm.models import llama

    tied = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=96, rms_norm_eps=1e-5,
                                       rope_theta=10000.0, tie_word_embeddings=True))
    mx.eval(tied.parameters())
    tied_engine = Engine(tied, make_tokenizer(96), name="tied")
    model = new_dspark_model(ck.target_config_of(tied), num_layers=1, block_size=7, markov_rank=8, tap_layers=None,
                             mask_token_id=0, target=tied_engine.target)
    assert model.config["target_layer_ids"] == [1]  # 4 layers: 1..N-3 collapses to one id
    assert np.array_equal(np.array(model.lm_head.weight), np.array(tied.model.embed_tokens.weight))
    assert checkpoint.default_tap_layers(36) == [1, 9, 17, 25, 33]
    assert checkpoint.default_tap_layers(40) == [1, 10, 19, 28, 37]


# ----------------------------------------------------------------------------------------
# the block forward and the heads
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dspark", "dflash", "dflash-sliding", "dflash-sliding-causal"])
def test_append_only_context_matches_a_clean_numpy_forward(tmp_path, kind):
    engine = make_tiny_engine("qwen3", seed=2)
    if kind == "dspark":
        path = write_dspark(tmp_path / kind, engine, layers=2, taps=[0, 2], copy_head=False)
    else:
        path = write_dflash(tmp_path / kind, engine, layers=2, taps=[0, 2], block_size=6)
        if kind.startswith("dflash-sliding"):  # a window of 4 cuts the context (and the block, both ways)
            _edit(path, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                  is_causal=kind.endswith("causal") or None)
        kind = "dflash"
    drafter = drafter_for(engine, path, kind)
    target = engine.target
    target.set_taps(drafter.tap_layers)
    ids = [5, 9, 17, 4, 33, 60, 2, 8, 71, 13, 40, 41, 42, 7, 19, 23]
    done = feed_in_rounds(target, drafter, ids)
    got = np.array(drafter.block_states(ids[: done + 1]), dtype=np.float64)
    weights = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    cfg = json.loads((path / "config.json").read_text())
    embed = weights["embed_tokens.weight"] if kind == "dspark" else np.array(engine.model.model.embed_tokens.weight)
    block_ids = [ids[done]] + [drafter.cfg.mask_token_id] * (drafter.block_size - 1)
    want = reference_block(weights, cfg, tapped_hidden(target, ids[:done]), block_ids, embed)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    with pytest.raises(RuntimeError, match="out of step"):
        drafter.block_states(ids[: done + 2])


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_markov_head_matches_numpy(tmp_path, head):
    engine = make_tiny_engine("qwen3", seed=3)
    path = write_dspark(tmp_path / head, engine, markov_rank=16, markov_head_type=head, taps=[0, 2], markov_scale=40.0)
    w = {k: np.array(v, dtype=np.float64) for k, v in mx.load(str(path / "model.safetensors")).items()}
    drafter = drafter_for(engine, path, "dspark")
    target = engine.target
    target.set_taps(drafter.tap_layers)
    ids = [7, 8, 9, 10, 11, 12]
    _, hidden = target.prefill(ids[:-1], target.new_cache(), tap=True)
    drafter.begin(ids[:-1], hidden)
    h = np.array(drafter.block_states(ids), dtype=np.float64)
    base = h @ w["lm_head.weight"].T

    def chain(pick):
        prev, state, toks, logits_rows = ids[-1], np.zeros(16), [], []
        for k in range(h.shape[0]):
            e = w["markov_head.markov_w1.weight"][prev]
            if head == "gated":
                z = np.concatenate([h[k], e]) @ w["markov_head.gate_proj.weight"].T + w["markov_head.gate_proj.bias"]
                e = e / (1 + np.exp(-z))
            elif head == "rnn":
                z = np.concatenate([state, e, h[k]]) @ w["markov_head.joint_proj.weight"].T + w["markov_head.joint_proj.bias"]
                gate, cand, out = np.split(z, 3)
                gate = 1 / (1 + np.exp(-gate))
                state = gate * state + (1 - gate) * np.tanh(cand)
                e = np.tanh(out)
            row = base[k] + w["markov_head.markov_w2.weight"] @ e
            logits_rows.append(row)
            prev = pick(k, row)
            toks.append(prev)
        return toks, np.array(logits_rows)

    want, _ = chain(lambda k, row: int(np.argmax(row)))
    draft = drafter.propose(ids, drafter.max_draft, GREEDY)
    assert draft.tokens.tolist() == want
    assert want != np.argmax(base, axis=-1).tolist()  # the chain changed the drafts: the test has power
    # Sampling: q_k is the truncated distribution of the Markov-adjusted logits given the
    # token actually drawn at k-1, and every drawn token has q > 0.
    params = SamplingParams(temperature=0.8, top_k=20)
    draft = drafter.propose(ids, 5, Sampler(SamplingParams(0.8, 1.0, 20, seed=4)))
    toks = draft.tokens.tolist()
    _, rows = chain(lambda k, row: toks[k] if k < len(toks) else int(np.argmax(row)))
    q_want = np.array(target_probs(mx.array(rows[:5].astype(np.float32)), params))
    q_got = np.array(draft.probs)
    assert np.abs(q_got - q_want).max() < 1e-4
    assert all(q_got[k, t] > 0 for k, t in enumerate(toks))


def test_confidence_head_only_shortens_drafts(tmp_path):
    engine = make_tiny_engine("llama", seed=4)
    cfg, w = ck.dspark_checkpoint(ck.target_config_of(engine.model), markov_rank=16, taps=[0, 1, 2])
    ck.copy_target_head(w, engine.model)
    rng = np.random.default_rng(1)
    w["confidence_head.proj.weight"] = rng.standard_normal(w["confidence_head.proj.weight"].shape).astype(np.float32) * 0.3
    w["confidence_head.proj.bias"] = np.array([1.5], dtype=np.float32)
    path = ck.write(tmp_path / "conf", cfg, w)
    full = drafter_for(engine, path, "dspark")
    target = engine.target
    target.set_taps(full.tap_layers)
    ids = [4, 5, 6, 7, 8]
    _, hidden = target.prefill(ids[:-1], target.new_cache(), tap=True)
    full.begin(ids[:-1], hidden)
    h = np.array(full.block_states(ids), dtype=np.float64)
    untruncated = full.propose(ids, 7, GREEDY).tokens.tolist()
    prevs = [ids[-1]] + untruncated[:-1]
    feats = np.concatenate([h, w["markov_head.markov_w1.weight"][prevs]], axis=1)
    conf = 1 / (1 + np.exp(-(feats @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0])))
    survival = np.cumprod(conf)
    assert 0.1 < survival[-1] < 0.9  # the thresholds below really cut
    # DeepSpec's rule (the default): stop at the first slot scored below the threshold; the
    # product rule: stop where the running product falls below it.
    for rule, scores in (("slot", conf), ("product", survival)):
        cuts = set()
        for threshold in (0.05, float(np.sort(scores)[1]) + 1e-4, float(np.median(scores)) + 1e-4, 0.97):
            kw = {} if rule == "slot" else {"confidence_rule": rule}
            d = DSparkDrafter(full.model, full.cfg, target, confidence_threshold=threshold, **kw)
            d.begin(ids[:-1], hidden)
            draft = d.propose(ids, 7, GREEDY)
            below = np.nonzero(scores < threshold)[0]
            keep = int(below[0]) if len(below) else 7
            got = [] if draft is None else draft.tokens.tolist()
            assert got == untruncated[:keep], (rule, threshold)
            assert keep == keep_count(conf.tolist(), threshold, rule)
            cuts.add(keep)
        assert cuts & set(range(1, 7)), rule  # some threshold cut inside the block
    # slot keeps at least as much as product at every threshold (c_k >= prod_{i<=k} c_i)
    for threshold in np.linspace(0.05, 0.95, 19):
        assert keep_count(conf.tolist(), threshold, "slot") >= keep_count(conf.tolist(), threshold, "product")
    # Through the loop: same output at every threshold, never more drafted per round.
    base = engine.generate([9, 10, 11], mode="baseline", max_new_tokens=30)
    truncated_rounds = 0
    for threshold in (None, 0.3, 0.7, 0.99):
        engine.confidence_threshold = threshold  # read at each proposal: no reload
        res = engine.generate([9, 10, 11], mode="dspark", max_new_tokens=30, max_draft=0)
        assert res.token_ids == base.token_ids
        assert all(d <= 7 for d, _ in res.rounds)
        truncated_rounds += sum(1 for d, _ in res.rounds[1:-1] if d < 7) if threshold else 0
    assert truncated_rounds > 0
    engine.confidence_threshold = 1.5
    with pytest.raises(TandemError, match="confidence threshold must be in"):
        engine.generate([9, 10, 11], mode="dspark", max_new_tokens=5)
    engine.confidence_threshold = None
    # A drafter's own default (config.json tandem.confidence_threshold) applies when the
    # engine sets none; 0 turns it off; a bad value is refused at load.
    mid = float(survival[3] + survival[4]) / 2  # between two slots: float32 vs float64 rounding cannot move the cut
    own = DSparkDrafter(full.model, dict_cfg(full.cfg, tandem={"confidence_threshold": mid,
                                                                  "confidence_rule": "product"}), target)
    for setting, keep in ((None, int((survival >= mid).sum())), (0.0, 7)):
        own._threshold = lambda s=setting: s
        own.begin(ids[:-1], hidden)
        assert own.propose(ids, 7, GREEDY).tokens.tolist() == untruncated[:keep]
    # a calibrated cut applies when the user sets neither rule nor threshold; theirs wins
    own._threshold, own.calibrated = (lambda: None), ("slot", float(conf[2]) + 1e-4)
    assert own.cut() == ("slot", float(conf[2]) + 1e-4)
    own._threshold = lambda: 0.5
    assert own.cut() == ("product", 0.5)
    own._rule = lambda: "slot"
    assert own.cut() == ("slot", 0.5)
    with pytest.raises(TandemError, match="tandem.confidence_threshold must be a number"):
        DSparkDrafter(full.model, dict_cfg(full.cfg, tandem={"confidence_threshold": "high"}), target)
    with pytest.raises(TandemError, match="tandem.confidence_rule must be one of slot, product"):
        DSparkDrafter(full.model, dict_cfg(full.cfg, tandem={"confidence_rule": "sum"}), target)
    engine.confidence_rule = "sum"
    with pytest.raises(TandemError, match="confidence rule must be one of slot, product, got 'sum'"):
        engine.generate([9, 10, 11], mode="dspark", max_new_tokens=5)
    engine.confidence_rule = None


def dict_cfg(cfg, **raw):
    """A copy of a drafter config whose config.json had these extra fields."""
    import dataclasses

    return dataclasses.replace(cfg, raw={**cfg.raw, **raw})


# ----------------------------------------------------------------------------------------
# lossless through the verify loop
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_greedy_output_identical_to_baseline(tmp_path, arch, kind):
    engine = make_tiny_engine(arch, seed=6)
    if kind == "dspark":
        path = write_dspark(tmp_path / kind, engine, layers=2, taps=[0, 1, 2], markov_scale=10.0)
    else:
        path = write_dflash(tmp_path / kind, engine, layers=2, taps=[1, 2])
    engine.drafter_path = str(path)
    drafted = 0
    for i, ids in enumerate(prompts(12, 96, seed=11)):
        n = [1, 3, 9, 20, 40][i % 5]
        base = engine.generate(ids, mode="baseline", max_new_tokens=n)
        for cap in (0, 2):  # 0 = the full block
            res = engine.generate(ids, mode=kind, max_new_tokens=n, max_draft=cap)
            assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"{arch}/{kind}/prompt {i}/cap {cap}")
            drafted += res.drafted
    assert drafted > 0
    assert isinstance(engine.drafter(kind), DSparkDrafter if kind == "dspark" else DFlashDrafter)


def test_dspark_with_an_exact_markov_head_has_every_draft_accepted(tmp_path):
    engine = bigram_engine()
    engine.drafter_path = str(exact_markov_dspark(tmp_path / "exact", engine))
    for ids in ([3, 4, 5], [17], [9, 9, 30, 2]):
        base = engine.generate(ids, mode="baseline", max_new_tokens=40)
        res = engine.generate(ids, mode="dspark", max_new_tokens=40, max_draft=0)
        assert res.token_ids == base.token_ids
        assert res.drafted > 0 and res.accepted == res.drafted
        assert res.target_forwards <= 1 + -(-(base.generated - 1) // 8)  # 7 drafts + 1 per forward
    # The drafter's context grew by exactly the committed rows (prompt + anchor/accepted).
    drafter = engine.drafter("dspark")
    assert drafter.context_len == len(ids) + sum(a + 1 for _, a in res.rounds[1:])


def test_dflash_drafts_are_all_accepted_when_the_target_is_predictable(tmp_path):
    # All embedding rows equal and layers silent: the target always predicts the same token,
    # and so does a DFlash drafter with silent layers (it reads the target's embedding and head).
    engine = bigram_engine(seed=7)
    row = engine.model.model.embed_tokens.weight[:1]
    engine.model.model.embed_tokens.weight = mx.repeat(row, engine.model.args.vocab_size, axis=0)
    mx.eval(engine.model.parameters())
    engine = Engine(engine.model, make_tokenizer(32), name="constant")
    cfg, w = ck.dflash_checkpoint(ck.target_config_of(engine.model), taps=[0, 1])
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = np.zeros_like(w[k])
    engine.drafter_path = str(ck.write(tmp_path / "dflash", cfg, w))
    res = engine.generate([3, 4], mode="dflash", max_new_tokens=40, max_draft=0)
    base = engine.generate([3, 4], mode="baseline", max_new_tokens=40)
    assert res.token_ids == base.token_ids
    assert res.drafted >= 15 and res.accepted == res.drafted
    assert max(d for d, _ in res.rounds) == 15  # slots 1..15 of a 16-token block


def context_free_engine(seed: int, vocab: int = 16, spread: float = 1.0) -> Engine:
    """A bigram target with ``vocab`` tokens; ``spread`` < 1 pulls the embedding rows
    together, so the next-token distributions of different tokens overlap."""
    engine = bigram_engine(seed=seed, vocab=vocab, scale=2.0)
    w = engine.model.model.embed_tokens.weight
    engine.model.model.embed_tokens.weight = w[:1] + spread * (w - w[:1])
    mx.eval(engine.model.parameters())
    return Engine(engine.model, make_tokenizer(vocab), name="context-free")


def chi_square_z(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square over every (previous, next) cell, bins with E < 5 merged per row,
    as a Wilson-Hilferty z score (about N(0, 1) when the counts follow ``expected``)."""
    stat, df = 0.0, 0
    for o_row, e_row in zip(observed, expected):
        small = e_row < 5
        o = np.append(o_row[~small], o_row[small].sum())
        e = np.append(e_row[~small], e_row[small].sum())
        keep = e > 0
        stat += (((o - e) ** 2)[keep] / e[keep]).sum()
        df += int(keep.sum()) - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / np.sqrt(2 / (9 * df))


@pytest.mark.parametrize("kind", ["dspark", "dspark+vocab", "dspark+lookup", "dflash"])
def test_sampled_tokens_are_exact_samples_of_the_target(tmp_path, kind):
    """14k sampled tokens through the real loop (decode), the real drafter and the verify rule
    match the target's exact distribution.

    The target is context-free (its layers add nothing), so every generated token is a sample
    of the exact, truncated next-token distribution of the token before it: each of the 14k
    tokens is checked, not just the first few. The drafter's own distribution q differs from
    the target's (acceptance well below 1), so the rule's rejections and residual draws are
    exercised; long sequences keep each round cheap. With a draft vocabulary (dspark+vocab)
    q is zero on the unlisted tokens, which the target still produces through rejections;
    behind n-gram lookup (dspark+lookup) rounds alternate between one-hot lookup drafts and
    the drafter's sampled ones."""
    vocab, per_seq, seqs = 16, 500, 28
    params = SamplingParams(temperature=1.0, top_k=12)
    unlisted = [1, 4, 7, 10, 13]
    if kind.startswith("dspark"):
        engine = context_free_engine(seed=5)
        path = exact_markov_dspark(tmp_path / "dspark", engine, taps=[0])
        weights = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
        weights["markov_head.markov_w2.weight"] *= 1.3  # q sharper than p
        ck.write(path, json.loads((path / "config.json").read_text()), weights)
        if kind == "dspark+vocab":
            listed = [t for t in range(vocab) if t not in unlisted]
            (path / checkpoint.DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": listed[::-1]}))
        cap = 7
    else:
        engine = context_free_engine(seed=7, spread=0.2)
        cfg, w = ck.dflash_checkpoint(ck.target_config_of(engine.model), taps=[0])
        for k in w:  # silent layers: slot k reads the target's head on norm(embed[MASK])
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                w[k] = np.zeros_like(w[k])
        path = ck.write(tmp_path / kind, cfg, w)
        cap = 15
    engine.lookup_first = kind == "dspark+lookup"
    drafter = drafter_for(engine, path, kind.split("+")[0])
    assert (getattr(drafter, "vocab_ids", None) is not None) == (kind == "dspark+vocab")
    target = engine.target
    exact = np.array(target_probs(engine.model(mx.array([[x] for x in range(vocab)]))[:, -1], params), dtype=np.float64)
    observed = np.zeros((vocab, vocab))
    rounds: list[tuple[int, int]] = []
    for seed in range(seqs):
        prompt = [(3 * seed + 1) % vocab, (5 * seed + 2) % vocab]
        sampler = Sampler(SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed))
        stats = DecodeStats()
        seq = list(prompt)
        for new, _ in decode(target, drafter, prompt, sampler, max_new_tokens=per_seq, cap_policy=FixedCap(cap), stats=stats):
            seq += new
        assert len(seq) == len(prompt) + per_seq
        for prev, tok in zip(seq[len(prompt) - 1 : -1], seq[len(prompt) :]):
            observed[prev, tok] += 1
        rounds += stats.rounds[1:]
    expected = observed.sum(axis=1, keepdims=True) * exact
    total = observed.sum()
    assert total == seqs * per_seq
    assert (observed[exact == 0] == 0).all()  # never a token outside the target's top-k
    tv = 0.5 * np.abs(observed.sum(axis=0) - expected.sum(axis=0)).sum() / total
    assert tv < 0.02, f"total variation {tv:.4f} between generated tokens and the target"
    z = chi_square_z(observed, expected)
    assert z < 4.0, f"per-token conditionals deviate from the target (chi-square z = {z:.1f})"
    # Power: the drafter's proposals differ from the target: drafts were both accepted and
    # rejected, in many rounds.
    rejected = sum(1 for d, a in rounds if a < d) / len(rounds)
    assert sum(a for _, a in rounds) > 0 and 0.2 < rejected, rejected
    q = first_draft_q(target, drafter, [3, 4], SamplingParams(1.0, 1.0, 12, seed=0))
    assert 0.5 * np.abs(q - exact[4]).sum() > 0.03
    if kind == "dspark+lookup":
        assert drafter.from_lookup > 500 and drafter.from_model > 500, (drafter.from_lookup, drafter.from_model)
    if kind == "dspark+vocab":
        assert q[unlisted].sum() == 0 and abs(q.sum() - 1) < 1e-5 and observed[:, unlisted].sum() > 1000


def test_sampled_drafts_are_draws_from_the_reported_q(tmp_path):
    """Each draft token is the sampler's categorical draw from the q it reports (replayed with
    the same key stream), so q is the distribution the verify rule must divide by."""
    engine = make_tiny_engine("qwen3", seed=12)
    for kind, path in (("dspark", write_dspark(tmp_path / "s", engine, markov_rank=16, taps=[0, 2], markov_scale=30.0)),
                       ("dflash", write_dflash(tmp_path / "f", engine, taps=[0, 2], block_size=6, scale=0.5))):
        drafter = drafter_for(engine, path, kind)
        engine.target.set_taps(drafter.tap_layers)
        ids = [6, 7, 8, 9]
        _, hidden = engine.target.prefill(ids[:-1], engine.target.new_cache(), tap=True)
        drafter.begin(ids[:-1], hidden)
        for seed in range(5):
            params = SamplingParams(0.8, 0.95, 40, seed=seed)
            draft = drafter.propose(ids, 5, Sampler(params))
            replay = Sampler(params)
            q = draft.probs
            if kind == "dspark":  # one draw per slot, left to right
                want = [sample_from(q[k], replay.next_key()).item() for k in range(len(draft))]
            else:  # one draw for all slots
                want = sample_from(q, replay.next_key()).tolist()
            assert draft.tokens.tolist() == want
            assert np.allclose(np.array(q).sum(axis=-1), 1.0, atol=1e-5)


# ----------------------------------------------------------------------------------------
# quantization
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,tol", [(8, 0.03), (4, 0.35)])
def test_quantized_drafter_agrees_with_float(tmp_path, bits, tol):
    engine = make_tiny_engine("qwen3", seed=8)
    path = write_dspark(tmp_path / "q", engine, markov_rank=64, taps=[0, 2], scale=0.1)
    ref, cfg = load_checkpoint(path, engine.target)
    quant, _ = load_checkpoint(path, engine.target, bits=bits)
    assert isinstance(quant.layers[0].self_attn.q_proj, block.nn.QuantizedLinear)
    assert isinstance(quant.markov_head.markov_w1, block.nn.QuantizedEmbedding)
    assert not isinstance(quant.confidence_head.proj, block.nn.QuantizedLinear)
    target = engine.target
    target.set_taps(cfg.tap_layers)
    ids = [5, 6, 7, 8, 9, 10]
    _, hidden = target.prefill(ids[:-1], target.new_cache(), tap=True)
    out = []
    for model in (ref, quant):
        d = DSparkDrafter(model, cfg, target)
        d.begin(ids[:-1], hidden)
        h = d.block_states(ids)
        tokens, _, _ = chain_tokens(model, h, ids[-1], GREEDY)
        logits = model.logits(h)
        out.append((np.array(h), np.array(logits), tokens.tolist()))
    (h0, l0, _), (h1, l1, _) = out
    for a, b in ((h0, h1), (l0, l1)):
        err = np.linalg.norm(b - a) / np.linalg.norm(a)
        assert 1e-4 < err < tol, err  # really quantized, and close (random weights quantize badly at 4 bits)


def test_quantization_policy_follows_the_backend(monkeypatch, tiny_qwen3):
    from engine import platform

    assert platform.backend() != "metal" and modes.drafter_bits(tiny_qwen3) is None  # CPU: float32
    monkeypatch.setattr(platform, "backend", lambda: "metal")
    assert modes.drafter_bits(tiny_qwen3) == 4
    for bits, want in ((8, 8), (16, None), (0, None)):
        monkeypatch.setattr(tiny_qwen3, "drafter_bits", bits)
        assert modes.drafter_bits(tiny_qwen3) == want
    monkeypatch.setattr(tiny_qwen3, "drafter_bits", 7)
    with pytest.raises(TandemError, match="drafter bits"):
        modes.drafter_bits(tiny_qwen3)


# ----------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------
def _edit(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _refusal(engine: Engine, path, mode: str = "dspark") -> str:
    engine.drafter_path = str(path)
    with pytest.raises(TandemError) as err:
        engine.generate([5, 6, 7], mode=mode, max_new_tokens=3)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_every_incompatible_checkpoint_is_refused_before_use(tmp_path):
    engine = make_tiny_engine("qwen3", seed=9)  # 4 layers, H=64, vocab 96
    ok = lambda name, **kw: write_dspark(tmp_path / name, engine, taps=[0, 2], **kw)  # noqa: E731
    other = make_tiny_model("qwen3", seed=1, hidden=32)
    wrong_h = ck.write(tmp_path / "h", *ck.dspark_checkpoint(ck.target_config_of(other), taps=[0, 2]))
    assert "hidden size mismatch" in _refusal(engine, wrong_h)
    small_v = make_tiny_model("qwen3", seed=1, vocab=64)
    wrong_v = ck.write(tmp_path / "v", *ck.dspark_checkpoint(ck.target_config_of(small_v), taps=[0, 2]))
    assert "vocab mismatch" in _refusal(engine, wrong_v)
    p = ok("range"); _edit(p, target_layer_ids=[0, 7])
    assert "out of range" in _refusal(engine, p)
    p = ok("final"); _edit(p, target_layer_ids=[0, 3])
    assert "final layer" in _refusal(engine, p)
    p = ok("mask"); _edit(p, mask_token_id=96)
    assert "mask token id 96" in _refusal(engine, p)
    p = ok("block"); _edit(p, block_size=0)
    assert "bad block size" in _refusal(engine, p)
    p = ok("block2"); _edit(p, block_size=500)
    assert "bad block size" in _refusal(engine, p)
    p = ok("layers"); _edit(p, num_target_layers=36)
    assert "36-layer target" in _refusal(engine, p)
    # Weights that do not fit the config.
    cfg, w = ck.dspark_checkpoint(ck.target_config_of(engine.model), taps=[0, 2])
    del w["markov_head.markov_w2.weight"]
    assert "required keys missing: markov_head.markov_w2.weight" in _refusal(engine, ck.write(tmp_path / "miss", cfg, w))
    cfg, w = ck.dspark_checkpoint(ck.target_config_of(engine.model), taps=[0, 2])
    w["layers.0.self_attn.extra.weight"] = np.zeros((2, 2), dtype=np.float32)
    assert "unexpected keys: layers.0.self_attn.extra.weight" in _refusal(engine, ck.write(tmp_path / "extra", cfg, w))
    cfg, w = ck.dspark_checkpoint(ck.target_config_of(engine.model), taps=[0, 2])
    w["fc.weight"] = w["fc.weight"][:, :64]
    assert "wrong shape for fc.weight" in _refusal(engine, ck.write(tmp_path / "shape", cfg, w))
    # Files.
    p = ok("noconfig"); (p / "config.json").unlink()
    assert "config.json is missing" in _refusal(engine, p)
    p = ok("badconfig"); (p / "config.json").write_text("{not json")
    assert "unreadable config.json" in _refusal(engine, p)
    p = ok("trunc"); data = (p / "model.safetensors").read_bytes(); (p / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "safetensors file is corrupt" in _refusal(engine, p)
    p = ok("garbage"); (p / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "safetensors file is corrupt" in _refusal(engine, p)
    p = ok("noweights"); (p / "model.safetensors").unlink()
    assert "model.safetensors is missing" in _refusal(engine, p)
    assert "not found" in _refusal(engine, tmp_path / "nowhere")
    # Formats and modes.
    assert "use --mode dspark" in _refusal(engine, ok("kind"), mode="dflash")
    p = ok("eagle"); _edit(p, architectures=["LlamaForCausalLMEagle3"], markov_rank=None, enable_confidence_head=None)
    assert "is an EAGLE-3 checkpoint; use --mode eagle3" in _refusal(engine, p)
    d = write_dflash(tmp_path / "d2", engine, taps=[0, 2]); _edit(d, dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 2], "draft_window_size": 64})
    assert "draft_window_size" in _refusal(engine, d, mode="dflash")
    p = ok("gemma"); _edit(p, model_type="gemma4_text")
    assert "Gemma-4" in _refusal(engine, p)
    d = write_dflash(tmp_path / "d1", engine, taps=[0, 2]); _edit(d, block_size=1)
    assert "bad block size" in _refusal(engine, d, mode="dflash")
    assert "is a DFlash checkpoint" in _refusal(engine, write_dflash(tmp_path / "d3", engine, taps=[0, 2]), mode="dspark")


def test_repo_id_resolves_only_from_the_local_hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    engine = make_tiny_engine("qwen3", seed=9)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert "not in the local Hugging Face cache" in _refusal(engine, "someone/tiny-dspark")
    snap = tmp_path / "hub" / "models--someone--tiny-dspark" / "snapshots" / "abc123"
    write_dspark(snap, engine, taps=[0, 2])
    (tmp_path / "hub" / "models--someone--tiny-dspark" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-dspark" / "refs" / "main").write_text("abc123")
    assert checkpoint.resolve_drafter_path("someone/tiny-dspark") == snap
    engine.drafter_path = "someone/tiny-dspark"
    assert engine.generate([5, 6, 7], mode="dspark", max_new_tokens=5).generated == 5


def test_checkpoint_script_writes_loadable_drafters(tmp_path, capsys):
    engine = make_tiny_engine("qwen3", seed=1)
    (tmp_path / "target.json").write_text(json.dumps(ck.target_config_of(engine.model)))
    for kind in ("dspark", "dflash"):
        args = ["--kind", kind, "--out", str(tmp_path / kind), "--target-config", str(tmp_path / "target.json"),
                "--markov-rank", "8", "--mask-token-id", "2"]
        assert ck.main(args) == 0
        _, cfg = load_checkpoint(tmp_path / kind, engine.target, mode=kind)
        assert cfg.tap_layers == (1,) and cfg.mask_token_id == 2  # 4 layers: taps 1..N-3 = [1]
    assert "dflash drafter for a 4-layer H=64 V=96 target" in capsys.readouterr().out


@pytest.mark.parametrize("rule", ["slot", "product"])
def test_device_cut_and_replayed_cut_agree_at_every_boundary(rule):
    """The drafter's cut (confident_prefix, on the device) and the calibrator's replay of it
    (keep_count) keep the same slots, thresholds sitting exactly on a score or one ulp off it."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        conf = rng.uniform(0.4, 1.0, 7).astype(np.float32)
        scores = conf if rule == "slot" else np.cumprod(conf, dtype=np.float64)
        at = float(scores[rng.integers(7)])
        for threshold in (at, np.nextafter(at, 0.0), np.nextafter(at, 1.0), float(np.float32(at)), 0.0, 1.0):
            want = keep_count(conf.tolist(), float(threshold), rule)
            assert confident_prefix(mx.array(conf), float(threshold), rule) == want, (conf.tolist(), threshold)
