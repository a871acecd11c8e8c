"""The Qwen model against transformers' outputs on tiny random checkpoints.

The checkpoints and references in tests/fixtures were written by
tests/fixtures/make_qwen_fixtures.py (transformers on the CPU); ``make
test-reference`` writes them afresh into a temporary folder and reruns these
tests against that (``TPUPOD_MODEL_FIXTURES``).

Tolerances: float32 logits and hidden states within 1e-4 absolute. bfloat16
within 0.1 absolute on logits and hidden states of magnitude up to ~10 (a
bfloat16 value near 8 is only resolved to 0.03; two implementations that
round at different points drift by a few of those steps).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import IN_CI

if importlib.util.find_spec("flax") is None:  # the model needs the tpupod[model] extra
    if IN_CI:
        raise RuntimeError("prerequisite missing in CI: flax (pip install -e '.[test]')")
    pytest.skip("flax is not installed (pip install -e '.[model]')", allow_module_level=True)

from tests.checkpoints import CUT_AT, padding_checkpoint
from tests.conftest import CliResult
from tpupod.errors import CheckpointError, ModelError
from tpupod.model import QwenModel, load_model
from tpupod.pod.record import Pod

FIXTURES = Path(os.environ.get("TPUPOD_MODEL_FIXTURES") or Path(__file__).parent / "fixtures")
FAMILIES = ["qwen2", "qwen3"]
F32_ATOL = 1e-4
BF16_ATOL = 0.1


class Reference:
    def __init__(self, family: str) -> None:
        self.folder = FIXTURES / f"{family}-tiny"
        self.meta: dict[str, Any] = json.loads((self.folder / "reference.json").read_text())
        self.arrays = dict(np.load(self.folder / "reference.npz"))
        self.prompts: list[list[int]] = self.meta["prompt_ids"]

    def logits(self, i: int, tag: str = "f32") -> np.ndarray:
        return self.arrays[f"logits_{tag}_{i}"]

    def hidden(self, i: int, tag: str = "f32") -> np.ndarray:
        return self.arrays[f"hidden_{tag}_{i}"]


_models: dict[tuple[str, str], QwenModel] = {}


def model_of(family: str, dtype: str = "float32") -> QwenModel:
    """One loaded model per family and dtype for the whole module (loading compiles nothing)."""
    key = (family, dtype)
    if key not in _models:
        _models[key] = load_model(FIXTURES / f"{family}-tiny", dtype=dtype)
    return _models[key]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_every_hidden_state_match_transformers_f32(family: str) -> None:
    ref, model = Reference(family), model_of(family)
    layers = list(range(model.config.num_hidden_states))
    for i, ids in enumerate(ref.prompts):
        out = model.forward([ids], layers=layers)
        logits, hidden = out.numpy()
        assert logits is not None
        np.testing.assert_allclose(logits[0], ref.logits(i), atol=F32_ATOL, rtol=0)
        assert sorted(hidden) == layers
        for layer in layers:
            np.testing.assert_allclose(
                hidden[layer][0], ref.hidden(i)[layer], atol=F32_ATOL, rtol=0, err_msg=f"{layer}"
            )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_unpadded_reference(family: str, side: str) -> None:
    ref, model = Reference(family), model_of(family)
    width = max(map(len, ref.prompts))
    ids = np.zeros((len(ref.prompts), width), np.int32)
    mask = np.zeros_like(ids)
    spans = []
    for row, prompt in enumerate(ref.prompts):
        start = width - len(prompt) if side == "left" else 0
        ids[row, start : start + len(prompt)] = prompt
        mask[row, start : start + len(prompt)] = 1
        spans.append(slice(start, start + len(prompt)))
    last = model.config.num_layers
    logits, hidden = model.forward(ids, mask, layers=[1, last]).numpy()
    assert logits is not None
    assert logits.shape == (len(ref.prompts), width, model.config.vocab_size)
    for row, span in enumerate(spans):
        np.testing.assert_allclose(logits[row, span], ref.logits(row), atol=F32_ATOL, rtol=0)
        for layer in (1, last):
            np.testing.assert_allclose(
                hidden[layer][row, span], ref.hidden(row)[layer], atol=F32_ATOL, rtol=0
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_within_stated_tolerance(family: str) -> None:
    ref, model = Reference(family), model_of(family, "bfloat16")
    layers = list(range(model.config.num_hidden_states))
    for i, ids in enumerate(ref.prompts):
        out = model.forward([ids], layers=layers)
        assert out.logits is not None and str(out.logits.dtype) == "bfloat16"
        logits, hidden = out.numpy()
        assert logits is not None
        np.testing.assert_allclose(
            logits[0].astype(np.float32), ref.logits(i, "bf16"), atol=BF16_ATOL, rtol=0
        )
        for layer in layers:
            np.testing.assert_allclose(
                hidden[layer][0].astype(np.float32),
                ref.hidden(i, "bf16")[layer],
                atol=BF16_ATOL,
                rtol=0,
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers_generate(family: str) -> None:
    ref, model = Reference(family), model_of(family)
    n, new = ref.meta["greedy_prompts"], ref.meta["greedy_new_tokens"]
    result = model.generate(ref.prompts[:n], max_new_tokens=new, stop_tokens=())
    assert result.tokens == ref.arrays["greedy"].tolist()
    assert result.finish_reasons == ["length"] * n
    assert result.prompt_lengths == [len(p) for p in ref.prompts[:n]]


def test_generation_stops_at_a_stop_token_and_pads_the_rest() -> None:
    ref, model = Reference("qwen2"), model_of("qwen2")
    greedy = ref.arrays["greedy"].tolist()
    stop = greedy[0][4]
    first = greedy[0].index(stop)
    result = model.generate(ref.prompts[:2], max_new_tokens=20, stop_tokens=[stop])
    assert result.tokens[0] == greedy[0][: first + 1]
    assert result.finish_reasons[0] == "stop"
    if stop not in greedy[1]:
        assert result.tokens[1] == greedy[1] and result.finish_reasons[1] == "length"


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy() -> None:
    ref, model = Reference("qwen3"), model_of("qwen3")
    prompts = ref.prompts[:2]
    kwargs: dict[str, Any] = {"max_new_tokens": 12, "stop_tokens": ()}
    a = model.generate(prompts, temperature=1.5, top_p=0.95, seed=7, **kwargs)
    b = model.generate(prompts, temperature=1.5, top_p=0.95, seed=7, **kwargs)
    c = model.generate(prompts, temperature=1.5, top_p=0.95, seed=8, **kwargs)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    greedy = model.generate(prompts, **kwargs)
    narrow = model.generate(prompts, temperature=1.0, top_p=1e-6, seed=3, **kwargs)
    assert narrow.tokens == greedy.tokens == ref.arrays["greedy"][:, :12].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_as_transformers_does(family: str) -> None:
    ref, model = Reference(family), model_of(family)
    assert model.tokenizer is not None
    text = model.tokenizer.apply_chat_template(ref.meta["chat_messages"], **ref.meta["chat_kwargs"])
    assert text == ref.meta["chat_text"]
    assert model.tokenizer.encode(text) == ref.meta["chat_ids"]


def test_chat_generates_text_from_messages() -> None:
    ref, model = Reference("qwen3"), model_of("qwen3")
    result = model.chat(
        [ref.meta["chat_messages"], [{"role": "user", "content": "def add(a, b):"}]],
        template_kwargs=ref.meta["chat_kwargs"],
        max_new_tokens=6,
        stop_tokens=(),
    )
    assert result.texts is not None and len(result.texts) == 2
    assert result.prompt_lengths[0] == len(ref.meta["chat_ids"])
    expected = model.generate([ref.meta["chat_ids"]], max_new_tokens=6, stop_tokens=())
    assert result.tokens[0] == expected.tokens[0]
    assert model.tokenizer is not None
    assert result.texts[0] == model.tokenizer.decode(result.tokens[0])


def test_a_saved_tokenizer_that_pads_and_truncates_gives_each_text_its_own_ids(
    tmp_path: Path,
) -> None:
    """tokenizer.json with padding and truncation on (as many saved tokenizers have it):
    encode_batch padded every text to the longest and cut them all to 8 ids, so
    ``generate`` on texts continued after pad ids and answered differently in a batch."""
    ref = Reference("qwen2")
    model = load_model(padding_checkpoint(tmp_path / "padded"), tokenizer=True)
    tok = model.tokenizer
    assert tok is not None
    texts: list[str] = ref.meta["prompts"]
    assert max(len(p) for p in ref.prompts) > CUT_AT  # the saved truncation would cut it
    assert tok.encode_batch(["a", *texts]) == [[tok.encode("a")[0]], *ref.prompts]
    assert [tok.encode(t) for t in texts] == ref.prompts  # one text alone is not cut either
    chat = tok.apply_chat_template(ref.meta["chat_messages"], **ref.meta["chat_kwargs"])
    assert tok.encode(chat) == ref.meta["chat_ids"]
    n, new = ref.meta["greedy_prompts"], ref.meta["greedy_new_tokens"]
    batched = model.generate(["a", *texts[:n]], max_new_tokens=new, stop_tokens=())
    assert batched.tokens[1:] == ref.arrays["greedy"].tolist()  # transformers' answers
    assert batched.prompt_lengths == [1, *(len(p) for p in ref.prompts[:n])]
    alone = model.generate("a", max_new_tokens=new, stop_tokens=())
    assert batched.tokens[0] == alone.tokens[0]


def test_only_requested_layers_come_back_and_indices_are_checked() -> None:
    model = model_of("qwen2")
    out = model.forward([[5, 6, 7]], layers=[2, -1], logits="last")
    assert sorted(out.hidden_states) == [2, model.config.num_layers]
    assert out.logits is not None and out.logits.shape == (1, model.config.vocab_size)
    assert model.forward([[5, 6, 7]], logits="none").hidden_states == {}
    with pytest.raises(ModelError, match="no hidden state 4: this model has 4"):
        model.forward([[5, 6, 7]], layers=[4])


def test_varied_batches_compile_a_handful_of_programs() -> None:
    from tpupod.model import compute

    model = load_model(FIXTURES / "qwen2-tiny")  # a fresh graphdef: its own cache entries
    before = compute.forward._cache_size()  # type: ignore[attr-defined]
    for batch in (1, 2, 3, 4):
        for length in (3, 9, 14, 16):
            out = model.forward([[7] * length] * batch, layers=[1])
            assert out.hidden_states[1].shape == (batch, length, model.config.hidden_size)
    assert compute.forward._cache_size() - before == 3  # type: ignore[attr-defined]  # batch buckets 1, 2, 4; length 16


def _copy(family: str, tmp_path: Path) -> Path:
    folder = tmp_path / family
    shutil.copytree(FIXTURES / f"{family}-tiny", folder)
    return folder


def test_loader_lists_every_missing_and_misshapen_tensor(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from tpupod.model.loading import iter_tensors

    folder = _copy("qwen2", tmp_path)
    tensors = {name: t.astype(np.float32) for name, t in iter_tensors(folder)}
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["model.layers.2.self_attn.k_proj.bias"]
    tensors["model.norm.weight"] = np.ones(65, np.float32)
    tensors["model.layers.0.self_attn.extra.weight"] = np.ones(3, np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_model(folder)
    message = str(info.value)
    assert "4 problems" in message
    assert "missing tensor model.layers.1.mlp.up_proj.weight [128, 64]" in message
    assert "missing tensor model.layers.2.self_attn.k_proj.bias [32]" in message
    assert "model.norm.weight has shape [65], config.json implies [64]" in message
    assert "unexpected tensor model.layers.0.self_attn.extra.weight [3]" in message


def test_loader_refuses_an_unsupported_architecture(tmp_path: Path) -> None:
    folder = _copy("qwen3", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"], config["model_type"] = ["LlamaForCausalLM"], "llama"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported architecture: LlamaForCausalLM") as info:
        load_model(folder)
    assert info.value.hint is not None and "Qwen3ForCausalLM" in info.value.hint


def test_loader_says_what_a_folder_lacks(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelError, match="unsupported dtype 'bf16'") as info:
        load_model(FIXTURES / "qwen2-tiny", dtype="bf16")
    assert info.value.hint == "choose one of float32, bfloat16, float16"
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        load_model(tmp_path)
    folder = _copy("qwen3", tmp_path)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lacks shards its index names"):
        load_model(folder)


def test_loads_through_fsspec_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote path (fsspec's in-memory filesystem stands in for gs://) is copied once."""
    import fsspec

    monkeypatch.setenv("TPUPOD_MODEL_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    for f in (FIXTURES / "qwen3-tiny").iterdir():
        fs.pipe(f"/ckpt/qwen3-tiny/{f.name}", f.read_bytes())
    remote = load_model("memory://ckpt/qwen3-tiny")
    ref = Reference("qwen3")
    logits, _ = remote.forward([ref.prompts[0]]).numpy()
    assert logits is not None
    np.testing.assert_allclose(logits[0], ref.logits(0), atol=F32_ATOL, rtol=0)
    copies = list((tmp_path / "cache").iterdir())
    assert len(copies) == 1 and not copies[0].name.startswith(".partial")
    assert not (copies[0] / "reference.npz").exists()  # only checkpoint files travel
    fs.rm("/ckpt/qwen3-tiny", recursive=True)  # a second load reads the cache alone
    assert load_model("memory://ckpt/qwen3-tiny").config == remote.config
    with pytest.raises(CheckpointError, match="cannot list memory://ckpt/other"):
        load_model("memory://ckpt/other")


SHARDED = """
import json, sys
import numpy as np
import jax
from tpupod.model import load_model, make_mesh
folder = sys.argv[1]
plain = load_model(folder)
mesh = make_mesh(data=2, model=2)
sharded = load_model(folder, mesh=mesh)
ids = json.loads(sys.argv[2])
ids = ids + ids[:1]  # four rows: the data axis splits them evenly
layers = [0, 1, plain.config.num_layers]
a = plain.forward(ids, layers=layers)
b = sharded.forward(ids, layers=layers)
up = sharded._state["layers"][0]["mlp"]["up_kernel"][...]
print(json.dumps({
    "devices": len(jax.devices()),
    "logits": float(np.abs(a.numpy()[0] - b.numpy()[0]).max()),
    "hidden": max(float(np.abs(a.numpy()[1][i] - b.numpy()[1][i]).max()) for i in layers),
    "logits_spec": str(b.logits.sharding.spec),
    "up_spec": str(up.sharding.spec),
    "generate_equal": plain.generate(ids, max_new_tokens=8).tokens
        == sharded.generate(ids, max_new_tokens=8).tokens,
}))
"""


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_over_four_devices_equals_unsharded(family: str) -> None:
    ref = Reference(family)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED, str(ref.folder), json.dumps(ref.prompts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert result["logits"] < 1e-5 and result["hidden"] < 1e-5, result
    assert result["logits_spec"] == "P('data', None, 'model')", result
    assert result["up_spec"] == "P('model', None)", result
    assert result["generate_equal"], result


def test_tensor_parallel_across_the_processes_of_a_lockstep_run(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    """Two processes of two devices each; the model axis spans the processes."""
    pod = make_pod(2, devices=2)
    program = Path(__file__).parent / "programs" / "qwen_multihost.py"
    folder = FIXTURES / "qwen3-tiny"
    result = cli(
        "run", "--pod", pod.name, "--", sys.executable, str(program), str(folder), timeout=50
    )
    assert result.code == 0, result.out[-2000:] + result.err[-2000:]
    lines = [
        line for line in result.out.splitlines() if "greedy matches transformers: True" in line
    ]
    assert len(lines) == 2, result.out[-2000:]
    assert all("mesh {'data': 2, 'model': 2}" in line for line in lines)


# the config.json of Qwen/Qwen2.5-0.5B as published (fields the model reads, and some it ignores)
QWEN2_5_0_5B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    ("name", "total", "non_embedding"),
    [
        ("qwen2.5-0.5b", 494_032_768, 0.36e9),  # the model card: 0.49B, 0.36B non-embedding
        ("qwen3-0.6b", 596_049_920, 0.44e9),  # 0.6B, 0.44B
        ("qwen3-1.7b", 1_720_574_976, 1.4e9),  # 1.7B, 1.4B
    ],
)
def test_presets_have_the_published_sizes(name: str, total: int, non_embedding: float) -> None:
    from flax import nnx

    from tpupod.model import PRESETS
    from tpupod.model.modeling import Qwen

    config = PRESETS[name]()
    shapes = nnx.eval_shape(lambda: Qwen(config, np.dtype(np.float32), nnx.Rngs(0)))
    count = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(shapes)))
    assert count == total
    assert abs(config.non_embedding_params() - non_embedding) / non_embedding < 0.03


