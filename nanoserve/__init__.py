"""nanoserve: a small, readable LLM inference server in the shape of vLLM.

Public API: ``LLM`` (offline), ``SamplingParams``, ``StructuredOutputsParams``,
``RequestOutput``, ``CompletionOutput``. The server is ``python -m nanoserve``.
"""
from nanoserve.engine import LLM, CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
