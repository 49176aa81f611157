"""benchmarks/gpu.py, the GPU check that runs only on a lent device machine:
here its parity part runs on the CPU with tiny shapes, one part goes through
the worker protocol (a fresh process that writes its result), and the JSON and
the RESULTS.md section are written from made-up results, so that the script
cannot rot between the rare calls that run it for real. No timing is asserted."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu  # noqa: E402
from conftest import TRITON_INTERPRETER_CLASH  # noqa: E402

HEADLINE = ("date", "gpu", "torch", "commit", "w1_warm_s", "w1_cold_s", "w1_eager_s", "hf_cb_graph_s",
            "decode_step_ms_b64")


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-work")
    models = gpu.part_models(gpu.DRY, dict(work=str(work)), archs=("qwen3", "mistral-sw"), w1=False)
    return dict(work=str(work), models=models)


def test_parity_part_on_the_cpu(spec, tmp_path):
    """transformers' greedy tokens, under preemption and chunking (eager: the
    padded CPU path compiles, which is test_decode_graphs' business). After each
    architecture the part leaves what it checked, which a timeout would otherwise lose."""
    partial = tmp_path / "parity.json"
    res = gpu.part_parity(gpu.DRY, dict(spec, result=str(partial)), archs=("qwen3", "mistral-sw"),
                          configs=["preempt-eager", "chunked-eager"])
    left = json.loads(partial.read_text())
    assert left["error"] == "timed out after 2 of 2 architectures" and left["archs"] == res["archs"]
    for arch in ("qwen3", "mistral-sw"):  # the windowed pool is sized apart: its requests preempt too
        assert res["archs"][arch]["preempt-eager"]["preemptions"] > 0, res["archs"][arch]
    assert res["ok"], res["archs"]
    assert res["summary"] == "4/4 configs equal"


def test_a_part_runs_in_a_fresh_process(tmp_path):
    run = gpu.Run(out=tmp_path / "out", work=tmp_path, scale=gpu.DRY, dry_run=True, budget_s=120)
    res = gpu.run_part(run, "env")
    assert res["ok"], res
    assert res["device"] == "cpu" and res["torch"]
    assert res["triton_launch"] == "ok" or TRITON_INTERPRETER_CLASH  # a Triton kernel ran (interpreted here)


def test_match_rate():
    assert gpu.match_rate([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == dict(
        requests_identical="1/2", tokens_before_first_difference="4/5", rate=0.8)
    assert gpu.match_rate(None, [[1]]) is None


def fake_record() -> dict:
    by_batch = {"1": dict(graph_ms=4.1, eager_ms=20.0), "64": dict(graph_ms=2.4, eager_ms=22.0),
                "256": dict(graph_ms=None, graph_note="no CUDA graph of size 256", eager_ms=23.0)}
    ms = dict(schedule=0.1, build_inputs=0.05, buffer_copy=0.2, forward=2.5, forward_eager=22.0, prepare=0.6,
              logits=0.1, sampler=0.2, postprocess=0.1)
    level = dict(completed=16, num_requests=16, failed=0, output_throughput=210.0,
                 ttft_ms=dict(p50=12.0, p99=20.0), itl_ms=dict(p50=4.5, p99=6.0), tpot_ms=dict(p50=4.6))
    return dict(date="2026-12-05 10:00 UTC", commit="abc1234", dry_run=False, parts=dict(
        env=dict(ok=True, gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", transformers="5.17.0"),
        w1_graphs=dict(ok=True, warm_s=1.1, cold_s=2.9, startup_s=30.0, graphs=35, warm_digest="aa",
                       warm_output_tok_s=8000.0),
        w1_eager=dict(ok=True, warm_s=7.0, cold_s=9.0, startup_s=10.0, warm_digest="bb"),
        w1_async=dict(ok=True, warm_s=1.0, cold_s=2.0, startup_s=20.0, warm_digest="aa"),
        breakdown=dict(ok=True, decode_step_ms_b64=2.4, fixed_context=dict(context=400, by_batch=by_batch),
                       per_step=dict(batch=64, steps=100, context_first=351, context_last=450, ms=ms, host_ms=0.45),
                       plain_step_ms=dict(mean=3.5)),
        parity=dict(ok=False, summary="23/24 configs equal"),
        hf_cb=dict(ok=False, error="RuntimeError: boom"),
        serve=dict(ok=True, levels={"c=1": level, "c=64": dict(level, completed=64, num_requests=64)})),
        graphs_eager_match=dict(requests_identical="60/64", tokens_before_first_difference="8000/8859", rate=0.9))


def test_json_and_markdown_from_made_up_results(tmp_path):
    run = gpu.Run(out=tmp_path / "out", work=tmp_path / "work", scale=gpu.GPU, dry_run=False, budget_s=450)
    gpu.save(run, fake_record())
    data = json.loads((tmp_path / "out" / "gpu-w1.json").read_text())
    assert all(k in data for k in HEADLINE)
    assert data["w1_warm_s"] == 1.1 and data["decode_step_ms_b64"] == 2.4 and data["hf_cb_graph_s"] is None
    assert data["graphs_eager_same_tokens"] is False and data["gpu"] == "NVIDIA H200"
    assert data["w1_async_warm_s"] == 1.0 and data["async_graphs_same_tokens"] is True
    md = (tmp_path / "out" / "gpu-w1.md").read_text()
    assert md.startswith("## 2026-12-05 10:00 UTC: issue 22's GPU check on NVIDIA H200")
    assert "| W1 warm (second run in the process, CUDA graphs; prefix caching off in all W1 runs) | **1.10 s**" \
        in md
    assert "60/64" in md and "`hf_cb`: RuntimeError: boom" in md and "`parity`: a check failed" in md
    assert "online c=64 (64/64 requests)" in md
    assert "| W1 `async_scheduling=True` (CUDA graphs): warm / first | 1.00 s / 2.00 s, tokens identical" in md
    assert not (gpu.HERE / "results" / "gpu-w1.json").exists() or \
        json.loads((gpu.HERE / "results" / "gpu-w1.json").read_text())["commit"] != "abc1234"


def test_commit_without_git(tmp_path):
    """On the device machine .git does not travel: the commit comes from the file
    written at prepare time (RESULTS.md, "GPU check: how to run it")."""
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "COMMIT").write_text("0123abcd\n")
    assert gpu.commit_of(None, tmp_path) == "0123abcd"
    (tmp_path / ".whl" / "COMMIT").write_text("0123abcd\n M nanoserve/model.py\n")
    assert gpu.commit_of(None, tmp_path) == "0123abcd-dirty"
    assert gpu.commit_of("feed", tmp_path) == "feed"


def test_a_parity_mismatch_records_transformers_top2_gap(spec, monkeypatch):
    """Where nanoserve's greedy token differs, the JSON says how close transformers'
    top two logits were there: a near-tie (fp32 rounding) or a bug."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanoserve import LLM
    generate = LLM.generate

    def third_token_off(self, *args, **kwargs):
        outs = generate(self, *args, **kwargs)
        ids = outs[0].outputs[0].token_ids
        ids[2] = (ids[2] + 1) % 384
        return outs
    monkeypatch.setattr(LLM, "generate", third_token_off)
    res = gpu.part_parity(gpu.DRY, spec, archs=("qwen3",), configs=["plain-eager"])
    m = res["archs"]["qwen3"]["plain-eager"]["first_mismatch"]
    assert not res["ok"] and (m["prompt"], m["position"]) == (0, 2)
    prompt = torch.randint(1, 384, (gpu.DRY.parity_prompts[0],), generator=torch.Generator().manual_seed(5)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(spec["models"]["tiny"]["qwen3"], dtype=torch.float32).eval()
    with torch.no_grad():
        top2 = hf(torch.tensor([prompt + m["want"][:2]])).logits[0, -1].topk(2).values
    assert m["hf_top2_logit_gap"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-4) and m["hf_top2_logit_gap"] > 0


def test_cuda_tests_part_ignores_the_image_pytest_plugins(tmp_path, monkeypatch):
    """On the device, the carried pytest sits beside the image's own plugins
    (pytest-cov, xdist, ...), built for another pytest: one that breaks on import
    must not fail the part. Here a plugin that raises stands in for them (the
    CUDA tests themselves skip on the CPU). Nor may a file it collects import what the image lacks
    and .whl does not carry (openai: test_server's, which test_lora imported at first)."""
    (tmp_path / "broken_plugin.py").write_text("raise ImportError('built for another pytest')\n")
    (tmp_path / "openai").mkdir()
    (tmp_path / "openai" / "__init__.py").write_text("raise ImportError('not in the GPU image')\n")
    info = tmp_path / "broken_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nbroken = broken_plugin\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    res = gpu.part_cuda_tests(gpu.DRY, {})
    assert res["ok"] and res["skipped"] > 0, res


def test_a_worker_leaves_when_its_result_is_written(tmp_path):
    """A part that leaves a non-daemon thread running (transformers' generation
    loop after an error) must not hold its process, and the run's budget, until
    the part's timeout: the worker exits once its result is written."""
    import subprocess
    import textwrap
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(dict(scale=dataclasses.asdict(gpu.DRY), result=str(tmp_path / "result.json"))))
    script = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(gpu.HERE)!r})
        import gpu
        def part(scale, spec):
            threading.Thread(target=threading.Event().wait).start()  # never ends, no daemon
            raise RuntimeError("boom")
        gpu.WORKERS["stuck"] = part
        gpu.worker_main("stuck", gpu.Path({str(spec)!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert json.loads((tmp_path / "result.json").read_text())["error"] == "RuntimeError: boom"


def test_launch_syncs_counts_only_sync_warnings(spec, monkeypatch):
    """w1_async's launch check counts the launches during which torch's sync debug
    mode warned, not those that raised some other warning. (On the CPU the debug
    mode cannot be set: the launches raise both kinds themselves here.)"""
    import warnings

    import torch

    from nanoserve import LLM
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    llm = LLM(spec["models"]["tiny"]["qwen3"], dtype="float32", device="cpu", skip_tokenizer_init=True,
              enforce_eager=True, async_scheduling=True)
    launch, calls = llm.engine.runner.execute_model, []

    def warning_launch(seqs):
        calls.append(len(calls))
        warnings.warn("some deprecation, not a sync", UserWarning)
        if len(calls) % 3 == 0:
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
        return launch(seqs)
    llm.engine.runner.execute_model = warning_launch
    res = gpu._launch_syncs(llm, [[1 + i, 2, 3] for i in range(4)])
    assert res["launches"] == len(calls) > 3
    assert res["launches_that_synced"] == len(calls) // 3
    assert res["first"] == ["called a synchronizing CUDA operation"]
