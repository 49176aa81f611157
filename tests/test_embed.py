"""The pooling runner (embeddings) against transformers: a decoder's final-norm hidden state at the
last token (normalized), the mean of all of them, or the first's (CLS), through chunked prefill, prefix
caching and batching, with LoRA adapters and tensor parallelism; a bare-decoder checkpoint (Qwen3Model)
and a sentence-transformers one chosen by --runner auto; /v1/embeddings' shapes (the openai SDK's base64,
vLLM's embed_dtype, endianness and bytes too), chat messages, --max-queue-len, /metrics and its refusals."""
from __future__ import annotations

import base64
import concurrent.futures
import functools
import json
import shutil
import threading
import time

import httpx
import numpy
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
    assert out.prompt_token_ids == list(range(5, 37))  # max_model_len tokens, from the tokenizer's side (right)
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
    (dict(runner="pooling", pooler_config={"pooling_type": "STEP"}), "tok_pooling_type must be ALL"),
    (dict(runner="pooling", pooler_config={"pooling_type": "max"}), "pooling_type must be one of CLS, LAST, MEAN, ALL"),
    (dict(convert="reward"), "convert must be one of auto, none, embed, classify"),
    (dict(convert="classify", runner="generate"), "convert=classify needs the pooling runner"),
])
def test_engine_config_refusals(kwargs, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig("unused", **kwargs)


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    """A LoRA adapter of tiny_model, and the model with it merged (transformers' oracle for it)."""
    from test_lora import make_adapter, merged_model
    root = tmp_path_factory.mktemp("pool-lora")
    path = make_adapter(tiny_model, root / "a", seed=1)
    return path, merged_model(tiny_model, path, root / "merged")


@pytest.fixture(scope="module")
def pooling_server(tiny_model, adapter):
    from test_server import ServerThread  # (openai, which test_server imports, only where it serves)
    with ServerThread(tiny_model, "--runner", "pooling", "--max-num-batched-tokens", "16",
                      "--max-num-seqs", "4", "--max-queue-len", "4", "--enable-lora",
                      "--lora-modules", f"adapted={adapter[0]}") as s:
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
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,  # vLLM's UsageInfo
                             "prompt_tokens_details": None, "completion_tokens_details": None}
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
    ({"input": "hi", "encoding_format": "bits"}, 400, "encoding_format"),
    ({"input": "hi", "embed_dtype": "int8"}, 400, "embed_dtype"),
    ({"input": "hi", "normalize": True}, 400, "`normalize` was removed; use `use_activation`"),
    ({"input": "hi", "padding": "longest"}, 400, "padding must be"),
    ({"input": "hi", "dimensions": 0}, 400, "does not support Matryoshka"),  # the model's check, as vLLM's
    ({"input": "hi", "truncate_prompt_tokens": 257}, 400, "cannot be greater than max_model_len = 256"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "the prompt is empty"),
    ({"input": "hi", "mm_processor_kwargs": {"a": 1}}, 400, "multimodal inputs are not supported"),
    ({"input": "hi", "request_id": "a\nb"}, 400, "request_id must be 1 to 1024 printable characters"),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "input or messages, not both"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
      "continue_final_message": True}, 400, "Cannot set both `continue_final_message`"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ x }}"}, 400,
     "--trust-request-chat-template"),
    ({"input": ["a", "b", "c", "d", "e"]}, 400, "5 engine requests (5 prompt(s) x n=1), more than --max-queue-len 4"),
    ({"input": [[5, 10**9]]}, 400, "outside the vocabulary"),
    ({"input": "hi", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
])
def test_embeddings_endpoint_refusals(pooling_server, body, status, says):
    r = httpx.post(pooling_server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
    pooling_server.wait_idle()


def test_pooling_server_truncates_and_refuses_generation(pooling_server, tiny_model):
    def vector(body: dict) -> torch.Tensor:
        r = httpx.post(pooling_server.url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return torch.tensor(r.json()["data"][0]["embedding"])

    def last(prompt: list[int]) -> torch.Tensor:
        return torch.nn.functional.normalize(hf_hidden(tiny_model, prompt)[-1], dim=-1)

    # truncation_side unset is the tokenizer's, as vLLM's: "right" here, the first tokens kept
    assert pooling_server.engine.tokenizer.truncation_side == "right"
    torch.testing.assert_close(vector({"input": [list(range(5, 300))], "truncate_prompt_tokens": 10}),
                               last(list(range(5, 15))))
    torch.testing.assert_close(vector({"input": [list(range(5, 300))], "truncate_prompt_tokens": 10,
                                       "truncation_side": "left"}), last(list(range(290, 300))))
    # padding max_length appends the pad token up to max_model_len, after truncation (vLLM's, transformers')
    pad = pooling_server.engine.tokenizer.pad_token_id
    torch.testing.assert_close(vector({"input": [list(range(5, 300))], "truncate_prompt_tokens": 10,
                                       "padding": "max_length"}), last(list(range(5, 15)) + [pad] * 246))
    # vLLM's truncation_side, request_id (the response's id) and cache_salt (who shares cached blocks)
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={
        "input": [list(range(5, 300))], "truncate_prompt_tokens": 10, "truncation_side": "right",
        "request_id": "mine"}, timeout=30)
    assert r.status_code == 200 and r.json()["id"] == "embd-mine", r.text
    want = torch.nn.functional.normalize(hf_hidden(tiny_model, list(range(5, 15)))[-1], dim=-1)
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), want)
    hits = []
    for salt in ("a", "b", "a"):
        before = pooling_server.stats()["prefix_cache_hits"]
        r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": [list(range(40, 80))],
                                                                    "cache_salt": salt}, timeout=30)
        assert r.status_code == 200, r.text
        hits.append(pooling_server.stats()["prefix_cache_hits"] - before)
    assert hits[0] == hits[1] == 0 < hits[2], hits
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": []}),
                       ("/v1/messages/count_tokens", {"messages": []})):  # vLLM mounts Anthropic's for generation
        r = httpx.post(pooling_server.url + path, json=body, timeout=30)
        assert r.status_code == 404 and "--runner pooling" in r.json()["error"]["message"], r.text
    assert httpx.get(pooling_server.url + "/v1/models", timeout=30).status_code == 200
    # as vLLM's: /tokenize and /detokenize serve a pooling model; SageMaker's /invocations takes embeddings
    r = httpx.post(pooling_server.url + "/tokenize", json={"prompt": "hello world"}, timeout=30)
    tokens = pooling_server.engine.tokenizer.encode("hello world")
    assert r.status_code == 200 and r.json()["tokens"] == tokens, r.text
    r = httpx.post(pooling_server.url + "/detokenize", json={"tokens": tokens}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"] == "hello world", r.text
    r = httpx.post(pooling_server.url + "/invocations", json={"input": [[5, 6, 7]]}, timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "list", r.text
    want = torch.nn.functional.normalize(hf_hidden(pooling_server.args.model, [5, 6, 7])[-1], dim=-1)
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), want)
    # vLLM's /pooling: the same vector as a "pooling" object's data; task embed only, no dimensions
    r = httpx.post(pooling_server.url + "/pooling", json={"input": [[5, 6, 7]], "task": "embed"}, timeout=30)
    assert r.status_code == 200 and r.json()["id"].startswith("pool-"), r.text
    assert [(d["index"], d["object"]) for d in r.json()["data"]] == [(0, "pooling")]
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["data"]), want)
    for body, says in (({"input": "hi", "task": "classify"}, "Unsupported task: 'classify'"),
                       ({"input": "hi", "dimensions": 8}, "dimensions is currently not supported")):
        r = httpx.post(pooling_server.url + "/pooling", json=body, timeout=30)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_generate_server_refuses_embeddings_and_cli_flags(tiny_model):
    from test_server import ServerThread, parse_args
    with ServerThread(tiny_model) as s:
        for path in ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v2/rerank"):
            r = httpx.post(s.url + path, json={"input": "hi", "query": "a", "documents": ["b"]}, timeout=30)
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
    from test_server import _metrics
    pooling_server.delay = 1.0  # 200 tokens in chunks of 16: 13 steps of >= 1 s, far beyond the 0.4 s read
    aborted = "vllm:request_success_total{finished_reason=abort}"
    try:
        before, counted = pooling_server.stats()["num_finished"], _metrics(pooling_server.url).get(aborted, 0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(pooling_server.url + "/v1/embeddings", json={"input": [list(range(10, 210))]},
                       timeout=httpx.Timeout(5, read=0.4))
        pooling_server.wait_idle(timeout=30)
        assert pooling_server.stats()["num_finished"] == before
        assert _metrics(pooling_server.url)[aborted] == counted + 1  # as a completion's aborted choice
    finally:
        pooling_server.delay = 0.0


def test_embed_dtype_endianness_and_bytes(pooling_server, tiny_model):
    """vLLM's encodings: base64 of embed_dtype's bytes in endianness' order; bytes: the vectors' bytes one
    after another, with where each lies in a `metadata` header (bytes_only: none)."""
    body = {"input": [[5, 6, 7], [30, 31, 32, 33]], "model": str(tiny_model)}
    want = [torch.nn.functional.normalize(hf_hidden(tiny_model, p)[-1], dim=-1) for p in body["input"]]
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={**body, "encoding_format": "base64",
                                                                "embed_dtype": "float16", "endianness": "big"})
    got = numpy.frombuffer(base64.b64decode(r.json()["data"][1]["embedding"]), dtype=">f2")  # big-endian
    torch.testing.assert_close(torch.tensor(got.astype("f4")), want[1], atol=1e-3, rtol=1e-3)
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={**body, "encoding_format": "bytes",
                                                                "embed_dtype": "bfloat16"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text
    meta = json.loads(r.headers["metadata"])
    assert meta["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and meta["model"] == str(tiny_model)
    hidden = len(want[0])
    assert [(d["index"], d["start"], d["end"], d["shape"], d["embed_dtype"]) for d in meta["data"]] == [
        (0, 0, 2 * hidden, [hidden], "bfloat16"), (1, 2 * hidden, 4 * hidden, [hidden], "bfloat16")]
    raw = torch.frombuffer(bytearray(r.content), dtype=torch.bfloat16).float()
    torch.testing.assert_close(raw, torch.cat(want), atol=1e-2, rtol=1e-2)
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={**body, "encoding_format": "bytes_only"})
    assert "metadata" not in r.headers
    torch.testing.assert_close(torch.frombuffer(bytearray(r.content), dtype=torch.float32), torch.cat(want))


def test_chat_messages_are_rendered_by_the_chat_template(pooling_server, tiny_model):
    """vLLM's EmbeddingChatRequest: the chat template renders the messages (no generation prompt, no
    special tokens of the tokenizer's unless asked); a list of chats, or chats given as input, too."""
    tok = pooling_server.engine.tokenizer
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    other = [{"role": "user", "content": [{"type": "text", "text": "the quick fox"}]}]

    def want(messages, **kw):
        ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=False)
        return ids, torch.nn.functional.normalize(hf_hidden(tiny_model, ids)[-1], dim=-1)

    def post(**body):
        r = httpx.post(pooling_server.url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    ids, vec = want(chat, add_generation_prompt=False)
    for body in ({"messages": chat}, {"input": chat}):
        out = post(**body)
        assert out["usage"]["prompt_tokens"] == len(ids)
        torch.testing.assert_close(torch.tensor(out["data"][0]["embedding"]), vec)
    ids2, vec2 = want([{"role": "user", "content": "the quick fox"}], add_generation_prompt=False)
    for body in ({"messages": [chat, other]}, {"input": [chat, other]}):
        out = post(**body)
        assert out["usage"]["prompt_tokens"] == len(ids) + len(ids2) and len(out["data"]) == 2
        torch.testing.assert_close(torch.tensor(out["data"][1]["embedding"]), vec2)
    ids3, vec3 = want(chat, add_generation_prompt=True)
    assert len(ids3) > len(ids)
    out = post(messages=chat, add_generation_prompt=True)
    assert out["usage"]["prompt_tokens"] == len(ids3)
    torch.testing.assert_close(torch.tensor(out["data"][0]["embedding"]), vec3)
    pooling_server.wait_idle()


def test_max_queue_len_and_metrics(pooling_server, tiny_model):
    """--max-queue-len counts embeddings' waiting prompts as completions' (429 with Retry-After beyond it),
    and each finished one moves vLLM's request series, as vLLM observes a pooling request."""
    from test_server import _metrics
    before = _metrics(pooling_server.url)
    release, execute = threading.Event(), pooling_server.engine.runner.execute
    pooling_server.engine.runner.execute = lambda seqs: release.wait(60) and execute(seqs)

    def wait_for(key: str, n: int) -> None:
        deadline = time.monotonic() + 30
        while pooling_server.stats()[key] < n:
            assert time.monotonic() < deadline, key
            time.sleep(0.01)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            post = functools.partial(httpx.post, pooling_server.url + "/v1/embeddings", timeout=60)
            running = pool.submit(post, json={"input": [[5, 6], [7, 8], [9, 10, 11], [12]]})
            wait_for("num_running", 4)  # their step is held
            waiting = pool.submit(post, json={"input": [[13, 14], [15], [16], [17]]})
            wait_for("num_waiting", 4)
            during = _metrics(pooling_server.url)
            busy = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
            assert "4 requests are waiting (--max-queue-len 4)" in busy.json()["error"]["message"]
            release.set()
            assert running.result().status_code == waiting.result().status_code == 200
    finally:
        release.set()
        pooling_server.engine.runner.execute = execute
    pooling_server.wait_idle()
    after = _metrics(pooling_server.url)
    assert (during["vllm:num_requests_running"], during["vllm:num_requests_waiting"]) == (4, 4)
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    grew = {k: after[k] - before.get(k, 0) for k in after if k.startswith("vllm:")}
    assert grew["vllm:request_success_total{finished_reason=stop}"] == 8
    for series in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                   "request_prefill_time_seconds", "request_inference_time_seconds", "request_decode_time_seconds",
                   "request_prompt_tokens", "request_generation_tokens", "request_params_n",
                   "request_time_per_output_token_seconds"):
        assert grew[f"vllm:{series}_count"] == 8, series
    assert grew["vllm:request_prompt_tokens_sum"] == 8 + 5 and grew["vllm:request_generation_tokens_sum"] == 0
    assert grew["vllm:request_queue_time_seconds_sum"] > 0  # four waited for the held step
    assert grew["vllm:request_decode_time_seconds_sum"] == grew["vllm:request_time_per_output_token_seconds_sum"] == 0
    assert grew.get("vllm:request_params_max_tokens_count", 0) == 0  # vLLM's: a pooling request has none
    assert grew["vllm:request_rejected_total{code=429}"] == 1


