"""Beam search (engine.BeamSearch; the server's use_beam_search, LLM.beam_search)
against a beam search written here over transformers' logits: the same
algorithm as vLLM's (each round the top 2 x width logprobs of every live beam are
its candidates, an EOS ends a beam, the width best candidates live on; the
width best of ended and live beams by length-penalised score are the result)."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from conftest import hf_model, make_model
from nanoserve import LLM, BeamSearchParams, SamplingParams
from test_server import ServerThread, sse_events

PROMPTS = [[5, 17, 42, 9], [100, 3, 77, 250, 31, 8, 64]]


def reference(hf, prompt: list[int], width: int, max_tokens: int, eos: set[int], length_penalty: float = 1.0,
              ignore_eos: bool = False, allowed: list[int] | None = None) -> list[tuple[list[int], float, bool]]:
    """(output tokens, cumulative logprob, ended by EOS) of the width best beams. With
    ``allowed`` (at most 128), every one of those tokens is a candidate, by its raw logprob
    (vLLM ranks them all through logprob_token_ids)."""
    live, ended = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for out, cum in live:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([prompt + out])).logits[0, -1].double(), -1)
            if allowed is not None:
                logprobs = torch.full_like(logprobs, float("-inf")).index_copy(0, torch.tensor(allowed),
                                                                               logprobs[allowed])
            top = logprobs.topk(2 * width if allowed is None else len(allowed))
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                if t in eos and not ignore_eos:
                    ended.append((out + [t], cum + lp, True))
                else:
                    candidates.append((out + [t], cum + lp))
        live = sorted(candidates, key=lambda c: -c[1])[:width]
        if not live:
            break

    def score(beam):
        out, cum, _ = beam
        return cum / (len(prompt) + len(out) - (out[-1] in eos)) ** length_penalty
    return sorted(ended + [(out, cum, False) for out, cum in live], key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def model(model_root):
    """The tiny Qwen3 whose EOS is the second likeliest first token of PROMPTS[0], so
    that beams end by EOS (as the first, reserved, id 0 of the vocabulary never would)."""
    src = make_model(model_root, "qwen3", seed=3)
    with torch.no_grad():
        second = hf_model(src)(torch.tensor([PROMPTS[0]])).logits[0, -1].topk(2).indices[1].item()
    out = src.with_name(src.name + "-beam-eos")
    if not out.exists():
        shutil.copytree(src, out)
        for name in ("config.json", "generation_config.json"):
            config = json.loads((out / name).read_text())
            config["eos_token_id"] = second
            (out / name).write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), dtype="float32", num_kv_blocks=128, max_model_len=128)


@pytest.fixture(scope="module")
def hf(model):
    return hf_model(model)


@pytest.mark.parametrize("width,length_penalty,ignore_eos", [(1, 1.0, False), (3, 1.0, False), (3, 0.5, False),
                                                             (4, 2.0, True)])
def test_beam_search_matches_the_reference(llm, hf, width, length_penalty, ignore_eos):
    eos = set(llm.engine.eos_token_ids)
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty, ignore_eos=ignore_eos)
    outs = llm.beam_search(PROMPTS, params)
    ended = 0
    for prompt, out in zip(PROMPTS, outs):
        want = reference(hf, prompt, width, 6, eos, length_penalty, ignore_eos)
        got = out.sequences
        assert [s.tokens[len(prompt):] for s in got] == [w[0][:-1] if w[2] else w[0] for w in want]
        assert [s.finish_reason for s in got] == ["stop" if w[2] else "length" for w in want]
        assert [s.cum_logprob for s in got] == pytest.approx([w[1] for w in want], abs=1e-4)
        assert all(s.text == llm.get_tokenizer().decode(s.tokens[len(prompt):]) for s in got)
        ended += sum(w[2] for w in want)
    assert ended > 0 or ignore_eos or width == 1  # the EOS did end beams


def test_width_one_without_eos_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    assert [b.sequences[0].tokens for b in beams] == [g.prompt_token_ids + g.outputs[0].token_ids for g in greedy]


def test_logprobs_and_the_stop_token(llm):
    """logprobs: each token's own and the top N (N <= 2 x width); include_stop_str_in_output
    keeps an ending EOS (and its logprobs), whose text stays out as vLLM's; the cumulative
    logprob adds up the tokens' own."""
    params = BeamSearchParams(beam_width=3, max_tokens=6, logprobs=2, include_stop_str_in_output=True)
    (out,) = llm.beam_search(PROMPTS[:1], params)
    eos, tok = llm.engine.eos_token_ids, llm.get_tokenizer()
    assert any(s.finish_reason == "stop" for s in out.sequences)
    for s in out.sequences:
        ids = s.tokens[len(PROMPTS[0]):]
        assert len(s.logprobs) == len(ids)
        assert all(t in e and len(e) <= 3 and {lp.rank for lp in e.values()} >= {1, 2} for t, e in zip(ids, s.logprobs))
        assert s.cum_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(ids, s.logprobs)), abs=1e-5)
        if s.finish_reason == "stop":
            assert ids[-1] in eos and s.stop_reason == ids[-1] and s.text == tok.decode(ids[:-1])


