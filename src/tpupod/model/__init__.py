"""Qwen2 / Qwen2.5 / Qwen3 in JAX (Flax NNX): load Hugging Face checkpoints, take
layer activations, generate. Needs the ``tpupod[model]`` extra.

    >>> from tpupod.model import load_model, make_mesh
    >>> model = load_model("/tmp/model/qwen2.5-0.5b", dtype="bfloat16")
    >>> out = model.forward(ids, mask, layers=[15, 16, 23])
    >>> model.chat([{"role": "user", "content": "Who are you?"}], max_new_tokens=64).texts

Design notes: docs/model.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpupod.model.config import PRESETS, QwenConfig, qwen2_5_0_5b, qwen3_0_6b, qwen3_1_7b
    from tpupod.model.qwen import ForwardOutput, Generation, QwenModel, load_model, random_model
    from tpupod.model.sharding import make_mesh
    from tpupod.model.tokenizer import Tokenizer

# Where each name lives: imported on first use, so a process that needs only the
# tokenizer (the builtin server's front end unpickles one) does not load JAX and flax.
_HOMES = {
    "PRESETS": "config",
    "QwenConfig": "config",
    "qwen2_5_0_5b": "config",
    "qwen3_0_6b": "config",
    "qwen3_1_7b": "config",
    "ForwardOutput": "qwen",
    "Generation": "qwen",
    "QwenModel": "qwen",
    "load_model": "qwen",
    "random_model": "qwen",
    "make_mesh": "sharding",
    "Tokenizer": "tokenizer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:  # a submodule (``from tpupod.model import slots``) is imported as usual
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


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
