"""The prefix cache: a prompt that starts like an earlier sequence restores its state and prefills
only the rest, in every mode, with the same output as a prefill from token 0; the disk tier
survives a restart and refuses what it did not write; memory stays within its budget; the server
reports cached tokens in both dialects."""

from __future__ import annotations

import shutil
import threading
import urllib.request

import anthropic
import mlx.core as mx
import numpy as np
import openai
import pytest

from engine import prefix_disk
from engine.api import Session
from engine.caches import common_prefix
from engine.drafters.draft_model import DraftModelDrafter
from engine.generate import Engine
from engine.prefix_cache import MARK_EVERY, PrefixCache, layer_classes
from engine.serve.chat_format import render_chat
from engine.serve.server import make_server
from tests.lossless import assert_same_greedy
from tests.test_block_drafters import write_dflash, write_dspark
from tests.tiny import make_tiny_engine, make_tiny_model, make_tokenizer

EOS = 0
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }} {{ m.content }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")
MODES = ["baseline", "lookup", "draft", "dspark", "dflash", "dflash2", "lookup-first", "eagle3", "mtp"]


def engine_for(mode: str, tmp_path, arch: str = "llama") -> tuple[Engine, str]:
    """A tiny engine set up for ``mode``; returns (engine, the mode name to ask for)."""
    engine = make_tiny_engine("qwen3" if mode == "mtp" else arch, seed=6, scale=4.0)
    if mode == "mtp":  # a random head in Qwen3.5's layout (test_mtp's)
        from engine.drafters import formats
        from engine.drafters.mtp import MTPDrafter
        from tests import drafter_ckpt as ck
        from tests.test_mtp import sidecar_config

        config = sidecar_config(engine)
        weights = {k: mx.array(v) for k, v in ck.mtp_tensors(config["text_config"], seed=3, scale=0.3).items()}
        engine.set_drafter("mtp", MTPDrafter(formats.load_mtp_head(engine.target, config, weights, where="test head"),
                                             engine.target))
    elif mode == "eagle3":
        from tests.test_eagle3 import write_eagle3

        engine.drafter_path = str(write_eagle3(tmp_path / "eagle3", engine, aux=[1, 2], scale=0.3,
                                               draft_tokens=range(2, 90)))
    elif mode == "dflash2":
        from tests.test_dflash2 import write_dflash2

        engine.drafter_path = str(write_dflash2(tmp_path / "dflash2", engine, layers=2, taps=[1, 2]))
        return engine, "dflash"  # the checkpoint says which DFlash
    elif mode == "draft":
        engine.set_drafter("draft", DraftModelDrafter(make_tiny_model(arch, seed=9), max_draft=3))
    elif mode in ("dspark", "lookup-first"):
        engine.drafter_path = str(write_dspark(tmp_path / "dspark", engine, layers=2, taps=[0, 1, 2], markov_scale=10.0))
        engine.lookup_first = mode == "lookup-first"
        return engine, "dspark"
    elif mode == "dflash":
        engine.drafter_path = str(write_dflash(tmp_path / "dflash", engine, layers=2, taps=[1, 2]))
    return engine, mode


def rows_counter(engine: Engine) -> list[int]:
    """Count the rows every target forward runs over."""
    rows: list[int] = []
    forward = engine.target.forward

    def counted(ids, cache, **kw):
        rows.append(int(ids.shape[1]))
        return forward(ids, cache, **kw)

    engine.target.forward = counted
    return rows


def user(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, 96, size=n)]


def check(engine: Engine, mode: str, prompt: list[int], n: int = 16, **kw):
    """Generate with the prefix cache; the same prompt prefilled from token 0 must give the same
    tokens (greedy: or differ at a floating-point tie, proved by its margin; restored rows were
    computed in forwards of other widths, which may change their last bits)."""
    warm = engine.generate(prompt, mode=mode, max_new_tokens=n, **kw)
    cold = engine.generate(prompt, mode=mode, max_new_tokens=n, prefix_cache=False, **kw)
    label = f"{mode} with {warm.cached_tokens} of {len(prompt)} tokens restored"
    if kw.get("temperature"):
        assert warm.token_ids == cold.token_ids, label
    else:
        assert_same_greedy(engine.model, prompt, cold.token_ids, warm.token_ids, label)
    assert cold.cached_tokens == 0
    return warm


