"""The HTTP server: FastAPI routes over the Engine, OpenAI's wire format, the playground page.

    GET  /                      the playground (static/index.html, app.js, style.css)
    GET  /health                liveness, load and batching counters (answers while models work)
    GET  /openapi.json          the routes' schema, request bodies included
    GET  /v1/models[/{id}]      the served model ids with their paradigm
    POST /v1/completions        OpenAI completions (+ suffix infilling, + dlm's extra fields)
    POST /v1/chat/completions   OpenAI chat completions over a plain template (protocol.chat_prompt)

Load: at most `max_concurrency` requests generate at once, at most `max_queue` more wait for a
slot (in arrival order); beyond that a request gets 429 with Retry-After. Generation runs in the
engine's threads; the event loop only moves events to the client, so /health and new requests are
answered while models work. A client that disconnects cancels its job (the workers check between
events). Request bodies are capped (413), nested at most 64 deep, and must not stall (408). Every
error is OpenAI's error object; client mistakes are 4xx, never 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dlm.files import loads_bounded

from dlm.serve.engine import Engine, Failed, Job
from dlm.serve.protocol import (
    ApiError, ChatRequest, Collector, CompletionRequest, Piece, Plan, chat_body, chunk, completion_body, parse,
    plan_chat, plan_completion,
)

log = logging.getLogger("dlm.serve")
STATIC = Path(__file__).parent / "static"
PAGES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8"}
MAX_BODY = 1 << 20  # bytes of a request body (1 MiB)
BODY_TIMEOUT = 30.0  # seconds a client may pause while sending its body


# admission: concurrency and queue limits --------------------------------------------------------------

class Busy(Exception):
    pass


class Ticket:
    """A request's place: running, or waiting in line for a slot."""

    def __init__(self, adm: Admission, fut: asyncio.Future | None):
        self.adm, self.fut = adm, fut
        self.t0 = time.perf_counter()
        self.queued = 0.0
        self.released = False

    async def wait(self) -> None:
        if self.fut is not None:
            await self.fut
        self.queued = time.perf_counter() - self.t0

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.adm._release(self)


