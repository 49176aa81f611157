"""vLLM's token-wise pooling tasks against transformers: token_embed (every prompt token's final-norm hidden
state, each row normalized) and token_classify (the score head on every token, each row activated), served
when --pooler-config's task names them: offline LLM.encode and /pooling, rows gathered chunk by chunk, with
vLLM's refusals for the tasks the server is not serving; and /invocations trying vLLM's handlers in order."""
from __future__ import annotations

import base64
import sys
from pathlib import Path

import httpx
import pytest
import torch

from conftest import make_model
from nanoserve.engine import LLM, EngineConfig, InvalidInput, PoolingParams
from test_classify import LABELS, make_classifier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
# A Qwen3-Reranker-shaped score template (vLLM's examples/pooling/score/template/qwen3_reranker.jinja is of this
# shape): the one benchmarks/api_diff.py serves both vLLM and nanoserve with
from api_diff import SCORE_TEMPLATE  # noqa: E402

# 20 and 22 tokens: prefilled in chunks of 8; the last shares its first 16 with the first (a cached prefix)
PROMPTS = [list(range(5, 25)), [5, 6, 7], list(range(5, 21)) + [50, 51, 52, 53, 54, 55]]


def hf_rows(path, prompt: list[int]) -> torch.Tensor:
    """transformers' final-norm hidden state of every token of one prompt (the decoder without a head)."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def hf_token_logits(path, prompt: list[int]) -> torch.Tensor:
    """transformers' ForSequenceClassification's score head on every token (its logits before pooling)."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.score(model.model(torch.tensor([prompt])).last_hidden_state[0])


def small_llm(path, **kw) -> LLM:
    return LLM(str(path), runner="pooling", dtype="float32", max_num_batched_tokens=8, max_num_seqs=4,
               num_kv_blocks=32, block_size=8, **kw)


def test_token_embed_rows_through_chunks_normalized_and_refusals(model_root):
    path = make_model(model_root, "qwen3")
    llm = small_llm(path, pooler_config={"task": "token_embed"})
    assert (llm.engine.pooling_task, llm.engine.supported_pooling_tasks) == ("token_embed", ("token_embed", "embed"))
    outs = llm.encode(PROMPTS, pooling_task="token_embed", use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        want = hf_rows(path, prompt)
        assert out.outputs.data.shape == (len(prompt), want.shape[-1])
        torch.testing.assert_close(out.outputs.data, torch.nn.functional.normalize(want, dim=-1),
                                   atol=2e-5, rtol=1e-4)
        assert out.num_cached_tokens == 0  # every row is computed (vLLM's skip_reading_prefix_cache)
    raw = llm.encode(PROMPTS[0], PoolingParams(use_activation=False), pooling_task="token_embed", use_tqdm=False)
    torch.testing.assert_close(raw[0].outputs.data, hf_rows(path, PROMPTS[0]), atol=2e-5, rtol=1e-4)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    for call, says in (
            (lambda: llm.embed("hi", use_tqdm=False), 'via `PoolerConfig(task="embed")`'),
            (lambda: llm.encode("hi", use_tqdm=False), "pooling_task required for `LLM.encode`"),
            (lambda: llm.encode("hi", pooling_task="token_classify", use_tqdm=False),
             "Classification API is not supported by this model"),
            (lambda: llm.encode("hi", pooling_task="encode", use_tqdm=False), "`encode` task was removed"),
            (lambda: llm.encode("hi", PoolingParams(dimensions=4), pooling_task="token_embed", use_tqdm=False),
             "does not support Matryoshka")):
        with pytest.raises(InvalidInput, match=None) as e:
            call()
        assert says in str(e.value), str(e.value)
    q, d = (torch.nn.functional.normalize(hf_rows(path, llm.engine.tokenizer.encode(t)), dim=-1)
            for t in ("a cat", "the cat sat"))  # token_embed scores by late interaction (MaxSim), as vLLM's
    assert llm.score("a cat", "the cat sat", use_tqdm=False)[0].outputs.score == pytest.approx(
        (q @ d.T).amax(-1).sum().item(), abs=1e-4)
    # an embed server refuses the token-wise task with vLLM's hint, and the same model serves both ways
    plain = small_llm(path)
    with pytest.raises(InvalidInput, match='via `PoolerConfig\\(task="token_embed"\\)`'):
        plain.encode("hi", pooling_task="token_embed", use_tqdm=False)
    vector = plain.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(vector), outs[0].outputs.data[-1], atol=2e-5, rtol=1e-4)


