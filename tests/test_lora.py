"""LoRA adapters (vLLM's multi-LoRA serving): an adapter in PEFT's format runs as the same
model with its delta merged into the weights does in transformers, any mix of adapters and
the base model in one step, each with its own prefix cache, offline and over HTTP."""
import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from nanoserve import LLM, LoRARequest, SamplingParams

from conftest import hf_model, make_model

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 9, 11, 3, 8], [40, 41, 42], [100, 7, 7, 7, 7, 2, 60, 61], [17] * 20]


def _shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    hidden, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or \
        cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
            "qkv_proj": (hidden, q + 2 * kv), "gate_up_proj": (hidden, 2 * inter)}  # Phi-3's fused modules


def make_adapter(base: Path, out: Path, targets=ATTN + MLP, r: int = 4, alpha: float = 8, seed: int = 1,
                 extra: dict | None = None, **config) -> Path:
    """A random adapter in PEFT's layout (B random too: PEFT starts it at zero, which would change nothing)."""
    cfg = json.loads((base / "config.json").read_text())
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for i in range(cfg["num_hidden_layers"]):
        for t in targets:
            n_in, n_out = _shapes(cfg)[t]
            key = f"base_model.model.model.layers.{i}.{'self_attn' if t in ATTN + ('qkv_proj',) else 'mlp'}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=gen) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=gen) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **(extra or {})}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
        "base_model_name_or_path": str(base), **config}))
    return out


def merged_model(base: Path, adapter: Path, out: Path) -> Path:
    """The base model with W + scale * B @ A in every targeted weight: what the adapter means."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
    from safetensors.torch import load_file
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    model = hf_model(base)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in lora.items():
            if ".lora_A." in key:
                b = lora[key.replace(".lora_A.", ".lora_B.")]
                params[key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")] += scale * b @ a
    model.save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def models(model_root, tmp_path_factory):
    base = make_model(model_root, "llama", seed=3)
    root = tmp_path_factory.mktemp("lora")
    a = make_adapter(base, root / "a", seed=1)
    b = make_adapter(base, root / "b", targets=("q_proj", "v_proj", "down_proj"), r=2, alpha=16, seed=2,
                     use_rslora=True)
    return dict(base=base, a=a, b=b, merged_a=merged_model(base, a, root / "merged-a"),
                merged_b=merged_model(base, b, root / "merged-b"))


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    model = hf_model(path)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)


def _llm(path, **kw):
    return LLM(str(path), **{"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128, "enable_lora": True,
                             "max_loras": 2, **kw})


@pytest.mark.parametrize("kw", [{}, {"cudagraph_capture_sizes": [1, 2, 4]}, {"max_num_batched_tokens": 8,
                                                                             "max_num_seqs": 4}],
                         ids=["plain", "padded-decodes", "chunked"])
def test_adapters_mixed_in_one_batch_are_their_merged_models(models, kw):
    """Adapter a on q/k/v/o/gate/up/down, b (rslora, rank 2) on three of them, and the base model,
    side by side in every step (max_loras 2): transformers' greedy tokens of the merged checkpoints
    (and of the base). With padded decode sizes, their decodes take the padded (CUDA-graph) path."""
    llm = _llm(models["base"], **kw)
    la, lb = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
    loras = [la, None, lb, la, lb, None]
    prompts = PROMPTS + PROMPTS[:2]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    paths = {None: models["base"], la.lora_int_id: models["merged_a"], lb.lora_int_id: models["merged_b"]}
    for p, lora, o in zip(prompts, loras, outs):
        assert o.outputs[0].token_ids == hf_greedy(paths[lora and lora.lora_int_id], p, 10), lora
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:2]}) == 2  # the adapter changes the output


def _record_steps(runner) -> list[tuple[bool, int]]:
    """Each step's way through the runner from now on: (padded, its distinct adapters)."""
    steps, compute = [], runner.compute_step_logits

    def recorded(seqs, rows):
        steps.append((runner._is_padded_decode(seqs), len({s.lora_int_id for s in seqs} - {None})))
        return compute(seqs, rows)
    runner.compute_step_logits = recorded
    return steps


