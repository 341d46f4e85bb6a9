"""The long-input benchmarks: ``tandem benchmark --context`` (a preamble of exactly N tokens of
shipped text before each prompt, the speed-up per context length) and ``--agent-replay`` (a
coding agent's session built from Tandem's own source, replayed with and without the suffix
index)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from engine import agent_bench as AB
from engine import benchmark as B
from engine import context_bench as CB
from engine import corpus
from engine.agent_session import SUB_AGENT, Session, build_delegating_session, build_session
from engine.cli import main
from engine.errors import TandemError
from engine.prompts import documents
from tests.tiny import make_tiny_engine


@pytest.fixture(scope="module")
def eng():
    return make_tiny_engine(seed=3, scale=4.0)  # stretched logits: no near-ties


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cache_dir(tmp_path, module_cache, monkeypatch):
    """The module's cache (a model is calibrated once), and real but short calibrations (what
    the benchmarks report is under test here, not the curves)."""
    from engine.calibrate import calibrate

    def quick(engine, arms, progress=None):
        return {mode: calibrate(engine, mode, engine.drafter(mode), passes=1, context=64, overhead_rounds=2)
                for mode in dict.fromkeys(a.mode for a in arms if a.mode != "baseline")}

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(module_cache))
    monkeypatch.setattr(B, "calibrate_arms", quick)
    monkeypatch.setattr(AB, "calibrate_arms", quick)
    return tmp_path


PLANTED = {"arm": "lookup@4", "trial": 0, "prompt": 1, "cls": "chat", "index": 3, "baseline_token": 7, "arm_token": 9,
           "margin": 0.5, "near_tie": False}


# ------------------------------------------------------------------ --context
def find(ids: list[int], part: list[int]) -> int:
    return next(i for i in range(len(ids) - len(part) + 1) if ids[i: i + len(part)] == part)


@pytest.mark.parametrize("code_first", [False, True])
def test_preamble_is_exactly_n_tokens_of_shipped_text_before_the_task(starter_engine, code_first):
    tok = starter_engine.tokenizer
    question = "What is 2 + 3?"
    bare = CB.with_preamble(starter_engine, question, 0, code_first)
    ids = CB.with_preamble(starter_engine, question, 700, code_first)
    assert len(ids) == len(bare) + 700
    material = corpus.token_prefix(tok, 700, code_first)
    start = find(ids, material)  # one contiguous run, in the user turn, after the lead line
    assert tok.decode(ids[:start]).endswith(CB.LEAD) and "<|im_start|>user" in tok.decode(ids[:start])
    assert tok.decode(ids[start + 700:]) == f"{CB.TASK}{question}<|im_end|>\n<|im_start|>assistant\n"
    text = tok.decode(material)
    if code_first:  # Tandem's own source, file by file
        first = corpus.source_files()[0]
        assert text.startswith(f"# {first}\n{corpus.source_text(first)[:200]}")
    else:  # the shipped articles
        assert text.startswith(documents()[0][:200])
    assert CB.with_preamble(starter_engine, question, 701, code_first)[:start + 700] == ids[:start + 700]


def test_preamble_without_a_chat_template_and_its_limits(eng, monkeypatch):
    ids = CB.with_preamble(eng, "w5 w6 w7", 50)
    assert len(ids) == len(CB.with_preamble(eng, "w5 w6 w7", 0)) + 50 and ids[-3:] == [5, 6, 7]
    monkeypatch.setattr(corpus, "blocks", lambda code_first: iter(["w5 w6", "w7"]))
    with pytest.raises(TandemError, match="hold only 3 tokens"):
        corpus.token_prefix(eng.tokenizer, 4, False)
    with pytest.raises(TandemError, match="token counts"):
        CB.parse_contexts("512,2k")
    assert CB.parse_contexts("512, 2048,512") == [512, 2048]
    with pytest.raises(TandemError, match="'multi-turn'"):
        CB.check_single_turn([("chat", "hi"), ("multi-turn", B.Turns(("a", "b")))])


def test_context_report_has_every_length_per_arm(eng, cache_dir):
    prompts = [("code", "w5 w6 w7 w8"), ("chat", "w9 w10 w11 w12 w13")]
    report = CB.run_context(eng, prompts, B.make_arms(["lookup"], [4]), [0, 48], trials=1, max_new_tokens=8)
    assert report["contexts"] == [0, 48] and report["lossless"] and report["divergences"] == []
    assert list(report["arms"]) == ["baseline", "lookup@4"]
    for arm in report["arms"].values():
        assert len(arm["tok_s"]) == len(arm["ratio"]) == 2 and all(t > 0 for t in arm["tok_s"])
    assert report["arms"]["baseline"]["ratio"] == [1.0, 1.0]
    short, long = report["by_context"]
    assert [p["prompt_tokens"] + 48 for p in short["prompts"]] == [p["prompt_tokens"] for p in long["prompts"]]
    assert long["context"] == 48 and long["arms"]["lookup@4"]["tok_s"] == report["arms"]["lookup@4"]["tok_s"][1]
    assert [p["prompt"] for p in long["prompts"]] == [p for _, p in prompts]
    json.dumps(report)
    table = CB.format_context(report)
    assert "N=48 tok/s (x)" in table and re.search(r"lookup@4 +[\d.]+ \(\d\.\d\d\)", table)
    planted = dict(report, divergences=[dict(PLANTED, context=48)])
    assert "divergence (MISMATCH): lookup@4 at 48 tokens, trial 0 prompt 1 (chat) at token 3: baseline 7 vs 9" \
        in CB.format_context(planted)


# ------------------------------------------------------------------ --agent-replay
@pytest.fixture(scope="module")
def session():
    return build_session()


def test_agent_session_is_deterministic_and_shaped_like_an_agents_loop(session):
    again = build_session()
    assert again.requests == session.requests and again.labels == session.labels
    assert 10 <= len(session.requests) <= 20
    main_loop = session.requests[:-1]
    for before, after in zip(main_loop, main_loop[1:]):  # each request: the whole conversation so far, and more
        assert after[: len(before)] == before and len(after) == len(before) + 2
    system, task = main_loop[0]
    assert system["role"] == "system" and all(f'"name": "{t}"' in system["content"] for t in
                                              ("grep", "read_file", "edit_file", "run_tests"))
    assert task["role"] == "user" and session.symbol in task["content"]
    last = main_loop[-1]
    calls = [m["content"] for m in last if m["role"] == "assistant"]
    results = [m["content"] for m in last[2:] if m["role"] == "user"]
    assert all("<tool_call>" in c for c in calls) and all(r.startswith("<tool_response>") for r in results)
    edit = f'"old_string": "{session.symbol}", "new_string": "{session.new_name}", "replace_all": true'
    assert sum(edit in c for c in calls) >= 4  # the same edit, module after module
    assert session.labels.count("run_tests") == 2 and "ImportError" in results[session.labels.index("run_tests") - 1]
    # tool output is the real source: grep hits and numbered lines quote the installed files
    hits = [line for line in results[0].splitlines()[1:-1]]
    assert len(hits) >= 4
    for hit in hits:
        path, n, text = hit.split(":", 2)
        assert corpus.source_text(path).splitlines()[int(n) - 1] == text
    reads = [r for r, label in zip(results, session.labels[1:]) if label == "read_file"]
    path, n, text = re.search(r'"path": "([^"]+)", "offset": (\d+)', calls[1]).group(1, 2) + (None,)
    first = reads[0].splitlines()[1].split("\t", 1)
    assert int(first[0]) == int(n) and corpus.source_text(path).splitlines()[int(n) - 1] == first[1]
    # files come back again: the missed module's hits in both greps, its lines in a read
    greps = [r for r, label in zip(results, session.labels[1:]) if label == "grep"]
    assert len(greps) == 2 and set(greps[1].splitlines()[1:-1]) <= set(greps[0].splitlines()[1:-1])
    # the reviewer sub-agent: a fresh conversation quoting lines the main session read
    review = session.requests[-1]
    assert session.labels[-1].startswith("review") and review[0]["role"] == "system" and len(review) == 2
    removed = [line[1:] for line in review[1]["content"].splitlines() if line.startswith("-") and session.symbol in line]
    assert removed and all(any(line in r for r in results) for line in removed[:3])


def test_delegating_session_hands_each_module_to_a_fresh_sub_agent(session):
    deleg = build_delegating_session()
    assert deleg.shape == "delegating" and (deleg.symbol, deleg.new_name) == (session.symbol, session.new_name)
    assert 10 <= len(deleg.requests) <= 20 and deleg.requests == build_delegating_session().requests
    subs = [r for r, label in zip(deleg.requests, deleg.labels) if label.startswith("sub-agent")]
    main_loop = [r for r, label in zip(deleg.requests, deleg.labels) if not label.startswith(("sub-agent", "review"))]
    for before, after in zip(main_loop, main_loop[1:]):
        assert after[: len(before)] == before and len(after) == len(before) + 2
    assert '"name": "task"' in main_loop[0][0]["content"] and '"name": "task"' not in SUB_AGENT
    jobs = [r for r in subs if len(r) == 2]
    assert len(jobs) == len(subs) // 2 >= 4 and all(r[0]["content"] == SUB_AGENT for r in subs)
    edit = f'"old_string": "{deleg.symbol}", "new_string": "{deleg.new_name}", "replace_all": true'
    paths = []
    for job in jobs:  # a fresh conversation: its own job, quoting the module's real lines, and nothing else
        path = re.match(r"In (\S+), rename", job[1]["content"]).group(1)
        paths.append(path)
        quoted = [line for line in job[1]["content"].splitlines() if line.startswith(path + ":")]
        assert quoted and all(corpus.source_text(path).splitlines()[int(n) - 1] == text
                              for _, n, text in (line.split(":", 2) for line in quoted))
    for sub in subs:  # no sub-agent sees another's module
        mine = re.match(r"In (\S+), rename", sub[1]["content"]).group(1)
        assert not any(p in m["content"] for p in paths if p != mine for m in sub)
        if len(sub) == 4:
            assert edit in sub[2]["content"] and f"The file {mine} has been updated" in sub[3]["content"]
    reports = [m["content"] for m in main_loop[-1] if m["role"] == "user" and "Renamed `" in m["content"]]
    assert [re.search(r" in (\S+) \(", r).group(1) for r in reports] == paths
    assert deleg.labels[-1].startswith("review") and deleg.requests[-1][1] == session.requests[-1][1]  # the same diff


def tiny_session() -> Session:
    """Three requests of a growing conversation in the tiny tokenizer's words."""
    words = " ".join(f"w{5 + i % 13}" for i in range(40))
    s = Session("a", "b")
    chat = [{"role": "user", "content": words}]
    for k in range(3):
        s.requests.append([dict(m) for m in chat])
        s.labels.append(f"r{k}")
        chat += [{"role": "assistant", "content": "w20 w21 w22"}, {"role": "user", "content": words}]
    return s


