"""Draft vocabularies (FR-Spec): a DSpark drafter folder's draft_vocab.json restricts the head
and the Markov output to the listed tokens. Drafts come only from them, the logits over them
are the full head's, output stays the target's own (greedy here; sampled exactness in
test_block_drafters), and a damaged file is refused with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.drafters.checkpoint import DRAFT_VOCAB_FILE
from engine.errors import TandemError
from engine.sampling import Sampler, SamplingParams
from engine.train.data import Example, draft_vocabulary
from tests.lossless import assert_same_greedy
from tests.test_block_drafters import _refusal, prompts, write_dspark
from tests.tiny import make_tiny_engine

GREEDY = Sampler(SamplingParams())
LISTED = [int(t) for t in np.random.default_rng(3).permutation(96)[:40]]


@pytest.fixture
def setup(tmp_path):
    engine = make_tiny_engine("llama", seed=6)  # vocab 96
    path = write_dspark(tmp_path / "d", engine, layers=2, taps=[0, 1, 2], markov_scale=10.0)
    (path / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": LISTED}))
    engine.drafter_path = str(path)
    return engine


def _drafter(engine, n):
    engine.draft_vocab = n
    return engine.drafter("dspark")


def test_drafts_come_from_the_listed_tokens_with_the_full_heads_logits(setup):
    engine = setup
    full, sub, first8 = _drafter(engine, 0), _drafter(engine, None), _drafter(engine, 8)
    assert full.vocab_ids is None and sub.model.lm_head.weight.shape[0] == 40
    assert np.array(first8.vocab_ids).tolist() == LISTED[:8]
    idx = mx.array(LISTED)
    assert mx.array_equal(sub.model.lm_head.weight, full.model.lm_head.weight[idx]).item()
    assert mx.array_equal(sub.model.markov_head.markov_w2.weight, full.model.markov_head.markov_w2.weight[idx]).item()
    engine.target.set_taps(sub.tap_layers)
    seen = set()
    for ids in prompts(6, 96, seed=2):
        ids = [5] + ids
        _, hidden = engine.target.prefill(ids[:-1], engine.target.new_cache(), tap=True)
        sub.begin(ids[:-1], hidden)
        tokens = np.array(sub.propose(ids, 7, GREEDY).tokens).tolist()
        seen |= set(tokens)
        # slot 0: the full head's argmax over the listed columns (the Markov bias included)
        full.begin(ids[:-1], hidden)
        h = full.block_states(ids)[:1]
        bias, _ = full.model.markov_head.step(mx.array(ids[-1], dtype=mx.uint32), h[0], None)
        logits = (full.model.logits(h)[0] + bias)[idx]
        assert tokens[0] == LISTED[int(mx.argmax(logits).item())]
    assert seen <= set(LISTED) and len(seen) > 3


def test_greedy_output_is_unchanged(setup):
    engine = setup
    engine.draft_vocab = None
    drafted = 0
    for i, ids in enumerate(prompts(8, 96, seed=4)):
        n = [3, 9, 20, 40][i % 4]
        base = engine.generate(ids, mode="baseline", max_new_tokens=n)
        res = engine.generate(ids, mode="dspark", max_new_tokens=n, max_draft=0)
        assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"prompt {i}")
        drafted += res.drafted
    assert drafted > 0 and engine.drafter("dspark").vocab_ids is not None


@pytest.mark.parametrize("content, reason", [
    ("{not json", "unreadable draft_vocab.json"),
    (json.dumps({"token_ids": []}), "needs 'token_ids'"),
    (json.dumps({"ids": [1, 2]}), "needs 'token_ids'"),
    (json.dumps({"token_ids": [1, 2, 96]}), "outside the vocabulary (0..95): [96]"),
    (json.dumps({"token_ids": [1, 2, 2]}), "more than once"),
    (json.dumps({"token_ids": [1, True]}), "needs 'token_ids'"),
])
def test_a_damaged_draft_vocabulary_is_refused(setup, content, reason):
    engine = setup
    (Path(engine.drafter_path) / DRAFT_VOCAB_FILE).write_text(content)
    msg = _refusal(engine, engine.drafter_path)
    assert reason in msg and "draft_vocab.json" in msg
    engine.draft_vocab = 0  # the full vocabulary never reads the file
    assert engine.generate([5, 6, 7], mode="dspark", max_new_tokens=3).generated == 3


def test_negative_size_is_refused(setup):
    setup.draft_vocab = -1
    assert "must be >= 0" in _refusal(setup, setup.drafter_path)


def test_vocabulary_from_answers_covers_what_was_asked():
    answers = [Example("gsm8k", [1], [7] * 50 + [8] * 30 + [9] * 15 + [10] * 4 + [11]) for _ in range(3)]
    v = draft_vocabulary(answers, 5000, coverage=0.95, minimum=1, always=[4000])
    assert v["token_ids"][:3] == [7, 8, 9] and len(v["token_ids"]) == 257  # 256 (rounded up) + EOS
    assert v["token_ids"][-1] == 4000 and v["coverage"] == 1.0 and v["counted_tokens"] == 300
    small = draft_vocabulary(answers, 5000, coverage=0.5, minimum=1)
    assert len(small["token_ids"]) == 256 and small["token_ids"][0] == 7
    with pytest.raises(TandemError, match="no answer tokens"):
        draft_vocabulary([Example("x", [1], [])], 10)


def test_a_quantized_drafter_keeps_its_draft_vocabulary(setup):
    """Metal/CUDA quantize the drafter after the restriction: the smaller head is what they read."""
    import mlx.nn as nn

    from engine.drafters.checkpoint import load_checkpoint
    from engine.drafters.dspark import DSparkDrafter

    engine = setup
    model, cfg = load_checkpoint(Path(engine.drafter_path), engine.target, mode="dspark", bits=4)
    assert isinstance(model.lm_head, nn.QuantizedLinear) and model.lm_head.weight.shape[0] == len(LISTED)
    drafter = DSparkDrafter(model, cfg, engine.target)
    engine.target.set_taps(drafter.tap_layers)
    ids = [5, 9, 14, 3, 22]
    _, hidden = engine.target.prefill(ids[:-1], engine.target.new_cache(), tap=True)
    drafter.begin(ids[:-1], hidden)
    assert set(np.array(drafter.propose(ids, 7, GREEDY).tokens).tolist()) <= set(LISTED)


def test_d2t_in_the_weights_gives_the_same_drafter(setup, tmp_path):
    """A DSpark folder whose head and Markov output are stored over the listed tokens only, with
    d2t/t2d (vLLM speculators' form), drafts exactly as the full folder restricted to them; a
    full-size folder with d2t (what train-drafter exports) reads d2t as its list."""
    from engine.drafters.checkpoint import vocab_tensors
    from tests import drafter_ckpt as ck

    engine = setup
    full = Path(engine.drafter_path)
    cfg = json.loads((full / "config.json").read_text())
    w = {k: np.array(v) for k, v in mx.load(str(full / "model.safetensors")).items()}
    tensors = {k: np.array(v) for k, v in vocab_tensors(LISTED, 96).items()}
    reduced = dict(w, **tensors)
    for key in ("lm_head.weight", "markov_head.markov_w2.weight"):
        reduced[key] = w[key][LISTED]
    ck.write(tmp_path / "reduced", dict(cfg, draft_vocab_size=len(LISTED)), reduced)
    ck.write(tmp_path / "listing", cfg, dict(w, **tensors))  # full-size tensors, d2t as the list
    expected = _drafter(engine, None)
    engine.target.set_taps(expected.tap_layers)
    for folder in ("reduced", "listing"):
        engine.drafter_path = str(tmp_path / folder)
        got = _drafter(engine, None)
        assert np.array(got.vocab_ids).tolist() == LISTED and got.model.lm_head.weight.shape[0] == len(LISTED)
        for ids in prompts(4, 96, seed=5):
            ids = [5] + ids
            _, hidden = engine.target.prefill(ids[:-1], engine.target.new_cache(), tap=True)
            for d in (expected, got):
                d.begin(ids[:-1], hidden)
            assert got.propose(ids, 7, GREEDY).tokens.tolist() == expected.propose(ids, 7, GREEDY).tokens.tolist()
        assert np.array(_drafter(engine, 8).vocab_ids).tolist() == LISTED[:8]
    engine.draft_vocab = 0
    assert "cannot draft from the full vocabulary" in _refusal(engine, tmp_path / "reduced")
    engine.draft_vocab = None
    other = next(t for t in range(96) if t not in LISTED)
    ck.write(tmp_path / "mismatch", dict(cfg, draft_vocab_size=len(LISTED)), reduced)
    (tmp_path / "mismatch" / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": LISTED[:-1] + [other]}))
    assert "draft_vocab.json and d2t list different tokens" in _refusal(engine, tmp_path / "mismatch")
    cfg_bad = dict(cfg, draft_vocab_size=len(LISTED))
    ck.write(tmp_path / "no_d2t", cfg_bad, {k: v for k, v in reduced.items() if k not in ("d2t", "t2d")})
    assert "needs a 'd2t' tensor" in _refusal(engine, tmp_path / "no_d2t")


def test_averaged_drafters_keep_one_parents_vocabulary_and_load(tmp_path):
    """tests/device/soup_drafters.py (how the fifth starter drafter was made): every floating
    tensor is the parents' weighted mean, the draft vocabulary (d2t/t2d, draft_vocab.json) is
    the first parent's whole, and the result loads and drafts from that vocabulary; parents of
    different shapes are refused."""
    import importlib.util

    from engine.drafters.checkpoint import vocab_tensors
    from tests import drafter_ckpt as ck

    script = Path(__file__).parent / "device" / "soup_drafters.py"
    spec = importlib.util.spec_from_file_location("soup_drafters", script)
    soup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soup)
    engine = make_tiny_engine("llama", seed=6)  # vocab 96
    other = [t for t in range(96) if t not in LISTED][:30]
    parents = []
    for name, seed, listed in (("a", 1, LISTED), ("b", 2, other)):
        cfg, w = ck.dspark_checkpoint(ck.target_config_of(engine.model), layers=2, taps=[0, 1, 2], seed=seed)
        ck.copy_target_head(w, engine.model)
        w.update({k: np.array(v) for k, v in vocab_tensors(listed, 96).items()})
        parents.append(ck.write(tmp_path / name, cfg, w))
        (parents[-1] / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": listed}))
    soup.soup(parents[0], parents[1], tmp_path / "soup", weight=0.25)
    a, b, s = (mx.load(str(p / "model.safetensors")) for p in (*parents, tmp_path / "soup"))
    assert mx.array_equal(s["d2t"], a["d2t"]).item() and mx.array_equal(s["t2d"], a["t2d"]).item()
    for key in ("fc.weight", "layers.1.mlp.down_proj.weight", "markov_head.markov_w2.weight"):
        want = (0.75 * a[key].astype(mx.float32) + 0.25 * b[key].astype(mx.float32)).astype(b[key].dtype)
        assert mx.array_equal(s[key], want).item() and not mx.array_equal(s[key], a[key]).item(), key
    assert json.loads((tmp_path / "soup" / DRAFT_VOCAB_FILE).read_text())["token_ids"] == LISTED
    engine.drafter_path = str(tmp_path / "soup")
    drafter = _drafter(engine, None)
    assert np.array(drafter.vocab_ids).tolist() == LISTED
    prompt = [5, 9, 14, 3, 22]
    base = engine.generate(prompt, mode="baseline", max_new_tokens=24)
    spec_run = engine.generate(prompt, mode="dspark", max_new_tokens=24, max_draft=7)
    assert_same_greedy(engine.model, prompt, base.token_ids, spec_run.token_ids, "dspark (averaged drafter)")
    cfg, w = ck.dspark_checkpoint(ck.target_config_of(engine.model), layers=1, taps=[0, 1, 2])
    ck.write(tmp_path / "one_layer", cfg, w)
    with pytest.raises(SystemExit, match="different tensors"):
        soup.soup(parents[0], tmp_path / "one_layer", tmp_path / "bad")
