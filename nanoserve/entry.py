"""Entry layer: the CLI and the OpenAI-compatible HTTP server.

This module owns
* the command line (``python -m nanoserve``), with ``vllm serve``'s flag names;
* the Starlette app: ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``,
  ``/version``;
* the OpenAI protocol: parsing and validating request bodies (every error names
  its field), mapping them onto ``SamplingParams``, and shaping responses and
  SSE chunks;
* admission: request ids (``X-Request-Id``), the API key, the waiting-queue
  limit (429), the body-size limit (413), and aborting the engine requests of a
  client that disconnects;
* ``/metrics`` (Prometheus, one registry per app) and the periodic stats line;
* uvicorn start-up, the banner, and the graceful shutdown on SIGINT/SIGTERM.

It hands the engine layer prompts (token ids) and ``SamplingParams`` through
``AsyncLLM`` and reads back ``RequestOutput``s. It never touches blocks, tensors
or the scheduler's queues: what it knows of them comes from ``engine.stats()``.

Read top to bottom: CLI -> app -> handlers -> protocol helpers -> SSE ->
metrics -> start-up and shutdown.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from nanoserve import __version__
from nanoserve.engine import (MAX_LOGPROBS, AsyncLLM, CompletionOutput, EngineConfig, EngineDeadError,
                              local_ranks, run_worker_node,
                              LLMEngine, RequestOutput, SamplingParams, apply_chat_template, model_thread)

logger = logging.getLogger("nanoserve.entry")

MAX_N = 128                          # completions per prompt (n)
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # no "#": the engine names n's children id#i


# =========================================================================== CLI

def default_model_path() -> str:
    """The demo model packaged at nanoserve/demo_model, when there is one."""
    demo = Path(__file__).resolve().parent / "demo_model"
    if (demo / "config.json").is_file():
        return str(demo)
    raise ValueError("no --model given and no demo model packaged: pass --model DIR, "
                     "a Hugging Face model directory")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" unless the help text already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default:" in help_text:
            return help_text
        return super()._get_help_string(action)


def _parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512MiB', '2G', '2GB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 4294967296 or 4GiB, got {text!r}")
    number, prefix, suffix = float(m.group(1)), m.group(2).upper(), m.group(3).lower()
    base = 1024 if suffix.startswith("i") or suffix == "" else 1000
    return int(number * base ** " KMGT".index(prefix or " "))


def make_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nanoserve", formatter_class=_HelpFormatter,
        description="Serve a Hugging Face model (Llama, Qwen2, Qwen3, Mistral) with an OpenAI-compatible API.")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model directory (config.json, safetensors, tokenizer) "
                        "(default: the packaged demo model, if there is one)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) clients pass as `model`; the first is used in responses "
                        "(default: the --model value)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "half", "float"],
                   help="weight and KV dtype; auto: the checkpoint's on a GPU, bfloat16 on a CPU")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if available, else cpu")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's limit, capped "
                        "by what the KV cache holds)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile: CPU decode attention runs eager SDPA (starts faster, decodes slower)")

    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model across N ranks, one process (and GPU) each: gloo on the CPU, NCCL on CUDA")
    g.add_argument("--distributed-init-method", default=None, metavar="URL",
                   help="where the ranks meet: tcp://HOST:PORT (node 0's address), or env:// under torchrun "
                        "(default: a free port on this machine)")
    g.add_argument("--nnodes", type=int, default=1, help="machines the N ranks are spread over, N / nnodes each")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index; node 0 serves HTTP, the others only run their ranks")

    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                        "(default: max(8192, --max-num-seqs))")

    g = p.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128],
                   help="tokens per KV block")
    g.add_argument("--kv-cache-memory-bytes", type=_parse_bytes, default=None, metavar="BYTES",
                   help="KV cache budget, e.g. 4GiB (default: on a GPU what "
                        "--gpu-memory-utilization leaves; on a CPU min(4 GiB, a quarter of free RAM))")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks; overrides --kv-cache-memory-bytes "
                        "(default: as many as the budget buys)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a shared prompt prefix")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $NANOSERVE_API_KEY, "
                        "or no key)")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 429 while this many requests wait for the scheduler (default: no limit)")
    g.add_argument("--max-request-body-bytes", type=_parse_bytes, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="BYTES", help="answer 413 to a larger request body")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long in-flight requests may run before they are aborted")

    g = p.add_argument_group("logging")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug shows each request's path through every layer")
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="how often to log throughput and queue stats while busy")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    if args.model is None:
        try:
            args.model = default_model_path()
        except ValueError as e:
            parser.error(str(e))
    checks = [("--port", 0 <= args.port <= 65535, "in [0, 65535]"),
              ("--max-num-seqs", args.max_num_seqs >= 1, ">= 1"),
              ("--max-queue-len", args.max_queue_len is None or args.max_queue_len >= 1, ">= 1"),
              ("--max-request-body-bytes", args.max_request_body_bytes >= 1, ">= 1"),
              ("--shutdown-timeout", args.shutdown_timeout >= 0, ">= 0"),
              ("--log-stats-interval", args.log_stats_interval > 0, "> 0")]
    for flag, ok, rule in checks:
        if not ok:
            parser.error(f"{flag} must be {rule}")
    args.served_model_name = args.served_model_name or [args.model]
    return args


# =========================================================================== app

@dataclass(eq=False)
class ServerState:
    """What the handlers share: one per app, no module-level state."""
    async_llm: AsyncLLM
    model_names: list[str]
    api_key: str | None
    max_queue_len: int | None
    max_body_bytes: int
    metrics: "ServerMetrics"
    generations: dict[str, "Generation"] = field(default_factory=dict)  # in flight, by request id

    @property
    def engine(self) -> LLMEngine:
        return self.async_llm.engine


def build_app(async_llm: AsyncLLM, args: argparse.Namespace) -> Starlette:
    """The HTTP app over an AsyncLLM that is not started yet: the app's lifespan
    starts it on uvicorn's loop and stops it at shutdown."""
    names = list(args.served_model_name or [args.model])
    state = ServerState(async_llm, names, args.api_key, args.max_queue_len, args.max_request_body_bytes,
                        ServerMetrics(async_llm, names[0]))
    stats_interval = None if args.disable_log_stats else args.log_stats_interval

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async_llm.start()
        stats_task = (asyncio.create_task(log_stats_periodically(state, stats_interval))
                      if stats_interval else None)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            if state.generations:  # what the drain timeout left
                logger.info("[entry] shutdown: aborting %d request(s) still in flight", len(state.generations))
            for gen in list(state.generations.values()):
                gen.close("shutdown timeout")
            await async_llm.shutdown()

    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(EntryMiddleware, state=state)],
                    exception_handlers={ApiError: _api_error_handler, HTTPException: _http_error_handler,
                                        Exception: _internal_error_handler})
    app.state.server = state
    return app


