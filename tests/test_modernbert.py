"""ModernBERT on the pooling runner (vLLM's modernbert.py: gte-modernbert-base, modernbert-embed,
gte-reranker-modernbert-base) against transformers' ModernBertModel and ModernBert*Classification:
CLS and MEAN embeddings, the classifier's head on its CLS or mean pooling, a token classifier's labels, with
prompts longer than the local layers' window and of different lengths in one step."""
from __future__ import annotations

import pytest
import torch

from nanoserve.engine import LLM
from test_encoder import QUERY, WORDS, one_step_spy

LONG = " ".join(WORDS[:14])  # 16 tokens with [CLS] and [SEP]: far past the local layers' 2 either side
TEXTS = ["the cat sat on a mat", LONG, "rain", "stock prices fell today the dog ran"]
DOCS = ["a small feline", "a stock index", "the cat sat down on a mat today"]


def _sizes(**extra):
    """Three layers, the middle one local (global_attn_every_n_layers 2), attending 2 tokens either side."""
    return dict(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=40, max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4,
                pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3, **extra)


def _save(model, out):
    """save_pretrained, with a WordPiece tokenizer over WORDS that, as ModernBERT's, gives no token types."""
    from transformers import BertTokenizerFast
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1 if name.endswith("norm.weight") else 0, 0.3 if p.dim() >= 2 else 0.2)
    model.eval().save_pretrained(out)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)},
                      model_input_names=["input_ids", "attention_mask"]).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def mb_dir(tmp_path_factory):
    from transformers import ModernBertConfig, ModernBertModel
    return _save(ModernBertModel(ModernBertConfig(**_sizes(norm_bias=True))), tmp_path_factory.mktemp("mb") / "emb")


