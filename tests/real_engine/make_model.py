"""Make a tiny Llama for the real-engine tier: random weights, a locally trained tokenizer.

Run with the vLLM venv's python (it has torch, transformers and tokenizers; the test venv
has none of them):   .ci-vllm-venv/bin/python tests/real_engine/make_model.py OUT_DIR [--shape gpu]

`--shape cpu` (the default) is what the CPU build of vLLM accepts (../shared/notes/engines.md):
hidden 128, 4 heads of 32 (head size 16 is refused), 2 layers, a 2,048-token vocabulary,
float32. `--shape gpu` (bench/gpu_check.py) suits the CUDA attention kernels: 4 heads of
64, hidden 256, every dimension a multiple of 64, float16 (every CUDA GPU vLLM supports
has it; bfloat16 needs compute capability 8.0). No download: the tokenizer is a
byte-level BPE trained on text files this machine has.
"""

from __future__ import annotations

import glob
import os
import sys

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 2048
# The Llama dimensions and dtype per shape (see the docstring).
SHAPES: dict[str, dict[str, object]] = {
    "cpu": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 32, "torch_dtype": "float32"},
    "gpu": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 64, "torch_dtype": "float16"},
}


def shape_config(shape: str) -> dict[str, object]:
    """LlamaConfig's keyword arguments for `shape` (no token ids: they come from the
    tokenizer). Importable without torch."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}: choose from {', '.join(SHAPES)}")
    return {"vocab_size": VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 8192,
            "tie_word_embeddings": True, **SHAPES[shape]}


def corpus() -> list[str]:
    files = [p for p in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(p)]
    if not files:  # any text will do; the tokenizer's quality does not matter
        files = [p for p in sorted(glob.glob("/usr/share/doc/*/copyright"))[:200] if os.path.isfile(p)]
    if not files:
        raise SystemExit("no local text files to train a tokenizer on")
    return files


def main(out: str, shape: str = "cpu") -> None:
    kwargs = shape_config(shape)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        **kwargs,
    )
    model = LlamaForCausalLM(config)
    model = model.to(getattr(torch, str(kwargs["torch_dtype"])))
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny llama ({shape}): {sum(p.numel() for p in model.parameters())} parameters in {out}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    shape = "cpu"
    if len(argv) == 3 and argv[1] == "--shape":
        shape = argv[2]
    elif len(argv) != 1:
        raise SystemExit(__doc__)
    main(argv[0], shape)
