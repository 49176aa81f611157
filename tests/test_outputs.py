"""Output tests: logprobs against transformers, incremental detokenization of
multi-byte text, stop strings / stop ids / EOS with vLLM's finish_reason and
stop_reason, streamed text (delta_text from LLMEngine.step(); DELTA outputs, which
carry only each step's new text, tokens and logprobs), n > 1 sharing the
prompt's blocks, and LLM.chat.

A random model's text is not controllable, so most stop and detokenizer tests
swap the model runner's sampler for a scripted one: the model still runs, and
the engine's own detokenizer, stop checks and streaming see exactly the tokens
of a text chosen here. One test picks its stop string from the random model's
own greedy output instead.
"""
from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import nanoserve
from conftest import CORPUS, hf_model
from nanoserve import LLM, SamplingParams
from nanoserve.engine import IncrementalDetokenizer, RequestOutputKind, chat_template_content_format, merge_deltas
from nanoserve.model import SamplerOutput

EOS = 0  # conftest: the tokenizer's <|endoftext|> and the config's eos_token_id
PROMPT = "The quick brown fox jumps over"
TEXT = "Hello world, this is a stop test. 你好世界 END here and more text"
MULTIBYTE = ["你好，世界！🙂 emoji 🎉 done", "🙂🙂🎉🚀", "ünïcödé — “quotes” €100 𝔘𝔫𝔦", "中文字符和emoji混合🙂测试"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, seed=0)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def hf(tiny_model):
    return hf_model(tiny_model)


# =========================================================================== helpers

class ScriptedSampler:
    """Returns the scripted next token of each row (keyed by its prompt)."""

    def __init__(self, scripts: dict[tuple[int, ...], list[int]]):
        self.scripts = scripts

    def sample(self, logits, rows):
        ids = torch.tensor([self.scripts[tuple(r.prompt_token_ids)][len(r.output_token_ids)] for r in rows])
        return SamplerOutput(ids, ids, [None] * len(rows))


@contextlib.contextmanager
def scripted(llm, prompt: str, script: list[int]):
    runner = llm.engine.runner
    real = runner.sampler
    runner.sampler = ScriptedSampler({tuple(llm.get_tokenizer().encode(prompt)): list(script)})
    try:
        yield
    finally:
        runner.sampler = real


