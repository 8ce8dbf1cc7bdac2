"""The HTTP API's ASGI entry: the two generation routes served without FastAPI's request layer.

`POST /v1/completions` and `POST /v1/chat/completions` are the routes on every request's path,
so this entry serves them itself: it reads the body (at most `max_body` bytes, else 413 and the
connection closed; a Content-Length over it is refused before reading),
validates it with the route's pydantic model in one `model_validate_json` call (400 naming the
parameter, as the FastAPI app's handler does for every other route) and hands it to
`OpenAIFrontend.generate`; another method on these paths is a 405 here. Everything else — the
other routes and unknown paths (404) — goes to the FastAPI app unchanged.

Why: FastAPI's path for one request (its middleware stack, dependency solving, body parsing
into a dict and then the model) cost about 200 µs of the 400 µs the HTTP layer spent before
`Generate` on an idle loop (2-core machine, cProfile of in-process ASGI calls); the request's
time in the router is what the HTTP frontend adds to every request's TTFT (docs/benchmarks.md).

The body is parsed as JSON whatever its Content-Type says (a `curl -d` without `-H` works).
Both paths stamp the request's arrival (`scope["tandem.arrived"]`, HttpTimings.before_s) and
uvicorn's own send (`scope["tandem.send"]`, through which the streamed events are written; a
response's start goes through the send the app is given, which counts its status where metrics
are on) and the request cycle that send belongs to (`scope["tandem.cycle"]`: its transport tells
a disconnect).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import Counter
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from router.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body

log = logging.getLogger(__name__)
MAX_BODY = 8 << 20  # bytes; a 128K-token prompt is about 0.5 MB as text, 1 MB as a token list
ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
UNION_TAGS = {"str", "int", "float", "bool", "none"}  # pydantic's names of a union's members in an error's loc
THREAD_BODY = 1 << 20  # bytes; a body this large is validated off the event loop (seconds at MAX_BODY)


def loc_name(loc: tuple) -> str:
    """pydantic's ("body", "messages", 0, "content") or ("messages", 0, "content") →
    "messages[0].content" (FastAPI prefixes "body"; model_validate_json does not); an object's
    key that is no field name, as logit_bias's token ids, in brackets: "logit_bias[50]"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in UNION_TAGS or part.startswith(("function-", "list[", "dict[")):  # union member tags
            continue
        elif out and not part.isidentifier():
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def _union_tag(part) -> bool:
    return isinstance(part, str) and (part in UNION_TAGS or part.startswith(("list[", "dict[")))


NOUNS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "none": "null"}


def _noun(tag: str, plural: bool = False) -> str:
    """pydantic's tag of a union member ("str", "list[int]", a model class) in JSON's terms:
    "string", "array of integers", "object"."""
    if tag.startswith("list["):
        return f"array{'s' if plural else ''} of {_noun(tag[5:-1], True)}"
    noun = NOUNS.get(tag, "object" if tag[:1].isupper() else tag)
    return noun + ("s" if plural else "")


