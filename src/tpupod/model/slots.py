"""Slot-based decoding for continuous batching (the ``builtin`` server's engine).

A fixed number of KV-cache slots ``[S, K, L, H]`` per layer (S slots of L
positions) lives on the device for the life of an engine. ``Programs`` holds
the jitted programs that work on it, each compiled once per shape, with the
caches donated so XLA updates them in place and the weights passed as one
list of arrays flattened once (see ``Programs``):

- ``prefill``: the newcomers' prompts packed one after another into one row
  of T tokens (T a length bucket), attention kept within each prompt; every
  token's key and value land in its prompt's slot at its own position.
  Padding tokens name slot ``S`` (out of range) and the scatter drops them.
  One program per length bucket serves any mix of newcomers. It returns the
  newcomers' last hidden states, which ``head`` turns into logits for only as
  many rows as there are newcomers (a power of two); ``choose`` (compiled
  once, for S rows) turns those into their first tokens.
- ``decode``: ``decode_steps`` tokens for every slot. Each row writes its key
  and value at its own position (a scatter; ``compute.generate``'s rows share
  one index because they are left-padded together, these do not) and attends
  to the keys before it. Its input tokens are the previous call's output,
  still on the device, except where the host gives a newcomer's first token,
  so the host can start call k+1 before it reads call k's tokens (the
  engine's overlap). Rows of idle slots compute and are ignored.

A row's positions are 0..n-1 for its n prompt tokens, as ``compute.generate``
gives them after its left padding, so a greedy answer equals ``generate``'s.

Sampling is per row: a temperature, a top-p and a seed each; a row's token k
is drawn with ``fold_in(key(seed), k)``, what ``compute.generate`` draws for a
batch of one, so a row's sample does not depend on its neighbours. When every
row is greedy the sort that top-p needs is skipped (``lax.cond``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tpupod.model.modeling import (
    Attention,
    KVCache,
    Qwen,
    _attend_block,
    run_layers,
)

Array = jax.Array


@jax.jit
def choose(
    logits: Array,  # [B, V]
    steps: Array,  # [B] int32: which token of its answer each row is choosing
    temperature: Array,  # [B] float32, 0 = greedy
    top_p: Array,  # [B] float32 in (0, 1]
    seeds: Array,  # [B] uint32
) -> Array:
    """The next token of each row under its own sampling parameters."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample() -> Array:
        scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # keep the smallest set of most likely tokens whose probability reaches top_p
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(before < top_p[:, None], ordered, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)

        def draw(seed: Array, step: Array, row: Array) -> Array:
            key = jax.random.fold_in(jax.random.key(seed), step)
            return jax.random.categorical(key, row[None])[0]

        drawn = jax.vmap(draw)(seeds, steps, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sample, lambda: greedy)


def empty_caches(
    model: Qwen, slots: int, length: int, sharding: jax.sharding.Sharding | None = None
) -> list[KVCache]:
    """Zeroed caches [S, K, L, H] per layer (on ``sharding`` when given)."""
    cfg = model.config
    shape = (slots, cfg.num_kv_heads, length, cfg.head_dim)

    def zeros() -> Array:
        if sharding is None:
            return jnp.zeros(shape, model.dtype)
        return jax.jit(lambda: jnp.zeros(shape, model.dtype), out_shardings=sharding)()

    return [(zeros(), zeros()) for _ in range(cfg.num_layers)]


