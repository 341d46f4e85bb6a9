"""The Models tab's data side beyond the HF cache: Hub search against a local fake Hub, and LM
Studio's and Ollama's stores built in a temp HOME in their real layouts, with real tiny GGUFs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from app import hub, hub_search, local_stores
from engine.errors import TandemError
from tests.test_app_hub import FakeHub, online  # noqa: F401  (fixture)
from tests.test_gguf import write_tiny_gguf

GB = 10**9
MLX_REPO = {"id": "mlx-community/Qwen3-0.6B-4bit", "library_name": "mlx", "tags": ["mlx", "safetensors", "qwen3"],
            "downloads": 900, "likes": 12, "lastModified": "2025-05-01T10:00:00.000Z",
            "pipeline_tag": "text-generation",
            "safetensors": {"parameters": {"BF16": 1_000_000, "U32": 500_000}, "total": 1_500_000}}
MLX_8BIT = {"id": "mlx-community/Qwen3-0.6B-8bit", "library_name": "mlx", "tags": ["mlx"], "downloads": 50,
            "safetensors": {"parameters": {"BF16": 1_000_000, "U32": 500_000}, "total": 1_500_000}}
GGUF_REPO = {"id": "Qwen/Qwen3-0.6B-GGUF", "library_name": "gguf", "tags": ["gguf", "qwen3"], "downloads": 700,
             "likes": 3, "gguf": {"total": 600_000_000, "architecture": "qwen3", "context_length": 32768}}
OTHER = {"id": "someone/qwen3-pytorch", "tags": ["pytorch"], "downloads": 5}
GGUF_FILES = {"Qwen3-0.6B-Q8_0.gguf": 639_000_000, "Qwen3-0.6B-Q4_K_M.gguf": 397_000_000,
              "mmproj-F16.gguf": 1000, "README.md": 2000}


def fake_hub(**kw) -> FakeHub:
    return FakeHub({}, models=[MLX_REPO, MLX_8BIT, GGUF_REPO, OTHER], repo_files={GGUF_REPO["id"]: GGUF_FILES}, **kw)


# -- Hub search ------------------------------------------------------------------------------------------
def test_search_filters_by_format_and_reads_sizes(online):  # noqa: F811
    with fake_hub() as fake:
        mlx = hub_search.search("qwen3", "MLX", endpoint=fake.url)
        gguf = hub_search.search("qwen3", "GGUF", endpoint=fake.url)
        anything = hub_search.search("qwen3", "Any format", endpoint=fake.url)
        files = hub_search.gguf_files(GGUF_REPO["id"], endpoint=fake.url)
        listing = [r for r in fake.requests if r.startswith("/api/models?")]
    assert [r.repo_id for r in mlx] == [MLX_REPO["id"], MLX_8BIT["id"]]
    four = mlx[0]
    assert four.format == "MLX" and four.downloads == 900 and four.likes == 12 and four.updated == "2025-05-01"
    assert four.size_bytes == 1_000_000 * 2 + 500_000 * 4  # stored bytes per dtype
    assert four.params == 1_000_000 + 500_000 * 8  # 4-bit: eight parameters per packed U32 word
    assert mlx[1].params == 1_000_000 + 500_000 * 4  # "-8bit" in the name
    assert [(r.repo_id, r.format, r.params, r.architecture, r.size_bytes) for r in gguf] == [
        (GGUF_REPO["id"], "GGUF", 600_000_000, "qwen3", None)]  # a GGUF repo's size is per file
    assert {r.format for r in anything} == {"MLX", "GGUF", ""}
    assert files == [("Qwen3-0.6B-Q4_K_M.gguf", 397_000_000), ("Qwen3-0.6B-Q8_0.gguf", 639_000_000)]
    assert "filter=mlx" in listing[0] and "sort=downloads" in listing[0] and "expand=safetensors" in listing[0]
    assert "filter" not in listing[2]


def test_search_errors_are_one_line(online, monkeypatch):  # noqa: F811
    with pytest.raises(TandemError, match="offline: cannot reach 127.0.0.1:9"):
        hub_search.search("qwen", endpoint="http://127.0.0.1:9")
    with fake_hub() as fake:
        with pytest.raises(TandemError, match="listing the files of 'org/absent' failed: not found"):
            hub_search.gguf_files("org/absent", endpoint=fake.url)
    with pytest.raises(TandemError, match="unknown format"):
        hub_search.search("qwen", "ONNX")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TandemError, match=r"offline \(HF_HUB_OFFLINE is set\): searching"):
        hub_search.search("qwen")


def test_fits_counts_what_the_engine_holds():
    # CPU: dense float32 whatever the file; Metal: as stored, but a GGUF becomes dense float16
    assert hub.memory_needed(400, 1000, "GGUF", dense=True) == 4000
    assert hub.memory_needed(400, 1000, "GGUF", dense=False) == 2000
    assert hub.memory_needed(600, 1000, "MLX", dense=False) == 600
    assert hub.memory_needed(600, None, "MLX", dense=True) == 600  # unknown parameter count: size on disk
    e = hub.assess(hub.ModelEntry("x", "Ollama", size_bytes=4 * GB, params=8 * GB // 1, format="GGUF"), 16 * GB, False)
    assert e.needed_bytes == 16 * GB and e.fits is False
    assert hub.assess(e, 64 * GB, False).fits is True


# -- LM Studio and Ollama ----------------------------------------------------------------------------------
def _params(weights: dict) -> int:
    return sum(int(np.prod(w.shape)) for w in weights.values())


def ollama_blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def ollama_manifest(root: Path, name: str, layers: list[dict]) -> None:
    """``name`` = registry/namespace/model/tag, as ollama writes it."""
    path = root / "manifests" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64, "size": 2}
    path.write_text(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                                "config": config, "layers": layers}))


def build_stores(home: Path) -> dict:
    """Both apps' stores in their real layouts; returns the weights each tiny GGUF encodes."""
    lms = home / ".lmstudio" / "models"
    qwen = lms / "lmstudio-community" / "Tiny-Qwen2-GGUF"
    qwen.mkdir(parents=True)
    weights = {"qwen2": write_tiny_gguf(qwen / "Tiny-Qwen2-Q8_0.gguf", "qwen2")}
    (qwen / "mmproj-Tiny-F16.gguf").write_bytes(b"GGUF")  # a vision projector, not a model
    split = lms / "someone" / "Big-GGUF"
    split.mkdir(parents=True)
    for part in (1, 2):
        (split / f"Big-Q4_K_M-0000{part}-of-00002.gguf").write_bytes(b"GGUF" + b"\0" * 16)
    mlx = lms / "mlx-community" / "Tiny-bf16"
    mlx.mkdir(parents=True)
    (mlx / "config.json").write_text(json.dumps({"model_type": "llama"}))
    from safetensors.numpy import save_file

    save_file({"model.embed_tokens.weight": np.zeros((32, 8), np.float16)}, str(mlx / "model.safetensors"))
    legacy = home / ".cache" / "lm-studio" / "models" / "old" / "Gemma-GGUF"
    legacy.mkdir(parents=True)
    write_tiny_gguf(legacy / "gemma.gguf", "llama", arch_name="gemma3")

    root = home / ".ollama" / "models"
    path = home / "llama.gguf"
    weights["llama"] = write_tiny_gguf(path, "llama")
    data = path.read_bytes()
    path.unlink()
    digest = ollama_blob(root, data)
    template = ollama_blob(root, b"{{ .Prompt }}")
    model_layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": len(data)}
    ollama_manifest(root, "registry.ollama.ai/library/tinyllama/latest",
                    [model_layer, {"mediaType": "application/vnd.ollama.image.template", "digest": template,
                                   "size": 13}])
    ollama_manifest(root, "registry.ollama.ai/someone/tiny/q8", [model_layer])
    ollama_manifest(root, "hf.co/org/repo/Q4_K_M", [model_layer])
    ollama_manifest(root, "registry.ollama.ai/library/safetensors-model/latest",  # no GGUF layer: not listed
                    [{"mediaType": "application/vnd.ollama.image.tensor; name=w; dtype=BF16; shape=2",
                      "digest": template, "size": 13}])
    ollama_manifest(root, "registry.ollama.ai/library/gone/latest",  # its blob was deleted: not listed
                    [dict(model_layer, digest="sha256:" + "f" * 64)])
    return weights


