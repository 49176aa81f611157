"""Parity with Hugging Face transformers, the correctness oracle (DESIGN.md
"Correctness oracle"): for tiny random fp32 models of every supported
architecture and config variant, nanoserve's logits match HF's to fp32
rounding and its greedy tokens equal ``generate(do_sample=False)``'s.

Every model here also gets random norm weights and biases (transformers
initialises them to ones and zeros, which would hide a norm or bias that is
loaded wrong or not at all)."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ARCHS, VOCAB, hf_model, make_model, step_logits
from nanoserve import LLM, SamplingParams, kernels
from nanoserve.model import SeqInput

ATOL = 1e-4
N_NEW = 12
_rng = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(1, VOCAB, (n,), generator=_rng).tolist() for n in (1, 7, 16, 23, 40)]
LONG = torch.randint(1, VOCAB, (57,), generator=_rng).tolist()


@functools.lru_cache(maxsize=None)
def _variant(root: str, arch: str, shard: bool, overrides_json: str) -> Path:
    src = make_model(Path(root), arch, **json.loads(overrides_json))
    out = src.with_name(src.name + ("-sharded" if shard else "") + "-p")
    if (out / "config.json").exists():
        return out
    model = hf_model(src)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if name.endswith("bias") else 1.0))
    model.save_pretrained(out, **({"max_shard_size": "40KB"} if shard else {}))
    for f in src.iterdir():  # the tokenizer files
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def variant(model_root):
    """variant(arch, shard=False, **hf_config_overrides) -> a saved model directory."""
    def get(arch: str, shard: bool = False, **overrides) -> Path:
        return _variant(str(model_root), arch, shard, json.dumps(overrides, sort_keys=True))
    return get


def make_llm(path: Path, **kw) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256, **kw}
    return LLM(str(path), **kw)


def nanoserve_logits(llm: LLM, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every token, computed in the given chunks: each chunk attends
    to the earlier ones through the KV cache, as a prefix-cached prompt does."""
    bm, runner = llm.engine.scheduler.block_manager, llm.engine.runner
    assert sum(chunks) == len(token_ids)
    assert bm.allocate_slots("parity", token_ids, len(token_ids))
    table = list(bm.req_to_blocks["parity"])
    out, start = [], 0
    for n in chunks:
        out.append(step_logits(runner, [SeqInput(token_ids[start:start + n], start, table, None)]))
        start += n
    bm.free("parity")
    return torch.cat(out)


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    # min_new_tokens bans EOS for n tokens, as nanoserve's min_tokens does; the
    # prompts run one at a time so HF needs no padding.
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


_CHECKED: dict[Path, LLM] = {}


def check_parity(path: Path) -> LLM:
    """Logits in one pass and over a cached prefix, and greedy tokens of a batch.
    Once per model directory: tests that look at other facts of the same model
    reuse the result."""
    if path in _CHECKED:
        return _CHECKED[path]
    llm, hf = make_llm(path), hf_model(path)
    ref = hf_logits(hf, LONG)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [len(LONG)]), ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [21, 19, 1, 16]), ref, atol=ATOL, rtol=ATOL)
    params = SamplingParams(temperature=0, max_tokens=N_NEW, min_tokens=N_NEW)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    _CHECKED[path] = llm
    return llm


# ---------------------------------------------------------------- every architecture