# ----------------------------------------------------------------------------------------
# Same output, fewer forwards, in every mode
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_conversations_give_the_same_greedy_output(tmp_path, mode):
    engine, ask = engine_for(mode, tmp_path)
    ahead = 1 if mode in ("eagle3", "mtp") else 0  # a chain head's row reads the next token too
    p1 = user(1, 40) + user(1, 12)  # a repeat: lookup has something to draft
    r1 = check(engine, ask, p1)
    assert r1.cached_tokens == 0
    p2 = p1 + r1.token_ids + [EOS] + user(2, 9)
    r2 = check(engine, ask, p2)
    assert r2.cached_tokens >= len(p1) + len(r1.token_ids) - 1 - ahead  # everything the target had computed
    p3 = p2 + r2.token_ids + [EOS] + user(3, 7)
    r3 = check(engine, ask, p3)
    assert r3.cached_tokens >= len(p2) + len(r2.token_ids) - 1 - ahead
    inside = p1 + r1.token_ids[: len(r1.token_ids) // 2] + [EOS]  # ends inside an earlier answer
    assert check(engine, ask, inside).cached_tokens == len(p1) + len(r1.token_ids) // 2 - ahead
    edited = p3[:20] + [EOS] + p3[21:]  # the first message edited in the middle
    assert check(engine, ask, edited).cached_tokens == 20 - ahead
    again = check(engine, ask, p3)  # regenerate: the whole prompt is stored, with the row after it
    assert again.cached_tokens == len(p3) - ahead and again.token_ids == r3.token_ids
    if mode != "baseline":
        assert r2.drafted > 0


@pytest.mark.parametrize("mode", ["draft", "dspark", "dflash", "lookup-first", "eagle3", "mtp"])
def test_a_resumed_drafter_holds_what_begin_would_build(tmp_path, mode):
    """After turn 2 the drafter's state (context K/V rows, the draft model's cache, a chain head's
    rows) over the prompt equals, to rounding, the state of a run that prefilled from token 0."""
    engine, ask = engine_for(mode, tmp_path)
    p1 = user(30, 40)
    r1 = engine.generate(p1, mode=ask, max_new_tokens=10)
    p2 = p1 + r1.token_ids + [EOS] + user(31, 8)

    def prompt_rows(prefix_cache: bool) -> list[np.ndarray]:
        result = engine.generate(p2, mode=ask, max_new_tokens=10, prefix_cache=prefix_cache)
        assert (result.cached_tokens > len(p1)) == prefix_cache
        state = engine.drafter(ask).state()
        kv = state.tree["cache"] if isinstance(state.tree, dict) else state.tree
        return [np.array(layer[0][..., : len(p2) - 1, :]) for layer in kv]

    warm, cold = prompt_rows(True), prompt_rows(False)
    assert all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(warm, cold))


def test_the_second_turn_runs_the_target_over_the_new_tokens_only(tmp_path):
    engine, _ = engine_for("dspark", tmp_path)
    rows = rows_counter(engine)
    p1 = user(7, 60)
    r1 = engine.generate(p1, mode="dspark", max_new_tokens=12)
    p2 = p1 + r1.token_ids + [EOS] + user(8, 10)
    rows.clear()
    r2 = engine.generate(p2, mode="dspark", max_new_tokens=12)
    stored = len(p1) + len(r1.token_ids) - (0 if r1.finish_reason == "stop" else 1)  # the last anchor is not cached
    assert r2.cached_tokens == stored
    decode_rows = sum(d + 1 for d, _ in r2.rounds[1:])  # each verify: the anchor and its drafts
    assert sum(rows) == len(p2) - stored + decode_rows
    rows.clear()
    engine.generate(p2, mode="dspark", max_new_tokens=12, prefix_cache=False)
    assert sum(rows) >= len(p2)  # without the cache the whole prompt is prefilled


