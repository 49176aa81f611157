"""The pooling runner (embeddings) against transformers: a decoder's final-norm hidden state at the
last token (normalized), the mean of all of them, or the first's (CLS), through chunked prefill, prefix caching and
batching; a bare-decoder checkpoint (Qwen3Model) and a sentence-transformers one chosen by
--runner auto; /v1/embeddings' shapes (the openai SDK's base64 too) and its refusals."""
from __future__ import annotations

import base64
import json
import shutil

import httpx
import pytest
import torch

from conftest import hf_config, make_model
from nanoserve.engine import LLM, EngineConfig, InvalidInput, PoolingParams

PROMPTS = [list(range(5, 25)), [5, 6, 7], list(range(30, 41)), list(range(5, 21)) + [50, 51]]  # 0 and 3 share 16


def hf_hidden(path, prompt: list[int]) -> torch.Tensor:
    """transformers' final-norm hidden states of one prompt (AutoModel: the decoder without its head)."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def embeddings(outs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_last_token_normalized_chunked_batched_and_prefix_cached(model_root, arch):
    """vLLM's default pooler for a decoder: LAST, normalized. Prompts of 20 and 22 tokens are prefilled in
    chunks of 8 beside the others; the second round finds prompt 0's blocks cached and computes less."""
    path = make_model(model_root, arch)
    llm = LLM(str(path), runner="pooling", dtype="float32", max_num_batched_tokens=8, max_num_seqs=4,
              num_kv_blocks=32, block_size=8)
    first = llm.embed(PROMPTS, use_tqdm=False)
    again = llm.embed(PROMPTS[:1], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prefix cache served part of it
    for prompt, got in zip(PROMPTS + PROMPTS[:1], embeddings(first + [again])):
        want = torch.nn.functional.normalize(hf_hidden(path, prompt)[-1], dim=-1)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # no KV held past a request's last step


def test_mean_pooling_unnormalized_reads_no_cached_prefix(model_root):
    path = make_model(model_root, "qwen3")
    llm = LLM(str(path), task="embed", pooler_config={"pooling_type": "MEAN", "use_activation": False},
              dtype="float32", max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=32, block_size=8)
    outs = llm.embed(PROMPTS, use_tqdm=False) + llm.embed(PROMPTS[:1], use_tqdm=False)
    assert outs[-1].num_cached_tokens == 0  # every position's hidden state is needed
    for prompt, got in zip(PROMPTS + PROMPTS[:1], embeddings(outs)):
        torch.testing.assert_close(got, hf_hidden(path, prompt).mean(0), atol=2e-5, rtol=1e-4)
    # a request's own use_activation overrides the pooler config's
    got = embeddings(llm.embed([PROMPTS[1]], pooling_params=PoolingParams(use_activation=True), use_tqdm=False))[0]
    torch.testing.assert_close(got.norm(), torch.tensor(1.0))


def test_cls_pooling_is_the_first_token_s_through_chunks_and_reads_no_cached_prefix(model_root):
    """vLLM pools CLS on a decoder too: the first position's hidden state (causal: the first token's
    alone). Prompts of 20 and 22 tokens come in chunks of 8; the second round finds nothing cached."""
    path = make_model(model_root, "qwen3")
    llm = LLM(str(path), runner="pooling", pooler_config={"pooling_type": "cls"}, dtype="float32",
              max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=32, block_size=8)
    outs = llm.embed(PROMPTS, use_tqdm=False) + llm.embed(PROMPTS[:1], use_tqdm=False)
    assert outs[-1].num_cached_tokens == 0
    for prompt, got in zip(PROMPTS + PROMPTS[:1], embeddings(outs)):
        torch.testing.assert_close(got, torch.nn.functional.normalize(hf_hidden(path, prompt)[0], dim=-1))
    assert not torch.equal(embeddings(outs)[0], embeddings(outs)[2])  # prompts 0 and 2 start differently
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_bare_decoder_and_sentence_transformers_checkpoints_pick_pooling(model_root, tmp_path):
    """config.json's Qwen3Model (tensors without "model.", no lm_head) and a modules.json with a Pooling
    module both resolve --runner auto to pooling; the latter's pooling mode and Normalize are taken."""
    from transformers import AutoModel
    torch.manual_seed(0)
    bare = tmp_path / "bare"
    AutoModel.from_config(hf_config("qwen3"), dtype=torch.float32).save_pretrained(bare)
    for f in (make_model(model_root, "qwen3")).glob("tokenizer*"):
        shutil.copy(f, bare)
    assert json.loads((bare / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = LLM(str(bare), dtype="float32", num_kv_blocks=16)
    assert llm.engine.runner_type == "pooling"
    got = embeddings(llm.embed(PROMPTS[2], use_tqdm=False))[0]
    torch.testing.assert_close(got, torch.nn.functional.normalize(hf_hidden(bare, PROMPTS[2])[-1], dim=-1))
    with pytest.raises(ValueError, match="Qwen3Model, a decoder without its LM head"):
        LLM(str(bare), runner="generate", dtype="float32", num_kv_blocks=16)

    st = make_model(model_root, "llama")
    st_dir = tmp_path / "st"
    shutil.copytree(st, st_dir)
    (st_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (st_dir / "1_Pooling").mkdir()
    (st_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    llm = LLM(str(st_dir), dtype="float32", num_kv_blocks=16)
    assert llm.engine.runner_type == "pooling"
    got = embeddings(llm.embed(PROMPTS[2], use_tqdm=False))[0]
    torch.testing.assert_close(got, hf_hidden(st_dir, PROMPTS[2]).mean(0), atol=2e-5, rtol=1e-4)  # no Normalize
    (st_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    llm = LLM(str(st_dir), dtype="float32", num_kv_blocks=16)
    got = embeddings(llm.embed(PROMPTS[2], use_tqdm=False))[0]
    torch.testing.assert_close(got, hf_hidden(st_dir, PROMPTS[2])[0])  # CLS: the first token's


def test_matryoshka_dimensions_and_refusals(model_root):
    path = make_model(model_root, "qwen3")
    llm = LLM(str(path), runner="pooling", dtype="float32", num_kv_blocks=16, max_model_len=32,
              hf_overrides={"matryoshka_dimensions": [16, 32]})
    got = embeddings(llm.embed([PROMPTS[1]], pooling_params=PoolingParams(dimensions=16), use_tqdm=False))[0]
    want = torch.nn.functional.normalize(hf_hidden(path, PROMPTS[1])[-1][:16], dim=-1)  # cut, then normalized
    torch.testing.assert_close(got, want)
    with pytest.raises(InvalidInput, match=r"only supports Matryoshka dimensions \[16, 32\], got 20"):
        llm.embed([PROMPTS[1]], pooling_params=PoolingParams(dimensions=20), use_tqdm=False)
    with pytest.raises(InvalidInput, match="maximum context length is 32"):
        llm.embed([list(range(5, 38))], use_tqdm=False)
    assert len(llm.embed([list(range(5, 37))], use_tqdm=False)[0].prompt_token_ids) == 32  # no room for output
    out = llm.embed([list(range(5, 50))], pooling_params=PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(18, 50))  # the last max_model_len tokens
    with pytest.raises(InvalidInput, match="the prompt is empty"):
        llm.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"LLM.generate\(\) is only supported for generative models"):
        llm.generate(["hi"], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

    gen = LLM(str(path), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"LLM.encode\(\) is only supported for pooling models"):
        gen.embed(["hi"], use_tqdm=False)
    with pytest.raises(InvalidInput, match="does not support Matryoshka embeddings"):
        LLM(str(path), runner="pooling", dtype="float32", num_kv_blocks=16).embed(
            ["hi"], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)


@pytest.mark.parametrize("kwargs, error", [
    (dict(task="embed", runner="generate"), "task=embed needs the pooling runner"),
    (dict(runner="pooling", pooler_config={"normalize": True}), "`normalize` was removed; use `use_activation`"),
    (dict(runner="pooling", pooler_config={"pooling_type": "all"}),
     "pooling_type ALL pools each token .* embeddings take one of CLS, LAST, MEAN"),
    (dict(runner="pooling", pooler_config={"pooling_type": "STEP"}), "pooling_type STEP pools each token"),
    (dict(runner="pooling", pooler_config={"pooling_type": "max"}), "pooling_type must be one of CLS, LAST, MEAN"),
    (dict(convert="classify"), "convert must be one of auto, none, embed"),
])
def test_engine_config_refusals(kwargs, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig("unused", **kwargs)


@pytest.fixture(scope="module")
def pooling_server(tiny_model):
    from test_server import ServerThread  # (openai, which test_server imports, only where it serves)
    with ServerThread(tiny_model, "--runner", "pooling", "--max-num-batched-tokens", "16",
                      "--max-num-seqs", "4") as s:
        yield s


def test_embeddings_endpoint_shapes(pooling_server, tiny_model):
    import openai
    texts = ["The quick brown fox jumps over the lazy dog.", "hello world", "你好，世界！ 🙂"]
    tokenizer = pooling_server.engine.tokenizer
    want = [torch.nn.functional.normalize(hf_hidden(tiny_model, tokenizer.encode(t))[-1], dim=-1) for t in texts]
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": texts, "model": str(tiny_model)}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("embd-") and isinstance(body["created"], int)
    assert body["model"] == str(tiny_model)
    n = sum(len(tokenizer.encode(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1), ("embedding", 2)]
    for d, w in zip(body["data"], want):
        torch.testing.assert_close(torch.tensor(d["embedding"]), w, atol=2e-5, rtol=1e-4)
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": [[5, 6, 7], [30, 31]],
                                                                "encoding_format": "base64"}, timeout=30)
    raw = [torch.frombuffer(bytearray(base64.b64decode(d["embedding"])), dtype=torch.float32) for d in r.json()["data"]]
    torch.testing.assert_close(raw[0], torch.nn.functional.normalize(hf_hidden(tiny_model, [5, 6, 7])[-1], dim=-1))
    client = openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="x", max_retries=0)
    out = client.embeddings.create(model=str(tiny_model), input=texts[1])  # the SDK asks for base64 and decodes it
    torch.testing.assert_close(torch.tensor(out.data[0].embedding), want[1])
    assert out.usage.prompt_tokens == len(tokenizer.encode(texts[1]))
    pooling_server.wait_idle()


@pytest.mark.parametrize("body, status, says", [
    ({"input": []}, 400, "input must be"),
    ({"input": 3}, 400, "input must be"),
    ({}, 400, "input is required"),
    ({"input": ""}, 400, "the prompt is empty"),
    ({"input": [list(range(5, 300))]}, 400, "maximum context length is 256"),
    ({"input": "hi", "dimensions": 8}, 400, "does not support Matryoshka"),
    ({"input": "hi", "encoding_format": "bytes"}, 400, "encoding_format"),
    ({"input": [[5, 10**9]]}, 400, "outside the vocabulary"),
    ({"input": "hi", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
])
def test_embeddings_endpoint_refusals(pooling_server, body, status, says):
    r = httpx.post(pooling_server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
    pooling_server.wait_idle()


def test_pooling_server_truncates_and_refuses_generation(pooling_server):
    r = httpx.post(pooling_server.url + "/v1/embeddings",
                   json={"input": [list(range(5, 300))], "truncate_prompt_tokens": 10}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10, r.text
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": []})):
        r = httpx.post(pooling_server.url + path, json=body, timeout=30)
        assert r.status_code == 404 and "--runner pooling" in r.json()["error"]["message"], r.text
    assert httpx.get(pooling_server.url + "/v1/models", timeout=30).status_code == 200


def test_generate_server_refuses_embeddings_and_cli_flags(tiny_model):
    from test_server import ServerThread, parse_args
    with ServerThread(tiny_model) as s:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 404 and "--runner pooling" in r.json()["error"]["message"], r.text
    args = parse_args(["--model", str(tiny_model), "--task", "embed", "--override-pooler-config",
                       '{"pooling_type": "mean"}'])
    assert (args.runner, args.pooler_config) == ("auto", {"pooling_type": "mean"})
    from nanoserve.entry import engine_config
    config = engine_config(args)
    assert config.runner == "pooling" and config.pooler_config.pooling_type == "MEAN"
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tiny_model), "--runner", "generate", "--convert", "embed"])


def test_a_client_that_leaves_aborts_its_embeddings(pooling_server):
    """The handler waits on its output queue; watch_disconnect puts the client's leaving there, and the
    requests are aborted, not computed to the end: no request finishes, every block is free again."""
    pooling_server.delay = 1.0  # 200 tokens in chunks of 16: 13 steps of >= 1 s, far beyond the 0.4 s read
    try:
        before = pooling_server.stats()["num_finished"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(pooling_server.url + "/v1/embeddings", json={"input": [list(range(10, 210))]},
                       timeout=httpx.Timeout(5, read=0.4))
        pooling_server.wait_idle(timeout=30)
        assert pooling_server.stats()["num_finished"] == before
    finally:
        pooling_server.delay = 0.0
