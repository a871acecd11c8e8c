"""The Qwen2 / Qwen2.5 / Qwen3 configuration, read from a checkpoint's config.json.

One frozen dataclass covers the family: Qwen2 differs from Qwen3 only in its
q/k/v biases (Qwen2 always has them) and Qwen3's per-head RMSNorm on queries
and keys. The presets carry the public shapes so benchmarks can build
random-weight models of real size without downloading anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpupod.errors import CheckpointError

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """The shapes and constants of one Qwen model.

    ``family`` is ``"qwen2"`` (Qwen2 and Qwen2.5: q/k/v biases) or ``"qwen3"``
    (q/k RMSNorm, biases only when ``attention_bias``).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.family == "qwen3" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def num_hidden_states(self) -> int:
        """How many hidden states transformers' ``output_hidden_states`` returns."""
        return self.num_layers + 1

    def non_embedding_params(self) -> int:
        """Parameters outside the embedding and the LM head (for FLOP counts)."""
        d, f, n, k, h = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attention = d * n * h * 2 + d * k * h * 2
        return self.num_layers * (attention + 3 * d * f)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> QwenConfig:
        """Build from a Hugging Face config.json, refusing what this model cannot run."""
        architectures = raw.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
        if family is None and raw.get("model_type") in ARCHITECTURES.values():
            family = raw["model_type"]
        if family is None:
            found = ", ".join(architectures) or f"model_type {raw.get('model_type')!r}"
            raise CheckpointError(
                f"unsupported architecture: {found}",
                hint="tpupod.model runs Qwen2, Qwen2.5 and Qwen3 "
                "(Qwen2ForCausalLM, Qwen3ForCausalLM)",
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(
                f"unsupported rope scaling {rope_type!r}",
                hint="only the default rotary embedding is implemented",
            )
        if raw.get("use_sliding_window"):
            raise CheckpointError(
                "sliding-window attention is not implemented",
                hint="set use_sliding_window to false in config.json (Qwen's default)",
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            return cls(
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                attention_bias=bool(raw.get("attention_bias", False)),
                eos_token_ids=_ids(eos),
            )
        except KeyError as exc:
            raise CheckpointError(
                f"config.json lacks {exc.args[0]!r}", hint="is this a complete checkpoint?"
            ) from exc

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"{self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} key/value heads"
            )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def qwen2_5_0_5b() -> QwenConfig:
    """Qwen/Qwen2.5-0.5B (494M parameters, tied embeddings)."""
    return QwenConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        eos_token_ids=(151643,),
    )


def qwen3_0_6b() -> QwenConfig:
    """Qwen/Qwen3-0.6B (0.6B parameters, tied embeddings, head_dim 128)."""
    return QwenConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        eos_token_ids=(151645,),
    )


def qwen3_1_7b() -> QwenConfig:
    """Qwen/Qwen3-1.7B (1.7B parameters, tied embeddings): Qwen3-0.6B, wider."""
    return dataclasses.replace(qwen3_0_6b(), hidden_size=2048, intermediate_size=6144)


PRESETS = {
    "qwen2.5-0.5b": qwen2_5_0_5b,
    "qwen3-0.6b": qwen3_0_6b,
    "qwen3-1.7b": qwen3_1_7b,
}
