"""LoRA adapter folders for tests: what vLLM's PEFT loader reads (adapter_config.json and
adapter_model.safetensors), written directly so that no test needs peft or a download."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def write_adapter(folder: Path, *, rank: int = 8, base: str = "org/sim-model",
                  tensors: dict[str, tuple[tuple[int, ...], bytes]] | None = None) -> Path:
    """A PEFT LoRA folder: its config, and a safetensors file holding `tensors`
    (name -> (shape, float32 little-endian bytes); none: an empty but valid file)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": base,
              "target_modules": ["q_proj", "v_proj"], "fan_in_fan_out": False,
              "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, (shape, raw) in (tensors or {}).items():
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data)
    return folder
