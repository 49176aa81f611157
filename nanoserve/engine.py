"""Engine layer: the request lifecycle and the step loop.

This module owns
* ``SamplingParams`` (vLLM's names, defaults and validation), ``Request`` and
  the output types ``RequestOutput`` / ``CompletionOutput``;
* tokenizing prompts and detokenizing outputs incrementally, stop conditions;
* chat templates (``apply_chat_template``); the sampling defaults of generation_config.json;
* structured outputs: xgrammar grammars compiled once, a matcher per request;
* speculative decoding's config and n-gram drafts (``NgramProposer``), asked for after each step;
* ``LLMEngine.step()``: schedule -> execute -> postprocess, the loop every
  front end drives (``step_work``; with async scheduling step N+1 is launched
  before step N lands); the offline ``LLM`` class drives it in a plain loop, and
  ``AsyncLLM`` drives it as one task on the server's asyncio loop;
* tensor parallelism's processes: rank 0's workers (``TPWorkers``), other nodes' (``run_worker_node``);
* the counters behind ``stats()`` and ``/metrics``.

It does not decide who runs in a step (the scheduler does) and never indexes
the KV cache (the block manager and the model runner do). At start-up it sizes
and allocates the KV cache (``kvcache``) and hands the ``BlockManager`` to the
scheduler; at run time it talks to the scheduler only, whose output carries
each scheduled request's block table.

Read from a server request's side: ``AsyncLLM`` (near the end) -> ``LLMEngine.add_request``
-> ``LLMEngine.step_work``; from Python's: ``LLM.generate`` -> the same two.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import enum
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import logging
import math
import os
import re
import threading
import time
import weakref
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Generator, Iterable, Sequence

import torch

from nanoserve import kernels, kvcache
from nanoserve.kvcache import BlockManager, CacheConfig, KVCachePlan, KVCacheSpec
from nanoserve.model import LOG_DATE_FORMAT, LOG_FORMAT  # noqa: F401 - for entry: the server logs as its ranks do
from nanoserve.model import (MAX_LOGPROBS, NO_TOKEN, AsyncModelRunnerOutput, LogitsProcessor, LoRAConfig, ModelConfig,
                             ModelRunner, SampleRequest, SampleResult, SamplingTensors, SeqInput, TokenLogprobs, TPGroup,
                             WorkerSpec, check_tensor_parallel, cudagraph_capture_sizes, first_line, init_distributed,
                             load_model, load_tokenizer, log_tensor_parallel, lora_slot_bytes, num_kv_heads_per_rank,
                             plan_rank_kv_cache, release_idle_memory, resolve_dtype, resolve_model_dir, wna16_packed,
                             run_worker, select_backend, shard_config, tcp_address, tune_process,
                             weight_bytes_before_load, wrap_lora_layers)
from nanoserve.model import WNA16_WEIGHTS, load_st_projector
from nanoserve.scheduler import (SCHEDULING_POLICIES, RequestStatus, ScheduledRequest, Scheduler, SchedulerConfig,
                                 SchedulerOutput)

logger = logging.getLogger("nanoserve.engine")

_SAMPLING_EPS = 1e-5  # as vLLM: a temperature below this is greedy
_MIN_TEMP = 1e-2      # as vLLM's _MAX_TEMP: a smaller positive one is raised to this (1/t overflows)
_FP32_MAX = torch.finfo(torch.float32).max  # the sampler adds logit_bias to fp32 logits
# The sampler divides a seen token's positive fp32 logit by repetition_penalty (and multiplies a negative one): a
# smaller one overflows the logit to inf, or rounds to 0 (0 / 0), and a row with NaN samples garbage (an unused id,
# past any grammar); a larger one rounds to inf (0 * inf)
_REPETITION_PENALTY_RANGE = (1e-30, 1e30)
MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine is dead: /health 503, the server exits


class InvalidInput(ValueError):
    """Bad input; ``param`` names what it is about (a SamplingParams field,
    "prompt", "request_id", "token_ids"), for a front end to name its own field."""

    def __init__(self, param: str, message: str):
        super().__init__(re.sub(r"\s*\n\s*", " ", message))  # one line, even where it shows a tensor's repr
        self.param = param


# =========================================================================== parameters

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # one per constraint
REASONING_PARSERS = ("deepseek_r1", "openai_gptoss", "qwen3")  # vLLM's --reasoning-parser names nanoserve has
THINK_TAGS = ("<think>", "</think>")  # what both of them read the reasoning between
# JSON nested deeper than this is refused (a body, tool-call arguments): jinja, xgrammar or json itself may recurse
# too far, and where json's own RecursionError falls depends on the process (torch.compile raises the limit)
MAX_JSON_DEPTH = 128
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
MAX_N_SEQUENCES = 16384  # vLLM's bound on n (its VLLM_MAX_N_SEQUENCES): each is a request, made up front


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: constrain the output to exactly one of a
    JSON schema, any JSON object, a regex, a choice of strings, an EBNF grammar, or
    a structural tag (xgrammar's, as JSON text: free text until a trigger, then a
    tag's begin, its content, its end; vLLM also takes the older structures/triggers)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):  # the others' contents are xgrammar's to refuse
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidInput("structured_outputs", f"structured_outputs.{name} must be True or False, got "
                                                         f"{getattr(self, name)!r}")
        given = self.given()
        if len(given) != 1:
            raise InvalidInput("structured_outputs", "structured_outputs must set exactly one of json, regex, "
                               f"choice, grammar, json_object; got {given or 'none'}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise InvalidInput("structured_outputs", "structured_outputs.choice must be a non-empty list of strings")

    def given(self) -> list[str]:
        """The kinds set: as vLLM, an empty one counts ({} is any JSON, "" matches the empty text)."""
        return [n for n in STRUCTURED_KINDS if getattr(self, n) is not None and getattr(self, n) is not False]

    def key(self) -> str:
        """What identifies the compiled grammar."""
        return json.dumps([getattr(self, n) for n in (*STRUCTURED_KINDS, "disable_any_whitespace")],
                          sort_keys=True, default=str)


@dataclass(slots=True)
class RepetitionDetectionParams:
    """vLLM's: end a request (finish_reason "repetition") once its output ends in a run of
    tokens min_pattern_size..max_pattern_size long (0: 1) repeated min_count times in a row."""
    max_pattern_size: int = 0  # 0: off
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            raise InvalidInput("repetition_detection", f"repetition_detection's sizes and count must be integers, "
                                                       f"got {sizes}")
        if not 0 <= self.min_pattern_size <= self.max_pattern_size or self.min_count < 0 or \
                (self.max_pattern_size > 0 and self.min_count < 2):
            raise InvalidInput("repetition_detection", "repetition_detection needs 0 <= min_pattern_size <= "
                                                       "max_pattern_size and, with max_pattern_size > 0, "
                                                       f"min_count >= 2; got {sizes}")

    def found(self, token_ids: list[int]) -> bool:
        """Whether ``token_ids`` end in a pattern repeated min_count times (vLLM's check_sequence_repetition)."""
        count = self.min_count
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if size * count > len(token_ids):
                return False
            tail = token_ids[-size:]
            if all(token_ids[-size * (m + 1):len(token_ids) - size * m] == tail for m in range(1, count)):
                return True
        return False


@dataclass(slots=True)
class SamplingParams:
    """vLLM's SamplingParams: same names, defaults and allowed ranges."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16     # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None     # the sampled token's logprob + the top-N (-1: all; cap: max_logprobs)
    prompt_logprobs: int | None = None  # each prompt token's logprob + the top-N (as logprobs)
    logprob_token_ids: list[int] | None = None  # the logprobs of these tokens instead of the top-N (at most 128)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never to complete (their last token is banned after the rest)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: max_model_len - 1, as vLLM 0.32)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # taken as vLLM's: fast tokenizers decode as they do anyway
    detokenize: bool = True         # False: token ids only (as vLLM; benchmarks use it)
    structured_outputs: StructuredOutputsParams | None = None
    # with a reasoning parser: once this many tokens are thought (since the last <think>), </think> is forced
    thinking_token_budget: int | None = None
    stream_interval: int | None = None  # a stream's outputs every N tokens (the first and last too; engine's if more)
    repetition_detection: RepetitionDetectionParams | None = None
    extra_args: dict[str, Any] | None = None  # as vLLM's: for custom code (the custom logits processors)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)  # vLLM's: bad_words tokenized

    def __post_init__(self) -> None:
        self.structured_outputs = _nested_params(self.structured_outputs, "structured_outputs",
                                                 StructuredOutputsParams)
        self.repetition_detection = _nested_params(self.repetition_detection, "repetition_detection",
                                                   RepetitionDetectionParams)
        _check_bools(self, _BOOL_FIELDS)  # a non-bool went as far as the detokenizer, and failed the request there
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # `==` and truthiness below must not meet a tensor or an array (their answer is one per element)
        if _is_int(self.seed) and self.seed == -1:  # as vLLM's: -1 asks for a random seed ("regenerate")
            self.seed = None
        if _is_int(self.thinking_token_budget) and self.thinking_token_budget == -1:  # as vLLM's: no budget
            self.thinking_token_budget = None
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidInput("logit_bias", f"logit_bias must be a dict of token ids to numbers, got "
                                             f"{type(self.logit_bias).__name__}")
        if self.logprob_token_ids is not None and not isinstance(self.logprob_token_ids, (list, tuple)):
            raise InvalidInput("logprob_token_ids", f"logprob_token_ids must be a list, got {self.logprob_token_ids!r}")
        self.logprob_token_ids = list(self.logprob_token_ids or ()) or None  # as vLLM's: [] asks for nothing
        for name in ("stop", "stop_token_ids", "bad_words", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise InvalidInput(name, f"{name} must be a list, got {value!r}")
            if name != "allowed_token_ids":  # its None (all) and [] (refused by _verify) differ
                setattr(self, name, list(value or []))
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise InvalidInput("logit_bias", "logit_bias must map token ids to numbers") from None
            # +inf (or past fp32's range) would turn a row into NaN, which samples garbage; -inf bans the token
            if not all(_is_num(v) and (v == -math.inf or abs(v) <= _FP32_MAX) for v in self.logit_bias.values()):
                raise InvalidInput("logit_bias", "logit_bias values must be numbers within fp32's range, or -inf "
                                                 "(a ban); not NaN or +inf")
        self._verify()
        if self.allowed_token_ids:  # the sampler reads the list at every step: a repeat costs time and means nothing
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.logprob_token_ids:  # as vLLM's: each position has their logprobs (a repeat has one entry)
            self.logprob_token_ids = list(dict.fromkeys(self.logprob_token_ids))
            self.logprobs = len(self.logprob_token_ids)
        if 0 < self.temperature < _MIN_TEMP:  # so only 0 is greedy, as in vLLM
            self.temperature = _MIN_TEMP
        if self.temperature < _SAMPLING_EPS:  # greedy: the truncations cannot change argmax
            if self.n > 1:  # as vLLM's _verify_greedy_sampling: n copies of one argmax
                raise InvalidInput("n", f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0

    def _verify(self) -> None:
        def bad(name, rule):
            raise InvalidInput(name, f"{name} must be {rule}, got {getattr(self, name)!r}")
        _check_int(self, "n")
        if not 1 <= self.n <= MAX_N_SEQUENCES:
            bad("n", f"in [1, {MAX_N_SEQUENCES}]")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= 2:
            bad("temperature", "in [0, 2]")  # as vLLM's and OpenAI's
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        _check_int(self, "top_k")
        if self.top_k < -1:
            bad("top_k", "-1, 0 (disabled) or a positive integer")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "in [-2, 2]")
        low, high = _REPETITION_PENALTY_RANGE
        if not _is_num(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            bad("repetition_penalty", f"in [{low:g}, {high:g}] (> 0; fp32 logits cannot take a smaller or larger one)")
        if self.seed is not None:
            _check_int(self, "seed")
            if not -2**63 <= self.seed < 2**63:  # vLLM's range (a torch.long)
                bad("seed", "in [-2**63, 2**63 - 1]")
        if self.max_tokens is not None:
            _check_int(self, "max_tokens")
            if self.max_tokens < 1:
                bad("max_tokens", ">= 1")
        _check_int(self, "min_tokens")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(self, name)
                if getattr(self, name) < -1:  # the upper bound is the engine's max_logprobs
                    bad(name, "None, -1 (the whole vocabulary) or >= 0")
        if not all(isinstance(s, str) for s in self.stop) or any(s == "" for s in self.stop):
            bad("stop", "a string or a list of non-empty strings")
        for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in getattr(self, name) or ()):
                bad(name, "a list of token ids")
        if self.logprob_token_ids:
            if len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
                raise InvalidInput("logprob_token_ids", f"logprob_token_ids must hold at most {MAX_LOGPROB_TOKEN_IDS} "
                                                        f"token ids, got {len(self.logprob_token_ids)}")
            if self.logprobs is not None and self.logprobs != len(self.logprob_token_ids):
                bad("logprobs", f"None or the number of logprob_token_ids ({len(self.logprob_token_ids)})")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "None or a non-empty list of token ids")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "a list of non-empty strings")
        if self.truncate_prompt_tokens is not None:
            _check_int(self, "truncate_prompt_tokens")
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                bad("truncate_prompt_tokens", "None, -1 (all but one token of max_model_len) or >= 1")
        if self.stop and not self.detokenize:
            bad("stop", "empty when detokenize=False (stop strings need the text)")
        if self.stream_interval is not None:
            _check_int(self, "stream_interval")
            if self.stream_interval < 1:
                bad("stream_interval", "None or >= 1")
        if self.thinking_token_budget is not None:
            _check_int(self, "thinking_token_budget")
            if self.thinking_token_budget < 0:
                bad("thinking_token_budget", "None, -1 (no budget) or >= 0")

    def update_from_tokenizer(self, tokenizer) -> None:
        """As vLLM's: tokenize bad_words now (the server, on its tokenizer thread, not on the loop)."""
        self._bad_words_token_ids = self.bad_words_token_ids(tokenizer)

    def bad_words_token_ids(self, tokenizer) -> list[list[int]]:
        """Each bad word's tokens as vLLM finds them: the word as given, and with a
        leading space where that tokenizes differently but as long; those that
        update_from_tokenizer stored, if it ran."""
        if self._bad_words_token_ids is not None:
            return self._bad_words_token_ids
        out = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out += [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        return out


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (its LLM.beam_search; the server's use_beam_search).
    Beams are ranked by raw logprobs, which temperature leaves alone: it is taken, as vLLM's, and changes nothing."""
    beam_width: int
    max_tokens: int | None            # None: up to max_model_len
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0       # a beam's score: cumulative logprob / length ** length_penalty
    include_stop_str_in_output: bool = False  # keep an ending EOS in the token ids
    allowed_token_ids: list[int] | None = None
    # nanoserve's (vLLM has no such fields): what the outputs show
    logprobs: int | None = None       # each token's logprob and the top-N (at most 2 x beam_width)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        w = self.beam_width
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise InvalidInput("beam_width", f"beam_width must be an integer >= 1, got {w!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidInput("max_tokens", f"max_tokens must be None or >= 1 for beam search, got "
                                             f"{self.max_tokens!r}")
        if not _is_num(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise InvalidInput("length_penalty", f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not _is_num(self.temperature) or not 0 <= self.temperature < math.inf:  # taken, and changes nothing
            raise InvalidInput("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        # read by the beams' requests, where a non-bool failed them
        _check_bools(self, ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (list, tuple)):
            raise InvalidInput("allowed_token_ids", f"allowed_token_ids must be a list, got "
                                                    f"{type(self.allowed_token_ids).__name__}")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) > MAX_LOGPROB_TOKEN_IDS:
            # vLLM ranks more than that by the top 2 x beam_width of all tokens: a beam may find no candidate
            raise InvalidInput("allowed_token_ids", f"allowed_token_ids must hold at most {MAX_LOGPROB_TOKEN_IDS} "
                                                    f"token ids for beam search (each round ranks them all), got "
                                                    f"{len(self.allowed_token_ids)}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= 2 * w):
            raise InvalidInput("logprobs", f"logprobs must be None or in [0, {2 * w}] (2 x beam_width: the "
                                           f"candidates beam search ranks) for beam search, got {self.logprobs}")


def held_back_by_min_tokens(p: SamplingParams, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids min_tokens bans until it is reached: stop_token_ids, and EOS unless ignore_eos."""
    return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_token_ids))


def _token_bits(token_ids: Iterable[int], vocab_size: int) -> int:
    """Token ids as one int's bits (bit t: token t), to intersect sets of the vocabulary's size at once."""
    bits = bytearray((vocab_size + 7) // 8)
    for t in token_ids:
        if t < vocab_size:  # a tokenizer's id past the model's vocabulary is never sampled anyway
            bits[t >> 3] |= 1 << (t & 7)
    return int.from_bytes(bits, "little")


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _check_int(p: SamplingParams, name: str) -> None:
    v = getattr(p, name)
    if not _is_int(v):
        raise InvalidInput(name, f"{name} must be an integer, got {v!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_bools(p: Any, names: Iterable[str]) -> None:
    for name in names:
        if not isinstance(getattr(p, name), bool):
            raise InvalidInput(name, f"{name} must be True or False, got {getattr(p, name)!r}")


_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                "detokenize")


def _nested_params(value: Any, name: str, cls: type) -> Any:
    """A SamplingParams field that holds params of its own: ``cls``, None, or a dict of its fields."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise InvalidInput(name, f"{name} must be a {cls.__name__} or a dict of its fields, got "
                                 f"{type(value).__name__}")
    try:
        return cls(**value)
    except TypeError as e:  # a key it has not, or one not a string
        raise InvalidInput(name, f"{name}: {e}") from None


# =========================================================================== outputs

@dataclass(slots=True)
class Logprob:
    """vLLM's Logprob: a token's raw logprob, its rank in the distribution
    (1 = the most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; the first is None (nothing predicts it)


def logprob_entry(token_id: int, logprob: float, rank: int, top: list[tuple[int, float]],
                  texts: list[str | None]) -> dict[int, Logprob]:
    """One position's logprobs as vLLM's: the token's own (with its rank: how many are at
    least as likely), then the top ones ranked 1, 2, ...; ``texts``: each one's text, in that order."""
    entry = {token_id: Logprob(logprob, rank, texts[0])}
    for i, ((t, lp), text) in enumerate(zip(top, texts[1:])):
        entry.setdefault(t, Logprob(lp, i + 1, text))
    return entry


class RequestOutputKind(enum.Enum):
    """vLLM's: what each output of a request carries. ``every_step`` and ``is_delta``
    are plain attributes, as RequestStatus's: every step reads them for every request."""
    CUMULATIVE = 0, True, False   # everything so far, every step (step()'s default)
    DELTA = 1, True, True         # only what is new since the previous output (the server's: O(1) a step)
    FINAL_ONLY = 2, False, False  # nothing until the request finishes, then everything (offline generate)

    def __new__(cls, value: int, every_step: bool, is_delta: bool):
        member = object.__new__(cls)
        member._value_, member.every_step, member.is_delta = value, every_step, is_delta
        return member


@dataclass(slots=True)
class CompletionOutput:
    """One completion's text, token ids and logprobs: all of them so far, or under
    RequestOutputKind.DELTA only this output's new ones (merge_deltas adds them up)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the token's and the top ones, as vLLM's
    finish_reason: str | None = None                # "stop", "length", "abort", "repetition" or None
    stop_reason: int | str | None = None
    delta_text: str = ""                            # what this step added (for streaming)

    def finished(self) -> bool:
        return self.finish_reason is not None


def merge_deltas(deltas: list[CompletionOutput]) -> CompletionOutput:
    """A completion's DELTA outputs, in order, as the one cumulative output they make."""
    last = deltas[-1]
    return dataclasses.replace(last, text="".join(c.text for c in deltas),
                               token_ids=[t for c in deltas for t in c.token_ids],
                               logprobs=None if last.logprobs is None else [e for c in deltas for e in c.logprobs])


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic) the server turns into latency histograms."""
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None


@dataclass(slots=True)
class RequestOutput:
    """One request's state after a step. For n > 1, ``outputs`` holds the
    completions that changed in this step (``LLM.generate`` returns all n)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None


# =========================================================================== pooling (embeddings)
# vLLM's pooling runner for decoder models (--runner pooling, as_embedding_model): a prompt is
# prefilled, never sampled from; its pooler turns the final-norm hidden states into one vector.

POOLING_TYPES = ("CLS", "LAST", "MEAN")  # vLLM's SequencePoolingType (CLS, on a decoder: the first token's)
TOKEN_POOLING_TYPES = ("ALL", "STEP")  # vLLM's TokenPoolingType: a vector per token (token_embed, token_classify)
# vLLM's PoolingTask that nanoserve serves: an embedding model's two, a classifier's two
POOLING_TASKS = ("embed", "token_embed", "classify", "token_classify")
REMOVED_POOLING_TASKS = {"score": "`score` task was removed; use `classify` instead.",  # vLLM's words
                         "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead."}
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")  # vLLM's reward head is not built here
# older vLLM's --task: embed(ding) is the pooling runner, classify and score too (as --convert classify)
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")


@dataclass(slots=True)
class PoolerConfig:
    """vLLM's --pooler-config for embeddings: how the hidden states become one vector.
    None fields are filled from a sentence-transformers checkpoint's modules.json, then
    from vLLM's defaults for a decoder (LAST token, normalized). ``task`` picks which of the
    model's two pooling tasks the server and LLM.encode serve (vLLM's: the sequence one, embed or
    classify, unless told token_embed or token_classify: every token's row, ALL pooling)."""
    pooling_type: str | None = None
    use_activation: bool | None = None  # embeddings: L2-normalize (vLLM's name since `normalize` went)
    task: str | None = None

    @classmethod
    def from_dict(cls, given: dict[str, Any] | None) -> "PoolerConfig":
        given = dict(given or {})
        if "normalize" in given:  # vLLM 0.32's own words
            raise ValueError("pooler_config: Parameter `normalize` was removed; use `use_activation` instead.")
        for name in ("seq_pooling_type", "tok_pooling_type"):  # vLLM's internal names
            if name in given and "pooling_type" in given:
                raise ValueError(f"pooler_config: Cannot set both `pooling_type` and `{name}`")
        if "seq_pooling_type" in given:
            given["pooling_type"] = given.pop("seq_pooling_type")
        tok = given.pop("tok_pooling_type", None)
        if str(given.get("pooling_type")).upper() in TOKEN_POOLING_TYPES:  # vLLM's tok_pooling_type, so said
            tok = given.pop("pooling_type")
        if tok is not None and str(tok).upper() != "ALL":
            raise ValueError(f"pooler_config: tok_pooling_type must be ALL (every token's row; vLLM's STEP, a "
                             f"process reward model's, is not served here), got {tok!r}")
        unknown = sorted(set(given) - {"pooling_type", "use_activation", "task"})
        if unknown:
            raise ValueError(f"pooler_config: {', '.join(unknown)} not supported here (pooling_type, "
                             f"use_activation and task are)")
        config = cls(**given)
        if config.task is not None:
            check_removed_pooling_task(config.task, "pooler_config: ")
            if config.task not in POOLING_TASKS:
                raise ValueError(f"pooler_config: task must be one of {', '.join(POOLING_TASKS)}, got "
                                 f"{config.task!r}")
        if config.pooling_type is not None:
            config.pooling_type = str(config.pooling_type).upper()
            if config.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config: pooling_type must be one of "
                                 f"{', '.join(POOLING_TYPES + TOKEN_POOLING_TYPES[:1])}, got "
                                 f"{given['pooling_type']!r}")
        if config.use_activation is not None and not isinstance(config.use_activation, bool):
            raise ValueError(f"pooler_config: use_activation must be true or false, got {config.use_activation!r}")
        return config

    def resolved(self, path: Path, default_pooling_type: str = "LAST") -> "PoolerConfig":
        """The fields left None filled from the checkpoint's sentence-transformers files, then vLLM's defaults
        (the model's pooling type: LAST for a decoder, CLS for an encoder; normalized)."""
        st = sentence_transformers_pooling(path) or {}
        pooling_type = self.pooling_type or st.get("pooling_type") or default_pooling_type
        return PoolerConfig(pooling_type, next(v for v in (self.use_activation, st.get("use_activation"), True)
                                               if v is not None), self.task)


def check_removed_pooling_task(task: Any, where: str = "") -> None:
    """vLLM's check_removed_pooling_task: the tasks it renamed, refused in its words."""
    if isinstance(task, str) and task in REMOVED_POOLING_TASKS:
        raise InvalidInput("task", where + REMOVED_POOLING_TASKS[task])


def embed_task_instructions(path: Path) -> dict[str, str] | None:
    """vLLM's Cohere input_type prefixes: config.json's ``task_instructions``, else the sentence-transformers
    ``prompts`` (config_sentence_transformers.json); the string entries, None where there are none."""
    for name, key in (("config.json", "task_instructions"), ("config_sentence_transformers.json", "prompts")):
        try:
            found = json.loads((path / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, dict) and (found := {k: v for k, v in found.items() if isinstance(v, str)}):
            return found
    return None


def sentence_transformers_pooling(path: Path) -> dict[str, Any] | None:
    """vLLM's get_pooling_config: a sentence-transformers checkpoint's modules.json names its Pooling
    module (whose config.json says which pooling) and whether a Normalize module follows; None without."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        found: dict[str, Any] = {"use_activation": normalize}
        if pooling is not None and (path / pooling["path"] / "config.json").is_file():
            for key, value in json.loads((path / pooling["path"] / "config.json").read_text()).items():
                name = value if key == "pooling_mode" and isinstance(value, str) else key if value is True else ""
                kind = name.replace("pooling_mode_", "").split("_", 1)[0]  # pooling_mode_mean_tokens: MEAN
                kind = "LAST" if "lasttoken" in kind else kind.upper()
                if kind in ("CLS", "LAST", "MEAN"):  # vLLM's sequence poolings (include_prompt: not one)
                    found["pooling_type"] = kind
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{modules_file} (sentence-transformers) cannot be read: {type(e).__name__}: {e}") from None
    return found


@dataclass(slots=True)
class PoolingParams:
    """vLLM's PoolingParams for embeddings: ``dimensions`` keeps the first N of a Matryoshka
    model's vector (then normalizes); ``use_activation`` None takes the pooler config's;
    ``truncate_prompt_tokens`` as SamplingParams' (-1: as many as max_model_len holds)."""
    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise InvalidInput(name, f"{name} must be an integer, got {v!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise InvalidInput("truncate_prompt_tokens", f"truncate_prompt_tokens must be >= 1, or -1, got "
                                                         f"{self.truncate_prompt_tokens}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidInput("use_activation", f"use_activation must be true or false, got {self.use_activation!r}")


@dataclass(slots=True)
class PoolingOutput:
    data: torch.Tensor  # fp32, on the host


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's: a pooling request's result (it is finished in the step that computes it)."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: RequestMetrics | None = None  # the server's latency histograms (first_token_time: the vector's)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # the activation of the score head's logits (the logits with use_activation false)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class TaskRequestOutput:
    """What vLLM's results of one pooling task share (its PoolingRequestOutput[T]): the request's id,
    tokens and ``outputs``, the task's own type."""
    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    OUTPUT: ClassVar[type] = PoolingOutput  # what ``from_base`` makes of the pooled vector, as a list

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "TaskRequestOutput":
        return cls(out.request_id, cls.OUTPUT(out.outputs.data.tolist()), out.prompt_token_ids,
                   out.num_cached_tokens, out.finished)


class EmbeddingRequestOutput(TaskRequestOutput):
    """vLLM's LLM.embed() result: ``outputs.embedding``, a list of floats."""
    __slots__ = ()
    OUTPUT = EmbeddingOutput


class ClassificationRequestOutput(TaskRequestOutput):
    """vLLM's LLM.classify() result: ``outputs.probs``, a probability per label."""
    __slots__ = ()
    OUTPUT = ClassificationOutput


@dataclass(slots=True)
class ScoringOutput:
    score: float  # the cosine similarity of the pair's two embeddings, or a cross-encoder's activated logit


class ScoringRequestOutput(TaskRequestOutput):
    """vLLM's LLM.score() result for an embedding model (its bi-encoder): the pair's ids and tokens
    joined by the pad token (as vLLM's), ``outputs.score`` their embeddings' cosine similarity (or, for a
    cross-encoder, the pair's one prompt and its activated logit)."""
    __slots__ = ()

    @classmethod
    def from_pair(cls, a: PoolingRequestOutput, b: PoolingRequestOutput, pad_token_id: int | None,
                  score: Callable[[torch.Tensor, torch.Tensor], float] | None = None) -> "ScoringRequestOutput":
        """``score``: of the two outputs' data (None: cosine_score, a bi-encoder's)."""
        tokens = a.prompt_token_ids + ([] if pad_token_id is None else [pad_token_id]) + b.prompt_token_ids
        value = (score or cosine_score)(a.outputs.data, b.outputs.data)
        return cls(f"{a.request_id}_{b.request_id}", ScoringOutput(value), tokens,
                   a.num_cached_tokens + b.num_cached_tokens)


def cross_encoder_scores(outs: list[PoolingRequestOutput]) -> list[ScoringRequestOutput]:
    """A cross-encoder's pairs (each one prompt, scored by the model's one label) as vLLM's score outputs."""
    return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.data[0].item()), o.prompt_token_ids,
                                 o.num_cached_tokens) for o in outs]


def cosine_score(a: torch.Tensor, b: torch.Tensor) -> float:
    """vLLM's bi-encoder score: cosine similarity in fp32 (norms clamped at 1e-8)."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0).item()


def maxsim_score(query: torch.Tensor, doc: torch.Tensor) -> float:
    """vLLM's late-interaction (ColBERT MaxSim) score of two token_embed outputs, in fp32: for each query
    token the largest dot product with a document token, summed over the query's tokens."""
    return (query.float() @ doc.float().T).amax(dim=-1).sum().item()


def score_inputs(data_1: Any, data_2: Any, architecture: str, names: tuple[str, str] = ("data_1", "data_2")
                 ) -> tuple[list[str], list[str]]:
    """vLLM's validate_score_input: each side a text or a list of texts, paired 1:1, 1:N or N:N
    (multimodal {"content": ...} items are refused, as vLLM refuses them for a text-only model)."""
    sides = []
    for name, data in zip(names, (data_1, data_2)):
        items = data if isinstance(data, list) else [data]
        for i, item in enumerate(items):
            if isinstance(item, dict) and "content" in item:
                raise InvalidInput(name, f"MultiModalParam is not supported for {architecture}")
            if not isinstance(item, str):
                where = name if data is item else f"{name}[{i}]"
                raise InvalidInput(name, f"{where} must be a string (or a list of strings), got "
                                         f"{type(item).__name__}")
        sides.append(list(items))
    first, second = sides
    if len(first) > 1 and len(first) != len(second):  # vLLM's words
        raise InvalidInput(names[1], "Input lengths must be either 1:1, 1:N or N:N")
    if not first:
        raise InvalidInput(names[0], "At least one text element must be given")
    if not second:
        raise InvalidInput(names[1], "At least one text_pair element must be given")
    return first, second


def score_pairs(outs: list[PoolingRequestOutput], num_queries: int, pad_token_id: int | None,
                late_interaction: bool = False) -> list[ScoringRequestOutput]:
    """The queries' and documents' embeddings (queries first) as scored pairs: one query against each
    document (1:N), or each query against its document (N:N); by cosine similarity, or with
    ``late_interaction`` (token_embed's rows) by MaxSim."""
    score = maxsim_score if late_interaction else cosine_score
    return [ScoringRequestOutput.from_pair(q, d, pad_token_id, score) for q, d in paired(outs[:num_queries],
                                                                                         outs[num_queries:])]


def paired(queries: list, docs: list) -> list[tuple]:
    """vLLM's score pairs (score_inputs checked the lengths): one query against each document (1:N), or
    each query with its own (N:N)."""
    return list(zip(queries * len(docs) if len(queries) == 1 else queries, docs))


def resolve_runner(config: EngineConfig, path: Path, model_config: ModelConfig) -> str:
    """vLLM's runner "auto": pooling for a sentence-transformers checkpoint (a Pooling module in
    its modules.json) or a bare decoder (Qwen3Model), else generate. A bare decoder cannot generate."""
    runner = config.runner
    if runner == "generate" and model_config.encoder_only:
        raise ValueError(f"config.json names {model_config.architecture}, an encoder model: it serves the pooling "
                         f"runner only (--runner pooling)")
    if runner == "auto" and model_config.encoder_only:
        return "pooling"
    if runner == "auto":
        st = sentence_transformers_pooling(path)
        runner = "pooling" if model_config.base_model or model_config.num_labels is not None \
            or st is not None and "pooling_type" in st else "generate"
    if runner == "generate" and model_config.num_labels is not None:
        raise ValueError(f"config.json names {model_config.checkpoint_architecture}, a classifier without an LM "
                         f"head: it serves the classify task only (--runner pooling)")
    if runner == "generate" and model_config.base_model:
        raise ValueError(f"config.json names {model_config.checkpoint_architecture}, a decoder without its LM "
                         f"head: it makes embeddings only (--runner pooling)")
    return runner


def classify_overrides(config: EngineConfig, path: Path) -> dict[str, Any] | None:
    """hf_overrides with --convert classify's (vLLM's as_seq_cls_model): a causal LM's architecture named
    as its ForSequenceClassification, the decoder with a score head (from the checkpoint's score.weight,
    or built from LM-head rows by classifier_from_token)."""
    if not config.converts_to_classify:
        return config.hf_overrides
    if not (path / "config.json").is_file():
        return config.hf_overrides  # ModelConfig.from_dir says why
    archs = (config.hf_overrides or {}).get("architectures") or \
        json.loads((path / "config.json").read_text()).get("architectures") or [None]
    arch = str(archs[0])
    if arch.endswith("ForSequenceClassification"):
        return config.hf_overrides
    if not arch.endswith("ForCausalLM"):
        raise ValueError(f"convert classify turns a *ForCausalLM into its *ForSequenceClassification, and "
                         f"config.json names {arch}")
    return {**(config.hf_overrides or {}), "architectures": [arch.removesuffix("ForCausalLM") +
                                                             "ForSequenceClassification"]}


def model_overrides(config: EngineConfig, path: Path) -> dict[str, Any] | None:
    """hf_overrides as every rank loads the model: the pooling runner has no LM head (vLLM's pooling
    models have none), so it loads as if tied: a checkpoint's lm_head.weight is skipped, and one without is
    whole. A score head built from LM-head rows gets the tokens' ids, and which tensor holds those rows."""
    overrides = classify_overrides(config, path)
    mc = ModelConfig.from_dir(path, overrides)
    if resolve_runner(config, path, mc) != "pooling":
        return overrides
    rows = {} if mc.classifier_from_token is None else {
        "classifier_token_ids": classifier_token_ids(config, path, mc.classifier_from_token),
        "lm_head_tied": mc.tie_word_embeddings}
    return {**(overrides or {}), "tie_word_embeddings": True, **rows}


def encoder_head_pooling(mc: ModelConfig) -> str | None:
    """The pooling an encoder classifier's head is trained on (BERT's: CLS; ModernBERT's: its classifier_pooling,
    which vLLM takes whatever its pooler config or sentence-transformers files say); None: an embedding model."""
    if mc.num_labels is None or mc.token_classifier:
        return None
    return mc.modernbert.pooling if mc.modernbert else "CLS"


def check_encoder_config(config: EngineConfig, mc: ModelConfig) -> None:
    """What an encoder model is not served with: vLLM's ENCODER_ONLY attention has no prefix caching (turned
    off here too) and no chunked prefill (the engine checks max_num_batched_tokens once max_model_len is known)."""
    if config.tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: {mc.architecture} (an encoder "
                         f"model) runs on one rank only")
    if config.enable_lora:
        raise ValueError(f"enable_lora: LoRA adapters are not supported for {mc.architecture} (an encoder model)")
    if config.enable_prompt_embeds:
        raise ValueError(f"enable_prompt_embeds: {mc.architecture} (an encoder model) takes token ids only")
    if config.disable_sliding_window and mc.sliding_window is not None:  # vLLM's: full attention, the window
        # the longest prompt; an encoder here attends as config.json says, so the flag would be silently ignored
        raise ValueError(f"disable_sliding_window is not supported for {mc.architecture} (an encoder model): its "
                         f"sliding layers attend within their window; leave the flag out")
    head = encoder_head_pooling(mc)
    if head is not None and config.pooler_config.pooling_type not in (None, head):
        reads = "the CLS token" if head == "CLS" else "the mean of the tokens"
        raise ValueError(f"pooler_config: {mc.architecture}'s classifier head reads {reads}, got "
                         f"pooling_type {config.pooler_config.pooling_type}")
    if config.enable_prefix_caching:
        logger.info("[engine] prefix caching is off: %s attends bidirectionally (vLLM's ENCODER_ONLY)",
                    mc.architecture)
        config.enable_prefix_caching = False


def classifier_token_ids(config: EngineConfig, path: Path, tokens: tuple[str, ...]) -> list[int]:
    """classifier_from_token's ids, as vLLM's loader reads them (the tokenizer's convert_tokens_to_ids:
    vocabulary entries, not texts to tokenize); one the vocabulary lacks is refused by name."""
    tokenizer = load_tokenizer(path if config.tokenizer is None
                               else resolve_model_dir(config.tokenizer, config.revision, config.download_dir))
    unk = getattr(tokenizer, "unk_token", None)
    ids = []
    for token in tokens:
        i = tokenizer.convert_tokens_to_ids(token)
        if i is None or (token != unk and i == getattr(tokenizer, "unk_token_id", None)):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of this model's vocabulary "
                             f"(tokens as the tokenizer's vocabulary spells them, e.g. Qwen's \"yes\")")
        ids.append(i)
    return ids


def classify_activation(mc: ModelConfig) -> str:
    """vLLM's get_act_fn for a classifier's logits, as transformers' loss reads problem_type: regression's
    as they are, multi-label's sigmoid, else (single-label, or a sentence-transformers cross-encoder's
    Sigmoid or Softmax) softmax over several labels and sigmoid over one; Identity leaves them."""
    if mc.problem_type == "regression":
        return "identity"
    if mc.problem_type == "multi_label_classification":
        return "sigmoid"
    if mc.problem_type in (None, "single_label_classification") and mc.score_activation is not None:
        name = mc.score_activation.rsplit(".", 1)[-1]
        if not mc.score_activation.startswith("torch.nn.modules.") or name not in ("Identity", "Sigmoid", "Softmax"):
            raise ValueError(f"config.json's activation function {mc.score_activation!r} is not supported "
                             f"(torch.nn.modules' Identity, Sigmoid and Softmax are)")
        if name == "Identity":
            return "identity"
    return "sigmoid" if mc.num_labels < 2 else "softmax"


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """vLLM's PoolerActivation on one request's logits (fp32)."""
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits) if activation == "sigmoid" else logits