def stream(llm, prompt, params, kind=RequestOutputKind.CUMULATIVE):
    """Drive LLMEngine.step() for one request; return every streamed
    CompletionOutput and the final one."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    rid = engine.add_request(prompt, params, output_kind=kind)
    snaps, final = [], None
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id == rid
            snaps.extend(out.outputs)
            if out.finished:
                final = out.outputs[-1]
    assert final is not None
    return snaps, final


def check_stream(snaps, final) -> None:
    """The stream never shows text the final output does not have (no part of
    a stop string that ends up matching), and adds up to the final text."""
    acc = ""
    for c in snaps:
        acc += c.delta_text
        assert c.text == acc
        assert final.text.startswith(acc), (acc, final.text)
    assert acc == final.text


def check_deltas(deltas, snaps) -> None:
    """DELTA outputs carry only what their cumulative twins added (the step's
    text, its one token and its logprobs), and add up to the final output."""
    assert [d.text for d in deltas] == [d.delta_text for d in deltas] == [c.delta_text for c in snaps]
    assert [d.token_ids for d in deltas] == [c.token_ids[-1:] for c in snaps]
    assert [d.logprobs for d in deltas] == [None if c.logprobs is None else c.logprobs[-1:] for c in snaps]
    assert merge_deltas(deltas) == snaps[-1]


def run_script(llm, script, params, prompt=PROMPT):
    """The scripted request streamed twice: cumulative outputs, then DELTA ones."""
    with scripted(llm, prompt, script):
        snaps, final = stream(llm, prompt, params)
        deltas, _ = stream(llm, prompt, params, RequestOutputKind.DELTA)
    check_stream(snaps, final)
    check_deltas(deltas, snaps)
    return final


def first_token_containing(tok, script, s: str) -> int:
    """Index of the token whose text completes the first occurrence of s."""
    for k in range(len(script)):
        if s in tok.decode(script[:k + 1]):
            return k
    raise AssertionError(f"{s!r} not in the script")


def spans_tokens(tok, script, s: str) -> bool:
    return not any(s in tok.decode([t]) for t in script)


# =========================================================================== logprobs

def _hf_logprobs(hf, prompt_ids, output_ids):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt_ids) - 1:len(prompt_ids) + len(output_ids) - 1]


@pytest.mark.parametrize("n_top,kw", [(5, dict(temperature=0)), (2, dict(temperature=1.5, seed=3)),
                                      (0, dict(temperature=1.0, seed=4)), (20, dict(temperature=0))])
def test_logprobs_equal_transformers_log_softmax(llm, tok, hf, n_top, kw):
    prompts = [PROMPT, "def main(): return 0"]
    outs = llm.generate(prompts, SamplingParams(logprobs=n_top, max_tokens=8, ignore_eos=True, **kw),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        ref = _hf_logprobs(hf, tok.encode(prompt), c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 8
        total = 0.0
        for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            top = ref[i].topk(n_top).indices.tolist() if n_top else []
            assert set(entry) == set(top) | {t}            # the N largest, plus the sampled token
            for tid, lp in entry.items():  # vLLM's Logprob: the value, its rank and its text
                assert lp.logprob == pytest.approx(float(ref[i, tid]), abs=2e-5)
                assert lp.decoded_token == tok.decode([tid])
            assert entry[t].rank == int((ref[i] >= ref[i, t]).sum())  # how many are at least as likely
            assert [entry[tid].rank for tid in top if tid != t] == [r + 1 for r, tid in enumerate(top) if tid != t]
            if kw["temperature"] == 0:
                assert t == int(ref[i].argmax())
            total += entry[t].logprob
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_logprob_texts_are_decoded_once_per_token(llm, monkeypatch):
    params = SamplingParams(logprobs=3, max_tokens=6, ignore_eos=True, temperature=0)
    first = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].logprobs
    decoded = []
    real = llm.engine.tokenizer.batch_decode
    monkeypatch.setattr(llm.engine.tokenizer, "batch_decode", lambda ids, **kw: decoded.extend(ids) or real(ids, **kw))
    again = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].logprobs
    assert again == first and decoded == []  # the same tokens: every text from the engine's cache
    other = llm.generate(["def main(): return 0"], params, use_tqdm=False)[0].outputs[0]
    ids = [t for entry in other.logprobs for t in entry]
    assert len(decoded) == len(set(decoded)) and set(map(tuple, decoded)) <= {(t,) for t in ids}  # new ones, once


def test_no_logprobs_unless_asked(llm):
    c = llm.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


def test_streamed_logprobs_are_snapshots(llm):
    snaps, final = stream(llm, PROMPT, SamplingParams(logprobs=2, max_tokens=5, temperature=0))
    assert [len(c.token_ids) for c in snaps] == [1, 2, 3, 4, 5]
    assert [len(c.logprobs) for c in snaps] == [1, 2, 3, 4, 5]


def test_delta_outputs_stay_the_same_size_as_the_output_grows(llm):
    """The server's outputs (DELTA): however long the output, each step's carries
    one token, its logprobs and its text, where a cumulative one carries (copies)
    everything so far; they add up to the same final output."""
    params = SamplingParams(logprobs=2, max_tokens=300, ignore_eos=True, temperature=1.0, seed=7)
    snaps, final = stream(llm, PROMPT, params)
    deltas, _ = stream(llm, PROMPT, params, RequestOutputKind.DELTA)
    assert [len(c.token_ids) for c in snaps] == list(range(1, 301))
    assert all(len(d.token_ids) == len(d.logprobs) == 1 for d in deltas)
    assert sum(len(d.text) for d in deltas) == len(final.text) and final.finish_reason == "length"
    assert deltas[-1].finish_reason == "length" and deltas[-1].cumulative_logprob == final.cumulative_logprob
    check_deltas(deltas, snaps)


def test_stream_interval_sends_every_n_tokens(llm, monkeypatch):
    """vLLM's stream_interval: a stream's first token at once, then every N tokens, and the last;
    the deltas add up to the same output. The engine's --stream-interval is a floor. Cumulative
    outputs (step()'s default) come every step, as vLLM's."""
    params = SamplingParams(logprobs=1, max_tokens=10, ignore_eos=True, temperature=1.0, seed=3, stream_interval=4)
    snaps, final = stream(llm, PROMPT, params)
    assert len(snaps) == 10
    deltas, _ = stream(llm, PROMPT, params, RequestOutputKind.DELTA)
    assert [len(d.token_ids) for d in deltas] == [len(d.logprobs) for d in deltas] == [1, 4, 4, 1]
    assert merge_deltas(deltas) == final
    monkeypatch.setattr(llm.engine.config, "stream_interval", 3)
    deltas, _ = stream(llm, PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, stream_interval=2),
                       RequestOutputKind.DELTA)
    assert [len(d.token_ids) for d in deltas] == [1, 3, 3, 3]
    with pytest.raises(ValueError, match="stream_interval must be None or >= 1"):
        SamplingParams(stream_interval=0)


def test_delta_outputs_of_n_children_add_up(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, logprobs=1, stop=["e "])
    got = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        for c in stream(llm, PROMPT, params, kind)[0]:
            got.setdefault(kind, {}).setdefault(c.index, []).append(c)
    cumulative, deltas = got[RequestOutputKind.CUMULATIVE], got[RequestOutputKind.DELTA]
    assert sorted(deltas) == [0, 1, 2] and len({tuple(cs[-1].token_ids) for cs in cumulative.values()}) > 1
    assert {i: merge_deltas(cs) for i, cs in deltas.items()} == {i: cs[-1] for i, cs in cumulative.items()}


# =========================================================================== detokenization

def _deltas(tok, ids, prompt_ids=()):
    """One delta per token, then the flush the engine does when the request finishes."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids), skip_special_tokens=True)
    return [detok.step(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("text", MULTIBYTE + [TEXT], ids=["zh-emoji", "emoji", "latin-math", "zh-mixed", "text"])
@pytest.mark.parametrize("prompt", ["", "prompt: 你好"], ids=["no-prompt", "zh-prompt"])
def test_incremental_detokenizer_multibyte(tok, text, prompt):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    deltas = _deltas(tok, ids, tok.encode(prompt) if prompt else ())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_texts_really_split_characters(tok):
    """The texts above exercise the hold-back: some of their tokens are
    partial UTF-8 characters on their own."""
    pieces = [tok.decode([t]) for text in MULTIBYTE for t in tok.encode(text)]
    assert sum("\ufffd" in p for p in pieces) >= 5


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=25),
       prompt=st.text(st.characters(blacklist_categories=("Cs",)), max_size=8))
@example(text="\ufffd", prompt="")  # a real U+FFFD at the end is held back until the flush
@example(text="a\ufffdb", prompt="")
def test_incremental_detokenizer_property(tok, text, prompt):
    ids = tok.encode(text)
    deltas = _deltas(tok, ids, tok.encode(prompt))
    assert "".join(deltas) == tok.decode(ids)
    if "\ufffd" not in tok.decode(ids):  # else the text itself has one to emit
        assert not any("\ufffd" in d for d in deltas)


def _llama_style_tokenizer(root: Path):
    """Llama 2's kind of tokenizer: spaces as U+2581, byte fallback, and a Strip
    decoder, whose windows DecodeStream sometimes refuses (random byte tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([CORPUS] * 4, trainers.BpeTrainer(vocab_size=700, special_tokens=special))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(root)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(root)


@pytest.mark.parametrize("name", ["test", "demo", "llama-style"])
def test_decode_stream_deltas_equal_the_windows(tok, tmp_path, name):
    """IncrementalDetokenizer's DecodeStream path gives the very deltas (and flush)
    of its two-decodes window, over random token sequences heavy in partial UTF-8
    characters and special tokens, with and without skip_special_tokens."""
    from transformers import AutoTokenizer
    tokenizer = {"test": lambda: tok, "llama-style": lambda: _llama_style_tokenizer(tmp_path),
                 "demo": lambda: AutoTokenizer.from_pretrained(Path(nanoserve.__file__).parent / "demo_model")}[name]()
    vocab = range(len(tokenizer))
    partial = [t for t in vocab if "\ufffd" in tokenizer.decode([t])]
    pools = [vocab, partial + tokenizer.all_special_ids, partial]
    rng, streamed, refused = random.Random(0), 0, 0
    for _ in range(400):
        pool = rng.choice(pools)
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, IncrementalDetokenizer.HOLD + 1))]  # longer: below
        prompt, skip = [rng.choice(vocab) for _ in range(rng.randrange(0, 8))], rng.random() < 0.5
        fast, window = IncrementalDetokenizer(tokenizer, prompt, skip), IncrementalDetokenizer(tokenizer, prompt, skip)
        window.stream = None
        started = fast.stream is not None
        assert [fast.step(t) for t in ids] + [fast.flush()] == [window.step(t) for t in ids] + [window.flush()]
        streamed += fast.stream is not None
        refused += started and fast.stream is None
    assert streamed > 200 and (refused > 0) == (name == "llama-style"), (streamed, refused)


class _Untrimmed(IncrementalDetokenizer):
    HOLD = 10**9  # the detokenizer before _trim: its window holds a run whole


@pytest.mark.parametrize("name", ["test", "demo", "llama-style"])
def test_detokenizer_window_stays_short_over_runs_without_text(tok, tmp_path, name):
    """A run of lead bytes (replacement characters that no later byte changes) or
    of skipped special tokens is released or dropped as it comes, so the window
    stays short instead of being decoded whole again at every token (quadratic
    in the run); the text is that of the untrimmed window, stream or not."""
    from transformers import AutoTokenizer
    tokenizer = {"test": lambda: tok, "llama-style": lambda: _llama_style_tokenizer(tmp_path),
                 "demo": lambda: AutoTokenizer.from_pretrained(Path(nanoserve.__file__).parent / "demo_model")}[name]()
    vocab = range(len(tokenizer))
    partial = [t for t in vocab if "\ufffd" in tokenizer.decode([t])]
    lead = next(t for t in partial if tokenizer.decode([t] * 3) == "\ufffd" * 3)
    special = tokenizer.all_special_ids
    rng = random.Random(1)
    runs = [[lead] * 300, special[:1] * 300, [rng.choice(partial + special) for _ in range(300)],
            [rng.choice(partial) for _ in range(300)]]
    held = 0
    for ids in runs:
        for skip in (True, False):
            prompt = [rng.choice(vocab) for _ in range(rng.randrange(0, 8))]
            trimmed, whole = IncrementalDetokenizer(tokenizer, prompt, skip), _Untrimmed(tokenizer, prompt, skip)
            whole.stream = None
            texts, windows = [], []
            for d in (trimmed, whole):
                pieces, window = [], 0
                for t in ids:
                    pieces.append(d.step(t))
                    window = max(window, len(d.ids) - d.prefix_offset)
                texts.append("".join(pieces) + d.flush())
                windows.append(window)
            assert texts[0] == texts[1]
            assert windows[0] <= 2 * IncrementalDetokenizer.HOLD + 1
            held = max(held, windows[1])
    assert held >= 300  # the untrimmed window did hold a run whole


@pytest.mark.parametrize("text", MULTIBYTE[:2], ids=["zh-emoji", "emoji"])
def test_streamed_deltas_multibyte_end_to_end(llm, tok, text):
    script = tok.encode(text)
    final = run_script(llm, script, SamplingParams(max_tokens=len(script)))
    assert final.text == text and final.token_ids == script
    assert final.finish_reason == "length" and final.stop_reason is None


def test_streamed_deltas_of_random_model_add_up(llm):
    snaps, final = stream(llm, "def main():", SamplingParams(temperature=1.0, seed=5, max_tokens=24))
    check_stream(snaps, final)
    assert len(snaps) == len(final.token_ids)


# =========================================================================== stop strings

# (name, stops, the stop that must match); TEXT is scripted token by token.
STOP_CASES = [
    ("spans_tokens", [" stop te"], " stop te"),
    ("at_start_inside_first_tokens", ["Hel"], "Hel"),
    ("at_start_whole_first_token", ["H"], "H"),
    ("at_start_spanning", ["Hello wo"], "Hello wo"),
    ("inside_one_token_with_text_after", ["wor"], "wor"),
    ("overlapping_first_completed_wins", ["is a stop", "a s"], "a s"),
    ("one_is_prefix_of_other", ["stop test", "stop"], "stop"),
    ("multibyte", ["好世"], "好世"),
    ("several_none_before", ["nothing", "END"], "END"),
]


@pytest.mark.parametrize("include", [False, True], ids=["exclude", "include"])
@pytest.mark.parametrize("name,stops,match", STOP_CASES, ids=[c[0] for c in STOP_CASES])
def test_stop_strings(llm, tok, name, stops, match, include):
    script = tok.encode(TEXT)
    if name == "spans_tokens":
        assert spans_tokens(tok, script, match)
    final = run_script(llm, script, SamplingParams(stop=stops, include_stop_str_in_output=include,
                                                  max_tokens=len(script)))
    i = TEXT.find(match)
    assert final.text == (TEXT[:i + len(match)] if include else TEXT[:i])
    assert final.finish_reason == "stop" and final.stop_reason == match
    assert final.token_ids == script[:first_token_containing(tok, script, match) + 1]


def _whole_text_deltas(pieces: list[str], stops: list[str], include: bool) -> list[str]:
    """What each output adds, found on the whole text every token: the text up to the
    earliest stop string that ends in the new piece; while none has, all but its longest
    suffix that is a prefix of a stop string."""
    text, sent, out = "", 0, []
    for piece in pieces:
        prev, text = len(text), text + piece
        hits = [(i, s) for s in stops if (i := text.find(s, max(0, prev - len(s) + 1))) != -1]
        if hits:
            i, s = min(hits, key=lambda h: h[0])
            return out + [text[sent:i + len(s) if include else i]]
        hold = next((n for n in range(min(len(text), max(map(len, stops)) - 1), 0, -1)
                     if any(s.startswith(text[-n:]) for s in stops)), 0)
        out.append(text[sent:len(text) - hold])
        sent = len(text) - hold
    raise AssertionError("no stop string in the text")


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY], ids=["delta", "final"])
@pytest.mark.parametrize("include", [False, True], ids=["exclude", "include"])
def test_stop_strings_on_a_long_output(llm, tok, include, kind):
    """A long output full of stop strings' beginnings, held back and then released,
    that ends in a stop string of many tokens and hundreds of characters: each DELTA
    output carries what holding back on the whole text gives (FINAL_ONLY: all of it
    at once), and the stop is found where it completes."""
    stop = "<stop here now" + " and again" * 25 + ">"
    rng = random.Random(0)
    starts = rng.choices(["<stop", "<stop here", "<stop here no", "!!", "<", "x"], k=25)
    text = "".join(f"{w} {i} " for i, w in enumerate(starts)) + stop + " and after"
    script = tok.encode(text)
    with scripted(llm, PROMPT, script):
        deltas, final = stream(llm, PROMPT, SamplingParams(stop=[stop, "!!!"], include_stop_str_in_output=include,
                                                           max_tokens=len(script)), kind)
    want = _whole_text_deltas(_deltas(tok, script, tok.encode(PROMPT))[:-1], [stop, "!!!"], include)
    assert len(want) > 250 and want.count("") > 100
    assert [d.text for d in deltas] == (want if kind.is_delta else ["".join(want)])
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(want) == text[:text.index(stop) + (len(stop) if include else 0)]


def test_stop_string_self_overlapping(llm, tok):
    text = "xx aaab yy and more"
    script = tok.encode(text)
    final = run_script(llm, script, SamplingParams(stop="aab", max_tokens=len(script)))
    assert final.text == "xx a" and final.stop_reason == "aab"


def test_partial_stop_match_is_released(llm, tok):
    """A prefix of a stop string that never completes is held back while
    streaming and then shown in full."""
    script = tok.encode(TEXT)
    final = run_script(llm, script, SamplingParams(stop=["stop now", "text!"], max_tokens=len(script)))
    assert final.text == TEXT
    assert final.finish_reason == "length" and final.stop_reason is None


def test_stop_string_from_the_models_own_greedy_output(llm, tok):
    """No script: pick a stop string spanning a token boundary of the random
    model's greedy text, then generate again with it."""
    for prompt in ("def main():", PROMPT, "print('hello", "import os, sys;"):
        base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
        ends = [len("".join(_deltas(tok, base.token_ids[:k], tok.encode(prompt))))
                for k in range(1, len(base.token_ids))]
        text = base.text
        good = [b for b in ends if 1 <= b < len(text) - 1
                and all(ch.isprintable() and ch != "\ufffd" for ch in text[b - 1:b + 1])]
        if good:
            break
    else:
        pytest.fail("no clean token boundary in the model's outputs")
    b = good[0]
    stop = text[b - 1:b + 1]
    i = text.find(stop)
    for include in (False, True):
        snaps, final = stream(llm, prompt, SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                                          include_stop_str_in_output=include))
        check_stream(snaps, final)
        assert final.text == (text[:i + len(stop)] if include else text[:i])
        assert final.finish_reason == "stop" and final.stop_reason == stop
        assert final.token_ids == base.token_ids[:len(final.token_ids)]