def test_prefill_chunks_keep_their_boundaries_after_a_restore(tmp_path):
    """Prompts over several prefill chunks; after a restore inside a chunk, the next chunks end
    where a prefill from token 0 ends them (multiples of 512)."""
    engine, ask = engine_for("dflash", tmp_path)
    long = user(9, 700)
    r1 = check(engine, ask, long, n=8)
    p2 = long + r1.token_ids + [EOS] + user(10, 900)
    rows = rows_counter(engine)
    r2 = engine.generate(p2, mode=ask, max_new_tokens=8)
    start = r2.cached_tokens
    assert start >= len(long) and start % 512
    prefill = rows[: len(rows) - (len(r2.rounds) - 1)]  # the rest are verify forwards
    assert list(np.cumsum(prefill) + start) == [1024, 1536, len(p2)] and len(p2) > 1536

@pytest.mark.parametrize("mode", ["baseline", "lookup", "dspark"])
def test_seeded_sampling_gives_the_same_tokens(tmp_path, mode):
    engine, ask = engine_for(mode, tmp_path)
    p1 = user(11, 30)
    kw = dict(temperature=1.0, top_p=0.95, seed=3)
    r1 = check(engine, ask, p1, n=20, **kw)
    p2 = p1 + r1.token_ids + [EOS] + user(12, 6)
    r2 = check(engine, ask, p2, n=20, **kw)
    assert r2.cached_tokens > len(p1)


@pytest.mark.parametrize("arch,mode", [("gemma3", "baseline"), ("gemma3", "lookup"), ("qwen3_5", "baseline"),
                                       ("qwen3_5", "draft"), ("lfm2", "lookup"), ("nemotron_h", "lookup"),
                                       ("gemma3", "dspark"), ("gemma3", "dflash")])
def test_caches_that_cannot_be_cut_back_restore_at_marks(tmp_path, arch, mode):
    """Sliding windows that wrapped (Gemma-3, window 8) and recurrent state (Qwen3.5, LFM2,
    Nemotron-H) restore where a snapshot was taken: turn 1's prompt end and answer, turn 2's
    resume point; an edit before every mark prefills from token 0. Same output throughout."""
    engine, ask = engine_for(mode, tmp_path, arch)
    assert set(layer_classes(engine.target.new_cache())) & {"RotatingKVCache", "ArraysCache"}
    p1 = user(13, 30)
    r1 = check(engine, ask, p1, n=14)
    p2 = p1 + r1.token_ids + [EOS] + user(14, 8)
    r2 = check(engine, ask, p2, n=14)
    assert r2.cached_tokens >= len(p1)
    edited = p2[: len(p2) - 8] + user(15, 8)  # turn 2's message rewritten
    assert check(engine, ask, edited, n=14).cached_tokens >= r2.cached_tokens
    other_answer = p1 + [t for t in user(17, 6) if t != r1.token_ids[0]]  # turn 1 answered otherwise
    assert check(engine, ask, other_answer, n=6).cached_tokens == len(p1)  # the mark at turn 1's prompt end
    assert check(engine, ask, p1[:10] + user(16, 20), n=6).cached_tokens == 0
    if mode == "baseline":  # a long prompt is marked every MARK_EVERY tokens
        long = user(18, MARK_EVERY + 60)
        check(engine, ask, long, n=4)
        assert check(engine, ask, long[: MARK_EVERY + 20] + user(19, 5), n=4).cached_tokens == MARK_EVERY


# ----------------------------------------------------------------------------------------
# The store: entries never change, memory stays in budget
# ----------------------------------------------------------------------------------------
def test_a_stored_entry_is_never_written_by_a_later_generation():
    engine = make_tiny_engine("llama", seed=6, scale=4.0)
    p1 = user(17, 50)
    engine.generate(p1, mode="baseline", max_new_tokens=10)
    (entry,) = list(engine.prefix_cache.entries())
    before = [np.array(a) for a in _arrays(entry.final)]
    # Diverge inside the stored tokens: the restored caches are trimmed and written in place.
    engine.generate(p1[:30] + user(18, 5), mode="lookup", max_new_tokens=10)
    engine.generate(p1[:40] + user(19, 5), mode="baseline", max_new_tokens=10)
    assert entry in list(engine.prefix_cache.entries())
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(before, _arrays(entry.final)))


def _arrays(tree):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def test_memory_stays_within_its_budget_under_distinct_prompts():
    engine = make_tiny_engine("llama", seed=6)
    budget = 400_000
    engine.prefix_cache = PrefixCache(budget)
    for i in range(12):
        engine.generate(user(100 + i, 60), mode="baseline", max_new_tokens=8)
        assert 0 < engine.prefix_cache.nbytes <= budget
    assert engine.prefix_cache.evictions > 0 and len(engine.prefix_cache) < 12
    engine.clear_prefix_cache()
    assert len(engine.prefix_cache) == 0