class EntryMiddleware:
    """Gives every HTTP request its id (X-Request-Id, read or made, echoed in the
    response) and checks the API key on /v1/*. Plain ASGI, not Starlette's
    BaseHTTPMiddleware, which would hide client disconnects from the handlers."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.expected_auth = None if state.api_key is None else b"Bearer " + state.api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id")
        error = None
        if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
            error = ApiError(400, "X-Request-Id must be 1 to 128 characters from A-Z a-z 0-9 . _ : -",
                             param="X-Request-Id")
            request_id = None
        request_id = request_id or uuid.uuid4().hex
        scope["nanoserve.request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        if error is None and self.expected_auth is not None and _is_api_path(scope["path"]):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected_auth):  # constant time
                error = ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                                 headers={"WWW-Authenticate": "Bearer"})
        if error is not None:
            logger.info("[entry] %s: %s %s -> %d: %s", request_id, scope["method"], scope["path"],
                        error.status, error.message)
            await error.response()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


def _is_api_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


# =========================================================================== handlers

async def create_completion(request: Request) -> Response:
    state, request_id = _state(request), _request_id(request)
    body = await read_json(request, state)
    model = check_model(body, state)
    spec = parse_completion(body, state, request_id)
    gen = Generation(state, request_id, spec)
    if spec.stream:
        return EventStream(completion_events(gen, model), on_close=gen.close)
    finals = await _collect_or_disconnect(request, gen)
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    choices = []
    for idx, c in sorted(finals.items()):
        prompt = spec.prompts[idx // spec.params.n]
        text = (_prompt_text(state, prompt) if spec.echo else "") + c.text
        choices.append({"index": idx, "text": text,
                        "logprobs": _completion_logprobs(state, c, 0, len(c.token_ids), 0)
                        if spec.logprobs is not None else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return json_response({"id": gen.response_id, "object": "text_completion", "created": gen.created,
                          "model": model, "choices": choices, "usage": gen.usage(finals)})


async def create_chat_completion(request: Request) -> Response:
    state, request_id = _state(request), _request_id(request)
    body = await read_json(request, state)
    model = check_model(body, state)
    spec = parse_chat(body, state, request_id)
    gen = Generation(state, request_id, spec, prefix="chatcmpl-")
    if spec.stream:
        return EventStream(chat_events(gen, model), on_close=gen.close)
    finals = await _collect_or_disconnect(request, gen)
    if finals is None:
        return Response(status_code=499)
    choices = [{"index": idx, "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(state, c, 0, len(c.token_ids), spec.logprobs)
                if spec.logprobs is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for idx, c in sorted(finals.items())]
    return json_response({"id": gen.response_id, "object": "chat.completion", "created": gen.created,
                          "model": model, "choices": choices, "usage": gen.usage(finals)})


async def list_models(request: Request) -> Response:
    state = _state(request)
    created = int(time.time())
    return json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "nanoserve",
         "root": state.engine.config.model, "parent": None, "max_model_len": state.engine.max_model_len}
        for name in state.model_names]})


async def health(request: Request) -> Response:
    async_llm = _state(request).async_llm
    if async_llm.is_running:
        return Response(status_code=200)
    reason = f"the engine loop died: {async_llm.errored!r}" if async_llm.errored else "the engine is not running"
    return ApiError(503, reason).response()


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""
    state = _state(request)
    body = await read_json(request, state)
    check_model(body, state)
    tokenizer = _tokenizer(state)
    if body.get("messages") is not None:
        text = _render_chat(state, parse_messages(body))
        add_special = get_bool(body, "add_special_tokens", False)
    else:
        text = get_str(body, "prompt", None)
        if text is None:
            raise ApiError(400, "prompt (a string) or messages is required", param="prompt")
        add_special = get_bool(body, "add_special_tokens", True)
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    if get_bool(body, "return_token_strs", False):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return json_response(out)


async def detokenize(request: Request) -> Response:
    state = _state(request)
    body = await read_json(request, state)
    check_model(body, state)
    ids = get_token_ids(body, "tokens", state, required=True)
    return json_response({"prompt": _tokenizer(state).decode(ids)})


async def version(request: Request) -> Response:
    return json_response({"version": __version__})


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _request_id(request: Request) -> str:
    return request.scope["nanoserve.request_id"]


async def _collect_or_disconnect(request: Request, gen: "Generation") -> dict[int, CompletionOutput] | None:
    """Run a non-streaming request to the end, or abort it when the client leaves."""
    done, why = False, "the server stopped"  # unless we get further
    try:
        done, finals = await until_disconnect(request.receive, gen.collect())
        why = "" if done else "client disconnected"
    except EngineDeadError as e:
        why = str(e)
        raise ApiError(503, str(e)) from None
    finally:
        gen.close(why)
    return finals if done else None


# =========================================================================== protocol helpers

class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {message, type, param, code}}."""
    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


