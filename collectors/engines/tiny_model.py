"""Build a tiny Llama (config + word-level tokenizer) for the embedded engine, entirely offline.

Runs under the engine's Python (it needs only `tokenizers`), so it imports nothing from cancelwatch.
Weights are not written: the engine starts it with `--load-format dummy` (random weights), which is
all a cancel test needs. Every word `w0`..`wN` is one token, so a prompt of N words is N tokens.

Usage: python tiny_model.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_WORDS = 1000
SPECIALS = ["<unk>", "<s>", "</s>"]

# Sized for the KV pool, not for quality: 8 layers x 8 KV heads x head_dim 64 in float32 is
# 32 KiB of KV per token, so a pool of a few thousand tokens is hundreds of MiB and shows as a
# plateau in the engine's memory. head_dim must be >= 32 on CPU.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": VOCAB_WORDS + len(SPECIALS),
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def build(out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    # chat roles are words too, so chat prompts stay inside the vocabulary
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": CONFIG["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    )
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tiny_model.py OUT_DIR")
    print(build(Path(sys.argv[1])))
