"""Qwen2 / Qwen2.5 / Qwen3 in JAX (Flax NNX): load Hugging Face checkpoints, take
layer activations, generate. Needs the ``tpupod[model]`` extra.

    >>> from tpupod.model import load_model, make_mesh
    >>> model = load_model("/tmp/model/qwen2.5-0.5b", dtype="bfloat16")
    >>> out = model.forward(ids, mask, layers=[15, 16, 23])
    >>> model.chat([{"role": "user", "content": "Who are you?"}], max_new_tokens=64).texts

Design notes: docs/model.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpupod.base.lazy import attributes

if TYPE_CHECKING:
    from tpupod.model.config import PRESETS, QwenConfig, qwen2_5_0_5b, qwen3_0_6b, qwen3_1_7b
    from tpupod.model.qwen import ForwardOutput, Generation, QwenModel, load_model, random_model
    from tpupod.model.sharding import make_mesh
    from tpupod.model.tokenizer import Tokenizer

# Imported on first use: a process that needs only the tokenizer (the builtin server's
# front end unpickles one) does not load JAX and flax.
_CONFIG, _QWEN = "tpupod.model.config", "tpupod.model.qwen"
__getattr__, __dir__ = attributes(
    __name__,
    {
        "PRESETS": _CONFIG,
        "QwenConfig": _CONFIG,
        "qwen2_5_0_5b": _CONFIG,
        "qwen3_0_6b": _CONFIG,
        "qwen3_1_7b": _CONFIG,
        "ForwardOutput": _QWEN,
        "Generation": _QWEN,
        "QwenModel": _QWEN,
        "load_model": _QWEN,
        "random_model": _QWEN,
        "make_mesh": "tpupod.model.sharding",
        "Tokenizer": "tpupod.model.tokenizer",
    },
)

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
