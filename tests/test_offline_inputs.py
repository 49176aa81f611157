"""Bad inputs to the offline API (vLLM's LLM and its parameter classes) that its fuzz, tests/test_offline_fuzz.py,
found getting past the checks: each is now a ValueError or TypeError whose one-line message names the parameter,
and the engine is left as it was."""
from __future__ import annotations

import math

import pytest
import torch

from nanoserve import LoRARequest, PoolingParams, SamplingParams
from nanoserve.engine import BeamSearchParams, InvalidInput, StructuredOutputsParams

T = torch.tensor([1, 2])  # a tensor where a scalar belongs: `==` and `if` on it raise RuntimeError


@pytest.mark.parametrize("make, param", [
    (lambda: SamplingParams(logit_bias=T), "logit_bias"),  # RuntimeError (a tensor's truth value)
    (lambda: SamplingParams(seed=T), "seed"),  # RuntimeError (seed == -1)
    (lambda: SamplingParams(thinking_token_budget=T), "thinking_token_budget"),  # RuntimeError
    (lambda: SamplingParams(allowed_token_ids=T), "allowed_token_ids"),  # RuntimeError
    (lambda: SamplingParams(structured_outputs="x"), "structured_outputs"),  # AttributeError as it compiled
    (lambda: SamplingParams(structured_outputs={"jsn": {}}), "structured_outputs"),  # a bare TypeError
    (lambda: SamplingParams(repetition_detection=[2]), "repetition_detection"),  # taken: AttributeError in a step
    (lambda: SamplingParams(skip_special_tokens="\ud800"), "skip_special_tokens"),  # taken: failed in a step
    (lambda: SamplingParams(detokenize=T), "detokenize"),
    (lambda: SamplingParams(n=2**63), "n"),  # taken: MemoryError making 2**63 requests
    (lambda: StructuredOutputsParams(json={}, disable_any_whitespace=T), "structured_outputs"),  # RuntimeError
    (lambda: BeamSearchParams(2, 3, allowed_token_ids=T), "allowed_token_ids"),  # RuntimeError in BeamSearch
    (lambda: BeamSearchParams(2, 3, skip_special_tokens="x"), "skip_special_tokens"),  # taken: failed in a step
    (lambda: BeamSearchParams(2, 3, temperature=math.nan), "temperature"),
    (lambda: BeamSearchParams(2, True), "max_tokens"),  # taken as 1
    (lambda: PoolingParams(dimensions=torch.randn(20, 20)), "dimensions"),  # a ValueError of many lines
], ids=lambda v: v if isinstance(v, str) else "")
def test_params_refuse_in_one_line_naming_the_field(make, param):
    with pytest.raises(InvalidInput) as e:
        make()
    assert e.value.param == param
    assert "\n" not in str(e.value) and param in str(e.value), str(e.value)


def test_params_still_take_what_they_took():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(allowed_token_ids=(3, 3, 4)).allowed_token_ids == [3, 4]
    assert SamplingParams(n=16384, temperature=1.0).n == 16384  # vLLM's VLLM_MAX_N_SEQUENCES
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.choice == ["a"]
    assert BeamSearchParams(2, None, temperature=0.7, allowed_token_ids=(5, 6)).beam_width == 2


# ================================================================ LLM's methods

USER = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def llm(tiny_model):
    from nanoserve import LLM
    return LLM(str(tiny_model), dtype="float32", max_model_len=64, num_kv_blocks=16, enable_lora=True)


@pytest.fixture(scope="module")
def pooling_llm(tiny_model):
    from nanoserve import LLM
    return LLM(str(tiny_model), runner="pooling", dtype="float32", max_model_len=64, num_kv_blocks=16)


def _refused(call, param: str, kind: type = InvalidInput) -> None:
    with pytest.raises(kind) as e:
        call()
    assert getattr(e.value, "param", param) == param
    assert "\n" not in str(e.value) and param in str(e.value), str(e.value)


@pytest.mark.parametrize("call, param", [
    (lambda llm: llm.chat(385), "messages"),  # TypeError: 'int' object is not subscriptable
    (lambda llm: llm.chat([USER, 5]), "messages"),
    (lambda llm: llm.chat(USER, chat_template={"a": 1}), "chat_template"),  # TypeError: unhashable type
    (lambda llm: llm.chat(USER, chat_template_kwargs=[1]), "chat_template_kwargs"),  # dict()'s ValueError
    (lambda llm: llm.chat(USER, add_generation_prompt=T), "add_generation_prompt"),  # RuntimeError
    (lambda llm: llm.generate("hi", priority=object()), "priority"),  # TypeError: not iterable
    (lambda llm: llm.generate("hi", lora_request=LoRARequest("a", 1, ["x"])), "lora_request"),  # pathlib's TypeError
    (lambda llm: llm.generate("hi", lora_request=LoRARequest("a", torch.randn(9, 9), "x")), "lora_request"),
    (lambda llm: llm.beam_search("hi", BeamSearchParams(2, 3), concurrency_limit="x"), "concurrency_limit"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_llm_refuses_in_one_line_naming_the_argument(llm, call, param):
    free = llm.engine.scheduler.block_manager.num_free_blocks
    _refused(lambda: call(llm), param)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_free_blocks == free


def test_beam_search_takes_only_beam_search_params(llm):
    _refused(lambda: llm.beam_search("hi", 63), "params", TypeError)  # AttributeError: no max_tokens


def test_encode_names_a_bad_pooling_task_in_one_line(pooling_llm):
    _refused(lambda: pooling_llm.encode("hi", pooling_task=torch.randn(20, 20)), "pooling_task")


def test_truncated_token_ids_are_checked_before_they_are_decoded(llm):
    """truncate_prompt_tokens kept ids past a C long, which the tokenizer's decode met first (OverflowError)."""
    _refused(lambda: llm.generate([2**64] * 30, SamplingParams(truncate_prompt_tokens=5, max_tokens=2),
                                  use_tqdm=False), "prompt")
    out = llm.generate([9999, 5, 6], SamplingParams(truncate_prompt_tokens=2, max_tokens=2, temperature=0),
                       use_tqdm=False)[0]  # the id dropped is never read
    assert out.prompt_token_ids == [5, 6] and len(out.outputs[0].token_ids) == 2
