"""Continuous batching (engine/batch.py, engine/batch_cache.py, engine/batching.py): every row of a
batch is the request run alone, greedy and seeded, on every cache family and in every mode; rows
join mid-flight and leave early; each row's caches end as a clean forward over its tokens; sampled
rows are exact samples of the target; the server answers concurrent clients together."""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import engine.api as api
from engine.batch import BatchLoop, BatchRow
from engine.batch_cache import batchable
from engine.batching import Batcher
from engine.target import PREFILL_CHUNK
from engine.drafters.draft_model import DraftModelDrafter
from engine.sampling import Sampler, SamplingParams, target_probs
from engine.shapes import ShapePolicy
from engine.serve.server import make_server
from engine.speculative import FixedCap
from tests import drafter_ckpt as ck
from tests.lossless import assert_same_greedy
from tests.test_sampling import CAP, LENGTH, PROMPT, RUNS, Tally, assert_conditionals, assert_exact, models
from tests.tiny import FAMILIES, make_tiny_engine

# Rows of different lengths; the first repeats itself (lookup drafts), the last is long enough
# to wrap the tiny sliding windows (8) and to take several prefill chunks when chunks are small.
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10] * 3, [20, 21, 22], list(range(30, 70)), [50, 51, 50, 51, 50, 51, 52]]
BUDGETS = [24, 9, 30, 16]


def make_engine(arch: str = "llama", **kw):
    """A tiny engine without the suffix index: drafts from the requests a test first runs alone
    would make the batched ones finish in fewer rounds and overlap less (their output is the same)."""
    eng = make_tiny_engine(arch, **kw)
    eng.suffix_index = None
    return eng


@pytest.fixture(scope="module", params=["llama", *FAMILIES])
def family_engine(request):
    return make_engine(request.param)


def alone(engine, prompt, **kw):
    return engine.generate(prompt, prefix_cache=False, **kw)


def run_batch(engine, requests, max_batch=3):
    """Submit ``requests`` (kwargs each) to a Batcher and run it to the end; the tickets."""
    batcher = Batcher(engine, max_batch)
    tickets = [batcher.submit(r.pop("prompt"), prefix_cache=False, **r) for r in requests]
    widths = []
    while batcher.busy:
        batcher.step()
        widths.append(batcher.loop.last_width)
    assert batcher.occupancy == 0 and not batcher.loop.waiting
    return tickets, widths


def assert_caches_clean(engine, ticket):
    """The row's caches hold its committed tokens and nothing else: the next step's logits equal
    a clean forward's over the same tokens (to rounding: one long forward sums in another order
    than the rounds did; a kept filler or rejected row would move them by far more)."""
    row, target = ticket.row, engine.target
    ids, held = row.stats.ids, row.stats.cache_len
    assert held in (len(ids) - 1, len(ids))  # all but the last token, or all (a pipelined step fed it)
    probe = ids[held] if held < len(ids) else 1
    got, _ = target.forward(mx.array([[probe]], dtype=mx.uint32), row.cache)
    want, _ = target.forward(mx.array([ids[:held] + [probe]], dtype=mx.uint32), target.new_cache())
    gap = mx.abs(got[-1] - want[-1]).max().item()
    assert gap < 1e-4, f"row caches differ from a clean forward by {gap} ({ticket.result.mode})"


@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_every_row_equals_its_request_alone(family_engine, mode):
    eng = family_engine
    requests = [dict(prompt=p, mode=mode, max_new_tokens=n, max_draft=cap)
                for p, n, cap in zip(PROMPTS, BUDGETS, [None, 3, 8, 1])]
    want = [alone(eng, r["prompt"], mode=mode, max_new_tokens=r["max_new_tokens"], max_draft=r["max_draft"])
            for r in requests]
    tickets, widths = run_batch(eng, [dict(r) for r in requests], max_batch=3)
    for t, w, r in zip(tickets, want, requests):
        assert_same_greedy(eng.model, r["prompt"], w.token_ids, t.result.token_ids, f"{mode} batched")
        if t.result.token_ids == w.token_ids:
            assert t.result.text == w.text and t.result.finish_reason == w.finish_reason
        assert_caches_clean(eng, t)
    assert eng.target.batch_blocker() is None  # every family batches, recurrent state included
    assert max(widths) == 3 and max(t.result.batch_width for t in tickets) == 3
    assert all(t.result.note is None for t in tickets)


def test_batched_forward_matches_each_rows_own_forward():
    """The batch view's logits are each row's own forward's, through wrapped sliding windows and
    rows of different lengths and widths: to the last bits only (a row's attention sums over
    left-padded keys in another grouping: MLX's softmax and BLAS), which is why the greedy
    comparisons above allow a divergence only at a proven tie."""
    for arch in ("llama", "gemma3"):
        eng = make_tiny_engine(arch)
        t = eng.target
        batched, single = [], []
        for p in PROMPTS[:3]:
            for group in (batched, single):
                c = t.new_cache()
                t.prefill(p, c)
                group.append(c)
        for width in (1, 4, 1, 2):
            ids = mx.array([[(5 * r + 3 * j + width) % 90 + 2 for j in range(width)] for r in range(3)], dtype=mx.uint32)
            logits, _ = t.forward_rows(ids, batched)
            for r in range(3):
                ref, _ = t.forward(ids[r : r + 1], single[r])
                gap = mx.abs(logits[r] - ref).max().item()
                assert gap < 1e-5, f"{arch} width {width} row {r}: {gap}"


