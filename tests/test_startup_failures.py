"""Start-up failures of ``python -m nanoserve`` (issue 6): each is one line that
says what is wrong and what to change, a non-zero exit, and no traceback. Each
runs the CLI in a subprocess, as a user would; they fail before the server
listens, so each takes about the time of an import, and they run side by side."""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.engine import LLMEngine
from nanoserve.entry import engine_config, parse_args

pytestmark = pytest.mark.timeout(300)  # the first test waits for all of the module's CLI runs


def one_line_error(out: subprocess.CompletedProcess) -> str:
    """Check a CLI run's exit and the absence of a traceback; return its one error line."""
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    assert "URL" not in out.stdout  # no banner: it never served
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr
    return errors[0]


def edited_config(src: Path, out: Path, **changes) -> Path:
    """A copy of the model at ``src`` whose config.json has ``changes``."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def kv_flags(model: Path) -> list[str]:
    # --enforce-eager: the fresh process reaches the KV cache check without compiling the decode attention (~4 s)
    return ["--model", str(model), "--port", "0", "--dtype", "float32", "--enforce-eager"]


@pytest.fixture(scope="module")
def cli(tiny_model, tmp_path_factory):
    """Every CLI run of this module, started at once and read to its exit: each is a fresh process that spends
    its time importing, on one core, while this one waits; side by side they take the cores together.
    {case: (the run, what its test needs to name)}."""
    tmp = tmp_path_factory.mktemp("startup")
    missing = tmp / "no-such-model"
    gpt2 = edited_config(tiny_model, tmp / "gpt2-ish", architectures=["GPT2LMHeadModel"])
    bnb = edited_config(tiny_model, tmp / "bnb-ish",
                        quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    model = ["--model", str(tiny_model), "--port", "0"]
    with socket.socket() as busy:  # held until every run has exited
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = {"missing": (["--model", str(missing), "--port", "0"], missing),
                 "gpt2": (["--model", str(gpt2), "--port", "0"], gpt2),
                 # float32: 16 KiB a block of 16 tokens, so 64 KiB buys 4 blocks, 64 tokens
                 "kv": ([*kv_flags(tiny_model), "--kv-cache-memory-bytes", "64KiB", "--max-model-len", "256"], None),
                 "port": (["--model", str(tiny_model), "--host", "127.0.0.1", "--port", str(port)], port),
                 "memory": ([*model, "--kv-cache-memory-bytes", "1024TiB"], None),
                 "bnb": (["--model", str(bnb), "--port", "0"], bnb)}
        procs = {case: subprocess.Popen([sys.executable, "-m", "nanoserve", *flags, "--disable-log-stats"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for case, (flags, _) in cases.items()}
        runs = {}
        for case, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=240)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            runs[case] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), cases[case][1])
    return runs


def test_no_such_model_directory(cli):
    run, missing = cli["missing"]
    err = one_line_error(run)
    assert f"model directory '{missing}' does not exist" in err and "--model DIR" in err


def test_unsupported_architecture(cli):
    run, model = cli["gpt2"]
    err = one_line_error(run)
    assert "unsupported architecture 'GPT2LMHeadModel'" in err
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM"):
        assert arch in err


def test_kv_cache_too_small_for_max_model_len_suggests_values_that_fit(tiny_model, cli):
    err = one_line_error(cli["kv"][0])
    assert "KV cache too small: 4 blocks hold 64 tokens" in err and "max_model_len=256 needs 16 blocks" in err
    m = re.search(r"Lower --max-model-len to at most (\d+), or raise --kv-cache-memory-bytes to at least (\d+) "
                  r"\(or --num-kv-blocks to at least (\d+)\)", err)
    assert m, err
    max_len, budget, blocks = m.groups()
    # each suggestion, taken alone, starts (in-process: the failure above was the subprocess's)
    for fix in (["--kv-cache-memory-bytes", "64KiB", "--max-model-len", max_len],
                ["--kv-cache-memory-bytes", budget, "--max-model-len", "256"],
                ["--num-kv-blocks", blocks, "--max-model-len", "256"]):
        engine = LLMEngine(engine_config(parse_args([*kv_flags(tiny_model), *fix])))
        assert engine.max_model_len == int(fix[-1]), fix


def test_port_already_in_use(cli):
    run, port = cli["port"]
    err = one_line_error(run)
    assert err == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_more_memory_than_the_machine_has(tiny_model, cli):
    err = one_line_error(cli["memory"][0])
    assert err.startswith(f"error: cannot serve {tiny_model}: not enough memory: the weights need ")
    assert "the KV cache 1048576.00 GiB" in err and "GiB available" in err
    assert "a smaller --kv-cache-memory-bytes" in err


def test_a_quantized_checkpoint_is_refused_by_name(cli):
    """Not "unexpected tensor ...qweight" from deep in the loader: its config says what it is. (FP8, which
    nanoserve serves dequantized: tests/test_fp8.py; GPTQ, AWQ, compressed-tensors: tests/test_wna16.py.)"""
    run, model = cli["bnb"]
    err = one_line_error(run)
    assert err == (f"error: cannot serve {model}: the checkpoint is quantized with quant_method 'bitsandbytes', "
                   "which nanoserve does not serve: it serves unquantized checkpoints (bf16, fp16 or fp32 "
                   "safetensors), FP8 ones (quant_method 'fp8', block or per-tensor), int4/int8 weight-only ones "
                   "(quant_method 'gptq', 'awq' or 'compressed-tensors'), and gpt-oss's MXFP4 experts")


@pytest.mark.parametrize("flags", [
    ["--max-model-len", "9" * 400], ["--kv-cache-memory-bytes", "9" * 400],  # OverflowError: float inf to int
    ["--max-cudagraph-capture-size=--"],  # Python 3.11's argparse: [], then TypeError comparing it
    ["--hf-overrides", "[" * 5000],  # RecursionError from json
    ["--chat-template", "9" * 400], ["--chat-template", "~no-such-user-x/t.jinja"],  # OSError, RuntimeError
    ["--host", "\udcff"], ["--host", "x\x00"],  # TypeError as the socket was bound, after parse_args
    ["--ssl-certfile", "x\x00"],  # ValueError from ssl (argv from Python only: a process's cannot hold NUL)
], ids=["max-model-len", "kv-cache-memory-bytes", "dashes", "hf-overrides", "template-name", "template-home",
        "host-surrogate", "host-nul", "certfile-nul"])
def test_flag_values_refused_in_one_line(tiny_model, flags, capsys):
    """Found by tests/test_offline_fuzz.py's CLI fuzz: each was a traceback."""
    with pytest.raises(SystemExit) as e:
        parse_args([str(tiny_model), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("python -m nanoserve: error: "), err
