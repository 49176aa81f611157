"""Encoder models on the pooling runner (vLLM's bert.py and roberta.py: BAAI/bge-*, e5, all-MiniLM, gte,
ms-marco cross-encoders, bge-reranker) against transformers' own BertModel, XLMRobertaModel and
*ForSequenceClassification: CLS and MEAN pooling of the last hidden state, normalized; classifier logits
and their activation; a cross-encoder's pair with its token types. Prompts of different lengths share one
step (bidirectional attention must not leak between them), and a prompt at max_model_len runs whole while
one past it is refused."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from nanoserve.engine import LLM, InvalidInput, PoolingParams

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "stock", "prices", "fell", "today", "rain", "is",
         "wet", "small", "feline", "index", "what", "down"]
TEXTS = ["the cat sat on a mat", "rain", "stock prices fell today the dog ran", "a small wet dog"]
QUERY, DOCS = "what is a cat", ["a small feline", "a stock index", "the cat sat down"]
MAX_POSITIONS = 24  # BERT's max_model_len; RoBERTa's is 2 (padding_idx + 1) less
MAX_SEQ_LENGTH = 20  # sentence-transformers' (sentence_bert_config.json), which vLLM takes as max_model_len


def _tokenizer(out):
    """A WordPiece tokenizer over WORDS (BERT's [CLS] a [SEP] b [SEP] pairs, with token types), built here."""
    from transformers import BertTokenizerFast
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(out)


def _save(model, out, prefix: str = ""):
    """save_pretrained, or (prefix) the tensors under transformers' "bert." names, as a BertForX's base saves."""
    out.mkdir(parents=True, exist_ok=True)
    if not prefix:
        model.save_pretrained(out)
    else:
        from safetensors.torch import save_file
        save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
        model.config.save_pretrained(out)
    _tokenizer(out)
    return out


def _init(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1 if name.endswith("LayerNorm.weight") else 0, 0.3 if p.dim() >= 2 else 0.2)
    return model.eval()


def _sizes(**extra):
    return dict(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48, max_position_embeddings=MAX_POSITIONS, **extra)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """BertModel as sentence-transformers saves it (no "bert." prefix), MEAN pooling and Normalize modules."""
    from transformers import BertConfig, BertModel
    out = _save(_init(BertModel(BertConfig(**_sizes(hidden_act="gelu", layer_norm_eps=1e-5))), 1),
                tmp_path_factory.mktemp("enc") / "bert-st")
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH}))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                               "pooling_mode_cls_token": False,
                                                               "pooling_mode_mean_tokens": True}))
    return out


@pytest.fixture(scope="module")
def bert_prefixed_dir(bert_dir, tmp_path_factory):
    """The same BertModel's tensors under "bert." names and no sentence-transformers files: CLS, as vLLM's default."""
    from transformers import BertModel
    return _save(BertModel.from_pretrained(bert_dir), tmp_path_factory.mktemp("enc") / "bert-prefixed", "bert.")


@pytest.fixture(scope="module")
def xlmr_dir(tmp_path_factory):
    from transformers import XLMRobertaConfig, XLMRobertaModel
    return _save(_init(XLMRobertaModel(XLMRobertaConfig(**_sizes(pad_token_id=1))), 2),
                 tmp_path_factory.mktemp("enc") / "xlmr")


@pytest.fixture(scope="module")
def bert_ce_dir(tmp_path_factory):
    """A one-label BertForSequenceClassification: a cross-encoder (ms-marco-MiniLM's kind)."""
    from transformers import BertConfig, BertForSequenceClassification
    model = _init(BertForSequenceClassification(BertConfig(**_sizes(num_labels=1))), 3)
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight.normal_(0, 2.0)  # the pair's types weigh on its score
        model.bert.pooler.dense.weight.normal_(0, 0.05)  # tanh unsaturated: the pairs score apart
    return _save(model, tmp_path_factory.mktemp("enc") / "bert-ce")


@pytest.fixture(scope="module")
def roberta_cls_dir(tmp_path_factory):
    from transformers import RobertaConfig, RobertaForSequenceClassification
    return _save(_init(RobertaForSequenceClassification(RobertaConfig(**_sizes(num_labels=3, pad_token_id=1))), 4),
                 tmp_path_factory.mktemp("enc") / "roberta-cls")


