"""Activation extraction: tpupod's end-to-end rate beside the model's bare prefill, beside
what users write by hand with transformers, and its writes beside a raw sequential write.

One process, one after the other, the same samples (``--samples`` texts of exactly
``--length`` tokens), the same ``--layers`` hidden states (evenly spaced, embeddings
to the final norm), the same random-weight checkpoint of a public shape:

- *bare prefill*: ``model.forward(batch, logits="last")`` over the same batches (the
  forward a generation needs; nothing else leaves the program);
- *tpupod extract*: ``runner.extract_here`` (what each host of ``tpupod extract``
  runs): tokenize, batch, forward with the layers, copy to the host, encode
  safetensors shards, write them on the background thread; timed from its first
  batch to its last byte written (model loading excluded on every side);
- *transformers by hand*: ``AutoModelForCausalLM`` with ``output_hidden_states=True``
  on the base model (no LM head), per batch each sample's real tokens of each layer
  and ``safetensors.torch.save_file``;
- *writes*: the extraction's own files written again through its store (staged,
  renamed) beside ``ndarray.tofile`` of the same number of bytes, same folder.

Needs torch and transformers (``pip install torch==2.13.0 transformers``) for the
checkpoint and the anchor; ``make test`` does not.

    python benchmarks/extract.py                                       # this CPU
    python benchmarks/extract.py --dtype bfloat16 --batch 32 --length 1024 \\
        --samples 256 --shard-samples 64                              # a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tpupod.extract import runner
from tpupod.extract.store import open_store
from tpupod.model import PRESETS, QwenConfig, load_model

TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen2-tiny"


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def checkpoint(cfg: QwenConfig, folder: Path) -> None:
    """A Hugging Face folder of random weights of ``cfg``'s shape, the fixtures' tokenizer."""
    import torch
    import transformers
    from model import hf_config  # benchmarks/model.py

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(cfg))
    hf.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)


def samples(path: Path, n: int, length: int) -> list[list[int]]:
    """``n`` JSONL texts of at least ``length`` tokens; their first ``length`` token ids."""
    from tpupod.model import Tokenizer

    tok = Tokenizer(TOKENIZER)
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
    texts, ids = [], []
    for _ in range(n):
        text = "".join(rng.choice(letters, 6 * length))
        tokens = tok.encode(text)
        assert len(tokens) >= length
        texts.append(text)
        ids.append(tokens[:length])
    path.write_text(
        "".join(json.dumps({"id": f"s{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    return ids


def bare_prefill(folder: Path, ids: list[list[int]], args: argparse.Namespace) -> Any:
    """A function timing every batch's forward (last logits only); warmed up."""
    model = load_model(folder, dtype=args.dtype)
    batches = [ids[i : i + args.batch] for i in range(0, len(ids), args.batch)]

    def run(batch: list[list[int]]) -> None:
        out = model.forward(batch, logits="last")
        jax.block_until_ready(out.logits)

    def timed() -> float:
        started = time.perf_counter()
        for batch in batches:
            run(batch)
        return time.perf_counter() - started

    run(batches[0])
    return timed


def tpupod_extract(folder: Path, data: Path, out: Path, args: argparse.Namespace) -> Any:
    """One extraction into ``out`` (fresh), after a warm-up that compiles; its HostStats."""
    options = runner.ExtractOptions(
        model=str(folder),
        data=str(data),
        layers=tuple(args.layer_list),
        out=str(out),
        batch_size=args.batch,
        max_length=args.length,
        dtype=args.dtype,
        shard_samples=args.shard_samples,
    )
    warm = dataclasses.replace(options, out=f"{out}-warm", max_samples=args.batch)
    runner.extract_here(warm, say=lambda line: None)
    shutil.rmtree(f"{out}-warm")
    _, stats = runner.extract_here(options, say=progress)
    return stats


def transformers_by_hand(
    folder: Path, ids: list[list[int]], out: Path, args: argparse.Namespace
) -> float:
    import torch
    import transformers
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    batches = [ids[i : i + args.batch] for i in range(0, len(ids), args.batch)]

    def run(k: int, batch: list[list[int]]) -> None:
        x = torch.tensor(batch, device=device)
        with torch.inference_mode():
            hidden = model.model(
                x, attention_mask=torch.ones_like(x), output_hidden_states=True
            ).hidden_states
        tensors = {}
        for layer in args.layer_list:
            tensors[f"hidden.{layer}"] = torch.cat(
                [hidden[layer][r, : len(batch[r])] for r in range(len(batch))]
            ).cpu()
        save_file(tensors, str(out / f"batch-{k}.safetensors"))

    run(0, batches[0])
    started = time.perf_counter()
    for k, batch in enumerate(batches):
        run(k, batch)
    return time.perf_counter() - started


def device_to_host(args: argparse.Namespace, cfg: QwenConfig) -> float:
    """Bytes/s of copying one batch's activations (all layers) from the device to numpy."""
    import jax.numpy as jnp

    shape = (len(args.layer_list), args.batch, args.length, cfg.hidden_size)
    x = jax.block_until_ready(jnp.ones(shape, args.dtype))
    seconds = []
    for _ in range(4):
        y = jax.block_until_ready(x + 1)  # a fresh array: no cached host copy
        started = time.perf_counter()
        np.asarray(y)
        seconds.append(time.perf_counter() - started)
    return float(y.nbytes / statistics.median(seconds[1:]))


def writes(source: Path, folder: Path) -> tuple[float, float, int]:
    """Seconds to write ``source``'s files again through the store, and as one tofile."""
    files = [(p.name, p.read_bytes()) for p in sorted(source.iterdir()) if p.is_file()]
    total = sum(len(b) for _, b in files)
    store_s, raw_s = [], []
    for rep in range(3):
        target = folder / f"store-{rep}"
        store = open_store(str(target))
        started = time.perf_counter()
        for name, data in files:
            store.write(name, data)
        store_s.append(time.perf_counter() - started)
        shutil.rmtree(target)
        buffer = np.frombuffer(b"".join(b for _, b in files), np.uint8)
        started = time.perf_counter()
        buffer.tofile(folder / f"raw-{rep}")
        raw_s.append(time.perf_counter() - started)
        (folder / f"raw-{rep}").unlink()
    return statistics.median(store_s), statistics.median(raw_s), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--layers", type=int, default=9, help="how many hidden states to save")
    parser.add_argument("--shard-samples", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = PRESETS[args.shape]()
    n = cfg.num_hidden_states
    args.layer_list = sorted({round(i * (n - 1) / (args.layers - 1)) for i in range(args.layers)})
    work = Path(tempfile.mkdtemp(prefix="tpupod-bench-extract-", dir=args.workdir))
    try:
        result = measure(cfg, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(result, args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def measure(cfg: QwenConfig, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    progress(f"{args.shape}: writing a random checkpoint")
    folder = work / "checkpoint"
    checkpoint(cfg, folder)
    ids = samples(work / "data.jsonl", args.samples, args.length)
    tokens = sum(len(r) for r in ids)
    prefill = bare_prefill(folder, ids, args)
    prefill_s, extract_s = [], []
    for rep in range(args.reps):  # interleaved, so both see the same machine
        progress(f"rep {rep + 1}: bare prefill")
        prefill_s.append(prefill())
        progress(f"rep {rep + 1}: tpupod extract")
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        stats = tpupod_extract(folder, work / "data.jsonl", out, args)
        assert stats.tokens == tokens, (stats.tokens, tokens)
        extract_s.append(stats.seconds)
    result: dict[str, Any] = {
        "shape": args.shape,
        "dtype": args.dtype,
        "batch": args.batch,
        "length": args.length,
        "samples": args.samples,
        "layers": args.layer_list,
        "device": str(jax.devices()[0].device_kind),
        "tokens": tokens,
        "prefill_s": prefill_s,
        "extract_s": extract_s,
        "prefill_tok_s": tokens / statistics.median(prefill_s),
        "extract_tok_s": tokens / statistics.median(extract_s),
        "extract_bytes": stats.bytes,
    }
    result["d2h_bytes_s"] = device_to_host(args, cfg)
    per_token = len(args.layer_list) * cfg.hidden_size * np.dtype(args.dtype).itemsize
    result["bytes_per_token"] = per_token
    progress("writes")
    store_s, raw_s, total = writes(work / "out", work)
    result.update(store_bytes_s=total / store_s, raw_bytes_s=total / raw_s, write_bytes=total)
    if not args.no_transformers:
        progress("transformers by hand")
        hf_s = [transformers_by_hand(folder, ids, work / "hf", args) for _ in range(args.reps)]
        result["transformers_s"] = hf_s
        result["transformers_tok_s"] = tokens / statistics.median(hf_s)
    return result


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"{r['shape']} {r['dtype']}, {r['samples']} samples x {r['length']} tokens, batch "
        f"{r['batch']}, {len(r['layers'])} layers {r['layers']}, on {r['device']}"
    )
    print(f"{'':34}{'tok/s':>10}{'ratio':>9}")
    print(f"{'bare prefill (anchor)':34}{r['prefill_tok_s']:>10.0f}{1:>8.2f}x")
    ratio = r["extract_tok_s"] / r["prefill_tok_s"]
    print(f"{'tpupod extract':34}{r['extract_tok_s']:>10.0f}{ratio:>8.2f}x")
    if "transformers_tok_s" in r:
        hf = r["transformers_tok_s"]
        print(f"{'transformers by hand':34}{hf:>10.0f}{hf / r['prefill_tok_s']:>8.2f}x")
        print(f"tpupod extract / transformers by hand: {r['extract_tok_s'] / hf:.2f}x")
    d2h = r["d2h_bytes_s"] / r["bytes_per_token"]
    print(f"{'device -> host copy bound':34}{d2h:>10.3g}{d2h / r['prefill_tok_s']:>8.2f}x")
    disk = r["raw_bytes_s"] / r["bytes_per_token"]
    print(f"{'ndarray.tofile bound':34}{disk:>10.3g}{disk / r['prefill_tok_s']:>8.2f}x")
    store, raw = r["store_bytes_s"], r["raw_bytes_s"]
    print(
        f"writes of {r['write_bytes'] / 1e6:.0f} MB: tpupod's store {store / 1e9:.2f} GB/s, "
        f"ndarray.tofile {raw / 1e9:.2f} GB/s ({store / raw:.2f}x)"
    )


if __name__ == "__main__":
    main()
