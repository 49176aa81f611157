"""ColBERT (vLLM's HF_ColBERT: colbert-ir/colbertv2.0, answerai-colbert-small) against transformers' BertModel
with the checkpoint's bias-free projection applied here: every token's row projected and L2-normalized
(token_embed, its only task), and pairs scored by late interaction (MaxSim: each query token's best dot product
with a document token, summed) on LLM.score, /score and /rerank."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from nanoserve.engine import LLM, InvalidInput, PoolingParams
from nanoserve.model import ModelLoadError
from test_encoder import DOCS, MAX_POSITIONS, QUERY, TEXTS, _init, _sizes, _tokenizer

DIM = 8  # the projection's rows (colbertv2.0's 128)


def _save_colbert(out, linear_name: str = "linear.weight", config_extra: dict | None = None, seed: int = 7,
                  both: bool = False):
    """HF_ColBERT as colbert-ai saves it: BertModel under "bert." (its pooler too) and ``linear.weight``
    (``both``: and a colbert_linear.weight beside it)."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel
    bert = _init(BertModel(BertConfig(**_sizes())), seed)
    torch.manual_seed(seed + 1)
    tensors = {"bert." + k: v.contiguous() for k, v in bert.state_dict().items()}
    for name in ("linear.weight", "colbert_linear.weight") if both else (linear_name,) if linear_name else ():
        tensors[name] = torch.randn(DIM, bert.config.hidden_size) * 0.3
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    bert.config.architectures = ["HF_ColBERT"]
    bert.config.save_pretrained(out)
    if config_extra:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **config_extra}))
    _tokenizer(out)
    return out


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory):
    return _save_colbert(tmp_path_factory.mktemp("colbert") / "m")