def finish_embedding(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """vLLM's EmbeddingPoolerHead (and its token-wise one, a row per token): Matryoshka's first
    ``dimensions`` first, then L2-normalize."""
    if dimensions is not None:
        pooled = pooled[..., :dimensions]
    return torch.nn.functional.normalize(pooled, p=2, dim=-1) if normalize else pooled


# =========================================================================== detokenizer

class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. It decodes a short
    window (a few tokens of context + the new ones) and emits only what the
    window adds, holding back a trailing incomplete UTF-8 character (U+FFFD), so
    the deltas concatenate to the final text and never split a character.

    A fast tokenizer's window is kept in Rust by tokenizers' DecodeStream (as
    vLLM's FastIncrementalDetokenizer): one call a token instead of two decodes.
    The offsets here move with it, so flush() and any window DecodeStream refuses
    (decoded here from then on) see the same window.

    A window that holds more than HOLD tokens without text is trimmed (_trim):
    else a run of bytes that form no character, or of skipped special tokens,
    would be decoded again whole at every token, quadratic in the run."""

    CONTEXT = 5  # prompt tokens kept as context, so a leading space decodes right
    HOLD = 16    # a character is at most 4 bytes: a longer wait is a run with nothing more to come
    # slots: step() reads its attributes for every request every token
    __slots__ = ("tokenizer", "skip", "ids", "prefix_offset", "read_offset", "backend", "stream")

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.backend = _rust_tokenizer(tokenizer)
        self.stream = None if self.backend is None else self._decode_stream()

    def step(self, token_id: int) -> str:
        """The text the new token completes, if any."""
        self.ids.append(token_id)
        if self.stream is not None:
            try:
                piece = self.stream.step(self.backend, token_id)
            except Exception:  # noqa: BLE001 - its only error: a window whose text changed under it
                self.stream = None
            else:
                if piece is not None:
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                    return piece
                if len(self.ids) - self.read_offset <= self.HOLD:
                    return ""
                self.stream = None  # its window would grow with the run: trimmed below from now on
        prefix, full = self._window()
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return self._trim(prefix, full) if len(self.ids) - self.read_offset > self.HOLD else ""

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete character and all."""
        prefix, full = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]

    def _decode_stream(self):
        """A DecodeStream that has read the context; None where the context ends
        inside a character (it would hand the prompt's bytes out as output)."""
        from tokenizers.decoders import DecodeStream
        if self._decode(self.ids).endswith("\ufffd"):
            return None
        stream = DecodeStream(skip_special_tokens=self.skip)
        try:
            for token_id in self.ids:
                stream.step(self.backend, token_id)
        except Exception:  # noqa: BLE001 - as in LLMEngine.step
            return None
        return stream

    def _trim(self, prefix: str, full: str) -> str:
        """Keep a long-held window short: drop a last token with no text (its text
        is the same without it), or release the text up to a cut where the tokens
        before and after decode apart (full == head + tail). There a replacement
        character that ends head is final: the bytes after the cut already decided it."""
        ids, last = self.ids, len(self.ids) - 1
        if self._decode(ids[last:]) == "" and self._decode(ids[self.prefix_offset:last]) == full:
            del ids[last]
            return ""
        for cut in range(last, max(self.read_offset, last - 4), -1):
            head, tail = self._decode(ids[self.prefix_offset:cut]), self._decode(ids[cut:])
            if tail and len(head) > len(prefix) and head + tail == full:
                self.prefix_offset, self.read_offset = self.read_offset, cut
                return head[len(prefix):]
        return ""

    def _window(self) -> tuple[str, str]:
        ids = self.ids
        return self._decode(ids[self.prefix_offset:self.read_offset]), self._decode(ids[self.prefix_offset:])

    def _decode(self, ids: list[int]) -> str:
        # the Rust tokenizer's decode is transformers' (_rust_tokenizer), without its Python layers
        return (self.tokenizer if self.backend is None else self.backend).decode(ids, skip_special_tokens=self.skip)


def _rust_tokenizer(tokenizer):
    """The tokenizers.Tokenizer that a transformers fast tokenizer's decode() is
    (its _decode not overridden, no clean-up of spaces after it); else None."""
    from transformers import PreTrainedTokenizerFast
    if getattr(type(tokenizer), "_decode", None) is not PreTrainedTokenizerFast._decode \
            or tokenizer.clean_up_tokenization_spaces:
        return None
    return tokenizer.backend_tokenizer


# =========================================================================== requests

@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int                   # resolved against max_model_len
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None      # n > 1: the id the caller knows
    priority: int = 0                 # the priority scheduling policy's: lower first (then arrival)
    index: int = 0
    cache_salt: str | None = None     # who may share this request's cached blocks
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # prompt_logprobs need every prompt position computed: no prefix-cache hits (as vLLM)
    skip_reading_prefix_cache: bool = False
    grammar: Any = None               # structured outputs: its matcher (StructuredOutputManager)
    thinking: ThinkingBudget | None = None  # thinking_token_budget's count
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # its full blocks' hash chain, as far as looked up
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_placeholders: int = 0  # sampled tokens still on the device (steps launched, not landed)
    spec_token_ids: list[int] = field(default_factory=list)  # speculative decoding: its drafts for the next step
    token_ids: list[int] = field(default_factory=list)          # prompt + output
    output_token_ids: list[int] = field(default_factory=list)
    # The detokenized output: text_pieces, which no stop string can cut any more (joined only into an
    # output: str += would copy all the text each token; DELTA drops those it sent), then held_text,
    # the new text and the end that could yet begin a stop string (_release_text)
    text_pieces: list[str] = field(default_factory=list)
    held_text: str = ""
    sent_text_len: int = 0            # CUMULATIVE: how much of the text earlier outputs carried
    sent_token_len: int = 0           # DELTA: how many output tokens earlier outputs carried
    stream_interval: int = 1          # DELTA: an output every this many tokens (and the first, and the last)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # Filled chunk by chunk while the prompt is prefilled, by the one request that
    # skips the prefix cache (n > 1: the family shares one list, the first child fills it)
    prompt_logprobs: PromptLogprobs | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    sample_row: SampleRequest | None = None  # sample_request()'s, once nothing in it changes any more
    sampling_tensors: SamplingTensors | None = None  # its logit_bias and allowed ids, made once
    prompt_embeds: torch.Tensor | None = None  # TokenizedPrompt's: the model's input for the prompt's positions
    lora_int_id: int | None = None    # the LoRA adapter it runs with (TokenizedPrompt's)
    serial: int = -1                  # unique for the engine's life, where a caller may reuse an id
    # The pooling runner's (embeddings): the request is its prompt's prefill and nothing more. MEAN
    # pooling adds up the chunks' hidden-state sums in ``pooled`` (fp32, on the host), CLS keeps its first row,
    # a token-wise task (ALL) the list of its chunks' rows.
    pooling_params: PoolingParams | None = None
    pooled: torch.Tensor | list[torch.Tensor] | None = None
    token_type_ids: list[int] | None = None  # an encoder's, a type a prompt token (TokenizedPrompt's)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The length at which _check_stop ends it (max_tokens is resolved against max_model_len)."""
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def can_run_ahead(self) -> bool:
        """Whether its next token may be sampled while the last is still on the device
        (async scheduling): only if sampling reads no output token from the host."""
        p = self.sampling_params
        return self.grammar is None and self.thinking is None and not self.bad_words_token_ids and \
            p.presence_penalty == p.frequency_penalty == 0 and p.repetition_penalty == 1

    @property
    def can_speculate(self) -> bool:
        """Whether draft tokens may be proposed for it: only if its sampling is the same at every position
        of a step (as vLLM skips penalties; bans, grammars and thinking budgets change from token to token),
        and its prompt has token ids to match (an embeddings prompt's are stand-ins)."""
        return self.can_run_ahead and len(self.output_token_ids) >= self.sampling_params.min_tokens \
            and self.prompt_embeds is None

    def stream_due(self) -> bool:
        """Whether a stream (DELTA) sends this step's token now: always, but with a
        stream_interval N only its first, then every N (and its last, which the caller sends)."""
        n, sent = self.stream_interval, self.sent_token_len
        return n == 1 or not self.output_kind.is_delta or sent == 0 or len(self.output_token_ids) - sent >= n

    def sample_request(self) -> SampleRequest:
        """Its row in a step's sampling. As vLLM's persistent batch keeps a request's sampling
        state from step to step, the row is kept once nothing in it can change but the count of
        placeholders (no grammar, no bad_words, no min_tokens ban left): it reads the live token lists."""
        if (row := self.sample_row) is not None:
            row.num_output_placeholders = self.num_output_placeholders
            return row
        p = self.sampling_params
        banned: list[int] = []
        if len(self.output_token_ids) + self.num_output_placeholders < p.min_tokens:
            banned = held_back_by_min_tokens(p, self.eos_token_ids)  # the count only grows: [] stays []
        if self.bad_words_token_ids:  # a word's last token is banned once the output ends in the rest of it
            out = self.output_token_ids
            banned += [w[-1] for w in self.bad_words_token_ids if len(w) <= len(out) + 1 and
                       (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1])]
        allowed = self.thinking.forced_bitmask() if self.thinking is not None else None
        if allowed is None and self.grammar is not None:  # (a grammar waits for </think>: the two never meet)
            allowed = self.grammar.next_token_bitmask()
        if self.sampling_tensors is None:
            self.sampling_tensors = SamplingTensors.of(p)
        row = SampleRequest(p, self.prompt_token_ids, self.output_token_ids, banned, allowed,
                            self.num_output_placeholders, self.sampling_tensors, self.serial)
        if not banned and not self.bad_words_token_ids and self.grammar is None and self.thinking is None:
            self.sample_row = row
        return row

    def prompt_logprob_ids(self, start: int, num_new_tokens: int) -> list[int] | None:
        """The prompt tokens whose logprobs a chunk of ``num_new_tokens`` from
        ``start`` computes (its row at position p predicts token p + 1); None when
        none are asked for or all are known (a preempted request recomputing)."""
        if not self.skip_reading_prefix_cache or self.prompt_logprobs is None \
                or len(self.prompt_logprobs) >= self.num_prompt_tokens:  # (MEAN, CLS pooling skip it too, asking none)
            return None
        n = self.num_prompt_tokens
        return self.prompt_token_ids[start + 1:min(start + num_new_tokens, n - 1) + 1] or None


@dataclass(slots=True)
class TokenizedPrompt:
    """A prompt after ``LLMEngine.process_prompt``: tokenized and validated."""
    text: str | None          # None: it was given as token ids
    token_ids: list[int]
    cache_salt: str | None = None  # as vLLM's: only prompts with the same salt share cached blocks
    # given as embeddings (vLLM's prompt_embeds): a row a token, in the model's dtype; token_ids are stand-ins
    # (0), so its blocks are cached under the digest of these values (the prefix cache hashes token ids)
    prompt_embeds: torch.Tensor | None = None
    embeds_digest: str | None = None
    lora_int_id: int | None = None  # the LoRA adapter it runs with (LLMEngine.add_lora's), None: the base model
    # an encoder's BERT token types, one a token (vLLM's token_type_ids: a cross-encoder pair's, from its
    # tokenizer); None: every token is type 0, as every other prompt's
    token_type_ids: list[int] | None = None


@dataclass(slots=True)
class PairPrompt:
    """A cross-encoder's pair as its tokenizer gives it (``LLMEngine.cross_encoder_prompt``), before
    process_prompt truncates and validates it: token ids and their token types (None: all type 0)."""
    token_ids: list[int]
    token_type_ids: list[int] | None = None


def aligned_token_types(types: list[int], kept: int, side: str, length: int) -> list[int] | None:
    """A pair's token types cut as its ids were (``kept`` of them, from ``side``), then padded to ``length``
    with the last type, as vLLM's; None where all are type 0 (the encoder's default: nothing to carry)."""
    types = types[len(types) - kept:] if side == "left" else types[:kept]
    types = types + types[-1:] * (length - len(types))
    return types if any(types) else None


