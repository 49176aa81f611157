"""Send one battery of OpenAI-API requests to two servers and print where their answers differ.

    python benchmarks/api_diff.py http://127.0.0.1:18431 http://127.0.0.1:18432 [--model demo] [--json out.json]

Both servers must serve the same model under the same name (``--served-model-name``), in float32, with the same
``--max-model-len`` (512 by default here: ``--max-model-len`` of this script names it for the too-long cases), so
that greedy tokens can match. The first URL is labelled nanoserve and the second vLLM (``--labels`` changes that).

Compared, per request: the status code; for errors the error JSON's shape and its ``type``/``code``/``param``
(messages are printed with ``-v``, not compared); for answers the keys and value types, recursively, and every
value except ids, timestamps and, where a request samples (temperature > 0), its text and logprobs; for streams
the sequence of chunk kinds (role, content, finish, usage ...; runs of one kind folded), the text the deltas add
up to, each kind's chunk shape, and the closing ``[DONE]``.

``--battery pooling`` sends the embeddings battery instead, to two servers run with ``--runner pooling`` (vLLM:
``--runner pooling --dtype float32``): vectors (floats, base64 or bytes, decoded by ``embed_dtype`` and
``endianness``) are compared value by value within VECTOR_TOL of the vector's scale, plus one rounding step of a
narrower ``embed_dtype``; the too-long and truncation cases assume ``--max-model-len`` and the dimensions cases a
hidden size of 128 (benchmarks/RESULTS.md has the models used).

``--battery classify`` sends the classifier battery, to two servers on a ForSequenceClassification model
(``--make-classify-models DIR`` writes a three-label one and a one-label cross-encoder; run it on each):
probabilities and scores are compared within SCORE_TOL. ``--battery reranker`` is the same battery plus
Qwen3-Reranker-formatted pairs, for a causal LM served as a classifier by ``--hf-overrides``'
``classifier_from_token`` (``--make-reranker-models DIR`` writes two, LM head untied and tied, whose vocabulary
has "no" and "yes"). ``--battery pooltasks`` is for a server of a token-wise task (``--pooler-config
'{"task": "token_embed"}'`` on the pooling models, ``token_classify`` on a classifier): /pooling's rows, compared
as vectors. ``--battery score_template`` is for a cross-encoder served with ``--chat-template FILE``, the file
``--make-score-template FILE`` writes (SCORE_TEMPLATE, of Qwen3-Reranker's template's shape). ``--battery
encoder`` is for BERT/RoBERTa/XLM-R/ModernBERT models (``--make-encoder-models DIR`` writes eight), served with no
``--max-model-len`` (each server derives its own; this script's ``--max-model-len`` names vLLM's for the
too-long cases).

Only the standard library and httpx; the servers are not started here (benchmarks/PEERS.md says how).
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

IGNORED_VALUES = {"id", "created", "created_at", "system_fingerprint", "root", "owned_by", "permission",
                  "request_id", "message", "kv_transfer_params", "response_id", "item_id", "sequence_number",
                  "call_id", "completed_at", "cached_tokens"}  # cached_tokens: the prefix cache's state, not the request's
SAMPLED_VALUES = {"text", "content", "logprobs", "top_logprobs", "token", "bytes", "logprob", "tokens",
                  "token_logprobs", "text_offset", "completion_tokens", "total_tokens", "finish_reason",
                  "stop_reason", "output_text", "reasoning_content", "delta", "arguments", "tool_calls"}
FLOAT_TOL = 2e-3
# an embedding sent as embed_dtype's bytes: each value may round one of its steps either way (relative)
DTYPE_STEP = {"float32": 0.0, "float16": 2 ** -10, "bfloat16": 2 ** -7, "fp8_e4m3": 2 ** -3, "fp8_e5m2": 2 ** -2}
VECTOR_MIN_LEN = 16   # a list of at least this many floats is a vector: one row for its worst value, not one each
VECTOR_KEYS = {"embedding", "data", "vectors"}  # where vectors are: a completion's token_logprobs is no vector
VECTOR_TOL = 1e-4     # fp32 vectors of the same model: 2.5e-6 apart at most when measured (RESULTS.md)
SCORE_TOL = 1e-5      # fp32 probabilities and scores of the same classifier (relative, at least absolute)


@dataclass
class Case:
    name: str
    path: str
    body: Any = None          # None: GET; bytes: sent raw
    method: str = "POST"
    tol: float = FLOAT_TOL    # how far two numbers may be apart (relative to the larger, at least 1)

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True

    @property
    def sampled(self) -> bool:
        """Its tokens are drawn at random (temperature above 0, or left to the default 1)."""
        if not isinstance(self.body, dict) or not self.path.startswith("/v1/"):
            return False
        return self.body.get("temperature", 1) is None or self.body.get("temperature", 1) > 0

    @property
    def step(self) -> float:
        """embed_dtype's rounding step (relative) where its vectors come as that dtype's bytes: two servers'
        fp32 values a hair apart may round to neighbouring values."""
        body = self.body if isinstance(self.body, dict) else {}
        binary = body.get("encoding_format") in ("base64", "bytes", "bytes_only")
        return DTYPE_STEP.get(body.get("embed_dtype", "float32"), 0.0) if binary else 0.0


@dataclass
class Answer:
    status: int
    body: Any = None                    # parsed JSON, or the raw text
    chunks: list[Any] = field(default_factory=list)   # a stream's events, parsed; "[DONE]" as is


def battery(model: str, max_len: int) -> list[Case]:
    long_prompt = " ".join(map(str, range(max_len)))  # over max_len tokens, none repeating: which end is kept shows
    C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
    c = {"model": model, "prompt": "import os\n", "max_tokens": 8, "temperature": 0}
    msgs = [{"role": "user", "content": "def f"}]
    ch = {"model": model, "messages": msgs, "max_tokens": 8, "temperature": 0}
    tool = {"type": "function", "function": {"name": "get", "description": "d",
                                             "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    js = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}

    def cc(name: str, **kw) -> Case:
        return Case("cmpl." + name, C, {**c, **kw})

    def chat(name: str, **kw) -> Case:
        return Case("chat." + name, CH, {**ch, **kw})

    def drop(d: dict, key: str) -> dict:
        return {k: v for k, v in d.items() if k != key}

    cases = [
        Case("models", "/v1/models", method="GET"),
        Case("models.one", f"/v1/models/{model}", method="GET"),
        Case("health", "/health", method="GET"),
        Case("version", "/version", method="GET"),
        Case("unknown_path", "/v1/nothing", {}),
        Case("cmpl.get", C, method="GET"),
        Case("cmpl.not_json", C, b"{not json"),
        Case("cmpl.body_list", C, [1, 2]),
        Case("cmpl.empty_body", C, {}),
        cc("basic"), Case("cmpl.no_model", C, drop(c, "model")), cc("wrong_model", model="nope"),
        cc("max_tokens_default", max_tokens=None), Case("cmpl.no_max_tokens", C, drop(c, "max_tokens")),
        cc("n2", n=2), cc("n0", n=0), cc("n_str", n="2"), cc("n_float", n=2.5),
        cc("best_of2", best_of=2), cc("best_of_lt_n", n=2, best_of=1),
        cc("logprobs2", logprobs=2), cc("logprobs0", logprobs=0), cc("logprobs21", logprobs=21),
        cc("logprobs_neg", logprobs=-1), cc("logprobs_true", logprobs=True),
        cc("echo", echo=True), cc("echo_logprobs", echo=True, logprobs=1),
        cc("echo_max0", echo=True, max_tokens=0), cc("max0", max_tokens=0),
        cc("stop_str", stop=["\n"]), cc("stop_one", stop="os"), cc("stop_ids", stop_token_ids=[13]),
        cc("stop_incl", stop=["\n"], include_stop_str_in_output=True), cc("stop_bad", stop=5),
        cc("suffix", suffix="x"),
        cc("stream", stream=True), cc("stream_usage", stream=True, stream_options={"include_usage": True}),
        cc("stream_cont", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
        cc("stream_opts_nostream", stream_options={"include_usage": True}),
        cc("stream_n2", stream=True, n=2), cc("stream_logprobs", stream=True, logprobs=1),
        cc("stream_echo", stream=True, echo=True), cc("stream_return_ids", stream=True, return_token_ids=True),
        cc("rf_json_object", response_format={"type": "json_object"}),
        cc("rf_json_schema", response_format=js), cc("rf_bad", response_format={"type": "yaml"}),
        cc("min_tokens", min_tokens=4), cc("ignore_eos", ignore_eos=True),
        cc("rep_pen", repetition_penalty=1.3), cc("rep_pen0", repetition_penalty=0),
        cc("top_k", temperature=0.8, top_k=5, seed=1), cc("top_k_bad", top_k=-2),
        cc("min_p", temperature=0.8, min_p=0.1, seed=1), cc("min_p_bad", min_p=2),
        cc("skip_special", skip_special_tokens=False),
        cc("guided_json", guided_json=schema), cc("guided_regex", guided_regex="[a-z]{3}"),
        cc("guided_choice", guided_choice=["yes", "no"]),
        cc("so_choice", structured_outputs={"choice": ["yes", "no"]}),
        cc("so_bad", structured_outputs={"choice": "yes"}),
        cc("logit_bias", logit_bias={"100": 100}), cc("logit_bias_badkey", logit_bias={"abc": 1}),
        cc("logit_bias_big", logit_bias={"100": 1000}), cc("logit_bias_oov", logit_bias={"999999": 1}),
        cc("seed", temperature=1.0, seed=7), cc("seed_str", seed="x"),
        cc("max_tokens_past", max_tokens=100000), cc("max_tokens_room", max_tokens=max_len - 1),
        cc("max_tokens_neg", max_tokens=-1),
        cc("max_tokens_str", max_tokens="abc"), cc("long_prompt", prompt=long_prompt),
        cc("long_prompt_trunc", prompt=long_prompt, truncate_prompt_tokens=20),
        cc("trunc_right", prompt=long_prompt, truncate_prompt_tokens=20, truncation_side="right"),
        cc("trunc_left", prompt=long_prompt, truncate_prompt_tokens=20, truncation_side="left"),
        cc("trunc_echo", prompt=long_prompt, truncate_prompt_tokens=20, echo=True),
        cc("echo_ids", echo=True, return_token_ids=True),
        cc("trunc_neg1", prompt=long_prompt, truncate_prompt_tokens=-1),
        # max_tokens 1: both keep max_model_len - 1 tokens, so the ids show which end is kept
        cc("trunc_neg1_ids", prompt=long_prompt, truncate_prompt_tokens=-1, max_tokens=1, return_token_ids=True),
        cc("trunc_zero", truncate_prompt_tokens=0), cc("trunc_big", truncate_prompt_tokens=max_len + 1),
        cc("trunc_max", prompt=long_prompt, truncate_prompt_tokens=max_len), cc("trunc_neg2", truncate_prompt_tokens=-2),
        cc("trunc_short", truncate_prompt_tokens=20), cc("trunc_side_bad", truncation_side="middle"),
        cc("trunc_stream", prompt=long_prompt, truncate_prompt_tokens=20, stream=True),
        cc("logprobs_long", max_tokens=20, logprobs=1, ignore_eos=True),
        cc("empty_prompt", prompt=""), cc("empty_list", prompt=[]), cc("empty_ids", prompt=[[]]),
        cc("ids", prompt=[100, 200, 300]), cc("ids_list", prompt=[[100, 200], [300]]),
        cc("str_list", prompt=["import os\n", "def "]), cc("mixed_list", prompt=["a", 5]),
        cc("ids_oov", prompt=[999999]), cc("ids_neg", prompt=[-1]), cc("prompt_int", prompt=5),
        Case("cmpl.no_prompt", C, drop(c, "prompt")),
        cc("unknown_field", foo=1), cc("temp_str", temperature="hot"), cc("temp_neg", temperature=-1),
        cc("top_p0", top_p=0), cc("top_p_big", top_p=1.5), cc("presence_big", presence_penalty=3),
        cc("user", user="u1"), cc("return_token_ids", return_token_ids=True),
        cc("prompt_logprobs", prompt_logprobs=1), cc("bad_words", bad_words=["os"]),
        cc("allowed_ids", allowed_token_ids=[100, 200]),
        chat("basic"), Case("chat.no_model", CH, drop(ch, "model")),
        chat("n2", n=2), chat("logprobs", logprobs=True, top_logprobs=2),
        chat("top_logprobs_only", top_logprobs=2), chat("top_logprobs21", logprobs=True, top_logprobs=21),
        chat("logprobs_int", logprobs=3), chat("max_completion", max_tokens=None, max_completion_tokens=5),
        Case("chat.no_max_tokens", CH, drop(ch, "max_tokens")),
        chat("stream", stream=True), chat("stream_usage", stream=True, stream_options={"include_usage": True}),
        chat("stream_cont", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
        chat("stream_n2", stream=True, n=2), chat("stream_logprobs", stream=True, logprobs=True, top_logprobs=1),
        chat("stream_return_ids", stream=True, return_token_ids=True), chat("stop", stop=["\n"]),
        chat("rf_json_object", response_format={"type": "json_object"}),
        chat("rf_json_schema", response_format=js), chat("rf_text", response_format={"type": "text"}),
        chat("tools_auto", tools=[tool]), chat("tools_auto_explicit", tools=[tool], tool_choice="auto"),
        chat("tools_none", tools=[tool], tool_choice="none"),
        chat("tools_required", tools=[tool], tool_choice="required"),
        chat("tools_named", tools=[tool], tool_choice={"type": "function", "function": {"name": "get"}}),
        chat("tools_named_missing", tools=[tool], tool_choice={"type": "function", "function": {"name": "zz"}}),
        chat("tool_choice_no_tools", tool_choice="required"), chat("tools_empty", tools=[]),
        chat("tools_bad", tools=[{"type": "function"}]),
        chat("stream_tools_required", stream=True, tools=[tool], tool_choice="required"),
        chat("bad_role", messages=[{"role": "robot", "content": "hi"}]),
        chat("parts", messages=[{"role": "user", "content": [{"type": "text", "text": "def f"}]}]),
        chat("part_bad", messages=[{"role": "user", "content": [{"type": "foo", "x": 1}]}]),
        chat("empty_messages", messages=[]), chat("messages_str", messages="hi"),
        chat("no_content", messages=[{"role": "user"}]), chat("null_content", messages=[{"role": "user", "content": None}]),
        chat("content_int", messages=[{"role": "user", "content": 5}]),
        chat("system_only", messages=[{"role": "system", "content": "be brief"}]),
        chat("continue_final", messages=msgs + [{"role": "assistant", "content": "def f"}],
             continue_final_message=True, add_generation_prompt=False),
        chat("continue_and_add", messages=msgs + [{"role": "assistant", "content": "x"}], continue_final_message=True),
        chat("continue_and_add_true", messages=msgs + [{"role": "assistant", "content": "x"}],
             continue_final_message=True, add_generation_prompt=True),
        chat("system_null", messages=[{"role": "system", "content": None}, *msgs]),
        chat("assistant_null", messages=[*msgs, {"role": "assistant", "content": None}, *msgs]),
        chat("echo", echo=True), chat("min_tokens", min_tokens=3), chat("ignore_eos", ignore_eos=True),
        chat("rep_pen", repetition_penalty=1.3), chat("top_k", temperature=0.8, top_k=5, seed=1),
        chat("skip_special", skip_special_tokens=False), chat("incl_stop", stop=["\n"], include_stop_str_in_output=True),
        chat("guided_choice", guided_choice=["yes", "no"]), chat("so_regex", structured_outputs={"regex": "[a-z]{3}"}),
        chat("logit_bias", logit_bias={"100": 100}), chat("seed", temperature=1.0, seed=7),
        chat("max_tokens_past", max_tokens=100000), chat("long", messages=[{"role": "user", "content": long_prompt}]),
        chat("trunc", messages=[{"role": "user", "content": long_prompt}], truncate_prompt_tokens=20,
             return_token_ids=True),
        chat("trunc_right", messages=[{"role": "user", "content": long_prompt}], truncate_prompt_tokens=20,
             truncation_side="right"),
        chat("trunc_neg1", messages=[{"role": "user", "content": long_prompt}], truncate_prompt_tokens=-1),
        chat("trunc_zero", truncate_prompt_tokens=0), chat("trunc_big", truncate_prompt_tokens=max_len + 1),
        chat("trunc_stream", messages=[{"role": "user", "content": long_prompt}], truncate_prompt_tokens=20,
             stream=True),
        chat("unknown_field", foo=1), chat("n_str", n="x"), chat("temp_neg", temperature=-1),
        chat("user_name", messages=[{"role": "user", "content": "def f", "name": "bob"}]),
        chat("tool_msg", messages=msgs + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"x\": \"1\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}]),
        chat("return_token_ids", return_token_ids=True), chat("parallel_tool_calls", parallel_tool_calls=False),
        chat("chat_template_kwargs", chat_template_kwargs={"enable_thinking": False}),
        Case("resp.basic", R, {"model": model, "input": "def f", "max_output_tokens": 8, "temperature": 0}),
        Case("resp.messages", R, {"model": model, "input": msgs, "max_output_tokens": 8, "temperature": 0}),
        Case("resp.instructions", R, {"model": model, "input": "def f", "instructions": "be brief",
                                      "max_output_tokens": 8, "temperature": 0}),
        Case("resp.stream", R, {"model": model, "input": "def f", "max_output_tokens": 4, "temperature": 0,
                                "stream": True}),
        Case("resp.penalties", R, {"model": model, "input": "def f", "max_output_tokens": 8, "temperature": 0,
                                   "presence_penalty": 1.5, "frequency_penalty": 0.5}),
        Case("resp.bad_input", R, {"model": model, "input": 5}),
        Case("resp.no_input", R, {"model": model}),
        Case("resp.unknown_field", R, {"model": model, "input": "x", "max_output_tokens": 2, "foo": 1}),
        Case("resp.prev_missing", R, {"model": model, "input": "x", "max_output_tokens": 2,
                                      "previous_response_id": "resp_nope"}),
        Case("resp.json_schema", R, {"model": model, "input": "x", "max_output_tokens": 8, "temperature": 0,
                                     "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}),
        Case("resp.long", R, {"model": model, "input": long_prompt, "max_output_tokens": 8, "temperature": 0}),
        Case("resp.trunc_auto", R, {"model": model, "input": long_prompt, "max_output_tokens": 8, "temperature": 0,
                                    "truncation": "auto"}),
        Case("resp.trunc_disabled", R, {"model": model, "input": long_prompt, "max_output_tokens": 8,
                                        "temperature": 0, "truncation": "disabled"}),
        Case("tok.prompt", "/tokenize", {"model": model, "prompt": "import os\n"}),
        Case("tok.trunc", "/tokenize", {"model": model, "prompt": long_prompt, "truncate_prompt_tokens": 20}),
        Case("tok.no_model", "/tokenize", {"prompt": "import os\n"}),
        Case("tok.strs", "/tokenize", {"model": model, "prompt": "import os", "return_token_strs": True}),
        Case("tok.special", "/tokenize", {"model": model, "prompt": "import", "add_special_tokens": False}),
        Case("tok.messages", "/tokenize", {"model": model, "messages": msgs}),
        Case("tok.both", "/tokenize", {"model": model, "messages": msgs, "prompt": "x"}),
        Case("tok.none", "/tokenize", {"model": model}),
        Case("tok.int", "/tokenize", {"model": model, "prompt": 5}),
        Case("tok.empty", "/tokenize", {"model": model, "prompt": ""}),
        Case("detok.basic", "/detokenize", {"model": model, "tokens": [100, 200, 300]}),
        Case("detok.empty", "/detokenize", {"model": model, "tokens": []}),
        Case("detok.oov", "/detokenize", {"model": model, "tokens": [999999]}),
        Case("detok.neg", "/detokenize", {"model": model, "tokens": [-1]}),
        Case("detok.str", "/detokenize", {"model": model, "tokens": "abc"}),
        Case("detok.none", "/detokenize", {"model": model}),
    ]
    return _drop_nulls(cases)


def _drop_nulls(cases: list[Case]) -> list[Case]:
    for case in cases:  # an explicit null stands for "leave it out" only where a case says so
        if isinstance(case.body, dict):
            case.body = {k: v for k, v in case.body.items() if v is not None or k == "max_tokens"}
    return cases


def pooling_battery(model: str, max_len: int) -> list[Case]:
    """The pooling runner's endpoints (a server started with --runner pooling): /v1/embeddings in each input
    shape and encoding, /pooling, /tokenize, /detokenize, /v1/models, and the generation routes it refuses."""
    E, P = "/v1/embeddings", "/pooling"
    long_prompt = " ".join(map(str, range(max_len)))  # over max_len tokens, none repeating: which end is kept shows
    e = {"model": model, "input": "import os\n"}
    msgs = [{"role": "user", "content": "def f"}]

    def emb(name: str, **kw) -> Case:
        return Case("emb." + name, E, {**e, **kw})

    def pool(name: str, **kw) -> Case:
        return Case("pool." + name, P, {**e, **kw})

    return _drop_nulls([
        Case("models", "/v1/models", method="GET"),
        Case("health", "/health", method="GET"),
        Case("emb.get", E, method="GET"),
        Case("emb.not_json", E, b"{not json"), Case("emb.body_list", E, [1, 2]), Case("emb.empty_body", E, {}),
        emb("str"), emb("list_str", input=["import os\n", "def f"]), emb("ids", input=[100, 200, 300]),
        emb("ids_list", input=[[100, 200], [300]]), emb("float", encoding_format="float"),
        emb("base64", encoding_format="base64"), emb("base64_list", input=["a", "b c"], encoding_format="base64"),
        emb("format_bad", encoding_format="hex"),
        emb("no_model", model=None), emb("wrong_model", model="nope"), emb("no_input", input=None),
        emb("empty_str", input=""), emb("empty_list", input=[]), emb("empty_ids", input=[[]]),
        emb("list_empty_str", input=["a", ""]), emb("int", input=5), emb("float_list", input=[1.5, 2.5]),
        emb("mixed", input=["a", 5]), emb("dict", input={"text": "a"}), emb("bool_list", input=[True]),
        emb("ids_oov", input=[999999]), emb("ids_neg", input=[-1]), emb("unknown_field", foo=1),
        emb("long", input=long_prompt), emb("long_ids", input=[5] * (max_len + 1)),
        emb("exact_len_ids", input=[5] * max_len),
        emb("trunc", input=long_prompt, truncate_prompt_tokens=20),
        emb("trunc_right", input=long_prompt, truncate_prompt_tokens=20, truncation_side="right"),
        emb("trunc_side_bad", truncation_side="middle"),
        emb("trunc_neg1", input=long_prompt, truncate_prompt_tokens=-1),
        emb("trunc_big", truncate_prompt_tokens=max_len + 1), emb("trunc_neg2", truncate_prompt_tokens=-2),
        emb("trunc_zero", truncate_prompt_tokens=0), emb("trunc_str", truncate_prompt_tokens="5"),
        emb("dims", dimensions=32), emb("dims_full", dimensions=128), emb("dims_big", dimensions=129),
        emb("dims_odd", dimensions=7), emb("dims_zero", dimensions=0), emb("dims_neg", dimensions=-1),
        emb("dims_str", dimensions="32"), emb("dims_base64", dimensions=32, encoding_format="base64"),
        emb("use_activation_false", use_activation=False), emb("use_activation_true", use_activation=True),
        emb("use_activation_str", use_activation="x"),
        emb("normalize", normalize=True), emb("normalize_false", normalize=False),
        emb("user", user="u1"), emb("user_int", user=5), emb("request_id", request_id="my-req-1"),
        emb("request_id_int", request_id=5), emb("priority", priority=1), emb("priority_str", priority="high"),
        emb("cache_salt", cache_salt="s"), emb("cache_salt_empty", cache_salt=""),
        emb("add_special_false", add_special_tokens=False),
        emb("padding", padding="max_length"), emb("padding_none", padding="do_not_pad"),
        emb("padding_trunc", input=long_prompt, padding="max_length", truncate_prompt_tokens=5),
        emb("padding_bad", padding="longest"),
        emb("mm_kwargs", mm_processor_kwargs={"a": 1}),
        emb("f16", encoding_format="base64", embed_dtype="float16"),
        emb("bf16", encoding_format="base64", embed_dtype="bfloat16"),
        emb("fp8_e4m3", encoding_format="base64", embed_dtype="fp8_e4m3"),
        emb("fp8_e5m2", encoding_format="base64", embed_dtype="fp8_e5m2"),
        emb("f32_big", encoding_format="base64", endianness="big"),
        emb("f16_little", encoding_format="base64", embed_dtype="float16", endianness="little"),
        emb("dtype_float_format", embed_dtype="float16"),
        emb("dtype_bad", encoding_format="base64", embed_dtype="int8"),
        emb("endian_bad", encoding_format="base64", endianness="middle"),
        emb("bytes", input=["a", "b c"], encoding_format="bytes"),
        emb("bytes_only", input=["a", "b c"], encoding_format="bytes_only"),
        emb("bytes_bf16_big", encoding_format="bytes", embed_dtype="bfloat16", endianness="big"),
        emb("messages", input=None, messages=msgs),
        emb("messages_batch", input=None, messages=[msgs, [{"role": "user", "content": "x"}]]),
        emb("messages_gen", input=None, messages=msgs, add_generation_prompt=True),
        emb("messages_continue", input=None, messages=msgs + [{"role": "assistant", "content": "def f"}],
            continue_final_message=True),
        emb("messages_special", input=None, messages=msgs, add_special_tokens=True),
        emb("messages_parts", input=None, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}]),
        emb("messages_kwargs", input=None, messages=msgs, chat_template_kwargs={"x": 1}),
        emb("messages_in_input", input=msgs), emb("messages_batch_in_input", input=[msgs, msgs]),
        emb("messages_and_input", messages=msgs), emb("messages_empty", input=None, messages=[]),
        emb("messages_str", input=None, messages="hi"), emb("messages_bad_role", input=None,
                                                          messages=[{"role": "robot", "content": "a"}]),
        emb("messages_empty_chat", input=None, messages=[msgs, []]),
        emb("messages_long", input=None, messages=[{"role": "user", "content": long_prompt}]),
        emb("messages_trunc", input=None, messages=[{"role": "user", "content": long_prompt}],
            truncate_prompt_tokens=10),
        emb("messages_dims", input=None, messages=msgs, dimensions=32),
        Case("invocations", "/invocations", e),
        Case("invocations.input_and_rerank", "/invocations", {**e, "query": "a", "documents": ["b", "c d"]}),
        Case("invocations.bad_input_and_rerank", "/invocations", {**e, "input": 5, "query": "a", "documents": ["b"]}),
        Case("invocations.bad_input", "/invocations", {**e, "input": 5}),
        *cohere_cases(model, long_prompt),
        pool("unset"), pool("embed", task="embed"), pool("list", input=["a", "b c"], task="embed"),
        pool("token_embed", task="token_embed"), pool("classify", task="classify"), pool("other", task="x"),
        pool("encode", task="encode"), pool("dims", dimensions=32), pool("base64", encoding_format="base64"),
        pool("bytes", encoding_format="bytes"), pool("messages", input=None, messages=msgs),
        pool("empty", input=""), pool("unknown_field", foo=1), pool("use_activation_false", use_activation=False),
        *score_cases(model, long_prompt),
        Case("tok.prompt", "/tokenize", {"model": model, "prompt": "import os\n"}),
        Case("tok.messages", "/tokenize", {"model": model, "messages": msgs}),
        Case("tok.int", "/tokenize", {"model": model, "prompt": 5}),
        Case("detok.basic", "/detokenize", {"model": model, "tokens": [100, 200, 300]}),
        Case("detok.str", "/detokenize", {"model": model, "tokens": "abc"}),
        Case("gen.completions", "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 2}),
        Case("gen.chat", "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 2}),
        Case("gen.messages", "/v1/messages", {"model": model, "messages": msgs, "max_tokens": 2}),
        Case("gen.count_tokens", "/v1/messages/count_tokens", {"model": model, "messages": msgs}),
        Case("gen.responses", "/v1/responses", {"model": model, "input": "a", "max_output_tokens": 2}),
    ])


def cohere_cases(model: str, long_prompt: str) -> list[Case]:
    """Cohere's /v2/embed (vLLM's CohereEmbedRequest) on an embedding model."""
    c = {"model": model, "texts": ["import os\n", "def f"]}

    def co(name: str, **kw) -> Case:
        return Case("cohere." + name, "/v2/embed", {k: v for k, v in {**c, **kw}.items() if v is not None})

    return [
        co("texts"), co("float", embedding_types=["float"]), co("binary", embedding_types=["binary"]),
        co("ubinary", embedding_types=["ubinary"]), co("base64", embedding_types=["base64"]),
        co("all_types", embedding_types=["float", "binary", "ubinary", "base64"]),
        co("type_bad", embedding_types=["int8"]), co("input_type", input_type="search_query"),
        co("end", texts=[long_prompt], max_tokens=20), co("start", texts=[long_prompt], truncate="START", max_tokens=20),
        co("start_no_max", texts=[long_prompt], truncate="START"), co("none_ok", truncate="NONE", max_tokens=50),
        co("none_over", texts=[long_prompt], truncate="NONE", max_tokens=20),
        co("none_long", texts=[long_prompt], truncate="NONE"), co("long", texts=[long_prompt]),
        co("truncate_bad", truncate="MIDDLE"), co("max_tokens_big", max_tokens=513),
        co("dims", output_dimension=32), co("dims_bad", output_dimension=7),
        co("empty", texts=[]), co("none", texts=None), co("both", inputs=[{"content": [{"type": "text", "text": "a"}]}]),
        co("inputs", texts=None, inputs=[{"content": [{"type": "text", "text": "def f"}]}]),
        co("inputs_no_text", texts=None, inputs=[{"content": [{"type": "text"}]}]),
        co("images", texts=None, images=["data:image/png;base64,AAAA"]),
        co("wrong_model", model="nope"), co("priority", priority=1), co("unknown_field", foo=1),
    ]


def pooltasks_battery(model: str, max_len: int) -> list[Case]:
    """A server of a token-wise task (--pooler-config '{"task": "token_embed"}' on an embedding model, or
    token_classify on a classifier): /pooling's rows, its task checks, and the routes the server refuses."""
    long_prompt = " ".join(map(str, range(max_len)))
    e = {"model": model, "input": "import os\n"}

    def pool(name: str, **kw) -> Case:
        return Case("tok." + name, "/pooling", {k: v for k, v in {**e, **kw}.items() if v is not None}, tol=SCORE_TOL)

    return [
        pool("unset"), pool("list", input=["a", "b c d"]), pool("ids", input=[100, 200, 300]),
        pool("token_embed", task="token_embed"), pool("token_classify", task="token_classify"),
        pool("embed", task="embed"), pool("classify", task="classify"), pool("encode", task="encode"),
        pool("plugin", task="plugin"), pool("other", task="x"), pool("raw", use_activation=False),
        pool("dims", dimensions=8), pool("base64", encoding_format="base64"),
        pool("bytes", input=["a", "b c"], encoding_format="bytes"),
        pool("messages", input=None, messages=[{"role": "user", "content": "def f"}]),
        pool("trunc", input=long_prompt, truncate_prompt_tokens=20), pool("long", input=long_prompt),
        pool("empty", input=""),
        Case("tok.invocations", "/invocations", e), Case("tok.invocations_rerank", "/invocations",
                                                          {"model": model, "query": "a", "documents": ["b"]}),
        Case("tok.embeddings", "/v1/embeddings", e), Case("tok.classify", "/classify", e),
        Case("tok.v2_embed", "/v2/embed", {"model": model, "texts": ["a"]}),
        Case("tok.score", "/score", {"model": model, "queries": "a", "documents": ["b", "c"]}),
        Case("tok.rerank", "/rerank", {"model": model, "query": "a", "documents": ["b", "c"]}),
        Case("tok.models", "/v1/models", method="GET"),
    ]


