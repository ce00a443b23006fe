"""The HTTP side: an OpenAI-compatible FastAPI app over an ``Engine``.

Routes only translate: parse and validate the request (a 400 in OpenAI's
error shape that names the field), build a ``Request``, submit it, and relay
what the engine emits, as one JSON response or as server-sent events
(OpenAI's chunk format, ending with ``data: [DONE]``). A client that goes
away cancels its request (queued or running); its blocks go back at the
engine's next step.

Tenants: the ``X-Tenant`` header, else the ``user`` field, is the prefix
cache's salt, so requests of different tenants never share blocks; requests
with neither share the untenanted prefixes.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Annotated, Literal, Union

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      StrictBool, StrictInt)
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferrox_kv.serve.engine import NeverFits, Overloaded, Request, Sampling

__all__ = ["make_app"]

MAX_STOP = 4
MAX_STOP_CHARS = 256


def _valid_unicode(v: str) -> str:
    """A string that encodes to UTF-8 (JSON can carry an unpaired surrogate,
    ``"\\ud800"``, which no tokenizer takes)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: an unpaired surrogate at character "
                         f"{e.start}") from None
    return v


def _json_number(v):
    """A JSON number (int or float), as OpenAI takes: never a bool nor a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"must be a number, got {type(v).__name__}")
    return v


Text = Annotated[str, AfterValidator(_valid_unicode)]
Number = Annotated[float, BeforeValidator(_json_number)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Common(_Strict):
    model: Text | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: Text | list[Text] | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=1)
    stream: StrictBool | None = False
    stream_options: dict[str, StrictBool] | None = None
    user: Text | None = Field(default=None, max_length=256)
    # accepted at their defaults only (a client library may send them)
    presence_penalty: Number | None = Field(default=None, ge=0.0, le=0.0)
    frequency_penalty: Number | None = Field(default=None, ge=0.0, le=0.0)
    logprobs: Literal[False] | None = None
    logit_bias: dict[str, Number] | None = Field(default=None, max_length=0)


class CompletionBody(_Common):
    prompt: Union[Text, list[StrictInt]]
    echo: Literal[False] | None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    suffix: None = None


class _Part(_Strict):
    type: Literal["text"]
    text: Text


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[_Part]
    name: Text | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)


class _AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote what a
    client sent (a field's name), which may hold an unpaired surrogate."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


def _error(status, message, param=None, code=None, kind="invalid_request_error", headers=None):
    return _AsciiJSON({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}, status_code=status, headers=headers)


_HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed",
               413: "body_too_large"}


def _fields(loc):
    """The body's field names and list indexes in a validation error's
    location, without pydantic's tags for the members of a union."""
    return [str(x) for x in loc if x != "body" and (
        isinstance(x, int) or (isinstance(x, str) and x.isidentifier()))]


def _param(loc):
    return ".".join(_fields(loc)) or None


def _overloaded(e: Overloaded):
    return _error(503, str(e), code=e.reason, kind="server_overloaded",
                  headers={"Retry-After": str(e.retry_after)})


