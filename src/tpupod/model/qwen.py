"""The public model object: ``load_model``, ``random_model``, forward and generate.

Inputs are padded here, on the host, to buckets (powers of two, at least 16
positions; batches to a power of two that the mesh's data axis divides), so
a run with varied batches compiles a handful of programs. Outputs are sliced
back to the caller's shape.

On a mesh spanning several processes (a multi-host JAX run) every process
calls with the same global batch, the way lockstep programs do; parameters
and inputs are placed shard by shard from each process's full host copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from tpupod.errors import ModelError
from tpupod.model import compute, loading, sharding
from tpupod.model.config import QwenConfig
from tpupod.model.modeling import Qwen
from tpupod.model.tokenizer import Message, Tokenizer

DTypeLike = str | Any
Logits = Literal["all", "last", "none"]
# "auto": cuDNN flash attention for right-padded bf16/f16 batches on a GPU, else XLA's
Attention = Literal["auto", "xla", "cudnn"]
MIN_LENGTH_BUCKET = 16


def bucket(n: int, minimum: int = 1, multiple: int = 1) -> int:
    """The smallest power of two >= max(n, minimum), rounded up to ``multiple``."""
    size = max(minimum, 1 << max(n - 1, 0).bit_length())
    return -(-size // multiple) * multiple


@dataclasses.dataclass
class ForwardOutput:
    """What ``QwenModel.forward`` returns; arrays may be sharded across processes."""

    logits: jax.Array | None  # [B, T, V] ("all") or [B, V] ("last")
    hidden_states: dict[int, jax.Array]  # index -> [B, T, D], transformers' numbering
    attention_mask: np.ndarray  # [B, T]

    def numpy(self) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
        """Host copies of the logits and hidden states (gathered across processes)."""
        logits = None if self.logits is None else to_host(self.logits)
        return logits, {i: to_host(h) for i, h in self.hidden_states.items()}


@dataclasses.dataclass
class Generation:
    """New tokens per prompt, why each stopped, and the text when there is a tokenizer."""

    tokens: list[list[int]]
    finish_reasons: list[Literal["stop", "length"]]
    prompt_lengths: list[int]
    texts: list[str] | None = None


def to_host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class QwenModel:
    """A Qwen2 / Qwen2.5 / Qwen3 model ready to run: weights placed, tokenizer loaded."""

    def __init__(
        self,
        module: Qwen,
        tokenizer: Tokenizer | None = None,
        mesh: Mesh | None = None,
        stop_tokens: Sequence[int] = (),
        attention: Attention = "auto",
    ) -> None:
        self.module = module
        self.attention = attention
        self.config: QwenConfig = module.config
        self.dtype = module.dtype
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.stop_tokens = tuple(dict.fromkeys(stop_tokens))
        self._graphdef, self._state = nnx.split(module)
        self._data = mesh.shape[sharding.DATA] if mesh is not None else 1

    # ---- inputs -------------------------------------------------------------

    def _batch(
        self,
        input_ids: Any,
        attention_mask: Any,
        *,
        left: bool,
        extra: int = 0,
    ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Padded ids and mask (bucketed), and the caller's batch and length."""
        rows = _rows(input_ids, attention_mask)
        if not rows:
            raise ModelError("no prompts given")
        b, t = len(rows), max(len(r) for r in rows)
        if t + extra > self.config.max_position_embeddings:
            raise ModelError(
                f"{t + extra} positions exceed the model's {self.config.max_position_embeddings}",
                hint="shorten the prompt or max_new_tokens",
            )
        tb = bucket(t, MIN_LENGTH_BUCKET)
        bb = bucket(b, multiple=self._data)
        ids = np.zeros((bb, tb), np.int32)
        mask = np.zeros((bb, tb), np.int32)
        if attention_mask is not None and not left:  # keep the caller's layout
            given_ids = np.asarray(input_ids, np.int32)
            ids[:b, : given_ids.shape[1]] = given_ids
            mask[:b, : given_ids.shape[1]] = np.asarray(attention_mask, np.int32)
            return ids, mask, b, given_ids.shape[1]
        for i, row in enumerate(rows):
            start = tb - len(row) if left else 0
            ids[i, start : start + len(row)] = row
            mask[i, start : start + len(row)] = 1
        return ids, mask, b, t

    def _place(self, array: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(array)
        return sharding.place(array, sharding.batch_sharding(self.mesh))

    def _act_sharding(self) -> jax.sharding.NamedSharding | None:
        return None if self.mesh is None else sharding.batch_sharding(self.mesh)

    def hidden_index(self, layer: int) -> int:
        """A hidden-state index with negatives counted from the end, checked."""
        n = self.config.num_hidden_states
        if not -n <= layer < n:
            raise ModelError(
                f"no hidden state {layer}: this model has {n} (0 = embeddings, "
                f"{n - 1} = after the final norm)",
                hint=f"choose layers in 0..{n - 1} (or negative, from the end)",
            )
        return layer % n

    def _precision(self) -> contextlib.AbstractContextManager[Any]:
        """float32 means float32: GPUs would otherwise multiply in TF32 and TPUs in
        bfloat16 passes (10^-3 off transformers, where float32 is exact)."""
        if self.dtype == jnp.float32:
            return jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    def _fused(self, mask: np.ndarray) -> bool:
        """Whether this batch's attention can run fused (cuDNN): rows right-padded,
        a half-precision dtype, a head size cuDNN takes, and a GPU (or asked for)."""
        if self.attention == "xla":
            return False
        lengths = mask.sum(axis=1, keepdims=True)
        right_padded = bool(np.all(mask == (np.arange(mask.shape[1]) < lengths)))
        if self.attention == "cudnn":
            if jax.default_backend() != "gpu":
                raise ModelError(
                    "cuDNN attention needs a GPU", hint="use attention='auto' or 'xla'"
                )
            if not right_padded:
                raise ModelError("cuDNN attention needs right-padded rows", hint="pad on the right")
            return True
        head_dim = self.config.head_dim
        return (
            right_padded
            and jax.default_backend() == "gpu"
            and self.dtype in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0
            and head_dim <= 128
        )

    # ---- forward ------------------------------------------------------------

    def forward(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        layers: Sequence[int] | None = None,
        logits: Logits = "all",
    ) -> ForwardOutput:
        """Logits and the hidden states of ``layers``, indexed as transformers'
        ``output_hidden_states`` (0 = embeddings, i = after decoder layer i, the
        last = after the final norm). ``input_ids``: [B, T] array (with its mask,
        left or right padded) or a list of token-id lists (right-padded here)."""
        keep = frozenset(self.hidden_index(i) for i in layers or ())
        ids, mask, b, t = self._batch(input_ids, attention_mask, left=False)
        with self._precision():
            out, states = compute.forward(
                self._graphdef,
                self._state,
                self._place(ids),
                self._place(mask),
                keep=keep,
                logits=logits,
                fused=self._fused(mask),
                act_sharding=self._act_sharding(),
                logits_sharding=(
                    None
                    if self.mesh is None
                    else sharding.logits_sharding(self.mesh, self.config.vocab_size)
                ),
            )
        if out is not None:
            out = _crop(out, (b, t) if logits == "all" else (b,))
        ordered = {i: _crop(states[i], (b, t)) for i in sorted(keep)}
        return ForwardOutput(out, ordered, mask[:b, :t])

    # ---- generation ---------------------------------------------------------

    def generate(
        self,
        prompts: Any,
        *,
        attention_mask: Any = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_tokens: Sequence[int] | None = None,
    ) -> Generation:
        """Continue each prompt: token-id lists, a padded [B, T] array with its
        mask, or text (encoded with the checkpoint's tokenizer). Greedy when
        ``temperature`` is 0; ``stop_tokens`` default to the checkpoint's EOS."""
        if max_new_tokens < 1:
            raise ModelError("max_new_tokens must be at least 1")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ModelError("temperature must be >= 0 and top_p in (0, 1]")
        prompts = self._encode_texts(prompts)
        ids, mask, b, _ = self._batch(prompts, attention_mask, left=True, extra=max_new_tokens)
        stops = tuple(self.stop_tokens if stop_tokens is None else stop_tokens)
        stop = np.full((bucket(len(stops) or 1),), -1, np.int32)
        stop[: len(stops)] = stops
        capacity = bucket(max_new_tokens, MIN_LENGTH_BUCKET)
        pad = self.tokenizer.pad_id if self.tokenizer is not None else None
        with self._precision():
            out, _ = compute.generate(
                self._graphdef,
                self._state,
                self._place(ids),
                self._place(mask),
                jnp.int32(max_new_tokens),
                jnp.asarray(stop),
                jnp.float32(max(temperature, 1e-6)),
                jnp.float32(top_p),
                jax.random.key(seed),
                jnp.int32(pad if pad is not None else 0),
                new_capacity=capacity,
                sample=temperature > 0,
                act_sharding=self._act_sharding(),
                cache_sharding=(
                    None
                    if self.mesh is None
                    else sharding.cache_sharding(self.mesh, self.config.num_kv_heads)
                ),
            )
        host = to_host(out)[:b, :max_new_tokens]
        tokens: list[list[int]] = []
        reasons: list[Literal["stop", "length"]] = []
        for row in host.tolist():
            end = next((i for i, tok in enumerate(row) if tok in stops), None)
            tokens.append(row if end is None else row[: end + 1])
            reasons.append("length" if end is None else "stop")
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(t) for t in tokens]
        return Generation(tokens, reasons, [int(m.sum()) for m in mask[:b]], texts)

    def chat(
        self,
        conversations: list[Message] | list[list[Message]],
        *,
        template_kwargs: dict[str, Any] | None = None,
        **generate_kwargs: Any,
    ) -> Generation:
        """Answer one conversation (a list of messages) or several, rendered with
        the checkpoint's chat template (``template_kwargs``: e.g.
        ``{"enable_thinking": False}`` for Qwen3)."""
        tokenizer = self._need_tokenizer()
        batch = cast(
            "list[list[Message]]",
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations,
        )
        prompts = [
            tokenizer.encode(tokenizer.apply_chat_template(c, **(template_kwargs or {})))
            for c in batch
        ]
        return self.generate(prompts, **generate_kwargs)

    def _encode_texts(self, prompts: Any) -> Any:
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], str):
            return self._need_tokenizer().encode_batch(prompts)
        return prompts

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ModelError(
                "this model has no tokenizer", hint="load it from a folder with tokenizer.json"
            )
        return self.tokenizer