def test_caches_that_do_not_batch_are_named():
    from mlx_lm.models.cache import QuantizedKVCache

    assert "QuantizedKVCache" in batchable([QuantizedKVCache()])
    assert batchable(make_tiny_engine("falcon_h1").target.new_cache()) is None  # CacheList of both kinds


def test_rows_join_mid_flight_leave_early_and_speculate(tmp_path):
    """max_batch 2 with four requests: the third and fourth join as the first rows finish; dspark
    rows (each with its own forked drafter state) and lookup rows share forwards."""
    from tests.test_block_drafters import write_dspark

    eng = make_engine("llama", seed=3)
    eng.drafter_path = str(write_dspark(tmp_path / "dspark", eng))
    modes = ["dspark", "lookup", "dspark", "baseline"]
    want = [alone(eng, p, mode=m, max_new_tokens=n, max_draft=4) for p, m, n in zip(PROMPTS, modes, BUDGETS)]
    tickets, widths = run_batch(eng, [dict(prompt=p, mode=m, max_new_tokens=n, max_draft=4)
                                      for p, m, n in zip(PROMPTS, modes, BUDGETS)], max_batch=2)
    for t, w, p in zip(tickets, want, PROMPTS):
        assert_same_greedy(eng.model, p, w.token_ids, t.result.token_ids, f"{t.result.mode} batched")
        assert_caches_clean(eng, t)
    assert max(widths) == 2
    assert sum(t.result.drafted for t in tickets) > 0  # speculation ran inside the batch
    assert tickets[1].row.drafter is None or tickets[1].row.drafter is not tickets[0].row.drafter


def _engine_for(mode: str, tmp_path):
    """A tiny target with a drafter for ``mode`` (checkpoints in their real on-disk layouts)."""
    from tests.test_block_drafters import write_dflash, write_dspark
    from tests.test_eagle3 import exact_eagle3
    from tests.test_mtp import exact_head, write_sidecar
    from tests.tiny import make_tiny_model

    from tests.test_block_drafters import bigram_engine

    arch = {"eagle3": "qwen3", "draft-windowed": "gemma3", "draft-recurrent": "qwen3_5"}.get(mode, "llama")
    eng = bigram_engine() if mode == "mtp" else make_tiny_engine(arch, seed=4)
    eng.suffix_index = None  # see make_engine
    if mode == "draft-stable":  # CUDA's shape policy on this CPU: buffers of 16 rows grow mid-run
        eng.target.set_shapes(ShapePolicy(step=16, widths=(1, 2, 4, 8)))
    if mode.startswith("draft"):
        draft_arch = {"draft-windowed": "llama-sliding", "draft-recurrent": "qwen3_5"}.get(mode, "llama")
        eng.set_drafter("draft", DraftModelDrafter(make_tiny_model(draft_arch, seed=4), max_draft=4,
                                                   shapes=eng.target.shapes))
        return eng, "draft"
    elif mode in ("dspark", "lookup-first"):
        eng.drafter_path = str(write_dspark(tmp_path / "dspark", eng))
        eng.lookup_first = mode == "lookup-first"
    elif mode == "dflash":
        eng.drafter_path = str(write_dflash(tmp_path / "dflash", eng))
    elif mode == "eagle3":
        eng.drafter_path = str(exact_eagle3(tmp_path / "eagle3", eng, aux=[1, 2]))
    elif mode == "mtp":
        eng.drafter_path = str(write_sidecar(tmp_path / "mtp", eng, exact_head(eng, noise=0.05, seed=2)))
    return eng, "dspark" if mode == "lookup-first" else mode


@pytest.mark.parametrize("mode", ["draft", "draft-windowed", "draft-recurrent", "draft-stable", "dspark", "dflash",
                                  "eagle3", "mtp", "lookup-first"])
def test_every_drafter_batches(mode, tmp_path, monkeypatch):
    """Each mode's rows (own drafter state each, different caps, one joining mid-flight) equal
    their requests alone; rows whose drafters have a head propose together (a draft model also
    with sliding windows or recurrent state on both sides, and under a shape policy)."""
    eng, run_mode = _engine_for(mode, tmp_path)
    together: list[int] = []
    drafter = eng.drafter(run_mode)
    head_type = type(getattr(drafter, "model_drafter", drafter))  # behind lookup-first: the rows lookup left
    if run_mode == "draft":  # rows in each of the draft model's forwards (forks share the model)
        model_type, call = type(drafter.model), type(drafter.model).__call__
        monkeypatch.setattr(model_type, "__call__", lambda self, x, *a, **k: (
            self is drafter.model and together.append(x.shape[0])) or call(self, x, *a, **k))
    elif hasattr(head_type, "propose_rows"):
        propose_rows = head_type.propose_rows
        monkeypatch.setattr(head_type, "propose_rows",
                            staticmethod(lambda requests: together.append(len(requests)) or propose_rows(requests)))
    prompts = [[t % (eng.target.vocab_size - 2) + 2 for t in p] for p in PROMPTS]
    requests = [dict(prompt=p, mode=run_mode, max_new_tokens=n, max_draft=cap)
                for p, n, cap in zip(prompts, BUDGETS, [4, 2, 3, 4])]
    want = [alone(eng, r["prompt"], mode=run_mode, max_new_tokens=r["max_new_tokens"], max_draft=r["max_draft"])
            for r in requests]
    tickets, widths = run_batch(eng, [dict(r) for r in requests], max_batch=3)
    for t, w, r in zip(tickets, want, requests):
        assert_same_greedy(eng.model, r["prompt"], w.token_ids, t.result.token_ids, f"{mode} batched")
        assert_caches_clean(eng, t)
    assert max(widths) == 3 and sum(t.result.drafted for t in tickets) > 0
    assert max(together) >= 2


