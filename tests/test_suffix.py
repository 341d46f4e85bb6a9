"""Drafts from earlier requests (engine/drafters/suffix.py): the index proposes the most frequent
continuation of the earlier matches and evicts under its budget; lookup drafting from it keeps the
output identical (every drafter that uses it) while a repeated request drafts from what an earlier
one wrote; the index survives a restart (engine/suffix_disk.py) and refuses bad files; concurrent
and batched requests update it safely; each API key drafts only from its own requests."""

from __future__ import annotations

import json
import struct

import pytest

from engine.drafters.lookup import LookupDrafter
from engine.drafters.suffix import SuffixIndex
from tests.lossless import assert_same_greedy
from tests.test_engine_core import prompts
from tests.tiny import make_tiny_engine


def test_longest_match_wins_and_extensions_replace_what_they_extend():
    index = SuffixIndex(ngram=3)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([9, 8, 2, 3, 4, 7, 7])
    found = lambda context: (lambda p: (p.tokens, p.match) if p else ([], 0))(index.propose(context))  # noqa: E731
    assert found([0, 2, 3, 4]) == ([7, 7], 3)  # two matches of 3 that disagree: the latest
    assert found([1, 2, 3, 4]) == ([5, 6], 4)  # the longer one
    assert found([5, 5, 5]) == ([], 0)
    index.add([1, 2, 3, 4, 5, 6, 10, 11])  # a chat's next turn: replaces its first turn
    assert len(index) == 2 and index.tokens == 15
    assert found([1, 2, 3, 4]) == ([5, 6, 10, 11], 4)
    version = index.version
    index.add([9, 8, 2, 3])  # already known: nothing new
    index.add([1, 2, 3, 4, 5, 6, 10, 11])
    assert len(index) == 2 and index.version == version


def test_budget_evicts_least_recently_used_and_matches_stay_right():
    index = SuffixIndex(budget_tokens=20, ngram=3)
    for start in range(0, 60, 10):
        index.add(list(range(start, start + 10)))
    assert index.tokens <= 20 and index.evictions == 4 and len(index) == 2
    assert index.propose([40, 41, 42]).tokens == [43, 44, 45]
    assert index.propose([10, 11, 12]) is None  # evicted: its postings are never used
    assert index.propose([50, 51, 52], limit=2).tokens == [53, 54]


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


# -- frequency-based proposals (SuffixDecoding) ---------------------------------------------------

def test_the_most_frequent_continuation_wins_and_its_probability_sets_the_length():
    index = SuffixIndex(ngram=3)
    shared = [1, 2, 3, 4, 5, 6]
    for i in range(3):  # three earlier answers continue ``shared`` with 7 8, then each its own way
        index.add([100 + i, *shared, 7, 8, 200 + i, 300 + i, 400 + i])
    index.add([110, *shared] + [9] * 10)  # the latest one went elsewhere
    p = index.propose([50, *shared], limit=16)
    # 3 of 4 occurrences say 7 (p 0.75), all three then say 8; after it each of the three differs
    # (p 0.25, the latest of them wins the tie), and the one occurrence left drafts on to the
    # match length (6 tokens, one per matched token), here the end of its sequence
    assert (p.tokens, p.match, p.support, p.shared) == ([7, 8, 202, 302, 402], 6, 4, 6)
    assert p.prob == 0.25 and p.score == 2 * 0.75 + 3 * 0.25
    assert index.propose([50, *shared], limit=16, min_prob=0.5).tokens == [7, 8]  # stops where it splits
    assert index.propose([50, *shared], limit=1).tokens == [7]  # the loop's cap
    # a longer match narrows the count to the occurrences that share it
    assert index.propose([110, *shared]).tokens == [9] * 7
    assert index.propose([101, *shared]).tokens == [7, 8, 201, 301, 401]
    assert index.propose([5, 5, 5]) is None


def test_a_lone_earlier_match_drafts_one_token_per_matched_token():
    index = SuffixIndex(ngram=3)
    index.add(list(range(10, 60)))
    assert index.propose([0, 20, 21, 22], limit=40).tokens == [23, 24, 25]
    assert index.propose(list(range(10, 30)), limit=40).tokens == list(range(30, 50))
    assert index.propose(list(range(10, 30)), limit=8).tokens == list(range(30, 38))


