"""Lookup first: n-gram lookup's draft when the context repeats itself, the model drafter's
otherwise; greedy output stays the target's own (sampled exactness: test_block_drafters)."""

from __future__ import annotations

import numpy as np

from engine.drafters.lookup_first import LookupFirst
from engine.sampling import Sampler, SamplingParams
from tests.lossless import assert_same_greedy
from tests.test_block_drafters import prompts, write_dspark
from tests.tiny import make_tiny_engine

GREEDY = Sampler(SamplingParams())


def test_each_round_takes_lookup_when_it_matches_else_the_drafter(tmp_path):
    engine = make_tiny_engine("llama", seed=6)
    engine.drafter_path = str(write_dspark(tmp_path / "d", engine, layers=2, taps=[0, 1, 2], markov_scale=10.0))
    engine.lookup_first = True
    both = engine.drafter("dspark")
    assert isinstance(both, LookupFirst) and both.max_draft == 32 and both.tap_layers == (0, 1, 2)
    engine.target.set_taps(both.tap_layers)
    repeat = [5, 9, 14, 3, 22, 5, 9, 14]  # "5 9 14" occurred: lookup proposes "3 22 ..."
    fresh = [5, 9, 14, 3, 22, 7, 8, 2]
    for ids, source in ((repeat, "lookup"), (fresh, "model")):
        _, hidden = engine.target.prefill(ids[:-1], engine.target.new_cache(), tap=True)
        both.begin(ids[:-1], hidden)
        draft = np.array(both.propose(ids, 12, GREEDY).tokens).tolist()
        if source == "lookup":
            assert draft[:2] == [3, 22]
        else:
            alone = both.model_drafter
            alone.begin(ids[:-1], hidden)
            assert draft == np.array(alone.propose(ids, 12, GREEDY).tokens).tolist() and len(draft) == 7


def test_greedy_output_is_unchanged_and_both_draft(tmp_path):
    engine = make_tiny_engine("qwen3", seed=6)
    engine.drafter_path = str(write_dspark(tmp_path / "d", engine, layers=2, taps=[0, 1, 2], markov_scale=10.0))
    engine.lookup_first = True
    for i, ids in enumerate(prompts(10, 96, seed=8)):
        n = [3, 9, 20, 40, 60][i % 5]
        base = engine.generate(ids, mode="baseline", max_new_tokens=n)
        for cap in (0, 4):
            res = engine.generate(ids, mode="dspark", max_new_tokens=n, max_draft=cap)
            assert_same_greedy(engine.model, ids, base.token_ids, res.token_ids, f"prompt {i} cap {cap}")
    both = engine.drafter("dspark")
    assert both.from_lookup > 0 and both.from_model > 0


def test_round_events_name_the_drafter_of_each_round(tmp_path):
    """RoundEvent.drafted_by says whose draft a round verified (the app colours tokens by it)."""
    engine = make_tiny_engine("llama", seed=6)
    engine.drafter_path = str(write_dspark(tmp_path / "d", engine, layers=2, taps=[0, 1, 2], markov_scale=10.0))
    engine.lookup_first = True
    both = engine.drafter("dspark")
    ids = [5, 9, 14, 3, 22, 5, 9, 14, 3, 22, 7, 8, 2, 5, 9, 14]
    for mode, allowed in (("dspark", {"lookup", "dspark"}), ("lookup", {"lookup"}), ("baseline", set())):
        lookups, models = both.from_lookup, both.from_model
        events = []
        engine.generate(ids, mode=mode, max_new_tokens=40, on_round=events.append)
        names = [e.drafted_by for e in events]
        assert all((e.drafted > 0) == bool(e.drafted_by) for e in events)
        assert set(names) - {""} <= allowed
        if mode == "dspark":  # exact: one name per proposal that drafted something
            assert names.count("lookup") == both.from_lookup - lookups > 0
            assert 0 < names.count("dspark") <= both.from_model - models


def _reference_match(ids: list[int], n: int) -> tuple[int, int]:
    """Lookup's match found from scratch: the latest ``MAX_CANDIDATES`` earlier occurrences of the
    last n tokens, each extended backwards (up to ``MAX_MATCH``); the longest wins, the latest a tie."""
    from engine.drafters.lookup import MAX_CANDIDATES, MAX_MATCH

    if len(ids) <= n:
        return 0, 0
    ends = [end for end in range(n, len(ids)) if ids[end - n:end] == ids[-n:]][-MAX_CANDIDATES:]
    best = (0, 0)
    for pos in reversed(ends):
        length = n
        while length < MAX_MATCH and pos - length - 1 >= 0 and ids[pos - length - 1] == ids[len(ids) - length - 1]:
            length += 1
        if length > best[1]:
            best = (pos, length)
    return best


def test_lookup_index_grows_with_the_context_and_starts_over_for_another():
    from engine.drafters.lookup import LookupDrafter

    rng = np.random.default_rng(3)
    lookup = LookupDrafter()
    for sequence in range(3):  # a new sequence (shorter than the last) is indexed afresh
        ids = rng.integers(0, 4, size=5).tolist()
        if sequence == 2:
            lookup.begin(ids, None)
        while len(ids) < 120 - 30 * sequence:
            ids.extend(rng.integers(0, 4, size=int(rng.integers(1, 4))).tolist())  # a plain step or a round
            lookup.commit(ids, 0, None)
            assert lookup.match(ids) == _reference_match(ids, lookup.min_ngram), (sequence, len(ids))