@pytest.fixture(scope="module", params=["cls", "mean"])
def mb_cls_dir(request, tmp_path_factory):
    """A one-label reranker (gte-reranker-modernbert's shape) pooling by CLS, and by the mean."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification
    config = ModernBertConfig(**_sizes(num_labels=1, classifier_pooling=request.param, classifier_bias=True))
    return _save(ModernBertForSequenceClassification(config), tmp_path_factory.mktemp("mb") / request.param)


def hf_rows(path, auto_class: str, texts=None, pairs=None, **config) -> list[torch.Tensor]:
    """transformers' forward of each text (or pair) alone: its last hidden state's rows, or its logits."""
    import transformers
    from transformers import AutoTokenizer
    model = getattr(transformers, auto_class).from_pretrained(path, dtype=torch.float32, **config).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = [tokenizer(t, return_tensors="pt") for t in texts] if texts else \
        [tokenizer(q, d, return_tensors="pt") for q, d in pairs]
    with torch.no_grad():
        out = [model(input_ids=e["input_ids"]) for e in encoded]
    return [o.logits[0] if hasattr(o, "logits") else o.last_hidden_state[0] for o in out]


@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_modernbert_embeddings_in_one_step(mb_dir, pooling):
    rows = hf_rows(mb_dir, "ModernBertModel", TEXTS)
    want = [torch.nn.functional.normalize(h[0] if pooling == "CLS" else h.mean(0), dim=0) for h in rows]
    # the local layer weighs: every layer global, the long prompt's vector is another
    everywhere = hf_rows(mb_dir, "ModernBertModel", [LONG], layer_types=["full_attention"] * 3)[0]
    assert not torch.allclose(everywhere, rows[1], atol=1e-3)
    llm = LLM(str(mb_dir), dtype="float32", **({} if pooling == "CLS" else {"pooler_config": {"pooling_type": "MEAN"}}))
    assert (llm.engine.pooler_config.pooling_type, llm.engine.max_model_len) == (pooling, 64)  # CLS: vLLM's default
    steps = one_step_spy(llm)
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert steps == [len(TEXTS)]
    for o, w in zip(outs, want):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), w, atol=1e-5, rtol=1e-4)


def test_modernbert_reranker_head_on_its_pooling(mb_cls_dir):
    """The head (dense, GELU, norm, classifier) on the CLS row or on the mean of the rows, as
    classifier_pooling says; a pooler config asking for the other is refused."""
    pairs = [(QUERY, d) for d in DOCS]
    want = torch.stack(hf_rows(mb_cls_dir, "ModernBertForSequenceClassification", pairs=pairs))[:, 0].sigmoid()
    llm = LLM(str(mb_cls_dir), dtype="float32")
    head = llm.engine.model_config.modernbert.pooling
    assert llm.engine.pooler_config.pooling_type == head and llm.engine.is_cross_encoder
    steps = one_step_spy(llm)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    assert steps == [len(DOCS)]
    assert got == pytest.approx(want.tolist(), abs=1e-5)
    assert max(got) - min(got) > 0.01  # far above the tolerance: the pairs score apart
    other = "CLS" if head == "MEAN" else "MEAN"
    with pytest.raises(ValueError, match=f"classifier head reads .*got pooling_type {other}"):
        LLM(str(mb_cls_dir), dtype="float32", pooler_config={"pooling_type": other})


def test_modernbert_token_classify_is_the_classifier_on_each_row(mb_cls_dir):
    """vLLM's token_classify on ModernBertForSequenceClassification: the classifier alone on every row."""
    from transformers import AutoTokenizer, ModernBertForSequenceClassification
    model = ModernBertForSequenceClassification.from_pretrained(mb_cls_dir, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(mb_cls_dir)(LONG, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model.classifier(model.model(ids).last_hidden_state[0]).sigmoid()
    llm = LLM(str(mb_cls_dir), dtype="float32", pooler_config={"task": "token_classify"})
    got = llm.encode(LONG, pooling_task="token_classify", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_modernbert_token_classifier_labels_each_token(tmp_path):
    """ModernBertForTokenClassification: its head (dense, activation, norm) and classifier on every row, softmax
    over its labels; token_classify is its one task (vLLM's), so /classify's is refused."""
    from transformers import AutoTokenizer, ModernBertConfig, ModernBertForTokenClassification

    from nanoserve.engine import InvalidInput
    path = _save(ModernBertForTokenClassification(ModernBertConfig(**_sizes(num_labels=3))), tmp_path)
    ids = AutoTokenizer.from_pretrained(path)(LONG, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = ModernBertForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()(
            input_ids=ids).logits[0].softmax(-1)
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.supported_pooling_tasks == ("token_classify",)
    got = llm.encode(LONG, pooling_task="token_classify", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidInput, match="Classification API is not supported"):
        llm.classify(TEXTS, use_tqdm=False)


def test_modernbert_one_label_token_classifier_server_says_why_it_does_not_score(tmp_path):
    """A one-label token classifier is no cross-encoder: /score's 404 names its token_classify task (it said
    "served for a classifier with num_labels == 1; this one has 1")."""
    import httpx
    from transformers import ModernBertConfig, ModernBertForTokenClassification

    from test_server import ServerThread
    path = _save(ModernBertForTokenClassification(ModernBertConfig(**_sizes(num_labels=1))), tmp_path)
    with ServerThread(path, "--max-model-len", "64") as s:
        for route, body in (("/score", {"queries": "rain", "documents": ["rain"]}),
                            ("/rerank", {"query": "rain", "documents": ["rain"]})):
            r = httpx.post(s.url + route, json=body, timeout=30)
            assert r.status_code == 404 and "serves the token_classify task" in r.json()["error"]["message"], r.text


def test_modernbert_config_as_transformers_4_saved_it():
    """Released checkpoints' config.json (global_attn_every_n_layers, global_/local_rope_theta, no layer_types)
    reads as transformers 5's own; bad values are refused in one line."""
    from transformers import ModernBertConfig

    from nanoserve.model import ModelConfig, ModelLoadError
    old = {"architectures": ["ModernBertModel"], **_sizes(global_rope_theta=80_000.0, local_rope_theta=5_000.0)}
    new = ModernBertConfig(**_sizes(global_rope_theta=80_000.0, local_rope_theta=5_000.0)).to_dict()
    assert "layer_types" in new and "global_rope_theta" not in new
    got = [ModelConfig.from_dict(c) for c in (old, {**new, "architectures": ["ModernBertModel"]})]
    assert got[0] == got[1]
    assert (got[0].rope_theta, got[0].modernbert.local_rope_theta, got[0].modernbert.local_layers,
            got[0].modernbert.window) == (80_000.0, 5_000.0, (1,), 2)
    for bad, says in (({"classifier_pooling": "max"}, "classifier_pooling"),
                      ({"layer_types": ["full_attention"]}, "layer_types"),
                      ({"global_attn_every_n_layers": 0}, "global_attn_every_n_layers"),
                      ({"hidden_activation": "tanh"}, "hidden_activation"),
                      ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope_type 'yarn'")):
        with pytest.raises(ModelLoadError, match=says):
            ModelConfig.from_dict({**old, **bad})


ENCODER_CONFIGS = {  # the least config.json each architecture reads
    "ModernBertModel": _sizes(),
    "HF_ColBERT": dict(vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=40,
                       max_position_embeddings=64),
    "Gemma3TextModel": dict(use_bidirectional_attention=True, vocab_size=30, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=40,
                            max_position_embeddings=64, sliding_window=8),
}


@pytest.mark.parametrize("arch, bad, says", [
    ("ModernBertModel", {"norm_eps": "x"}, "norm_eps 'x' must be a positive number"),
    ("ModernBertModel", {"rope_parameters": [1]}, r"rope_parameters \[1\] must be an object"),
    ("ModernBertModel", {"rope_parameters": {"full_attention": [1]}}, "rope_parameters.full_attention .* object"),
    ("ModernBertModel", {"rope_parameters": {"sliding_attention": {"rope_theta": "x"}}},
     "rope_parameters.sliding_attention.rope_theta 'x' must be a positive number"),
    ("ModernBertModel", {"num_hidden_layers": "3"}, "num_hidden_layers '3': sizes must be positive integers"),
    ("ModernBertModel", {"hidden_activation": ["gelu"]}, r"hidden_activation \['gelu'\] must be a string"),
    ("ModernBertModel", {"matryoshka_dimensions": 8}, "matryoshka_dimensions 8 must be a list"),
    ("HF_ColBERT", {"layer_norm_eps": "x"}, "layer_norm_eps 'x' must be a positive number"),
    ("HF_ColBERT", {"hidden_act": ["gelu"]}, r"hidden_act \['gelu'\] must be a string"),
    ("Gemma3TextModel", {"rms_norm_eps": "x"}, "rms_norm_eps 'x' must be a positive number"),
    ("Gemma3TextModel", {"rope_parameters": [1]}, r"rope_parameters \[1\] must be an object"),
    ("Gemma3TextModel", {"sliding_window": "8"}, "sliding_window '8' must be a non-negative integer"),
    ("Gemma3TextModel", {"rope_local_base_freq": "x"}, "rope_local_base_freq 'x' must be a positive number"),
    ("Gemma3TextModel", {"attention_bias": True}, "^Gemma3TextModel with attention_bias"),
    ("Gemma3TextModel", {"hidden_activation": "gelu"}, "^Gemma3TextModel with hidden_activation 'gelu'"),
])
def test_a_config_value_of_the_wrong_kind_is_refused_by_its_key(tmp_path, arch, bad, says):
    """One line naming the key and what it must be (not a Python exception's text), under the architecture
    config.json names."""
    import json

    from nanoserve.model import ModelConfig, ModelLoadError
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], **ENCODER_CONFIGS[arch], **bad}))
    with pytest.raises(ModelLoadError, match=says) as e:
        ModelConfig.from_dir(tmp_path)
    assert "Error" not in str(e.value) and "Gemma3ForCausalLM" not in str(e.value)