@pytest.mark.parametrize("stops", [
    ["ab"],
    ["ab", "a much longer stop string"],
])
def test_stop_strings_before_min_tokens_are_ignored(llm, tok, stops):
    text = "xab then more words here and ab again"
    script = tok.encode(text)
    min_tokens = first_token_containing(tok, script, "then") + 1   # "ab" completes well before
    final = run_script(llm, script, SamplingParams(stop=stops, min_tokens=min_tokens, max_tokens=len(script)))
    assert final.text == "xab then more words here and "
    assert final.stop_reason == "ab"


def test_max_tokens_is_length_with_no_stop_reason(llm, tok):
    script = tok.encode(TEXT)
    final = run_script(llm, script, SamplingParams(max_tokens=4, stop=["zzz"]))
    assert final.finish_reason == "length" and final.stop_reason is None
    assert final.token_ids == script[:4] and final.text == tok.decode(script[:4])


# =========================================================================== stop ids and EOS

@pytest.mark.parametrize("include", [False, True],
                         ids=["exclude", "include"])
def test_stop_token_ids(llm, tok, include):
    script = tok.encode(TEXT)
    k = 6
    stop_id = script[k]
    assert tok.decode([stop_id]) == " t" and stop_id not in script[:k]
    final = run_script(llm, script, SamplingParams(stop_token_ids=[stop_id], max_tokens=len(script),
                                                  include_stop_str_in_output=include))
    assert final.finish_reason == "stop" and final.stop_reason == stop_id
    assert final.token_ids == script[:k + 1]
    assert final.text == tok.decode(script[:k + 1] if include else script[:k])


