"""Benchmark: prompt loading, arms, the lossless check (a planted mismatch is caught and its
margin comes from a real clean re-run) and a whole run on a tiny model."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest

from engine import benchmark as B
from engine.cli import main
from engine.errors import TandemError
from tests.tiny import make_tiny_engine

COPY = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]


@pytest.fixture(scope="module")
def eng():
    return make_tiny_engine(seed=3, scale=4.0)  # stretched logits: no near-ties


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_first_divergence():
    assert B.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert B.first_divergence([1, 2, 3], [1, 2]) is None  # length alone is not a divergence
    assert B.first_divergence([1, 2, 3], [1, 9, 3]) == 1


def test_planted_mismatch_is_caught_with_a_real_margin(eng):
    base = eng.generate(COPY, mode="baseline", max_new_tokens=20).token_ids
    planted = list(base)
    planted[6] = (base[6] + 1) % 96
    report = B.check_lossless(eng, COPY, base, planted, "lookup@4")
    assert report["index"] == 6 and report["arm"] == "lookup@4"
    assert report["baseline_token"] == base[6] and report["arm_token"] == planted[6]
    # the clean re-run of baseline's prefix reproduces baseline's choice as the top-1
    logits, _ = eng.target.prefill(COPY + base[:6], eng.target.new_cache())
    top = mx.argsort(-logits)[:2].tolist()
    assert report["top1"] == base[6] == top[0] and report["top2"] == top[1]
    assert report["margin"] == pytest.approx(logits[top[0]].item() - logits[top[1]].item())
    assert report["margin"] > 0 and not report["near_tie"]
    assert B.check_lossless(eng, COPY, base, list(base), "x") is None


def test_a_reference_that_left_the_clean_order_is_re_anchored(eng):
    """bf16 on a GPU moves a logit a few units between two runs of one request: where the
    reference run, not the arm, left the clean forward's choice, the arm's rest is checked against
    clean greedy decoding from there on."""
    base = eng.generate(COPY, mode="baseline", max_new_tokens=20).token_ids
    assert B.clean_greedy(eng, COPY, len(base)) == base
    logits, _ = eng.target.prefill(COPY + base[:6], eng.target.new_cache())
    second = mx.argsort(-logits)[1].item()
    drifted = base[:6] + [second] + B.clean_greedy(eng, COPY + base[:6] + [second], len(base) - 7)
    assert "reference_drift" not in B.check_lossless(eng, COPY, drifted, base, "arm")  # only asked for plain references
    report = B.check_lossless(eng, COPY, drifted, base, "arm", reanchors=B.PLAIN_REANCHORS)
    assert report["index"] == 6 and report["top1"] == base[6] and not report["near_tie"]
    assert report["reference_drift"] and report["after"] is None
    assert not B.is_mismatch(report) and B.divergence_kind(report) == "reference drift"
    wrong = list(base)  # the arm's rest is still checked: a wrong token after the drift is a mismatch
    wrong[12] = (base[12] + 1) % 96
    report = B.check_lossless(eng, COPY, drifted, wrong, "arm", reanchors=B.PLAIN_REANCHORS)
    assert report["reference_drift"] and report["after"]["index"] == 12 - 7 and B.is_mismatch(report)
    assert B.divergence_kind(report) == "MISMATCH"
    planted = list(base)  # an arm that leaves the clean order itself is no drift
    planted[6] = second
    report = B.check_lossless(eng, COPY, base, planted, "arm", reanchors=B.PLAIN_REANCHORS)
    assert "reference_drift" not in report and B.is_mismatch(report)


def test_run_benchmark_on_a_tiny_model(eng, cache_dir):
    prompts = [("code", COPY), ("chat", list(range(2, 30)))]
    arms = B.make_arms(["lookup"], [4, "auto"], noise_floor=True)
    ticks = []
    report = B.run_benchmark(eng, prompts, arms, trials=2, max_new_tokens=24,
                             progress=lambda d, t, s: ticks.append((d, t)), trace=True)
    assert report["lossless"] and report["divergences"] == []
    assert list(report["arms"]) == ["baseline", B.NOISE_ARM, "lookup@4", "lookup@auto"]
    again = report["arms"][B.NOISE_ARM]  # plain decoding as its own arm: the A/A noise floor
    assert again["mode"] == "baseline" and again["accept_per_round"] == 1.0 and again["lossless"] and again["ratio"] > 0
    base = report["arms"]["baseline"]
    assert base["ratio"] == pytest.approx(1.0) and base["accept_per_round"] == 1.0
    look = report["arms"]["lookup@4"]
    assert look["cap"] == 4 and look["accept_per_round"] > 1.0  # the copy prompt repeats
    assert look["target_forwards"] < base["target_forwards"]
    assert look["tokens"] == base["tokens"] and len(look["tok_s_trials"]) == 2
    assert set(look["classes"]) == {"code", "chat"}
    assert report["arms"]["lookup@auto"]["cap"] == "auto" and "lookup" in report["calibrations"]
    assert ticks[-1][0] == ticks[-1][1] == 4 + 2 * 2 * 4
    for stamp in ("device", "backend", "mlx", "model", "precision"):
        assert report[stamp]
    assert report["roofline"]["ceiling_tps"] > 0
    assert report["cuda_graph_cache"] == os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"]  # set by `import engine`
    assert report["verify_matmuls"] == "not needed on cpu"  # Tandem's kernel serves CUDA only
    cal = report["calibrations"]["lookup"]  # the curves the controller ran on, with the pair's key
    assert cal["key"] and len(cal["verify_ms"]) == len(cal["widths"]) > 1 and cal["plain_ms"] > 0
    json.dumps(report)
    text = B.format_report(report)
    assert ("graph cache" in text.splitlines()[0]) is (report["backend"] == "cuda")
    assert "lookup@auto" in text and "lossless: every arm" in text and "noise floor" in text
    runs = report["runs"]["lookup@4"]  # the trace: every round of every run, in order
    assert len(runs) == 2 and len(runs[0]) == len(prompts)
    for trial in runs:
        for run in trial:
            rows = run["rounds"]
            assert sum(steps if cap == 0 else acc + 1 for cap, steps, acc, _ in rows) == run["tokens"] - 1
            assert [end for *_, end in rows] == sorted(end for *_, end in rows)
            assert rows[-1][3] <= 1000.0 * run["decode_s"] + 1e-6
    assert any(cap == 4 and acc > 0 for trial in runs for run in trial for cap, _, acc, _ in run["rounds"])


def test_run_benchmark_reports_a_planted_mismatch(eng, cache_dir, monkeypatch):
    real = eng.generate

    def corrupt(prompt, **kw):  # an arm that gets one token wrong
        res = real(prompt, **kw)
        if kw.get("mode") == "lookup" and len(res.token_ids) > 3:
            res.token_ids = res.token_ids[:3] + [(res.token_ids[3] + 1) % 96] + res.token_ids[4:]
        return res

    monkeypatch.setattr(eng, "generate", corrupt)
    report = B.run_benchmark(eng, [("code", COPY)], B.make_arms(["lookup"], [4]), trials=1, max_new_tokens=12)
    assert not report["lossless"] and not report["arms"]["lookup@4"]["lossless"]
    assert report["arms"]["baseline"]["lossless"]
    (d,) = report["divergences"]
    assert d["arm"] == "lookup@4" and d["index"] == 3 and not d["near_tie"]
    assert "MISMATCH" in B.format_report(report)


def test_arms_and_caps():
    arms = B.make_arms(["lookup", "baseline", "draft"], [2, "auto"])
    assert [a.name for a in arms] == ["baseline", "lookup@2", "lookup@auto", "draft@2", "draft@auto"]
    assert [a.name for a in B.make_arms(["lookup"])] == ["baseline", "lookup"]
    assert B.parse_caps("2, 8,auto") == [2, 8, "auto"] and B.parse_caps(None) == [None]
    with pytest.raises(TandemError, match="'x'"):
        B.parse_caps("2,x")


def test_prompts_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_PROMPTS_DIR", str(tmp_path))
    with pytest.raises(TandemError, match="not found.*mt-bench.jsonl"):
        B.load_prompts(["chat"], 1)
    (tmp_path / "mt-bench.jsonl").write_text('{"turns": ["hi", "again"]}\n\n{"turns": ["two"]}\n{"turns": ["3"]}\n')
    (tmp_path / "math500.jsonl").write_text('{"turns": ["1+1?"]}\n{"nope": 1}\n')
    assert B.load_prompts(["chat", "math"], 1) == [("chat", "hi"), ("math", "1+1?")]
    assert B.load_prompts(["chat"], 2) == [("chat", "hi"), ("chat", "two")]
    with pytest.raises(TandemError, match=r"math500.jsonl:2"):
        B.load_prompts(["math"], 2)
    with pytest.raises(TandemError, match="unknown prompt class 'poetry'"):
        B.load_prompts(["poetry"], 1)


def test_shipped_prompt_sets_load_without_any_folder_beside_the_checkout(monkeypatch):
    from engine import prompts as P
    from engine.paths import resources_dir

    monkeypatch.delenv("TANDEM_PROMPTS_DIR", raising=False)
    assert P.prompts_dir() == resources_dir() / "prompts"
    prompts = B.load_prompts(["chat", "code", "math"], 12)
    assert [c for c, _ in prompts] == ["chat"] * 12 + ["code"] * 12 + ["math"] * 12
    assert "def " in prompts[12][1] and all(p.strip() for _, p in prompts)
    spec = P.load_spec_bench(per_category=10)
    assert [c for c, _ in spec] == [c for c in P.SPEC_BENCH for _ in range(10)]
    turns = [p for c, p in spec if c == "multi-turn"]
    assert all(isinstance(p, P.Turns) and len(p.turns) == 2 for p in turns)
    assert all(isinstance(p, str) and p.strip() for c, p in spec if c != "multi-turn")
    assert "NOTICE" in {f.name for f in P.prompts_dir().iterdir()}
    with pytest.raises(TandemError, match="unknown Spec-Bench category 'poetry'"):
        P.load_spec_bench(["poetry"])


def test_the_product_never_reads_the_team_folder():
    from engine.paths import resources_dir

    root = resources_dir().parent
    hits = [str(f.relative_to(root)) for d in ("engine", "app", "resources") for f in (root / d).rglob("*")
            if f.is_file() and f.suffix in (".py", ".json", ".jsonl", ".txt", ".md", "")
            and any(s in f.read_text(errors="ignore") for s in ("shared/data", "../shared"))]
    assert hits == []


def test_multi_turn_prompts_time_the_last_turn_after_the_targets_own_answer(eng, cache_dir):
    from engine.prompts import Turns

    class Chat:  # the tiny tokenizer with a chat template: "role: content" lines
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt=True):
            text = " ".join(f"w{2 + len(m['content']) % 90}" for m in messages)
            return eng.tokenizer.encode(text)

        def __getattr__(self, name):
            return getattr(tok, name)

    tok = eng.tokenizer
    eng.tokenizer = Chat()
    try:
        messages = B.conversation(eng, Turns(("first question", "and a second one")), 6)
        first = eng.generate([{"role": "user", "content": "first question"}], mode="baseline", max_new_tokens=6)
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[1]["content"] == first.text and messages[2]["content"] == "and a second one"
        report = B.run_benchmark(eng, [("multi-turn", Turns(("first question", "and a second one")))],
                                 B.make_arms(["lookup"], [4]), trials=1, max_new_tokens=6)
        assert report["prompts"][0]["prompt_tokens"] == len(eng.encode(messages))
    finally:
        eng.tokenizer = tok
    assert B.conversation(eng, Turns(("a", "b")), 4) == "a\n\nb"  # no chat template: one text


def test_lossless_column_names_ties_and_mismatches():
    assert B.lossless_label({"lossless": True, "ties": 0}) == "yes"
    assert B.lossless_label({"lossless": True, "ties": 1}) == "yes, 1 tie"
    assert B.lossless_label({"lossless": True, "ties": 3}) == "yes, 3 ties"
    assert B.lossless_label({"lossless": False, "ties": 2}) == "NO"


def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys):
    assert main(["benchmark", "--modes", "baseline,bogus"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown mode 'bogus'" in err
    monkeypatch.setenv("TANDEM_PROMPTS_DIR", str(tmp_path))
    assert main(["benchmark", "--classes", "chat"]) == 1  # fails before loading any model
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "benchmark prompts not found" in err


def test_cli_benchmark_end_to_end(cache_dir, tmp_path, monkeypatch, capsys):
    from tests.test_gguf import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "llama")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for name, text in (("mt-bench", "Tell me about the sea."), ("humaneval", "def add(a, b):"),
                       ("math500", "What is 2 + 3?")):
        (prompts / f"{name}.jsonl").write_text(json.dumps({"turns": [text]}) + "\n")
    monkeypatch.setenv("TANDEM_PROMPTS_DIR", str(prompts))
    report_path = tmp_path / "out" / "report.json"
    rc = main(["benchmark", "--model", str(gguf), "--modes", "lookup", "--max-draft", "4,auto", "--trials", "1",
               "--max-new-tokens", "8", "--prompts-per-class", "1", "--json", str(report_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "lookup@auto" in out and "lossless: every arm" in out
    report = json.loads(report_path.read_text())
    assert list(report["arms"]) == ["baseline", "lookup@4", "lookup@auto"] and report["lossless"]
    assert [p["class"] for p in report["prompts"]] == ["chat", "code", "math"]
    assert report["model"] and report["mlx"] and report["backend"] == "cpu"


def test_near_tie_tolerance_follows_the_logit_precision():
    import mlx.core as mx

    from engine.benchmark import is_near_tie, logit_ulp

    assert logit_ulp(3.0, mx.bfloat16) == 2 ** -6  # 3 = 1.5 * 2^1, 7 mantissa bits
    assert is_near_tie(3.0, 3.0 - 2 ** -6, mx.bfloat16)  # one bf16 step apart: a rounding tie
    assert not is_near_tie(3.0, 2.9, mx.bfloat16)
    assert not is_near_tie(3.0, 3.0 - 2 ** -6, mx.float32)  # in float32 that gap is real
    assert is_near_tie(3.0, 3.0 - 1e-4, mx.float32)


def test_arms_take_every_position_and_more_than_one_predecessor():
    """Five arms on nine prompts over two trials (the device runs): each arm runs in every position
    and after several different arms, never always behind the same heavy neighbour."""
    n_arms, n_prompts = 5, 9
    orders = [B.arm_order(n_arms, t, j, n_prompts) for t in range(2) for j in range(n_prompts)]
    assert all(sorted(o) == list(range(n_arms)) for o in orders)  # every arm once per prompt
    for arm in range(n_arms):
        assert {o.index(arm) for o in orders} == set(range(n_arms))
        before = {o[o.index(arm) - 1] for o in orders if o.index(arm) > 0}
        assert len(before) >= 2