def _crop(x: jax.Array, leading: tuple[int, ...]) -> jax.Array:
    """Drop the bucket padding (no copy when there was none)."""
    if x.shape[: len(leading)] == leading:
        return x
    return x[tuple(slice(0, n) for n in leading)]


def _rows(input_ids: Any, attention_mask: Any) -> list[list[int]]:
    """The real tokens of each row."""
    if isinstance(input_ids, np.ndarray | jax.Array):
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if attention_mask is None:
            return [list(map(int, r)) for r in ids]
        mask = np.asarray(attention_mask).reshape(ids.shape).astype(bool)
        return [list(map(int, r[m])) for r, m in zip(ids, mask, strict=True)]
    if input_ids and isinstance(input_ids[0], int | np.integer):
        return [list(map(int, input_ids))]
    return [list(map(int, r)) for r in input_ids]


DTYPES = ("float32", "bfloat16", "float16")


def _dtype(dtype: DTypeLike) -> Any:
    """The compute dtype, refusing what the model does not run in."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPES)}")
    return resolved


def _abstract(config: QwenConfig, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """The module's graph and its parameters (shapes only) by dotted name."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen(config, dtype, nnx.Rngs(0))))
    return graphdef, {".".join(map(str, p)): (p, v) for p, v in nnx.to_flat_state(state)}