class _BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes gets 413 before the app
    sees it (by Content-Length, or counted while it streams in, buffering at
    most ``limit`` bytes); the app then reads the buffered body."""

    def __init__(self, app, limit):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                return await self._refuse(send)
        parts, seen = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return                               # the client left before its body
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                return await self._refuse(send)
            parts.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send):
        resp = _error(413, f"the request body is over {self.limit} bytes (--max-body)",
                      code="body_too_large")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(k.encode(), v.encode()) for k, v in resp.headers.items()]})
        await send({"type": "http.response.body", "body": resp.body})


def make_app(engine, metrics, *, model_name, default_max_tokens=256, max_body=1 << 20):
    """The app. ``default_max_tokens``: the chat default when the request
    sets none (completions default to 16, as OpenAI's)."""
    app = FastAPI(title="ferrox-kv serve", version="0.1.0",
                  description="OpenAI-compatible completions over a ferrox_kv pool")
    tok = engine.tokenizer
    vocab = engine.model.get_input_embeddings().num_embeddings    # ids the model can embed
    created = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        # routing (404, 405) and the body parser (400: not UTF-8, JSON nested
        # too deep) answer in OpenAI's error shape too
        status = exc.status_code
        message = {404: f"no route {request.url.path!r}; this server has /v1/completions, "
                        "/v1/chat/completions, /v1/models, /health and /metrics",
                   405: f"{request.method} is not allowed on {request.url.path!r}",
                   400: f"the body could not be parsed as JSON ({exc.detail}): it must be "
                        "UTF-8 JSON, nested at most a few hundred levels"}.get(
            status, str(exc.detail))
        return _error(status, message, code=_HTTP_CODES.get(status),
                      kind="invalid_request_error" if status < 500 else "server_error",
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        errs = exc.errors()
        # of a union's members, the error of the one that got furthest in
        first = max(errs, key=lambda e: len(_fields(e.get("loc", ()))), default={})
        param = _param(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return _error(400, "the body is not valid JSON: " + str(first.get("msg", "")),
                          code="invalid_json")
        if first.get("type") == "extra_forbidden":
            return _error(400, f"unknown field {param!r}; this server accepts the OpenAI "
                          "fields listed in its OpenAPI document (/openapi.json)", param=param,
                          code="unknown_field")
        msg = first.get("msg", "invalid request")
        return _error(400, f"{param or 'body'}: {msg}", param=param, code="invalid_value")

    @app.get("/health")
    async def health():
        # one snapshot: the engine takes and gives back blocks under its lock,
        # so the counts and the pool's figures agree (a request retired
        # between two separate reads looked idle with its blocks still held)
        with engine._cv:
            running = engine.stats()
            s = engine.pool.stats()
        return {"status": "draining" if engine._draining else "ok", **running,
                "free_blocks": s["free_blocks"], "used_blocks": s["used_blocks"],
                "cached_blocks": s["cached_blocks"], "total_blocks": s["total_blocks"]}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "ferrox_kv"}]}

    def _tenant(http, body):
        return http.headers.get("x-tenant") or body.user

    def _stops(body):
        stop = body.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP:
            raise _Bad(f"stop: at most {MAX_STOP} sequences, got {len(stops)}", "stop")
        if any(len(x) > MAX_STOP_CHARS for x in stops):
            raise _Bad(f"stop: each sequence at most {MAX_STOP_CHARS} characters", "stop")
        return stops

    def _check_model(body):
        if body.model is not None and body.model != model_name:
            raise _Bad(f"model {body.model!r} is not served here; GET /v1/models lists "
                       f"{model_name!r}", "model", code="model_not_found", status=404)

    def _sampling(body):
        t = 1.0 if body.temperature is None else body.temperature
        return Sampling(t, 1.0 if body.top_p is None else body.top_p, body.seed)

    def _encode(text, param, **kw):
        """The ids of ``text``; a tokenizer that refuses it is the client's
        400 naming ``param``, never a 500."""
        try:
            return list(tok(text, **kw)["input_ids"])
        except Exception as e:
            raise _Bad(f"{param}: the tokenizer refused the text ({type(e).__name__}: {e})",
                       param) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        try:
            _check_model(body)
            if not body.prompt:
                raise _Bad("prompt is empty; send at least one token", "prompt")
            if isinstance(body.prompt, str):
                ids = _encode(body.prompt, "prompt")
                if not ids:
                    raise _Bad("prompt: this model's tokenizer encodes it to no tokens; send "
                               "text it encodes, or token ids", "prompt",
                               code="empty_prompt")
            else:
                ids = body.prompt
                if any(i < 0 or i >= vocab for i in ids):
                    raise _Bad(f"prompt: token ids must be in [0, {vocab})", "prompt")
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            return await _run(http, body, ids, max_tokens, chat=False)
        except _Bad as e:
            return e.response()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest):
        try:
            _check_model(body)
            msgs = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in body.messages]
            try:
                text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            except Exception as e:
                raise _Bad(f"messages: the chat template refused them: {e}", "messages")
            ids = _encode(text, "messages", add_special_tokens=False)
            if not ids:
                raise _Bad("messages: the chat template produced an empty prompt", "messages")
            max_tokens = body.max_completion_tokens or body.max_tokens
            if max_tokens is None:
                room = engine.max_positions - len(ids)
                max_tokens = max(1, min(default_max_tokens, room))
            return await _run(http, body, ids, max_tokens, chat=True)
        except _Bad as e:
            return e.response()

    async def _run(http, body, ids, max_tokens, *, chat):
        stops = _stops(body)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind, payload):                    # from the engine's threads
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        req = Request(ids, max_tokens, _sampling(body), stop=stops,
                      tenant=_tenant(http, body), emit=emit)
        try:
            engine.submit(req)
        except NeverFits as e:
            metrics.refused("never_fits")
            return _error(400, str(e), param=e.param, code="context_length_exceeded")
        except Overloaded as e:
            metrics.refused(e.reason)
            return _overloaded(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            # the first event (first token, or a refusal from the queue) comes
            # before any header: a request refused while queued gets a real 503
            first = await _next(events, gone)
            if first is None or first[0] == "error":
                req.cancel()
                return _failed(first)
            if body.stream:
                gone.cancel()                   # from here StreamingResponse watches the client
                include_usage = bool((body.stream_options or {}).get("include_usage"))
                return StreamingResponse(
                    _stream(req, first, events, rid, int(time.time()), chat, include_usage),
                    media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            ev = first
            while ev[0] == "token":
                ev = await _next(events, gone)
                if ev is None or ev[0] == "error":
                    req.cancel()
                    return _failed(ev)
        except asyncio.CancelledError:
            req.cancel()
            raise
        finally:
            gone.cancel()
        reason, out = ev[1], req.text        # the whole decode, not the deltas joined
        choice = ({"index": 0, "message": {"role": "assistant", "content": out},
                   "finish_reason": reason, "logprobs": None} if chat else
                  {"index": 0, "text": out, "finish_reason": reason, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": req.usage()}

    async def _stream(req, first, events, rid, now, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta=None, reason=None, usage=None, choices=True):
            if chat:
                c = {"index": 0, "delta": delta if delta is not None else {},
                     "finish_reason": reason, "logprobs": None}
            else:
                c = {"index": 0, "text": (delta or {}).get("content", ""),
                     "finish_reason": reason, "logprobs": None}
            d = {"id": rid, "object": obj, "created": now, "model": model_name,
                 "choices": [c] if choices else []}
            if usage is not None:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            ev = first
            while True:
                kind, payload = ev
                ev = None
                if kind == "token":
                    yield chunk({"content": payload})
                elif kind == "error":
                    err = {"message": str(payload), "type": "server_overloaded"
                           if isinstance(payload, Overloaded) else "server_error",
                           "param": None, "code": getattr(payload, "reason", None)}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    break
                else:
                    if payload != "cancelled":
                        yield chunk({}, payload)
                        if include_usage:
                            yield chunk(usage=req.usage(), choices=False)
                    break
                ev = await events.get()
            yield "data: [DONE]\n\n"
        finally:
            req.cancel()          # no-op once done; a client gone mid-stream stops its sequence

    return _BodyLimit(app, max_body), app


async def _next(events, gone):
    """The engine's next event, or None when the client went away first."""
    get = asyncio.ensure_future(events.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


def _failed(ev):
    """The response for a request that ended without a result: the client
    left (499, which it never reads), a refusal from the queue (503), or a
    failed generation (500: a bug, never bad input)."""
    if ev is None:
        return Response(status_code=499)
    if isinstance(ev[1], Overloaded):
        return _overloaded(ev[1])
    return _error(500, f"generation failed: {ev[1]}", kind="server_error")


async def _disconnected(http: HttpRequest):
    """Returns when the client has gone away."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return


class _Bad(Exception):
    def __init__(self, message, param, code="invalid_value", status=400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def response(self):
        return _error(self.status, str(self), param=self.param, code=self.code)