def test_token_classify_rows_are_the_score_head_on_every_token(model_root):
    path = make_classifier(model_root, "llama", 1, num_labels=3, id2label=LABELS,
                           label2id={v: k for k, v in LABELS.items()})
    llm = small_llm(path, pooler_config={"task": "token_classify"})
    outs = llm.encode(PROMPTS, pooling_task="token_classify", use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        want = hf_token_logits(path, prompt)
        assert out.outputs.data.shape == (len(prompt), 3)
        torch.testing.assert_close(out.outputs.data, want.softmax(-1), atol=1e-5, rtol=1e-4)
    raw = llm.encode(PROMPTS[2], PoolingParams(use_activation=False), pooling_task="token_classify",
                     use_tqdm=False)
    torch.testing.assert_close(raw[0].outputs.data, hf_token_logits(path, PROMPTS[2]), atol=1e-5, rtol=1e-4)
    for call, says in (
            (lambda: llm.classify("hi", use_tqdm=False), 'via `PoolerConfig(task="classify")`'),
            (lambda: llm.encode("hi", pooling_task="token_embed", use_tqdm=False),
             "Embedding API is not supported by this model"),
            (lambda: llm.encode("hi", PoolingParams(dimensions=2), pooling_task="token_classify", use_tqdm=False),
             "Task 'token_classify' only supports ['use_activation'] parameters")):
        with pytest.raises(InvalidInput) as e:
            call()
        assert says in str(e.value), str(e.value)


@pytest.mark.parametrize("pooler_config, says", [
    ({"task": "token_classify"}, "Unsupported task: 'token_classify' Supported tasks: ['token_embed', 'embed']"),
    ({"task": "encode"}, "`encode` task was removed; use `token_embed` or `token_classify` instead."),
    ({"task": "rerank"}, "task must be one of"),
    ({"tok_pooling_type": "STEP"}, "tok_pooling_type must be ALL"),
    ({"pooling_type": "ALL", "tok_pooling_type": "ALL"}, "Cannot set both `pooling_type` and `tok_pooling_type`"),
])
def test_pooler_config_task_refusals(model_root, pooler_config, says):
    """vLLM's task checks; pooling_type ALL is its token pooling (tok_pooling_type), every token's row."""
    assert EngineConfig("unused", runner="pooling", pooler_config={"pooling_type": "all"}).pooler_config.pooling_type \
        is None
    with pytest.raises(ValueError) as e:
        small_llm(make_model(model_root, "qwen3"), pooler_config=pooler_config)
    assert says in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def token_embed_server(tiny_model):
    from test_server import ServerThread
    with ServerThread(tiny_model, "--runner", "pooling", "--max-num-batched-tokens", "8",
                      "--pooler-config", '{"task": "token_embed"}') as s:
        yield s


def test_pooling_route_serves_token_embed_rows(token_embed_server, tiny_model):
    url, tokenizer = token_embed_server.url, token_embed_server.engine.tokenizer
    texts = ["The quick brown fox jumps over the lazy dog.", "hi"]
    r = httpx.post(url + "/pooling", json={"input": texts}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("pool-") and body["usage"]["prompt_tokens"] == sum(
        len(tokenizer.encode(t)) for t in texts)
    for d, text in zip(body["data"], texts):
        want = torch.nn.functional.normalize(hf_rows(tiny_model, tokenizer.encode(text)), dim=-1)
        assert d["object"] == "pooling"
        torch.testing.assert_close(torch.tensor(d["data"]), want, atol=2e-5, rtol=1e-4)
    r = httpx.post(url + "/pooling", json={"input": [[5, 6, 7]], "task": "token_embed", "encoding_format": "base64"},
                   timeout=30)
    raw = torch.frombuffer(bytearray(base64.b64decode(r.json()["data"][0]["data"])), dtype=torch.float32)
    torch.testing.assert_close(raw.view(3, -1), torch.nn.functional.normalize(hf_rows(tiny_model, [5, 6, 7]), dim=-1))
    rows = [torch.nn.functional.normalize(hf_rows(tiny_model, tokenizer.encode(t)), dim=-1) for t in ["hi", *texts]]
    r = httpx.post(url + "/score", json={"queries": "hi", "documents": texts}, timeout=30)  # vLLM's late interaction
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(
        [(rows[0] @ d.T).amax(-1).sum().item() for d in rows[1:]], abs=1e-4)
    r = httpx.post(url + "/invocations", json={"input": "hi"}, timeout=30)  # /pooling's body, the only one
    assert r.status_code == 200 and r.json()["id"].startswith("pool-"), r.text
    for path, body, status, says in (
            ("/pooling", {"input": "hi", "task": "embed"}, 400,
             "Try switching the model's pooling_task via --pooler-config.task embed."),
            ("/pooling", {"input": "hi", "task": "classify"}, 400,
             "Unsupported task: 'classify' Supported tasks: ['token_embed', 'embed']"),
            ("/pooling", {"input": "hi", "task": "encode"}, 400, "`encode` task was removed"),
            ("/v1/embeddings", {"input": "hi"}, 501, "The model does not support Embeddings API"),
            ("/v1/embeddings", {"input": "hi", "normalize": False}, 400, "`normalize` was removed"),  # body first
            ("/v1/embeddings", {"model": "x"}, 400, "input is required"),
            ("/classify", {"input": "hi"}, 404, "needs a classifier")):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == status and says in r.json()["error"]["message"], (path, r.text)
    token_embed_server.wait_idle()


INSTRUCTIONS = {"query": "query: ", "document": "passage: "}


@pytest.fixture(scope="module")
def embed_server(tiny_model, tmp_path_factory):
    """The tiny model as an embedding model whose config.json names Cohere input_type prefixes."""
    import json
    import shutil
    from test_server import ServerThread
    path = tmp_path_factory.mktemp("cohere") / "m"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "task_instructions": INSTRUCTIONS}))
    with ServerThread(path, "--runner", "pooling") as s:
        yield s


