"""The OpenAI protocol of the entry layer: request bodies as pydantic models (as
vLLM's ``entrypoints/openai/protocol.py``), the error shape, and the few places
where completions and chat shape their responses differently.

Types and defaults are declared here, strictly (no "1" for 1, no 1 for true);
value ranges are checked where SamplingParams checks them, so the offline LLM
and the server share one rule, and an engine error is reported under the
request's own field name (``param_name``). Every declared field is used or
refused; unknown fields are ignored with a warning, as vLLM does, so that newer
clients keep working. A null is the field's default.
"""
from __future__ import annotations

import json
import logging
import re
import types
import typing
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.responses import Response

from nanoserve.engine import (CompletionOutput, InvalidInput, LLMEngine, SamplingParams, TokenizedPrompt,
                              apply_chat_template)

logger = logging.getLogger("nanoserve.entry")

MAX_N = 128  # completions per prompt (n)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into JSON text


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {message, type, param, code}}."""
    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
             429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


Number = Annotated[float, Field(allow_inf_nan=False)]
ROLES = ("system", "developer", "user", "assistant", "tool")
# SamplingParams fields that the request bodies carry under the same name
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                    "min_tokens", "skip_special_tokens")


class Refused(ValueError):
    """A rule broken across fields, raised from a model validator: names its field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class OpenAIBaseModel(_Strict):
    prompt_field: ClassVar[str] = "prompt"  # where the engine's "prompt" came from

    model: str | None = None

    def param_name(self, engine_param: str) -> str:
        """This body's name for what an engine error calls ``engine_param``."""
        return {"prompt": self.prompt_field, "request_id": "X-Request-Id"}.get(engine_param, engine_param)

    def invalid(self, e: InvalidInput) -> ApiError:
        """An engine error as a 400, in the words of this body's own fields."""
        name, message = self.param_name(e.param), str(e)
        if name != e.param and message.startswith(e.param):
            message = name + message[len(e.param):]
        return bad_request(message, name)


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(OpenAIBaseModel):
    """The fields completions and chat share (OpenAI's, and vLLM's extras)."""
    object_name: ClassVar[str]
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]

    n: int = Field(1, le=MAX_N)
    best_of: int | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: int = 0
    min_p: Number = 0.0
    seed: int | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    logit_bias: dict[str, Number] | None = Field(
        None, description="an object mapping token ids to numbers in [-100, 100]")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description='an object such as {"include_usage": true}')
    user: str | None = None  # the caller's end user: logged with the request

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float]) -> dict[str, float]:
        for key, bias in v.items():
            if not re.fullmatch(r"\d{1,9}", key):
                raise ValueError(f"logit_bias keys must be token ids, got {show(key)}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {show(bias)}")
        return v

    @field_validator("spaces_between_special_tokens")
    @classmethod
    def _spaces(cls, v: bool) -> bool:
        if not v:  # fast tokenizers decode as they do, like vLLM's detokenizer does for them
            raise ValueError("spaces_between_special_tokens=false is not supported")
        return v

    @model_validator(mode="after")
    def _shared_rules(self) -> "GenerationRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise Refused("best_of", "best_of is not supported: leave it out or make it equal to n")
        if self.stream_options is not None and not self.stream:
            raise Refused("stream_options", "stream_options needs stream: true")
        return self

    def sampling_params(self) -> SamplingParams:
        """Raises InvalidInput (SamplingParams checks the ranges)."""
        bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        return SamplingParams(**{name: getattr(self, name) for name in _SAMPLING_FIELDS}, logit_bias=bias,
                              max_tokens=self.requested_max_tokens(), logprobs=self.requested_logprobs())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    # what differs between the two endpoints
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        raise NotImplementedError

    def num_prompts(self) -> int:
        return 1

    def prompt_inputs(self, engine: LLMEngine) -> list[str | list[int]]:
        """The prompts to tokenize (on the tokenizer thread)."""
        raise NotImplementedError

    def process_prompts(self, engine: LLMEngine) -> list[TokenizedPrompt]:
        """On the tokenizer thread: render, tokenize and check every prompt."""
        return [engine.process_prompt(p) for p in self.prompt_inputs(engine)]

    def check_length(self, num_prompt: int, max_tokens: int | None, max_model_len: int) -> None:
        """OpenAI's rule: prompt + max_tokens must fit (the engine alone would cap
        max_tokens). A prompt too long by itself is the engine's error, raised first."""
        if max_tokens is not None and num_prompt + max_tokens > max_model_len:
            name, what = self.param_name("max_tokens"), self.prompt_field
            raise bad_request(
                f"this model's max-model-len is {max_model_len} tokens, but the request needs "
                f"{num_prompt + max_tokens}: {num_prompt} in the {what} and {name}={max_tokens}; lower {name} "
                f"to at most {max(max_model_len - num_prompt, 0)} or shorten the {what}", name)

    def wants_echo(self) -> bool:
        return False

    def choice(self, index: int, text: str, logprobs: dict | None, c: CompletionOutput, stream: bool) -> dict:
        raise NotImplementedError

    def logprobs_body(self, tokens: list[tuple[str, float, list[tuple[str, float]]]], text_offset: int) -> dict:
        raise NotImplementedError

    def first_chunks(self, head: dict) -> list[dict]:
        return []