@dataclass(slots=True)
class LoRARequest:
    """vLLM's: a LoRA adapter, by a name, an id of its own (>= 1) and its directory (PEFT's
    adapter_config.json and adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


# =========================================================================== structured outputs

GRAMMAR_CACHE_BYTES = 512 << 20  # compiled grammars kept, least recently used dropped (vLLM's default)
RECENT_GRAMMARS = 8  # also held here: the server's compile ahead must still be there when add_request asks


class StructuredOutputManager:
    """Structured outputs through xgrammar (vLLM's default backend): each
    constraint is compiled once while it stays in xgrammar's cache (bounded in
    bytes: each distinct schema costs memory); each request gets its own
    matcher, which says before every step which tokens may come next (a bitmask
    the sampler applies) and takes each sampled token. EOS is allowed only where
    the grammar accepts. Preemption keeps a request's tokens, so its matcher
    stays valid; nothing here runs for unconstrained requests. With a reasoning
    parser (as vLLM's reasoner here) each grammar waits for the reasoning to end."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_bytes: int = GRAMMAR_CACHE_BYTES, reasoning_parser: str | None = None):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.cache_bytes = cache_bytes
        self.compiler = None
        self.think_ids: tuple[int, int] | None = None  # (<think>, </think>): grammars start after the reasoning
        if reasoning_parser == "openai_gptoss":  # vLLM's grammar starts after the final channel's header
            logger.warning("[engine] --reasoning-parser openai_gptoss: structured outputs hold from the first token "
                           "(not after the analysis channel), so a constrained reply is bare content")
        elif reasoning_parser is not None and tokenizer is not None:
            vocab = tokenizer.get_vocab()
            if all(tag in vocab for tag in THINK_TAGS):
                self.think_ids = tuple(vocab[tag] for tag in THINK_TAGS)
            else:  # vLLM's parsers refuse such a tokenizer; here the text is still split, the grammar is not held
                logger.warning("[engine] --reasoning-parser %s: the tokenizer has no %s token, so structured "
                               "outputs hold from the first token (not after the reasoning) and reasoning tokens "
                               "are not counted in the usage", reasoning_parser, " and ".join(THINK_TAGS))
        self.recent: collections.OrderedDict[str, Any] = collections.OrderedDict()  # by spec.key()
        self.lock = threading.Lock()  # the server's grammar thread and the event loop both call compile

    def compile(self, spec: StructuredOutputsParams | None):
        """The compiled grammar of ``spec`` (None for None); InvalidInput naming it
        when it cannot be compiled. The server calls it ahead of time on a thread of
        its own, so that the event loop's call (add_request's) finds it here: xgrammar's
        own cache could have dropped it meanwhile for others, under its byte bound."""
        if spec is None:
            return None
        key = spec.key()
        with self.lock:
            if key in self.recent:  # is_cached's test
                self.recent.move_to_end(key)
                return self.recent[key]
            compiler = self._compiler()
        compiled = self._compile(compiler, spec)
        with self.lock:
            self.recent[key] = compiled
            if len(self.recent) > RECENT_GRAMMARS:
                self.recent.popitem(last=False)
        return compiled

    def is_cached(self, spec: StructuredOutputsParams) -> bool:
        """Would compile() return at once (a grammar compiled recently)?"""
        with self.lock:
            return spec.key() in self.recent

    def grammar_state(self, compiled, prompt_token_ids: list[int]) -> GrammarState:
        """A request's matcher: with a reasoning parser it waits for </think> unless the prompt already
        ended the reasoning, as vLLM's BaseThinkingReasoningParser.is_reasoning_end (basic_parsers.py)
        reads it: its last think tag is </think> (Qwen3's template with enable_thinking false writes one)."""
        if self.think_ids is None:
            return GrammarState(compiled)
        return GrammarState(compiled, None if self.prompt_reasoning(prompt_token_ids) == "ended" else self.think_ids[1])

    def prompt_reasoning(self, prompt_token_ids: list[int]) -> str | None:
        """Where the prompt leaves the reasoning, by its last think tag: "open" (<think>: the template opened
        the thought), "ended" (</think>), None (no tag, or no reasoning parser). The server's reasoning
        parser starts from the same answer, so the text is split where the grammar starts."""
        if self.think_ids is None:
            return None
        last = last_think_tag(prompt_token_ids, self.think_ids)
        return None if last is None else "open" if prompt_token_ids[last] == self.think_ids[0] else "ended"

    def _compiler(self):
        import xgrammar as xgr
        if self.tokenizer is None:
            raise InvalidInput("structured_outputs", "structured outputs need a tokenizer, but this engine "
                                                     "runs without one (skip_tokenizer_init)")
        if self.compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(self.eos_token_ids))
            self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self.cache_bytes)
        return self.compiler

    def _compile(self, c, spec: StructuredOutputsParams):
        whitespace = not spec.disable_any_whitespace
        try:
            if spec.json is not None:
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return c.compile_json_schema(schema, any_whitespace=whitespace)
            if spec.json_object:  # OpenAI's json_object: an object (xgrammar's builtin JSON is any value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=whitespace)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:  # one alternative per choice, each a JSON-quoted EBNF string; not
                # ASCII-escaped: EBNF reads "\ud83d\ude00" as two code points, a surrogate pair's bytes, no emoji
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False)
                                                                  for x in spec.choice))
            if spec.structural_tag is not None:
                return _compile_structural_tag(c, spec.structural_tag)
            return c.compile_grammar(spec.grammar)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
            what = spec.given()[0]
            raise InvalidInput("structured_outputs", f"structured_outputs.{what} cannot be compiled: "
                                                     f"{_XGRAMMAR_PREFIX.sub('', first_line(e))}") from None


def _compile_structural_tag(compiler, tag: str | dict):
    """A structural tag in xgrammar's form ({"type": "structural_tag", "format": ...}), or
    in the older one vLLM still takes ({"structures": [{"begin", "schema", "end"}], "triggers"})."""
    import xgrammar as xgr
    text = tag if isinstance(tag, str) else json.dumps(tag)
    tag = json.loads(text)
    if not (isinstance(tag, dict) and "structures" in tag):
        return compiler.compile_structural_tag(text)
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(structures, list) and isinstance(triggers, list) and all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
            and isinstance(s.get("schema"), dict) for s in structures)):
        raise ValueError('the older form is {"structures": [{"begin": "...", "schema": {...}, "end": "..."}, ...], '
                         '"triggers": ["...", ...]}')
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]) for s in structures]
    return compiler.compile_structural_tag(items, triggers)


# xgrammar's log prefix on its errors, "[13:20:06] /project/cpp/regex_converter.cc:94: " and a failed check's
# "Check failed: (error.empty()) is false: ": its build's source lines, nothing the request can change
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarState:
    """One request's matcher over a compiled grammar, and its bitmask buffer. While the request
    reasons (``reasoning_end``: the </think> id it waits for) the grammar is neither applied nor
    advanced, nor fed </think> itself: it holds from the token after (vLLM's StructuredOutputManager
    should_fill_bitmask / should_advance, v1/structured_output/__init__.py, with one token a step
    as here). A thought that never ends is never constrained."""

    def __init__(self, compiled, reasoning_end: int | None = None):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        self.reasoning_end = reasoning_end

    def next_token_bitmask(self) -> torch.Tensor | None:
        """int32 [ceil(vocab / 32)]: bit t of word t // 32 set where token t may come next (None: any)."""
        if self.reasoning_end is not None:
            return None
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0].clone()

    def accept(self, token_id: int) -> None:
        if self.reasoning_end is not None:
            if token_id == self.reasoning_end:
                self.reasoning_end = None
            return
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
            logger.warning("[engine] structured outputs: the grammar refused token %d", token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def last_think_tag(token_ids: list[int], think_ids: tuple[int, int]) -> int | None:
    """The index of the last <think> or </think> in ``token_ids`` (None: neither is there)."""
    return next((i for i in range(len(token_ids) - 1, -1, -1) if token_ids[i] in think_ids), None)


class ThinkingBudget:
    """vLLM's thinking_token_budget: a request that has thought ``budget`` tokens since its last
    <think> (in the prompt or the output) must sample </think> next; the count starts again
    at its next <think>."""

    def __init__(self, budget: int, think_ids: tuple[int, int], prompt_token_ids: list[int], vocab_size: int):
        self.budget, (self.start, self.end) = budget, think_ids
        last = last_think_tag(prompt_token_ids, think_ids)
        opened = last is not None and prompt_token_ids[last] == self.start
        self.count: int | None = len(prompt_token_ids) - last - 1 if opened else None  # None: not thinking
        self.bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # </think> alone (bit 31: the sign)
        self.bitmask[self.end // 32] = torch.tensor(1 << (self.end % 32), dtype=torch.int64).to(torch.int32)

    def accept(self, token_id: int) -> None:
        if token_id == self.start:
            self.count = 0
        elif token_id == self.end:
            self.count = None
        elif self.count is not None:
            self.count += 1

    def forced_bitmask(self) -> torch.Tensor | None:
        """The bitmask that allows </think> alone, once the budget is spent; else None."""
        return self.bitmask if self.count is not None and self.count >= self.budget else None


# =========================================================================== beam search

@dataclass(slots=True)
class BeamSearchSequence:
    """vLLM's: one of LLM.beam_search's results."""
    tokens: list[int]                            # the prompt's and the output's
    logprobs: list[dict[int, Logprob]] | None
    cum_logprob: float
    text: str                                    # the output's
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]          # the best first


@dataclass(slots=True)
class Beam:
    token_ids: list[int]                         # output tokens, an ending EOS included
    logprobs: list[dict[int, Logprob]] | None    # each token's, if the caller asked for them
    cum_logprob: float = 0.0
    ended: bool = False                          # by an EOS


class BeamSearch:
    """One beam-search request, run as vLLM runs it: each round, every live beam
    is a one-token request (``child_params``) whose top 2 x beam_width logprobs are
    its candidate next tokens (or, with allowed_token_ids, theirs). An
    EOS candidate ends its beam (``completed``); the beam_width best of the other
    candidates of all beams live on. After max_tokens rounds, or once no beam is
    left, the beam_width best of the ended and live beams by score are the outputs."""

    def __init__(self, request_id: str, prompt: TokenizedPrompt, params: BeamSearchParams, max_tokens: int,
                 eos_token_ids: frozenset[int], priority: int = 0):
        self.request_id, self.prompt, self.params, self.max_tokens = request_id, prompt, params, max_tokens
        self.priority = priority
        self.eos_token_ids = eos_token_ids
        self.beams = [Beam([], None if params.logprobs is None else [])]
        self.completed: list[Beam] = []
        self.rounds = 0
        self.landed: dict[int, Request] = {}     # this round's finished one-token requests, by beam
        self.arrival_time = time.monotonic()
        self.first: Request | None = None        # the first round's request: the prompt's metrics
        allowed = params.allowed_token_ids  # all of them ranked, as vLLM's
        self.child_params = SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, allowed_token_ids=allowed,
            logprobs=None if allowed else 2 * params.beam_width, logprob_token_ids=allowed)

    def child_ids(self) -> list[str]:
        # a control character: no id the server takes (printable ones only) can be one of these
        return [f"{self.request_id}\x1fbeam{self.rounds}.{i}" for i in range(len(self.beams))]

    def land(self, index: int, req: Request) -> bool:
        """A beam's one-token request finished; True once the round's all have."""
        self.first = self.first or req
        self.landed[index] = req
        return len(self.landed) == len(self.beams)

    def advance(self) -> bool:
        """The round's candidates into the next beams; True when the search is done."""
        p = self.params
        candidates = []  # (cumulative logprob, beam, token, its logprobs entry)
        for i, beam in enumerate(self.beams):
            req = self.landed[i]
            entry = req.logprobs[0] if req.logprobs else {}  # none: the request found no token to sample
            for token, lp in entry.items():
                candidate = (beam.cum_logprob + lp.logprob, beam, token, entry)
                if token in self.eos_token_ids and not p.ignore_eos:
                    self.completed.append(self._extend(*candidate, ended=True))
                else:
                    candidates.append(candidate)
        candidates.sort(key=lambda c: -c[0])  # stable: ties in beam, then rank, order
        self.beams = [self._extend(*c) for c in candidates[:p.beam_width]]
        self.landed.clear()
        self.rounds += 1
        return self.rounds >= self.max_tokens or not self.beams

    def _extend(self, cum_logprob: float, beam: Beam, token: int, entry: dict[int, Logprob],
                ended: bool = False) -> Beam:
        logprobs = None
        if beam.logprobs is not None:  # the token's own and the top ones the caller asked for (by logprob:
            top = sorted(entry, key=lambda t: -entry[t].logprob)[:self.params.logprobs]  # listed ids rank by place)
            shown = {t: lp for t, lp in entry.items() if t == token or t in top}
            logprobs = beam.logprobs + [shown]
        return Beam(beam.token_ids + [token], logprobs, cum_logprob, ended)

    def score(self, beam: Beam) -> float:
        """vLLM's (after transformers'): the length counts the prompt, not an ending EOS (ignore_eos's too)."""
        ids = beam.token_ids
        length = len(self.prompt.token_ids) + len(ids) - (bool(ids) and ids[-1] in self.eos_token_ids)
        return beam.cum_logprob / max(length, 1) ** self.params.length_penalty

    def output(self, tokenizer) -> RequestOutput:
        p = self.params
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)[:p.beam_width]
        outputs = []
        for i, beam in enumerate(best):
            ids, logprobs = beam.token_ids, beam.logprobs
            if beam.ended and not p.include_stop_str_in_output:
                ids, logprobs = ids[:-1], logprobs and logprobs[:-1]
            shown = beam.token_ids[:-1] if beam.ended else beam.token_ids  # an EOS's text never (as vLLM)
            text = "" if tokenizer is None else tokenizer.decode(shown, skip_special_tokens=p.skip_special_tokens)
            outputs.append(CompletionOutput(i, text, ids, beam.cum_logprob, logprobs,
                                            "stop" if beam.ended else "length",
                                            beam.token_ids[-1] if beam.ended else None, text))
        first = self.first
        metrics = RequestMetrics(self.arrival_time, first and first.first_scheduled_time,
                                 first and first.first_token_time, time.monotonic())
        return RequestOutput(self.request_id, self.prompt.text, self.prompt.token_ids, outputs, True,
                             first.num_cached_tokens if first else 0, metrics)


# =========================================================================== speculative decoding
# vLLM's --speculative-config '{"method": "ngram", ...}' in small (vLLM keeps these in config/speculative.py and
# v1/spec_decode/ngram_proposer.py). After each step the engine asks the proposer for up to
# num_speculative_tokens draft tokens for each running request: the tokens that followed an earlier occurrence
# of the request's last n tokens in its prompt and output. The scheduler gives the request 1 + k token slots,
# the model runs them as one short chunk, and the sampler (model.Sampler.sample_speculative) keeps the longest
# prefix of the drafts that matches what it samples, plus one token of its own. Only methods without a draft
# model are served: n-gram drafts cost no forward.

SPECULATIVE_METHODS = ("ngram",)
# vLLM's methods that run a draft model (or heads) beside the target: none is served here
DRAFT_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                       "ernie_mtp", "qwen3_next_mtp", "longcat_flash_mtp", "suffix")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's SpeculativeConfig, its n-gram fields: up to ``num_speculative_tokens`` drafts a step,
    found by matching the last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.
    ``num_speculative_tokens_per_batch_size``: vLLM's dynamic speculative decoding, the drafts a step
    allows by its batch size (validated, sorted ``(range_start, range_end, k)``, ranges inclusive)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

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
        fields = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                  "num_speculative_tokens_per_batch_size")
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
        schedule = config.get("num_speculative_tokens_per_batch_size")
        if schedule is not None:
            try:
                schedule = tuple(validate_and_normalize_dynamic_sd_schedule(schedule))
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
        return cls(method, k, hi, lo, schedule)


# vLLM's dynamic speculative decoding (v1/spec_decode/dynamic/utils.py): a schedule of inclusive batch-size
# ranges, each with the drafts a step of that many requests allows. Drafts pay where a step's cost hardly
# grows with its tokens (few requests: the weights are read once either way) and lose where the step is
# compute-bound (many requests), so a schedule speculates at low batch sizes and stops above some size.

def validate_and_normalize_dynamic_sd_schedule(schedule: Any) -> list[tuple[int, int, int]]:
    """``num_speculative_tokens_per_batch_size`` checked as vLLM checks it, sorted by range start:
    ValueError with vLLM's message (one line) for what it refuses."""
    if not isinstance(schedule, list | tuple):  # vLLM's field is a list; JSON gives one
        raise ValueError("num_speculative_tokens_per_batch_size must be a non-empty list of "
                         "(range_start, range_end, num_speculative_tokens) entries.")
    if not schedule:
        raise ValueError("num_speculative_tokens_per_batch_size must not be empty.")
    parsed = []
    for entry in schedule:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ValueError("Each num_speculative_tokens_per_batch_size entry must be a 3-item sequence: "
                             "(range_start, range_end, num_speculative_tokens).")
        if not all(_is_int(x) for x in entry):  # vLLM's pydantic field
            # takes integers only too (its int() would truncate 2.5 silently)
            raise ValueError(f"num_speculative_tokens_per_batch_size entries must be integers, got {list(entry)!r}.")
        start, end, k = entry
        if start <= 0 or end <= 0:
            raise ValueError(f"Batch-size range ({start}, {end}) must be positive.")
        if start > end:
            raise ValueError(f"Batch-size range start must be <= end for ({start}, {end}, {k}).")
        if k < 0:
            raise ValueError("num_speculative_tokens_per_batch_size values must be >= 0.")
        parsed.append((start, end, k))
    parsed.sort(key=lambda e: e[0])
    for (_, previous_end, _), (start, _, _) in zip(parsed, parsed[1:]):
        if start <= previous_end:
            raise ValueError("Batch-size ranges must be non-overlapping and sorted.")
    if parsed[0][0] != 1:
        raise ValueError("The first batch-size range must start at 1 so every runtime batch size has a defined "
                         "schedule.")
    return parsed


def build_dynamic_sd_schedule_lookup(schedule: Sequence[tuple[int, int, int]], max_batch_size: int,
                                     num_speculative_tokens: int) -> list[int]:
    """The schedule as a table, batch size -> drafts a step allows (index 0 unused), as vLLM's: each k
    capped at ``num_speculative_tokens``; a gap between ranges, and the sizes past the last range up to
    ``max_batch_size``, take the k of the range before them."""
    table = [0] * (max_batch_size + 1)
    next_size, last_k = 1, 0
    for start, end, k in validate_and_normalize_dynamic_sd_schedule(schedule):
        for size in range(next_size, min(start, max_batch_size + 1)):  # a gap: the previous range's k
            table[size] = min(num_speculative_tokens, last_k)
        for size in range(max(start, next_size), min(end, max_batch_size) + 1):
            table[size] = min(num_speculative_tokens, k)
        next_size, last_k = max(next_size, end + 1), k
        if next_size > max_batch_size:
            break
    for size in range(next_size, max_batch_size + 1):  # the tail: the last range's k
        table[size] = min(num_speculative_tokens, last_k)
    return table


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


# =========================================================================== engine

@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None    # None: 256, at most max_num_batched_tokens (as vLLM's default)
    max_num_batched_tokens: int | None = None  # None: max(8192, max_num_seqs) (__post_init__)
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_prompt_embeds: bool = False  # as vLLM: prompts may come as embeddings (prompt_embeds)
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    skip_tokenizer_init: bool = False  # token-id prompts only, no text out (as vLLM)
    enforce_eager: bool = False        # as vLLM: no torch.compile; on the CPU no C kernels either
    cpu_allocator_tuning: bool = True  # model.tune_process: THP, glibc malloc, oneDNN's caches
    # A GPTQ / AWQ / compressed-tensors W4A16-W8A16 checkpoint's Linear weights: "packed" (the checkpoint's
    # memory, a W4A16 kernel), "dequantized" (the model's dtype: 4x an int4 checkpoint's), or "auto": packed
    # on CUDA, dequantized on the CPU (model.wna16_packed says why). vLLM has no such switch: it keeps them packed.
    wna16_weights: str = "auto"
    # Decode batch sizes replayed as CUDA graphs (None: model.cudagraph_capture_sizes, vLLM's
    # pattern, up to the most rows a decode step has, on CUDA; none on the CPU, where given
    # sizes run the same padded path eagerly); enforce_eager turns them off.
    cudagraph_capture_sizes: list[int] | None = None
    # vLLM's: caps the default list (None: 512; at most a decode step's rows here); beside a list, its largest size
    max_cudagraph_capture_size: int | None = None
    disable_sliding_window: bool = False  # as vLLM's: max_model_len defaults to the window, which never acts then
    revision: str | None = None        # of a hub id (resolve_model_dir)
    download_dir: str | None = None    # as vLLM's: the Hugging Face cache hub ids are found in (None: the default)
    tokenizer: str | None = None       # a directory or hub id of its own (default: the model's)
    # Sampling defaults as vLLM's --generation-config: "auto" takes the model's
    # generation_config.json, "vllm" none (vLLM's own defaults), else a directory.
    generation_config: str = "auto"
    # As vLLM's --override-generation-config: generation_config.json fields laid over
    # (also over "vllm"); its max_new_tokens caps every request's max_tokens.
    override_generation_config: dict[str, Any] | None = None
    # As vLLM's --hf-overrides: config.json keys laid over the checkpoint's (e.g. a
    # rope_scaling that turns YaRN on, as Qwen's docs for long contexts say)
    hf_overrides: dict[str, Any] | None = None
    # As vLLM's --async-scheduling: schedule and launch step N+1 before step N's
    # sampled ids reach the host (a GPU's win; the outputs are the same).
    async_scheduling: bool = False
    max_logprobs: int = MAX_LOGPROBS  # as vLLM's: the most (prompt) logprobs a request may ask for (-1: no cap)
    stream_interval: int = 1  # as vLLM's --stream-interval: streams send every N tokens (a request may ask more)
    scheduling_policy: str = "fcfs"  # as vLLM's: "priority" orders the queues by a request's priority, then arrival
    # As vLLM's structured_outputs_config.reasoning_parser (--reasoning-parser): structured
    # outputs start after the reasoning (GrammarState)
    reasoning_parser: str | None = None
    # As vLLM's: custom logits processors (model.LogitsProcessor subclasses, or "module:Class" names)
    logits_processors: list[str | type] | None = None
    enable_lora: bool = False  # as vLLM's: LoRA adapters (LoRARequest, --lora-modules) beside the base weights
    max_lora_rank: int = 16    # as vLLM's: the largest adapter rank taken
    max_loras: int = 1         # as vLLM's: adapters on the device at once (its slots), so in one step
    max_cpu_loras: int | None = None  # as vLLM's: adapters kept in host memory (None: max_loras); others are
    #                                   read again from their paths when a step needs them
    # As vLLM's (--speculative-config): {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max",
    # "prompt_lookup_min"}, a SpeculativeConfig once checked; None: no speculative decoding
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None
    # As vLLM's --runner / --convert (and older vLLM's --task embed): "pooling" serves embeddings (LLM.embed,
    # /v1/embeddings) instead of generating; "auto" picks it for a sentence-transformers checkpoint
    # (modules.json) or a bare decoder (Qwen3Model). pooler_config: vLLM's --pooler-config (PoolerConfig).
    runner: str = "auto"
    convert: str = "auto"
    task: str = "auto"
    pooler_config: dict[str, Any] | PoolerConfig | None = None

    tensor_parallel_size: int = 1      # ranks the model is split across (one process each)
    distributed_init_method: str | None = None  # tcp://HOST:PORT or env:// (torchrun); None: a local port
    nnodes: int = 1                    # machines the ranks are spread over, tensor_parallel_size / nnodes each
    node_rank: int = 0                 # this machine's index; node 0 runs the engine (rank 0)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # enable_lora="yes" was taken as true, "false" too (a non-empty str)
            if f.type in (bool, "bool") and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be true or false, got {getattr(self, f.name)!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "seed",
                     "max_logprobs", "tensor_parallel_size", "nnodes", "node_rank"):
            value = getattr(self, name)  # a str or float went far (a TypeError from a comparison, or a float length)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:  # 0 was taken as unset
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # torch.manual_seed's range: it failed at
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")  # the first sampled request
        self.device = None if self.device == "auto" else self.device  # vLLM's word for the engine's choice
        if self.wna16_weights not in WNA16_WEIGHTS:
            raise ValueError(f"wna16_weights must be one of {', '.join(WNA16_WEIGHTS)}, got {self.wna16_weights!r}")
        override = self.override_generation_config
        if override is not None:  # checked here, not by every request that leaves the field out (each a 400)
            if not isinstance(override, dict):
                raise ValueError(f"override_generation_config must be an object of generation_config.json "
                                 f"fields, got {override!r}")
            try:
                SamplingParams(**generation_defaults(Path(), "vllm", override))  # its fields alone
            except (ValueError, TypeError) as e:
                raise ValueError(f"override_generation_config (--override-generation-config) does not make valid "
                                 f"sampling defaults: {e}") from None
        if self.max_num_seqs is None:
            self.max_num_seqs = min(256, self.max_num_batched_tokens or 256)
        self.max_num_batched_tokens = self.max_num_batched_tokens or max(8192, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:  # as vLLM's SchedulerConfig: an error, chunked or not
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): a step has a token of each running request")
        if not 0 < self.gpu_memory_utilization <= 1:  # a fraction of the GPU's memory
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 (no cap: the whole vocabulary), "
                             f"got {self.max_logprobs}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        for name in ("max_lora_rank", "max_loras"):  # (a bool is an int to isinstance: True was taken as 1 slot)
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:  # vLLM's default
            self.max_cpu_loras = self.max_loras
        if not isinstance(self.max_cpu_loras, int) or isinstance(self.max_cpu_loras, bool) or \
                self.max_cpu_loras < self.max_loras:  # a step's adapters must fit in host memory together
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= max_loras "
                             f"({self.max_loras})")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling does not work with tensor_parallel_size > 1 (yet): the workers "
                             "would need the previous step's sampled token ids, which stay on rank 0's device")
        self._check_runner()
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if self.async_scheduling:  # as vLLM did at first: a step's input would be a run of tokens still
                # on the device, of a length known only once it lands
                logger.warning("[engine] async_scheduling is turned off: it does not work with speculative "
                               "decoding (yet)")
                self.async_scheduling = False

    def _check_runner(self) -> None:
        """runner, convert, task and pooler_config as vLLM reads them: task embed and convert embed
        ask for the pooling runner, which a runner "generate" given beside them contradicts."""
        for name, allowed in (("runner", RUNNERS), ("convert", CONVERTS), ("task", TASKS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r} "
                                 f"(nanoserve's pooling runner makes embeddings and classifies)")
        pooling = {"embed": "embed", "embedding": "embed", "classify": "classify", "score": "classify"}
        if len({pooling[v] for v in (self.convert, self.task) if v in pooling}) > 1:
            raise ValueError(f"convert {self.convert!r} and task {self.task!r} ask for different pooling tasks")
        asks_pooling = [f"{k}={v}" for k, v in (("task", self.task), ("convert", self.convert))
                        if v in pooling] + (["pooler_config"] if self.pooler_config else [])
        asks_generate = [f"{k}=generate" for k in ("runner", "task") if getattr(self, k) == "generate"]
        if asks_pooling and asks_generate:
            raise ValueError(f"{asks_pooling[0]} needs the pooling runner, but {asks_generate[0]} was given")
        if asks_pooling:
            self.runner = "pooling"
        elif asks_generate:  # older vLLM's --task generate is its runner (an encoder or classifier is then refused)
            self.runner = "generate"
        if not isinstance(self.pooler_config, PoolerConfig):
            if self.pooler_config is not None and not isinstance(self.pooler_config, dict):
                raise ValueError(f"pooler_config must be an object, got {self.pooler_config!r}")
            self.pooler_config = PoolerConfig.from_dict(self.pooler_config)

    @property
    def converts_to_classify(self) -> bool:
        """vLLM's --convert classify (older vLLM's --task classify or score): a causal LM served as a classifier."""
        return self.convert == "classify" or self.task in ("classify", "score")

    def check_pooling_runner(self) -> None:
        """What the pooling runner does not run with (once the engine has resolved runner "auto")."""
        if self.speculative_config is not None:
            raise ValueError("speculative_config does not apply to the pooling runner: it samples no tokens")
        if self.async_scheduling:
            logger.warning("[engine] async_scheduling is turned off: the pooling runner samples nothing that "
                           "a next step could wait for")
            self.async_scheduling = False

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The adapter slots every rank reserves (None: LoRA is off)."""
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None


# vLLM engine arguments (EngineArgs' fields: LLM() keywords, `vllm serve` flags) that nanoserve takes
# without acting on them: name -> (type, the values taken (None: any), what nanoserve does instead). A
# given one logs that line; any other value is refused with it, since taking it would change what is
# served. The CLI makes a flag of each (entry.VLLM_FLAGS) but the ones it acts on itself.
VLLM_ENGINE_ARGS: dict[str, tuple[type, tuple | None, str]] = {
    "trust_remote_code": (bool, None, "nanoserve runs no code from a checkpoint: it implements each "
                                      "architecture it serves itself"),
    "enable_chunked_prefill": (bool, None, "prompts are always prefilled in chunks of at most max_num_batched_tokens, "
                                           "which changes no output (raise it to prefill whole prompts in one step)"),
    "kv_cache_dtype": (str, ("auto",), "the KV cache has the model's dtype (no fp8 KV cache)"),
    "quantization": (str, (None, "fp8", "gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors"),
                     "nanoserve reads an FP8, GPTQ, AWQ or compressed-tensors checkpoint's quantization from its "
                     "config.json and holds its weights dequantized; it quantizes no unquantized checkpoint "
                     "(vLLM's online fp8) and serves no other method"),
    "load_format": (str, ("auto", "safetensors"), "nanoserve loads safetensors weights only"),
    "cpu_offload_gb": (float, (0,), "nanoserve keeps every weight on the device (no CPU offloading)"),
    "pipeline_parallel_size": (int, (1,), "nanoserve has no pipeline parallelism; tensor_parallel_size splits a model"),
    "data_parallel_size": (int, (1,), "one engine serves; start more behind a load balancer"),
    "distributed_executor_backend": (str, (None, "mp", "uni"), "nanoserve starts a process per rank itself (across "
                                     "machines: nnodes, node_rank, distributed_init_method)"),
    "disable_custom_all_reduce": (bool, None, "tensor parallelism all-reduces with torch.distributed"),
    "swap_space": (float, None, "a preempted request is recomputed, never swapped to CPU memory"),
    "use_v2_block_manager": (bool, None, "nanoserve has one block manager (vLLM has dropped the argument)"),
    "max_seq_len_to_capture": (int, None, "the decode CUDA graphs serve every context length up to max_model_len"),
    "disable_async_output_proc": (bool, None, "outputs are processed on the loop thread after each step "
                                              "(async_scheduling overlaps that with the next step)"),
    "disable_log_stats": (bool, None, "the offline LLM logs no periodic stats (LLM.stats() reads the counters)"),
    "tokenizer_mode": (str, ("auto", "hf"), "the tokenizer is Hugging Face's (tokenizer.json)"),
    "tokenizer_revision": (str, (None,), "a tokenizer hub id is loaded at the model's revision"),
    "logprobs_mode": (str, ("raw_logprobs",),
                      "logprobs are the raw model distribution's, before penalties, bias and temperature"),
    "optimization_level": (int, None, "nanoserve picks its kernels itself (enforce_eager: the torch references; "
                                      "CUDA graphs: cudagraph_capture_sizes)"),  # vLLM's -O
    "fully_sharded_loras": (bool, (False,), "an adapter is split as its layer is, vLLM's default"),
    "lora_dtype": (str, ("auto",), "LoRA adapters run in the model's dtype (on a CPU in fp32, faster there)"),
}
VLLM_RENAMED = {"num_gpu_blocks_override": "num_kv_blocks"}  # vLLM's name -> EngineConfig's


def vllm_arg_note(given: str, value: Any, taken: tuple | None, note: str, kind: str = "argument") -> str:
    """The line that a vLLM option taken without effect logs; ``given`` spells it as its user wrote it.
    ValueError (that line, as why) where ``value`` is not one of ``taken``."""
    if taken is not None and value not in taken:
        raise ValueError(f"{given} is not supported: {note}")
    return f"{given} (a vLLM {kind}) does nothing here: {note}"


def engine_config_from_kwargs(model: str, kwargs: dict[str, Any]) -> EngineConfig:
    """vLLM's ``LLM(model, **kwargs)`` as an EngineConfig: EngineConfig's fields (None: the default, as
    vLLM's Optional arguments), VLLM_RENAMED, compilation_config's CUDA-graph sizes, and VLLM_ENGINE_ARGS
    (each logs its note); anything else is a ValueError naming it, never a TypeError."""
    fields = EngineConfig.__dataclass_fields__
    unknown = sorted(set(kwargs) - set(fields) - set(VLLM_ENGINE_ARGS) - set(VLLM_RENAMED) - {"compilation_config"})
    if unknown:  # vLLM has many more engine arguments: say which are not nanoserve's
        raise ValueError(f"LLM() got argument(s) nanoserve does not have: {', '.join(unknown)}; it takes "
                         f"{', '.join(f for f in fields if f != 'model')}, and vLLM's "
                         f"{', '.join(VLLM_ENGINE_ARGS)} where they ask for what nanoserve does anyway")
    taken: dict[str, Any] = {}
    for name, value in [*kwargs.items(), *_compilation_config(kwargs.get("compilation_config")).items()]:
        name = VLLM_RENAMED.get(name, name)
        if name in VLLM_ENGINE_ARGS:
            if VLLM_ENGINE_ARGS[name][0] is bool and value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")  # as EngineConfig's own
            logger.info("[engine] %s", vllm_arg_note(f"{name}={value!r}", value, *VLLM_ENGINE_ARGS[name][1:]))
        elif name == "compilation_config" or value is None:
            continue  # read just above; None: the default
        elif name in taken:
            raise ValueError(f"{name} is given twice (by compilation_config or vLLM's name, and by its own)")
        else:
            taken[name] = value
    return EngineConfig(str(model), **taken)


def load_logits_processors(specs: list[str | type]) -> list[type[LogitsProcessor]]:
    """The classes of ``logits_processors``: LogitsProcessor subclasses, given or named
    "module:Class" (or "module.Class", as vLLM's --logits-processors takes them)."""
    classes = []
    for spec in specs:
        cls = spec
        if isinstance(spec, str):
            module, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"logits processor {spec!r}: cannot import it ({e}); name it module:Class, "
                                 f"importable from this Python") from None
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits processor {spec!r} is not a subclass of nanoserve's LogitsProcessor "
                             f"(vLLM's interface: from nanoserve import LogitsProcessor)")
        classes.append(cls)
    return classes