def test_invocations_tries_vllm_s_handlers_in_order(embed_server):
    """An embed server: a body with input and a rerank's fields is an embedding where input is one; where
    input is not, vLLM tries rerank next; a body no handler takes names them all."""
    s = embed_server
    r = httpx.post(s.url + "/pooling", json={"input": "hi", "task": "token_embed"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "Try switching the model's pooling_task via --pooler-config.task token_embed.", r.text
    both = {"query": "a cat", "documents": ["a small cat", "stocks"]}
    r = httpx.post(s.url + "/invocations", json={"input": "hi", **both}, timeout=30)
    assert r.status_code == 200 and r.json()["id"].startswith("embd-"), r.text
    r = httpx.post(s.url + "/invocations", json={"input": 3, **both}, timeout=30)
    assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
    r = httpx.post(s.url + "/invocations", json={"input": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "Cannot find suitable handler for request. Expected one of: ['EmbeddingRequest', 'RerankRequest', "
        "'ScoreRequest', 'PoolingRequest']"), r.text


def test_cohere_v2_embed(embed_server):
    """vLLM's /v2/embed: texts embedded as /v1/embeddings' input, in each asked encoding; input_type's
    prefix as a system message of the chat template; truncation by truncate and max_tokens."""
    url, tokenizer = embed_server.url, embed_server.engine.tokenizer
    texts = ["the cat sat on the mat", "stocks fell"]
    plain = httpx.post(url + "/v1/embeddings", json={"input": texts}, timeout=30).json()
    want = torch.tensor([d["embedding"] for d in plain["data"]])
    r = httpx.post(url + "/v2/embed", json={"texts": texts, "embedding_types": ["float", "binary", "ubinary",
                                                                               "base64"]}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("embd-") and body["response_type"] == "embeddings_by_type"
    assert body["texts"] == texts and body["meta"] == {"api_version": {"version": "2"}, "billed_units": {
        "input_tokens": plain["usage"]["prompt_tokens"], "image_tokens": 0}}
    got = body["embeddings"]
    torch.testing.assert_close(torch.tensor(got["float"]), want)
    b64 = torch.stack([torch.frombuffer(bytearray(base64.b64decode(x)), dtype=torch.float32) for x in got["base64"]])
    torch.testing.assert_close(b64, want)
    bits = (want >= 0).long().view(2, -1, 8)  # the sign bits, most significant first
    ubinary = (bits * (2 ** torch.arange(7, -1, -1))).sum(-1)
    assert got["ubinary"] == ubinary.tolist() and got["binary"] == (ubinary - 128).tolist()
    only = httpx.post(url + "/v2/embed", json={"texts": texts[:1]}, timeout=30).json()["embeddings"]
    assert list(only) == ["float"]
    # input_type: the model's prefix, as a system message the chat template renders before the text
    chat = [{"role": "system", "content": INSTRUCTIONS["query"]}, {"role": "user", "content": texts[0]}]
    ids = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    ids = tokenizer.encode(ids, add_special_tokens=False)
    r = httpx.post(url + "/v2/embed", json={"texts": texts[:1], "input_type": "query"}, timeout=30).json()
    rows = httpx.post(url + "/v1/embeddings", json={"input": [ids]}, timeout=30).json()["data"][0]["embedding"]
    torch.testing.assert_close(torch.tensor(r["embeddings"]["float"][0]), torch.tensor(rows))
    assert r["meta"]["billed_units"]["input_tokens"] == len(ids)
    # inputs: each a chat of one user message, its text parts (no input_type: no system message)
    chat = tokenizer.apply_chat_template(chat[1:], tokenize=False, add_generation_prompt=False)
    rows = httpx.post(url + "/v1/embeddings", json={"input": [tokenizer.encode(chat, add_special_tokens=False)]},
                      timeout=30).json()["data"][0]["embedding"]
    r = httpx.post(url + "/v2/embed", json={"inputs": [{"content": [{"type": "text", "text": texts[0]}]}]},
                   timeout=30).json()
    torch.testing.assert_close(torch.tensor(r["embeddings"]["float"][0]), torch.tensor(rows))
    assert "texts" not in r  # vLLM's exclude_none
    # truncate END and START with max_tokens: the first or the last tokens, as /v1/embeddings' sides
    long = "one two three four five six seven eight nine ten"
    for truncate, side in (("END", "right"), ("START", "left")):
        r = httpx.post(url + "/v2/embed", json={"texts": [long], "truncate": truncate, "max_tokens": 4}, timeout=30)
        ref = httpx.post(url + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 4,
                                                       "truncation_side": side}, timeout=30).json()
        assert r.json()["meta"]["billed_units"]["input_tokens"] == 4
        torch.testing.assert_close(torch.tensor(r.json()["embeddings"]["float"][0]),
                                   torch.tensor(ref["data"][0]["embedding"]))
    for body, param, says in (
            ({"texts": [long], "truncate": "NONE", "max_tokens": 4}, "max_tokens",
             "tokens exceeds max_tokens=4 with truncate=NONE"),
            ({"texts": []}, "texts", "Exactly one of texts, images, or inputs must be provided"),
            ({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "a"}]}]}, "texts",
             "Exactly one of texts, images, or inputs"),
            ({"images": ["data:image/png;base64,AAAA"]}, "images", "multimodal inputs are not supported"),
            ({"texts": ["a"], "input_type": "classification"}, "input_type",
             "Unsupported input_type 'classification'. Supported values: document, query"),
            ({"texts": ["a"], "output_dimension": 8}, "output_dimension", "does not support Matryoshka"),
            ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types", "embedding_types"),
            ({"texts": ["a"], "truncate": "MIDDLE"}, "truncate", "truncate"),
            ({"texts": [long * 60], "truncate": "NONE"}, "input_tokens", "maximum context length is 256")):
        r = httpx.post(url + "/v2/embed", json=body, timeout=30)
        assert r.status_code == 400 and says in r.json()["error"]["message"], (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    embed_server.wait_idle()


def formatted(query: str, doc: str, instruction: str = "Given a web search query, retrieve relevant passages") -> str:
    """The pair as vLLM's offline Qwen3-Reranker example formats it by hand (the oracle's text)."""
    return ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
            'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
            f'<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}<|im_end|>\n'
            '<|im_start|>assistant\n<think>\n\n</think>\n\n')


