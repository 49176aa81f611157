"""sentence-transformers Dense modules (vLLM's ST projector) on embeddings, and EmbeddingGemma (a bidirectional
Gemma3TextModel with two Dense modules), against transformers' forward with the Dense layers applied here: after
pooling, in modules.json's order, before Matryoshka's cut and Normalize; on token_embed's rows too; refused by name
where a module cannot be applied."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import _tokenizer_dir, hf_config, make_model
from nanoserve.engine import LLM, InvalidInput, PoolingParams
from nanoserve.model import ModelLoadError
from test_embed import hf_hidden
from test_encoder import TEXTS, bert_dir, hf_outputs  # noqa: F401 - bert_dir: a fixture

F = torch.nn.functional
PROMPTS = [[5, 6, 7], list(range(30, 41)), list(range(40, 61))]  # 3, 11, 21 tokens


def write_st_modules(out, pooling: str, dense: list[dict], seed: int, weights: str = "model.safetensors",
                     normalize: bool = True) -> list[torch.nn.Linear]:
    """modules.json (Transformer, Pooling, the Dense modules, Normalize) and each Dense folder as
    sentence-transformers saves it (config.json, linear.weight/linear.bias); the Linears, to apply in the test."""
    torch.manual_seed(seed)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{pooling}": True}))
    linears = []
    for i, d in enumerate(dense, start=2):
        folder = out / f"{i}_Dense"
        folder.mkdir(exist_ok=True)
        modules.append({"idx": i, "name": str(i), "path": folder.name, "type": "sentence_transformers.models.Dense"})
        (folder / "config.json").write_text(json.dumps(d))
        linear = torch.nn.Linear(d["in_features"], d["out_features"], bias=d.get("bias", True))
        with torch.no_grad():
            linear.weight.normal_(0, 0.3)
        tensors = {f"linear.{k}": v.detach().clone() for k, v in linear.state_dict().items()}
        if weights == "model.safetensors":
            from safetensors.torch import save_file
            save_file(tensors, str(folder / weights))
        else:
            torch.save(tensors, folder / weights)
        linears.append(linear)
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": "3_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    return linears


def dense(i: int, o: int, act: str = "torch.nn.modules.linear.Identity", bias: bool = True) -> dict:
    return {"in_features": i, "out_features": o, "bias": bias, "activation_function": act}


@pytest.fixture(scope="module")
def bert_dense_dir(bert_dir, tmp_path_factory):
    """test_encoder's BERT (hidden 32), MEAN pooling, Dense 32 -> 16 with tanh, Dense 16 -> 12 without bias,
    Normalize."""
    out = tmp_path_factory.mktemp("st") / "bert-dense"
    shutil.copytree(bert_dir, out)
    linears = write_st_modules(out, "mean_tokens", [dense(32, 16, "torch.nn.modules.activation.Tanh"),
                                                    dense(16, 12, bias=False)], seed=7)
    return out, linears


def project(linears, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return linears[1](torch.tanh(linears[0](x)))


def test_dense_modules_on_an_encoder_in_order_before_normalize(bert_dense_dir):
    path, linears = bert_dense_dir
    hidden = hf_outputs(path, "BertModel", TEXTS)
    llm = LLM(str(path), dtype="float32", hf_overrides={"is_matryoshka": True})
    got = [torch.tensor(o.outputs.embedding) for o in llm.embed(TEXTS, use_tqdm=False)]
    for g, h in zip(got, hidden):
        assert g.shape == (12,)
        torch.testing.assert_close(g, F.normalize(project(linears, h.mean(0)), dim=0), atol=1e-5, rtol=1e-4)
    # Matryoshka's cut after the projection, then the norm; its range is the projection's size (vLLM's)
    cut = llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=5), use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(cut), F.normalize(project(linears, hidden[0].mean(0))[:5], dim=0),
                               atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidInput, match=r"range \[1, 12\]"):
        llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=13), use_tqdm=False)
    # token_embed: every row projected, then normalized (vLLM's token-wise head)
    llm = LLM(str(path), dtype="float32", pooler_config={"task": "token_embed"})
    rows = llm.encode(TEXTS[:2], pooling_task="token_embed", use_tqdm=False)
    for r, h in zip(rows, hidden):
        torch.testing.assert_close(r.outputs.data, F.normalize(project(linears, h), dim=-1), atol=1e-5, rtol=1e-4)


def test_dense_module_on_a_decoder_after_the_whole_mean(model_root, tmp_path):
    """A decoder's MEAN is summed chunk by chunk (chunks of 8 here): the projection, not linear (tanh), must
    see the whole mean. The Dense weights as pytorch_model.bin; no Normalize module: not normalized."""
    path = tmp_path / "qwen3-dense"
    shutil.copytree(make_model(model_root, "qwen3"), path)
    linears = write_st_modules(path, "mean_tokens", [dense(64, 24, "torch.nn.modules.activation.Tanh")], seed=8,
                               weights="pytorch_model.bin", normalize=False)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=32, block_size=8,
              enforce_eager=True)
    assert llm.engine.runner_type == "pooling" and not llm.engine.pooler_config.use_activation
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS, use_tqdm=False)):
        with torch.no_grad():
            want = torch.tanh(linears[0](hf_hidden(path, prompt).mean(0)))
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("edit, match", [
    (lambda c, f: c.update(activation_function="torch.nn.modules.activation.Softplus"),
     r"'2_Dense'.*activation_function 'torch.nn.modules.activation.Softplus' is not supported"),
    (lambda c, f: c.update(out_features=17), r"'2_Dense'.*linear.weight has shape \(16, 32\), its config.json "
                                             r"makes it \(17, 32\)"),
    (lambda c, f: c.update(in_features=31), r"'2_Dense'.*in_features 31, but the rows it is given have 32"),
    (lambda c, f: (f / "model.safetensors").unlink(), r"'2_Dense'.*neither model.safetensors nor pytorch_model.bin"),
])
def test_a_dense_module_that_cannot_be_applied_is_refused_by_name(bert_dense_dir, tmp_path, edit, match):
    """vLLM logs these and serves without the module (other vectors); refused here, naming it."""
    path = tmp_path / "bad"
    shutil.copytree(bert_dense_dir[0], path)
    config = json.loads((path / "2_Dense" / "config.json").read_text())
    edit(config, path / "2_Dense")
    (path / "2_Dense" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(path), dtype="float32")


GEMMA_WINDOW = 8  # config.json's sliding_window: a token sees 4 either side on the sliding layers


@pytest.fixture(scope="module")
def embedding_gemma_dir(tmp_path_factory):
    """A tiny EmbeddingGemma: Gemma3TextModel with use_bidirectional_attention, a sliding layer, a full one, a
    sliding one; MEAN pooling, Dense 64 -> 96 -> 64 (identity), Normalize."""
    from transformers import Gemma3TextModel
    out = tmp_path_factory.mktemp("st") / "embeddinggemma"
    torch.manual_seed(3)
    config = hf_config("gemma3", use_bidirectional_attention=True, sliding_window=GEMMA_WINDOW, num_hidden_layers=3,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = Gemma3TextModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() >= 2 else 0.3)  # the norms' weights too (transformers starts them at 0)
    model.save_pretrained(out)
    shutil.copytree(_tokenizer_dir(str(out.parent)), out, dirs_exist_ok=True)
    linears = write_st_modules(out, "mean_tokens", [dense(64, 96), dense(96, 64)], seed=9)
    return out, model, linears


def test_embedding_gemma_bidirectional_sliding_as_transformers(embedding_gemma_dir):
    path, model, linears = embedding_gemma_dir
    assert json.loads((path / "config.json").read_text())["sliding_window"] == GEMMA_WINDOW
    with torch.no_grad():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
        changed = model(torch.tensor([PROMPTS[2][:-1] + [7]])).last_hidden_state[0]
    assert not torch.allclose(changed[0], hidden[2][0])  # the oracle is bidirectional: row 0 sees the last token
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.pooler_config.pooling_type == "MEAN" and not llm.engine.config.enable_prefix_caching
    steps = []
    execute = llm.engine.runner.execute_model
    llm.engine.runner.execute_model = lambda seqs: steps.append(len(seqs)) or execute(seqs)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert steps == [len(PROMPTS)]  # the three prompts, whole, in one step
    for out, h in zip(outs, hidden):
        with torch.no_grad():
            want = F.normalize(linears[1](linears[0](h.mean(0))), dim=0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-4)


def test_embedding_gemma_defaults_and_refusals(embedding_gemma_dir, tmp_path):
    """Without sentence-transformers files: LAST pooling, normalized (vLLM's Gemma3Model default)."""
    path, model = embedding_gemma_dir[:2]
    bare = tmp_path / "bare"
    shutil.copytree(path, bare, ignore=shutil.ignore_patterns("modules.json", "*_Pooling", "*_Dense"))
    llm = LLM(str(bare), dtype="float32")
    assert llm.engine.pooler_config.pooling_type == "LAST" and llm.engine.projector is None
    with torch.no_grad():
        want = F.normalize(model(torch.tensor([PROMPTS[2]])).last_hidden_state[0, -1], dim=0)
    torch.testing.assert_close(torch.tensor(llm.embed(PROMPTS[2:], use_tqdm=False)[0].outputs.embedding), want,
                               atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="tensor_parallel_size 2: Gemma3TextModel .*one rank only"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) is smaller than max_model_len \(32\)"):
        LLM(str(path), dtype="float32", max_model_len=32, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="runner pooling"):
        LLM(str(path), dtype="float32", runner="generate")
    with pytest.raises(ValueError, match="disable_sliding_window is not supported for Gemma3TextModel"):
        LLM(str(path), dtype="float32", disable_sliding_window=True)
    causal = tmp_path / "causal"
    shutil.copytree(path, causal)
    config = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": False}))
    with pytest.raises(ModelLoadError, match="Gemma3TextModel without use_bidirectional_attention"):
        LLM(str(causal), dtype="float32")
