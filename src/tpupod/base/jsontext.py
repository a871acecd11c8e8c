"""JSON text that no encoder can take.

JSON may escape half of a UTF-16 surrogate pair on its own (``"\\ud800"``), and
``json.loads`` gives it back as a ``str`` that UTF-8, and so every tokenizer, refuses:
web-scraped datasets hold such strings (text cut between the halves of an emoji). The
places that take JSON text for a tokenizer (a request body, a dataset's line) check it
here, where they can name it, not in the tokenizer, where it is an internal error.
"""

from __future__ import annotations

import json
import re
from typing import Any

# the escape of a surrogate half; a whole pair escaped (ensure_ascii JSON's emoji) loads
# as one character, so only a match makes it worth encoding every string
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(value: Any, raw: bytes | None = None) -> str | None:
    """What is wrong with ``value`` if a string in it holds half a surrogate pair, else
    None. Given the ``raw`` JSON it was parsed from, the strings are looked at only when
    ``raw`` escapes such a half (Python's own strings may hold one from anywhere: a
    command line's undecodable byte is one, by ``surrogateescape``)."""
    if raw is not None and not _ESCAPED_SURROGATE.search(raw):
        return None
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode()
    except UnicodeEncodeError as exc:
        char = exc.object[exc.start]
        bad = char.encode("unicode_escape").decode()
        if 0xDC80 <= ord(char) <= 0xDCFF:  # what surrogateescape makes of a byte
            byte = ord(char) - 0xDC00
            return (
                f"the byte 0x{byte:02x} is not UTF-8 text ({bad}, as Python reads such a "
                "byte of a command line or a file name)"
            )
        return f"{bad} is half of a UTF-16 surrogate pair, not a character"
    return None
