"""Cache transactions on every cache mlx-lm builds: sliding windows (RotatingKVCache), recurrent
state (ArraysCache: GatedDeltaNet, Mamba2, short convolutions), both in one layer (CacheList) and
quantized K/V. Tiny random targets from mlx-lm's own classes (tests/tiny.py): greedy output equals
baseline in every mode, the caches after every commit equal a clean forward over the committed
tokens, sampled output is an exact sample of the target, and what cannot be rolled back is refused."""

from __future__ import annotations

import copy
import dataclasses
import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, ConcatenateKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from engine import caches, platform
from engine.drafters.base import Draft, Drafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.errors import TandemError
from engine.generate import Engine
from engine.sampling import Sampler, SamplingParams, target_probs
from engine.shapes import ShapePolicy, StableKVCache
from engine.speculative import DecodeStats, FixedCap, decode
from engine.target import Target
from tests import drafter_ckpt as ck
from tests.lossless import assert_same_greedy
from tests.test_sampling import ALPHA, CAP, LENGTH, RUNS, VOCAB, Tally, assert_conditionals, chi2_sf
from tests.tiny import FAMILIES, WINDOW, make_family_model, make_tokenizer

RECURRENT = ("qwen3_5", "nemotron_h", "falcon_h1", "lfm2")
OUT = 4 * WINDOW + 4  # every output wraps the sliding windows several times
GREEDY = Sampler(SamplingParams())
SAMPLED = SamplingParams(temperature=1.0, top_k=6)


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts shorter and longer than the window; every other one repeats a span (lookup drafts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(2, vocab) for _ in range([3, 6, 11, 19][i % 4])]
        out.append(body + body[: max(2, len(body) // 2)] + body if i % 2 else body)
    return out


def noisy_copy(arch: str, seed: int, noise: float, **kw) -> nn.Module:
    """The target's own weights with a perturbed head: a draft model (of the same family) that is
    right often but not always, so drafts are rejected at every position."""
    model = make_family_model(arch, seed=seed, **kw)
    params = dict(tree_flatten(model.parameters()))
    key = next(k for k in ("lm_head.weight", "language_model.lm_head.weight", "model.embed_tokens.weight")
               if k in params)
    w = params[key]
    model.load_weights([(key, w + noise * mx.abs(w).mean() * mx.random.normal(w.shape, key=mx.random.key(seed)))],
                       strict=False)
    mx.eval(model.parameters())
    return model


def drafter_target_config(target: Target) -> dict:
    """What a DSpark/DFlash checkpoint needs to know about any target."""
    return {"model_type": "qwen3", "hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "vocab_size": target.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 4096}


def write_drafters(tmp_path, target: Target) -> dict[str, str]:
    tc = drafter_target_config(target)
    cfg, w = ck.dspark_checkpoint(tc, taps=[0, 2], markov_rank=16)
    w["embed_tokens.weight"] = np.array(target.embed_tokens.weight, dtype=np.float32)
    w["lm_head.weight"] = np.array(target.head(mx.eye(target.hidden_size)).T, dtype=np.float32)
    for k in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
        w[k] = w[k] * 10.0
    return {"dspark": str(ck.write(tmp_path / "dspark", cfg, w)),
            "dflash": str(ck.write(tmp_path / "dflash", *ck.dflash_checkpoint(tc, taps=[1, 2], block_size=6)))}


def assert_cache_is_clean(target: Target, cache: list, ids: list[int], label: str) -> None:
    """``cache`` equals a clean forward over ``ids`` (one chunk): offsets, K/V rows in temporal
    order over each sliding window, recurrent states; and the next forward gives the same logits."""
    clean = target.new_cache()
    target.forward(mx.array([ids]), clean)
    for i, (a, b) in enumerate(zip(caches.leaves(cache), caches.leaves(clean))):
        where = f"{label}: cache {i} ({type(a).__name__}) after {len(ids)} tokens"
        assert type(a) is type(b), where
        if type(a) is ArraysCache:
            for x, y in zip(a.cache, b.cache):
                assert x.shape == y.shape and mx.allclose(x, y, atol=1e-4, rtol=1e-3).item(), where
            continue
        assert a.offset == b.offset == len(ids), where
        if type(a) is RotatingKVCache:
            rows = min(a.offset, a.max_size)
            pairs = [(a._temporal_order(x)[..., -rows:, :], b._temporal_order(y)[..., -rows:, :])
                     for x, y in ((a.keys, b.keys), (a.values, b.values))]
        else:  # a quantized cache holds (data, scales, biases) per side
            mine = (*a.keys, *a.values) if type(a) is QuantizedKVCache else (a.keys, a.values)
            clean_ = (*b.keys, *b.values) if type(b) is QuantizedKVCache else (b.keys, b.values)
            pairs = [(x[..., : a.offset, :], y[..., : a.offset, :]) for x, y in zip(mine, clean_)]
        for x, y in pairs:
            assert x.shape == y.shape and mx.allclose(x, y, atol=1e-4, rtol=1e-3).item(), where
    nxt = mx.array([[ids[-1]]])
    got, _ = target.forward(nxt, copy.deepcopy(cache))
    want, _ = target.forward(nxt, clean)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-3).item(), f"{label}: next logits differ after {len(ids)} tokens"


class Scripted(Drafter):
    """Drafts the true continuation with one wrong token at a rotating position, so each round
    accepts 0, 1, ..., cap drafts in turn."""

    name = "scripted"

    def __init__(self, truth: list[int], prompt_len: int, vocab: int, max_draft: int = 4):
        self.truth, self.prompt_len, self.vocab, self.max_draft = truth, prompt_len, vocab, max_draft
        self.round = 0

    def propose(self, ids, cap, sampler):
        at = len(ids) - self.prompt_len
        good = self.truth[at : at + cap]
        j = self.round % (cap + 1)
        self.round += 1
        if j < len(good):
            good = good[:j] + [(good[j] + 1) % self.vocab] + good[j + 1 :]
        return Draft(mx.array(good, dtype=mx.uint32)) if good else None


# ----------------------------------------------------------------------------------------
# greedy: every mode, every family
# ----------------------------------------------------------------------------------------
# CUDA's stable shapes on every family: full-attention layers get StableKVCache (whole-buffer
# attention with a mask, padded verifies), sliding windows and recurrent state stay as they are.
STABLE = ShapePolicy(step=16, widths=(1, 2, 4, 8))


def under_stable_shapes(target: Target) -> None:
    target.set_shapes(STABLE)
    kinds = [type(c) for c in caches.leaves(target.new_cache())]
    assert target.shapes == STABLE, target.shapes_refused
    assert StableKVCache in kinds and KVCache not in kinds


# Stable shapes on a windowed and two hybrid families here (every family, CacheList included, in
# the commit test below): the suite's time goes where the drafters' paths differ.
@pytest.mark.parametrize("arch,shapes", [(a, "exact") for a in FAMILIES] + [(a, "stable") for a in ("gemma3", "qwen3_5", "lfm2")])
def test_greedy_output_identical_in_every_mode(tmp_path, arch, shapes):
    engine = Engine(make_family_model(arch, seed=3), make_tokenizer(), name=f"tiny-{arch}")
    if shapes == "stable":
        under_stable_shapes(engine.target)
    assert engine.target.speculation_blocker() is None and engine.resolve_mode("auto") == "lookup"
    # A draft model of the same family (sliding-window or hybrid itself), right most of the time.
    engine.set_drafter("draft", DraftModelDrafter(noisy_copy(arch, 3, noise=0.6), max_draft=4))
    paths = write_drafters(tmp_path, engine.target)
    engine.drafter_path = paths["dspark"]
    assert engine.resolve_mode("auto") == "dspark"  # --mode auto runs a hybrid/sliding target's drafter
    drafted = partial = 0
    for i, ids in enumerate(prompts(6, 96, seed=21)):  # each cycled cap twice
        base = engine.generate(ids, mode="baseline", max_new_tokens=OUT)
        for mode, cap in (("lookup", None), ("draft", 3), ("dspark", (1, 3, 0)[i % 3]), ("dflash", (0, 1, 3)[i % 3])):
            engine.drafter_path = paths.get(mode)
            res = engine.generate(ids, mode=mode, max_new_tokens=OUT, max_draft=cap)
            assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"{arch}/{mode}/cap {cap}/prompt {i}")
            drafted += res.drafted
            partial += sum(1 for d, a in res.rounds if 0 < a < d)
    assert drafted > 0 and partial > 0  # real speculative rounds, rejections after accepted drafts


# ----------------------------------------------------------------------------------------
# the caches after every commit
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shapes", ["exact", "stable"])
@pytest.mark.parametrize("arch,method", [(a, m) for a in FAMILIES
                                         for m in (("states", "replay") if a in RECURRENT else (None,))])
def test_cache_after_every_commit_equals_a_clean_forward(monkeypatch, arch, method, shapes):
    model = make_family_model(arch, seed=5)
    target = Target(model, rollback_method=method)
    if shapes == "stable":  # 5-token verifies padded to 8: the filler rows are cut with the rejected drafts
        under_stable_shapes(target)
    assert target.speculation_blocker() is None
    if method:
        assert target.recorder.method == method  # the load-time check passed for this way
    prompt = prompts(2, 96, seed=4)[1]
    truth = [t for new, _ in decode(target, None, prompt, GREEDY, max_new_tokens=OUT) for t in new]
    seen = {}
    verify = target.verify

    def spy(ids, cache, **kw):
        seen["cache"] = cache
        return verify(ids, cache, **kw)

    monkeypatch.setattr(target, "verify", spy)
    out, kept = [], set()
    stats = DecodeStats()
    for new, event in decode(target, Scripted(truth, len(prompt), 96), prompt, GREEDY, max_new_tokens=OUT,
                             cap_policy=FixedCap(4), stats=stats):
        out += new
        kept.add(event.accepted)
        if "cache" in seen:  # the cache holds everything but the newest token (the next anchor)
            assert_cache_is_clean(target, seen["cache"], prompt + out[:-1], f"{arch}/{method}")
    assert out == truth
    assert {0, 1, 2, 3, 4} <= kept  # rejections at every position of a 4-token draft


@pytest.mark.parametrize("arch", ["llama-sliding", "qwen3_5", "falcon_h1"])
def test_draft_model_proposes_the_same_after_repeated_proposals(arch):
    """Calibration proposes again and again from the same tokens, without commits: every
    proposal must start from the committed tokens only (no stale drafted rows)."""
    drafter = DraftModelDrafter(make_family_model(arch, seed=9), max_draft=5)
    ids = prompts(2, 96, seed=5)[1] * 2  # longer than the window
    drafter.begin(ids[:-1], None)
    first = drafter.propose(ids, 5, GREEDY).tokens.tolist()
    for cap in (5, 2, 5):
        assert drafter.propose(ids, cap, GREEDY).tokens.tolist() == first[:cap]


# ----------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------
def sharp_attention(model: nn.Module, factor: float) -> nn.Module:
    """Scale query and key projections: peaked attention makes the output depend on which rows
    the window holds (a sliding-window target where a stale row shows)."""
    model.load_weights([(k, v * factor) for k, v in tree_flatten(model.parameters())
                        if k.endswith(("q_proj.weight", "k_proj.weight"))], strict=False)
    mx.eval(model.parameters())
    return model


def sampled_ranks(arch: str, runs: int = RUNS) -> Tally:
    """tests/test_sampling.py's check, with each token's outcome taken as its *rank* under its
    exact conditional (a clean forward over its own prefix), per draft position and previous
    token. A cache holding the wrong context draws from another context's distribution, which
    ranks the drawn tokens lower; by token identity, such errors average out over contexts."""
    kw = dict(vocab=VOCAB, hidden=32, scale=2.0)
    sharp = 3.0 if arch == "llama-sliding" else 1.0
    target = Target(sharp_attention(make_family_model(arch, seed=7, **kw), sharp))
    # A draft model of the same family with a sharper head: long accepted runs, rejections everywhere.
    drafter = DraftModelDrafter(sharp_attention(make_family_model(arch, seed=7, **{**kw, "scale": 3.0}), sharp),
                                max_draft=CAP)
    prompt, tally = [3, 1, 5], Tally()
    for run in range(runs):
        tokens, positions = [], []
        for new, event in decode(target, drafter, prompt, Sampler(dataclasses.replace(SAMPLED, seed=run)),
                                 max_new_tokens=LENGTH, cap_policy=FixedCap(CAP)):
            tokens += new
            positions += range(len(new))
            if event.drafted:
                tally.outcomes[event.drafted, event.accepted] += 1
        seq = prompt + tokens
        logits = target.model(mx.array([seq[:-1]]))[0, len(prompt) - 1 :]
        exact = np.array(target_probs(logits, SAMPLED), dtype=np.float64)
        for row, prev, tok, j in zip(exact, seq[len(prompt) - 1 : -1], tokens, positions):
            order = np.argsort(-row, kind="stable")
            tally.add(j, prev, int(np.nonzero(order == tok)[0][0]), row[order])
    return tally


@pytest.mark.parametrize("arch", ["qwen3_5", "llama-sliding"])
def test_sampled_tokens_are_exact_samples_of_the_target(arch):
    """Tokens sampled through the real loop on a hybrid and a sliding-window target (and draft
    model) follow the target's exact conditionals at every draft position. With the rollback
    removed (recurrent state kept after every verified row; rejected rows left in the window)
    this check fails at p < 1e-8."""
    tally = sampled_ranks(arch)
    full = tally.outcomes[CAP]
    assert min(int(full[i]) for i in range(CAP)) >= 10 and full[CAP] >= 10, f"rounds by accepted drafts: {full}"
    assert tally.impossible == 0  # never a token outside the target's top-k
    assert_conditionals(tally, CAP, f"{arch} ")


def test_the_sampling_check_catches_recurrent_state_left_unrolled(monkeypatch):
    """The check above has power: with the recurrent state kept after every verified row (the
    bug this transaction prevents) it fails, on a tenth of the tokens."""
    from engine import recurrent

    monkeypatch.setattr(recurrent.Recording, "rewind", lambda self, txn, kept: {
        i for i, c in enumerate(txn.leaves) if type(c) is ArraysCache})
    tally = sampled_ranks("qwen3_5", runs=1)
    assert min(chi2_sf(*tally.chi2(j)) for j in range(CAP + 1)) < ALPHA and tally.impossible > 0


# ----------------------------------------------------------------------------------------
# what the recorder cannot see, and what cannot be rolled back at all
# ----------------------------------------------------------------------------------------
class ToyMixer(nn.Module):
    """An exponential moving average over the rows, its state in an ArraysCache slot, computed by
    a plain Python loop (no recurrence mlx-lm's models share): per-position states cannot be
    derived, so it is replayed."""

    def __init__(self, dim: int, where: str):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.where = where

    def step(self, x: mx.array, state: mx.array | None) -> tuple[mx.array, mx.array]:
        state = mx.zeros((x.shape[0], x.shape[2])) if state is None else state
        rows = []
        for u in self.proj(x).transpose(1, 0, 2):
            state = 0.7 * state + u
            rows.append(state)
        return mx.stack(rows, axis=1), state

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if self.where == "attribute":  # state kept out of the cache: nothing can roll it back
            out, self._state = self.step(x, getattr(self, "_state", None))
            return out
        out, state = self.step(x, cache[0])
        cache[0] = state
        return out


class ToyLayer(nn.Module):
    def __init__(self, dim: int, where: str):
        super().__init__()
        self.mixer = ToyMixer(dim, where)

    def __call__(self, x, mask=None, cache=None):
        return x + self.mixer(x, mask, cache)


class ToyTrunk(nn.Module):
    def __init__(self, vocab: int, dim: int, where: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = [ToyLayer(dim, where) for _ in range(2)]
        self.where = where

    def __call__(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        for layer, c in zip(self.layers, cache or [None] * len(self.layers)):
            if self.where == "model":  # the model updates the cache itself: no module receives it
                out, c[0] = layer.mixer.step(h, c[0])
                h = h + out
            else:
                h = layer(h, cache=c)
        return h


class ToyModel(nn.Module):
    def __init__(self, where: str, vocab: int = 32, dim: int = 16):
        super().__init__()
        mx.random.seed(1)
        self.model = ToyTrunk(vocab, dim, where)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.args = type("Args", (), {"vocab_size": vocab})()
        mx.eval(self.parameters())

    def __call__(self, inputs, cache=None):
        return self.lm_head(self.model(inputs, cache))

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return [ArraysCache(size=1) for _ in self.layers]


@pytest.mark.parametrize("where", ["module", "model"])
def test_recurrent_state_the_recorder_cannot_derive_is_replayed_or_rerun(where):
    engine = Engine(ToyModel(where), make_tokenizer(32), name=f"toy-{where}")
    assert engine.target.speculation_blocker() is None
    engine.set_drafter("draft", DraftModelDrafter(ToyModel(where), max_draft=4))
    for ids in prompts(4, 32, seed=8):
        base = engine.generate(ids, mode="baseline", max_new_tokens=24)
        for mode in ("lookup", "draft"):
            res = engine.generate(ids, mode=mode, max_new_tokens=24, max_draft=4)
            assert res.token_ids == base.token_ids, (where, mode, ids)


def test_state_kept_outside_the_cache_fails_the_load_check_and_runs_baseline():
    engine = Engine(ToyModel("attribute"), make_tokenizer(32), name="toy")
    reason = engine.target.speculation_blocker()
    assert reason is not None and "failed the load-time check" in reason and "\n" not in reason
    assert engine.generate([3, 4, 5], mode="baseline", max_new_tokens=5).generated == 5


class OwnCache(KVCache):
    """A cache class the engine has never seen (a subclass may keep rows its own way)."""


def test_unknown_cache_type_is_refused_with_its_reason_and_baseline_runs():
    model = make_family_model("llama-sliding", seed=2)
    model.make_cache = lambda: [OwnCache() for _ in model.layers]
    engine = Engine(model, make_tokenizer(), name="own-cache")
    reason = engine.target.speculation_blocker()
    assert reason == "layer 0 keeps a OwnCache cache, which the engine cannot roll back"
    assert engine.generate([3, 4, 5], mode="baseline", max_new_tokens=6).note is None
    auto = engine.generate([3, 4, 5], mode="auto", max_new_tokens=6)  # falls back, and says why
    assert auto.mode == "baseline" and auto.generated == 6
    assert auto.note == f"speculation off: own-cache: {reason}" and auto.note in auto.summary()
    with pytest.raises(TandemError, match="--mode lookup cannot run: own-cache: layer 0 keeps a OwnCache cache"):
        engine.generate([3, 4, 5], mode="lookup", max_new_tokens=6)
    support = engine.mode_support()
    assert support["baseline"] is None and support["auto"] is None
    assert all(reason in support[m] for m in ("lookup", "draft", "dspark", "dflash"))
    # A draft model whose cache cannot roll back: auto runs baseline, --mode draft is refused.
    target = Engine(make_family_model("qwen3_5", seed=2), make_tokenizer(), name="hybrid")
    target.draft_model_spec = "own-cache-draft"  # --mode auto picks the draft model
    target.set_drafter("draft", DraftModelDrafter(model, max_draft=3))
    assert target.generate([3, 4, 5], mode="auto", max_new_tokens=4).note.startswith("speculation off: the draft model")
    with pytest.raises(TandemError, match="--mode draft cannot run: the draft model: layer 0 keeps a OwnCache"):
        target.generate([3, 4, 5], mode="draft", max_new_tokens=4)
    assert caches.blocker(caches.quantize_kv([KVCache(), RotatingKVCache(8), ArraysCache(2)], 8)) is None


def test_a_trim_that_trims_nothing_is_an_error_not_silence():
    from mlx_lm.models.cache import trim_prompt_cache

    c = RotatingKVCache(max_size=4)
    for _ in range(6):
        c.update_and_fetch(mx.zeros((1, 1, 1, 8)), mx.zeros((1, 1, 1, 8)))
    assert trim_prompt_cache([c], 2) == 0  # wrapped: mlx-lm trims nothing and says so only by a 0
    with pytest.raises(caches.CacheError, match="cannot be trimmed back"):
        caches.trim_to([c], c.offset - 2)
    with pytest.raises(caches.CacheError, match="trimmed 0 of 2 rows"):
        caches.trim(KVCache(), 2)
    cat = ConcatenateKVCache()  # its own trim keeps the rows, and the next update would reuse them
    cat.update_and_fetch(mx.zeros((1, 1, 5, 8)), mx.zeros((1, 1, 5, 8)))
    caches.trim(cat, 2)
    keys, _ = cat.update_and_fetch(mx.ones((1, 1, 1, 8)), mx.ones((1, 1, 1, 8)))
    assert cat.offset == 4 and keys.shape[2] == 4 and keys[0, 0, 3, 0].item() == 1
    with pytest.raises(caches.CacheError, match="cannot keep 0 of a 1-row forward"):
        caches.Verify([c], 1).commit(0)
    txn = caches.Verify([KVCache()], 1)
    txn.commit(1)
    with pytest.raises(caches.CacheError, match="committed already"):
        txn.commit(1)


# ----------------------------------------------------------------------------------------
# quantized K/V
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_kv_bits_output_equals_baseline_with_the_same_bits(bits):
    from mlx_lm.models import llama

    mx.random.seed(6)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=3, intermediate_size=256,
                           num_attention_heads=2, num_key_value_heads=1, vocab_size=96, rms_norm_eps=1e-5,
                           tie_word_embeddings=False)  # head dim 64: one quantization group
    model = llama.Model(args)
    mx.eval(model.parameters())
    engine = Engine(model, make_tokenizer(), name="tiny-kv")
    engine.set_kv_bits(bits)
    if platform.backend() == "cpu":  # off here, with the reason; forced on below
        assert engine.kv_bits is None and engine.notes[0].startswith(f"--kv-bits {bits} is off on the cpu backend")
        assert all(type(c) is KVCache for c in engine.target.new_cache())
    engine.set_kv_bits(bits, force=True)
    assert engine.kv_bits == bits and not engine.notes
    assert all(type(c) is QuantizedKVCache and c.bits == bits for c in engine.target.new_cache())
    engine.set_drafter("draft", DraftModelDrafter(model, max_draft=4))
    ids = prompts(2, 96, seed=3)[1]
    base = engine.generate(ids, mode="baseline", max_new_tokens=30)
    for mode in ("lookup", "draft"):
        res = engine.generate(ids, mode=mode, max_new_tokens=30, max_draft=4)
        assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"kv{bits}/{mode}",
                           new_cache=engine.target.new_cache)
    cache = engine.target.new_cache()
    logits_q, _ = engine.target.forward(mx.array([ids]), cache)
    engine.set_kv_bits(None)
    logits_f, _ = engine.target.forward(mx.array([ids]), engine.target.new_cache())
    assert mx.abs(logits_q - logits_f).max().item() > 1e-5  # the K/V really were quantized


def test_kv_bits_policy_follows_the_backend(monkeypatch):
    from engine import modes
    from engine.options import add_model_arguments

    monkeypatch.setattr(platform, "backend", lambda: "metal")
    assert modes.kv_bits_policy(4) == (4, None) and modes.kv_bits_policy(None) == (None, None)
    monkeypatch.setattr(platform, "backend", lambda: "cpu")
    assert modes.kv_bits_policy(8)[0] is None and modes.kv_bits_policy(8, force=True) == (8, None)
    with pytest.raises(TandemError, match="--kv-bits must be one of 4, 8"):
        modes.kv_bits_policy(2)
    import argparse

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    assert p.parse_args(["--kv-bits", "8"]).kv_bits == 8
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-bits", "3"])


def test_doctor_shows_a_models_caches_and_modes():
    from engine.doctor import model_rows

    rows = dict(model_rows(Engine(make_family_model("nemotron_h", seed=2), make_tokenizer(), name="hybrid")))
    assert rows["Caches"].startswith("2 ArraysCache (recurrent), 1 KVCache (full attention); "
                                     "recurrent state rewound by")
    assert rows["--mode lookup"] == "runs"
    model = make_family_model("llama-sliding", seed=2)
    model.make_cache = lambda: [OwnCache() for _ in model.layers]
    rows = dict(model_rows(Engine(model, make_tokenizer(), name="own-cache")))
    assert "OwnCache (unknown to the engine)" in rows["Caches"] and "cannot roll back" in rows["--mode lookup"]


def test_kv_bits_refused_in_one_line_when_the_head_dim_does_not_fit():
    target = Target(make_family_model("qwen3_5", seed=1))  # head dim 16 < one group of 64
    with pytest.raises(TandemError, match="4-bit KV cache refused") as err:
        target.set_kv_bits(4)
    assert "\n" not in str(err.value) and target.kv_bits is None
    with pytest.raises(TandemError, match="kv bits must be one of 4, 8"):
        target.set_kv_bits(3)


# ----------------------------------------------------------------------------------------
# snapshots for a prefix cache
# ----------------------------------------------------------------------------------------
def test_snapshot_restore_and_trimmable_to():
    target = Target(make_family_model("falcon_h1", seed=2))
    cache = target.new_cache()
    target.forward(mx.array([[3, 4, 5, 6, 7]]), cache)
    snap = caches.snapshot(cache)
    assert not caches.trimmable_to(cache, 3) and caches.trimmable_to(cache, 5)  # recurrent state
    target.forward(mx.array([[8, 9]]), cache)
    target.forward(mx.array([[10]]), cache)
    caches.restore(cache, snap)
    assert_cache_is_clean(target, cache, [3, 4, 5, 6, 7], "restored snapshot")
    sliding = Target(make_family_model("llama-sliding", seed=2))
    cache = sliding.new_cache()
    sliding.forward(mx.array([list(range(2, 2 + WINDOW - 2))]), cache)
    assert caches.trimmable_to(cache, 2)  # the window has not wrapped yet
    caches.trim_to(cache, 2)
    assert_cache_is_clean(sliding, cache, [2, 3], "trimmed")
    sliding.forward(mx.array([list(range(2, 2 + 2 * WINDOW))]), cache)
    assert not caches.trimmable_to(cache, 4)  # wrapped: older rows are gone