def _prefill(  # noqa: PLR0917 (jit takes the arrays positionally)
    model: Qwen,
    caches: list[KVCache],  # each [S, K, L, H]
    input_ids: Array,  # [T]: the newcomers' prompts one after another, then padding
    token_slots: Array,  # [T] the slot of each token's prompt; S (out of range) for padding
    positions: Array,  # [T] each token's position in its own prompt
    last: Array,  # [P] where each newcomer's last token is (0 for padding rows)
) -> tuple[list[KVCache], Array]:
    """Fill the newcomers' slots; return the caches and the final hidden state [P, D]
    of each newcomer's last token (``head`` turns the first rows into logits).

    The prompts are packed into one row: a token attends only to the tokens of
    its own prompt before it, and its key and value land in its prompt's slot at
    its own position. One program per packed length serves any mix of prompts.
    """
    t = input_ids.shape[0]
    same = token_slots[:, None] == token_slots[None, :]
    mask = (jnp.tril(jnp.ones((t, t), bool)) & same)[None]  # [1, T, T]
    hidden = run_layers(model, input_ids[None], positions[None], mask)
    ends = hidden.last[0, last]  # [P, D]
    filled = []
    for (cache_k, cache_v), (k, v) in zip(caches, hidden.caches, strict=True):
        # k, v: [1, K, T, H] -> [T, K, H], one row per token
        k_rows = jnp.transpose(k[0], (1, 0, 2)).astype(cache_k.dtype)
        v_rows = jnp.transpose(v[0], (1, 0, 2)).astype(cache_v.dtype)
        filled.append(
            (
                cache_k.at[token_slots, :, positions].set(k_rows, mode="drop"),
                cache_v.at[token_slots, :, positions].set(v_rows, mode="drop"),
            )
        )
    return filled, ends


def _head(model: Qwen, ends: Array, count: int) -> Array:
    """Logits [P, V] of the first ``count`` rows of ``ends`` [P, D] (the rest zero): a
    prefill of a few newcomers does not pay the LM head for every slot. Compiled
    per ``count`` (powers of two)."""
    logits = model.logits(ends[None, :count])[0]
    return jnp.zeros((ends.shape[0], logits.shape[-1]), logits.dtype).at[:count].set(logits)


def _attention_step(
    attn: Attention,
    x: Array,  # [B, 1, D]
    *,
    rope: tuple[Array, Array],
    cache: KVCache,  # each [B, K, L, H]
    positions: Array,  # [B]
    mask: Array,  # [B, 1, W]
) -> tuple[Array, KVCache]:
    """``modeling.Attention`` for one new token per row, each written at its own position;
    the rows attend over the cache's first W positions (the mask's span)."""
    q, k, v = attn.project(x, rope)  # [B, 1, N, H], [B, 1, K, H], [B, 1, K, H]
    rows = jnp.arange(x.shape[0])
    cache_k = cache[0].at[rows, :, positions].set(k[:, 0].astype(cache[0].dtype))
    cache_v = cache[1].at[rows, :, positions].set(v[:, 0].astype(cache[1].dtype))
    span = mask.shape[-1]
    grouped = _attend_block(  # [B, K, G, 1, H]
        q, cache_k[:, :, :span], cache_v[:, :, :span], mask, attn.groups
    )
    return attn.output(jnp.transpose(grouped, (0, 3, 1, 2, 4))), (cache_k, cache_v)


def _step(
    model: Qwen, caches: list[KVCache], tokens: Array, positions: Array, span: int
) -> tuple[list[KVCache], Array]:
    """One token for every slot, each row attending over the first ``span`` positions of
    its slot: the new caches and the logits [S, V]."""
    mask = (jnp.arange(span)[None, :] <= positions[:, None])[:, None, :]  # [S, 1, W]
    x = jnp.take(model.embedding[...], tokens[:, None], axis=0)  # [S, 1, D]
    rope = model.rope(positions[:, None])
    new_caches: list[KVCache] = []
    for layer, cache in zip(model.layers, caches, strict=True):
        attn_out, kv = _attention_step(
            layer.attn,
            layer.input_norm(x),
            rope=rope,
            cache=cache,
            positions=positions,
            mask=mask,
        )
        x = x + attn_out
        x = x + layer.mlp(layer.post_attn_norm(x))
        new_caches.append(kv)
    return new_caches, model.logits(model.final_norm(x))[:, 0]