def hf_outputs(path, auto_class: str, texts=None, pairs=None) -> list[torch.Tensor]:
    """transformers' own forward, each text (or pair, with its token types) on its own."""
    import transformers
    from transformers import AutoTokenizer
    model = getattr(transformers, auto_class).from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = [tokenizer(t, return_tensors="pt") for t in texts] if texts else \
        [tokenizer(q, d, return_tensors="pt") for q, d in pairs]
    with torch.no_grad():
        out = [model(**e) for e in encoded]
    return [o.logits[0] if hasattr(o, "logits") else o.last_hidden_state[0] for o in out]


def one_step_spy(llm) -> list[int]:
    """The number of prompts in each step the engine runs (to see that a batch shared one)."""
    sizes, execute = [], llm.engine.runner.execute_model

    def spy(seqs):
        sizes.append(len(seqs))
        return execute(seqs)
    llm.engine.runner.execute_model = spy
    return sizes


def test_bert_mean_normalized_as_sentence_transformers(bert_dir):
    want = [torch.nn.functional.normalize(h.mean(0), dim=0) for h in hf_outputs(bert_dir, "BertModel", TEXTS)]
    llm = LLM(str(bert_dir), dtype="float32")  # runner auto: pooling, for an encoder
    assert (llm.engine.runner_type, llm.engine.pooler_config.pooling_type) == ("pooling", "MEAN")
    assert llm.engine.max_model_len == MAX_SEQ_LENGTH
    assert llm.engine.kv_plan.bytes_per_block == 0 and not llm.engine.config.enable_prefix_caching
    steps = one_step_spy(llm)
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert steps == [len(TEXTS)]  # every prompt, whole, in one step
    for o, w in zip(outs, want):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), w, atol=1e-5, rtol=1e-4)
    raw = llm.encode(TEXTS[:1], PoolingParams(use_activation=False), pooling_task="embed", use_tqdm=False)
    torch.testing.assert_close(raw[0].outputs.data, hf_outputs(bert_dir, "BertModel", TEXTS[:1])[0].mean(0),
                               atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidInput, match="Classification API is not supported"):
        llm.classify(TEXTS, use_tqdm=False)


def test_prompts_wait_whole_for_a_step_with_room(bert_dir):
    """A step's budget (24 tokens) too small for all four prompts (26): the last waits for the next
    step, whole, where a decoder's would be chunked (vLLM's encoders run without chunked prefill)."""
    want = [torch.nn.functional.normalize(h.mean(0), dim=0) for h in hf_outputs(bert_dir, "BertModel", TEXTS)]
    llm = LLM(str(bert_dir), dtype="float32", max_num_batched_tokens=MAX_POSITIONS)
    steps = one_step_spy(llm)
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert steps == [3, 1]
    for o, w in zip(outs, want):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), w, atol=1e-5, rtol=1e-4)


def test_bert_prefixed_cls_and_max_model_len(bert_prefixed_dir):
    llm = LLM(str(bert_prefixed_dir), dtype="float32")
    assert llm.engine.pooler_config.pooling_type == "CLS" and llm.engine.max_model_len == MAX_POSITIONS
    longest = [2] + [5 + i % len(WORDS) for i in range(MAX_POSITIONS - 2)] + [3]  # [CLS] ... [SEP]: every position
    prompts = [longest, "rain", "the cat sat"]
    want = [torch.nn.functional.normalize(h[0], dim=0) for h in
            hf_outputs(bert_prefixed_dir, "BertModel", ["rain", "the cat sat"])]
    from transformers import BertModel
    model = BertModel.from_pretrained(bert_prefixed_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want.insert(0, torch.nn.functional.normalize(model(torch.tensor([longest])).last_hidden_state[0, 0], dim=0))
    outs = llm.embed(prompts, use_tqdm=False)
    for o, w in zip(outs, want):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), w, atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidInput, match=str(MAX_POSITIONS)):
        llm.embed([longest + [5]], use_tqdm=False)


def test_xlm_roberta_cls_with_position_offset(xlmr_dir):
    llm = LLM(str(xlmr_dir), dtype="float32")
    assert llm.engine.max_model_len == MAX_POSITIONS - 2  # positions start at padding_idx + 1
    want = [torch.nn.functional.normalize(h[0], dim=0) for h in hf_outputs(xlmr_dir, "XLMRobertaModel", TEXTS)]
    outs = llm.embed(TEXTS, use_tqdm=False)
    for o, w in zip(outs, want):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), w, atol=1e-5, rtol=1e-4)


def test_roberta_classifier_softmax(roberta_cls_dir):
    want = torch.stack(hf_outputs(roberta_cls_dir, "RobertaForSequenceClassification", TEXTS))
    llm = LLM(str(roberta_cls_dir), dtype="float32")
    assert llm.engine.pooling_task == "classify"
    got = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(got, want.softmax(-1), atol=1e-5, rtol=1e-4)