@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_match_hf(variant, arch):
    check_parity(variant(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_step_of_prefill_chunk_and_decode_matches_hf(variant, arch):
    # One step that mixes a continuation chunk over a cached prefix with a
    # whole second prompt: each row must see only its own sequence's KV.
    path = variant(arch)
    llm, hf = make_llm(path), hf_model(path)
    bm, runner = llm.engine.scheduler.block_manager, llm.engine.runner
    a, b = LONG, PROMPTS[3]
    assert bm.allocate_slots("a", a, len(a)) and bm.allocate_slots("b", b, len(b))
    step_logits(runner, [SeqInput(a[:30], 0, bm.req_to_blocks["a"], None)])
    got = step_logits(runner, [SeqInput(a[30:], 30, bm.req_to_blocks["a"], None),
                         SeqInput(b, 0, bm.req_to_blocks["b"], None)])
    ref = torch.cat([hf_logits(hf, a)[30:], hf_logits(hf, b)])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)


# ---------------------------------------------------------------- config variants

def test_tied_embeddings_llama(variant):
    path = variant("llama", tie_word_embeddings=True)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    llm = check_parity(path)
    assert llm.engine.runner.model.lm_head is None  # the embedding is the head


def test_untied_embeddings_qwen3(variant):
    path = variant("qwen3", tie_word_embeddings=False)
    llm = check_parity(path)
    model = llm.engine.runner.model
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("arch,overrides,layers", [
    ("mistral", {"sliding_window": 12}, (0, 1)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}, (1,)),
], ids=["mistral", "qwen2-second-layer"])
def test_sliding_window_matches_hf(variant, arch, overrides, layers):
    """A 12-token window over 57-token prompts (in one pass, in chunks over the cache, and in
    decodes): transformers' logits and greedy tokens. Without the window the logits differ."""
    path = variant(arch, **overrides)
    llm = check_parity(path)
    assert [a.self_attn.sliding_window for a in llm.engine.runner.model.model.layers] == \
        [12 if i in layers else None for i in range(2)]
    full = make_llm(path, hf_overrides={"sliding_window": None})
    assert not torch.allclose(nanoserve_logits(full, LONG, [len(LONG)]), hf_logits(hf_model(path), LONG),
                              atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sliding_window_frees_the_blocks_out_of_it(variant, async_scheduling):
    """Every layer windowed (Mistral, 12 tokens): four prompts of up to 57 tokens, prefilled
    in chunks of 16 (under async scheduling a chunk may be in flight, reading blocks the next
    one's schedule frees: only a later step writes them), then 40 tokens each, run side by side
    in 23 blocks of 8, where each would hold 13 without the freeing: no preemption, and
    transformers' greedy tokens."""
    path = variant("mistral", sliding_window=12)
    llm = make_llm(path, num_kv_blocks=24, block_size=8, max_model_len=120, max_num_batched_tokens=16,
                   async_scheduling=async_scheduling)
    prompts = [LONG, LONG[::-1], LONG[3:], LONG[:41]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40), use_tqdm=False)
    hf = hf_model(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 40) for p in prompts]
    stats = llm.stats()
    assert stats["num_preemptions"] == 0 and stats["peak_kv_blocks"] < 2 * 13
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 23  # block 0: the null block


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_sliding_window_pool_holds_windows_not_whole_requests(variant, async_scheduling):
    """vLLM sizes a windowed model's pool by the window (and a step's tokens), not by
    max_model_len: 8 blocks of 8 (one the null block) serve a 512-token max_model_len and a
    prompt of 200 tokens, three times the pool, beside others that preempt each other.
    Then the long prompt alone, twice: the second hits the first's cached window (the blocks
    before it long evicted). Transformers' greedy tokens each time, every block back at the end."""
    path = variant("mistral", sliding_window=12)
    llm = make_llm(path, num_kv_blocks=8, block_size=8, max_model_len=None, max_num_batched_tokens=16,
                   async_scheduling=async_scheduling)
    assert llm.engine.max_model_len == 512  # the model's max_position_embeddings: one request's window fits
    info = llm.engine.describe()  # the banner's: 7 blocks to hold (block 0 is the null block), 4 + 1 a request
    assert (info.num_kv_blocks, info.blocks_per_request) == (7, 5)
    prompts = [LONG * 3 + LONG[:29], LONG[::-1], LONG[3:], PROMPTS[4]]
    hf = hf_model(path)
    want = [hf_greedy(hf, p, 24) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    # Alone, twice: the second hits the first's last window of the prompt, 2 blocks, and the
    # 22 blocks before it, evicted, are the null block's
    again = [llm.generate(prompts[:1], params, use_tqdm=False)[0] for _ in range(2)]
    assert [o.outputs[0].token_ids for o in again] == want[:1] * 2 and again[1].num_cached_tokens == 192
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 7


def test_sliding_window_layers_as_transformers_reads_them():
    from nanoserve.model import _sliding_window
    qwen = dict(num_hidden_layers=4, sliding_window=8, max_window_layers=2)
    assert _sliding_window("Qwen2ForCausalLM", qwen) == (None, ())  # use_sliding_window false
    assert _sliding_window("Qwen2ForCausalLM", {**qwen, "use_sliding_window": True}) == (8, (2, 3))
    types = ["sliding_attention", "full_attention"] * 2
    qwen3 = {**qwen, "use_sliding_window": True, "layer_types": types}
    assert _sliding_window("Qwen3ForCausalLM", qwen3) == (8, (0, 2))
    assert _sliding_window("MistralForCausalLM", {**qwen, "sliding_window": None}) == (None, ())
    assert _sliding_window("LlamaForCausalLM", qwen) == (None, ())  # transformers' Llama has no window
    gemma = {"num_hidden_layers": 8, "sliding_window": 512}  # Gemma 3: every 6th layer full, unless layer_types
    assert _sliding_window("Gemma3ForCausalLM", gemma) == (512, (0, 1, 2, 3, 4, 6, 7))
    assert _sliding_window("Gemma3ForCausalLM", {**gemma, "sliding_window_pattern": 2}) == (512, (0, 2, 4, 6))
    assert _sliding_window("Gemma3ForCausalLM", {**gemma, "layer_types": types * 2}) == (512, (0, 2, 4, 6))


def test_qwen2_attention_bias_is_loaded(variant):
    path = variant("qwen2")
    llm = check_parity(path)
    bias = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.bias
    assert bias is not None and bias.abs().sum() > 0  # non-zero, so parity covers it


def test_qwen3_qk_norm_and_head_dim_not_hidden_over_heads(variant):
    path = variant("qwen3")
    llm = check_parity(path)
    mc = llm.engine.model_config
    assert mc.qk_norm and mc.head_dim == 32 != mc.hidden_size // mc.num_heads
    assert llm.engine.runner.kv_caches[0][0].shape[-1] == 32


@pytest.mark.parametrize("num_kv_heads", [1, 4])  # MQA and plain multi-head, beside the GQA above
def test_kv_head_counts(variant, num_kv_heads):
    check_parity(variant("llama", num_key_value_heads=num_kv_heads))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _to_legacy_rope(path: Path) -> Path:
    """Rewrite config.json in transformers 4's form: top-level rope_theta and
    rope_scaling (with the old "type" key) instead of rope_parameters."""
    out = path.with_name(path.name + "-legacy")
    if not out.exists():
        shutil.copytree(path, out)
        cfg = json.loads((out / "config.json").read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        rope_type = params.pop("rope_type")
        cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
@pytest.mark.parametrize("scaling", [LINEAR, LLAMA3, YARN], ids=["linear", "llama3", "yarn"])
def test_rope_scaling(variant, scaling, form):
    path = variant("llama", rope_parameters={**scaling, "rope_theta": 10000.0})
    if form == "legacy":
        path = _to_legacy_rope(path)
    hf = hf_model(path)
    assert hf.config.rope_parameters["rope_type"] == scaling["rope_type"]  # HF read it as meant
    # The scaling must matter at these positions, or parity would prove nothing.
    unscaled = hf_model(variant("llama"))
    assert not torch.allclose(hf_logits(hf, LONG), hf_logits(unscaled, LONG), atol=1e-3)
    llm = check_parity(path)
    assert llm.engine.model_config.rope_scaling["rope_type"] == scaling["rope_type"]


def test_linear_rope_scaling_stretches_the_context_as_vllms(variant):
    """vLLM derives max_model_len for linear RoPE scaling as max_position_embeddings x factor (a 4k model
    scaled 4x serves 16k): the default covers it, and logits past the unscaled limit match HF's."""
    path = variant("llama", rope_parameters={**LINEAR, "rope_theta": 10000.0}, max_position_embeddings=16)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert llm.engine.max_model_len == 64
    ref = hf_logits(hf_model(path), LONG)  # 57 positions, most past 16
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [len(LONG)]), ref, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("extra", [{"beta_fast": 16, "beta_slow": 2, "truncate": False},
                                   {"mscale": 0.8, "mscale_all_dim": 0.6},  # DeepSeek's attention temperature
                                   {"attention_factor": 1.5}], ids=["betas", "mscale", "attention_factor"])
def test_yarn_options(variant, extra):
    """Qwen3 is YaRN's usual user (Qwen's docs switch it on for long contexts); each
    option moves the logits, and each must move them as transformers does."""
    path = variant("qwen3", rope_parameters={**YARN, **extra, "rope_theta": 10000.0})
    assert not torch.allclose(hf_logits(hf_model(path), LONG),
                              hf_logits(hf_model(variant("qwen3", rope_parameters={**YARN, "rope_theta": 10000.0})),
                                        LONG), atol=1e-3)
    check_parity(path)


def test_yarn_stretches_the_pretraining_length_as_vllms(variant):
    """vLLM derives max_model_len for YaRN as original_max_position_embeddings x factor
    (Qwen3's 32k x 4 = 128k), whatever max_position_embeddings says; the logits past
    the pre-training length match HF's."""
    path = variant("llama", rope_parameters={**YARN, "original_max_position_embeddings": 16, "rope_theta": 10000.0})
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert llm.engine.max_model_len == 64
    ref = hf_logits(hf_model(path), LONG)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [len(LONG)]), ref, atol=ATOL, rtol=ATOL)