class Admission:
    def __init__(self, max_running: int, max_queue: int):
        self.max_running, self.max_queue = max_running, max_queue
        self.running = 0
        self.line: list[Ticket] = []
        self.rejected = 0

    def enter(self) -> Ticket:
        """A running ticket, a waiting one, or Busy when the line is full."""
        if self.running < self.max_running and not self.line:
            self.running += 1
            return Ticket(self, None)
        if len(self.line) >= self.max_queue:
            self.rejected += 1
            raise Busy
        t = Ticket(self, asyncio.get_running_loop().create_future())
        self.line.append(t)
        return t

    def _release(self, t: Ticket) -> None:
        if t in self.line:  # left while waiting
            self.line.remove(t)
            return
        self.running -= 1
        while self.line and self.running < self.max_running:
            nxt = self.line.pop(0)
            self.running += 1
            if not nxt.fut.done():
                nxt.fut.set_result(None)

    def retry_after(self) -> int:
        return max(1, len(self.line) // max(self.max_running, 1))


# the app ----------------------------------------------------------------------------------------------

def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_json(request: Request, cap: int) -> dict:
    """The request body as a JSON object; 413 past `cap` bytes, 400 for anything not a JSON object."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > cap):
        raise ApiError(413, f"request body too large (at most {cap} bytes)", None, "body_too_large")
    body = bytearray()
    parts = request.stream().__aiter__()
    try:
        while True:
            try:
                part = await asyncio.wait_for(parts.__anext__(), BODY_TIMEOUT)
            except StopAsyncIteration:
                break
            body += part
            if len(body) > cap:
                raise ApiError(413, f"request body too large (at most {cap} bytes)", None, "body_too_large")
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body stalled (nothing for {BODY_TIMEOUT:g} s)", None, "timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "the client left before sending its whole body", None, "client_disconnected") from None
    try:
        obj = loads_bounded(body.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"could not parse the request body as JSON ({str(e)[:120]})", None, "invalid_json") \
            from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    try:  # a lone surrogate (JSON's "\\ud800") is no text a tokenizer can take
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the request body holds a lone surrogate ({e.object[e.start:e.end]!r}): text must be "
                            "valid Unicode", None, "invalid_json") from None
    return obj


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose cleanup runs however the response ends (finished, failed, client gone)."""

    def __init__(self, content: AsyncIterator[str], on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            self.on_close()


class ApiKey:
    """ASGI middleware: /v1/ routes need `Authorization: Bearer KEY` (compared in constant time)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                err = ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)", None,
                               "invalid_api_key")
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, *, max_concurrency: int = 8, max_queue: int = 32, api_key: str | None = None,
               max_body: int = MAX_BODY) -> FastAPI:
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    app = FastAPI(title="dlm serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    adm = Admission(max_concurrency, max(0, max_queue))
    app.state.engine, app.state.admission = engine, adm
    started = time.time()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} not allowed "
               f"on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(ApiError(e.status_code, msg, None, {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return _error(ApiError(400, str(e)[:300], None, "invalid_request"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        return _error(ApiError(500, f"internal error: {type(e).__name__}", None, "internal_error"))

    if api_key:
        app.add_middleware(ApiKey, key=api_key)

    def openapi() -> dict:
        """FastAPI's schema of the routes, with the two POST bodies (parsed by hand: protocol.parse) declared from
        their pydantic models, `model` naming the served ids."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, kind in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatRequest)):
                s = kind.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(s.pop("$defs", {}))
                s["properties"]["model"] = {"type": "string", "enum": list(engine.models)}
                comps[kind.__name__] = s
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{kind.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    # pages --------------------------------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    async def index():
        return Response((STATIC / "index.html").read_bytes(), media_type=PAGES["index.html"])

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in PAGES:
            raise ApiError(404, f"no file {name}", None, "not_found")
        return Response((STATIC / name).read_bytes(), media_type=PAGES[name])

    @app.get("/health")
    async def health():
        return {"status": "ok", "uptime": time.time() - started, "models": list(engine.models),
                "running": adm.running, "queued": len(adm.line), "rejected": adm.rejected,
                "max_concurrency": adm.max_running, "max_queue": adm.max_queue, "auth": bool(api_key),
                "batching": engine.stats()}

    # the API ------------------------------------------------------------------------------------

    def _models() -> list[dict]:
        return [{"id": s.id, "object": "model", "created": int(started), "owned_by": "dlm", "dlm": s.describe()}
                for s in engine.models.values()]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": _models()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        for m in _models():
            if m["id"] == model_id:
                return m
        raise ApiError(404, f"model {model_id!r} is not served here (served: {', '.join(engine.models)})", "model",
                       "model_not_found")

    async def _plan(request: Request, kind) -> Plan:
        body = await read_json(request, max_body)
        req = parse(kind, body)
        served = engine.get(req.model)
        if served is None:
            raise ApiError(404, f"model {req.model!r} is not served here (served: {', '.join(engine.models)})",
                           "model", "model_not_found")
        planner = plan_chat if kind is ChatRequest else plan_completion
        return await asyncio.to_thread(planner, engine, served, req)  # tokenizing can take a while

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _respond(request, await _plan(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _respond(request, await _plan(request, ChatRequest))

    async def _respond(request: Request, plan: Plan):
        try:
            ticket = adm.enter()
        except Busy:
            raise ApiError(429, f"the server is busy ({adm.running} requests generating, {len(adm.line)} waiting); "
                                "retry later", None, "rate_limit_exceeded",
                           {"Retry-After": str(adm.retry_after())}) from None
        if plan.stream:
            state: dict[str, Job | None] = {"job": None}

            def close() -> None:
                if state["job"] is not None:
                    state["job"].cancel()
                ticket.release()

            return _named_ignored(EventStream(_stream(plan, ticket, state), close), plan)
        job: Job | None = None

        async def work() -> dict:
            nonlocal job
            await ticket.wait()
            job = engine.start(plan.served, plan.rows, asyncio.get_running_loop(), plan.stream_steps)
            col = Collector(plan)
            async for ev in job:
                if isinstance(ev, Failed):
                    raise ApiError(400 if ev.client else 500, ev.message, None,
                                   "invalid_value" if ev.client else "internal_error")
                col.feed(ev, job)
            col.finish()
            body = chat_body if plan.kind == "chat" else completion_body
            return body(plan, col, ticket.queued)

        task = asyncio.ensure_future(work())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client left: stop its generation
                task.cancel()
                return Response(status_code=499)
            return _named_ignored(JSONResponse(task.result()), plan)
        finally:
            gone.cancel()
            if job is not None:
                job.cancel()
            ticket.release()

    async def _stream(plan: Plan, ticket: Ticket, state: dict) -> AsyncIterator[str]:
        await ticket.wait()
        job = state["job"] = engine.start(plan.served, plan.rows, asyncio.get_running_loop(), plan.stream_steps)
        col = Collector(plan)
        started: set[int] = set()

        def emit(piece) -> str:
            first = piece.row not in started
            started.add(piece.row)
            return _sse(chunk(plan, col, piece, first))

        if plan.kind == "chat":  # the role comes first, as OpenAI sends it
            for i in range(len(plan.rows)):
                yield emit(Piece(i))
        async for ev in job:
            if isinstance(ev, Failed):
                err = ApiError(400 if ev.client else 500, ev.message, None,
                               "invalid_value" if ev.client else "internal_error")
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            for piece in col.feed(ev, job):
                yield emit(piece)
        final = col.finish()
        for k, piece in enumerate(final):
            body = chunk(plan, col, piece, piece.row not in started)
            if k == len(final) - 1:
                body["dlm"] = {"event": "stats", **col.dlm(ticket.queued)}
                if not plan.include_usage:
                    body["usage"] = col.usage()
            yield _sse(body)
        if plan.include_usage:
            yield _sse({**chunk(plan, col, None), "usage": col.usage()})
        yield "data: [DONE]\n\n"

    return app


def _named_ignored(response: Response, plan: Plan) -> Response:
    """The request's fields the API does not know (ignored, as vLLM does) named in a header."""
    if plan.ignored:
        response.headers["X-Dlm-Ignored-Fields"] = ", ".join(plan.ignored)
    return response


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body has been read: receive() only reports the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


# running it ------------------------------------------------------------------------------------------

def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _server(app: FastAPI, log_level: str):
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2, access_log=log_level == "debug")
    return uvicorn.Server(config)


@contextlib.contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> Iterator[str]:
    """Serve `app` from a thread on host:port (0: a free port) while the block runs; yields the base URL."""
    sock = bind(host, port)
    server = _server(app, log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="dlm-uvicorn")
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    h, p = sock.getsockname()[:2]
    try:
        yield f"http://{'[' + h + ']' if ':' in h else h}:{p}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def serve(models: list[str], draft: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          max_concurrency: int = 8, max_queue: int = 32, api_key: str | None = None, max_body: int = MAX_BODY,
          device: str = "auto", log_level: str = "info", compile: bool = False, pack_weights: bool = False,
          prefix_cache: int = 256 << 20, kv_dtype: str = "auto") -> None:
    """Load the models and serve until interrupted (what `dlm serve` runs)."""
    from dlm.device import resolve_device

    engine = Engine(models, draft, device=resolve_device(device), max_batch=max(64, max_concurrency * 4),
                    compile=compile, pack_weights=pack_weights, prefix_cache=prefix_cache, kv_dtype=kv_dtype)
    app = create_app(engine, max_concurrency=max_concurrency, max_queue=max_queue, api_key=api_key,
                     max_body=max_body)
    sock = bind(host, port)
    h, p = sock.getsockname()[:2]
    print(f"dlm serve: {', '.join(f'{s.id} ({s.paradigm})' for s in engine.models.values())}", flush=True)
    print(f"playground: http://{h}:{p}/   API: http://{h}:{p}/v1   (Ctrl-C stops)", flush=True)
    try:
        _server(app, log_level).run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