def test_padded_lora_decodes_are_the_eager_path_s(models):
    """The padded (CUDA-graph) path with adapter rows: every slot applied to every row under a
    per-row mask. A decode step mixing the base model and both adapters, padded from 3 rows to 4,
    gives the eager path's logits, writes only its 3 real KV slots, and decode steps with adapter
    rows do take it."""
    from nanoserve.model import SeqInput
    padded = _llm(models["base"], cudagraph_capture_sizes=[1, 2, 4])
    eager = _llm(models["base"])
    la, lb = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
    for llm in (padded, eager):
        llm.engine.add_lora(la)
        llm.engine.add_lora(lb)
    gen = torch.Generator().manual_seed(0)
    for k, v in padded.engine.runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    for (k, v), (k2, v2) in zip(padded.engine.runner.kv_caches, eager.engine.runner.kv_caches):
        k2.copy_(k)
        v2.copy_(v)
    before = [(k.clone(), v.clone()) for k, v in padded.engine.runner.kv_caches]
    tables, starts = [[3, 4], [7], [9, 10, 11]], [20, 5, 40]
    seqs = [SeqInput([11 + i], p, t, None, lora_int_id=lora)
            for i, (p, t, lora) in enumerate(zip(starts, tables, (2, None, 1)))]
    runner = padded.engine.runner
    assert runner._is_padded_decode(seqs) and not eager.engine.runner._is_padded_decode(seqs)
    with torch.inference_mode():
        got = runner.compute_step_logits(seqs, [0, 1, 2])[0]
        want = eager.engine.runner.compute_step_logits(seqs, [0, 1, 2])[0]
        base = eager.engine.runner.compute_step_logits([SeqInput(s.token_ids, s.start, s.block_table, None)
                                                        for s in seqs], [0, 1, 2])[0]
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    # the adapters change their rows only: the base row's mask leaves every slot out
    assert ((base - got).abs().amax(-1) > 1e-2 * want.abs().max()).tolist() == [True, False, True]
    written = sorted(t[p // 16] * 16 + p % 16 for t, p in zip(tables, starts))
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            assert (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist() == written
    steps = _record_steps(runner)
    outs = _tokens(padded, PROMPTS[:3], [la, None, lb])
    assert outs == _tokens(eager, PROMPTS[:3], [la, None, lb])
    assert (True, 2) in steps  # a padded decode of both adapters beside the base


def test_more_adapters_than_slots_wait_their_turn(models, tmp_path):
    """Three adapters and max_loras 2: as vLLM's scheduler, no step runs more than 2 (a request
    whose adapter would be the third waits, and requests behind it go first), the slots are
    refilled as adapters come and go, and every output is what it is with a slot for each."""
    c = make_adapter(models["base"], tmp_path / "c", targets=ATTN, r=3, seed=4)
    la, lb, lc = (LoRARequest(n, i, str(p)) for n, i, p in (("a", 1, models["a"]), ("b", 2, models["b"]),
                                                            ("c", 3, c)))
    loras = [la, lb, lc, None, lc, la, lb, None]
    prompts = PROMPTS + PROMPTS
    want = _tokens(_llm(models["base"], max_loras=3), prompts, loras)
    llm = _llm(models["base"], cudagraph_capture_sizes=[1, 2, 4, 8])
    steps = _record_steps(llm.engine.runner)
    assert _tokens(llm, prompts, loras) == want
    assert max(n for _, n in steps) == 2 and (True, 2) in steps
    assert llm.engine.runner.lora.slot_fills == 3  # c into the slot that the first adapter done with left


def test_a_freed_slot_serves_the_next_adapter(models, tmp_path):
    """max_loras 1: an adapter evicted by another comes back right, and one unloaded leaves its
    slot (zeroed) to the next, whose outputs are a fresh engine's."""
    c = make_adapter(models["base"], tmp_path / "c", targets=ATTN, r=3, seed=4)
    la, lb, lc = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"])), \
        LoRARequest("c", 3, str(c))
    llm = _llm(models["base"], max_loras=1, cudagraph_capture_sizes=[1, 2])
    slots = llm.engine.runner.lora
    first = [_tokens(llm, PROMPTS[:2], [lora, lora]) for lora in (la, lb, la)]
    assert first[0] == first[2] != first[1] and slots.slot_fills == 3
    assert llm.engine.remove_lora(1) and llm.engine.remove_lora(2) and not slots.slot_of
    assert _tokens(llm, PROMPTS[:2], [lc, None]) == _tokens(_llm(models["base"]), PROMPTS[:2], [lc, None])
    assert slots.slot_of == {3: 0}


def test_max_cpu_loras_keeps_that_many_host_copies(models, tmp_path):
    """max_cpu_loras 2 (vLLM's CPU LRU) and three adapters used in turn, one slot: an adapter dropped
    from host memory is read again from its path, the outputs are those of a cache that holds all three,
    and no more than 2 host copies are ever held."""
    c = make_adapter(models["base"], tmp_path / "c", targets=ATTN, r=3, seed=4)
    loras = [LoRARequest(n, i, str(p)) for n, i, p in (("a", 1, models["a"]), ("b", 2, models["b"]), ("c", 3, c))]
    turns = loras + loras  # one slot: the scheduler runs one adapter's requests at a time
    big = _llm(models["base"], max_loras=1, max_cpu_loras=3)
    want = _tokens(big, PROMPTS[:2] * 3, turns)
    llm = _llm(models["base"], max_loras=1, max_cpu_loras=2)
    slots, held = llm.engine.runner.lora, []
    add = slots.add
    slots.add = lambda *a, **kw: (add(*a, **kw), held.append(len(slots.adapters)))
    assert _tokens(llm, PROMPTS[:2] * 3, turns) == want
    assert max(held) == 2 and len(held) > 3  # a, b and c loaded, then dropped ones again
    assert len(big.engine.runner.lora.adapters) == 3


def test_a_runtime_load_before_a_step_keeps_that_step_s_host_copies(models, tmp_path):
    """max_loras 1, max_cpu_loras 2: a step whose adapter is in host memory only (not in the slot)
    reloads nothing, and an adapter loaded at runtime just before its launch, on the model thread,
    must drop another host copy than the step's (else the launch finds its adapter nowhere)."""
    c = make_adapter(models["base"], tmp_path / "c", targets=ATTN, r=3, seed=4)
    la, lb, lc = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"])), \
        LoRARequest("c", 3, str(c))
    want = _tokens(_llm(models["base"], max_loras=1), PROMPTS[:1], [la])
    llm = _llm(models["base"], max_loras=1, max_cpu_loras=2)
    _tokens(llm, PROMPTS[:1], [la])
    _tokens(llm, PROMPTS[:1], [lb])  # b in the slot; a in host memory only
    runner = llm.engine.runner
    execute, loads = runner.execute, []

    def load_then_execute(*args, **kwargs):
        if not loads:  # the server's load_lora_adapter, run on the model thread before this launch
            loads.append(llm.engine.add_lora(lc))
        return execute(*args, **kwargs)
    runner.execute = load_then_execute
    assert _tokens(llm, PROMPTS[:1], [la]) == want and loads == [True]
    assert 2 not in runner.lora.adapters and {1, 3} <= set(runner.lora.adapters)


def test_an_adapter_whose_file_vanished_fails_only_its_requests(models, tmp_path):
    """Dropped from host memory (max_cpu_loras) and its directory deleted since: the requests that need
    it end with why before any step runs for them, the others in the same steps run on, and LLM.generate
    says why. The block its prompt filled was never written: restored, the adapter's request finds no
    prefix-cache hit there."""
    from nanoserve.engine import RequestFailedError
    c = shutil.copytree(models["a"], tmp_path / "c")
    la, lb, lc = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"])), \
        LoRARequest("c", 3, str(c))
    llm = _llm(models["base"], max_loras=2, max_cpu_loras=2)
    want = _tokens(_llm(models["base"]), PROMPTS[:2], [la, None])
    _tokens(llm, PROMPTS[:2], [lc, lb])
    _tokens(llm, PROMPTS[:2], [la, lb])  # c out of host memory, and out of its slot
    shutil.rmtree(c)
    engine, runner = llm.engine, llm.engine.runner
    steps, execute = [], runner.execute
    runner.execute = lambda seqs: steps.append(len(seqs)) or execute(seqs)
    for i, (prompt, lora) in enumerate(zip([PROMPTS[0], PROMPTS[3], PROMPTS[1]], [la, lc, None])):
        engine.add_request(engine.with_lora(engine.process_prompt(prompt), lora), GREEDY, f"r{i}")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(engine.failed_requests) == ["r1"]
    assert "the LoRA adapter 'c' could not be loaded again" in engine.failed_requests.pop("r1")
    assert [finals[r].outputs[0].token_ids for r in ("r0", "r2")] == want
    assert steps and max(steps) == 2  # r1 was in none
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    steps.clear()
    with pytest.raises(RequestFailedError, match=r"'c' could not be loaded again: LoRA adapter .*cannot read"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lc)
    assert steps == []  # a step of its requests only: not run at all
    assert _tokens(llm, PROMPTS[:2], [la, None]) == want  # and the engine serves on
    shutil.copytree(models["a"], c)
    hits = bm.prefix_cache_hits
    assert _tokens(llm, PROMPTS[3:], [lc]) == _tokens(llm, PROMPTS[3:], [la]) and bm.prefix_cache_hits == hits


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="CUDA graphs need a GPU and compiled Triton (TRITON_INTERPRET=0)")
def test_lora_graph_replay_is_the_eager_forward(models):
    """On a GPU: every decode size is captured with and without the LoRA ops, once, and decode steps
    mixing the base model and both adapters replay the LoRA graphs (each row's slot read from the
    input buffer) to the eager engine's greedy tokens."""
    kw = dict(device="cuda", max_loras=2)
    eager = _llm(models["base"], enforce_eager=True, **kw)
    graphs = _llm(models["base"], cudagraph_capture_sizes=[1, 2, 4, 8], **kw)
    runner = graphs.engine.runner
    assert sorted(runner.graphs) == sorted(runner.lora_graphs) == [1, 2, 4, 8]
    la, lb = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
    loras, prompts = [la, None, lb, la, lb, None], PROMPTS + PROMPTS[:2]
    steps = _record_steps(runner)
    assert _tokens(graphs, prompts, loras) == _tokens(eager, prompts, loras)
    assert (True, 2) in steps


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_memory_check_counts_the_lora_slots_wrap_lora_layers_makes(models, world_size):
    """lora_slot_bytes (the check before loading) is what wrap_lora_layers allocates, on one rank of a split."""
    from nanoserve import kernels
    from nanoserve.model import LoRAConfig, ModelConfig, TPGroup, build_model, lora_slot_bytes, wrap_lora_layers
    cfg, config = ModelConfig.from_dir(models["base"]), LoRAConfig(3, 8)
    model = build_model(cfg, torch.float32, torch.device("cpu"), kernels.TORCH, TPGroup(world_size - 1, world_size))
    assert wrap_lora_layers(model, config) == lora_slot_bytes(cfg, config, world_size, torch.float32)


def test_max_loras_is_checked():
    from nanoserve.engine import EngineConfig
    from nanoserve.entry import engine_config, parse_args
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match=r"max_loras must be an integer >= 1"):
            EngineConfig("unused", max_loras=bad)
    assert engine_config(parse_args(["m", "--enable-lora", "--max-loras", "3"])).max_loras == 3
    assert EngineConfig("unused").max_loras == 1  # vLLM's default
    for bad in (1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"max_cpu_loras \(.*\) must be an integer >= max_loras \(2\)"):
            EngineConfig("unused", max_loras=2, max_cpu_loras=bad)
    assert EngineConfig("unused", max_loras=3).max_cpu_loras == 3  # vLLM's default: max_loras
    assert engine_config(parse_args(["m", "--enable-lora", "--max-cpu-loras", "5"])).max_cpu_loras == 5


def test_each_adapter_has_its_own_prefix_cache(models):
    llm = _llm(models["base"])
    la = LoRARequest("a", 1, str(models["a"]))
    prompt = list(range(3, 60))  # 3 full blocks of 16 and more
    cached = [llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens
              for lora in (None, la, la, None)]
    assert cached == [0, 0, 48, 48]


def test_no_salt_spells_an_adapter_s_and_a_reloaded_id_starts_cold(models):
    """A base request whose cache_salt spells what an adapter's blocks are salted with gets none of
    them; an id unloaded and loaded again with other weights gets none of the old ones."""
    from nanoserve.engine import TokenizedPrompt
    llm = _llm(models["base"])
    engine = llm.engine
    la, lb = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 1, str(models["b"]))
    prompt = list(range(3, 60))
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=la)
    salt = engine._salt(engine.with_lora(TokenizedPrompt(None, prompt), la))

    def cached(salted: str) -> int:  # a base request under the caller's salt
        rid = engine.add_request(TokenizedPrompt(None, prompt, cache_salt=salted), GREEDY)
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.request_id == rid and o.finished]
        return done[0].num_cached_tokens
    assert salt == "[null, null, 0]"  # the adapter's first load, no caller's salt
    assert [cached(s) for s in (salt, "lora:1")] == [0, 0]
    assert cached(salt) == 48  # the salt works: the same caller's salt again hits the first one's blocks
    assert engine.remove_lora(1)
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lb)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == hf_greedy(models["merged_b"], prompt, 10)