def test_bert_cross_encoder_score_with_token_types(bert_ce_dir):
    pairs = [(QUERY, d) for d in DOCS]
    want = torch.stack(hf_outputs(bert_ce_dir, "BertForSequenceClassification", pairs=pairs))[:, 0].sigmoid()
    llm = LLM(str(bert_ce_dir), dtype="float32")
    steps = one_step_spy(llm)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    assert steps == [len(DOCS)]
    assert got == pytest.approx(want.tolist(), abs=1e-5)
    assert max(got) - min(got) > 0.01  # far above the tolerance: the pairs score apart
    # the pair's second text is token type 1: as one type it would score otherwise
    from transformers import AutoTokenizer, BertForSequenceClassification
    model = BertForSequenceClassification.from_pretrained(bert_ce_dir, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(bert_ce_dir)(QUERY, DOCS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert float(model(ids).logits[0, 0].sigmoid()) != pytest.approx(got[0], abs=1e-3)


SEP_TEXT = QUERY + " [SEP] " + DOCS[0]  # one text with a separator inside: no pair, every token type 0
SEP_TEMPLATE = "{{ messages[0].content }} [SEP] {{ messages[1].content }}"  # renders QUERY, DOCS[0] as SEP_TEXT


def test_cross_encoder_single_text_with_a_separator_is_one_token_type(bert_ce_dir):
    """vLLM passes the tokenizer's token types: a single text's (a /classify text, token ids, a score
    template's rendering) are all 0, [SEP] inside or not; only a text pair's second text is type 1."""
    want = hf_outputs(bert_ce_dir, "BertForSequenceClassification", [SEP_TEXT])[0][0].sigmoid().item()
    as_pair = hf_outputs(bert_ce_dir, "BertForSequenceClassification", pairs=[(QUERY, DOCS[0])])[0][0].sigmoid()
    assert abs(as_pair.item() - want) > 0.01  # the types weigh: read as a pair it would score otherwise
    llm = LLM(str(bert_ce_dir), dtype="float32")
    ids = llm.get_tokenizer()(SEP_TEXT)["input_ids"]
    got = [o.outputs.probs[0] for o in llm.classify([SEP_TEXT, ids], use_tqdm=False)]
    assert got == pytest.approx([want, want], abs=1e-5)
    score = llm.score(QUERY, DOCS[0], chat_template=SEP_TEMPLATE, use_tqdm=False)[0].outputs.score
    assert score == pytest.approx(want, abs=1e-5)


def test_cross_encoder_query_with_a_literal_separator_keeps_the_tokenizers_types(bert_ce_dir):
    """A query holding "[SEP]" is still all the pair's first text (type 0): types come from the tokenizer."""
    query = "what [SEP] is a cat"
    want = torch.stack(hf_outputs(bert_ce_dir, "BertForSequenceClassification", pairs=[(query, d) for d in DOCS]))
    got = [o.outputs.score for o in LLM(str(bert_ce_dir), dtype="float32").score(query, DOCS, use_tqdm=False)]
    assert got == pytest.approx(want[:, 0].sigmoid().tolist(), abs=1e-5)


def test_pair_token_types_are_cut_and_padded_with_the_ids(bert_ce_dir):
    """A request that names a truncation side cuts the pair's ids after tokenizing: its types are cut the
    same way, and padded with the last type (vLLM's); a pair that keeps no type 1 carries none."""
    from nanoserve.engine import PairPrompt
    engine = LLM(str(bert_ce_dir), dtype="float32").engine
    pair = PairPrompt([2, 5, 3, 6, 7, 3], [0, 0, 0, 1, 1, 1])
    cut = PoolingParams(truncate_prompt_tokens=4)
    left = engine.process_pooling_prompt(pair, cut, truncation_side="left")
    assert (left.token_ids, left.token_type_ids) == ([3, 6, 7, 3], [0, 1, 1, 1])
    right = engine.process_pooling_prompt(pair, cut, truncation_side="right")
    assert right.token_type_ids == [0, 0, 0, 1]
    first = engine.process_pooling_prompt(pair, PoolingParams(truncate_prompt_tokens=3), truncation_side="right")
    assert (first.token_ids, first.token_type_ids) == ([2, 5, 3], None)
    padded = engine.process_pooling_prompt(pair, PoolingParams(), padding="max_length")
    assert padded.token_type_ids == [0, 0, 0] + [1] * (MAX_POSITIONS - 3)


def test_a_preempted_pair_is_recomputed_with_its_token_types(bert_ce_dir):
    """Preemption starts a request over from position 0: its pair's types go with it."""
    from nanoserve.scheduler import SchedulerOutput
    want = hf_outputs(bert_ce_dir, "BertForSequenceClassification", pairs=[(QUERY, DOCS[0])])[0][0].sigmoid()
    engine = LLM(str(bert_ce_dir), dtype="float32").engine
    rid = engine.add_pooling_request(engine.cross_encoder_prompt(QUERY, DOCS[0]), PoolingParams())
    assert [s.request.request_id for s in engine.scheduler.schedule().scheduled] == [rid]
    engine.scheduler._preempt(engine.scheduler.requests[rid], SchedulerOutput())  # before its step ran
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert engine.stats()["num_preemptions"] == 1
    assert outs[-1].outputs.data.item() == pytest.approx(want.item(), abs=1e-5)  # (the activated score)


def test_bert_token_classify_is_the_classifier_on_each_row(bert_ce_dir, roberta_cls_dir):
    """vLLM's token_classify on BertForSequenceClassification: the classifier on every token's row, without
    BERT's pooler (dense, tanh: the CLS pooling's); RoBERTa's head is its classifier whole."""
    from transformers import AutoTokenizer, BertForSequenceClassification, RobertaForSequenceClassification
    for path, cls, head in ((bert_ce_dir, BertForSequenceClassification, lambda m, h: m.classifier(h).sigmoid()),
                            (roberta_cls_dir, RobertaForSequenceClassification,
                             lambda m, h: m.classifier(h[:, None].expand(-1, 2, -1)).softmax(-1))):
        model = cls.from_pretrained(path, dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(path)(TEXTS[0], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want = head(model, model.base_model(ids).last_hidden_state[0])
        llm = LLM(str(path), dtype="float32", pooler_config={"task": "token_classify"})
        got = llm.encode(TEXTS[0], pooling_task="token_classify", use_tqdm=False)[0].outputs.data
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs, says", [
    (dict(max_num_batched_tokens=16), "max_num_batched_tokens \\(16\\) is smaller than max_model_len \\(24\\)"),
    (dict(enable_lora=True), "LoRA adapters are not supported for BertModel"),
    (dict(tensor_parallel_size=2), "runs on one rank only"),
    (dict(runner="generate"), "an encoder model: it serves the pooling runner only"),
    (dict(task="generate"), "an encoder model: it serves the pooling runner only"),  # older vLLM's spelling
])
def test_encoder_refusals(bert_prefixed_dir, kwargs, says):
    with pytest.raises(ValueError, match=says):
        LLM(str(bert_prefixed_dir), dtype="float32", **kwargs)


def test_server_embeddings_and_rerank(bert_dir, bert_ce_dir):
    from test_server import ServerThread
    want = [torch.nn.functional.normalize(h.mean(0), dim=0) for h in hf_outputs(bert_dir, "BertModel", TEXTS)]
    pairs = [(QUERY, d) for d in DOCS]
    scores = torch.stack(hf_outputs(bert_ce_dir, "BertForSequenceClassification", pairs=pairs))[:, 0].sigmoid()
    flags = ("--max-num-seqs", "4", "--max-model-len")
    with ServerThread(bert_dir, *flags, str(MAX_SEQ_LENGTH)) as emb, \
            ServerThread(bert_ce_dir, *flags, str(MAX_POSITIONS)) as ce:
        r = httpx.post(emb.url + "/v1/embeddings", json={"input": TEXTS}, timeout=30)
        assert r.status_code == 200, r.text
        for d, w in zip(r.json()["data"], want):
            torch.testing.assert_close(torch.tensor(d["embedding"]), w, atol=1e-5, rtol=1e-4)
        too_long = " ".join(["cat"] * (MAX_SEQ_LENGTH - 1))  # with [CLS] and [SEP]: one past max_model_len
        r = httpx.post(emb.url + "/v1/embeddings", json={"input": [too_long[4:], too_long]}, timeout=30)
        assert r.status_code == 400 and str(MAX_SEQ_LENGTH) in r.json()["error"]["message"], r.text
        r = httpx.post(emb.url + "/v1/embeddings", json={"input": too_long[4:]}, timeout=30)  # max_model_len
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_SEQ_LENGTH, r.text
        r = httpx.post(ce.url + "/rerank", json={"query": QUERY, "documents": DOCS}, timeout=30)
        assert r.status_code == 200, r.text
        got = {d["index"]: d["relevance_score"] for d in r.json()["results"]}
        assert [got[i] for i in range(len(DOCS))] == pytest.approx(scores.tolist(), abs=1e-5)


def test_truncation_keeps_the_special_tokens(bert_prefixed_dir, bert_ce_dir):
    """truncate_prompt_tokens with no side is the tokenizer's truncation, as vLLM's: [CLS] and [SEP] stay
    (a pair's tokens cut from its longer text), not the first N ids of [CLS] ... [SEP] sliced."""
    from transformers import AutoTokenizer, BertForSequenceClassification, BertModel
    text, doc = " ".join(WORDS), " ".join(reversed(WORDS))
    tokenizer = AutoTokenizer.from_pretrained(bert_prefixed_dir)
    ids = tokenizer(text, truncation=True, max_length=6, return_tensors="pt")["input_ids"]
    assert ids[0, -1] == tokenizer.sep_token_id
    with torch.no_grad():
        want = BertModel.from_pretrained(bert_prefixed_dir, dtype=torch.float32).eval()(ids).last_hidden_state[0, 0]
    llm = LLM(str(bert_prefixed_dir), dtype="float32")
    out = llm.embed([text], pooling_params=PoolingParams(truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[0].tolist()
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.nn.functional.normalize(want, dim=0),
                               atol=1e-5, rtol=1e-4)
    pair = AutoTokenizer.from_pretrained(bert_ce_dir)(QUERY, doc, truncation=True, max_length=10, return_tensors="pt")
    with torch.no_grad():
        score = BertForSequenceClassification.from_pretrained(bert_ce_dir, dtype=torch.float32).eval()(
            **pair).logits[0, 0].sigmoid()
    llm = LLM(str(bert_ce_dir), dtype="float32")
    got = llm.score(QUERY, [doc], pooling_params=PoolingParams(truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert got.outputs.score == pytest.approx(float(score), abs=1e-5)


def test_max_model_len_from_the_tokenizer_where_positions_are_absolute(bert_prefixed_dir, tmp_path):
    """vLLM's rule for a pooling model whose config.json names position_embedding_type "absolute" (every
    BERT transformers 4 saved): the tokenizer's model_max_length caps max_model_len where it is shorter;
    without the key (transformers 5 saves none) the positions alone count."""
    import shutil

    from nanoserve.model import ModelConfig
    shutil.copytree(bert_prefixed_dir, tmp_path, dirs_exist_ok=True)
    tok = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tok, "model_max_length": MAX_POSITIONS - 4}))
    assert ModelConfig.from_dir(tmp_path).max_position_embeddings == MAX_POSITIONS
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "absolute"}))
    assert ModelConfig.from_dir(tmp_path).max_position_embeddings == MAX_POSITIONS - 4