def test_score_template_formats_a_cross_encoder_s_pairs(model_root, tmp_path):
    """Qwen3-Reranker as vLLM serves it: --chat-template's score template renders each pair; the score is
    transformers' causal LM's sigmoid(logit[yes] - logit[no]) on the formatted text."""
    import json
    from test_reranker import DOCS, QUERY, hf_last_logits, qwen3_reranker_overrides
    from test_server import ServerThread
    path = make_model(model_root, "qwen3", seed=7)
    overrides = qwen3_reranker_overrides(path)
    no, yes = 150, 250

    def want(instruction=None) -> list[float]:
        texts = [formatted(QUERY, d, *([instruction] if instruction else [])) for d in DOCS]
        logits = hf_last_logits(path, texts)
        return (logits[:, yes] - logits[:, no]).sigmoid().tolist()
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, hf_overrides=overrides)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, chat_template=SCORE_TEMPLATE, use_tqdm=False)]
    assert got == pytest.approx(want(), abs=1e-5)
    plain = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    assert max(abs(a - b) for a, b in zip(got, plain)) > 1e-3  # the template changed the prompts
    template = tmp_path / "qwen3_reranker.jinja"
    template.write_text(SCORE_TEMPLATE)
    with ServerThread(path, "--hf-overrides", json.dumps(overrides), "--chat-template", str(template)) as s:
        r = httpx.post(s.url + "/score", json={"queries": QUERY, "documents": DOCS}, timeout=30)
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want(), abs=1e-5), r.text
        tokenizer = s.engine.tokenizer
        assert r.json()["usage"]["prompt_tokens"] == sum(len(tokenizer(formatted(QUERY, d))["input_ids"]) for d in DOCS)
        r = httpx.post(s.url + "/rerank", json={"query": QUERY, "documents": DOCS, "instruction": "find code"},
                       timeout=30)
        scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert [scores[i] for i in range(3)] == pytest.approx(want("find code"), abs=1e-5), r.text
        r = httpx.post(s.url + "/score", json={"queries": QUERY, "documents": DOCS,
                                               "chat_template_kwargs": {"tools": []}}, timeout=30)
        assert r.status_code == 400 and "reserved keys that conflict with fixed scorer arguments" in \
            r.json()["error"]["message"], r.text