def _build(
    graphdef: Any,
    params: dict[str, Any],
    weights: dict[str, np.ndarray],
    dtype: Any,
    mesh: Mesh | None,
) -> Qwen:
    """The module with each parameter placed (on the mesh, if any) from ``weights``."""
    for name, (_, variable) in params.items():
        host = loading.cast(np.asarray(weights[name]), dtype)
        if mesh is None:
            variable.set_value(jnp.asarray(host))
        else:
            variable.set_value(
                sharding.place(host, sharding.param_sharding(name, host.shape, mesh))
            )
    return nnx.merge(graphdef, nnx.from_flat_state(list(params.values())))


def _random_weights(params: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Small normal weights (norm scales 1), drawn on the host so every process agrees."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, (_, variable) in params.items():
        shape = variable.get_value().shape
        if name.endswith("scale"):
            weights[name] = np.ones(shape, np.float32)
        else:
            weights[name] = 0.02 * rng.standard_normal(shape, np.float32)
    return weights


def load_model(
    path: str | Path,
    dtype: DTypeLike = "float32",
    mesh: Mesh | None = None,
    tokenizer: bool = True,
    attention: Attention = "auto",
) -> QwenModel:
    """Load a Hugging Face Qwen2 / Qwen2.5 / Qwen3 folder (local or ``gs://``).

    ``dtype``: ``"float32"`` or ``"bfloat16"`` (weights and compute). ``mesh``:
    a (data, model) mesh from ``make_mesh`` for tensor and data parallelism.
    ``attention``: ``"auto"`` uses cuDNN flash attention where it can (right-padded
    half-precision batches on a GPU), ``"xla"`` never, ``"cudnn"`` always.
    """
    folder = loading.localize(path)
    config = loading.read_config(folder)
    dtype = _dtype(dtype)
    graphdef, params = _abstract(config, dtype)
    expected = {name: tuple(v.get_value().shape) for name, (_, v) in params.items()}
    weights = loading.read_weights(folder, config, expected)
    module = _build(graphdef, params, weights, dtype, mesh)
    tok = Tokenizer(folder) if tokenizer else None
    return QwenModel(module, tok, mesh, _stop_tokens(folder, config, tok), attention)


def _stop_tokens(folder: Path, config: QwenConfig, tok: Tokenizer | None) -> list[int]:
    stops = list(config.eos_token_ids)
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        stops += eos if isinstance(eos, list) else [] if eos is None else [eos]
    if tok is not None and tok.eos_id is not None:
        stops.append(tok.eos_id)
    return [int(s) for s in stops]


def random_model(
    config: QwenConfig,
    dtype: DTypeLike = "float32",
    mesh: Mesh | None = None,
    seed: int = 0,
    attention: Attention = "auto",
) -> QwenModel:
    """A model of ``config``'s shape with random weights (benchmarks, tests)."""
    config.validate()
    dtype = _dtype(dtype)
    graphdef, params = _abstract(config, dtype)
    module = _build(graphdef, params, _random_weights(params, seed), dtype, mesh)
    return QwenModel(module, None, mesh, config.eos_token_ids, attention)
