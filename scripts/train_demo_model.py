"""Train the embedded demo model, nanoserve/demo_model/, from text every Python ships.

`python -m nanoserve` with no --model serves this directory, so a fresh checkout can
answer requests with recognisable text and no download. The model is a tiny
code-completion Llama trained on the Python standard library's own top-level modules
(`<stdlib>/*.py`, sorted by name), so prompts such as "import os\n" or "def " continue
as Python-like code. It knows nothing else: it is a smoke-test model, not an assistant.

Everything is deterministic on a given Python and torch build: the file list is sorted,
the tokenizer is trained on that fixed text, torch is seeded, and training windows are
drawn from a seeded generator. Runs on the CPU in a few minutes on two cores:

    python scripts/train_demo_model.py                 # train and save (default steps)
    python scripts/train_demo_model.py --bench 5       # time 5 steps, save nothing
    python scripts/train_demo_model.py --steps 100 --out /tmp/demo

The output is a standard Hugging Face directory (config.json, model.safetensors,
generation_config.json, tokenizer files with a ChatML chat template) that
transformers' Auto* classes and nanoserve both load.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sysconfig
import time
from pathlib import Path

import torch

SEED = 0
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DATE = "2026-12-02"
# identifier or keyword, number, punctuation run (each with one trailing space), newline,
# other whitespace run
PRETOKENIZE_PATTERN = r"[\p{L}_][\p{L}\p{N}_]* ?|\p{N}+ ?|[^\s\p{L}\p{N}_]+ ?|\r?\n|[^\S\n]+"
OUTPUT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "README.md"]
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "nanoserve" / "demo_model"


def corpus_files() -> list[Path]:
    """The stdlib's top-level modules, sorted by name: ~4.7 MB of varied, idiomatic code."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"), key=lambda p: p.name)


def load_corpus() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files()]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # A word keeps the one space *after* it ("def ", "import ", "x ", "= "), and newlines
    # and indentation are tokens of their own. GPT-2's split glues the space to the next
    # word instead, so a prompt ending in a space ("def ") ends in a lone-space token the
    # model rarely saw there, and greedy decoding wanders. With this split, the prompts
    # people type for a code model ("def ", "import os\n", "    return ") end where the
    # training text's tokens end.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=None, bos_token=None,
        additional_special_tokens=[IM_START, IM_END], model_max_length=1024,
        clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=eos_id, attention_bias=False, mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))  # cosine to 10%


