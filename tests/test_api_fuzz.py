"""A seeded HTTP-level fuzz of the server. Valid bodies of every endpoint (completions, chat, responses,
Anthropic's messages and count_tokens, /invocations, /tokenize, /detokenize) are each mutated a few
times: a field of the endpoint's schema, or one nested in the body, set to a value of its type at the
edge of its range or of another type (null, booleans, huge, negative and fractional numbers, NaN and
Infinity, numbers as strings, empty and long strings, lone surrogates, special tokens, empty and
wrong-shaped lists and objects, bad schemas, regexes and templates); fields dropped, wrapped, added;
the model's output forced (a structured-outputs choice) into each tool-call parser's syntax, well formed
or not, whole or cut short. Some bodies are spoiled as bytes (invalid JSON or UTF-8, duplicate keys,
another body than an object, a wrong content type, nesting past the limit, an integer past Python's);
some requests go by another method, to another path, with an odd X-Request-Id, or leave before or
while the answer comes.

Each answer must be a 2xx or a 4xx (never a 5xx: the server's rule is a clear error for every bad
input); a 4xx in the error shape of its API, whose ``param``, where it names one, is a field of the
body (or the header) that was sent or one the body left out; a 2xx as the openai or anthropic SDK's
type of it reads it; a stream framed as its API frames one and ending as it ends one (a completion's
and a chat's with [DONE], a response's with response.completed, a message's with message_stop), or with
an error event that is not the server's fault. Nothing is logged at ERROR (no traceback), no request
hangs, and after the batch the engine is idle with every KV block free and an ordinary request is served.

CI runs a few hundred requests on one server (CONFIGS[0]); many more, on each of CONFIGS in turn, by
several clients at once, listing the slowest requests:
``python tests/test_api_fuzz.py --seeds 20 --minutes 30 --clients 2``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import heapq
import json
import logging
import random
import socket
import sys
import tempfile
import time
import types
import typing
from collections import Counter
from pathlib import Path

import httpx
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_model  # noqa: E402
from nanoserve.entry import (AnthropicCountTokensRequest, AnthropicMessagesRequest, ChatCompletionRequest,  # noqa: E402
                             CompletionRequest, DetokenizeRequest, ResponsesRequest, TokenizeRequest,
                             RESPONSES_PASSED_ON, UNSUPPORTED_FIELDS, esc)
from test_server import ServerThread, _metrics  # noqa: E402
from test_tools import CLOCK, TOOLS, WEATHER  # noqa: E402

FLAGS = ("--max-model-len", "128", "--max-request-body-bytes", "262144")
# The servers a seed may run on (CI's: the first); the long runs take them in turn
CONFIGS = (
    ("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic", "--reasoning-parser", "deepseek_r1",
     "--trust-request-chat-template", "--enable-force-include-usage", "--return-tokens-as-token-ids",
     "--enable-prompt-embeds"),
    ("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3",
     "--max-num-seqs", "2", "--max-queue-len", "6", "--max-num-batched-tokens", "32", "--enable-prefix-caching"),
    ("--enable-auto-tool-choice", "--tool-call-parser", "mistral", "--async-scheduling",
     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'),
    ("--enable-auto-tool-choice", "--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss"),
)
TIMEOUT = 120.0  # any answer takes far less: past it, the server hung
CI_SEEDS = (0, 1, 2)
CI_REQUESTS = 100  # a seed

# ================================================================ what is sent

USER = [{"role": "user", "content": "hello world"}]
HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
              {"type": "function", "name": "get_time", "parameters": CLOCK}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "the forecast", "input_schema": WEATHER}]

# A Qwen-style template that takes any tools (their names), past calls (as JSON) and tool results
TEMPLATE = (
    '{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n'
    '{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for tc in m.tool_calls or [] %}'
    '<tool_call>{{ tc.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}'
    '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')

# Valid bodies, a few an endpoint, each cheap to serve (a handful of tokens)
BASES: dict[str, list[dict]] = {
    "/v1/completions": [
        {"prompt": "hello world", "max_tokens": 3},
        {"prompt": [1, 2, 3], "max_tokens": 2, "n": 2, "logprobs": 2, "echo": True, "temperature": 0.7, "seed": 1},
        {"prompt": ["a", "b"], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "the fox", "max_tokens": 4, "stop": ["o", "!"], "logit_bias": {"5": 10.0}, "top_k": 5,
         "top_p": 0.9, "presence_penalty": 0.5, "repetition_penalty": 1.1, "min_tokens": 1},
        {"prompt": "x", "max_tokens": 3, "response_format": {"type": "json_object"}, "prompt_logprobs": 1},
        {"prompt": "x", "max_tokens": 3, "structured_outputs": {"choice": ["yes", "no"]}, "stream": True},
        {"prompt": "hi", "max_tokens": 2, "bad_words": ["the"], "stop_token_ids": [0], "allowed_token_ids": [5, 6, 7],
         "return_token_ids": True, "truncate_prompt_tokens": 2},
    ],
    "/v1/chat/completions": [
        {"messages": USER, "max_tokens": 3},
        {"messages": USER, "max_completion_tokens": 3, "stream": True, "logprobs": True, "top_logprobs": 2,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"messages": HISTORY, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 4},
        {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
         "max_tokens": 8, "stream": True},
        {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8, "parallel_tool_calls": False},
        {"messages": USER, "max_tokens": 6, "response_format": {
            "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}, "n": 2},
        {"messages": [*USER, {"role": "assistant", "content": "Hel"}], "continue_final_message": True,
         "add_generation_prompt": False, "max_tokens": 2, "echo": True, "chat_template_kwargs": {"x": 1}},
        {"messages": USER, "max_tokens": 2, "use_beam_search": True, "n": 2, "length_penalty": 0.5},
    ],
    "/v1/responses": [
        {"input": "hello", "max_output_tokens": 3},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], "instructions": "be brief",
         "max_output_tokens": 3, "stream": True},
        {"input": [{"type": "message", "role": "user", "content": "weather?"},
                   {"type": "function_call", "call_id": "c1", "name": "get_weather",
                    "arguments": '{"city": "Paris", "days": 1}'},
                   {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
         "tools": FLAT_TOOLS, "tool_choice": "auto", "max_output_tokens": 4},
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
         "max_output_tokens": 6, "include": ["message.output_text.logprobs"], "top_logprobs": 1},
        {"input": "x", "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "get_time"},
         "max_output_tokens": 8, "stream": True, "reasoning": {"effort": "low"}, "truncation": "auto"},
    ],
    "/v1/messages": [
        {"model": "", "max_tokens": 3, "messages": USER},
        {"model": "", "max_tokens": 3, "system": "be brief", "stream": True, "stop_sequences": ["o"],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"model": "", "max_tokens": 8, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Oslo", "days": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"}]}]},
        {"model": "", "max_tokens": 6, "stream": True, "output_config": {
            "format": {"type": "json_schema", "schema": CLOCK}}, "messages": USER, "top_k": 3},
    ],
    "/v1/messages/count_tokens": [
        {"model": "", "messages": USER, "system": [{"type": "text", "text": "be brief"}]},
        {"model": "", "messages": USER, "tools": ANTHROPIC_TOOLS,
         "tool_choice": {"type": "tool", "name": "get_weather"}},
    ],
    "/invocations": [
        {"prompt": "hello", "max_tokens": 2},
        {"messages": USER, "max_tokens": 2, "stream": True},
    ],
    "/tokenize": [
        {"prompt": "hello world", "return_token_strs": True},
        {"messages": HISTORY, "tools": TOOLS, "add_generation_prompt": True},
    ],
    "/detokenize": [{"tokens": [1, 2, 3]}],
}
GETS = ("/v1/models", "/health", "/version", "/ping", "/v1/responses/resp_1", "/metrics")
OTHER_PATHS = ("/v1/embeddings", "/v1/completions/", "/v1/chat", "/v2/completions", "/pooling", "/score", "/")
SCHEMAS = {"/v1/completions": [CompletionRequest], "/v1/chat/completions": [ChatCompletionRequest],
           "/v1/responses": [ResponsesRequest], "/v1/messages": [AnthropicMessagesRequest],
           "/v1/messages/count_tokens": [AnthropicCountTokensRequest],
           "/invocations": [CompletionRequest, ChatCompletionRequest], "/tokenize": [TokenizeRequest],
           "/detokenize": [DetokenizeRequest]}
# Every field a body of the endpoint may hold: its schema's, vLLM's refused ones, the Responses API's passed on
FIELDS = {path: sorted({name for s in schemas for name in s.model_fields} | set(UNSUPPORTED_FIELDS)
                       | (RESPONSES_PASSED_ON if path == "/v1/responses" else set()))
          for path, schemas in SCHEMAS.items()}
# A field an error may name though the body left it out: one it requires (or that another it gave requires)
REQUIRED = {"prompt", "messages", "input", "max_tokens", "model", "tokens", "X-Request-Id", "repetition_min_count",
            "input_tokens", "input_text"}  # these two: vLLM 0.32's names for the prompt's length, which clients read

BIG_INTS = (2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30, 10**300)
WORDS = ("", " ", "a", "0", "1", "-1", "1.5", "1e3", "NaN", "true", "null", "none", "auto", "required", "text",
         "json_object", "json_schema", "function", "user", "assistant", "system", "tool", "developer", "message",
         "input_text", "tool_use", "left", "right", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>",
         "\n", "\x00", "\x1b[31m", "\ud800", "x\udfffy", "\ud83d\ude42", "🙂", "你好", "ü" * 3, "{}", "[]",
         '{"a":',
         "get_weather", "get_time", "$ref", "#/$defs/x", "(((a)))*", "a{1,99999}")
KEYS = ("type", "text", "content", "role", "name", "function", "arguments", "parameters", "schema", "json_schema",
        "format", "include_usage", "choice", "regex", "json", "grammar", "id", "input", "properties", "required",
        "$defs", "items", "enum", "", "\ud800", "0", "-1", "999999999", "1" * 12, "5")


def weird(rng: random.Random, depth: int = 0):
    """A JSON value, of any type and shape, mostly of those a validator can get wrong."""
    kind = rng.randrange(10 if depth < 2 else 7)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, -1, 2, 3, 5, 16, 127, 128, 129, 255, 383, 384, 385, 1000, 1024, 1025, 16384, 16385])
    if kind == 2:
        return rng.choice(BIG_INTS) * rng.choice([1, -1])
    if kind == 3:
        return rng.choice([0.0, -0.0, 0.5, 1.5, -1.5, 1e-300, 5e-324, 1e308, -1e308, 2.0, 100.5, float("nan"),
                           float("inf"), float("-inf"), 3.0000000001])
    if kind in (4, 5):
        word = rng.choice(WORDS)
        return word * rng.choice([1, 1, 1, 2, 500, 5000]) if word else word
    if kind == 6:
        return rng.choice([[], {}, [[]], [{}], [None], [""], [0], [-1], [1] * 200, list(range(300, 400)), [[1], []],
                           {"": None}, {"type": None}])
    if kind in (7, 8):
        return [weird(rng, depth + 1) for _ in range(rng.choice([1, 1, 2, 3]))]
    return {rng.choice(KEYS): weird(rng, depth + 1) for _ in range(rng.choice([1, 1, 2, 3]))}


# Outputs a structured-outputs choice forces on the model, for the tool-call and reasoning parsers to read
# (whole, or cut short by max_tokens): calls in each parser's format, well formed or not
FORCED = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>',
    'a <tool_call>{"name": "get_time", "arguments": {"tz": "utc"}}</tool_call> b <tool_call>{"name": "get_time"',
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', '<tool_call>{"name": "get_time", "arguments": "x"}',
    '<tool_call>not json</tool_call><tool_call>[1, 2]</tool_call>', '<tool_call></tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"tz": "\\ud800\\u0000"}}</tool_call>',
    '{"name": "get_time", "parameters": {"tz": "utc"}}; {"name": "get_weather", "parameters": {}}',
    '{"name": 5, "parameters": []}', '[{"name": "get_time", "arguments": {"tz": "utc"}}]',
    '[get_time(tz="utc"), get_weather(city="x", days=1)]', '[get_time(tz=1e999)]', '[f(**x)]', '[get_time(tz=)]',
    '[get_time(tz=[1, {"a": None}])]', '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "utc"}}]',
    '[TOOL_CALLS]get_time{"tz": "utc"}', '[TOOL_CALLS][{"name": "get_time"}]', '[TOOL_CALLS]',
    "<think>hmm</think>answer", "<think>unterminated", "</think>after", "<think></think>", "<think><think>x</think>",
    '<think>a</think><tool_call>{"name": "get_time", "arguments": {"tz": "cet"}}</tool_call>',
    '<think><tool_call>{"name": "get_time", "arguments": {}}</tool_call></think>', "\n\n", "{", "",
    "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>hi",
    '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "utc"}<|call|>',
    '<|channel|>commentary to=functions.nope<|message|>{"a": [<|end|>', "<|start|><|start|><|channel|>",
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "x", "days": 1}<|end|>to=',
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant to=browser.search<|channel|>analysis<|message|>b",
)
FORCING = tuple({"choice": [text]} for text in FORCED)
INTS = (0, 1, -1, 2, 3, 5, 16, 20, 21, 127, 128, 129, 255, 256, 383, 384, 385, 1024, 1025, 16384, 16385, 2**31,
        2**63, -2**63, 2**64)
FLOATS = (0.0, -0.0, 1e-9, 0.1, 0.5, 1.0, 1.5, 2.0, 100.0, 1e6, -0.5, -1.0, -2.0, -100.0, 1e308, -1e308, 5e-324)
SCHEMAS_JSON = (WEATHER, CLOCK, {}, {"type": "object"}, {"type": "string", "maxLength": 0}, {"enum": []},
                {"type": "array", "items": {"$ref": "#"}}, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
                {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "string", "pattern": "(((a)))*b{2,3}"},
                {"anyOf": []}, {"type": "object", "required": ["x"], "properties": {}}, {"not": {}},
                {"type": "string", "format": "date-time"}, {"type": ["string", "null"]}, {"type": "nonsense"}, True)
# Values a field of that name takes (and some it does not), beside what its type says
SPECIAL = {
    "prompt": ("", " ", "hello", [1, 2, 3], [[1], [2, 3]], ["a", ""], [0], [383], [384], [-1], [2**63],
               [[1, 2], "a"], ["x"] * 40, "hello " * 200, [1] * 127, [1] * 128, [1] * 129),
    "messages": (USER, HISTORY, [{"role": "user", "content": ""}], [{"role": "assistant", "content": "x"}],
                 [{"role": "tool", "content": "x"}],
                 [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}],
                 [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
                 [{"role": "user", "content": "x" * 3000}], [{"role": "assistant", "content": None}],
                 [{"role": "user", "content": "x", "tool_calls": []}],
                 [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
                 [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    "input": ("", "hi", [{"role": "user", "content": "x"}], [{"type": "reasoning", "summary": []}],
              [{"role": "assistant", "content": "x", "status": "in_progress"}],
              [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
              [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"}]}],
              [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    "tools": (TOOLS, FLAT_TOOLS, ANTHROPIC_TOOLS, [], [{"type": "function", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"$defs": {"a": {}}, "type": "object"}}},
               {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"a": {"type": "integer"}}}}}],
              [{"type": "function", "name": "f",
                "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}}],
              [{"type": "web_search"}], [{"name": "f", "input_schema": {"type": "array"}}],
              [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]),
    "tool_choice": ("none", "auto", "required", "any", {"type": "function", "function": {"name": "get_time"}},
                    {"type": "function", "name": "get_time"}, {"type": "tool", "name": "get_weather"}, {"type": "any"},
                    {"type": "auto", "disable_parallel_tool_use": True}, {"type": "none"}, {"type": "tool"},
                    {"type": "function", "function": {"name": "nope"}}, {"type": "web_search_preview"}),
    "response_format": ({"type": "text"}, {"type": "json_object"}, *({"type": "json_schema", "json_schema": {
        "name": "x", "schema": sch}} for sch in SCHEMAS_JSON), {"type": "structural_tag", "format": {}},
        {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a"]},
        {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}}),
    "text": ({"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"verbosity": "low"},
             *({"format": {"type": "json_schema", "name": "x", "schema": sch}} for sch in SCHEMAS_JSON)),
    "output_config": ({"format": {"type": "json_schema", "schema": CLOCK}}, {"effort": "low"},
                      *({"format": {"type": "json_schema", "schema": sch}} for sch in SCHEMAS_JSON)),
    "structured_outputs": (*FORCING, {"choice": ["a"]}, {"choice": []}, {"choice": [""]}, {"regex": "a+"},
                           {"regex": "("},
                           {"regex": "a{1,99999}"}, {"regex": ""}, {"json": WEATHER}, {"json": "{"}, {"json": {}},
                           {"grammar": 'root ::= "a"'}, {"grammar": "root ::= "}, {"grammar": ""},
                           {"json_object": True}, {"json_object": False}, {"structural_tag": "{}"},
                           {"structural_tag": {"type": "structural_tag", "format": {"type": "const_string",
                                                                                     "value": "x"}}},
                           {"choice": ["a"], "regex": "b"},
                           {"json": {"type": "integer"}, "disable_any_whitespace": True},
                           *({"json": sch} for sch in SCHEMAS_JSON)),
    "guided_json": (*SCHEMAS_JSON, "{", '{"type": "integer"}', ""),
    "guided_regex": ("a+", "(", "", "[", "a{0}", "\\", "(a|b)*c", "a{1,99999}", "\\d{3}"),
    "guided_choice": (["a", "b"], [], [""], ["a"] * 300, *([text] for text in FORCED)),
    "guided_grammar": ('root ::= "a"', "root ::=", "", 'root ::= [a-z]+', "x ::= y", 'root ::= root "a"'),
    "structural_tag": ("{}", '{"type": "structural_tag"}', "x", '{"structures": [], "triggers": []}'),
    "logit_bias": ({"5": 100}, {"0": -100}, {"383": 1e9}, {"384": 1}, {"999999999": 1}, {"-1": 1}, {"00005": 1},
                   {"5": -1e308}, {str(i): 1 for i in range(384)}),
    "chat_template_kwargs": ({"enable_thinking": False}, {"tools": 1}, {"messages": []}, {"add_generation_prompt": 1},
                             {"self": 1}, {"reasoning_effort": "x"}, {"documents": 5}),
    "chat_template": ("{{ messages }}", "{% for %}", "", "{{ raise_exception('x') }}", "{{ 1/0 }}"),
    "system": ("", "be brief", [{"type": "text", "text": "x"}], [{"type": "image"}], [], [{"type": "text"}]),
    "vllm_xargs": ({"a": 1}, {"a": [1, "b", 2.5]}, {"": ""}),
    "stream_options": ({}, {"include_usage": True}, {"include_usage": False, "continuous_usage_stats": True},
                       {"include_usage": None}),
    "repetition_penalty": (5e-324, 1e-30, 1e30, 1e308),
    "repetition_detection": ({"max_pattern_size": 4, "min_count": 2}, {"max_pattern_size": 1, "min_pattern_size": 2},
                             {"min_count": 2}, {}),
    "documents": ([{"title": "a", "text": "b"}], [], [{}]),
    "include": (["message.output_text.logprobs"], ["reasoning.encrypted_content"], []),
    "reasoning": ({"effort": "none"}, {"effort": "high", "summary": "auto"}, {}),
    "metadata": ({"a": "b"}, {}, {"a": 1}),
    "thinking": ({"type": "enabled", "budget_tokens": 10}, {"type": "disabled"}),
    "tokens": ([], [0], [383], [384], [-1], [2**31], list(range(384)), [1] * 5000),
    "model": ("", "nope", "x" * 2000),
    "request_id": ("a", "dup", "x" * 1024, "x" * 1025, "a\nb", " a"),
    "prompt_embeds": ("", "AAAA", ["AAAA"], []),
}


def typed(rng: random.Random, tp, name: str = ""):
    """A value of (about) the type ``tp`` of a schema's field: mostly at an edge of its range."""
    if name in SPECIAL and rng.random() < 0.6:
        return json.loads(json.dumps(rng.choice(SPECIAL[name])))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return typed(rng, args[0], name)
    if origin in (typing.Union, types.UnionType):
        return typed(rng, rng.choice(args), name)
    if origin is typing.Literal:
        return rng.choice(args) if rng.random() < 0.8 else rng.choice(WORDS)
    if tp is type(None):
        return None
    if tp is bool:
        return rng.random() < 0.5 if rng.random() < 0.9 else rng.choice(["true", "false", 0, 1, "yes"])
    if tp is int:
        return rng.choice(INTS) if rng.random() < 0.9 else rng.choice([1.0, "5", 2.5])
    if tp is float:
        return rng.choice(FLOATS) if rng.random() < 0.9 else rng.choice(INTS[:12])
    if tp is str:
        word = rng.choice(WORDS)
        return word * rng.choice([1, 1, 3, 300]) if word else word
    if origin is list:
        size = rng.choice([0, 1, 1, 2, 3, 40, 1025])
        return [typed(rng, args[0], name) for _ in range(size)]
    if origin is dict:
        return {str(typed(rng, args[0])): typed(rng, args[1]) for _ in range(rng.choice([0, 1, 2, 3]))}
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        fields = tp.model_fields
        return {k: typed(rng, f.annotation, k) for k, f in fields.items() if rng.random() < 0.6}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return {f.name: typed(rng, hints[f.name], f.name) for f in dataclasses.fields(tp) if rng.random() < 0.4}
    return weird(rng)


