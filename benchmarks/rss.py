"""The demo server's resident memory (issue 23 item 8): at start, over thousands of
requests of varied lengths, after one big transient request, and idle after it.

    python benchmarks/rss.py [--requests 2000] [--no-trim-off] [-- extra server flags]

Starts `python -m nanoserve` (the packaged demo model, default flags unless given
after `--`) and reads the server's VmRSS from /proc. `--no-trim-off` starts it with
cpu_backend.tune_process patched out, so glibc's malloc keeps its default trimming (and
oneDNN its default caches);
`--no-pack` without oneDNN-packed linear weights; `--fixed` sends one small request
over and over (one step shape). Runs side by side say what each costs in memory. Prints one JSON
record."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time

import httpx

LAUNCH = """
import sys
import nanoserve.cpu_backend
if "no-trim-off" in sys.argv[1]:  # none of the process-wide settings, as --no-cpu-allocator-tuning
    nanoserve.cpu_backend.tune_process = lambda: []
if "no-pack" in sys.argv[1]:
    nanoserve.cpu_backend.can_pack_linear_weights = lambda dtype, device: False
if "trim-every-2s" in sys.argv[1]:  # does free memory stay mapped? glibc's malloc_trim returns it
    import ctypes, threading, time
    def trim():
        while True:
            time.sleep(2)
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    threading.Thread(target=trim, daemon=True).start()
from nanoserve.entry import main
sys.exit(main(sys.argv[2:]))
"""


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(url: str, n: int, seed: int, concurrency: int, fixed: bool) -> None:
    rng = random.Random(seed)
    words = "def main return import os sys print the quick brown fox class self value".split()
    if fixed:  # one shape: what grows now grows per request, not per new step size
        bodies = [{"prompt": "def main(): return 0", "max_tokens": 16, "temperature": 0}] * n
    else:
        bodies = [{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(1, 300))),
                   "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.8])} for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async def one(body):
            async with sem:
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
        await asyncio.gather(*(one(b) for b in bodies))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--no-trim-off", action="store_true", help="no cpu_backend.tune_process (glibc trims)")
    p.add_argument("--no-pack", action="store_true", help="no oneDNN-packed linear weights")
    p.add_argument("--trim-every-2s", action="store_true", help="call glibc's malloc_trim(0) every 2 s")
    p.add_argument("--fixed", action="store_true", help="the same small request every time, one at a time")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("server_flags", nargs="*")
    args = p.parse_args()
    port = free_port()
    mode = "+".join(m for m, on in (("no-trim-off", args.no_trim_off), ("no-pack", args.no_pack),
                                        ("trim-every-2s", args.trim_every_2s)) if on) or "as-is"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, mode, "--port", str(port), "--disable-log-stats",
                             "--disable-uvicorn-access-log", *args.server_flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        banner = []
        for line in proc.stdout:
            banner.append(line.rstrip())
            if line.strip().startswith("URL"):
                break
        start_s = time.monotonic() - t0
        rec = {"mode": mode, "fixed": args.fixed, "flags": args.server_flags, "start_s": round(start_s, 1),
               "banner_kv": next((b.strip() for b in banner if "KV cache" in b), None)}
        rec["rss_start_mib"] = round(rss_mib(proc.pid))
        samples = []
        step = max(1, args.requests // 4)
        for i in range(0, args.requests, step):
            asyncio.run(load(url, min(step, args.requests - i), i, 1 if args.fixed else args.concurrency, args.fixed))
            samples.append((i + step, round(rss_mib(proc.pid))))
        rec["rss_after_requests_mib"] = samples
        # one big transient request: 64 prompts near max_model_len at once
        big = {"prompt": [" ".join(["the quick brown fox"] * 100)] * 64, "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=big, timeout=600).status_code == 200
        rec["rss_after_big_mib"] = round(rss_mib(proc.pid))
        time.sleep(2)
        rec["rss_idle_after_big_mib"] = round(rss_mib(proc.pid))
        first, last = samples[0], samples[-1]
        rec["creep_kib_per_request"] = round((last[1] - first[1]) * 1024 / max(1, last[0] - first[0]), 1)
        print(json.dumps(rec))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