class CompletionRequest(GenerationRequest):
    object_name: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"
    id_prefix: ClassVar[str] = "cmpl-"

    prompt: Any = Field(None, description="a string, a list of strings, a list of token ids, "
                                          "or a list of token-id lists")
    max_tokens: int = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: None = Field(None, description="left out: suffix is not supported")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, p: Any) -> list[str | list[int]]:
        """Only the shape: the engine checks the token ids, after the cheap length bound."""
        rule = "a string, a list of strings, a list of token ids, or a list of token-id lists"
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list) or not p:
            raise ValueError(f"prompt must be {rule} (and not empty), got {show(p)}")
        if isinstance(p[0], int) and not isinstance(p[0], bool):
            return [p]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) and x for x in p):
            return list(p)
        raise ValueError(f"prompt must be {rule}, got {show(p)}")

    @model_validator(mode="after")
    def _completion_rules(self) -> "CompletionRequest":
        if self.prompt is None:
            raise Refused("prompt", "prompt is required: a string, a list of strings, a list of token ids, "
                                    "or a list of token-id lists")
        if self.echo and self.logprobs is not None:
            raise Refused("echo", "echo together with logprobs would need the prompt's logprobs, which "
                                  "nanoserve does not compute; drop one of them")
        return self

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompts(self) -> int:
        return len(self.prompt)

    def prompt_inputs(self, engine: LLMEngine) -> list[str | list[int]]:
        return self.prompt

    def wants_echo(self) -> bool:
        return self.echo

    def choice(self, index: int, text: str, logprobs: dict | None, c: CompletionOutput, stream: bool) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def logprobs_body(self, tokens, text_offset: int) -> dict:
        """The legacy shape: parallel lists, top_logprobs keyed by token text."""
        offsets = []
        for text, _, _ in tokens:
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": [t for t, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens],
                "top_logprobs": [dict(ranked) for _, _, ranked in tokens], "text_offset": offsets}


