"""The entry layer's command line: ``python -m nanoserve``'s flags, with ``vllm
serve``'s names (as vLLM keeps them in ``entrypoints/openai/cli_args.py``).
``entry.main`` parses them and serves."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 16 * 2**20


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
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                        "(default: $NANOSERVE_API_KEY, or no key)")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 429 while this many engine requests (prompts x n) wait for the "
                        "scheduler (default: no limit)")
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