def _forms(tags: list[str]) -> str:
    """A union's member tags as the forms it takes: "a string or an array of strings"."""
    names = [("an " if n[0] in "aeiou" else "a ") + n for n in map(_noun, tags)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def validation_error(errors: list[dict]) -> JSONResponse:
    """The 400 for a body pydantic refused: its first error, the parameter named; a field of
    several accepted types (prompt, stop) says them all; an empty list says so."""
    err = errors[0]
    if err.get("type") == "json_invalid":
        return error_response(400, f"request body is not valid JSON: {err.get('msg', '')}")
    loc = tuple(err.get("loc", ()))
    param = loc_name(loc) or None
    msg = err.get("msg", "invalid")
    at = next((i for i, part in enumerate(loc) if _union_tag(part)), None)
    field = loc[:at] if at is not None else ()
    members = [e for e in errors if at is not None and tuple(e.get("loc", ()))[:at] == field
               and len(e["loc"]) > at and _union_tag(e["loc"][at])]
    tags = list(dict.fromkeys(e["loc"][at] for e in members))  # (a dict key alone is no union: one tag)
    deeper = [e for e in members if len(e["loc"]) > at + 1]
    if len(tags) >= 2 and len({e["loc"][at] for e in deeper}) == 1:
        # one form of the union fits the value's shape and fails inside it (a content part's
        # text that is no string, stop's second string): that member's own error, its place named
        param = loc_name(tuple(deeper[0]["loc"])) or None
        msg = deeper[0].get("msg", "invalid")
    elif len(tags) >= 2:  # no form fits: name the field and every form it takes
        param = loc_name(field) or None
        msg = f"must be {_forms(tags)}"
    elif err.get("type") == "too_short" and (err.get("ctx") or {}).get("min_length") == 1:
        msg = "must not be empty"
    return error_response(400, f"{param}: {msg}" if param else msg, param=param)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error object with HTTP `status` (every error of the HTTP API comes from here)."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _too_large(limit: int) -> JSONResponse:
    # connection: close — uvicorn closes the connection after it, so the rest of the body is never read
    return error_response(413, f"request body exceeds {limit} bytes", headers={"Connection": "close"})


class BodyTooLarge(Exception):
    pass


class BodyCutOff(Exception):
    """The client went away before its request body was whole."""


async def read_body(receive, limit: int) -> bytes:
    """The request body from ASGI `receive` messages.

    Raises:
        BodyTooLarge: more than `limit` bytes (the rest is not read).
        BodyCutOff: the client went away before the body was whole.
    """
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise BodyCutOff
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
        if not msg.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


COUNTED_ROUTES = (*ROUTES, "/v1/models", "/health", "/metrics")  # other paths count as route "other"
MODEL_ROUTE = "/v1/models/{model}"  # GET /v1/models/NAME: one label, whatever the name


class Front:
    """ASGI app: the generation routes served directly (see the module docstring), the rest by
    `app` (the FastAPI app of router/http_api.py:create_app). With a metrics registry
    (`api.registry`) every HTTP response is counted by route and status code,
    `tandem_router_http_responses_total`: refusals before a Generate call (a body that is no
    JSON, a wrong type, a missing key, 401, 404, 413) count there and nowhere else."""

    def __init__(self, api: Any, app: Any, max_body: int = MAX_BODY) -> None:
        self.api, self.app, self.max_body = api, app, max_body
        registry = getattr(api, "registry", None)
        self.responses = None if registry is None else Counter(
            "tandem_router_http_responses", "HTTP API responses by route (the path; 'other' for an unknown one) "
            "and HTTP status code", ["route", "code"], registry=registry)

    async def __call__(self, scope, receive, send) -> None:
        scope["tandem.arrived"] = time.perf_counter()
        # uvicorn's send is its request cycle's bound method; the cycle holds the connection,
        # which the disconnect watch polls (router/http_api.py ConnectionWatch)
        scope["tandem.cycle"] = getattr(send, "__self__", None)
        scope["tandem.send"] = send  # uvicorn's own: a streamed event pays no counting wrapper
        if self.responses is not None and scope["type"] == "http":
            send = self._counting(send, scope.get("path", ""))  # what the response's start goes through
        model = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if model is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await error_response(405, f"{scope['method']} not allowed on {scope['path']}",
                                 headers={"Allow": "POST"})(scope, receive, send)
            return
        try:
            response = await self._generate(scope, receive, model)
        except BodyCutOff:
            return  # nobody to answer
        except Exception as exc:  # a bug: the client gets a 500 with its repr, the log the traceback
            log.exception("%s %s failed", scope["method"], scope["path"])
            response = error_response(500, f"internal error: {exc!r}", "internal_error")
        await response(scope, receive, send)

    def _counting(self, send, path: str):
        """`send` that counts the response's status once, at its start."""
        route = path if path in COUNTED_ROUTES else MODEL_ROUTE if path.startswith("/v1/models/") else "other"

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.responses.labels(route, str(message["status"])).inc()
            await send(message)
        return counted

    async def _generate(self, scope, receive, model) -> Any:
        request = Request(scope, receive)
        refused = self.api.authorize(request)  # first: a client without a key learns nothing of the body's rules
        if refused is not None:
            return refused
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        if declared.isdigit() and int(declared) > self.max_body:
            return _too_large(self.max_body)  # refused from the header, before reading anything
        try:
            body = await read_body(receive, self.max_body)
        except BodyTooLarge:
            return _too_large(self.max_body)
        try:
            # a large body takes seconds to validate: off the loop, so other requests keep streaming
            req = (model.model_validate_json(body) if len(body) < THREAD_BODY
                   else await asyncio.to_thread(model.model_validate_json, body))
        except ValidationError as exc:
            return validation_error(exc.errors(include_url=False))
        return await self.api.generate(request, req, scope["path"])