def test_beam_search_and_chat_take_an_adapter(models):
    llm = _llm(models["base"])
    la = LoRARequest("a", 1, str(models["a"]))
    from nanoserve import BeamSearchParams
    beams = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=6), lora_request=la)
    assert beams[0].sequences[0].tokens[len(PROMPTS[0]):] == hf_greedy(models["merged_a"], PROMPTS[0], 6)


def test_what_is_refused(models, tmp_path):
    base = models["base"]
    with pytest.raises(ValueError, match=r"need enable_lora=True"):
        LLM(str(base), dtype="float32", num_kv_blocks=64, max_model_len=128).generate(
            [PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(models["a"])))
    llm = _llm(base, max_lora_rank=2)
    cases = [
        (LoRARequest("a", 1, str(models["a"])), r"has rank 4, more than max_lora_rank \(2\)"),
        (LoRARequest("x", 0, str(models["b"])), r"lora_int_id must be an integer >= 1"),
        (object(), r"lora_request must be a LoRARequest"),
        (LoRARequest("x", 3, str(tmp_path / "none")), r"cannot read adapter_config.json"),
        (LoRARequest("e", 4, str(make_adapter(base, tmp_path / "e", r=2, targets=("q_proj",), extra={
            "base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)}))), r"lm_head.lora_A.weight is not a weight"),
        (LoRARequest("d", 5, str(make_adapter(base, tmp_path / "d", r=2, use_dora=True))), r"no use_dora"),
        (LoRARequest("j", 7, str(_spoiled(models["a"], tmp_path / "j", "adapter_config.json", b"[4]"))),
         r"adapter_config.json holds a JSON list, not an object"),
        (LoRARequest("s", 8, str(_spoiled(models["a"], tmp_path / "s", "adapter_model.safetensors", b"\x07" * 64))),
         r"cannot read adapter_config.json and adapter_model.safetensors \(Error while deserializing header"),
        (LoRARequest("i", 6, str(make_adapter(base, tmp_path / "i", r=2, targets=("q_proj",), extra={
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((2, 64), float("inf"))}))),
         r"q_proj.lora_A.weight holds inf or nan"),
    ]
    for lora, why in cases:
        with pytest.raises(ValueError, match=why):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora)
    llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("b", 2, str(models["b"])))
    with pytest.raises(ValueError, match=r"lora_int_id 2 is already the adapter 'b'"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("c", 2, str(models["a"])))


def _spoiled(adapter: Path, out: Path, name: str, content: bytes) -> Path:
    """A copy of ``adapter`` with its file ``name`` holding ``content`` (a 500 before: AttributeError, SafetensorError)."""
    shutil.copytree(adapter, out)
    (out / name).write_bytes(content)
    return out


def _adapters(base: Path, root: Path) -> tuple[list[LoRARequest | None], dict[int | None, Path]]:
    """models' a and b for ``base``: a request list mixing them with the base, and each one's merged model."""
    a, b = make_adapter(base, root / "a", seed=1), make_adapter(
        base, root / "b", targets=("q_proj", "v_proj", "down_proj"), r=2, alpha=16, seed=2, use_rslora=True)
    la, lb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    return [la, None, lb, la, lb, None], {None: base, 1: merged_model(base, a, root / "merged-a"),
                                          2: merged_model(base, b, root / "merged-b")}


def _tokens(llm: LLM, prompts, loras) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_tensor_parallel_adapters_are_their_merged_models(model_root, tmp_path, kv_heads):
    """Under tensor_parallel_size=2 each rank holds its part of an adapter: q by heads, k and v by
    its KV head (2 heads split over the 2 ranks, or 1 replicated on both), gate and up by rows, o and
    down by input columns with one all-reduce of x A^T. A mix of both adapters and the base in
    every step (chunked prefills beside decodes) gives the one-rank run's tokens and transformers'."""
    base = make_model(model_root, "llama", seed=3, num_key_value_heads=kv_heads)
    loras, merged = _adapters(base, tmp_path)
    # eager (the torch attention, as tests/test_tp.py): the spawned rank compiles no decode attention, ~4 s a start
    prompts, kw = PROMPTS + PROMPTS[:2], dict(max_num_batched_tokens=8, max_num_seqs=4, enforce_eager=True)
    tp1 = _tokens(_llm(base, **kw), prompts, loras)
    llm = _llm(base, tensor_parallel_size=2, **kw)
    try:
        tp2 = _tokens(llm, prompts, loras)
    finally:
        llm.shutdown()
    assert tp2 == tp1 == [hf_greedy(merged[lora and lora.lora_int_id], p, 10) for p, lora in zip(prompts, loras)]


def test_tensor_parallel_bad_adapters_are_refused_and_the_engine_serves_on(models, tmp_path, monkeypatch):
    """Under tensor parallelism an adapter rank 0 refuses is its ValueError (the workers never hear
    of it); one a worker cannot load (here: a relative path, which its node's working directory
    does not hold, as a path missing on another node) is a ValueError that names the rank, and no
    rank keeps it. Either way the engine serves on, and remove_lora unloads an adapter on every rank."""
    here, elsewhere = tmp_path / "rank0", tmp_path / "worker"
    shutil.copytree(models["a"], here / "adapter")
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the spawned worker starts here and stays
    llm = _llm(models["base"], tensor_parallel_size=2, max_lora_rank=4, enforce_eager=True)  # as test_tp.py's
    try:
        monkeypatch.chdir(here)
        with pytest.raises(ValueError, match=r"rank\(s\) could not load it .*rank 1: .*cannot read adapter_config"):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, "adapter"))
        assert not llm.engine.loras
        for lora, why in [(LoRARequest("x", 3, str(tmp_path / "none")), r"^LoRA adapter .*cannot read adapter_config"),
                          (LoRARequest("d", 4, str(make_adapter(models["base"], tmp_path / "d", r=8))),
                           r"has rank 8, more than max_lora_rank \(4\)")]:
            with pytest.raises(ValueError, match=why):
                llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora)
        la, lb = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
        paths = {None: models["base"], 1: models["merged_a"], 2: models["merged_b"]}
        loras = [la, None, lb, la]
        want = [hf_greedy(paths[lora and lora.lora_int_id], p, 10) for p, lora in zip(PROMPTS, loras)]
        assert _tokens(llm, PROMPTS, loras) == want
        assert llm.engine.remove_lora(1) and set(llm.engine.loras) == {2}
        assert _tokens(llm, PROMPTS, [None, None, lb, None]) == [
            hf_greedy(models["base"], p, 10) if i != 2 else want[2] for i, p in enumerate(PROMPTS)]
        assert _tokens(llm, PROMPTS, loras) == want  # loaded again, on every rank
        # a third adapter past max_cpu_loras (2): a and b dropped from host memory in turn and read again,
        # each rank its own part, every rank dropping the same ones (else a step finds no weights)
        lc = LoRARequest("c", 5, str(make_adapter(models["base"], tmp_path / "c", targets=ATTN, r=3, seed=4)))
        runner, loads = llm.engine.runner, []
        add = runner.add_lora
        runner.add_lora = lambda *a, **kw: (loads.append(a[0]), add(*a, **kw))
        assert _tokens(llm, PROMPTS[:2], [lc, lc]) == _tokens(_llm(models["base"]), PROMPTS[:2], [lc, lc])
        assert _tokens(llm, PROMPTS, loras) == want and len(runner.lora.adapters) == 2 and len(loads) > 1
    finally:
        llm.shutdown()


