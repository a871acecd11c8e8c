"""asyncssh, imported without cryptography's DSA deprecation warning.

asyncssh (2.24) builds its DSA key types when it is imported, and cryptography 51
deprecated DSA: every command on an SSH pod printed a two-line warning that a user can do
nothing about. tpupod never offers DSA keys (it makes ed25519 keys, and a host's DSA key
is refused by OpenSSH itself), so that one warning is ignored for this import, and no
other. transport/ssh.py and tarstream.py take asyncssh from here.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="DSA is deprecated")
    import asyncssh
    import asyncssh.encryption
    import asyncssh.kex

__all__ = ["asyncssh"]