class ChatCompletionRequest(GenerationRequest):
    object_name: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"
    id_prefix: ClassVar[str] = "chatcmpl-"
    prompt_field: ClassVar[str] = "messages"

    messages: Any = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens; it wins
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    response_format: dict | None = Field(None, description='{"type": "text"}: structured output is not supported')
    tools: list | None = Field(None, description="left out: tools (function calling) are not supported")
    tool_choice: typing.Literal["none", "auto"] | None = Field(
        None, description='"none" or "auto": tool_choice is not supported')

    _messages = field_validator("messages")(classmethod(lambda cls, v: parse_messages(v)))

    @model_validator(mode="after")
    def _chat_rules(self) -> "ChatCompletionRequest":
        if self.messages is None:
            raise Refused("messages", "messages is required: a non-empty list of {role, content} objects")
        if self.response_format not in (None, {"type": "text"}):
            raise Refused("response_format", 'response_format must be {"type": "text"}: structured output '
                                             "is not supported")
        if self.tools:
            raise Refused("tools", "tools (function calling) are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise Refused("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def param_name(self, engine_param: str) -> str:
        if engine_param == "max_tokens":
            return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return "top_logprobs" if engine_param == "logprobs" else super().param_name(engine_param)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_inputs(self, engine: LLMEngine) -> list[str | list[int]]:
        return [apply_chat_template(engine.tokenizer, self.messages,
                                    add_generation_prompt=self.add_generation_prompt)]

    def choice(self, index: int, text: str, logprobs: dict | None, c: CompletionOutput, stream: bool) -> dict:
        body = ({"delta": {"content": text} if text else {}} if stream
                else {"message": {"role": "assistant", "content": text}})
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def logprobs_body(self, tokens, text_offset: int) -> dict:
        def item(text: str, lp: float | None) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        top = self.top_logprobs or 0
        return {"content": [{**item(text, lp), "top_logprobs": [item(t, v) for t, v in ranked[:top]]}
                            for text, lp, ranked in tokens]}

    def first_chunks(self, head: dict) -> list[dict]:  # the first delta of each choice carries the role
        return [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]} for i in range(self.n)]


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    _messages = field_validator("messages")(classmethod(lambda cls, v: parse_messages(v)))

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if self.prompt is None and self.messages is None:
            raise Refused("prompt", "prompt (a string) or messages is required")
        return self

    def param_name(self, engine_param: str) -> str:
        return "messages" if engine_param == "prompt" and self.messages is not None else engine_param

    def run(self, engine: LLMEngine) -> dict[str, Any]:
        """The response (on the tokenizer thread; raises InvalidInput)."""
        text = self.prompt
        if self.messages is not None:
            text = apply_chat_template(engine.tokenizer, self.messages,
                                       add_generation_prompt=self.add_generation_prompt)
        special = self.add_special_tokens if self.add_special_tokens is not None else self.messages is None
        _, ids = engine.tokenize(text, add_special_tokens=special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if self.return_token_strs:
            out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return out


class DetokenizeRequest(OpenAIBaseModel):
    tokens: list[int]

    def param_name(self, engine_param: str) -> str:
        return "tokens" if engine_param == "token_ids" else engine_param


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages -> [{role, content}] with text content."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, got {show(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with role and content, got {show(m)}")
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {show(m.get('role'))}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                 f"are supported, got {show(content)}")
            content = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of text parts, got {show(content)}")
        out.append({"role": m["role"], "content": content or ""})
    return out


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object of text: a lone surrogate (which JSON's
    \\u escapes can spell, and no tokenizer takes) is a 400 naming its field."""
    try:
        text = raw.decode("utf-8")  # strict: no encoded surrogates either
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    if not text.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    if _SURROGATE_ESCAPE.search(text):  # rare: only then walk the body to name the field
        for key, value in body.items():
            if not (_is_text(key) and _is_text(value)):
                raise bad_request(f"{esc(key)} holds a lone UTF-16 surrogate (such as \\ud800), which is not "
                                  f"text", esc(key))
    return body


def _is_text(value: Any) -> bool:
    """No lone surrogate anywhere in it (UTF-8 cannot encode one)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
    elif isinstance(value, list):
        return all(map(_is_text, value))
    elif isinstance(value, dict):
        return all(_is_text(k) and _is_text(v) for k, v in value.items())
    return True


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def parse_body(schema: type[OpenAIBaseModel], body: dict[str, Any], request_id: str) -> Any:
    """The body as ``schema``, or a 400 that names the first bad field."""
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        raise _validation_error(schema, body, e.errors(include_url=False)[0]) from None
    if req.model_extra:
        logger.warning("[entry] %s: ignoring unknown field(s): %s", request_id,
                       ", ".join(show(k) for k in sorted(req.model_extra)))
    return req


def _validation_error(schema: type[BaseModel], body: dict, err: dict) -> "ApiError":
    loc = err["loc"]
    name = str(loc[0]) if loc else None
    info = schema.model_fields.get(name)
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if err["type"] == "missing":
        return bad_request(f"{path} is required", name)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, Refused):
        return bad_request(str(cause), cause.param)
    if isinstance(cause, ValueError):
        return bad_request(str(cause), name)
    if info is not None and (err["type"].endswith(("_type", "_parsing", "literal_error", "none_required"))
                             or err["type"] in ("finite_number", "int_from_float")):
        return bad_request(f"{name} must be {info.description or _describe(info.annotation)}, "
                           f"got {show(body.get(name))}", name)
    msg = err["msg"][:1].lower() + err["msg"][1:]
    return bad_request(f"{path}: {msg}, got {show(err.get('input'))}", name)


_TYPE_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
               str: ("a string", "strings")}


def _describe(tp: Any, plural: bool = False) -> str:
    """What a field's annotation takes, in words: 'a string or a list of strings'."""
    origin, args = typing.get_origin(tp), [a for a in typing.get_args(tp) if a is not type(None)]
    if origin is Annotated:
        return _describe(args[0], plural)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a, plural) for a in args)
    if origin is list:
        return "lists" if plural else f"a list of {_describe(args[0], True)}"
    return _TYPE_WORDS.get(tp, ("an object", "objects"))[plural]


def show(value: Any) -> str:
    """A client's value for a message or a log line: JSON, short, and printable
    (escaped where it is not, so a newline cannot forge a log line and a lone
    surrogate cannot break the response's encoding)."""
    text = repr(value) if isinstance(value, float) else json.dumps(value, ensure_ascii=False, default=str)
    if not text.isprintable():
        text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def esc(text: str) -> str:
    """Client text inside a log line: as it is when printable, else escaped."""
    return text if text.isprintable() else json.dumps(text)[1:-1]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status, headers, media_type="application/json")


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