def _start_logits_processor(cls: type[LogitsProcessor], config: EngineConfig, device: torch.device
                            ) -> LogitsProcessor:
    try:
        return cls(config, device, False)  # is_pin_memory: nanoserve copies from pageable host memory
    except Exception as e:  # noqa: BLE001 - the user's code: name it
        raise ValueError(f"logits processor {cls.__name__} failed to start: {type(e).__name__}: {e}") from e


def _compilation_config(config: int | dict | None) -> dict[str, Any]:
    """vLLM's compilation_config (an optimization level, or a dict): its CUDA-graph sizes as EngineConfig's
    fields; its level (mode) is taken with a note, anything else is refused."""
    if config is None or isinstance(config, int):
        config = {} if config is None else {"level": config}
    if not isinstance(config, dict):
        raise ValueError(f"compilation_config must be an int (a level) or a dict, got {type(config).__name__}")
    sizes = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")
    for key, value in config.items():
        if key in ("level", "mode"):
            logger.info("[engine] compilation_config's %s=%r (vLLM's torch.compile level) does nothing here: "
                        "nanoserve picks its kernels itself (enforce_eager=True: the torch references)", key, value)
        elif key not in sizes:
            raise ValueError(f"compilation_config[{key!r}] is not supported: nanoserve takes only its "
                             f"{' and '.join(sizes)} (and level or mode, which change nothing here)")
    return {k: config[k] for k in sizes if k in config}


@dataclass(slots=True)
class StepInFlight:
    """A launched step not landed yet (vLLM: an entry of EngineCore's batch_queue); ``output``: a
    ModelRunnerOutput, or async an AsyncModelRunnerOutput."""
    sched: SchedulerOutput
    # The next step may be scheduled before this one lands. vLLM's nearest: step_with_batch_queue defers a step's
    # sampling, not its scheduling, while SchedulerOutput.pending_structured_output_tokens waits on this one's.
    may_run_ahead: bool
    output: Any = None


