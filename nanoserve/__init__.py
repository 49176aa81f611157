"""nanoserve: a small, readable LLM inference server in the shape of vLLM.

Public API: ``LLM`` (offline), ``SamplingParams``, ``BeamSearchParams``, ``StructuredOutputsParams``,
``RequestOutput``, ``CompletionOutput``, ``LoRARequest``, and vLLM's custom logits processor interface
(``LogitsProcessor``, ``AdapterLogitsProcessor``, ``BatchUpdate``, ``MoveDirectionality``, ``process_dict_updates``).
The server is ``python -m nanoserve``.
"""
from nanoserve.engine import (LLM, BeamSearchParams, CompletionOutput, LoRARequest, RequestOutput, SamplingParams,
                              StructuredOutputsParams)
from nanoserve.model import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, MoveDirectionality,
                             process_dict_updates)

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "LoRARequest", "LogitsProcessor", "AdapterLogitsProcessor", "BatchUpdate",
           "MoveDirectionality", "process_dict_updates"]
__version__ = "0.1.0"
