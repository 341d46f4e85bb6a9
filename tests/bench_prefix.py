"""Prefix cache figures on the real starter model (a benchmark, not a test: pytest does not collect it).

    PYTHONPATH=$PWD python tests/bench_prefix.py [chat|server|restart|all] [--reps 3] [--modes baseline,auto]

* chat: a 3-turn conversation over 2,000 tokens; TTFT of turns 2 and 3 with the earlier turns
  restored (warm) vs the same prompt prefilled from token 0 (cold), per mode; same tokens?
* server: ``tandem serve`` (a subprocess) and 10 agent-style requests sharing a 4,000-token system
  prompt; client-side TTFT of the first request vs the median of requests 2-10.
* restart: ``tandem serve --prefix-cache-dir``: one request, stop, start again, a new request;
  its TTFT vs a cold server's first request.

The machine may be shared: every figure is a median over ``--reps`` repetitions; ratios matter.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def corpus(n_words: int) -> str:
    """Plain English from the repository's own docstrings (self-contained, deterministic)."""
    import ast

    words: list[str] = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node):
                words += ast.get_docstring(node).split()
        if len(words) >= n_words:
            break
    return " ".join(words[:n_words])


# ----------------------------------------------------------------------------------------
# chat: 3 turns in the engine
# ----------------------------------------------------------------------------------------
def bench_chat(reps: int, modes: list[str]) -> dict:
    import engine.api as tandem
    from engine.benchmark import first_divergence, check_lossless

    eng = tandem.load()
    turns = [f"Here are my notes on a software project:\n\n{corpus(1000)}\n\nSummarise the main ideas in a few sentences.",
             "Which part sounds hardest to get right, and why?",
             "Write three short test ideas for that part."]
    out = {}
    for mode in modes:
        rows = []
        for rep in range(reps):
            eng.clear_prefix_cache()
            messages: list[dict] = []
            for t, text in enumerate(turns):
                messages.append({"role": "user", "content": text})
                ids = eng.encode(messages)
                warm = eng.generate(ids, mode=mode, max_new_tokens=128)
                cold = eng.generate(ids, mode=mode, max_new_tokens=128, prefix_cache=False)
                bad = check_lossless(eng, ids, cold.token_ids, warm.token_ids, mode)
                rows.append({"turn": t + 1, "prompt": len(ids), "cached": warm.cached_tokens, "warm": warm.ttft_s,
                             "cold": cold.ttft_s, "same": first_divergence(cold.token_ids, warm.token_ids) is None,
                             "divergence": bad, "resolved": warm.mode})
                messages.append({"role": "assistant", "content": warm.text})
            print(f"  {mode} rep {rep}: " + ", ".join(f"turn {r['turn']} {r['prompt']} tok {r['cached']} cached "
                                                    f"{r['warm']:.3f}s vs {r['cold']:.3f}s" for r in rows[-3:]), flush=True)
        summary = {}
        for t in (1, 2, 3):
            rs = [r for r in rows if r["turn"] == t]
            summary[f"turn{t}"] = {"prompt": rs[0]["prompt"], "cached": statistics.median(r["cached"] for r in rs),
                                   "warm_s": statistics.median(r["warm"] for r in rs),
                                   "cold_s": statistics.median(r["cold"] for r in rs),
                                   "ratio": statistics.median(r["warm"] / r["cold"] for r in rs),
                                   "same_tokens": all(r["same"] for r in rs),
                                   "divergences": [r["divergence"] for r in rs if r["divergence"]]}
        out[f"{mode} ({rows[0]['resolved']})"] = summary
    return out


# ----------------------------------------------------------------------------------------
# server: tandem serve as a subprocess
# ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags: str):
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(self.port), "--quiet",
                                      "--max-tokens", "32", *flags], env=env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not start")

    def ask(self, system: str, user: str) -> tuple[float, dict]:
        """Streamed chat completion: (client-side seconds to the first content chunk, final x_tandem)."""
        body = json.dumps({"model": "m", "stream": True, "max_tokens": 32, "stream_options": {"include_usage": True},
                           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        first = None
        tandem = {}
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
                tandem = chunk.get("x_tandem") or tandem
        return (first if first is not None else time.perf_counter() - t0), tandem

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def agent_system() -> str:
    return ("You are a coding agent. Follow the project's rules below exactly.\n\n" + corpus(2400))


def bench_server(reps: int) -> dict:
    system = agent_system()
    firsts, laters, cached = [], [], []
    for rep in range(reps):
        srv = Server()
        try:
            times = []
            for i in range(10):
                ttft, x = srv.ask(system, f"Task {rep}.{i}: list the files you would open first for change number {i}.")
                times.append(ttft)
                cached.append((x.get("prompt_tokens"), x.get("cached_tokens")))
            print(f"  rep {rep}: first {times[0]:.2f}s, then " + " ".join(f"{t:.2f}" for t in times[1:]), flush=True)
            firsts.append(times[0])
            laters.append(statistics.median(times[1:]))
        finally:
            srv.stop()
    return {"first_s": statistics.median(firsts), "later_p50_s": statistics.median(laters),
            "ratio": statistics.median(b / a for a, b in zip(firsts, laters)), "prompt_and_cached": cached[:3]}


def bench_restart(reps: int) -> dict:
    system = agent_system()
    colds, restarted, cached = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for rep in range(reps):
            for p in Path(folder).rglob("*.safetensors"):
                p.unlink()
            srv = Server("--prefix-cache-dir", folder)
            try:
                cold, _ = srv.ask(system, f"Run {rep}: what would you check first?")
                deadline = time.time() + 120  # the entry is written once the reply is out
                while not list(Path(folder).rglob("[!.]*.safetensors")) and time.time() < deadline:
                    time.sleep(0.2)
            finally:
                srv.stop()
            srv = Server("--prefix-cache-dir", folder)
            try:
                warm, x = srv.ask(system, f"Run {rep}, after a restart: and what next?")
            finally:
                srv.stop()
            size = sum(p.stat().st_size for p in Path(folder).rglob("*.safetensors"))
            print(f"  rep {rep}: cold {cold:.2f}s, after restart {warm:.2f}s ({x.get('cached_tokens')} of "
                  f"{x.get('prompt_tokens')} cached; {size / 2**20:.0f} MiB on disk)", flush=True)
            colds.append(cold)
            restarted.append(warm)
            cached.append((x.get("prompt_tokens"), x.get("cached_tokens")))
    return {"cold_s": statistics.median(colds), "restart_s": statistics.median(restarted),
            "ratio": statistics.median(b / a for a, b in zip(colds, restarted)), "prompt_and_cached": cached}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all", choices=["chat", "server", "restart", "all"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="baseline,auto")
    args = ap.parse_args()
    results = {}
    if args.what in ("chat", "all"):
        print("chat: 3 turns, warm vs cold TTFT", flush=True)
        results["chat"] = bench_chat(args.reps, args.modes.split(","))
    if args.what in ("server", "all"):
        print("server: 10 requests, one 4,000-token system prompt", flush=True)
        results["server"] = bench_server(args.reps)
    if args.what in ("restart", "all"):
        print("restart: disk tier", flush=True)
        results["restart"] = bench_restart(args.reps)
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
