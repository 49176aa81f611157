"""Entry layer: the CLI and the OpenAI-compatible HTTP server.

This module owns
* the command line (``python -m nanoserve``), with ``vllm serve``'s flag names;
* the Starlette app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and
  Anthropic's ``/v1/messages`` (both served as chat), ``/v1/models``, ``/health`` (and ``/ping``),
  ``/metrics``, ``/tokenize``, ``/detokenize``, ``/version``, behind CORS; on the pooling runner
  ``/v1/embeddings`` (and Cohere's ``/v2/embed``), ``/pooling``, ``/classify``, ``/score`` and ``/rerank``
  instead of generation;
* the OpenAI protocol: request bodies as declarative pydantic models (as
  vLLM's ``protocol.py``; every error names its field), and one handler,
  serving path (``Generation``, as vLLM's ``serving_*.py``) and SSE stream
  that completions and chat share;
* chat's tools: the chat-template settings, and the tool-call parsers that
  turn a model's output into OpenAI's ``tool_calls`` (vLLM's --tool-call-parser);
* admission: request ids (``X-Request-Id``), the API key, the waiting-queue
  limit (429), the body-size limit (413) and time limits, stopping the admission
  of a client that leaves (``cancel_on_disconnect``), and aborting the engine
  requests of a client that disconnects;
* ``/metrics`` (Prometheus, one registry per app) and the periodic stats line;
* uvicorn start-up, the banner, connection limits, and the graceful shutdown
  on SIGINT/SIGTERM.

It hands the engine layer prompts and ``SamplingParams`` through ``AsyncLLM``
and reads back ``RequestOutput``s from one queue per HTTP request. Tokenizing runs on a thread of its own, never
on the event loop. It never touches blocks, the KV tensors or the scheduler's queues (prompt_embeds it only decodes):
what it knows of them comes from ``engine.describe()`` and ``engine.stats()``.

Read top to bottom: CLI -> protocol -> tool calls -> reasoning -> app -> handlers -> serving (admission,
the engine requests, the response) -> SSE -> the Responses API -> the Anthropic Messages API -> metrics ->
start-up and shutdown.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import hmac
import io
import itertools
import json
import logging
import math
import os
import pickle
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import typing
import uuid
import zipfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Awaitable, Callable, ClassVar, Iterable, Iterator

import h11
import partial_json_parser
import torch
import uvicorn
from partial_json_parser.core.options import Allow
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, field_validator,
                      model_validator)
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoserve import __version__
from nanoserve.engine import (DEAD_MESSAGE, LOG_DATE_FORMAT, LOG_FORMAT, MAX_JSON_DEPTH, MAX_LOGPROBS, AsyncLLM,
                              BeamSearchParams, CompletionOutput, CONTENT_FORMATS, EngineConfig, EngineDeadError,
                              InvalidInput, LLMEngine, Logprob, LoRARequest, PoolingParams, PoolingRequestOutput,
                              REASONING_PARSERS, RepetitionDetectionParams, RequestFailedError, RequestMetrics,
                              RequestOutput,
                              RequestOutputKind, SamplingParams, StructuredOutputsParams, TEXT_PARTS, THINK_TAGS,
                              TokenizedPrompt, VLLM_ENGINE_ARGS, apply_chat_template, chat_template_content_format,
                              engine_config_from_kwargs, local_ranks, merge_deltas, model_thread, nested_deeper,
                              opens_reply, parse_call_arguments, part_text, run_worker_node, score_inputs,
                              paired, score_pairs, vllm_arg_note, PoolingOutput, ScoringRequestOutput,
                              cross_encoder_scores, check_removed_pooling_task)

logger = logging.getLogger("nanoserve.entry")

BODY_TIMEOUT_S = 30.0                # the whole body must arrive within this (else 408)
HEADER_TIMEOUT_S = 10.0              # a connection must send a request's headers within this
KEEP_ALIVE_TIMEOUT_S = 5.0           # an idle keep-alive connection is closed after this
DRAIN_GRACE_S = 5.0                  # after the drain timeout: for streams to send their last event
MAX_N = 128                          # completions per prompt (n)
# engine requests (prompts x n) one HTTP request may make: each takes ~2 KB and its place in the FCFS queue, so
# a 16 MiB body of one-token prompts (3M of them) took ~6 GB and held every later request back for minutes
MAX_ENGINE_REQUESTS = 16384
MAX_STOP_WORDS = 1024                # stop, stop_token_ids, bad_words: each step of a request checks all, on the loop
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
LARGE_BODY_BYTES = 2**20             # a larger body is decoded off the event loop
GRAMMAR_COMPILE_TIMEOUT_S = 10.0     # a constraint must compile within this (else 400), as vLLM bounds a regex's
CHAT_TEMPLATE_TIMEOUT_S = 10.0       # a request's own chat_template must render within this (else 400)
MAX_OVERDUE_COMPILES = 2             # compiles past it, left to finish; more: 503 until they end
MAX_TEMPLATE_RENDERS = 4             # requests' own chat templates rendering or waiting their turn; more: 503
# how a lone surrogate gets into JSON text, and how Python's json takes numbers JSON has not (NaN, Infinity, 1e999,
# and 200 digits or more: with an exponent under 100, no shorter number is past a double's range; looked for from
# a run's first digit only, else each digit of a long run starts a new try)
_NOT_JSON_TEXT = re.compile(r"\\u[dD][89a-fA-F]|NaN|Infinity|[0-9][eE]\+?[0-9]{3}|(?<![0-9])[0-9]{200}")
_LONG_INT = re.compile(r"Exceeds the limit \((\d+) digits\) for integer string conversion: value has (\d+) digits")
_IDS_LIST = re.compile(rb'"prompt"[ \t\r\n]*:[ \t\r\n]*\[[ \t\r\n]*-?[0-9]')  # a prompt of token ids


# =========================================================================== CLI

def default_model_path() -> str:
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
    return _whole(number * base ** " KMGT".index(prefix or " "), text, "bytes")


def _whole(number: float, text: str, what: str) -> int:
    """A parsed size as an int: a number too long for a float is infinite, which int() cannot take."""
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}{'...' if len(text) > 40 else ''} is too many {what}")
    return int(number)


def _json_or_none(text: str) -> Any:
    """A flag's JSON value, None where it is not JSON (or nested too deep for json: a RecursionError)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _json_list(text: str) -> list[str]:
    """--allowed-origins and its kin, as vLLM takes them: a JSON list of strings."""
    value = _json_or_none(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


def _json_object_or_level(text: str) -> dict[str, Any] | int:
    """--compilation-config, as vLLM's: a JSON object, or an integer (a level)."""
    value = _json_or_none(text)
    if not isinstance(value, (dict, int)) or isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"cudagraph_capture_sizes\": [1, 2, 4]}}' "
                                         f"or a level, got {text!r}")
    return value


def _lora_module(text: str) -> LoRARequest:
    """--lora-modules' items as vLLM takes them: NAME=PATH, or a JSON object with "name" and "path"
    (its "base_model_name" is the served model's anyway). Ids are given in parse_args."""
    value = _json_or_none(text) if text.lstrip().startswith("{") else dict(zip(("name", "path"), text.split("=", 1)))
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str) \
            or not value["name"] or not value["path"]:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or '{{\"name\": NAME, \"path\": PATH}}', got {text!r}")
    return LoRARequest(value["name"], 0, value["path"])


def _json_object(text: str) -> dict[str, Any]:
    """--override-generation-config and its kin: a JSON object."""
    value = _json_or_none(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"temperature\": 0.5}}', got {text!r}")
    return value


def _token_count(text: str) -> int | None:
    """--max-model-len and --max-num-batched-tokens, as vLLM's human_readable_int: 4096, 32k (32,000),
    32K (32,768), 1.5M; also auto or -1, the default (None)."""
    if text.strip() in ("auto", "-1"):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgtKMGT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a number of tokens such as 4096, 32k or 32K, got {text!r}")
    number, unit = m.groups()
    scale = (1000 if unit.islower() else 1024) ** ("kmgt".index(unit.lower()) + 1) if unit else 1
    return _whole(float(number) * scale, text, "tokens")


def _dashes(arg: str) -> str:
    """--max_model_len[=N] -> --max-model-len[=N]: vLLM's parser takes both spellings (and -O=3 for -O3)."""
    if not arg.startswith("--"):
        return "-O" + arg[3:] if arg.startswith("-O=") else arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


_ON_OFF = {"action": argparse.BooleanOptionalAction}
_SHORT_FLAGS = {"quantization": ["-q"], "pipeline_parallel_size": ["-pp"], "data_parallel_size": ["-dp"],
                "optimization_level": ["-O"]}  # -O3, -O 3 (and -O=3: _dashes), as vLLM's parser


def _vllm_flag(name: str, kind: type) -> tuple[str, dict[str, Any]]:
    """An engine argument of VLLM_ENGINE_ARGS as a flag: --name-with-dashes and its argparse keywords."""
    kwargs = _ON_OFF if kind is bool else {"type": _json_object if kind is dict else kind,
                                           "metavar": {int: "N", float: "N", dict: "JSON"}.get(kind, "VALUE")}
    return "--" + name.replace("_", "-"), {"flags": _SHORT_FLAGS.get(name, []), **kwargs}


# vLLM flags that a copied `vllm serve` line carries and nanoserve takes without acting on
# them: the flag, its argparse keywords, the values taken (None: any), and what nanoserve
# does instead, logged when the flag is given. Any other value stops start-up with that
# line, since taking it would change what is served. First the engine's arguments, which
# LLM() takes too (engine.VLLM_ENGINE_ARGS; --disable-log-stats is the server's own flag),
# then the server's.
VLLM_FLAGS: list[tuple[str, dict[str, Any], tuple | None, str]] = [
    (*_vllm_flag(name, kind), taken, note) for name, (kind, taken, note) in VLLM_ENGINE_ARGS.items()
    if name != "disable_log_stats"] + [
    ("--disable-log-requests", _ON_OFF, None, "prompts are logged only with --enable-log-requests; the "
     "line per finished request (its id and token counts) stays"),
    ("--disable-fastapi-docs", _ON_OFF, None, "nanoserve serves no /docs, /redoc or /openapi.json"),
    ("--enable-request-id-headers", _ON_OFF, None, "X-Request-Id is always echoed"),
    ("--disable-frontend-multiprocessing", _ON_OFF, None, "the HTTP server and the engine share one process"),
    ("--response-role", {"metavar": "ROLE"}, ("assistant",), "replies have the role assistant"),
    ("--api-server-count", {"type": int, "metavar": "N"}, (1,), "one process serves HTTP"),
    ("--enable-log-outputs", _ON_OFF, None, "outputs are not logged (--enable-log-requests logs the prompts)"),
]


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        """One line (argparse's usage of every flag would bury it)."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def make_arg_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog="python -m nanoserve", formatter_class=_HelpFormatter,
        description="Serve a Hugging Face model (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Granite, Phi-3; "
                    "the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoe, GLM-4.5) with an "
                    "OpenAI-compatible API.")
    g = p.add_argument_group("model")
    g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    g.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model directory (config.json, safetensors, tokenizer), or a hub id such "
                        "as Qwen/Qwen3-0.6B (the local Hugging Face cache; a download unless HF_HUB_OFFLINE=1) "
                        "(default: the packaged demo model, if there is one)")
    g.add_argument("--revision", default=None, help="the hub revision of a hub id (default: main)")
    g.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache a hub id is found in or downloaded to, as vLLM's (default: "
                        "$HF_HUB_CACHE, else ~/.cache/huggingface/hub)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="load the tokenizer from here, a directory or a hub id (default: the model's)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults: auto takes the model's generation_config.json, vllm none, or a "
                        "directory's; a request's own fields win (a directory's max_new_tokens caps them)")
    g.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help="generation_config fields laid over those, e.g. '{\"temperature\": 0.5}'; its "
                        "max_new_tokens caps every request's max_tokens")
    g.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help="config.json keys laid over the checkpoint's, as vLLM's, e.g. YaRN for a long context: "
                        "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 32768}}'")
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: serve embeddings (/v1/embeddings) instead of generating; auto picks it for a "
                        "sentence-transformers checkpoint (modules.json) or a bare decoder (config.json's "
                        "Qwen3Model, MistralModel ...)")
    g.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "classify"],
                   help="embed: a decoder's final hidden states pooled into embeddings (the pooling runner); "
                        "classify: a causal LM served as a classifier (its score head built from LM-head rows "
                        "by --hf-overrides' classifier_from_token and method, as vLLM's)")
    g.add_argument("--task", default="auto", choices=["auto", "generate", "embed", "embedding", "classify", "score"],
                   help="older vLLM's spelling: embed is --runner pooling, classify and score --convert classify")
    g.add_argument("--pooler-config", "--override-pooler-config", type=_json_object, default=None, metavar="JSON",
                   help="the pooling runner's pooler, as vLLM's: '{\"pooling_type\": \"MEAN\", "
                        "\"use_activation\": false}' (LAST, MEAN or CLS; use_activation: L2-normalize; "
                        "default: the checkpoint's sentence-transformers config, else LAST, normalized); "
                        "\"task\": \"token_embed\" or \"token_classify\" serves every token's row on /pooling")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) clients pass as `model`; the first is used in responses "
                        "(default: the --model value)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "half", "float"],
                   help="weight and KV dtype; auto: the checkpoint's on a GPU, bfloat16 on a CPU")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if available, else cpu")
    g.add_argument("--wna16-weights", default="auto", choices=["auto", "packed", "dequantized"],
                   help="an int4/int8 weight-only checkpoint's (GPTQ, AWQ, compressed-tensors) linear weights: "
                        "kept packed (the checkpoint's memory) or dequantized at load (about 4x it, faster on "
                        "the CPU); auto: packed on CUDA, dequantized on the CPU")
    g.add_argument("--max-model-len", type=_token_count, default=None,
                   help="prompt + output tokens per request, e.g. 4096 or 32k (default, or auto: the model's "
                        "limit, capped by what the KV cache holds)")
    g.add_argument("--disable-sliding-window", action="store_true",
                   help="as vLLM's: --max-model-len defaults to (and may not pass) the model's sliding window, "
                        "if it has one, within which full attention is the same")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    g.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                   help="the most logprobs and prompt_logprobs (chat: top_logprobs) a request may ask for; -1: "
                        "no cap (a request's -1 asks for the whole vocabulary)")
    g.add_argument("--logits-processors", nargs="+", default=None, metavar="MODULE:CLASS",
                   help="custom logits processors, as vLLM's: nanoserve.LogitsProcessor subclasses, importable "
                        "from this Python; a request passes them arguments in vllm_xargs")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT's format) beside the base model, as vLLM's: a request names one "
                        "as its model")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="the adapters, loaded at start-up: NAME=PATH, or a JSON object with name and path")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank taken, as vLLM's")
    g.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="LoRA adapters kept in host memory, as vLLM's (default: --max-loras; at least that): one "
                        "dropped from there is read again from its path when a request needs it")
    g.add_argument("--max-loras", type=int, default=1,
                   help="LoRA adapters on the device at once, as vLLM's: their slots are reserved before the KV "
                        "cache is sized, and a step runs at most this many (others wait their turn)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs, no torch.compile, no C kernels: the torch references (and Triton "
                        "on CUDA), eagerly; on the CPU bf16 linear weights are still packed for oneDNN")
    g.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs (default: 1 2 4 8 16 ... up to "
                        "--max-num-seqs, at most --max-cudagraph-capture-size and --max-num-batched-tokens)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="the largest decode batch size captured by default (512), as vLLM's; beside "
                        "--cudagraph-capture-sizes, their largest")
    g.add_argument("--compilation-config", "-cc", type=_json_object_or_level, default=None, metavar="JSON",
                   help="as vLLM's (and LLM()'s compilation_config): its cudagraph_capture_sizes and "
                        "max_cudagraph_capture_size are taken, its level or mode (or an integer) does nothing here")
    g.add_argument("--cpu-allocator-tuning", action=argparse.BooleanOptionalAction, default=True,
                   help="on the CPU, set transparent huge pages and glibc malloc for speed, and cap oneDNN's "
                        "GEMM caches for memory, process-wide")

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
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most requests running in one step (default: 256, at most --max-num-batched-tokens)")
    g.add_argument("--max-num-batched-tokens", type=_token_count, default=None,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                        "(default: max(8192, --max-num-seqs))")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="as vLLM's: first come, first served, or by each request's priority (lower first, then "
                        "arrival; the lowest is preempted first)")
    g.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="as vLLM's: a stream sends a chunk every N tokens (and its first and last), less work "
                        "per token for the server; a request's stream_interval may ask for more")
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule and launch step N+1 before step N's tokens reach the host, hiding host work "
                        "behind the GPU's (same outputs; not with --tensor-parallel-size > 1)")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help="as vLLM's: speculative decoding with n-gram (prompt lookup) drafts, e.g. '{\"method\": "
                        "\"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": "
                        "2}', and \"num_speculative_tokens_per_batch_size\": [[1, 8, 3], [9, 256, 0]] for fewer or no "
                        "drafts in bigger batches (no draft models; turns --async-scheduling off)")

    g = p.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128],
                   help="tokens per KV block")
    g.add_argument("--kv-cache-memory-bytes", type=_parse_bytes, default=None, metavar="BYTES",
                   help="KV cache budget, e.g. 4GiB (default: on a GPU what --gpu-memory-utilization leaves; "
                        "on a CPU the least of 4 GiB, a quarter of the RAM beside the weights (at least "
                        "64 MiB), and what --max-num-seqs requests of --max-model-len can fill)")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None,
                   help="exact number of KV blocks (vLLM's --num-gpu-blocks-override); overrides "
                        "--kv-cache-memory-bytes (default: as many as the budget buys)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a shared prompt prefix")
    g.add_argument("--enable-prompt-embeds", action="store_true",
                   help="take completions' prompt_embeds (base64 of torch.save(tensor [tokens, hidden_size])), as "
                        "vLLM's: the tensors are loaded with torch.load(weights_only=True)")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0",
                   help="address to listen on: all interfaces, as vLLM's (127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix socket instead of --host and --port, as vLLM's")
    g.add_argument("--root-path", default=None, metavar="PREFIX",
                   help="the path a proxy serves this server under, as vLLM's: /PREFIX/v1/... is served as "
                        "/v1/... (which is served too)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate (chain), as vLLM's (default: plain HTTP)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="the certificate's private key (default: in --ssl-certfile)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="CA certificates client certificates "
                   "are checked against")
    g.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=0,
                   help="client certificates: 0 none, 1 optional, 2 required (Python ssl's CERT_*)")
    g.add_argument("--ssl-ciphers", default=None, metavar="CIPHERS", help="TLS 1.2 cipher suites (OpenSSL's list "
                   "format)")
    g.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` (any of the keys) on /v1/* "
                        "(default: $NANOSERVE_API_KEY, else $VLLM_API_KEY, else no key)")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: the origins whose pages may call the API, a JSON list")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: the methods they may use, a JSON list")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: the headers they may send, a JSON list")
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="CORS: let them send cookies and Authorization")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 429 while this many engine requests (prompts x n) wait for the "
                        "scheduler (default: no limit)")
    g.add_argument("--max-request-body-bytes", type=_parse_bytes, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="BYTES", help="answer 413 to a larger request body")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long in-flight requests may run before they are aborted")

    g = p.add_argument_group("chat")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the chat template, a file or an inline Jinja string (default: the tokenizer's)")
    g.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                   help="how a message's content reaches the template: string (text parts joined by newlines), "
                        "openai (a list of {type: text, text} parts), auto (the one the template reads)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (Jinja run on the server)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": parse tool calls out of the output (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format: hermes (Qwen2.5, Qwen3: <tool_call>{...}</tool_call>), "
                        "llama3_json (Llama 3.1+: the output is one JSON object), "
                        "pythonic (Llama 3.2/4: the output is a Python list of calls), "
                        "mistral (Mistral: [TOOL_CALLS] then the calls), "
                        "openai (gpt-oss: harmony messages to functions.NAME)")
    g.add_argument("--tool-strict-level", default="auto", choices=TOOL_STRICT_LEVELS,
                   help='which calls a structural tag of the parser\'s format holds (hermes, llama3_json, openai): '
                        'auto (forced calls, and "auto" where a tool is strict), function (every request with '
                        'tools), parameter (the same, every tool\'s arguments per its schema as if strict)')
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split chat output into reasoning_content (<think>...</think>) and content: deepseek_r1 "
                        "(the output starts thinking), qwen3 (both tags needed), openai_gptoss (gpt-oss's harmony: "
                        "the analysis channel is the reasoning, final the content); tool calls are read from the "
                        "content, and structured outputs start after </think>")
    g.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=False,
                   help="logprobs name tokens as token_id:N, unless a request's return_tokens_as_token_ids says")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='with tool_choice "none", the tools are not passed to the chat template')
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="chat_template_kwargs every chat request gets, under its own, e.g. "
                        "'{\"enable_thinking\": false}'")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream carries usage, in each chunk and at the end, as if its stream_options "
                        "asked for both")

    g = p.add_argument_group("logging")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug shows each request's path through every layer")
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="how often to log throughput and queue stats while busy")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")
    g.add_argument("--disable-access-log-for-endpoints", default=set(),
                   type=lambda v: {p.strip() for p in v.split(",") if p.strip()}, metavar="PATHS", help="no access-log line for these paths, as vLLM's: "
                   "comma-separated, e.g. /health,/metrics,/ping")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["trace", "debug", "info", "warning", "error", "critical"],
                   help="uvicorn's own log level (default: --log-level), as vLLM's flag")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request's prompt, its token ids and sampling parameters as it is admitted")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="the most prompt characters and token ids a --enable-log-requests line shows "
                        "(default: all)")

    g = p.add_argument_group("vLLM flags taken without effect",
                             "so that a `vllm serve` command line runs: each given one logs what nanoserve "
                             "does instead; a value it does not take stops start-up")
    for flag, kwargs, taken, note in VLLM_FLAGS:
        kwargs = dict(kwargs)
        shown = [str(t) for t in taken or () if t is not None]  # None: left out, which a flag cannot be
        only = "" if taken is None else f" (takes only: {', '.join(shown)})" if shown else " (refused)"
        g.add_argument(*kwargs.pop("flags", []), flag, default=argparse.SUPPRESS, help=note + only, **kwargs)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_arg_parser()
    argv = [_dashes(a) for a in (sys.argv[1:] if argv is None else argv)]
    if given := next((a for a in argv if a.startswith("-") and a.endswith("=--")), None):
        # Python 3.11's argparse takes --flag=-- as an empty list, which no check expects
        parser.error(f"{given.partition('=')[0]}: '--' is not a value")
    if argv[:1] == ["serve"]:  # `nanoserve serve MODEL`, as `vllm serve MODEL` (a directory named serve: ./serve)
        argv = argv[1:]
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.model is None:
        try:
            args.model = default_model_path()
        except ValueError as e:
            parser.error(str(e))
    checks = [("--port", 0 <= args.port <= 65535, "in [0, 65535]"),
              ("--host", _host_name(args.host), "a host name or address"),
              ("--max-num-seqs", args.max_num_seqs is None or args.max_num_seqs >= 1, ">= 1"),
              ("--gpu-memory-utilization", 0 < args.gpu_memory_utilization <= 1, "in (0, 1]"),
              ("--max-queue-len", args.max_queue_len is None or args.max_queue_len >= 1, ">= 1"),
              ("--stream-interval", args.stream_interval >= 1, ">= 1"),
              ("--max-request-body-bytes", args.max_request_body_bytes >= 1, ">= 1"),
              ("--shutdown-timeout", args.shutdown_timeout >= 0, ">= 0"),
              ("--max-logprobs", args.max_logprobs >= -1, ">= 0, or -1 (no cap: the whole vocabulary)"),
              ("--max-log-len", args.max_log_len is None or args.max_log_len >= 0, ">= 0"),
              ("--log-stats-interval", args.log_stats_interval > 0, "> 0"),
              ("--max-cudagraph-capture-size",
               args.max_cudagraph_capture_size is None or args.max_cudagraph_capture_size >= 1, ">= 1")]
    for flag, ok, rule in checks:
        if not ok:
            parser.error(f"{flag} must be {rule}")
    if args.root_path is not None and args.root_path.rstrip("/") and not args.root_path.startswith("/"):
        parser.error(f"--root-path must start with /, got {args.root_path!r}")
    args.root_path = (args.root_path or "").rstrip("/") or None
    if args.root_path:  # the access line has the path as sent, the proxy's prefix included
        args.disable_access_log_for_endpoints |= {args.root_path + p for p in args.disable_access_log_for_endpoints}
    if args.ssl_keyfile is not None and args.ssl_certfile is None:
        parser.error("--ssl-keyfile needs --ssl-certfile, the certificate it is the key of")
    if args.ssl_certfile is not None:
        try:  # a bad file is one line now, not a traceback after the model has loaded
            uvicorn.config.create_ssl_context(args.ssl_certfile, args.ssl_keyfile, None,
                                              uvicorn.config.SSL_PROTOCOL_VERSION, args.ssl_cert_reqs,
                                              args.ssl_ca_certs, args.ssl_ciphers)
        except (OSError, ValueError) as e:  # ssl.SSLError too; ValueError: a NUL in a path
            parser.error(f"cannot serve HTTPS with --ssl-certfile {args.ssl_certfile} (--ssl-keyfile "
                         f"{args.ssl_keyfile}): {e}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser NAME")
    if args.async_scheduling and args.tensor_parallel_size > 1:
        parser.error("--async-scheduling does not work with --tensor-parallel-size > 1 (yet)")
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except ValueError as e:
            parser.error(str(e))
    args.served_model_name = args.served_model_name or [args.model]
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    args.lora_modules = [dataclasses.replace(m, lora_int_id=i) for i, m in enumerate(args.lora_modules or [], 1)]
    names = [m.lora_name for m in args.lora_modules]
    if clash := sorted({n for n in names if names.count(n) > 1 or n in args.served_model_name}):
        parser.error(f"--lora-modules: each adapter needs a name of its own, not a served model's: {clash}")
    args.vllm_notes = []  # logged at start-up
    for flag, _, taken, note in VLLM_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            given = flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}"
            try:
                args.vllm_notes.append(vllm_arg_note(given, value, taken, note, "flag"))
            except ValueError as e:
                parser.error(str(e))
    try:  # EngineConfig's checks, as argparse's: one line and exit 2, before anything loads; silent, since
        with _unlogged("nanoserve.engine"):  # serve() builds it again, once logging is set up, and that logs
            engine_config(args)
    except ValueError as e:
        parser.error(str(e))
    args.api_key, args.api_key_from = api_keys(args.api_key)
    return args


def _host_name(host: str) -> bool:
    """Whether the socket module can look ``host`` up: it raised TypeError (a traceback at start-up, after the
    checks) on a NUL or on a name its IDNA codec cannot encode, as a lone surrogate from undecodable argv bytes."""
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return "\x00" not in host


def api_keys(flag: list[str] | None) -> tuple[list[str] | None, str | None]:
    """The keys a request may bring, and where they came from: as vLLM, --api-key's (a list)
    wins, then $NANOSERVE_API_KEY, then $VLLM_API_KEY; an empty key is unset."""
    for keys, source in ((flag or [], "--api-key"), ([os.environ.get("NANOSERVE_API_KEY")], "$NANOSERVE_API_KEY"),
                         ([os.environ.get("VLLM_API_KEY")], "$VLLM_API_KEY")):
        keys = [k for k in keys if k]
        if keys:
            return keys, source
    return None, None


def load_chat_template(value: str) -> str:
    """--chat-template, as vLLM reads it: a file's text, or the value itself when it is a template."""
    error = None
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text()
    except (OSError, RuntimeError, UnicodeDecodeError) as e:  # a name too long for a file's (ENAMETOOLONG),
        # ~nosuchuser, unreadable, not UTF-8 text
        error = e
    if any(c in value for c in "{}\n"):
        return value
    if error is not None:
        raise ValueError(f"--chat-template {value[:60]!r}: cannot read it as a file ({error.__class__.__name__}: "
                         f"{getattr(error, 'strerror', None) or error}), and it is not a Jinja template either")
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template either")


# =========================================================================== protocol
# OpenAI's request bodies as pydantic models, as vLLM's protocol.py has them:
# types and defaults here, in pydantic's lax mode as vLLM's ("5" and 5.0 are 5,
# 1 and "true" are true; 2.5 is no integer; numbers finite; null is the default);
# value ranges in SamplingParams, except the server's own (logit_bias clamped to [-100, 100], n <= MAX_N,
# MAX_STOP_WORDS: here), so
# both share one rule, and an engine error is reported under the body's own field name
# (param_name). Every declared field is used or refused, and so is every other
# field of vLLM's schemas (UNSUPPORTED_FIELDS: a 400 naming it unless it asks for
# nothing); fields unknown to vLLM too are ignored with a warning, as vLLM does,
# so newer clients keep working (tests/test_fields.py holds vLLM's list).

class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {message, type, param, code}}."""
    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
             429: "RateLimitError", 500: "InternalServerError", 501: "NotImplementedError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape, which /v1/messages answers in (as vLLM's), its type by the status as Anthropic's."""
        kind = ANTHROPIC_ERRORS.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> Response:
        return json_response(self.anthropic_body() if anthropic else self.body(), self.status, self.headers)


ANTHROPIC_ERRORS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error"}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


Number = Annotated[float, Field(allow_inf_nan=False)]
MAX_REQUEST_ID = 1024  # a request id, body's or X-Request-Id's, in characters (vLLM sets no bound; it is logged)
_UNSET = (None,)
_NO_LIST, _NO_DICT = (None, []), (None, {})  # vLLM reads these by their truth: an empty one asks for nothing
# vLLM request fields that nanoserve does not implement: a 400 naming the field,
# unless it is left at a value that asks for nothing (vLLM's default).
UNSUPPORTED_FIELDS: dict[str, tuple[tuple, str]] = {
    "watermarking": ((None, False), "watermarking is not implemented"),
    "logits_processors": (_NO_LIST, "per-request logits_processors are not supported, as in vLLM V1: start the "
                                    "server with --logits-processors module:Class and pass a request's arguments "
                                    "in vllm_xargs"),
    "kv_transfer_params": (_NO_DICT, "disaggregated serving (KV transfer) is not supported"),
    "ec_transfer_params": (_NO_DICT, "disaggregated serving (encoder-cache transfer) is not supported"),
    "routed_experts_prompt_start": ((None, 0), "returning the experts a mixture-of-experts model routed each token "
                                               "to is not implemented"),
    "media_io_kwargs": (_NO_DICT, "multimodal inputs are not supported"),
    "mm_processor_kwargs": (_NO_DICT, "multimodal inputs are not supported"),
}
_LAX = {t: TypeAdapter(t) for t in (bool, int, float)}
# The fields that change sampling, which beam search (ranking raw logprobs) would ignore, as vLLM does
BEAM_SEARCH_IGNORES = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                       "logit_bias", "stop", "stop_token_ids", "min_tokens", "bad_words", "prompt_logprobs",
                       "logprob_token_ids", "thinking_token_budget", "stream_interval", "repetition_detection",
                       "max_repetition_pattern_size", "echo", "vllm_xargs")


def _coerces_to(value: Any, harmless: Any) -> bool:
    """``value`` is ``harmless`` once pydantic's lax mode makes it that type (0 and "false" are false)."""
    if harmless is None or value is None:
        return value is harmless
    if isinstance(harmless, (list, dict)):
        return value == harmless and type(value) is type(harmless)
    try:
        return _LAX[type(harmless)].validate_python(value) == harmless
    except ValidationError:
        return False


# vLLM's older fields for repetition_detection's max_pattern_size, min_pattern_size and min_count
FLAT_REPETITION = ("max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count")
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structural_tag")


class _Strict(BaseModel):
    """A body's model: lax types (as vLLM's), finite numbers, and null as the field's default."""
    model_config = ConfigDict(extra="allow")
    null_kept: ClassVar[frozenset[str]] = frozenset()  # fields whose null means something else than the default

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k in cls.null_kept}


class OpenAIBaseModel(_Strict):
    prompt_field: ClassVar[str] = "prompt"  # where the engine's "prompt" came from

    model: str | None = None

    def param_name(self, engine_param: str) -> str:
        """This body's name for what an engine error calls ``engine_param``."""
        return {"prompt": self.prompt_field, "request_id": "X-Request-Id"}.get(engine_param, engine_param)

    def invalid(self, e: InvalidInput) -> ApiError:
        """An engine error as a 400, in the words of this body's own fields."""
        name, message = self.param_name(e.param), str(e)
        if name != e.param and message.startswith(e.param):  # and its sub-field, which this body's has not
            message = name + re.sub(r"^(\.\w+)+", "", message[len(e.param):])
        return bad_request(message, name)


class StreamOptions(_Strict):
    include_usage: bool | None = True  # vLLM's default: a stream_options object asks for the usage chunk
    continuous_usage_stats: bool | None = False  # with include_usage: each chunk carries its choice's usage so far
    # as vLLM's: a null is kept, and asks for nothing
    null_kept: ClassVar[frozenset[str]] = frozenset({"include_usage", "continuous_usage_stats"})


