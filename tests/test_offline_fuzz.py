"""A seeded fuzz of the two front doors that are not HTTP: the offline API (vLLM's ``LLM``: generate,
chat, beam_search, embed / encode, and the parameter classes they take) and the CLI's argument parsing.

Offline: each case builds a valid call (prompts as text, token ids, lists, prompt dicts or embeddings;
SamplingParams, BeamSearchParams, PoolingParams, StructuredOutputsParams, LoRARequest as keyword dicts
built inside the call, so that their own checks count) and mutates one or two of its values (wrong types,
NaN and infinities, negative, huge, empty, lone surrogates, wrong nesting, unknown keys, token ids out
of the vocabulary, lengths past max_model_len) or replaces a whole argument. The call must return a
valid result or raise ValueError or TypeError (what vLLM raises for bad input) with a one-line message
that names a parameter of the call, raised by nanoserve's own code (not from inside torch, the
tokenizer or jinja); never another exception, never a hang. After each case the engine is idle with
its KV blocks all free; every few cases, and at the end, a plain greedy generate gives the tokens it
gave at the start.

CLI: parse_args (what ``python -m nanoserve`` runs before anything loads) on the tiny model with one to
three flags given mutated values, repeated, left without a value, or unknown: a Namespace, or argparse's
exit 2 with one line on stderr; never a traceback. A few cases run ``python -m nanoserve`` itself.

CI runs CI_CASES offline and CI_CLI_CASES CLI cases of seed 0 (about 10 s, the two processes included).
A long run: ``NANOSERVE_FUZZ_CASES=3000 NANOSERVE_FUZZ_SEED=1 pytest tests/test_offline_fuzz.py -q -s -k fuzz``
(NANOSERVE_FUZZ_CLI_CASES: the CLI's count, default the larger of the two; NANOSERVE_FUZZ_VERBOSE=1 prints each
case as it starts, NANOSERVE_FUZZ_REPORT=FILE writes every failure there, not only the first 20).
"""
from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import random
import re
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_model  # noqa: E402
from nanoserve import LLM, LoRARequest, PoolingParams, SamplingParams  # noqa: E402
from nanoserve.engine import BeamSearchParams, InvalidInput, StructuredOutputsParams  # noqa: E402
from test_lora import make_adapter  # noqa: E402

CI_CASES = 600
CI_CLI_CASES = 2000
CASES = int(os.environ.get("NANOSERVE_FUZZ_CASES", CI_CASES))
CLI_CASES = int(os.environ.get("NANOSERVE_FUZZ_CLI_CASES", max(CI_CLI_CASES, CASES)))
SEED = int(os.environ.get("NANOSERVE_FUZZ_SEED", 0))
CALL_LIMIT = 120.0  # seconds: any case takes far less; past it the call hung
CHECK_EVERY = 20  # cases between greedy replays
MAX_MODEL_LEN = 64
NANOSERVE = str(Path(__file__).parents[1] / "nanoserve")

# ================================================================ what is sent


def weird(rng: random.Random, depth: int = 0):
    """A value of any type, mostly one a validator can get wrong."""
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.choice([None, True, False, object()])
    if kind == 1:
        return rng.choice([0, 1, -1, -2, 2, 3, 5, 63, 64, 65, 383, 384, 385, 1000, 2**31, 2**63 - 1, 2**63, 2**64,
                           -2**63 - 1, 10**30, -10**30])
    if kind == 2:
        return rng.choice([0.0, -0.0, 0.5, -0.5, 1.5, 2.0, 1e-300, 1e308, -1e308, float("nan"), float("inf"),
                           -float("inf")])
    if kind == 3:
        return rng.choice(["", " ", "a", "1", "-1", "nan", "the", "<|endoftext|>", "<|im_start|>", "\ud800",
                           "x\udfffy", "🙂", "你好", "\x00", "a" * 5000, "{", "auto", "user", "LAST", "text"])
    if kind == 4:
        return rng.choice([[], [1], [-1], [384], [2**63], [None], ["a"], [""], [1.5], [True], [[1, 2]], [[]],
                           [float("nan")], (1, 2), [5] * 200, list(range(129))])
    if kind == 5:
        return rng.choice([{}, {"a": 1}, {1: 2.0}, {"5": "x"}, {5: float("inf")}, {384: 1.0}, {-1: 1.0},
                           {"type": "text"}, {None: 1}])
    if kind == 6:
        return [weird(rng, depth + 1) for _ in range(rng.randrange(3))]
    if kind == 7:
        return {rng.choice(["a", "type", "prompt", "choice", "json", 5]): weird(rng, depth + 1)}
    return rng.choice([torch.tensor([1, 2]), torch.randn(3, 64), torch.randn(2, 7), torch.full((2, 64), math.nan),
                       torch.zeros(0, 64), torch.randn(1, 3, 64), torch.randn(2, 64).to(torch.float64),
                       torch.randint(0, 5, (3, 64)), torch.randn(100, 64)])


