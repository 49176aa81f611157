"""Classifiers (vLLM's classify task) against transformers' own ForSequenceClassification: the score head
on the last token's final-norm hidden state, softmax over several labels and sigmoid over one; /classify,
/pooling's classify task, LLM.classify, and a one-label model as a cross-encoder (Score and Rerank: each
pair tokenized together as the tokenizer's text pair), with one-line 400s naming the field."""
from __future__ import annotations

import httpx
import pytest
import torch

from conftest import _tokenizer_dir, hf_config
from nanoserve.engine import LLM, ClassificationRequestOutput, InvalidInput, PoolingParams, ScoringRequestOutput

TEXTS = ["the cat sat", "stock prices fell today", "rain"]
QUERY, DOCS = "the cat sat", ["a cat sat down", "stock prices fell", "the cat"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def make_classifier(root, arch: str, seed: int, **overrides):
    """A tiny random XForSequenceClassification saved with the test tokenizer, whose text pairs get a
    separator token between them (so that a pair tokenized as one text would score differently)."""
    from tokenizers import processors
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    out = root / f"{arch}-cls-{seed}-{overrides.get('num_labels')}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(hf_config(arch, pad_token_id=0, **overrides),
                                                           dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
        model.score.weight.normal_(0, 0.5)  # logits far enough apart for the labels to differ
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir(str(root)))
    sep = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A <|im_start|> $B:1", special_tokens=[("<|im_start|>", sep)])
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def classifier(model_root):
    """Llama with three labels (id2label named): softmax."""
    return make_classifier(model_root, "llama", 1, num_labels=3, id2label=LABELS,
                           label2id={v: k for k, v in LABELS.items()})


@pytest.fixture(scope="module")
def cross_encoder(model_root):
    """Qwen3 with one label: sigmoid, and the Score and Rerank APIs."""
    return make_classifier(model_root, "qwen3", 2, num_labels=1)


