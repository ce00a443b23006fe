"""What the HTTP side speaks: the request bodies (OpenAI's completions and
chat fields, strict: an unknown field is a 400 naming it), the error shape
(``{"error": {message, type, param, code}}``), and the errors the engine
raises that map to HTTP (``Overloaded``: 503 + Retry-After; ``NeverFits``:
400)."""
from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
)

__all__ = ["Bad", "ChatBody", "CompletionBody", "Message", "NeverFits", "Overloaded", "error",
           "http_error", "overloaded", "stops", "validation_error"]


class Overloaded(Exception):
    """No room now (queue full, queue timeout, shutting down): HTTP 503 with
    ``Retry-After: retry_after`` seconds."""

    def __init__(self, message, retry_after, reason):
        super().__init__(message)
        self.retry_after = int(retry_after)
        self.reason = reason


class NeverFits(ValueError):
    """The request can never be served by this pool or model: HTTP 400."""

    def __init__(self, message, param):
        super().__init__(message)
        self.param = param


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


def error(status, message, param=None, code=None, kind="invalid_request_error", headers=None):
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


def overloaded(e: Overloaded):
    return error(503, str(e), code=e.reason, kind="server_overloaded",
                  headers={"Retry-After": str(e.retry_after)})


def validation_error(errs) -> JSONResponse:
    """The 400 for pydantic's errors of a body: the error of the union member
    that got furthest in, naming its field."""
    first = max(errs, key=lambda e: len(_fields(e.get("loc", ()))), default={})
    param = _param(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return error(400, "the body is not valid JSON: " + str(first.get("msg", "")),
                     code="invalid_json")
    if first.get("type") == "extra_forbidden":
        return error(400, f"unknown field {param!r}; this server accepts the OpenAI "
                     "fields listed in its OpenAPI document (/openapi.json)", param=param,
                     code="unknown_field")
    msg = first.get("msg", "invalid request")
    return error(400, f"{param or 'body'}: {msg}", param=param, code="invalid_value")


def http_error(status, method, path, detail, headers=None) -> JSONResponse:
    """Routing (404, 405) and the body parser (400: not UTF-8, JSON nested
    too deep) answer in OpenAI's error shape too."""
    message = {404: f"no route {path!r}; this server has /v1/completions, "
                    "/v1/chat/completions, /v1/models, /health and /metrics",
               405: f"{method} is not allowed on {path!r}",
               400: f"the body could not be parsed as JSON ({detail}): it must be "
                    "UTF-8 JSON, nested at most a few hundred levels"}.get(status, str(detail))
    return error(status, message, code=_HTTP_CODES.get(status),
                 kind="invalid_request_error" if status < 500 else "server_error",
                 headers=headers)


def stops(body) -> list[str]:
    """The body's stop strings as a list, or ``Bad`` naming ``stop``."""
    stop = body.stop
    out = [stop] if isinstance(stop, str) else list(stop or [])
    if len(out) > MAX_STOP:
        raise Bad(f"stop: at most {MAX_STOP} sequences, got {len(out)}", "stop")
    if any(len(x) > MAX_STOP_CHARS for x in out):
        raise Bad(f"stop: each sequence at most {MAX_STOP_CHARS} characters", "stop")
    return out


class Bad(Exception):
    """A request the client must fix: ``response()`` is its 4xx naming ``param``."""

    def __init__(self, message, param, code="invalid_value", status=400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def response(self):
        return error(self.status, str(self), param=self.param, code=self.code)