# A Qwen3-Reranker-shaped score template (its query, instruction and document in the places vLLM's
# examples/pooling/score/template/qwen3_reranker.jinja puts them; jinja drops the text's last newline)
SCORE_TEMPLATE = (
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    '<Instruct>: {{ instruction | default("Given a web search query, retrieve relevant passages") }}\n'
    '<Query>: {{ (messages | selectattr("role", "eq", "query") | first)["content"] }}\n'
    '<Document>: {{ (messages | selectattr("role", "eq", "document") | first)["content"] }}<|im_end|>\n'
    '<|im_start|>assistant\n<think>\n\n</think>\n\n\n')


def score_template_battery(model: str, max_len: int) -> list[Case]:
    """A cross-encoder served with a score template (--chat-template, SCORE_TEMPLATE written by
    --make-score-template): unformatted pairs, the instruction, chat_template_kwargs and their refusals."""
    docs = ["a cat sat down", "stock prices fell", "the cat"]

    def st(name: str, path: str, **kw) -> Case:
        return Case("st." + name, path, {"model": model, **kw}, tol=SCORE_TOL)

    return [
        st("score", "/score", queries="the cat sat", documents=docs),
        st("score_nn", "/score", queries=["the cat sat", "stocks", "a"], documents=docs),
        st("rerank", "/rerank", query="the cat sat", documents=docs),
        st("instruction", "/rerank", query="the cat sat", documents=docs, instruction="find finance news"),
        st("kwargs", "/score", queries="the cat sat", documents=docs,
           chat_template_kwargs={"instruction": "find animals"}),
        st("kwargs_win", "/score", queries="the cat sat", documents=docs, instruction="a",
           chat_template_kwargs={"instruction": "find animals"}),
        st("kwargs_reserved", "/score", queries="a", documents=docs, chat_template_kwargs={"tools": []}),
        st("per_doc", "/score", queries="the cat sat", documents=docs, max_tokens_per_doc=1),
        st("trunc", "/score", queries="the cat sat", documents=docs, truncate_prompt_tokens=20),
        st("classify", "/classify", input=["the cat sat"]),
        st("invocations", "/invocations", query="the cat sat", documents=docs),
    ]