def test_llama3_rope_without_original_length_takes_max_position_embeddings(variant):
    """transformers fills a missing original_max_position_embeddings with
    max_position_embeddings; it used to be a KeyError at start-up."""
    src = _to_legacy_rope(variant("llama", rope_parameters={**LLAMA3, "rope_theta": 10000.0},
                                  max_position_embeddings=48))
    path = src.with_name(src.name + "-no-original")
    if not path.exists():  # save_pretrained writes the key, so take it out by hand
        shutil.copytree(src, path)
        cfg = json.loads((path / "config.json").read_text())
        del cfg["rope_scaling"]["original_max_position_embeddings"]
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    llm = make_llm(path, max_model_len=48)
    assert llm.engine.model_config.rope_scaling["original_max_position_embeddings"] == 48
    hf = hf_model(path)
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 48  # HF's reading, the same
    torch.testing.assert_close(nanoserve_logits(llm, LONG[:48], [48]), hf_logits(hf, LONG[:48]), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
def test_rope_theta_read_from_both_config_forms(variant, form):
    path = variant("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    if form == "legacy":
        path = _to_legacy_rope(path)
        assert "rope_theta" in json.loads((path / "config.json").read_text())
    llm = check_parity(path)
    assert llm.engine.model_config.rope_theta == 500.0
    assert llm.engine.model_config.rope_scaling is None


def test_sharded_checkpoint(variant):
    path = variant("llama", shard=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    check_parity(path)


def test_dtype_float32_everywhere(variant):
    llm = make_llm(variant("mistral"))
    assert llm.engine.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in llm.engine.runner.model.parameters())
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float32
    assert step_logits(llm.engine.runner, [SeqInput([1, 2, 3], 0, [0], None)]).dtype == torch.float32


# ---------------------------------------------------------------- Granite and Phi-3

def test_granite_reads_its_four_scalars(variant):
    """conftest's Granite sets all four away from Llama's math; parity above proves they act as HF's."""
    mc = check_parity(variant("granite")).engine.model_config
    assert (mc.embedding_multiplier, mc.residual_multiplier, mc.attention_scale, mc.logits_scaling) == \
        (3.0, 0.4, 0.09, 2.5)
    assert make_llm(variant("llama")).engine.model_config.attention_scale is None  # head_dim ** -0.5


def test_granite_tied_embeddings_with_logits_scaling(variant):
    """The tied head's logits are divided by logits_scaling; the embedding it shares is not."""
    path = variant("granite", tie_word_embeddings=True)
    llm, hf = make_llm(path), hf_model(path)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [21, 36]), hf_logits(hf, LONG), atol=ATOL, rtol=ATOL)
    model = llm.engine.runner.model
    assert model.lm_head is None
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight)


