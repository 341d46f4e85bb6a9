"""One generation's chunks into the app's result dict (no Qt; runs in the engine worker's thread).

``Engine.stream`` (a chat turn alone, a race lane) and the shared batch (a chat turn while the
app serves its model, app.serving) feed a ``Generation`` alike, so the chat gets the same
result either way. The worker hands it the engine's streaming detokenizer (only app.worker
imports engine code).
"""

from __future__ import annotations

from typing import Any, Callable

from app.race_verdict import token_sources


class Generation:
    """One generation's chunks into the app's result dict: the text as it streams, the text of
    each token (the race's token diff), which drafter made each token (token colours) and the
    telemetry. ``Engine.stream`` and the shared batch feed it alike (``on_round``, ``add``)."""

    def __init__(self, eng: Any, detok: Any, tel: Any, label: str, key: Any, params: dict,
                 on_text: Callable[[str], None], started: Callable[[str, int], None] | None = None):
        self.eng, self.tel, self.label, self.key, self.params = eng, tel, label, key, params
        self.on_text, self.started = on_text, started
        self.kwargs = {k: params[k] for k in ("mode", "max_new_tokens", "max_draft", "temperature", "top_p", "top_k",
                                              "seed", "stop", "system") if k in params and params[k] is not None}
        self.detok = detok  # engine.detokenize.StreamingDetokenizer: the text of each token
        self.pieces: list[str] = []
        self.made_by: list[tuple[int, int, str]] = []  # per round (accepted, committed, drafted_by): token colours
        self.result = None
        self.first = True
        tel.begin(label, key)

    def on_round(self, ev: Any) -> None:
        self.made_by.append((ev.accepted, ev.committed, ev.drafted_by))
        self.tel.push_round({"index": ev.index, "t": ev.t, "drafted": ev.drafted, "accepted": ev.accepted,
                             "committed": ev.committed, "cap": ev.cap, "context": ev.context,
                             "generated": ev.generated, "draft_s": ev.draft_s, "verify_s": ev.verify_s,
                             "mode": ev.mode, "drafted_by": ev.drafted_by}, self.key)

    def add(self, chunk: Any) -> None:
        if chunk.event is not None and self.first:
            self.first = False
            if self.started is not None:
                self.started(chunk.event.mode, chunk.event.context - chunk.event.generated)
        for tok in chunk.token_ids:  # per-token text, for the race's token diff
            self.pieces.append(self.detok.add([tok]))
        if chunk.text:
            self.on_text(chunk.text)
        if chunk.result is not None:
            self.result = chunk.result

    def finish(self) -> dict:
        r, tel = self.result, self.tel
        pieces = self.pieces[: len(r.token_ids)]  # a stop string may have cut the last round short
        if pieces and len(pieces) == len(r.token_ids):
            pieces[-1] += self.detok.flush()  # an incomplete multi-byte character at the very end
        out = r.to_dict()
        out.update(text=r.text, token_ids=list(r.token_ids), token_times=list(r.token_times), pieces=pieces,
                   sources=token_sources(self.made_by)[: len(r.token_ids)],
                   ttft_s=r.ttft_s, rounds=list(r.rounds), decode_tps=r.decode_tps, mean_accepted=r.mean_accepted,
                   cached_tokens=r.cached_tokens, model=self.eng.name,
                   temperature=float(self.params.get("temperature") or 0.0))
        tel.end(self.key, out)
        if r.generated > 1 and r.finish_reason != "cancelled":
            tel.push_point({"mode": r.mode, "tps": r.decode_tps, "context": r.prompt_tokens + r.generated / 2,
                            "speculative": r.mode != "baseline", "accept": r.mean_accepted, "label": self.label})
        return out