def places(value, path=()) -> list[tuple]:
    """The paths of every value inside a body (below its top level), depth first."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        if path:
            out.append((*path, key))
        out += places(sub, (*path, key))
    return out


def mutate(rng: random.Random, path: str, body: dict) -> str:
    """Change one thing in ``body`` (in place); say what, for the failure's message."""
    op = rng.randrange(12)
    if op <= 3 or not places(body):  # a field of this endpoint, or one it does not have
        name = rng.choice(FIELDS[path]) if rng.random() < 0.85 else rng.choice(KEYS + ("ignore_me", "Prompt"))
        info = next((s.model_fields[name] for s in SCHEMAS[path] if name in s.model_fields), None)
        body[name] = typed(rng, info.annotation, name) if info is not None and op <= 2 else weird(rng)
        return f"{name}={short(body[name])}"
    if op == 4 and body:  # drop a top-level field
        name = rng.choice(sorted(body))
        del body[name]
        return f"del {name}"
    where = rng.choice(places(body))
    parent = body
    for key in where[:-1]:
        parent = parent[key]
    key, old = where[-1], parent[where[-1]]
    if op in (5, 6):
        parent[key] = weird(rng)
    elif op in (7, 10, 11):  # the same type, another value
        parent[key] = typed(rng, type(old), str(key)) if isinstance(old, (bool, int, float, str)) else weird(rng)
    elif op == 8:
        parent[key] = rng.choice([[old], {"value": old}, str(old) if not isinstance(old, str) else [old],
                                  old if not isinstance(old, (int, float)) or isinstance(old, bool) else -old])
    elif isinstance(parent, dict):
        if rng.random() < 0.5:
            del parent[key]
        else:
            parent[rng.choice(KEYS)] = weird(rng)
    else:
        parent.insert(rng.randrange(len(parent) + 1), rng.choice([old, weird(rng)]))
    return f"{'.'.join(map(str, where))}={short(parent.get(key) if isinstance(parent, dict) else old)}"


