"""The server's routes: generation in both dialects, models, health, metrics and events.

A generation request is parsed by its dialect (``engine.serve.openai`` / ``anthropic``), its prompt
rendered and tokenized in the handler's own thread, then queued for the engine thread as a
``Job``; the handler relays the job's chunks to the socket as they come, with keep-alives while
it waits, and cancels the job when the client leaves.

One client must not stall the others: a prompt is checked against the context before the costly
part (token ids by count; text by bytes, against ``context x bytes_per_token_bound``, before it is
tokenized), and tokenizing holds no lock, so a big prompt costs its own thread's time only. The
engine thread then prefills at most a context's worth of tokens."""

from __future__ import annotations

import json
import queue
import time
from typing import Any, Callable, Iterator

from engine.errors import TandemError
from engine.prefix_cache import boundaries
from engine.processors import Processing
from engine.serve import anthropic as anthropic_api
from engine.serve import openai as openai_api
from engine.serve import images as serve_images
from engine.serve.chat_format import (GenSpec, OutputParser, PromptTooLong, Reply, RequestError,
                                      bytes_per_token_bound, encode_bounded, matched_stop, new_id, opens_thinking,
                                      render_chat, tools_as_text, unread_template_kwargs)
from engine.serve.http import ClientGone, RequestHandler
from engine.serve.worker import Job

POLL_S = 0.05  # how often a waiting handler looks at its socket