class GenerationRequest(OpenAIBaseModel):
    """The fields completions and chat share (OpenAI's, and vLLM's extras)."""

    n: int = Field(1, le=MAX_N)
    best_of: int | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: int = 0
    min_p: Number = 0.0
    seed: int | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    logit_bias: dict[str, Number] | None = Field(
        None, description="an object mapping token ids to numbers (clamped to [-100, 100])")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # fast tokenizers decode as they do (vLLM's detokenizer too)
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description='an object such as {"include_usage": true}')
    user: str | None = None  # the caller's end user: logged with the request
    session_id: str | None = None  # as user: a label (vLLM routes by it; one server has nowhere to route)
    return_token_offsets: bool = False  # vLLM's render endpoints only, ignored on these as vLLM does
    return_mm_kwargs: bool = True       # likewise
    echo: bool = False
    prompt_logprobs: int | None = None  # -1: the whole vocabulary (as vLLM's); the range: SamplingParams
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: typing.Literal["left", "right"] = Field("left", description='"left" (keep the last tokens) '
                                                                                  'or "right" (the first)')
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    request_id: str | None = Field(None, description=f"a string of 1 to {MAX_REQUEST_ID} printable characters")
    cache_salt: str | None = Field(None, min_length=1, max_length=1024,
                                   description="a string of 1 to 1024 characters")
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema" | "structural_tag", ...}')
    structured_outputs: StructuredOutputsParams | None = Field(  # typed as vLLM's: json_object 0 asks for nothing
        None, description="an object with one of json, regex, choice, grammar, json_object, structural_tag")
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None  # vLLM v0.10's field (a JSON text), later structured_outputs.structural_tag
    thinking_token_budget: int | None = Field(None, description="with --reasoning-parser: </think> after this many "
                                                                "thought tokens (-1: no budget)")
    stream_interval: int | None = Field(None, description="a stream's chunks every N tokens (the server's "
                                                          "--stream-interval if larger)")
    logprob_token_ids: list[int] | None = Field(None, description="the logprobs of these tokens (at most 128) at each "
                                                                 "position, in place of the top ones")
    priority: int = Field(0, description="with --scheduling-policy priority: lower is served first")
    # vLLM's: end with finish_reason "repetition" once the output repeats itself (and its older flat fields)
    repetition_detection: RepetitionDetectionParams | None = None
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0
    # as vLLM's: SamplingParams.extra_args, for custom extensions: the --logits-processors read them
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    use_beam_search: bool = False  # n beams, the n best the choices (engine.BeamSearch)
    length_penalty: Number = 1.0

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float]) -> dict[str, float]:
        for key in v:
            if not re.fullmatch(r"\d{1,9}", key):
                raise ValueError(f"logit_bias keys must be token ids, got {show(key)}")
        return {key: min(100.0, max(-100.0, bias)) for key, bias in v.items()}  # clamped, as vLLM's from_optional

    @field_validator("stop", "stop_token_ids", "bad_words")
    @classmethod
    def _few_words(cls, v: Any, info) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP_WORDS:
            raise ValueError(f"{info.field_name} must hold at most {MAX_STOP_WORDS} entries (each step of the request "
                             f"checks them all), got {len(v)}")
        return v

    @field_validator("structured_outputs", "repetition_detection", mode="before")
    @classmethod
    def _known_fields(cls, v: Any, info) -> Any:
        kind = {"structured_outputs": StructuredOutputsParams, "repetition_detection": RepetitionDetectionParams}
        unknown = sorted(set(v) - set(kind[info.field_name].__dataclass_fields__)) if isinstance(v, dict) else ()
        if unknown:  # a dataclass takes any key
            raise InvalidInput(info.field_name, f"{info.field_name} has unknown field(s) {unknown}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        for name, (harmless, why) in UNSUPPORTED_FIELDS.items():
            if isinstance(data, dict) and name in data and not any(_coerces_to(data[name], v) for v in harmless):
                raise InvalidInput(name, f"{name} is not supported: {why}")
        return data

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, v: str) -> str:
        """Any string, as vLLM's, but one that can be logged and sent back in X-Request-Id as it is."""
        if not (0 < len(v) <= MAX_REQUEST_ID and v.isprintable() and v.strip(" ") == v):
            raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID} printable characters (no control characters, "
                             f"no leading or trailing space), got {show(v)}")
        return v

    @model_validator(mode="after")
    def _shared_rules(self) -> "GenerationRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidInput("best_of", "best_of is not supported: leave it out or make it equal to n")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:  # {} goes
            raise InvalidInput("stream_options", "stream_options needs stream: true")
        if self.prompt_logprobs and self.stream:  # as vLLM: 0 goes
            raise InvalidInput("prompt_logprobs", "prompt_logprobs are not available when stream=true")
        return self

    def sampling_params(self, defaults: dict[str, Any], override_max_tokens: int | None = None) -> SamplingParams:
        """Raises InvalidInput (SamplingParams checks the ranges). ``defaults``
        (the model's generation config) fill the fields this body leaves out;
        ``override_max_tokens`` (the engine's) caps max_tokens."""
        fields = {name: getattr(self, name) for name in SamplingParams.__dataclass_fields__  # same name, same meaning
                  if name in GenerationRequest.model_fields}
        # as vLLM's: listed ids take the place of the top-N count (SamplingParams counts them)
        logprobs = None if self.logprob_token_ids else self.requested_logprobs()
        fields.update(max_tokens=self.requested_max_tokens(), logprobs=logprobs, extra_args=self.vllm_xargs or None,
                      repetition_detection=self.repetition_spec(),
                      prompt_logprobs=self.requested_prompt_logprobs(), structured_outputs=self.structured_spec())
        given = {name for name in self.model_fields_set if getattr(self, name) is not None}  # a kept null: not given
        # as vLLM's get_max_tokens: the body's max_tokens (completions': 16 unless given), else the model's
        max_tokens = fields["max_tokens"] if fields["max_tokens"] is not None else defaults.get("max_tokens")
        caps = [v for v in (max_tokens, override_max_tokens) if v is not None]
        fields.update({k: v for k, v in defaults.items() if k not in given}, max_tokens=min(caps, default=None))
        if self.use_beam_search:  # n beams, nothing sampled: greedy's rule of n == 1 is not beam search's
            fields["temperature"] = 1.0
        return SamplingParams(**fields)

    def param_name(self, engine_param: str) -> str:
        if engine_param == "beam_width":
            return "n"
        if engine_param == "extra_args":  # what this body sends them in
            return "vllm_xargs"
        if engine_param == "structured_outputs":  # the field this body gave its constraint in
            return next((n for n in STRUCTURED_FIELDS if getattr(self, n) is not None), engine_param)
        if engine_param == "request_id" and self.request_id is not None:
            return "request_id"
        return super().param_name(engine_param)

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams | None:
        """use_beam_search's parameters, from ``params`` (None without it). vLLM ignores the
        sampling fields beam search does not read; here one given is a 400 naming it."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise InvalidInput("length_penalty", "length_penalty applies to beam search: it needs "
                                                     "use_beam_search: true")
            return None
        fields = type(self).model_fields
        ignored = [name for name in BEAM_SEARCH_IGNORES if name in self.model_fields_set
                   and getattr(self, name) not in (None, fields[name].default, [], {})]
        if params.structured_outputs is not None:  # tool_choice's, named as such (not as the tools' schemas)
            ignored.append("tool_choice" if self.tools_constrain() else self.param_name("structured_outputs"))
        if ignored:
            raise InvalidInput(ignored[0], f"{ignored[0]} does not apply to beam search (use_beam_search), which "
                                           f"reads n (the beam width), max_tokens, ignore_eos, length_penalty, "
                                           f"include_stop_str_in_output, allowed_token_ids and logprobs")
        return BeamSearchParams(params.n, params.max_tokens, params.ignore_eos, self.temperature,
                                self.length_penalty, params.include_stop_str_in_output, params.allowed_token_ids,
                                params.logprobs, params.skip_special_tokens)

    def repetition_spec(self) -> RepetitionDetectionParams | None:
        """repetition_detection, or vLLM's older three fields (given when any is not 0)."""
        flat = (self.max_repetition_pattern_size, self.min_repetition_pattern_size, self.repetition_min_count)
        if self.repetition_detection is not None:
            if any(flat):
                raise InvalidInput("repetition_detection", "give repetition_detection or max_repetition_pattern_size, "
                                                           "min_repetition_pattern_size and repetition_min_count, "
                                                           "not both")
            return self.repetition_detection
        if not any(flat):
            return None
        try:
            return RepetitionDetectionParams(*flat)
        except InvalidInput:  # the engine's rule, in the names of the fields this body gave
            max_size, min_size, _ = flat
            culprit = FLAT_REPETITION[0 if max_size < 0 else 1 if not 0 <= min_size <= max_size else 2]
            given = ", ".join(f"{name} {value}" for name, value in zip(FLAT_REPETITION, flat))
            raise InvalidInput(culprit, f"{culprit}: these fields need 0 <= min_repetition_pattern_size <= "
                                        f"max_repetition_pattern_size and, with max_repetition_pattern_size > 0, "
                                        f"repetition_min_count >= 2; got {given}") from None

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The one constraint this body asks for, from whichever field it used."""
        sources = {name: getattr(self, name) for name in STRUCTURED_FIELDS
                   if getattr(self, name) is not None and getattr(self, name) != {"type": "text"}}
        if len(sources) > 1:
            raise InvalidInput(sorted(sources)[1], f"give one structured-output constraint, not {sorted(sources)}")
        if not sources:
            return None
        (name, value), = sources.items()
        if name.startswith("guided_"):
            return StructuredOutputsParams(**{name[len("guided_"):]: value})
        if name == "structured_outputs":
            return value
        if name == "structural_tag":
            return StructuredOutputsParams(structural_tag=value)
        kind = value.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "structural_tag":  # as vLLM: the whole object is the tag (xgrammar's form, or structures/triggers)
            return StructuredOutputsParams(structural_tag=value)
        spec = value.get("json_schema") if kind == "json_schema" else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidInput("response_format", 'response_format must be {"type": "text"}, {"type": "json_object"}, '
                                                  '{"type": "json_schema", "json_schema": {"name": ..., "schema": '
                                                  '{...}}} or {"type": "structural_tag", ...}')
        return StructuredOutputsParams(json=schema)

    # what differs between the two endpoints
    def num_prompts(self) -> int:
        return 1

    def forces_call(self) -> bool:
        """(Chat's) whether tool_choice forces a call, which then is the output's constraint."""
        return False

    def tools_constrain(self) -> bool:
        """(Chat's) whether the output's constraint comes from the tools alone."""
        return self.forces_call()

    def echo_only(self) -> bool:
        """Completions' echo with max_tokens 0 (scoring a prompt): one token is
        generated, as in vLLM, and left out of the response."""
        return False


PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


class CompletionRequest(GenerationRequest):
    prompt: Any = None  # one of PROMPT_SHAPES
    prompt_embeds: str | list[str] | None = Field(
        None, description="base64 of torch.save(tensor [tokens, hidden_size]), or a list of them "
                          "(--enable-prompt-embeds); their prompts come before prompt's")
    max_tokens: int | None = 16  # OpenAI's default for completions, also for a null (vLLM's normalize_null_max_tokens)
    logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: None = Field(None, description="left out: suffix is not supported")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, p: Any) -> list[str | list[int]]:
        """Only the shape: the engine checks the token ids, after the cheap length bound (so
        unlike vLLM's lax union, no 1.0 or true for an id: coercing each would come first)."""
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list) or not p:
            raise ValueError(f"prompt must be {PROMPT_SHAPES} (and not empty), got {show(p)}")
        if isinstance(p[0], int) and not isinstance(p[0], bool):
            return [p]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) and x for x in p):
            return list(p)
        raise ValueError(f"prompt must be {PROMPT_SHAPES}, got {show(p)}")

    @model_validator(mode="after")
    def _completion_rules(self) -> "CompletionRequest":
        if isinstance(self.prompt_embeds, str):
            self.prompt_embeds = [self.prompt_embeds]
        if self.prompt_embeds is not None and not self.prompt_embeds:
            raise InvalidInput("prompt_embeds", "prompt_embeds must be a base64 string or a non-empty list of them")
        if self.prompt_embeds and self.prompt == [""]:  # as vLLM's: an empty prompt beside them is none
            self.prompt = None
        if self.prompt is None and not self.prompt_embeds:
            raise InvalidInput("prompt", f"prompt is required: {PROMPT_SHAPES}")
        if self.prompt_embeds and self.echo:
            raise InvalidInput("echo", "echo needs the prompt's text, which prompt_embeds do not have")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidInput("max_tokens", "max_tokens must be >= 1 (0 only with echo: true, to score the prompt)")
        return self

    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only() else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:  # as vLLM: echo's logprobs include the prompt's
        if self.echo and self.logprobs is not None:
            return self.logprobs if self.prompt_logprobs is None else self.prompt_logprobs
        return None if self.stream else self.prompt_logprobs  # (0) as vLLM's, a stream's chunks have none

    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def num_prompts(self) -> int:
        return len(self.prompt or ()) + len(self.prompt_embeds or ())


def load_prompt_embeds(text: str, engine: LLMEngine) -> torch.Tensor:
    """One of vLLM's prompt_embeds: base64 of torch.save(tensor). Read with weights_only (tensors
    and plain containers, no code) and sparse tensors' invariants checked (unchecked, a crafted
    one writes out of bounds: vLLM's CVE-2025-62164); the archive's size is bounded before it
    is read (an entry may be compressed: it could expand far past the body)."""
    def bad(why: str) -> InvalidInput:
        return InvalidInput("prompt_embeds", f"prompt_embeds must be base64 of torch.save(tensor): {why}")
    if not engine.config.enable_prompt_embeds:  # before a byte of it is read: the server opts in to torch.load
        raise InvalidInput("prompt_embeds", "prompt_embeds need --enable-prompt-embeds")
    try:
        raw = base64.b64decode(text, validate=True)
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            size = sum(entry.file_size for entry in archive.infolist())
    except (binascii.Error, ValueError, zipfile.BadZipFile):
        raise bad("this is not base64 of torch.save's (zip) format") from None
    cfg = engine.model_config
    if size > engine.max_model_len * cfg.hidden_size * 4 + 2**20:
        raise bad(f"its {size} bytes are more than a float32 prompt of max_model_len {engine.max_model_len} "
                  f"tokens takes")
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever a crafted archive makes torch.load raise
        raise bad(f"torch.load failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(tensor, torch.Tensor):
        raise bad(f"it holds a {type(tensor).__name__}, not a tensor")
    return tensor


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class ChatCompletionToolsParam(_Strict):
    """An OpenAI function tool."""
    type: typing.Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"  # JSON text: the engine parses it for the template


class ToolCall(_Strict):
    """A tool call of an earlier assistant message."""
    id: str | None = None
    type: typing.Literal["function"] = "function"
    function: FunctionCall


_TOOL_CALLS = TypeAdapter(list[ToolCall])


class ChatTemplateFields(OpenAIBaseModel):
    """What chat completions and /tokenize share: messages and how the chat template renders them (vLLM's names)."""
    messages: Any = None
    add_generation_prompt: bool | None = None  # left out: true, unless continue_final_message
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = Field(None, description='an object such as {"enable_thinking": false}')
    tools: list[ChatCompletionToolsParam] | None = None
    documents: list[dict[str, str]] | None = None  # for a RAG template, as vLLM: e.g. [{"title": ..., "text": ...}]

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: Any) -> list[dict[str, Any]]:
        """OpenAI chat messages -> [{role, content}] with text content (a string, text parts or None), and
        what the templates read besides: name, an assistant's tool_calls and reasoning, a tool's tool_call_id."""
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, got {show(messages)}")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise ValueError(f"{where} must be an object with role and content, got {show(m)}")
            if not isinstance(m.get("role"), str):  # any role, as vLLM: the chat template decides
                raise ValueError(f"{where}.role must be a string such as \"user\", got {show(m.get('role'))}")
            content = m.get("content")
            if isinstance(content, list):
                texts = [part_text(p) for p in content]
                if None in texts:
                    raise ValueError(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}, or "
                                     f"{', '.join(list(TEXT_PARTS)[1:])}) are supported, got {show(content)}")
                content = [{"type": "text", "text": t} for t in texts]  # the template's content format joins them
            elif not isinstance(content, str) and (content is not None or (m["role"] != "assistant" and
                                                                            "content" in m)):
                # null only for an assistant's (one that calls tools), as OpenAI's message types and vLLM's
                raise ValueError(f"{where}.content must be a string or a list of text parts, got {show(content)}")
            msg = {"role": m["role"], "content": content}
            for key in ("name", "tool_call_id"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise ValueError(f"{where}.{key} must be a string, got {show(m[key])}")
                    msg[key] = m[key]
            reasoning = m.get("reasoning", m.get("reasoning_content"))
            if reasoning is not None and m["role"] == "assistant":  # as vLLM's: templates read either name
                if not isinstance(reasoning, str):
                    raise ValueError(f"{where}.reasoning must be a string, got {show(reasoning)}")
                msg["reasoning"] = msg["reasoning_content"] = reasoning
            if m.get("tool_calls") is not None:
                if m["role"] != "assistant":
                    raise ValueError(f"{where}.tool_calls: only an assistant message has tool_calls")
                try:
                    calls = _TOOL_CALLS.validate_python(m["tool_calls"])
                except ValidationError as e:
                    err = e.errors(include_url=False)[0]
                    raise ValueError(_error_text(err, f"{where}.tool_calls")) from None
                msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in calls]
            out.append(msg)
        return out

    def template_kwargs(self) -> dict[str, Any]:
        """What reaches the template besides messages, tools and documents."""
        return dict(self.chat_template_kwargs or {})

    def invalid(self, e: InvalidInput) -> ApiError:
        if e.param == "chat_template" and "has no chat template" in str(e):  # the engine's advice is the offline API's
            return bad_request("this model's tokenizer has no chat template: start the server with --chat-template "
                               "FILE (or an inline Jinja template), or send chat_template in the request",
                               "chat_template")
        return super().invalid(e)


class ChatCompletionRequest(GenerationRequest, ChatTemplateFields):
    prompt_field: ClassVar[str] = "messages"

    max_completion_tokens: int | None = None  # the newer name of max_tokens; it wins
    logprobs: bool = False
    top_logprobs: int | None = None  # -1: the whole vocabulary (as vLLM's); the range: SamplingParams
    add_special_tokens: bool = False  # the chat template adds them (vLLM's default)
    return_prompt_text: bool = False
    prompt_embeds: None = Field(None, description="left out: completions take prompt_embeds; a chat's prompt is its "
                                                  "messages")
    include_reasoning: bool = True  # false: --reasoning-parser drops the reasoning (without one: nothing to drop)
    # reaches the template, as vLLM's; "none" also turns thinking off (enable_thinking), unless
    # chat_template_kwargs say otherwise
    reasoning_effort: typing.Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    tool_choice: Any = None  # check_tool_choice says what it takes
    parallel_tool_calls: bool | None = None  # false: only the first tool call is returned (as vLLM)
    _call_format: str | None = PrivateAttr(None)  # the tool parser whose own format a forced call takes, if any
    _calls_tag: str | None = PrivateAttr(None)  # vLLM 0.32's structural tag over the calls (JSON text), if any

    @model_validator(mode="after")
    def _chat_rules(self) -> "ChatCompletionRequest":
        if self.messages is None:
            raise InvalidInput("messages", "messages is required: a non-empty list of {role, content} objects")
        if self.top_logprobs and not self.logprobs:  # as vLLM: 0 asks for nothing
            raise InvalidInput("top_logprobs", "top_logprobs needs logprobs: true")
        if self.tools == []:  # as vLLM's check_tool_usage (and OpenAI)
            raise InvalidInput("tools", "tools must not be an empty array: give at least one tool or leave it out")
        if self.tool_choice is None and self.tools is not None:
            self.tool_choice = "auto"  # as OpenAI and vLLM
        check_tool_choice(self.tool_choice, self.tools)
        return self

    def template_kwargs(self) -> dict[str, Any]:
        if self.reasoning_effort is None:
            return super().template_kwargs()
        return {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none",
                **super().template_kwargs()}

    tool_schema_field: ClassVar[str] = "parameters"  # where a tool's JSON schema sits in this API's body

    def param_name(self, engine_param: str) -> str:
        if engine_param == "max_tokens":
            return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return "top_logprobs" if engine_param == "logprobs" else super().param_name(engine_param)

    def settle_tools(self, parser: str | None, strict_tool_calling: bool, level: str) -> None:
        """The server's side of the calls' constraint: the format a forced call takes (mistral's list whatever
        $VLLM_ENFORCE_STRICT_TOOL_CALLING says, as vLLM's), and the structural tag of the parser's format."""
        tagged = parser in TOOL_CALL_TAGS and strict_tool_calling
        if self.forces_call() and (tagged or parser == "mistral"):
            self._call_format = parser
        if not tagged:
            return
        own = super().structured_spec()
        try:
            output = None if own is None or self.forces_call() else output_format(own)
        except (ValueError, TypeError, AttributeError):  # a constraint that is no format stays alone (as vLLM's),
            return                                        # for its compile to name what is wrong
        if own is None or output is not None:
            tag = tool_call_tag(parser, self.tools, self.tool_choice, self.parallel_tool_calls, level, output)
            self._calls_tag = None if tag is None else json.dumps(tag)  # a string: the grammar cache keys on it

    def tools_constrain(self) -> bool:
        """Whether the output's constraint comes from the tools alone (a forced call, or the calls' tag)."""
        return self.forces_call() or (self._calls_tag is not None and super().structured_spec() is None)

    def invalid(self, e: InvalidInput) -> ApiError:
        if e.param == "structured_outputs" and self.tools_constrain():  # xgrammar refused the tools' schemas
            return bad_request(f"the tools' {self.tool_schema_field} are not JSON schemas xgrammar can compile: "
                               f"{str(e).partition(': ')[2]}", "tools")
        return super().invalid(e)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def structured_spec(self) -> StructuredOutputsParams | None:
        own = super().structured_spec()
        if self.forces_call() and own is not None:
            raise InvalidInput("tool_choice", f"tool_choice {show(self.tool_choice)} constrains the output to tool "
                                              "calls: it cannot be combined with another structured-output field")
        if self._calls_tag is not None:
            return StructuredOutputsParams(structural_tag=self._calls_tag)
        if not self.forces_call():
            return own
        if self._call_format == "mistral":
            return StructuredOutputsParams(json=self.mistral_schema())
        return StructuredOutputsParams(json=self.tool_schema())

    def mistral_schema(self) -> dict:
        """vLLM 0.32's forced call with the mistral parser (a tokenizer of transformers'): a JSON list of
        {"name", "arguments"}, one for a named function."""
        tools = _forced_tools(self.tools, self.tool_choice)
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "arguments": t.function.parameters or {"type": "object"}},
                  "required": ["name", "arguments"]} for t in tools]
        return {"type": "array", "minItems": 1, **({"maxItems": 1} if isinstance(self.tool_choice, dict) else {}),
                "items": {"type": "object", "anyOf": items}}

    def forces_call(self) -> bool:
        return isinstance(self.tool_choice, dict) or self.tool_choice == "required"

    def tool_schema(self) -> dict:
        """vLLM's JSON constraint for a forced call (without a parser that has its own): a named function's
        parameters, or for "required" an array of {name, parameters} objects, each of one of the tools
        (at most one with parallel_tool_calls false)."""
        if isinstance(self.tool_choice, dict):
            return _parameters(find_tool(self.tools, self.tool_choice["function"]["name"]))
        defs: dict[str, Any] = {}
        items = []
        for tool in self.tools:
            params = dict(_parameters(tool))
            local = params.pop("$defs") if isinstance(params.get("$defs"), dict) else {}  # else xgrammar judges it
            for name, sub in local.items():  # one $defs at the root, where "#/$defs/..." points
                if defs.setdefault(name, sub) != sub:
                    raise InvalidInput("tools", f"tools define $defs.{name} twice, differently")
            items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                         "parameters": params}, "required": ["name", "parameters"]})
        return {"type": "array", "minItems": 1, **({"maxItems": 1} if self.parallel_tool_calls is False else {}),
                "items": {"type": "object", "anyOf": items}, **({"$defs": defs} if defs else {})}

    def requested_prompt_logprobs(self) -> int | None:  # as vLLM: echo asks for them (a stream has no room for them)
        if self.prompt_logprobs is None and self.echo and not self.stream:
            return self.top_logprobs or 0
        return None if self.stream else self.prompt_logprobs  # (0) vLLM's stream chunks have none


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""
    prompt: str | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):  # both: which to tokenize? (vLLM's union takes prompt)
            raise InvalidInput("prompt", "prompt (a string) or messages is required, one of them")
        return self

    def param_name(self, engine_param: str) -> str:
        return "messages" if engine_param == "prompt" and self.messages is not None else engine_param


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's /v1/load_lora_adapter (served where VLLM_ALLOW_RUNTIME_LORA_UPDATING is set)."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's: taken, the name says which


class DetokenizeRequest(OpenAIBaseModel):
    tokens: list[int]

    def param_name(self, engine_param: str) -> str:
        return "tokens" if engine_param == "token_ids" else engine_param


def check_tool_choice(choice: Any, tools: list[dict] | None) -> None:
    """vLLM's rules: "none" always goes; any other choice needs tools, and a named one one of them."""
    usage = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    if choice is None or choice == "none":
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    named = (isinstance(fn, dict) and choice.get("type", "function") == "function"
             and isinstance(fn.get("name"), str) and fn["name"] != "")
    if not named and choice not in ("auto", "required"):
        raise InvalidInput("tool_choice", f"tool_choice must be {usage}, got {show(choice)}")
    if tools is None:
        raise InvalidInput("tool_choice", f"tool_choice {show(choice)} needs tools: the functions it may call")
    if named and find_tool(tools, fn["name"]) is None:
        raise InvalidInput("tool_choice", f"tool_choice names the function {show(fn['name'])}, "
                                          f"which is not one of the tools")


def find_tool(tools: list[ChatCompletionToolsParam], name: str) -> ChatCompletionToolsParam | None:
    return next((t for t in tools if t.function.name == name), None)


def _parameters(tool: ChatCompletionToolsParam) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def parse_json_object(raw: bytes, yielding: bool = False) -> dict[str, Any]:
    """A request body as a JSON object of text: a lone surrogate (which JSON's
    \\u escapes can spell, and no tokenizer takes) is a 400 naming its field, and so is
    a number JSON has not (NaN, Infinity, 1e999), which Python's json takes and no
    answer that echoes it could carry."""
    try:
        text = raw.decode("utf-8")  # strict: no encoded surrogates either
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    text = text.removeprefix("\ufeff")  # a UTF-8 BOM, which vLLM's json.loads(bytes) skips and RFC 8259 allows
    if not text.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:  # yielding: numbers parsed by a Python function, so that the GIL can pass to the loop between them
        body = json.loads(text, parse_int=(lambda v: int(v)) if yielding else None,
                          parse_float=(lambda v: float(v)) if yielding else None)
    except (ValueError, RecursionError) as e:
        if m := _LONG_INT.match(str(e)):  # valid JSON, but Python's bound on int(): its message advises sys calls
            raise bad_request(f"the request body holds an integer of {m[2]} digits, more than the {m[1]} this "
                              f"server reads (no field takes such a number)") from None
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    if _NOT_JSON_TEXT.search(text):  # rare: only then look for the field that holds it
        for key, value in body.items():
            try:  # UTF-8 cannot encode a lone surrogate
                json.dumps({key: value}, ensure_ascii=False, allow_nan=False).encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(f"{_key_name(key)} holds a lone UTF-16 surrogate (such as \\ud800), which is not "
                                  f"text", esc(key)) from None
            except ValueError:
                raise bad_request(f"{_key_name(key)} holds NaN, Infinity or a number beyond a double's range (such "
                                  f"as 1e999), which are not JSON numbers", esc(key)) from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:  # only then can a field be nested that deep
        for key, value in body.items():
            if nested_deeper(value, MAX_JSON_DEPTH - 1):
                raise bad_request(f"{_key_name(key)} is nested more than {MAX_JSON_DEPTH} levels deep (counting the "
                                  f"body's own)", esc(key))
    return body


def _key_name(key: str) -> str:
    """A body's key as an error's message names it: an empty one is still a field, named as JSON spells it."""
    return esc(key) or '""'


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def parse_body(schema: type[OpenAIBaseModel], body: dict[str, Any], request_id: str) -> Any:
    """The body as ``schema``, or a 400 that names the first bad field."""
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        raise _validation_error(schema, body, e.errors(include_url=False)[0]) from None
    unknown = sorted(set(req.model_extra or ()) - set(UNSUPPORTED_FIELDS))  # those were refused unless harmless
    if unknown:
        logger.warning("[entry] %s: ignoring unknown field(s): %s", request_id, ", ".join(map(show, unknown)))
    return req


def _validation_error(schema: type[BaseModel], body: dict, err: dict) -> "ApiError":
    loc = err["loc"]
    name = str(loc[0]) if loc else None
    info = schema.model_fields.get(name)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidInput):
        return bad_request(str(cause), cause.param)
    if isinstance(cause, ValueError):
        return bad_request(str(cause), name)
    if len(loc) == 1 and info is not None and (  # a field's own type: say what it takes
            err["type"].endswith(("_type", "_parsing", "literal_error", "none_required"))
            or err["type"] in ("finite_number", "int_from_float")):
        return bad_request(f"{name} must be {info.description or _describe(info.annotation)}, "
                           f"got {show(body.get(name))}", name)
    return bad_request(_error_text(err), name)


def _error_text(err: dict, where: str = "") -> str:
    """A pydantic error as a sentence that names the place: 'tools[0].function.name is required'."""
    path = (where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])).lstrip(".")
    if err["type"] == "missing":
        return f"{path} is required"
    return f"{path}: {err['msg'][:1].lower() + err['msg'][1:]}, got {show(err.get('input'))}"


_TYPE_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
               str: ("a string", "strings")}


def _describe(tp: Any, plural: bool = False) -> str:
    """What a field's annotation takes, in words: 'a string or a list of strings'."""
    origin, args = typing.get_origin(tp), [a for a in typing.get_args(tp) if a is not type(None)]
    if origin is Annotated:
        return _describe(args[0], plural)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a, plural) for a in args)
    if origin is list:
        return "lists" if plural else f"a list of {_describe(args[0], True)}"
    if origin is typing.Literal:
        return " or ".join(map(show, args))
    return _TYPE_WORDS.get(tp, ("an object", "objects"))[plural]


def show(value: Any) -> str:
    """A client's value for a message or a log line: JSON, short, and printable
    (escaped where it is not, so a newline cannot forge a log line and a lone
    surrogate cannot break the response's encoding)."""
    text = repr(value) if isinstance(value, float) else json.dumps(value, ensure_ascii=False, default=str)
    if not text.isprintable():
        text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def esc(text: str) -> str:
    """Client text inside a log line: as it is when printable, else escaped."""
    return text if text.isprintable() else json.dumps(text)[1:-1]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj).encode(), status, headers, media_type="application/json")


def dumps(obj: Any) -> str:
    """JSON as a body or an SSE event carries it: UTF-8 as it is, except that an object holding a lone
    surrogate (which only an escape makes: a tool call's "\\ud800" the model wrote, parsed) goes all
    escaped, since UTF-8 cannot carry one."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return text


# =========================================================================== tool calls
# A parser finds the tool calls in a model's output (vLLM's --tool-call-parser). One
# parser reads one choice, fed its text as it comes: feed(text, final) gives the content
# that is out and what the calls gained, each {"name", "arguments"} for a new call or
# {"arguments"} for more of the last one's. It keeps its place between feeds, so a
# feed costs what its own text does and a call's JSON is read once, when it is whole:
# a long response never re-reads its past. A response that is not streamed is one feed.

class ToolParser:
    CONTENT_AFTER_CALLS: ClassVar[bool] = False  # where a response's content stands: before its calls, or after
    streamed: bool = False  # fed a stream's deltas (ToolStream says), not a whole response

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Qwen2.5/Qwen3 and Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number
    of them. A response is read as vLLM's hermes parser reads a whole output: the content is the text
    before the first <tool_call> (the text between and after calls is dropped), and every block (to its
    </tool_call>, the last maybe to the output's end) must be a call, else the whole output is content
    (a forced call cut short by max_tokens too). The content streams until the first <tool_call>, the rest
    is read at the end. A chat stream is read as vLLM 0.32's streamed parser reads it (HermesStreamBlock):
    the content is the text before the first <tool_call> (a tag's start at the output's end never goes
    out); each block's call starts once its name is whole, and its arguments follow as the model writes
    them; after a block that closed with no name, no later block is read."""
    START, END = "<tool_call>", "</tool_call>"
    BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM's tool_call_regex

    def __init__(self):
        self.held, self.body, self.called = "", None, False  # held: may start a tag; body: the text from it
        self.block: HermesStreamBlock | None = None  # a stream's open block
        self.last: HermesStreamBlock | None = None  # the last block vLLM's stream reading reached
        self.stuck = False  # a stream's block closed with no name: vLLM's reads none after it

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        if self.streamed:
            content, calls = self._feed_stream(text)
            if final and calls and not (self.last is not None and self.last.sent_arguments):
                # vLLM's finalize_generation: the last block its reading reached sent no arguments, so they read
                # as {} not yet sent, which go out with the last delta's last call
                calls[-1] = {**calls[-1], "arguments": calls[-1].get("arguments", "") + "{}"}
            return content, calls
        text, content, self.held = self.held + text, "", ""
        if self.body is None:  # before the first <tool_call>: content, as it comes
            at = text.find(self.START)
            if at < 0:
                cut = len(text) - (0 if final else _tag_start(text, self.START))
                self.held = text[cut:]
                return text[:cut], []
            self.body, content, text = [], text[:at], text[at:]
        self.body.append(text)
        if not final:
            return content, []
        rest = "".join(self.body)
        calls = self.read(rest)
        return (content, calls) if calls is not None else (content + rest, [])

    def read(self, text: str) -> list[dict[str, str]] | None:
        """The calls of the text from the first <tool_call> on, or None where a block is no call."""
        calls = []
        for closed, left_open in self.BLOCKS.findall(text):
            values, end = _json_values(closed or left_open, 0, "")
            value = values[0] if len(values) == 1 and not (closed or left_open)[end:].strip() else None
            if not (isinstance(value, dict) and "arguments" in value) or (call := _json_call(value)) is None:
                return None
            calls.append(call)
        return calls

    def _feed_stream(self, text: str) -> tuple[str, list[dict[str, str]]]:
        """A stream's delta, as vLLM 0.32's extract_tool_calls_streaming reads the text so far. Nothing is
        flushed at the end: a tag's start held there stays unsent, as vLLM's does."""
        text, pos, content, calls = self.held + text, 0, [], []
        while True:
            tag = self.START if self.block is None else self.END
            at = text.find(tag, pos)
            cut = at if at >= 0 else max(pos, len(text) - _tag_start(text, tag))
            if self.block is not None and not self.stuck:
                self.block.add(text[pos:cut])
            elif self.block is None and not self.called:
                content.append(text[pos:cut])
            if at < 0:
                break
            pos = at + len(tag)
            if self.block is None:
                self.block, self.called = HermesStreamBlock(), True
                self.last = self.last if self.stuck else self.block
            else:
                self.stuck = self.stuck or not self.block.read(True, calls)
                self.block = None
        self.held = text[cut:]
        if self.block is not None and not self.stuck:
            self.block.read(False, calls)
        return "".join(content), calls


class JSONBrackets:
    """JSON text read a piece at a time, each character once: where its brackets open and close a
    value (those inside strings, or escaped, do not). Its user keeps ``depth`` from the steps."""
    MARKS = re.compile(r'[][{}"\\]')
    in_str: bool
    skip: int  # the place of a character a backslash escapes

    def _bracket(self, ch: str, at: int) -> int:
        """``ch``, one of MARKS, at place ``at``: +1 where a bracket opens a value, -1 where one closes, else 0."""
        if at == self.skip:  # escaped
            return 0
        if self.in_str:
            self.skip = at + 1 if ch == "\\" else self.skip
            self.in_str = ch != '"'
            return 0
        if ch == '"':
            self.in_str = True
            return 0
        return 1 if ch in "[{" else -1


class HermesStreamBlock(JSONBrackets):
    """One <tool_call> block of a hermes chat stream, read as vLLM 0.32's streamed parser reads it at each
    delta (it re-reads all the text; here each character is read about once): the call starts once a
    ``"name": "..."`` in it is whole; its arguments are the text after the first ``"arguments":``, sent as
    it comes but for its blanks at the end and, where the block is whole (closed by </tool_call>, or its
    text so far a whole JSON value), the "}" that ends it and the blanks before that."""
    NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
    ARGUMENTS = re.compile(r'"arguments"\s*:')
    # the start of a match that the text to come may still complete (held for the next search)
    NAME_TAIL = re.compile(r'"(?:n(?:a(?:m(?:e(?:"\s*(?::\s*(?:"[^"]*)?)?)?)?)?)?)?\Z')
    ARGUMENTS_TAIL = re.compile(r'"(?:a(?:r(?:g(?:u(?:m(?:e(?:n(?:t(?:s(?:"\s*)?)?)?)?)?)?)?)?)?)?\Z')

    def __init__(self):
        self.parts, self.size = [], 0  # the block's text
        self.name, self.name_text = None, ""  # name_text: where a name may still be found
        self.args_text: str | None = ""  # where "arguments": may still be found; None once it was
        self.pending: list[str] = []  # the arguments' text not sent yet
        self.started = False  # the arguments' first character came (the blanks before it are not theirs)
        self.sent_arguments = False  # some of them went out
        # whether the text so far is one whole JSON value, as vLLM's json.loads would say: a bracket's value
        # that closed (``end``: where), valid (``valid``), with only blanks after it (not ``more``)
        self.depth, self.in_str, self.skip, self.end, self.valid, self.more = 0, False, -1, None, False, False

    def add(self, text: str) -> None:
        if not text:
            return
        self._scan(text)
        self.parts.append(text)
        self.size += len(text)
        if self.name is None:
            self.name_text += text
        if self.args_text is None:
            self._arguments(text)
            return
        self.args_text += text
        if (m := self.ARGUMENTS.search(self.args_text)) is not None:
            rest, self.args_text = self.args_text[m.end():], None
            self._arguments(rest)
        else:
            tail = self.ARGUMENTS_TAIL.search(self.args_text)
            self.args_text = self.args_text[tail.start():] if tail else ""

    def _arguments(self, text: str) -> None:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        if text:
            self.pending.append(text)

    def _scan(self, text: str) -> None:
        """Follow the JSON's brackets and strings over ``text``, the block's next characters."""
        base = self.size
        if self.end is None and self.depth == 0 and not self.in_str:  # the value has not started yet
            head = text.lstrip()
            if head and head[0] not in "{[":  # no bracket's value: vLLM's json.loads never reads a call here
                self.end, self.more = base, True
                return
        for m in self.MARKS.finditer(text):
            if self.end is not None:
                break
            at = base + m.start()
            step = self._bracket(m.group(), at)
            self.depth += step
            if step < 0 and self.depth <= 0:  # the value closed (or a bracket closed nothing): read it once, as vLLM's
                self.end = at + 1
                whole = "".join(self.parts) + text[:m.end()]
                self.valid = self.depth == 0 and _loads(whole.strip())
        if self.end is not None and not self.more:
            self.more = bool(text[max(0, self.end - base):].strip())

    def read(self, closed: bool, calls: list) -> bool:
        """What vLLM's parser sends for this block now (``closed``: by </tool_call>); whether it is named."""
        if self.name is None:
            if (m := self.NAME.search(self.name_text)) is None:
                tail = self.NAME_TAIL.search(self.name_text)
                self.name_text = self.name_text[tail.start():] if tail else ""
                return False
            self.name, self.name_text = m.group(1), ""
            calls.append({"name": self.name})  # as vLLM's: the name, then the arguments in a delta of their own
        text = "".join(self.pending)
        keep = len(text.rstrip())
        if (closed or (self.valid and not self.more)) and text[:keep].endswith("}"):
            keep = len(text[:keep - 1].rstrip())
        if keep:
            calls.append({"arguments": text[:keep]})
            self.sent_arguments = True
        self.pending = [text[keep:]] if text[keep:] else []
        return True


