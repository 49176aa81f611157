"""Score and rerank with an embedding model (vLLM's bi-encoder) against transformers: each pair's score is
the cosine similarity of the two texts' final-norm hidden states at their last token (LAST pooling);
1:1, 1:N and N:N pairing, rerank's order and top_n, max_tokens_per_doc, and one-line 400s naming the field."""
from __future__ import annotations

import httpx
import pytest
import torch

from nanoserve import LLM, PoolingParams, ScoringRequestOutput
from nanoserve.engine import InvalidInput

QUERY, DOCS = "the cat sat", ["a cat sat down", "stock prices fell", "the cat", "rain all day"]


def hf_embedding(path, tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """transformers' oracle: the decoder's final-norm hidden state at the text's last token."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer.encode(text)[:max_tokens]
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


@pytest.fixture(scope="module")
def oracle(tiny_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    vectors = {t: hf_embedding(tiny_model, tokenizer, t) for t in [QUERY, *DOCS]}
    return tokenizer, vectors


def test_llm_score_is_the_cosine_of_transformers_embeddings(tiny_model, oracle):
    _, hf = oracle
    llm = LLM(str(tiny_model), runner="pooling", dtype="float32", max_num_seqs=4)
    outs = llm.score(QUERY, DOCS, use_tqdm=False)  # 1:N
    assert all(isinstance(o, ScoringRequestOutput) for o in outs) and len(outs) == len(DOCS)
    for doc, out in zip(DOCS, outs):
        assert out.outputs.score == pytest.approx(cosine(hf[QUERY], hf[doc]), abs=1e-5)
    assert len({round(o.outputs.score, 4) for o in outs}) == len(DOCS)  # the documents score apart
    pairs = llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)  # N:N, each with its own
    assert [o.outputs.score for o in pairs] == pytest.approx([cosine(hf[DOCS[0]], hf[DOCS[2]]),
                                                              cosine(hf[DOCS[1]], hf[DOCS[3]])], abs=1e-5)
    # use_activation false: unnormalized vectors, the same cosine
    raw = llm.score(QUERY, DOCS[0], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert raw.outputs.score == pytest.approx(outs[0].outputs.score, abs=1e-5)
    for args, says in (((["a", "b"], ["c", "d", "e"]), "Input lengths must be either 1:1, 1:N or N:N"),
                       (([], "a"), "At least one text element must be given"),
                       (("a", []), "At least one text_pair element must be given"),
                       (({"content": [{"type": "text", "text": "a"}]}, "b"), "MultiModalParam is not supported"),
                       (("a", [5]), "data_2[0] must be a string")):
        with pytest.raises(InvalidInput, match=says.replace("[", r"\[")):
            llm.score(*args, use_tqdm=False)


@pytest.fixture(scope="module")
def score_server(tiny_model):
    from test_server import ServerThread  # (openai, which test_server imports, only where it serves)
    with ServerThread(tiny_model, "--runner", "pooling", "--max-num-seqs", "4", "--max-queue-len", "4") as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_score_and_rerank_endpoints(score_server, tiny_model, oracle):
    tokenizer, hf = oracle
    want = [cosine(hf[QUERY], hf[d]) for d in DOCS[:3]]
    num_tokens = sum(len(tokenizer.encode(t)) for t in [QUERY, *DOCS[:3]])
    for path, names in (("/score", ("queries", "documents")), ("/v1/score", ("text_1", "text_2")),
                        ("/score", ("queries", "items")), ("/score", ("data_1", "data_2")),
                        ("/invocations", ("queries", "documents"))):
        r = post(score_server, path, {names[0]: QUERY, names[1]: DOCS[:3], "request_id": "r1"})
        body = r.json()
        assert r.status_code == 200, r.text
        assert (body["id"], body["object"], body["model"]) == ("score-r1", "list", str(tiny_model))
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                                 "prompt_tokens_details": None, "completion_tokens_details": None}
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/invocations"):  # SageMaker's: routed by the body
        body = post(score_server, path, {"query": QUERY, "documents": DOCS[:3], "top_n": 2}).json()
        assert body["id"].startswith("score-") and set(body) == {"id", "model", "usage", "results"}
        assert [r["index"] for r in body["results"]] == order[:2]
        assert [r["document"] for r in body["results"]] == [{"text": DOCS[i], "multi_modal": None} for i in order[:2]]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([want[i] for i in order[:2]],
                                                                                abs=1e-5)
        assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    every = post(score_server, "/rerank", {"query": QUERY, "documents": DOCS[:3]}).json()["results"]
    assert [r["index"] for r in every] == order  # top_n 0: all of them
    # max_tokens_per_doc cuts each document to its first N tokens before it is embedded
    r = post(score_server, "/score", {"queries": QUERY, "documents": DOCS[0], "max_tokens_per_doc": 2})
    cut = hf_embedding(tiny_model, tokenizer, DOCS[0], max_tokens=2)
    assert r.json()["data"][0]["score"] == pytest.approx(cosine(hf[QUERY], cut), abs=1e-5)


@pytest.mark.parametrize("path,body,param,says", [
    ("/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "documents",
     "Input lengths must be either 1:1, 1:N or N:N"),
    ("/score", {"queries": [], "documents": "c"}, "queries", "At least one text element must be given"),
    ("/score", {"text_1": "a"}, "text_2", "text_2 is required"),
    ("/score", {"queries": 5, "documents": "b"}, "queries", "queries must be a string"),
    ("/score", {"queries": "a", "documents": ""}, "documents", "the prompt is empty"),
    ("/score", {"queries": {"content": []}, "documents": "b"}, "queries", "MultiModalParam is not supported"),
    ("/score", {"queries": "a", "documents": "b", "max_tokens_per_doc": -1}, "max_tokens_per_doc",
     "max_tokens_per_doc must be a non-negative integer"),
    ("/score", {"queries": "a", "documents": "b", "max_tokens_per_query": 99999}, "max_tokens_per_query",
     "must be less than max_model_len"),
    ("/score", {"queries": "a", "documents": "b", "truncate_prompt_tokens": 99999}, "truncate_prompt_tokens", ""),
    ("/score", {"queries": "a", "documents": ["b"] * 4}, "documents", "more than --max-queue-len 4"),
    ("/rerank", {"query": ["a"], "documents": ["b"]}, "query", "query must be one text"),
    ("/rerank", {"documents": ["b"]}, "query", "query is required"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "At least one text_pair element must be given"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "top_n"),
])
def test_score_and_rerank_refusals(score_server, path, body, param, says):
    r = post(score_server, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], r.text
    assert "\n" not in error["message"]
    score_server.wait_idle()


def test_a_token_limit_needs_a_fast_tokenizer():
    """max_tokens_per_query/doc cut a text where its first N tokens end, by a fast tokenizer's offsets: with a
    slow tokenizer that is a 400 naming the field, not the tokenizer's NotImplementedError (a 500)."""
    from types import SimpleNamespace
    from nanoserve.entry import _check_token_limit
    _check_token_limit(4, "max_tokens_per_doc", 64, SimpleNamespace(is_fast=True))
    _check_token_limit(0, "max_tokens_per_doc", 64, SimpleNamespace(is_fast=False))  # 0: no limit, no cut
    with pytest.raises(InvalidInput, match="max_tokens_per_query needs a fast tokenizer") as e:
        _check_token_limit(4, "max_tokens_per_query", 64, SimpleNamespace(is_fast=False))
    assert e.value.param == "max_tokens_per_query"