def force(rng: random.Random, path: str, body: dict) -> None:
    """The model's output forced to one of FORCED (its tool-call or reasoning syntax), maybe cut short."""
    for name in ("response_format", "text", "use_beam_search"):
        body.pop(name, None)
    if "tools" in body:
        body["tool_choice"] = "auto"
    body["structured_outputs"] = rng.choice(FORCING)
    body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = rng.choice([4, 40, 120])


def short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def as_bytes(rng: random.Random, body: dict) -> tuple[bytes, dict[str, str], str]:
    """The body as it is sent: mostly JSON (Python's, which writes NaN and Infinity, and escapes lone
    surrogates), sometimes spoiled; the headers; what was done."""
    text = json.dumps(body)  # ensure_ascii: a lone surrogate as its \\u escape
    headers = {"Content-Type": "application/json"}
    roll = rng.randrange(40)
    if roll == 0:
        return text[:rng.randrange(len(text))].encode(), headers, "truncated"
    if roll == 1 and body:  # duplicate keys: json.loads keeps the last
        key = rng.choice(sorted(body))
        return ("{" + json.dumps(key) + ": " + json.dumps(weird(rng)) + ", " + text[1:]).encode(), headers, \
            f"duplicate {key}"
    if roll == 2:
        return json.dumps(weird(rng)).encode(), headers, "not an object"
    if roll == 3:
        return text.encode()[:-1] + rng.choice([b"\xff}", b"\xc0\xaf}", b"\xed\xa0\x80}", b"}garbage", b",}",
                                                 b"}}"]), headers, "bad bytes"
    if roll == 4:
        return b"\xef\xbb\xbf" + text.encode(), headers, "BOM"
    if roll == 5:
        headers["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", "",
                                              "multipart/form-data; boundary=x", "application/json; charset=latin-1"])
        return text.encode(), headers, f"content-type {headers['Content-Type']!r}"
    if roll == 6:
        return rng.choice([b"", b" ", b"null", b"{}", b"[]", b'"x"', b"{" * 20000, b"[" * 200 + b"]" * 200]), headers, \
            "odd body"
    if roll == 7:  # nested past the limit, or an integer past Python's int() limit, in a field
        key = rng.choice(sorted(body) or ["prompt"])
        value = rng.choice(["[" * 300 + "]" * 300, "1" * 5000, "-" + "9" * 4301, "1e999", "-1e999", "NaN", "1E400",
                            "0.0000000000000000000000000000001e-400", '"' + "\\ud800" * 3 + '"', '"\\u0000"'])
        return ("{" + json.dumps(key) + ": " + value + ", " + text[1:]).encode() if body else b"{}", headers, \
            f"raw {key}={value[:20]}"
    if roll == 8:
        headers["X-Request-Id"] = rng.choice([b"a", b"x" * 1025, b"a b", b"r\xe9", b"#1", b"id-1", b"-", b"a\tb",
                                              b"\x7e" * 1024])
        return text.encode(), headers, f"X-Request-Id {headers['X-Request-Id'][:20]!r}"
    return text.encode(), headers, ""