def _loads(text: str) -> bool:
    """Whether ``text`` is one JSON value to Python's json (vLLM's is_complete_json)."""
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return False


def _tag_start(text: str, tag: str) -> int:
    """How much of ``text``'s end may be the start of ``tag``: held back until the next text says."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class WholeOutputToolParser(ToolParser):
    """A format where the whole output is the calls (maybe after TAG) or else content, as vLLM's
    pythonic: its first characters decide (OPEN starts calls), text streams as it
    comes, calls are held to the end and read there by ``read`` (None: not calls, so content)."""
    TAG, OPEN = "", ""

    def __init__(self):
        self.parts, self.head, self.is_call = [], "", None  # head: the output's start, blanks dropped

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        if self.is_call is False:
            return text, []
        self.parts.append(text)
        if self.is_call is None:
            head = (self.head + text).lstrip()
            body = head[len(self.TAG):].lstrip() if head.startswith(self.TAG) else head
            self.head = head[:len(head) - len(body)].rstrip() + body  # blanks after the tag say nothing
            if body.startswith(self.OPEN) or (body and not self.TAG.startswith(body)):
                self.is_call = body.startswith(self.OPEN)
        if not final or self.is_call is False:  # (decided in this feed: the rest is content too)
            return ("", []) if self.is_call is not False else ("".join(self.parts), [])
        text = "".join(self.parts)
        body = text.strip()
        calls = self.read(body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body)
        return (text, []) if not calls else ("", calls)

    def read(self, body: str) -> list[dict[str, str]] | None:
        raise NotImplementedError


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+ JSON tool calls, {"name": ..., "parameters" (or "arguments"): ...}, read as vLLM 0.32's
    llama3_json parser reads them for "auto" and (strict tool calling on) a forced call alike. A response: every
    JSON object in the text is a call, the text around them dropped; one that is no call, or a "{" that starts
    no JSON, makes it all content. As vLLM's, a "{" right where an object ended counts as inside it: two calls
    back to back read as none. A chat stream, as its extract_tool_calls_streaming: an output that does not start
    with "{" (or <|python_tag|>) is content; else it is calls, joined by any two characters ("; "), each named
    once its name is whole (vLLM's partial JSON reading), its arguments sent as far as they read the same at two
    deltas (JSON written afresh), the rest once the call is whole. Its quirks are vLLM's: a call is named only at
    a delta after the one where it began; text after a call stops the reading of later calls."""
    TAG = "<|python_tag|>"
    KEEP_WHOLE: ClassVar[bool] = True  # keep the calls read whole (False: read all again each delta, as vLLM)

    def __init__(self):
        self.parts: list[str] = []  # a response's text
        self.head = ""  # a stream's start, until it says whether it holds calls (is_call)
        self.is_call: bool | None = None
        self.rest = ""  # a stream's text from its first call not read whole
        self.whole: list[dict] = []  # the calls read whole before it (JSON that later text cannot change)
        self.read_text: list[str] = []  # their text
        # vLLM's state, by its names
        self.prev_tool_call_arr: list[Any] = []
        self.current_tool_id, self.current_tool_name_sent = -1, False
        self.streamed_args_for_tool: list[str] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        if self.streamed:
            return self._feed_stream(text, final)
        self.parts.append(text)
        if not final:  # any "{" to come may start a call, which takes the text before it out of the content
            return "", []
        text = "".join(self.parts)
        calls = self.read(text)
        return ("", calls) if calls else (text, [])

    def read(self, text: str) -> list[dict[str, str]] | None:
        """vLLM's extract_tool_calls: the calls of a whole output, or None where it is content."""
        calls, end, decoder = [], -1, json.JSONDecoder(strict=False)
        for at in (m.start() for m in re.finditer("{", text)):
            if at <= end:
                continue
            try:
                value, end = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return None
            keyed = isinstance(value, dict) and "name" in value and ("arguments" in value or "parameters" in value)
            if (call := _json_call(value) if keyed else None) is None:
                return None
            calls.append(call)
        return calls or None

    def _feed_stream(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        if self.is_call is None:
            self.head += text
            if self.head.startswith(("{", self.TAG)):
                self.is_call, text = True, self.head.removeprefix(self.TAG)
            elif not self.TAG.startswith(self.head):
                self.is_call = False
        if not self.is_call:  # (a start of the tag is content until the tag is whole, as vLLM's)
            return text, []
        self.rest += text
        calls = self._read_stream() or []
        if final and calls:  # vLLM's finalize_generation: the last call's arguments not sent yet
            calls[-1] = {**calls[-1], "arguments": calls[-1].get("arguments", "") + self._unstreamed_arguments()}
        return "", calls

    def _read_stream(self) -> list[dict] | None:
        """What vLLM's extract_tool_calls_streaming sends for the text so far (it reads it all again; here the
        calls read whole are kept, see _calls_so_far). None: nothing (vLLM's None, also where it fails)."""
        try:
            tool_call_arr, is_complete = self._calls_so_far()
            if not tool_call_arr:
                return None
            current, index = tool_call_arr[self.current_tool_id], self.current_tool_id
            if len(tool_call_arr) > index + 1:  # a new call: what the last one's arguments still lack, first
                delta = None
                if index >= 0 and (args := current.get("arguments")):
                    diff = json.dumps(args, ensure_ascii=False)[len(self.streamed_args_for_tool[index]):]
                    self.streamed_args_for_tool[index] += diff
                    delta = [{"index": index, "arguments": diff}]
                self.current_tool_id, self.current_tool_name_sent = len(tool_call_arr) - 1, False
                self.streamed_args_for_tool.append("")
                return delta
            delta = None
            if not self.current_tool_name_sent:
                if name := current.get("name"):
                    if not isinstance(name, str):  # vLLM's DeltaFunctionCall refuses it: the delta fails
                        return None
                    delta, self.current_tool_name_sent = [{"index": index, "name": name}], True
            elif args := current.get("arguments"):
                args_json, sent = json.dumps(args, ensure_ascii=False), len(self.streamed_args_for_tool[index])
                prev, diff = self.prev_tool_call_arr[index].get("arguments"), None
                if is_complete[index]:
                    diff = args_json[sent:]
                elif prev:
                    prev_json = json.dumps(prev, ensure_ascii=False)
                    if args_json != prev_json:
                        diff = args_json[:_common_prefix(prev_json, args_json)][sent:]
                if diff is not None:
                    self.streamed_args_for_tool[index] += diff
                    delta = [{"index": index, "arguments": diff}]
            self.prev_tool_call_arr = tool_call_arr
            return delta
        # vLLM's sends nothing (partial_json_parser's MalformedJSON is a ValueError; its scan of the brackets
        # asserts, and pops an empty stack, where they do not match)
        except (ValueError, IndexError, AssertionError, TypeError, AttributeError, RecursionError):
            return None

    def _calls_so_far(self) -> tuple[list[Any], list[bool]]:
        """vLLM's reading of the calls' text: partial JSON values, each after the last one's end and two more
        characters, each with whether it is whole. A call read whole with more text after it reads the same
        whatever follows, so it is kept and only the text after it is read again at each delta (all the text,
        in the one case where what follows could change vLLM's reading of a kept call: below)."""
        flags = Allow.ALL if self.current_tool_name_sent else Allow.ALL & ~Allow.STR  # a name is sent whole
        if self.whole and (mark := _JSON_MARKS.search(self.rest)) and mark.group() == '"':
            # vLLM reads the text from each call's start: where the rest starts with a string, the brackets
            # scanned over it from a call's start may fail where the rest's own reading does not
            self.rest, self.whole, self.read_text = "".join(self.read_text) + self.rest, [], []
        tool_call_arr, is_complete, keep = list(self.whole), [True] * len(self.whole), self.KEEP_WHOLE
        pos = 0
        while pos < len(self.rest):
            obj, end = partial_json_loads(self.rest[pos:], flags)
            is_complete.append(_loads_strict(self.rest[pos:pos + end]))
            gap = self.rest[pos + end:pos + end + 2]
            if "parameters" in obj:
                if "arguments" in obj:
                    raise ValueError("model generated both parameters and arguments")
                obj["arguments"] = obj["parameters"]
            tool_call_arr.append(obj)
            # kept: read whole with more text after it (then it stays so), a call, the two characters after
            # it written and no JSON marks (else the text after them reads otherwise from the call's start)
            keep = keep and pos + end < len(self.rest) and isinstance(obj, dict) and len(gap) == 2 \
                and not _JSON_MARKS.search(gap)
            pos += end + 2
            if keep:
                self.whole.append(obj)
                self.read_text.append(self.rest[:pos])
                self.rest, pos = self.rest[pos:], 0
        return tool_call_arr, is_complete

    def _unstreamed_arguments(self) -> str:
        """vLLM's get_remaining_unstreamed_args: the last call's arguments that were read but not sent."""
        if not self.prev_tool_call_arr or not isinstance(last := self.prev_tool_call_arr[-1], dict):
            return ""
        index, args = len(self.prev_tool_call_arr) - 1, last.get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = self.streamed_args_for_tool[index] if index < len(self.streamed_args_for_tool) else ""
        return expected[len(actual):] if expected.startswith(actual) else ""


# --------------------------------------------------------------------------- partial JSON, as vLLM reads it
_JSON_MARKS = re.compile(r'["\[\]{}]')  # what partial_json_parser's fast completion scans for


def partial_json_loads(text: str, flags: Allow) -> tuple[Any, int]:
    """vLLM's partial_json_loads: the value the text so far reads as (partial_json_parser completes it, as
    vLLM's does), and where it ends: the text's end, or a whole first value's where more follows."""
    try:
        return partial_json_parser.loads(text, flags), len(text)
    except json.JSONDecodeError as e:
        if "Extra data" in e.msg:
            return json.JSONDecoder().raw_decode(text)
        raise


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix (vLLM's find_common_prefix), found by halving: each step
    compares two slices at C speed where a loop would step a character at a time."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _loads_strict(text: str) -> bool:
    """vLLM's is_complete_json (strict JSON; a RecursionError fails the delta, as there)."""
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


class PythonicToolParser(WholeOutputToolParser):
    """Llama 3.2/3.3/4 pythonic tool calls: the whole output is a Python list of calls with literal
    keyword arguments, [get_weather(city="Paris", days=3), f()], maybe within <|python_start|> and
    <|python_end|> (Llama 4); anything else (a positional argument, a name, an expression) is content."""
    TAG, OPEN, END = "<|python_start|>", "[", "<|python_end|>"

    def read(self, body: str) -> list[dict[str, str]] | None:
        try:
            tree = ast.parse(body.removesuffix(self.END), mode="eval").body
            if not isinstance(tree, ast.List) or not all(_python_call(c) for c in tree.elts):
                return None
            return [{"name": c.func.id, "arguments": arguments_json({k.arg: ast.literal_eval(k.value)
                                                                     for k in c.keywords})} for c in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # not Python, or not literals
            return None


def _python_call(node: ast.expr) -> bool:
    """f(a=..., b=...): a plain name called with keyword arguments only."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
            and all(k.arg is not None for k in node.keywords))


class MistralToolParser(ToolParser):
    """Mistral: content, then [TOOL_CALLS] and the calls in either form vLLM reads: a JSON array
    [{"name": ..., "arguments": {...}}, ...] (tokenizers before v11), or name{...} after each call's
    own [TOOL_CALLS] (v11+; name[ARGS]{...} from HF tokenizers). The content streams as it comes,
    the calls are held to the end and read there; if they are not calls, all the output is content."""
    TAG = "[TOOL_CALLS]"

    def __init__(self):
        self.held, self.rest = "", None  # held: may start the tag; rest: the text after it

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        content = ""
        if self.rest is None:
            text, self.held = self.held + text, ""
            at = text.find(self.TAG)
            if at < 0:
                cut = len(text) - (0 if final else _tag_start(text, self.TAG))
                self.held = text[cut:]
                return text[:cut], []
            content, text, self.rest = text[:at], text[at + len(self.TAG):], []
        self.rest.append(text)
        if not final:
            return content, []
        rest = "".join(self.rest)
        calls = self.read(rest.strip())
        return (content, calls) if calls else (content + self.TAG + rest, [])

    def read(self, body: str) -> list[dict[str, str]] | None:
        if body.startswith("["):  # as vLLM's, what follows the array is dropped
            values, _ = _json_values(body, 0, "")
            calls = [_json_call(v) for v in values[0]] if values and isinstance(values[0], list) else [None]
        else:
            calls = []
            for piece in body.split(self.TAG):
                name, brace, args = piece.partition("{")
                values, end = _json_values(brace + args, 0, "")
                whole = len(values) == 1 and not (brace + args)[end:].strip()
                calls.append(_json_call({"name": name.replace("[ARGS]", "").strip() or None,
                                         "arguments": values[0]}) if whole else None)
        return None if None in calls else calls


class RequiredToolParser(ToolParser, JSONBrackets):
    """tool_choice "required": the output is the JSON array the schema allows, [{"name", "parameters"},
    ...]. A scan of its brackets and strings finds where each call ends; its JSON is read then, once. A chat
    stream is read as vLLM 0.32's (RequiredCallScan): each call sent once its name is whole and its
    "parameters" value has begun, with the arguments so far as written, then the rest as it comes."""
    CONTENT_AFTER_CALLS = True  # its content is what the calls leave over at the end (cut short)
    STREAM_AS_WRITTEN: ClassVar[bool] = True  # a chat stream: vLLM's required reading (else each call whole)

    def __init__(self):
        self.parts, self.size, self.end, self.called = [], 0, 0, False  # end: where the last call ends
        self.depth, self.in_str, self.skip, self.value = 0, False, -1, None  # value: an open call's text
        self.scan: RequiredCallScan | None = None

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        if self.streamed and self.STREAM_AS_WRITTEN:
            self.scan = self.scan or RequiredCallScan()
            return "", self.scan.feed(text)
        base, start, calls = self.size, 0, []
        self.parts.append(text)
        self.size += len(text)
        for m in self.MARKS.finditer(text):
            step = self._bracket(m.group(), base + m.start())
            self.depth += step
            if step > 0 and self.depth == 2:  # a value of the array starts
                self.value, start = [], m.start()
            elif step < 0 and self.depth == 1 and self.value is not None:
                body, self.value = "".join(self.value) + text[start:m.end()], None
                if (call := _json_call(body)) is not None:
                    calls.append(call)
                    self.end, self.called = base + m.end(), True
        if self.value is not None:
            self.value.append(text[start:])
        if not final:
            return "", calls
        rest = "".join(self.parts)[self.end:].strip()  # what the calls do not account for (cut short): text
        rest = rest.removeprefix(",").lstrip() if self.called else rest
        return ("" if rest == "]" else rest), calls


class MistralForcedParser(RequiredToolParser):
    """mistral's forced call, a JSON list of {"name", "arguments"} (vLLM 0.32 streams it through its mistral
    parser, not checked here): read as "required"'s list, a stream's calls each whole when its JSON closes."""
    STREAM_AS_WRITTEN = False


@dataclass
class RequiredCallSpan:
    """Where a call of "required"'s array stands in the text (vLLM's _RequiredToolCallSpan): its name, once its
    string closed, and where that ended; where its "parameters" value starts and (once known) ends."""
    name: str | None = None
    name_end: int | None = None
    args_start: int | None = None
    args_end: int | None = None

    def ready_at(self, length: int) -> bool:
        """Whether the text's first ``length`` characters made it ready to send."""
        return (self.name is not None and self.name_end is not None and self.name_end <= length
                and self.args_start is not None and self.args_start < length)


class RequiredCallScan:
    """A chat stream's "required" array read as vLLM 0.32's extract_required_tool_call_streaming reads it: its
    _scan_required_tool_calls (one pass, string- and nesting-aware, reading only the array's elements' keys; a
    "{" outside the array, or the array's end, ends it) kept between deltas, as every prefix of the text scans
    alike; then each call ready (its name whole, its "parameters" begun) is sent with its arguments so far, as
    written, and the rest as it comes."""
    KEY, COLON, VALUE, IN_STRING, IN_CONTAINER, IN_SCALAR, AFTER = range(7)  # what the element's scan expects

    def __init__(self):
        self.text, self.spans, self.done = "", [], 0  # done: the spans wholly sent
        self.depth, self.in_string, self.escaped, self.string_start, self.stopped = 0, False, False, 0, False
        self.cur: RequiredCallSpan | None = None
        self.expect, self.key, self.value_start = self.KEY, None, 0

    def feed(self, delta: str) -> list[dict[str, str]]:
        sent_len = len(self.text)
        # the text's one reference a local, so += extends it in place: on the attribute it would copy it all
        text, self.text = self.text, ""
        text += delta
        self.text = text
        self._scan(sent_len)
        if not self.text:
            return []
        calls = []
        for index in range(self.done, len(self.spans)):
            span = self.spans[index]
            if span.name is None or span.args_start is None:
                break
            end = span.args_end if span.args_end is not None else len(self.text)
            if span.ready_at(sent_len):
                if new := self.text[min(end, sent_len):end]:
                    calls.append({"index": index, "name": None, "arguments": new})
            else:
                calls.append({"index": index, "name": span.name, "arguments": self.text[span.args_start:end]})
            if index == self.done and span.args_end is not None:
                self.done += 1
        return calls

    def _scan(self, start: int) -> None:
        text = self.text
        for i in range(start, len(text)):
            if self.stopped:
                return
            ch = text[i]
            element = self.depth == 2 and self.cur is not None
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if element and self.expect == self.KEY:
                        self.key, self.expect = text[self.string_start + 1:i], self.COLON
                    elif element and self.expect == self.IN_STRING:
                        self._end_value(i + 1)
            elif ch == '"':
                self.in_string, self.string_start = True, i
                if element and self.expect == self.VALUE:
                    self._start_value(i, self.IN_STRING)
            elif ch in "{[":
                if self.depth == 0 and ch != "[" or self.depth == 1 and ch != "{":
                    self.stopped = True
                    return
                if self.depth == 1:
                    self.cur = RequiredCallSpan()
                    self.spans.append(self.cur)
                    self.expect, self.key = self.KEY, None
                elif element and self.expect == self.VALUE:
                    self._start_value(i, self.IN_CONTAINER)
                self.depth += 1
            elif ch in "}]":
                if element and self.expect == self.IN_SCALAR:
                    self._end_value(i)
                self.depth -= 1
                if self.depth == 2 and self.cur is not None and self.expect == self.IN_CONTAINER:
                    self._end_value(i + 1)
                elif self.depth == 1:
                    self.cur = None
                elif self.depth <= 0:
                    self.stopped = True
                    return
            elif not element:
                continue
            elif ch == ":":
                self.expect = self.VALUE if self.expect == self.COLON else self.expect
            elif ch == ",":
                if self.expect == self.IN_SCALAR:
                    self._end_value(i)
                self.expect, self.key = self.KEY, None
            elif ch.isspace():
                if self.expect == self.IN_SCALAR:
                    self._end_value(i)
            elif self.expect == self.VALUE:
                self._start_value(i, self.IN_SCALAR)

    def _start_value(self, pos: int, state: int) -> None:
        self.value_start, self.expect = pos, state
        if self.key == "parameters":
            self.cur.args_start = pos

    def _end_value(self, pos: int) -> None:
        if self.key == "parameters":
            self.cur.args_end = pos
        elif self.key == "name" and self.expect == self.IN_STRING:
            try:
                self.cur.name, self.cur.name_end = json.loads(self.text[self.value_start:pos]), pos
            except json.JSONDecodeError:
                self.cur.name = None
        self.expect = self.AFTER


class NamedToolParser(ToolParser):
    """A named tool_choice: the output is that function's arguments, streamed as they come (a chat stream as
    vLLM 0.32's extract_named_tool_call_streaming: a delta for each step, one that added no text too)."""

    def __init__(self, name: str):
        self.name, self.begun = name, False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        if self.streamed:
            first, self.begun = not self.begun, True
            return "", [{"name": self.name, "arguments": text} if first else {"arguments": text}]
        if self.begun or not (text or final):
            return "", [{"arguments": text}] if text else []
        self.begun = True
        return "", [{"name": self.name, "arguments": text}]


class OpenAIToolParser(ToolParser):
    """gpt-oss: a call is a harmony message to functions.NAME. HarmonyParser reads those with the reasoning
    and content, for every choice of a server with this parser or --reasoning-parser openai_gptoss
    (ChatGeneration.harmony), so this class only names the format; its feed is never called."""

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, str]]]:
        raise NotImplementedError("harmony output is read by HarmonyParser")


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                              "mistral": MistralToolParser, "openai": OpenAIToolParser,
                                              "pythonic": PythonicToolParser}


# how a forced call in a parser's own format reads where that parser's "auto" reading differs
FORCED_CALL_PARSERS: dict[str, type[ToolParser]] = {
    "mistral": MistralForcedParser}  # its list, as "required"'s (whose parser reads "arguments" too)


def tool_parser(tool_choice: Any, auto_parser: str | None, call_format: str | None = None
                ) -> Callable[[], ToolParser] | None:
    """What makes a parser for each of this request's choices: none for "none" (or no tools). A forced
    call written in a parser's own format (``call_format``) is read back by that parser."""
    if call_format is not None:
        return FORCED_CALL_PARSERS.get(call_format, TOOL_PARSERS[call_format])
    if isinstance(tool_choice, dict):
        return functools.partial(NamedToolParser, tool_choice["function"]["name"])
    if tool_choice == "required":
        return RequiredToolParser
    return TOOL_PARSERS.get(auto_parser) if tool_choice == "auto" else None  # no --tool-call-parser: none


# =========================================================================== tool calls under a structural tag
# As vLLM 0.32 (Parser._apply_structural_tag, tool_parsers/structural_tag_registry.py): a tool parser whose
# format has a structural tag (hermes; llama3_json: xgrammar's builtin "llama"; openai: harmony) writes a
# "required" or named call in that format, under an xgrammar structural tag, and reads it back
# ($VLLM_ENFORCE_STRICT_TOOL_CALLING, on unless 0). "auto" takes the tag too where a tool says "strict": true,
# --tool-strict-level is function or parameter, or parallel_tool_calls is false: the text stays free, but a
# call once opened (the tag's trigger) is whole. A tool's arguments follow its schema where the tool is strict
# (every tool with --tool-strict-level parameter), else any JSON. mistral's forced call is a JSON list of
# {"name", "arguments"} (ChatCompletionRequest.mistral_schema); pythonic's keeps vLLM's older JSON list.

TOOL_STRICT_LEVELS = ("auto", "function", "parameter")  # vLLM's --tool-strict-level, weakest first
SINGLE_CALL_LISTS = ("triggered_tags", "token_triggered_tags", "tags_with_separator")  # what repeats calls


@dataclass(frozen=True)
class TagTool:
    """A tool as a structural tag writes its calls: its name, and its arguments' JSON schema (True: any JSON)."""
    name: str
    arguments: dict | bool


def _forced_tools(tools: list[ChatCompletionToolsParam], tool_choice: Any) -> list[ChatCompletionToolsParam]:
    """The tools a call may be of: the named one, or all of them."""
    return [find_tool(tools, tool_choice["function"]["name"])] if isinstance(tool_choice, dict) else tools


def tag_tools(tools: list[ChatCompletionToolsParam], tool_choice: Any, level: str) -> list[TagTool] | None:
    """vLLM's resolve_tool_strictness: the tools a call may be of (the named one, else all), each strict where
    it says so or the level is "parameter"; None where "auto" stays free (level "auto" and no strict tool)."""
    if tool_choice == "auto" and level == "auto" and not any(t.function.strict is True for t in tools):
        return None
    return [TagTool(t.function.name, t.function.parameters if t.function.parameters is not None
                    and (level == "parameter" or t.function.strict is True) else True)
            for t in _forced_tools(tools, tool_choice)]


def _arguments(tool: TagTool) -> dict:
    return {"type": "json_schema", "json_schema": tool.arguments}


def hermes_tag(tools: list[TagTool], choice: str) -> dict:
    """<tool_call>{"name": ..., "arguments": ...}</tool_call>, each with or without a newline inside its tags:
    after free text for "auto", one or more calls and nothing else for "required", one for a named function."""
    start, end = HermesToolParser.START, HermesToolParser.END
    tags = [{"type": "tag", "begin": f'{start}{nl}{{"name": "{tool.name}", "arguments": ', "content": _arguments(tool),
             "end": f"}}{nl}{end}"} for tool in tools for nl in ("\n", "")]
    if choice == "auto":
        return {"type": "triggered_tags", "triggers": [start], "tags": tags}
    return {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
            "stop_after_first": choice == "forced"}


def llama_tag(tools: list[TagTool], choice: str) -> dict:
    """xgrammar's builtin "llama" format: {"name": ..., "parameters": ...}; a named function's call alone, else
    calls among free text ("required": the output starts with one), the think tags never written outside one."""
    tags = [{"type": "tag", "begin": f'{{"name": "{tool.name}", "parameters": ', "content": _arguments(tool),
             "end": "}"} for tool in tools]
    if choice == "forced":
        return tags[0]
    return {"type": "triggered_tags", "triggers": ['{"name": '], "tags": tags, "excludes": list(THINK_TAGS),
            "at_least_one": choice == "required"}


HARMONY_CALL_CHANNELS = ("<|channel|>commentary", "<|channel|>analysis", "<|channel|>final")
HARMONY_CONSTRAINS = (" json", " <|constrain|>json")
# a message ends with <|end|>, or with the grammar ("") where an EOS token (<|call|>, <|return|>) closes it:
# xgrammar lets no stop token be written inside a structure
HARMONY_ENDS = ["<|end|>", ""]


def harmony_tag(tools: list[TagTool], choice: str) -> dict:
    """vLLM's harmony tag (gpt-oss): an analysis message and a commentary one, each optional, then one call, a
    message to functions.NAME (the recipient before or after its channel, either JSON content type) or, for
    "auto", a final message of any text."""
    calls = [{"type": "tag", "begin": begin, "content": _arguments(tool), "end": HARMONY_ENDS}
             for tool in tools for begin in _harmony_call_begins(tool.name)]
    finals = [{"type": "tag", "begin": f"<|channel|>final{constrain}<|message|>", "content": {"type": "any_text"},
               "end": HARMONY_ENDS} for constrain in HARMONY_CONSTRAINS + ("",)] if choice == "auto" else []
    return {"type": "sequence", "elements": [_harmony_message("analysis"), _harmony_message("commentary"),
                                             {"type": "or", "elements": calls + finals}]}


def _harmony_call_begins(name: str) -> list[str]:
    return [begin for pattern in (" to=functions.{name}{channel}{constrain}<|message|>",
                                  "{channel} to=functions.{name}{constrain}<|message|>")
            for constrain in HARMONY_CONSTRAINS for channel in HARMONY_CALL_CHANNELS
            for begin in [pattern.format(name=name, channel=channel, constrain=constrain)]]


def _harmony_message(channel: str) -> dict:
    """An optional whole message on ``channel`` and the next one's start."""
    return {"type": "optional", "content": {"type": "sequence", "elements": [
        {"type": "tag", "begin": f"<|channel|>{channel}<|message|>", "content": {"type": "any_text"}, "end": "<|end|>"},
        {"type": "const_string", "value": "<|start|>assistant"}]}}


TOOL_CALL_TAGS: dict[str, Callable[[list[TagTool], str], dict]] = {
    "hermes": hermes_tag, "llama3_json": llama_tag, "openai": harmony_tag}


def tool_call_tag(parser: str, tools: list[ChatCompletionToolsParam], tool_choice: Any,
                  parallel_tool_calls: bool | None, level: str, output: dict | None = None) -> dict | None:
    """vLLM 0.32's structural tag over a request's calls in ``parser``'s format, or None where they take none.
    ``output``: the format of the request's own structured output, which "auto" allows instead of calls (vLLM
    then takes "required"'s calls); parallel_tool_calls false stops every list of calls after its first."""
    choice = "forced" if isinstance(tool_choice, dict) else tool_choice
    if parser not in TOOL_CALL_TAGS or not tools or choice not in ("auto", "required", "forced"):
        return None
    single = parallel_tool_calls is False
    if single and not (choice == "auto" and output is not None):  # bounding the calls takes their envelope
        level = max(level, "function", key=TOOL_STRICT_LEVELS.index)
    chosen = tag_tools(tools, tool_choice, level)
    if chosen is None:
        return None
    if choice == "auto" and output is not None:
        fmt = {"type": "or", "elements": [TOOL_CALL_TAGS[parser](chosen, "required"), output]}
    else:
        fmt = TOOL_CALL_TAGS[parser](chosen, choice)
    return {"type": "structural_tag", "format": _single_call(fmt) if single else fmt}


def _single_call(fmt: Any) -> Any:
    """vLLM's limit_to_single_tool_call: every list of calls in ``fmt`` stops after its first."""
    if isinstance(fmt, list):
        return [_single_call(f) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    out = {k: _single_call(v) for k, v in fmt.items()}
    return {**out, "stop_after_first": True} if out.get("type") in SINGLE_CALL_LISTS else out


def output_format(spec: StructuredOutputsParams) -> dict | None:
    """vLLM's structured_outputs_to_format: a request's own structured output as a structural tag's format."""
    if spec.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        return {"type": "json_schema", "json_schema": schema}
    if spec.regex is not None:
        return {"type": "regex", "pattern": spec.regex}
    if spec.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in spec.choice]}
    if spec.grammar is not None:
        return {"type": "grammar", "grammar": spec.grammar}
    if spec.structural_tag is None:
        return None
    tag = json.loads(spec.structural_tag) if isinstance(spec.structural_tag, str) else spec.structural_tag
    if isinstance(tag, dict) and "structures" in tag:  # the older form
        return {"type": "triggered_tags", "triggers": tag.get("triggers"), "tags": [
            {"type": "tag", "begin": s.get("begin"), "content": {"type": "json_schema", "json_schema": s.get("schema")},
             "end": s.get("end")} for s in tag["structures"]]}
    return tag.get("format") if isinstance(tag, dict) else None


_BLANKS = re.compile(r"\s*")


def _json_values(text: str, pos: int, sep: str) -> tuple[list[Any], int]:
    """The whole JSON values in ``text`` from ``pos`` on, ``sep`` between them, and where the last ends."""
    values, decoder = [], json.JSONDecoder(strict=False)  # xgrammar's JSON lets control characters stand in strings
    while True:
        at = _BLANKS.match(text, pos).end()
        if values and text.startswith(sep, at):
            at = _BLANKS.match(text, at + len(sep)).end()
        try:
            value, pos = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):  # RecursionError: a model's text nested ~1000 deep is no call
            return values, pos
        values.append(value)


def _json_call(value: Any) -> dict[str, str] | None:
    """{"name": ..., "arguments" (or "parameters"): ...}, as JSON text or parsed -> a call, else None. As
    vLLM's parsers, the arguments are any JSON value (a forced call's grammar allows one for a tool that is
    not strict), sent as its JSON text."""
    if isinstance(value, str):
        values, end = _json_values(value, 0, "")
        value = values[0] if len(values) == 1 and not value[end:].strip() else None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    try:
        return {"name": value["name"], "arguments": arguments_json(args)}
    except ValueError:  # NaN or Infinity (the model wrote 1e999), or too deep: not JSON to us, so not a call
        return None


def arguments_json(args: Any) -> str:
    """A call's arguments as JSON text that goes out as UTF-8: a lone surrogate the model wrote
    escaped ("\\ud800") stays escaped. ValueError where they are not JSON (NaN, Infinity) or are
    nested deeper than a request may send them back (whether json itself could read them depends
    on the process's recursion limit, which torch.compile raises)."""
    if nested_deeper(args, MAX_JSON_DEPTH):
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
    text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(args, allow_nan=False)
    return text


class ToolStream:
    """One choice's tool calls: its parser, and how many calls it began; ``feed`` gives
    a delta's parts in OpenAI's shape. A response that is not streamed is one feed."""

    def __init__(self, parser: ToolParser, streamed: bool = False):
        self.parser, self.calls, self.sent = parser, 0, False
        parser.streamed = streamed

    def feed(self, delta_text: str, final: bool) -> tuple[str, list[dict], bool]:
        """(new content, OpenAI tool-call deltas, whether any call's delta was made)."""
        content, found = self.parser.feed(delta_text, final)
        return content, *self.deltas(found)

    def deltas(self, found: list[dict[str, str]]) -> tuple[list[dict], bool]:
        """A parser's calls -> (OpenAI tool-call deltas, whether any call's delta was made)."""
        deltas = []
        for call in found:  # each the last call's unless it says its index (llama3_json's stream)
            if call.get("name") is not None:  # a new call: its first delta names it (hermes' stream: by its name alone)
                index = call.get("index", self.calls)
                body = tool_call_body({"arguments": "", **call})
                if "arguments" not in call:
                    del body["function"]["arguments"]
                deltas.append({"index": index, **body})
                self.calls = max(self.calls, index + 1)
            else:  # (a name of None goes out as null: vLLM's "required" stream sends it)
                deltas.append({"index": call.get("index", self.calls - 1),
                               "function": {**({"name": None} if "name" in call else {}),
                                            "arguments": call["arguments"]}})
        self.sent = self.sent or bool(deltas)  # (vLLM's tools_streamed: any delta of a call, named or not)
        return deltas, self.sent