def test_seeded_sampling_alone_equals_batched():
    eng = make_engine("llama", seed=5)
    kw = dict(mode="lookup", temperature=0.9, top_p=0.95, max_draft=4)
    want = [alone(eng, p, seed=40 + i, max_new_tokens=n, **kw) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))]
    tickets, _ = run_batch(eng, [dict(prompt=p, seed=40 + i, max_new_tokens=n, **kw)
                                 for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))], max_batch=4)
    assert [t.result.token_ids for t in tickets] == [w.token_ids for w in want]


def tally_batches(target, make_row, params: SamplingParams, rows_per_batch: int = 3) -> tuple[Tally, int]:
    """RUNS + 2 sampled rows of LENGTH tokens after PROMPT, ``rows_per_batch`` at a time in one
    BatchLoop (``make_row(seed)`` builds each), every token tallied against the target's exact
    conditional by draft position and previous token. Returns (the tally, the widest round)."""
    tally, widest = Tally(), 0
    for start in range(0, RUNS + 2, rows_per_batch):
        loop = BatchLoop(target, max_batch=rows_per_batch)
        rows = [loop.add(make_row(start + i)) for i in range(rows_per_batch)]
        tokens = {id(r): ([], []) for r in rows}
        while loop.busy:
            for e in loop.step():
                toks, positions = tokens[id(e.row)]
                toks += e.tokens
                positions += range(len(e.tokens))
                if e.event.drafted:
                    tally.outcomes[e.event.drafted, e.event.accepted] += 1
            widest = max(widest, loop.last_width)
        for r in rows:
            toks, positions = tokens[id(r)]
            seq = PROMPT + toks
            exact = np.array(target_probs(target.model(mx.array([seq]))[0, len(PROMPT) - 1 : -1], params),
                             dtype=np.float64)
            for t, (token, j) in enumerate(zip(toks, positions)):
                tally.add(j, seq[len(PROMPT) + t - 1], token, exact[t])
    return tally, widest


@pytest.mark.parametrize("proposals", ["alone", "together"])
def test_batched_sampling_is_exact(proposals, monkeypatch):
    """Three rows at a time, each with its own draft-model drafter (multi-token drafts, rejections
    at every position): every row's tokens follow the target's exact conditionals. ``together``:
    the rows' requests are marked unseeded, as a server's are, so their draft model runs each
    forward once over the three rows (``propose_rows``); ``alone``: seeded, each row proposes alone."""
    target_model, draft_model = models()
    from engine.target import Target

    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=6)
    base = DraftModelDrafter(draft_model, max_draft=CAP)
    together: list[int] = []
    propose_rows = DraftModelDrafter.propose_rows
    monkeypatch.setattr(DraftModelDrafter, "propose_rows",
                        staticmethod(lambda requests: together.append(len(requests)) or propose_rows(requests)))

    def row(seed: int) -> BatchRow:
        sampler = Sampler(SamplingParams(1.0, 0.9, 6, seed=1000 + seed))  # a deterministic key stream either way
        if proposals == "together":
            sampler.params = params
        return BatchRow(list(PROMPT), sampler, LENGTH, drafter=base.fork(), cap_policy=FixedCap(CAP))

    tally, widest = tally_batches(Target(target_model), row, params)
    assert widest == 3 and (max(together) == 3 if proposals == "together" else not together)
    assert_exact(tally)


def _padding_rows(target, drafter_row, sampler, length, prompts, plain_drafter):
    """A loop of one row that drafts every round (``drafter_row``) beside rows that never draft
    themselves (``FixedCap(0)``) but whose n-gram lookup has matches: their padding is free."""
    loop = BatchLoop(target, max_batch=1 + len(prompts))
    loop.add(drafter_row)
    plain = [loop.add(BatchRow(list(p), sampler(i), length, drafter=plain_drafter(), cap_policy=FixedCap(0)))
             for i, p in enumerate(prompts)]
    return loop, plain