def test_an_entry_extending_another_absorbs_it():
    engine = make_tiny_engine("llama", seed=6)
    p1 = user(20, 30)
    r1 = engine.generate(p1, mode="lookup", max_new_tokens=8)
    engine.generate(p1 + r1.token_ids + [EOS] + user(21, 5), mode="lookup", max_new_tokens=8)
    (entry,) = list(engine.prefix_cache.entries())
    assert len(p1) in entry.logits  # turn 1's prompt can still be regenerated with no forward
    assert engine.generate(p1, mode="lookup", max_new_tokens=8).cached_tokens == len(p1)


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    a = list(range(5000))
    assert common_prefix(a, a[:3000] + [-1] + a[3001:]) == 3000


# ----------------------------------------------------------------------------------------
# The disk tier
# ----------------------------------------------------------------------------------------
def disk_engine(root, seed: int = 6, dtype=None) -> Engine:
    model = make_tiny_model("llama", seed=seed, scale=4.0)
    if dtype is not None:
        model.set_dtype(dtype)
    engine = Engine(model, make_tokenizer(), name="tiny")
    engine.prefix_cache = PrefixCache(disk_dir=root, min_disk_tokens=1)
    return engine


def files(root) -> list:
    return sorted(p for p in root.rglob("*.safetensors") if not p.name.startswith("."))


def test_the_disk_tier_survives_a_restart(tmp_path):
    path = write_dspark(tmp_path / "drafter", make_tiny_engine("llama", seed=6, scale=4.0), layers=2, taps=[0, 1, 2],
                        markov_scale=10.0)
    tmp_path = tmp_path / "prefix"
    first = disk_engine(tmp_path)
    first.drafter_path = str(path)
    p1 = user(22, 80)
    r1 = first.generate(p1, mode="dspark", max_new_tokens=12)
    assert len(files(tmp_path)) == 1
    second = disk_engine(tmp_path)  # a restart: new engine, new store, same folder
    second.drafter_path = str(path)
    second.target.set_taps(second.drafter("dspark").tap_layers)  # (the tap's probe forward)
    rows = rows_counter(second)
    p2 = p1 + r1.token_ids + [EOS] + user(23, 6)
    r2 = second.generate(p2, mode="dspark", max_new_tokens=12)
    assert r2.cached_tokens >= len(p1) + len(r1.token_ids) - 1  # with the drafter's context
    assert r2.token_ids == second.generate(p2, mode="dspark", max_new_tokens=12, prefix_cache=False).token_ids
    assert rows[0] == len(p2) - r2.cached_tokens
    assert second.prefix_cache.disk.loads == 1
    assert len(files(tmp_path)) == 1  # turn 2's entry replaced turn 1's file