USER = [{"role": "user", "content": "hello world"}]
CONVERSATION = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "Hel"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def prompts_choice(rng: random.Random, embeds: bool = True):
    choices = ["hello world", ["the fox", "hello"], [5, 9, 11], [[5, 9], [40, 41, 42]], {"prompt": "hi"},
               [{"prompt_token_ids": [1, 2, 3]}, {"prompt": "x"}], [17] * 30]
    if embeds:
        choices.append({"prompt_embeds": torch.randn(4, 64)})
    return copy.deepcopy(rng.choice(choices))


SAMPLING = [
    {"temperature": 0, "max_tokens": 3},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "seed": 1, "max_tokens": 3, "n": 2, "logprobs": 2},
    {"max_tokens": 4, "stop": ["o"], "logit_bias": {5: 1.0}, "presence_penalty": 0.5, "frequency_penalty": 0.1,
     "repetition_penalty": 1.1, "min_tokens": 1, "temperature": 0},
    {"max_tokens": 3, "prompt_logprobs": 1, "allowed_token_ids": [5, 6, 7], "bad_words": ["the"],
     "stop_token_ids": [0], "temperature": 0, "min_p": 0.1},
    {"max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}, "temperature": 0},
    {"max_tokens": 4, "structured_outputs": {"json": {"type": "object"}}, "temperature": 0.5, "seed": 3},
    {"max_tokens": 3, "logprob_token_ids": [1, 2], "truncate_prompt_tokens": 2, "temperature": 0,
     "include_stop_str_in_output": True, "ignore_eos": True},
    {"max_tokens": 3, "repetition_detection": {"max_pattern_size": 2, "min_count": 2}, "stream_interval": 2,
     "extra_args": {"a": 1}, "skip_special_tokens": False, "detokenize": False},
    {"max_tokens": None, "truncate_prompt_tokens": -1, "temperature": 0},
]
BEAM = [{"beam_width": 2, "max_tokens": 3}, {"beam_width": 3, "max_tokens": 2, "length_penalty": 0.5, "logprobs": 2},
        {"beam_width": 2, "max_tokens": 3, "allowed_token_ids": [5, 6, 7, 8], "ignore_eos": True,
         "include_stop_str_in_output": True, "temperature": 0.0}]
POOLING = [{}, {"use_activation": False}, {"truncate_prompt_tokens": 3}, {"truncate_prompt_tokens": -1}]


def sampling(rng):
    return copy.deepcopy(rng.choice(SAMPLING))