def test_rows_that_draft_nothing_verify_free_drafts_in_the_padding():
    """A round is as wide as its widest row's drafts; a row that drafts nothing (a plain run, a
    cut, a parked policy) had its padding filled with copies of its last token. Where its n-gram
    lookup has a match, that draft costs nothing to make and its verify is already paid: it is
    verified there, and the row commits what holds, the same tokens as alone. Its policy still
    takes the round as the plain step it planned."""
    from engine.drafters.lookup import LookupDrafter

    eng = make_engine("llama")
    repeating = [[7, 8, 9, 10, 11] * 4, [30, 31, 32] * 5]
    want = [alone(eng, p, mode="baseline", max_new_tokens=20).token_ids for p in repeating]
    lead = BatchRow([3, 4, 5, 6, 7, 8, 9, 10] * 3, Sampler(SamplingParams()), 40, drafter=LookupDrafter(max_draft=4),
                    cap_policy=FixedCap(4))
    loop, plain = _padding_rows(eng.target, lead, lambda i: Sampler(SamplingParams()), 20, repeating,
                                lambda: LookupDrafter(max_draft=8))
    drafted = {id(r): 0 for r in plain}
    while loop.busy:
        for e in loop.step():
            if e.row in plain:
                assert e.event.cap == 0  # never asked to draft ...
                drafted[id(e.row)] += e.event.drafted  # ... yet verified free drafts
    for row, tokens in zip(plain, want):
        assert_same_greedy(eng.model, row.prompt_ids, tokens, row.stats.ids[len(row.prompt_ids):], "padding")
        assert all(c == 0 for c in row.stats.caps) and row.cap_policy.cap() == 0
    assert all(drafted.values()) and all(sum(a for _, a in r.stats.rounds) for r in plain)


def test_free_drafts_in_the_padding_sample_exactly(monkeypatch):
    """Unseeded sampled rows whose padding carries one-hot n-gram drafts beside a row drafting
    every round (a rejection at each position): their tokens follow the target's conditionals.
    A seeded row takes none (its draws follow the schedule it has alone)."""
    import os
    import random

    from engine.drafters.lookup import LookupDrafter
    from engine.target import Target

    keys = random.Random(77)  # an unseeded sampler keys itself from os.urandom: reproducible here
    monkeypatch.setattr(os, "urandom", keys.randbytes)

    target_model, draft_model = models()
    target = Target(target_model)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=6)
    tally = Tally()
    for start in range(RUNS):
        lead = BatchRow(list(PROMPT), Sampler(SamplingParams(1.0, 0.9, 6, seed=500 + start)), LENGTH,
                        drafter=DraftModelDrafter(draft_model, max_draft=CAP), cap_policy=FixedCap(CAP))
        seeded_params = SamplingParams(1.0, 0.9, 6, seed=900 + start)  # the third row's
        loop, plain = _padding_rows(target, lead, lambda i: Sampler(seeded_params if i == 2 else params),
                                    LENGTH, [PROMPT] * 3, lambda: LookupDrafter(max_draft=CAP, min_ngram=1))
        seeded, plain = plain[2], plain[:2]
        tokens = {id(r): [] for r in plain}
        while loop.busy:
            for e in loop.step():
                if e.row not in plain:
                    assert e.row is not seeded or not e.event.drafted
                    continue
                tokens[id(e.row)] += [(t, j) for j, t in enumerate(e.tokens)]
                if e.event.drafted == CAP:
                    tally.outcomes[CAP, e.event.accepted] += 1
        for r in plain:
            seq = PROMPT + [t for t, _ in tokens[id(r)]]
            exact = np.array(target_probs(target_model(mx.array([seq]))[0, len(PROMPT) - 1 : -1], params),
                             dtype=np.float64)
            for t, (token, j) in enumerate(tokens[id(r)]):
                tally.add(j, seq[len(PROMPT) + t - 1], token, exact[t])
    full = tally.outcomes[CAP]
    assert min(full) >= 5, f"rounds of {CAP} free drafts by accepted: {full}"  # every path of the rule
    assert tally.impossible == 0
    # positions 3 and 4 are reached too rarely here for a total variation under 0.1
    assert_conditionals(tally, 2, "free drafts in the padding: ")


def test_generate_batch_api_and_results_order():
    eng = make_engine("llama")
    results = api.generate_batch(eng, ["w5 w6 w7", "w9 w9 w9 w9", "w30"], mode="lookup", max_new_tokens=6,
                                 chat_template=False, max_batch=2)
    assert [r.text for r in results] == [eng.generate(p, mode="lookup", max_new_tokens=6, chat_template=False).text
                                         for p in ["w5 w6 w7", "w9 w9 w9 w9", "w30"]]


@pytest.mark.parametrize("arch", ["llama", "llama-sliding", "qwen3_5"])
def test_requests_arriving_together_with_one_opening_prefill_it_once(arch):
    """Requests submitted at once that share a long opening (an agent's system prompt and
    tools): the first prefills it and keeps its prompt in the prefix cache as soon as it is done;
    the others look the cache up as they start, after it, and restore the opening instead of
    prefilling it again, where their caches can be cut back to it (full attention). One that
    repeats the first prompt exactly (a retry, another sample) restores all of it on every cache
    family (a snapshot at the prompt's end). Every answer is the one it gets alone."""
    eng = make_engine(arch)
    opening = list(range(10, 50))
    prompts = [opening + [5, 6, 7], opening + [8, 9], opening + [10, 11, 12, 13], opening + [5, 6, 7]]
    kw = dict(mode="lookup", max_new_tokens=12, max_draft=3)
    solo = [alone(eng, p, **kw) for p in prompts]
    eng.clear_prefix_cache()
    batcher = Batcher(eng, 4)
    tickets = [batcher.submit(p, **kw) for p in prompts]
    batcher.run()
    assert [t.result.token_ids for t in tickets] == [r.token_ids for r in solo]
    assert max(t.result.batch_width for t in tickets) == 4
    cached = [t.result.cached_tokens for t in tickets]
    assert cached[0] == 0 and cached[3] == len(prompts[0])
    if arch == "llama":
        assert cached[1:3] == [len(opening)] * 2
    # Each kept its prompt, then its whole sequence, in one entry: a repeat restores all of it.
    again = Batcher(eng, 3)
    repeat = again.submit(prompts[2], **kw)
    again.run()
    assert repeat.result.token_ids == solo[2].token_ids and repeat.result.cached_tokens >= len(prompts[2]) - 1


