"""Speculative decoding: its config and the n-gram (prompt lookup) proposer.

vLLM's ``--speculative-config '{"method": "ngram", ...}'`` in small (vLLM keeps these in
``config/speculative.py`` and ``v1/spec_decode/ngram_proposer.py``). After each step the
engine asks the proposer for up to ``num_speculative_tokens`` draft tokens for each
running request: the tokens that followed an earlier occurrence of the request's last n
tokens in its prompt and output. The scheduler gives the request 1 + k token slots, the
model runs them as one short chunk, and the sampler (model.Sampler.sample_speculative)
keeps the longest prefix of the drafts that matches what it samples, plus one token of
its own. Only methods without a draft model are served: n-gram drafts cost no forward.

It imports neither torch nor the engine: it reads token id lists and hands back lists.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("ngram",)
# vLLM's methods that run a draft model (or heads) beside the target: none is served here
DRAFT_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                       "ernie_mtp", "qwen3_next_mtp", "longcat_flash_mtp", "suffix")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's SpeculativeConfig, its n-gram fields: up to ``num_speculative_tokens`` drafts a step,
    found by matching the last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @classmethod
    def from_dict(cls, config: Any) -> "SpeculativeConfig":
        """vLLM's speculative_config (a dict, as --speculative-config's JSON): ValueError, one line, for
        what nanoserve cannot serve. As vLLM's: model "ngram" means the method; one prompt_lookup bound
        given stands for both; neither given is 5 and 5."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a JSON object such as '{{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 3}}', got {config!r}")
        fields = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
        if unknown := sorted(set(config) - set(fields)):
            raise ValueError(f"speculative_config: {', '.join(map(repr, unknown))} not supported: nanoserve takes "
                             f"{', '.join(fields)} (n-gram speculation)")
        method, model = config.get("method"), config.get("model")
        if method is None and model in ("ngram", "[ngram]"):  # vLLM's older spelling
            method, model = "ngram", None
        if model is not None or method in DRAFT_MODEL_METHODS:
            raise ValueError(f"speculative_config: draft models are not supported (method {method!r}, model "
                             f"{model!r}); nanoserve speculates with method \"ngram\" only (prompt lookup)")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {method!r}")
        k = config.get("num_speculative_tokens")
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        return cls(method, k, hi, lo)


class NgramProposer:
    """Prompt lookup (vLLM's NgramProposer): the longest n-gram, n in [min_n, max_n], that ends the
    tokens and occurs earlier in them, at its earliest occurrence; the draft is what followed it."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens for what follows ``token_ids`` (fewer where the match is near the
        end; none where nothing matches)."""
        total = len(token_ids)
        if k < 1 or total <= self.min_n:
            return []
        # The search runs in C over the ids' bytes (4 a token); a hit must also start on a token's edge.
        data = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self._earliest(data, data[-4 * n:], 4 * (total - 1))
            if start is not None:
                return token_ids[start + n:start + n + k]
        return []

    @staticmethod
    def _earliest(data: bytes, pattern: bytes, end: int) -> int | None:
        """The first token index where ``pattern`` occurs in ``data[:end]``, if any."""
        i = data.find(pattern, 0, end)
        while i != -1 and i % 4:
            i = data.find(pattern, i + 1, end)
        return None if i == -1 else i // 4