def serve(*args):
    """test_server's ServerThread, imported only by the tests that serve: test_server needs openai, which
    the GPU image lacks, and gpu.py's cuda_tests part collects this file there for its graph test."""
    from test_server import ServerThread
    return ServerThread(*args)


def test_the_server_serves_adapters_by_model_name(models):
    with serve(models["base"], "--enable-lora", "--lora-modules", f"a={models['a']}",
                      json.dumps({"name": "b", "path": str(models["b"])})) as s:
        listed = {m["id"]: m for m in httpx.get(s.url + "/v1/models").json()["data"]}
        assert listed["a"]["parent"] == str(models["base"]) and listed["a"]["root"] == str(models["a"])
        assert set(listed) == {str(models["base"]), "a", "b"}
        for name, merged in (("a", models["merged_a"]), ("b", models["merged_b"])):
            r = httpx.post(s.url + "/v1/completions", json={"model": name, "prompt": PROMPTS[2], "max_tokens": 10,
                                                            "min_tokens": 10, "temperature": 0,
                                                            "return_token_ids": True}, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == name
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(merged, PROMPTS[2], 10)
        missing = httpx.post(s.url + "/v1/completions", json={"model": "c", "prompt": "hi"}, timeout=60)
        assert missing.status_code == 404 and "'a', 'b'" in missing.json()["error"]["message"]
        s.wait_idle()


def test_the_server_reloads_start_up_adapters_and_fails_one_whose_file_vanished(models, tmp_path):
    """--lora-modules' adapters past --max-cpu-loras 1: b drops a's host copy and a is read again; once a's
    directory is gone, a request for a is a 500 that says why, and b's are served on."""
    a = shutil.copytree(models["a"], tmp_path / "a")
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "min_tokens": 10, "temperature": 0, "return_token_ids": True}
    with serve(models["base"], "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1",
                      "--lora-modules", f"a={a}", f"b={models['b']}") as s:
        def complete(name):
            return httpx.post(s.url + "/v1/completions", json={**body, "model": name}, timeout=60)
        assert len(s.engine.runner.lora.adapters) == 1
        first = [complete(n).json()["choices"][0]["token_ids"] for n in ("a", "b", "a")]
        assert first[0] == first[2] == hf_greedy(models["merged_a"], PROMPTS[1], 10)
        complete("b")
        shutil.rmtree(a)
        r = complete("a")
        assert r.status_code == 500 and "the LoRA adapter 'a' could not be loaded again" in r.json()["error"]["message"]
        assert complete("b").json()["choices"][0]["token_ids"] == first[1]
        s.wait_idle()