def test_phi3_checkpoint_stores_qkv_and_gate_up_fused(variant):
    from safetensors import safe_open
    path = variant("phi3")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    check_parity(path)


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_phi3_fused_tensors_split_by_rank(variant, num_kv_heads):
    """Under TP 2 each rank takes its q heads, its (or its replicated) k and v heads, and its
    gate and up rows out of the fused checkpoint tensors: the same rows the split form gives."""
    from nanoserve.model import ModelConfig, TPGroup, build_model, load_weights
    path = variant("phi3", num_key_value_heads=num_kv_heads)
    hf = hf_model(path).model.layers[0]
    cfg = ModelConfig.from_dir(path)
    D, I = cfg.head_dim, cfg.intermediate_size
    q, k, v = hf.self_attn.qkv_proj.weight.split([4 * D, num_kv_heads * D, num_kv_heads * D])
    gate, up = hf.mlp.gate_up_proj.weight.split([I, I])
    for rank in range(2):
        model = build_model(cfg, torch.float32, torch.device("cpu"), kernels.TORCH, TPGroup(rank, 2))
        load_weights(model, path)
        layer = model.model.layers[0]
        kv = max(num_kv_heads // 2, 1) * D
        kv_rank = rank if num_kv_heads == 2 else 0
        want_qkv = torch.cat([q[rank * 2 * D:(rank + 1) * 2 * D], k[kv_rank * kv:(kv_rank + 1) * kv],
                              v[kv_rank * kv:(kv_rank + 1) * kv]])
        assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
        assert torch.equal(layer.mlp.gate_up_proj.weight,
                           torch.cat([gate[rank * I // 2:(rank + 1) * I // 2], up[rank * I // 2:(rank + 1) * I // 2]]))


_PHI4_MINI_LIKE = dict(  # Phi-4-mini's shape of config: LongRoPE, partial rotary 0.75, tied embeddings
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                     "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0], "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]},
    original_max_position_embeddings=48, partial_rotary_factor=0.75, tie_word_embeddings=True)


@pytest.mark.parametrize("regime", ["short", "long"])
def test_phi3_longrope_and_partial_rotary_match_hf(variant, regime):
    """transformers takes LongRoPE's long factors for a forward whose positions pass the
    pre-training length (48 here), vLLM (and nanoserve) for every position once max_model_len
    passes it. They agree where transformers' choice holds for a whole generation: within 48
    tokens under max_model_len 48, and past them from the prompt on under max_model_len 256.
    12 of each head's 16 dims turn (partial rotary); LongRoPE's attention factor scales them."""
    path = variant("phi3", **_PHI4_MINI_LIKE)
    hf = hf_model(path)
    assert hf.model.rotary_emb.inv_freq.numel() == 6 and hf.model.rotary_emb.attention_scaling > 1
    if regime == "short":
        llm, ids, prompts, n = make_llm(path, max_model_len=48), LONG[:40], PROMPTS[:4], 8
    else:
        llm, ids, prompts, n = make_llm(path), LONG, [LONG, LONG[::-1][:50]], N_NEW
    assert llm.engine.runner.model.config.rope_scaling["use_long_factor"] == (regime == "long")
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(nanoserve_logits(llm, ids, [len(ids)]), ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(nanoserve_logits(llm, ids, [17, 1, len(ids) - 18]), ref, atol=ATOL, rtol=ATOL)
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, n) for p in prompts]
    other = make_llm(path, max_model_len=256 if regime == "short" else 48)  # the other factors: other logits
    assert not torch.allclose(nanoserve_logits(other, ids[:40], [40]), ref[:40], atol=1e-3)


def test_phi3_sliding_window_on_every_layer(variant):
    """transformers' Phi-3 windows every layer when sliding_window is set (Phi-3-mini-4k's 2047);
    a window no sequence can outgrow (Phi-3.5's 262144 over 131072 positions) is none."""
    from nanoserve.model import _sliding_window
    assert _sliding_window("Phi3ForCausalLM", dict(num_hidden_layers=2, sliding_window=2047,
                                                   max_position_embeddings=4096)) == (2047, (0, 1))
    assert _sliding_window("Phi3ForCausalLM", dict(num_hidden_layers=2, sliding_window=262144,
                                                   max_position_embeddings=131072)) == (None, ())
    path = variant("phi3", sliding_window=12)
    llm = make_llm(path)
    assert [a.self_attn.sliding_window for a in llm.engine.runner.model.model.layers] == [12, 12]
    ref = hf_logits(hf_model(path), LONG)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [21, 19, 1, 16]), ref, atol=ATOL, rtol=ATOL)


