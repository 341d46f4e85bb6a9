"""The model manager's data side (app.hub) on a hand-built HF cache and a local fake Hub: no network."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from app import hub
from engine.errors import TandemError

TARGET = "org/tiny-target"
DRAFTER = "org/tiny-dspark"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def _blob(repo: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs" / digest).write_bytes(data)
    return digest


def add_repo(cache: Path, repo_id: str, files: dict[str, bytes], commit: str | None = None,
             ref: str | None = "main", kind: str = "models") -> Path:
    """One revision of a repo in the layout scan_cache_dir reads (platform.md §5): blobs, refs,
    snapshots/<commit>/<file> -> ../../blobs/<hash> (relative symlinks)."""
    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()  # commits are unique across repos
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        digest = _blob(repo, data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (len(Path(name).parts) + 1)) / "blobs" / digest)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo


def build_cache(root: Path) -> Path:
    cache = root / "hub"
    weights = b"\x00" * 300_000
    add_repo(cache, TARGET, {"config.json": json.dumps({"model_type": "llama", "hidden_size": 64}).encode(),
                             "model.safetensors": weights}, commit=COMMIT_A)
    add_repo(cache, TARGET, {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights},
             commit=COMMIT_B, ref=None)  # an old detached revision sharing the weights blob
    add_repo(cache, DRAFTER, {"config.json": json.dumps({"model_type": "qwen3", "block_size": 16,
                                                         "dflash_config": {"target_layer_ids": [1, 2]}}).encode(),
                              "model.safetensors": b"\x01" * 50_000})
    add_repo(cache, "org/prompts", {"data.jsonl": b"{}\n"}, kind="datasets")
    (cache / "not-a-repo").mkdir()  # junk: a scan warning, never an exception
    return cache


def test_lists_a_hand_built_cache(tmp_path):
    cache = build_cache(tmp_path)
    entries, warnings = hub.scan_cache(str(cache), memory=16 * 2**30)
    by_name = {e.name: e for e in entries}
    assert set(by_name) == {TARGET, DRAFTER}  # the dataset is skipped
    assert by_name[TARGET].kind == "target" and by_name[DRAFTER].kind == "drafter"
    assert by_name[TARGET].size_bytes >= 300_000 and by_name[TARGET].fits is True
    assert len(by_name[TARGET].revisions) == 2 and by_name[TARGET].complete
    assert by_name[TARGET].path.endswith(COMMIT_A)
    assert warnings and "not-a-repo" in warnings[0]
    small, _ = hub.scan_cache(str(cache), memory=100_000)
    assert {e.name: e.fits for e in small}[TARGET] is False


def test_lists_builtins_first(tmp_path):
    entries, _ = hub.list_models(str(build_cache(tmp_path)), memory=16 * 2**30)
    sources = [e.source for e in entries]
    assert sources[-2:] == ["hf-cache", "hf-cache"]
    assert any(e.source == "built-in" and e.name == "smollm2-135m" for e in entries)


def test_registry_pairs_come_from_the_worker_rows(tmp_path):
    rows = [{"target": "Qwen/Qwen3-4B", "mode": "dspark", "drafter": "deepseek-ai/dspark_qwen3_4b_block7"},
            {"target": "org/tiny-target", "mode": "dflash", "drafter": DRAFTER},
            {"target": "google/gemma-x", "mode": "dspark", "drafter": "x/y", "supported": False}]
    assert hub.registry_pair("mlx-community/Qwen3-4B-4bit", rows) == "deepseek-ai/dspark_qwen3_4b_block7"
    assert hub.registry_pair("deepseek-ai/dspark_qwen3_4b_block7", rows) == "Qwen/Qwen3-4B"
    assert hub.registry_pair("google/gemma-x", rows) is None and hub.registry_pair("org/other", rows) is None
    assert hub.registry_pair("Qwen/Qwen3-4B", None) is None  # rows not read yet
    by_name = {e.name: e for e in hub.scan_cache(str(build_cache(tmp_path)), rows=rows)[0]}
    assert by_name[TARGET].pair == DRAFTER and by_name[DRAFTER].pair == TARGET


def test_missing_cache_is_empty(tmp_path):
    assert hub.scan_cache(str(tmp_path / "nope")) == ([], [])


def test_evict_deletes_every_revision(tmp_path):
    cache = build_cache(tmp_path)
    assert hub.eviction_size(TARGET, str(cache)).endswith("K")  # '300.1K'-style, from huggingface_hub
    freed = hub.evict(TARGET, str(cache))
    assert freed >= 300_000
    assert not (cache / "models--org--tiny-target").exists()
    assert [e.name for e in hub.scan_cache(str(cache))[0]] == [DRAFTER]
    with pytest.raises(TandemError, match="not in the Hugging Face cache"):
        hub.evict(TARGET, str(cache))


def test_evict_refuses_the_loaded_model(tmp_path):
    cache = build_cache(tmp_path)
    snapshot = cache / "models--org--tiny-target" / "snapshots" / COMMIT_A
    for loaded in ([TARGET], [str(snapshot)], ["SmolLM2", str(snapshot / "model.safetensors")]):
        with pytest.raises(TandemError, match="loaded right now"):
            hub.evict(TARGET, str(cache), loaded=loaded)
    assert snapshot.exists()
    hub.evict(DRAFTER, str(cache), loaded=[TARGET, str(snapshot)])  # another repo is fine


def test_download_offline_is_a_clear_error_not_a_hang(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t = time.perf_counter()
    with pytest.raises(TandemError, match="offline .*'org/absent' is not in the local cache"):
        hub.download("org/absent", lambda *a: None, threading.Event(), cache_dir=str(tmp_path))
    assert time.perf_counter() - t < 5
    # offline but cached: the snapshot path, at once
    cache = build_cache(tmp_path)
    assert hub.download(TARGET, lambda *a: None, threading.Event(), cache_dir=str(cache)).endswith(COMMIT_A)


def test_download_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    t = time.perf_counter()
    with pytest.raises(TandemError, match="offline: cannot reach 127.0.0.1:9"):
        hub.download("org/absent", lambda *a: None, threading.Event(), cache_dir=str(tmp_path),
                     endpoint="http://127.0.0.1:9")
    assert time.perf_counter() - t < 5


def test_download_rejects_bad_repo_ids(tmp_path):
    for bad in ("", "justaname", "a/b/c", "org/has space"):
        with pytest.raises(TandemError, match="not a Hugging Face repo id"):
            hub.download(bad, lambda *a: None, threading.Event(), cache_dir=str(tmp_path))


# -- a local fake Hub (the routes snapshot_download uses in huggingface_hub 2.x) ----------------------
FAKE_COMMIT = "c" * 40


class FakeHub:
    """Serves the download routes, and the search routes from ``models`` (what /api/models lists)
    and ``repo_files`` (what /api/models/<repo>?blobs=true lists, with sizes). Records every
    request line, so a test sees which ones arrived through a proxy (absolute-form URLs)."""

    def __init__(self, files: dict[str, bytes], delay: float = 0.0, models: list[dict] | None = None,
                 repo_files: dict[str, dict[str, int]] | None = None, hold: threading.Event | None = None):
        self.files = files
        self.delay = delay
        self.hold = hold  # set: a body longer than one chunk pauses after its first chunk until it is set
        self.models = models or []
        self.repo_files = repo_files or {}
        self.requests: list[str] = []
        hubself = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body=b"", headers=None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    chunk = 64 * 1024
                    for i in range(0, len(body), chunk):
                        if i and hubself.hold is not None:
                            hubself.hold.wait(30)
                        self.wfile.write(body[i:i + chunk])
                        if hubself.delay:
                            time.sleep(hubself.delay)

            def _json(self, obj):
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _route(self, head=False):
                hubself.requests.append(self.path)
                url = urlsplit(self.path)  # a proxied request carries the whole URL
                path, query = url.path, parse_qs(url.query)
                parts = path.strip("/").split("/")
                if parts == ["api", "models"]:
                    return self._json(hubself.search(query))
                if parts[:2] == ["api", "models"] and "/".join(parts[2:]) in hubself.repo_files:
                    sizes = hubself.repo_files["/".join(parts[2:])]
                    return self._json({"id": "/".join(parts[2:]), "sha": FAKE_COMMIT,
                                       "siblings": [{"rfilename": f, "size": n} for f, n in sizes.items()]})
                if parts[:2] == ["api", "models"] and "revision" in parts:
                    repo = "/".join(parts[2:parts.index("revision")])
                    return self._json({"id": repo, "sha": FAKE_COMMIT,
                                       "siblings": [{"rfilename": f} for f in hubself.files]})
                if parts[:2] == ["api", "models"] and "tree" in parts:
                    return self._json([{"type": "file", "path": f, "size": len(d),
                                        "oid": hashlib.sha1(d).hexdigest()} for f, d in hubself.files.items()])
                if "resolve" in parts:
                    name = "/".join(parts[parts.index("resolve") + 2:])
                    if name not in hubself.files:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    data = hubself.files[name]
                    etag = hashlib.sha256(data).hexdigest()
                    return self._send(200, data, {"X-Repo-Commit": FAKE_COMMIT, "ETag": f'"{etag}"',
                                                  "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))},
                                      head)
                return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)

            def do_GET(self):
                self._route()

            def do_HEAD(self):
                self._route(head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def search(self, query: dict) -> list[dict]:
        """/api/models: ``search`` is a substring of the id, ``filter`` a tag, ``limit`` caps."""
        text = (query.get("search") or [""])[0].lower()
        tags = query.get("filter") or []
        found = [m for m in self.models if text in m["id"].lower() and all(t in m.get("tags", []) for t in tags)]
        return found[: int((query.get("limit") or [len(found)])[0])]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def online(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


FILES = {"config.json": json.dumps({"model_type": "llama"}).encode(), "model.safetensors": b"\x07" * (3 * 2**20)}


def test_download_reports_progress_into_the_cache(tmp_path, online):
    seen = []
    with FakeHub(FILES) as fake:
        path = hub.download("org/fake", lambda *a: seen.append(a), threading.Event(), cache_dir=str(tmp_path),
                            endpoint=fake.url)
    assert Path(path, "model.safetensors").read_bytes() == FILES["model.safetensors"]
    byte_updates = [(done, total) for unit, done, total in seen if unit == "bytes"]
    assert byte_updates and byte_updates[-1][0] >= len(FILES["model.safetensors"])
    assert any(unit == "files" and done == total == 2 for unit, done, total in seen)
    entries, _ = hub.scan_cache(str(tmp_path))
    assert [(e.name, e.complete) for e in entries] == [("org/fake", True)]


def test_download_cancel_leaves_a_resumable_incomplete_snapshot(tmp_path, online):
    cancel = threading.Event()

    def on_progress(unit, done, total):
        if unit == "bytes" and done > 0:
            cancel.set()  # as if the user pressed Cancel once bytes flowed

    files = dict(FILES, **{"model-2.safetensors": b"\x09" * (3 * 2**20)})
    with FakeHub(files, delay=0.01) as fake:
        with pytest.raises(hub.DownloadCancelled):
            hub.download("org/fake", on_progress, cancel, cache_dir=str(tmp_path), endpoint=fake.url, max_workers=1)
        entries, _ = hub.scan_cache(str(tmp_path))
        assert [(e.name, e.complete) for e in entries] == [("org/fake", False)]
        path = hub.download("org/fake", lambda *a: None, threading.Event(), cache_dir=str(tmp_path),
                            endpoint=fake.url)  # resumes
    assert Path(path, "model-2.safetensors").read_bytes() == files["model-2.safetensors"]
    assert [(e.name, e.complete) for e in hub.scan_cache(str(tmp_path))[0]] == [("org/fake", True)]


# -- behind a proxy; no leaks ------------------------------------------------------------------------
@pytest.fixture
def proxied(monkeypatch):
    """HTTP(S)_PROXY as a user behind a proxy has it, with huggingface_hub's session re-made
    (it reads the environment once, when created)."""
    from huggingface_hub.utils import close_session

    def use(proxy: str) -> None:
        for var in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(var, raising=False)
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            monkeypatch.setenv(var, proxy)
        close_session()

    yield use
    monkeypatch.undo()
    close_session()


def test_download_goes_through_the_users_proxy(tmp_path, online, proxied):
    """The Hub's host does not resolve here; only the proxy can reach it. The reachability check
    used to open a direct TCP connection and called a proxied user offline."""
    with FakeHub(FILES) as proxy:  # the fake answers absolute-form (proxied) requests itself
        proxied(proxy.url)
        path = hub.download("org/fake", lambda *a: None, threading.Event(), cache_dir=str(tmp_path),
                            endpoint="http://hub.tandem-test.invalid")
        assert Path(path, "model.safetensors").read_bytes() == FILES["model.safetensors"]
        assert proxy.requests and all(r.startswith("http://hub.tandem-test.invalid/") for r in proxy.requests)


def test_unreachable_proxy_is_named_in_the_error(tmp_path, online, proxied):
    proxied("http://127.0.0.1:9")
    with pytest.raises(TandemError, match="offline: cannot reach hub.tandem-test.invalid:80 through the proxy"):
        hub.check_reachable("http://hub.tandem-test.invalid", timeout=2)


def test_downloads_leave_no_open_file(tmp_path, online):
    """Each download used to open os.devnull for its progress bars and never close it."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with FakeHub(FILES) as fake:
            for i in range(3):
                hub.download(f"org/fake{i}", lambda *a: None, threading.Event(), cache_dir=str(tmp_path),
                             endpoint=fake.url)
        gc.collect()
    leaks = [str(w.message) for w in caught
             if issubclass(w.category, ResourceWarning) and "unclosed file" in str(w.message)]
    assert leaks == []
