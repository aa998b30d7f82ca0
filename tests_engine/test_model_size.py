"""The weights part of the memory anatomy, checked against the real model class: the parameter count
that `weights_bytes` works out from config.json is the one transformers' LlamaForCausalLM holds."""

from __future__ import annotations

import json

from cancelwatch.collectors.engines.tiny_model import build
from cancelwatch.collectors.engines.vllm_server import DTYPE_BYTES, weights_bytes


def test_weights_bytes_is_the_real_models_parameter_count_times_the_dtype(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = build(tmp_path / "tiny")
    cfg = json.loads((model_dir / "config.json").read_text())
    with torch.device("meta"):  # the shapes without the memory
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    params = sum(p.numel() for p in model.parameters())
    assert weights_bytes(model_dir, "float32") == params * DTYPE_BYTES["float32"]
    assert weights_bytes(model_dir, "bfloat16") == params * 2
    # tied embeddings share one matrix: the count drops by vocab x hidden, as the model's does
    tied = {**cfg, "tie_word_embeddings": True}
    (model_dir / "config.json").write_text(json.dumps(tied))
    with torch.device("meta"):
        tied_params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**tied)).parameters())
    assert weights_bytes(model_dir, "float32") == tied_params * 4 < params * 4
    (model_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    assert weights_bytes(model_dir, "float32") is None  # no guess for a shape it does not know