def hf_logits(path, texts=None, pairs=None) -> torch.Tensor:
    """transformers' logits, each text (or pair, tokenized as the tokenizer's text pair) on its own."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = [tokenizer(t) for t in texts] if texts else [tokenizer(q, d) for q, d in pairs]
    with torch.no_grad():
        return torch.stack([model(torch.tensor([e["input_ids"]])).logits[0] for e in encoded])


def test_llm_classify_is_transformers_softmax(classifier):
    want = hf_logits(classifier, TEXTS)
    llm = LLM(str(classifier), dtype="float32", max_num_seqs=4)  # runner auto: pooling, for the architecture
    assert (llm.engine.runner_type, llm.engine.pooling_task) == ("pooling", "classify")
    outs = llm.classify(TEXTS, use_tqdm=False)
    assert all(isinstance(o, ClassificationRequestOutput) for o in outs)
    got = torch.tensor([o.outputs.probs for o in outs])
    torch.testing.assert_close(got, want.softmax(-1), atol=1e-5, rtol=1e-4)
    assert {o.outputs.num_classes for o in outs} == {3}
    assert len({int(p.argmax()) for p in got}) > 1  # the texts fall under different labels
    raw = llm.encode(TEXTS[:1], PoolingParams(use_activation=False), pooling_task="classify", use_tqdm=False)
    torch.testing.assert_close(raw[0].outputs.data, want[0], atol=1e-5, rtol=1e-4)
    for call, says in ((lambda: llm.embed(TEXTS, use_tqdm=False), "Embedding API is not supported"),
                       (lambda: llm.classify("a", pooling_params=PoolingParams(dimensions=2), use_tqdm=False),
                        "only supports \\['use_activation'\\]"),
                       (lambda: llm.score("a", "b", use_tqdm=False), "only enabled for num_labels == 1")):
        with pytest.raises(InvalidInput, match=says):
            call()


def test_llm_score_cross_encoder_is_transformers_sigmoid_of_the_pair(cross_encoder):
    want = hf_logits(cross_encoder, pairs=[(QUERY, d) for d in DOCS])[:, 0].sigmoid()
    llm = LLM(str(cross_encoder), dtype="float32", max_num_seqs=4)
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    assert all(isinstance(o, ScoringRequestOutput) for o in outs)
    assert [o.outputs.score for o in outs] == pytest.approx(want.tolist(), abs=1e-5)
    sep = llm.engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(sep in o.prompt_token_ids for o in outs)  # the pair, with the tokenizer's separator
    nn = llm.score(DOCS[:2], DOCS[1:], use_tqdm=False)  # N:N
    want_nn = hf_logits(cross_encoder, pairs=list(zip(DOCS[:2], DOCS[1:])))[:, 0].sigmoid()
    assert [o.outputs.score for o in nn] == pytest.approx(want_nn.tolist(), abs=1e-5)


@pytest.fixture(scope="module")
def servers(classifier, cross_encoder):
    from test_server import ServerThread
    with ServerThread(classifier, "--max-num-seqs", "4", "--max-queue-len", "4") as cls, \
            ServerThread(cross_encoder, "--max-num-seqs", "4") as ce:
        yield cls, ce


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_classify_and_pooling_endpoints(servers, classifier):
    server, _ = servers
    want = hf_logits(classifier, TEXTS).softmax(-1)
    r = post(server, "/classify", {"input": TEXTS, "request_id": "c1"})
    body = r.json()
    assert r.status_code == 200, r.text
    assert (body["id"], body["object"], body["model"]) == ("classify-c1", "list", str(classifier))
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["num_classes"] for d in body["data"]} == {3}
    torch.testing.assert_close(torch.tensor([d["probs"] for d in body["data"]]), want, atol=1e-5, rtol=1e-4)
    assert [d["label"] for d in body["data"]] == [LABELS[int(p.argmax())] for p in want]
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 0
    raw = post(server, "/classify", {"input": TEXTS[0], "use_activation": False}).json()["data"][0]["probs"]
    torch.testing.assert_close(torch.tensor(raw), hf_logits(classifier, TEXTS[:1])[0], atol=1e-5, rtol=1e-4)
    pooled = post(server, "/pooling", {"input": TEXTS, "task": "classify"}).json()
    torch.testing.assert_close(torch.tensor([d["data"] for d in pooled["data"]]), want, atol=1e-5, rtol=1e-4)
    assert post(server, "/v1/embeddings", {"input": "a"}).status_code == 404  # vLLM mounts neither for it
    assert post(server, "/rerank", {"query": "a", "documents": ["b"]}).status_code == 404  # 3 labels
    # vLLM's classify body has no embeddings-only fields: it ignores them, as any unknown field
    odd = post(server, "/classify", {"input": TEXTS, "dimensions": 2, "encoding_format": "base64"}).json()
    torch.testing.assert_close(torch.tensor([d["probs"] for d in odd["data"]]), want, atol=1e-5, rtol=1e-4)
    # SageMaker's /invocations takes the classify body; a score body only where the model scores (1 label)
    sagemaker = post(server, "/invocations", {"input": TEXTS}).json()
    assert sagemaker["id"].startswith("classify-")
    torch.testing.assert_close(torch.tensor([d["probs"] for d in sagemaker["data"]]), want, atol=1e-5, rtol=1e-4)
    r = post(server, "/invocations", {"query": "a", "documents": ["b"]})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "Cannot find suitable handler for request. Expected one of: ['ClassificationRequest', 'PoolingRequest']", r.text
    r = post(server, "/v1/completions", {"prompt": "a"})
    assert r.status_code == 404 and "/classify is served" in r.json()["error"]["message"], r.text


def test_cross_encoder_score_and_rerank(servers, cross_encoder):
    _, server = servers
    want = hf_logits(cross_encoder, pairs=[(QUERY, d) for d in DOCS])[:, 0].sigmoid().tolist()
    body = post(server, "/score", {"queries": QUERY, "documents": DOCS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    body = post(server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [r["index"] for r in body["results"]] == order[:2]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([want[i] for i in order[:2]], abs=1e-5)
    one = post(server, "/classify", {"input": "a cat"}).json()["data"][0]
    assert one["num_classes"] == 1 and one["label"] == "LABEL_0"
    # /invocations: the task's own body first, then rerank's, then score's (vLLM's order)
    results = post(server, "/invocations", {"query": QUERY, "documents": DOCS, "top_n": 2}).json()["results"]
    assert [r["index"] for r in results] == order[:2]
    assert [d["score"] for d in post(server, "/invocations", {"queries": QUERY, "documents": DOCS}).json()["data"]] \
        == pytest.approx(want, abs=1e-5)
    assert post(server, "/invocations", {"input": "a cat"}).json()["data"][0]["probs"] == pytest.approx(one["probs"],
                                                                                                     abs=1e-6)


@pytest.mark.parametrize("which,path,body,param,says", [
    (1, "/score", {"queries": {"content": [{"type": "text", "text": "a"}]}, "documents": "b"}, "queries",
     "MultiModalParam is not supported for Qwen3ForSequenceClassification"),  # config.json's architecture
    (0, "/classify", {}, "input", "input is required"),
    (0, "/classify", {"input": ""}, "input", "the prompt is empty"),
    (0, "/classify", {"input": ["a"] * 5}, "input", "more than --max-queue-len 4"),
    (0, "/pooling", {"input": "a", "task": "embed"}, "task", "Unsupported task: 'embed'"),
    (0, "/pooling", {"input": "a", "task": "score"}, "task", "`score` task was removed"),
    (1, "/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "documents", "1:1, 1:N or N:N"),
    (1, "/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": -1}, "max_tokens_per_doc",
     "must be a non-negative integer"),
    (1, "/score", {"queries": "a", "documents": "b", "truncate_prompt_tokens": 99999}, "truncate_prompt_tokens", ""),
])
def test_classify_refusals(servers, which, path, body, param, says):
    server = servers[which]
    r = post(server, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], r.text
    assert "\n" not in error["message"]
    server.wait_idle()