def test_adapters_load_and_unload_while_serving(models, monkeypatch):
    """vLLM's runtime updating (VLLM_ALLOW_RUNTIME_LORA_UPDATING): an adapter loaded by a request
    serves by its name, one in use is not unloaded from under its request, and an unloaded
    name is a 404 again. Without the variable the endpoints do not exist."""
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "min_tokens": 10, "temperature": 0, "return_token_ids": True}
    with serve(models["base"], "--enable-lora") as s:
        assert httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"}).status_code == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with serve(models["base"], "--enable-lora") as s:
        load = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(models["a"])})
        assert load.status_code == 200 and load.text == "Success: LoRA adapter 'a' added successfully."
        again = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(models["a"])})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        bad = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "/nowhere"})
        assert bad.status_code == 400 and "cannot read adapter_config.json" in bad.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={**body, "model": "a"}, timeout=60)
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(models["merged_a"], PROMPTS[1], 10)
        s.delay = 0.1  # a stream with the adapter, 20 s long, running when the unload comes; closed after
        stream = {**body, "model": "a", "stream": True, "max_tokens": 200, "min_tokens": 200}
        with httpx.stream("POST", s.url + "/v1/completions", json=stream, timeout=60) as resp:
            lines = resp.iter_lines()  # held: a closed iterator closes the response (a disconnect)
            assert next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
            assert busy.status_code == 400 and "still running" in busy.json()["error"]["message"]
        s.delay = 0.0
        s.wait_idle(30)  # the disconnect aborted it
        gone = httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'a' removed successfully."
        assert httpx.post(s.url + "/v1/completions", json={**body, "model": "a"}, timeout=60).status_code == 404
        assert httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
        _unloaded_while_tokenizing(s, body, models)
        _named_while_unloading(s, body)
        _named_while_loading(s, body, models)
        _left_while_loading(s, body, models)
        s.wait_idle()


