"""The OpenAI-compatible HTTP app over the engine (FastAPI).

/v1/chat/completions, /v1/completions (both streamed as server-sent events with
"stream": true), /v1/models, /health, /metrics (Prometheus text). Requests are checked
in `protocol` (400 naming the field); a full queue is 429; nothing a client sends reaches
the engine unchecked, and an unexpected failure answers 500 and leaves the server up.

The engine runs on its own thread; its per-request events cross into the event loop
through `call_soon_threadsafe`. A client that disconnects has its request cancelled, which
frees the slot before the next step.
"""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from k3jax.chat.parsing import ReplyStream, parse_reply
from k3jax.errors import InputError
from k3jax.infer.engine import EngineFull, Request
from k3jax.infer.sampling import SamplingParams
from k3jax.serve import protocol as P
from k3jax.tokenizer import END_OF_MSG


class Service:
    """What the routes need: the front door (`Generator`), its engine, the served name."""

    def __init__(self, generator, engine, model_name: str):
        self.gen, self.engine, self.model = generator, engine, model_name
        self.started = time.time()
        self.stop_ids = {generator.tokenizer.token_id(END_OF_MSG), generator.cfg.eos_token_id} - {None}

    def request(self, prompt: list[int], opts: dict, stop_ids, detok=None) -> Request:
        sampling = SamplingParams(opts["temperature"], opts["top_k"], opts["top_p"], opts["seed"])
        return Request(prompt, opts["max_tokens"], sampling, frozenset(() if opts["ignore_eos"] else stop_ids),
                       opts["stop"], detok=detok)


def make_app(svc: Service) -> FastAPI:
    app = FastAPI(title="k3jax", docs_url=None, redoc_url=None)

    @app.exception_handler(P.BadRequest)
    async def bad_request(_, e: P.BadRequest):
        return JSONResponse(P.error_body(str(e), e.param, e.kind), status_code=e.status)

    @app.exception_handler(Exception)
    async def unexpected(_, e: Exception):
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", None, "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        alive = svc.engine.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model, "object": "model", "created": int(svc.started),
                                            "owned_by": "k3jax", "max_model_len": svc.engine.max_len}]}

    @app.get("/metrics")
    async def metrics():
        s = svc.engine.stats()
        lines = [f"# TYPE k3jax_{k} gauge\nk3jax_{k} {v}" for k, v in (
            ("running_requests", s["running"]), ("waiting_requests", s["waiting"]), ("slots", s["slots"]),
            ("generation_tokens_per_second", round(s["tokens_per_s"], 3)))]
        lines += [f"# TYPE k3jax_{k} counter\nk3jax_{k} {v}" for k, v in (
            ("generated_tokens_total", s["generated_tokens"]), ("prompt_tokens_total", s["prompt_tokens"]),
            ("engine_steps_total", s["steps"]))]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        return await chat_completions(svc, http)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await text_completions(svc, http)

    return app