def test_a_published_config_reads_as_its_preset() -> None:
    from tpupod.model import QwenConfig, qwen2_5_0_5b

    assert QwenConfig.from_hf(QWEN2_5_0_5B_CONFIG) == qwen2_5_0_5b()
    with pytest.raises(CheckpointError, match="unsupported rope scaling 'yarn'"):
        QwenConfig.from_hf({**QWEN2_5_0_5B_CONFIG, "rope_scaling": {"type": "yarn"}})
    with pytest.raises(CheckpointError, match="sliding-window attention"):
        QwenConfig.from_hf({**QWEN2_5_0_5B_CONFIG, "use_sliding_window": True})
    broken = dict(QWEN2_5_0_5B_CONFIG)
    del broken["hidden_size"]
    with pytest.raises(CheckpointError, match=r"config\.json lacks 'hidden_size'"):
        QwenConfig.from_hf(broken)


def test_blocked_causal_attention_equals_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts longer than a CPU attention block (64) take the blocked path; padded too."""
    import jax

    from tpupod.model import modeling

    model = model_of("qwen3")
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 400, n).tolist() for n in (150, 97, 64)]
    blocked, _ = model.forward(rows, layers=[1]).numpy()
    greedy = model.generate(rows, max_new_tokens=5, stop_tokens=()).tokens
    monkeypatch.setattr(modeling, "ATTENTION_BLOCK", {})
    jax.clear_caches()
    whole, _ = model.forward(rows, layers=[1]).numpy()
    assert blocked is not None and whole is not None
    for row, ids in enumerate(rows):
        np.testing.assert_allclose(blocked[row, : len(ids)], whole[row, : len(ids)], atol=1e-5)
    assert model.generate(rows, max_new_tokens=5, stop_tokens=()).tokens == greedy
    jax.clear_caches()