# -- the index on disk -----------------------------------------------------------------------------

def _disk_engine(folder, seed: int = 1):
    engine = make_tiny_engine("qwen3", seed=seed, scale=2.0)
    engine.configure_suffix_drafts(disk_dir=str(folder))
    return engine


def _files(folder):
    return sorted(p for p in folder.rglob("suffix-*.safetensors"))


def test_a_restarted_engine_drafts_from_the_history_it_saved(tmp_path, monkeypatch):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    first = _disk_engine(tmp_path)
    ref = first.generate(prompt, mode="baseline", max_new_tokens=40, prefix_cache=False)
    first.history("client-a").add([40, 41, 42, 43, 44])
    assert _files(tmp_path) == []  # nothing written per request below SAVE_EVERY
    first.save_history()
    assert len(_files(tmp_path)) == 2  # the process's index and client-a's
    assert "client-a" not in " ".join(p.name for p in _files(tmp_path))  # a keyed hash names it

    again = _disk_engine(tmp_path)  # a restart: same weights, same folder
    assert again.suffix_index.sequences() == [prompt + ref.token_ids]
    assert again.history("client-a").sequences() == [[40, 41, 42, 43, 44]]
    assert len(again.history("client-b")) == 0
    res = again.generate(prompt, mode="lookup", max_new_tokens=40, prefix_cache=False)
    assert res.token_ids == ref.token_ids and again.drafter("lookup").history_tokens >= 20

    from engine import suffix_disk

    monkeypatch.setattr(suffix_disk, "SAVE_EVERY", 2)  # periodic saves, after the reply is out
    again.generate([30, 31, 32, 33], mode="lookup", max_new_tokens=5, prefix_cache=False)
    saves = again.suffix_disk.saves
    again.generate([34, 35, 36, 37], mode="lookup", max_new_tokens=5, prefix_cache=False)
    assert again.suffix_disk.saves == saves + 1 and len(_files(tmp_path)) == 2  # the old file replaced
    assert len(_disk_engine(tmp_path).suffix_index) == 3


def test_damaged_foreign_and_out_of_vocabulary_files_are_refused_and_removed(tmp_path, caplog):
    from engine import suffix_disk

    engine = _disk_engine(tmp_path)
    engine.suffix_index.add([5, 6, 7, 8, 9])
    engine.save_history()
    (good,) = _files(tmp_path)
    data = good.read_bytes()
    disk = engine.suffix_disk
    meta = {"format": suffix_disk.FORMAT, "identity": disk.identity}

    def signed(payload: bytes) -> None:  # a file this install wrote (its keyed hash is right)
        (good.parent / f"suffix-shared-{suffix_disk.file_mac(payload, disk.key)}.safetensors").write_bytes(payload)

    def header_only(header: dict) -> bytes:
        text = json.dumps({**header, "__metadata__": meta}).encode()
        return struct.pack("<Q", len(text)) + text

    vector = {"dtype": "U32", "shape": [4], "data_offsets": [0, 16]}
    cases = [  # (what is wrong, the reason logged)
        (lambda: good.write_bytes(data[:-4] + bytes([data[-4] ^ 1]) + data[-3:]), "keyed hash mismatch"),  # a bit
        (lambda: good.write_bytes(data[: len(data) - 6]), "keyed hash mismatch"),  # truncated in the tokens
        (lambda: good.write_bytes(data[:20]), "truncated header"),
        (lambda: signed(suffix_disk.encode([[5, 6, 7, 8]], {**meta, "format": "tandem-suffix-file-0"})),
         "another format"),
        (lambda: signed(suffix_disk.encode([[5, 6, 7, 8]], {**meta, "identity": "another"})), "another model"),
        (lambda: signed(suffix_disk.encode([[5, 6, 10**6, 8]], meta)), "beyond the vocabulary"),
        (lambda: signed(header_only({"tokens": vector, "lengths": vector})), "malformed"),  # tensors past the end
    ]
    for damage, why in cases:
        for p in _files(tmp_path):
            p.unlink()
        damage()
        caplog.clear()
        restarted = _disk_engine(tmp_path)
        assert len(restarted.suffix_index) == 0, why
        assert _files(tmp_path) == [] and restarted.suffix_disk.refused == 1, why
        assert why in caplog.text and "removed" in caplog.text, why
        restarted.generate([5, 6, 7, 8], mode="lookup", max_new_tokens=3)  # and the engine works
    # a file another model wrote is in that model's folder: never read by this one
    other = _disk_engine(tmp_path, seed=2)
    other.suffix_index.add([5, 6, 7, 8, 9])
    other.save_history()
    assert len(_disk_engine(tmp_path).suffix_index) == 0 and len(_files(tmp_path)) == 1


