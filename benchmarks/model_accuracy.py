"""How far tpupod.model's outputs are from transformers' on this machine's backend.

Loads the tiny fixture checkpoints (tests/fixtures) and prints the largest
absolute difference of logits and hidden states from the committed
transformers references, per dtype and attention implementation, and whether
greedy generation matches. The tests assert the CPU numbers; this reports
what a GPU gives (where float32 matmuls may run as TF32).

    python benchmarks/model_accuracy.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tpupod.model import load_model

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def main() -> None:
    print(f"backend {jax.default_backend()}: {jax.devices()[0].device_kind}")
    head = ("family", "dtype", "attention", "logits", "hidden", "greedy")
    print("| {:<6} | {:<8} | {:<9} | {:>9} | {:>9} | {:<6} |".format(*head))
    print(f"|{'-' * 8}|{'-' * 10}|{'-' * 11}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    attentions = ["xla", "cudnn"] if jax.default_backend() == "gpu" else ["xla"]
    for family in ("qwen2", "qwen3"):
        folder = FIXTURES / f"{family}-tiny"
        meta = json.loads((folder / "reference.json").read_text())
        ref = np.load(folder / "reference.npz")
        for dtype, tag in (("float32", "f32"), ("bfloat16", "bf16")):
            for attention in attentions:
                if attention == "cudnn" and dtype == "float32":
                    continue
                try:
                    row = measure(folder, meta, ref, dtype=dtype, tag=tag, attention=attention)
                except Exception as exc:
                    row = f"failed: {str(exc)[:200]}"
                print(f"| {family:<6} | {dtype:<8} | {attention:<9} | {row}")


def measure(
    folder: Path, meta: dict[str, Any], ref: Any, *, dtype: str, tag: str, attention: Any
) -> str:
    """One row's cells: worst logits and hidden-state errors, and greedy agreement."""
    model = load_model(folder, dtype=dtype, attention=attention)
    layers = list(range(model.config.num_hidden_states))
    worst_logits = worst_hidden = 0.0
    for i, ids in enumerate(meta["prompt_ids"]):
        logits, hidden = model.forward([ids], layers=layers).numpy()
        assert logits is not None
        diff = np.abs(logits[0].astype(np.float32) - ref[f"logits_{tag}_{i}"])
        worst_logits = max(worst_logits, float(diff.max()))
        for j in layers:
            diff = np.abs(hidden[j][0].astype(np.float32) - ref[f"hidden_{tag}_{i}"][j])
            worst_hidden = max(worst_hidden, float(diff.max()))
    greedy = "-"
    if dtype == "float32":
        n = meta["greedy_prompts"]
        out = model.generate(meta["prompt_ids"][:n], max_new_tokens=20, stop_tokens=())
        greedy = "same" if out.tokens == ref["greedy"].tolist() else "DIFFERS"
    return f"{worst_logits:9.2e} | {worst_hidden:9.2e} | {greedy:<6} |"


if __name__ == "__main__":
    main()
