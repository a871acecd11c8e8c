"""Qwen2 / Qwen2.5 / Qwen3 in JAX (Flax NNX): load Hugging Face checkpoints, take
layer activations, generate. Needs the ``tpupod[model]`` extra.

    >>> from tpupod.model import load_model, make_mesh
    >>> model = load_model("/tmp/model/qwen2.5-0.5b", dtype="bfloat16")
    >>> out = model.forward(ids, mask, layers=[15, 16, 23])
    >>> model.chat([{"role": "user", "content": "Who are you?"}], max_new_tokens=64).texts

Design notes: docs/model.md.
"""

from tpupod.model.config import PRESETS, QwenConfig, qwen2_5_0_5b, qwen3_0_6b, qwen3_1_7b
from tpupod.model.qwen import ForwardOutput, Generation, QwenModel, load_model, random_model
from tpupod.model.sharding import make_mesh
from tpupod.model.tokenizer import Tokenizer

__all__ = [
    "PRESETS",
    "ForwardOutput",
    "Generation",
    "QwenConfig",
    "QwenModel",
    "Tokenizer",
    "load_model",
    "make_mesh",
    "qwen2_5_0_5b",
    "qwen3_0_6b",
    "qwen3_1_7b",
    "random_model",
]