async def _api_error_handler(request: Request, exc: ApiError) -> Response:
    logger.info("[entry] %s: %s %s -> %d: %s", request.scope.get("nanoserve.request_id"), request.method,
                request.url.path, exc.status, exc.message)
    return exc.response()


async def _http_error_handler(request: Request, exc: HTTPException) -> Response:
    return ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                    headers=dict(exc.headers or {})).response()


async def _internal_error_handler(request: Request, exc: Exception) -> Response:
    # The traceback goes to the log (Starlette re-raises to uvicorn), never to the client.
    return ApiError(500, "internal server error; the server log has the details").response()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_dumps(obj), status, headers, media_type="application/json")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# ---------------------------------------------------------------- reading a body

async def read_json(request: Request, state: ServerState) -> dict[str, Any]:
    """The body as a JSON object, read no further than the size limit."""
    limit = state.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {length} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes, this server's limit")
            chunks.append(chunk)
    except ClientDisconnect:
        raise bad_request("the client disconnected while sending the body") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def check_model(body: dict[str, Any], state: ServerState) -> str:
    """The served name the request asks for (the first one if it names none)."""
    model = get_str(body, "model", None)
    if model is None:
        return state.model_names[0]
    if model not in state.model_names:
        raise ApiError(404, f"the model `{model}` does not exist; this server serves "
                            f"{', '.join(map(repr, state.model_names))}", param="model")
    return model


# ---------------------------------------------------------------- typed fields
# Each getter returns the default for a missing or null field and names the
# field in its error, as vLLM's (pydantic) errors do.

def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) != float("inf") and v == v


def get_bool(body: dict, name: str, default: bool | None) -> bool | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{name} must be true or false, got {_show(v)}", name)
    return v