def _decode(  # noqa: PLR0917 (jit takes the arrays positionally)
    model: Qwen,
    caches: list[KVCache],
    fed: Array,  # [count, S]: the previous call's tokens, still on the device
    ints: Array,  # [5, S]: host tokens, use-the-host-token, positions, steps, seeds' bits
    floats: Array,  # [2, S]: temperature, top-p
    count: int,
    span: int,
) -> tuple[list[KVCache], Array]:
    """``count`` decode steps, each token fed back on the device: the caches and the
    tokens [count, S]. A slot's first input is the previous call's last token
    (``fed[-1]``), or the host's token where the host says so (a newcomer's first
    token, from its prefill): the host never has to read a token back before the
    next call can start. A row that stops early computes on (in its own slot) until
    the call ends; a position past the cache's end is dropped by the scatter.

    The rows attend over the first ``span`` positions of their slots only (a static
    bucket, ``attention_spans``): the host picks the smallest that holds every running
    row's last position of the call, so a short conversation does not read the whole
    cache every step."""
    host_tokens, use_host, positions, steps, seed_bits = ints
    seeds = jax.lax.bitcast_convert_type(seed_bits, jnp.uint32)
    temperature, top_p = floats
    tokens = jnp.where(use_host != 0, host_tokens, fed[-1])

    def body(carry: Any, _: Any) -> tuple[Any, Array]:
        caches, tokens, positions, steps = carry
        caches, logits = _step(model, caches, tokens, positions, span)
        nxt = choose(logits, steps, temperature, top_p, seeds)
        return (caches, nxt, positions + 1, steps + 1), nxt

    if count == 1:  # one step: no loop
        caches, logits = _step(model, caches, tokens, positions, span)
        return caches, choose(logits, steps, temperature, top_p, seeds)[None]
    (caches, _, _, _), out = jax.lax.scan(
        body, (caches, tokens, positions, steps), None, length=count
    )
    return caches, out


class Programs:
    """The engine's device programs for one model, its weights flattened once.

    ``jax.jit`` flattens every argument on every call and hashes its static
    ones: passing the model as ``(graphdef, state)`` cost a host time per decode
    call that grew with the layer count (nnx's ``State`` is a Python pytree; the
    graphdef a static argument hashed each call). Here the weights are one list
    of arrays (``weights``), flattened once; the graphdef and the tree's
    structure are closed over, and each program is jitted once per engine (the
    decode once per attention span, each its own jitted function: no static
    argument to hash a call).
    """

    def __init__(self, graphdef: nnx.GraphDef[Qwen], state: Any, decode_steps: int = 1) -> None:
        self.weights, treedef = jax.tree.flatten(state)

        def merge(weights: list[Array]) -> Qwen:
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))

        def prefill(weights: list[Array], caches: list[KVCache], *arrays: Array) -> Any:
            return _prefill(merge(weights), caches, *arrays)

        def head(weights: list[Array], ends: Array, count: int) -> Array:
            return _head(merge(weights), ends, count)

        def decoder(span: int) -> Any:
            def decode(
                weights: list[Array], caches: list[KVCache], fed: Array, ints: Array, floats: Array
            ) -> Any:
                return _decode(merge(weights), caches, fed, ints, floats, decode_steps, span)

            return jax.jit(decode, donate_argnums=1)

        self.steps = decode_steps
        self._prefill = jax.jit(prefill, donate_argnums=1)
        self._head = jax.jit(head, static_argnums=2)
        self._decoder = decoder
        self._decodes: dict[int, Any] = {}  # span -> its jitted decode

    def prefill(self, caches: list[KVCache], *arrays: Array) -> tuple[list[KVCache], Array]:
        """``_prefill`` (see there) on these weights: the caches and the ends [P, D]."""
        out: tuple[list[KVCache], Array] = self._prefill(self.weights, caches, *arrays)
        return out

    def head(self, ends: Array, count: int) -> Array:
        out: Array = self._head(self.weights, ends, count)
        return out

    def decode(
        self, caches: list[KVCache], fed: Array, ints: Array, floats: Array, span: int | None = None
    ) -> tuple[list[KVCache], Array]:
        """``_decode`` (see there) on these weights, the rows attending over the first
        ``span`` positions (None: the whole cache): the caches and the tokens [D, S]."""
        span = caches[0][0].shape[2] if span is None else span
        program = self._decodes.get(span)
        if program is None:
            program = self._decodes[span] = self._decoder(span)
        out: tuple[list[KVCache], Array] = program(self.weights, caches, fed, ints, floats)
        return out


def attention_spans(length: int, smallest: int) -> list[int]:
    """The spans a decode call may attend over for slots of ``length`` positions: powers
    of two from ``smallest``, then ``length`` itself. A call attends over the smallest
    that holds its rows (a short conversation reads 128 positions of a 4,096 cache, not
    all of them); each span is one program to compile, so the ladder doubles."""
    spans = []
    span = smallest
    while span < length:
        spans.append(span)
        span *= 2
    return [*spans, length]
