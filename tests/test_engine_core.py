"""The verify loop on tiny random targets: every mode is lossless, rollback is exact, the tap
probe refuses a broken tap, bad input gets a one-line error."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.lookup import LookupDrafter
from engine.errors import TandemError
from engine.generate import Engine
from engine.target import Target, TapLayer
from tests.lossless import assert_same_greedy, first_divergence
from tests.tiny import FixedDrafter, make_tiny_engine, make_tiny_model, make_tokenizer


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of many lengths, half with repeated spans so lookup has matches to draft from."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([1, 2, 5, 9, 17, 33])
        body = [rng.randrange(2, vocab) for _ in range(length)]
        if i % 2:
            body = body + body[: max(1, length // 2)] + body
        out.append(body)
    return out


def run(engine: Engine, ids, mode: str, n: int, **kw):
    return engine.generate(ids, mode=mode, max_new_tokens=n, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_mode_matches_baseline_greedy(arch):
    engine = make_tiny_engine(arch, seed=3)
    other = make_tiny_model(arch, seed=4)  # an unrelated draft model: mostly rejected drafts
    drafted = accepted = 0
    for i, ids in enumerate(prompts(12, 96, seed=7)):
        n = [1, 2, 7, 24, 40][i % 5]
        base = run(engine, ids, "baseline", n)
        assert 1 <= base.generated <= n
        for mode, drafter in [
            ("lookup", LookupDrafter()),
            ("draft-self", DraftModelDrafter(engine.model, max_draft=5)),
            ("draft-other", DraftModelDrafter(other, max_draft=3)),
        ]:
            engine.set_drafter("draft" if mode.startswith("draft") else mode, drafter)
            res = run(engine, ids, "draft" if mode.startswith("draft") else mode, n, max_draft=drafter.max_draft)
            assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"{arch}/{mode}/prompt {i}")
            drafted += res.drafted
            accepted += res.accepted
            if mode == "draft-self":  # the target drafting for itself: every draft is accepted
                assert res.drafted == res.accepted
    assert drafted > 0 and accepted > 0  # the comparison exercised real speculative rounds


def test_lookup_is_faster_in_forwards_on_copy_prompt(tiny_llama):
    ids = list(range(2, 60)) * 3
    base = run(tiny_llama, ids, "baseline", 40)
    look = run(tiny_llama, ids, "lookup", 40)
    assert look.token_ids == base.token_ids
    assert look.mean_accepted >= 1.0
    assert look.target_forwards <= base.target_forwards


def test_rollback_leaves_cache_as_clean_forward():
    model = make_tiny_model("llama", seed=5)
    target = Target(model)
    prompt = [3, 9, 4, 7, 7, 12, 5]
    cache = target.new_cache()
    target.prefill(prompt[:-1], cache)
    anchor = prompt[-1]
    base_next = mx.argmax(model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1]).item()
    drafts = [base_next, 11, 13, 17]  # first draft right, the rest (very likely) wrong
    logits, _, txn = target.verify(mx.array([[anchor] + drafts]), cache)
    n = 1
    txn.commit(n + 1)
    committed = prompt + drafts[:n]
    clean = make_prompt_cache(model)
    model(mx.array([committed]), cache=clean)
    for got, want in zip(cache, clean):
        assert got.offset == want.offset == len(committed)
        for a, b in zip(got.keys_and_values(), want.keys_and_values()):
            assert a.shape == b.shape
            assert mx.allclose(a, b, atol=1e-5).item()
    # and the next forward from the rolled-back cache equals the clean one
    nxt = mx.array([[29]])
    assert mx.allclose(model(nxt, cache=cache), model(nxt, cache=clean), atol=1e-4).item()


def test_partial_acceptance_commits_argmax_after_accepted_prefix(tiny_llama):
    ids = [5, 6, 7, 8]
    base = run(tiny_llama, ids, "baseline", 12).token_ids
    # Draft the true continuation for 3 tokens, then garbage: exactly 3 drafts accepted per first round.
    script = base[1:4] + [(base[4] + 1) % 90 + 2] * 4
    engine = make_tiny_engine("llama", seed=0)
    engine.set_drafter("lookup", FixedDrafter(script))
    res = run(engine, ids, "lookup", 12, max_draft=7)
    assert res.token_ids == base
    assert res.rounds[1] == (7, 3)


def test_eos_and_max_tokens_inside_an_accepted_block():
    engine = make_tiny_engine("llama", seed=8)
    ids = [4, 5, 6, 7, 4, 5, 6]
    base = run(engine, ids, "baseline", 30).token_ids
    # Declare a token in the middle of the output to be EOS: both modes must stop right before it.
    eos_tok = next(t for i, t in enumerate(base) if i >= 3 and t not in base[:i])
    engine.tokenizer.eos_token_ids = {eos_tok}
    engine.set_drafter("draft", DraftModelDrafter(engine.model, max_draft=8))
    b = run(engine, ids, "baseline", 30)
    d = run(engine, ids, "draft", 30, max_draft=8)
    assert b.token_ids == d.token_ids == base[: base.index(eos_tok)]
    assert b.finish_reason == d.finish_reason == "stop"
    engine.tokenizer.eos_token_ids = {0}
    # max tokens cuts inside a block too
    d = run(engine, ids, "draft", 5, max_draft=8)
    assert d.token_ids == base[:5] and d.finish_reason == "length"


def test_stop_string_inside_block_truncates_text_and_tokens():
    engine = make_tiny_engine("llama", seed=8)
    ids = [4, 5, 6, 7, 4, 5, 6]
    full = run(engine, ids, "baseline", 30)
    words = full.text.split()
    stop = " ".join(words[5:7])
    for mode in ("baseline", "lookup"):
        res = run(engine, ids, mode, 30, stop=[stop])
        assert stop not in res.text
        assert full.text.startswith(res.text)
        assert res.finish_reason == "stop"
        assert len(res.token_ids) <= 7


def test_tap_probe_accepts_real_tap_and_refuses_broken_one():
    model = make_tiny_model("qwen3", seed=2)
    target = Target(model)
    target.set_taps([0, 2])
    logits, hidden = target.forward(mx.array([[3, 4, 5]]), target.new_cache(), tap=True)
    assert hidden.shape == (3, 2 * target.hidden_size)
    target.clear_taps()
    with pytest.raises(TandemError, match="last one"):
        target.set_taps([target.num_layers - 1])

    class BrokenTap(TapLayer):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) * 1.5  # a tap that perturbs the residual stream

    import engine.target as target_mod

    original = target_mod.TapLayer
    target_mod.TapLayer = BrokenTap
    try:
        with pytest.raises(TandemError, match="tap refused"):
            target.set_taps([1])
    finally:
        target_mod.TapLayer = original
    assert not any(isinstance(layer, TapLayer) for layer in target.layers)  # refused tap fully removed


def test_bad_input_is_one_line_error(tiny_llama):
    with pytest.raises(TandemError, match="empty prompt"):
        tiny_llama.generate("   ", mode="baseline")
    with pytest.raises(TandemError, match="empty prompt"):
        tiny_llama.generate([], mode="baseline")
    with pytest.raises(TandemError, match="max-new-tokens"):
        tiny_llama.generate([3, 4], mode="baseline", max_new_tokens=0)
    with pytest.raises(TandemError, match="unknown mode"):
        tiny_llama.generate([3, 4], mode="eagle")
    with pytest.raises(TandemError, match="draft-model"):
        tiny_llama.generate([3, 4], mode="draft")
    with pytest.raises(TandemError, match="top_p"):
        tiny_llama.generate([3, 4], temperature=1.0, top_p=0.0)
    vocab = tiny_llama.target.vocab_size  # an id past the embedding table would read garbage, not fail
    for outside in (vocab, -1):
        with pytest.raises(TandemError, match=f"token id {outside}, outside the vocabulary"):
            tiny_llama.generate([3, outside, 4], mode="baseline")


def test_draft_model_with_other_tokenizer_is_refused():
    from engine.drafters.draft_model import check_same_tokenizer

    with pytest.raises(TandemError, match="does not share the tokenizer"):
        check_same_tokenizer(make_tokenizer(96), make_tokenizer(80), "t", "d")


def test_first_divergence_helper():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