def _phi3_dict(**kw) -> dict:
    c = dict(architectures=["Phi3ForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    return {**c, **kw}


@pytest.mark.parametrize("config,message", [
    ({"architectures": ["GraniteMoeHybridForCausalLM"]}, r"mixture-of-experts.*GraniteForCausalLM"),
    (_phi3_dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8}), "short_factor and long_factor"),
    (_phi3_dict(rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7}),
     "need 8 values each"),
    (_phi3_dict(partial_rotary_factor=0.5625), "partial_rotary_factor 0.5625 of head_dim 16 gives 9 rotary dims"),
    ({**_phi3_dict(architectures=["GraniteForCausalLM"]), "mlp_bias": True}, "mlp_bias"),
], ids=["granite-4-hybrid", "longrope-no-long-factor", "su-factor-length", "odd-rotary-dims",
        "mlp-bias"])
def test_granite_and_phi3_refusals(config, message):
    from nanoserve.model import ModelConfig, ModelLoadError


# ---------------------------------------------------------------- Gemma 2

def test_gemma2_reads_as_transformers_builds_it_and_every_part_matters(variant):
    """The tiny Gemma 2 (parity in the all-architecture tests): layer 0 slides over 16 tokens, layer 1
    attends to everything, one rotary; no q/k norm; query_pre_attn_scalar's scale; transformers'
    parameter count. Its soft caps and its window each change the logits at the tests' prompt."""
    from nanoserve.model import num_parameters
    path = variant("gemma2")
    llm, hf = check_parity(path), hf_model(path)
    model, cfg = llm.engine.runner.model, llm.engine.model_config
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [16, None] and model.model.sliding_rotary_emb is None
    assert [a.logits_soft_cap for a in attns] == [0.5, 0.5] and cfg.final_logit_softcapping == 2.0
    assert attns[0].q_norm is None and attns[0].scale == 24 ** -0.5 and model.lm_head is None
    assert num_parameters(cfg) == sum(p.numel() for p in hf.parameters())
    ref = hf_logits(hf, LONG)
    for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None}, {"sliding_window": None}):
        other = nanoserve_logits(make_llm(path, hf_overrides=change), LONG, [len(LONG)])
        assert not torch.allclose(other, ref, atol=1e-3, rtol=1e-3), change