def test_agent_replay_report_on_a_tiny_model(eng, cache_dir):
    report = AB.run_agent_replay(eng, B.make_arms(["lookup"], [4]), session=tiny_session(), trials=2,
                                 max_new_tokens=10)
    assert list(report["arms"]) == ["baseline", "lookup@4 (in-context)", "lookup@4 (+suffix)"]
    assert report["lossless"] and report["divergences"] == []
    kept, alone = report["arms"]["lookup@4 (+suffix)"], report["arms"]["lookup@4 (in-context)"]
    assert kept["suffix_index"] and not alone["suffix_index"]
    assert all(a["best_tok_s"] >= max(a["tok_s_trials"]) for a in report["arms"].values())  # each request's fastest
    per_trial = [k / c for k, c in zip(kept["tok_s_trials"], alone["tok_s_trials"])]
    assert report["suffix_vs_context"]["lookup@4"]["ratio"] == pytest.approx(sum(per_trial) / 2)  # median of two
    assert report["suffix_vs_context"]["lookup@4"]["best_ratio"] == pytest.approx(kept["best_tok_s"] / alone["best_tok_s"])
    assert all(a["cached_tokens"] > 0 for a in report["arms"].values())  # later requests restore the earlier ones
    assert [r["prompt_tokens"] for r in report["session"]["requests"]] == [41, 86, 131]
    json.dumps(report)
    table = AB.format_agent_replay(report)
    assert "suffix drafts vs in-context lookup alone (lookup@4)" in table and "lossless: every arm" in table
    planted = dict(report, divergences=[dict(PLANTED, cls="r1")])
    assert "MISMATCH): lookup@4 trial 0 request 1 (r1) at token 3" in AB.format_agent_replay(planted)


