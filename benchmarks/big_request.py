"""How long /health waits while the server takes one huge request (issue 23 item 1),
and what the request costs in RSS.

    python benchmarks/big_request.py [--nanoserve-dir DIR] [--repeat N]

Starts the demo server (from DIR's nanoserve package if given: an older checkout,
for a before/after), sends a ~15 MB text prompt, then a ~15 MB body of token ids,
from a process of its own (a sending thread beside the poller would hold this
process's GIL: its waits would count as the server's), and polls /health every
10 ms meanwhile. Prints one JSON record per request."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

SEND = """
import json, sys, time, httpx
body = open(sys.argv[2], "rb").read()
t0 = time.monotonic()
r = httpx.post(sys.argv[1], content=body, timeout=600, headers={"Content-Type": "application/json"})
print(json.dumps(dict(status=r.status_code, seconds=round(time.monotonic() - t0, 2),
                      message=r.json().get("error", {}).get("message", "")[:100])))
"""


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nanoserve-dir", default=None)
    p.add_argument("--repeat", type=int, default=1, help="send each body this many times (for medians)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    if args.nanoserve_dir:
        env["PYTHONPATH"] = args.nanoserve_dir
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "--port", str(port), "--disable-log-stats",
                             "--disable-uvicorn-access-log"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env,
                            cwd=args.nanoserve_dir)  # -m puts the cwd first on sys.path
    url = f"http://127.0.0.1:{port}"
    try:
        for line in proc.stdout:
            if line.strip().startswith("URL"):
                break
        bodies = {"text_15MB": json.dumps({"prompt": "hello world " * 1_250_000, "max_tokens": 1}),
                  "token_ids_15MB": json.dumps({"prompt": [1] * 5_000_000, "max_tokens": 1})}
        for name, body in [item for item in bodies.items() for _ in range(args.repeat)]:
            before = rss_mib(proc.pid)
            with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
                f.write(body)
                f.flush()
                sender = subprocess.Popen([sys.executable, "-c", SEND, url + "/v1/completions", f.name],
                                          stdout=subprocess.PIPE, text=True)
                worst = 0.0
                while sender.poll() is None:
                    t0 = time.monotonic()
                    assert httpx.get(url + "/health", timeout=600).status_code == 200
                    worst = max(worst, time.monotonic() - t0)
                    time.sleep(0.01)
                result = json.loads(sender.stdout.read())
            time.sleep(1)
            print(json.dumps({"request": name, "body_MB": round(len(body) / 1e6, 1), **result,
                              "health_worst_ms": round(worst * 1000, 1), "rss_before_mib": round(before),
                              "rss_after_mib": round(rss_mib(proc.pid))}), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