def score_cases(model: str, long_prompt: str) -> list[Case]:
    """/score and /rerank with an embedding model (vLLM's bi-encoder): each field pair, 1:1, 1:N, N:N,
    top_n, truncation, and bad inputs."""
    docs = ["import os\n", "def f", "x = 1"]

    def score(name: str, path: str = "/score", **kw) -> Case:
        return Case("score." + name, path, {"model": model, **kw})

    def rerank(name: str, path: str = "/rerank", **kw) -> Case:
        return Case("rerank." + name, path, {"model": model, "query": "import os", "documents": docs, **kw})

    return [
        score("1_1", queries="import os", documents="def f"), score("1_n", queries="import os", documents=docs),
        score("n_n", queries=docs[:2], documents=docs[1:]), score("v1", "/v1/score", text_1="a", text_2=docs),
        score("items", queries="a", items=docs), score("data", data_1="a", data_2=["b"]),
        score("request_id", queries="a", documents="b", request_id="s-1"),
        score("n_m", queries=docs[:2], documents=docs), score("n_1", queries=docs[:2], documents="a"),
        score("empty_1", queries=[], documents="a"), score("empty_2", queries="a", documents=[]),
        score("missing", text_1="a"), score("none"), score("int", queries=5, documents="a"),
        score("ids", queries=[1, 2], documents="a"), score("empty_str", queries="a", documents=""),
        score("mm", queries={"content": [{"type": "text", "text": "a"}]}, documents="b"),
        score("long", queries="a", documents=long_prompt),
        score("trunc", queries="a", documents=long_prompt, truncate_prompt_tokens=20),
        score("trunc_big", queries="a", documents="b", truncate_prompt_tokens=100000),
        score("max_doc", queries="a", documents=long_prompt, max_tokens_per_doc=5),
        score("max_query", queries=long_prompt, documents="b", max_tokens_per_query=5),
        score("max_doc_neg", queries="a", documents="b", max_tokens_per_doc=-1),
        score("max_query_big", queries="a", documents="b", max_tokens_per_query=100000),
        score("dims", queries="a", documents="b", dimensions=32),
        score("normalize", queries="a", documents="b", normalize=False),
        score("use_activation_false", queries="a", documents=docs, use_activation=False),
        score("instruction", queries="a", documents="b", instruction="find code"),
        score("wrong_model", queries="a", documents="b", model="nope"),
        score("rerank_body", query="a", documents=docs),
        rerank("basic"), rerank("v1", "/v1/rerank"), rerank("v2", "/v2/rerank"), rerank("top_n", top_n=2),
        rerank("top_n_big", top_n=9), rerank("top_n_neg", top_n=-1), rerank("one_doc", documents="def f"),
        rerank("return_documents", return_documents=False), rerank("no_query", query=None),
        rerank("query_list", query=["a"]), rerank("no_docs", documents=[]), rerank("int_doc", documents=[5]),
        rerank("request_id", request_id="r-1"),
    ]


