"""A Hugging Face hub id (``org/name``), as ``vllm serve`` takes one, is found in
the local Hugging Face cache with nothing downloaded (a cache laid out here, as
huggingface_hub lays one out, and HF_HUB_OFFLINE set)."""
from __future__ import annotations

import importlib
import shutil

import pytest

from conftest import make_model
from nanoserve import LLM, SamplingParams


def lay_cache(cache, model_root):
    """models--org--tiny/snapshots/<hash>/ holding the tiny model, refs/main naming it."""
    repo = cache / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(make_model(model_root, "qwen3"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture
def hub_cache(model_root, tmp_path, monkeypatch):
    snapshot = lay_cache(tmp_path / "hub", model_root)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    importlib.reload(huggingface_hub.constants)  # it reads the environment at import
    yield snapshot
    monkeypatch.undo()
    importlib.reload(huggingface_hub.constants)


def test_a_hub_id_in_the_local_cache_serves_offline(hub_cache):
    llm = LLM("org/tiny", dtype="float32", max_model_len=64, num_kv_blocks=16, enforce_eager=True)
    assert llm.engine.config.model == "org/tiny"
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_hub_id_not_in_the_cache_offline_is_one_clear_error(hub_cache):
    with pytest.raises(ValueError, match="'org/missing' is not a directory and not in the local Hugging Face "
                                         "cache .* HF_HUB_OFFLINE is set"):
        LLM("org/missing", dtype="float32", enforce_eager=True)


def test_download_dir_is_the_cache_a_hub_id_is_found_in(hub_cache, model_root, tmp_path):
    """vLLM's --download-dir (LLM's download_dir): a cache of its own, not $HF_HUB_CACHE."""
    from nanoserve.entry import engine_config, parse_args
    elsewhere = tmp_path / "models"
    lay_cache(elsewhere, model_root)
    shutil.rmtree(hub_cache.parent.parent)  # the default cache no longer has it
    config = engine_config(parse_args(["org/tiny", "--download-dir", str(elsewhere)]))
    assert config.download_dir == str(elsewhere)
    llm = LLM("org/tiny", dtype="float32", max_model_len=64, num_kv_blocks=16, enforce_eager=True,
              download_dir=str(elsewhere))
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=f"not in the local Hugging Face cache \\({tmp_path / 'empty'}\\)"):
        LLM("org/tiny", dtype="float32", enforce_eager=True, download_dir=str(tmp_path / "empty"))


def test_a_hub_id_under_tensor_parallelism(hub_cache):
    """As `vllm serve org/name -tp 2`: the worker ranks load the cached directory rank 0 found (they were
    handed the hub id itself, no directory, and died at start-up)."""
    llm = LLM("org/tiny", dtype="float32", max_model_len=64, num_kv_blocks=16, enforce_eager=True,
              tensor_parallel_size=2)
    try:
        one = LLM(str(hub_cache), dtype="float32", max_model_len=64, num_kv_blocks=16, enforce_eager=True)
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        tp, single = (x.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids for x in (llm, one))
        assert tp == single and len(tp) == 3
    finally:
        llm.shutdown()