def test_phi3_adapters_of_its_fused_modules_are_their_merged_models(model_root, tmp_path):
    """PEFT adapts Phi-3's qkv_proj and gate_up_proj as stored, fused: one A, and B over all the
    slices' rows. Beside the base model in one batch: transformers' greedy tokens of the merged checkpoint."""
    base = make_model(model_root, "phi3", seed=3)
    adapter = make_adapter(base, tmp_path / "a", targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    merged = merged_model(base, adapter, tmp_path / "merged")
    lora = LoRARequest("a", 1, str(adapter))
    outs = _llm(base).generate(PROMPTS[2:3] * 2, GREEDY, use_tqdm=False, lora_request=[lora, None])
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(merged, PROMPTS[2], 10), hf_greedy(base, PROMPTS[2], 10)] and got[0] != got[1]


def _unloaded_while_tokenizing(s, body, models):
    """A request for "a" waits on the tokenizer thread while "a" is unloaded and "b" loaded: it is
    refused, where it ran with the base model (the adapter looked up after the unload) and, had the
    lookup been earlier, would have run with "b" (given the id "a" had)."""
    assert httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(models["a"])}) \
        .status_code == 200
    state = s.app.state.server
    old_id, busy, gate, result = state.loras["a"].lora_int_id, threading.Event(), threading.Event(), {}
    state.tokenizer_thread.submit(lambda: (busy.set(), gate.wait(30)))  # the tokenizer thread busy until the unload
    try:
        assert busy.wait(30)
        request = threading.Thread(target=lambda: result.update(r=httpx.post(
            s.url + "/v1/completions", json={**body, "model": "a"}, timeout=60)))
        request.start()
        deadline = time.monotonic() + 30
        while state.tokenizer_thread._work_queue.qsize() < 1:  # the request's tokenizing queued behind the gate
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(models["b"])}) \
            .status_code == 200
        assert state.loras["b"].lora_int_id != old_id
    finally:
        gate.set()
    request.join(60)
    r = result["r"]
    assert r.status_code == 404 and "LoRA adapter was unloaded" in r.json()["error"]["message"], r.text