def get_int(body: dict, name: str, default: int | None, lo: int | None = None,
            hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad_request(f"{name} must be an integer, got {_show(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rule = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise bad_request(f"{name} must be {rule}, got {v}", name)
    return v


def get_number(body: dict, name: str, default: float | None) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_finite_number(v):
        raise bad_request(f"{name} must be a finite number, got {_show(v)}", name)
    return float(v)


def get_str(body: dict, name: str, default: str | None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad_request(f"{name} must be a string, got {_show(v)}", name)
    return v


def get_token_ids(body: dict, name: str, state: ServerState, required: bool = False) -> list[int]:
    v = body.get(name)
    if v is None and not required:
        return []
    vocab = state.engine.model_config.vocab_size
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad_request(f"{name} must be a list of token ids (integers), got {_show(v)}", name)
    bad = [t for t in v if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", name)
    return v


def _warn_unknown(body: dict, known: frozenset[str], request_id: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:  # as vLLM: ignored, not an error, so newer clients keep working
        logger.warning("[entry] %s: ignoring unknown field(s): %s", request_id, ", ".join(unknown))


# ---------------------------------------------------------------- requests -> SamplingParams

SAMPLING_FIELDS = frozenset({
    "model", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "max_tokens", "logprobs", "stream", "stream_options", "user"})
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                                 "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt"}


@dataclass(slots=True)
class Prompt:
    text: str | None          # None: the client sent token ids
    token_ids: list[int]


@dataclass(slots=True)
class GenerationSpec:
    """What one OpenAI request asks of the engine, validated."""
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None   # top-N to report, None: no logprobs


def parse_completion(body: dict, state: ServerState, request_id: str) -> GenerationSpec:
    _warn_unknown(body, COMPLETION_FIELDS, request_id)
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")
    logprobs = get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = get_bool(body, "echo", False)
    if echo and logprobs is not None:
        raise bad_request("echo together with logprobs would need the prompt's logprobs, which nanoserve "
                          "does not compute; drop one of them", "echo")
    max_tokens = get_int(body, "max_tokens", 16, lo=1)   # OpenAI's default for completions
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs)
    prompts = [_tokenize_prompt(state, p) for p in _completion_prompts(body)]
    for p in prompts:
        check_length(state, len(p.token_ids), max_tokens, "prompt")
    return GenerationSpec(prompts, params, *_stream_flags(body), echo=echo, logprobs=logprobs)


def parse_chat(body: dict, state: ServerState, request_id: str) -> GenerationSpec:
    _warn_unknown(body, CHAT_FIELDS, request_id)
    messages = parse_messages(body)
    if body.get("tools"):
        raise bad_request("tools (function calling) are not supported", "tools")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise bad_request("tool_choice is not supported", "tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request('response_format must be {"type": "text"}: structured output is not supported',
                          "response_format")
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    max_tokens = get_int(body, "max_tokens", None, lo=1)
    max_tokens = get_int(body, "max_completion_tokens", max_tokens, lo=1)  # the newer name wins
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs)
    prompt = _tokenize_prompt(state, _render_chat(state, messages))
    check_length(state, len(prompt.token_ids), max_tokens, "messages")
    return GenerationSpec([prompt], params, *_stream_flags(body), logprobs=logprobs)


def sampling_params(body: dict, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The sampling fields shared by both endpoints (OpenAI's and vLLM's extras).
    Types are checked here; ranges by SamplingParams, whose errors name the field."""
    n = get_int(body, "n", 1, 1, MAX_N)
    best_of = get_int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request("best_of is not supported: leave it out or make it equal to n", "best_of")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or
                                 (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise bad_request(f"stop must be a string or a list of strings, got {_show(stop)}", "stop")
    fields = dict(
        n=n, max_tokens=max_tokens, logprobs=logprobs, stop=stop,
        temperature=get_number(body, "temperature", 1.0),
        top_p=get_number(body, "top_p", 1.0),
        top_k=get_int(body, "top_k", 0),
        min_p=get_number(body, "min_p", 0.0),
        seed=get_int(body, "seed", None),
        presence_penalty=get_number(body, "presence_penalty", 0.0),
        frequency_penalty=get_number(body, "frequency_penalty", 0.0),
        repetition_penalty=get_number(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
        ignore_eos=get_bool(body, "ignore_eos", False),
        min_tokens=get_int(body, "min_tokens", 0),
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
    )
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise bad_request(str(e), _param_of(str(e))) from None


def _param_of(message: str) -> str | None:
    """The field an engine error names: its messages start with the field."""
    name = message.split(" ", 1)[0]
    return name if name in SamplingParams.__dataclass_fields__ else None


def _logit_bias(body: dict) -> dict[int, float] | None:
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request(f"logit_bias must be an object mapping token ids to numbers, got {_show(v)}",
                          "logit_bias")
    out = {}
    for key, bias in v.items():
        if not re.fullmatch(r"\d{1,9}", key):
            raise bad_request(f"logit_bias keys must be token ids, got {_show(key)}", "logit_bias")
        if not _is_finite_number(bias) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {_show(bias)}",
                              "logit_bias")
        out[int(key)] = float(bias)
    return out


def _int_list(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad_request(f"{name} must be a list of integers, got {_show(v)}", name)
    return v


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {_show(options)}", "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request("stream_options.include_usage must be true or false", "stream_options")
    return stream, bool(include)


def _completion_prompts(body: dict) -> list[str | list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of those lists."""
    p = body.get("prompt")
    rule = "a string, a list of strings, a list of token ids, or a list of token-id lists"
    if p is None:
        raise bad_request(f"prompt is required: {rule}", "prompt")
    if isinstance(p, str):
        return [p]
    if not isinstance(p, list) or not p:
        raise bad_request(f"prompt must be {rule} (and not empty), got {_show(p)}", "prompt")
    if all(_is_int(t) for t in p):
        return [p]
    if all(isinstance(s, str) for s in p):
        return list(p)
    if all(isinstance(ids, list) and ids and all(_is_int(t) for t in ids) for ids in p):
        return list(p)
    raise bad_request(f"prompt must be {rule}, got {_show(p)}", "prompt")


def _tokenize_prompt(state: ServerState, prompt: str | list[int]) -> Prompt:
    try:
        text, ids = state.engine.tokenize(prompt)
        state.engine.validate_prompt(ids)
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    return Prompt(text, ids)


def check_length(state: ServerState, num_prompt: int, max_tokens: int | None, what: str) -> None:
    limit = state.engine.max_model_len
    if max_tokens is not None and num_prompt + max_tokens > limit:
        raise bad_request(
            f"this model's max-model-len is {limit} tokens, but the request needs {num_prompt + max_tokens}: "
            f"{num_prompt} in the {what} and max_tokens={max_tokens}; lower max_tokens to at most "
            f"{max(limit - num_prompt, 0)} or shorten the {what}", "max_tokens")


ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def parse_messages(body: dict) -> list[dict[str, str]]:
    """OpenAI chat messages -> [{role, content}] with text content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects, got "
                          f"{_show(messages)}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with role and content, got {_show(m)}", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {_show(role)}",
                              "messages")
        out.append({"role": role, "content": _message_text(m.get("content"), where)})
    return out


def _message_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  f"are supported, got {_show(part)}", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts, got {_show(content)}",
                      "messages")


def _render_chat(state: ServerState, messages: list[dict[str, str]]) -> str:
    try:
        return apply_chat_template(state.engine.tokenizer, messages)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


def _tokenizer(state: ServerState):
    if state.engine.tokenizer is None:
        raise bad_request("this server runs without a tokenizer (token ids only)")
    return state.engine.tokenizer


def _prompt_text(state: ServerState, prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    tokenizer = state.engine.tokenizer
    return "" if tokenizer is None else tokenizer.decode(prompt.token_ids)


# ---------------------------------------------------------------- admission and the engine requests

@dataclass(slots=True)
class _Tracked:
    """One engine request's progress, for metrics and clean-up."""
    engine_id: str
    queue: asyncio.Queue
    started: bool = False           # its AsyncLLM.stream ran (and so cleans up after itself)
    done: bool = False
    finish_reasons: list[str] = field(default_factory=list)
    num_output_tokens: dict[int, int] = field(default_factory=dict)  # by completion index
    first_token_seen: bool = False
    last_token_time: float | None = None


class Generation:
    """The engine requests behind one HTTP request (one per prompt), admitted
    at construction (raising 400/429/503), read back as one stream of
    (prompt index, RequestOutput). ``close()`` aborts whatever has not finished;
    every path out of a handler calls it."""

    def __init__(self, state: ServerState, request_id: str, spec: GenerationSpec, prefix: str = "cmpl-"):
        self.state, self.request_id, self.spec = state, request_id, spec
        self.response_id = prefix + request_id
        self.created = int(time.time())
        self.start = time.monotonic()
        self.tracked: list[_Tracked] = []
        self.closed = False
        if request_id in state.generations:
            raise bad_request(f"request id {request_id!r} (X-Request-Id) is already in flight", "X-Request-Id")
        self._admit()
        state.generations[request_id] = self

    def _admit(self) -> None:
        state, async_llm, spec = self.state, self.state.async_llm, self.spec
        if not async_llm.is_running:
            raise ApiError(503, "the engine is not running" + (f": {async_llm.errored!r}" if async_llm.errored else ""))
        waiting = state.engine.stats()["num_waiting"]
        if state.max_queue_len is not None and waiting >= state.max_queue_len:
            raise ApiError(429, f"the server is busy: {waiting} requests are waiting (--max-queue-len "
                                f"{state.max_queue_len}); retry later", headers={"Retry-After": "1"})
        try:
            state.engine.validate_params(spec.params)
            for i, prompt in enumerate(spec.prompts):
                engine_id = self.request_id if len(spec.prompts) == 1 else f"{self.request_id}-{i}"
                queue = async_llm.add_request(prompt.token_ids, spec.params, engine_id)
                self.tracked.append(_Tracked(engine_id, queue))
        except EngineDeadError as e:
            self.close()
            raise ApiError(503, str(e)) from None
        except ValueError as e:  # the engine's own checks: token ids against the vocabulary, the id
            self.close()
            raise bad_request(str(e), "X-Request-Id" if "already in use" in str(e) else _param_of(str(e))) from None
        logger.debug("[entry] %s: admitted %d prompt(s) of %s tokens, max_tokens %s, n %d, stream %s",
                     self.request_id, len(spec.prompts), "+".join(str(len(p.token_ids)) for p in spec.prompts),
                     spec.params.max_tokens, spec.params.n, spec.stream)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The engine requests' outputs as they come, merged."""
        merged: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(i: int, t: _Tracked) -> None:
            t.started = True
            try:
                async for out in self.state.async_llm.stream(t.engine_id, t.queue):
                    merged.put_nowait((i, out))
                merged.put_nowait((i, end))
            except Exception as e:  # EngineDeadError: hand it to the reader
                merged.put_nowait((i, e))

        pumps = [asyncio.create_task(pump(i, t)) for i, t in enumerate(self.tracked)]
        try:
            remaining = len(pumps)
            while remaining:
                i, item = await merged.get()
                if item is end:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self._observe(self.tracked[i], item)
                    yield i, item
        finally:  # cancelling a pump cancels its stream, which aborts that engine request
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def collect(self) -> dict[int, CompletionOutput]:
        """Every choice's final output, by choice index."""
        finals: dict[int, CompletionOutput] = {}
        async with contextlib.aclosing(self.outputs()) as outputs:
            async for i, out in outputs:
                for c in out.outputs:
                    finals[self.choice_index(i, c)] = c
        return finals

    def choice_index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.spec.params.n + c.index

    def usage(self, finals: dict[int, CompletionOutput]) -> dict[str, int]:
        prompt = sum(len(p.token_ids) for p in self.spec.prompts)
        completion = sum(len(c.token_ids) for c in finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _observe(self, t: _Tracked, out: RequestOutput) -> None:
        metrics, m = self.state.metrics, out.metrics
        if m is not None and m.first_token_time is not None:
            if not t.first_token_seen:
                t.first_token_seen = True
                metrics.time_to_first_token.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    metrics.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            elif t.last_token_time is not None and m.last_token_time > t.last_token_time:
                metrics.inter_token_latency.observe(m.last_token_time - t.last_token_time)
            t.last_token_time = m.last_token_time
        for c in out.outputs:
            t.num_output_tokens[c.index] = len(c.token_ids)
            if c.finish_reason is not None:
                t.finish_reasons.append(c.finish_reason)
                metrics.count_finished(c.finish_reason)
        if out.finished:
            t.done = True
            if m is not None:
                metrics.e2e_latency.observe(time.monotonic() - m.arrival_time)

    def close(self, why: str = "") -> None:
        """Abort what has not finished (a disconnect, an error, a shutdown)."""
        if self.closed:
            return
        self.closed = True
        aborted = 0
        for t in self.tracked:
            if not t.done:
                if not t.started:  # a started stream aborts in its own finally
                    self.state.async_llm.abort(t.engine_id)
                left = self.spec.params.n - len(t.finish_reasons)
                aborted += left
                self.state.metrics.count_finished("abort", left)
        if self.state.generations.get(self.request_id) is self:
            del self.state.generations[self.request_id]
        if self.tracked:
            reasons = sorted({r for t in self.tracked for r in t.finish_reasons})
            outcome = (f"aborted {aborted} choice(s){f' ({why})' if why else ''}" if aborted
                       else f"finished ({', '.join(reasons)})")
            logger.info("[entry] %s: %s in %.2f s, %d prompt + %d completion tokens", self.request_id, outcome,
                        time.monotonic() - self.start, sum(len(p.token_ids) for p in self.spec.prompts),
                        sum(sum(t.num_output_tokens.values()) for t in self.tracked))


# ---------------------------------------------------------------- logprobs

def _token_text(state: ServerState, token_id: int) -> str:
    tokenizer = state.engine.tokenizer
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def _lp(value: float | None) -> float | None:
    # JSON has no -inf; vLLM reports such a logprob as -9999.0
    return None if value is None else max(value, -9999.0)


def _completion_logprobs(state: ServerState, c: CompletionOutput, start: int, end: int,
                         text_offset: int) -> dict[str, list]:
    """The legacy completions shape, for tokens [start, end) of a choice."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    entries = c.logprobs or []
    for token_id, entry in zip(c.token_ids[start:end], entries[start:end]):
        text = _token_text(state, token_id)
        tokens.append(text)
        token_logprobs.append(_lp(entry.get(token_id)))
        top_logprobs.append({_token_text(state, t): _lp(lp)
                             for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _chat_logprobs(state: ServerState, c: CompletionOutput, start: int, end: int, top_n: int) -> dict:
    """The chat shape, {"content": [{token, logprob, bytes, top_logprobs}]}, for tokens [start, end)."""
    def item(token_id: int, lp: float | None) -> dict:
        text = _token_text(state, token_id)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}
    content = []
    entries = c.logprobs or []
    for token_id, entry in zip(c.token_ids[start:end], entries[start:end]):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**item(token_id, entry.get(token_id)),
                        "top_logprobs": [item(t, lp) for t, lp in ranked]})
    return {"content": content}


# =========================================================================== SSE

def sse(obj: Any) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {_dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def completion_events(gen: Generation, model: str) -> AsyncIterator[str]:
    spec, state = gen.spec, gen.state
    head = {"id": gen.response_id, "object": "text_completion", "created": gen.created, "model": model}
    echo_pending = set(range(len(spec.prompts) * spec.params.n)) if spec.echo else set()
    tokens_sent: dict[int, int] = {}
    text_sent: dict[int, int] = {}
    finals: dict[int, CompletionOutput] = {}
    try:
        async with contextlib.aclosing(gen.outputs()) as outputs:
            async for i, out in outputs:
                for c in out.outputs:
                    idx = gen.choice_index(i, c)
                    finals[idx] = c
                    text = c.delta_text
                    if idx in echo_pending:
                        echo_pending.discard(idx)
                        text = _prompt_text(state, spec.prompts[i]) + text
                    start, end = tokens_sent.get(idx, 0), len(c.token_ids)
                    if not text and c.finish_reason is None and (spec.logprobs is None or start == end):
                        continue  # nothing new to say (text held back for a possible stop string)
                    logprobs = None
                    if spec.logprobs is not None:
                        logprobs = _completion_logprobs(state, c, start, end, text_sent.get(idx, 0))
                    tokens_sent[idx] = end
                    text_sent[idx] = text_sent.get(idx, 0) + len(text)
                    yield sse({**head, "choices": [{"index": idx, "text": text, "logprobs": logprobs,
                                                    "finish_reason": c.finish_reason,
                                                    "stop_reason": c.stop_reason}]})
        if spec.include_usage:
            yield sse({**head, "choices": [], "usage": gen.usage(finals)})
    except Exception as e:  # the status line is gone: report in the stream
        yield sse(_stream_error(gen, e))
    yield SSE_DONE


async def chat_events(gen: Generation, model: str) -> AsyncIterator[str]:
    spec, state = gen.spec, gen.state
    head = {"id": gen.response_id, "object": "chat.completion.chunk", "created": gen.created, "model": model}
    tokens_sent: dict[int, int] = {}
    finals: dict[int, CompletionOutput] = {}
    for idx in range(spec.params.n):  # the first delta of each choice carries the role
        yield sse({**head, "choices": [{"index": idx, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
    try:
        async with contextlib.aclosing(gen.outputs()) as outputs:
            async for i, out in outputs:
                for c in out.outputs:
                    idx = gen.choice_index(i, c)
                    finals[idx] = c
                    start, end = tokens_sent.get(idx, 0), len(c.token_ids)
                    if not c.delta_text and c.finish_reason is None and (spec.logprobs is None or start == end):
                        continue
                    logprobs = None
                    if spec.logprobs is not None:
                        logprobs = _chat_logprobs(state, c, start, end, spec.logprobs)
                    tokens_sent[idx] = end
                    delta = {"content": c.delta_text} if c.delta_text else {}
                    yield sse({**head, "choices": [{"index": idx, "delta": delta, "logprobs": logprobs,
                                                    "finish_reason": c.finish_reason,
                                                    "stop_reason": c.stop_reason}]})
        if spec.include_usage:
            yield sse({**head, "choices": [], "usage": gen.usage(finals)})
    except Exception as e:
        yield sse(_stream_error(gen, e))
    yield SSE_DONE


def _stream_error(gen: Generation, e: Exception) -> dict:
    if isinstance(e, ApiError):
        error = e
    elif isinstance(e, EngineDeadError):
        error = ApiError(503, str(e))
    else:
        logger.exception("[entry] %s: the stream failed", gen.request_id)
        error = ApiError(500, "internal server error; the server log has the details")
    logger.info("[entry] %s: stream ended by an error: %s", gen.request_id, error.message)
    return error.body()


class EventStream:
    """A text/event-stream response from an async iterator of framed events.
    It stops when the client disconnects, which closes the iterator and so
    aborts the engine requests behind it; ``on_close(why)`` runs in every case."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[str], None] | None = None):
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            async with contextlib.aclosing(self.events) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        why = "the server stopped"  # unless we get further
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            done, _ = await until_disconnect(receive, pump())
            why = "" if done else "client disconnected mid-stream"
        finally:
            await self.events.aclose()  # a no-op unless pump() never started it
            if self.on_close is not None:
                self.on_close(why)


async def until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run ``work`` unless the client disconnects first, in which case it is
    cancelled. Returns (True, its result) or (False, None)."""
    async def wait_for_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        return False, None
    finally:  # also when we are cancelled ourselves (the shutdown timeout)
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


# =========================================================================== metrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)


class ServerMetrics:
    """/metrics: vLLM's metric names under ``nanoserve:``, in this app's own
    registry. Gauges and engine counters are read from ``engine.stats()`` at
    scrape time; latency histograms are fed by each request's timestamps."""

    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(async_llm, model_name))

        def histogram(name: str, doc: str):
            return Histogram(f"nanoserve:{name}", doc, ["model_name"], buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)
        self.model_name = model_name
        self._request_success = Counter("nanoserve:request_success", "Finished requests (choices), by reason",
                                        ["model_name", "finished_reason"], registry=self.registry)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first output token")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output tokens")
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled")

    def count_finished(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self._request_success.labels(self.model_name, reason).inc(n)


class _EngineStatsCollector:
    """Gauges and counters that the engine already keeps, read at scrape time."""

    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.async_llm, self.model_name = async_llm, model_name

    def collect(self):
        s = self.async_llm.engine.stats()

        def family(kind, name: str, doc: str, value: float):
            f = kind(f"nanoserve:{name}", doc, labels=["model_name"])
            f.add_metric([self.model_name], value)
            return f
        yield family(GaugeMetricFamily, "num_requests_running", "Requests in the running queue", s["num_running"])
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled",
                     s["num_waiting"])
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)",
                     s["kv_cache_usage"])
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                     s["prefix_cache_queries"])
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache",
                     s["prefix_cache_hits"])
        yield family(CounterMetricFamily, "num_preemptions", "Preemptions", s["num_preemptions"])
        yield family(CounterMetricFamily, "prompt_tokens", "Prompt tokens admitted", s["prompt_tokens"])
        yield family(CounterMetricFamily, "generation_tokens", "Tokens generated", s["generation_tokens"])


async def log_stats_periodically(state: ServerState, interval: float) -> None:
    """vLLM's periodic line: throughput, queues, KV usage, prefix hit rate, while busy."""
    last, last_time = state.engine.stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        s, now = state.engine.stats(), time.monotonic()
        dt = max(now - last_time, 1e-9)
        prompt_tps = (s["prompt_tokens"] - last["prompt_tokens"]) / dt
        gen_tps = (s["generation_tokens"] - last["generation_tokens"]) / dt
        if prompt_tps or gen_tps or s["num_running"] or s["num_waiting"]:
            queries = s["prefix_cache_queries"] - last["prefix_cache_queries"]
            hits = s["prefix_cache_hits"] - last["prefix_cache_hits"]
            logger.info("[entry] avg prompt throughput: %.1f tokens/s, avg generation throughput: %.1f tokens/s, "
                        "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                        prompt_tps, gen_tps, s["num_running"], s["num_waiting"], 100 * s["kv_cache_usage"],
                        100 * hits / queries if queries else 0.0)
        last, last_time = s, now


# =========================================================================== start-up and shutdown

def build_engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(engine_config(args))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=None if args.device == "auto" else args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method, nnodes=args.nnodes, node_rank=args.node_rank)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def banner(engine: LLMEngine, args: argparse.Namespace, url: str) -> str:
    """The start-up summary: what is served, on what, with how much KV cache."""
    mc, plan = engine.model_config, engine.kv_plan
    block_size, max_len = engine.config.block_size, engine.max_model_len
    per_request = -(-max_len // block_size)
    names = ", ".join(args.served_model_name)
    return "\n".join([
        f"nanoserve {__version__}: serving {args.model} as {names!r}",
        f"  model        {mc.architecture}, {str(engine.dtype).replace('torch.', '')} on {engine.device}, "
        f"weights {_fmt_bytes(engine.weight_bytes)}",
        f"  KV cache     {plan.num_blocks} blocks x {block_size} tokens = {plan.num_blocks * block_size} tokens "
        f"({_fmt_bytes(plan.bytes_per_block)} per block, {_fmt_bytes(plan.num_blocks * plan.bytes_per_block)})",
        f"  concurrency  {plan.num_blocks / per_request:.2f}x at max-model-len {max_len} "
        f"(max-num-seqs {args.max_num_seqs}, prefix caching {'on' if args.enable_prefix_caching else 'off'})",
        f"  URL          {url}  (OpenAI API under {url}/v1{', API key required' if args.api_key else ''})",
    ])


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model: a busy port fails fast, and port 0 is
    resolved in time for the banner."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # other libraries stay quiet
    for name in ("nanoserve", "uvicorn"):
        logging.getLogger(name).setLevel(level.upper())
    logging.getLogger("uvicorn.error").addFilter(_forced_exit_in_one_line)


def _forced_exit_in_one_line(record: logging.LogRecord) -> bool:
    """A second Ctrl-C makes uvicorn cancel the app's lifespan mid-shutdown, and
    starlette hands it the CancelledError's traceback to log: say it in one line."""
    message = record.getMessage()
    if message.startswith("Traceback") and message.rstrip().endswith("CancelledError"):
        record.msg, record.args = "[entry] forced exit: a second signal cut the shutdown short", ()
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


class _Server(uvicorn.Server):
    """uvicorn, except that a SIGINT/SIGTERM is not re-raised after the drain:
    a graceful shutdown exits with status 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            logger.info("[entry] %s: no new connections; draining requests in flight (up to %s s)",
                        signal.Signals(sig).name, self.config.timeout_graceful_shutdown)
        super().handle_exit(sig, frame)


def serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if 0 not in local_ranks(engine_config(args)):  # a node of a tensor-parallel group that only computes
        try:
            return run_worker_node(engine_config(args))
        except Exception as e:  # noqa: BLE001 - a bad configuration: one line, as below
            print(f"error: cannot run node {args.node_rank} of {args.model}: {e}", file=sys.stderr)
            return 1
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    executor = model_thread()  # every torch op of the engine runs here, its loading included
    try:
        engine = executor.submit(build_engine, args).result()
    except Exception as e:  # a clear line, not a traceback (which --log-level debug still shows)
        logger.debug("[entry] start-up failed", exc_info=True)
        print(f"error: cannot serve {args.model}: {e}", file=sys.stderr)
        sock.close()
        executor.shutdown()
        return 1
    async_llm = AsyncLLM(engine, executor)
    app = build_app(async_llm, args)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(banner(engine, args, f"http://{host}:{port}"), flush=True)
    config = uvicorn.Config(app, host=args.host, port=port, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout,
                            access_log=not args.disable_uvicorn_access_log)
    server = _Server(config)
    asyncio.run(_serve_while_healthy(server, sock, async_llm))
    dead = _engine_failure(async_llm)
    engine.shutdown()
    logger.info("[entry] shut down" + (" (exit status 1: the engine could not serve)" if dead else ""))
    return 1 if dead else 0


async def _serve_while_healthy(server: uvicorn.Server, sock: socket.socket, async_llm: AsyncLLM) -> None:
    """uvicorn, told to drain and stop (as on SIGTERM) once the engine cannot
    serve: its loop died, or a tensor-parallel worker did."""
    async def watch() -> None:
        while (failure := _engine_failure(async_llm)) is None:
            await asyncio.sleep(0.5)
        logger.error("[entry] the engine cannot serve (%s): shutting down, exit status 1", failure)
        server.should_exit = True
    watcher = asyncio.create_task(watch())
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()


def _engine_failure(async_llm: AsyncLLM) -> str | None:
    if async_llm.errored is not None:
        return f"the engine loop died: {async_llm.errored}"
    try:
        async_llm.engine.check_health()
    except Exception as e:  # noqa: BLE001 - whatever it raises is the reason
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    return serve(parse_args(argv))
