"""Prompts given as embeddings (vLLM's prompt_embeds, --enable-prompt-embeds):
greedy parity with transformers' generate(inputs_embeds=...), also prefilled in
chunks, beside token prompts and after preemption; the prefix cache keyed by the
embeddings' values; and every bad tensor a 400 naming prompt_embeds."""
from __future__ import annotations

import base64
import io
import json
import zipfile

import httpx
import pytest
import torch

from conftest import hf_model, make_model
from nanoserve import LLM, BeamSearchParams, SamplingParams
from test_server import ServerThread

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)  # as hf_greedy's min_new_tokens: no EOS


def embeddings(hf, n: int, seed: int) -> torch.Tensor:
    """n rows near the model's own token embeddings (a plausible input), but of no token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, hf.config.vocab_size, (n,), generator=g)
    with torch.no_grad():
        return hf.get_input_embeddings()(ids) + 0.05 * torch.randn(n, hf.config.hidden_size, generator=g)


def hf_greedy(hf, embeds: torch.Tensor, n: int = 8) -> list[int]:
    with torch.no_grad():
        return hf.generate(inputs_embeds=embeds[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0).tolist()[0]


def b64(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_parity_with_transformers(model_root, arch):
    """Prompts of 5 and 37 rows (the longer in chunks of 16), beside a token prompt in one batch."""
    path = make_model(model_root, arch)
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16,
              enable_prompt_embeds=True)
    short, long = embeddings(hf, 5, 1), embeddings(hf, 37, 2)
    tokens = [3, 14, 15, 92, 65]
    outs = llm.generate([{"prompt_embeds": short}, tokens, {"prompt_embeds": long}], GREEDY, use_tqdm=False)
    with torch.no_grad():
        want_tokens = hf.generate(torch.tensor([tokens]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  pad_token_id=0).tolist()[0][len(tokens):]
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, short), want_tokens, hf_greedy(hf, long)]
    assert outs[0].prompt is None and len(outs[2].prompt_token_ids) == 37


def test_a_refused_prompt_leaves_none_of_its_batch_queued(model_root):
    """LLM.generate checks every prompt before it queues any: the token prompt before a refused
    embeddings prompt does not wait to run in the next call."""
    path = make_model(model_root, "qwen3")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=128, enable_prompt_embeds=True)
    embeds = embeddings(hf_model(path), 5, 1)
    for bad in (SamplingParams(prompt_logprobs=1), SamplingParams(repetition_penalty=1.2)):
        with pytest.raises(ValueError, match="needs the prompt's token ids"):
            llm.generate([[3, 14, 15], {"prompt_embeds": embeds}], [GREEDY, bad], use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()


def test_prefix_cache_is_keyed_by_the_values(model_root):
    """The same embeddings again read their blocks from the cache; others of the same length
    (the same stand-in token ids) do not, and still get their own tokens."""
    path = make_model(model_root, "qwen3")
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=128, enable_prompt_embeds=True)
    a, b = embeddings(hf, 40, 3), embeddings(hf, 40, 4)
    first = llm.generate([{"prompt_embeds": a}], GREEDY, use_tqdm=False)[0]
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate([{"prompt_embeds": a.clone()}], GREEDY, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hits"] - hits == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    hits = llm.stats()["prefix_cache_hits"]
    other = llm.generate([{"prompt_embeds": b}], GREEDY, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hits"] == hits and other.outputs[0].token_ids == hf_greedy(hf, b)


def test_preempted_and_recomputed(model_root):
    """A KV cache too small for all four: preempted requests recompute their prompt from the embeddings."""
    path = make_model(model_root, "llama")
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=9, block_size=16, max_model_len=128,
              enable_prompt_embeds=True, enable_prefix_caching=False)
    prompts = [embeddings(hf, 30, 10 + i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
    outs = llm.generate([{"prompt_embeds": e} for e in prompts], params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, e, 20) for e in prompts]


def test_tensor_parallel_ranks_get_the_embeddings(model_root):
    """Each rank embeds its own step: the rows a prompt gave reach the worker with the step."""
    path = make_model(model_root, "qwen3")
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", enforce_eager=True, num_kv_blocks=32, max_model_len=128,
              tensor_parallel_size=2, enable_prompt_embeds=True)
    try:
        e = embeddings(hf, 21, 7)
        out = llm.generate([{"prompt_embeds": e}], GREEDY, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == hf_greedy(hf, e)


def test_what_needs_the_prompts_token_ids_is_refused(model_root):
    path = make_model(model_root, "qwen3")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=64, enable_prompt_embeds=True)
    e = torch.zeros(4, 64)
    for params, field in ((SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
                          (SamplingParams(repetition_penalty=1.3), "repetition_penalty"),
                          (BeamSearchParams(beam_width=2, max_tokens=3), "prompt_embeds")):
        with pytest.raises(ValueError, match=field):
            llm.engine.add_request(e, params)
    for bad, why in ((torch.zeros(4, 63), "shape"), (torch.zeros(4, 64, dtype=torch.int64), "int64"),
                     (torch.zeros(70, 64), "maximum context length"), (torch.zeros(0, 64), "empty"),
                     (torch.full((4, 64), float("nan")), "NaN"), (torch.zeros(4, 64).to_sparse(), "dense")):
        with pytest.raises(ValueError, match=why):
            llm.engine.add_request(bad, GREEDY)
    off = LLM(str(path), dtype="float32", num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="enable-prompt-embeds"):
        off.generate([{"prompt_embeds": e}], GREEDY, use_tqdm=False)
    assert not llm.engine.scheduler.requests


# =========================================================================== over HTTP

@pytest.fixture(scope="module")
def server(model_root):
    with ServerThread(make_model(model_root, "qwen3"), "--enable-prompt-embeds") as s:
        yield s


def _complete(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 8, "temperature": 0, "min_tokens": 8,
                                                            **body}, timeout=60)


def test_completions_take_base64_embeddings(server, model_root):
    hf = hf_model(make_model(model_root, "qwen3"))
    a, b = embeddings(hf, 6, 5), embeddings(hf, 9, 6).to(torch.bfloat16)  # cast to the model's float32
    r = _complete(server, {"prompt_embeds": [b64(a), b64(b[None])], "prompt": "hi", "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["token_ids"] for c in choices[:2]] == [hf_greedy(hf, a), hf_greedy(hf, b.float())]
    assert choices[0]["prompt_token_ids"] is None and choices[2]["prompt_token_ids"][0] != 0
    assert r.json()["usage"]["prompt_tokens"] == 6 + 9 + len(choices[2]["prompt_token_ids"])
    alone = _complete(server, {"prompt_embeds": b64(a), "prompt": ""})  # an empty prompt beside them is none
    assert alone.status_code == 200 and [c["text"] for c in alone.json()["choices"]] == [choices[0]["text"]]


def _zip_bomb() -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data/0", b"\0" * (64 << 20))
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("value,says", [
    ("not base64!", "not base64"),
    (base64.b64encode(b"plain bytes").decode(), "zip"),
    (b64({"a": torch.zeros(2, 64)}), "holds a dict"),
    (b64(torch.zeros(3, 65)), "shape"),
    (b64(torch.zeros(3, 64).to_sparse()), "dense"),
    (b64(torch.zeros(300, 64)), "maximum context length"),
    (_zip_bomb(), "bytes are more than"),
], ids=["base64", "not-zip", "dict", "shape", "sparse", "too-long", "zip-bomb"])
def test_bad_embeddings_are_400s(server, value, says):
    r = _complete(server, {"prompt_embeds": value})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt_embeds", "prompt", "input_tokens"), r.text
    assert says in r.json()["error"]["message"], r.text


def test_fields_that_need_the_prompts_text_or_ids(server):
    e = b64(torch.zeros(3, 64))
    for body, param in (({"echo": True}, "echo"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
                        ({"use_beam_search": True, "n": 2, "min_tokens": 0}, "prompt_embeds"),
                        ({"prompt_embeds": []}, "prompt_embeds")):
        r = _complete(server, {"prompt_embeds": e, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    server.wait_idle()
    assert not server.engine.scheduler.requests


def test_decodes_after_an_embeddings_prompt_carry_no_rows(model_root):
    """Past the prompt a step's input is its token again: a decode step carries no embeddings (and
    so may take the padded decode path)."""
    path = make_model(model_root, "qwen3")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=64, enable_prompt_embeds=True)
    engine, seen = llm.engine, []
    build = engine.build_inputs

    def spy(*args):
        seqs = build(*args)
        seen.append([(len(s.token_ids), None if s.prompt_embeds is None else len(s.prompt_embeds)) for s in seqs])
        return seqs
    engine.build_inputs = spy
    llm.generate([{"prompt_embeds": torch.zeros(5, 64)}], GREEDY, use_tqdm=False)
    assert seen[0] == [(5, 5)] and all(step == [(1, None)] for step in seen[1:]) and len(seen) == 8


def test_embeddings_are_not_read_without_the_flag(model_root):
    """A server without --enable-prompt-embeds never passes a body's bytes to torch.load."""
    with ServerThread(make_model(model_root, "qwen3")) as plain:
        r = httpx.post(f"{plain.url}/v1/completions", json={"prompt_embeds": b64({"a": torch.zeros(2, 64)})},
                       timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt_embeds need --enable-prompt-embeds"


def test_odd_tensors_and_other_endpoints(server, model_root):
    r = _complete(server, {"prompt_embeds": b64(torch.zeros(3, 64, device="meta"))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds", r.text
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "prompt_embeds": b64(torch.zeros(3, 64))}, timeout=60)
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_embeds", chat.text
    hf = hf_model(make_model(model_root, "qwen3"))
    e = embeddings(hf, 10, 8)
    for side, rows in (("left", e[-4:]), ("right", e[:4])):
        r = _complete(server, {"prompt_embeds": b64(e), "truncate_prompt_tokens": 4, "truncation_side": side,
                               "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == hf_greedy(hf, rows), (side, r.text)
    for keep in (15, -1):  # more than the rows (-1: max_model_len's): all of them kept, as a token-id prompt's
        r = _complete(server, {"prompt_embeds": b64(e), "truncate_prompt_tokens": keep, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == hf_greedy(hf, e), (keep, r.text)
