"""A causal LM served as a classifier (vLLM's --convert classify and --hf-overrides classifier_from_token /
method / is_original_qwen3_reranker, the documented way to serve Qwen3-Reranker): the score head built at load
from the LM head's rows, checked against transformers' causal LM itself. from_2_way_softmax: the sigmoid of
logit[true] - logit[false] at the last position; no_post_processing: the chosen tokens' logits. A reranker so
built reads a pair as query + document, one text. Bad overrides are one-line errors naming the field."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from conftest import make_model
from nanoserve.engine import LLM, PoolingParams

QUERY, DOCS = "the quick fox", ["the lazy dog", "print('hello world')", "the quick brown fox jumps"]


def vocab_tokens(path, *ids: int) -> list[str]:
    """Tokens of the test vocabulary, as the tokenizer spells them (vLLM reads classifier_from_token so)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(list(ids))


def hf_last_logits(path, texts: list[str]) -> torch.Tensor:
    """transformers' causal LM logits at each text's last position (the oracle)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return torch.stack([model(torch.tensor([tokenizer(t)["input_ids"]])).logits[0, -1] for t in texts])


@pytest.fixture(scope="module")
def tied_lm(model_root):
    """Qwen3, tied embeddings (the head's rows are the embedding's), as Qwen3-Reranker-0.6B."""
    return make_model(model_root, "qwen3", seed=7)


@pytest.fixture(scope="module")
def untied_lm(model_root):
    return make_model(model_root, "qwen3", seed=8, tie_word_embeddings=False)


def qwen3_reranker_overrides(path) -> dict:
    """vLLM's documented hf_overrides for the original Qwen3-Reranker, with two of this vocabulary's tokens."""
    no, yes = vocab_tokens(path, 150, 250)
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
            "is_original_qwen3_reranker": True}


def test_from_2_way_softmax_is_the_lm_yes_minus_no(tied_lm):
    no, yes = 150, 250
    logits = hf_last_logits(tied_lm, [QUERY + d for d in DOCS])  # use_sep_token false: one text
    want = (logits[:, yes] - logits[:, no]).sigmoid()
    # (also the softmax of the two logits' "yes": what the model was trained to say)
    torch.testing.assert_close(want, logits[:, [no, yes]].softmax(-1)[:, 1])
    llm = LLM(str(tied_lm), dtype="float32", max_num_seqs=4, hf_overrides=qwen3_reranker_overrides(tied_lm))
    assert (llm.engine.pooling_task, llm.engine.model_config.num_labels, llm.engine.is_cross_encoder) == \
        ("classify", 1, True)
    assert [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)] == pytest.approx(want.tolist(), abs=1e-5)
    probs = [o.outputs.probs[0] for o in llm.classify([QUERY + d for d in DOCS], use_tqdm=False)]
    assert probs == pytest.approx(want.tolist(), abs=1e-5)
    assert max(want) - min(want) > 0.05  # the documents score apart


def test_convert_classify_no_post_processing_is_the_lm_logits(untied_lm):
    ids = [100, 200, 300]
    want = hf_last_logits(untied_lm, DOCS)[:, ids]
    llm = LLM(str(untied_lm), dtype="float32", max_num_seqs=4, convert="classify",
              hf_overrides={"classifier_from_token": vocab_tokens(untied_lm, *ids), "method": "no_post_processing"})
    assert (llm.engine.runner_type, llm.engine.model_config.num_labels, llm.engine.is_cross_encoder) == \
        ("pooling", 3, False)
    raw = llm.classify(DOCS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), want, atol=1e-5, rtol=1e-4)
    probs = llm.classify(DOCS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in probs]), want.softmax(-1), atol=1e-5, rtol=1e-4)


def test_server_score_rerank_classify(tied_lm):
    """`--task score` (older vLLM's spelling of --convert classify) with the documented overrides."""
    from test_server import ServerThread
    overrides = qwen3_reranker_overrides(tied_lm)
    del overrides["architectures"]
    logits = hf_last_logits(tied_lm, [QUERY + d for d in DOCS])
    want = (logits[:, 250] - logits[:, 150]).sigmoid().tolist()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    with ServerThread(tied_lm, "--task", "score", "--hf-overrides", json.dumps(overrides),
                      "--max-num-seqs", "4") as server:
        def post(path, body):
            r = httpx.post(server.url + path, json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()
        assert [d["score"] for d in post("/score", {"queries": QUERY, "documents": DOCS})["data"]] == \
            pytest.approx(want, abs=1e-5)
        results = post("/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})["results"]
        assert [r["index"] for r in results] == order[:2]
        assert [r["relevance_score"] for r in results] == pytest.approx([want[i] for i in order[:2]], abs=1e-5)
        data = post("/classify", {"input": [QUERY + DOCS[0]]})["data"][0]
        assert data["num_classes"] == 1 and data["probs"] == pytest.approx([want[0]], abs=1e-5)


@pytest.mark.parametrize("kwargs,says", [
    (dict(convert="classify", hf_overrides={"classifier_from_token": ["no-such-token", "<|im_end|>"],
                                            "method": "from_2_way_softmax"}),
     "classifier_from_token: 'no-such-token' is not a token"),
    (dict(convert="classify", hf_overrides={"classifier_from_token": ["<|im_end|>"], "method": "from_3_way"}),
     "method must be one of from_2_way_softmax, no_post_processing"),
    (dict(convert="classify", hf_overrides={"classifier_from_token": ["<|im_end|>"]}),  # vLLM asserts a method
     "method must be one of"),
    (dict(convert="classify", hf_overrides={"classifier_from_token": ["<|im_end|>"], "method": "from_2_way_softmax"}),
     "from_2_way_softmax takes two classifier_from_token tokens"),
    (dict(convert="classify", hf_overrides={"is_original_qwen3_reranker": True}),
     "is_original_qwen3_reranker needs classifier_from_token of two tokens"),
    (dict(convert="embed", hf_overrides={"classifier_from_token": ["<|im_end|>", "<|im_start|>"],
                                         "method": "from_2_way_softmax"}),
     "classifier_from_token builds a classifier's score head"),
    (dict(runner="pooling", hf_overrides={"classifier_from_token": ["<|im_end|>", "<|im_start|>"]}),
     "classifier_from_token builds a classifier's score head"),
    (dict(convert="classify", task="embed"), "ask for different pooling tasks"),
    (dict(convert="classify"), "checkpoint is missing weights for score"),  # no tokens, no score.weight
])
def test_bad_overrides_are_one_line_errors(tied_lm, kwargs, says):
    with pytest.raises(ValueError) as e:
        LLM(str(tied_lm), dtype="float32", max_num_seqs=2, **kwargs)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