def classify_battery(model: str, max_len: int) -> list[Case]:
    """A classifier on the pooling runner (run it on a several-label model and on a one-label one, vLLM's
    cross-encoder): /classify in each input shape, /pooling with each task, /score and /rerank (1:1, 1:N,
    N:N, top_n, per-side limits, content objects), /v1/embeddings, /v1/models, and bad inputs. Scores and
    probabilities are compared within SCORE_TOL."""
    K, P, E = "/classify", "/pooling", "/v1/embeddings"
    long_prompt = " ".join(map(str, range(max_len)))  # over max_len tokens, none repeating: which end is kept shows
    texts = ["the cat sat", "stock prices fell today", "rain"]
    docs = ["a cat sat down", "stock prices fell", "the cat"]
    msgs = [{"role": "user", "content": "the cat sat"}]
    k = {"model": model, "input": texts[0]}

    def cls(name: str, **kw) -> Case:
        return Case("cls." + name, K, {**k, **kw}, tol=SCORE_TOL)

    def pool(name: str, **kw) -> Case:
        return Case("pool." + name, P, {**k, **kw}, tol=SCORE_TOL)

    def score(name: str, path: str = "/score", **kw) -> Case:
        return Case("score." + name, path, {"model": model, **kw}, tol=SCORE_TOL)

    def rerank(name: str, path: str = "/rerank", **kw) -> Case:
        return Case("rerank." + name, path, {"model": model, "query": texts[0], "documents": docs, **kw},
                    tol=SCORE_TOL)

    def content(text: str) -> dict:
        return {"content": [{"type": "text", "text": text}]}

    return _drop_nulls([
        Case("models", "/v1/models", method="GET"), Case("health", "/health", method="GET"),
        Case("cls.get", K, method="GET"), Case("cls.not_json", K, b"{not json"), Case("cls.empty_body", K, {}),
        cls("str"), cls("list", input=texts), cls("ids", input=[100, 200, 300]),
        cls("ids_list", input=[[100, 200], [300]]), cls("request_id", request_id="c-1"),
        cls("use_activation_false", input=texts, use_activation=False), cls("use_activation_true", use_activation=True),
        cls("use_activation_str", use_activation="x"), cls("use_activation_null", use_activation=None),
        cls("messages", input=None, messages=msgs), cls("messages_gen", input=None, messages=msgs,
                                                        add_generation_prompt=True),
        cls("messages_parts", input=None, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}]),
        cls("messages_batch", input=None, messages=[msgs, msgs]), cls("messages_and_input", messages=msgs),
        cls("messages_empty", input=None, messages=[]),
        cls("messages_trunc", input=None, messages=[{"role": "user", "content": long_prompt}],
            truncate_prompt_tokens=10),
        cls("long", input=long_prompt), cls("long_ids", input=[5] * (max_len + 1)),
        cls("exact_len_ids", input=[5] * max_len),
        cls("trunc", input=long_prompt, truncate_prompt_tokens=20),
        cls("trunc_left", input=long_prompt, truncate_prompt_tokens=20, truncation_side="left"),
        cls("trunc_neg1", input=long_prompt, truncate_prompt_tokens=-1), cls("trunc_zero", truncate_prompt_tokens=0),
        cls("trunc_big", truncate_prompt_tokens=max_len + 1), cls("trunc_neg2", truncate_prompt_tokens=-2),
        cls("add_special_false", add_special_tokens=False),
        cls("no_model", model=None), cls("wrong_model", model="nope"), cls("no_input", input=None),
        cls("empty_str", input=""), cls("empty_list", input=[]), cls("list_empty_str", input=["a", ""]),
        cls("int", input=5), cls("mixed", input=["a", 5]), cls("ids_oov", input=[999999]), cls("ids_neg", input=[-1]),
        cls("unknown_field", foo=1), cls("dims", dimensions=2), cls("normalize", normalize=True),
        cls("softmax", softmax=True), cls("activation", activation=True),
        cls("encoding_format", encoding_format="base64"),
        cls("user", user="u1"), cls("priority", priority=1),
        pool("unset"), pool("classify", task="classify"), pool("classify_list", input=texts, task="classify"),
        pool("classify_raw", task="classify", use_activation=False), pool("embed", task="embed"),
        pool("score", task="score"), pool("token_classify", task="token_classify"),
        pool("token_embed", task="token_embed"), pool("encode", task="encode"), pool("other", task="x"),
        pool("messages", input=None, messages=msgs, task="classify"), pool("base64", task="classify",
                                                                           encoding_format="base64"),
        Case("emb.str", E, k), Case("emb.list", E, {**k, "input": texts}),
        score("1_1", queries=texts[0], documents=docs[0]), score("1_n", queries=texts[0], documents=docs),
        score("n_n", queries=texts, documents=docs), score("n_m", queries=texts[:2], documents=docs),
        score("n_1", queries=texts[:2], documents=docs[0]),
        score("v1", "/v1/score", text_1=texts[0], text_2=docs), score("items", queries=texts[0], items=docs),
        score("data", data_1=texts[0], data_2=docs), score("request_id", queries="a", documents="b", request_id="s-1"),
        score("use_activation_false", queries=texts[0], documents=docs, use_activation=False),
        score("content", queries=content(texts[0]), documents=[content(d) for d in docs]),
        score("content_query", queries=content(texts[0]), documents=docs),
        score("trunc", queries="a", documents=long_prompt, truncate_prompt_tokens=20),
        score("trunc_neg1", queries="a", documents=long_prompt, truncate_prompt_tokens=-1),
        score("long", queries="a", documents=long_prompt),
        score("max_doc", queries=texts[0], documents=long_prompt, max_tokens_per_doc=5),
        score("max_query", queries=long_prompt, documents=docs[0], max_tokens_per_query=5),
        score("max_both", queries=long_prompt, documents=long_prompt, max_tokens_per_query=4, max_tokens_per_doc=6),
        score("max_doc_neg", queries="a", documents="b", max_tokens_per_doc=-1),
        score("max_doc_zero", queries="a", documents="b", max_tokens_per_doc=0),
        score("trunc_big", queries="a", documents="b", truncate_prompt_tokens=100000),
        score("empty_1", queries=[], documents="a"), score("empty_2", queries="a", documents=[]),
        score("empty_str", queries="a", documents=""), score("missing", text_1="a"), score("none"),
        score("int", queries=5, documents="a"), score("ids", queries=[1, 2], documents="a"),
        score("instruction", queries="a", documents="b", instruction="find"),
        score("template_kwargs", queries="a", documents="b", chat_template_kwargs={"x": 1}),
        score("wrong_model", queries="a", documents="b", model="nope"),
        rerank("basic"), rerank("v1", "/v1/rerank"), rerank("v2", "/v2/rerank"), rerank("top_n", top_n=2),
        rerank("top_n_big", top_n=9), rerank("top_n_zero", top_n=0), rerank("top_n_neg", top_n=-1),
        rerank("one_doc", documents=docs[0]), rerank("content_docs", documents=[content(d) for d in docs]),
        rerank("content_query", query=content(texts[0])), rerank("return_documents", return_documents=False),
        rerank("max_doc", documents=[long_prompt, docs[0]], max_tokens_per_doc=5),
        rerank("max_query", query=long_prompt, max_tokens_per_query=5),
        rerank("use_activation_false", use_activation=False), rerank("no_query", query=None),
        rerank("query_list", query=["a"]), rerank("no_docs", documents=[]), rerank("int_doc", documents=[5]),
        rerank("long_doc", documents=[long_prompt]), rerank("text_docs", documents=[{"text": d} for d in docs]),
        score("trunc_left", queries="a", documents=long_prompt, truncate_prompt_tokens=20, truncation_side="left"),
        cls("trunc_side_bad", truncation_side="middle"),
        Case("invocations.classify", "/invocations", k, tol=SCORE_TOL),
        Case("invocations.score", "/invocations", {"model": model, "queries": "a", "documents": docs}, tol=SCORE_TOL),
        Case("invocations.rerank", "/invocations", {"model": model, "query": "a", "documents": docs}, tol=SCORE_TOL),
        Case("tok.prompt", "/tokenize", {"model": model, "prompt": texts[0]}),
        Case("gen.completions", "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 2}),
        Case("gen.chat", "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 2}),
    ])