# ----------------------------------------------------------------------------------------
# The server with --max-batch
# ----------------------------------------------------------------------------------------
def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict, dict]:
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, dict(resp.getheaders()), data


@pytest.fixture(scope="module")
def batch_server():
    srv = make_server(lambda: make_engine("llama"), port=0, max_batch=3, max_queue=4).start()
    srv.wait_ready(60)
    yield srv
    srv.stop()


@contextlib.contextmanager
def engine_thread_held(worker):
    """The server's engine thread pauses before its next tick until the block ends, so that
    requests queue up meanwhile."""
    hold, original = threading.Event(), worker.batcher.step

    def held_step():
        hold.wait(30)
        original()

    worker.batcher.step = held_step
    try:
        yield
    finally:
        hold.set()
        worker.batcher.step = original


def test_server_short_request_joining_long_ones_returns_first(batch_server):
    srv = batch_server
    done: dict[str, float] = {}
    replies: dict[str, dict] = {}

    def ask(name: str, prompt: str, n: int) -> None:
        status, _, body = _post(srv.url, {"prompt": prompt, "max_tokens": n, "tandem": {"mode": "baseline"}})
        assert status == 200, body
        replies[name], done[name] = body, time.perf_counter()

    longs = [threading.Thread(target=ask, args=(f"long{i}", f"w{10 + i} w11 w12", 400)) for i in range(2)]
    for t in longs:
        t.start()
    time.sleep(0.3)
    short = threading.Thread(target=ask, args=("short", "w40 w41", 3))
    short.start()
    for t in longs + [short]:
        t.join(120)
    assert done["short"] < min(done["long0"], done["long1"])
    assert replies["short"]["x_tandem"]["batch_width"] >= 2
    assert srv.metrics.batch_occupancy == 0
    metrics = srv.metrics.render()
    assert "tandem_batch_occupancy 0" in metrics and "tandem_queue_depth 0" in metrics


def test_server_requests_sent_together_restore_their_common_opening(batch_server):
    """Two completions with one 40-token opening, queued while the engine thread is held: the one
    that starts second restores the opening that the first prefilled (usage reports it)."""
    srv = batch_server
    opening = " ".join(f"w{i}" for i in range(50, 90))
    replies: list[dict] = []

    def ask(tail: str) -> None:
        status, _, body = _post(srv.url, {"prompt": f"{opening} {tail}", "max_tokens": 4, "tandem": {"mode": "baseline"}})
        assert status == 200, body
        replies.append(body)

    threads = [threading.Thread(target=ask, args=(tail,)) for tail in ("w5 w6", "w7")]
    with engine_thread_held(srv.worker):
        for th in threads:
            th.start()
            time.sleep(0.2)
    for th in threads:
        th.join(60)
    assert sorted(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies) == [0, 40]


def test_server_full_queue_answers_503_with_retry_after(batch_server):
    srv = batch_server
    threads, statuses = [], []
    try:
        with engine_thread_held(srv.worker):  # requests pile up in the queue
            for i in range(6):  # one may be taken off the queue before the pause; four more fill it
                th = threading.Thread(target=lambda i=i: statuses.append(
                    _post(srv.url, {"prompt": f"w{20 + i}", "max_tokens": 2})[0]))
                th.start()
                threads.append(th)
                time.sleep(0.2)
            status, headers, body = _post(srv.url, {"prompt": "w60", "max_tokens": 2})
            assert status == 503 and headers.get("Retry-After") and "busy" in json.dumps(body)
    finally:
        for th in threads:
            th.join(60)
    assert statuses.count(200) >= 5 and set(statuses) <= {200, 503}
    assert "tandem_requests_rejected_total" in srv.metrics.render()


