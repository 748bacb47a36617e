"""Write a sluice model as a Hugging Face checkpoint directory that transformers loads as-is."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..model.config import ModelConfig
from ..model.weights import sluice_to_hf

# ChatML, the convention of the Qwen family. The bundled model is a base model trained on code and
# has never seen a chat; the template is here so `sluice chat` and llm.chat() work on it mechanically.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def export_hf(model, cfg: ModelConfig, out_dir: Path, tokenizer_json: Path, recipe=None,
              dtype: torch.dtype = torch.bfloat16) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # transformers re-ties it from the embedding, as for Qwen3-0.6B
        tensors[sluice_to_hf(name)] = tensor.detach().to(dtype).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.replace(torch_dtype=str(dtype).removeprefix("torch.")).to_hf_dict()
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    shutil.copyfile(tokenizer_json, out_dir / "tokenizer.json")
    eos = "<|endoftext|>"
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
               "bos_token": None, "eos_token": eos, "pad_token": eos, "unk_token": None,
               "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
               "chat_template": CHATML_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.eos_token_id, "do_sample": True,
           "temperature": 0.7, "top_p": 0.95, "max_new_tokens": 128}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if recipe is not None:  # the full resolved recipe, defaults included, next to what it made
        (out_dir / "recipe.json").write_text(json.dumps(dataclasses.asdict(recipe), indent=2) + "\n")
    return out_dir