def test_stop_token_ids_wait_for_min_tokens(llm, tok):
    script = tok.encode(TEXT)
    stop_id = tok.encode(" t")[0]
    positions = [i for i, t in enumerate(script) if t == stop_id]
    assert len(positions) >= 2
    final = run_script(llm, script, SamplingParams(stop_token_ids=[stop_id], min_tokens=positions[0] + 2,
                                                  max_tokens=len(script), include_stop_str_in_output=True))
    assert final.token_ids == script[:positions[1] + 1] and final.stop_reason == stop_id


def _eos_script(tok):
    head, tail = tok.encode("Hello world"), tok.encode(" and more")
    return head + [EOS] + tail, len(head)


def test_eos_stops_with_no_stop_reason(llm, tok):
    script, k = _eos_script(tok)
    final = run_script(llm, script, SamplingParams(max_tokens=len(script)))
    assert final.finish_reason == "stop" and final.stop_reason is None
    assert final.token_ids == script[:k + 1] and final.text == "Hello world"


def test_eos_text_left_out_even_without_skipping_special_tokens(llm, tok):
    script, k = _eos_script(tok)
    final = run_script(llm, script, SamplingParams(max_tokens=len(script), skip_special_tokens=False))
    assert final.finish_reason == "stop" and final.text == "Hello world"


