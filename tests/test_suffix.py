"""Drafts from earlier requests (engine/drafters/suffix.py): the index finds the longest earlier
match, evicts under its budget, and lookup drafting from it keeps the output identical while
a repeated request drafts (and saves target forwards) from what an earlier one wrote."""

from __future__ import annotations

from engine.drafters.lookup import LookupDrafter
from engine.drafters.suffix import SuffixIndex
from tests.lossless import assert_same_greedy
from tests.test_engine_core import prompts
from tests.tiny import make_tiny_engine


def test_longest_match_wins_and_extensions_replace_what_they_extend():
    index = SuffixIndex(ngram=3)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([9, 8, 2, 3, 4, 7, 7])
    assert index.match([0, 2, 3, 4]) == ([7, 7], 3)  # two matches of 3: the latest
    assert index.match([1, 2, 3, 4]) == ([5, 6], 4)  # the longer one
    assert index.match([5, 5, 5]) == ([], 0)
    index.add([1, 2, 3, 4, 5, 6, 10, 11])  # a chat's next turn: replaces its first turn
    assert len(index) == 2 and index.tokens == 15
    assert index.match([1, 2, 3, 4]) == ([5, 6, 10, 11], 4)
    index.add([9, 8, 2, 3])  # already known: nothing new
    assert len(index) == 2


def test_budget_evicts_least_recently_used_and_matches_stay_right():
    index = SuffixIndex(budget_tokens=20, ngram=3)
    for start in range(0, 60, 10):
        index.add(list(range(start, start + 10)))
    assert index.tokens <= 20 and index.evictions == 4 and len(index) == 2
    assert index.match([40, 41, 42]) == ([43, 44, 45, 46, 47, 48, 49], 3)
    assert index.match([10, 11, 12]) == ([], 0)  # evicted: its postings are never used
    assert index.match([50, 51, 52], limit=2) == ([53, 54], 3)


def test_a_repeated_request_drafts_from_the_index_with_the_same_output():
    engine = make_tiny_engine("qwen3", seed=1, scale=2.0)
    prompt = [11, 12, 13, 14, 15, 16, 17]
    engine.set_drafter("lookup", LookupDrafter())  # the context alone
    alone = engine.generate(prompt, mode="lookup", max_new_tokens=40, prefix_cache=False)
    index = SuffixIndex()
    drafter = LookupDrafter(history=index)
    engine.suffix_index = index
    engine.set_drafter("lookup", drafter)
    first = engine.generate(prompt, mode="baseline", max_new_tokens=40)
    assert len(index) == 1 and index.tokens == len(prompt) + first.generated
    again = engine.generate(prompt, mode="lookup", max_new_tokens=40, prefix_cache=False)
    assert again.token_ids == first.token_ids == alone.token_ids
    assert drafter.from_history > 0 and again.accepted > alone.accepted
    assert again.target_forwards < alone.target_forwards
    # seeded sampling does not draft from the index: the same seed, the same sample, whatever ran before
    used = drafter.from_history
    a = engine.generate(prompt, mode="lookup", max_new_tokens=30, temperature=0.9, seed=4)
    b = engine.generate(prompt, mode="lookup", max_new_tokens=30, temperature=0.9, seed=4)
    assert a.token_ids == b.token_ids and drafter.from_history == used


def test_greedy_output_identical_with_the_index_on_many_prompts():
    engine = make_tiny_engine("llama", seed=3)
    used = 0
    for i, ids in enumerate(prompts(10, 96, seed=5)):
        base = engine.generate(ids, mode="baseline", max_new_tokens=24, prefix_cache=False)
        res = engine.generate(ids + base.token_ids[:3], mode="lookup", max_new_tokens=20, prefix_cache=False)
        want = engine.generate(ids + base.token_ids[:3], mode="baseline", max_new_tokens=20, prefix_cache=False)
        assert_same_greedy(engine.model, ids + base.token_ids[:3], want.token_ids, res.token_ids, f"prompt {i}")
        used = engine.drafter("lookup").from_history
    assert used > 0 and len(engine.suffix_index) > 0


def test_no_suffix_drafts_leaves_lookup_to_the_context():
    from engine import modes
    from engine.cli import build_parser

    assert build_parser("serve").parse_args(["serve", "--no-suffix-drafts"]).no_suffix_drafts
    assert not build_parser("generate").parse_args(["generate"]).no_suffix_drafts
    engine = make_tiny_engine("llama", seed=0)
    assert modes.make_drafter(engine, "lookup").history is engine.suffix_index is not None
    engine.suffix_index = None  # what load_engine does with --no-suffix-drafts
    assert modes.make_drafter(engine, "lookup").history is None
    engine.generate([5, 6, 7], mode="lookup", max_new_tokens=4)  # and nothing is recorded