def base_call(rng: random.Random, lora_path: str) -> tuple[str, dict]:
    """(method, keyword arguments) of a valid call; dict values under "sampling_params", "params",
    "pooling_params", "lora_request" and "structured_outputs" are made into their classes in the call."""
    method = rng.choice(["generate"] * 4 + ["chat"] * 2 + ["beam_search", "embed", "encode"])
    lora = {"lora_name": "a", "lora_int_id": 1, "lora_path": lora_path}
    if method == "generate":
        kw = {"prompts": prompts_choice(rng), "sampling_params": sampling(rng)}
        if rng.random() < 0.2:
            kw["lora_request"] = lora
        if rng.random() < 0.1:
            kw["priority"] = [0] * (2 if isinstance(kw["prompts"], list) and len(kw["prompts"]) == 2
                                    and not isinstance(kw["prompts"][0], int) else 1)
    elif method == "chat":
        kw = {"messages": copy.deepcopy(rng.choice([USER, [USER, USER], CONVERSATION])),
              "sampling_params": sampling(rng)}
        if isinstance(kw["messages"][-1], dict) and kw["messages"][-1]["content"] == "Hel":
            kw.update(continue_final_message=True, add_generation_prompt=False)
        for name, value in (("tools", TOOLS), ("chat_template_kwargs", {"enable_thinking": False}),
                            ("chat_template_content_format", "openai"), ("lora_request", lora),
                            ("chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")):
            if rng.random() < 0.2:
                kw[name] = copy.deepcopy(value)
    elif method == "beam_search":
        kw = {"prompts": prompts_choice(rng, embeds=False), "params": copy.deepcopy(rng.choice(BEAM))}
        if rng.random() < 0.3:
            kw["concurrency_limit"] = 1
    else:
        kw = {"prompts": prompts_choice(rng, embeds=False), "pooling_params": copy.deepcopy(rng.choice(POOLING))}
        if method == "encode":
            kw["pooling_task"] = "embed"
    return method, kw


def mutate(rng: random.Random, kw: dict) -> list[str]:
    """Change one or two of ``kw``'s values (top-level or one level into a params dict); returns the names
    touched: the parameters an error may name."""
    touched = []
    for _ in range(rng.choice([1, 1, 1, 2])):
        holders = [(None, kw)] + [(k, v) for k, v in kw.items() if isinstance(v, dict) and k != "prompts"]
        name, holder = rng.choice(holders)
        if name == "sampling_params" and "structured_outputs" in holder and rng.random() < 0.3 \
                and isinstance(holder["structured_outputs"], dict):
            name, holder = "structured_outputs", holder["structured_outputs"]
        op = rng.random()
        if op < 0.08:  # an unknown key
            key = rng.choice(["bogus", "use_beam_search", "best_of", "guided_json", "stop_str", ""])
            holder[key] = weird(rng)
        elif op < 0.16 and holder:  # a key left out
            key = rng.choice(sorted(holder, key=str))
            del holder[key]
        elif op < 0.24 and name is None:  # a whole argument replaced by another type
            key = rng.choice(sorted(holder, key=str))
            holder[key] = rng.choice([weird(rng), [weird(rng)], "x", [], {}])
        else:
            keys = list(holder) + ({"sampling_params": list(SamplingParams.__dataclass_fields__),
                                    "params": list(BeamSearchParams.__dataclass_fields__),
                                    "pooling_params": list(PoolingParams.__dataclass_fields__),
                                    "structured_outputs": list(StructuredOutputsParams.__dataclass_fields__),
                                    "lora_request": ["lora_name", "lora_int_id", "lora_path"]}.get(name, []))
            key = rng.choice([k for k in keys if not str(k).startswith("_")] or ["bogus"])
            holder[key] = mutate_value(rng, holder.get(key))
        touched += [key] + ([name] if name else [])
    return [str(t) for t in touched]


def mutate_value(rng: random.Random, value):
    """Something near ``value`` (its edge, its neighbour, a list with a bad element) or anything."""
    if rng.random() < 0.5:
        return weird(rng)
    if isinstance(value, bool) or value is None:
        return weird(rng)
    if isinstance(value, int):
        return rng.choice([value - 1, value + 1, -value, value * 1000, 0, -1, 2**63, MAX_MODEL_LEN,
                           MAX_MODEL_LEN - 1, 384, float(value), str(value)])
    if isinstance(value, float):
        return rng.choice([-value, value * 1e6, float("nan"), float("inf"), 0.0, 1e-9, 2.0, 2.0000001, str(value)])
    if isinstance(value, str):
        return rng.choice(["", value * 2000, value + "\ud800", value.upper(), " " + value, None])
    if isinstance(value, list) and value:
        out = list(value)
        out[rng.randrange(len(out))] = weird(rng)
        return rng.choice([out, out * 50, [out], value[:0], tuple(value)])
    if isinstance(value, dict) and value:
        out = dict(value)
        out[rng.choice(list(out))] = weird(rng)
        return out
    if isinstance(value, torch.Tensor):
        ops = [lambda: value.transpose(0, -1), lambda: value[..., :7], lambda: value * math.inf, value.half,
               lambda: value[None], value.to_sparse, lambda: torch.empty(0, 64),
               lambda: value.repeat(20, *[1] * (value.dim() - 1))]  # of a tensor of any shape
        return rng.choice(ops)()
    return weird(rng)