def test_ignore_eos_runs_to_length(llm, tok):
    script, k = _eos_script(tok)
    final = run_script(llm, script, SamplingParams(max_tokens=len(script), ignore_eos=True))
    assert final.finish_reason == "length" and final.stop_reason is None
    assert final.token_ids == script and final.text == "Hello world and more"
    # EOS listed as a stop id still stops, with the id as the reason (as vLLM)
    final = run_script(llm, script, SamplingParams(max_tokens=len(script), ignore_eos=True,
                                                  stop_token_ids=[EOS]))
    assert final.finish_reason == "stop" and final.stop_reason == EOS
    assert final.token_ids == script[:k + 1]


def test_eos_before_min_tokens_does_not_stop(llm, tok):
    script, k = _eos_script(tok)
    final = run_script(llm, script, SamplingParams(max_tokens=len(script), min_tokens=k + 2))
    assert final.finish_reason == "length" and final.token_ids == script


def test_real_model_eos_stops(llm, tok):
    """The sampled EOS of the real model (forced by a logit bias) stops it."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, logit_bias={EOS: 100.0}, min_tokens=2),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.token_ids[-1] == EOS
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_blocks


# =========================================================================== n > 1

def test_n4_shares_prompt_blocks_and_frees_them(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, block_size=16)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    prompt = list(range(3, 43))                     # 40 tokens: 2 full blocks + a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)

    engine.add_request(list(range(50, 90)), SamplingParams(max_tokens=2))  # one request alone
    engine.step()
    single = bm.num_blocks - bm.num_free_blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert single == 3 and bm.num_free_blocks == bm.num_blocks

    rid = engine.add_request(prompt, params)
    outs = engine.step()
    used = bm.num_blocks - bm.num_free_blocks
    assert used < 4 * single
    assert used == 2 + 4                            # the full blocks once, a tail block each
    completions = {}
    for out in outs:
        completions.update({c.index: c for c in out.outputs})
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            completions.update({c.index: c for c in out.outputs})
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(completions) == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in completions.values())

    res = llm.generate([prompt], params, use_tqdm=False)
    assert len(res) == 1 and res[0].finished
    assert [c.index for c in res[0].outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in res[0].outputs}) > 1  # n samples, not one copied
    assert [c.token_ids for c in res[0].outputs] == [completions[i].token_ids for i in range(4)]
    assert bm.num_free_blocks == bm.num_blocks


# =========================================================================== chat

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 你好"}]
RENDERED = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi 你好<|im_end|>\n"
            "<|im_start|>assistant\n")


def test_chat_renders_the_template(llm, tok):
    p = SamplingParams(temperature=0, max_tokens=4)
    out = llm.chat(MESSAGES, p, use_tqdm=False)
    assert len(out) == 1
    assert out[0].prompt == RENDERED
    assert out[0].prompt_token_ids == tok.encode(RENDERED)
    assert tok.convert_ids_to_tokens(out[0].prompt_token_ids[:1]) == ["<|im_start|>"]  # a special token
    same = llm.generate([RENDERED], p, use_tqdm=False)[0]
    assert out[0].outputs[0].token_ids == same.outputs[0].token_ids
    two = llm.chat([MESSAGES, MESSAGES[1:]], p, use_tqdm=False)
    assert [o.prompt for o in two] == [RENDERED, RENDERED[len("<|im_start|>system\nbe brief<|im_end|>\n"):]]


def test_chat_takes_openai_content_parts(llm):
    """As the server and vLLM's LLM.chat: a list of text parts is their text (it was its Python repr)."""
    p = SamplingParams(temperature=0, max_tokens=2)
    two_parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "你好"}]
    parts = [MESSAGES[0], {"role": "user", "content": two_parts}]
    assert llm.chat(parts, p, use_tqdm=False)[0].prompt == RENDERED.replace("hi 你好", "hi\n你好")
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], p, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\].role must be a string such as 'user', got None"):
        llm.chat([MESSAGES[0], {"content": "hi"}], p, use_tqdm=False)  # was rendered with an empty role
    assert not llm.engine.has_unfinished_requests()


