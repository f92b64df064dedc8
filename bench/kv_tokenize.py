"""How long the router's prompt tokenizer (llmgw.kvcache.tokenize) takes, so the router knows
when to encode off the event loop.

    .venv/bin/python bench/kv_tokenize.py [--vocab 32000] [--tokens 1000 4000 16000] [--runs 20]

No download: a byte-level BPE (the kind Llama 3, Qwen and GPT tokenizers are) is trained on
this machine's text files with the asked vocabulary, beside a ChatML template, and loaded
through tokenize.load as a model folder's files would be. For each prompt size it prints the
median and p90 of: load (once), encode_completion of one text prompt, render_chat and
encode_chat of a system prompt plus turns of the same total size. Prompts are cut from the
same text, so a size is in the trained tokenizer's tokens (printed beside). Last, how long a
thread beside the encoder (the router's event loop, were the encoder in trio.to_thread)
waits at worst while the largest prompt is encoded five times: with encode_completion (the
batch encoder, which releases the GIL) and with the plain Tokenizer.encode (which holds it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import threading
import time
from datetime import datetime

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmgw.kvcache import tokenize

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def corpus() -> list[str]:
    files = [p for p in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(p)]
    files += [p for p in sorted(glob.glob("/usr/share/doc/*/copyright"))[:400] if os.path.isfile(p)]
    if not files:
        raise SystemExit("no local text files to train a tokenizer on")
    return files


def model_files(vocab: int) -> tuple[dict[str, bytes], str]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train(corpus(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, show_progress=False,
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    text = ""
    for path in corpus():
        with open(path, encoding="utf-8", errors="replace") as f:
            text += f.read()
        if len(text) > 2_000_000:
            break
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()}, text


def timed(fn: object, runs: int) -> tuple[float, float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - t0)
    out.sort()
    return statistics.median(out) * 1e3, out[min(len(out) - 1, int(len(out) * 0.9))] * 1e3


def longest_wait(fn: object) -> float:
    """The longest gap, in ms, between the wake-ups of a thread that sleeps 0.5 ms at a
    time while another runs fn five times."""
    done = threading.Event()

    def work() -> None:
        for _ in range(5):
            fn()  # type: ignore[operator]
        done.set()

    t = threading.Thread(target=work)
    t.start()
    worst, last = 0.0, time.perf_counter()
    while not done.is_set():
        time.sleep(0.0005)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    t.join()
    return worst * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    files, text = model_files(args.vocab)
    t0 = time.perf_counter()
    tok = tokenize.load(files)
    load_ms = (time.perf_counter() - t0) * 1e3
    assert isinstance(tok, tokenize.PromptTokenizer), tok
    size = len(json.loads(files["tokenizer.json"])["model"]["vocab"])
    print(f"byte-level BPE, vocabulary {size} (asked {args.vocab}), load {load_ms:.1f} ms; "
          f"median / p90 of {args.runs} runs, one thread")
    full = tok._tok.encode(text, add_special_tokens=False)
    now = datetime(2024, 1, 1)
    for n in args.tokens:
        if n > len(full.ids):
            print(f"{n} tokens: the corpus has only {len(full.ids)}")
            continue
        prompt = text[: full.offsets[n - 1][1]]
        quarter = len(prompt) // 4
        messages = [{"role": "system", "content": prompt[:quarter]},
                    *({"role": r, "content": prompt[i * quarter:(i + 1) * quarter]}
                      for i, r in ((1, "user"), (2, "assistant"), (3, "user")))]
        got = len(tok.encode_completion(prompt))
        c = timed(lambda p=prompt: tok.encode_completion(p), args.runs)  # type: ignore[misc]
        r = timed(lambda m=messages: tok.render_chat(m, now=now), args.runs)  # type: ignore[misc]
        e = timed(lambda m=messages: tok.encode_chat(m, now=now), args.runs)  # type: ignore[misc]
        print(f"{n:>6} tokens ({len(prompt)} chars, {got} ids): completion {c[0]:.2f} / {c[1]:.2f} ms, "
              f"chat render {r[0]:.2f} / {r[1]:.2f} ms, chat render+encode {e[0]:.2f} / {e[1]:.2f} ms, "
              f"{n / (c[0] / 1e3) / 1e6:.2f} M tokens/s")
    n = min(max(args.tokens), len(full.ids))
    prompt = text[: full.offsets[n - 1][1]]
    ours = longest_wait(lambda: tok.encode_completion(prompt))
    plain = longest_wait(lambda: tok._tok.encode(prompt))
    print(f"a thread beside the encoder of {n} tokens waits at most {ours:.1f} ms with encode_completion, "
          f"{plain:.1f} ms with Tokenizer.encode (which holds the GIL)")


if __name__ == "__main__":
    main()