# Qwen3-Reranker's prompt format (vLLM's examples/pooling/score/qwen3_reranker_offline.py): the client's, as
# neither server applies a score template unless told
RERANK_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
                 'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def reranker_battery(model: str, max_len: int) -> list[Case]:
    """The classify battery, for a causal LM served as a classifier from LM-head rows (classifier_from_token),
    plus Qwen3-Reranker-formatted pairs: the query with its instruction, each document with the suffix that
    ends where the model's next token is "yes" or "no"."""
    query = f"{RERANK_PREFIX}<Instruct>: Given a web search query, retrieve relevant passages\n<Query>: the cat sat\n"
    docs = [f"<Document>: {d}{RERANK_SUFFIX}" for d in ("a cat sat down", "stock prices fell", "the cat")]

    def rr(name: str, path: str, **kw) -> Case:
        return Case("rr." + name, path, {"model": model, **kw}, tol=SCORE_TOL)

    return classify_battery(model, max_len) + [
        rr("score", "/score", queries=query, documents=docs), rr("rerank", "/rerank", query=query, documents=docs),
        rr("rerank_top1", "/rerank", query=query, documents=docs, top_n=1),
        rr("classify", "/classify", input=[query + d for d in docs]),
        rr("classify_raw", "/classify", input=[query + d for d in docs], use_activation=False),
        rr("pool_classify", "/pooling", input=query + docs[0], task="classify"),
    ]


def make_classify_models(root: str) -> None:
    """The classify battery's models under root, with the demo model's tokenizer and chat template: llama-cls
    (LlamaForSequenceClassification, 3 labels named in id2label: softmax) and qwen3-ce
    (Qwen3ForSequenceClassification, 1 label: sigmoid, a cross-encoder). Hidden 128, head_dim 32 (vLLM's CPU
    attention has no kernel for 16). The tokenizer joins a text pair with <|im_start|> between, so that a pair
    read as one text would score differently. Needs torch and transformers (nanoserve's venv)."""
    import pathlib

    import torch
    from transformers import AutoModelForSequenceClassification, LlamaConfig, Qwen3Config
    out = pathlib.Path(root)
    base = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
                tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=0)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    for name, config, seed in (
            ("llama-cls", LlamaConfig(**base, num_labels=3, id2label=labels,
                                      label2id={v: i for i, v in labels.items()}), 1),
            ("qwen3-ce", Qwen3Config(**base, num_labels=1), 2)):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # sharper than the default init: labels and scores that differ from text to text
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.08)
            model.score.weight.normal_(0, 0.5)
        model.save_pretrained(out / name)
        _save_pair_tokenizer(out / name)
    print(f"api_diff: wrote {out / 'llama-cls'} and {out / 'qwen3-ce'}")


def _save_pair_tokenizer(path) -> None:
    """The demo model's tokenizer and chat template, its text pair joined as A <|im_start|> B: a server that
    reads a pair as the tokenizer's pair where vLLM joins the texts (or the reverse) scores differently."""
    import pathlib

    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    demo = pathlib.Path(__file__).resolve().parent.parent / "nanoserve" / "demo_model"
    tokenizer: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(demo)
    sep = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A <|im_start|> $B:1", special_tokens=[("<|im_start|>", sep)])
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text((demo / "chat_template.jinja").read_text())


def make_reranker_models(root: str) -> None:
    """The reranker battery's models under root: qwen3-lm, a tiny random Qwen3ForCausalLM (hidden 128,
    head_dim 32, 2 layers, untied LM head) with _save_pair_tokenizer's tokenizer, whose vocabulary has "no"
    and "yes" (ids 311 and 2907), and qwen3-lm-tied, the same with the LM head tied to the embedding (the
    score head is then built from embedding rows). Served with --hf-overrides' classifier_from_token as
    Qwen3-Reranker is. Needs torch and transformers (nanoserve's venv)."""
    import pathlib

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    for name, tied in (("qwen3-lm", False), ("qwen3-lm-tied", True)):
        out = pathlib.Path(root) / name
        torch.manual_seed(3)
        config = Qwen3Config(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                             rms_norm_eps=1e-6, tie_word_embeddings=tied, eos_token_id=0, bos_token_id=None,
                             pad_token_id=0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # sharper than the default init, the LM head most: yes/no odds far from 1:1
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.08)
            model.lm_head.weight.normal_(0, 0.5)
        model.save_pretrained(out)
        _save_pair_tokenizer(out)
        print(f"api_diff: wrote {out}")


def make_pooling_models(root: str) -> None:
    """The pooling battery's models under root: a tiny random Qwen3 (hidden 128, head_dim 32: vLLM's CPU
    attention has no kernel for 16) with the demo model's tokenizer and chat template (qwen3-pool: LAST, the
    decoder default), and sentence-transformers copies (modules.json, 1_Pooling, Normalize) pooling MEAN (also
    Matryoshka: matryoshka_dimensions [32, 64, 128]) and CLS, and MEAN through a Dense module (tanh, to 96).
    Needs torch and transformers (nanoserve's venv)."""
    import pathlib
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    out, demo = pathlib.Path(root), pathlib.Path(__file__).resolve().parent.parent / "nanoserve" / "demo_model"
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # sharper than the default init: vectors that differ from prompt to prompt
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    base = out / "qwen3-pool"
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(demo).save_pretrained(base)
    shutil.copy(demo / "chat_template.jinja", base / "chat_template.jinja")
    for pooling in ("mean", "cls"):
        d = out / f"qwen3-pool-st-{pooling}"
        shutil.copytree(base, d, dirs_exist_ok=True)
        (d / "1_Pooling").mkdir(exist_ok=True)
        (d / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (d / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 128, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_lasttoken": False}))
        if pooling == "mean":
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [32, 64, 128]}, indent=2))
    # a decoder with a sentence-transformers Dense module: MEAN, Dense 128 -> 96 (tanh, bias), Normalize
    shutil.copytree(base, out / "qwen3-pool-st-dense", dirs_exist_ok=True)
    _write_dense(out / "qwen3-pool-st-dense", 14, [(128, 96, "torch.nn.modules.activation.Tanh", True)])
    print(f"api_diff: wrote {base} and its -st-mean, -st-cls and -st-dense copies")


ENCODER_WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "stock", "prices", "fell", "today", "rain",
                 "is", "wet", "small", "feline", "index", "what", "down"]