def build(method: str, kw: dict):
    """The call: params dicts become their classes here, so their checks are part of what is tested."""
    kw = dict(kw)
    for name, cls in (("sampling_params", SamplingParams), ("params", BeamSearchParams),
                      ("pooling_params", PoolingParams), ("lora_request", LoRARequest)):
        if isinstance(kw.get(name), dict) and all(isinstance(k, str) for k in kw[name]):
            fields = dict(kw[name])
            if cls is SamplingParams and isinstance(fields.get("structured_outputs"), dict) \
                    and all(isinstance(k, str) for k in fields["structured_outputs"]):
                fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
            kw[name] = cls(**fields)
    return kw


# ================================================================ the checks

OK_TYPES = (ValueError, TypeError)
UNEXPECTED_KW = re.compile(r"got an unexpected keyword argument '([^']*)'|missing \d+ required positional "
                           r"argument")


def call_names(kw: dict) -> set[str]:
    """Every parameter name of the call: its arguments', its params dicts'."""
    names = set()
    for k, v in kw.items():
        names.add(str(k))
        if isinstance(v, dict) and k != "prompts":
            names |= {str(n) for n in v}
            for n, sub in v.items():
                if isinstance(sub, dict):
                    names |= {str(s) for s in sub}
    return names | {"prompt", "prompts", "prompt_embeds", "model", "structured_outputs", "request_id"}


def judge(e: BaseException, method: str, kw: dict, touched: list[str]) -> str | None:
    """Why ``e`` is not a clear error for this call, or None."""
    if not isinstance(e, OK_TYPES):
        return f"{type(e).__name__} is not ValueError or TypeError"
    message = str(e)
    if not message.strip() or "\n" in message.strip():
        return "the message is not one line"
    if UNEXPECTED_KW.search(message):  # Python's own words for a keyword a class or method does not take
        return None
    frame = traceback.extract_tb(e.__traceback__)[-1]
    if NANOSERVE not in frame.filename and frame.filename != "<string>":  # <string>: a dataclass's __init__
        return f"raised in {frame.filename}:{frame.lineno}, not by nanoserve"
    names = call_names(kw) | set(touched)
    if isinstance(e, InvalidInput) and e.param in names | {"messages", "chat_template", "extra_args"}:
        return None
    if "lora_request" in names and "LoRA adapter" in message:  # the adapter's load: its path or files
        return None
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message))
    if not words & (names - {"n"}) and not re.search(r"\bn must\b", message):
        return "the message names none of the call's parameters"
    return None