def test_gemma2_bf16_is_transformers_bit_for_bit(variant):
    """In bf16 the torch references' soft-capped attention (written out: SDPA has no cap) and capped
    logits round as transformers' eager Gemma 2 does: its logits bit for bit."""
    path = variant("gemma2")
    llm = make_llm(path, dtype="bfloat16", enforce_eager=True)
    hf = hf_model(path, torch.bfloat16)
    assert torch.equal(nanoserve_logits(llm, LONG, [len(LONG)]), hf_logits(hf, LONG))


# ---------------------------------------------------------------- Gemma 3

def test_gemma3_layers_read_as_transformers_builds_them(variant):
    """The tiny Gemma 3 (parity above): layer 0 slides over 16 tokens with the local rotary base,
    layer 1 attends to everything with the global one; the scale is query_pre_attn_scalar's; the
    parameter count is transformers'; and the window matters at the tests' prompt lengths."""
    from nanoserve.model import num_parameters
    path = variant("gemma3")
    llm, hf = check_parity(path), hf_model(path)
    model, cfg = llm.engine.runner.model, llm.engine.model_config
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [16, None]
    assert attns[0].rotary_emb is model.model.sliding_rotary_emb and attns[1].rotary_emb is model.model.rotary_emb
    assert (cfg.rope_theta, cfg.sliding_rope) == (1e6, (1e4, None))
    assert attns[0].scale == 24 ** -0.5 and model.lm_head is None
    assert num_parameters(cfg) == sum(p.numel() for p in hf.parameters())
    full = make_llm(path, hf_overrides={"sliding_window": None})
    assert not torch.allclose(nanoserve_logits(full, LONG, [len(LONG)]), hf_logits(hf, LONG), atol=ATOL, rtol=ATOL)