def test_classifier_prompt_with_a_separator_is_one_token_type(roberta_cls_dir):
    """A several-label classifier reads every prompt as type 0 (vLLM passes token types for a cross-encoder's
    pairs only): ids with [SEP] inside are no pair, and score as transformers scores them."""
    from transformers import RobertaForSequenceClassification
    sep = 3  # [SEP] in _tokenizer's vocabulary
    ids = [2, 5, 6, sep, 7, 8, sep]
    with torch.no_grad():
        want = RobertaForSequenceClassification.from_pretrained(roberta_cls_dir, dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0].softmax(-1)
    with torch.no_grad():
        model = RobertaForSequenceClassification.from_pretrained(roberta_cls_dir, dtype=torch.float32).eval()
        as_pair = model(torch.tensor([ids]), token_type_ids=torch.tensor([[0] * 4 + [1] * 3])).logits[0].softmax(-1)
    assert not torch.allclose(as_pair, want, atol=1e-3)  # the types weigh: a pair's would score otherwise
    got = LLM(str(roberta_cls_dir), dtype="float32").classify([ids], use_tqdm=False)[0].outputs.probs
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-4)


def test_convert_embed_leaves_an_encoder_classifier_a_classifier(bert_ce_dir):
    """vLLM's as_embedding_model returns a pooling model's class unchanged: --convert embed serves
    BertForSequenceClassification as the classifier it is, and its /v1/embeddings says so (vLLM's words)."""
    llm = LLM(str(bert_ce_dir), dtype="float32", convert="embed")
    assert llm.engine.pooling_task == "classify"
    with pytest.raises(InvalidInput, match="Embedding API is not supported by this model"):
        llm.embed(["the cat"], use_tqdm=False)
