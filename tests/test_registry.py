"""The target -> drafter registry: quant-agnostic name matching, local availability (bundled
or in the local HF cache, never downloaded), --mode auto, and ``tandem models``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import registry
from engine.cli import main as cli_main
from engine.drafters import checkpoint
from engine.drafters.dspark import DSparkDrafter
from engine.errors import TandemError
from tests import drafter_ckpt as ck
from tests.tiny import make_tiny_engine


@pytest.mark.parametrize("name", [
    "Qwen/Qwen3-8B", "mlx-community/Qwen3-8B-4bit", "Qwen3-8B-bf16", "mlx-community/Qwen3-8B-8bit",
    "qwen3-8b-MLX-4bit-DWQ", "lmstudio-community/Qwen3-8B-MLX-6bit", "/models/Qwen3-8B-Q4_K_M.gguf",
    "Qwen3-8B-3.5bit", "Qwen3-8B-fp16",
])
def test_quantized_variants_resolve_the_same_row(name):
    row = registry.lookup(name)
    assert row is not None and row["drafter"] == "deepseek-ai/dspark_qwen3_8b_block7"
    assert registry.base_name(name) == "qwen3-8b"


def test_rows_do_not_leak_between_sizes_or_families():
    assert registry.lookup("Qwen3-4B-4bit")["drafter"] == "deepseek-ai/dspark_qwen3_4b_block7"
    assert registry.lookup("Qwen/Qwen3-14B")["drafter"] == "deepseek-ai/dspark_qwen3_14b_block7"
    assert [r["drafter"] for r in registry.rows_for("Qwen3-8B", "dflash")] == ["z-lab/Qwen3-8B-DFlash-b16"]
    assert registry.lookup("Qwen3-80B") is None and registry.lookup("Llama-3.2-1B-Instruct-4bit") is None
    assert registry.lookup("SmolLM2-135M-Instruct") is None or Path(
        checkpoint.resources_dir() / "drafters").is_dir()  # a starter row only with a bundled drafter
    assert registry.lookup("mlx-community/gemma-4-12B-it-qat-4bit")["supported"] is False


def test_registry_file_is_well_formed():
    data = json.loads(registry.registry_path().read_text())
    assert data["schema"] == 1
    for row in data["pairs"]:
        assert row["mode"] in ("dspark", "dflash", "eagle3", "mtp") and "/" in row["target"]
        assert (row["mode"] == "mtp") == (row["drafter"] == registry.OWN_HEAD)
        if row["drafter"].startswith("resources:"):  # bundled drafters must ship
            assert checkpoint.resolve_drafter_path(row["drafter"]).is_dir()
    targets = {registry.base_name(r["target"]) for r in data["pairs"]}
    assert {"qwen3-4b", "qwen3-8b", "qwen3-14b", "gemma-4-12b-it", "qwen3.6-27b"} <= targets


def _fake_hf_cache(root: Path, repo: str, engine) -> Path:
    """A local HF hub cache entry, as ``hf download`` leaves it."""
    folder = root / f"models--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / "0123abcd"
    ck.write(snap, *ck.dspark_checkpoint(ck.target_config_of(engine.model), taps=[0, 2]))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123abcd")
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


@pytest.fixture
def tiny_rows(tmp_path, monkeypatch):
    """A registry for the tiny test target (named like a real model), first row preferred."""
    reg = tmp_path / "registry.json"
    reg.write_text(json.dumps({"schema": 1, "pairs": [
        {"target": "test-org/Tiny-Qwen3", "mode": "dspark", "drafter": "test-org/tiny-dspark"},
        {"target": "test-org/Tiny-Qwen3", "mode": "dflash", "drafter": "test-org/tiny-dflash"},
    ]}))
    monkeypatch.setattr(registry, "registry_path", lambda: reg)
    return reg


def test_auto_mode_uses_a_cached_registered_drafter_else_lookup(hub, tiny_rows):
    engine = make_tiny_engine("qwen3", seed=1)
    engine.name = "mlx-community/Tiny-Qwen3-4bit"
    assert registry.auto_mode(engine) == "lookup"  # registered, but nothing on this machine
    assert registry.usable_row(engine) is None
    msg = registry.missing_drafter_message(engine, "dspark")
    assert "not in the local Hugging Face cache" in msg and "hf download test-org/tiny-dspark" in msg
    with pytest.raises(TandemError, match="not in the local Hugging Face cache"):
        engine.generate([5, 6], mode="dspark", max_new_tokens=2)
    _fake_hf_cache(hub, "test-org/tiny-dspark", engine)
    assert registry.auto_mode(engine) == "dspark"
    assert registry.usable_row(engine)["drafter"] == "test-org/tiny-dspark"
    res = engine.generate([5, 6, 7], mode="auto", max_new_tokens=6)
    assert res.mode == "dspark" and res.generated == 6
    # A registered drafter that does not fit this target is skipped, not mis-loaded.
    other = make_tiny_engine("qwen3", seed=1, hidden=32)
    other.name = "Tiny-Qwen3-bf16"
    assert registry.auto_mode(other) == "lookup"
    assert "does not fit" in registry.missing_drafter_message(other, "dspark")


def test_a_row_marked_auto_false_serves_its_mode_but_not_auto(hub, tiny_rows):
    data = json.loads(tiny_rows.read_text())
    data["pairs"] = [dict(data["pairs"][0], auto=False, why="measured slower than lookup")]
    tiny_rows.write_text(json.dumps(data))
    engine = make_tiny_engine("qwen3", seed=1)
    engine.name = "Tiny-Qwen3"
    _fake_hf_cache(hub, "test-org/tiny-dspark", engine)
    assert registry.auto_mode(engine) == "lookup"
    assert registry.usable_row(engine, "dspark")["drafter"] == "test-org/tiny-dspark"
    assert engine.generate([5, 6, 7], mode="dspark", max_new_tokens=4).generated == 4
    assert engine.generate([5, 6, 7], mode="auto", max_new_tokens=4).mode == "lookup"


def test_lookup_first_follows_the_row_unless_the_user_says(hub, tiny_rows):
    from engine.drafters.lookup_first import LookupFirst

    data = json.loads(tiny_rows.read_text())
    data["pairs"][0]["lookup_first"] = True
    tiny_rows.write_text(json.dumps(data))
    engine = make_tiny_engine("qwen3", seed=1)
    engine.name = "Tiny-Qwen3"
    snap = _fake_hf_cache(hub, "test-org/tiny-dspark", engine)
    assert isinstance(engine.drafter("dspark"), LookupFirst)  # the row's choice
    engine.lookup_first = False
    assert isinstance(engine.drafter("dspark"), DSparkDrafter)
    engine.lookup_first, engine.drafter_path = None, str(snap)  # an explicit drafter: no row, no lookup
    assert isinstance(engine.drafter("dspark"), DSparkDrafter)
    engine.lookup_first = True
    assert isinstance(engine.drafter("dspark"), LookupFirst)


def test_auto_mode_follows_an_explicit_drafter_and_refuses_a_bad_one(tmp_path):
    engine = make_tiny_engine("qwen3", seed=1)
    tc = ck.target_config_of(engine.model)
    engine.drafter_path = str(ck.write(tmp_path / "f", *ck.dflash_checkpoint(tc, taps=[0, 2])))
    assert registry.auto_mode(engine) == "dflash"
    engine.drafter_path = str(ck.write(tmp_path / "s", *ck.dspark_checkpoint(tc, taps=[0, 2])))
    assert registry.auto_mode(engine) == "dspark"
    (tmp_path / "s" / "config.json").write_text("{}")
    with pytest.raises(TandemError, match="not a DSpark or DFlash checkpoint"):
        registry.auto_mode(engine)


def test_auto_mode_is_baseline_when_the_cache_cannot_roll_back(monkeypatch, tiny_qwen3):
    monkeypatch.setattr(tiny_qwen3.target, "speculation_blocker", lambda: "a cache it cannot roll back")
    assert registry.auto_mode(tiny_qwen3) == "baseline"


def test_unregistered_model_needs_an_explicit_drafter(tiny_qwen3):
    tiny_qwen3.drafter_path = None
    with pytest.raises(TandemError, match="needs a DFlash drafter: pass --drafter"):
        tiny_qwen3.generate([5, 6], mode="dflash", max_new_tokens=2)


def test_bundled_drafter_path_is_relative_to_resources(tmp_path, monkeypatch):
    engine = make_tiny_engine("qwen3", seed=1)
    monkeypatch.setattr(checkpoint, "resources_dir", lambda: tmp_path)
    ck.write(tmp_path / "drafters" / "tiny", *ck.dspark_checkpoint(ck.target_config_of(engine.model), taps=[0, 2]))
    assert checkpoint.resolve_drafter_path("resources:drafters/tiny") == tmp_path / "drafters" / "tiny"
    assert registry.available({"target": "x/y", "mode": "dspark", "drafter": "resources:drafters/tiny"})
    assert not registry.available({"target": "x/y", "mode": "dspark", "drafter": "resources:drafters/none"})
    with pytest.raises(TandemError, match="bundled drafter"):
        checkpoint.resolve_drafter_path("resources:drafters/none")


def test_tandem_models_prints_the_table(capsys, hub):
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    assert "base-name match" in out and "deepseek-ai/dspark_qwen3_8b_block7" in out and "unsupported" in out
    assert cli_main(["models", "--model", "mlx-community/Qwen3-8B-4bit"]) == 0
    out = capsys.readouterr().out
    assert "z-lab/Qwen3-8B-DFlash-b16" in out and "Qwen3-14B" not in out
    assert cli_main(["models", "--model", "SmolLM2-135M-Instruct"]) == 0  # the bundled drafter
    assert "resources:drafters/smollm2-135m-dspark  yes    yes" in capsys.readouterr().out
    assert cli_main(["models", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(r["local"] in ("yes", "no", "unsupported", "in model") for r in data["registry"])
    assert {r["mode"] for r in data["registry"]} >= {"dspark", "dflash", "eagle3", "mtp"}
    assert cli_main(["models", "--model", "nothing-like-it"]) == 0
    assert "--mode auto uses lookup" in capsys.readouterr().out


def test_mode_support_names_what_each_mode_needs(tmp_path):
    from tests import drafter_ckpt as ck
    from tests.tiny import make_tiny_engine

    eng = make_tiny_engine("qwen3", seed=3)
    support = eng.mode_support()
    assert support["baseline"] is None and support["lookup"] is None and support["auto"] is None
    assert "--draft-model" in support["draft"]
    assert "--drafter" in support["dspark"] and "--drafter" in support["dflash"]
    eng.drafter_path = str(ck.write(tmp_path / "dflash", *ck.dflash_checkpoint(ck.target_config_of(eng.model))))
    support = eng.mode_support()
    assert support["dflash"] is None
    assert "DFlash checkpoint" in support["dspark"] and "--mode dflash" in support["dspark"]


@pytest.mark.parametrize("spec", ["smollm2", "starter", "SmolLM2-135M", "smollm2-135m-instruct"])
def test_a_builtin_name_finds_the_rows_its_loaded_model_runs_with(spec, starter_engine):
    """``tandem models --model smollm2`` and ``--model smollm2 --mode dspark`` match through one
    function: a built-in's name or alias finds the rows the loaded model finds."""
    assert registry.rows_for(spec) == registry.rows_for(starter_engine) != []
    assert registry.rows_for(spec)[0]["drafter"] == "resources:drafters/smollm2-135m-dspark"


def test_tandem_models_finds_the_starter_drafter_by_its_short_name(capsys):
    assert cli_main(["models", "--model", "smollm2"]) == 0
    assert "resources:drafters/smollm2-135m-dspark  yes    yes" in capsys.readouterr().out