def test_the_budget_applies_on_load(tmp_path):
    from engine.suffix_disk import SuffixDisk

    engine = _disk_engine(tmp_path)
    for start in range(0, 50, 10):
        engine.suffix_index.add(list(range(start + 2, start + 12)))
    engine.save_history()
    disk = SuffixDisk(tmp_path)
    disk.bind(engine.suffix_disk.identity, engine.target.vocab_size)
    small = SuffixIndex(budget_tokens=25)
    assert disk.load(None, small) == 5
    assert small.sequences() == [list(range(32, 42)), list(range(42, 52))] and small.evictions == 3


# -- concurrency, batching, API keys ---------------------------------------------------------------

def test_concurrent_adds_and_proposals_are_safe():
    """Threads adding (with evictions and postings rebuilds under a small budget) while others
    draft: no error, and the index stays consistent."""
    import random
    import threading

    index = SuffixIndex(budget_tokens=3000)
    errors: list[BaseException] = []
    stop = threading.Event()

    def adder(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                index.add([rng.randrange(2, 40) for _ in range(rng.randrange(5, 60))])
        except BaseException as e:  # noqa: BLE001 - any error is the failure
            errors.append(e)

    def drafter(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                context = [rng.randrange(2, 40) for _ in range(8)]
                p = index.propose(context, limit=8)
                assert p is None or (0 < len(p.tokens) <= 8 and 0 < p.prob <= 1 and p.match >= 3)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    readers = [threading.Thread(target=drafter, args=(s,)) for s in range(2)]
    writers = [threading.Thread(target=adder, args=(s,)) for s in range(4)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[0]
    seqs = index.sequences()
    assert index.tokens == sum(map(len, seqs)) <= 3000 and index.evictions > 0
    for seq in [s for s in seqs if len(s) >= 12][-5:]:  # the last ones kept are found again
        assert index.propose(seq[:3]) is not None and index.propose([1] + seq[:6]).tokens == seq[6:12]


def test_batched_rows_draft_from_and_add_to_their_own_index():
    """Rows of one batch, each of its own API key (``history_scope``): each adds to its key's index
    when it finishes, and a row drafts only from its own key's earlier requests."""
    from engine.batching import Batcher

    engine = make_tiny_engine("qwen3", seed=1, scale=2.0)
    prompts_ = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35, 36]]
    kw = dict(mode="lookup", max_new_tokens=30, prefix_cache=False)

    def batch(requests):
        batcher = Batcher(engine, 3)
        tickets = [batcher.submit(p, history_scope=scope, **kw) for p, scope in requests]
        batcher.run()
        return tickets

    first = batch([(prompts_[0], "a"), (prompts_[1], "b"), (prompts_[2], None)])
    assert [engine.history(s).sequences() for s in ("a", "b", None)] == [
        [p + t.result.token_ids] for p, t in zip(prompts_, first)]
    # the same prompts again: a's prompt under a (its own answer), and under b (never seen there)
    again = batch([(prompts_[0], "a"), (prompts_[0], "b"), (prompts_[2], None)])
    assert [t.result.token_ids for t in again] == [first[0].result.token_ids] * 2 + [first[2].result.token_ids]
    from_history = [t.row.drafter.history_tokens for t in again]
    assert from_history[0] >= 20 and from_history[2] >= 20 and from_history[1] == 0
    assert again[0].result.target_forwards < again[1].result.target_forwards
    assert len(engine.history("b")) == 2 and len(engine.history("a")) == 1


def test_each_api_key_drafts_only_from_its_own_requests():
    """The timing side channel of a shared index: with several keys, a client's reply is never
    faster because another client sent the same thing before (x_tandem shows its drafts)."""
    import http.client

    from engine.serve.http import key_scope
    from engine.serve.server import make_server

    keys = ("key-one", "key-two")
    srv = make_server(lambda: make_tiny_engine("qwen3", seed=1, scale=2.0), port=0, api_key=keys,
                      mode="lookup", default_max_tokens=30).start()
    try:
        srv.wait_ready(60)

        def complete(key: str | None) -> dict:
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
            body = {"prompt": "w11 w12 w13 w14 w15 w16 w17", "max_tokens": 30, "temperature": 0}
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Authorization": f"Bearer {key}"} if key else {})
            resp = conn.getresponse()
            data = json.loads(resp.read())
            conn.close()
            assert resp.status == (200 if key else 401), data
            return data

        complete(None)  # no key, no answer
        one = complete("key-one")
        two = complete("key-two")  # the same prompt from the other client: nothing of key-one's to draft from
        one_again = complete("key-one")
        text = one["choices"][0]["text"]
        assert two["choices"][0]["text"] == one_again["choices"][0]["text"] == text
        rounds = lambda r: (r["x_tandem"]["drafted"], r["x_tandem"]["accepted"])  # noqa: E731 (the prefill may differ: the prefix cache)
        assert rounds(two) == rounds(one)
        assert one_again["x_tandem"]["accepted"] >= one["x_tandem"]["accepted"] + 10
        engine = srv.worker.engine
        assert set(engine.suffix_scopes) == {key_scope(k) for k in keys} and len(engine.suffix_index) == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("mode", ["lookup", "dspark", "auto"])
def test_greedy_output_is_the_same_with_and_without_the_index(mode, tmp_path):
    """Every drafter that drafts from the index: lookup, lookup in front of DSpark (a row's
    lookup_first), and --mode auto's history-first lookup in front of a DFlash drafter."""
    from tests.test_block_drafters import write_dflash, write_dspark

    engine = make_tiny_engine("qwen3", seed=1, scale=2.0)
    if mode == "dspark":
        engine.drafter_path, engine.lookup_first = str(write_dspark(tmp_path / "d", engine)), True
    elif mode == "auto":
        engine.drafter_path = str(write_dflash(tmp_path / "d", engine))
    asks = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42, 43], [11, 12, 13, 14, 15, 16, 17, 60]]
    kw = dict(max_new_tokens=30, prefix_cache=False)
    base = [engine.generate(p, mode="baseline", **kw).token_ids for p in asks]  # what the index then holds
    drafter = engine.drafter(mode) if mode != "auto" else engine._auto_drafter(engine.resolve_mode("auto"))
    lookup = getattr(drafter, "lookup", drafter)
    assert lookup.context == (mode != "auto")
    with_index = [engine.generate(p, mode=mode, **kw).token_ids for p in asks]
    assert lookup.history_tokens >= 30
    engine.configure_suffix_drafts(False)
    without = [engine.generate(p, mode=mode, **kw).token_ids for p in asks]
    assert with_index == without == base


def test_a_key_file_may_list_several_keys_for_the_server(tmp_path, monkeypatch):
    from engine.cli import build_parser
    from engine.cli.serve import api_key_from, api_keys_from
    from engine.errors import TandemError

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    parse = build_parser("serve").parse_args
    keys = tmp_path / "keys"
    keys.write_text("alice-key\n\n  bob-key \n")
    assert api_keys_from(parse(["serve", "--api-key-file", str(keys)])) == ("alice-key", "bob-key")
    with pytest.raises(TandemError, match="on one line"):  # a client (tandem claude) sends one key
        api_key_from(parse(["serve", "--api-key-file", str(keys)]))
    assert api_keys_from(parse(["serve", "--api-key", "k"])) == ("k",) and api_keys_from(parse(["serve"])) == ()
    keys.write_text("\n")
    with pytest.raises(TandemError, match="holds no key"):
        api_keys_from(parse(["serve", "--api-key-file", str(keys)]))