def test_abort_and_a_failed_step_leave_nothing_behind(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=20))
    for _ in range(4):  # into its second or third round
        engine.step()
    assert engine.beam_searches and engine.beam_children and engine.scheduler.requests
    engine.abort_request(rid)
    assert not engine.beam_searches and not engine.beam_children and not engine.scheduler.requests
    rid = engine.add_request(PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=20))
    engine.step()
    assert engine.schedule_step() is not None  # a step in flight, as when the model raised in it
    assert engine.fail_step() == [rid]  # the id the caller knows, not its round's requests'
    assert not engine.beam_searches and not engine.beam_children and not engine.scheduler.requests
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not engine.has_unfinished_requests()


def test_bad_beam_search_params_name_their_field(llm):
    for kw, field in (({"beam_width": 0}, "beam_width"), ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                      ({"beam_width": 2, "logprobs": 5}, "logprobs"),
                      ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty")):
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**{"max_tokens": 4, **kw})
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.engine.add_request(PROMPTS[0], BeamSearchParams(beam_width=11, max_tokens=4))  # 22 > 20
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.engine.add_request(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4, allowed_token_ids=[10**6]))
    assert not llm.engine.beam_searches


# =========================================================================== over HTTP

@pytest.fixture(scope="module")
def server(model):
    with ServerThread(model) as s:
        yield s


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)


def test_use_beam_search_over_http_is_llm_beam_search(server, llm):
    want = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=5))
    body = {"prompt": PROMPTS, "n": 3, "max_tokens": 5, "use_beam_search": True, "temperature": 0,
            "return_token_ids": True}
    r = _post(server, "completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [(c["index"], c["token_ids"], c["text"], c["finish_reason"]) for c in choices] == \
        [(3 * i + j, s.tokens[len(p):], s.text, s.finish_reason)
         for i, (p, out) in enumerate(zip(PROMPTS, want)) for j, s in enumerate(out.sequences)]
    events = sse_events(_post(server, "completions", {**body, "stream": True}).text)
    texts = {}
    for e in events[:-1]:
        for c in json.loads(e)["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert events[-1] == "[DONE]" and texts == {c["index"]: c["text"] for c in choices}
    chat = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                              "max_tokens": 4, "use_beam_search": True, "logprobs": True,
                                              "top_logprobs": 1})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 2
    assert all(len(c["logprobs"]["content"]) >= 1 for c in chat.json()["choices"])
    server.wait_idle()
    assert not server.engine.beam_searches and not server.engine.scheduler.requests