def test_stress_random_arrivals_lengths_and_cancellations():
    """50 requests arriving at random ticks with random lengths, caps and modes, a fifth cancelled
    at a random tick: every one ends (result or cancelled), occupancy returns to 0, each finished
    one equals its request alone, and a second identical run holds no more memory than the first."""
    eng = make_engine("gemma3", seed=9)
    rng = np.random.default_rng(0)
    plan = []
    for i in range(50):
        prompt = [int(t) for t in rng.integers(2, 90, size=int(rng.integers(2, 40)))]
        plan.append(dict(prompt=prompt, arrive=int(rng.integers(0, 60)), mode=str(rng.choice(["baseline", "lookup"])),
                         max_new_tokens=int(rng.integers(1, 20)), max_draft=int(rng.integers(1, 6)),
                         cancel_at=int(rng.integers(1, 15)) if i % 5 == 0 else None))

    def run_once() -> list:
        batcher = Batcher(eng, 4)
        tickets: list = [None] * len(plan)
        tick = 0
        while tick < 60 or batcher.busy:
            for i, p in enumerate(plan):
                if p["arrive"] == tick:
                    flag = {"n": 0}

                    def cancel(p=p, flag=flag) -> bool:
                        flag["n"] += 1
                        return p["cancel_at"] is not None and flag["n"] >= p["cancel_at"]

                    tickets[i] = batcher.submit(p["prompt"], mode=p["mode"], max_new_tokens=p["max_new_tokens"],
                                                max_draft=p["max_draft"], prefix_cache=False, cancel=cancel)
            batcher.step()
            tick += 1
            assert batcher.occupancy <= 4
        assert batcher.occupancy == 0 and not batcher.busy
        return tickets

    def outcomes() -> tuple[list, int]:
        """Each request's (tokens, finish reason), and the memory MLX holds once its tickets
        (and with them the rows' caches) are gone."""
        got = [(t.result.token_ids, t.result.finish_reason) for t in run_once()]
        gc.collect()
        return got, mx.get_active_memory()

    first, held_first = outcomes()
    second, held_second = outcomes()
    assert first == second and held_second <= held_first + (256 << 10)
    for p, (tokens, reason) in zip(plan, first):
        if reason != "cancelled":
            want = alone(eng, p["prompt"], mode=p["mode"], max_new_tokens=p["max_new_tokens"], max_draft=p["max_draft"])
            assert_same_greedy(eng.model, p["prompt"], want.token_ids, tokens, "stress")
    assert sum(reason == "cancelled" for _, reason in first) >= 5


def test_concurrent_benchmark_reports_batched_against_sequential():
    from engine.benchmark import Arm
    from engine.concurrent_bench import format_concurrent, run_concurrent

    eng = make_engine("llama", seed=2)
    prompts = [("code", p) for p in PROMPTS[:3]] + [("chat", p[::-1]) for p in PROMPTS[:3]]
    labels = []
    report = run_concurrent(eng, prompts, [Arm("baseline"), Arm("lookup", "auto")], concurrent=3, arrival_ms=5,
                            max_new_tokens=12, trials=2, progress=lambda done, total, label: labels.append(label))
    assert report["lossless"] and set(report["arms"]) == {"baseline", "lookup@auto"}
    # each class's trials time every arm back to back (a drifting machine's pace hits them alike)
    timed = [label.split()[:3] for label in labels if not label.startswith("warm-up")]
    assert [(a, c) for a, c, _ in timed[::2]] == [(a, c) for c in ("code", "chat") for _ in range(2)
                                                  for a in ("baseline", "lookup@auto")]
    for arm in report["arms"].values():
        for cls in ("code", "chat"):
            c = arm["classes"][cls]
            assert c["batched"]["batch_width"] == 3 and c["batched"]["tokens"] == c["sequential"]["tokens"]
            assert c["batched"]["latency_p95_s"] >= c["batched"]["latency_p50_s"] > 0
            assert 0 < c["batched"]["ttft_p50_s"] <= c["batched"]["latency_p50_s"]
            assert c["batched"]["stream_tok_s_p50"] > 0 and c["sequential"]["stream_tok_s_p50"] > 0
            late = c["late_arrival"]  # the last request joined the others mid-flight (5 ms apart)
            assert late["ttft_s"] == c["batched"]["ttft_s"][-1] > 0 and late["round_p50_s"] > 0
            assert isinstance(late["within_prefill_plus_two_rounds"], bool)
    assert report["arms"]["baseline"]["vs_batched_baseline"] == {"code": 1.0, "chat": 1.0}
    assert report["arms"]["baseline"]["stream_vs_batched_baseline"] == {"code": 1.0, "chat": 1.0}
    assert report["arms"]["baseline"]["paired_vs_batched_baseline"] == {"code": 1.0, "chat": 1.0}
    assert all(r > 0 for r in report["arms"]["lookup@auto"]["paired_vs_batched_baseline"].values())
    assert "lookup@auto" in format_concurrent(report) and "p50 stream" in format_concurrent(report)


def test_concurrent_benchmark_with_a_shared_prefix_restores_it_both_ways():
    """--shared-prefix: one after another, a request restores the opening from the one before; batched,
    from the row that prefilled it first. Both passes restore the same tokens, and nothing leaks
    from one pass into the next (the cache is emptied before each)."""
    from engine.benchmark import Arm
    from engine.concurrent_bench import format_concurrent, run_concurrent

    eng = make_engine("llama", seed=2)
    opening = list(range(10, 40))
    prompts = [("agent", opening + tail) for tail in ([5, 6], [7], [8, 9, 10])]
    for shared in (True, False):
        report = run_concurrent(eng, prompts, [Arm("baseline")], concurrent=3, max_new_tokens=8, trials=2,
                                shared_prefix=shared)
        c = report["arms"]["baseline"]["classes"]["agent"]
        assert report["lossless"] and c["batched"]["batch_width"] == 3
        assert c["sequential"]["cached_tokens"] == c["batched"]["cached_tokens"] == (2 * len(opening) if shared else 0)
        assert ("restored from the prefix cache" in format_concurrent(report)) == shared