# A template that reads a message's content as parts, as Gemma 3's does (a string too).
PARTS_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{% if m['content'] is string %}{{ m['content'] }}"
                  "{% else %}{% for part in m['content'] %}<{{ part['text'] | trim }}>{% endfor %}{% endif %}"
                  "{% endfor %}")


@pytest.mark.parametrize("template, found", [
    (PARTS_TEMPLATE, "openai"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for c in m['content'] | list %}"
     "{{ c['text'] }}{% endfor %}{% endfor %}", "openai"),  # an alias of messages, a filtered content
    ("{% for m in messages %}{% generation %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
     "{% endgeneration %}{% endfor %}", "openai"),  # transformers' own tag (its assistant-mask tracker)
    ("{% for m in messages %}{% for c in other['content'] %}{{ c }}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{% for k in m['tool_calls'] %}{{ k }}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %", "string"),  # not Jinja: rendering names the error
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "string"),  # too deep for the parser: rendering names it
    (None, "string"),
])
def test_chat_template_content_format_is_detected(template, found):
    """vLLM's "auto": "openai" where the template loops over a message's content, else "string"."""
    assert chat_template_content_format(template) == found


def test_chat_content_reaches_the_template_in_its_format(llm):
    """Under "auto" a template that loops over parts gets every content as text parts, a string one too, as
    vLLM hands them ({"type": "text", "text": ...}); a string template gets them joined; either is forced by
    chat_template_content_format, and another value is refused."""
    p = SamplingParams(temperature=0, max_tokens=1)
    parts = [{"role": "system", "content": " be brief "},
             {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "input_text", "text": "你好"}]},
             {"role": "assistant", "content": None}]

    def prompt(**kw):
        return llm.chat(parts, p, use_tqdm=False, chat_template=PARTS_TEMPLATE, **kw)[0].prompt
    assert prompt() == prompt(chat_template_content_format="openai") == "[system]<be brief>[user]<hi><你好>[assistant]"
    assert prompt(chat_template_content_format="string") == "[system] be brief [user]hi \n你好[assistant]"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        prompt(chat_template_content_format="list")
    assert llm.chat(parts[:2], p, use_tqdm=False)[0].prompt.startswith("<|im_start|>system\n be brief <|im_end|>")
    assert not llm.engine.has_unfinished_requests()