def test_agent_replay_empties_the_index_only_for_the_in_context_arm(eng, monkeypatch):
    seen = []  # per request: does the suffix index know the end of its prompt (from the requests before)?
    real = eng.generate

    def generate(ids, **kw):
        seen.append(eng.suffix_index.propose(ids) is not None)
        return real(ids, **kw)

    monkeypatch.setattr(eng, "generate", generate)
    requests = [AB.render(eng, messages) for messages in tiny_session().requests]
    for keep in (False, True):
        seen.clear()
        list(AB.replay(eng, requests, AB.ReplayArm(B.Arm("lookup", 4), keep_index=keep), 6))
        assert seen == ([False, True, True] if keep else [False, False, False])
    with pytest.raises(TandemError, match="unknown agent session 'solo': choose from single, delegating"):
        AB.run_agent_replay(eng, B.make_arms(["lookup"]), shape="solo")
    monkeypatch.setattr(eng, "suffix_index", None)
    with pytest.raises(TandemError, match="suffix index"):
        AB.run_agent_replay(eng, B.make_arms(["lookup"]), session=tiny_session())


def test_cli_runs_both_benchmarks(cache_dir, tmp_path, capsys, monkeypatch):
    from tests.test_gguf import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "llama")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "humaneval.jsonl").write_text(json.dumps({"turns": ["def add(a, b):"]}) + "\n")
    (prompts / "spec-bench.jsonl").write_text(json.dumps({"category": "rag", "turns": ["Rivers flow.\nWhy?"]}) + "\n")
    monkeypatch.setenv("TANDEM_PROMPTS_DIR", str(prompts))
    out = tmp_path / "context.json"
    assert main(["benchmark", "--model", str(gguf), "--modes", "lookup", "--max-draft", "4", "--trials", "1",
                 "--max-new-tokens", "6", "--classes", "code", "--prompts-per-class", "1", "--context", "0,32",
                 "--json", str(out)]) == 0
    assert "N=32 tok/s (x)" in capsys.readouterr().out and json.loads(out.read_text())["contexts"] == [0, 32]
    monkeypatch.setattr(AB, "build_session", tiny_session)
    assert main(["benchmark", "--model", str(gguf), "--modes", "lookup", "--max-draft", "4", "--trials", "1",
                 "--max-new-tokens", "6", "--agent-replay", "--json", str(out)]) == 0
    assert "lookup@4 (+suffix)" in capsys.readouterr().out
    assert list(json.loads(out.read_text())["arms"]) == ["baseline", "lookup@4 (in-context)", "lookup@4 (+suffix)"]
    monkeypatch.setattr(AB, "build_delegating_session", lambda: dataclasses.replace(tiny_session(), shape="delegating"))
    assert main(["benchmark", "--model", str(gguf), "--modes", "lookup", "--max-draft", "4", "--trials", "1",
                 "--max-new-tokens", "4", "--agent-replay", "delegating", "--json", str(out)]) == 0
    assert "agent session (rename a to b, delegating)" in capsys.readouterr().out
    assert json.loads(out.read_text())["session"]["shape"] == "delegating"
    assert main(["benchmark", "--agent-replay", "--context", "512"]) == 1
    assert "separate benchmarks" in capsys.readouterr().err