def _named_while_unloading(s, body):
    """A request for "b" while its unload is taking the weights out (on the model thread) is a 404: it
    was admitted, then ran on the base model under "b"'s name, the unload having checked for users first."""
    runner, entered, gate, result = s.engine.runner, threading.Event(), threading.Event(), {}
    remove = runner.remove_lora

    def slow_remove(lora_int_id):
        entered.set()
        gate.wait(30)
        remove(lora_int_id)
    runner.remove_lora = slow_remove
    try:
        unload = threading.Thread(target=lambda: result.update(unload=httpx.post(
            s.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60)))
        unload.start()
        assert entered.wait(30)
        request = threading.Thread(target=lambda: result.update(r=httpx.post(
            s.url + "/v1/completions", json={**body, "model": "b"}, timeout=60)))
        request.start()
        deadline = time.monotonic() + 30
        while "r" not in result and s.stats()["num_waiting"] + s.stats()["num_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        gate.set()
        runner.remove_lora = remove
    unload.join(60)
    request.join(60)
    assert result["unload"].status_code == 200
    assert result["r"].status_code == 404, result["r"].text


@contextlib.contextmanager
def _add_lora_held(runner):
    """runner.add_lora held until the block ends (the adapter loading all the while); yields the event
    set once a load has entered it."""
    entered, gate, add = threading.Event(), threading.Event(), runner.add_lora

    def slow_add(*args):
        entered.set()
        gate.wait(30)
        add(*args)
    runner.add_lora = slow_add
    try:
        yield entered
    finally:
        gate.set()
        runner.add_lora = add


def _named_while_loading(s, body, models):
    """An adapter still loading is no model yet (vLLM lists one once loaded): a request naming it is a 404,
    where it was a 400 naming its internal id ("LoRA adapter 4 is not loaded"); a second load of the name a 400."""
    result = {}
    with _add_lora_held(s.engine.runner) as entered:
        load = threading.Thread(target=lambda: result.update(load=httpx.post(
            s.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(models["a"])}, timeout=60)))
        load.start()
        assert entered.wait(30)
        r = httpx.post(s.url + "/v1/completions", json={**body, "model": "c"}, timeout=60)
        assert r.status_code == 404 and "'c'" not in r.json()["error"]["message"].split("serves")[1], r.text
        assert "c" not in [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]]
        again = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(models["a"])})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    load.join(60)
    assert result["load"].status_code == 200
    assert httpx.post(s.url + "/v1/completions", json={**body, "model": "c"}, timeout=60).status_code == 200