def test_lora_adapters_and_tensor_parallel_are_their_merged_models(tiny_model, adapter, pooling_server):
    """An adapter's embedding is its merged model's, mixed with the base model's in one step, offline
    under tensor_parallel_size 1 and 2 (rank 0 pools the all-reduced hidden states), and over HTTP
    where the request names the adapter as its model."""
    from nanoserve import LoRARequest
    lora = LoRARequest("adapted", 1, str(adapter[0]))
    loras = [lora, None, lora, None]
    want = [torch.nn.functional.normalize(hf_hidden(adapter[1] if a else tiny_model, p)[-1], dim=-1)
            for p, a in zip(PROMPTS, loras)]
    assert not torch.allclose(want[0], torch.nn.functional.normalize(hf_hidden(tiny_model, PROMPTS[0])[-1], dim=-1))
    # eager (the torch attention, as tests/test_tp.py): the spawned rank compiles no decode attention
    kw = dict(runner="pooling", dtype="float32", enable_lora=True, max_loras=1, max_num_batched_tokens=8,
              max_num_seqs=4, num_kv_blocks=32, block_size=8, enforce_eager=True)
    for tp in (1, 2):
        llm = LLM(str(tiny_model), tensor_parallel_size=tp, **kw)
        try:
            got = embeddings(llm.embed(PROMPTS, lora_request=loras, use_tqdm=False))
        finally:
            llm.shutdown()
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": [PROMPTS[0]], "model": "adapted"},
                   timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "adapted", r.text
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), want[0], atol=2e-5, rtol=1e-4)