def test_named_templates_without_a_default_are_the_renderer_s_clear_error(llm):
    """A tokenizer of several named templates, none "default": without a name (or tools, for "tool_use") the
    renderer's one-line error, not a TypeError from looking for the content format; a name renders."""
    import copy

    from nanoserve.engine import InvalidInput, apply_chat_template
    tokenizer, messages = copy.copy(llm.engine.tokenizer), [{"role": "user", "content": "hi"}]
    tokenizer.chat_template = {"tool_use": "T{{ messages[0]['content'] }}", "rag": "R{{ messages[0]['content'] }}"}
    with pytest.raises(InvalidInput, match="multiple chat templates with no default"):
        apply_chat_template(tokenizer, messages)
    assert apply_chat_template(tokenizer, messages, chat_template="rag") == "Rhi"


def test_chat_without_a_template_is_a_clear_error(tiny_model, tmp_path):
    bare = tmp_path / "no-template"
    shutil.copytree(tiny_model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    import json
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(bare), dtype="float32", num_kv_blocks=16)
    assert not llm.get_tokenizer().chat_template
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # an explicit template works
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False,
                   chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    assert out[0].prompt == "be brief|hi 你好|"


def test_n4_shares_prompt_blocks_with_prefix_caching_off(tiny_model):
    # The family's own salt lets the n children share; unrelated requests still do not.
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, block_size=16,
              enable_prefix_caching=False)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    prompt = list(range(3, 43))
    engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True))
    engine.step()
    assert bm.num_blocks - bm.num_free_blocks == 2 + 4
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.step()
    assert bm.num_blocks - bm.num_free_blocks == 2 * 3      # two unrelated requests: no sharing
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks
