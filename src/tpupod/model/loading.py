"""Read a Hugging Face Qwen checkpoint folder into the NNX model.

A folder holds config.json, one ``model.safetensors`` or several shards with
``model.safetensors.index.json``, and the tokenizer files. A ``gs://`` (or any
other fsspec) path is first copied into the model cache, file by file into a
temporary folder that is renamed when complete, so an interrupted copy is
never mistaken for a checkpoint.

Weights are renamed and reshaped by one table (``_WEIGHTS``); every missing,
unexpected or misshapen tensor is collected and reported in one error.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tpupod import settings
from tpupod.errors import CheckpointError
from tpupod.model.config import QwenConfig

_CHECKPOINT_FILES = re.compile(
    r"(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json"
    r"|chat_template\.jinja|special_tokens_map\.json|.*\.safetensors(\.index\.json)?)"
)
# tensors a checkpoint may carry that the model recomputes
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")

Transform = Callable[[np.ndarray, QwenConfig], np.ndarray]


def _same(w: np.ndarray, cfg: QwenConfig) -> np.ndarray:
    return w


def _heads_in(w: np.ndarray, cfg: QwenConfig) -> np.ndarray:
    """[N*H, D] projection to [N, H, D] (a view: kernels keep the [out, in] layout)."""
    return w.reshape(-1, cfg.head_dim, w.shape[1])


def _heads_bias(w: np.ndarray, cfg: QwenConfig) -> np.ndarray:
    """[N*H] bias to [N, H]."""
    return w.reshape(-1, cfg.head_dim)


def _heads_out(w: np.ndarray, cfg: QwenConfig) -> np.ndarray:
    """[D, N*H] output projection to [D, N, H]."""
    return w.reshape(w.shape[0], -1, cfg.head_dim)


_L = r"model\.layers\.(\d+)\."
# Hugging Face name -> (this model's path, with \1 for the layer; transform)
_WEIGHTS: list[tuple[str, str, Transform]] = [
    (r"model\.embed_tokens\.weight", "embedding", _same),
    (r"model\.norm\.weight", "final_norm.scale", _same),
    (r"lm_head\.weight", "lm_head", _same),  # [V, D], as the embedding
    (_L + r"input_layernorm\.weight", r"layers.\1.input_norm.scale", _same),
    (_L + r"post_attention_layernorm\.weight", r"layers.\1.post_attn_norm.scale", _same),
    (_L + r"self_attn\.([qkv])_proj\.weight", r"layers.\1.attn.\2_kernel", _heads_in),
    (_L + r"self_attn\.([qkv])_proj\.bias", r"layers.\1.attn.\2_bias", _heads_bias),
    (_L + r"self_attn\.o_proj\.weight", r"layers.\1.attn.o_kernel", _heads_out),
    (_L + r"self_attn\.o_proj\.bias", r"layers.\1.attn.o_bias", _same),
    (_L + r"self_attn\.([qk])_norm\.weight", r"layers.\1.attn.\2_norm.scale", _same),
    (_L + r"mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_kernel", _same),
]


def map_name(name: str) -> tuple[str, Transform] | None:
    """This model's parameter path and transform for a Hugging Face tensor name."""
    for pattern, target, transform in _WEIGHTS:
        match = re.fullmatch(pattern, name)
        if match:
            return match.expand(target), transform
    return None


def localize(path: str | Path) -> Path:
    """A local folder holding the checkpoint; remote paths are copied into the cache once."""
    text = str(path)
    if "://" not in text or text.startswith("file://"):
        folder = Path(text.removeprefix("file://")).expanduser()
        if not folder.is_dir():
            raise CheckpointError(
                f"no checkpoint folder at {folder}",
                hint="pass a folder with config.json and *.safetensors (local or gs://)",
            )
        return folder
    return _download(text)