class Handler(RequestHandler):
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._handle({"/health": self._health, "/metrics": self._metrics, "/events": self._events,
                      "/models": self._models, "/": self._index}, get=True)

    def do_POST(self) -> None:
        self._handle({"/chat/completions": self._chat, "/completions": self._completions,
                      "/messages": self._messages, "/messages/count_tokens": self._count_tokens}, get=False)

    # -- simple routes --------------------------------------------------------------------------
    def _index(self) -> None:
        self._json(200, {"name": "tandem", "model": self.tandem.model_name,
                         "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                       "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics", "/events"]})

    def _health(self) -> None:
        w = self.tandem.worker
        if w.load_error:
            self._json(503, {"status": "error", "error": w.load_error})
        elif not w.ready.is_set():
            self._json(503, {"status": "loading"})
        else:
            self._json(200, {"status": "ok", "model": self.tandem.model_name, "mode": self.tandem.config.mode,
                             "queue_depth": self.tandem.metrics.queued, "in_flight": self.tandem.metrics.in_flight})

    def _metrics(self) -> None:
        self._send(200, self.tandem.metrics.render().encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _models(self) -> None:
        self._engine()
        name, now = self.tandem.model_name, int(self.tandem.started_at)
        # One list both SDKs can read: OpenAI's fields and Anthropic's side by side.
        entry = {"id": name, "object": "model", "created": now, "owned_by": "tandem", "type": "model",
                 "display_name": name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                 "context_length": self.tandem.max_context}
        route = self._route()
        if route.startswith("/models/"):
            self._json(200, entry)  # any id: this server answers every model name with its one model
            return
        self._json(200, {"object": "list", "data": [entry], "has_more": False, "first_id": name, "last_id": name})

    def _events(self) -> None:
        if self.command == "HEAD":  # the headers a GET would get, and no stream
            self._start_sse()
            self._sse_open = False
            return
        hub = self.tandem.events
        q = hub.subscribe()
        try:
            self._start_sse()
            self._write(b": connected\n\n")
            while True:
                try:
                    event = q.get(timeout=min(self.tandem.config.keepalive_s, 1.0))
                except queue.Empty:
                    if self._client_gone():
                        raise ClientGone()
                    if time.monotonic() - self._last_write >= self.tandem.config.keepalive_s:
                        self._write(b": keep-alive\n\n")
                    continue
                if event is None:  # the server is stopping
                    self._end_sse()
                    self.close_connection = True
                    return
                self._write(f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n")
        finally:
            hub.unsubscribe(q)

    # -- generation -----------------------------------------------------------------------------
    def _engine(self) -> Any:
        worker = self.tandem.worker
        while not worker.ready.wait(POLL_S * 4):
            if self._client_gone():
                raise ClientGone()
        if worker.load_error:
            raise RequestError(f"the model failed to load: {worker.load_error}", status=503, kind="api_error")
        return worker.engine

    def _chat(self) -> None:
        spec = openai_api.parse_chat(self._read_json())
        self._generate(spec, openai_api.ChatWriter(spec), openai_api)

    def _completions(self) -> None:
        spec = openai_api.parse_completion(self._read_json())
        self._generate(spec, None, openai_api)

    def _messages(self) -> None:
        spec = anthropic_api.parse_request(self._read_json())
        self._generate(spec, anthropic_api.MessagesWriter(spec), anthropic_api)

    def _count_tokens(self) -> None:
        spec = anthropic_api.parse_request(self._read_json(), count_only=True)
        engine = self._engine()
        image = self._image_prompt(engine, spec)
        _, ids = (image.text, image.ids) if image is not None else self._render(engine, spec, anthropic_api)
        self._json(200, {"input_tokens": len(ids)})

    def _image_prompt(self, engine: Any, spec: GenSpec) -> Any:
        """A chat with images as the engine's ImagePrompt (None for one without); a 4xx for a
        text-only model or an image that cannot be used."""
        if spec.kind != "chat" or not serve_images.has_refs(spec.messages):
            return None
        from engine import vision

        refusal = engine.image_refusal()
        if refusal is not None:
            raise RequestError(refusal, param="messages")
        messages = serve_images.resolve(spec.messages, allow_urls=self.tandem.config.allow_image_urls)
        if spec.tools:
            messages = tools_as_text(messages, spec.tools)
        with self.tandem.tokenizer_lock:  # the processor (image preprocessing) is not known to be thread-safe
            try:
                return vision.image_prompt(engine, *vision.split_images(messages))
            except vision.ImageError as e:
                raise RequestError(str(e), param="messages", status=e.status) from None

    def _tokenizer(self, engine: Any) -> Any:
        """The engine's tokenizer, for use without a lock: encoding and decoding only read it. The one
        call that may change it (transformers drops a truncation or padding setting a tokenizer.json
        carries, on the first encode) runs once, under the lock, before any concurrent use."""
        srv, tok = self.tandem, engine.tokenizer
        if srv.settled_tokenizer is not tok:
            with srv.tokenizer_lock:
                if srv.settled_tokenizer is not tok:
                    tok.encode("settle")
                    srv.settled_tokenizer = tok
        return tok

    def _render(self, engine: Any, spec: GenSpec, dialect: Any) -> tuple[str, list[int]]:
        """(prompt text, token ids), refused with the dialect's context error before tokenizing when
        the prompt cannot fit (see the module doc)."""
        tok, limit = self._tokenizer(engine), self.tandem.max_context
        if isinstance(spec.prompt, list):  # completions by token ids
            if limit and len(spec.prompt) >= limit:
                raise dialect.context_error(len(spec.prompt), limit)
            vocab = engine.target.vocab_size
            if any(t >= vocab for t in spec.prompt):
                raise RequestError(f"'prompt' has a token id outside the vocabulary (size {vocab})", param="prompt")
            return tok.decode(spec.prompt), list(spec.prompt)
        per_token = bytes_per_token_bound(tok)
        max_bytes = limit * per_token if limit else None
        try:
            if spec.kind == "chat":
                spec.ignored += unread_template_kwargs(tok, spec.template_kwargs)
                return render_chat(tok, spec.messages, spec.tools, self._template_kwargs(spec), max_bytes=max_bytes)
            if not spec.prompt.strip():
                raise RequestError("'prompt' is only whitespace: give some text to continue", param="prompt")
            return spec.prompt, encode_bounded(tok, spec.prompt, max_bytes)
        except PromptTooLong as e:  # at least this many tokens, whatever the tokenizer makes of it
            raise dialect.context_error(-(-e.n_bytes // per_token), limit, at_least=True) from None

    def _template_kwargs(self, spec: GenSpec) -> dict:
        """The request's template variables over the server's defaults (tandem serve --no-thinking)."""
        thinking = self.tandem.config.thinking
        return ({} if thinking is None else {"enable_thinking": thinking}) | spec.template_kwargs

    def _boundaries(self, engine: Any, spec: GenSpec, ids: list[int]) -> list[int]:
        """Where this chat's opening ends and its next turn departs (the prefix cache keeps states there)."""
        if spec.kind != "chat":
            return []
        kwargs, tok = self._template_kwargs(spec), self._tokenizer(engine)
        return boundaries(lambda m: render_chat(tok, m, spec.tools, kwargs, add_generation_prompt=False)[1],
                          spec.messages, ids)

    def _generate(self, spec: GenSpec, writer: Any, dialect: Any) -> None:
        t0 = time.perf_counter()
        srv, cfg = self.tandem, self.tandem.config
        engine = self._engine()
        image = self._image_prompt(engine, spec)
        prompt_text, ids = (image.text, image.ids) if image is not None else self._render(engine, spec, dialect)
        if writer is None:
            writer = openai_api.CompletionWriter(spec, prompt_text)
        limit = srv.max_context
        if limit and len(ids) >= limit:
            raise dialect.context_error(len(ids), limit)
        wanted = spec.max_tokens or cfg.default_max_tokens
        kwargs = dict(
            mode=spec.mode or cfg.mode, max_draft=spec.max_draft if spec.max_draft is not None else cfg.max_draft,
            max_new_tokens=min(wanted, limit - len(ids)) if limit else wanted,
            temperature=cfg.temperature if spec.temperature is None else spec.temperature,
            top_p=cfg.top_p if spec.top_p is None else spec.top_p,
            top_k=cfg.top_k if spec.top_k is None else spec.top_k,
            seed=cfg.seed if spec.seed is None else spec.seed, stop=spec.stop,
            boundaries=[] if image is not None else self._boundaries(engine, spec, ids),
            history_scope=self.client_scope, **spec.processing())
        if image is not None:
            kwargs["image_prompt"] = image
        try:
            Processing(**spec.processing()).validate(engine.target.vocab_size)
        except TandemError as e:
            raise RequestError(str(e), param="logit_bias") from None
        prefix = {"openai": "chatcmpl-" if spec.kind == "chat" else "cmpl-", "anthropic": "msg_"}
        reply = Reply(id=new_id(prefix["anthropic" if dialect is anthropic_api else "openai"]),
                      model=spec.model or srv.model_name, created=int(time.time()), prompt_tokens=len(ids),
                      stop=spec.stop, token_text=self._token_text(engine) if spec.logprobs is not None else None)
        parser = None
        if spec.kind == "chat":
            names = [t["function"]["name"] for t in spec.tools] if spec.tools else None
            parser = OutputParser(tool_names=names, in_think=opens_thinking(prompt_text))
        job = srv.worker.submit(Job(reply.id, self._endpoint, ids, kwargs))
        srv.metrics.gauge("in_flight", 1)
        try:
            if spec.stream:
                self._stream(job, writer, parser, reply, spec)
            else:
                for _ in self._relay(job, writer, parser, reply, spec):
                    pass
                self._json(200, writer.body(reply))
        finally:
            job.cancel.set()  # a no-op when it finished; stops it when anything above failed
            srv.metrics.gauge("in_flight", -1)
            srv.metrics.latency_observe(time.perf_counter() - t0)

    def _token_text(self, engine: Any) -> Callable[[int], str]:
        """Token id -> its text, for logprobs (cached per request). Decoding only reads a settled
        tokenizer (``_tokenizer``): no lock, so a long prompt rendered elsewhere never holds it up."""
        known: dict[int, str] = {}
        tok = self._tokenizer(engine)

        def text(token: int) -> str:
            if token not in known:
                known[token] = tok.decode([token])
            return known[token]

        return text

    def _relay(self, job: Job, writer: Any, parser: OutputParser | None, reply: Reply, spec: GenSpec,
               keepalive: Callable[[], None] | None = None) -> Iterator[list]:
        """Yield parsed events as the engine produces them; fill ``reply`` when it finishes."""
        keepalive_s = self.tandem.config.keepalive_s
        last_check = 0.0
        while True:
            try:
                item = job.out.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if item is None or now - last_check >= POLL_S:
                last_check = now
                if self._client_gone():
                    job.cancel.set()
                    raise ClientGone()
            if item is None:
                if keepalive is not None and now - self._last_write >= keepalive_s:
                    keepalive()
                continue
            kind = item[0]
            if kind == "text":
                reply.logprobs += item[2] if len(item) > 2 else []
                events = parser.feed(item[1]) if parser else [("text", item[1])]
                reply.add(events)
                yield events
            elif kind == "result":
                events = parser.finish() if parser else []
                reply.add(events)
                self._finish_reply(reply, item[1], spec, job)
                yield events
                return
            elif kind == "cancelled":
                raise ClientGone()
            else:
                raise RequestError(item[1], status=item[2], kind="invalid_request_error" if item[2] == 400 else "api_error")

    def _finish_reply(self, reply: Reply, result: Any, spec: GenSpec, job: Job) -> None:
        reply.result = result
        if result.finish_reason == "stop" and spec.stop:
            full = self.tandem.worker.engine.tokenizer.decode(result.token_ids, skip_special_tokens=False)
            reply.stop_sequence = matched_stop(full, spec.stop)
        reply.x_tandem = {**result.to_dict(), "ttft_s": round(result.ttft_s, 4),
                          "queue_s": round(job.started - job.submitted, 4)}
        if spec.ignored:
            reply.x_tandem["ignored"] = spec.ignored
        if result.finish_reason == "cancelled":
            raise RequestError("the generation was cancelled (the server is shutting down)", status=503,
                               kind="api_error")

    def _stream(self, job: Job, writer: Any, parser: OutputParser | None, reply: Reply, spec: GenSpec) -> None:
        def begin() -> None:
            if not self._sse_open:
                self._start_sse()
                self._write(writer.start(reply))

        def keepalive() -> None:
            begin()
            self._write(writer.keepalive())

        for events in self._relay(job, writer, parser, reply, spec, keepalive):
            begin()
            self._write(writer.events(reply, events))
        begin()
        self._write(writer.end(reply))
        self._end_sse()
