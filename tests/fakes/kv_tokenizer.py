"""A model's tokenizer folder for kv_aware routing tests: a word-level tokenizer built with
`tokenizers` (one id per word of WORDS, a BOS before every prompt) and a ChatML template,
written as the files a model folder holds (tokenizer.json, tokenizer_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = SPECIAL + ["user", "assistant", "system"] + [f"w{i}" for i in range(200)]
BOS = 1
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def ids(text: str, bos: bool = True) -> list[int]:
    """The ids a completion prompt of WORDS separated by spaces gets."""
    return ([BOS] if bos else []) + [WORDS.index(w) for w in text.split()]


def write_tokenizer(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", BOS)])
    (folder / "tokenizer.json").write_text(tok.to_str())
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": CHATML,
              "added_tokens_decoder": {str(i): {"content": w, "special": True}
                                       for i, w in enumerate(SPECIAL)}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
