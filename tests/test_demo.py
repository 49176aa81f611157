"""The newcomer's path: the embedded demo model and the README's commands, as
written, against a live server."""
from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "nanoserve" / "demo_model"


def readme_bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_two_commands_and_ci_runs_the_second():
    first, second = [b.strip() for b in readme_bash_blocks()[:2]]
    assert first.endswith("python -m nanoserve") and "pip install" in first
    assert second.endswith("python -m pytest") and "pip install" in second
    ci = (ROOT / ".ci" / "run").read_text()
    assert second in ci.splitlines()


def test_demo_model_is_small_and_transformers_greedy_equals_nanoserve():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from nanoserve import LLM, SamplingParams
    assert sum(f.stat().st_size for f in DEMO.iterdir()) < 25 * 2**20
    tok = AutoTokenizer.from_pretrained(DEMO)
    hf = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    llm = LLM(str(DEMO), dtype="float32", num_kv_blocks=64, max_model_len=512)
    for prompt in ["import os\n", "def "]:
        ids = tok.encode(prompt)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(ids):]
        got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=24), use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.tolist()
        assert got.outputs[0].text.strip()  # recognisable text, not nothing


def _launch_demo_server(port: int) -> subprocess.Popen:
    """The README's server command as written (minus the set-up already done
    here), with no --model: the demo model. Only the port is chosen, to stay free."""
    command = readme_bash_blocks()[0].strip().split("&&")[-1].split()
    assert command == ["python", "-m", "nanoserve"]
    return subprocess.Popen([sys.executable, *command[1:], "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _wait_until_healthy(proc: subprocess.Popen, port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "demo server did not start"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def launched():
    """The module's two demo servers (the Ctrl-C test's and demo_server), started at once: each spends its
    start-up importing and compiling on one core while this process waits, so side by side they take the
    cores together. [(proc, port)]; any still running at the end is killed."""
    with socket.socket() as a, socket.socket() as b:  # two distinct free ports
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = [a.getsockname()[1], b.getsockname()[1]]
    servers = [(_launch_demo_server(port), port) for port in ports]
    yield servers
    for proc, _ in servers:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def demo_server(launched):
    proc, port = launched[1]
    _wait_until_healthy(proc, port)
    yield port
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0


def test_a_second_ctrl_c_exits_at_once_without_a_traceback(launched):
    """Ctrl-C twice: uvicorn cuts the graceful shutdown short, the log says so
    in one line instead of the cancelled lifespan's traceback, and the exit
    status says it was not a clean shutdown."""
    proc, port = launched[0]
    _wait_until_healthy(proc, port)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert "Traceback" not in out and "[entry] shut down (exit status 1)" in out


def test_no_arguments_streams_from_the_demo_model(demo_server):
    body = {"prompt": "import os\n", "max_tokens": 16, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"http://127.0.0.1:{demo_server}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text.strip() and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_example_works_as_written(demo_server):
    curl = next(b for b in readme_bash_blocks() if b.lstrip().startswith("curl"))
    out = subprocess.run(["bash", "-c", curl.replace("127.0.0.1:8000", f"127.0.0.1:{demo_server}")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "data: " in out.stdout and out.stdout.rstrip().endswith("data: [DONE]")


def test_the_readme_s_logits_processor_example_runs_as_written(monkeypatch, capsys):
    """The custom logits processor in the README, run from the repository root as its path says."""
    block, = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
              if "class OnlyToken(LogitsProcessor)" in b]
    monkeypatch.chdir(ROOT)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme_example"})
    assert capsys.readouterr().out.strip() == "[42, 42, 42, 42]"
