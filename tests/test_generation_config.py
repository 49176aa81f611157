"""A model's generation_config.json sets the sampling defaults, as in vLLM
(--generation-config auto); "vllm" ignores it; a request's own fields win."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import make_model
from nanoserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_with_defaults(model_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "qwen3"
    shutil.copytree(make_model(model_root, "qwen3"), out)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 0, "do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 0.8, "max_new_tokens": 7}))
    return out


def make_llm(path, **kw):
    return LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=32, enforce_eager=True, **kw)


def test_defaults_come_from_generation_config(model_with_defaults):
    llm = make_llm(model_with_defaults)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.7, 1, 0.8, 7)
    # top_k=1 makes every draw the argmax: three runs give one text, 7 tokens long (or fewer at EOS)
    outs = [llm.generate(["The quick brown"], use_tqdm=False)[0].outputs[0] for _ in range(3)]
    assert len({tuple(o.token_ids) for o in outs}) == 1 and len(outs[0].token_ids) <= 7
    explicit = llm.generate(["The quick brown"], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 12  # the request's own params win


def test_vllm_ignores_it_and_a_bad_directory_is_clear(model_with_defaults, tmp_path):
    p = make_llm(model_with_defaults, generation_config="vllm").get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 0, 16)
    with pytest.raises(ValueError, match="no generation_config.json there"):
        make_llm(model_with_defaults, generation_config=str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2]")  # was an AttributeError at start-up
    with pytest.raises(ValueError, match="generation_config.json holds a JSON list, not an object of fields"):
        make_llm(model_with_defaults, generation_config=str(tmp_path))


def test_sampling_defaults_that_no_request_could_use(model_with_defaults, tmp_path, caplog):
    """--override-generation-config's are the operator's: refused at start (each request that left the
    field out was a 400). A model's own file is served as vLLM serves it, with a warning at start."""
    with pytest.raises(ValueError, match=r"override_generation_config \(--override-generation-config\) does not "
                                         r"make valid sampling defaults: temperature must be in \[0, 2\], got -1"):
        make_llm(model_with_defaults, override_generation_config={"temperature": -1})
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with caplog.at_level("WARNING", logger="nanoserve.engine"):
        llm = make_llm(model_with_defaults, generation_config=str(tmp_path))
    assert any("sampling defaults from generation_config.json are not valid" in m and "got -1" in m
               for m in caplog.messages), caplog.messages
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\], got -1"):
        llm.generate(["The quick brown"], use_tqdm=False)
    assert llm.generate(["The quick brown"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_vllm_prompt_dicts_and_unknown_llm_arguments(model_with_defaults):
    llm = make_llm(model_with_defaults)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.get_tokenizer().encode("The quick brown")
    a = llm.generate([{"prompt_token_ids": ids}, {"prompt": "The quick brown"}, ids], greedy, use_tqdm=False)
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == a[2].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt dict must be"):
        llm.generate([{"prompt": "x", "extra": 1}], greedy, use_tqdm=False)
    # what vLLM code passes by habit: empty multimodal fields, lora_request=None, trust_remote_code
    b = llm.generate({"prompt": "The quick brown", "multi_modal_data": None}, greedy, use_tqdm=False,
                     lora_request=None)
    assert b[0].outputs[0].token_ids == a[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="LoRA adapters need enable_lora=True"):
        llm.generate("x", greedy, lora_request=object())
    assert make_llm(model_with_defaults, trust_remote_code=True).engine is not None
    # seed -1 is vLLM's "no seed": each run draws anew; temperature above 2 is refused, as vLLM's
    assert SamplingParams(seed=-1).seed is None
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        SamplingParams(temperature=2.5)
    # a positive temperature under 0.01 is raised to 0.01, as vLLM's: it samples, only 0 is greedy
    assert [SamplingParams(temperature=t).temperature for t in (1e-6, 0.005, 0.0, 0.5)] == [0.01, 0.01, 0.0, 0.5]
    with pytest.raises(ValueError, match="nanoserve does not have: kv_transfer_config, tensor_parallel_sizes"):
        make_llm(model_with_defaults, kv_transfer_config={}, tensor_parallel_sizes=2)


def test_http_requests_get_the_defaults_for_what_they_leave_out(model_with_defaults):
    import httpx
    from test_server import ServerThread
    with ServerThread(model_with_defaults) as s:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        outs = [httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=60).json() for _ in range(3)]
        assert len({o["choices"][0]["message"]["content"] for o in outs}) == 1  # top_k=1: greedy
        assert all(o["usage"]["completion_tokens"] <= 7 for o in outs)       # max_new_tokens=7
        # as vLLM's server (get_max_tokens, --generation-config auto): the model's max_new_tokens is
        # only the default of a chat request that gives none; completions' 16 (also for a null) wins
        for body, want in [({**chat, "max_tokens": 12}, 12), ({**chat, "max_completion_tokens": 3}, 3),
                           ({"prompt": "hi"}, 16), ({"prompt": "hi", "max_tokens": None}, 16)]:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(s.url + path, json={**body, "ignore_eos": True}, timeout=60)
            assert r.json()["usage"]["completion_tokens"] == want, body
        long = {"prompt": list(range(1, 253)), "ignore_eos": True}  # 252 of --max-model-len 256
        for body in (long, {**long, "max_tokens": None}):  # completions' 16, clamped to the 4 left, as vLLM 0.32
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_vllm_launch_habits_parse():
    from nanoserve.entry import engine_config, parse_args
    a = parse_args(["org/model", "--revision", "v1", "--generation-config", "vllm", "--no-cpu-allocator-tuning",
                    "--cudagraph-capture-sizes", "1", "2", "4"])
    c = engine_config(a)
    assert (c.model, c.revision, c.generation_config, c.cpu_allocator_tuning, c.cudagraph_capture_sizes) == (
        "org/model", "v1", "vllm", False, [1, 2, 4])
    with pytest.raises(SystemExit):
        parse_args(["a", "--model", "b"])
    # `nanoserve serve MODEL`, as `vllm serve MODEL`; a directory named serve is ./serve
    assert parse_args(["serve", "org/model", "--port", "9"]).model == "org/model"
    assert parse_args(["./serve"]).model == "./serve"


def test_a_tokenizer_of_its_own_and_uvicorns_log_level(model_with_defaults, tmp_path):
    import logging
    from nanoserve.entry import configure_logging, parse_args
    tok_dir = tmp_path / "tok"
    make_llm(model_with_defaults).get_tokenizer().save_pretrained(tok_dir)
    llm = make_llm(model_with_defaults, tokenizer=str(tok_dir))
    assert llm.get_tokenizer().encode("The quick brown") == make_llm(model_with_defaults).get_tokenizer().encode(
        "The quick brown")
    args = parse_args(["--model", str(model_with_defaults), "--uvicorn-log-level", "warning"])
    root, saved = logging.getLogger(), {n: logging.getLogger(n).level for n in ("", "nanoserve", "uvicorn")}
    handlers = list(root.handlers)
    try:
        configure_logging(args.log_level, args.uvicorn_log_level)
        assert logging.getLogger("uvicorn").level == logging.WARNING
        assert logging.getLogger("nanoserve").level == logging.INFO
    finally:  # leave the test process's logging as it was
        root.handlers[:] = handlers
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def test_max_tokens_as_vllms_get_max_tokens(model_with_defaults):
    """The body's max_tokens, else the model's default (chat only: completions' is 16, also for a
    null); a --generation-config directory's or --override-generation-config's max_new_tokens caps it."""
    from nanoserve.entry import ChatCompletionRequest, CompletionRequest
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [(CompletionRequest(prompt="x"), 40, None, 16), (CompletionRequest(prompt="x"), 9, None, 16),
             (CompletionRequest(prompt="x", max_tokens=None), 40, None, 16), (CompletionRequest(prompt="x"), 9, 9, 9),
             (ChatCompletionRequest(**chat), 40, None, 40), (ChatCompletionRequest(**chat), None, None, None),
             (ChatCompletionRequest(**chat, max_tokens=50), 40, None, 50),
             (ChatCompletionRequest(**chat, max_tokens=50), 40, 30, 30), (ChatCompletionRequest(**chat), 40, 30, 30)]
    for req, model_max, cap, want in cases:
        defaults = {} if model_max is None else {"max_tokens": model_max}
        assert req.sampling_params(defaults, cap).max_tokens == want, (req, model_max, cap)
    assert make_llm(model_with_defaults).engine.override_max_tokens is None
    assert make_llm(model_with_defaults, generation_config=str(model_with_defaults)).engine.override_max_tokens == 7
    llm = make_llm(model_with_defaults, generation_config="vllm",
                   override_generation_config={"max_new_tokens": 5, "temperature": 0.5})
    p = llm.get_default_sampling_params()
    assert (llm.engine.override_max_tokens, p.max_tokens, p.temperature, p.top_k) == (5, 5, 0.5, 0)