def test_lmstudio_and_ollama_stores_in_their_real_layouts(tmp_path, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    weights = build_stores(tmp_path)
    entries = {e.name: e for e in hub.store_entries(memory=64 * GB, dense=True, home=tmp_path)}
    assert set(entries) == {
        "lmstudio-community/Tiny-Qwen2-GGUF/Tiny-Qwen2-Q8_0.gguf", "mlx-community/Tiny-bf16",
        "someone/Big-GGUF/Big-Q4_K_M-00001-of-00002.gguf", "old/Gemma-GGUF/gemma.gguf",
        "tinyllama:latest", "someone/tiny:q8", "hf.co/org/repo:Q4_K_M"}
    qwen = entries["lmstudio-community/Tiny-Qwen2-GGUF/Tiny-Qwen2-Q8_0.gguf"]
    assert (qwen.source, qwen.format, qwen.architecture, qwen.problem) == ("LM Studio", "GGUF", "qwen2", "")
    assert qwen.params == _params(weights["qwen2"]) and qwen.needed_bytes == 4 * qwen.params  # CPU: float32
    assert qwen.load_spec == qwen.path and qwen.path.endswith("Tiny-Qwen2-Q8_0.gguf")
    assert entries["mlx-community/Tiny-bf16"].format == "MLX" and entries["mlx-community/Tiny-bf16"].params == 256
    assert "split GGUF" in entries["someone/Big-GGUF/Big-Q4_K_M-00001-of-00002.gguf"].problem
    assert "architecture 'gemma3' is not supported" in entries["old/Gemma-GGUF/gemma.gguf"].problem
    llama = entries["tinyllama:latest"]
    assert (llama.source, llama.format, llama.architecture, llama.problem) == ("Ollama", "GGUF", "llama", "")
    assert Path(llama.path).name.startswith("sha256-") and llama.params == _params(weights["llama"])

    link = local_stores.link_for_loading(llama.name, Path(llama.path), tmp_path / "tandem")
    assert link.name == "tinyllama-latest.gguf" and link.resolve() == Path(llama.path).resolve()
    assert local_stores.link_for_loading(llama.name, Path(llama.path), tmp_path / "tandem") == link  # reused
    assert local_stores.link_for_loading(qwen.name, Path(qwen.path), tmp_path / "tandem") == Path(qwen.path)


def test_ollama_models_env_and_missing_stores(tmp_path, monkeypatch):
    assert hub.store_entries(home=tmp_path) == []  # neither app installed
    build_stores(tmp_path / "elsewhere")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "elsewhere" / ".ollama" / "models"))
    names = [e.name for e in hub.store_entries(home=tmp_path)]
    assert names == ["hf.co/org/repo:Q4_K_M", "someone/tiny:q8", "tinyllama:latest"]