def test_a_drafter_tapping_other_layers_waits_and_says_so(tmp_path):
    from tests.test_block_drafters import write_dspark

    eng = make_engine("llama", seed=3)
    first, second = write_dspark(tmp_path / "a", eng, taps=[0, 2]), write_dspark(tmp_path / "b", eng, taps=[1, 2])
    batcher = Batcher(eng, 4)
    tickets = []
    for path, prompt in ((first, PROMPTS[0]), (second, PROMPTS[1]), (first, PROMPTS[2])):
        eng.drafter_path = str(path)
        tickets.append(batcher.submit(prompt, mode="dspark", max_new_tokens=10, max_draft=3, prefix_cache=False))
    widths = []
    while batcher.busy:
        batcher.step()
        widths.append(batcher.loop.last_width)
    assert max(widths) == 1  # the second waits for the first; the third for the second (arrival order)
    assert tickets[0].result.note is None and "other target layers" in tickets[1].result.note
    for t, path, prompt in zip(tickets, (first, second, first), PROMPTS):
        eng.drafter_path = str(path)
        assert t.result.token_ids == alone(eng, prompt, mode="dspark", max_new_tokens=10, max_draft=3).token_ids


def test_server_client_that_disconnects_frees_its_slot(batch_server):
    srv = batch_server
    host, port = srv.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "w7 w8", "max_tokens": 5000, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline()  # streaming: it holds a slot
    deadline = time.monotonic() + 10
    while srv.metrics.batch_occupancy == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.metrics.batch_occupancy == 1
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 20
    while (srv.metrics.batch_occupancy or srv.worker.running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.metrics.batch_occupancy == 0 and not srv.worker.running
    status, _, body = _post(srv.url, {"prompt": "w9", "max_tokens": 3})
    assert status == 200 and body["x_tandem"]["batch_width"] == 1


def test_server_both_dialects_streaming_and_not_batched_equal_alone(batch_server):
    import anthropic
    import openai

    srv = batch_server
    oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
    ant = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)

    def oai_chat(stream: bool) -> str:
        kw = dict(model="m", messages=[{"role": "user", "content": "w5 w6 w7 w5 w6"}], max_tokens=24)
        if not stream:
            return oai.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                       if c.choices)

    def ant_msg(stream: bool) -> str:
        kw = dict(model="m", messages=[{"role": "user", "content": "w9 w10 w11"}], max_tokens=24)
        if not stream:
            return ant.messages.create(**kw).content[0].text
        with ant.messages.stream(**kw) as s:
            return "".join(s.text_stream)

    calls = [(oai_chat, True), (oai_chat, False), (ant_msg, True), (ant_msg, False)]
    alone_texts = [fn(stream) for fn, stream in calls]  # one at a time
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i, fn=fn, s=s: together.__setitem__(i, fn(s)))
               for i, (fn, s) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [together[i] for i in range(len(calls))] == alone_texts
    assert alone_texts[0] == alone_texts[1] and alone_texts[2] == alone_texts[3]  # streamed == not streamed


@pytest.mark.parametrize("mode", ["lookup", "baseline"])  # baseline: pipelined plain rounds (a token in flight)
def test_penalties_bias_and_logprobs_per_row(mode):
    """Rows with their own penalties, logit_bias and logprobs share forwards: each row's tokens and
    logprobs are its request's alone."""
    eng = make_engine("llama", seed=6)
    settings = [dict(presence_penalty=0.8, logprobs=3), dict(repetition_penalty=1.3, logit_bias={7: -100.0}),
                dict(frequency_penalty=0.5, logprobs=0, temperature=0.8, seed=3), {}]
    requests = [dict(prompt=p, mode=mode, max_new_tokens=n, max_draft=4 if mode != "baseline" else None, **kw)
                for p, n, kw in zip(PROMPTS, BUDGETS, settings)]
    want = [alone(eng, r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) for r in requests]
    tickets, widths = run_batch(eng, [dict(r) for r in requests], max_batch=4)
    assert max(widths) == 4
    for t, w in zip(tickets, want):
        assert t.result.token_ids == w.token_ids
        assert (t.result.logprobs is None) == (w.logprobs is None)
        for a, b in zip(t.result.logprobs or [], w.logprobs or []):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
    assert 7 not in tickets[1].result.token_ids
    assert len(tickets[0].result.logprobs) == len(tickets[0].result.token_ids)


def test_plain_rounds_are_queued_before_the_last_is_read():
    """Rows taking plain steps run pipelined (the next round queued on the lazy tokens of the one in
    flight), rows leave with a step in flight, and every answer and cache is the lone one's."""
    eng = make_engine("llama")
    batcher = Batcher(eng, 3)
    tickets = [batcher.submit(p, prefix_cache=False, mode="baseline", max_new_tokens=n) for p, n in zip(PROMPTS, BUDGETS)]
    queued = 0
    while batcher.busy:
        batcher.step()
        queued += batcher.loop._flight is not None
    assert queued >= 20 and batcher.loop._flight is None
    assert any(t.row.stats.cache_len == len(t.row.stats.ids) for t in tickets)  # one left with its last step fed
    for p, n, t in zip(PROMPTS, BUDGETS, tickets):
        assert t.result.token_ids == alone(eng, p, mode="baseline", max_new_tokens=n).token_ids
        assert_caches_clean(eng, t)