# ================================================================ what must come back

SDK_TYPES = {"text_completion": Completion, "chat.completion": ChatCompletion,
             "chat.completion.chunk": ChatCompletionChunk, "response": Response, "message": Message}
EVENTS = {"/v1/responses": pydantic.TypeAdapter(ResponseStreamEvent),
          "/v1/messages": pydantic.TypeAdapter(RawMessageStreamEvent)}

class Failures(logging.Handler):
    """Every record at ERROR or above, or carrying a traceback, of any logger; and the engine's word that
    a grammar refused a sampled token (the sampler drew one its bitmask did not allow)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.ERROR or record.exc_info or "Traceback" in message or (
                record.name == "nanoserve.engine" and "grammar refused" in message):
            self.records.append(record)


def check_error(path: str, r: httpx.Response, body) -> dict:
    """A 4xx in its API's error shape; the field it names one that was sent (or left out)."""
    err = r.json()
    if path.startswith("/v1/messages"):  # Anthropic's shape
        assert set(err) == {"type", "error"} and err["type"] == "error", err
        err = err["error"]
        assert set(err) == {"type", "message"} and isinstance(err["message"], str) and err["message"], err
        assert err["type"] != "api_error", err  # Anthropic's for a 5xx
        return err
    assert set(err) == {"error"}, err
    err = err["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == r.status_code and isinstance(err["message"], str) and err["message"], err
    assert err["message"] == err["message"].lstrip(), err  # a sentence, not one whose subject is missing
    param = err["param"]
    if param is not None and isinstance(body, dict):
        assert isinstance(param, str), err
        root = param.split(".")[0].split("[")[0]
        assert root in map(esc, body) or root in REQUIRED, f"the error names {param!r}, not a field of the body: {err}"
    return err


def check_stream(path: str, text: str) -> str:
    """A stream's events framed as its API frames them, ending as it ends one; the last event's kind."""
    assert text.endswith("\n\n"), text[-300:]
    frames = text[:-2].split("\n\n")
    if path in ("/v1/responses", "/v1/messages"):  # named events, no [DONE]
        kinds = []
        for frame in frames:
            head, data = frame.split("\n")
            kind = head.removeprefix("event: ")
            assert head.startswith("event: ") and data.startswith("data: "), frame
            event = json.loads(data[len("data: "):])
            assert event["type"] == kind, frame
            kinds.append(kind)
            if kind == "error":
                code = event.get("code") or event["error"]["type"]
                assert code not in ("api_error", "overloaded_error") and not str(code).startswith("5"), frame
            else:
                EVENTS[path].validate_python(event)
            if kind.startswith("content_block_"):  # Anthropic's blocks: numbered from 0, each stopped before the next
                last = kinds.count("content_block_start") - 1
                assert event["index"] == last == kinds[:-1].count("content_block_stop"), (kinds, event)
        end = {"/v1/responses": "response.completed", "/v1/messages": "message_stop"}[path]
        assert kinds[-1] in (end, "error"), kinds
        if kinds[-1] == end and path == "/v1/messages":
            assert kinds.count("content_block_start") == kinds.count("content_block_stop"), kinds
        return kinds[-1]
    assert frames[-1] == "data: [DONE]", text[-300:]
    finished = Counter()
    for frame in frames[:-1]:
        assert frame.startswith("data: ") and "\n" not in frame, repr(frame)
        event = json.loads(frame[len("data: "):])
        if "error" in event:
            assert event["error"]["code"] < 500, frame
            return "error"
        if event["object"] != "text_completion":  # the SDK's type has no null finish_reason, which a chunk has
            check_shape(event)
        finished.update(c["index"] for c in event["choices"] if c["finish_reason"] is not None)
    # every choice (prompts x n of them) ends once; none is lost
    assert sorted(finished) == list(range(len(finished))) and set(finished.values()) == {1}, finished
    return "[DONE]"


def check_shape(obj: dict) -> None:
    """A whole answer or a chunk of a stream as the SDK's type of it reads it, but for what vLLM (and
    nanoserve) answer otherwise on purpose: a completion's first echoed token has a null logprob (OpenAI's
    legacy answer too), a continued chat message has the role of the message it continues, and
    repetition_detection's finish_reason is "repetition"."""
    kind = "message" if obj.get("type") == "message" else obj.get("object")
    if kind in ("text_completion", "chat.completion"):  # every choice, each once, none still running
        assert [c["index"] for c in obj["choices"]] == list(range(len(obj["choices"]))), obj["choices"]
        assert all(c["finish_reason"] is not None for c in obj["choices"]), obj["choices"]
    if kind in SDK_TYPES:
        obj = json.loads(json.dumps(obj))
        for choice in obj.get("choices", ()):
            if isinstance(choice.get("logprobs"), dict) and "token_logprobs" in choice["logprobs"]:
                for key, blank in (("token_logprobs", 0.0), ("top_logprobs", {})):
                    if choice["logprobs"][key] and choice["logprobs"][key][0] is None:
                        choice["logprobs"][key][0] = blank
            for key in ("message", "delta"):
                if isinstance(choice.get(key), dict) and choice[key].get("role") is not None:
                    choice[key]["role"] = "assistant"
            if choice.get("finish_reason") == "repetition":
                choice["finish_reason"] = "stop"
        SDK_TYPES[kind].model_validate(obj)
    else:
        assert set(obj) in ({"count", "max_model_len", "tokens", "token_strs"}, {"prompt"},
                            {"input_tokens", "context_management"}), obj


def send(client: httpx.Client, url: str, rng: random.Random, coverage: Counter) -> str:
    """One fuzzed request, its answer checked; what it was, for a failure's message."""
    roll = rng.randrange(50)
    if roll == 0:
        path = rng.choice(GETS)
        r = client.get(url + path)
        coverage[f"GET {path} {r.status_code}"] += 1
        assert r.status_code < 500 and (r.status_code < 400 or check_error(path, r, None)), (path, r.text)
        return f"GET {path}"
    if roll == 1:  # another method or another path
        path = rng.choice([*OTHER_PATHS, *BASES])
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "POST"])
        r = client.request(method, url + path, content=b'{"prompt": "x"}')
        coverage[f"other {r.status_code}"] += 1
        assert r.status_code < 500 and (r.status_code < 400 or check_error(path, r, None)), (method, path, r.text)
        return f"{method} {path}"
    path = rng.choice(list(BASES))
    body = json.loads(json.dumps(rng.choice(BASES[path])))
    if path in ("/v1/completions", "/v1/chat/completions", "/v1/responses") and rng.random() < 0.15:
        force(rng, path, body)
    what = [mutate(rng, path, body) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
    raw, headers, spoiled = as_bytes(rng, body)
    what = f"POST {path} {' '.join(filter(None, [*what, spoiled]))}: {raw[:300]!r}"
    if roll == 2:  # a client that sends it and leaves
        hang_up(url, path, raw, rng.choice([0, 0, 1, 200, 600, 2000]))
        coverage["hung up"] += 1
        return what
    try:
        answer(client, url, path, raw, headers, coverage)
    except (AssertionError, httpx.HTTPError, pydantic.ValidationError) as e:
        raise AssertionError(f"{what}: {type(e).__name__}: {e}") from None
    return what


def answer(client: httpx.Client, url: str, path: str, raw: bytes, headers: dict, coverage: Counter) -> None:
    r = client.post(url + path, content=raw, headers=headers)
    coverage[f"{path} {r.status_code}"] += 1
    assert r.status_code < 500, r.text[:500]
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if r.status_code >= 400:
        err = check_error(path, r, parsed)
        coverage["param named" if err.get("param") else "no param"] += 1
    elif r.headers["content-type"].startswith("text/event-stream"):
        coverage[f"stream ended by {check_stream(path, r.text)}"] += 1
    else:
        check_shape(r.json())
    if r.status_code == 200 and any(word in r.text for word in ('"tool_calls":[{', '"function_call"', '"tool_use"')):
        coverage["tool calls parsed"] += 1
    if r.status_code == 200 and any(word in r.text for word in ('"reasoning_content":"', '"thinking":"')):
        coverage["reasoning parsed"] += 1


def hang_up(url: str, path: str, raw: bytes, read: int) -> None:
    """Send the request on a socket of its own, read up to ``read`` bytes of the answer, and close it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        got = 0
        with contextlib.suppress(ConnectionResetError):  # an answer before the whole body (a 413): the rest unread
            while got < read and (chunk := s.recv(read - got)):
                got += len(chunk)


def fuzz(server: ServerThread, seed: int, requests: int, coverage: Counter, deadline: float | None = None,
         failed: list[str] | None = None, slow: list | None = None) -> int:
    """``requests`` fuzzed requests (fewer if ``deadline`` passes); how many were sent. A failed check
    raises, or with ``failed`` is added to it and the next request is sent; ``slow`` collects (seconds,
    request) of the slowest."""
    rng = random.Random(seed)
    with httpx.Client(timeout=TIMEOUT) as client:
        for i in range(requests):
            if deadline is not None and time.monotonic() > deadline:
                return i
            t = time.monotonic()
            try:
                what = send(client, server.url, rng, coverage)
                if slow is not None:
                    heapq.heappushpop(slow, (time.monotonic() - t, what)) if len(slow) >= 10 else \
                        heapq.heappush(slow, (time.monotonic() - t, what))
            except (AssertionError, httpx.HTTPError, pydantic.ValidationError) as e:
                if failed is None:
                    raise AssertionError(f"seed {seed} request {i}: {e}") from e
                failed.append(ascii_safe(f"seed {seed} request {i}: {type(e).__name__}: {str(e)[:1500]}"))
                print("FAIL", failed[-1], flush=True)
                client = httpx.Client(timeout=TIMEOUT)  # the connection may be gone
    return requests


def ascii_safe(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


def check_still_serving(server: ServerThread) -> None:
    """Idle (nothing running or waiting, every KV block free), and an ordinary request is served."""
    server.wait_idle(timeout=30)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0},
                   timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    server.wait_idle(timeout=30)
    metrics = _metrics(server.url)  # Prometheus' text, parsed; the gauges back at rest
    assert metrics["nanoserve:num_requests_running"] == metrics["nanoserve:num_requests_waiting"] == 0, metrics
    assert metrics["nanoserve:kv_cache_usage_perc"] == 0, metrics


def start_server(model_dir: Path, template_dir: Path, config: int = 0) -> ServerThread:
    template = template_dir / "tools.jinja"
    template.write_text(TEMPLATE)
    return ServerThread(model_dir, *FLAGS, *CONFIGS[config], "--chat-template", str(template))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with start_server(tiny_model, tmp_path_factory.mktemp("api_fuzz")) as s:
        yield s


@pytest.fixture
def failures():
    handler = Failures()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@pytest.mark.timeout(300)
def test_api_fuzz(server, failures):
    coverage = Counter()
    for seed in CI_SEEDS:
        fuzz(server, seed, CI_REQUESTS, coverage)
        check_still_serving(server)
    assert not failures.records, [failures.format(r) for r in failures.records[:3]]
    print(sorted(coverage.items()))
    # the draw reaches each endpoint's 200 and 400, streams, and the spoiled bodies
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert coverage[f"{path} 200"] and coverage[f"{path} 400"], path
    assert coverage["stream ended by [DONE]"] and coverage["hung up"] and coverage["param named"]


# ================================================================ many seeds, by hand

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--start", type=int, default=100, help="the first seed")
    ap.add_argument("--requests", type=int, default=2000, help="requests a seed")
    ap.add_argument("--minutes", type=float, default=None, help="send no request after this long")
    ap.add_argument("--config", type=int, default=None, choices=range(len(CONFIGS)),
                    help="the server's flags: CONFIGS[i] (default: seed modulo their number)")
    ap.add_argument("--clients", type=int, default=1, help="clients sending at once, each its own seed's requests")
    ap.add_argument("--root", default=None, help="where the tiny model is saved (default: a temporary directory)")
    args = ap.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="nanoserve-api-fuzz-"))
    handler = Failures()
    logging.getLogger().addHandler(handler)
    deadline = None if args.minutes is None else time.monotonic() + 60 * args.minutes
    coverage, fails, slow, sent, t0 = Counter(), [], [], 0, time.monotonic()
    model = make_model(root, "qwen3")
    for seed in range(args.start, args.start + args.seeds):
        if deadline is not None and time.monotonic() > deadline:
            break
        config = seed % len(CONFIGS) if args.config is None else args.config
        with start_server(model, root, config) as server:
            print(f"seed {seed} on {' '.join(CONFIGS[config])}", flush=True)
            before = len(handler.records)
            try:
                with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:  # client j's seed: seed * 100 + j
                    sent += sum(pool.map(lambda j: fuzz(server, seed if args.clients == 1 else seed * 100 + j,
                                                        args.requests, coverage, deadline, fails, slow),
                                         range(args.clients)))
                check_still_serving(server)
            except AssertionError as e:
                fails.append(ascii_safe(f"seed {seed}: {str(e)[:1500]}"))
                print("FAIL", fails[-1], flush=True)
            for record in handler.records[before:]:
                fails.append(ascii_safe(f"seed {seed} logged: {handler.format(record)[:3000]}"))
                print("FAIL", fails[-1], flush=True)
            print(f"seed {seed}: {sent} requests so far, {time.monotonic() - t0:.0f} s", flush=True)
    print(f"{sent} requests in {time.monotonic() - t0:.0f} s; coverage:")
    for k, v in sorted(coverage.items()):
        print(f"  {k}: {v}")
    print("slowest:")
    for took, what in sorted(slow, reverse=True):
        print(f"  {took:.1f} s: {ascii_safe(what[:300])}")
    print(f"{len(fails)} failures")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
