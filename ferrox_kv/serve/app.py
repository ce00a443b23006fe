"""The HTTP side: an OpenAI-compatible FastAPI app over an ``Engine``.

Routes only translate: parse and validate the request (a 400 in OpenAI's
error shape that names the field: ``protocol``), build a ``Request``, submit
it, and relay what the engine emits, as one JSON response or as server-sent
events (OpenAI's chunk format, ending with ``data: [DONE]``). A client that
goes away cancels its request (queued or running); its blocks go back at
the engine's next step.

The routes are module functions over one ``AppState`` (the engine, the
metrics, the model's name and the tokenizer), kept in ``app.state.serve``.

Tenants: the ``X-Tenant`` header, else the ``user`` field, is the prefix
cache's salt, so requests of different tenants never share blocks; requests
with neither share the untenanted prefixes.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferrox_kv.serve.protocol import (
    Bad,
    ChatBody,
    CompletionBody,
    NeverFits,
    Overloaded,
    error,
    http_error,
    overloaded,
    stops,
    validation_error,
)
from ferrox_kv.serve.requests import Request, Sampling

__all__ = ["AppState", "make_app"]


class AppState:
    """What the routes share: ``engine``, ``metrics``, ``model_name``,
    ``default_max_tokens`` (the chat default when a request sets none;
    completions default to 16, as OpenAI's), and what they read of the
    model (the tokenizer, the ids it can embed), plus ``info``: extra fields
    of ``/v1/models``' entry (the server's dtypes)."""

    def __init__(self, engine, metrics, *, model_name, default_max_tokens=256, info=None):
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.tokenizer = engine.tokenizer
        self.vocab = engine.model.get_input_embeddings().num_embeddings
        self.created = int(time.time())
        self.info = dict(info or {})


def make_app(engine, metrics, *, model_name, default_max_tokens=256, max_body=1 << 20,
             info=None):
    """``(asgi, app)``: the FastAPI app over ``engine``, and the ASGI app to
    serve (the app behind the body-size limit)."""
    app = FastAPI(title="ferrox-kv serve", version="0.1.0",
                  description="OpenAI-compatible completions over a ferrox_kv pool")
    app.state.serve = AppState(engine, metrics, model_name=model_name,
                               default_max_tokens=default_max_tokens, info=info)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.include_router(router)
    return _BodyLimit(app, max_body), app


router = APIRouter()


def _state(http: HttpRequest) -> AppState:
    return http.app.state.serve


async def _http_exception(request, exc):
    return http_error(exc.status_code, request.method, request.url.path, exc.detail,
                      headers=getattr(exc, "headers", None))


async def _invalid(request, exc):
    return validation_error(exc.errors())


@router.get("/health")
async def health(http: HttpRequest):
    return _state(http).engine.health()


@router.get("/metrics")
async def prom(http: HttpRequest):
    return Response(_state(http).metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(http: HttpRequest):
    st = _state(http)
    return {"object": "list", "data": [{"id": st.model_name, "object": "model",
                                        "created": st.created, "owned_by": "ferrox_kv",
                                        **st.info}]}


@router.post("/v1/completions")
async def completions(body: CompletionBody, http: HttpRequest):
    st = _state(http)
    try:
        _check_model(st, body)
        if not body.prompt:
            raise Bad("prompt is empty; send at least one token", "prompt")
        if isinstance(body.prompt, str):
            ids = _encode(st, body.prompt, "prompt")
            if not ids:
                raise Bad("prompt: this model's tokenizer encodes it to no tokens; send "
                          "text it encodes, or token ids", "prompt", code="empty_prompt")
        else:
            ids = body.prompt
            if any(i < 0 or i >= st.vocab for i in ids):
                raise Bad(f"prompt: token ids must be in [0, {st.vocab})", "prompt")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await _run(st, http, body, ids, max_tokens, chat=False)
    except Bad as e:
        return e.response()


@router.post("/v1/chat/completions")
async def chat(body: ChatBody, http: HttpRequest):
    st = _state(http)
    try:
        _check_model(st, body)
        msgs = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content)} for m in body.messages]
        try:
            text = st.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                    tokenize=False)
        except Exception as e:
            raise Bad(f"messages: the chat template refused them: {e}", "messages")
        ids = _encode(st, text, "messages", add_special_tokens=False)
        if not ids:
            raise Bad("messages: the chat template produced an empty prompt", "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            room = st.engine.max_positions - len(ids)
            max_tokens = max(1, min(st.default_max_tokens, room))
        return await _run(st, http, body, ids, max_tokens, chat=True)
    except Bad as e:
        return e.response()


def _tenant(http, body):
    return http.headers.get("x-tenant") or body.user


def _check_model(st, body):
    if body.model is not None and body.model != st.model_name:
        raise Bad(f"model {body.model!r} is not served here; GET /v1/models lists "
                  f"{st.model_name!r}", "model", code="model_not_found", status=404)


def _sampling(body):
    t = 1.0 if body.temperature is None else body.temperature
    return Sampling(t, 1.0 if body.top_p is None else body.top_p, body.seed)


def _encode(st, text, param, **kw):
    """The ids of ``text``; a tokenizer that refuses it is the client's 400
    naming ``param``, never a 500."""
    try:
        return list(st.tokenizer(text, **kw)["input_ids"])
    except Exception as e:
        raise Bad(f"{param}: the tokenizer refused the text ({type(e).__name__}: {e})",
                  param) from None


async def _run(st, http, body, ids, max_tokens, *, chat):
    stop = stops(body)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(kind, payload):                    # from the engine's threads
        loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

    req = Request(ids, max_tokens, _sampling(body), stop=stop, tenant=_tenant(http, body),
                  emit=emit)
    try:
        st.engine.submit(req)
    except NeverFits as e:
        st.metrics.refused("never_fits")
        return error(400, str(e), param=e.param, code="context_length_exceeded")
    except Overloaded as e:
        st.metrics.refused(e.reason)
        return overloaded(e)
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
                _stream(st, req, first, events, rid, int(time.time()), chat, include_usage),
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
            "created": int(time.time()), "model": st.model_name,
            "choices": [choice], "usage": req.usage()}


async def _stream(st, req, first, events, rid, now, chat, include_usage):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta=None, reason=None, usage=None, choices=True):
        if chat:
            c = {"index": 0, "delta": delta if delta is not None else {},
                 "finish_reason": reason, "logprobs": None}
        else:
            c = {"index": 0, "text": (delta or {}).get("content", ""),
                 "finish_reason": reason, "logprobs": None}
        d = {"id": rid, "object": obj, "created": now, "model": st.model_name,
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
        return overloaded(ev[1])
    return error(500, f"generation failed: {ev[1]}", kind="server_error")


async def _disconnected(http: HttpRequest):
    """Returns when the client has gone away."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return


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
        resp = error(413, f"the request body is over {self.limit} bytes (--max-body)",
                      code="body_too_large")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(k.encode(), v.encode()) for k, v in resp.headers.items()]})
        await send({"type": "http.response.body", "body": resp.body})
