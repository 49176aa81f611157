"""nanoserve: a small, readable LLM inference server in the shape of vLLM.

Public API: ``LLM`` (offline), ``SamplingParams``, ``BeamSearchParams``, ``StructuredOutputsParams``,
``RequestOutput``, ``CompletionOutput``, ``PoolingParams``, ``EmbeddingRequestOutput`` (``LLM.embed``),
``ClassificationRequestOutput`` (``LLM.classify``) and ``ScoringRequestOutput`` (``LLM.score``),
``LoRARequest``, and vLLM's custom logits processor interface
(``LogitsProcessor``, ``AdapterLogitsProcessor``, ``BatchUpdate``, ``MoveDirectionality``, ``process_dict_updates``).
The server is ``python -m nanoserve``.
"""
import os
import sys

# The one setting made at import, because no later moment exists: libgomp reads GOMP_SPINCOUNT once, as
# torch loads it. OpenMP threads (torch's, oneDNN's, the C kernels') that wait at a barrier spin ~300,000
# times before they sleep by default; on a CPU another process also uses, a descheduled thread then stalls
# its peers for whole time slices, and a mixture-of-experts step (many small parallel regions) crawls.
# 10,000 spins cost nothing measurable on an idle CPU (RESULTS.md, "OpenMP threads that wait"). Imported
# after torch, this does nothing; a value the user set wins.
if "torch" not in sys.modules:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from nanoserve.engine import (LLM, BeamSearchParams, ClassificationRequestOutput, CompletionOutput,
                              EmbeddingRequestOutput, LoRARequest, PoolingParams, RequestOutput, SamplingParams,
                              ScoringRequestOutput, StructuredOutputsParams)
from nanoserve.model import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, MoveDirectionality,
                             process_dict_updates)

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "PoolingParams", "EmbeddingRequestOutput", "ClassificationRequestOutput",
           "ScoringRequestOutput", "LoRARequest", "LogitsProcessor",
           "AdapterLogitsProcessor", "BatchUpdate", "MoveDirectionality", "process_dict_updates"]
__version__ = "0.1.0"
