"""nanoserve: a small, readable LLM inference server in the shape of vLLM.

Public API: ``LLM`` (offline), ``SamplingParams``, ``BeamSearchParams``, ``StructuredOutputsParams``,
``RequestOutput``, ``CompletionOutput``. The server is ``python -m nanoserve``.
"""
from nanoserve.engine import (LLM, BeamSearchParams, CompletionOutput, RequestOutput, SamplingParams,
                              StructuredOutputsParams)

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"