async def chat_completions(svc: Service, http: HttpRequest):
    body = P.parse_body(await http.body())
    opts = P.sampling_options(body, P.CHAT, None)
    chat_req = P.chat_request(body)
    try:
        prompt = svc.gen.chat_prompt(chat_req["messages"], chat_req["tools"], thinking=chat_req["thinking"],
                                     thinking_effort=chat_req["thinking_effort"],
                                     tool_choice=chat_req["tool_choice"],
                                     response_format=chat_req["response_format"])
    except (InputError, ValueError, KeyError, TypeError) as e:
        raise P.BadRequest("messages", f"the messages cannot be rendered: {e}") from None
    tok, thinking = svc.gen.tokenizer, chat_req["thinking"]
    req = svc.request(prompt, opts, svc.stop_ids,
                      detok=lambda ids: parse_reply(ids, thinking=thinking, tokenizer=tok)["content"])
    events = _submit(svc, req, "messages")
    rid = P.new_id("chatcmpl")
    if not opts["stream"]:
        await _wait(http, svc, req, events)
        reply = parse_reply(req.out, thinking=thinking, tokenizer=tok)
        reply["content"] = req.text            # stop strings cut the answer
        return P.chat_completion(rid, svc.model, reply, req.finish_reason, _usage(req))

    async def sse():
        reasoning = ReplyStream(tok, thinking)
        yield _sse(P.chat_chunk(rid, svc.model, {"role": "assistant", "content": ""}))
        async for new_ids, new_text in _events(svc, req, events):
            think, _ = reasoning.feed(new_ids)
            if think:
                yield _sse(P.chat_chunk(rid, svc.model, {"reasoning_content": think}))
            if new_text:
                yield _sse(P.chat_chunk(rid, svc.model, {"content": new_text}))
        reply = parse_reply(req.out, thinking=thinking, tokenizer=tok)
        if reply["tool_calls"]:
            calls = [{"index": i, **c} for i, c in enumerate(reply["tool_calls"])]
            yield _sse(P.chat_chunk(rid, svc.model, {"tool_calls": calls}))
        yield _sse(P.chat_chunk(rid, svc.model, {}, P.finish_reason(req.finish_reason, reply)))
        if opts["include_usage"]:
            yield _sse(P.chat_chunk(rid, svc.model, None, use=_usage(req)))
        yield "data: [DONE]\n\n"
    return StreamingResponse(sse(), media_type="text/event-stream")


async def text_completions(svc: Service, http: HttpRequest):
    body = P.parse_body(await http.body())
    opts = P.sampling_options(body, P.COMPLETION, 16)
    prompt = P.completion_prompt(body, svc.gen.cfg.vocab_size)
    ids = svc.gen.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    req = svc.request(ids, opts, {svc.gen.cfg.eos_token_id} - {None})
    events = _submit(svc, req, "prompt")
    rid = P.new_id("cmpl")
    if not opts["stream"]:
        await _wait(http, svc, req, events)
        return P.completion(rid, svc.model, req.text, P.finish_reason(req.finish_reason), _usage(req))

    async def sse():
        async for _, new_text in _events(svc, req, events):
            if new_text:
                yield _sse(P.completion(rid, svc.model, new_text, None, None))
        yield _sse(P.completion(rid, svc.model, "", P.finish_reason(req.finish_reason), None))
        if opts["include_usage"]:
            yield _sse(P.completion(rid, svc.model, None, None, _usage(req)))
        yield "data: [DONE]\n\n"
    return StreamingResponse(sse(), media_type="text/event-stream")


def _submit(svc: Service, req: Request, field: str) -> asyncio.Queue:
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    # r.done read on the engine's thread when the event is made: the last one says so
    req.on_event = lambda r, ids, text: loop.call_soon_threadsafe(events.put_nowait, (ids, text, r.done))
    try:
        svc.engine.submit(req)
    except EngineFull as e:
        raise P.BadRequest(None, str(e), status=429, kind="rate_limit_exceeded") from None
    except InputError as e:
        msg = str(e)
        param = "max_tokens" if msg.startswith("max_tokens") else field
        raise P.BadRequest(param, msg.replace("prompt:", f"{field}:", 1)) from None
    return events


async def _events(svc: Service, req: Request, events: asyncio.Queue):
    """(new ids, new text) as the engine hands them on; a client gone cancels the request."""
    try:
        while True:
            ids, text, last = await events.get()
            yield ids, text
            if last:
                return
    finally:
        if not req.done:
            svc.engine.cancel(req)


async def _wait(http: HttpRequest, svc: Service, req: Request, events: asyncio.Queue):
    try:
        while not req.done:
            try:
                await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    break
    finally:
        if not req.done:
            svc.engine.cancel(req)


def _usage(req: Request) -> dict:
    return P.usage(len(req.prompt), len(req.out), req.cached_prompt)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