def test_gemma3_bf16_is_transformers_bit_for_bit(variant):
    """Gemma's norms scale in fp32 and round once, their weight 1 + w in fp32 (GemmaRMSNorm): in bf16
    the torch references give transformers' logits bit for bit, as for the other architectures."""
    from transformers import AutoModelForCausalLM
    path = variant("gemma3")
    llm = make_llm(path, dtype="bfloat16", enforce_eager=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert torch.equal(nanoserve_logits(llm, LONG, [len(LONG)]), hf_logits(hf, LONG))


def test_gemma3_transformers_4_config(variant):
    """The hub's Gemma 3 configs are transformers 4's: rope_theta and rope_local_base_freq, the larger
    models' linear rope_scaling (factor 8) for the full layers only, sliding_window_pattern instead of
    layer_types, defaults left out. transformers reads them so; nanoserve must too, and keeps
    max_model_len at max_position_embeddings (vLLM's Gemma 3 exception: it is already scaled)."""
    src = variant("gemma3", rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                 "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    path = src.with_name(src.name + "-legacy")
    if not path.exists():
        shutil.copytree(src, path)
        cfg = json.loads((path / "config.json").read_text())
        for key in ("rope_parameters", "layer_types", "tie_word_embeddings", "hidden_activation", "rms_norm_eps"):
            del cfg[key]
        cfg.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   sliding_window_pattern=2)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    hf = hf_model(path)
    assert hf.config.rope_parameters["full_attention"]["rope_type"] == "linear"  # HF read it as meant
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    assert not torch.allclose(hf_logits(hf, LONG), hf_logits(hf_model(variant("gemma3")), LONG), atol=1e-3)
    llm, ref = make_llm(path), hf_logits(hf, LONG)  # logits only: the greedy tokens are the tests' above
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [len(LONG)]), ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [21, 19, 1, 16]), ref, atol=ATOL, rtol=ATOL)
    assert llm.engine.model_config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert llm.engine.model_config.max_position_embeddings == 512  # not 8 x 512: the default max_model_len


