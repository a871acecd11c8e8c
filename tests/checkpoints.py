"""Fixture checkpoints as saved tokenizers often are: ``tokenizer.json`` with padding
(every text of a batch padded to the longest) and truncation turned on. The
committed fixtures have ``"padding": null``, which hid that tpupod took the
tokenizer's settings as they came."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
CUT_AT = 12  # the saved truncation's max_length: far shorter than the test texts


def padding_checkpoint(dest: Path, family: str = "qwen2") -> Path:
    """A copy of the ``family`` fixture whose tokenizer pads (BatchLongest, pad id 0) and
    truncates (to ``CUT_AT`` tokens) when loaded as saved."""
    shutil.copytree(FIXTURES / f"{family}-tiny", dest)
    path = dest / "tokenizer.json"
    saved = json.loads(path.read_text())
    saved["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<|endoftext|>",
    }
    saved["truncation"] = {
        "direction": "Right",
        "max_length": CUT_AT,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    path.write_text(json.dumps(saved))
    return dest