def hf_colbert_rows(path, texts, normalize: bool = True) -> list[torch.Tensor]:
    """transformers' BertModel on each text, then the checkpoint's projection (and L2 norm) on every row."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertModel
    model = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    weight = load_file(str(path / "model.safetensors"))["linear.weight"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        rows = [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0] @ weight.T for t in texts]
    return [torch.nn.functional.normalize(r, dim=-1) if normalize else r for r in rows]


def maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    return sum(max(float(qi @ dj) for dj in d) for qi in q)  # written out, not the engine's matmul


def test_colbert_token_vectors_and_late_interaction_score(colbert_dir):
    llm = LLM(str(colbert_dir), dtype="float32")
    assert (llm.engine.pooling_task, llm.engine.supported_pooling_tasks) == ("token_embed", ("token_embed",))
    want = hf_colbert_rows(colbert_dir, TEXTS)
    outs = llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    for o, w in zip(outs, want):
        assert o.outputs.data.shape == w.shape == (w.shape[0], DIM)
        torch.testing.assert_close(o.outputs.data, w, atol=1e-5, rtol=1e-4)
    raw = llm.encode(TEXTS[:1], PoolingParams(use_activation=False), pooling_task="token_embed", use_tqdm=False)
    torch.testing.assert_close(raw[0].outputs.data, hf_colbert_rows(colbert_dir, TEXTS[:1], False)[0],
                               atol=1e-5, rtol=1e-4)
    q, docs = hf_colbert_rows(colbert_dir, [QUERY])[0], hf_colbert_rows(colbert_dir, DOCS)
    scores = [s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)]
    assert scores == pytest.approx([maxsim(q, d) for d in docs], abs=1e-4)
    assert len(set(round(s, 3) for s in scores)) == len(DOCS)  # the documents score apart
    n_to_n = llm.score(DOCS, DOCS[::-1], use_tqdm=False)  # N:N, each text its own rows
    assert [s.outputs.score for s in n_to_n] == pytest.approx([maxsim(a, b) for a, b in zip(docs, docs[::-1])],
                                                              abs=1e-4)
    with pytest.raises(InvalidInput, match="Embedding API is not supported by this model"):
        llm.embed(TEXTS, use_tqdm=False)


@pytest.mark.parametrize("linear_name, extra, error, says", [
    ("", None, ModelLoadError, "needs its projection \\(a tensor named linear.weight\\)"),
    ("linear.weight", {"dim": DIM + 1}, ModelLoadError, f"'linear.weight' has shape \\({DIM}, 32\\), config.json "
                                                         f"makes it \\({DIM + 1}, 32\\)"),
    ("linear.weight", {"dim": "8"}, ModelLoadError, "dim '8' must be a positive integer"),
    ("both", None, ModelLoadError, "holds 'colbert_linear.weight' and 'linear.weight', two projections"),
])
def test_colbert_checkpoint_refusals(tmp_path, linear_name, extra, error, says):
    """("both": linear.weight and colbert_linear.weight, which vLLM loads by its reading order, the last kept.)"""
    path = _save_colbert(tmp_path / "m", linear_name, extra, both=linear_name == "both")
    with pytest.raises(error, match=says):
        LLM(str(path), dtype="float32")


def test_colbert_named_dim_and_projection_name(tmp_path, colbert_dir):
    """config.json's colbert_dim sizes the projection; vLLM's other name for it, colbert_linear.weight, loads."""
    path = _save_colbert(tmp_path / "m", "colbert_linear.weight", {"colbert_dim": DIM})
    rows = LLM(str(path), dtype="float32").encode(["rain"], pooling_task="token_embed", use_tqdm=False)
    assert rows[0].outputs.data.shape == (3, DIM)
    # a dim of 0 is no size (vLLM's `colbert_dim or dim or projection_dim`): the tensor's rows are
    path = _save_colbert(tmp_path / "dim0", config_extra={"dim": 0, "projection_dim": 0})
    rows = LLM(str(path), dtype="float32").encode(["rain"], pooling_task="token_embed", use_tqdm=False)
    assert rows[0].outputs.data.shape == (3, DIM)
    with pytest.raises(ValueError, match=r"Unsupported task: 'embed' Supported tasks: \['token_embed'\]"):
        LLM(str(colbert_dir), dtype="float32", pooler_config={"task": "embed"})


def test_server_colbert_score_rerank_and_pooling(colbert_dir):
    from test_server import ServerThread
    q, docs = hf_colbert_rows(colbert_dir, [QUERY])[0], hf_colbert_rows(colbert_dir, DOCS)
    want = [maxsim(q, d) for d in docs]
    with ServerThread(colbert_dir, "--max-num-seqs", "4", "--max-model-len", str(MAX_POSITIONS)) as s:
        r = httpx.post(s.url + "/score", json={"queries": QUERY, "documents": DOCS}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
        assert body["usage"]["prompt_tokens"] == len(q) + sum(len(d) for d in docs)  # each text once
        r = httpx.post(s.url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}, timeout=30)
        assert r.status_code == 200, r.text
        best = sorted(range(len(DOCS)), key=lambda i: want[i], reverse=True)[:2]
        assert [x["index"] for x in r.json()["results"]] == best
        assert [x["relevance_score"] for x in r.json()["results"]] == pytest.approx([want[i] for i in best], abs=1e-4)
        r = httpx.post(s.url + "/pooling", json={"input": TEXTS[:2]}, timeout=30)
        assert r.status_code == 200, r.text
        for d, w in zip(r.json()["data"], hf_colbert_rows(colbert_dir, TEXTS[:2])):
            torch.testing.assert_close(torch.tensor(d["data"]), w, atol=1e-5, rtol=1e-4)
        for path, body, status, says in (
                ("/v1/embeddings", {"input": "rain"}, 404, "serves the token_embed task"),  # vLLM: no route
                ("/pooling", {"input": "rain", "task": "embed"}, 400,
                 "Unsupported task: 'embed' Supported tasks: ['token_embed']"),
                ("/score", {"queries": ["a", "b"], "documents": ["a", "b", "c"]}, 400,
                 "Input lengths must be either 1:1, 1:N or N:N")):
            r = httpx.post(s.url + path, json=body, timeout=30)
            assert r.status_code == status and says in r.json()["error"]["message"], (path, r.text)