def test_gemma3_multimodal_checkpoint_serves_its_text(model_root):
    """Gemma3ForConditionalGeneration (4B and up): its text_config and language_model weights, the
    vision tower left unread, give transformers' logits for text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from conftest import hf_config
    path = Path(model_root) / "gemma3-multimodal"
    if not (path / "config.json").exists():
        torch.manual_seed(3)
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        config = Gemma3Config(text_config=hf_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                              mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                              eoi_token_index=VOCAB - 2, eos_token_id=0)
        model = Gemma3ForConditionalGeneration(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0, 0.08) if p.dim() == 2 else p.copy_(torch.randn_like(p) * 0.3)
        model.save_pretrained(path)
        shutil.copytree(make_model(model_root, "gemma3"), path, dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if not n.startswith("tokenizer")])
    llm = make_llm(path)
    assert llm.engine.model_config.num_layers == 2
    with torch.no_grad():
        hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        ref = hf(torch.tensor([LONG])).logits[0]
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [len(LONG)]), ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(nanoserve_logits(llm, LONG, [21, 19, 1, 16]), ref, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("change,message", [
    ({"use_bidirectional_attention": True}, "an embedding model"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"architectures": ["Gemma2ForCausalLM"], "attention_bias": True}, "Gemma2ForCausalLM with attention_bias"),
], ids=["bidirectional", "silu", "gemma2-bias"])
def test_gemma_configs_nanoserve_cannot_serve_are_refused(change, message):
    from nanoserve.model import ModelConfig, ModelLoadError
    config = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2, **change}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(config)


def test_gemma_soft_caps_read_as_transformers_reads_them():
    """Gemma 2's caps, Gemma2Config's defaults (50, 30) where config.json leaves them out, none where it
    says null; Gemma 3's configs say null (its default): none. A Gemma 3 config that sets one is served
    with it, as transformers' eager Gemma 3 applies it (it used to be refused: no kernel soft-capped)."""
    from nanoserve.model import ModelConfig
    caps = lambda **c: (lambda m: (m.attn_logit_softcapping, m.final_logit_softcapping))(  # noqa: E731
        ModelConfig.from_dict({"num_hidden_layers": 4, **c}))
    assert caps(architectures=["Gemma2ForCausalLM"]) == (50.0, 30.0)
    assert caps(architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=None) == (None, 30.0)
    assert caps(architectures=["Gemma3ForCausalLM"]) == (None, None)
    assert caps(architectures=["Gemma3ForCausalLM"], attn_logit_softcapping=None, final_logit_softcapping=None) \
        == (None, None)
    assert caps(architectures=["Gemma3ForCausalLM"], final_logit_softcapping=30.0) == (None, 30.0)
    assert caps(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, vocab_size=10,
                num_attention_heads=4, attn_logit_softcapping=50.0) == (None, None)  # not Llama's
    gemma2 = ModelConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4})
    assert gemma2.sliding_layers == (0, 2) and gemma2.sliding_window == 4096 and not gemma2.qk_norm


def test_gemma3_turns_whole_heads_whatever_partial_rotary_factor_says():
    """transformers' and vLLM's Gemma 3 rotate every dim of a head in both of its rotaries (the
    sliding layers' too), ignoring partial_rotary_factor: nanoserve's full-attention layers must
    not turn fewer dims than its sliding ones (they did, through hf_overrides)."""
    from nanoserve.model import ModelConfig
    config = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2, "head_dim": 32,
              "partial_rotary_factor": 0.5}
    assert ModelConfig.from_dict(config).rotary_dim == 32


def test_gemma3_multimodal_text_config_override_is_laid_over_not_swapped():
    """--hf-overrides '{"text_config": {...}}' on Gemma3ForConditionalGeneration changes the keys it
    names, as vLLM's sub-config overrides do; the text decoder keeps the checkpoint's sizes (replaced
    whole, they fell back to Gemma3TextConfig's 2304-wide defaults)."""
    from nanoserve.model import ModelConfig, override_config
    checkpoint = {"architectures": ["Gemma3ForConditionalGeneration"],
                  "text_config": {"hidden_size": 64, "num_hidden_layers": 2, "sliding_window": 32,
                                  "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                      "sliding_attention": {"rope_type": "default",
                                                                            "rope_theta": 1e4}}}}
    cfg = ModelConfig.from_dict(override_config(checkpoint, {"text_config": {"sliding_window": 8}}))
    assert (cfg.hidden_size, cfg.num_layers, cfg.sliding_window) == (64, 2, 8)
    legacy = {"text_config": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}  # transformers 4's form
    cfg = ModelConfig.from_dict(override_config(checkpoint, legacy))
    assert (cfg.hidden_size, cfg.rope_theta, cfg.rope_scaling["factor"]) == (64, 1e6, 2.0)