def run_limited(fn, limit: float):
    """fn() on a thread; (result, exception); raises TimeoutError past ``limit`` seconds (a hang)."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            box["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        raise TimeoutError(f"no answer in {limit:.0f} s")
    return box.get("result"), box.get("error")


def check_result(method: str, kw: dict, result) -> str | None:
    if not isinstance(result, list) or not result:
        return f"{method} returned {type(result).__name__}"
    if method in ("generate", "chat", "beam_search"):
        for out in result:
            outs = out.sequences if method == "beam_search" else out.outputs
            if not outs or any(not isinstance(getattr(c, "token_ids", getattr(c, "tokens", None)), list)
                               for c in outs):
                return f"{method} returned an output without token ids: {out}"
    else:
        for out in result:
            data = out.outputs.embedding if method == "embed" else out.outputs.data.tolist()
            if not data or any(not math.isfinite(x) for x in data):
                return f"{method} returned a bad embedding: {data[:4]}"
    return None


def engine_idle(llm: LLM, free_at_start: int) -> str | None:
    engine = llm.engine
    if engine.has_unfinished_requests() or engine.beam_searches or engine.beam_children:
        return "requests left unfinished"
    free = engine.scheduler.block_manager.num_free_blocks
    if free != free_at_start:
        return f"{free_at_start - free} KV blocks leaked"
    return None


GREEDY_PROMPTS = [[5, 9, 11, 3, 8], "hello world"]


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, SamplingParams(temperature=0, max_tokens=6),
                                                          use_tqdm=False)]


# ================================================================ the offline fuzz

@pytest.fixture(scope="module")
def llms(model_root, tmp_path_factory):
    path = make_model(model_root, "qwen3")
    adapter = make_adapter(path, tmp_path_factory.mktemp("fuzz-lora") / "a", r=2)
    common = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=48, max_num_batched_tokens=32)
    gen = LLM(str(path), enable_prompt_embeds=True, enable_lora=True, max_loras=2, max_cpu_loras=4, **common)
    pool = LLM(str(path), runner="pooling", **common)
    return gen, pool, str(adapter)


def test_offline_api_fuzz(llms):
    gen, pool, adapter = llms
    want = greedy(gen)
    free = {id(gen): gen.engine.scheduler.block_manager.num_free_blocks,
            id(pool): pool.engine.scheduler.block_manager.num_free_blocks}
    rng, failures, counts = random.Random(SEED), [], {"ok": 0, "refused": 0}
    for case in range(CASES):
        method, kw = base_call(rng, adapter)
        touched = mutate(rng, kw) if rng.random() < 0.9 else []
        llm = pool if method in ("embed", "encode") else gen
        shown = f"case {case}: {method}({short(kw)}) touching {touched}"
        if os.environ.get("NANOSERVE_FUZZ_VERBOSE"):
            print(shown, file=sys.stderr, flush=True)
        try:
            result, error = run_limited(lambda: getattr(llm, method)(**build(method, kw), use_tqdm=False), CALL_LIMIT)
        except TimeoutError as e:
            failures.append(f"{shown}: {e}")
            break  # the engine is stuck: nothing after this case means anything
        if error is not None:
            why = judge(error, method, kw, touched)
            counts["refused"] += 1
            if why:
                failures.append(f"{shown}: {why}: {type(error).__name__}: {str(error)[:300]}\n"
                                + "".join(traceback.format_tb(error.__traceback__)[-3:]))
        else:
            counts["ok"] += 1
            if why := check_result(method, kw, result):
                failures.append(f"{shown}: {why}")
        if why := engine_idle(llm, free[id(llm)]):
            failures.append(f"{shown}: {why}")
            break
        if case % CHECK_EVERY == CHECK_EVERY - 1 and greedy(gen) != want:
            failures.append(f"{shown}: a greedy generate now gives other tokens")
            break
    assert greedy(gen) == want
    print(f"\noffline fuzz: {CASES} cases (seed {SEED}): {counts['ok']} results, {counts['refused']} refused, "
          f"{len(failures)} failures")
    assert counts["ok"] > CASES // 10 and counts["refused"] > CASES // 10  # both sides of the door were reached
    if os.environ.get("NANOSERVE_FUZZ_REPORT"):
        Path(os.environ["NANOSERVE_FUZZ_REPORT"]).write_text("\n".join(failures))
    assert not failures, "\n".join(failures[:20])


def short(value, limit: int = 240) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ================================================================ the CLI

CLI_VALUES = ("", " ", "0", "1", "2", "-1", "-2", "3", "8", "16", "17", "64", "128", "4096", "1.5", "-0.5", "1e3",
              "nan", "inf", "-inf", "1e999", "9" * 400, "99999999999999999999", "0x10", "32k", "32K", "1.5M", "2G",
              "1GiB", "512MiB", "0B", "auto", "none", "true", "false", "null", "{}", "[]", "[1]", '["*"]', '{"a": 1}',
              '{"pooling_type": "MEAN"}', '{"method": "ngram", "num_speculative_tokens": 2}',
              '{"cudagraph_capture_sizes": [1, 2]}', '{"max_new_tokens": -1}', '{"temperature": "x"}', "{",
              "[" * 2000, "a=b", "=", "x=", "/", "/api", "api", "tcp://h:1", "env://", "\udcff", "é", "🙂",
              "--", "-", "--model", "::1", "127.0.0.1", "x\x00", "fcfs", "priority", "hermes", "qwen3", "float32", "cpu", "cuda", "pooling",
              "embed", "generate", "string", "debug", "/nonexistent/file", "/dev/null")


def cli_flags():
    from nanoserve.entry import make_arg_parser
    return [a for a in make_arg_parser()._actions if a.option_strings and a.dest != "help"]


def cli_case(rng: random.Random, model: str, actions) -> list[str]:
    argv = [model]
    for _ in range(rng.choice([1, 1, 2, 3])):
        action = rng.choice(actions)
        flag = rng.choice(action.option_strings)
        if rng.random() < 0.1:
            flag = flag.replace("-", "_").replace("__", "--", 1)  # vLLM's other spelling
        if action.nargs == 0:  # a switch, or --no-NAME of BooleanOptionalAction
            argv.append(flag)
            continue
        values = [rng.choice(list(action.choices) if action.choices and rng.random() < 0.5 else CLI_VALUES)
                  for _ in range(rng.choice([1, 1, 1, 2]) if action.nargs in ("+", "*") else 1)]
        op = rng.random()
        if op < 0.05:
            argv.append(flag)  # no value
        elif op < 0.12:
            argv.append(f"{flag}={values[0]}")
        else:
            argv += [flag, *map(str, values)]
    if rng.random() < 0.05:
        argv.insert(rng.randrange(len(argv) + 1), rng.choice(["--bogus", "--max-model", "serve", "extra"]))
    return argv


def parse_outcome(argv: list[str]) -> tuple[str, str]:
    """("ok" | "refused" | "crashed", stderr or the traceback)."""
    from nanoserve import entry
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            entry.parse_args(argv)
    except SystemExit as e:
        text = err.getvalue()
        one_line = text.count("\n") == 1 and text.startswith("python -m nanoserve: error: ")
        return ("refused", text) if e.code == 2 and one_line else ("crashed", f"exit {e.code}: {text}")
    except BaseException:  # noqa: BLE001 - what a user would see as a traceback
        return "crashed", traceback.format_exc()
    return "ok", ""


def test_cli_flags_fuzz(model_root):
    model = str(make_model(model_root, "qwen3"))
    rng, actions, failures, counts = random.Random(SEED), cli_flags(), [], {"ok": 0, "refused": 0}
    for case in range(CLI_CASES):
        argv = cli_case(rng, model, actions)
        outcome, text = parse_outcome(argv)
        if outcome == "crashed":
            failures.append(f"case {case}: {short(argv[1:])}: {text[-600:]}")
        else:
            counts[outcome] += 1
    print(f"\nCLI fuzz: {CLI_CASES} cases (seed {SEED}): {counts['ok']} parsed, {counts['refused']} refused, "
          f"{len(failures)} failures")
    assert counts["ok"] > CLI_CASES // 10 and counts["refused"] > CLI_CASES // 10
    assert not failures, "\n".join(failures[:20])


def test_cli_refusals_as_a_user_sees_them(model_root):
    """What the fuzz checks in-process, through ``python -m nanoserve`` itself (the two at once): a flag
    value argparse refuses (exit 2), and one it takes that the engine refuses as it loads (exit 1), each
    one line and no traceback."""
    model = str(make_model(model_root, "qwen3"))
    cases = {2: [model, "--max-model-len", "9" * 400],
             1: [model, "--max-model-len", "100000", "--host", "127.0.0.1", "--port", "0", "--disable-log-stats"]}
    procs = {code: subprocess.Popen([sys.executable, "-m", "nanoserve", *argv], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for code, argv in cases.items()}
    for code, proc in procs.items():
        out, err = proc.communicate(timeout=CALL_LIMIT)
        errors = [line for line in err.splitlines() if "error: " in line]
        assert proc.returncode == code and len(errors) == 1 and "Traceback" not in out + err, (code, err)
        assert "--max-model-len" in errors[0] or "max_model_len" in errors[0], errors[0]