def test_gguf_header_reader_matches_the_gguf_library(tmp_path):
    from gguf import GGUFReader

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    info = local_stores.gguf_info(path)
    reader = GGUFReader(path)
    assert info.architecture == reader.fields["general.architecture"].contents() == "qwen2"
    assert info.params == sum(int(t.n_elements) for t in reader.tensors)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    assert local_stores.gguf_info(tmp_path / "junk.gguf") is None
    assert local_stores.gguf_info(tmp_path / "absent.gguf") is None


def demo_hub() -> FakeHub:
    """A fake Hub with a few realistic search results (tests/app_screens.py --demo-hub)."""
    big = dict(MLX_REPO, id="mlx-community/Qwen3-30B-A3B-4bit", downloads=48_211, likes=140,
               safetensors={"parameters": {"BF16": 300_000_000, "U32": 3_800_000_000}, "total": 4_100_000_000})
    mid = dict(MLX_REPO, id="mlx-community/Qwen3-4B-8bit", downloads=20_113, likes=31,
               safetensors={"parameters": {"BF16": 400_000_000, "U32": 1_000_000_000}, "total": 1_400_000_000})
    return FakeHub({}, models=[big, mid, dict(MLX_REPO, downloads=35_002), dict(GGUF_REPO, downloads=61_920), OTHER],
                   repo_files={GGUF_REPO["id"]: GGUF_FILES})


def test_a_cached_gguf_repo_lists_one_row_per_file(tmp_path):
    from tests.test_app_hub import add_repo

    gguf = tmp_path / "q.gguf"
    weights = write_tiny_gguf(gguf, "qwen2")
    add_repo(tmp_path / "hub", "org/Tiny-GGUF", {"Tiny-Q8_0.gguf": gguf.read_bytes(), "mmproj-F16.gguf": b"GGUF",
                                                  "config.json": b"{}", "README.md": b"# tiny"})
    entries, _ = hub.scan_cache(str(tmp_path / "hub"), memory=64 * GB, dense=False)
    assert [(e.name, e.key, e.format, e.architecture, e.problem) for e in entries] == [
        ("org/Tiny-GGUF", "org/Tiny-GGUF/Tiny-Q8_0.gguf", "GGUF", "qwen2", "")]
    row = entries[0]
    assert row.load_spec.endswith("Tiny-Q8_0.gguf") and row.params == _params(weights)
    assert row.needed_bytes == 2 * row.params  # Metal: the engine converts a GGUF to dense float16
