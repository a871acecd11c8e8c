"""The Qwen2 / Qwen3 decoder in Flax NNX.

Shapes are named by letters: B batch, T query positions, S key positions,
D hidden, N query heads, K key/value heads, G query heads per key/value head
(N = K * G), H head dim, F MLP width, V vocabulary, L layers.

Numerics follow transformers so hidden states match it closely: RMSNorm
normalises in float32 and casts back before the scale, rotary embeddings are
computed in float32 and cast to the compute dtype, attention softmax runs in
float32. Positions come from the attention mask (a cumulative sum), so left
padding, right padding and no padding give the same values at real tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tpupod.model.config import QwenConfig

Array = jax.Array
KVCache = tuple[Array, Array]  # each [B, K, S, H]: heads lead, as attention reads them


class CausalLengths(NamedTuple):
    """Causal attention over rows that are right-padded (or not padded): row b's
    first ``lengths[b]`` tokens are real. This form lets a GPU use cuDNN's fused
    flash attention instead of a materialised [T, S] score matrix."""

    lengths: Array  # [B] int32


Mask = Array | CausalLengths  # [B, T, S] bool, or lengths for fused attention


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param[Array]:
    return nnx.Param((0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


# Up to this many rows a product runs on a CPU with the weight as the dot's left
# operand (see ``dense``): decode steps, the LM head of a prefill's newcomers. A
# prefill of 256 rows took 20% more CPU time that way than the plain way.
FEW_ROWS = 64


def dense(x: Array, weight: Array) -> Array:
    """``x`` [..., I] times a weight stored [O..., I] (out, then in, as Hugging Face
    stores it): [..., O...].

    On a CPU, for a few rows, the weight is the dot's left operand: XLA's CPU dot
    (YNNPACK) packs its right operand anew on every call, so with the weight on
    the right every decode step copied every weight once more (the LM head's
    136M entries in Qwen2.5-0.5B among them); on the left only the few rows of
    activations are packed. Measured on a 2-core Xeon, a 32-row decode step of
    the 0.5B shape (4 layers): LM head ~1.5x faster, the whole step ~1.3x.
    """
    lead, out = x.shape[:-1], weight.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    table = weight.reshape(-1, weight.shape[-1])
    if jax.default_backend() != "cpu" or rows.shape[0] > FEW_ROWS:
        # elsewhere (and for many rows) the packing is amortised, and the
        # transposed copy of the product below would cost more than it saves
        y = jax.lax.dot_general(rows, table, (((1,), (1,)), ((), ())))
    else:
        # XLA would fold the transpose into the dot, swapping the operands back:
        # a barrier keeps the [O, rows] product
        y = jax.lax.dot_general(table, rows, (((1,), (1,)), ((), ())))
        y = jax.lax.optimization_barrier(y).T
    return y.reshape(*lead, *out)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * xf.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: QwenConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # kernels [out..., in], as Hugging Face stores them (see ``dense``)
        self.q_kernel = _normal(rngs, (n, h, d), dtype)  # [N, H, D]
        self.k_kernel = _normal(rngs, (k, h, d), dtype)  # [K, H, D]
        self.v_kernel = _normal(rngs, (k, h, d), dtype)
        self.o_kernel = _normal(rngs, (d, n, h), dtype)  # [D, N, H]
        self.q_bias = nnx.Param(jnp.zeros((n, h), dtype)) if cfg.qkv_bias else None
        self.k_bias = nnx.Param(jnp.zeros((k, h), dtype)) if cfg.qkv_bias else None
        self.v_bias = nnx.Param(jnp.zeros((k, h), dtype)) if cfg.qkv_bias else None
        self.o_bias = nnx.Param(jnp.zeros((d,), dtype)) if cfg.o_bias else None
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.groups = n // k

    def __call__(
        self,
        x: Array,  # [B, T, D]
        rope: tuple[Array, Array],  # cos, sin: [B, T, H]
        mask: Mask,
        cache: KVCache | None,
        cache_index: Array | None,
    ) -> tuple[Array, KVCache]:
        q, k, v = self.project(x, rope)
        if isinstance(mask, CausalLengths):
            out = jax.nn.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                query_seq_lengths=mask.lengths,
                key_value_seq_lengths=mask.lengths,
                implementation="cudnn",
            )
        # [B, K, T, H]: a decode step then reads the cache without transposing it
        k, v = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
        if cache is not None:
            assert cache_index is not None
            start = (0, 0, cache_index, 0)
            k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), start)
            v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), start)
        if not isinstance(mask, CausalLengths):
            grouped = _attend(q, k, v, mask, self.groups)  # [B, K, G, T, H]
            out = jnp.transpose(grouped, (0, 3, 1, 2, 4))  # [B, T, K, G, H] = [B, T, N, H]
        return self.output(out), (k, v)

    def project(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        """Queries [B, T, N, H], keys and values [B, T, K, H] of ``x`` [B, T, D]: the
        projections, their biases and norms, and the rotary embedding of q and k."""
        q = dense(x, self.q_kernel[...])  # [B, T, N, H]
        k = dense(x, self.k_kernel[...])  # [B, T, K, H]
        v = dense(x, self.v_kernel[...])
        if self.q_bias is not None and self.k_bias is not None and self.v_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return _rotate(q, rope), _rotate(k, rope), v

    def output(self, out: Array) -> Array:
        """The output projection of attention's result ``out`` [B, T, N, H] (or
        [B, T, K, G, H], the same heads grouped) -> [B, T, D]."""
        # one merged (N*H) contracting dimension: with two, XLA may permute the output
        # kernel to suit the activation, a copy of the kernel at every decode step
        o_kernel = self.o_kernel[...]
        d, n, h = o_kernel.shape
        y = dense(out.reshape(*out.shape[:2], n * h), o_kernel.reshape(d, n * h))
        if self.o_bias is not None:
            y = y + self.o_bias[...]
        return y


def _rotate(x: Array, rope: tuple[Array, Array]) -> Array:
    """Rotary embedding, transformers' rotate-half layout. x: [B, T, N, H]."""
    cos, sin = rope[0][:, :, None, :], rope[1][:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# Query rows per block of causal self-attention, by backend. On a CPU, blocks
# skip the masked upper triangle (about 40% of attention's work at 512
# tokens); elsewhere one block (a GPU prefers few large kernels).
ATTENTION_BLOCK = {"cpu": 64}


def _attend(q: Array, k: Array, v: Array, mask: Array, groups: int) -> Array:
    """Grouped-query attention; q [B, T, N, H], k/v [B, K, S, H], mask [B, T, S];
    returns [B, K, G, T, H] (query head n = k * G + g).

    When T == S this is a causal self-attention (a prefill): a block of query
    rows then only meets the keys up to its own last row.
    """
    t, s = q.shape[1], k.shape[2]
    block = ATTENTION_BLOCK.get(jax.default_backend(), t)
    if t != s or t <= block:
        return _attend_block(q, k, v, mask, groups)
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        rows = _attend_block(
            q[:, start:end], k[:, :, :end], v[:, :, :end], mask[:, start:end, :end], groups
        )
        outs.append(rows)
    return jnp.concatenate(outs, axis=3)


def _attend_block(q: Array, k: Array, v: Array, mask: Array, groups: int) -> Array:
    b, t, n, h = q.shape
    qg = q.reshape(b, t, n // groups, groups, h)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k.astype(q.dtype)).astype(jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * (h**-0.5), jnp.finfo(jnp.float32).min)
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    total = jnp.sum(weights, axis=-1)  # [B, K, G, T]
    out = jnp.einsum("bkgts,bksh->bkgth", weights.astype(q.dtype), v.astype(q.dtype))
    # normalise after the product: [T, H] values to divide instead of [T, S]
    return out / total[..., None].astype(out.dtype)


class MLP(nnx.Module):
    def __init__(self, cfg: QwenConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_kernel = _normal(rngs, (f, d), dtype)  # [F, D]
        self.up_kernel = _normal(rngs, (f, d), dtype)
        self.down_kernel = _normal(rngs, (d, f), dtype)  # [D, F]

    def __call__(self, x: Array) -> Array:
        gate = dense(x, self.gate_kernel[...])
        up = dense(x, self.up_kernel[...])
        return dense(jax.nn.silu(gate) * up, self.down_kernel[...])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: QwenConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(
        self,
        x: Array,
        rope: tuple[Array, Array],
        mask: Mask,
        cache: KVCache | None = None,
        cache_index: Array | None = None,
    ) -> tuple[Array, KVCache]:
        attn_out, kv = self.attn(self.input_norm(x), rope, mask, cache, cache_index)
        x = x + attn_out
        return x + self.mlp(self.post_attn_norm(x)), kv


class Qwen(nnx.Module):
    """The decoder stack: embedding, L layers, final norm, LM head."""

    def __init__(self, cfg: QwenConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.dtype = dtype
        self.embedding = _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)  # [V, D]
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)  # [V, D], as tied
        )

    def rope(self, positions: Array) -> tuple[Array, Array]:
        """cos and sin [B, T, H] for integer positions [B, T]."""
        h = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
        angles = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(angles).astype(self.dtype), jnp.sin(angles).astype(self.dtype)

    def logits(self, x: Array) -> Array:
        """[B, T, D] normed hidden states to [B, T, V] logits."""
        return dense(x, self.embedding[...] if self.lm_head is None else self.lm_head[...])


class Hidden(NamedTuple):
    """What one pass through the stack produced."""

    last: Array  # [B, T, D] after the final norm
    states: dict[int, Array]  # the requested hidden states, transformers' indexing
    caches: list[KVCache]


def run_layers(
    model: Qwen,
    input_ids: Array,  # [B, T]
    positions: Array,  # [B, T]
    mask: Mask,
    *,
    keep: frozenset[int] = frozenset(),
    caches: list[KVCache] | None = None,
    cache_index: Array | None = None,
    constrain: ActivationSharding | None = None,
) -> Hidden:
    """Embed, run every decoder layer, apply the final norm.

    ``keep`` names hidden-state indices as transformers counts them: 0 is the
    embedding output, i the output of decoder layer i (1-based), and
    ``num_layers`` the final norm's output.
    """
    x = jnp.take(model.embedding[...], input_ids, axis=0)
    x = constrain(x) if constrain else x
    rope = model.rope(positions)
    states = {0: x} if 0 in keep else {}
    new_caches: list[KVCache] = []
    last_layer = model.config.num_layers
    for i, layer in enumerate(model.layers):
        cache = caches[i] if caches is not None else None
        x, kv = layer(x, rope, mask, cache, cache_index)
        x = constrain(x) if constrain else x
        new_caches.append(kv)
        if i + 1 in keep and i + 1 != last_layer:
            states[i + 1] = x
    x = model.final_norm(x)
    if last_layer in keep:
        states[last_layer] = x
    return Hidden(x, states, new_caches)


class ActivationSharding:
    """Pins activations [B, ...] to the mesh's data axis inside jitted code."""

    def __init__(self, sharding: jax.sharding.NamedSharding) -> None:
        self.sharding = sharding

    def __call__(self, x: Array) -> Array:
        return jax.lax.with_sharding_constraint(x, self.sharding)