def encoder_battery(model: str, max_len: int) -> list[Case]:
    """Encoder models (BERT, RoBERTa, XLM-R; --make-encoder-models): the same cases on an embedding model and on
    a classifier, each server answering what its task serves and refusing the rest: /v1/embeddings (one, a
    batch, token ids, truncate_prompt_tokens, at and past max_len, dimensions), /pooling, /classify, /score
    and /rerank (a cross-encoder's pairs are [CLS] q [SEP] d [SEP] with token types 0 then 1), /tokenize,
    /v1/models' max_model_len, and bad inputs. Texts are of ENCODER_WORDS and numbers, all in the vocabulary."""
    E, P, K = "/v1/embeddings", "/pooling", "/classify"
    long_prompt = " ".join(map(str, range(max_len)))  # past max_len with [CLS] and [SEP], none repeating
    at_len = " ".join(map(str, range(max_len - 2)))   # with [CLS] and [SEP]: exactly max_len tokens
    texts = ["the cat sat on a mat", "rain", "stock prices fell today the dog ran"]
    query, docs = "what is a cat", ["a small feline", "a stock index", "the cat sat down"]
    ids = [2, 5, 6, 7, 3]  # [CLS] the cat sat [SEP] in the BERT tokenizer, positions one type

    def emb(name: str, **kw) -> Case:
        return Case("emb." + name, E, {"model": model, "input": texts[0], **kw}, tol=SCORE_TOL)

    def pool(name: str, **kw) -> Case:
        return Case("pool." + name, P, {"model": model, "input": texts[0], **kw}, tol=SCORE_TOL)

    def cls(name: str, **kw) -> Case:
        return Case("cls." + name, K, {"model": model, "input": texts[0], **kw}, tol=SCORE_TOL)

    def score(name: str, path: str = "/score", **kw) -> Case:
        return Case("score." + name, path, {"model": model, "queries": query, "documents": docs, **kw},
                    tol=SCORE_TOL)

    def rerank(name: str, path: str = "/rerank", **kw) -> Case:
        return Case("rerank." + name, path, {"model": model, "query": query, "documents": docs, **kw},
                    tol=SCORE_TOL)

    def tok(name: str, **kw) -> Case:
        return Case("tok." + name, "/tokenize", {"model": model, "prompt": texts[0], **kw})

    return _drop_nulls([
        Case("models", "/v1/models", method="GET"), Case("health", "/health", method="GET"),
        emb("str"), emb("list", input=texts), emb("ids", input=ids), emb("ids_list", input=[ids, ids[:3]]),
        emb("trunc", input=long_prompt, truncate_prompt_tokens=5),
        emb("trunc_left", input=long_prompt, truncate_prompt_tokens=5, truncation_side="left"),
        emb("trunc_neg1", input=long_prompt, truncate_prompt_tokens=-1),
        emb("trunc_big", truncate_prompt_tokens=max_len + 1),
        emb("at_len", input=at_len), emb("past_len", input=long_prompt),
        emb("at_len_ids", input=[2] + [5] * (max_len - 2) + [3]), emb("past_len_ids", input=[5] * (max_len + 1)),
        emb("batch_one_long", input=[texts[1], long_prompt]),
        emb("dims", dimensions=16), emb("dims_full", dimensions=128), emb("dims_zero", dimensions=0),
        emb("no_special", add_special_tokens=False), emb("use_activation_false", use_activation=False),
        emb("normalize_false", normalize=False), emb("base64", encoding_format="base64"),
        emb("messages", input=None, messages=[{"role": "user", "content": "the cat"}]),
        emb("empty_str", input=""), emb("empty_list", input=[]), emb("ids_oov", input=[99999]),
        emb("int", input=5), emb("wrong_model", model="nope"), emb("no_input", input=None),
        pool("unset"), pool("embed", task="embed"), pool("token_embed", task="token_embed"),
        pool("classify", task="classify"), pool("token_classify", task="token_classify"),
        pool("list", input=texts[:2]), pool("past_len", input=long_prompt),
        cls("str"), cls("list", input=texts), cls("ids", input=ids), cls("use_activation_false", use_activation=False),
        cls("trunc", input=long_prompt, truncate_prompt_tokens=5), cls("past_len", input=long_prompt),
        cls("at_len", input=at_len),
        # a single text with the separator inside (one text: type 0 throughout), and a query holding one in a pair
        cls("sep_inside", input=query + " [SEP] " + docs[0]), cls("sep_ids", input=[2, 5, 6, 3, 7, 3]),
        score("sep_in_query", queries=query + " [SEP] the"),
        score("1_1", documents=docs[0]), score("1_n"), score("n_n", queries=[query] * 3),
        score("v1", "/v1/score", queries=None, documents=None, text_1=query, text_2=docs),
        score("use_activation_false", use_activation=False),
        score("trunc", documents=long_prompt, truncate_prompt_tokens=10),
        score("past_len", documents=long_prompt), score("max_doc", documents=long_prompt, max_tokens_per_doc=5),
        score("empty_docs", documents=[]),
        rerank("basic"), rerank("v1", "/v1/rerank"), rerank("top_n", top_n=2),
        rerank("max_doc", documents=[long_prompt, docs[0]], max_tokens_per_doc=5),
        rerank("past_len", documents=[long_prompt]), rerank("no_query", query=None),
        tok("str"), tok("no_special", add_special_tokens=False), tok("past_len", prompt=long_prompt),
        tok("messages", prompt=None, messages=[{"role": "user", "content": "the cat"}]),
        Case("detok", "/detokenize", {"model": model, "tokens": ids}),
        Case("gen.completions", "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 2}),
    ])


def make_encoder_models(root: str) -> None:
    """The encoder battery's models under root, tiny and random (hidden 128, 4 heads of 32: vLLM's CPU attention
    has no kernel for 16; 2 layers), each with a WordPiece BertTokenizerFast over [PAD] [UNK] [CLS] [SEP] [MASK],
    ENCODER_WORDS and the numbers 0-99 (RoBERTa's with [PAD] at 1, its padding_idx): bert-st (BertModel with
    sentence-transformers files: MEAN, Normalize, max_seq_length 48 of 64 positions), bert-cls (the same
    weights without them: CLS; position_embedding_type "absolute" and a tokenizer model_max_length of 56),
    xlmr (XLMRobertaModel, 66 positions: 64 tokens; position_embedding_type "absolute"), bert-ce (a one-label
    BertForSequenceClassification, a cross-encoder) and roberta-cls (a 3-label
    RobertaForSequenceClassification, 66 positions, no position_embedding_type: as transformers 5 saves it);
    modernbert (ModernBertModel, 64 positions, 3 layers, the middle one local with local_attention 8) and
    modernbert-ce (a one-label ModernBertForSequenceClassification of that shape, classifier_pooling "mean") and
    modernbert-tok (a 3-label ModernBertForTokenClassification), their tokenizer without token types (ModernBERT's);
    and colbert (HF_ColBERT, _make_colbert). Needs torch and transformers (nanoserve's venv)."""
    import pathlib
    import shutil

    import torch
    from transformers import (BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast,
                              ModernBertConfig, ModernBertForSequenceClassification, ModernBertForTokenClassification,
                              ModernBertModel, RobertaConfig, RobertaForSequenceClassification, XLMRobertaConfig,
                              XLMRobertaModel)
    out = pathlib.Path(root)
    words = ENCODER_WORDS + [str(i) for i in range(100)]
    sizes = dict(vocab_size=5 + len(words), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=256)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    specs = [("bert-st", BertModel, BertConfig(**sizes, max_position_embeddings=64), 1),
             ("xlmr", XLMRobertaModel, XLMRobertaConfig(**sizes, max_position_embeddings=66, pad_token_id=1), 2),
             ("bert-ce", BertForSequenceClassification,
              BertConfig(**sizes, max_position_embeddings=64, num_labels=1), 3),
             ("roberta-cls", RobertaForSequenceClassification, RobertaConfig(
                 **sizes, max_position_embeddings=66, pad_token_id=1, num_labels=3, id2label=labels,
                 label2id={v: i for i, v in labels.items()}), 4)]
    modern = dict(sizes, num_hidden_layers=3, global_attn_every_n_layers=2, local_attention=8,
                  max_position_embeddings=64, pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
                  eos_token_id=3)
    specs += [("modernbert", ModernBertModel, ModernBertConfig(**modern), 5),
              ("modernbert-ce", ModernBertForSequenceClassification,
               ModernBertConfig(**modern, num_labels=1, classifier_pooling="mean"), 6),
              ("modernbert-tok", ModernBertForTokenClassification, ModernBertConfig(**modern, num_labels=3), 7)]
    for name, cls, config, seed in specs:
        torch.manual_seed(seed)
        model = cls(config).eval()
        with torch.no_grad():  # sharper than the default init: vectors and scores that differ from text to text
            for pname, p in model.named_parameters():
                p.normal_(1 if pname.endswith(("LayerNorm.weight", "norm.weight")) else 0,
                          0.1 if p.dim() >= 2 else 0.05)
            if name == "bert-ce":
                model.bert.embeddings.token_type_embeddings.weight.normal_(0, 1.0)  # the pair's types weigh
        model.save_pretrained(out / name)
        special = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"] if "roberta" in name or name == "xlmr" else \
            ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        types = {"model_input_names": ["input_ids", "attention_mask"]} if name.startswith("modernbert") else {}
        BertTokenizerFast(vocab={w: i for i, w in enumerate(special + words)},
                          model_max_length=64, **types).save_pretrained(out / name)
    _make_colbert(out / "colbert", sizes, words)
    st = out / "bert-st"
    shutil.copytree(st, out / "bert-cls", dirs_exist_ok=True)
    # as transformers 4 saved them (real checkpoints): vLLM then caps max_model_len by the tokenizer's
    # model_max_length (bert-cls: 56 of 64 positions), and its XLM-R config check needs the key to start
    for name, tokens in (("bert-cls", 56), ("xlmr", 64)):
        for file, key, value in (("config.json", "position_embedding_type", "absolute"),
                                 ("tokenizer_config.json", "model_max_length", tokens)):
            cfg = json.loads((out / name / file).read_text())
            (out / name / file).write_text(json.dumps({**cfg, key: value}, indent=2))
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (st / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    (st / "1_Pooling").mkdir(exist_ok=True)
    (st / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 128, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    _make_st_dense(out, sizes, words)
    print(f"api_diff: wrote {', '.join(name for name, *_ in specs)}, bert-cls, colbert, bert-dense and embgemma "
          f"under {out}")


def _write_dense(folder, seed: int, dims: list[tuple[int, int, str, bool]]) -> None:
    """sentence-transformers Dense modules (2_Dense, 3_Dense, ...: config.json, linear.weight/bias) after
    modules.json's Transformer, MEAN Pooling and before its Normalize, as sentence-transformers saves them."""
    import torch
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    for i, (n_in, n_out, act, bias) in enumerate(dims, start=2):
        (folder / f"{i}_Dense").mkdir(exist_ok=True)
        (folder / f"{i}_Dense" / "config.json").write_text(json.dumps({
            "in_features": n_in, "out_features": n_out, "bias": bias, "activation_function": act}))
        tensors = {"linear.weight": torch.randn(n_out, n_in) * 0.1}
        if bias:
            tensors["linear.bias"] = torch.randn(n_out) * 0.1
        save_file(tensors, str(folder / f"{i}_Dense" / "model.safetensors"))
        modules.append({"idx": i, "name": str(i), "path": f"{i}_Dense", "type": "sentence_transformers.models.Dense"})
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))


def _make_st_dense(out, sizes: dict, words: list[str]) -> None:
    """bert-dense: bert-st's BertModel, MEAN, Dense 128 -> 64 (tanh, bias), Dense 64 -> 48 (identity, no bias),
    Normalize; embgemma: a tiny EmbeddingGemma (Gemma3TextModel, use_bidirectional_attention, 3 layers: sliding
    (sliding_window 8: 4 either side), full, sliding; 4 heads of 32, 2 KV heads; 64 positions), MEAN, Dense 128 ->
    256 -> 128 (identity, no bias, as EmbeddingGemma's), Normalize; the encoder battery's tokenizer."""
    import shutil

    import torch
    from transformers import BertTokenizerFast, Gemma3TextConfig, Gemma3TextModel
    shutil.copytree(out / "bert-cls", out / "bert-dense", dirs_exist_ok=True)
    _write_dense(out / "bert-dense", 11, [(128, 64, "torch.nn.modules.activation.Tanh", True),
                                          (64, 48, "torch.nn.modules.linear.Identity", False)])
    torch.manual_seed(12)
    model = Gemma3TextModel(Gemma3TextConfig(
        vocab_size=sizes["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        max_position_embeddings=64, sliding_window=8, use_bidirectional_attention=True, pad_token_id=0,
        bos_token_id=2, eos_token_id=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1 if p.dim() >= 2 else 0.3)
    model.eval().save_pretrained(out / "embgemma")
    BertTokenizerFast(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)},
                      model_max_length=64).save_pretrained(out / "embgemma")
    _write_dense(out / "embgemma", 13, [(128, 256, "torch.nn.modules.linear.Identity", False),
                                        (256, 128, "torch.nn.modules.linear.Identity", False)])


def _make_colbert(out, sizes: dict, words: list[str]) -> None:
    """HF_ColBERT as colbert-ai saves it (vLLM's ColBERTModel): BertModel under "bert." and a bias-free
    ``linear.weight`` projecting each token's row to 32; config.json names no dim (both infer it)."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel, BertTokenizerFast
    torch.manual_seed(5)
    model = BertModel(BertConfig(**sizes, max_position_embeddings=64)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(1 if pname.endswith("LayerNorm.weight") else 0, 0.1 if p.dim() >= 2 else 0.05)
    tensors = {"bert." + k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["linear.weight"] = torch.randn(32, sizes["hidden_size"]) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    model.config.architectures = ["HF_ColBERT"]
    model.config.save_pretrained(out)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)},
                      model_max_length=64).save_pretrained(out)


def _param_names_field(row: tuple) -> bool:
    case, where, what, a, b = row
    return where.endswith(".error.param") and (what == "type" or (isinstance(b, str) and b.startswith("body.")) or
                                               b in ("logprobs", "response_id"))


# Differences measured and kept on purpose (README's "Differences from vLLM" says why): a row that matches one is
# labelled with its reason, so that what is left unlabelled is what is new.
KEPT: list[tuple[str, Any]] = [
    ("a body that is no object names no field", lambda r: r[1].endswith(".error.param") and r[2] == "type"
     and r[3] == "null"),
    ("vLLM types pydantic errors 'Bad Request'", lambda r: r[1].endswith(".error.type") and r[4] == "Bad Request"),
    ("param names the request's field", _param_names_field),
    ("404 in OpenAI's error shape", lambda r: r[2] == "keys" and r[4] == ["detail"]),
    ("404 NotFoundError, as every 404", lambda r: r[0] == "resp.prev_missing"),
    ("different programs", lambda r: r[0] == "version"),
    ("guided_* honoured (vLLM 0.32 ignores)", lambda r: r[0] in ("cmpl.guided_json", "cmpl.guided_regex",
                                                                   "cmpl.guided_choice", "chat.guided_choice")),
    ("best_of refused (vLLM 0.32 ignores)", lambda r: r[0] == "cmpl.best_of2"),
    ("invalid UTF-8 shown as U+FFFD", lambda r: r[0] in ("cmpl.logit_bias", "cmpl.logit_bias_big", "cmpl.allowed_ids",
                                                          "chat.logit_bias") and r[1].endswith((".text", ".content"))),
    ("forced tool calls without a parser", lambda r: r[0] in ("chat.tools_required", "chat.tools_named",
                                                              "chat.stream_tools_required") and r[2] == "status"),
    ("continue_final_message implies no gen. prompt", lambda r: r[0] == "chat.continue_and_add"),
    ("echo with max_tokens 0 counts no token", lambda r: r[0] == "cmpl.echo_max0"),
    ("prompt and messages together: 400", lambda r: r[0] in ("tok.both", "emb.messages_and_input",
                                                              "cls.messages_and_input")),
    ("an id outside the vocabulary: 400", lambda r: r[0] == "detok.oov"),
    ("a bool is no token id (pydantic takes true as 1)", lambda r: r[0] == "emb.bool_list"),
    ("FCFS refuses priority != 0 (vLLM's docs; its code ignores it)", lambda r: r[0] in ("emb.priority",
                                                                                          "cls.priority",
                                                                                          "cohere.priority")),
    ("an empty input list: nanoserve's schema refuses it, before a token-wise server's 501",
     lambda r: r[0] == "emb.empty_list" and (r[3], r[4]) in ((400, 501), ("BadRequestError", "NotImplementedError"))),
    ("/v2/embed's param names its own field", lambda r: r[0].startswith("cohere.") and r[1] == ".error.param"
     and r[3] in ("texts", "max_tokens")),
    ("/classify's messages as /v1/embeddings': one chat or a batch", lambda r: r[0] == "cls.messages_batch"),
    ("truncated echo: the tokens the model saw", lambda r: r[0] == "cmpl.trunc_echo" and r[1].endswith(".text")),
    ("echo with return_token_ids echoes the prompt", lambda r: r[0] == "cmpl.echo_ids" and r[1].endswith(".text")),
    ("vLLM counts RoBERTa's padding_idx+1 positions as tokens (no position_embedding_type in config.json)",
     lambda r: (r[1].endswith(".max_model_len") and isinstance(r[3], int) and r[4] == r[3] + 2) or (
         r[0] in ("pool.past_len", "cls.past_len") and r[2] == "status" and (r[3], r[4]) == (400, 200))),
    ("OpenAI's Response has error: null", lambda r: r[0].startswith("resp.") and r[2] == "keys" and r[3] == ["error"]
     and r[4] == []),
]


def kept(row: tuple) -> str:
    return next((why for why, rule in KEPT if rule(row)), "")


def send(client: httpx.Client, base: str, case: Case) -> Answer:
    """One case's answer; a connection the server dropped is status 0 (a crash shows, the battery goes on)."""
    try:
        return _send(client, base, case)
    except httpx.TransportError as e:
        return Answer(0, f"{type(e).__name__}: {e}")


def _send(client: httpx.Client, base: str, case: Case) -> Answer:
    url = base.rstrip("/") + case.path
    if case.method == "GET":
        r = client.get(url)
        return Answer(r.status_code, _parse(r.text))
    kw = {"content": case.body, "headers": {"Content-Type": "application/json"}} if isinstance(case.body, bytes) \
        else {"json": case.body}
    if not case.stream:
        r = client.post(url, **kw)
        if r.headers.get("content-type", "").startswith("application/octet-stream"):
            return Answer(r.status_code, bytes_answer(case, r))
        return Answer(r.status_code, decode_base64(case, _parse(r.text)))
    with client.stream("POST", url, **kw) as r:
        if r.status_code != 200:
            return Answer(r.status_code, _parse(r.read().decode()))
        chunks = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                chunks.append(data if data == "[DONE]" else _parse(data))
        return Answer(200, None, chunks)


def decode_vector(raw: bytes, dtype: str, endianness: str) -> list[float]:
    """vLLM's binary2tensor in the standard library: embed_dtype's bytes in endianness's order."""
    order = ">" if endianness == "big" or endianness == "native" and sys.byteorder == "big" else "<"
    if dtype in ("float32", "float16"):
        size = 4 if dtype == "float32" else 2
        return list(struct.unpack(f"{order}{len(raw) // size}{'f' if size == 4 else 'e'}", raw))
    if dtype == "bfloat16":  # the high half of a float32
        halves = struct.unpack(f"{order}{len(raw) // 2}H", raw)
        return list(struct.unpack(f"<{len(halves)}f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves))))
    man_bits, bias = {"fp8_e4m3": (3, 7), "fp8_e5m2": (2, 15)}[dtype]
    out = []
    for b in raw:
        exp, man = (b & 0x7F) >> man_bits, b & ((1 << man_bits) - 1)
        value = man / (1 << man_bits) * 2.0 ** (1 - bias) if exp == 0 else \
            (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)  # e4m3fn's NaN and e5m2's inf: not in an embedding
        out.append(-value if b & 0x80 else value)
    return out


def decode_base64(case: Case, body: Any) -> Any:
    """An embeddings answer's base64 vectors as floats (fp32 sums differ in the last bits between servers)."""
    req = case.body if isinstance(case.body, dict) else {}
    cohere = body.get("embeddings") if isinstance(body, dict) and case.path == "/v2/embed" else None
    if isinstance(cohere, dict) and isinstance(cohere.get("base64"), list):  # Cohere's: little-endian fp32 each
        cohere["base64"] = [decode_vector(base64.b64decode(v), "float32", "little") for v in cohere["base64"]]
        return body
    if req.get("encoding_format") != "base64" or not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return body
    dtype, endianness = req.get("embed_dtype", "float32"), req.get("endianness", "native")
    for item in body["data"]:
        for key in ("embedding", "data"):
            if isinstance(item, dict) and isinstance(item.get(key), str):
                item[key] = decode_vector(base64.b64decode(item[key]), dtype, endianness)
    return body


def bytes_answer(case: Case, r: httpx.Response) -> dict:
    """encoding_format bytes (bytes_only): the metadata header, and the vectors it places (without it: the
    request's embed_dtype, the body cut in as many equal parts as the request has prompts)."""
    req = case.body if isinstance(case.body, dict) else {}
    dtype, endianness = req.get("embed_dtype", "float32"), req.get("endianness", "native")
    metadata = _parse(r.headers["metadata"]) if "metadata" in r.headers else None
    if isinstance(metadata, dict):
        spans = [(d["start"], d["end"]) for d in metadata["data"]]
    else:
        n = len(req["input"]) if isinstance(req.get("input"), list) and isinstance(req["input"][0], str) else 1
        spans = [(i * len(r.content) // n, (i + 1) * len(r.content) // n) for i in range(n)]
    return {"content-type": r.headers["content-type"], "metadata": metadata,
            "vectors": [decode_vector(r.content[a:b], dtype, endianness) for a, b in spans]}


def wait_ready(client: httpx.Client, base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.get(base.rstrip("/") + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"api_diff: {base} did not answer /health with 200 in {timeout:.0f} s")
        time.sleep(1)


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def compare(a: Any, b: Any, path: str, values: bool, sampled: bool, out: list, step: float = 0.0,
            tol: float = FLOAT_TOL) -> None:
    """Record (path, what, a, b) for each place a and b differ: type, keys, length or value."""
    if kind(a) != kind(b) and not {kind(a), kind(b)} <= {"int", "float"}:
        out.append((path, "type", kind(a), kind(b)))
        return
    if values and path_key(path) in VECTOR_KEYS and is_vector(a) and is_vector(b):
        compare_vectors(a, b, path, step, out)
        return
    if isinstance(a, dict):
        if set(a) != set(b):
            out.append((path, "keys", sorted(set(a) - set(b)), sorted(set(b) - set(a))))
        for k in sorted(set(a) & set(b)):
            ignored = k in IGNORED_VALUES and (k != "message" or path.endswith(".error"))  # an error's text
            if ignored or (sampled and k in SAMPLED_VALUES):
                compare(a[k], b[k], f"{path}.{k}", False, sampled, out, step, tol)
            else:
                compare(a[k], b[k], f"{path}.{k}", values, sampled, out, step, tol)
    elif isinstance(a, list):
        if values and len(a) != len(b):
            out.append((path, "len", len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{path}[{i}]", values, sampled, out, step, tol)
    elif values and a != b:
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and abs(a - b) <= tol * max(1.0, abs(a), abs(b)):
            return
        out.append((path, "value", a, b))


def path_key(path: str) -> str:
    """The key a value sits under, list indices aside: "data[0].embedding" -> "embedding", "vectors[1]" -> "vectors"."""
    return path.rsplit(".", 1)[-1].split("[", 1)[0]


def is_vector(value: Any) -> bool:
    return isinstance(value, list) and len(value) >= VECTOR_MIN_LEN and \
        all(isinstance(x, float) or isinstance(x, int) and not isinstance(x, bool) for x in value) and \
        any(isinstance(x, float) for x in value)


def compare_vectors(a: list[float], b: list[float], path: str, step: float, out: list) -> None:
    """Two embeddings: their lengths, and the value furthest past its tolerance if any is: VECTOR_TOL of
    the vector's largest magnitude (at least 1), plus a rounding step of the value's own where it came
    as a narrower dtype's bytes."""
    if len(a) != len(b):
        out.append((path, "len", len(a), len(b)))
        return
    scale = max(1.0, *map(abs, a), *map(abs, b))
    excess, i = max((abs(x - y) - VECTOR_TOL * scale - step * max(abs(x), abs(y)), i)
                    for i, (x, y) in enumerate(zip(a, b)))
    if excess > 0:
        out.append((f"{path}[{i}]", "vector", a[i], b[i]))


def chunk_kind(chunk: Any) -> str:
    """One stream chunk, in words: which of role/content/finish/usage/logprobs ... it carries."""
    if chunk == "[DONE]":
        return "[DONE]"
    if not isinstance(chunk, dict):
        return "text?"
    if "type" in chunk and "choices" not in chunk:          # a Responses API event
        return chunk["type"]
    if "error" in chunk:
        return "error"
    parts = []
    for ch in chunk.get("choices") or []:
        d = ch.get("delta", ch)
        if d.get("role"):
            parts.append("role")
        if d.get("content") or d.get("text"):
            parts.append("content")
        elif "content" in d or "text" in d:
            parts.append("empty")
        if d.get("tool_calls"):
            parts.append("tool_calls")
        if ch.get("logprobs"):
            parts.append("logprobs")
        if ch.get("finish_reason"):
            parts.append("finish:" + ch["finish_reason"])
    if not chunk.get("choices"):
        parts.append("no-choices")
    if chunk.get("usage"):
        parts.append("usage")
    return "+".join(dict.fromkeys(parts)) or "bare"


def fold(kinds: list[str]) -> list[str]:
    out: list[str] = []
    for k in kinds:
        if out and out[-1].split(" x")[0] == k:
            n = int(out[-1].split(" x")[1]) + 1 if " x" in out[-1] else 2
            out[-1] = f"{k} x{n}"
        else:
            out.append(k)
    return out


def stream_text(chunks: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for ch in (chunk.get("choices") or []) if isinstance(chunk, dict) else []:
            d = ch.get("delta", ch)
            texts[ch.get("index", 0)] = texts.get(ch.get("index", 0), "") + (d.get("content") or d.get("text") or "")
    return texts


def diff(case: Case, a: Answer, b: Answer) -> list[tuple]:
    out: list[tuple] = []
    if a.status != b.status:
        out.append(("", "status", a.status, b.status))
    if a.status != 200 or b.status != 200:
        if a.status >= 400 and b.status >= 400:
            compare(a.body, b.body, "", True, False, out)
        return out
    if not case.stream:
        compare(a.body, b.body, "", True, case.sampled, out, case.step, case.tol)
        return out
    ka, kb = fold([chunk_kind(c) for c in a.chunks]), fold([chunk_kind(c) for c in b.chunks])
    # vLLM under load may merge two steps' tokens into one chunk: compare which kinds come in which order
    if [k.split(" x")[0] for k in ka] != [k.split(" x")[0] for k in kb]:
        out.append(("stream", "chunks", " ".join(ka), " ".join(kb)))
    if not case.sampled and stream_text(a.chunks) != stream_text(b.chunks):
        out.append(("stream", "text", stream_text(a.chunks), stream_text(b.chunks)))
    first_a = {chunk_kind(c): c for c in reversed(a.chunks) if isinstance(c, dict)}
    first_b = {chunk_kind(c): c for c in reversed(b.chunks) if isinstance(c, dict)}
    for k in sorted(set(first_a) & set(first_b)):
        compare(first_a[k], first_b[k], f"<{k}>", k.startswith(("finish", "usage", "no-choices")) and not
                case.sampled, case.sampled, out)
    return out


def short(value: Any, width: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", nargs="?", help="base URL of the first server (nanoserve)")
    p.add_argument("b", nargs="?", help="base URL of the second server (vLLM)")
    p.add_argument("--make-pooling-models", metavar="DIR", help="write the pooling battery's models there, and exit")
    p.add_argument("--make-classify-models", metavar="DIR", help="write the classify battery's models there, and exit")
    p.add_argument("--make-reranker-models", metavar="DIR", help="write the reranker battery's models there, and exit")
    p.add_argument("--make-encoder-models", metavar="DIR", help="write the encoder battery's models there, and exit")
    p.add_argument("--model", default="demo", help="the served model name both use")
    p.add_argument("--make-score-template", metavar="FILE", help="write the score_template battery's template there, "
                   "and exit")
    p.add_argument("--battery", choices=["generate", "pooling", "classify", "reranker", "pooltasks",
                                        "score_template", "encoder"],
                   default="generate",
                   help="pooling: the embeddings battery, for two servers run with --runner pooling; classify: "
                        "the classifier battery (a several-label classifier, or a one-label cross-encoder); "
                        "reranker: classify's plus Qwen3-Reranker-formatted pairs (a causal LM served with "
                        "classifier_from_token); pooltasks: a token_embed or token_classify server's "
                        "/pooling; score_template: a cross-encoder served with --chat-template SCORE_TEMPLATE")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--labels", default="nanoserve,vllm")
    p.add_argument("--only", default="", help="run the cases whose name starts with this")
    p.add_argument("--json", help="write every case's two answers and differences here")
    p.add_argument("-v", "--verbose", action="store_true", help="print both error messages of each error case")
    p.add_argument("--width", type=int, default=70)
    p.add_argument("--wait", type=float, default=120, help="seconds to wait for each server's /health")
    args = p.parse_args()
    for out, make in ((args.make_pooling_models, make_pooling_models), (args.make_classify_models,
                      make_classify_models), (args.make_reranker_models, make_reranker_models),
                      (args.make_encoder_models, make_encoder_models)):
        if out:
            make(out)
            return 0
    if args.make_score_template:
        with open(args.make_score_template, "w") as f:
            f.write(SCORE_TEMPLATE)
        return 0
    if not (args.a and args.b):
        p.error("two base URLs are needed: nanoserve's, then vLLM's")
    la, lb = args.labels.split(",")
    make = {"pooling": pooling_battery, "classify": classify_battery,
            "reranker": reranker_battery, "pooltasks": pooltasks_battery,
            "score_template": score_template_battery, "encoder": encoder_battery}.get(args.battery, battery)
    cases = [c for c in make(args.model, args.max_model_len) if c.name.startswith(args.only)]
    record, rows, differing = [], [], 0
    with httpx.Client(timeout=120) as client:
        for base in (args.a, args.b):
            wait_ready(client, base, args.wait)
        for case in cases:
            a, b = send(client, args.a, case), send(client, args.b, case)
            found = diff(case, a, b)
            differing += bool(found)
            rows += [(case.name, *d) for d in found]
            record.append({"case": case.name, "path": case.path, "body": case.body if not isinstance(case.body, bytes)
                           else case.body.decode(), la: a.__dict__, lb: b.__dict__, "diffs": found})
            if args.verbose and (a.status >= 400 or b.status >= 400):
                msg = lambda x: x.body.get("error", {}).get("message") if isinstance(x.body, dict) and \
                    isinstance(x.body.get("error"), dict) else x.body
                print(f"# {case.name}: {la} {a.status} {short(msg(a), 150)!r}\n#   {lb} {b.status} {short(msg(b), 150)!r}")
    w = args.width
    print(f"{'case':28} {'where':34} {'what':7} {la:{w}} {lb:{w}} kept because")
    for row in rows:
        name, where, what, x, y = row
        x, y = (json.dumps(v) for v in (x, y))
        print(f"{name:28} {short(where, 34):34} {what:7} {short(x, w):{w}} {short(y, w):{w}} {kept(row)}")
    known = sum(bool(kept(r)) and not kept(r).startswith("OPEN") for r in rows)
    reasons = collections.Counter(kept(r) or "(not known)" for r in rows)
    print("\n" + "\n".join(f"{n:4} {why}" for why, n in reasons.most_common()))
    print(f"\n{len(cases)} cases, {differing} differ, {len(rows)} differences "
          f"({known} known and kept, {len(rows) - known} other)")
    if any(kept(r).startswith("OPEN") for r in rows):
        print("(OPEN rows are known differences still to fix)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