def test_a_joining_rows_first_token_goes_out_before_the_others_round():
    """The tick whose chunk ends a prompt ends there: the new row's first token goes out without
    waiting for the decoding rows' round, and the next tick is that round (not another arrival's
    chunk), so the rows already decoding wait one chunk at most, as before."""
    eng = make_engine("llama")
    loop = BatchLoop(eng.target, max_batch=3)
    first = loop.add(BatchRow(PROMPTS[0], Sampler(SamplingParams()), 12, cap_policy=FixedCap(0)))
    assert [e.row for e in loop.step()] == [first] and loop.last_width == 0  # its prefill alone
    assert [e.row for e in loop.step()] == [first] and loop.last_width == 1  # its first round
    second = loop.add(BatchRow(PROMPTS[1], Sampler(SamplingParams()), 12, cap_policy=FixedCap(0)))
    third = loop.add(BatchRow(PROMPTS[3], Sampler(SamplingParams()), 12, cap_policy=FixedCap(0)))
    ticks = []
    while loop.busy and len(ticks) < 5:
        ticks.append(([e.row for e in loop.step()], loop.last_width))
    # each arrival's last chunk alone (its first token out), each followed by a round: the first
    # lands the step the decoding row had in flight, the next one is every decoding row's
    assert [w for _, w in ticks] == [0, 1, 0, 3, 3]
    assert ticks[0][0] == [second] and ticks[1][0] == [first] and ticks[2][0] == [third]
    assert set(ticks[3][0]) == {first, second, third}


@pytest.mark.parametrize("slice_s, ticks_to_join", [(0.0, 3), (60.0, 1)])
def test_a_long_prompt_joins_in_slices_of_chunks(slice_s, ticks_to_join):
    """A newcomer's prompt of three chunks joins a decoding row one chunk a tick where each chunk
    fills the slice (each tick's chunk followed by the decoding row's round, the last one alone),
    and in one tick where all three fit. Either way both rows get their lone tokens."""
    eng = make_engine("llama")
    loop = BatchLoop(eng.target, max_batch=2, prefill_slice_s=slice_s)
    first = loop.add(BatchRow(PROMPTS[0], Sampler(SamplingParams()), 40, cap_policy=FixedCap(0)))
    loop.step(), loop.step()  # its prefill, its first round
    long_prompt = [(7 * i) % 89 + 3 for i in range(2 * PREFILL_CHUNK + 40)]
    second = loop.add(BatchRow(long_prompt, Sampler(SamplingParams()), 6, cap_policy=FixedCap(0)))
    joining = []  # each tick's round width until the newcomer decodes
    while not second.decoding:
        loop.step()
        joining.append(loop.last_width)
    assert joining == [1] * (ticks_to_join - 1) + [0]
    while loop.busy:
        loop.step()
    for row, prompt, n in ((first, PROMPTS[0], 40), (second, long_prompt, 6)):
        assert row.stats.ids[len(prompt):] == alone(eng, prompt, mode="baseline", max_new_tokens=n).token_ids


def test_suffix_drafts_from_earlier_requests_under_batching():
    """Lookup rows draft from what earlier requests wrote (the engine's suffix index): a batch
    repeating earlier prompts drafts far more than the first, with the same tokens."""
    eng = make_tiny_engine("llama", seed=8)
    kw = dict(mode="lookup", max_new_tokens=24, max_draft=6)
    first, _ = run_batch(eng, [dict(prompt=p, **kw) for p in PROMPTS[1:]], max_batch=3)
    again, _ = run_batch(eng, [dict(prompt=p, **kw) for p in PROMPTS[1:]], max_batch=3)
    assert [t.result.token_ids for t in again] == [t.result.token_ids for t in first]
    assert sum(t.result.drafted for t in again) > sum(t.result.drafted for t in first)


def test_concurrent_agent_class_is_the_replayed_sessions_requests_spread_over_it(capsys):
    """``--classes agent``: N requests of the agent session, spread over it and ending with its
    last (the reviewer sub-agent's), each its conversation so far; refused without ``--concurrent``."""
    from engine.agent_session import build_session
    from engine.cli import main
    from engine.concurrent_bench import AGENT, agent_prompts

    requests = build_session().requests
    picked = agent_prompts(4)
    assert [c for c, _ in picked] == [AGENT] * 4 and picked[-1][1] == requests[-1]
    sizes = [sum(len(m["content"]) for m in messages) for _, messages in picked]
    assert sizes[:3] == sorted(sizes[:3]) and len(set(sizes)) == 4  # three stages of the main loop, in order,
    assert picked[-1][1][0]["content"] != requests[0][0]["content"]  # and the reviewer sub-agent's own conversation
    assert all(messages in requests for _, messages in picked)
    assert main(["benchmark", "--classes", "agent", "--modes", "lookup"]) == 1  # before any model loads
    assert "--agent-replay" in capsys.readouterr().err
