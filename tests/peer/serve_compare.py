"""Tandem's server and mlx-dspark's side by side: the same few chat and code requests sent all at
once and one after another, to each engine's server with ``--max-batch 4`` and ``--max-batch 1``
(issue 42: Tandem's batching beside the peer's own).

    PYTHONPATH=$PWD .venv/bin/python tests/peer/serve_compare.py [--trials 3] [--max-tokens 128]

An arm is one server process: an engine (``tandem serve`` or ``mlx-dspark serve``), a mode
(``baseline``; ``auto``, which with the shipped drafter is DSpark on both) and a ``--max-batch``.
Both load the float32 mlx-lm folder of the starter that ``compare.py`` converts, the peer its
drafter unquantized (``--drafter-bits 0``, as Tandem on a CPU); both run without their prefix
caches (the same prompts come again every trial) and Tandem without drafts from earlier requests
(``--no-suffix-drafts``: lookup would otherwise find each answer in the trial before), its
speculating arms with ``--lookup-first`` (the starter's registry default, which a converted
folder does not match). The peer
preloads OpenBLAS as Tandem does and runs without Tandem's skinny matmuls unless ``--peer-skinny``.
Before timing, Tandem's calibration of the pair is made (cached, as ``compare.py`` does).

All servers are up at once and every trial runs each arm's two passes (``concurrent``: the
requests from one thread each at the same moment; ``sequential``: one after another) in a rotated
order, so a busy machine slows every arm alike (``--one-by-one``: one server at a time, less
memory). Reported per arm: aggregate tok/s (the replies' ``usage.completion_tokens`` over the wall
seconds from the first request to the last reply, median over trials; tokens past ``max_tokens``,
which the peer's DSpark can commit, not counted), concurrent / sequential and Tandem / peer
concurrent (medians of per-trial ratios), median latency, and whether the answers equal the same
server's first sequential ones and the engine's baseline (greedy: they should; a mismatch is
reported, not fatal). Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import DRAFTER, PEER_PYTHON, ROOT, model_folder, peer_env, prompts  # noqa: E402

ENGINES = ("peer", "tandem")
PASSES = ("concurrent", "sequential")
# The peer's CLI in a process that preloads OpenBLAS first, as Tandem's does (``import engine``).
PEER_MAIN = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import engine; "
             "from mlx_dspark.cli import main; sys.exit(main(sys.argv[1:]))")


@dataclass
class ArmSpec:
    engine: str
    mode: str
    max_batch: int

    @property
    def name(self) -> str:
        return f"{self.engine} {self.mode} b{self.max_batch}"


@dataclass
class Reply:
    tokens: int  # usage.completion_tokens, at most max_tokens (see chat)
    reported_tokens: int  # as the server said
    latency_s: float
    text: str
    x: dict  # from the server's own note on the request (x_tandem, x_mlx_dspark): mode, batch width


@dataclass
class Pass:
    wall_s: float
    replies: list[Reply]

    @property
    def tok_s(self) -> float:
        return sum(r.tokens for r in self.replies) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Server:
    spec: ArmSpec
    proc: subprocess.Popen
    url: str
    log: Path
    model: str = ""
    mode: str = ""  # the mode its /health names (the peer resolves auto there; Tandem per request)
    passes: dict[str, list[Pass]] = field(default_factory=lambda: {p: [] for p in PASSES})

    def alive(self) -> bool:
        return self.proc.poll() is None


# ------------------------------------------------------------------ server processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # Linux: a server ends when this script is killed outright
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def server_command(spec: ArmSpec, folder: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict]:
    """The command line and environment of one arm's server."""
    speculates = spec.mode != "baseline"
    if spec.engine == "peer":
        cmd = [args.peer_python, "-c", PEER_MAIN, str(ROOT), "serve", "--model", str(folder), "--mode", spec.mode,
               "--max-batch", str(spec.max_batch), "--host", "127.0.0.1", "--port", str(port), "--no-prefix-cache"]
        if speculates:
            cmd += ["--drafter", str(DRAFTER), "--drafter-bits", "0"]
        env = peer_env(args.peer_skinny, args.peer_path)
    else:
        cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", str(folder), "--mode", spec.mode,
               "--max-batch", str(spec.max_batch), "--host", "127.0.0.1", "--port", str(port), "--no-prefix-cache",
               "--no-suffix-drafts"]
        if speculates:  # the folder is not the registry's starter row: its lookup-first default, said
            cmd += ["--drafter", str(DRAFTER), "--lookup-first"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if args.tandem_no_skinny:
            env["TANDEM_NO_SKINNY"] = "1"
    if speculates and args.max_draft:
        cmd += ["--max-draft", args.max_draft]
    return cmd, env


def start(spec: ArmSpec, folder: Path, args: argparse.Namespace, logs: Path) -> Server:
    port = free_port()
    cmd, env = server_command(spec, folder, port, args)
    log = logs / (spec.name.replace(" ", "-") + ".log")
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        out.write(" ".join(cmd) + "\n\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,  # Ctrl-C reaches us only
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    return Server(spec, proc, f"http://127.0.0.1:{port}", log)


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def wait_ready(server: Server, timeout_s: float) -> None:
    """Until /health says ok (Tandem answers 503 while loading, the peer listens once loaded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.spec.name}: the server exited ({server.proc.returncode}) while starting")
        try:
            status, body = get_json(server.url + "/health")
            if status == 200 and body.get("status") == "ok":
                server.mode = str(body.get("mode", ""))
                _, models = get_json(server.url + "/v1/models")
                server.model = models["data"][0]["id"]
                return
        except (OSError, ValueError, KeyError, IndexError):
            pass  # not listening yet
        time.sleep(0.5)
    raise RuntimeError(f"{server.spec.name}: not ready after {timeout_s:.0f} s")


def stop(server: Server, grace_s: float = 20.0) -> None:
    if server.alive():
        server.proc.terminate()
        try:
            server.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def log_tail(server: Server, lines: int = 30) -> str:
    try:
        text = server.log.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text[-lines:])


# ------------------------------------------------------------------ requests
def chat(server: Server, text: str, max_tokens: int, timeout_s: float) -> Reply:
    body = {"model": server.model, "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": max_tokens, "stream": False}
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{server.spec.name}: HTTP {e.code}: {e.read()[:300]!r}") from None
    latency = time.perf_counter() - t0
    x = out.get("x_tandem") or out.get("x_mlx_dspark") or {}  # each engine's note on the request
    # The peer's DSpark commits a round's accepted draft whole, past max_tokens: those tokens
    # were not asked for, and every engine is credited the same budget.
    reported = int(out["usage"]["completion_tokens"])
    return Reply(min(reported, max_tokens), reported, latency, out["choices"][0]["message"]["content"] or "",
                 {k: x[k] for k in ("mode", "cap", "batch_width", "accept_per_round") if k in x})


def run_pass(server: Server, texts: list[str], max_tokens: int, concurrent: bool, timeout_s: float) -> Pass:
    """The requests all at once (one thread each, released together) or one after another."""
    if not concurrent:
        t0 = time.perf_counter()
        replies = [chat(server, t, max_tokens, timeout_s) for t in texts]
        return Pass(time.perf_counter() - t0, replies)
    replies: list[Reply | None] = [None] * len(texts)
    errors: list[BaseException] = []
    gate = threading.Barrier(len(texts) + 1)

    def one(i: int) -> None:
        gate.wait()
        try:
            replies[i] = chat(server, texts[i], max_tokens, timeout_s)
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(texts))]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return Pass(wall, replies)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the run
def calibrate(folder: Path, modes: set[str], logs: Path) -> None:
    """Tandem's calibration of the pair, made once and cached, so its servers start from it."""
    for mode in sorted(modes - {"baseline"}):
        print(f"calibrating tandem {mode} (cached after the first time) ...", file=sys.stderr, flush=True)
        with open(logs / f"calibrate-{mode}.log", "w") as out:
            rc = subprocess.call([sys.executable, "-m", "engine.cli", "calibrate", "--model", str(folder),
                                  "--drafter", str(DRAFTER), "--mode", mode], cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=subprocess.STDOUT)
        if rc:
            raise RuntimeError(f"tandem calibrate --mode {mode} failed ({rc}); see {logs}/calibrate-{mode}.log")


def run_group(specs: list[ArmSpec], folder: Path, texts: list[str], args: argparse.Namespace, logs: Path,
              done: list[Server]) -> None:
    """Start these arms' servers, run every trial of their passes interleaved, stop them."""
    from engine.benchmark import arm_order

    servers: list[Server] = []
    try:
        for spec in specs:  # one at a time: loads and calibration probes must not overlap
            print(f"starting {spec.name} ...", file=sys.stderr, flush=True)
            server = start(spec, folder, args, logs)
            servers.append(server)
            started = time.perf_counter()
            wait_ready(server, args.start_timeout)
            run_pass(server, texts, min(8, args.max_tokens), True, args.request_timeout)  # warm-up
            print(f"  ready in {time.perf_counter() - started:.0f} s (log {server.log})", file=sys.stderr)
        units = [(s, p) for s in servers for p in PASSES]
        for trial in range(args.trials):
            for server, name in (units[i] for i in arm_order(len(units), trial, 0, 1)):
                result = run_pass(server, texts, args.max_tokens, name == "concurrent", args.request_timeout)
                server.passes[name].append(result)
                print(f"  trial {trial + 1}/{args.trials} {server.spec.name} {name}: {result.tok_s:.1f} tok/s",
                      file=sys.stderr, flush=True)
        done.extend(servers)
    except Exception:
        for server in servers:
            if not server.alive() or server is servers[-1]:
                print(f"--- {server.spec.name} ({server.log}), last lines:\n{log_tail(server)}", file=sys.stderr)
        raise
    finally:
        for server in servers:
            stop(server)


# ------------------------------------------------------------------ the report
def texts_of(p: Pass) -> list[str]:
    return [r.text for r in p.replies]


def same_text(a: str, b: str) -> bool:
    """Equal, or one stopped earlier (the peer's answers may run past max_tokens)."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def mismatches(reference: list[str], passes: list[Pass]) -> int:
    return sum(not same_text(a, b) for p in passes for a, b in zip(reference, texts_of(p)))


def summarize(servers: list[Server], n_requests: int) -> list[dict]:
    by = {(s.spec.engine, s.spec.mode, s.spec.max_batch): s for s in servers}
    rows = []
    for s in servers:
        conc, seq = s.passes["concurrent"], s.passes["sequential"]
        reference = texts_of(seq[0])
        base = by.get((s.spec.engine, "baseline", 1)) or by.get((s.spec.engine, "baseline", s.spec.max_batch))
        peer = by.get(("peer", s.spec.mode, s.spec.max_batch)) if s.spec.engine == "tandem" else None
        row = {
            "arm": s.spec.name, "engine": s.spec.engine, "mode": s.spec.mode, "max_batch": s.spec.max_batch,
            "ran": sorted({r.x.get("mode", "") for p in conc + seq for r in p.replies} - {""}) or [s.mode],
            "concurrent_tok_s": [p.tok_s for p in conc], "sequential_tok_s": [p.tok_s for p in seq],
            "concurrent_latency_s": [[r.latency_s for r in p.replies] for p in conc],
            "sequential_latency_s": [[r.latency_s for r in p.replies] for p in seq],
            "completion_tokens": [r.reported_tokens for r in conc[0].replies],
            "batch_width": [r.x.get("batch_width") for r in conc[-1].replies],
            "concurrent_vs_sequential": statistics.median(c.tok_s / q.tok_s for c, q in zip(conc, seq) if q.tok_s),
            "concurrent_mismatches": mismatches(reference, conc),
            "sequential_mismatches": mismatches(reference, seq[1:]),
            "answers_checked": n_requests * (len(conc) + len(seq) - 1),
            "baseline_mismatches": None if base is None else mismatches(texts_of(base.passes["sequential"][0]),
                                                                          seq[:1]),
            "vs_peer_concurrent": None if peer is None else statistics.median(
                a.tok_s / b.tok_s for a, b in zip(conc, peer.passes["concurrent"]) if b.tok_s),
            "answers": reference,
        }
        rows.append(row)
    return rows


def print_table(rows: list[dict], n_requests: int) -> None:
    def same(n: int | None, of: int) -> str:
        return "-" if n is None else "yes" if n == 0 else f"NO {n}/{of}"

    print(f"\n{'arm':<22}{'ran':<10}{'conc tok/s':>11}{'seq tok/s':>10}{'conc/seq':>9}{'vs peer':>8}"
          f"{'p50 lat s':>10}  {'conc = seq':<11}{'= baseline':<10}")
    for r in rows:
        lat = statistics.median(x for p in r["concurrent_latency_s"] for x in p)
        vs = "" if r["vs_peer_concurrent"] is None else f"{r['vs_peer_concurrent']:.2f}"
        print(f"{r['arm']:<22}{','.join(r['ran']) or '-':<10}{statistics.median(r['concurrent_tok_s']):11.1f}"
              f"{statistics.median(r['sequential_tok_s']):10.1f}{r['concurrent_vs_sequential']:9.2f}{vs:>8}"
              f"{lat:10.2f}  {same(r['concurrent_mismatches'] + r['sequential_mismatches'], r['answers_checked']):<11}"
              f"{same(r['baseline_mismatches'], n_requests):<10}")
    peers = [r for r in rows if r["engine"] == "peer" and r["max_batch"] > 1]
    ours = [r for r in rows if r["engine"] == "tandem" and r["max_batch"] > 1]
    if peers and ours:
        best_peer = max(peers, key=lambda r: statistics.median(r["concurrent_tok_s"]))
        best_ours = max(ours, key=lambda r: statistics.median(r["concurrent_tok_s"]))
        ratio = statistics.median(best_ours["concurrent_tok_s"]) / statistics.median(best_peer["concurrent_tok_s"])
        print(f"\nTandem's best batched arm ({best_ours['arm']}) / the peer's best ({best_peer['arm']}), "
              f"concurrent: {ratio:.2f}x (issue 42's target: >= 2x)")
    print("tok/s: completion tokens (at most max_tokens each) / wall seconds of the pass, median over trials; "
          "conc/seq and vs peer (the peer arm of the same mode and --max-batch): medians of per-trial ratios; "
          "p50 lat: median request latency at once; conc = seq: every answer equals the server's first "
          "sequential answer; = baseline: the first sequential answers equal the engine's baseline server's "
          "(b1 where run)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--classes", default="chat,code", help="prompt classes (compare.py's prompts)")
    p.add_argument("--per-class", type=int, default=2, help="requests per class (default: 2 chat + 2 code)")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--modes", default="baseline,auto", help="server --mode per arm (both engines take "
                                                            "baseline, auto, lookup, dspark)")
    p.add_argument("--max-batch", default="4,1", help="server --max-batch per arm")
    p.add_argument("--max-draft", default=None, help="--max-draft for the speculating arms of both engines "
                                                     "(default: each engine's own)")
    p.add_argument("--one-by-one", action="store_true", help="one server at a time (less memory; arms no "
                                                             "longer interleaved)")
    p.add_argument("--no-calibrate", action="store_true", help="do not make Tandem's calibration first")
    p.add_argument("--peer-python", default=None,
                   help=f"the peer's python (default {PEER_PYTHON} where it exists, else this one)")
    p.add_argument("--peer-path", default=None, help="PYTHONPATH for the peer (packages installed with --target)")
    p.add_argument("--peer-skinny", action="store_true", help="lend Tandem's skinny matmuls to the peer as well")
    p.add_argument("--tandem-no-skinny", action="store_true",
                   help="Tandem without its skinny matmuls too (TANDEM_NO_SKINNY=1; on a machine other work keeps "
                        "busy, their threads can cost more than they save)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to be ready")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--logs", default=None, help="folder for the servers' logs (default: a new temporary one)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    args.peer_python = args.peer_python or (PEER_PYTHON if Path(PEER_PYTHON).exists() else sys.executable)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    engines, modes = split(args.engines), split(args.modes)
    batches = [int(b) for b in split(args.max_batch)]
    if bad := [e for e in engines if e not in ENGINES]:
        p.error(f"unknown engine {bad[0]}: choose from {', '.join(ENGINES)}")
    if args.trials < 1 or args.max_tokens < 1 or min(batches, default=0) < 1:
        p.error("--trials, --max-tokens and --max-batch must be at least 1")
    classes = split(args.classes)
    texts = [text for cls, text in prompts(args.per_class) if cls in classes]
    if not texts:
        p.error(f"no prompts of class {args.classes}")
    if "peer" in engines and subprocess.call([args.peer_python, "-c", "import mlx_dspark"], env=peer_env(
            False, args.peer_path), stderr=subprocess.DEVNULL):
        p.error(f"{args.peer_python} cannot import mlx_dspark: pass --peer-python (or --peer-path)")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="serve-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the finally blocks: servers stop

    folder = model_folder()
    specs = [ArmSpec(e, m, b) for e in engines for m in modes for b in batches]
    print(f"model {folder} | {len(texts)} requests ({args.classes}) x {args.trials} trials, max_tokens "
          f"{args.max_tokens}, temperature 0 | peer python {args.peer_python} | logs {logs}", file=sys.stderr)
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print(f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: absolute figures are "
              "noisy, ratios less so", file=sys.stderr)
    servers: list[Server] = []
    try:
        if "tandem" in engines and not args.no_calibrate:
            calibrate(folder, set(modes), logs)
        for group in ([[s] for s in specs] if args.one_by_one else [specs]):
            run_group(group, folder, texts, args, logs, servers)
    except RuntimeError as e:  # a server that would not start or answer (its log's tail is above), a calibration
        print(f"serve_compare: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"serve_compare: interrupted; the servers are stopped (logs {logs})", file=sys.stderr)
        return 130
    rows = summarize(servers, len(texts))
    print(f"\nmodel {folder}: {len(texts)} requests ({args.classes}), max_tokens {args.max_tokens}, greedy, "
          f"{args.trials} trials{', one server at a time' if args.one_by_one else ', arms interleaved'}")
    print_table(rows, len(texts))
    if args.json:
        report = {"model": str(folder), "drafter": str(DRAFTER), "prompts": texts, "max_tokens": args.max_tokens,
                  "trials": args.trials, "one_by_one": args.one_by_one, "max_draft": args.max_draft,
                  "peer_skinny": args.peer_skinny, "tandem_skinny": not args.tandem_no_skinny,
                  "load_average": os.getloadavg()[0], "arms": rows}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
