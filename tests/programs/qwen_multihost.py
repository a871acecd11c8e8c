"""Run the tiny Qwen across the processes of a lockstep JAX run (``tpupod run``).

The mesh splits the data axis within a process and the model axis across
processes, so every tensor-parallel matmul needs a cross-process collective. Every process passes
the same global batch; results must match the transformers reference.

    tpupod run -- python tests/programs/qwen_multihost.py FIXTURE_FOLDER
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import tpupod

tpupod.init_jax()

import jax  # noqa: E402  (after init_jax)

from tpupod.model import load_model, make_mesh  # noqa: E402

folder = Path(sys.argv[1])
reference = json.loads((folder / "reference.json").read_text())
arrays = np.load(folder / "reference.npz")
devices = np.array(jax.devices()).reshape(jax.process_count(), -1).T  # [local, process]
mesh = make_mesh(data=devices.shape[0], model=devices.shape[1], devices=devices.ravel().tolist())
model = load_model(folder, mesh=mesh)
prompts = reference["prompt_ids"]
batch = (prompts * 2)[: 2 * ((len(prompts) + 1) // 2)]  # rows divisible by the data axis
logits, hidden = model.forward(batch, layers=[1]).numpy()
assert logits is not None
worst = max(
    float(np.abs(logits[i, : len(p)] - arrays[f"logits_f32_{i % len(prompts)}"]).max())
    for i, p in enumerate(batch)
)
n = reference["greedy_prompts"]
tokens = model.generate(prompts[:n], max_new_tokens=20, stop_tokens=()).tokens
same = tokens == arrays["greedy"].tolist()
print(
    f"process {jax.process_index()} of {jax.process_count()}: mesh {dict(mesh.shape)}, "
    f"max logits error {worst:.2e}, greedy matches transformers: {same}"
)
sys.exit(0 if worst < 1e-4 and same else 1)