def resolve_device(device: str | None) -> torch.device:
    """``device``, or where it is left out CUDA if there is a GPU, else the CPU."""
    try:
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as e:  # torch's list of every device type it knows, or a non-string
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from e
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():  # torch's AssertionError otherwise
        raise ValueError(f"device={device!r}, but this torch sees no CUDA GPU (torch {torch.__version__}, "
                         f"CUDA {torch.version.cuda})")
    return resolved


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a front end may know of a built engine (the banner, /v1/models)."""
    model: str
    architecture: str
    dtype: str
    device: str
    weight_bytes: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int       # those requests can hold (not a sliding window's null block)
    kv_bytes_per_block: int
    blocks_per_request: int  # the most one request holds (kvcache.blocks_per_request)


# The caching allocator reserves whole segments (2 and 20 MiB), so a graphs' pool
# exceeds the profiled peak it was sized by a little without anything amiss.
GRAPH_POOL_SLACK = 64 * 2**20


class LLMEngine:
    """The engine core (vLLM's LLMEngine and EngineCore in one), synchronous: ``add_request``, then
    ``step()`` until done. A request's path through it: ``add_request`` (validate, tokenize) ->
    ``Scheduler.add_request``; each ``step_work``: ``schedule_step`` (``Scheduler.schedule``) ->
    ``build_inputs`` (a ``SeqInput`` a request) -> ``ModelRunner.execute_model`` (model.py) -> ``_land``
    (sampled tokens, drafts, detokenize, stops) -> ``RequestOutput``s, which ``AsyncLLM`` puts on each
    request's queue for the server."""

    def __init__(self, config: EngineConfig):
        self.config = config
        path = resolve_model_dir(config.model, config.revision, config.download_dir)
        self.model_config = ModelConfig.from_dir(path, classify_overrides(config, path))
        if config.hf_overrides:
            logger.info("[engine] config.json overridden (hf_overrides): %s", json.dumps(config.hf_overrides))
        self.runner_type = resolve_runner(config, path, self.model_config)  # "generate" or "pooling"
        self.pooler_config: PoolerConfig | None = None
        # the pooling runner's task (vLLM's get_pooling_task): --pooler-config's task, else a classifier's
        # "classify" and an embedding model's "embed"; supported_pooling_tasks: the model's two (vLLM's
        # DispatchPooler: each sequence task with its token-wise one)
        self.pooling_task: str | None = None
        self.supported_pooling_tasks: tuple[str, ...] = ()
        self.task_instructions: dict[str, str] | None = None
        self.classify_activation: str | None = None  # classify's: "softmax", "sigmoid" or "identity"
        # an embedding model's sentence-transformers Dense modules (vLLM's ST projector), on the pooled rows in fp32
        self.projector: torch.nn.Sequential | None = None
        if self.runner_type == "pooling":
            if config.runner == "auto":  # vLLM's line
                logger.info("[engine] Resolved `--runner auto` to `--runner pooling`. Pass the value explicitly "
                            "to silence this message.")
            config.check_pooling_runner()
            if self.model_config.encoder_only:
                check_encoder_config(config, self.model_config)
            # vLLM's defaults: CLS for its BERT, RoBERTa and ModernBERT models, LAST for a decoder (and for
            # EmbeddingGemma's Gemma3Model); a ModernBERT classifier's is its head's, always (vLLM's
            # ModernBertPooler reads classifier_pooling alone)
            mc, pooler = self.model_config, config.pooler_config
            if mc.modernbert and encoder_head_pooling(mc):
                pooler = dataclasses.replace(pooler, pooling_type=mc.modernbert.pooling)
            self.pooler_config = pooler.resolved(path, "CLS" if mc.encoder_only and not mc.gemma else "LAST")
            self.task_instructions = embed_task_instructions(path)  # /v2/embed's input_type prefixes
            self._resolve_pooling_task()
            if mc.num_labels is None and not mc.late_interaction:  # vLLM's ColBERT projects with its own linear
                self.projector = load_st_projector(path, mc.hidden_size)
        self.device = resolve_device(config.device)
        if self.device.index is not None and self.device.type == "cuda":  # Triton and graph capture use the current one
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config)
        # First, before torch allocates anything here: torch reads THP_MEM_ALLOC_ENABLE once, at its
        # first CPU allocation of any size.
        for setting in tune_process(self.device, config.cpu_allocator_tuning):
            logger.info("[engine] process-wide: %s (--no-cpu-allocator-tuning turns it off)", setting)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            path if config.tokenizer is None
            else resolve_model_dir(config.tokenizer, config.revision, config.download_dir))
        self.token_texts: dict[int, str] = {}  # each token's own text (logprobs'), decoded once: at most the vocabulary
        self._check_memory()
        self.workers: TPWorkers | None = None
        tp = TPGroup()
        if config.tensor_parallel_size != 1:  # ranks 1..N-1 start loading while this one does
            self.workers = TPWorkers.start(config, self.model_config, self.device, self.dtype)
            weakref.finalize(self, self.workers.shutdown, None)  # at exit, or when dropped unshut
            tp = self.workers.tp
        try:
            t0 = time.perf_counter()
            # an encoder runs in plain torch (its forward uses none of the backend's kernels) and never decodes
            self.backend = kernels.TORCH if self.model_config.encoder_only else select_backend(
                shard_config(self.model_config, tp.world_size), self.dtype, self.device, config.block_size,
                config.enforce_eager)
            self.compile_time_s = time.perf_counter() - t0
            self.decode_sizes = [] if self.model_config.encoder_only else self._decode_sizes()
            model, self.weight_bytes = load_model(path, self.dtype, self.device, self.backend, tp,
                                                  model_overrides(config, path),
                                                  config.max_model_len, config.wna16_weights)
            if config.lora_config is not None:  # the adapters' device slots, before the KV cache is sized
                self.weight_bytes += wrap_lora_layers(model, config.lora_config)
            self.max_model_len, self.kv_plan, window, kv_caches = self._init_kv_cache(model)
            block_manager = BlockManager(self.kv_plan.num_blocks, config.block_size, config.enable_prefix_caching,
                                         window)
            self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                       self.max_model_len, config.scheduling_policy,
                                                       config.max_loras if config.enable_lora else None,
                                                       *self._spec_schedule(),
                                                       enable_chunked_prefill=not self.model_config.encoder_only),
                                       block_manager)
            self.info = self._engine_info(block_manager)
            self.logits_processor_classes = load_logits_processors(config.logits_processors or [])
            self.runner = ModelRunner(model, kv_caches, config.block_size, self.device, self.backend, config.seed,
                                      self.decode_sizes, self.max_model_len,
                                      [_start_logits_processor(c, config, self.device)
                                       for c in self.logits_processor_classes])
            self._warm_up()
        except BaseException:
            self.shutdown()
            raise
        self.eos_token_ids = frozenset(_eos_ids(path, self.model_config, self.tokenizer))
        # The longest text that could fit in max_model_len tokens, checked before
        # tokenizing: no token stands for more characters than the longest vocabulary
        # string (byte-level BPE: bytes, and a character is at least one). The 4 covers
        # normalizers that merge characters (NFKC: 3 Hangul jamo make one syllable).
        self.max_prompt_chars = None if self.tokenizer is None else (
            4 * self.max_model_len * max(1, max(map(len, self.tokenizer.get_vocab()), default=1)))
        self.default_sampling = generation_defaults(path, config.generation_config, config.override_generation_config)
        # vLLM's override_max_tokens: a named directory's (or the override's) max_new_tokens caps
        # a request's max_tokens; the model's own is only the default of a request without one
        self.override_max_tokens = (config.override_generation_config or {}).get("max_new_tokens") \
            if config.generation_config in ("auto", "vllm") else self.default_sampling.get("max_tokens")
        if self.default_sampling:
            logger.info("[engine] sampling defaults from generation_config.json (--generation-config vllm "
                        "ignores them; a request's own fields win): %s", self.default_sampling)
            try:
                SamplingParams(**self.default_sampling)
            except (ValueError, TypeError) as e:  # the model's own file (the override was checked): served anyway,
                logger.warning("[engine] the sampling defaults from generation_config.json are not valid, so every "
                               "request that leaves the field out will be refused: %s (--generation-config vllm "
                               "ignores them; --override-generation-config can mend one)", e)  # as in vLLM
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                          self.eos_token_ids, reasoning_parser=config.reasoning_parser)
        self.request_counter = itertools.count()
        self.stats_counters = {"prompt_tokens": 0, "generation_tokens": 0, "num_finished": 0}
        self.proposer = self._proposer()
        if self.proposer is not None:  # vLLM's spec-decode metrics (its acceptance rate: accepted / draft tokens;
            # per position: how many drafts had their i-th token accepted, i from 0 to k - 1)
            k = config.speculative_config.num_speculative_tokens
            self.stats_counters.update(spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
                                       spec_decode_num_accepted_tokens=0,
                                       spec_decode_num_accepted_tokens_per_pos=[0] * k)
        self.in_flight: list[StepInFlight] = []
        self.beam_searches: dict[str, BeamSearch] = {}
        self.beam_children: dict[str, tuple[BeamSearch, int]] = {}  # a round's one-token requests: search, beam
        self.loras: dict[int, LoRARequest] = {}  # the adapters loaded, by lora_int_id
        self.lora_loads: dict[int, int] = {}     # ... and which load each is (the prefix cache's salt)
        # requests ended for what went wrong with them alone (caller id -> why: their adapter could not be
        # loaded again, a custom logits processor raised, their inputs or output raised), for the caller to
        # pop: AsyncLLM fails each with it, LLM.generate raises it
        self.failed_requests: dict[str, str] = {}
        # step_work's verdict, for AsyncLLM's count of failed steps: whether a step served some request
        # (took in its result, or computed its chunk), and whether one ran whose every request a bug of the
        # engine's own ended (building its inputs, taking in its output: ``faults`` counts those requests)
        self.step_served = self.step_faulted = False
        self.faults = 0
        self.load_counter = itertools.count()
        self.serials = itertools.count()  # Request.serial's

    # ---------------------------------------------------------------- start-up
    def _spec_schedule(self) -> tuple[int, list[int] | None]:
        """The scheduler's num_spec_tokens and dynamic_sd_lookup (as vLLM's scheduler builds it, over
        batch sizes 1 to max_num_seqs)."""
        spec = self.config.speculative_config
        if spec is None:
            return 0, None
        schedule = spec.num_speculative_tokens_per_batch_size
        return spec.num_speculative_tokens, None if schedule is None else build_dynamic_sd_schedule_lookup(
            schedule, self.config.max_num_seqs, spec.num_speculative_tokens)

    def _proposer(self) -> NgramProposer | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.logits_processor_classes:  # they act on a request's row with its output so far, one a step
            logger.warning("[engine] speculative decoding is off: custom logits processors are loaded")
            return None
        logger.info("[engine] speculative decoding: %s, up to %d draft tokens a step (n-grams of %d to %d)%s",
                    spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                    f", by batch size {list(spec.num_speculative_tokens_per_batch_size)}"
                    if spec.num_speculative_tokens_per_batch_size else "")
        return NgramProposer(spec)

    def _freed_window(self, num_blocks: int, max_model_len: int) -> int | None:
        """The sliding window whose out-of-window blocks the block manager frees: only where
        every layer has it (a full-attention layer reads every block), and where the pool holds
        a request's window and the null block (else it holds the whole request: see check_fits)."""
        mc, cfg = self.model_config, self.config
        if mc.sliding_window is None or cfg.disable_sliding_window or len(mc.sliding_layers) != mc.num_layers:
            return None
        need = kvcache.blocks_per_request(max_model_len, cfg.block_size, mc.sliding_window,
                                          cfg.max_num_batched_tokens)
        return mc.sliding_window if num_blocks >= need + 1 else None

    def _decode_sizes(self) -> list[int]:
        cfg = self.config
        if cfg.enforce_eager:
            return []
        if cfg.tensor_parallel_size > 1:  # workers would have to pad and capture in lockstep: not yet
            logger.info("[engine] no CUDA graphs or padded decode steps under tensor parallelism (yet)")
            return []
        if self.device.type == "cuda" and not self.backend.capture_safe:  # select_backend said why (one line)
            return []
        cap = cfg.max_cudagraph_capture_size
        if cap is not None and cap < 1:
            raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {cap}")
        if cfg.cudagraph_capture_sizes is None:  # max_num_seqs <= max_num_batched_tokens (EngineConfig)
            return cudagraph_capture_sizes(cfg.max_num_seqs, cap or 512) if self.device.type == "cuda" else []
        sizes = sorted(set(cfg.cudagraph_capture_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"cudagraph_capture_sizes must be positive batch sizes, got {cfg.cudagraph_capture_sizes}")
        # as vLLM's _set_cudagraph_sizes: sizes above a step's token budget are dropped with a warning, and a
        # max_cudagraph_capture_size given beside the list must be what is left of it
        kept = [s for s in sizes if s <= cfg.max_num_batched_tokens]
        if kept != sizes:
            logger.warning("[engine] cudagraph_capture_sizes %s: %s dropped, above max_num_batched_tokens (%d)",
                           cfg.cudagraph_capture_sizes, sizes[len(kept):], cfg.max_num_batched_tokens)
        if cap is not None and cap != max(kept, default=0):
            raise ValueError(f"max_cudagraph_capture_size ({cap}) must be the largest of cudagraph_capture_sizes "
                             f"({max(kept, default=0)}), as vLLM's, or be left out")
        return kept

    def _check_memory(self) -> None:
        """Before loading: do the weights, with an explicitly sized KV cache, fit (a GPU: this rank's share)?"""
        cfg, mc = self.config, self.model_config
        # a packed int4/int8 checkpoint's linear layers (its experts the most of them) hold its codes, not the dtype's
        weight_bytes = weight_bytes_before_load(mc, self.dtype, wna16_packed(cfg.wna16_weights, mc, self.device))
        ranks = cfg.tensor_parallel_size if self.device.type == "cuda" else 1  # CPU ranks share one machine
        spec = KVCacheSpec(mc.num_layers, num_kv_heads_per_rank(mc.num_kv_heads, ranks), mc.head_dim, self.dtype,
                           cfg.block_size, bool(mc.kv_lora_rank))
        kv_bytes = cfg.kv_cache_memory_bytes if cfg.num_kv_blocks is None else cfg.num_kv_blocks * spec.bytes_per_block
        # the LoRA slots too, allocated with the weights (wrap_lora_layers; fp32 on a CPU: lora_dtype)
        lora = 0 if cfg.lora_config is None else lora_slot_bytes(
            mc, cfg.lora_config, cfg.tensor_parallel_size, self.dtype if self.device.type == "cuda" else torch.float32)
        if self.device.type == "cuda":
            return kvcache.check_gpu_memory(weight_bytes // ranks, self.device,
                                            cfg.gpu_memory_utilization, kv_bytes, lora)
        kvcache.check_cpu_memory(weight_bytes, kv_bytes, lora * cfg.tensor_parallel_size)

    def _init_kv_cache(self, model) -> tuple[int, KVCachePlan, int | None, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Size the KV cache from what the weights leave, settle max_model_len, and
        allocate the KV tensors: (max_model_len, the plan, the sliding window whose
        blocks are freed, per layer K and V)."""
        cfg, mc = self.config, self.model_config
        if cfg.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {cfg.block_size}")
        if mc.encoder_only:
            return self._encoder_blocks()
        spec, plan = plan_rank_kv_cache(model, self.weight_bytes, cache_config(cfg, self.decode_sizes))
        log_tensor_parallel(model.tp, self.weight_bytes, spec, plan)
        max_len = cfg.max_model_len
        if max_len is None:  # as long as the model allows and one request fits (in its window, where it has one)
            max_len = mc.max_position_embeddings
            if self._freed_window(plan.num_blocks, max_len) is None:
                max_len = min(max_len, plan.num_blocks * cfg.block_size)
            if cfg.disable_sliding_window and mc.sliding_window is not None:
                max_len = min(max_len, mc.sliding_window)
        elif max_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_len}")
        elif max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} is longer than the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        mc.check_max_model_len(max_len, cfg.disable_sliding_window)
        window = self._freed_window(plan.num_blocks, max_len)
        need = kvcache.blocks_per_request(max_len, cfg.block_size, window, cfg.max_num_batched_tokens)
        nulls = int(window is not None)
        kvcache.check_fits(plan, spec, max_len, need + nulls)
        kvcache.log_plan(plan, spec, self.weight_bytes, max_len, need, nulls)
        return max_len, plan, window, kvcache.allocate_kv_cache(spec, plan.num_blocks, self.device)

    def _encoder_blocks(self) -> tuple[int, KVCachePlan, None, list]:
        """An encoder keeps no KV: the block manager only counts the slots of one step's prompts (each is
        computed whole and ends in its step), and no tensor backs them. max_model_len as a decoder's, but a
        prompt must fit a step's token budget, unchunked (vLLM's check without chunked prefill)."""
        cfg, mc = self.config, self.model_config
        max_len = mc.max_position_embeddings if cfg.max_model_len is None else cfg.max_model_len
        if max_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_len}")
        if max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} is longer than the model's max_position_embeddings="
                             f"{mc.max_position_embeddings}")
        if cfg.max_num_batched_tokens < max_len:  # vLLM's words
            raise ValueError(f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) is smaller than max_model_len "
                             f"({max_len}). This effectively limits the maximum sequence length to "
                             f"max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                             f"max_num_batched_tokens or decrease max_model_len.")
        num_blocks = -(-cfg.max_num_batched_tokens // cfg.block_size) + cfg.max_num_seqs
        logger.info("[kvcache] %s attends bidirectionally within each prompt: no KV cache, prompts computed "
                    "whole (up to %d tokens a step), prefix caching off", mc.architecture, cfg.max_num_batched_tokens)
        return max_len, KVCachePlan(num_blocks, 0, 0), None, []

    def _warm_up(self) -> None:
        """Build what the first steps would (a warm-up forward; on CUDA the decode graphs)."""
        t0 = time.perf_counter()
        self.runner.warmup()
        self.compile_time_s += time.perf_counter() - t0
        logger.info("[engine] kernels: %s; building them and a warm-up forward took %.1f s",
                    self.backend.name, self.compile_time_s)
        if self.device.type == "cuda" and self.decode_sizes:
            # reserved, not allocated: the graphs' pool keeps its memory while the
            # tensors in it count as freed once capture ends. Each capture empties the
            # cache first, so empty it here too, or the warm-up's cached blocks would be
            # subtracted from the graphs' memory.
            torch.cuda.empty_cache()
            t0, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
            try:
                self.runner.capture_cudagraphs()
            except Exception as e:  # noqa: BLE001 - a launch capture forbids, or memory: say where, and the way out
                raise RuntimeError(f"[model] capturing the decode CUDA graphs failed: {first_line(e)} "
                                   "(--enforce-eager serves without them)") from e
            pool, estimate = torch.cuda.memory_reserved(self.device) - before, self.kv_plan.graph_pool_bytes
            lora = self.runner.lora is not None  # each size with and without the LoRA ops: vLLM's specialize_lora
            logger.info("[model] captured %d CUDA graphs (decode batches of %s%s) in %.1f s, %.0f MiB%s "
                        "(--enforce-eager turns them off)", len(self.decode_sizes) * (1 + lora),
                        ", ".join(map(str, self.decode_sizes)), ", each with and without LoRA" * lora,
                        time.perf_counter() - t0, pool / 2**20,
                        f" (the KV cache's sizing estimated {estimate / 2**20:.0f} MiB)" if estimate else "")
            if estimate and pool > estimate + GRAPH_POOL_SLACK:
                logger.warning("[model] the CUDA graphs took %.0f MiB more than the KV cache's sizing left them: "
                               "steps may run out of GPU memory (lower --gpu-memory-utilization if they do)",
                               (pool - estimate) / 2**20)

    def release_memory(self) -> None:
        """Going idle after steps (the server's loop calls it on the model thread): on
        the CPU, the heap glibc kept for the steps (tune_process) goes back to the system."""
        release_idle_memory(self.device, self.config.cpu_allocator_tuning)

    def _engine_info(self, bm: BlockManager) -> EngineInfo:
        cfg = self.config
        return EngineInfo(cfg.model, self.model_config.architecture, str(self.dtype).replace("torch.", ""),
                          str(self.device), self.weight_bytes, self.max_model_len, cfg.block_size,
                          bm.num_blocks, self.kv_plan.bytes_per_block,
                          kvcache.blocks_per_request(self.max_model_len, cfg.block_size, bm.sliding_window,
                                                     cfg.max_num_batched_tokens))

    def describe(self) -> EngineInfo:
        """What a front end may know of this engine (made at start-up: none of it changes)."""
        return self.info

    # ---------------------------------------------------------------- requests
    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; a text longer than any prompt that fits
        is refused before the tokenizer sees it."""
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise InvalidInput("prompt", f"a prompt must be a string or a list of token ids, got "
                                         f"{type(prompt).__name__}")
        if self.tokenizer is None:
            raise InvalidInput("prompt", "a text prompt needs a tokenizer, but skip_tokenizer_init=True; "
                                         "pass token ids")
        if len(prompt) > self.max_prompt_chars:  # vLLM 0.32's words and param (TokenizeParams._text_len_check)
            raise InvalidInput("input_text", f"This model's maximum context length is {self.max_model_len} tokens. "
                                             f"However, your prompt contains {len(prompt)} characters (more than "
                                             f"{self.max_prompt_chars} characters, which is the upper bound for "
                                             f"{self.max_model_len} input tokens). Please reduce the length of the "
                                             f"input prompt.")
        try:
            prompt.encode("utf-8")  # fails on a lone surrogate, on which the tokenizer raises TypeError
        except UnicodeEncodeError:
            raise InvalidInput("prompt", "the prompt is not valid Unicode: it holds a lone surrogate") from None
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise InvalidInput("token_ids", "this engine runs without a tokenizer (skip_tokenizer_init=True)")
        self._check_token_ids("token_ids", token_ids)
        return self.tokenizer.decode(list(token_ids))

    def process_prompt(self, prompt: str | Sequence[int] | PairPrompt | TokenizedPrompt,
                       truncate_prompt_tokens: int | None = None,
                       add_special_tokens: bool = True, truncation_side: str = "left",
                       output_tokens: int = 1, pad_to: int | None = None) -> TokenizedPrompt:
        """Tokenize, truncate (as vLLM: keep the last ``truncate_prompt_tokens``,
        or the first with truncation_side "right"; -1: all but ``output_tokens``) and
        validate (raises InvalidInput); safe off the loop thread. truncation_side None (a pooling request
        that names none) is the tokenizer's own truncation, as vLLM's TokenizeParams: its side, and a text's
        special tokens kept ([CLS] ... [SEP] stay, as the encoder was trained), ids cut on its side. A
        PairPrompt's token types are cut and padded with its ids."""
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        types = None
        if isinstance(prompt, PairPrompt):
            prompt, types = prompt.token_ids, prompt.token_type_ids
        keep = truncate_prompt_tokens
        self.check_truncation(keep)
        if keep == -1:  # vLLM 0.32's max_truncation_tokens: one token of room kept, max_tokens then clamped to it
            keep = max(1, self.max_model_len - output_tokens)
        if isinstance(prompt, torch.Tensor):
            return self._embeds_prompt(prompt, keep, truncation_side)
        text, token_ids = self.tokenize(prompt, add_special_tokens)
        truncated = keep is not None and len(token_ids) > keep
        if truncated and truncation_side is None and text is not None and keep > 0:
            token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens, truncation=True,
                                              max_length=keep)
        side = truncation_side or getattr(self.tokenizer, "truncation_side", None) or "right"
        if truncated and len(token_ids) > keep:  # ids, a given side, or a keep below the special tokens' count
            token_ids = token_ids[len(token_ids) - keep:] if side == "left" else token_ids[:keep]
        kept = token_ids
        if pad_to is not None and len(token_ids) < pad_to:  # after truncation, as transformers' (and vLLM's)
            token_ids = token_ids + [self._pad_token_id()] * (pad_to - len(token_ids))
        self.validate_prompt(token_ids, output_tokens)  # before the tokenizer decodes them (an id past C's long)
        if truncated:
            text = None if self.tokenizer is None else self.tokenizer.decode(kept)  # what the model saw
        if types is not None:
            types = aligned_token_types(types, len(kept), side, len(token_ids))
        return TokenizedPrompt(text, token_ids, token_type_ids=types)

    def check_truncation(self, keep: int | None) -> None:
        """vLLM's TokenizeParams' rule: no truncation to more tokens than max_model_len (it could not fit)."""
        if keep is not None and keep > self.max_model_len:
            raise InvalidInput("truncate_prompt_tokens", f"truncate_prompt_tokens={keep} cannot be greater than "
                                                         f"max_model_len = {self.max_model_len}. Please request a "
                                                         f"smaller truncation size.")

    def _embeds_prompt(self, embeds: torch.Tensor, keep: int | None, truncation_side: str) -> TokenizedPrompt:
        """A prompt given as embeddings (vLLM's prompt_embeds): [tokens, hidden_size], or [1, tokens,
        hidden_size]; ``keep``: that many rows only, as truncate_prompt_tokens keeps tokens."""
        if not self.config.enable_prompt_embeds:  # vLLM's rule: a model's inputs are the server's to open
            raise InvalidInput("prompt_embeds", "prompt_embeds need --enable-prompt-embeds (offline: "
                                                "enable_prompt_embeds=True)")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        hidden = self.model_config.hidden_size
        if embeds.layout != torch.strided or embeds.is_meta or embeds.dim() != 2 or embeds.shape[1] != hidden \
                or embeds.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidInput("prompt_embeds", f"prompt_embeds must be a dense float32, bfloat16 or float16 tensor "
                                                f"of shape [tokens, {hidden}] (the model's hidden size), got "
                                                f"{embeds.layout} {embeds.dtype} of shape {list(embeds.shape)}")
        if keep is not None and len(embeds) > keep:  # (a keep past the rows would slice from the end)
            embeds = embeds[len(embeds) - keep:] if truncation_side == "left" else embeds[:keep]
        self.check_prompt_length(len(embeds))
        embeds = embeds.to("cpu", self.dtype).contiguous()  # the steps carry it from the host, as token ids
        if not torch.isfinite(embeds).all():  # NaN spreads through attention to the other rows' outputs
            raise InvalidInput("prompt_embeds", "prompt_embeds hold NaN or infinite values")
        digest = hashlib.sha256(embeds.view(torch.uint8).numpy()).hexdigest()
        return TokenizedPrompt(None, [0] * len(embeds), prompt_embeds=embeds, embeds_digest=digest)

    def validate_prompt(self, token_ids: list[int], output_tokens: int = 1) -> None:
        """``output_tokens``: 0 for an embedding, which needs no room beside its prompt."""
        self.check_prompt_length(len(token_ids), output_tokens)  # before the per-token checks: they cost as much
        self._check_token_ids("prompt", token_ids)

    def check_prompt_length(self, num_tokens: int, output_tokens: int = 1) -> None:
        """Also before there is a list: the server counts a huge body's token ids in its bytes. A prompt
        only counted (Anthropic's count_tokens) or embedded needs no ``output_tokens`` beside it, as in vLLM's."""
        if not num_tokens:
            raise InvalidInput("prompt", "the prompt is empty: give at least one token")
        if num_tokens > self.max_model_len:
            # vLLM 0.32's words and param (TokenizeParams._token_len_check): clients match "maximum context length"
            raise InvalidInput("input_tokens", f"This model's maximum context length is {self.max_model_len} tokens. "
                                               f"However, your prompt contains {num_tokens} input tokens, which "
                                               f"exceeds this limit even without any output tokens. Please reduce "
                                               f"the length of the input prompt.")
        if num_tokens + output_tokens > self.max_model_len:
            # vLLM's get_max_tokens clamps max_tokens to the room, here none: its SamplingParams' 400, then why
            raise InvalidInput("max_tokens", f"max_tokens must be at least 1, got 0. (The prompt's {num_tokens} "
                                             f"tokens fill max_model_len, leaving no room for an output token: "
                                             f"shorten the prompt.)")

    def resolve_max_tokens(self, num_prompt: int, max_tokens: int | None) -> int:
        """The one place of the length rule (vLLM 0.32's get_max_tokens): a request's max_tokens (the server
        folded in the generation config's default and cap) is clamped to the room the prompt leaves in
        max_model_len, never refused; None is all the room. Offline as served: vLLM's scheduler ends a request
        at max_model_len with finish_reason "length" too."""
        room = self.max_model_len - num_prompt
        return room if max_tokens is None else min(max_tokens, room)

    def validate_params(self, params: SamplingParams) -> tuple[Any, list[list[int]]]:
        """Check ``params`` against this model (raises InvalidInput); returns the
        compiled grammar of its structured outputs (None without), from the cache
        when the server compiled it ahead on its grammar thread (ServerState.compile_grammar), and its bad_words
        tokenized (SamplingParams.bad_words_token_ids), once for both the check and the request."""
        vocab, cap = self.model_config.vocab_size, self.config.max_logprobs
        limit = vocab if cap == -1 else min(cap, vocab)  # -1: no cap (as vLLM's); more would be none to rank
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)  # -1: the whole vocabulary (as vLLM's), resolved in _add_validated
            if name == "logprobs" and params.logprob_token_ids:  # their own bound (MAX_LOGPROB_TOKEN_IDS)
                continue
            if (vocab if v == -1 else v or 0) > limit:
                raise InvalidInput(name, f"{name} must be None or in [0, {limit}] (the engine's max_logprobs), "
                                         f"got {v}")
        self._check_token_ids("logit_bias", list(params.logit_bias or {}))
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or [])
        self._check_token_ids("logprob_token_ids", params.logprob_token_ids or [])
        if params.bad_words and self.tokenizer is None:
            raise InvalidInput("bad_words", "bad_words need a tokenizer, but skip_tokenizer_init=True")
        if params.stop and self.tokenizer is None:  # they match the text, which there is none of
            raise InvalidInput("stop", "stop strings need a tokenizer, but skip_tokenizer_init=True (stop_token_ids "
                                       "need none)")
        for word in params.bad_words:
            try:
                word.encode("utf-8")  # fails on a lone surrogate, on which the tokenizer raises TypeError
            except UnicodeEncodeError:
                raise InvalidInput("bad_words", "bad_words are not valid Unicode: one holds a lone surrogate") from None
        if params.thinking_token_budget is not None and self.structured_outputs.think_ids is None:
            raise InvalidInput("thinking_token_budget", "thinking_token_budget needs a reasoning parser (--reasoning-"
                                                        f"parser) and the tokens {' and '.join(THINK_TAGS)}")
        for cls in self.logits_processor_classes:
            try:
                cls.validate_params(params)
            except (ValueError, TypeError) as e:  # the processor's own words, named as vLLM's custom arguments
                # (TypeError too: a check such as `target < 0` raises it on a string the request sent)
                raise InvalidInput("extra_args", f"extra_args refused by the logits processor {cls.__name__}: "
                                                 f"{e}") from None
        grammar = self.structured_outputs.compile(params.structured_outputs)
        bad_words = params.bad_words_token_ids(self.tokenizer)
        self._check_first_token(params, grammar, bad_words)
        return grammar, bad_words

    def _check_first_token(self, p: SamplingParams, grammar: Any, bad_words: list[list[int]]) -> None:
        """Refuse a request whose own fields leave no token to sample at its first step (the sampler would
        end it there, empty): allowed_token_ids and the grammar's first tokens, less the bans that hold from
        the start. Dead ends that come later (a finished grammar under min_tokens) end it where they come."""
        bans = {"bad_words": [w[0] for w in bad_words if len(w) == 1],
                "logit_bias": [t for t, b in (p.logit_bias or {}).items() if b == -math.inf],
                "min_tokens": held_back_by_min_tokens(p, self.eos_token_ids) if p.min_tokens else []}
        if not any(bans.values()) and not (p.allowed_token_ids and grammar is not None):
            return
        vocab = self.model_config.vocab_size
        pool = _token_bits(p.allowed_token_ids, vocab) if p.allowed_token_ids else (1 << vocab) - 1
        if grammar is not None:  # the bitmask's bytes, little-endian, are the same bits: token t is bit t
            words = GrammarState(grammar).next_token_bitmask().tolist()
            pool &= int.from_bytes(array("i", words).tobytes(), "little")
        if pool & ~_token_bits(itertools.chain(*bans.values()), vocab):
            return
        # named in the request's own words (its structured-output field has a name per API: left out)
        hit = [n for n, ids in bans.items() if pool & _token_bits(ids, vocab)]
        names = ["allowed_token_ids"] * bool(p.allowed_token_ids) + hit or ["structured_outputs"]
        why = " (which holds back EOS and stop_token_ids)" if "min_tokens" in hit else ""
        raise InvalidInput(names[0], f"{' and '.join(names)}{why} leave no token to sample as the first one"
                                     f"{' that the structured output allows' if grammar is not None else ''}")

    def _check_token_ids(self, param: str, token_ids: Sequence[int]) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidInput(param, f"{param} has token ids outside the vocabulary [0, {vocab}) (or not "
                                      f"integers): {bad[:5]}")

    def add_request(self, prompt: str | Sequence[int] | TokenizedPrompt, params: SamplingParams | None = None,
                    request_id: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Validate and queue a request (n > 1 becomes n child requests that share
        the prompt's blocks through the prefix cache); returns its id. ``output_kind``
        says what step() reports of it (RequestOutputKind); ``priority`` (vLLM's, lower
        first) needs the priority scheduling policy; ``lora_request``: the adapter it runs with."""
        if isinstance(params, PoolingParams) or params is None and self.runner_type == "pooling":
            return self.add_pooling_request(prompt, params or PoolingParams(), request_id, priority, lora_request)
        self.check_runner("generate")
        params = params or SamplingParams()
        self.check_priority(priority)
        if isinstance(params, BeamSearchParams):
            return self.add_beam_search(self.with_lora(self.process_prompt(prompt),
                                                       lora_request), params, request_id, priority)
        prompt = self.process_prompt(prompt, params.truncate_prompt_tokens)
        prompt = self.with_lora(prompt, lora_request)
        return self._add_validated(prompt, params, *self.validate_params(params), request_id, output_kind, priority)

    def _resolve_pooling_task(self) -> None:
        mc, pc = self.model_config, self.pooler_config
        base = "embed" if mc.num_labels is None else "classify"
        # vLLM's order (its DispatchPooler's); a token classifier's and ColBERT's poolers have the token-wise task
        # alone (vLLM's ColBERTModel)
        self.supported_pooling_tasks = ("token_classify",) if mc.token_classifier else ("token_embed",) \
            if mc.late_interaction else (f"token_{base}", base)
        if pc.task is not None and pc.task not in self.supported_pooling_tasks:  # vLLM's words
            raise ValueError(f"Unsupported task: {pc.task!r} Supported tasks: {list(self.supported_pooling_tasks)}")
        self.pooling_task = pc.task or self.supported_pooling_tasks[-1]
        rows = "every token's final hidden state" if self.token_wise else f"{pc.pooling_type} pooling of the " \
                                                                          f"final hidden states"
        if base == "embed":
            logger.info("[engine] pooling runner: %s, %s%s", self.pooling_task, rows,
                        ", normalized" if pc.use_activation else "")
            return
        self.classify_activation = classify_activation(mc)
        logger.info("[engine] pooling runner: %s, %d labels from the score head on %s%s", self.pooling_task,
                    mc.num_labels, rows, f", {self.classify_activation}" if pc.use_activation else ", raw logits")

    @property
    def token_wise(self) -> bool:
        """vLLM's token_embed and token_classify: a row per prompt token (ALL pooling), not one per prompt."""
        return self.pooling_task is not None and self.pooling_task.startswith("token_")

    @property
    def is_cross_encoder(self) -> bool:
        """vLLM's enable_scoring_api for a classifier: Score and Rerank serve one with a single label."""
        return self.pooling_task == "classify" and self.model_config.num_labels == 1

    def check_pooling_task(self, task: str | None, online: bool = False) -> None:
        """``task`` against the model's (vLLM's checks and words: LLM.encode's, or /pooling's with
        ``online``): a task the model has but is not serving names --pooler-config's task to switch to."""
        self.check_runner("pooling")
        if task == self.pooling_task:
            return
        check_removed_pooling_task(task)
        if task is None:  # vLLM's words
            raise InvalidInput("pooling_task", "pooling_task required for `LLM.encode`. Use LLM.embed or "
                                               "LLM.classify, or set pooling_task: 'embed', 'classify', "
                                               "'token_embed' (multi-vector retrieval) or 'token_classify'")
        if not online and task in ("embed", "token_embed") and task not in self.supported_pooling_tasks:
            raise InvalidInput("task", "Embedding API is not supported by this model. Try converting the model "
                                       "using `--convert embed`.")
        if not online and task in ("classify", "token_classify") and task not in self.supported_pooling_tasks:
            raise InvalidInput("task", "Classification API is not supported by this model. Try converting the "
                                       "model using `--convert classify`.")
        if task == "plugin":  # vLLM's words: an IO processor plugin's task, none of which is served here
            raise InvalidInput("task", "No IOProcessor plugin installed. Please refer to the documentation and to "
                                       "the 'prithvi_geospatial_mae_io_processor' offline inference example for "
                                       "more details.")
        if task not in self.supported_pooling_tasks:
            raise InvalidInput("task", f"Unsupported task: {task!r} Supported tasks: "
                                       f"{list(self.supported_pooling_tasks)}")  # (vLLM's list, as its server says)
        if online:
            raise InvalidInput("task", f"Try switching the model's pooling_task via --pooler-config.task {task}.")
        raise InvalidInput("task", f'Try switching the model\'s pooling_task via `PoolerConfig(task="{task}")`')

    def check_runner(self, runner: str) -> None:
        """Generation needs the generate runner, embeddings the pooling one (vLLM's words)."""
        if runner == self.runner_type:
            return
        if runner == "generate":
            raise InvalidInput("model", "LLM.generate() is only supported for generative models. Try passing "
                                        "`--runner generate` to use the model as a generative model.")
        raise InvalidInput("model", "LLM.encode() is only supported for pooling models. Try passing `--runner "
                                    "pooling` to use the model as a pooling model.")

    def process_pooling_prompt(self, prompt: str | Sequence[int] | PairPrompt | TokenizedPrompt,
                               params: PoolingParams,
                               add_special_tokens: bool = True, truncation_side: str | None = None,
                               padding: str | None = None) -> TokenizedPrompt:
        """process_prompt for an embedding: no room for output, so truncate_prompt_tokens -1 keeps max_model_len.
        ``truncation_side`` None is the tokenizer's (vLLM's TokenizeParams): "right", keep the first tokens, for
        most tokenizers and without one. ``padding`` "max_length" appends pad tokens up to max_model_len (for
        models trained on fixed-length inputs, as vLLM's)."""
        if isinstance(prompt, torch.Tensor):
            raise InvalidInput("prompt", "the pooling runner takes text or token ids, not prompt_embeds")
        keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        pad_to = self.max_model_len if padding == "max_length" else None
        return self.process_prompt(prompt, keep, add_special_tokens, truncation_side, output_tokens=0,
                                   pad_to=pad_to)

    def cross_encoder_prompt(self, query: str, document: str, add_special_tokens: bool = True,
                             score_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                             max_length: int | None = None) -> PairPrompt:
        """vLLM's cross-encoder prompt: with a score template (the server's --chat-template, LLM.score's
        chat_template), the pair rendered as a "query" and a "document" message (``template_kwargs``, e.g.
        the request's instruction, in the template's variables); else the tokenizer's text pair (its separators
        and special tokens between and around), or, where config.json's use_sep_token is false, the texts
        joined as one. ``max_length``: the tokenizer's truncation (longest text first, special tokens kept),
        as vLLM's where a request truncates without naming a side. The tokenizer's token_type_ids go along
        (vLLM's): a text pair's are 1 for its second text, a single text's (a template's, joined texts') 0."""
        if self.tokenizer is None:
            raise InvalidInput("model", "a cross-encoder's pairs need the model's tokenizer (--skip-tokenizer-init "
                                        "leaves none)")
        kw = dict(add_special_tokens=add_special_tokens, truncation=max_length is not None, max_length=max_length)
        if score_template is not None:
            text = self.render_score_template(query, document, score_template, template_kwargs or {})
            enc = self.tokenizer(text, **kw)
        elif not self.model_config.use_sep_token:
            enc = self.tokenizer(query + document, **kw)
        else:
            enc = self.tokenizer(text=query, text_pair=document, **kw)
        types = enc.get("token_type_ids")
        takes_types = self.model_config.encoder_only and self.model_config.type_vocab_size > 1
        return PairPrompt(enc["input_ids"], list(types) if takes_types and types is not None else None)

    def render_score_template(self, query: str, document: str, template: str, kwargs: dict[str, Any]) -> str:
        """vLLM's score template: the template rendered over [query, document] messages, no tools, as text."""
        reserved = sorted({"chat_template", "tools", "tokenize"} & kwargs.keys())
        if reserved:  # vLLM's words
            raise InvalidInput("chat_template_kwargs", f"chat_template_kwargs contains reserved keys that conflict "
                                                       f"with fixed scorer arguments: {set(reserved)}")
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=template, tools=None, tokenize=False,
                                                      **kwargs)
        except Exception as e:  # the template's own error (jinja's): this pair cannot be scored with it
            raise InvalidInput("chat_template", f"the score template failed to render a pair: "
                                                f"{type(e).__name__}: {first_line(e)}") from None

    def _pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            raise InvalidInput("padding", "padding max_length needs the tokenizer's pad token, and this model's "
                                          "tokenizer has none")
        return pad

    def check_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """``params`` against this model (vLLM's PoolingParams.verify), with the pooler config's defaults in."""
        if not isinstance(params, PoolingParams):
            raise InvalidInput("pooling_params", f"pooling_params must be a PoolingParams, got "
                                                 f"{type(params).__name__}")
        self.check_runner("pooling")
        d, mc = params.dimensions, self.model_config
        if d is not None and self.model_config.num_labels is not None:  # vLLM's words
            raise InvalidInput("dimensions", f"Task {self.pooling_task!r} only supports ['use_activation'] "
                                             f"parameters, does not support ['dimensions'] parameters")
        if d is not None:
            if not mc.is_matryoshka:
                raise InvalidInput("dimensions", f"This model does not support Matryoshka embeddings; dimensions "
                                                 f"must be unset (received dimensions={d}).")
            if not 1 <= d <= self.embedding_size:
                raise InvalidInput("dimensions", f"This model only supports dimensions in range "
                                                 f"[1, {self.embedding_size}], got {d}.")
            if mc.matryoshka_dimensions is not None and d not in mc.matryoshka_dimensions:
                raise InvalidInput("dimensions", f"This model only supports Matryoshka dimensions "
                                                 f"{list(mc.matryoshka_dimensions)}, got {d}.")
        self.check_truncation(params.truncate_prompt_tokens)
        if params.use_activation is None:
            params = dataclasses.replace(params, use_activation=self.pooler_config.use_activation)
        return params

    def add_pooling_request(self, prompt: str | Sequence[int] | TokenizedPrompt, params: PoolingParams,
                            request_id: str | None = None, priority: int = 0,
                            lora_request: LoRARequest | None = None) -> str:
        """Validate and queue an embedding request (the pooling runner's); returns its id."""
        params = self.check_pooling_params(params)
        self.check_priority(priority)
        prompt = self.with_lora(self.process_pooling_prompt(prompt, params), lora_request)
        return self._add_pooling_validated(prompt, params, request_id, priority)

    def _add_pooling_validated(self, prompt: TokenizedPrompt, params: PoolingParams, request_id: str | None,
                               priority: int = 0) -> str:
        """A prefill-only request: scheduled as any prompt (chunked, batched, prefix-cached), it ends in
        the step that computes its last token, with no token sampled. MEAN pooling needs every
        position's hidden state, CLS the first's and the token-wise tasks each row, so they read no
        cached prefix (as vLLM's skip_reading_prefix_cache)."""
        self._check_lora_loaded(prompt)
        request_id = self._new_request_id(request_id)
        self.scheduler.add_request(Request(
            request_id, prompt.text, prompt.token_ids, SamplingParams(max_tokens=1), 0, self.eos_token_ids, None,
            cache_salt=self._salt(prompt) if self.config.enable_prefix_caching else None,
            skip_reading_prefix_cache=self.token_wise or self.pooler_config.pooling_type != "LAST",
            priority=priority,
            lora_int_id=prompt.lora_int_id, serial=next(self.serials), pooling_params=params,
            token_type_ids=prompt.token_type_ids))
        self.stats_counters["prompt_tokens"] += len(prompt.token_ids)
        return request_id

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: load an adapter into the model, once per lora_int_id; True if it was loaded now."""
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need enable_lora=True (the server's --enable-lora)")
        if not all(hasattr(lora_request, k) for k in ("lora_name", "lora_int_id", "lora_path")):
            raise InvalidInput("lora_request", f"lora_request must be a LoRARequest (lora_name, lora_int_id, "
                                               f"lora_path), got {type(lora_request).__name__}")
        lora_id = lora_request.lora_int_id
        if not _is_int(lora_id) or lora_id < 1:
            raise InvalidInput("lora_request", f"lora_request.lora_int_id must be an integer >= 1, got {lora_id!r}")
        if not isinstance(lora_request.lora_name, str) or not isinstance(lora_request.lora_path, (str, os.PathLike)):
            raise InvalidInput("lora_request", f"lora_request.lora_name must be a string and .lora_path a directory's "
                                               f"path, got {lora_request.lora_name!r} and {lora_request.lora_path!r}")
        known = self.loras.get(lora_id)
        if known is not None:
            if known.lora_path != lora_request.lora_path:
                raise ValueError(f"lora_int_id {lora_id} is already the adapter {known.lora_name!r} "
                                 f"({known.lora_path}), not {lora_request.lora_path}")
            return False
        self.runner.add_lora(lora_id, lora_request.lora_path, self.config.max_lora_rank)  # on every rank
        self.loras[lora_id], self.lora_loads[lora_id] = lora_request, next(self.load_counter)
        logger.info("[engine] LoRA adapter %r (id %d) loaded from %s", lora_request.lora_name, lora_id,
                    lora_request.lora_path)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's: unload an adapter; False if it is not loaded. ValueError while a request runs with it
        (it would go on without it)."""
        if not self.retire_lora(lora_int_id):
            return False
        self.drop_lora_weights(lora_int_id)
        return True

    def retire_lora(self, lora_int_id: int) -> bool:
        """remove_lora's first half, run where requests are added (the server's loop thread, as add_request):
        the adapter leaves the engine's books, so that no request is added with it from now on (add_request's
        "not loaded"), unless one still runs with it (ValueError). Its weights stay in the model until
        drop_lora_weights, which the server runs on the model thread: were both halves there, a request added
        on the loop thread in between would pass the check and then run without the adapter."""
        if lora_int_id not in self.loras:
            return False
        users = self.scheduler.lora_users(lora_int_id) + \
            [b.request_id for b in self.beam_searches.values() if b.prompt.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"the LoRA adapter {self.loras[lora_int_id].lora_name!r} serves {len(users)} "
                             f"request(s) still running; unload it when they end")
        del self.lora_loads[lora_int_id]
        logger.info("[engine] LoRA adapter %r (id %d) unloaded", self.loras.pop(lora_int_id).lora_name, lora_int_id)
        return True

    def drop_lora_weights(self, lora_int_id: int) -> None:
        """remove_lora's second half: a retired adapter's weights out of the model (between steps)."""
        self.runner.remove_lora(lora_int_id)

    def with_lora(self, prompt: TokenizedPrompt, lora_request: LoRARequest | None) -> TokenizedPrompt:
        """The prompt, run with ``lora_request``'s adapter (loaded here the first time)."""
        if lora_request is None:
            return prompt
        self.add_lora(lora_request)
        return dataclasses.replace(prompt, lora_int_id=lora_request.lora_int_id)

    def add_beam_search(self, prompt: TokenizedPrompt, params: BeamSearchParams, request_id: str | None,
                        priority: int = 0) -> str:
        """A beam search (BeamSearch): its one output comes when it ends, whatever the output kind."""
        if prompt.prompt_embeds is not None:  # as vLLM's: its rounds' prompts are token ids
            raise InvalidInput("prompt_embeds", "beam search takes token or text prompts, not prompt_embeds")
        request_id = self._new_request_id(request_id)
        max_tokens = self.resolve_max_tokens(len(prompt.token_ids), params.max_tokens)
        bound = 700 / math.log(max(self.max_model_len, 2))  # past it, length ** length_penalty overflows a float
        if abs(params.length_penalty) > bound:
            raise InvalidInput("length_penalty", f"length_penalty must be within +-{bound:.1f} for max_model_len "
                                                 f"{self.max_model_len}, got {params.length_penalty}")
        search = BeamSearch(request_id, prompt, params, max_tokens, self.eos_token_ids, priority)
        cap = self.config.max_logprobs
        if search.child_params.logprobs is not None and cap != -1 and search.child_params.logprobs > cap:
            raise InvalidInput("beam_width", f"beam search ranks 2 x beam_width logprobs a step, at most the engine's "
                                             f"max_logprobs ({cap}): beam_width (n) must be at most {cap // 2}, got "
                                             f"{params.beam_width}")
        self.validate_params(search.child_params)  # allowed_token_ids against the vocabulary
        self.beam_searches[request_id] = search
        self._beam_round(search)
        return request_id

    def _beam_round(self, search: BeamSearch) -> None:
        """A one-token request for each live beam: the prompt and the beam's tokens, read from
        the prefix cache but for the last few (with prefix caching off, from the blocks the
        search's own requests cached, as n > 1's children share theirs)."""
        prompt = search.prompt
        for i, (child_id, beam) in enumerate(zip(search.child_ids(), search.beams)):
            self._add_validated(TokenizedPrompt(prompt.text, prompt.token_ids + beam.token_ids, prompt.cache_salt,
                                                lora_int_id=prompt.lora_int_id),
                                search.child_params, None, [], child_id, RequestOutputKind.FINAL_ONLY,
                                search.priority, family=f"beam:{search.request_id}")
            self.beam_children[child_id] = search, i

    def _beam_landed(self, outputs: dict[str, RequestOutput], search: BeamSearch, index: int, req: Request) -> None:
        if not search.land(index, req):
            return
        if search.advance():
            outputs[search.request_id] = search.output(self.tokenizer)
            del self.beam_searches[search.request_id]  # only now: if the search raised, fail_step finds it
        else:
            self._beam_round(search)

    def check_priority(self, priority: Any) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2**63 <= priority < 2**63:
            raise InvalidInput("priority", f"priority must be an integer (lower is served first), got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":  # as vLLM's
            raise InvalidInput("priority", f"priority {priority} needs the priority scheduling policy "
                                           f"(--scheduling-policy priority); this engine serves first come, first "
                                           f"served")

    def _add_validated(self, prompt: TokenizedPrompt, params: SamplingParams, grammar: Any,
                       bad_words: list[list[int]], request_id: str | None, output_kind: RequestOutputKind,
                       priority: int = 0, family: str | None = None) -> str:
        """add_request's second half, for a prompt and params already checked. ``family``: the
        salt under which requests that share a prompt share its blocks with prefix caching off
        (a beam search's; an n > 1 family's own is its id)."""
        self._check_lora_loaded(prompt)
        whole = {k: self.model_config.vocab_size for k in ("logprobs", "prompt_logprobs") if getattr(params, k) == -1}
        params = dataclasses.replace(params, **whole) if whole else params  # our copy: the caller's keeps its -1
        text, token_ids = prompt.text, prompt.token_ids
        if prompt.prompt_embeds is not None:
            self._check_embeds_params(params)
        request_id = self._new_request_id(request_id, params.n)
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        max_tokens = self.resolve_max_tokens(len(token_ids), params.max_tokens)
        prompt_logprobs = None if params.prompt_logprobs is None else [None]
        for i in range(params.n):
            child = params
            if params.n > 1:  # each child its own seed, else all n would be the same text (wrapped in int64)
                seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
                child = dataclasses.replace(params, n=1, seed=seed)
            rid = ids[i]
            # The n children of one prompt always share its blocks: with prefix
            # caching off, a salt private to the family still lets them.
            if self.config.enable_prefix_caching:
                salt = self._salt(prompt)
            else:
                salt = family if params.n == 1 else f"n:{request_id}"
            self.scheduler.add_request(Request(
                rid, text, token_ids, child, max_tokens, self.eos_token_ids,
                self._detokenizer([] if prompt.prompt_embeds is not None else token_ids, params),
                parent_id=request_id if params.n > 1 else None, index=i, cache_salt=salt,
                output_kind=output_kind,
                grammar=None if grammar is None else self.structured_outputs.grammar_state(grammar, token_ids),
                thinking=None if params.thinking_token_budget is None else ThinkingBudget(
                    params.thinking_token_budget, self.structured_outputs.think_ids, token_ids,
                    self.model_config.vocab_size),
                skip_reading_prefix_cache=prompt_logprobs is not None and i == 0, prompt_logprobs=prompt_logprobs,
                bad_words_token_ids=bad_words, priority=priority, prompt_embeds=prompt.prompt_embeds,
                lora_int_id=prompt.lora_int_id, serial=next(self.serials),
                stream_interval=max(params.stream_interval or 1, self.config.stream_interval)))
        self.stats_counters["prompt_tokens"] += len(token_ids)
        logger.debug("[engine] add %s: %d prompt tokens, max_tokens %d, n %d", request_id,
                     len(token_ids), max_tokens, params.n)
        return request_id

    def _salt(self, prompt: TokenizedPrompt) -> str | None:
        """The prefix cache's salt: the caller's, a prompt's embeddings' digest (its token ids are
        stand-ins), and its LoRA adapter's load (as vLLM's block hashes hold the adapter: its KV
        differs; by load, not id, since an id may be loaded again with other weights). As JSON,
        so that no caller's salt can spell another's."""
        lora = None if prompt.lora_int_id is None else self.lora_loads[prompt.lora_int_id]
        parts = [prompt.cache_salt, prompt.embeds_digest, lora]
        return None if parts == [None] * 3 else json.dumps(parts)

    @staticmethod
    def _check_embeds_params(params: SamplingParams) -> None:
        """What reads a prompt's token ids cannot read an embeddings prompt's (its ids are stand-ins)."""
        for name, asks in (("prompt_logprobs", params.prompt_logprobs is not None),
                           ("repetition_penalty", params.repetition_penalty != 1.0)):
            if asks:
                raise InvalidInput(name, f"{name} needs the prompt's token ids: a prompt given as prompt_embeds has "
                                         f"none")

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)

    def abort_request(self, request_id: str) -> None:
        search = self.beam_searches.pop(request_id, None)
        children = [] if search is None else [rid for rid, (s, _) in self.beam_children.items() if s is search]
        for rid in children:
            del self.beam_children[rid]
        for rid in children or self._family(request_id):
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    def abort_all(self) -> None:
        """Abort every unfinished request (the server's loop, when the engine died)."""
        for request_id in self.scheduler.get_request_ids():
            self.abort_request(request_id)

    def reset_prefix_cache(self) -> None:
        """vLLM's: forget the prefix hashes of the free blocks (LLM.reset_prefix_cache's cold start)."""
        self.scheduler.reset_prefix_cache()

    def _caller_id(self, req: Request) -> str:
        """The id the caller knows a request by: its own, its n > 1 family's, or its beam search's."""
        child = self.beam_children.get(req.request_id)
        return child[0].request_id if child is not None else req.parent_id or req.request_id

    def _new_request_id(self, request_id: str | None, n: int = 1) -> str:
        """The caller's id, or the next number; InvalidInput where an unfinished request, an n > 1 family or a
        beam search has it, or (n > 1) a request has one of its children's ids, "id#i" ("a#0" vs a's children)."""
        request_id = str(next(self.request_counter)) if request_id is None else request_id
        children = [f"{request_id}#{i}" for i in range(n)] if n > 1 else []
        if self._family(request_id) or request_id in self.beam_searches \
                or any(self.scheduler.get_request(rid) is not None for rid in children):
            raise InvalidInput("request_id", f"request id {request_id!r} is already in use")
        return request_id

    def _check_lora_loaded(self, prompt: TokenizedPrompt) -> None:
        """The prompt's adapter is still loaded (it may have been unloaded since the request named it)."""
        if prompt.lora_int_id is not None and prompt.lora_int_id not in self.loras:
            raise InvalidInput("model", f"LoRA adapter {prompt.lora_int_id} is not loaded")

    def _family(self, request_id: str) -> list[str]:
        """The unfinished requests' ids a caller's id stands for: its own, or its n > 1 children."""
        if self.scheduler.get_request(request_id) is not None:
            return [request_id]
        return [r.request_id for r in self.scheduler.family(request_id)]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> postprocess (``step_work``, its
        model work run here; a step that raises ends its requests first: ``fail_step``)."""
        work, result = self.step_work(), None
        try:
            while True:
                fn, *args = work.send(result)
                result = fn(*args)
        except StopIteration as done:
            return done.value
        except BaseException:  # Ctrl-C too: no step may stay half-launched
            self.fail_step()
            raise

    def step_work(self) -> Generator[tuple[Callable, ...], Any, list[RequestOutput]]:
        """One step (vLLM's EngineCore.step; with async scheduling, step_with_batch_queue), as a
        generator that yields its model work, (function, *args), and is sent each result:
        step() runs it in place, the server's loop on its model thread.

        Synchronously, each call is one step, start to end:

            schedule_step()      the scheduler picks the requests and their chunks; their inputs
            runner.execute       (yielded) the model runs them and samples: the results on the host
            _land()              postprocess: tokens, text, stops, outputs

        With async_scheduling a call launches its step (runner.execute_model: the results stay on
        the device) and only then lands the step the call before launched: the host schedules step
        N+1 while the device runs step N. A step in flight whose may_run_ahead is False lands at the
        start of the next call instead, before it schedules. Between calls at most one step is in
        flight (none without async_scheduling)."""
        outputs, self.step_served, self.step_faulted = [], False, False
        if self.in_flight and not self.in_flight[0].may_run_ahead:
            outputs += yield from self._land()
        step = self.schedule_step()
        if step is not None and self.runner.lora is not None:
            step = yield from self._reload_loras(*step)
        if step is not None:
            flight, inputs = step
            for s in flight.sched.scheduled:  # the token each will sample is on the device until the step lands
                if s.will_sample:
                    s.request.num_output_placeholders += 1
            launch = self.runner.execute_model if self.config.async_scheduling else self.runner.execute
            flight.output = yield launch, inputs
        keep = 1 if step is not None and self.config.async_scheduling else 0  # this call's step, left running
        while len(self.in_flight) > keep:
            outputs += yield from self._land()
        return outputs

    def _reload_loras(self, flight: StepInFlight, inputs: list[SeqInput]
                      ) -> Generator[tuple[Callable, ...], Any, tuple[StepInFlight, list[SeqInput]] | None]:
        """The step's adapters that max_cpu_loras dropped from host memory, read again from their paths on
        the model thread. A request whose adapter cannot be (its file gone since) is ended with why
        (failed_requests) and taken out of the step before it runs: the step, or None if none is left."""
        ids = {s.lora_int_id for s in inputs} - {None}
        if all(self.runner.lora.resident(i) for i in ids):
            # reload_loras' keep all the same: a runtime load_lora_adapter may run on the model thread before
            # this step's launch, and must not drop a host copy the step's slots are filled from
            self.runner.lora_keep = sorted(ids)
            return flight, inputs
        failed = yield self.runner.reload_loras, {i: self.loras[i].lora_path for i in ids}, self.config.max_lora_rank
        ended = {}
        for s, seq in zip(flight.sched.scheduled, inputs):
            if seq.lora_int_id in failed:
                ended[self._caller_id(s.request)] = f"the LoRA adapter {self.loras[seq.lora_int_id].lora_name!r} " \
                                                    f"could not be loaded again: {failed[seq.lora_int_id]}"
        for request_id, why in ended.items():
            self._fail_request(request_id, why)
        return self._without_finished(flight, inputs)

    def _without_finished(self, flight: StepInFlight, inputs: list[SeqInput]
                          ) -> tuple[StepInFlight, list[SeqInput]] | None:
        """A step not launched yet without the requests ended since it was scheduled, and those that
        would have read the blocks they were to fill (Scheduler.drop_unwritten): None, and out of
        in_flight, if none is left."""
        if not any(s.request.status.is_finished for s in flight.sched.scheduled):
            return flight, inputs
        keep = self.scheduler.drop_unwritten(flight.sched)
        if not keep:
            self.in_flight.remove(flight)
            return None
        return flight, [inputs[i] for i in keep]

    def _fail_request(self, request_id: str, why: str, detail: str | None = None,
                      error: BaseException | None = None) -> None:
        """End a request (the id its caller knows) for what went wrong with it alone, and keep why
        in failed_requests for the caller (``detail``, if given, and ``error``'s traceback are for the
        log only, as a failed step's): the rest of the step and the engine carry on."""
        logger.error("[engine] %s: %s", request_id, detail or why, exc_info=error)
        self.abort_request(request_id)
        self.failed_requests[request_id] = why

    def _land(self) -> Generator[tuple[Callable, ...], Any, list[RequestOutput]]:
        """The oldest step in flight: its results to the host, then into its requests
        (also those aborted, finished or preempted since it was launched). vLLM's
        Scheduler.update_from_output and OutputProcessor in one (postprocess)."""
        flight = self.in_flight[0]
        out = flight.output
        if isinstance(out, AsyncModelRunnerOutput):
            out = yield (out.get,)
        for s in flight.sched.scheduled:  # their sampled tokens are on the host now
            if s.will_sample:
                s.request.num_output_placeholders -= 1
        faults = self.faults
        outputs = self.postprocess(flight.sched, out.sampled, out.prompt_logprobs, out.pooled)
        self.in_flight.pop(0)  # only now: if postprocess raised, fail_step ends its requests
        # served: an output, or a request it left running (those it finished have an output; those ended
        # before it landed were served by none: under async scheduling, the step after one that failed)
        if outputs or not all(s.request.status.is_finished for s in flight.sched.scheduled):
            self.step_served = True
        elif self.faults > faults:
            self.step_faulted = True
        return outputs

    def schedule_step(self) -> tuple[StepInFlight, list[SeqInput]] | None:
        """The next step, in flight from here on, and its model inputs; None when
        nothing can run."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        # In flight before its inputs are built: its requests moved on in the scheduler,
        # so if anything below or in the launch raises, fail_step must end them.
        before = self.in_flight[-1].sched if self.in_flight else None  # async: its tokens are inputs here
        flight = StepInFlight(sched, False)
        self.in_flight.append(flight)
        step = self._without_finished(flight, self.build_inputs(sched, before))  # less any whose inputs raised
        if step is None:  # every request's inputs raised
            self.step_faulted = True
            return None
        inputs = step[1]
        # The next step may be scheduled before this one lands unless a request that samples here
        # needs its output on the host for its next token, or prompt logprobs (the next chunk's) come back.
        # Custom logits processors read each request's output token ids, all of them, at every step.
        flight.may_run_ahead = self.config.async_scheduling and not any(i.prompt_logprob_ids for i in inputs) \
            and not self.logits_processor_classes \
            and all(s.request.can_run_ahead for s in sched.scheduled if s.will_sample)
        return step

    def fail_step(self) -> list[str]:
        """End the requests of the steps in flight (the failed one, and under async
        scheduling the one beside it: whole n-families) and free their blocks; forget
        free blocks' prefix hashes, registered before these steps wrote KV. Returns
        the ids the callers know (parents of n > 1)."""
        if not self.in_flight:
            return []
        failed = list(dict.fromkeys(self._caller_id(s.request) for f in self.in_flight for s in f.sched.scheduled))
        self.in_flight.clear()
        for request_id in failed:
            self.abort_request(request_id)
        self.scheduler.reset_prefix_cache()
        return failed

    def build_inputs(self, sched: SchedulerOutput, in_flight: SchedulerOutput | None = None
                     ) -> list[SeqInput | None]:
        """The scheduled step as plain data for the model runner. Token lists are
        sliced (copied) here so the model can run on another thread while the
        loop thread appends to requests. ``in_flight``: the step launched before
        this one and not landed (async scheduling), whose sampled ids some inputs are.
        A request whose inputs raise ends alone (_fail_input; None in its place)."""
        seqs, prev_rows = [], None
        now = time.monotonic()
        for s in sched.scheduled:
            req, start, num_new = s.request, s.start, s.num_new_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            try:
                token_ids, prev_row = req.token_ids[start:start + num_new], None
                if not token_ids:  # async scheduling: its input is the token the step in flight samples
                    prev_rows = prev_rows or {x.request: i for i, x in enumerate(
                        x for x in in_flight.scheduled if x.will_sample)}
                    token_ids, prev_row = [0], prev_rows[req]
                if s.spec_token_ids:  # the drafts follow its last token (the slice ends there)
                    token_ids += s.spec_token_ids
                pools = req.pooling_params is not None
                embeds = None if req.prompt_embeds is None or start >= len(req.prompt_embeds) \
                    else req.prompt_embeds[start:start + num_new]  # the prompt's rows only
                seqs.append(SeqInput(
                    token_ids, start, s.block_table,
                    sample=req.sample_request() if s.will_sample and not pools else None,
                    prompt_logprob_ids=req.prompt_logprob_ids(start, num_new),
                    num_prompt_logprobs=req.sampling_params.prompt_logprobs or 0, prev_sample_row=prev_row,
                    prompt_embeds=embeds, lora_int_id=req.lora_int_id, draft_token_ids=s.spec_token_ids or None,
                    pooling=self._pooling_rows(s) if pools else None,
                    token_type_ids=None if req.token_type_ids is None else req.token_type_ids[start:start + num_new]))
            except Exception as e:  # a bug met by this request's inputs (its grammar's mask, its sampling row)
                self._fail_input(req, e)
                seqs.append(None)
        return seqs

    def _pooling_rows(self, s: ScheduledRequest) -> str | None:
        """What a pooling request's chunk hands back (SeqInput.pooling): MEAN adds up every chunk's rows,
        LAST needs the last chunk's last row only, CLS the first chunk's first row; a token-wise task
        every chunk's rows."""
        kind = self._pooling_kind
        if kind == "ALL":
            return "ALL"
        if kind == "MEAN":  # an encoder's prompt is one chunk: its mean, whatever head follows
            return "MEAN" if self.model_config.encoder_only else "SUM"
        if kind == "CLS":
            return "FIRST" if s.start == 0 else None
        return "LAST" if s.will_sample else None

    @property
    def embedding_size(self) -> int:
        """An embedding's length (vLLM's ModelConfig.embedding_size): the last Dense module's out_features, else the
        hidden size."""
        return self.model_config.hidden_size if self.projector is None else self.projector[-1].linear.out_features

    @torch.no_grad()
    def _project(self, pooled: torch.Tensor) -> torch.Tensor:
        """The ST projector on a pooled vector (or a token-wise task's rows), before Matryoshka's cut and the
        normalization, as vLLM's embedding heads apply it."""
        return pooled if self.projector is None else self.projector(pooled)

    @property
    def _pooling_kind(self) -> str:
        """The pooling this engine does: "ALL" (every row) for a token-wise task, else the pooler config's."""
        return "ALL" if self.token_wise else self.pooler_config.pooling_type

    def _fail_input(self, req: Request, error: Exception) -> None:
        """End a request whose step inputs could not be built (the step runs without it: _without_finished)."""
        self.faults += 1
        self._fail_request(self._caller_id(req), "building this request's step inputs failed; the server log "
                                                 "has the details",
                           f"building its step inputs failed: {type(error).__name__}: {first_line(error)}", error)

    def postprocess(self, sched: SchedulerOutput, results: list[SampleResult],
                    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None,
                    pooled: dict[int, torch.Tensor] | None = None) -> list[RequestOutput | PoolingRequestOutput]:
        """A step's results into the requests: sampled tokens (``results``, one per
        sequence that samples), prompt logprobs and pooled hidden states (by the sequence's
        index). A request whose results raise here ends alone (_fail_output), not the step."""
        outputs: dict[str, RequestOutput] = {}
        sampled = iter(results)
        now = time.monotonic()
        num_generated = 0
        # This loop and what it calls run once per request per step: counters are added up once a step.
        for i, s in enumerate(sched.scheduled):
            if s.request.pooling_params is not None:
                self._take_pooled(outputs, s, (pooled or {}).get(i), now)
                continue
            result = next(sampled) if s.will_sample else None
            try:
                if prompt_logprobs and i in prompt_logprobs:
                    self._append_prompt_logprobs(s.request, s.start, prompt_logprobs[i])
                req = s.request
                # no sample, or aborted while the step ran (or, async, finished by the step before)
                if result is None or req.status.is_finished:
                    continue
                if result.error is not None:  # a custom logits processor raised for it: it alone ends
                    self._fail_request(self._caller_id(req), f"the logits processor {result.error.processor} "
                                                             f"failed for this request; the server log has the "
                                                             f"details", detail=str(result.error))
                    continue
                if s.spec_token_ids:
                    self._count_accepted(req, len(s.spec_token_ids), len(result.following))
                status = self._take_token(req, result, now)
                num_generated += result.token_id != NO_TOKEN
                for more in result.following:  # speculative decoding: the drafts accepted, then a bonus token
                    if status is not None:
                        break  # what came after a stop is dropped
                    status = self._take_token(req, more, now)
                    num_generated += more.token_id != NO_TOKEN
                if status is not None:
                    self.scheduler.finish_request(req.request_id, status)
                    self.stats_counters["num_finished"] += 1
                elif self.proposer is not None and req.can_speculate:
                    self._propose(req, sched.num_spec_tokens_to_schedule)
                if req.status.is_finished or req.output_kind.every_step and req.stream_due():
                    self._collect(outputs, req)
            except Exception as e:  # a bug met by this request's output (its text, stops, grammar): it alone ends
                self._fail_output(outputs, s.request, e)
        self.stats_counters["generation_tokens"] += num_generated
        return list(outputs.values())

    def _take_pooled(self, outputs: dict[str, Any], s: ScheduledRequest, rows: torch.Tensor | None,
                     now: float) -> None:
        """A pooling request's chunk: MEAN's sums added up, CLS's first row kept, a token-wise task's
        rows gathered (each from its first position again after a preemption); its last chunk ends it
        with its embedding (or rows), its blocks freed (and left cached)."""
        req, kind = s.request, self._pooling_kind
        # aborted while the step ran; a LAST request's earlier chunk, a CLS request's later one (but its last)
        if req.status.is_finished or rows is None and (kind != "CLS" or not s.will_sample):
            return
        try:
            if kind == "MEAN":
                req.pooled = rows if s.start == 0 else req.pooled + rows
            elif kind == "ALL":  # vLLM's AllPool: the chunks' rows, joined at the last
                req.pooled = [] if s.start == 0 else req.pooled
                req.pooled.append(rows)
            elif kind == "CLS" and rows is not None:
                req.pooled = rows
            if not s.will_sample:
                return
            sums = kind == "MEAN" and not self.model_config.encoder_only
            data = req.pooled / req.num_prompt_tokens if sums else req.pooled if kind in ("CLS", "MEAN") \
                else torch.cat(req.pooled) if kind == "ALL" else rows
            p = req.pooling_params
            if self.model_config.num_labels is not None:  # the score head's logits (a row's, token-wise)
                data = activate(data, self.classify_activation) if p.use_activation else data
            else:
                data = finish_embedding(self._project(data), p.dimensions, p.use_activation)
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            self.stats_counters["num_finished"] += 1
            outputs[req.request_id] = PoolingRequestOutput(
                req.request_id, PoolingOutput(data), req.prompt_token_ids, req.num_cached_tokens,
                metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time, now, now))
        except Exception as e:  # a bug met by this request's output: it alone ends
            self._fail_output(outputs, req, e)

    def _take_token(self, req: Request, result: SampleResult, now: float) -> RequestStatus | None:
        """A sampled token into its request: the status it ends the request with, if any."""
        if result.token_id == NO_TOKEN:
            return self._end_without_token(req)
        token = result.token_id
        self._append_token(req, result, now)
        if req.grammar is not None:
            req.grammar.accept(token)
        if req.thinking is not None:
            req.thinking.accept(token)
        status = self._check_stop(req)  # what the token ends: a stop token, the length, a repetition
        if req.detokenizer is not None:
            status = self._detokenize(req, token, status)  # and the stop strings its text ends
        return status

    def _count_accepted(self, req: Request, num_draft: int, num_accepted: int) -> None:
        """A speculative step's drafts, into vLLM's counters; the scheduler takes the rejected ones back."""
        self.scheduler.reject_draft_tokens(req, num_draft - num_accepted)
        c = self.stats_counters
        c["spec_decode_num_drafts"] += 1
        c["spec_decode_num_draft_tokens"] += num_draft
        c["spec_decode_num_accepted_tokens"] += num_accepted
        per_pos = c["spec_decode_num_accepted_tokens_per_pos"]
        for i in range(num_accepted):  # the accepted ones are a prefix of the drafts
            per_pos[i] += 1

    def _propose(self, req: Request, num_spec_tokens: int) -> None:
        """Its drafts for the next step: up to ``num_spec_tokens`` (the step that landed allows them: its
        batch size's, with a dynamic schedule), no more than the tokens it may still emit, less the one
        that step samples itself (so no draft's position passes max_model_len either)."""
        k = min(num_spec_tokens, req.max_num_tokens - req.num_tokens - 1)
        req.spec_token_ids = self.proposer.propose(req.token_ids, k)

    def _detokenize(self, req: Request, token: int, status: RequestStatus | None) -> RequestStatus | None:
        """Detokenize incrementally: the new token's text (as vLLM's, a stop token's is left out unless
        asked for), then the stop strings the new text ends (one ends the request even at its length or
        a repetition: ``status``, what the token itself ended). At the end, the rest of a UTF-8 character
        the detokenizer held back comes. Returns the request's status after its text."""
        p, held = req.sampling_params, req.held_text
        by_token = status is RequestStatus.FINISHED_STOPPED  # a stop token, or a grammar's end
        if not by_token or p.include_stop_str_in_output:
            req.held_text = held + req.detokenizer.step(token)
        if not by_token and p.stop and len(req.output_token_ids) >= p.min_tokens \
                and self._check_stop_strings(req, len(held)):
            return RequestStatus.FINISHED_STOPPED
        if status is not None:
            req.held_text += req.detokenizer.flush()
        elif len(req.held_text) > 256:  # each token copies it: outputs release it (FINAL_ONLY's only at the end)
            _release_text(req)
        return status

    def _fail_output(self, outputs: dict[str, RequestOutput], req: Request, error: Exception) -> None:
        """End a request whose step output could not be taken in (nothing of this step goes out for it)."""
        request_id = self._caller_id(req)
        outputs.pop(request_id, None)
        self.faults += 1
        self._fail_request(request_id, "taking in this request's output failed; the server log has the details",
                           f"taking in its output failed: {type(error).__name__}: {first_line(error)}", error)

    def _append_prompt_logprobs(self, req: Request, start: int, rows: list[TokenLogprobs]) -> None:
        """Positions start + 1 ... of the prompt (a recomputed chunk replaces what
        it covers): the prompt token first, then the top ones, each with its rank
        (as vLLM: the prompt token's is how many are at least as likely; the top
        ones are ranked 1, 2, ... in order)."""
        del req.prompt_logprobs[start + 1:]
        ids = [[r.token_id, *(t for t, _ in r.top)] for r in rows]
        texts = iter(self._decode_each([t for row in ids for t in row], req.sampling_params.detokenize))
        for r, row in zip(rows, ids):
            req.prompt_logprobs.append(logprob_entry(r.token_id, r.logprob, r.rank, r.top, [next(texts) for _ in row]))

    def _decode_each(self, token_ids: list[int], detokenize: bool = True) -> list[str | None]:
        """Each token's own text (None without a tokenizer or detokenize); one batch_decode
        of those this engine has not decoded before."""
        if self.tokenizer is None or not detokenize or not token_ids:
            return [None] * len(token_ids)
        texts = self.token_texts  # a token's text alone depends on its id only
        if missing := [t for t in dict.fromkeys(token_ids) if t not in texts]:
            texts.update(zip(missing, self.tokenizer.batch_decode([[t] for t in missing])))
        return [texts[t] for t in token_ids]

    def _append_token(self, req: Request, result: SampleResult, now: float) -> None:
        token = result.token_id
        req.token_ids.append(token)
        req.output_token_ids.append(token)
        if req.logprobs is not None:
            top = result.top_logprobs or []
            texts = self._decode_each([token, *(t for t, _ in top)], req.sampling_params.detokenize)
            req.logprobs.append(logprob_entry(token, result.logprob, result.rank, top, texts))
            req.cumulative_logprob += result.logprob
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now

    def _check_stop(self, req: Request) -> RequestStatus | None:
        """The finished status the new token itself puts the request in, if any (postprocess then
        detokenizes it: a stop string its text ends may still end the request)."""
        p, out = req.sampling_params, req.output_token_ids
        token, num_out = out[-1], len(out)
        done = num_out >= p.min_tokens
        if done and not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if done and token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_terminated():
            # The constraint is complete: it ends on an EOS it accepted (ignore_eos or min_tokens kept the branch
            # above from seeing it), whose text stays out as an EOS's does.
            return RequestStatus.FINISHED_STOPPED
        if num_out >= req.max_tokens or len(req.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if done and p.repetition_detection is not None and p.repetition_detection.found(out):
            req.stop_reason = "repetition_detected"  # vLLM's
            return RequestStatus.FINISHED_REPETITION
        return None

    def _end_without_token(self, req: Request) -> RequestStatus:
        """The sampler found no token this request may sample (its bans, bias, allowed_token_ids and
        grammar left none): it stops where it is, as vLLM ends a finished grammar that min_tokens holds
        open, rather than emit a token nothing allowed. stop_reason None: no stop string or token did it."""
        done = req.grammar is not None and req.grammar.matcher.is_completed()  # the grammar's end: expected
        (logger.debug if done else logger.warning)(
            "[engine] %s: no token is left to sample after %d output tokens (%s); it stops there",
            req.request_id, len(req.output_token_ids), "its structured output is complete" if done else
            "allowed_token_ids, bad_words, logit_bias, min_tokens and its structured output leave none")
        if req.detokenizer is not None:  # what it held back waiting for the rest of a UTF-8 character
            req.held_text += req.detokenizer.flush()
        return RequestStatus.FINISHED_STOPPED

    def _check_stop_strings(self, req: Request, prev_len: int) -> bool:
        """Find the earliest stop string that ends in the new text; truncate there.
        Each is searched only where it could end in the new text, so one that
        completed before min_tokens was reached is not found again later; and only
        in held_text: the text released before it cannot start one."""
        p = req.sampling_params
        best = None
        for stop in p.stop:
            i = req.held_text.find(stop, max(0, prev_len - len(stop) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        req.held_text = req.held_text[: i + len(stop) if p.include_stop_str_in_output else i]
        req.stop_reason = stop
        return True

    def _collect(self, outputs: dict[str, RequestOutput], req: Request) -> None:
        if self.beam_children and (child := self.beam_children.get(req.request_id)):
            self._beam_landed(outputs, *child, req)
            del self.beam_children[req.request_id]  # only now: if the search raised, _fail_output names it
            return
        key = req.parent_id or req.request_id
        completion = self.completion_output(req)
        finished = req.status.is_finished and all(r.status.is_finished for r in self._siblings(req))
        out = outputs.get(key)
        if out is None:  # built whole, not filled in after: one per request per step under DELTA
            outputs[key] = RequestOutput(key, req.prompt, req.prompt_token_ids, [completion], finished,
                                         req.num_cached_tokens, RequestMetrics(
                                             req.arrival_time, req.first_scheduled_time,
                                             req.first_token_time, req.last_token_time), req.prompt_logprobs)
            return
        if req.prompt_logprobs is not None:  # complete once a request samples; never changed after
            out.prompt_logprobs = req.prompt_logprobs
        out.outputs.append(completion)
        out.finished = finished

    def _siblings(self, req: Request) -> list[Request]:
        if req.parent_id is None:
            return [req]
        return [req] + self.scheduler.family(req.parent_id)

    def completion_output(self, req: Request) -> CompletionOutput:
        """The request's output so far (under DELTA: what is new since its last
        one, a cost that does not grow with the output). While it runs, text that
        could still turn out to be the start of a stop string is held back."""
        _release_text(req)
        pieces = req.text_pieces
        text = "".join(pieces)
        if req.output_kind.is_delta:  # no later output needs these pieces
            pieces.clear()
            first, req.sent_token_len = req.sent_token_len, len(req.output_token_ids)
            delta, token_ids = text, req.output_token_ids[first:]
            logprobs = None if req.logprobs is None else req.logprobs[first:]
        else:
            pieces[:] = [text]  # one piece: the next output joins two
            delta, req.sent_text_len = text[req.sent_text_len:], len(text)
            token_ids = list(req.output_token_ids)
            logprobs = None if req.logprobs is None else list(req.logprobs)
        return CompletionOutput(req.index, text, token_ids, req.cumulative_logprob, logprobs,
                                req.status.finish_reason, req.stop_reason, delta)

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        s = self.scheduler.make_stats()
        counters = {k: list(v) if isinstance(v, list) else v  # a copy: callers subtract one call's from a later one's
                    for k, v in self.stats_counters.items()}
        return {"num_running": s.num_running, "num_waiting": s.num_waiting, "num_preemptions": s.num_preemptions,
                **dataclasses.asdict(s.kv_cache), **counters}

    # ---------------------------------------------------------------- tensor-parallel workers
    def check_health(self) -> None:
        """As vLLM's: raise if the engine cannot serve (a tensor-parallel worker died)."""
        if self.workers is not None and self.workers.failure is not None:
            raise EngineDeadError(self.workers.failure)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also run at exit)."""
        if self.workers is not None:
            self.workers.shutdown(getattr(self, "runner", None))


def _release_text(req: Request) -> None:
    """Move from held_text to text_pieces what no later token can turn into the start
    of a stop string (all of it once the request is finished)."""
    text, stops = req.held_text, req.sampling_params.stop
    if not stops or req.status.is_finished:  # all of it (most requests, every token: no slicing)
        if text:
            req.text_pieces.append(text)
            req.held_text = ""
        return
    end = len(text) - _stop_holdback(text, stops)
    req.text_pieces.append(text[:end])
    req.held_text = text[end:]


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of the text (shorter than the longest stop string)
    that is a prefix of a stop string. Only where a stop's first character is can one
    start: found by str.find, not by trying every length."""
    if not stops:
        return 0
    held, limit = 0, max(map(len, stops)) - 1
    for stop in stops:
        i = text.find(stop[0], max(len(text) - min(len(stop), limit), 0))
        while i != -1 and len(text) - i > held:
            if stop.startswith(text[i:]):
                held = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return held


# generation_config.json's sampling fields, as vLLM reads them -> SamplingParams' names
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(path: Path, source: str = "auto", override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults a model's generation config sets (vLLM's
    --generation-config: "auto" = the model directory, "vllm" = none, or a
    directory; then --override-generation-config's fields over it), as SamplingParams fields."""
    cfg = {} if source == "vllm" else _read_generation_config(path, source)
    cfg.update(override or {})
    return {ours: cfg[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if cfg.get(theirs) is not None}


def _read_generation_config(path: Path, source: str) -> dict[str, Any]:
    file = (path if source == "auto" else Path(source)) / "generation_config.json"
    if not file.is_file():
        if source != "auto":
            raise InvalidInput("generation_config", f"--generation-config {source!r}: no generation_config.json there")
        return {}
    try:
        cfg = json.loads(file.read_text())
    except ValueError as e:
        raise InvalidInput("generation_config", f"{file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise InvalidInput("generation_config", f"{file} holds a JSON {type(cfg).__name__}, not an object of fields")
    return cfg


def _eos_ids(path: Path, config: ModelConfig, tokenizer) -> set[int]:
    """EOS ids as transformers' generate sees them: generation_config.json's if
    present (chat models often list several), else config.json's; plus the
    tokenizer's own EOS token."""
    ids = set(config.eos_token_ids)
    eos = _read_generation_config(path, "auto").get("eos_token_id")
    if eos is not None:
        ids = set([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# =========================================================================== tensor-parallel workers

def cache_config(config: EngineConfig, decode_sizes: list[int] = ()) -> CacheConfig:
    return CacheConfig(config.block_size, config.kv_cache_memory_bytes, config.num_kv_blocks,
                       config.gpu_memory_utilization, config.max_num_batched_tokens, config.max_num_seqs,
                       ranks_per_node(config), max(decode_sizes, default=0), config.max_num_seqs,
                       config.max_model_len, config.max_logprobs)


def local_ranks(config: EngineConfig) -> list[int]:
    """The ranks that run on this node: a contiguous share of tensor_parallel_size,
    or under torchrun (env://) this process's own rank (torchrun starts the others)."""
    if config.tensor_parallel_size > 1 and config.distributed_init_method == "env://":
        return [int(os.environ["RANK"])]
    per_node = ranks_per_node(config)
    return list(range(config.node_rank * per_node, (config.node_rank + 1) * per_node))


def ranks_per_node(config: EngineConfig) -> int:
    if config.tensor_parallel_size > 1 and config.distributed_init_method == "env://":
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return config.tensor_parallel_size // max(1, config.nnodes)


def check_parallel_config(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> None:
    """Every bad tensor-parallel setting is one ValueError at start-up, naming the numbers."""
    tp, nnodes = config.tensor_parallel_size, config.nnodes
    check_tensor_parallel(model_config, tp)
    if nnodes < 1 or tp % nnodes:
        raise ValueError(f"nnodes={nnodes} must be >= 1 and divide tensor_parallel_size={tp}")
    if not 0 <= config.node_rank < nnodes:
        raise ValueError(f"node_rank={config.node_rank} must be in [0, nnodes={nnodes})")
    if nnodes > 1 and config.distributed_init_method is None:
        raise ValueError(f"nnodes={nnodes}: every node needs distributed_init_method=tcp://HOST:PORT "
                         f"(node 0's address), or env:// under torchrun")
    if config.distributed_init_method not in (None, "env://"):
        tcp_address(config.distributed_init_method)  # raises for anything but tcp://HOST:PORT
    if device.type == "cuda" and device.index and tp > 1:  # a rank runs on cuda:<its local rank>
        raise ValueError(f"device={device} with tensor_parallel_size={tp}: the ranks of a node take cuda:0, cuda:1, "
                         f"...; choose the GPUs with CUDA_VISIBLE_DEVICES")
    if config.distributed_init_method == "env://" and int(os.environ.get("WORLD_SIZE", "-1")) != tp:
        raise ValueError(f"env:// (torchrun) needs WORLD_SIZE={tp} (tensor_parallel_size) and RANK set, "
                         f"got WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}")
    here = ranks_per_node(config)
    devices = torch.cuda.device_count() if device.type == "cuda" else (os.cpu_count() or 1)
    if here > devices:
        kind = "GPUs" if device.type == "cuda" else "CPU cores"
        raise ValueError(f"tensor_parallel_size={tp} over nnodes={nnodes} puts {here} ranks on this node, "
                         f"but it has {devices} {kind}: one rank per device at most")


def worker_specs(config: EngineConfig, init_method: str, device: torch.device, dtype: torch.dtype
                 ) -> list[WorkerSpec]:
    """One spec per rank on this node (rank 0's too, for its thread count)."""
    ranks = local_ranks(config)
    threads = max(1, (os.cpu_count() or 1) // ranks_per_node(config)) if device.type == "cpu" else None
    torchrun = config.distributed_init_method == "env://"
    level = logging.getLogger("nanoserve").getEffectiveLevel()
    path = str(resolve_model_dir(config.model, config.revision, config.download_dir))  # a hub id: its cached dir
    return [WorkerSpec(path, r, config.tensor_parallel_size,
                       int(os.environ.get("LOCAL_RANK", "0")) if torchrun else r - ranks[0],
                       init_method, device.type, dtype, cache_config(config), config.enforce_eager,
                       config.seed, threads, config.cpu_allocator_tuning, level,
                       model_overrides(config, Path(path)), config.lora_config, config.wna16_weights)
            for r in ranks]


def _while_workers_live(procs: list, fn: Callable[[], Any]) -> Any:
    """fn() (the rendezvous, which waits for every rank as long as IDLE_TIMEOUT) on a thread, raising
    as soon as one of this node's workers exits first: it will never join."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e
    thread = threading.Thread(target=target, name="nanoserve-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        dead = [p for p in procs if p.exitcode is not None]
        if dead and thread.is_alive():
            raise RuntimeError("tensor-parallel worker " + ", ".join(
                f"{p.name} (pid {p.pid}) exited with code {p.exitcode}" for p in dead) + " while starting (its "
                "traceback is above; an offline script that builds LLM(...) needs the if __name__ == '__main__': "
                "guard, as the workers are spawned)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TPWorkers:
    """Rank 0's side of tensor parallelism: the workers of this node (ranks
    1..N-1, spawned with torch.multiprocessing), the group it shares with
    them, and a watchdog thread that notices a worker dying and says which. A
    step in flight fails by itself then (the dead rank's connections close; a
    hung one's collectives time out): the engine loop fails its requests."""

    def __init__(self, tp: TPGroup, procs: list, threads_before: int):
        self.tp, self.procs, self.threads_before = tp, procs, threads_before
        self.failure: str | None = None
        self.stopping = False
        if procs:
            import threading
            threading.Thread(target=self._watch, name="nanoserve-tp-watchdog", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, model_config: ModelConfig, device: torch.device,
              dtype: torch.dtype) -> "TPWorkers":
        check_parallel_config(config, model_config, device)
        init_method = config.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        specs = worker_specs(config, init_method, device, dtype)
        ctx = torch.multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=run_worker, args=(spec,), name=f"nanoserve-tp-rank{spec.rank}", daemon=True)
                 for spec in specs if spec.rank != 0]
        for p in procs:
            p.start()
        threads_before = torch.get_num_threads()
        try:
            if specs[0].num_threads:  # one rank per core: else they take turns on every core
                torch.set_num_threads(specs[0].num_threads)
            tp = _while_workers_live(procs, lambda: init_distributed(0, config.tensor_parallel_size, init_method,
                                                                     device))
        except BaseException:
            _stop(procs)
            torch.set_num_threads(threads_before)
            raise
        logger.info("[engine] tensor parallel: world size %d over %d node(s), %s; rendezvous %s; this node "
                    "started ranks %s (pids %s)", tp.world_size, config.nnodes, torch.distributed.get_backend(),
                    init_method, [s.rank for s in specs[1:]], [p.pid for p in procs])
        return cls(tp, procs, threads_before)

    def _watch(self) -> None:
        from multiprocessing.connection import wait
        ready = wait([p.sentinel for p in self.procs])
        if self.stopping:
            return
        # a sentinel fires as the process closes its files, a moment before it can be reaped: join
        # those, so that their exit codes are known and named
        for p in self.procs:
            if p.sentinel in ready:
                p.join(5)
        dead = [p for p in self.procs if p.exitcode is not None]
        self.failure = "tensor-parallel worker " + ", ".join(
            f"{p.name} (pid {p.pid}) exited with code {p.exitcode}" for p in dead)
        logger.error("[engine] %s: the engine cannot serve any more", self.failure)

    def shutdown(self, runner: ModelRunner | None) -> None:
        if self.stopping:
            return
        self.stopping = True
        if runner is not None and self.failure is None:
            # Tell the workers to leave their loop; a thread, so that a broken
            # group cannot hold the shutdown up for more than a few seconds.
            import threading
            t = threading.Thread(target=_tell_workers_to_stop, args=(runner,), daemon=True)
            t.start()
            t.join(5)
            for p in self.procs:
                p.join(5)
        _stop(self.procs)
        torch.distributed.destroy_process_group()
        torch.set_num_threads(self.threads_before)
        logger.info("[engine] tensor-parallel workers stopped")


def _tell_workers_to_stop(runner: ModelRunner) -> None:
    try:
        runner.shutdown_workers()
    except RuntimeError as e:  # they are gone already (torchrun stops every rank at once): nothing to tell
        logger.debug("[engine] the workers did not get the shutdown message: %s", first_line(e))


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(3)
        if p.is_alive():
            p.kill()
            p.join()


def run_worker_node(config: EngineConfig) -> int:
    """A node that does not host rank 0 (``--node-rank`` > 0, or a torchrun rank
    > 0): run this node's ranks, the first in this process, until rank 0 shuts
    them down. Returns the exit status."""
    path = resolve_model_dir(config.model, config.revision, config.download_dir)
    model_config = ModelConfig.from_dir(path, classify_overrides(config, path))
    device = resolve_device(config.device)
    check_parallel_config(config, model_config, device)
    if config.distributed_init_method is None:
        raise ValueError("a worker node needs distributed_init_method=tcp://HOST:PORT (node 0's address)")
    dtype = resolve_dtype(config.dtype, device, model_config)
    specs = worker_specs(config, config.distributed_init_method, device, dtype)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run_worker, args=(spec,), daemon=True) for spec in specs[1:]]
    for p in procs:
        p.start()
    logger.info("[engine] worker node %d: ranks %s", config.node_rank, [s.rank for s in specs])
    try:
        run_worker(specs[0])
    except Exception as e:  # noqa: BLE001 - rank 0 went away, or start-up failed: say so and exit non-zero
        logger.error("[engine] rank %d stopped: %s", specs[0].rank, first_line(e))
        _stop(procs)
        return 1
    for p in procs:
        p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


# =========================================================================== offline API

VLLM_LLM_METHODS_MISSING = {
    "reward": "the pooling runner embeds and classifies (embed, classify, encode, score); no reward head is built",
    "sleep": "there is no sleep mode (the weights and KV cache stay on the device)", "wake_up": "there is no sleep mode",
    "start_profile": "run torch.profiler around generate() instead", "stop_profile": "run torch.profiler instead",
    "llm_engine": "the engine is LLM.engine (nanoserve's LLMEngine, not vLLM's)",
    "get_metrics": "LLM.stats() gives the engine's counters", "collective_rpc": "there are no worker processes to call",
    "apply_model": "the model is LLM.engine.runner.model, in this process",
}


class LLM:
    """The offline API, as vLLM's ``LLM``: build once, ``generate`` many."""

    def __init__(self, model: str, **kwargs: Any):
        """``kwargs``: EngineConfig's fields, and vLLM's engine arguments as ``engine_config_from_kwargs``
        takes them (vLLM's ``LLM`` passes its keywords to EngineArgs)."""
        self.engine = LLMEngine(engine_config_from_kwargs(model, kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """``priority``: each prompt's, as vLLM's (lower first), under scheduling_policy="priority";
        ``lora_request``: the LoRA adapter of every prompt, or of each (needs enable_lora)."""
        self.engine.check_runner("generate")
        prompts = _as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompts), "lora_requests")
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        if priority is not None and not isinstance(priority, (list, tuple)):  # vLLM's: one per prompt
            raise InvalidInput("priority", f"priority must be a list of integers, one per prompt, got "
                                           f"{type(priority).__name__}")
        priority = _per_prompt(0 if priority is None else list(priority), len(prompts), "priorities")
        for p in priority:
            self.engine.check_priority(p)
        params = [self.get_default_sampling_params() if p is None else p for p in params]
        if (wrong := next((p for p in params if not isinstance(p, SamplingParams)), None)) is not None:  # {} too
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(wrong).__name__}")
        engine = self.engine
        inputs = [engine.with_lora(engine.process_prompt(prompt, p.truncate_prompt_tokens),
                                   lora) for prompt, p, lora in zip(prompts, params, loras)]  # all before any
        checked = [engine.validate_params(p) for p in params]  # (grammar, bad_words) each
        for prompt, p in zip(inputs, params):  # what _add_validated would refuse, before any is queued
            if prompt.prompt_embeds is not None:
                engine._check_embeds_params(p)
        ids = []
        try:
            for prompt, p, c, rank in zip(inputs, params, checked, priority):
                ids.append(engine._add_validated(prompt, p, *c, None, RequestOutputKind.FINAL_ONLY, rank))
        except BaseException:  # none of the batch is left queued
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request: LoRARequest | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's beam_width best sequences (BeamSearch), at most
        ``concurrency_limit`` prompts searched at a time."""
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise InvalidInput("concurrency_limit", f"concurrency_limit must be None or >= 1, got "
                                                    f"{concurrency_limit!r}")
        if not isinstance(params, BeamSearchParams):  # as generate's sampling_params
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        engine = self.engine
        engine.check_runner("generate")
        inputs = [engine.with_lora(engine.process_prompt(p), lora_request)
                  for p in _as_prompt_list(prompts)]
        batch, results = concurrency_limit or max(len(inputs), 1), []
        for start in range(0, len(inputs), batch):
            ids = []
            try:
                for p in inputs[start:start + batch]:
                    ids.append(engine.add_beam_search(p, params, None))
            except BaseException:  # a prompt refused: none of the batch is left running
                for request_id in ids:
                    engine.abort_request(request_id)
                raise
            results += self._run(ids, use_tqdm)
        return [BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.logprobs,
                                                     c.cumulative_logprob, c.text, c.finish_reason, c.stop_reason)
                                  for c in out.outputs]) for out in results]

    def embed(self, prompts, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | list[PoolingParams] | None = None,
              lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: an embedding vector per prompt (``outputs.embedding``), with the pooling runner."""
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")]

    def classify(self, prompts, *, pooling_params: PoolingParams | list[PoolingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's: a classifier's probabilities per prompt (``outputs.probs``), with the pooling runner."""
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="classify")]

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
               use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's: the pooler's output per prompt (``outputs.data``, a tensor); pooling_task the model's
        served task: "embed" or "classify" (a vector each), or with PoolerConfig(task=...) "token_embed" or
        "token_classify" (a row per prompt token)."""
        engine = self.engine
        engine.check_runner("pooling")
        if pooling_task is not None and pooling_task not in POOLING_TASKS + ("plugin", *REMOVED_POOLING_TASKS):
            raise InvalidInput("pooling_task", f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got "
                                               f"{pooling_task!r}")
        engine.check_pooling_task(pooling_task)
        prompts = _as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompts), "lora_requests")
        params = [engine.check_pooling_params(PoolingParams() if p is None else p)
                  for p in _per_prompt(pooling_params, len(prompts), "pooling_params")]
        inputs = [engine.with_lora(engine.process_pooling_prompt(prompt, p), lora)
                  for prompt, p, lora in zip(prompts, params, loras)]  # all checked before any is queued
        ids = [engine._add_pooling_validated(prompt, p, None) for prompt, p in zip(inputs, params)]
        return self._run(ids, use_tqdm)

    def score(self, data_1, data_2, /, *, use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | list[LoRARequest | None] | None = None,
              tokenization_kwargs: dict[str, Any] | None = None,
              chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """vLLM's, for an embedding model (its bi-encoder): each text of ``data_1`` and ``data_2`` embedded
        once, then each pair (1:1, 1:N or N:N) scored by the cosine similarity of its embeddings (token_embed's,
        a ColBERT model's: by late interaction, MaxSim over the two texts' rows); for a
        classifier with one label (a cross-encoder), each pair read as one prompt, scored by the label's
        activated logit, rendered by ``chat_template`` where given (vLLM's score template: the pair as a "query"
        and a "document" message; a bi-encoder ignores it)."""
        engine = self.engine
        if engine.runner_type != "pooling":  # vLLM's words
            raise InvalidInput("model", "LLM.score() is only supported for pooling models. Try passing "
                                        "`--runner pooling` to use the model as a pooling model.")
        if engine.pooling_task == "classify" and not engine.is_cross_encoder:
            raise InvalidInput("model", f"Score API is only enabled for num_labels == 1 (this classifier has "
                                        f"{engine.model_config.num_labels})")
        if engine.pooling_task == "token_classify":  # vLLM's words (token_embed scores by late interaction)
            raise InvalidInput("model", "This model does not support the Scoring API.")
        if tokenization_kwargs:
            raise InvalidInput("tokenization_kwargs", "tokenization_kwargs is not supported: truncate with "
                                                      "PoolingParams(truncate_prompt_tokens=N)")
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        queries, docs = score_inputs(data_1, data_2, self.engine.model_config.checkpoint_architecture)
        if engine.is_cross_encoder:  # chat_template: vLLM's score template (its Qwen3-Reranker example's)
            keep = getattr(pooling_params, "truncate_prompt_tokens", None)
            keep = engine.max_model_len if keep == -1 else keep
            pairs = [engine.cross_encoder_prompt(q, d, score_template=chat_template, max_length=keep or None)
                     for q, d in paired(queries, docs)]
            return cross_encoder_scores(self.encode(pairs, pooling_params, use_tqdm=use_tqdm,
                                                    lora_request=lora_request, pooling_task="classify"))
        outs = self.encode(queries + docs, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task=engine.pooling_task)  # embed, or token_embed's rows for MaxSim
        return score_pairs(outs, len(queries), getattr(self.engine.tokenizer, "pad_token_id", None),
                           late_interaction=engine.pooling_task == "token_embed")

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation-config defaults applied."""
        return SamplingParams(**self.engine.default_sampling)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool | None = None,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, lora_request: LoRARequest | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Render the chat template (one conversation or a list) and generate, as
        vLLM's ``LLM.chat``; ``add_generation_prompt`` defaults to ``not continue_final_message``."""
        conversations = _conversations(messages)
        prompts = [apply_chat_template(self.engine.tokenizer, c, chat_template, add_generation_prompt,
                                       continue_final_message, tools, chat_template_kwargs,
                                       content_format=chat_template_content_format) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def reset_prefix_cache(self, device: Any = None) -> bool:
        """vLLM's: forget every cached prefix (a benchmark's cold start); False while a request holds blocks."""
        if self.engine.has_unfinished_requests():
            return False
        self.engine.reset_prefix_cache()
        return True

    def __getattr__(self, name: str) -> Any:
        """vLLM's LLM methods nanoserve has not: an AttributeError that says so and why, not only the name."""
        why = VLLM_LLM_METHODS_MISSING.get(name)
        if why is None:
            raise AttributeError(f"'LLM' object has no attribute {name!r}")
        raise AttributeError(f"LLM.{name} is vLLM's, and nanoserve does not have it: {why}")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (at exit this happens by itself)."""
        self.engine.shutdown()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        start, prompt_toks, gen_toks = time.perf_counter(), 0, 0
        children: dict[str, dict[int, CompletionOutput]] = {}
        try:
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                if failed := [self.engine.failed_requests.pop(i) for i in ids if i in self.engine.failed_requests]:
                    raise RequestFailedError(failed[0])
                for out in outputs:
                    if isinstance(out, PoolingRequestOutput):  # one output, at its end
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                        continue
                    merged = children.setdefault(out.request_id, {})
                    for c in out.outputs:
                        merged[c.index] = c
                    if out.finished:
                        out.outputs = [merged[i] for i in sorted(merged)]
                        final[out.request_id] = out
                        if bar is not None:
                            prompt_toks += len(out.prompt_token_ids)
                            gen_toks += sum(len(c.token_ids) for c in out.outputs)
                            dt = time.perf_counter() - start
                            bar.set_postfix_str(f"prompt {prompt_toks / dt:.0f} tok/s, "
                                                f"gen {gen_toks / dt:.0f} tok/s")
                            bar.update(1)
        except BaseException:
            self.engine.fail_step()  # a step still in flight (async scheduling) with them
            for rid in ids:  # leave no request half-run behind (e.g. Ctrl-C)
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]


def _conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """LLM.chat's messages: one conversation (a list of message dicts) or a non-empty list of them."""
    conversations = [messages] if isinstance(messages, (list, tuple)) and messages \
        and isinstance(messages[0], dict) else messages
    if not isinstance(conversations, (list, tuple)) or not conversations or not all(
            isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c) for c in conversations):
        raise InvalidInput("messages", "messages must be a conversation (a non-empty list of message dicts) or a "
                                       "non-empty list of conversations")
    return [list(c) for c in conversations]


def _as_prompt_list(prompts) -> list:
    """A prompt or a list of them: text, token ids, or vLLM's prompt dicts
    ({"prompt": text} / {"prompt_token_ids": ids})."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if isinstance(prompts, (list, tuple)):
        prompts = [_from_prompt_dict(p) if isinstance(p, dict) else p for p in prompts]
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of either")
    return list(prompts)


def _per_prompt(value: Any, n: int, name: str) -> list:
    """One value for each of n prompts: a list of them, or one for all."""
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise ValueError(f"got {len(values)} {name} for {n} prompts")
    return values


def _from_prompt_dict(p: dict):
    keys = {k for k, v in p.items() if v is not None}  # vLLM code may pass multi_modal_data=None and the like
    if keys == {"prompt_token_ids"}:
        return list(p["prompt_token_ids"])
    if keys == {"prompt"}:
        return p["prompt"]
    if keys == {"prompt_embeds"}:  # a tensor: LLMEngine.process_prompt
        return p["prompt_embeds"]
    raise InvalidInput("prompt", f"a prompt dict must be {{'prompt': text}}, {{'prompt_token_ids': ids}} or "
                                 f"{{'prompt_embeds': tensor}}, got keys {sorted(keys)} (nanoserve takes no "
                                 f"multimodal data)")


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


# =========================================================================== chat templates
# Shared by LLM.chat and the server's chat endpoints.

def opens_reply(add_generation_prompt: bool | None, continue_final_message: bool) -> bool:
    """Whether the rendered prompt opens the reply's turn: ``add_generation_prompt``,
    left out (None) true unless the last message is continued."""
    return not continue_final_message if add_generation_prompt is None else add_generation_prompt


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], chat_template: str | None = None,
                        add_generation_prompt: bool | None = None, continue_final_message: bool = False,
                        tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                        documents: list[dict] | None = None, content_format: str = "auto") -> str:
    """The conversation rendered by the tokenizer's chat template (or ``chat_template``),
    as vLLM renders it: ``tools``, ``documents`` (RAG) and ``chat_template_kwargs`` (e.g.
    enable_thinking) reach the template; assistant tool calls' JSON ``arguments`` are parsed first, as
    templates write them with ``| tojson``; ``continue_final_message`` leaves the
    last message open (``add_generation_prompt`` then defaults to False). Each message's content
    reaches the template in ``content_format`` (vLLM's --chat-template-content-format): "string"
    (text parts joined by newlines), "openai" (a list of {"type": "text", "text": ...} parts) or
    "auto", the one the template reads (chat_template_content_format)."""
    if tokenizer is None:
        raise InvalidInput("messages", "chat needs a tokenizer, but this engine runs without one")
    if chat_template is not None and not isinstance(chat_template, str):
        raise InvalidInput("chat_template", f"chat_template must be a Jinja template's text, got "
                                            f"{type(chat_template).__name__}")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidInput("chat_template", "this model's tokenizer has no chat template; pass chat_template=... "
                                            "or use generate() with a plain prompt")
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if value is not None and not isinstance(value, bool):
            raise InvalidInput(name, f"{name} must be True or False, got {value!r}")
    add_generation_prompt = opens_reply(add_generation_prompt, continue_final_message)
    if add_generation_prompt and continue_final_message:  # vLLM's words (its check_generation_prompt's)
        raise InvalidInput("continue_final_message", "Cannot set both `continue_final_message` and "
                                                     "`add_generation_prompt` to True.")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise InvalidInput("chat_template_kwargs", f"chat_template_kwargs must be a dict, got "
                                                   f"{type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & _template_arguments(tokenizer))
    if reserved:
        raise InvalidInput("chat_template_kwargs", f"chat_template_kwargs cannot set {', '.join(reserved)}: "
                                                   "they are the renderer's own arguments")
    import jinja2
    if content_format not in CONTENT_FORMATS:
        raise InvalidInput("chat_template_content_format", f"chat_template_content_format must be one of "
                                                          f"{', '.join(CONTENT_FORMATS)}, got {content_format!r}")
    if content_format == "auto":
        content_format = chat_template_content_format(_template_text(tokenizer, chat_template, tools))
    messages = _template_messages(messages, content_format)  # its own error names the message: not the template's
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, documents=documents,
                                             chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except InvalidInput:  # the renderer's own (a server's template worker: its limits)
        raise
    except jinja2.TemplateSyntaxError as e:
        raise InvalidInput("chat_template", f"the chat template is not valid Jinja: {e} (line {e.lineno})") from None
    except Exception as e:  # the template's own raise_exception, jinja errors, malformed messages
        raise InvalidInput("messages", f"cannot apply the chat template: {str(e) or type(e).__name__}") from None


def _template_arguments(tokenizer) -> set[str]:
    """What apply_chat_template takes itself (and ``messages``, the conversation's
    name in templates, and ``self``, which a bound method's signature leaves out):
    chat_template_kwargs must not override them."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind is not p.VAR_KEYWORD} | {"messages", "self"}


CONTENT_FORMATS = ("auto", "string", "openai")


def _template_text(tokenizer, chat_template: str | None, tools: list[dict] | None) -> str | None:
    """The Jinja source that will render: ``chat_template``, else the tokenizer's (by name where it keeps
    several, e.g. "tool_use"); None where none can be picked (rendering then names why: no template, or
    several named ones and no "default")."""
    try:
        return tokenizer.get_chat_template(chat_template, tools=tools)
    except Exception:
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=32)
def chat_template_content_format(template: str | None) -> str:
    """"openai" where the template loops over a message's content (``{% for part in message['content'] %}``:
    it reads a list of parts, as Gemma 3's and Llama 4's do), else "string": how vLLM's "auto" detects
    it, from the template's syntax tree. A message is any loop variable over ``messages`` or over a
    variable set from it (``{% set loop_messages = messages[1:] %}``). The template is parsed by the
    environment transformers renders it in, as vLLM's is: it knows transformers' own tags ({% generation %})."""
    if not isinstance(template, str):
        return "string"
    try:
        return _content_format(template)
    except Exception:  # not Jinja, or too deep for its parser: rendering will name the error
        return "string"


def _content_format(template: str) -> str:
    from jinja2 import nodes
    tree = _template_environment().parse(template)
    lists = {"messages"}
    for assign in tree.find_all(nodes.Assign):  # aliases of messages, in the order written
        if isinstance(assign.target, nodes.Name) and _reads(assign.node, lists):
            lists.add(assign.target.name)
    loops = list(tree.find_all(nodes.For))
    messages = {loop.target.name for loop in loops if isinstance(loop.target, nodes.Name) and _reads(loop.iter, lists)}
    return "openai" if any(_reads(loop.iter, messages, "content") for loop in loops) else "string"


@functools.lru_cache(maxsize=1)
def _template_environment():
    """transformers' Jinja environment, to parse a template: compiling one would fold its constants, and a
    request's own ``{{ 'x' * 10**10 }}`` would allocate 10 GB in the server (its render runs in a worker: entry.py)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template
    return _compile_jinja_template("").environment


def _reads(node, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` is one of ``names`` (or its ``key`` item, as ``m['content']`` or ``m.content``),
    seen through filters, tests and slices (``messages[1:]``, ``m.content | list``)."""
    from jinja2 import nodes
    while isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                           and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            node = node.node
        elif isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.name in names


def _template_messages(messages: list[dict[str, Any]], content_format: str = "string") -> list[dict[str, Any]]:
    """The messages as vLLM hands them to a template: assistant tool calls with their JSON-string arguments
    parsed; a content in ``content_format``: "string" (text parts joined by newlines, a null content "":
    transformers 5.17 renders None as "None") or "openai" (every content, a string too, as a list of
    {"type": "text", "text": ...} parts; a null one as [])."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and not isinstance(m.get("role"), str):  # the template renders it roleless, silently
            raise InvalidInput("messages", f"messages[{i}].role must be a string such as 'user', got "
                                           f"{m.get('role')!r}")
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_parsed_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]}
        if isinstance(m, dict) and "content" in m:
            m = {**m, "content": _template_content(m["content"], content_format, i)}
        out.append(m)
    return out


def _template_content(content: Any, content_format: str, i: int) -> Any:
    """messages[i]'s content as _template_messages hands it on (another type as it is: the template's to refuse)."""
    if content is None:
        content = []
    elif isinstance(content, str):
        if content_format == "string":
            return content
        content = [content]
    elif not isinstance(content, list):
        return content
    texts = [part_text(p) for p in content]  # OpenAI content parts: their text
    if None in texts:
        raise InvalidInput("messages", f"messages[{i}].content: only text parts ({{'type': 'text', "
                                       f"'text': ...}}) are supported")
    return "\n".join(texts) if content_format == "string" else [{"type": "text", "text": t} for t in texts]


# the content parts vLLM's chat_utils reads as text: part type -> the key that holds the text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}


def part_text(part: Any) -> str | None:
    """A content part's text where vLLM reads it as text (a plain string too); else None."""
    if isinstance(part, str):
        return part
    key = TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) and isinstance(part.get("type"), str) else None
    return part[key] if key is not None and isinstance(part.get(key), str) else None


def _parsed_call(call: Any, where: str) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    args = parse_call_arguments(fn["arguments"], "messages", f"{where}.function.arguments",
                                repr(fn["arguments"][:60]))
    return {**call, "function": {**fn, "arguments": args}}


def parse_call_arguments(text: str, param: str, where: str, shown: str) -> Any:
    """A tool call's arguments, JSON text ("" is {}), parsed; InvalidInput naming ``where`` (and the text
    as ``shown``) if they are not JSON or are nested deeper than MAX_JSON_DEPTH."""
    try:
        args = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise InvalidInput(param, f"{where} must be a JSON object in a string, got {shown} ({e})") from None
    if nested_deeper(args, MAX_JSON_DEPTH):
        raise InvalidInput(param, f"{where} must be a JSON object in a string nested at most {MAX_JSON_DEPTH} "
                                  f"levels deep")
    return args


def nested_deeper(value: Any, levels: int) -> bool:
    """Whether ``value`` has more than ``levels`` levels of arrays and objects: a level at a time, no recursion."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(levels):
        if not level:
            return False
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
    return bool(level)


# =========================================================================== async front

class EngineDeadError(RuntimeError):
    """The engine loop stopped; every request in flight gets this."""


class RequestFailedError(RuntimeError):
    """The model step this request was in raised; the engine carries on."""


DEAD_MESSAGE = "the engine stopped after repeated failures of the model step; the server log has the details"
FAILED_MESSAGE = "the model step of this request failed; the server log has the details"


def model_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one worker thread that runs a served engine's torch work. Build the
    engine on it too (``model_thread().submit(LLMEngine, config)``): on the CPU,
    stepping on another thread than the one that loaded the model is slower
    (two OpenMP pools; benchmarks/RESULTS.md)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-model")


class AsyncLLM:
    """The engine as one task on the server's one asyncio loop. Scheduling and
    postprocessing run on the loop thread, so their state needs no locks; only
    the model step runs on one worker thread (``executor``:
    the model_thread() the engine was built on). Each request's outputs go to the
    ``asyncio.Queue`` its caller gave (a server request's prompts share one). A
    step that raises ends only its own requests (``RequestFailedError``; under
    async scheduling those of the step still in flight too);
    MAX_CONSECUTIVE_STEP_FAILURES in a row end the loop (``EngineDeadError`` to
    all, ``dead`` set, ``is_running`` False). A step whose every request a bug of
    the engine's own ended one by one (LLMEngine.step_faulted) counts as failed:
    alone in its step, a request cannot tell that bug from one that fails them all."""

    def __init__(self, engine: LLMEngine, executor: concurrent.futures.ThreadPoolExecutor | None = None):
        self.engine = engine
        self.queues: dict[str, asyncio.Queue] = {}
        self.executor = executor or model_thread()
        self.wakeup: asyncio.Event | None = None
        self.dead: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.errored: BaseException | None = None

    @property
    def is_running(self) -> bool:
        if self.task is None or self.task.done() or self.errored is not None:
            return False
        try:
            self.engine.check_health()  # a tensor-parallel worker may have died
        except EngineDeadError:
            return False
        return True

    def start(self) -> None:
        self.wakeup, self.dead = asyncio.Event(), asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run_loop(), name="nanoserve-engine")

    async def shutdown(self) -> None:
        self.fail_all(EngineDeadError("the engine is shutting down"))
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.engine.fail_step()  # a step the cancelled loop left in flight: the engine may be driven again

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight now with ``error`` (e.g. a drain timeout)."""
        for request_id in list(self.queues):
            self._fail(request_id, error)

    def _fail(self, request_id: str, error: BaseException) -> None:
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)
        self.engine.abort_request(request_id)

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        failures, stepped = 0, False
        try:
            while True:
                try:
                    outputs = await self._step(loop)
                except Exception:
                    failures, failed = failures + 1, engine.fail_step()
                    logger.exception("[engine] the model step failed (%d in a row); ending its %d request(s): %s",
                                     failures, len(failed), ", ".join(failed))
                    for request_id in failed:
                        self._fail(request_id, RequestFailedError(FAILED_MESSAGE))
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise EngineDeadError(DEAD_MESSAGE) from None
                    continue
                while engine.failed_requests:  # before outputs: their queues get why, not an abort
                    request_id, why = engine.failed_requests.popitem()
                    self._fail(request_id, RequestFailedError(why))
                if engine.step_served:
                    failures = 0
                elif engine.step_faulted:  # a bug met by each of its requests counts as a failed step
                    failures += 1
                    logger.error("[engine] every request of the step failed (%d steps in a row)", failures)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise EngineDeadError(DEAD_MESSAGE)
                if outputs is None and stepped:  # going idle after steps
                    stepped = False
                    await loop.run_in_executor(self.executor, engine.release_memory)
                    continue  # a request may have come meanwhile
                if outputs is None:  # nothing can run until a request comes (or goes)
                    self.wakeup.clear()
                    await self.wakeup.wait()
                    continue
                stepped = True
                for out in outputs:  # a finished request's queue is dropped with its last output
                    queue = self.queues.pop(out.request_id, None) if out.finished else self.queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                # Yield once so handlers can drain their queues before the next step.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the engine is dead: fail every request in flight
            if isinstance(e, EngineDeadError):
                logger.error("[engine] %s", e)
            else:
                logger.exception("[engine] the engine loop died")
            self.errored = e
            self.fail_all(EngineDeadError(DEAD_MESSAGE))
            engine.abort_all()
            self.dead.set()

    async def _step(self, loop: asyncio.AbstractEventLoop) -> list[RequestOutput] | None:
        """engine.step_work() with its model work on the model thread; None when nothing ran
        (nor was scheduled: a step whose every request's inputs raised ran nothing)."""
        work, result, ran = self.engine.step_work(), None, False
        try:
            while True:
                fn, *args = work.send(result)
                result, ran = await loop.run_in_executor(self.executor, fn, *args), True
        except StopIteration as done:
            return done.value if ran or self.engine.step_faulted else None

    def add_request(self, prompt, params: SamplingParams, request_id: str, queue: asyncio.Queue,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, priority: int = 0) -> None:
        """Validate and queue a request (raises InvalidInput for bad input). Its
        outputs go to ``queue``, each naming its request; if the engine ends it
        early, an exception follows, which names none: a caller reading several
        requests from one queue ends them all."""
        if not self.is_running:
            raise EngineDeadError(DEAD_MESSAGE if self.errored else "the engine is not running")
        self.engine.add_request(prompt, params, request_id, output_kind, priority)
        self.queues[request_id] = queue
        self.wakeup.set()

    def abort(self, request_id: str, queue: asyncio.Queue) -> None:
        """Abort now, unless the request ended already (its queue is gone, or is
        a new request's under the same id): the scheduler frees the blocks at
        once. A step that is running on the worker thread may still write KV
        into them, which is harmless: nothing can allocate them before the next
        schedule() (async scheduling: whose step comes after it on the device)."""
        if self.queues.get(request_id) is queue:
            del self.queues[request_id]
            self.engine.abort_request(request_id)
            logger.debug("[engine] aborted %s", request_id)