@pytest.mark.parametrize("body,param", [
    ({"length_penalty": 0.5}, "length_penalty"),                        # without use_beam_search: would do nothing
    ({"use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p"),         # beam search ranks raw logprobs
    ({"use_beam_search": True, "n": 2, "stop": ["x"]}, "stop"),
    ({"use_beam_search": True, "n": 2, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"use_beam_search": True, "n": 11}, "n"),                          # 2 x 11 logprobs > max_logprobs 20
    ({"use_beam_search": True, "n": 2, "logprobs": 5}, "logprobs"),     # more than the 4 candidates ranked
    ({"use_beam_search": True, "n": 2, "vllm_xargs": {"k": 1}}, "vllm_xargs"),  # no logits processor reads them
])
def test_what_beam_search_would_ignore_is_a_400(server, body, param):
    r = _post(server, "completions", {"prompt": "hi", "max_tokens": 3, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_allowed_token_ids_are_the_only_candidates(llm, hf):
    """With allowed_token_ids each round ranks all of them by their raw logprobs (as vLLM's,
    through logprob_token_ids): an allowed EOS ends a beam whatever its rank."""
    allowed = [7, 11, 13, 200, 301, *llm.engine.eos_token_ids]
    (out,) = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=4, allowed_token_ids=allowed))
    want = reference(hf, PROMPTS[0], 2, 4, set(llm.engine.eos_token_ids), allowed=allowed)
    assert [s.tokens[len(PROMPTS[0]):] for s in out.sequences] == [w[0][:-1] if w[2] else w[0] for w in want]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([w[1] for w in want], abs=1e-4)
    assert all(set(s.tokens[len(PROMPTS[0]):]) <= set(allowed) for s in out.sequences)
    (shown,) = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=2, allowed_token_ids=allowed,
                                                            logprobs=2))
    for token, entry in zip(shown.sequences[0].tokens[len(PROMPTS[0]):], shown.sequences[0].logprobs):
        others = sorted((lp.logprob for t, lp in entry.items() if t != token), reverse=True)
        assert token in entry and len(others) <= 2 and others[-1] >= sorted(  # the top ones, not the first listed
            (lp.logprob for t, lp in entry.items()), reverse=True)[2]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        BeamSearchParams(beam_width=2, max_tokens=4, allowed_token_ids=list(range(129)))


def test_a_length_penalty_past_a_floats_range_is_refused(llm):
    """length ** 400 overflows: the score raised in the step, which ended every request in it."""
    with pytest.raises(ValueError, match="length_penalty must be within"):
        llm.engine.add_request(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=400))
    assert not llm.engine.beam_searches


def test_a_refused_prompt_leaves_no_search_of_its_batch_running(model):
    """The second prompt passes process_prompt, then add_beam_search refuses it (embeddings): the
    first, added already, is aborted."""
    llm = LLM(str(model), dtype="float32", num_kv_blocks=32, max_model_len=64, enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="prompt_embeds"):
        llm.beam_search([PROMPTS[0], {"prompt_embeds": torch.zeros(3, 64)}], BeamSearchParams(beam_width=2,
                                                                                              max_tokens=3))
    assert not llm.engine.beam_searches and not llm.engine.beam_children and not llm.engine.scheduler.requests


def test_without_prefix_caching_a_search_still_reads_its_own_blocks(model):
    """Its rounds' requests share the blocks they cache among themselves (as n > 1's family
    does), so each round computes a beam's last few tokens, not the whole prompt again."""
    prompt = list(range(1, 61))
    computed = {}
    for caching in (True, False):
        llm = LLM(str(model), dtype="float32", num_kv_blocks=64, max_model_len=128, enable_prefix_caching=caching)
        build, total = llm.engine.build_inputs, [0]

        def spy(*args, build=build, total=total):
            seqs = build(*args)
            total[0] += sum(len(s.token_ids) for s in seqs)
            return seqs
        llm.engine.build_inputs = spy
        out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8))
        computed[caching] = (total[0], [s.tokens for s in out[0].sequences])
    assert computed[True][1] == computed[False][1]
    assert computed[False][0] <= 60 + 8 * 3 * 16  # never the 60-token prompt again (8 x 3 x 60 = 1,440 more)


def test_a_forced_tool_call_is_named_by_tool_choice(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    r = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                           "tool_choice": "required", "use_beam_search": True, "n": 2,
                                           "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


@pytest.mark.parametrize("logprobs", [1.5, True, "2"])
def test_beam_search_logprobs_must_be_an_integer(logprobs):
    """A float passed the range check and failed as a TypeError after the whole search had run."""
    with pytest.raises(ValueError, match=r"logprobs must be None or in \[0, 4\]"):
        BeamSearchParams(beam_width=2, max_tokens=4, logprobs=logprobs)