def test_other_models_and_damaged_files_are_refused_and_removed(tmp_path):
    a = disk_engine(tmp_path)
    prompt = user(24, 40)
    ref = a.generate(prompt + [5], mode="baseline", max_new_tokens=6)
    (good,) = files(tmp_path)
    others = [disk_engine(tmp_path, seed=7), disk_engine(tmp_path, dtype=mx.float16)]
    for other in others:
        r = other.generate(prompt + [5], mode="baseline", max_new_tokens=6)
        assert r.cached_tokens == 0  # its own folder: never sees the first model's entries
    assert len(files(tmp_path)) == 3
    # A file planted in another model's folder (another precision) is refused when listed, and deleted.
    planted = others[1].prefix_cache.disk.dir / good.name
    shutil.copy(good, planted)
    b = disk_engine(tmp_path, dtype=mx.float16)
    assert b.generate(prompt + [5], mode="baseline", max_new_tokens=6).cached_tokens == len(prompt) + 1
    assert not planted.exists() and b.prefix_cache.disk.refused == 1

    backup = good.read_bytes()

    def damaged(edit) -> None:
        data = bytearray(backup)
        edit(data)
        good.write_bytes(bytes(data))
        fresh = disk_engine(tmp_path)
        r = fresh.generate(prompt + [5], mode="baseline", max_new_tokens=6)
        assert r.cached_tokens == 0 and r.token_ids == ref.token_ids
        assert fresh.prefix_cache.disk.refused == 1
        assert good.read_bytes() == backup  # deleted, then written again from the cold run

    damaged(lambda d: d.__delitem__(slice(len(d) // 2, None)))  # truncated

    def flip(d: bytearray) -> None:
        d[-100] ^= 0xFF

    damaged(flip)  # one byte of a tensor flipped


def test_the_disk_tier_stays_under_its_cap(tmp_path):
    engine = disk_engine(tmp_path)
    engine.prefix_cache.memory_bytes = 0  # every entry goes straight through to disk
    engine.generate(user(25, 60), mode="baseline", max_new_tokens=4)
    (one,) = files(tmp_path)
    engine.prefix_cache.disk.max_bytes = int(one.stat().st_size * 2.5)
    for i in range(5):
        engine.generate(user(26 + i, 60), mode="baseline", max_new_tokens=4)
        assert sum(p.stat().st_size for p in files(tmp_path)) <= engine.prefix_cache.disk.max_bytes
    assert len(files(tmp_path)) == 2
    # No room in memory at all: a later prompt still restores from disk.
    later = disk_engine(tmp_path)
    later.prefix_cache.memory_bytes = 0
    r = later.generate(user(30, 60) + [7], mode="baseline", max_new_tokens=4)
    assert r.cached_tokens == 60 and len(later.prefix_cache) == 0


# ----------------------------------------------------------------------------------------
# Session API and server
# ----------------------------------------------------------------------------------------
def chat_engine(seed: int = 6) -> Engine:
    tok = make_tokenizer()
    tok._tokenizer.chat_template = CHAT_TEMPLATE
    return Engine(make_tiny_model("llama", seed=seed, scale=4.0), tok, name="tiny-chat")


FOLDING_TEMPLATE = (  # Gemma 3's way: the system prompt opens the first user turn
    "{% if messages[0].role == 'system' %}{% set prefix = messages[0].content + ' w3 ' %}{% set rest = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{{ m.role }} {{ prefix if loop.first else '' }}{{ m.content }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}")


@pytest.mark.parametrize("opens_with", ["system", "folded-system", "template"])
@pytest.mark.parametrize("arch", ["qwen3_5", "llama-sliding"])
def test_conversations_that_open_alike_restore_the_whole_opening_where_caches_cannot_be_cut_back(arch, opens_with):
    """Two conversations with one system prompt (an agent's sub-agents, a new chat; rendered on
    its own or folded into the first user turn), or with none but the long preamble a template
    writes before the first user message (tools, a default system prompt): the second restores
    the whole opening, all that comes before the first user message's words, one after another
    and arriving together in a batch, on a recurrent hybrid and a sliding window alike (a
    snapshot at the opening's end; before it, the nearest snapshot was the prompt's start).
    Answers are those without the cache."""
    from engine.batching import Batcher

    tok = make_tokenizer()
    preamble = " ".join(f"w{i}" for i in range(10, 50))
    tok._tokenizer.chat_template = {
        "system": CHAT_TEMPLATE, "folded-system": FOLDING_TEMPLATE,
        "template": "{% if messages[0].role != 'system' %}system " + preamble + " </s> {% endif %}" + CHAT_TEMPLATE,
    }[opens_with]
    engine = Engine(make_tiny_model(arch, seed=6, scale=4.0), tok, name=f"tiny-chat-{arch}")
    engine.suffix_index = None
    firsts = [{"role": "user", "content": "w60 w61"}, {"role": "user", "content": "w70 w71 w72"}]
    system = [] if opens_with == "template" else [{"role": "system", "content": preamble}]
    chats = [system + [firsts[0]], system + [firsts[1]]]
    rendered = [tok.apply_chat_template(c, add_generation_prompt=False) for c in chats]
    opening = next(i for i, (a, b) in enumerate(zip(*rendered)) if a != b)
    assert opening > 40  # the preamble and the user's role, up to the first message's words
    kw = dict(mode="lookup", max_new_tokens=8)
    solo = [engine.generate(c, prefix_cache=False, **kw).token_ids for c in chats]
    engine.generate(chats[0], **kw)
    again = engine.generate(chats[1], **kw)
    assert again.cached_tokens == opening and again.token_ids == solo[1]
    engine.clear_prefix_cache()
    batcher = Batcher(engine, 2)
    tickets = [batcher.submit(c, **kw) for c in chats]
    batcher.run()
    assert [t.result.token_ids for t in tickets] == solo
    assert [t.result.cached_tokens for t in tickets] == [0, opening]


def test_session_keeps_history_and_reuses_it():
    engine = chat_engine()
    chat = Session(engine, system="w5 w6 w7", mode="lookup", max_new_tokens=10)
    a1 = chat.send("w10 w11 w12 w13")
    a2 = chat.send("w20 w21")
    assert a2.cached_tokens >= a1.prompt_tokens
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    ref = engine.generate(chat.messages[:-1], mode="lookup", max_new_tokens=10, prefix_cache=False)
    assert ref.token_ids == a2.token_ids
    again = chat.regenerate()
    assert again.token_ids == a2.token_ids and again.cached_tokens == again.prompt_tokens
    edited = chat.edit(1, "w30 w31")  # turn 1's message: turn 0 and its answer are reused
    assert edited.cached_tokens >= a1.prompt_tokens and len(chat.turns) == 2 and chat.turns[1][0] == "w30 w31"
    with pytest.raises(Exception):
        chat.edit(5, "w1")
    assert len(chat.turns) == 2


def test_multi_turn_benchmark(tmp_path):
    from engine.benchmark import format_multi_turn, run_multi_turn
    from engine.prompts import load_conversations

    (tmp_path / "mt-bench.jsonl").write_text(
        '{"turns": ["w5 w6 w7 w8"]}\n{"turns": ["w10 w11 w12", "w13 w14"]}\n{"turns": ["w20 w21", "w22", "w23 w24"]}\n')
    conversations = load_conversations(5, tmp_path)
    assert conversations == [["w10 w11 w12", "w13 w14"], ["w20 w21", "w22", "w23 w24"]]
    report = run_multi_turn(chat_engine(), conversations, ["baseline", "lookup"], trials=1, max_new_tokens=6)
    for arm in report["arms"].values():
        assert len(arm["runs"]) == 3 and all(r["cached_tokens"] > 0 and r["same"] for r in arm["runs"])
    assert report["lossless"] and "warm/cold" in format_multi_turn(report)


def test_server_requests_with_tools_and_no_system_message_restore_the_tools_on_a_hybrid():
    """An agent's side requests: the same tools, no system message, different first user
    messages. On a recurrent hybrid the second restores everything the template writes before
    the user's words (the tools block), from a snapshot where that opening ends."""
    tool = {"type": "function", "function": {"name": "w7", "description": " ".join(f"w{i}" for i in range(10, 60)),
                                             "parameters": {"type": "object", "properties": {}}}}

    def hybrid_engine() -> Engine:
        tok = make_tokenizer()
        tok._tokenizer.chat_template = ("{% if tools %}system {% for t in tools %}{{ t.function.name }} "
                                        "{{ t.function.description }} {% endfor %}</s> {% endif %}" + CHAT_TEMPLATE)
        return Engine(make_tiny_model("qwen3_5", seed=6, scale=4.0), tok, name="tiny-tools-hybrid")

    srv = make_server(hybrid_engine, port=0, mode="baseline").start().wait_ready(60)
    try:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        chats = [[{"role": "user", "content": "w70 w71"}], [{"role": "user", "content": "w80 w81 w82"}]]
        replies = [oai.chat.completions.create(model="m", max_tokens=4, messages=c, tools=[tool]) for c in chats]
        tok = srv.worker.engine.tokenizer
        prompts = [render_chat(tok, c, [tool])[1] for c in chats]
        opening = common_prefix(*prompts)
        assert opening > 50  # the tools block and the user's role word
        assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, opening]
    finally:
        srv.stop()


def test_server_reports_cached_tokens_in_both_dialects_to_concurrent_clients():
    system = " ".join(f"w{2 + i % 90}" for i in range(120))
    srv = make_server(chat_engine, port=0, mode="lookup").start().wait_ready(60)
    try:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        ant = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        oai.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "system", "content": system},
                                                                       {"role": "user", "content": "w9"}])
        out: dict = {}

        def ask_openai() -> None:
            out["openai"] = oai.chat.completions.create(model="m", max_tokens=8, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": "w40 w41"}])

        def ask_anthropic() -> None:
            out["anthropic"] = ant.messages.create(model="m", max_tokens=8, system=system,
                                                   messages=[{"role": "user", "content": "w50 w51"}])

        threads = [threading.Thread(target=ask_openai), threading.Thread(target=ask_anthropic)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        o, a = out["openai"], out["anthropic"]
        n_system = 120 + 2  # the system words, its role word and the end of the message
        assert o.usage.prompt_tokens_details.cached_tokens >= n_system
        assert o.model_extra["x_tandem"]["cached_tokens"] == o.usage.prompt_tokens_details.cached_tokens
        assert a.usage.cache_read_input_tokens >= n_system
        assert a.usage.input_tokens + a.usage.cache_read_input_tokens == a.model_extra["x_tandem"]["prompt_tokens"]
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        restored = o.usage.prompt_tokens_details.cached_tokens + a.usage.cache_read_input_tokens
        assert f"tandem_prompt_tokens_cached_total {restored}" in metrics
        # Same answers as a prefill from token 0.
        cold = chat_engine()
        for reply, user_text in ((o.choices[0].message.content, "w40 w41"), (a.content[0].text, "w50 w51")):
            _, ids = render_chat(cold.tokenizer, [{"role": "system", "content": system},
                                                  {"role": "user", "content": user_text}], None)
            ref = cold.generate(ids, mode="lookup", max_new_tokens=8, prefix_cache=False)
            assert reply.strip() == ref.text.strip()
    finally:
        srv.stop()


def test_stable_shape_caches_are_cut_back_like_plain_ones(tmp_path):
    """Under the CUDA shape policy (StableKVCache buffers in steps), a stored prompt is trimmable back
    to any prefix like mlx-lm's KVCache (no per-layer snapshots), it keeps its rows only,
    and a later prompt that diverges inside it is served from it with the same greedy tokens."""
    from engine.shapes import ShapePolicy

    engine, _ = engine_for("baseline", tmp_path)
    engine.target.set_shapes(ShapePolicy(step=16, widths=(1, 2, 4, 8)))
    p1 = user(40, 50)
    engine.generate(p1, mode="baseline", max_new_tokens=6)
    entry = next(engine.prefix_cache.entries())
    assert set(entry.classes) == {"StableKVCache"} and set(entry.floors) == {0} and not entry.marks
    assert entry.final[0][0].shape[2] == entry.final[0][2] == len(entry.tokens) < 64  # the rows, not the 64-row buffer
    p2 = p1[:30] + user(41, 12)
    warm = engine.generate(p2, mode="baseline", max_new_tokens=10)
    assert warm.cached_tokens == 30
    assert warm.token_ids == engine.generate(p2, mode="baseline", max_new_tokens=10, prefix_cache=False).token_ids


def test_an_entry_under_stable_shapes_keeps_only_its_rows():
    """On CUDA the target's K/V buffers grow 1024 rows at a time (engine/shapes.py): a kept
    prefix holds the rows it covers, not the spare ones (they cost 6-15x the memory of a short
    chat), and resumes into a buffer of the policy's shape with the same output."""
    from engine.shapes import ShapePolicy, StableKVCache

    plain, stable = make_tiny_engine("llama", seed=6), make_tiny_engine("llama", seed=6)
    stable.target.set_shapes(ShapePolicy(step=1024))
    draft = make_tiny_model("llama", seed=9)
    plain.set_drafter("draft", DraftModelDrafter(draft, max_draft=3))
    stable.set_drafter("draft", DraftModelDrafter(draft, max_draft=3, shapes=stable.target.shapes))
    p1 = user(30, 40)
    turns = []
    for eng in (plain, stable):
        r1 = eng.generate(p1, mode="draft", max_new_tokens=8)
        r2 = eng.generate(p1 + r1.token_ids + [EOS] + user(31, 6), mode="draft", max_new_tokens=8)
        assert r2.cached_tokens >= len(p1)
        turns.append((r1.token_ids, r2.token_ids))
    assert turns[0] == turns[1]
    assert isinstance(stable.target.new_cache()[0], StableKVCache)
    assert stable.prefix_cache.nbytes <= 1.2 * plain.prefix_cache.nbytes  # was ~6x: 1024-row buffers
