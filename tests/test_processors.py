"""Penalties, logit_bias and logprobs (engine/processors.py) through the real verify loop.

Every check compares against a reference written here in NumPy from the definitions (vLLM's):
one clean target forward over the whole sequence, then for each position the bias, the
repetition penalty over prompt + output before it, the frequency and presence penalties over
the output before it. Speculative decoding must give exactly what plain decoding with the same
processors gives: greedy tokens identical in every mode, sampled tokens an exact sample of the
processed target (chi-square per draft position with multi-token drafts and rejections, as in
tests/test_sampling.py), logprobs equal to the reference's log-softmax.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.lookup import LookupDrafter
from engine.errors import TandemError
from engine.processors import LogitsProcessor, Processing, parse_logit_bias
from engine.sampling import Sampler, SamplingParams
from engine.speculative import FixedCap, decode
from engine.target import Target
from tests import test_sampling as ts
from tests.lossless import TIE_MARGIN, first_divergence
from tests.test_block_drafters import write_dspark
from tests.tiny import make_tiny_engine, make_tiny_model

SETTINGS = {
    "repetition": Processing(repetition_penalty=1.4),
    "presence+frequency": Processing(presence_penalty=0.8, frequency_penalty=0.6),
    "bias": Processing(logit_bias={20: 4.0, 33: -3.0}),
    "all": Processing(presence_penalty=-0.4, frequency_penalty=0.9, repetition_penalty=0.8, logit_bias={7: 2.0}),
}


def reference_rows(logits: np.ndarray, prompt: list[int], output: list[int], p: Processing) -> np.ndarray:
    """Processed rows for positions after prompt + output[:i], i = 0..len(logits)-1, by the book."""
    out = np.array(logits, dtype=np.float64)
    for i in range(len(out)):
        x, before = out[i], output[:i]
        for token, bias in p.logit_bias.items():
            x[token] += bias
        if p.repetition_penalty != 1.0:
            for t in set(prompt) | set(before):
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t, c in Counter(before).items():
            x[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def clean_rows(model, prompt: list[int], output: list[int], p: Processing) -> np.ndarray:
    """The reference processed row before each output token (one clean forward)."""
    seq = prompt + output
    logits = np.array(model(mx.array([seq]))[0, len(prompt) - 1: len(seq) - 1].astype(mx.float32))
    return reference_rows(logits, prompt, output, p)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def assert_same_processed_greedy(model, prompt, base, other, p: Processing, label: str) -> None:
    """Identical, or different only at a float tie of the processed row (proved by its margin)."""
    i = first_divergence(base, other)
    if i is None:
        return
    row = clean_rows(model, prompt, list(base[: i + 1]), p)[i]
    top = np.sort(row)[-2:]
    assert top[1] - top[0] < TIE_MARGIN, f"{label}: diverged at token {i}, processed margin {top[1] - top[0]:.3g}"


# ----------------------------------------------------------------------------------------
# the processor alone
# ----------------------------------------------------------------------------------------
def test_rows_match_the_definitions_with_drafts_and_a_token_in_flight():
    rng = np.random.default_rng(0)
    vocab, prompt = 40, [3, 5, 5, 9, 30]
    for name, p in SETTINGS.items():
        proc = LogitsProcessor(p, prompt)
        ids = list(prompt)
        for step in range(6):  # the counts grow between calls, as in a decode
            drafts = [int(t) for t in rng.integers(0, vocab, size=step % 4)]
            logits = rng.normal(size=(len(drafts) + 1, vocab)).astype(np.float32) * 3
            got = np.array(proc.rows(mx.array(logits), ids, mx.array(drafts, dtype=mx.uint32)))
            output = ids[len(prompt):]
            want = [row_after(logits[i], prompt, output + drafts[:i], p) for i in range(len(logits))]
            np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5, err_msg=f"{name} step {step}")
            in_flight = int(rng.integers(0, vocab))  # a plain step queued before its token is read back
            row = rng.normal(size=(vocab,)).astype(np.float32)
            got = np.array(proc.rows(mx.array(row), ids, mx.array(in_flight)))
            np.testing.assert_allclose(got, row_after(row, prompt, output + [in_flight], p), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} in flight, step {step}")
            ids += [in_flight] + drafts[:1]


def row_after(row: np.ndarray, prompt: list[int], before: list[int], p: Processing) -> np.ndarray:
    """The reference row after prompt + ``before``."""
    return reference_rows(np.repeat(row[None], len(before) + 1, 0), prompt, before, p)[len(before)]


def test_bad_settings_are_refused_with_the_reason(tiny_llama):
    for kw, words in [(dict(presence_penalty=3.0), "presence-penalty must be between -2 and 2"),
                      (dict(repetition_penalty=0.0), "repetition-penalty must be a number above 0"),
                      (dict(logit_bias={96: 1.0}), "token id 96 is not in the vocabulary"),
                      (dict(logit_bias={5: -101.0}), "between -100 and 100"),
                      (dict(logprobs=21), "top logprobs must be between 0 and 20")]:
        with pytest.raises(TandemError, match=words):
            tiny_llama.generate([5, 6], max_new_tokens=2, **kw)
    assert parse_logit_bias("12:-100, 7:2.5") == {12: -100.0, 7: 2.5}
    with pytest.raises(TandemError, match="TOKEN_ID:BIAS"):
        parse_logit_bias("12")


# ----------------------------------------------------------------------------------------
# greedy: every mode equals plain decoding with the same processors, which follows the reference
# ----------------------------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 40, 41, 42, 40], [9, 30, 31, 9, 30, 9], [17]]


@pytest.fixture(scope="module")
def engine_with_drafters(tmp_path_factory):
    engine = make_tiny_engine("qwen3", seed=6)
    path = write_dspark(tmp_path_factory.mktemp("dspark"), engine, layers=1, taps=[0, 1, 2], markov_scale=10.0)
    engine.drafter_path = str(path)
    other = make_tiny_model("qwen3", seed=4)
    return engine, {"lookup": LookupDrafter(), "draft-self": DraftModelDrafter(engine.model, max_draft=5),
                    "draft-other": DraftModelDrafter(other, max_draft=3), "dspark": None}


def _run(engine, drafters, mode, ids, p: Processing, **kw):
    if mode.startswith("draft"):
        engine.set_drafter("draft", drafters[mode])
    kw = dict(presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
              repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, **kw)
    mode = "draft" if mode.startswith("draft") else mode
    return engine.generate(ids, mode=mode, max_new_tokens=24, prefix_cache=False,
                           max_draft=None if mode in ("baseline", "dspark") else drafters_cap(mode), **kw)


def drafters_cap(mode: str) -> int:
    return {"lookup": 6, "draft": 0}[mode]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_every_mode_equals_plain_decoding_with_the_processors(engine_with_drafters, setting):
    engine, drafters = engine_with_drafters
    p = SETTINGS[setting]
    drafted = 0
    for i, ids in enumerate(PROMPTS):
        base = _run(engine, drafters, "baseline", ids, p, logprobs=2)
        if i == 0:  # plain decoding itself follows the reference, token by token
            rows = clean_rows(engine.model, ids, base.token_ids, p)
            assert base.token_ids == [int(t) for t in rows.argmax(-1)][: base.generated]
        for mode in drafters:
            res = _run(engine, drafters, mode, ids, p, logprobs=2)
            assert_same_processed_greedy(engine.model, ids, base.token_ids, res.token_ids, p, f"{setting}/{mode}/{i}")
            drafted += res.drafted
            if res.token_ids == base.token_ids:  # logprobs: the plain ones, to float tolerance
                got = np.array([[t.logprob] + [v for _, v in t.top] for t in res.logprobs])
                want = np.array([[t.logprob] + [v for _, v in t.top] for t in base.logprobs])
                np.testing.assert_allclose(got, want, atol=2e-4, err_msg=f"{setting}/{mode}/{i}")
    assert drafted > 0


def test_a_bias_of_minus_100_keeps_a_token_out(engine_with_drafters):
    engine, drafters = engine_with_drafters
    ids = PROMPTS[0]
    plain = _run(engine, drafters, "baseline", ids, Processing())
    banned = Counter(plain.token_ids).most_common(1)[0][0]
    p = Processing(logit_bias={banned: -100.0, 0: -100.0})  # and EOS (id 0): every run goes the full length
    for mode in drafters:
        for kw in ({}, dict(temperature=1.0, seed=3)):
            res = _run(engine, drafters, mode, ids, p, **kw)
            assert banned not in res.token_ids, f"{mode} {kw}"
            assert res.generated == 24


# ----------------------------------------------------------------------------------------
# logprobs: the log-softmax of the processed clean rows, greedy and seeded sampling
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_equal_the_clean_forward_in_every_mode(engine_with_drafters, sampled):
    engine, drafters = engine_with_drafters
    p = SETTINGS["all"]
    kw = dict(temperature=0.8, top_p=0.9, seed=5) if sampled else {}
    for mode in ["baseline", *drafters]:
        for ids in PROMPTS[:2]:
            res = _run(engine, drafters, mode, ids, p, logprobs=5, **kw)
            want = log_softmax(clean_rows(engine.model, ids, res.token_ids, p))
            assert [t.token for t in res.logprobs] == res.token_ids
            for i, t in enumerate(res.logprobs):
                assert t.logprob == pytest.approx(want[i, t.token], abs=2e-4)
                top_ids = [j for j, _ in t.top]
                assert len(top_ids) == 5
                np.testing.assert_allclose([v for _, v in t.top], np.sort(want[i])[::-1][:5], atol=2e-4)
                np.testing.assert_allclose([v for _, v in t.top], want[i, top_ids], atol=2e-4)


def test_logprobs_without_processors_and_their_absence(tiny_llama):
    res = tiny_llama.generate([5, 6, 7], max_new_tokens=6, logprobs=0)
    want = log_softmax(clean_rows(tiny_llama.model, [5, 6, 7], res.token_ids, Processing()))
    assert [t.top for t in res.logprobs] == [[]] * 6
    np.testing.assert_allclose([t.logprob for t in res.logprobs], want[np.arange(6), res.token_ids], atol=2e-4)
    assert tiny_llama.generate([5, 6, 7], max_new_tokens=3).logprobs is None


def test_logprobs_follow_a_stop_string_cut(tiny_llama):
    base = tiny_llama.generate([5, 6, 7], max_new_tokens=12, logprobs=1)
    word = tiny_llama.tokenizer.decode([base.token_ids[3]])
    chunks = list(tiny_llama.stream([5, 6, 7], max_new_tokens=12, logprobs=1, stop=[word]))
    res = chunks[-1].result
    assert len(res.logprobs) == res.generated < base.generated
    assert sum(len(c.logprobs or ()) for c in chunks[:-1]) == res.generated


# ----------------------------------------------------------------------------------------
# sampled: an exact sample of the processed target, multi-token drafts and rejections
# ----------------------------------------------------------------------------------------
def test_speculative_sampling_with_penalties_is_exact():
    """tests/test_sampling.py's check, with the exact conditionals taken from the processed
    reference rows (which depend on the whole history, not only the previous token)."""
    make_drafter, params = ts.CASES["draft-model"]
    p = Processing(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={2: 1.0})
    model, draft = ts.models()
    target, tally = Target(model), ts.Tally()
    drafter = make_drafter(draft)
    for run in range(ts.RUNS):
        sampler = Sampler(SamplingParams(params.temperature, params.top_p, params.top_k, seed=run),
                          LogitsProcessor(p, ts.PROMPT))
        tokens, positions = [], []
        for new, event in decode(target, drafter, ts.PROMPT, sampler, max_new_tokens=ts.LENGTH,
                                 cap_policy=FixedCap(ts.CAP)):
            tokens += new
            positions += range(len(new))
            if event.drafted:
                tally.outcomes[event.drafted, event.accepted] += 1
        rows = clean_rows(model, ts.PROMPT, tokens, p)
        exact = np.array(ts.target_probs(mx.array(rows.astype(np.float32)), params), dtype=np.float64)
        seq = ts.PROMPT + tokens
        for t, (token, j) in enumerate(zip(tokens, positions)):
            tally.add(j, seq[len(ts.PROMPT) + t - 1], token, exact[t])
    ts.assert_exact(tally)