def _download(url: str) -> Path:
    # a remote (gs://) checkpoint only
    import fsspec

    cache = settings.model_cache_dir()
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    target = cache / f"{url.rstrip('/').rsplit('/', 1)[-1]}-{digest}"
    if (target / "config.json").is_file():
        return target
    try:
        fs, root = fsspec.core.url_to_fs(url)
        names = [Path(p).name for p in fs.ls(root, detail=False)]
    except (OSError, ImportError, ValueError) as exc:
        raise CheckpointError(
            f"cannot list {url}: {exc}",
            hint="check the path and credentials (gs:// needs gcsfs: pip install gcsfs)",
        ) from exc
    wanted = [n for n in names if _CHECKPOINT_FILES.fullmatch(n)]
    if "config.json" not in wanted:
        raise CheckpointError(f"{url} holds no config.json", hint="is this a checkpoint folder?")
    cache.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache))
    try:
        for name in wanted:
            fs.get(f"{root.rstrip('/')}/{name}", str(partial / name))
        partial.rename(target)
    except FileExistsError:  # another process finished first
        shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def read_config(folder: Path) -> QwenConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{folder} is not a Hugging Face checkpoint: it has no config.json",
            hint="pass the folder that holds config.json and the *.safetensors files",
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    config = QwenConfig.from_hf(raw)
    config.validate()
    return config


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{folder} lacks shards its index names: {', '.join(missing)}",
                hint="the download is incomplete; copy the checkpoint again",
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder} holds no *.safetensors weights",
            hint="save .bin checkpoints again with transformers (it writes safetensors)",
        )
    return files


def iter_tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the checkpoint as (Hugging Face name, numpy array)."""
    # the tensors only: a checkpoint's config and digest do without
    from safetensors import safe_open

    for path in _safetensors_files(folder):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def hf_names(config: QwenConfig) -> list[str]:
    """Every tensor name a checkpoint with this config must hold."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if config.qkv_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.o_bias:
        per_layer.append("self_attn.o_proj.bias")
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names += [f"model.layers.{i}.{n}" for i in range(config.num_layers) for n in per_layer]
    return names


def read_weights(
    folder: Path, config: QwenConfig, expected: dict[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """This model's parameters by path, checked against ``expected`` shapes."""
    weights: dict[str, np.ndarray] = {}
    problems: list[str] = []
    seen: set[str] = set()
    for name, tensor in iter_tensors(folder):
        if _IGNORED.fullmatch(name):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: some checkpoints store the copy anyway
        mapped = map_name(name)
        if mapped is None or mapped[0] not in expected:
            problems.append(f"unexpected tensor {name} {list(tensor.shape)}")
            continue
        path, transform = mapped
        seen.add(path)
        want = _hf_shape(expected[path], transform)
        if tensor.shape != want:
            problems.append(
                f"{name} has shape {list(tensor.shape)}, config.json implies {list(want)}"
            )
            continue
        weights[path] = transform(tensor, config)
    for name in hf_names(config):
        path, transform = map_name(name) or (name, _same)
        if path not in seen and path in expected:
            problems.append(f"missing tensor {name} {list(_hf_shape(expected[path], transform))}")
    if problems:
        raise CheckpointError(
            f"{folder} does not match its config.json ({len(problems)} problems):",
            hint="is the checkpoint complete, and is config.json the one it was saved with?",
            problems=problems,
        )
    return weights


def _hf_shape(shape: tuple[int, ...], transform: Transform) -> tuple[int, ...]:
    """The shape a Hugging Face tensor has when ``transform`` makes ``shape`` of it."""
    if transform is _heads_in:  # [N, H, D] from [N*H, D]
        return (shape[0] * shape[1], shape[2])
    if transform is _heads_out:  # [D, N, H] from [D, N*H]
        return (shape[0], shape[1] * shape[2])
    if transform is _heads_bias:  # [N, H] from [N*H]
        return (shape[0] * shape[1],)
    return shape


def cast(value: np.ndarray, dtype: Any) -> np.ndarray:
    """Cast on the host; bfloat16 comes from ml_dtypes (a JAX dependency)."""
    return value.astype(np.dtype(dtype))