def _left_while_loading(s, body, models):
    """A client that disconnects while its adapter loads leaves no adapter loaded but unnamed: the handler is
    not cancelled (Starlette cancels no plain handler when its client leaves), so the load completes and is
    named; the answer goes nowhere, and the name serves."""
    import socket
    with _add_lora_held(s.engine.runner) as entered:
        payload = json.dumps({"lora_name": "d", "lora_path": str(models["a"])}).encode()
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            assert entered.wait(30)
        deadline = time.monotonic() + 30  # the server has seen the client go
        while s.server.server_state.connections:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 30
    while "d" not in s.app.state.server.loras:
        assert time.monotonic() < deadline, "the load that lost its client was never named"
        time.sleep(0.01)
    assert s.engine.loras[s.app.state.server.loras["d"].lora_int_id].lora_name == "d"
    assert httpx.post(s.url + "/v1/completions", json={**body, "model": "d"}, timeout=60).status_code == 200
    assert httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200


def test_the_cpu_backend_s_bf16_layers_take_adapters(model_root, tmp_path):
    """bf16 on the CPU: the linears are the backend's own (packed for oneDNN or the C kernel), and
    LoRALinear wraps those: one step's logits are the merged checkpoint's, to bf16's precision, and
    far from the base model's."""
    from nanoserve.model import SeqInput
    from conftest import step_logits
    base = make_model(model_root, "llama", seed=3, dtype=torch.bfloat16)
    adapter = make_adapter(base, tmp_path / "a", seed=1)
    merged = merged_model(base, adapter, tmp_path / "m")
    kw = dict(dtype="bfloat16", num_kv_blocks=16, max_model_len=64)
    llm = LLM(str(base), enable_lora=True, **kw)
    llm.engine.add_lora(LoRARequest("a", 1, str(adapter)))
    runner = llm.engine.runner
    from nanoserve.model import LoRALinear
    assert isinstance(runner.model.model.layers[0].mlp.down_proj, LoRALinear)  # around what the backend made
    prompt, table = PROMPTS[2], list(range(1, 3))
    runner.lora.step.groups = [(runner.lora.slots([1])[1], None)]
    with_lora = step_logits(runner, [SeqInput(prompt, 0, table, None, lora_int_id=1)])
    runner.lora.step.groups = []
    without = step_logits(runner, [SeqInput(prompt, 0, table, None)])
    other = LLM(str(merged), **kw).engine.runner
    want = step_logits(other, [SeqInput(prompt, 0, table, None)])
    scale = want.abs().max()
    assert (with_lora - want).abs().max() < 0.05 * scale < (without - want).abs().max()