def greedy(model, tokenizer, prompt: str, n: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--amp", choices=["bf16", "none"], default="bf16",
                    help="autocast the forward to bf16 ('none': plain fp32, slower)")
    ap.add_argument("--bench", type=int, default=0, help="time this many steps, save nothing")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    t_start = time.perf_counter()

    texts = load_corpus()
    print(f"corpus: {len(texts)} files, {sum(len(t) for t in texts) / 1e6:.2f} M chars "
          f"from {sysconfig.get_paths()['stdlib']} (Python {platform.python_version()})")
    tokenizer = train_tokenizer(texts, args.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2]
    stream: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(eos_id)  # documents are separated, as in pretraining
    data = torch.tensor(stream, dtype=torch.long)
    print(f"tokenizer: vocab {len(tokenizer)}, {len(data) / 1e6:.2f} M tokens "
          f"({sum(len(t) for t in texts) / len(data):.2f} chars/token), "
          f"{time.perf_counter() - t_start:.1f}s")

    model = build_model(len(tokenizer), eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(SEED)  # the data order: random windows, fixed seed
    steps = args.bench or args.steps
    warmup = max(1, min(40, steps // 10))
    model.train()
    t_train, ema = time.perf_counter(), None
    for step in range(steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, warmup)
        # bf16 autocast: ~2x faster on CPUs with AVX512-BF16/AMX; weights stay fp32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            dt = time.perf_counter() - t_train
            print(f"step {step:4d}/{steps}  loss {loss.item():.3f}  ema {ema:.3f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {(step + 1) / dt:.2f} it/s", flush=True)
    train_s = time.perf_counter() - t_train
    final_loss = ema
    print(f"trained {steps} steps in {train_s:.0f}s ({steps / train_s:.2f} it/s), "
          f"final loss (ema) {final_loss:.3f}")
    if args.bench:
        return

    model.eval()
    samples = {}
    for prompt in ["import os\n", "def "]:
        samples[prompt] = greedy(model, tokenizer, prompt, 40)
        print(f"--- greedy from {prompt!r}:\n{prompt}{samples[prompt]}")
    save(args, model, tokenizer, n_params, steps, train_s, final_loss, len(texts), len(data), samples)
    print(f"saved to {args.out} in {time.perf_counter() - t_start:.0f}s total")


def save(args, model, tokenizer, n_params, steps, train_s, final_loss, n_files, n_tokens,
         samples) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:  # a re-run replaces what an earlier run wrote, nothing else
        (out / name).unlink(missing_ok=True)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(EOS),
                                            tokenizer.convert_tokens_to_ids(IM_END)]
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)  # float32: ~16 MB, exact for tests
    tokenizer.save_pretrained(out)
    # transformers 5 writes its own class name and `extra_special_tokens` as a list, which
    # transformers 4 cannot read; these keys mean the same to both.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.pop("backend", None)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["additional_special_tokens"] = tc.pop("extra_special_tokens", [IM_START, IM_END])
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    size_mb = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    c = model.config
    sample_md = "\n".join(f"From `{p!r}`:\n\n```python\n{p}{s}\n```\n" for p, s in samples.items())
    (out / "README.md").write_text(f"""# nanoserve demo model

A tiny code-completion model embedded in nanoserve so `python -m nanoserve` with no
`--model` serves recognisable text without a download. It continues Python code; it is
not an assistant (its chat template exists so `/v1/chat/completions` works, but it never
saw a conversation).

- Made on {DATE} by `python scripts/train_demo_model.py --steps {args.steps} --batch-size {args.batch_size} --seq-len {args.seq_len} --lr {args.lr} --vocab-size {args.vocab_size} --amp {args.amp}`
  (CPU, {args.threads} threads, torch {torch.__version__}, Python {platform.python_version()}).
- Data: the Python standard library's top-level modules (`<stdlib>/*.py`, {n_files} files
  sorted by name, {n_tokens / 1e6:.2f} M tokens), each followed by `<|endoftext|>`.
- Tokenizer: byte-level BPE trained on that text with `tokenizers`, vocab {len(tokenizer)},
  pre-split so a word keeps its trailing space (`def `, `import `) and newlines and
  indentation are separate tokens (pattern `{PRETOKENIZE_PATTERN}`);
  special tokens `<|endoftext|>` (0, eos), `<|im_start|>` (1), `<|im_end|>` (2); ChatML template.
- Model: `LlamaForCausalLM`, hidden {c.hidden_size}, {c.num_hidden_layers} layers,
  {c.num_attention_heads} heads / {c.num_key_value_heads} KV heads (head_dim {c.hidden_size // c.num_attention_heads}),
  intermediate {c.intermediate_size}, max positions {c.max_position_embeddings}, tied embeddings,
  default RoPE (theta 10000); {n_params / 1e6:.2f} M parameters, float32 ({size_mb:.1f} MB directory).
- Training: AdamW (betas 0.9/0.95, weight decay 0.1), peak lr {args.lr}, linear warm-up then
  cosine to 10%, grad clip 1.0, forward autocast {args.amp}, {steps} steps of {args.batch_size} random windows of
  {args.seq_len} tokens (seed {SEED}), {train_s:.0f} s; final training loss {final_loss:.3f}
  (exponential moving average, nats/token).

Greedy samples (40 tokens) at the end of training:

{sample_md}""")


if __name__ == "__main__":
    main()