def tool_call_body(call: dict[str, str]) -> dict[str, Any]:
    """A call in OpenAI's shape."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}


# =========================================================================== reasoning

class ReasoningParser:
    """vLLM's --reasoning-parser for one choice (as vLLM v0.10-0.11: vllm/reasoning/basic_parsers.py,
    deepseek_r1_reasoning_parser.py and qwen3_reasoning_parser.py at 693e2a48, serving_chat.py at 003fe593):
    the text between <think> and </think> is the reasoning, the rest the content. deepseek_r1 starts in
    the reasoning (R1's template opens <think> in the prompt); qwen3 only at a <think>. Chat only.
    A constraint (structured outputs, a forced tool call) starts after </think> (the engine's GrammarState),
    so its reply is split as any other; only where the tokenizer has no </think> token does the grammar hold
    from the first token: then (``constrained``) the reply starts as content with either parser."""
    START, END = THINK_TAGS

    def __init__(self, name: str, constrained: bool = False, prompt: str | None = None,
                 think_ids: tuple[int, int] | None = None):
        """``prompt``: where the prompt left the reasoning (the engine's prompt_reasoning), as current vLLM
        reads it: "ended" makes the whole reply content, "open" starts it in the reasoning with either parser.
        ``think_ids``: the tags' token ids, which ``count`` reads (None: the tokenizer has no such tokens)."""
        self.name, self.held, self.needs_both = name, "", (name == "qwen3" and prompt != "open") or constrained
        self.state = "before" if self.needs_both else "reasoning"  # -> "reasoning" -> "content"
        if prompt == "ended" and not constrained:
            self.state = "content"
        self.think_ids, self.token_state, self.num_reasoning_tokens = think_ids, self.state, 0

    def count(self, token_ids: list[int]) -> None:
        """vLLM's count_reasoning_tokens (responses' usage, chat's completion_tokens_details), token by token:
        the output tokens inside the reasoning as this parser splits it, the tags themselves not counted."""
        for t in token_ids if self.think_ids is not None else ():
            if t not in self.think_ids:
                self.num_reasoning_tokens += self.token_state == "reasoning"
            elif (self.token_state, t) in (("before", self.think_ids[0]), ("reasoning", self.think_ids[1])):
                self.token_state = "reasoning" if self.token_state == "before" else "content"

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """A whole output (vLLM's extract_reasoning_content): (reasoning, content), None for none."""
        if self.state == "content":
            return None, text
        before, start, rest = text.partition(self.START)
        if self.needs_both and not (start and self.END in rest):  # qwen3 needs both tags, else all is content
            return None, text
        reasoning, end, content = (rest if start else before).partition(self.END)
        return reasoning, (content or None) if end else None  # R1 without </think>: all reasoning (cut short)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """A stream's delta -> (reasoning, content); a possible tag's start is held until the next says.
        As vLLM's streamed parsers, a <think> is dropped and qwen3's reasoning needs no </think>."""
        text, pos, out = self.held + text, 0, {"reasoning": [], "content": []}
        while self.state != "content":
            tags = (self.START,) if self.state == "before" else (self.START, self.END)
            at, tag = min(((a, t) for t in tags if (a := text.find(t, pos)) >= 0), default=(-1, ""))
            cut = at if at >= 0 else len(text) - (0 if final else max(_tag_start(text[pos:], t) for t in tags))
            out["content" if self.state == "before" else "reasoning"].append(text[pos:cut])
            pos = cut + len(tag)
            if at < 0:
                break
            self.state = "content" if tag == self.END else "reasoning"
        if self.state == "content":
            out["content"].append(text[pos:])
            pos = len(text)
        self.held = text[pos:]
        return "".join(out["reasoning"]), "".join(out["content"])


# =========================================================================== harmony (gpt-oss)

class HarmonyParser:
    """gpt-oss's harmony output for one choice, as vLLM serves it with --reasoning-parser openai_gptoss
    and --tool-call-parser openai (harmony_utils.parse_chat_output and OpenAIToolParser): messages
    ``[<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>TEXT``,
    each ended by <|end|>, <|call|> or <|return|> (the last two are EOS tokens, so usually not in the text).
    The analysis channel is the reasoning; final, and commentary with no recipient (a preamble), the content;
    a message to functions.NAME a tool call (with ``calls``; else dropped, as a call to any other recipient).
    Messages of one kind are joined by a newline, as vLLM joins them. The markers are special tokens, so the
    request keeps them in its text (skip_special_tokens false). An output that does not start as harmony
    (a constraint held from the first token writes bare JSON) is all content. ``feed`` takes a stream's
    deltas or (``whole``) a response's text, and gives (reasoning, content, calls) in ToolParser's call
    shape; a possible marker's start is held until the next delta says. ``whole``: a call's arguments are
    read as JSON and written back (as vLLM's), a call cut short is dropped; a stream sends them as they come."""
    MESSAGE, CHANNEL, CONSTRAIN = "<|message|>", "<|channel|>", "<|constrain|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")  # <|start|>: a message its end did not close
    OPENINGS = ("<|start|>", CHANNEL, "to=")  # how an output in harmony begins (blanks before it dropped)
    RECIPIENT = re.compile(r"\bto=([^\s<]+)")
    WORD = re.compile(r"\s*([^\s<]+)")

    def __init__(self, calls: bool, whole: bool = False):
        self.calls, self.whole = calls, whole
        self.harmony: bool | None = None  # undecided until the output's first characters say
        self.held, self.header = "", None  # header: the open message's header, read so far (None: in its body)
        self.tail = ""
        self.sink = None  # the open message's kind: "reasoning", "content", "call", or None (dropped)
        self.name, self.content_type, self.body = "", "", []  # the open call's
        self.fresh = None  # a stream's call named in this feed: its arguments go in the same delta
        self.written = {"reasoning": False, "content": False}  # a later message of the kind starts on a new line

    def feed(self, text: str, final: bool, cut: bool = False) -> tuple[str, str, list[dict[str, str]]]:
        """``cut``: the output ended short (max_tokens) rather than on an EOS, which ends the last message."""
        text, self.held = self.held + text, ""
        if self.harmony is None:
            head = text.lstrip()
            if not head.startswith(self.OPENINGS) and not final and any(m.startswith(head) for m in self.OPENINGS):
                self.held = text
                return "", "", []
            self.harmony = head.startswith(self.OPENINGS)
            self.header = [] if self.harmony else None
        if not self.harmony:
            return "", text, []
        out, calls, pos, self.fresh = {"reasoning": [], "content": []}, [], 0, None
        while pos < len(text):
            if self.header is not None:  # reading a header: up to <|message|>, maybe over several deltas
                tail, piece = self.tail, text[pos:]  # tail: the header's end, which may hold <|message|>'s start
                at = (tail + piece).find(self.MESSAGE)
                self.header.append(piece)
                if at < 0:  # each delta is read once, so a header never ended costs what its text does
                    self.tail = (tail + piece)[-len(self.MESSAGE) + 1:]
                    break
                text = "".join(self.header)
                at += len(text) - len(piece) - len(tail)
                self._open(text[:at], calls)
                pos = at + len(self.MESSAGE)
                continue
            at, end = min(((a, m) for m in self.ENDS if (a := text.find(m, pos)) >= 0), default=(-1, ""))
            stop = at if at >= 0 else len(text) - (0 if final else max(_tag_start(text[pos:], m) for m in self.ENDS))
            self._write(text[pos:stop], out, calls)
            if at < 0:
                self.held = text[stop:]
                break
            self._close(calls)
            pos = at + (0 if end == "<|start|>" else len(end))
        if final and self.header is None:  # the output ended inside a message: on its EOS, or cut short
            self._close(calls, whole=not cut)
        return "".join(out["reasoning"]), "".join(out["content"]), calls

    def _open(self, header: str, calls: list) -> None:
        """A message's header is whole: where its text goes."""
        self.header, self.tail = None, ""
        channel = self.WORD.match(header, header.find(self.CHANNEL) + len(self.CHANNEL)) \
            if self.CHANNEL in header else None
        channel = channel.group(1) if channel else ""
        recipient = self.RECIPIENT.search(header)
        recipient = recipient.group(1) if recipient else ""
        kind = self.WORD.match(header, header.find(self.CONSTRAIN) + len(self.CONSTRAIN)) \
            if self.CONSTRAIN in header else None
        self.content_type, self.body = kind.group(1) if kind else "", []
        if recipient:
            self.sink = "call" if recipient.startswith("functions.") and self.calls else None
            self.name = recipient.removeprefix("functions.")
            if self.sink and not self.whole:
                self.fresh = {"name": self.name, "arguments": ""}
                calls.append(self.fresh)
        else:
            self.sink = {"analysis": "reasoning", "final": "content", "commentary": "content"}.get(channel)
            if self.sink and self.written[self.sink]:
                self.body.append("\n")

    def _write(self, text: str, out: dict, calls: list) -> None:
        if not text or self.sink is None:
            return
        if self.sink == "call":
            if self.whole:
                self.body.append(text)
            elif self.fresh is not None:
                self.fresh["arguments"] += text
            else:
                calls.append({"arguments": text})
            return
        out[self.sink] += self.body + [text]
        self.body, self.written[self.sink] = [], True

    def _close(self, calls: list, whole: bool = True) -> None:
        """The open message ended (``whole``) or the output did inside it."""
        if self.sink == "call" and self.whole and whole:
            calls.append({"name": self.name, "arguments": self._arguments("".join(self.body))})
        self.sink, self.header, self.body, self.fresh = None, [], [], None

    def _arguments(self, text: str) -> str:
        """As vLLM's: JSON arguments (the constraint json, or none given) read and written back; else as written."""
        if self.content_type and "json" not in self.content_type:
            return text
        values, end = _json_values(text, 0, "")
        if len(values) != 1 or text[end:].strip() or not isinstance(values[0], dict):
            return text
        try:
            return arguments_json(values[0])
        except ValueError:
            return text


# =========================================================================== app

@dataclass(eq=False)
class ServerState:
    """What the handlers share: one per app, no module-level state."""
    async_llm: AsyncLLM
    model_names: list[str]
    loras: dict[str, LoRARequest]  # --lora-modules, by the model name a request gives (start_engine loaded them)
    api_key: list[str] | None  # any of them
    max_queue_len: int | None
    max_body_bytes: int
    metrics: "ServerMetrics"
    body_timeout: float = BODY_TIMEOUT_S
    generations: set["Generation"] = field(default_factory=set)  # in flight
    admitting: set[asyncio.Task] = field(default_factory=set)  # handlers before the engine, or outside it (endable)
    ending: str | None = None  # why end_all ended what was in flight (the drain timeout)
    # Tokenizing (and chat templates) run here: never on the loop, nor on the model thread.
    tokenizer_thread: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenizer"))
    # Structured-output grammars compile (compile_grammar) not on the tokenizer thread: tokenizing the requests
    # behind them must not wait for them.
    compiles: "OwnThreads" = field(default_factory=lambda: OwnThreads("nanoserve-grammar", "compiling", "grammars"))
    # where a request's own chat template renders (--trust-request-chat-template): see render_own_template
    template_worker: ChatTemplateWorker | None = None
    template_renders: int = 0  # its renders in flight: one renders, the others wait their turn
    chat_template: str | None = None                     # --chat-template
    chat_template_content_format: str = "auto"           # --chat-template-content-format
    trust_request_chat_template: bool = False
    tool_parser: str | None = None                       # --tool-call-parser, with --enable-auto-tool-choice
    strict_tool_calling: bool = True                     # $VLLM_ENFORCE_STRICT_TOOL_CALLING: calls in its format
    tool_strict_level: str = "auto"                      # --tool-strict-level: which calls a structural tag holds
    reasoning_parser: str | None = None                  # --reasoning-parser
    exclude_tools_when_tool_choice_none: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # under a request's own
    force_include_usage: bool = False                    # --enable-force-include-usage
    return_tokens_as_token_ids: bool = False             # what a request that does not say gets
    enable_prompt_tokens_details: bool = False
    log_requests: bool = False                           # --enable-log-requests
    max_log_len: int | None = None
    exit_code: int = 0                                   # 1 once the engine cannot recover
    # /v1/load_lora_adapter gives each adapter an id never given before (vLLM's counter): a request that named an
    # adapter unloaded since must not run with the next one loaded under its id
    last_lora_id: int = 0
    # ... and holds its name here while it loads: taken (a second load is a 400) but no model yet (a request
    # naming it is a 404, as in vLLM, which lists an adapter once it is loaded)
    loading_loras: set[str] = field(default_factory=set)
    request_shutdown: Callable[[], None] | None = None  # set by the server that runs the app

    @property
    def engine(self) -> LLMEngine:
        return self.async_llm.engine

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    async def on_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) where the engine's steps run, between two of them (what changes the model)."""
        return await asyncio.get_running_loop().run_in_executor(self.async_llm.executor, fn, *args)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """``spec`` compiled ahead, off the loop (the engine's add_request finds it cached), within
        GRAMMAR_COMPILE_TIMEOUT_S. xgrammar cannot stop a compile, and a 40-byte schema can take minutes (a
        pattern's a{50000}: the time grows as the count squared)."""
        if self.engine.structured_outputs.is_cached(spec):  # no compile: neither the limit nor a thread
            return
        future = await self.compiles.run(self.engine.structured_outputs.compile, spec, limit=GRAMMAR_COMPILE_TIMEOUT_S)
        if future is None:
            raise InvalidInput("structured_outputs", f"structured_outputs.{spec.given()[0]} did not compile within "
                                                     f"{GRAMMAR_COMPILE_TIMEOUT_S:g} s: simplify it (large "
                                                     f"repetition counts such as {{1000}} in a schema's pattern, "
                                                     f"many alternatives, a very large schema)")
        future.result()  # InvalidInput where it cannot be compiled

    async def render_own_template(self, req: "ChatTemplateFields", render: Callable[[Any], str]) -> str | None:
        """The prompt of a request that brings its own chat_template (--trust-request-chat-template), rendered
        ahead: ``render(tokenizer)`` on a thread of its own, with a tokenizer whose render runs in the template
        worker, within CHAT_TEMPLATE_TIMEOUT_S and its memory cap (ChatTemplateWorker); None for any
        other request (the tokenizer thread renders it). In the server's process, ``{{ 'x' * 10**10 }}`` would take
        10 GB, and two nested loops (90 bytes) rendered for hours."""
        if req.chat_template is None or not self.trust_request_chat_template:
            return None
        worker = self.template_worker
        if worker is None or worker.error:
            raise InvalidInput("chat_template", f"this server cannot run a request's chat_template: "
                                                f"{worker.error if worker else 'it has no template worker'}")
        if self.template_renders >= MAX_TEMPLATE_RENDERS:  # one worker, one render at a time: 10 s each at worst
            raise ApiError(503, f"the server is rendering {self.template_renders} requests' own chat templates, "
                                f"one at a time: retry later")
        left = threading.Event()
        tokenizer = WorkerTokenizer(self.engine.tokenizer, worker, CHAT_TEMPLATE_TIMEOUT_S, left)
        self.template_renders += 1
        future = on_daemon_thread("nanoserve-template", render, tokenizer)
        future.add_done_callback(self._template_render_done)  # its thread's end, not its client's
        try:
            return await asyncio.shield(future)  # InvalidInput where it does not render
        except asyncio.CancelledError:  # its client left (or the drain ended it): the worker stops rendering it
            worker.abandon(left)
            raise

    def _template_render_done(self, _: asyncio.Future) -> None:
        self.template_renders -= 1

    def end_all(self, why: str) -> None:
        """The drain timeout: what is still in flight ends now, each stream with
        an error event and [DONE], each other request with a 503."""
        if self.generations:
            logger.info("[entry] shutdown: aborting %d request(s) still in flight", len(self.generations))
        self.async_llm.fail_all(EngineDeadError(why))
        if self.admitting:  # else uvicorn cancels them DRAIN_GRACE_S later: a plain-text 500 and a traceback
            logger.info("[entry] shutdown: ending %d request(s) not in the engine", len(self.admitting))
        self.ending = why
        for task in self.admitting:
            task.cancel()  # endable turns it into a 503 with why

    @contextlib.contextmanager
    def endable(self) -> Iterator[None]:
        """The work of a request before the engine has it (its body arriving, tokenizing, its grammar
        compiling), or of one it never has (/tokenize's, a LoRA adapter's load waiting for the model
        thread), which end_all ends with a 503 as it does the requests in the engine. Not nested: the
        inner one's end would take the task out of ``admitting``."""
        task = asyncio.current_task()
        self.admitting.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if self.ending is None:  # not end_all's: a forced exit
                raise
            task.uncancel()
            raise _engine_error(EngineDeadError(self.ending)) from None
        finally:
            self.admitting.discard(task)


@dataclass
class OwnThreads:
    """Work that may run long (an xgrammar compile), one at a time, each on a daemon thread of its own, waited
    for up to a limit: one past it, or left by its client, finishes on its thread, holding up neither the next
    one nor the exit. With MAX_OVERDUE_COMPILES of them still running, a 503."""
    thread_name: str
    doing: str  # the 503's words: "the server is still {doing} {n} {what} ..."
    what: str
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    overdue: int = 0  # past their limit (or left by their client), still running

    async def run(self, fn: Callable[..., Any], *args: Any, limit: float) -> asyncio.Future | None:
        """fn(*args)'s future, done within ``limit`` seconds; None if it is not."""
        async with self.turn:
            if self.overdue >= MAX_OVERDUE_COMPILES:
                raise ApiError(503, f"the server is still {self.doing} {self.overdue} {self.what} that went past "
                                    f"the limit: retry later", headers={"Retry-After": "1"})
            future = on_daemon_thread(self.thread_name, fn, *args)
            try:
                done, _ = await asyncio.wait({future}, timeout=limit)
            finally:
                if not future.done():
                    self.overdue += 1
                    future.add_done_callback(self._overdue_ended)
        return future if done else None

    def _overdue_ended(self, _: asyncio.Future) -> None:
        self.overdue -= 1


def on_daemon_thread(name: str, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """fn(*args) on a daemon thread of its own, as a future of the running loop: unlike an executor's
    thread, one that never ends does not hold up the process's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    # its error marked as read once it ends (a waiter still gets it): one whose waiter left as it ended (a
    # client gone, cancel_on_disconnect) would otherwise be logged by asyncio as never retrieved
    future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def settle(ok: bool, value: Any) -> None:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            outcome = True, fn(*args)
        except Exception as e:
            outcome = False, e
        with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
            loop.call_soon_threadsafe(settle, *outcome)
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def cors_middleware(args: argparse.Namespace) -> Middleware:
    """vLLM's CORS flags as starlette's middleware."""
    if args.allow_credentials and "*" in args.allowed_origins:  # starlette then echoes any Origin back
        logger.warning("[entry] --allow-credentials with --allowed-origins '[\"*\"]': any web site may make "
                       "credentialed requests here and read the answers (as with vLLM); name the origins")
    return Middleware(CORS, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                      allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)


class CORS(CORSMiddleware):
    """starlette's, but over the connection limit a preflight gets the 503 too (with CORS's headers, as any
    answer), as uvicorn's limit refuses every request before the app: OK to a preflight promised a request
    that would be refused."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or "nanoserve.refused" not in scope:
            await super().__call__(scope, receive, send)
        elif "origin" in (headers := Headers(scope=scope)):  # starlette < 0.48's send() reads Origin unchecked
            await self.simple_response(scope, receive, send, request_headers=headers)
        else:  # no browser: no CORS headers to add
            await self.app(scope, receive, send)


def runtime_lora_updating() -> bool:
    """vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter: an environment variable."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")


def start_engine(config: EngineConfig, loras: list[LoRARequest]) -> LLMEngine:
    """The engine, and --lora-modules' adapters loaded into it (raises what either refuses)."""
    engine = LLMEngine(config)
    try:
        for lora in loras:
            engine.add_lora(lora)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def build_app(async_llm: AsyncLLM, args: argparse.Namespace) -> Starlette:
    """The HTTP app over an AsyncLLM that is not started yet: the app's lifespan
    starts it on uvicorn's loop and stops it at shutdown."""
    state = ServerState(async_llm, args.served_model_name, {m.lora_name: m for m in args.lora_modules},
                        args.api_key, args.max_queue_len,
                        args.max_request_body_bytes, ServerMetrics(async_llm, args.served_model_name[0]),
                        chat_template=args.chat_template,
                        chat_template_content_format=args.chat_template_content_format,
                        trust_request_chat_template=args.trust_request_chat_template,
                        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                        strict_tool_calling=os.environ.get("VLLM_ENFORCE_STRICT_TOOL_CALLING", "true").lower()
                        in ("true", "1"), tool_strict_level=args.tool_strict_level,
                        reasoning_parser=args.reasoning_parser,
                        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
                        force_include_usage=args.enable_force_include_usage,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        log_requests=args.enable_log_requests, max_log_len=args.max_log_len)
    if args.trust_request_chat_template:
        engine = async_llm.engine
        state.template_worker = ChatTemplateWorker(engine.tokenizer, engine.max_prompt_chars)
    log_content_format(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async_llm.start()
        if state.template_worker is not None:
            state.template_worker.start_soon()
        tasks = [asyncio.create_task(_exit_when_dead(state))]
        if not args.disable_log_stats:
            tasks.append(asyncio.create_task(log_stats_periodically(state, args.log_stats_interval)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for gen in list(state.generations):  # what the drain left
                gen.close("shutdown")
            await async_llm.shutdown()
            state.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            if state.template_worker is not None:
                state.template_worker.close()

    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/embeddings", create_embedding, methods=["POST"]),
        Route("/v2/embed", create_cohere_embedding, methods=["POST"]),
        Route("/pooling", create_pooling, methods=["POST"]),
        Route("/classify", create_classify, methods=["POST"]),
        *(Route(path, create_score, methods=["POST"]) for path in ("/score", "/v1/score")),
        *(Route(path, create_rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", retrieve_response, methods=["POST"]),
        Route("/v1/messages", create_message, methods=["POST"]),  # Anthropic's Messages API
        Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # SageMaker's health check, as vLLM serves it
        Route("/invocations", invocations, methods=["POST"]),  # and its inference endpoint
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        *([Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
           Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
          if args.enable_lora and runtime_lora_updating() else []),
    ]
    routes = routes_for_runner(routes, async_llm.engine.runner_type)
    # CORS outermost (vLLM has it inside its API-key check): a preflight never meets
    # the key check, and every answer a browser reads, a 401 included, has its headers.
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[cors_middleware(args),
                                Middleware(EntryMiddleware, state=state, root_path=args.root_path)],
                    exception_handlers={ApiError: _api_error_handler, HTTPException: _http_error_handler,
                                        ClientDisconnect: _client_left_handler, Exception: _internal_error_handler})
    app.state.server = state
    return app


async def _exit_when_dead(state: ServerState) -> None:
    """An engine that cannot recover (its loop gave up, or a tensor-parallel
    worker died): /health is 503; drain, exit 1, so that a supervisor restarts
    the server (as vLLM's does)."""
    dead = asyncio.ensure_future(state.async_llm.dead.wait())
    try:
        while not dead.done():
            try:
                state.engine.check_health()
            except EngineDeadError as e:
                state.async_llm.fail_all(e)
                break
            await asyncio.wait({dead}, timeout=0.5)
    finally:
        dead.cancel()
    logger.error("[entry] the engine cannot recover: /health answers 503; draining, then exiting with status 1")
    state.exit_code = 1
    if state.request_shutdown is not None:
        state.request_shutdown()


class EntryMiddleware:
    """Gives every HTTP request its id (X-Request-Id, read or made, echoed in the
    response) and checks the API key where work is done. Plain ASGI, not
    Starlette's BaseHTTPMiddleware, which would hide client disconnects from the
    handlers."""

    def __init__(self, app, state: ServerState, root_path: str | None = None):
        self.app, self.state, self.root_path = app, state, root_path
        self.api_keys = None if state.api_key is None else [k.encode() for k in state.api_key]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        root = self.root_path  # --root-path: the prefix goes once, here, so that routes and the key check agree
        if root and (scope["path"] == root or scope["path"].startswith(root + "/")):
            scope = {**scope, "path": scope["path"][len(root):] or "/"}
        # Any value, as vLLM takes it (a trace id such as Root=1-abc;x=y, a/b): echoed as sent,
        # and in the engine and the logs escaped where it is not printable (no forged log line).
        given = _header(scope, b"x-request-id")
        too_long = len(given) > MAX_REQUEST_ID  # it would stand in every log line of the request: refused below
        given = b"" if too_long else given
        scope["nanoserve.request_id_given"] = bool(given)  # else a body's request_id may name it
        scope["nanoserve.request_id"] = esc(given.decode("latin-1")) if given else uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                echo = given or scope["nanoserve.request_id"].encode()  # or the id made, or the body's
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", echo)]}
            await send(message)

        error = scope.get("nanoserve.refused")  # H11WithTimeouts': over the connection limit
        if error is None and too_long:
            error = bad_request(f"X-Request-Id is longer than {MAX_REQUEST_ID} characters", "X-Request-Id")
        if error is not None:
            await _reject(self.state, scope, error)(scope, receive, send_with_id)
            return
        # OPTIONS passes, as in vLLM: a browser's CORS preflight never carries the key
        if self.api_keys is not None and scope["method"] != "OPTIONS" and _needs_key(scope["path"]):
            scheme, _, token = _header(scope, b"authorization").partition(b" ")
            if _anthropic(scope) and not scheme:  # Anthropic's clients send the key as x-api-key (their api_key)
                scheme, token = b"bearer", _header(scope, b"x-api-key")
            known = [hmac.compare_digest(token.strip(), key) for key in self.api_keys]  # constant time: all of them
            if scheme.lower() != b"bearer" or not any(known):
                also = " or `x-api-key: <key>`" if _anthropic(scope) else ""
                error = ApiError(401, f"missing or wrong API key: send `Authorization: Bearer <key>`{also}",
                                 headers={"WWW-Authenticate": "Bearer"})
                await _reject(self.state, scope, error)(scope, receive, send_with_id)
                return
        await self.app(scope, receive, send_with_id)


def _header(scope, name: bytes) -> bytes:
    return next((v for k, v in scope["headers"] if k == name), b"")


def _needs_key(path: str) -> bool:
    """As vLLM's AuthenticationMiddleware: paths under /v1. /tokenize, /detokenize and /invocations stay open
    as there (SageMaker, which calls /invocations, sends no Authorization), as do /health, /metrics ..."""
    return path.startswith("/v1")


# =========================================================================== handlers

async def create_completion(request: Request) -> Response:
    return await _generate(request, CompletionGeneration)


async def create_chat_completion(request: Request) -> Response:
    return await _generate(request, ChatGeneration)


async def invocations(request: Request) -> Response:
    """SageMaker's one endpoint, as vLLM serves it: a chat body (messages) or a completion's (prompt)."""
    def parse(body: dict[str, Any]) -> tuple[type[Generation], GenerationRequest]:
        kind = ChatGeneration if "messages" in body else CompletionGeneration if "prompt" in body else None
        if kind is None:
            raise bad_request("an /invocations body is a chat completion's (messages) or a completion's (prompt)")
        return kind, kind.parse(body, _request_id(request))
    return await _generate(request, *await read_json(request, _state(request), parse))


async def _generate(request: Request, kind: type["Generation"], req: GenerationRequest | None = None) -> Response:
    """Completions and chat: parse, admit (``Generation.admit``: tokenize off the loop, then
    ``AsyncLLM.add_request`` in engine.py), then stream (``stream_events``) or collect the
    ``RequestOutput``s the engine puts on the generation's queue."""
    state, request_id = _state(request), _request_id(request)
    if req is None:
        req = await read_json(request, state, functools.partial(kind.parse, request_id=request_id), kind.check_raw)
    request_id = settle_request_fields(request, req, state)
    model = check_model(req, state)
    async with cancel_on_disconnect(request):
        gen = await kind.admit(state, request_id, req)
    if state.log_requests:
        log_inputs(gen, state.max_log_len)
    if req.stream:
        return EventStream(gen, model)
    finals = await _collect_or_disconnect(request, gen)
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    return json_response(gen.response(model, finals))


def log_inputs(gen: "Generation", max_log_len: int | None) -> None:
    """--enable-log-requests, as vLLM's request logger: each prompt (its first
    ``max_log_len`` characters and token ids) and the sampling parameters."""
    for i, prompt in enumerate(gen.prompts):
        text = json.dumps(None if prompt.text is None else prompt.text[:max_log_len], ensure_ascii=False)
        logger.info("[entry] %s: prompt %d: %s, prompt_token_ids: %s, params: %r", gen.request_id, i,
                    text if text.isprintable() else text.encode("ascii", "backslashreplace").decode(),
                    prompt.token_ids[:max_log_len], gen.params)


async def list_models(request: Request) -> Response:
    state = _state(request)
    created, info = int(time.time()), state.engine.describe()
    permission = {"object": "model_permission", "created": created, "allow_create_engine": False,  # vLLM's defaults
                  "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                  "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    return json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "nanoserve",
         "root": info.model, "parent": None, "max_model_len": info.max_model_len,
         "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", **permission}]}
        for name in state.model_names] + [
        {"id": name, "object": "model", "created": created, "owned_by": "nanoserve", "root": lora.lora_path,
         "parent": state.model_names[0], "max_model_len": info.max_model_len,
         "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", **permission}]}
        for name, lora in state.loras.items()]})


async def health(request: Request) -> Response:
    async_llm = _state(request).async_llm
    if async_llm.is_running:
        return Response(status_code=200)
    return ApiError(503, DEAD_MESSAGE if async_llm.errored else "the engine is not running").response()


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.exposed), media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: Request) -> Response:
    state = _state(request)
    req = await read_json(request, state, functools.partial(parse_body, TokenizeRequest,
                                                             request_id=_request_id(request)))
    check_model(req, state)
    try:
        async with cancel_on_disconnect(request):
            with state.endable():
                text = None if req.messages is None else await state.render_own_template(
                    req, lambda tokenizer: render_chat(state, req, req.tools, tokenizer))
                out = await state.off_loop(_tokenize, state, req, text)
    except InvalidInput as e:
        raise req.invalid(e) from None
    return json_response(out)


def _tokenize(state: ServerState, req: TokenizeRequest, text: str | None) -> dict[str, Any]:
    """/tokenize's response (on the tokenizer thread; raises InvalidInput), of ``text`` if rendered ahead."""
    engine = state.engine
    if text is None:
        text = req.prompt if req.messages is None else render_chat(state, req, req.tools)
    special = req.add_special_tokens if req.add_special_tokens is not None else req.messages is None
    _, ids = engine.tokenize(text, add_special_tokens=special)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,  # token_strs null, as vLLM's
            "token_strs": engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}


# ---------------------------------------------------------------- embeddings (the pooling runner)
# vLLM's /v1/embeddings (entrypoints/pooling/embed): served when the engine runs the pooling runner, which
# serves no generation; each runner's server answers the other's endpoints with a 404, as vLLM mounts
# only its own (here with why).

# /v1/messages/count_tokens too: vLLM mounts Anthropic's routes for generation only (/tokenize serves both)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


EMBED_DTYPES = {"float32": (torch.float32, "<f4"), "float16": (torch.float16, "<f2"),  # vLLM's embed_dtype:
                "bfloat16": (torch.bfloat16, "<u2"), "fp8_e4m3": (torch.float8_e4m3fn, "u1"),  # the bytes of
                "fp8_e5m2": (torch.float8_e5m2, "u1")}  # each, read as the numpy type of their width


def _is_conversation(value: Any) -> bool:
    """vLLM's test for chat messages given as ``input``: a non-empty list of objects with a string role."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


class PoolingBasicRequest(OpenAIBaseModel):
    """The fields every pooling body shares (vLLM's PoolingBasicRequestMixin, with use_activation)."""
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    padding: typing.Literal["max_length", "do_not_pad"] | None = None  # max_length: pad to max_model_len
    truncation_side: typing.Literal["left", "right"] | None = None  # left: keep the last tokens, right: the
    # first; None: the tokenizer's (vLLM's), right for most
    use_activation: bool | None = None
    priority: int = 0
    request_id: str | None = None  # X-Request-Id wins, as vLLM's
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, (harmless, why) in UNSUPPORTED_FIELDS.items():  # as GenerationRequest's
                if name in data and not any(_coerces_to(data[name], v) for v in harmless):
                    raise InvalidInput(name, f"{name} is not supported: {why}")
        return data

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, v: str) -> str:
        return GenerationRequest._request_id(v)  # one that can be logged and echoed in X-Request-Id


class EmbeddingRequest(ChatTemplateFields, PoolingBasicRequest):
    """vLLM's /v1/embeddings body: ``input`` (prompts), or ``messages`` (one chat, or a list of chats)
    that the chat template renders, as vLLM's EmbeddingChatRequest and EmbeddingBatchChatRequest;
    chat messages given as ``input`` are taken as ``messages``, as vLLM's."""
    prompt_field: ClassVar[str] = "input"
    # the response's: its id's prefix, and each vector's object and field
    id_prefix: ClassVar[str] = "embd-"
    vector_object: ClassVar[str] = "embedding"
    vector_field: ClassVar[str] = "embedding"
    input: Any = None  # one of PROMPT_SHAPES
    add_generation_prompt: bool = False  # vLLM's pooling default: the chat is embedded as it is
    add_special_tokens: bool | None = None  # left out: true for input, false for messages (the template adds them)
    encoding_format: typing.Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: typing.Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: typing.Literal["native", "big", "little"] = "native"
    dimensions: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_input_and_removed_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "normalize" in data:  # vLLM's words (reject_removed_pooling_parameters; its scoring ignores it)
            raise InvalidInput("normalize", "Parameter `normalize` was removed; use `use_activation` instead.")
        if "tools" in data or "documents" in data:  # not fields of vLLM's pooling bodies: ignored, as any unknown
            data = {k: v for k, v in data.items() if k not in ("tools", "documents")}  # (a rerank's documents too)
        given = data.get("input")
        if "messages" not in data and (_is_conversation(given) or isinstance(given, list) and given
                                       and all(_is_conversation(c) for c in given)):
            data = {**{k: v for k, v in data.items() if k != "input"}, "messages": given}
        return data

    @field_validator("input")
    @classmethod
    def _inputs(cls, p: Any) -> list[str | list[int]]:
        """Only the shape, as CompletionRequest's prompt: the engine checks the token ids."""
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p and isinstance(p[0], int) and not isinstance(p[0], bool):
            return [p]
        if isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p)):
            return list(p)
        raise ValueError(f"input must be {PROMPT_SHAPES} (and not empty), got {show(p)}")

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: Any) -> list[list[dict[str, Any]]]:
        """One chat, or a non-empty list of chats (vLLM's batch): always a list of chats here."""
        if isinstance(messages, list) and messages and all(isinstance(c, list) for c in messages):
            return [ChatTemplateFields._messages(c) for c in messages]
        return [ChatTemplateFields._messages(messages)]

    @model_validator(mode="after")
    def _input_or_messages(self) -> "EmbeddingRequest":
        if self.input is not None and self.messages is not None:
            raise InvalidInput("messages", "input or messages, not both: input's prompts, or messages' chats")
        if self.input is None and self.messages is None:  # vLLM's schema's (before a token-wise server's 501)
            raise InvalidInput("input", f"input is required: {PROMPT_SHAPES} (or messages, chat messages)")
        return self

    def param_name(self, engine_param: str) -> str:
        if engine_param == "prompt":
            return "messages" if self.messages is not None else "input"
        return super().param_name(engine_param)

    def num_prompts(self) -> int:
        return len(self.input if self.messages is None else self.messages)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(self.dimensions, self.use_activation, self.truncate_prompt_tokens)


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling body: an embeddings body with the pooling ``task`` (the server's: embed for an
    embedding model, classify for a classifier, or --pooler-config's token_embed or token_classify),
    without ``dimensions``; the answer holds each vector (a classifier's: its probabilities; a token-wise
    task's: a row per prompt token) as a "pooling" object's ``data``."""
    id_prefix: ClassVar[str] = "pool-"
    vector_object: ClassVar[str] = "pooling"
    vector_field: ClassVar[str] = "data"
    task: str | None = None

    @model_validator(mode="after")
    def _no_dimensions(self) -> "PoolingRequest":
        if self.dimensions is not None:  # vLLM's words
            raise InvalidInput("dimensions", "dimensions is currently not supported")
        check_removed_pooling_task(self.task)  # vLLM's words
        return self


class ClassificationRequest(EmbeddingRequest):
    """vLLM's /classify body (ClassificationCompletionRequest and ClassificationChatRequest): ``input``'s
    prompts or ``messages``' chats, each classified by the model's score head."""
    id_prefix: ClassVar[str] = "classify-"
    EMBEDDING_ONLY: ClassVar[tuple[str, ...]] = ("dimensions", "encoding_format", "embed_dtype", "endianness")

    @model_validator(mode="before")
    @classmethod
    def _embedding_only_fields(cls, data: Any) -> Any:
        """vLLM's classify body has no such fields, so it ignores them as any unknown field: so does this one."""
        if isinstance(data, dict) and any(k in data for k in cls.EMBEDDING_ONLY):
            data = {k: v for k, v in data.items() if k not in cls.EMBEDDING_ONLY}
        return data


async def create_pooling(request: Request, req: PoolingRequest | None = None) -> Response:
    """POST /pooling (vLLM's): the model's pooler output (an embedding model's vectors, a classifier's
    probabilities, as /v1/embeddings and /classify compute them; a token-wise task's rows, a prompt's
    tokens' each). ``req``: a body pooling_invocations read."""
    state = _state(request)
    _check_pooling_server(request, state, None)
    if req is None:
        req = await read_json(request, state, functools.partial(parse_body, PoolingRequest,
                                                                 request_id=_request_id(request)))
    try:
        state.engine.check_pooling_task(req.task or state.engine.pooling_task, online=True)
    except InvalidInput as e:
        raise req.invalid(e) from None
    return await _embed(request, state, req)


def _check_pooling_server(request: Request, state: ServerState, task: str | None) -> None:
    """A 404 that says why where this server does not serve the path: a generative model's server, or
    a pooling one whose model has another task (vLLM mounts a task's routes only for its models)."""
    engine = state.engine
    if engine.runner_type != "pooling":
        raise ApiError(404, f"this server generates text (--runner generate): {esc(request.url.path)} needs a "
                            f"pooling model served with --runner pooling")
    if task is not None and task != engine.pooling_task and task not in engine.supported_pooling_tasks:
        kind = "a classifier (a ForSequenceClassification model)" if task == "classify" else "an embedding model"
        raise ApiError(404, f"this server's model serves the {engine.pooling_task} task: "
                            f"{esc(request.url.path)} needs {kind}")


def _check_task_served(state: ServerState, task: str) -> None:
    """vLLM's 501 where the model has ``task`` but --pooler-config's task is its token-wise one: its route is
    mounted, so (as vLLM's) a body is validated first, a bad one a 400."""
    if task != state.engine.pooling_task:
        raise ApiError(501, f"The model does not support {'Embeddings' if task == 'embed' else 'Classification'} API")


async def create_embedding(request: Request, req: EmbeddingRequest | None = None) -> Response:
    """POST /v1/embeddings: one engine request per prompt or chat, batched by the scheduler as any prompts
    (``req``: a body pooling_invocations read)."""
    state = _state(request)
    _check_pooling_server(request, state, "embed")
    if req is None:
        req = await read_json(request, state, functools.partial(parse_body, EmbeddingRequest,
                                                                 request_id=_request_id(request)))
    _check_task_served(state, "embed")
    return await _embed(request, state, req)


async def pooling_invocations(request: Request) -> Response:
    """SageMaker's /invocations on a pooling server, as vLLM's: the first handler whose body the request
    is, in vLLM's order: the model's own task's (``input`` or ``messages``; an embed or classify server's),
    then rerank's (``query`` and ``documents``) and score's (one of SCORE_FIELDS' pairs) where the model
    scores, then /pooling's. A body that is not one handler's (a missing or malformed field) is tried as
    the next's, so ``input`` beside a valid ``query`` and ``documents`` is a rerank where ``input`` is bad."""
    state, request_id = _state(request), _request_id(request)
    task = state.engine.pooling_task
    own = [(EmbeddingRequest, create_embedding)] if task == "embed" else \
        [(ClassificationRequest, create_classify)] if task == "classify" else []
    scores = [(RerankRequest, create_rerank), (ScoreRequest, create_score)] if _scores(state) else []
    handlers = [*own, *scores, (PoolingRequest, create_pooling)]

    def parse(body: dict[str, Any]) -> tuple[Callable[..., Awaitable[Response]], Any]:
        for schema, handler in handlers:
            if _body_fits(schema, body):
                try:
                    return handler, parse_body(schema, body, request_id=request_id)
                except (ApiError, InvalidInput):  # not this handler's body: vLLM tries the next
                    continue
        raise bad_request(f"Cannot find suitable handler for request. Expected one of: "
                          f"{[schema.__name__ for schema, _ in handlers]}")  # vLLM's words
    handler, req = await read_json(request, state, parse)
    return await handler(request, req=req)


def _body_fits(schema: type[OpenAIBaseModel], body: dict[str, Any]) -> bool:
    """Whether ``body`` has the fields that make it a ``schema`` body (its errors are that schema's)."""
    if schema is ScoreRequest:
        return any(set(pair) <= body.keys() for pair in SCORE_FIELDS)
    if schema is RerankRequest:
        return {"query", "documents"} <= body.keys()
    return "input" in body or "messages" in body


async def create_classify(request: Request, req: ClassificationRequest | None = None) -> Response:
    """POST /classify (vLLM's): each prompt's (or chat's) probabilities per label, and its likeliest label
    by config.json's id2label."""
    state = _state(request)
    _check_pooling_server(request, state, "classify")
    if req is None:
        req = await read_json(request, state, functools.partial(parse_body, ClassificationRequest,
                                                                 request_id=_request_id(request)))
    _check_task_served(state, "classify")
    pooled = await _pool_inputs(request, state, req)
    if pooled is None:
        return Response(status_code=499)  # nobody is listening
    request_id, model, prompts, vectors = pooled
    labels = state.engine.model_config.id2label
    usage = pooling_usage(sum(len(p.token_ids) for p in prompts))
    data = [{"index": i, "label": labels.get(int(v.argmax())), "probs": v.tolist(), "num_classes": len(v)}
            for i, v in enumerate(vectors)]
    return json_response({"id": f"classify-{request_id}", "object": "list", "created": int(time.time()),
                          "model": model, "data": data, "usage": usage})


async def _embed(request: Request, state: ServerState, req: EmbeddingRequest) -> Response:
    """An EmbeddingRequest's vectors, one per prompt or chat, as vLLM's embeddings (or /pooling) answer."""
    pooled = await _pool_inputs(request, state, req)
    if pooled is None:
        return Response(status_code=499)  # nobody is listening
    request_id, model, prompts, vectors = pooled
    num_tokens = sum(len(p.token_ids) for p in prompts)
    head = {"id": f"{req.id_prefix}{request_id}", "object": "list", "created": int(time.time()), "model": model}
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}  # the bytes header's, as vLLM's
    if req.encoding_format in ("bytes", "bytes_only"):
        return _bytes_response(vectors, req, {**head, "usage": usage})
    usage = pooling_usage(num_tokens)
    return json_response({**head, "data": [{"index": i, "object": req.vector_object,
                                            req.vector_field: _encode_embedding(v, req)}
                                           for i, v in enumerate(vectors)], "usage": usage})


def pooling_usage(num_tokens: int) -> dict[str, Any]:
    """A pooling answer's usage, vLLM's UsageInfo whole: its prompts' tokens, none generated."""
    return with_nulls({"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
                      Generation.USAGE_NULLS)


async def _pool_inputs(request: Request, state: ServerState, req: EmbeddingRequest) -> "Pooled | None":
    """An embeddings-shaped body's (``input`` or chat ``messages``) vectors, one per prompt or chat."""
    return await _pool(request, state, req, functools.partial(_pooling_prompts, state, req))


Pooled = tuple[str, str, list[TokenizedPrompt], list[torch.Tensor]]  # request id, model, prompts, vectors


async def _pool(request: Request, state: ServerState, req: PoolingBasicRequest,
                make_prompts: Callable[..., list[TokenizedPrompt]]) -> Pooled | None:
    """A pooling body's engine requests, one per prompt that ``make_prompts(params, texts, lora)`` makes on
    the tokenizer thread, admitted as completions' are (--max-queue-len, before and after tokenizing), each
    observed in /metrics as vLLM observes a pooling request; None if the client left first."""
    if req.request_id is not None and not request.scope["nanoserve.request_id_given"]:
        request.scope["nanoserve.request_id"] = esc(req.request_id)
    request_id = _request_id(request)
    model = check_model(req, state)
    lora = state.loras.get(req.model)
    engine, queue, ids, prompts = state.engine, asyncio.Queue(), [], []
    try:
        async with cancel_on_disconnect(request):
            with state.endable():
                check_queue(state, req, 1)
                params = engine.check_pooling_params(req.pooling_params())
                engine.check_priority(req.priority)
                texts = await _render_chats(state, req)
                prompts = await state.off_loop(make_prompts, params, texts, lora)
                check_queue(state, req, 1)  # again: others may have queued meanwhile
        for i, prompt in enumerate(prompts):
            ids.append(request_id if len(prompts) == 1 else f"{request_id}-{i}")
            state.async_llm.add_request(prompt, params, ids[-1], queue, priority=req.priority)
        vectors = await _embeddings_or_disconnect(request, queue, ids, state.metrics)
    except InvalidInput as e:
        raise req.invalid(e) from None
    except (EngineDeadError, RequestFailedError) as e:
        raise _engine_error(e) from None
    finally:
        for engine_id in ids:  # those not finished: an error, or the client gone
            if state.async_llm.queues.get(engine_id) is queue:
                state.metrics.count_finished("abort")  # as a completion's aborted choices
            state.async_llm.abort(engine_id, queue)
    return None if vectors is None else (request_id, model, prompts, vectors)


async def _render_chats(state: ServerState, req: EmbeddingRequest) -> list[str | None] | None:
    """Each chat's prompt where the request brings its own chat_template (rendered ahead, within its time
    limit: ServerState.render_own_template), else None for the tokenizer thread to render; None for input."""
    if req.messages is None:
        return None
    chats = [req.model_copy(update={"messages": chat}) for chat in req.messages]
    return [await state.render_own_template(chat, functools.partial(render_chat, state, chat, None))
            for chat in chats]


def _pooling_prompts(state: ServerState, req: EmbeddingRequest, params: PoolingParams,
                     texts: list[str | None] | None, lora: LoRARequest | None) -> list[TokenizedPrompt]:
    """On the tokenizer thread: input's prompts, or messages' chats rendered by the chat template
    (with no special tokens of the tokenizer's own unless asked, as vLLM's)."""
    if req.messages is None:
        sources, special = req.input, req.add_special_tokens is not False
    else:
        sources = [text if text is not None else render_chat(state, req.model_copy(update={"messages": chat}), None)
                   for chat, text in zip(req.messages, texts)]
        special = bool(req.add_special_tokens)
    return _tokenize_pooled(state, req, params, sources, special, lora)


def _tokenize_pooled(state: ServerState, req: PoolingBasicRequest, params: PoolingParams, sources: list,
                     special: bool, lora: LoRARequest | None) -> list[TokenizedPrompt]:
    prompts = [state.engine.process_pooling_prompt(p, params, special, req.truncation_side, req.padding)
               for p in sources]
    for p in prompts:  # as Generation.process_prompts
        p.cache_salt = req.cache_salt
        p.lora_int_id = None if lora is None else lora.lora_int_id
    return prompts


async def _embeddings_or_disconnect(request: Request, queue: asyncio.Queue, ids: list[str],
                                    metrics: "ServerMetrics") -> list[torch.Tensor] | None:
    """Each engine request's vector, in order; None if the client left first."""
    found = {}
    async with watch_disconnect(request.receive, queue):
        while len(found) < len(ids):
            out = await queue.get()
            if isinstance(out, ClientDisconnect):
                return None
            if isinstance(out, Exception):
                raise out
            found[out.request_id] = out.outputs.data
            metrics.observe_pooled(out)
    return [found[i] for i in ids]


def _embedding_bytes(vector: torch.Tensor, req: EmbeddingRequest) -> bytes:
    """vLLM's tensor2binary: the vector as ``embed_dtype``'s bytes, in ``endianness``'s order (native:
    this machine's, as vLLM's)."""
    dtype, view = EMBED_DTYPES[req.embed_dtype]
    array = vector.to(dtype).view(torch.uint8).numpy().view(view)
    if req.endianness == "big" or req.endianness == "native" and sys.byteorder == "big":
        array = array.byteswap()
    return array.tobytes()


def _encode_embedding(vector: torch.Tensor, req: EmbeddingRequest) -> list[float] | str:
    """vLLM's: a list of floats (embed_dtype does not apply), or base64 of embed_dtype's bytes (float32,
    little-endian on this machine: what the openai SDK asks for and decodes)."""
    if req.encoding_format == "base64":
        return base64.b64encode(_embedding_bytes(vector, req)).decode()
    return vector.tolist()


def _bytes_response(vectors: list[torch.Tensor], req: EmbeddingRequest, head: dict[str, Any]) -> Response:
    """vLLM's encoding_format bytes: the vectors' bytes one after another (application/octet-stream),
    and where each lies in a `metadata` header (bytes_only: none)."""
    chunks = [_embedding_bytes(v, req) for v in vectors]
    offsets = list(itertools.accumulate(map(len, chunks), initial=0))
    data = [{"index": i, "embed_dtype": req.embed_dtype, "endianness": req.endianness, "start": offsets[i],
             "end": offsets[i + 1], "shape": list(v.shape)} for i, v in enumerate(vectors)]
    metadata = {"id": head["id"], "created": head["created"], "model": head["model"], "data": data,
                "usage": head["usage"]}
    headers = None if req.encoding_format == "bytes_only" else {"metadata": dumps(metadata)}
    return Response(b"".join(chunks), 200, headers, media_type="application/octet-stream")


# ---------------------------------------------------------------- Cohere's /v2/embed (the pooling runner)
# vLLM's CohereEmbedRequest on an embedding model: its texts (or text-only inputs) embedded as an
# EmbeddingRequest would embed them, answered as Cohere's embeddings_by_type.

COHERE_EMBEDDING_TYPES = ("float", "binary", "ubinary", "base64")


class CohereEmbedContent(_Strict):
    """One part of a Cohere input: text here (vLLM takes image_url too, a multimodal model's)."""
    type: typing.Literal["text", "image_url"]
    text: str | None = None
    image_url: dict[str, str] | None = None

    @model_validator(mode="after")
    def _payload(self) -> "CohereEmbedContent":
        if self.type == "text" and self.text is None:  # vLLM's words
            raise ValueError("CohereEmbedContent with type='text' requires text")
        if self.type == "image_url" and not (self.image_url or {}).get("url"):
            raise ValueError("CohereEmbedContent with type='image_url' requires image_url.url")
        return self


class CohereEmbedInput(_Strict):
    content: list[CohereEmbedContent]


class CohereEmbedRequest(OpenAIBaseModel):
    """vLLM's /v2/embed body (Cohere's Embed v2): exactly one of ``texts``, ``images`` or ``inputs``;
    ``input_type`` picks the model's task-instruction prefix, ``truncate`` END/START/NONE with ``max_tokens``,
    ``output_dimension`` a Matryoshka model's, ``embedding_types`` the encodings the answer carries."""
    prompt_field: ClassVar[str] = "texts"
    input_type: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    inputs: list[CohereEmbedInput] | None = None
    output_dimension: int | None = None
    embedding_types: list[typing.Literal["float", "binary", "ubinary", "base64"]] | None = None
    truncate: typing.Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = None
    priority: int = 0

    @model_validator(mode="after")
    def _one_input(self) -> "CohereEmbedRequest":
        given = [f for f in (self.texts, self.images, self.inputs) if f is not None]
        if len(given) != 1 or not given[0]:  # vLLM's words
            raise InvalidInput("texts", "Exactly one of texts, images, or inputs must be provided, and it must be "
                                        "non-empty")
        if self.images is not None or any(c.type == "image_url" for i in self.inputs or () for c in i.content):
            raise InvalidInput("images" if self.images is not None else "inputs",
                               "multimodal inputs are not supported: images (and image_url contents) need a "
                               "multimodal model")
        return self

    def truncation(self) -> tuple[int | None, str | None]:
        """vLLM's: (truncate_prompt_tokens, truncation_side); NONE cuts nothing (max_tokens is checked after)."""
        if self.truncate == "NONE":
            return None, None
        keep = self.max_tokens if self.max_tokens is not None else -1
        return keep, "left" if self.truncate == "START" else None

    def as_embedding_request(self, instructions: dict[str, str] | None, has_template: bool) -> EmbeddingRequest:
        """vLLM's proxy: texts as input (the input_type prefix prepended, or, with a chat template, the
        prefix a system message and each text a chat's user message); text inputs always as chats."""
        if self.input_type is not None and instructions is None:  # vLLM's words
            raise InvalidInput("input_type", f"Unsupported input_type {self.input_type!r}. This model does not "
                                             f"define any input_type task instructions.")
        if self.input_type is not None and self.input_type not in instructions:
            raise InvalidInput("input_type", f"Unsupported input_type {self.input_type!r}. Supported values: "
                                             f"{', '.join(sorted(instructions))}")
        prefix = (instructions or {}).get(self.input_type) or None
        keep, side = self.truncation()
        common = dict(model=self.model, dimensions=self.output_dimension, truncate_prompt_tokens=keep,
                      truncation_side=side, priority=self.priority)
        if self.texts is not None and (prefix is None or not has_template):
            return EmbeddingRequest(input=[(prefix or "") + t for t in self.texts], **common)
        parts = [[{"type": "text", "text": t}] for t in self.texts] if self.texts is not None else \
            [[{"type": "text", "text": c.text} for c in i.content] for i in self.inputs]
        system = [] if prefix is None else [{"role": "system", "content": [{"type": "text", "text": prefix}]}]
        return EmbeddingRequest(messages=[[*system, {"role": "user", "content": p}] for p in parts], **common)

    def param_name(self, engine_param: str) -> str:
        texts = "texts" if self.texts is not None else "inputs"  # (the proxy's input, or its messages)
        return {"dimensions": "output_dimension", "truncate_prompt_tokens": "max_tokens", "prompt": texts,
                "input": texts, "messages": texts}.get(engine_param, engine_param)


async def create_cohere_embedding(request: Request) -> Response:
    """POST /v2/embed (vLLM's Cohere Embed v2, on an embedding model): each text's vector in every
    asked ``embedding_types`` encoding (float by default), with Cohere's meta."""
    state = _state(request)
    _check_pooling_server(request, state, "embed")
    req = await read_json(request, state, functools.partial(parse_body, CohereEmbedRequest,
                                                             request_id=_request_id(request)))
    _check_task_served(state, "embed")
    engine = state.engine
    has_template = bool(state.chat_template or getattr(engine.tokenizer, "chat_template", None))
    try:
        proxy = req.as_embedding_request(engine.task_instructions, has_template)
    except InvalidInput as e:
        raise req.invalid(e) from None
    except ValidationError as e:
        raise bad_request(str(e.errors(include_url=False)[0]["msg"]), req.param_name("prompt")) from None
    try:
        pooled = await _pool_inputs(request, state, proxy)
    except ApiError as e:  # the proxy's field names in this body's words
        e.param = req.param_name(e.param) if e.param else e.param
        raise
    if pooled is None:
        return Response(status_code=499)  # nobody is listening
    request_id, _, prompts, vectors = pooled
    if req.truncate == "NONE" and req.max_tokens is not None:
        for p in prompts:  # vLLM's check, after the run: NONE with max_tokens cuts nothing, refuses the long
            if len(p.token_ids) > req.max_tokens:
                raise bad_request(f"Input of {len(p.token_ids)} tokens exceeds max_tokens={req.max_tokens} with "
                                  f"truncate=NONE. Set truncate to END or START to allow truncation.", "max_tokens")
    floats = [v.tolist() for v in vectors]
    embeddings = {kind: cohere_embeddings(floats, kind) for kind in req.embedding_types or ["float"]}
    body = {"id": f"embd-{request_id}", "embeddings": embeddings, "texts": req.texts,
            "meta": {"api_version": {"version": "2"},
                     "billed_units": {"input_tokens": sum(len(p.token_ids) for p in prompts), "image_tokens": 0}},
            "response_type": "embeddings_by_type"}
    return json_response({k: v for k, v in body.items() if v is not None})  # vLLM's exclude_none


def cohere_embeddings(floats: list[list[float]], kind: str) -> list:
    """vLLM's build_typed_embeddings for one type: the floats; binary/ubinary each sign bit (>= 0 is 1)
    packed eight to a byte, most significant first (binary's bytes minus 128); base64 of little-endian fp32."""
    if kind == "float":
        return floats
    if kind == "base64":
        return [base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() for v in floats]
    dim = len(floats[0])
    if dim % 8:  # vLLM's words
        raise bad_request(f"Embedding dimension must be a multiple of 8 for binary embedding types, but got {dim}.",
                          "embedding_types")
    bits = (torch.tensor(floats, dtype=torch.float64) >= 0).long().view(len(floats), dim // 8, 8)
    packed = (bits * torch.tensor([128, 64, 32, 16, 8, 4, 2, 1])).sum(-1)
    return (packed - 128 if kind == "binary" else packed).tolist()

# ---------------------------------------------------------------- score and rerank (the pooling runner)
# vLLM's Score and Rerank APIs (entrypoints/pooling/scoring) for an embedding model, its bi-encoder: each
# text embedded once, each pair scored by the cosine similarity of its two embeddings (token_embed's, a
# ColBERT model's, by late interaction: MaxSim over the two texts' token rows).

# vLLM's ScoreRequest: any of these pairs of fields, the first that the body completes
SCORE_FIELDS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoringRequest(PoolingBasicRequest):
    """What score and rerank bodies share (vLLM's ScoringRequestMixin). ``instruction`` and
    ``chat_template_kwargs`` are a cross-encoder's score template's, which a bi-encoder does not read."""
    messages: ClassVar[None] = None  # no chats: the texts are embedded as given, with special tokens
    add_special_tokens: ClassVar[None] = None
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None
    chat_template_kwargs: dict | None = None
    _sides: tuple[list[str], list[str]] = PrivateAttr(([], []))
    _cross_encoder: bool = PrivateAttr(False)  # each pair one prompt (a classifier's), else each text
    _late_interaction: bool = PrivateAttr(False)  # each text's token rows, scored by MaxSim

    def side_names(self) -> tuple[str, str]:
        raise NotImplementedError

    def side_values(self) -> tuple[Any, Any]:
        return getattr(self, self.side_names()[0]), getattr(self, self.side_names()[1])

    def check_inputs(self, architecture: str) -> None:
        """The texts, paired as vLLM pairs them (1:1, 1:N, N:N), or an InvalidInput naming the field."""
        self._sides = score_inputs(*self.side_values(), architecture, self.side_names())

    @property
    def sides(self) -> tuple[list[str], list[str]]:
        return self._sides

    @property
    def prompt_field(self) -> str:  # what check_queue names when a request holds too many texts
        return self.side_names()[1]

    def num_prompts(self) -> int:
        if self._cross_encoder:
            return len(self._sides[1])  # 1:N or N:N: a pair per document
        return len(self._sides[0]) + len(self._sides[1])

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(None, self.use_activation, self.truncate_prompt_tokens)


class ScoreRequest(ScoringRequest):
    """vLLM's /score body: queries and documents (or queries and items, data_1 and data_2, text_1 and
    text_2), each a text or a list of texts."""
    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    text_1: Any = None
    text_2: Any = None
    _names: tuple[str, str] = PrivateAttr(SCORE_FIELDS[0])

    @model_validator(mode="after")
    def _one_pair(self) -> "ScoreRequest":
        given = self.model_fields_set
        pair = next((p for p in SCORE_FIELDS if set(p) <= given), None)
        if pair is None:
            missing = next((b if a in given else a for a, b in SCORE_FIELDS if a in given or b in given), "queries")
            raise InvalidInput(missing, f"{missing} is required: a score body pairs queries and documents (or "
                                        f"queries and items, data_1 and data_2, text_1 and text_2)")
        self._names = pair
        return self

    def side_names(self) -> tuple[str, str]:
        return self._names


class RerankRequest(ScoringRequest):
    """vLLM's /rerank body (Jina's and Cohere's shape): one query, its documents, the top_n best (0: all).
    Cohere's return_documents is not vLLM's field: every result carries its document, as vLLM's."""
    query: Any = None
    documents: Any = None
    top_n: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _query_and_documents(self) -> "RerankRequest":
        for name in ("query", "documents"):
            if name not in self.model_fields_set:
                raise InvalidInput(name, f"{name} is required: a rerank body has a query and its documents")
        if isinstance(self.query, list):
            raise InvalidInput("query", f"query must be one text, got {show(self.query)}")
        return self

    def side_names(self) -> tuple[str, str]:
        return "query", "documents"


async def create_score(request: Request, req: ScoreRequest | None = None) -> Response:
    """POST /score and /v1/score (vLLM's): each pair's score, in the order of the pairs."""
    req, pooled = await _score(request, ScoreRequest, req)
    if pooled is None:
        return Response(status_code=499)  # nobody is listening
    request_id, model, prompts, vectors = pooled
    scores, num_tokens = _pair_scores(req, prompts, vectors)
    usage = pooling_usage(num_tokens)
    return json_response({"id": f"score-{request_id}", "object": "list", "created": int(time.time()),
                          "model": model, "data": [{"index": i, "object": "score", "score": s.outputs.score}
                                                   for i, s in enumerate(scores)], "usage": usage})


async def create_rerank(request: Request, req: RerankRequest | None = None) -> Response:
    """POST /rerank, /v1/rerank and /v2/rerank (vLLM's, in Jina's and Cohere's shape): the documents by
    relevance to the query, best first (ties in their order), the top_n of them."""
    req, pooled = await _score(request, RerankRequest, req)
    if pooled is None:
        return Response(status_code=499)
    request_id, model, prompts, vectors = pooled
    scores, num_tokens = _pair_scores(req, prompts, vectors)
    results = sorted(({"index": i, "document": {"text": doc, "multi_modal": None},
                       "relevance_score": s.outputs.score} for i, (doc, s) in enumerate(zip(req.sides[1], scores))),
                     key=lambda r: r["relevance_score"], reverse=True)
    return json_response({"id": f"score-{request_id}", "model": model,
                          "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
                          "results": results[:req.top_n or None]})


def _scores(state: ServerState) -> bool:
    """vLLM's enable_scoring_api: an embedding model (its bi-encoder), token_embed (late interaction) or a
    one-label classifier scores."""
    return state.engine.pooling_task in ("embed", "token_embed") or state.engine.is_cross_encoder


def _no_scores(path: str, engine: LLMEngine) -> str:
    """Why a pooling server does not score: its classifier has other than one label, or it serves
    token_classify (a row of labels per token, which scores no pair, whatever its labels)."""
    if engine.pooling_task == "token_classify":
        return (f"{path} is served for an embedding model or a classifier with num_labels == 1 (a cross-encoder); "
                f"this server's model serves the token_classify task (labels for each token)")
    return (f"{path} is served for a classifier with num_labels == 1 (a cross-encoder); this one has "
            f"{engine.model_config.num_labels}")


async def _score(request: Request, schema: type[ScoringRequest], req: ScoringRequest | None
                 ) -> tuple[ScoringRequest, Pooled | None]:
    """The body's texts embedded, queries first, then documents; or, for a cross-encoder, each pair
    classified as one prompt (None if the client left). ``req``: a body pooling_invocations read."""
    state = _state(request)
    engine = state.engine
    _check_pooling_server(request, state, None)
    if not _scores(state):
        raise ApiError(404, _no_scores(esc(request.url.path), engine))
    if req is None:
        req = await read_json(request, state, functools.partial(parse_body, schema, request_id=_request_id(request)))
    try:
        req.check_inputs(state.engine.model_config.checkpoint_architecture)
        req._cross_encoder = engine.is_cross_encoder
        req._late_interaction = engine.pooling_task == "token_embed"
        for name in ("max_tokens_per_query", "max_tokens_per_doc"):
            _check_token_limit(getattr(req, name), name, state.engine.max_model_len, state.engine.tokenizer)
    except InvalidInput as e:
        raise req.invalid(e) from None
    make_prompts = _cross_encoder_prompts if engine.is_cross_encoder else _score_prompts
    return req, await _pool(request, state, req, functools.partial(make_prompts, state, req))


def _check_token_limit(value: int, name: str, max_model_len: int, tokenizer: Any) -> None:
    """vLLM's words for max_tokens_per_query and max_tokens_per_doc (0: no limit); a limit cuts each text
    where its first N tokens end (_truncate_text), which only a fast tokenizer's offsets say."""
    if value < 0:
        raise InvalidInput(name, f"{name} must be a non-negative integer")
    if value >= max_model_len:
        raise InvalidInput(name, f"{name} ({value}) must be less than max_model_len ({max_model_len}).")
    if value and not getattr(tokenizer, "is_fast", False):
        raise InvalidInput(name, f"{name} needs a fast tokenizer (the offsets of its tokens say where a text is "
                                 f"cut), and this model's is not one")


def _score_prompts(state: ServerState, req: ScoringRequest, params: PoolingParams, texts: None,
                   lora: LoRARequest | None) -> list[TokenizedPrompt]:
    """On the tokenizer thread: each side's texts (cut to max_tokens_per_query/doc tokens first, as
    vLLM's) tokenized with special tokens; an error names the side's field."""
    prompts = []
    for name, side in zip(req.side_names(), _cut_sides(state, req)):
        try:
            prompts += _tokenize_pooled(state, req, params, side, True, lora)
        except InvalidInput as e:
            raise InvalidInput(name if e.param == "prompt" else e.param, str(e)) from None
    return prompts


def _cross_encoder_prompts(state: ServerState, req: ScoringRequest, params: PoolingParams, texts: None,
                           lora: LoRARequest | None) -> list[TokenizedPrompt]:
    """On the tokenizer thread: each pair (1:N or N:N) as one prompt, rendered by the score template where the
    server has one (--chat-template, as vLLM's; the body's instruction and chat_template_kwargs its
    variables), else the tokenizer's text pair (each text cut to max_tokens_per_query/doc tokens first, as
    vLLM's); an error names the documents' field."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.instruction is not None:  # vLLM's: chat_template_kwargs' own instruction wins
        kwargs.setdefault("instruction", req.instruction)
    keep = state.engine.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    max_length = keep if keep and req.truncation_side is None else None  # a side named: cut after, as ids
    try:
        pairs = [state.engine.cross_encoder_prompt(q, d, score_template=state.chat_template,
                                                   template_kwargs=kwargs, max_length=max_length)
                 for q, d in paired(*_cut_sides(state, req))]
        return _tokenize_pooled(state, req, params, pairs, True, lora)
    except InvalidInput as e:
        raise InvalidInput(req.side_names()[1] if e.param == "prompt" else e.param, str(e)) from None


def _cut_sides(state: ServerState, req: ScoringRequest) -> tuple[list[str], list[str]]:
    """The queries and documents, each text cut to max_tokens_per_query/doc tokens where set (as vLLM's)."""
    return tuple([_truncate_text(t, state.engine.tokenizer, limit) for t in side] if limit else side
                 for side, limit in zip(req.sides, (req.max_tokens_per_query, req.max_tokens_per_doc)))


def _truncate_text(text: str, tokenizer: Any, max_tokens: int) -> str:
    """vLLM's truncate_text_to_tokens: the text cut where its first max_tokens tokens end (by the
    tokenizer's offsets, so that the text is tokenized once more as sent, special tokens and all)."""
    while text:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        if len(enc["input_ids"]) <= max_tokens:
            break
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[:min(end, len(text) - 1)]
    return text


def _pair_scores(req: ScoringRequest, prompts: list[TokenizedPrompt],
                 vectors: list[torch.Tensor]) -> tuple[list[ScoringRequestOutput], int]:
    """Each pair's score, and the tokens pooled (a bi-encoder's or late interaction's each text once, as vLLM
    counts them; a cross-encoder's each pair)."""
    outs = [PoolingRequestOutput(str(i), PoolingOutput(v), list(p.token_ids)) for i, (p, v) in
            enumerate(zip(prompts, vectors))]
    if req._cross_encoder:
        return cross_encoder_scores(outs), sum(len(p.token_ids) for p in prompts)
    return score_pairs(outs, len(req.sides[0]), None, req._late_interaction), sum(len(p.token_ids) for p in prompts)


def routes_for_runner(routes: list[Route], runner: str) -> list[Route]:
    """Each runner's server answers the other's endpoints with a 404 that says why; a pooling server's
    /invocations (SageMaker's) takes its pooling bodies, as vLLM's (pooling_invocations)."""
    async def not_generating(request: Request) -> Response:
        task = _state(request).engine.pooling_task
        served = "/v1/embeddings" if task == "embed" else "/classify" if task == "classify" else "/pooling"
        raise ApiError(404, f"this server runs a pooling model (--runner pooling): {esc(request.url.path)} needs "
                            f"a generative model (--runner generate); {served} is served")
    if runner != "pooling":
        return routes
    return [Route(r.path, not_generating, methods=r.methods) if r.path.startswith(GENERATION_PATHS)
            else Route(r.path, pooling_invocations, methods=r.methods) if r.path == "/invocations" else r
            for r in routes]


async def load_lora_adapter(request: Request) -> Response:
    """vLLM's: load an adapter while serving (on the model thread, between steps); its name is a model then."""
    state = _state(request)
    req = await read_json(request, state, functools.partial(parse_body, LoadLoRAAdapterRequest,
                                                             request_id=_request_id(request)))
    if req.load_inplace:
        raise bad_request("load_inplace is not supported: unload the adapter, then load it again", "load_inplace")
    if req.lora_name in state.loras or req.lora_name in state.loading_loras or req.lora_name in state.model_names:
        raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name")
    state.last_lora_id = max([state.last_lora_id, *(x.lora_int_id for x in state.loras.values())]) + 1
    lora = LoRARequest(req.lora_name, state.last_lora_id, req.lora_path)
    state.loading_loras.add(req.lora_name)  # held, so that a second load of the name waits for no one: a 400
    try:
        with state.endable():
            await state.on_model_thread(state.engine.add_lora, lora)
    except ValueError as e:
        raise bad_request(str(e), "lora_path") from None
    finally:
        state.loading_loras.discard(req.lora_name)
    state.loras[req.lora_name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's: unload an adapter (a 400 while a request still runs with it)."""
    state = _state(request)
    req = await read_json(request, state, functools.partial(parse_body, UnloadLoRAAdapterRequest,
                                                             request_id=_request_id(request)))
    lora = state.loras.get(req.lora_name)
    try:  # here on the loop thread, where requests are added: from now on none is added with it
        found = lora is not None and state.engine.retire_lora(lora.lora_int_id)
    except ValueError as e:
        raise bad_request(str(e), "lora_name") from None
    if not found:
        raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name")
    del state.loras[req.lora_name]  # with retire_lora, no await between: Generation.add_requests sees both or neither
    with state.endable():
        await state.on_model_thread(state.engine.drop_lora_weights, lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def detokenize(request: Request) -> Response:
    state = _state(request)
    req = await read_json(request, state, functools.partial(parse_body, DetokenizeRequest,
                                                             request_id=_request_id(request)))
    check_model(req, state)
    try:
        with state.endable():
            return json_response({"prompt": await state.off_loop(state.engine.detokenize, req.tokens)})
    except InvalidInput as e:
        raise req.invalid(e) from None


async def version(request: Request) -> Response:
    return json_response({"version": __version__})


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _request_id(request: Request) -> str:
    return request.scope["nanoserve.request_id"]


def settle_request_fields(request: Request, req: GenerationRequest, state: ServerState) -> str:
    """What the server settles in a body before admitting it; returns the request's id. The id is
    X-Request-Id's, else the body's request_id (vLLM's field; the header wins, as in vLLM); a body's
    id the header overrode is dropped, so that an error names the header's. return_tokens_as_token_ids,
    where the body does not say, is the server's flag."""
    if req.request_id is not None:
        if request.scope["nanoserve.request_id_given"]:
            req.request_id = None
        else:
            request.scope["nanoserve.request_id"] = esc(req.request_id)
    if "return_tokens_as_token_ids" not in req.model_fields_set:
        req.return_tokens_as_token_ids = state.return_tokens_as_token_ids
    return _request_id(request)


def check_model(req: OpenAIBaseModel, state: ServerState) -> str:
    """The name responses carry: a LoRA adapter's, or the first served one, whichever of those the
    request named (or none, or "": unset, as vLLM's check_model)."""
    if req.model in state.loras:
        return req.model
    if req.model and req.model not in state.model_names:
        raise ApiError(404, f"the model {show(req.model)} does not exist; this server serves "
                            f"{', '.join(map(repr, [*state.model_names, *state.loras]))}", param="model")
    return state.model_names[0]


async def _collect_or_disconnect(request: Request, gen: "Generation") -> dict[int, CompletionOutput] | None:
    """Run a non-streaming request to the end, or abort it (and give None) when the client leaves."""
    why = "the server stopped"  # unless we get further
    try:
        async with watch_disconnect(request.receive, gen.queue):
            finals = await gen.collect()
        why = ""
        return finals
    except ClientDisconnect:
        why = "client disconnected"
        return None
    except (EngineDeadError, RequestFailedError) as e:
        why = str(e)
        raise _engine_error(e) from None
    finally:
        gen.close(why)


# ---------------------------------------------------------------- errors

def _engine_error(e: Exception) -> ApiError:
    return ApiError(503 if isinstance(e, EngineDeadError) else 500, str(e))


async def _api_error_handler(request: Request, exc: ApiError) -> Response:
    return _reject(_state(request), request.scope, exc)


def _reject(state: ServerState, scope, error: ApiError) -> Response:
    """An error answer, counted and logged."""
    state.metrics.count_rejected(error.status)
    logger.info("[entry] %s: %s %s -> %d: %s", scope.get("nanoserve.request_id"), scope["method"],
                esc(scope["path"]), error.status, error.message)
    return error.response(_anthropic(scope))


def _anthropic(scope) -> bool:
    """Whether the request is to Anthropic's Messages API, whose errors take Anthropic's shape."""
    return scope["path"] == "/v1/messages" or scope["path"].startswith("/v1/messages/")


async def _client_left_handler(request: Request, exc: ClientDisconnect) -> Response:
    """A client that left before its request was admitted (cancel_on_disconnect): what it asked stopped."""
    logger.info("[entry] %s: %s %s: the client left before the request was admitted; its work stopped",
                request.scope.get("nanoserve.request_id"), request.method, esc(request.url.path))
    return Response(status_code=499)  # nobody is listening


async def _http_error_handler(request: Request, exc: HTTPException) -> Response:
    _state(request).metrics.count_rejected(exc.status_code)
    return ApiError(exc.status_code, f"{exc.detail}: {request.method} {esc(request.url.path)}",
                    headers=dict(exc.headers or {})).response(_anthropic(request.scope))


async def _internal_error_handler(request: Request, exc: Exception) -> Response:
    # The traceback goes to the log (Starlette re-raises to uvicorn), never to the client.
    return ApiError(500, "internal server error; the server log has the details").response(_anthropic(request.scope))


# ---------------------------------------------------------------- reading a body

async def read_json(request: Request, state: ServerState, parse: Callable[[dict[str, Any]], Any],
                    check_raw: Callable[[bytes, LLMEngine], None] | None = None) -> Any:
    """The body as a JSON object, ``parse``d (into its request model), read no further than
    the size limit and no longer than the body timeout (a client that never sends it holds
    nothing); a large one is decoded and parsed off the loop (validating megabytes of
    messages takes seconds too), after ``check_raw`` looked at its bytes."""
    with state.endable():
        return await _read_json(request, state, parse, check_raw)


async def _read_json(request: Request, state: ServerState, parse: Callable[[dict[str, Any]], Any],
                     check_raw: Callable[[bytes, LLMEngine], None] | None) -> Any:
    limit = state.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {length} bytes; this server takes at most {limit}")
    try:
        raw = await asyncio.wait_for(_read_body(request, limit), state.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {state.body_timeout:g} s") from None
    if len(raw) < LARGE_BODY_BYTES:
        return parse(parse_json_object(raw))
    if check_raw is not None:
        await state.off_loop(check_raw, raw, state.engine)
    return await state.off_loop(lambda: parse(parse_json_object(raw, True)))  # C's json holds the GIL: see there


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes, this server's limit")
            chunks.append(chunk)
    except ClientDisconnect:
        raise bad_request("the client disconnected while sending the body") from None
    return b"".join(chunks)


# =========================================================================== serving
# What a body becomes, as vLLM's serving_*.py: admission (the queue limit), the
# engine requests, and the response or chunks built from their outputs.

@dataclass(slots=True)
class ParsedText:
    """A chat choice's text after the reasoning and tool-call parsers (ChatGeneration.parse_text)."""
    content: str
    reasoning: str | None      # None: none, or not to be shown (include_reasoning false)
    calls: list[dict]
    finish_reason: str | None  # the output's, or "tool_calls" where the text ended in calls
    blank: str | None          # a message's content where it has none: vLLM's parsers say "" or null


def _chat_choice(index: int, body: dict, logprobs: dict | None, finish_reason: str | None, c: CompletionOutput,
                 extra: dict | None) -> dict:
    """A chat choice around its message or delta (``body``); of ``extra`` only token_ids (return_token_ids)."""
    token_ids = {"token_ids": extra["token_ids"]} if extra and "token_ids" in extra else {}
    return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": c.stop_reason, **token_ids}


def _thought(reasoning: str | None) -> dict:
    # vLLM v0.10's field, and the name vLLM renamed it to later (clients read one or the other)
    return {"reasoning_content": reasoning, "reasoning": reasoning}


@dataclass(slots=True)
class _Tracked:
    """One engine request's progress, for metrics and clean-up."""
    engine_id: str
    index: int                      # its prompt's
    done: bool = False
    finish_reasons: list[str] = field(default_factory=list)
    num_output_tokens: dict[int, int] = field(default_factory=dict)  # by completion index
    last_token_time: float | None = None  # None until the first token
    num_cached_tokens: int = 0            # of its prompt, found in the prefix cache


def check_queue(state: ServerState, req: GenerationRequest, n: int) -> None:
    """The engine requests one HTTP request makes (prompts x n): at most MAX_ENGINE_REQUESTS,
    and with those waiting already at most --max-queue-len."""
    limit, wanted = state.max_queue_len, req.num_prompts() * n
    too_many = (f"the server takes in one request ({MAX_ENGINE_REQUESTS})" if wanted > MAX_ENGINE_REQUESTS
                else f"--max-queue-len {limit} lets wait" if limit is not None and wanted > limit else None)
    if too_many:
        raise bad_request(f"this request is {wanted} engine requests ({req.num_prompts()} prompt(s) x n={n}), "
                          f"more than {too_many}; send them in several requests", "n" if n > 1 else req.prompt_field)
    if limit is None:
        return
    waiting = state.engine.stats()["num_waiting"]
    if waiting + wanted > limit:
        raise ApiError(429, f"the server is busy: {waiting} requests are waiting (--max-queue-len {limit}); "
                            f"retry later", headers={"Retry-After": "1"})


class Generation:
    """The engine requests behind one HTTP request (one per prompt), read back
    from one queue that the engine loop fills, and the response or chunks they
    make. ``close()`` aborts whatever has not finished; every path out of a
    handler calls it. What differs between the endpoints is in the subclasses
    (CompletionGeneration, ChatGeneration), as vLLM's serving_completion.py and
    serving_chat.py: the schema, the prompt, the shape of a choice and its logprobs."""
    schema: ClassVar[type[GenerationRequest]]
    object_name: ClassVar[str]
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]
    # The fields vLLM's response models always serialize, null where the request asked for nothing: a client
    # reading one by name finds it on both servers (with_nulls adds them; values set elsewhere win)
    RESPONSE_NULLS: ClassVar[tuple[str, ...]] = ("service_tier", "kv_transfer_params", "ec_transfer_params",
                                                 "metrics")
    CHOICE_NULLS: ClassVar[tuple[str, ...]] = ()
    DELTA_NULLS: ClassVar[tuple[str, ...]] = ()
    USAGE_NULLS: ClassVar[tuple[str, ...]] = ("prompt_tokens_details", "completion_tokens_details")
    check_raw: ClassVar[Callable[[bytes, LLMEngine], None] | None] = None  # a large body's bytes, before decoding
    reads_every_step = False  # a stream's step that adds no text still goes to delta_choice (its parser reads it)

    @classmethod
    def parse(cls, body: dict[str, Any], request_id: str) -> GenerationRequest:
        return parse_body(cls.schema, body, request_id)

    @classmethod
    async def admit(cls, state: ServerState, request_id: str, req: GenerationRequest) -> "Generation":
        """Cheap bounds first (prompts x n vs the queue; the engine's characters
        and length bounds before any per-token work), then tokenizing off the
        loop, then the engine requests. Raises 400/429/503."""
        with state.endable():
            return await cls._admit(state, request_id, req)

    @classmethod
    async def _admit(cls, state: ServerState, request_id: str, req: GenerationRequest) -> "Generation":
        try:
            cls.settle(state, req)
            params = req.sampling_params(state.engine.default_sampling, state.engine.override_max_tokens)
            gen = cls(state, request_id, req, params)
            gen.check_max_tokens()
            check_queue(state, req, gen.params.n)
            await gen.render_own_template()
            prompts = await state.off_loop(gen.process_prompts)
            if gen.params.structured_outputs is not None:
                await state.compile_grammar(gen.params.structured_outputs)
            for prompt in prompts:
                gen.check_min_tokens(len(prompt.token_ids))
            check_queue(state, req, gen.params.n)  # again: others may have queued meanwhile
            await gen.add_requests(prompts)
            return gen
        except InvalidInput as e:
            raise req.invalid(e) from None
        except EngineDeadError as e:
            raise _engine_error(e) from None

    @classmethod
    def settle(cls, state: ServerState, req: GenerationRequest) -> None:
        """What the request takes from the server before its sampling parameters are made."""

    def __init__(self, state: ServerState, request_id: str, req: GenerationRequest, params: SamplingParams):
        self.state, self.request_id, self.req, self.params = state, request_id, req, params
        self.response_id = self.id_prefix + request_id
        self.created = int(time.time())
        self.start = time.monotonic()
        self.prompts: list[TokenizedPrompt] = []
        self.queue: asyncio.Queue = asyncio.Queue()  # outputs of all its engine requests, each naming its own
        self.tracked: dict[str, _Tracked] = {}  # by engine request id
        self.prompt_logprobs: dict[int, Any] = {}  # by prompt index, once the engine has them
        self.closed = False
        self.beam = req.beam_search_params(params)  # use_beam_search: what the engine gets in params' place
        # the adapter the request named, as check_model found it: one unloaded while the request is tokenized is
        # the engine's 400 ("not loaded"), never the base model answering under the adapter's name
        self.lora = state.loras.get(req.model)

    async def render_own_template(self) -> None:
        """(Chat's) a request's own chat_template, rendered ahead: see ServerState.render_own_template."""

    def process_prompts(self) -> list[TokenizedPrompt]:
        """On the tokenizer thread: render, tokenize and check every prompt."""
        req = self.req
        prompts = [self.state.engine.process_prompt(p, req.truncate_prompt_tokens, req.add_special_tokens,
                                                    req.truncation_side)
                   for p in self.prompt_inputs()]
        for p in prompts:
            p.cache_salt = req.cache_salt
            p.lora_int_id = None if self.lora is None else self.lora.lora_int_id
        self.params.update_from_tokenizer(self.state.engine.tokenizer)  # its bad_words, not on the loop
        return prompts

    def check_max_tokens(self) -> None:
        """vLLM 0.32's one bound on the body's max_tokens, before tokenizing: at most max_model_len
        (TokenizeParams). Past the room a prompt leaves it is clamped, not refused (the engine's
        resolve_max_tokens, vLLM's get_max_tokens)."""
        max_tokens, max_model_len = self.req.requested_max_tokens(), self.state.engine.max_model_len
        if max_tokens is not None and max_tokens > max_model_len:
            name = self.req.param_name("max_tokens")
            raise bad_request(f"{name}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                              f"Please request fewer output tokens.", name)

    def check_min_tokens(self, num_prompt: int) -> None:
        """vLLM's server builds SamplingParams with the clamped max_tokens, so min_tokens past the room is its
        400 (where offline the request would end at max_model_len with fewer)."""
        max_tokens = self.state.engine.resolve_max_tokens(num_prompt, self.params.max_tokens)
        if self.params.min_tokens > max_tokens:
            raise bad_request(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                              f"{self.params.min_tokens}. (The prompt's {num_prompt} tokens leave room for "
                              f"{max_tokens} in max_model_len.)", "min_tokens")

    async def add_requests(self, prompts: list[TokenizedPrompt]) -> None:
        """One engine request per prompt, each putting its outputs in ``self.queue``. Between
        prompts the loop serves others: one body may hold thousands of prompts x n."""
        if self.lora is not None and self.state.loras.get(self.req.model) is not self.lora:
            raise ApiError(404, f"the model {show(self.req.model)} does not exist: its LoRA adapter was unloaded "
                                f"while the request was being prepared", param="model")
        self.prompts = prompts
        self.state.generations.add(self)
        try:
            for i, prompt in enumerate(prompts):
                if i:
                    await asyncio.sleep(0)
                    if self.closed:  # the server shut down meanwhile
                        raise EngineDeadError("the server is shutting down")
                engine_id = self.request_id if len(prompts) == 1 else f"{self.request_id}-{i}"
                self.state.async_llm.add_request(prompt, self.beam or self.params, engine_id, self.queue,
                                                 RequestOutputKind.DELTA, self.req.priority)  # O(1) a step
                self.tracked[engine_id] = _Tracked(engine_id, i)
        except BaseException:  # the engine's checks (a request id in use), a dead engine, a cancelled handler
            self.close()  # aborts the prompts already queued
            raise
        logger.debug("[entry] %s: admitted %d prompt(s) of %s tokens, max_tokens %s, n %d, stream %s%s",
                     self.request_id, len(prompts), "+".join(str(len(p.token_ids)) for p in prompts),
                     self.params.max_tokens, self.params.n, self.req.stream,
                     f", user {show(self.req.user)}" if self.req.user else "")

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, until every engine request finished. What
        ended one first is raised: the engine's error, or the client's ClientDisconnect."""
        remaining = len(self.tracked)
        while remaining:
            out = await self.queue.get()
            if isinstance(out, Exception):
                raise out
            t = self.tracked[out.request_id]
            self._observe(t, out)
            remaining -= out.finished
            if out.prompt_logprobs is not None:
                self.prompt_logprobs[t.index] = out.prompt_logprobs
            if self.req.echo_only():  # the one generated token is not shown
                out.outputs = [dataclasses.replace(c, text="", token_ids=[], delta_text="", logprobs=c.logprobs and [])
                               for c in out.outputs]
            yield t.index, out

    async def collect(self) -> dict[int, CompletionOutput]:
        """Every choice's final output, by choice index."""
        deltas: dict[int, list[CompletionOutput]] = {}
        async for i, out in self.outputs():
            for c in out.outputs:
                deltas.setdefault(self.choice_index(i, c), []).append(c)
        return {idx: merge_deltas(cs) for idx, cs in deltas.items()}

    def choice_index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.params.n + c.index

    def logprobs(self, c: CompletionOutput, text_offset: int, echo: int | None = None) -> dict | None:
        """The logprobs of a choice's tokens (a stream's: this step's), in the endpoint's
        shape; with ``echo`` (completions), those of that prompt's tokens first."""
        if self.params.logprobs is None:
            return None
        tokens = [] if echo is None else self.echo_logprobs(echo)
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            tokens.append(self._logprob_item(token_id, entry))
        return self.logprobs_body(tokens, text_offset)

    def _logprob_item(self, token_id: int, entry: dict[int, Logprob] | None) -> tuple:
        if entry is None:
            return self._token_text(token_id), None, None
        own, ranked = entry.get(token_id), sorted(entry.items(), key=lambda kv: -kv[1].logprob)
        return (self._token_text(token_id, own), _lp(None if own is None else own.logprob),
                [(self._token_text(t, lp), _lp(lp.logprob)) for t, lp in ranked])

    def _token_text(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:  # the engine decoded it already
            return lp.decoded_token
        return self.state.engine.tokenizer.decode([token_id])

    def extra(self, prompt_index: int, token_ids: list[int], first: bool) -> dict:
        """return_token_ids and prompt_logprobs, as vLLM adds them to a choice (the
        prompt's only in a choice's first chunk)."""
        out = {}
        if self.req.return_token_ids:
            prompt = self.prompts[prompt_index]  # prompt_embeds' have no ids, only stand-ins
            out.update({"prompt_token_ids": prompt.token_ids if prompt.prompt_embeds is None else None} if first
                       else {}, token_ids=token_ids)
        prompt_logprobs = self.prompt_logprobs.get(prompt_index) if first else None
        if prompt_logprobs is not None:  # asked for, or by echo (as vLLM's)
            out["prompt_logprobs"] = [None if e is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                                                       "decoded_token": lp.decoded_token}
                                                              for t, lp in e.items()} for e in prompt_logprobs]
        return out

    def num_output_tokens(self) -> int:
        """Of every choice so far."""
        return sum(n for t in self.tracked.values() for n in t.num_output_tokens.values())

    def num_cached_tokens(self) -> int:
        """Of the prompts, found in the prefix cache."""
        return sum(t.num_cached_tokens for t in self.tracked.values())

    def usage(self, num_output_tokens: Iterable[int], prompt_index: int | None = None) -> dict[str, Any]:
        """Of every prompt, or (a stream's continuous usage) of one prompt's choice."""
        prompt = sum(len(p.token_ids) for i, p in enumerate(self.prompts) if prompt_index in (None, i))
        completion = sum(num_output_tokens)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.state.enable_prompt_tokens_details and prompt_index is None:
            cached = self.num_cached_tokens()
            if cached:  # as vLLM: only when some were
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def response(self, model: str, finals: dict[int, CompletionOutput]) -> dict[str, Any]:
        """The non-streaming body."""
        req, choices, extra = self.req, [], {}
        for idx, c in sorted(finals.items()):
            i = idx // self.params.n
            echo = self.echo_text(i) if req.echo else ""
            extra = self.extra(i, c.token_ids, first=True)
            choices.append(self.message_choice(idx, c, self.logprobs(c, 0, i if req.echo else None), extra, echo))
        usage = self.usage(len(c.token_ids) for c in finals.values())
        return with_nulls({"id": self.response_id, "object": self.object_name, "created": self.created,
                           "model": model, "choices": [self.choice_nulls(c) for c in choices],
                           "system_fingerprint": SYSTEM_FINGERPRINT, "usage": with_nulls(usage, self.USAGE_NULLS),
                           **self.response_extra(extra, self.prompts[0].text)}, self.RESPONSE_NULLS)

    def choice_nulls(self, choice: dict) -> dict:
        return with_nulls(choice, self.CHOICE_NULLS)

    def delta_nulls(self, choice: dict) -> dict:
        return with_nulls(choice, self.DELTA_NULLS)

    def _observe(self, t: _Tracked, out: RequestOutput) -> None:
        metrics, m = self.state.metrics, out.metrics
        if m is not None and m.first_token_time is not None:
            if t.last_token_time is None:
                metrics.time_to_first_token.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    metrics.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            elif m.last_token_time > t.last_token_time:
                metrics.inter_token_latency.observe(m.last_token_time - t.last_token_time)
            t.last_token_time = m.last_token_time
        t.num_cached_tokens = out.num_cached_tokens
        for c in out.outputs:
            t.num_output_tokens[c.index] = t.num_output_tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                t.finish_reasons.append(c.finish_reason)
                metrics.count_finished(c.finish_reason)
        if out.finished:
            t.done = True
            if m is not None:
                metrics.e2e_latency.observe(time.monotonic() - m.arrival_time)
                num_prompt = len(self.prompts[t.index].token_ids)  # max_tokens as the request ran: clamped, vLLM's
                metrics.observe_finished(m, num_prompt, list(t.num_output_tokens.values()), self.params.n,
                                         self.state.engine.resolve_max_tokens(num_prompt, self.params.max_tokens))

    def close(self, why: str = "") -> None:
        """Abort what has not finished (a disconnect, an error, a shutdown)."""
        if self.closed:
            return
        self.closed = True
        aborted = 0
        for t in self.tracked.values():
            if not t.done:
                self.state.async_llm.abort(t.engine_id, self.queue)
                left = self.params.n - len(t.finish_reasons)
                aborted += left
                self.state.metrics.count_finished("abort", left)
        self.state.generations.discard(self)
        if self.tracked:
            reasons = sorted({r for t in self.tracked.values() for r in t.finish_reasons})
            outcome = (f"aborted {aborted} choice(s){f' ({why})' if why else ''}" if aborted
                       else f"finished ({', '.join(reasons)})")
            logger.info("[entry] %s: %s in %.2f s, %d prompt + %d completion tokens", self.request_id, outcome,
                        time.monotonic() - self.start, sum(len(p.token_ids) for p in self.prompts),
                        self.num_output_tokens())

    # what differs between the endpoints (the subclasses' own: prompt_inputs, echo_text, choice, logprobs_body)
    def echo_logprobs(self, prompt_index: int) -> list[tuple]:
        """The logprobs that lead a choice's with echo: none of chat's."""
        return []

    def first_chunks(self, head: dict) -> list[dict]:
        return []

    def stream(self, model: str) -> AsyncIterator[str]:
        return stream_events(self, model)

    def response_extra(self, extra: dict, prompt_text: str | None) -> dict:
        return {}

    def stream_extra(self, prompt_index: int, token_ids: list[int], first: bool) -> dict:
        return self.extra(prompt_index, token_ids, first)

    def chunk_usage(self, num_output_tokens: Iterable[int], prompt_index: int) -> dict[str, Any]:
        """A chunk's continuous usage (of its choice so far)."""
        return self.usage(num_output_tokens, prompt_index)


SYSTEM_FINGERPRINT = f"nanoserve-{__version__}"  # vLLM's is "vllm-<version>-<config hash>"


def with_nulls(obj: dict, keys: Iterable[str]) -> dict:
    """``obj`` with each of ``keys`` it lacks, as null (see Generation.RESPONSE_NULLS)."""
    return obj | {k: None for k in keys if k not in obj}


def _lp(value: float | None) -> float | None:
    # JSON has no -inf; vLLM reports such a logprob as -9999.0
    return None if value is None else max(value, -9999.0)


class CompletionGeneration(Generation):
    schema = CompletionRequest
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl-"
    CHOICE_NULLS = ("token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts")
    DELTA_NULLS = ("prompt_token_ids", "token_ids")

    @staticmethod
    def check_raw(raw: bytes, engine: LLMEngine) -> None:
        """A huge body's token-id prompt too long for the model is refused from its bytes,
        before decoding millions of numbers. Only where the count is certain: a "prompt" list
        opening with a number, no escape (so "prompt" has one spelling), one "prompt" key, no
        truncate_prompt_tokens: the commas before the first "]" count its ids (any element not
        an id is a 400 as well)."""
        ids = _IDS_LIST.match(raw, max(raw.find(b'"prompt"'), 0))
        if ids is None or b"\\" in raw or raw.count(b'"prompt"') != 1:  # C scans: the GIL passes between
            return
        if b'"truncate_prompt_tokens"' in raw:  # a truncated prompt may fit: the engine judges it
            return
        end = raw.find(b"]", ids.end())  # none: not JSON, which the decoder says
        try:
            if end > 0:
                engine.check_prompt_length(raw.count(b",", ids.end(), end) + 1)
        except InvalidInput as e:
            raise bad_request(str(e), e.param) from None

    def prompt_inputs(self) -> list[str | list[int] | torch.Tensor]:
        """(On the tokenizer thread) the prompt_embeds' tensors, then prompt's prompts, as vLLM orders them."""
        return [load_prompt_embeds(e, self.state.engine) for e in self.req.prompt_embeds or ()] + \
            list(self.req.prompt or ())

    def stream_extra(self, prompt_index: int, token_ids: list[int], first: bool) -> dict:
        """As vLLM's: a stream's echo sends the prompt's ids with its text (without return_token_ids too)."""
        extra = self.extra(prompt_index, token_ids, first)
        prompt = self.prompts[prompt_index]
        if first and self.req.echo and prompt.prompt_embeds is None:
            extra.setdefault("prompt_token_ids", prompt.token_ids)
        return extra

    def echo_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt.text if prompt.text is not None else self.state.engine.tokenizer.decode(prompt.token_ids)

    def echo_logprobs(self, prompt_index: int) -> list[tuple]:
        """The prompt's tokens lead the logprobs as its text leads the choice's."""
        entries = self.prompt_logprobs.get(prompt_index) or [None]
        return [self._logprob_item(token_id, entry)
                for token_id, entry in zip(self.prompts[prompt_index].token_ids, entries)]  # the first has none

    def message_choice(self, index: int, c: CompletionOutput, logprobs: dict | None = None,
                       extra: dict | None = None, echo: str = "") -> dict:
        """A response's choice: its whole text (``echo``, the prompt's, leads it)."""
        return self._text_choice(index, echo + c.text, logprobs, c, extra)

    def delta_choice(self, index: int, c: CompletionOutput, logprobs: dict | None = None,
                     extra: dict | None = None, echo: str = "") -> dict:
        """A stream chunk's choice: the text the step added, in the same shape."""
        return self._text_choice(index, echo + c.delta_text, logprobs, c, extra)

    @staticmethod
    def _text_choice(index: int, text: str, logprobs: dict | None, c: CompletionOutput, extra: dict | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, **(extra or {})}

    def logprobs_body(self, tokens: list[tuple], text_offset: int) -> dict:
        """The legacy shape: parallel lists, top_logprobs keyed by token text."""
        offsets = []
        for text, _, _ in tokens:
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": [t for t, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens],
                "top_logprobs": [None if ranked is None else dict(ranked) for _, _, ranked in tokens],
                "text_offset": offsets}


class ChatGeneration(Generation):
    schema = ChatCompletionRequest
    object_name, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"
    RESPONSE_NULLS = Generation.RESPONSE_NULLS + ("prompt_logprobs", "prompt_token_ids", "prompt_text")
    CHOICE_NULLS, DELTA_NULLS = ("token_ids", "routed_experts"), ("token_ids",)
    MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")
    auto_needs_parser: ClassVar[bool] = True  # "auto" without --enable-auto-tool-choice: a 400, as vLLM's chat

    @classmethod
    def settle(cls, state: ServerState, req: ChatCompletionRequest) -> None:
        """The calls take the tool parser's own format where it has one (TOOL_CALL_TAGS, mistral's list)."""
        req.settle_tools(state.tool_parser, state.strict_tool_calling, state.tool_strict_level)

    def __init__(self, state: ServerState, request_id: str, req: ChatCompletionRequest, params: SamplingParams):
        super().__init__(state, request_id, req, params)
        if req.tool_choice == "auto" and state.tool_parser is None and self.auto_needs_parser:
            raise InvalidInput("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                              '--tool-call-parser to be set')
        self.parser = tool_parser(req.tool_choice, state.tool_parser, req._call_format)  # None: no calls to parse
        # gpt-oss: the output is harmony, whatever the request's tool choice (as vLLM's serving_chat reads it)
        self.harmony = state.reasoning_parser == "openai_gptoss" or state.tool_parser == "openai"
        # as vLLM's: the parser reads special tokens
        if self.parser is MistralToolParser or req._call_format == "mistral" or self.harmony:
            params.skip_special_tokens = False
        self.tool_streams: dict[int, ToolStream] = {}  # by choice index: a parser keeps its place between chunks
        # as vLLM's parse_delta, a tool parser reads each step, one that adds no text (a token holding part of a
        # character) too: a named function's stream sends an empty arguments delta for it
        self.reads_every_step = self.parser is not None
        self.harmonies: dict[int, HarmonyParser] = {}  # likewise, for gpt-oss
        self.reasoners: dict[int, ReasoningParser] = {}  # likewise, with --reasoning-parser
        # as vLLM's get_chat_request_role: the reply's turn, or the last message's when it is continued
        self.role = "assistant" if opens_reply(req.add_generation_prompt, req.continue_final_message) \
            else req.messages[-1]["role"]
        self.prompt_text: str | None = None  # rendered ahead from the request's own chat_template

    async def render_own_template(self) -> None:
        self.prompt_text = await self.state.render_own_template(
            self.req, lambda tokenizer: chat_prompt(self.state, self.req, tokenizer))

    def prompt_inputs(self) -> list[str | list[int]]:
        return [chat_prompt(self.state, self.req) if self.prompt_text is None else self.prompt_text]

    def echo_text(self, prompt_index: int) -> str:
        """As vLLM: the last message's content, if it has the role the reply takes."""
        last = self.req.messages[-1]
        if last["role"] != self.role:
            return ""
        content = last["content"] or ""
        return content if isinstance(content, str) else "\n".join(part["text"] for part in content)

    def parse_text(self, index: int, text: str, c: CompletionOutput, stream: bool) -> ParsedText:
        """Choice ``index``'s text through the parsers: with --reasoning-parser, the reasoning split off,
        (gpt-oss: the harmony messages read into reasoning, content and, with the openai parser, calls),
        then, with tool calls asked for, the calls out of the content (the finish reason "tool_calls" once
        one is made). A stream's parsers keep their place between chunks; a response's parse it whole."""
        content, calls, finish, reasoning, blank = text, [], c.finish_reason, None, ""
        found = None  # calls a harmony parser read
        thinking = False  # a stream's reasoning still open: as vLLM's parse_delta, no tool phase before its end
        if self.harmony:
            if index not in self.harmonies:
                self.harmonies[index] = HarmonyParser(self.parser is OpenAIToolParser, whole=not stream)
            reasoning, content, found = self.harmonies[index].feed(text, finish is not None or not stream,
                                                                   cut=finish not in (None, "stop"))
            if not stream:  # as vLLM's parse_chat_output: null for none
                reasoning = reasoning or None
            blank = None
            reasoning, content = reasoning if self.req.include_reasoning else None, content or ""
        elif self.state.reasoning_parser is not None:
            parser = self.reasoner(index)
            reasoning, content = parser.feed(text, finish is not None) if stream else parser.extract(text)
            thinking = stream and parser.state == "reasoning"
            blank = None if content is None else ""  # vLLM's parsers say if no content is null or ""
            reasoning, content = reasoning if self.req.include_reasoning else None, content or ""
        if self.parser is not None and not thinking:
            if index not in self.tool_streams:
                # a stream (chat's, and the Responses and Messages streams built from its deltas, as vLLM's) is
                # read as vLLM's streamed parsers read it (ToolParser.streamed)
                self.tool_streams[index] = ToolStream(self.parser(), stream)
            tools = self.tool_streams[index]
            if self.parser is OpenAIToolParser:  # read with the rest of the harmony
                calls, made = tools.deltas(found or [])
            else:
                content, calls, made = tools.feed(content, finish is not None or not stream)
            if not stream:  # one feed: each call whole in its first delta
                calls = [{k: v for k, v in call.items() if k != "index"} for call in calls]
            if self.req.parallel_tool_calls is False:  # vLLM parses them all, then drops all but the first
                calls = [call for i, call in enumerate(calls) if call.get("index", i) == 0]
            # as vLLM's: a forced named function ends with "stop" (as OpenAI's); a response to "required" that
            # stopped says "tool_calls" whether or not its text read as calls, a stream where it sent one
            named, required = isinstance(self.req.tool_choice, dict), self.req.tool_choice == "required"
            if finish == "stop" and not named and (made or (required and not stream)):
                finish = "tool_calls"
        return ParsedText(content, reasoning, calls, finish, blank)

    def message_choice(self, index: int, c: CompletionOutput, logprobs: dict | None = None,
                       extra: dict | None = None, echo: str = "") -> dict:
        """A response's choice: the message its whole text parses into. ``echo`` (the last message's, when
        the reply continues it) leads the content and is never parsed (as vLLM: it is the prompt's)."""
        p = self.parse_text(index, c.text, c, stream=False)
        # as vLLM's Parser: text of only whitespace beside calls (a thought's "\n\n" before them) is none
        content = echo + (p.content if p.content.strip() or not p.calls or self.harmony else "")
        # no tool_calls key for none, as vLLM's ChatMessage serializes it (and OpenAI's)
        forced = self.req.forces_call() and self.state.tool_parser is not None  # vLLM's has text, "" for none
        message = {"role": self.role, "content": content or ("" if forced else None if p.calls else p.blank),
                   **(_thought(p.reasoning) if self.state.reasoning_parser is not None or self.harmony else {}),
                   **({"tool_calls": p.calls} if p.calls else {})}
        return _chat_choice(index, {"message": message}, logprobs, p.finish_reason, c, extra)

    def delta_choice(self, index: int, c: CompletionOutput, logprobs: dict | None = None,
                     extra: dict | None = None, echo: str = "") -> dict | None:
        """A stream chunk's choice: the delta the text the step added parses into (``echo`` as
        message_choice's); None while the parsers hold all of it back and nothing else is new."""
        p = self.parse_text(index, c.delta_text, c, stream=True)
        content = echo + p.content
        # vLLM's hermes stream sends its calls with the delta's content set, so null where there is none
        null = p.calls and self.parser is HermesToolParser
        delta = {**(_thought(p.reasoning) if p.reasoning else {}),
                 **({"content": content} if content else {"content": None} if null else {}),
                 **({"tool_calls": p.calls} if p.calls else {})}
        if not delta and logprobs is None and p.finish_reason is None and not (extra or {}).get("token_ids"):
            return None
        return _chat_choice(index, {"delta": delta}, logprobs, p.finish_reason, c, extra)

    def choice_nulls(self, choice: dict) -> dict:
        return with_nulls({**choice, "message": with_nulls(choice["message"], self.MESSAGE_NULLS)}, self.CHOICE_NULLS)

    def delta_nulls(self, choice: dict) -> dict:
        """vLLM's chat chunk has stop_reason only where it has a finish_reason."""
        if choice["finish_reason"] is None:
            choice = {k: v for k, v in choice.items() if k != "stop_reason"}
        return with_nulls(choice, self.DELTA_NULLS)

    def reasoner(self, index: int) -> ReasoningParser:
        """Choice ``index``'s reasoning parser (with --reasoning-parser): it splits the text and counts the tokens."""
        if index not in self.reasoners:
            manager = self.state.engine.structured_outputs
            held = self.params.structured_outputs is not None and manager.think_ids is None
            self.reasoners[index] = ReasoningParser(self.state.reasoning_parser, held, manager.prompt_reasoning(
                self.prompts[0].token_ids), manager.think_ids)
        return self.reasoners[index]

    def _observe(self, t: _Tracked, out: RequestOutput) -> None:
        super()._observe(t, out)
        if self.state.reasoning_parser is not None:  # every token, also those whose text a stream holds back
            for c in out.outputs:
                self.reasoner(self.choice_index(t.index, c)).count(c.token_ids)

    def usage(self, num_output_tokens: Iterable[int], prompt_index: int | None = None) -> dict[str, Any]:
        """With --reasoning-parser, the final usage has completion_tokens_details, as vLLM's (where the
        tokenizer has the think tags as tokens: vLLM's parsers refuse one without)."""
        usage = super().usage(num_output_tokens, prompt_index)
        if prompt_index is None and self.state.reasoning_parser and self.state.engine.structured_outputs.think_ids:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens()}
        return usage

    def chunk_usage(self, num_output_tokens: Iterable[int], prompt_index: int) -> dict[str, Any]:
        return with_nulls(self.usage(num_output_tokens, prompt_index), ("completion_tokens_details",))  # as vLLM's

    def reasoning_tokens(self) -> int:
        return sum(r.num_reasoning_tokens for r in self.reasoners.values())

    def logprobs_body(self, tokens: list[tuple], text_offset: int) -> dict:
        def item(text: str, lp: float | None) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        # -1: all (the vocabulary); logprob_token_ids: all of those and the sampled token, as vLLM's
        top = None if self.params.logprobs == -1 or self.params.logprob_token_ids else self.params.logprobs or 0
        return {"content": [{**item(text, lp), "top_logprobs": [item(t, v) for t, v in ranked[:top]]}
                            for text, lp, ranked in tokens]}

    def first_chunks(self, head: dict) -> list[dict]:
        """The first delta of each choice carries the role, and (as vLLM's) the prompt's ids and text if asked."""
        prompt = self.prompts[0]
        top = {"prompt_token_ids": prompt.token_ids if self.req.return_token_ids else None,
               "prompt_text": prompt.text if self.req.return_prompt_text else None}
        return [{**head, "choices": [{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                                      "finish_reason": None}], **top} for i in range(self.req.n)]

    def response_extra(self, extra: dict, prompt_text: str | None) -> dict:
        """What vLLM puts beside a chat response's choices rather than in them."""
        out = {k: v for k, v in extra.items() if k in ("prompt_token_ids", "prompt_logprobs")}
        return {**out, "prompt_text": prompt_text} if self.req.return_prompt_text and prompt_text is not None else out


def chat_prompt(state: ServerState, req: ChatCompletionRequest, tokenizer: Any = None) -> str:
    """Chat's prompt: the tools hidden where tool_choice "none" asks it (--exclude-tools-when-tool-choice-none)."""
    hidden = req.tool_choice == "none" and state.exclude_tools_when_tool_choice_none
    return render_chat(state, req, None if hidden else req.tools, tokenizer)


def log_content_format(state: ServerState) -> None:
    """The content format "auto" found in the chat template, as vLLM logs it (a template of a request's own is
    detected when it comes)."""
    tokenizer = state.engine.tokenizer
    template = state.chat_template or getattr(tokenizer, "chat_template", None)
    if state.chat_template_content_format == "auto" and isinstance(template, str):
        logger.info("[entry] the chat template reads message contents as %s (--chat-template-content-format "
                    "overrides)", {"openai": "lists of text parts", "string": "strings"}[
                        chat_template_content_format(template)])


def render_chat(state: ServerState, req: ChatTemplateFields, tools: list[ChatCompletionToolsParam] | None,
                tokenizer: Any = None) -> str:
    """Chat's prompt, and /tokenize's of messages: ``tools`` as the template sees them (on the tokenizer
    thread; raises InvalidInput); ``tokenizer`` in the engine's place (a request's own template's WorkerTokenizer)."""
    if req.chat_template is not None and not state.trust_request_chat_template:
        raise InvalidInput("chat_template", "this server does not run a request's chat_template: start it with "
                                            "--trust-request-chat-template, or use --chat-template FILE")
    if req.chat_template is not None and tokenizer is None:  # a path that forgot render_own_template
        raise InvalidInput("chat_template", "a request's chat_template renders only in the template worker")
    tools = None if tools is None else [t.model_dump(exclude_none=True) for t in tools]
    kwargs = {**state.default_chat_template_kwargs, **req.template_kwargs()}  # the request's win, as vLLM's
    return apply_chat_template(tokenizer or state.engine.tokenizer, req.messages,
                               req.chat_template or state.chat_template, req.add_generation_prompt,
                               req.continue_final_message, tools, kwargs, req.documents,
                               state.chat_template_content_format)


# =========================================================================== a request's own chat template
# A template is code: Jinja's sandbox stops attribute escapes, not cost. ``{{ 'x' * 10**10 }}`` is one C call that
# allocates 10 GB, ``{{ 10**10**8 }}`` one that computes for hours, and string methods, ``format``, ``%`` and
# filters such as ``center`` or ``wordwrap`` are more of them: in the server's process no thread can stop such a
# call, and the memory is the server's. Intercepting the sandbox's operators (``intercepted_binops``) would leave
# every C path through a method or filter, so a request's own template (--trust-request-chat-template) renders in
# a worker process instead, with a memory cap (RLIMIT_DATA and RLIMIT_AS) and a wall-clock limit past which it is
# killed and replaced. The worker runs transformers' own ``PreTrainedTokenizerBase.apply_chat_template`` (its
# sandboxed environment, filters and globals) on a stand-in tokenizer holding what a render reads: the chat
# template(s) and the special tokens. The server keeps the rest of engine.apply_chat_template (its checks, the
# content format, the messages as vLLM hands them on): only the render crosses (``WorkerTokenizer``). The worker
# imports this module (and so torch: a few seconds and ~300 MB once, at start-up) and then only renders.

CHAT_TEMPLATE_MEMORY_BYTES = 512 * 2**20  # a render's own memory, on top of the worker's imports: a prompt is MBs
CHAT_TEMPLATE_WORKER_START_S = 120.0      # the worker's imports: seconds on an idle machine
TEMPLATE_TURN_POLL_S = 0.05               # how often a render waiting its turn looks whether its client left
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)  # where the worker imports nanoserve from
# run in the worker: the package's directory in place of the current one (which `python -c` puts first)
_WORKER_BOOT = ("import sys; sys.path[0] = sys.argv[1]; from nanoserve.entry import serve_template_worker; "
                "serve_template_worker(int(sys.argv[2]), int(sys.argv[3]))")


class ChatTemplateWorker:
    """The server's side of the worker: one render at a time (``render``, on the request's own thread), the worker
    started on first need and killed past a limit, or when the request's client leaves (``abandon``), then
    replaced in the background. ``error`` says why none can run (the platform, the tokenizer): requests'
    templates are then refused."""

    def __init__(self, tokenizer: Any, max_chars: int | None, memory_bytes: int = CHAT_TEMPLATE_MEMORY_BYTES):
        self.error: str | None = _template_worker_unsupported(tokenizer)
        self.setup = None if self.error else {
            "chat_template": tokenizer.chat_template, "special_tokens_map": tokenizer.special_tokens_map,
            "memory_bytes": memory_bytes, "max_chars": max_chars}
        self.memory_bytes, self.max_chars = memory_bytes, max_chars
        self.turn = threading.Lock()  # one render (or start) at a time
        self.guard = threading.Lock()  # proc and current, between a render's thread and abandon's
        self.proc: subprocess.Popen | None = None
        self.conns: tuple[Connection, Connection] | None = None  # (to the worker, from it)
        self.current: threading.Event | None = None  # the render running: its "client left" event
        self.closed = False

    def start_soon(self) -> None:
        """Start the worker on a thread (the server's start-up does not wait); one line in the log if it cannot."""
        def refuse() -> None:
            logger.warning("[entry] --trust-request-chat-template: requests' own chat templates will be refused: %s",
                           self.error)

        def start() -> None:
            with self.turn:
                try:
                    self._ensure_started()
                except OSError as e:  # no process can start here: every request template is refused
                    if self.closed:  # the server stopped as it started
                        return
                    self.error = f"no worker process can start ({e})"
                    refuse()
        if self.error:
            refuse()
        else:
            threading.Thread(target=start, name="nanoserve-template-start", daemon=True).start()

    def render(self, kwargs: dict[str, Any], limit: float, left: threading.Event) -> dict[str, Any]:
        """The worker's answer to tokenizer.apply_chat_template(**kwargs): {"text": ...}, or {"syntax": str,
        "lineno": n} / {"error": str} as the render raised them, or {"limit": "time"|"memory"|"length"|"crash"|
        "left"} where it was stopped. Blocks the calling thread (never the event loop's)."""
        while not self.turn.acquire(timeout=TEMPLATE_TURN_POLL_S):  # behind another render: its slot frees
            if left.is_set():                                         # as soon as its client leaves
                return {"limit": "left"}
        try:
            if left.is_set():
                return {"limit": "left"}
            self._ensure_started()
            to_worker, from_worker = self.conns
            with self.guard:
                self.current = left
            try:
                to_worker.send_bytes(pickle.dumps((kwargs, limit), protocol=pickle.HIGHEST_PROTOCOL))
                if from_worker.poll(limit):
                    return json.loads(from_worker.recv_bytes())
                outcome = {"limit": "time"}
            except (EOFError, OSError):  # killed by abandon, or it died (a C stack overflow, the OOM killer)
                outcome = {"limit": "left" if left.is_set() else "crash"}
            finally:
                with self.guard:
                    self.current = None
            self._kill()
        finally:
            self.turn.release()
        self._replace_soon()
        return outcome

    def abandon(self, left: threading.Event) -> None:
        """The client of the render ``left`` stands for has gone: that render (if it runs now) is killed."""
        left.set()
        with self.guard:
            if self.current is left and self.proc is not None:
                self.proc.kill()

    def close(self) -> None:
        self.closed = True
        with self.guard:
            if self.proc is not None:
                self.proc.kill()
        if self.turn.acquire(timeout=5):  # a render still running ends at the kill
            try:
                self._kill()
            finally:
                self.turn.release()

    def _ensure_started(self) -> None:
        """The worker, started if none runs (under ``turn``); raises OSError where it cannot start."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self._kill()
        if self.closed:
            raise OSError("the server is shutting down")
        r_worker, w_server = os.pipe()
        r_server, w_worker = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-c", _WORKER_BOOT, PACKAGE_ROOT, str(r_worker),
                                     str(w_worker)], pass_fds=(r_worker, w_worker),
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # not the server's ^C
        except BaseException:
            for fd in (w_server, r_server):
                os.close(fd)
            raise
        finally:
            os.close(r_worker)
            os.close(w_worker)
        conns = Connection(w_server, readable=False), Connection(r_server, writable=False)
        with self.guard:
            self.proc, self.conns = proc, conns
        try:
            conns[0].send_bytes(pickle.dumps(self.setup))
            if not conns[1].poll(CHAT_TEMPLATE_WORKER_START_S):
                raise OSError(f"the worker did not start within {CHAT_TEMPLATE_WORKER_START_S:g} s")
            ready = json.loads(conns[1].recv_bytes())
        except (EOFError, OSError) as e:
            self._kill()
            raise OSError(str(e) or "the worker ended as it started") from None
        if "error" in ready or self.closed:
            self._kill()
            raise OSError(ready.get("error", "the server is shutting down"))

    def _kill(self) -> None:
        with self.guard:
            proc, conns, self.proc, self.conns = self.proc, self.conns, None, None
        if proc is not None:
            proc.kill()
            proc.wait()
        for conn in conns or ():
            conn.close()

    def _replace_soon(self) -> None:
        """A new worker, started now on a thread: the next request finds it ready."""
        def replace() -> None:
            with self.turn:
                try:
                    self._ensure_started()
                except OSError as e:  # the next render tries again, and says why if it fails too
                    logger.warning("[entry] the chat-template worker could not be replaced: %s", e)
        if not self.closed:
            threading.Thread(target=replace, name="nanoserve-template-start", daemon=True).start()


def _template_worker_unsupported(tokenizer: Any) -> str | None:
    """Why the worker cannot render as ``tokenizer`` would (None where it can): it runs transformers' own
    apply_chat_template, which a tokenizer class may have replaced."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError as e:
        return f"transformers cannot be imported ({e})"
    if tokenizer is None:
        return "the engine runs without a tokenizer"
    for name in ("apply_chat_template", "get_chat_template"):
        if getattr(type(tokenizer), name, None) is not getattr(PreTrainedTokenizerBase, name):
            return f"{type(tokenizer).__name__} has its own {name}, which the worker does not run"
    try:
        pickle.dumps((tokenizer.chat_template, tokenizer.special_tokens_map))
    except Exception as e:
        return f"the tokenizer's chat template or special tokens cannot be sent to the worker ({e})"
    if not hasattr(os, "pipe") or sys.platform == "win32":
        return "this platform has no pipes for a worker process"
    return None


# The server's side of a render.

TEMPLATE_LIMIT_WORDS = {
    "time": "chat_template did not render within {limit:g} s: simplify it (loops within loops, very long strings)",
    "memory": "chat_template needed more than {mib} MiB to render: simplify it (very long strings or lists)",
    "length": "chat_template rendered a prompt longer than {max_chars} characters, more than max_model_len "
              "tokens can hold",
    "crash": "chat_template ended the process that renders it (too deep a recursion?): simplify it",
    "left": "the client left before chat_template rendered",
}


class WorkerTokenizer:
    """The tokenizer as engine.apply_chat_template uses it, whose ``apply_chat_template`` renders in the worker:
    the rest (its chat template for the content format, its signature for the reserved kwargs) is the
    tokenizer's own. What the render raised is raised again here with the same words, so that the engine's
    400s are those of a render in the server; a limit is a 400 naming chat_template."""

    def __init__(self, tokenizer: Any, worker: ChatTemplateWorker, limit: float, left: threading.Event):
        self.tokenizer, self.worker, self.limit, self.left = tokenizer, worker, limit, left
        # the signature the engine reads for the renderer's own arguments (chat_template_kwargs cannot set them)
        self.apply_chat_template = functools.wraps(tokenizer.apply_chat_template)(
            lambda conversation, **kwargs: self._render(conversation, **kwargs))

    @property
    def chat_template(self) -> Any:
        return self.tokenizer.chat_template

    def get_chat_template(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.get_chat_template(*args, **kwargs)

    def _render(self, conversation: Any, **kwargs: Any) -> str:
        try:
            out = self.worker.render({"conversation": conversation, **kwargs}, self.limit, self.left)
        except OSError as e:  # no worker could be started for it
            raise InvalidInput("chat_template", f"this server cannot render a request's chat_template now: {e}") \
                from None
        if "text" in out:
            return out["text"]
        if "syntax" in out:
            raise _RenderedSyntaxError(out["syntax"], out["lineno"])
        if "error" in out:
            raise _RenderError(out["error"])
        raise InvalidInput("chat_template", TEMPLATE_LIMIT_WORDS[out["limit"]].format(
            limit=self.limit, mib=self.worker.memory_bytes >> 20, max_chars=self.worker.max_chars))


class _RenderError(Exception):
    """An exception the render raised, by its words (``str(e) or type(e).__name__``, as the engine words it)."""


def _RenderedSyntaxError(words: str, lineno: int | None) -> Exception:
    """jinja2's TemplateSyntaxError as the render raised it: its words and line."""
    import jinja2

    class RenderedSyntaxError(jinja2.TemplateSyntaxError):
        def __str__(self) -> str:
            return words
    return RenderedSyntaxError(words, lineno)


# The worker process.

def serve_template_worker(r_fd: int, w_fd: int) -> None:
    """Render each request that comes, until the server closes the pipe (or ends)."""
    from_server, to_server = Connection(r_fd, writable=False), Connection(w_fd, readable=False)
    try:
        setup = pickle.loads(from_server.recv_bytes())
    except EOFError:  # the server gave up on it
        return
    try:
        import jinja2
        from transformers import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import _compile_jinja_template
        _compile_jinja_template("{{ messages }}")  # its first compile imports what every render needs
        _cap_worker_memory(setup["memory_bytes"])
    except Exception as e:
        to_server.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return
    tokenizer = _template_tokenizer(PreTrainedTokenizerBase, setup)
    to_server.send_bytes(b'{"ready": true}')
    while True:
        try:
            kwargs, limit = pickle.loads(from_server.recv_bytes())
        except EOFError:
            return
        # The server kills a render at its limit; should the server itself end meanwhile, SIGALRM's default
        # action ends the worker, even in a C call that holds the GIL (a Python handler would wait for it).
        signal.alarm(int(limit) + 10)
        out = _render_in_worker(tokenizer, kwargs, setup["max_chars"], jinja2)
        signal.alarm(0)
        try:
            data = json.dumps(out).encode()  # ASCII: a lone surrogate goes escaped, as the render made it
        except MemoryError:
            data = b'{"limit": "memory"}'
        del out
        to_server.send_bytes(data)


def _render_in_worker(tokenizer: Any, kwargs: dict[str, Any], max_chars: int | None, jinja2: Any) -> dict[str, Any]:
    try:
        text = tokenizer.apply_chat_template(kwargs.pop("conversation"), **kwargs)
    except MemoryError:
        return {"limit": "memory"}
    except jinja2.TemplateSyntaxError as e:
        return {"syntax": str(e), "lineno": e.lineno}
    except Exception as e:
        return {"error": str(e) or type(e).__name__}
    if max_chars is not None and len(text) > max_chars:
        return {"limit": "length"}
    return {"text": text}


def _template_tokenizer(base: type, setup: dict[str, Any]) -> Any:
    """What transformers' apply_chat_template reads of a tokenizer when it only renders (tokenize=False): its
    chat template(s) and special tokens; the methods are transformers' own."""
    class TemplateTokenizer:
        apply_chat_template = base.apply_chat_template
        get_chat_template = base.get_chat_template

        def __init__(self) -> None:
            self.chat_template = setup["chat_template"]
            self.special_tokens_map = setup["special_tokens_map"]
    return TemplateTokenizer()


def _cap_worker_memory(extra: int) -> None:
    """No more than ``extra`` bytes beyond what the worker holds now: past it, an allocation is a MemoryError
    (RLIMIT_DATA: the heap and private mappings, where Python's large objects go; RLIMIT_AS as well, for
    kernels before 4.7, where RLIMIT_DATA did not cover mappings)."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    for limit, key in ((resource.RLIMIT_DATA, "VmData"), (resource.RLIMIT_AS, "VmSize")):
        cap = int(status[key].split()[0]) * 1024 + extra
        resource.setrlimit(limit, (cap, cap))


# =========================================================================== SSE

def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


async def stream_events(gen: Generation, model: str) -> AsyncIterator[str]:
    """The SSE events of a completion or a chat completion, ending in [DONE]."""
    req, params = gen.req, gen.params
    head = {"id": gen.response_id, "object": gen.chunk_object, "created": gen.created, "model": model}
    unsent = set(range(len(gen.prompts) * params.n))  # choices whose first chunk is still to come
    num_tokens: dict[int, int] = {}  # each choice's output tokens so far (its usage)
    text_sent: dict[int, int] = {}
    opts = req.stream_options
    force = gen.state.force_include_usage  # as vLLM's should_include_usage
    final_usage = force or (opts is not None and opts.include_usage)
    continuous = force or (final_usage and opts.continuous_usage_stats)
    for chunk in gen.first_chunks(head):
        yield sse({**chunk, "usage": gen.chunk_usage([0], 0)} if continuous else chunk)
    try:
        async for i, out in gen.outputs():
            for c in out.outputs:  # DELTA outputs: only what this step added
                idx = gen.choice_index(i, c)
                num_tokens[idx] = num_tokens.get(idx, 0) + len(c.token_ids)
                first = idx in unsent
                echo = gen.echo_text(i) if first and req.echo else ""
                text = echo + c.delta_text
                if not text and c.finish_reason is None and (not c.token_ids or (
                        params.logprobs is None and not req.return_token_ids and not gen.reads_every_step)):
                    continue  # nothing new to say (text held back for a possible stop string)
                logprobs = gen.logprobs(c, text_sent.get(idx, 0), i if first and req.echo else None)
                text_sent[idx] = text_sent.get(idx, 0) + len(text)
                extra = gen.stream_extra(i, c.token_ids, first)
                choice = gen.delta_choice(idx, c, logprobs, extra, echo)  # chat's prompt ids rode its role chunk
                if choice is not None:  # None: all of it held back (a tool call's text), or no text
                    unsent.discard(idx)
                    usage = {"usage": gen.chunk_usage([num_tokens[idx]], i)} if continuous else {}
                    # as vLLM's: the fingerprint on each finishing chunk, or on the usage chunk that follows them
                    last = {"system_fingerprint": SYSTEM_FINGERPRINT} \
                        if choice["finish_reason"] is not None and not final_usage else {}
                    yield sse({**head, "choices": [gen.delta_nulls(choice)], **usage, **last})
        if final_usage:
            yield sse({**head, "choices": [], "usage": gen.usage(num_tokens.values()),
                       "system_fingerprint": SYSTEM_FINGERPRINT})
    except ClientDisconnect:
        raise  # nobody to tell
    except Exception as e:  # the status line is gone: report in the stream
        yield sse(_stream_error(gen, e).body())
    yield "data: [DONE]\n\n"


def _stream_error(gen: Generation, e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        error = e
    elif isinstance(e, (EngineDeadError, RequestFailedError)):
        error = _engine_error(e)
    else:
        logger.exception("[entry] %s: the stream failed", gen.request_id)
        error = ApiError(500, "internal server error; the server log has the details")
    logger.info("[entry] %s: stream ended by an error: %s", gen.request_id, error.message)
    return error


class EventStream:
    """A Generation's SSE events as a text/event-stream response, each sent as it
    comes. A client that disconnects ends it, which aborts the engine requests
    behind it: ``gen.close(why)`` runs in every case."""

    def __init__(self, gen: Generation, model: str):
        self.gen, self.model = gen, model

    async def __call__(self, scope, receive, send) -> None:
        why = "the server stopped"  # unless we get further
        try:
            async with watch_disconnect(receive, self.gen.queue):
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no")]})
                async for event in self.gen.stream(self.model):
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            why = ""
        except ClientDisconnect:
            why = "client disconnected mid-stream"
        finally:
            self.gen.close(why)


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request) -> AsyncIterator[None]:
    """vLLM's with_cancellation, around a request's admission (its body read, no response started): the
    client leaving cancels the work inside (a template's render, whose worker is then killed; a wait for the
    tokenizer thread or a grammar's turn), and ClientDisconnect leaves the block instead, which the app answers
    with a 499 nobody reads. After it, the generation's own watch_disconnect listens."""
    task, left = asyncio.current_task(), asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        left.set()
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not left.is_set():  # not the client's: the drain's, or a forced exit
            raise
        task.uncancel()
    finally:
        watcher.cancel()
    if left.is_set():  # also where the work inside caught the cancellation and went on
        raise ClientDisconnect()


@contextlib.asynccontextmanager
async def watch_disconnect(receive: Callable[[], Awaitable[dict]], queue: asyncio.Queue) -> AsyncIterator[None]:
    """A task of its own listens for the client leaving, since the handler waits on
    the engine's output ``queue`` (a Generation's, or the embeddings'), not on the
    client: it puts ClientDisconnect there."""
    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        queue.put_nowait(ClientDisconnect())

    task = asyncio.ensure_future(watch())
    try:
        yield
    finally:  # also when we are cancelled ourselves (the shutdown timeout)
        task.cancel()


# =========================================================================== the Responses API
# POST /v1/responses as vLLM serves it (vllm/entrypoints/openai/responses/) without its response store
# (VLLM_ENABLE_RESPONSES_API_STORE unset, its default): the body becomes a chat request that ChatGeneration
# serves (template, structured outputs, tool and reasoning parsers, admission, metrics), whose choice is read
# back as output items (reasoning, message, function_call) and a stream's deltas as the events building them.

RESPONSES_PASSED_ON = frozenset({  # vLLM's extra fields: handed to the chat request, which checks them
    "top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos", "logit_bias", "skip_special_tokens",
    "include_stop_str_in_output", "request_id", "cache_salt", "structured_outputs", "priority", "vllm_xargs",
    "presence_penalty", "frequency_penalty"})  # vLLM 0.32's ResponsesRequest has both
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                   "response_format": "text", "truncate_prompt_tokens": "truncation"}  # chat's name -> the body's
NO_STORE = "this server keeps no responses (as vLLM without VLLM_ENABLE_RESPONSES_API_STORE=1)"


class FunctionTool(FunctionDefinition):
    """A Responses function tool: flat, where chat nests it under "function"."""
    type: typing.Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, tool: Any) -> Any:
        if isinstance(tool, dict) and tool.get("type", "function") != "function":  # a 400 where vLLM says nothing
            raise ValueError(f"tools of type {show(tool['type'])} are not supported, only function tools: this "
                             f"server has no tool server to run built-in ones (vLLM without --tool-server takes "
                             f"web_search, file_search, code_interpreter, mcp or custom tools but neither runs them "
                             f"nor shows them to the model)")
        return tool


class ReasoningOptions(BaseModel):
    """OpenAI's ``reasoning`` object: its effort reaches the chat template; all of it is echoed back."""
    model_config = ConfigDict(extra="allow")
    effort: typing.Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: typing.Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(OpenAIBaseModel):
    """OpenAI's Responses body (vLLM's ResponsesRequest); ``chat_body`` is the chat request it becomes."""
    input: Any = None  # input_messages reads it
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: bool = False
    text: dict | None = Field(None, description='an object such as {"format": {"type": "json_schema", ...}}')
    tool_choice: Any = "auto"
    tools: list[FunctionTool] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True  # taken and ignored, as by vLLM without its store
    previous_response_id: str | None = None
    truncation: typing.Literal["auto", "disabled"] = "disabled"
    reasoning: ReasoningOptions | None = None
    include: list[typing.Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                                 "file_search_call.results", "message.input_image.image_url",
                                 "message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    top_logprobs: int | None = None  # -1: the whole vocabulary (as vLLM's); the range: SamplingParams
    service_tier: typing.Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    background: typing.Literal[False] = Field(False, description=f"false: background mode needs a response store, "
                                                                 f"and {NO_STORE}")  # vLLM's answer too
    prompt: None = Field(None, description="left out: prompt templates are not supported")  # likewise
    enable_response_messages: typing.Literal[False] = Field(False, description="false: vLLM has them for gpt-oss only")

    def chat_body(self, request_id: str) -> dict[str, Any]:
        """The chat request's body. vLLM's extra fields pass as they are; chat's own fields that a Responses
        body does not have are ignored with a warning, as vLLM ignores fields it does not know."""
        extra = self.model_extra or {}
        ignored = sorted(k for k in extra if k in ChatCompletionRequest.model_fields and k not in RESPONSES_PASSED_ON)
        if ignored:
            logger.warning("[entry] %s: ignoring field(s) the Responses API does not have: %s", request_id,
                           ", ".join(map(show, ignored)))
        messages, continued = input_messages(self.input)
        tools = None if self.tools is None else [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools]
        choice = self.tool_choice
        named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
        if choice not in ("auto", "none", "required") and not named:
            kind = choice.get("type") if isinstance(choice, dict) else None
            what = f"a tool_choice of type {show(kind)} is not supported (vLLM takes it but applies neither its " \
                   f"tools nor its mode); " if isinstance(kind, str) and kind != "function" else ""
            raise InvalidInput("tool_choice", f'{what}tool_choice must be "auto", "none", "required" or {{"type": '
                                              f'"function", "name": ...}}, got {show(choice)}')
        if (named or choice == "required") and self.tools is None:  # an empty list means no tools: "required" drops
            raise InvalidInput("tool_choice", f"tool_choice {show(choice)} needs tools: the functions it may call")
        choice = {"type": "function", "function": {"name": choice["name"]}} if named else choice if tools else None
        fmt = (self.text or {}).get("format", {"type": "text"})
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema") or (
                fmt["type"] == "json_schema" and not (isinstance(fmt.get("schema"), dict) and isinstance(
                    fmt.get("name"), str) and fmt.get("strict") in (None, True, False))):  # as OpenAI's type
            raise InvalidInput("text", 'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                                       f'"json_schema", "name": ..., "schema": {{...}}}}, got {show(fmt)}')
        logprobs = "message.output_text.logprobs" in (self.include or ())
        effort = self.reasoning and self.reasoning.effort
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return {**{k: v for k, v in extra.items() if k not in ignored}, "model": self.model, "stream": self.stream,
                "messages": system + messages,
                "continue_final_message": continued, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "tools": tools if choice else None,
                "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
                "logprobs": logprobs, "top_logprobs": self.top_logprobs if logprobs else None,
                "truncate_prompt_tokens": -1 if self.truncation == "auto" else None,
                "chat_template_kwargs": {"reasoning_effort": effort} if effort else None,  # as vLLM's
                "response_format": None if fmt["type"] == "text" else fmt if fmt["type"] == "json_object" else
                {"type": "json_schema", "json_schema": {k: fmt.get(k) for k in ("name", "schema", "strict")}}}


INPUT_ROLES = ("user", "assistant", "system", "developer")  # a Responses message's (OpenAI's EasyInputMessage)


def input_messages(value: Any) -> tuple[list[dict[str, Any]], bool]:
    """A Responses input as chat messages, as vLLM's construct_input_messages: a function_call joins the
    assistant message before it, a function_call_output is a tool message, a reasoning item is dropped;
    and whether the last is an unfinished assistant message, to continue (vLLM's partial completion)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], False
    if not isinstance(value, list) or not value:
        raise InvalidInput("input", f"input must be a string or a non-empty list of input items, got {show(value)}")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where, kind = f"input[{i}]", item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in INPUT_ROLES:
            messages.append({"role": item["role"], "content": _item_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")) \
                and item["name"]:
            # read here, where its place in input is known (the template reads them later)
            parse_call_arguments(item["arguments"], "input", f"{where}.arguments", show(item["arguments"]))
            call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _item_text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise InvalidInput("input", f"{where} must be a message {{role ({', '.join(INPUT_ROLES)}), content}}, "
                                        f"a function_call {{call_id, "
                                        f"name, arguments}}, a function_call_output {{call_id, output}} or a reasoning "
                                        f"item, got {show(item)}")
    if not messages:
        raise InvalidInput("input", "input has no message (reasoning items are dropped)")
    return messages, value[-1].get("role") == "assistant" and value[-1].get("status") in ("in_progress", "incomplete")


def _item_text(content: Any, where: str) -> str:
    """A message's content (or a tool's output): a string, or text parts (input_text, output_text)."""
    texts = [part_text(p) for p in content] if isinstance(content, list) else [content]
    if not all(isinstance(t, str) for t in texts):
        raise InvalidInput("input", f"{where} must be a string or a list of text parts ({{\"type\": \"input_text\", "
                                    f"\"text\": ...}}); images, files and audio are not supported, got {show(content)}")
    return "\n".join(texts)


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses body becomes; its errors use the Responses body's names."""
    prompt_field: ClassVar[str] = "input"
    body_names: ClassVar[dict[str, str]] = RESPONSES_NAMES
    _source: OpenAIBaseModel | None = PrivateAttr(None)  # the body it was made from

    def param_name(self, engine_param: str) -> str:
        name = super().param_name(engine_param)
        return self.body_names.get(name, name)

    def invalid(self, e: InvalidInput) -> ApiError:
        error, name = super().invalid(e), ChatCompletionRequest.param_name(self, e.param)
        error.message = body_terms(self._source, self.body_names, name, getattr(self, name, None), error.message)
        return error


def translate(src: OpenAIBaseModel, schema: type[ResponsesChatRequest], request_id: str) -> ResponsesChatRequest:
    """The chat request another API's body becomes (``src.chat_body``), its errors in that body's terms."""
    body: dict[str, Any] = {}
    try:
        body = src.chat_body(request_id)
        req = parse_body(schema, body, request_id)
    except InvalidInput as e:
        raise bad_request(str(e), e.param) from None
    except ApiError as e:
        e.message = body_terms(src, schema.body_names, e.param, body.get(e.param), e.message)
        e.param = schema.body_names.get(e.param, e.param)
        raise
    req._source = src
    return req


def body_terms(src: BaseModel | None, names: dict[str, str], field: str | None, value: Any, message: str) -> str:
    """An error about the chat request's ``field`` quotes the body's value where the translation changed it
    (Anthropic's tool_choice {"type": "any"}, not chat's "required")."""
    theirs = getattr(src, names.get(field, field), None) if field else None
    if isinstance(theirs, BaseModel):
        theirs = theirs.model_dump(exclude_unset=True)
    return message if value is None or theirs is None or theirs == value else message.replace(show(value), show(theirs))


class ResponseOutput:
    """One response's output items, built from chat deltas (a stream's, or a whole message as one):
    ``feed`` and ``close`` give the events that build them, as (type, fields) pairs."""

    def __init__(self, logprobs: bool = True):
        self.logprobs = logprobs        # asked for: else a finished text part's are null, as vLLM's
        self.items: list[dict] = []     # the finished ones
        self.item: dict | None = None   # the one being built (a text item's text is in its part)
        self.part: dict = {}

    def feed(self, part: dict, logprobs: list[dict] | None, calls_first: bool = False) -> list[tuple[str, dict]]:
        """A chat delta (or message): its reasoning, content and tool calls, in the output's order (``calls_first``:
        the tool parser's content follows its calls), so that a whole message is read as its stream is. The
        logprobs go with the delta's content, as vLLM's: a step that adds no content (a call's, one the parser
        holds, the EOS) streams none."""
        events = []
        for key in ("reasoning_content", "tool_calls", "content") if calls_first else \
                ("reasoning_content", "content", "tool_calls"):
            events += self._calls(part.get(key) or []) if key == "tool_calls" else \
                self._text(key, part.get(key), logprobs or [])
        return events

    def _text(self, key: str, delta: str | None, logprobs: list[dict]) -> list[tuple[str, dict]]:
        """Reasoning or content text: to the item of its kind being built, else to a new one."""
        events, kind = [], "message" if key == "content" else "reasoning"
        if not delta:
            return events
        if self.item is None or self.item["type"] != kind:
            # as vLLM's (the SDK's models, nulls written): a reasoning item's content is null until it is done
            events += self._open({"id": f"{'msg' if kind == 'message' else 'rs'}_{uuid.uuid4().hex}", "type": kind,
                                  "status": "in_progress", **({"content": [], "role": "assistant", "phase": None}
                                                              if kind == "message" else
                                                              {"content": None, "summary": [],
                                                               "encrypted_content": None})})
            self.part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} \
                if kind == "message" else {"type": "reasoning_text", "text": ""}
            events.append(("response.content_part.added", {**self._where(), "content_index": 0,
                                                           "part": dict(self.part)}))
        self.part["text"] += delta
        fields = {**self._where(), "content_index": 0, "delta": delta}
        if kind == "message":
            # a delta event's logprobs are the SDK's delta kind, without bytes (vLLM's _to_stream_logprobs)
            fields["logprobs"] = [{"token": t["token"], "logprob": t["logprob"], "top_logprobs": [
                {"token": k["token"], "logprob": k["logprob"]} for k in t["top_logprobs"]]} for t in logprobs]
            self.part["logprobs"] = self.part["logprobs"] + logprobs
        return events + [(f"response.{self.part['type']}.delta", fields)]

    def _calls(self, calls: list[dict]) -> list[tuple[str, dict]]:
        events = []
        for call in calls:
            if "id" in call:  # a new call
                events += self._open({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                                      "call_id": call["id"], "name": call["function"]["name"], "arguments": "",
                                      **dict.fromkeys(("namespace", "async", "caller"))})  # the SDK's, null as vLLM's
            if delta := call["function"].get("arguments"):
                self.item["arguments"] += delta
                events.append(("response.function_call_arguments.delta", {**self._where(), "delta": delta}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        """The item being built is done: its done events."""
        item, self.item = self.item, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "function_call":
            events = [("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                  "arguments": item["arguments"]})]
        else:
            item["content"] = [part := self.part]
            done = {**where, "content_index": 0, "text": part["text"]}
            if item["type"] == "message":  # as vLLM's: the logprobs are the part's, none on the text's done event
                done["logprobs"] = []
            if item["type"] == "message" and not self.logprobs:
                part["logprobs"] = None
            events = [(f"response.{part['type']}.done", done),
                      ("response.content_part.done", {**where, "content_index": 0, "part": part})]
        item["status"] = "completed"
        self.items.append(item)
        return events + [("response.output_item.done", {"output_index": where["output_index"], "item": item})]

    def _open(self, item: dict) -> list[tuple[str, dict]]:
        events, self.item = self.close(), item
        return events + [("response.output_item.added", {"output_index": len(self.items), "item": dict(item)})]

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.items)}


class ResponsesGeneration(ChatGeneration):
    """A chat generation whose response and stream are the Responses API's."""
    schema = ResponsesChatRequest
    object_name, id_prefix = "response", "resp_"
    auto_needs_parser = False  # as vLLM's Responses path: the tools reach the template, the text is not parsed

    @classmethod
    def parse(cls, body: dict[str, Any], request_id: str) -> ResponsesChatRequest:
        try:
            src = ResponsesRequest.model_validate(body)
        except ValidationError as e:
            raise _validation_error(ResponsesRequest, body, e.errors(include_url=False)[0]) from None
        if src.previous_response_id is not None:  # vLLM's answer when its store does not hold it
            raise ApiError(404, f"Response with id {show(src.previous_response_id)} not found: {NO_STORE}; send the "
                                f"conversation in input", "previous_response_id")
        return translate(src, ResponsesChatRequest, request_id)

    def __init__(self, state: ServerState, request_id: str, req: ResponsesChatRequest, params: SamplingParams):
        super().__init__(state, request_id, req, params)
        self.src: ResponsesRequest = req._source

    def response(self, model: str, finals: dict[int, CompletionOutput]) -> dict[str, Any]:
        (c,) = finals.values()
        out = ResponseOutput(self.params.logprobs is not None)
        self.feed(out, self.message_choice(0, c, self.logprobs(c, 0)), "message")
        out.close()
        for item in out.items:  # as vLLM's whole response (a stream's done item says "completed")
            if item["type"] == "reasoning":
                item["status"] = None
        return self.body(model, out.items, c.finish_reason)

    async def stream(self, model: str) -> AsyncIterator[str]:
        """vLLM's events: response.created and .in_progress, each output item's added, delta and done
        events, then response.completed with the whole response (its status "incomplete" if cut short, as
        vLLM's); each an SSE event named by its type, numbered; no [DONE] (vLLM and OpenAI send none)."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': next(numbers), **fields})}\n\n"
        head = self.body(model, [], None)
        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        out, finish = ResponseOutput(self.params.logprobs is not None), None
        try:
            async for _, output in self.outputs():
                for c in output.outputs:
                    finish = c.finish_reason
                    if (choice := self.delta_choice(0, c, self.logprobs(c, 0))) is not None:
                        for kind, fields in self.feed(out, choice, "delta"):
                            yield event(kind, **fields)
            for kind, fields in out.close():
                yield event(kind, **fields)
            yield event("response.completed", response=self.body(model, out.items, finish))
        except ClientDisconnect:
            raise
        except Exception as e:  # the status line is gone: report in the stream
            error = _stream_error(self, e)
            yield event("error", code=str(error.status), message=error.message, param=error.param)

    def feed(self, out: ResponseOutput, choice: dict, key: str) -> list[tuple[str, dict]]:
        """A choice's message (or delta) into ``out``: a message's tool parser says whether its content follows
        its calls; a delta's content goes before its calls (vLLM's split_delta)."""
        tools = self.tool_streams.get(choice["index"])
        return out.feed(choice[key], (choice["logprobs"] or {}).get("content"),
                        key == "message" and tools is not None and tools.parser.CONTENT_AFTER_CALLS)

    def body(self, model: str, output: list[dict], finish_reason: str | None) -> dict[str, Any]:
        """The response (in progress while ``finish_reason`` is None), with the request's parameters as vLLM's
        from_request echoes them (the sampling ones as applied); the usage's details always, as vLLM's."""
        src, params, prompt = self.src, self.params, len(self.prompts[0].token_ids)
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        output_tokens = self.num_output_tokens()
        usage = {"input_tokens": prompt, "output_tokens": output_tokens, "total_tokens": prompt + output_tokens,
                 "input_tokens_details": {"cached_tokens": self.num_cached_tokens(), "cache_write_tokens": 0,
                                          "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                 "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(), "tool_output_tokens": 0,
                                           "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []}}
        return {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": None, "model": model, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "max_output_tokens": self.state.engine.resolve_max_tokens(prompt, params.max_tokens),
                "temperature": params.temperature,
                "top_p": params.top_p, "top_logprobs": params.logprobs, "previous_response_id": None,
                "text": src.text and response_text(src.text), "tools": [t.model_dump() for t in src.tools or []],
                **{k: getattr(src, k) for k in ("instructions", "max_tool_calls", "metadata", "parallel_tool_calls",
                                                "service_tier", "truncation", "user")},
                # as vLLM's: without tools, "auto" is reported as what it comes to
                "tool_choice": "none" if not src.tools and src.tool_choice == "auto" else src.tool_choice,
                "reasoning": src.reasoning and src.reasoning.model_dump(exclude_unset=True),  # as sent
                "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                "usage": None if finish_reason is None else usage,
                **dict.fromkeys(("prompt", "kv_transfer_params", "ec_transfer_params", "input_messages",
                                 "output_messages"))}  # vLLM's, null here as there (without its tool server)


def response_text(text: dict) -> dict:
    """The request's ``text`` as vLLM's model echoes it: its unset fields null."""
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = with_nulls(fmt, ("description", "strict"))
    return with_nulls({**text, **({"format": fmt} if "format" in text else {})}, ("verbosity",))


async def create_response(request: Request) -> Response:
    return await _generate(request, ResponsesGeneration)


async def retrieve_response(request: Request) -> Response:
    """GET /v1/responses/{id} and its /cancel, as vLLM answers them without its store."""
    raise ApiError(404, f"Response with id {show(request.path_params['response_id'])} not found: {NO_STORE}",
                   "response_id")


# =========================================================================== the Anthropic Messages API
# POST /v1/messages and /v1/messages/count_tokens as vLLM serves them (vllm/entrypoints/anthropic/), for the
# anthropic SDK and Claude Code: the body becomes a chat request that ChatGeneration serves, whose choice is read
# back as content blocks (thinking, text, tool_use) and a stream's deltas as Anthropic's events.

ANTHROPIC_NAMES = {"stop": "stop_sequences", "response_format": "output_config"}  # chat's name -> the body's
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request system line: vLLM drops it (prefix cache)


class AnthropicTool(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict = Field(description='a JSON schema such as {"type": "object", "properties": {...}}')
    strict: bool | None = None  # true: a forced call's input follows input_schema (with a parser of its own format)


class AnthropicToolChoice(_Strict):
    type: typing.Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False  # chat's parallel_tool_calls false: only the first call is returned

    def chat(self) -> str | dict:
        """As chat's tool_choice: "any" is "required", "tool" names the function."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return "required" if self.type == "any" else self.type


class AnthropicOutputConfig(_Strict):
    effort: typing.Literal["low", "medium", "high", "xhigh", "max"] | None = None  # chat's reasoning_effort
    format: dict | None = Field(None, description='{"type": "json_schema", "schema": {...}}')


class AnthropicCountTokensRequest(OpenAIBaseModel):
    """Anthropic's count_tokens body (vLLM's); ``chat_body`` is the chat request it becomes."""
    model: str  # required, as Anthropic's and vLLM's ("" is unset, as vLLM's check_model takes it)
    messages: Any = None  # anthropic_messages reads it
    system: Any = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    chat_template_kwargs: dict | None = Field(None, description='an object such as {"enable_thinking": false}')

    def chat_body(self, request_id: str) -> dict[str, Any]:
        choice = self.tool_choice
        if choice and (choice.type != "none" and not self.tools or choice.type == "tool" and not choice.name):
            raise InvalidInput("tool_choice", f"tool_choice {show(choice.type)} needs tools (and type \"tool\" a "
                                              f"tool_choice.name): the tools it may call")
        messages = anthropic_messages(self.messages, self.system)
        for i, t in enumerate(self.tools or ()):  # a call's input is an object: Anthropic's API takes no other
            if t.input_schema.get("type", "object") != "object":
                raise InvalidInput("tools", f'tools[{i}].input_schema must be an object\'s schema ({{"type": '
                                            f'"object", ...}}), got "type": {show(t.input_schema["type"])}')
        tools = None if self.tools is None else [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": {"type": "object", **t.input_schema},
            "strict": t.strict}}
            for t in self.tools]
        return {"model": self.model, "messages": messages, "tools": tools,
                # an assistant message last is continued (Anthropic's prefill), unless it ends in calls
                "continue_final_message": messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1],
                "tool_choice": None if choice is None else choice.chat(),
                "parallel_tool_calls": False if choice is not None and choice.disable_parallel_tool_use else None,
                "chat_template_kwargs": self.chat_template_kwargs}


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """Anthropic's Messages body (vLLM's AnthropicMessagesRequest)."""
    max_tokens: int = Field(gt=0)  # required, as Anthropic's
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_WORDS)
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict | None = None  # taken and not used, as by vLLM
    thinking: dict | None = None  # likewise: --reasoning-parser says what is a thought
    output_config: AnthropicOutputConfig | None = None

    def chat_body(self, request_id: str) -> dict[str, Any]:
        fmt, effort = (self.output_config.format, self.output_config.effort) if self.output_config else (None, None)
        if fmt is not None and not (fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
            raise InvalidInput("output_config", f'output_config.format must be {{"type": "json_schema", "schema": '
                                                f'{{...}}}}, got {show(fmt)}')
        return {**super().chat_body(request_id), "max_tokens": self.max_tokens, "stop": self.stop_sequences,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream,
                "reasoning_effort": effort, "response_format": fmt and {
                    "type": "json_schema", "json_schema": {"name": "json_schema", "schema": fmt["schema"]}}}


def anthropic_messages(value: Any, system: Any) -> list[dict[str, Any]]:
    """Anthropic messages as chat messages, as vLLM's converter: the system text first (the field's, and that of
    messages with the system role); an assistant's tool_use blocks as its tool_calls and its thinking blocks as its
    reasoning; a user's tool_result blocks as tool messages, before the rest of that message."""
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages", f"messages must be a non-empty list of {{role, content}} objects, "
                                       f"got {show(value)}")
    systems = [] if system is None else _anthropic_texts(system, "system", "system")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where, m = f"messages[{i}]", m if isinstance(m, dict) else {}
        role = m.get("role") if isinstance(m.get("role"), str) else None
        role = "user" if role in ("ctx", "msg") else role  # Claude Code's own roles, as vLLM reads them
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m.get("content"), str) else m.get("content")
        if role not in ("user", "assistant", "system") or not isinstance(blocks, list) or not blocks:
            raise InvalidInput("messages", f'{where} must be {{"role": "user" or "assistant", "content": a string or '
                                           f'a non-empty list of content blocks}}, got {show(value[i])}')
        if role == "system":
            systems += _anthropic_texts(blocks, f"{where}.content", "messages")
            continue
        texts, calls, thoughts = [], [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "thinking" and isinstance(b.get("thinking"), str):
                thoughts.append(b["thinking"])
            elif kind == "tool_use" and role == "assistant" and isinstance(b.get("id"), str) and isinstance(
                    b.get("name"), str) and b["name"] and isinstance(b.get("input", {}), dict):
                calls.append({"id": b["id"], "function": {"name": b["name"], "arguments": dumps(b.get("input", {}))}})
            elif kind == "tool_result" and role == "user" and isinstance(b.get("tool_use_id"), str):
                result = "" if b.get("content") is None else b["content"]  # (not `or`: a false or 0 is no text)
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": "\n".join(
                    _anthropic_texts(result, f"{where}.content[{j}].content", "messages"))})
            elif kind not in ("redacted_thinking", "tool_reference"):  # opaque: dropped, as vLLM drops them
                raise InvalidInput("messages", f"{where}.content[{j}] must be a text, thinking, tool_use (an "
                                               f"assistant's) or tool_result (a user's) block; images and documents "
                                               f"are not supported, got {show(b)}")
        if texts or calls or thoughts or role == "assistant":  # a user's tool results alone make no user message
            out.append({"role": role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {}),
                        **({"reasoning": "".join(thoughts)} if thoughts else {})})
    systems = [t for t in systems if t and not t.startswith(BILLING_HEADER)]
    if not out and not systems:  # only blocks dropped as opaque (redacted_thinking, tool_reference)
        raise InvalidInput("messages", f"messages hold nothing to render (text, thinking, tool_use or tool_result "
                                       f"blocks), got {show(value)}")
    return [{"role": "system", "content": "".join(systems)}] * bool(systems) + out


def _anthropic_texts(value: Any, where: str, param: str) -> list[str]:
    """A string, or a list of text blocks, as texts (tool_reference blocks dropped, as vLLM drops them)."""
    blocks = [{"type": "text", "text": value}] if isinstance(value, str) else value
    if not isinstance(blocks, list) or not all(isinstance(b, dict) and (b.get("type") == "tool_reference" or (
            b.get("type") == "text" and isinstance(b.get("text"), str))) for b in blocks):
        raise InvalidInput(param, f'{where} must be a string or a list of text blocks ({{"type": "text", "text": '
                                  f'...}}); images and documents are not supported, got {show(value)}')
    return [b["text"] for b in blocks if b["type"] == "text"]


class AnthropicChatRequest(ResponsesChatRequest):
    """The chat request an Anthropic body becomes; its errors use the Anthropic body's names."""
    prompt_field: ClassVar[str] = "messages"
    body_names: ClassVar[dict[str, str]] = ANTHROPIC_NAMES
    tool_schema_field: ClassVar[str] = "input_schema"


class AnthropicContent:
    """A message's content blocks, built from chat deltas (a stream's, or a whole message as one): ``feed``
    and ``close`` give the stream events that build them, as (type, fields) pairs."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.open = False      # the last block is still being built
        # the open block's text (a tool_use block's: its input's JSON) so far, joined when it closes: str +=
        # on a dict item or an attribute copies the whole text each delta, quadratic in a long answer
        self.parts: list[str] = []
        self.arguments = ""    # the last tool_use block's input, as JSON text
        self.pending: list[str] = []  # text that came while a tool_use block was open: a text block after it

    def feed(self, part: dict, calls_first: bool = False) -> list[tuple[str, dict]]:
        """A chat delta (or message), in the output's order (``calls_first``: the parser's text follows its calls)."""
        events = self._text("thinking", part.get("reasoning_content"))
        for key in ("tool_calls", "content") if calls_first else ("content", "tool_calls"):
            events += self._calls(part.get(key) or []) if key == "tool_calls" else self._text("text", part.get(key))
        return events

    def _calls(self, calls: list[dict]) -> list[tuple[str, dict]]:
        events = []
        for call in calls:
            if "id" in call:  # a new call
                events += self._start({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                       "input": {}})
            if delta := call["function"].get("arguments"):
                self.parts.append(delta)
                events.append(self._delta("input_json_delta", partial_json=delta))
        return events

    def _text(self, kind: str, delta: str | None) -> list[tuple[str, dict]]:
        if not delta:
            return []
        if kind == "text" and self.open and self.blocks[-1]["type"] == "tool_use":  # as vLLM's: held, not cut in
            self.pending.append(delta)
            return []
        # (a thinking block's signature comes at its end, in a signature_delta: none at its start, as vLLM's)
        events = [] if self.open and self.blocks[-1]["type"] == kind else self._start({"type": kind, kind: ""})
        self.parts.append(delta)
        return events + [self._delta(f"{kind}_delta", **{kind: delta})]

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.blocks.append(block)
        self.open = True
        return events + [("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)})]

    def _delta(self, kind: str, **fields: str) -> tuple[str, dict]:
        return "content_block_delta", {"index": len(self.blocks) - 1, "delta": {"type": kind, **fields}}

    def close(self) -> list[tuple[str, dict]]:
        """The block being built is done: its stop event."""
        if not self.open:
            return []
        self.open, block, events = False, self.blocks[-1], []
        text, self.parts = "".join(self.parts), []
        if block["type"] in ("text", "thinking"):
            block[block["type"]] = text
        if block["type"] == "thinking":  # as vLLM's: a random signature, which a client sends back with the thought
            block["signature"] = uuid.uuid4().hex
            events.append(self._delta("signature_delta", signature=block["signature"]))
        elif block["type"] == "tool_use":  # a named call cut short by max_tokens is no JSON yet: no input
            self.arguments = text
            with contextlib.suppress(ValueError):
                block["input"] = json.loads(self.arguments or "{}")
        events.append(("content_block_stop", {"index": len(self.blocks) - 1}))
        pending, self.pending = "".join(self.pending), []
        return events + (self._text("text", pending) + self.close() if pending else [])

    def call_cut(self) -> bool:
        """Whether the last tool_use block's input is no JSON (a stream's call that a stop string cut short)."""
        if not any(b["type"] == "tool_use" for b in self.blocks):
            return False
        try:
            json.loads(self.arguments)
            return False
        except ValueError:
            return True


class AnthropicGeneration(ChatGeneration):
    """A chat generation whose response and stream are Anthropic's Messages API's."""
    schema = AnthropicChatRequest
    object_name, id_prefix = "message", "msg_"

    @classmethod
    def parse(cls, body: dict[str, Any], request_id: str) -> AnthropicChatRequest:
        return translate(parse_body(AnthropicMessagesRequest, body, request_id), AnthropicChatRequest, request_id)

    def response(self, model: str, finals: dict[int, CompletionOutput]) -> dict[str, Any]:
        (c,) = finals.values()
        choice, content, tools = self.message_choice(0, c), AnthropicContent(), self.tool_streams
        content.feed(choice["message"], 0 in tools and tools[0].parser.CONTENT_AFTER_CALLS)
        content.close()
        return self.body(model, content.blocks, choice)

    async def stream(self, model: str) -> AsyncIterator[str]:
        """vLLM's events, each named by its type: message_start (no content yet), each content block's
        content_block_start, _delta and _stop, then message_delta (stop_reason, usage), message_stop; no [DONE]."""
        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\ndata: {dumps({'type': kind, **fields})}\n\n"
        yield event("message_start", message=self.body(model, [], None))
        content, last = AnthropicContent(), None
        try:
            async for _, output in self.outputs():
                for c in output.outputs:
                    if (choice := self.delta_choice(0, c)) is not None:
                        last = choice
                        for kind, fields in content.feed(choice["delta"]):
                            yield event(kind, **fields)
            for kind, fields in content.close():
                yield event(kind, **fields)
            final = self.body(model, content.blocks, last, content.call_cut())
            yield event("message_delta", usage=final["usage"],
                        delta={k: final[k] for k in ("stop_reason", "stop_sequence")})
            yield event("message_stop")
        except ClientDisconnect:
            raise
        except Exception as e:  # the status line is gone: report in the stream
            yield event("error", error=_stream_error(self, e).anthropic_body()["error"])

    def body(self, model: str, content: list[dict], choice: dict | None, call_cut: bool = False) -> dict[str, Any]:
        """The message (no stop_reason yet while ``choice``, the last, is None)."""
        stop = None if choice is None else choice["stop_reason"]
        reason = None if choice is None else anthropic_stop_reason(choice["finish_reason"], stop, content, call_cut)
        output_tokens = self.num_output_tokens()
        return {"id": self.response_id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": reason, "stop_sequence": stop if reason == "stop_sequence" else None,
                "usage": {"input_tokens": len(self.prompts[0].token_ids), "output_tokens": output_tokens}}


def anthropic_stop_reason(finish_reason: str | None, stop_reason: int | str | None, content: list[dict],
                          call_cut: bool = False) -> str | None:
    """Chat's finish_reason as Anthropic's stop_reason (None while the message runs). As vLLM's, a stop string
    that cut a streamed call short (``call_cut``) wins over the call: a call cut short must not run."""
    if finish_reason is None:
        return None
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "repetition":  # vLLM's repetition_detection: the turn ended, by no stop sequence
        return "end_turn"
    if isinstance(stop_reason, str) and (call_cut or not any(b["type"] == "tool_use" for b in content)):
        return "stop_sequence"
    return "tool_use" if any(b["type"] == "tool_use" for b in content) else "end_turn"  # a stop token or EOS: the turn's end


async def create_message(request: Request) -> Response:
    return await _generate(request, AnthropicGeneration)


async def count_message_tokens(request: Request) -> Response:
    """The prompt's tokens as the chat path renders them (vLLM's count_tokens): a prompt that no message could
    send (over max_model_len, output aside, as vLLM's) is the same 400 as on /v1/messages, its count in it."""
    state, request_id = _state(request), _request_id(request)
    req = await read_json(request, state, lambda body: translate(
        parse_body(AnthropicCountTokensRequest, body, request_id), AnthropicChatRequest, request_id))
    check_model(req, state)
    try:
        async with cancel_on_disconnect(request):
            with state.endable():
                _, ids = await state.off_loop(lambda: state.engine.tokenize(chat_prompt(state, req),
                                                                            req.add_special_tokens))
        state.engine.check_prompt_length(len(ids), output_tokens=0)
    except InvalidInput as e:
        raise req.invalid(e) from None
    return json_response({"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}})


# =========================================================================== metrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5 series
_ENGINE_SERIES = [  # (kind, name, help, engine.stats() key)
    (GaugeMetricFamily, "num_requests_running", "Requests in the running queue", "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled", "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", "kv_cache_usage"),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     "prefix_cache_queries"),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hits"),
    (CounterMetricFamily, "num_preemptions", "Preemptions", "num_preemptions"),
    (CounterMetricFamily, "prompt_tokens", "Prompt tokens admitted", "prompt_tokens"),
    (CounterMetricFamily, "generation_tokens", "Tokens generated", "generation_tokens"),
    # with --speculative-config only (vLLM's spec_decode_* counters)
    (CounterMetricFamily, "spec_decode_num_drafts", "Steps that ran draft tokens, a request each",
     "spec_decode_num_drafts"),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens run", "spec_decode_num_draft_tokens"),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted",
     "spec_decode_num_accepted_tokens"),
]


class ServerMetrics:
    """/metrics: vLLM's metric names under ``nanoserve:``, in this app's own
    registry, and each again under ``vllm:`` (``exposed``), so that dashboards and
    autoscalers built for vLLM read them. Gauges and engine counters are read from
    ``engine.stats()`` at scrape time; latency histograms are fed by each request's timestamps."""

    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.async_llm, self.model_name = async_llm, model_name
        self.registry = CollectorRegistry()
        self.registry.register(self)  # collect(): the engine's own series, at scrape time
        self.exposed = CollectorRegistry()
        self.exposed.register(self.registry)
        self.exposed.register(_Renamed(self.registry, "nanoserve:", "vllm:"))

        def histogram(name: str, doc: str, buckets: tuple = _LATENCY_BUCKETS):
            return Histogram(f"nanoserve:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)
        self._request_success = Counter("nanoserve:request_success", "Finished requests (choices), by reason",
                                        ["model_name", "finished_reason"], registry=self.registry)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first output token")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output tokens")
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled")
        # vLLM's per-request series, observed at a request's end (its dashboards' heatmaps and phase panels)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first output token")
        self.decode_time = histogram("request_decode_time_seconds", "First to last output token")
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last output token")
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "A request's mean time between output tokens")
        self.prompt_tokens = histogram("request_prompt_tokens", "A finished request's prompt tokens", _TOKEN_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "A finished request's output tokens",
                                           _TOKEN_BUCKETS)
        self.params_n = histogram("request_params_n", "A finished request's n", _TOKEN_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "A finished request's max_tokens",
                                           _TOKEN_BUCKETS)
        self._rejected = Counter("nanoserve:request_rejected", "Requests answered with an error status "
                                 "(429: the queue was full)", ["model_name", "code"], registry=self.registry)

    def observe_finished(self, m: RequestMetrics, num_prompt: int, num_output: list[int], n: int = 1,
                         max_tokens: int | None = None):
        """vLLM's per-request series, at the end of an engine request (``num_output``: each of its n completions')."""
        self.prompt_tokens.observe(num_prompt)
        self.generation_tokens.observe(sum(num_output))
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        if m.first_scheduled_time is None or m.first_token_time is None:
            return
        self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        self.decode_time.observe(m.last_token_time - m.first_token_time)
        self.inference_time.observe(m.last_token_time - m.first_scheduled_time)
        if max(num_output, default=0) > 1:  # the longest completion's gaps
            self.time_per_output_token.observe((m.last_token_time - m.first_token_time) / (max(num_output) - 1))

    def observe_pooled(self, out: PoolingRequestOutput) -> None:
        """A pooling request's end, as vLLM observes one: its vector is its first (and only) output, so
        time to first token, queue, prefill and e2e latency, its prompt tokens and no output tokens, a
        time per output token of 0 (vLLM's for fewer than two), and a success with finished_reason stop."""
        m = out.metrics
        self.count_finished("stop")
        if m is None:
            return
        self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        self.e2e_latency.observe(time.monotonic() - m.arrival_time)
        self.observe_finished(m, len(out.prompt_token_ids), [0])
        self.time_per_output_token.observe(0.0)

    def count_finished(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self._request_success.labels(self.model_name, reason).inc(n)

    def count_rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def collect(self):
        s = self.async_llm.engine.stats()
        for kind, name, doc, key in _ENGINE_SERIES:
            if key not in s:  # a counter of a feature that is off
                continue
            family = kind(f"nanoserve:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], s[key])
            yield family
        if "spec_decode_num_accepted_tokens_per_pos" in s:  # vLLM's: one series a draft position, 0 to k - 1
            family = CounterMetricFamily("nanoserve:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position", labels=["model_name", "position"])
            for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                family.add_metric([self.model_name, str(pos)], n)
            yield family


class _Renamed:
    """A registry's series under another prefix (the same values, read at the same scrape)."""

    def __init__(self, registry: CollectorRegistry, old: str, new: str):
        self.registry, self.old, self.new = registry, old, new

    def collect(self):
        for m in self.registry.collect():
            copy = Metric(m.name.replace(self.old, self.new, 1), m.documentation, m.type, m.unit)
            copy.samples = [s._replace(name=s.name.replace(self.old, self.new, 1)) for s in m.samples]
            yield copy


async def log_stats_periodically(state: ServerState, interval: float) -> None:
    """vLLM's periodic line: throughput, queues, KV usage, prefix hit rate, while busy; and with drafts in
    the interval, vLLM's spec-decode line after it."""
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
        if line := spec_decode_line(last, s, dt):
            logger.info("[entry] %s", line)
        last, last_time = s, now


def spec_decode_line(last: dict[str, Any], s: dict[str, Any], dt: float) -> str | None:
    """vLLM's SpecDecoding line over the interval from stats ``last`` to ``s`` (``dt`` seconds); None
    without drafts in it. As vLLM's: the mean acceptance length counts the bonus token (1 + accepted /
    drafts), and a position's rate is the drafts that had their token there accepted / all drafts."""
    if "spec_decode_num_drafts" not in s:
        return None
    drafts, drafted, accepted = (s[k] - last[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                          "spec_decode_num_accepted_tokens"))
    if not drafts:
        return None
    per_pos = [(n - m) / drafts for n, m in zip(s["spec_decode_num_accepted_tokens_per_pos"],
                                                last["spec_decode_num_accepted_tokens_per_pos"])]
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted throughput: "
            f"{accepted / dt:.2f} tokens/s, Drafted throughput: {drafted / dt:.2f} tokens/s, Accepted: {accepted} "
            f"tokens, Drafted: {drafted} tokens, Per-position acceptance rate: "
            f"{', '.join(f'{r:.3f}' for r in per_pos)}, Avg Draft acceptance rate: {100 * accepted / drafted:.1f}%")


# =========================================================================== start-up and shutdown

def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The flags named as EngineConfig's fields, and --compilation-config, read as LLM()'s keywords are
    (engine_config_from_kwargs). No flag sets skip_tokenizer_init: the server always has a tokenizer."""
    flags = {k: v for k, v in vars(args).items() if k in EngineConfig.__dataclass_fields__ and k != "model"}
    return engine_config_from_kwargs(args.model, {**flags, "compilation_config": args.compilation_config})


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def banner(engine: LLMEngine, args: argparse.Namespace, url: str) -> str:
    """The start-up summary: what is served, on what, with how much KV cache."""
    info = engine.describe()
    blocks, block_size, max_len = info.num_kv_blocks, info.block_size, info.max_model_len
    names = ", ".join(args.served_model_name)
    return "\n".join([
        f"nanoserve {__version__}: serving {args.model} as {names!r}",
        f"  model        {info.architecture}, {info.dtype} on {info.device}, weights {_fmt_bytes(info.weight_bytes)}",
        f"  KV cache     {blocks} blocks x {block_size} tokens = {blocks * block_size} tokens "
        f"({_fmt_bytes(info.kv_bytes_per_block)} per block, {_fmt_bytes(blocks * info.kv_bytes_per_block)})",
        f"  concurrency  {blocks / info.blocks_per_request:.2f}x at max-model-len {max_len} "
        f"(max-num-seqs {engine.config.max_num_seqs}, prefix caching {'on' if args.enable_prefix_caching else 'off'})",
        f"  URL          {url}  (OpenAI API under {url}/v1{', API key required' if args.api_key else ''}"
        f"{'; listening on all interfaces' if args.host in ('0.0.0.0', '::') and not args.uds else ''})",
    ])


def bind_socket(host: str, port: int, uds: str | None = None) -> socket.socket:
    """Bind before loading the model: a busy port fails fast, and port 0 is
    resolved in time for the banner. ``uds``: a Unix socket instead (vLLM's --uds)."""
    if uds is not None and Path(uds).is_socket():  # a previous run's, unless a server still answers on it
        with socket.socket(socket.AF_UNIX) as probe:
            if probe.connect_ex(uds) == 0:
                raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        os.unlink(uds)
    family = socket.AF_UNIX if uds is not None else socket.AF_INET6 if ":" in host else socket.AF_INET
    # TCP named as the protocol: asyncio turns Nagle off (TCP_NODELAY) only on connections whose socket says
    # IPPROTO_TCP, and with it on, a response's body (or an SSE event) written after its headers waited for
    # the client's delayed ACK, ~40 ms an answer
    sock = socket.socket(family, socket.SOCK_STREAM, 0 if uds is not None else socket.IPPROTO_TCP)
    if uds is None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(uds or (host, port))
    except OSError:
        sock.close()
        raise
    return sock


def configure_logging(level: str, uvicorn_level: str | None = None, quiet_paths: Iterable[str] = ()) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # other libraries stay quiet
    logging.getLogger("nanoserve").setLevel(level.upper())
    logging.getLogger("uvicorn").setLevel(uvicorn.config.LOG_LEVELS[uvicorn_level or level])  # trace: 5
    logging.getLogger("uvicorn.error").addFilter(_cancellations_in_one_line)
    quiet = frozenset(quiet_paths)
    logging.getLogger("uvicorn.access").filters[:] = [functools.partial(_not_quiet, quiet)] if quiet else []


@contextlib.contextmanager
def _unlogged(name: str) -> Iterator[None]:
    """Logger ``name`` drops its records meanwhile."""
    log = logging.getLogger(name)
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


def _not_quiet(quiet: frozenset[str], record: logging.LogRecord) -> bool:
    """--disable-access-log-for-endpoints; uvicorn's access record is (client, method, path?query, version, status)."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) > 2 and str(args[2]).partition("?")[0] in quiet)


def _cancellations_in_one_line(record: logging.LogRecord) -> bool:
    """A request cut off by a forced exit (a second Ctrl-C) gets one line, not
    its CancelledError's traceback; so does the lifespan that uvicorn cancels."""
    exc = record.exc_info[1] if record.exc_info else None
    message = record.getMessage()
    if isinstance(exc, asyncio.CancelledError) or (
            message.startswith("Traceback") and message.rstrip().endswith("CancelledError")):
        record.msg, record.args, record.exc_info, record.exc_text = (
            "[entry] forced exit: a second signal cut the shutdown short", (), None, None)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


class H11WithTimeouts(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for each request's headers
    (HEADER_TIMEOUT_S): else a client that connects and sends nothing, or
    trickles its headers (slowloris), holds its connection for ever. uvicorn
    times out only the idle keep-alive between requests. A request h11 cannot
    parse gets its 400, and one over the connection limit its 503, in OpenAI's
    error shape, as every other error (uvicorn's own are plain text)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's check, moved into the app (self.app) so that its 503 can be JSON
        self.limit, self.limit_concurrency, self.inner_app, self.app = \
            self.limit_concurrency, None, self.app, self._app_or_503

    async def _app_or_503(self, scope, receive, send) -> None:
        # uvicorn's test, made as the request's task starts: that task counts among the tasks
        if self.limit is not None and (len(self.connections) >= self.limit or len(self.tasks) > self.limit):
            # EntryMiddleware answers it (_reject: counted, logged, with its X-Request-Id)
            scope["nanoserve.refused"] = ApiError(
                503, f"the server is serving its limit of {self.limit} connections: retry later",
                headers={"Connection": "close"})  # as uvicorn's: this connection frees its place
        await self.inner_app(scope, receive, send)

    def send_400_response(self, msg: str) -> None:
        body = dumps(bad_request(f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}): check its request "
                                 f"line, headers, Content-Length and chunked framing").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._headers_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._headers_timer is None and self._between_requests():  # a keep-alive's next request
            self._headers_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_timed_out)
        super().data_received(data)
        if self._headers_timer is not None and not self._between_requests():  # its headers are in
            self._headers_timer.cancel()
            self._headers_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _headers_timed_out(self) -> None:
        self._headers_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


def connection_limit() -> int:
    """Connections (and requests) served at once; beyond it uvicorn answers 503.
    It stays under the open-file limit, so accepting never fails for want of one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 4096 if soft == resource.RLIM_INFINITY else max(16, min(4096, soft - 128))


class Server(uvicorn.Server):
    """uvicorn, with nanoserve's shutdown: a SIGINT/SIGTERM is not re-raised
    after the drain (a graceful shutdown exits 0); at ``drain_timeout`` what is
    still in flight ends with an error (a stream: an error event and [DONE])
    before uvicorn would cancel it; the app may ask it to stop (a dead engine)."""

    def __init__(self, app: Starlette, args: argparse.Namespace):
        super().__init__(uvicorn.Config(
            app, host=args.host, port=args.port, log_config=None, lifespan="on", http=H11WithTimeouts,
            timeout_graceful_shutdown=args.shutdown_timeout + DRAIN_GRACE_S,
            timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S, limit_concurrency=connection_limit(),
            access_log=not args.disable_uvicorn_access_log, ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers))
        self.state: ServerState = app.state.server
        self.state.request_shutdown = self.request_exit
        self.drain_timeout = args.shutdown_timeout

    def request_exit(self) -> None:
        self.should_exit = True

    @property
    def exit_code(self) -> int:
        return 1 if self.force_exit or self.state.exit_code else 0

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
                        signal.Signals(sig).name, self.drain_timeout)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.state.end_all,
                                                      "the server is shutting down")
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.uvicorn_log_level, args.disable_access_log_for_endpoints)
    for note in args.vllm_notes:
        logger.warning("[entry] %s", note)
    if args.api_key is not None:  # which source, never the key
        logger.info("[entry] an API key (from %s) is required on /v1/*", args.api_key_from)
    config = engine_config(args)
    if 0 not in local_ranks(config):  # a node of a tensor-parallel group that only computes
        try:
            return run_worker_node(config)
        except Exception as e:  # noqa: BLE001 - a bad configuration: one line, as below
            print(f"error: cannot run node {args.node_rank} of {args.model}: {e}", file=sys.stderr)
            return 1
    try:
        sock = bind_socket(args.host, args.port, args.uds)
    except OSError as e:
        print(f"error: cannot listen on {args.uds or f'{args.host}:{args.port}'}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    executor = model_thread()  # every torch op of the engine runs here, its loading included
    try:
        engine = executor.submit(start_engine, config, args.lora_modules).result()
    except Exception as e:  # a clear line, not a traceback (which --log-level debug still shows)
        logger.debug("[entry] start-up failed", exc_info=True)
        print(f"error: cannot serve {args.model}: {e}", file=sys.stderr)
        sock.close()
        executor.shutdown()
        return 1
    server = Server(build_app(AsyncLLM(engine, executor), args), args)
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host, args.host)  # all interfaces: this machine's URL
    host = f"[{shown}]" if ":" in shown else shown
    url = f"unix:{args.uds}" if args.uds else \
        f"{'https' if args.ssl_certfile else 'http'}://{host}:{sock.getsockname()[1]}"
    sock.listen()  # the banner's URL takes connections (they wait for uvicorn's start-up, not refused)
    print(banner(engine, args, url), flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        engine.shutdown()  # the tensor-parallel workers, if any
    code = server.exit_code
    logger.info("[entry] shut down%s", f" (exit status {code})" if code else "")
    return code


def main(argv: list[str] | None = None) -> int:
    return serve(parse_args(argv))
