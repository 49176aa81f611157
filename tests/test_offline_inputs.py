"""Bad inputs to the offline API (vLLM's LLM and its parameter classes) that its fuzz, tests/test_offline_fuzz.py,
found getting past the checks: each is now a ValueError or TypeError whose one-line message names the parameter,
and the engine is left as it was."""
from __future__ import annotations

import math

import pytest
import torch

from nanoserve import PoolingParams, SamplingParams
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
    assert SamplingParams(seed=-1).seed is None and SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(allowed_token_ids=(3, 3, 4)).allowed_token_ids == [3, 4]
    assert SamplingParams(n=16384, temperature=1.0).n == 16384  # vLLM's VLLM_MAX_N_SEQUENCES
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.choice == ["a"]
    assert BeamSearchParams(2, None, temperature=0.7, allowed_token_ids=(5, 6)).beam_width == 2
