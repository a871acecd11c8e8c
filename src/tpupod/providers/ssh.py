"""The SSH provider: a pod of hosts that already exist, reached over SSH.

``up`` checks that every host answers and records its hostname and address;
if any host does not, nothing is recorded and the error names each one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from pathlib import Path

from tpupod.errors import SpecError, TpupodError, WorkerError
from tpupod.holder.client import stop_holder
from tpupod.pod.record import Pod, Worker, slice_of
from tpupod.pod.spec import GcpPodSpec, PodSpec, SshHost, SshPodSpec
from tpupod.pod.state import StateDir
from tpupod.transport.ssh import ConnectOptions, SshConnector, SshPool, probe

KNOWN_HOSTS_FILE = "known_hosts"
KEY_HINT = "give the path of an SSH private key, or leave out --key to use ssh-agent and ~/.ssh"
PASSPHRASE = (
    "is protected by a passphrase",
    "tpupod never asks for one: load the key into ssh-agent (ssh-add) and leave out --key",
)
NOT_VALID = ("is not a valid private key", "the file looks damaged: " + KEY_HINT)
OPENSSH_BEGIN = b"-----BEGIN OPENSSH PRIVATE KEY-----"
OPENSSH_MAGIC = b"openssh-key-v1\0"


class SshProvider:
    async def create(self, spec: PodSpec, state: StateDir, *, recreate: bool = False) -> Pod:
        assert isinstance(spec, SshPodSpec)
        if spec.key:
            await asyncio.to_thread(check_key_file, spec.key)
        pool = SshPool(connect_options(spec, state))
        targets = [login_target(spec, host) for host in spec.hosts]
        try:
            answers = await asyncio.gather(
                *(probe(pool, target, i) for i, target in enumerate(targets)),
                return_exceptions=True,
            )
        finally:
            await pool.close()
        found = [a for a in answers if not isinstance(a, BaseException)]
        if len(found) < len(answers):
            failures = [a for a in answers if isinstance(a, BaseException)]
            raise _unreachable_hosts(failures, len(targets))
        workers = [
            Worker(
                id=i,
                hostname=host.hostname,
                internal_address=host.address,
                ssh=target,
                login_shell=host.login_shell,
                slice=slice_of(i, len(targets), spec.slices),
            )
            for i, (target, host) in enumerate(zip(targets, found, strict=True))
        ]
        return Pod(name=spec.name, spec=spec, workers=tuple(workers))

    async def destroy(self, pod: Pod, state: StateDir) -> None:
        """The hosts are not ours to delete: close the pod's held connections, and forget it."""
        await asyncio.to_thread(stop_holder, state, pod.name)

    async def live_state(self, pod: Pod) -> str | None:
        return None

    async def slice_states(self, pod: Pod) -> list[str]:
        return []

    def connect(self, pod: Pod, state: StateDir) -> SshConnector:
        assert isinstance(pod.spec, SshPodSpec)
        return SshConnector(SshPool(connect_options(pod.spec, state)))

    def worker_env(self, pod: Pod, worker: Worker) -> dict[str, str]:
        return dict(pod.spec.env)


def login_target(spec: SshPodSpec, host: SshHost) -> SshHost:
    """The host with its login user settled (the host's own, else the pod's, else ours)."""
    return host if host.user or not spec.user else host.model_copy(update={"user": spec.user})


def check_key_file(path: str) -> None:
    """Refuse a key file that cannot work, before any host is tried: a missing or unreadable
    file, a public key, a passphrase (never asked for), or text that is no private key."""
    try:
        data = Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        raise SpecError(f"key file {path} does not exist", hint=KEY_HINT) from None
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise SpecError(f"key file {path} cannot be read: {reason}", hint=KEY_HINT) from None
    problem = _key_problem(data.strip())
    if problem is not None:
        raise SpecError(f"key file {path} {problem[0]}", hint=problem[1])


def _key_problem(text: bytes) -> tuple[str, str] | None:
    """What is wrong with a private key file's contents (formats asyncssh reads), if anything."""
    if not text:
        return "is empty", KEY_HINT
    if text.startswith((b"ssh-", b"ecdsa-", b"sk-")):
        return "is a public key", "give the private key: the same path without .pub"
    if text.startswith(OPENSSH_BEGIN):
        return _openssh_problem(text)
    if text.startswith(b"-----BEGIN ") and b"PRIVATE KEY-----" in text.split(b"\n", 1)[0]:
        return PASSPHRASE if b"ENCRYPTED" in text[:200] else None  # PEM: PKCS#1, #8, SEC1
    if text.startswith(b"PuTTY-User-Key-File-"):
        return None if b"Encryption: none" in text else PASSPHRASE
    if text[0] == 0x30:
        return None  # DER: a binary ASN.1 sequence
    return "is not a private key", KEY_HINT


def _openssh_problem(text: bytes) -> tuple[str, str] | None:
    """OpenSSH's format: base64 of the magic, then the cipher's name ("none" unless encrypted)."""
    body = text.removeprefix(OPENSSH_BEGIN).split(b"-----END", 1)[0]
    try:
        blob = base64.b64decode(b"".join(body.split()), validate=True)
    except binascii.Error:
        return NOT_VALID
    start = len(OPENSSH_MAGIC) + 4
    if not blob.startswith(OPENSSH_MAGIC) or len(blob) < start:
        return NOT_VALID
    length = int.from_bytes(blob[len(OPENSSH_MAGIC) : start], "big")
    return None if blob[start : start + length] == b"none" else PASSPHRASE


def connect_options(spec: SshPodSpec | GcpPodSpec, state: StateDir) -> ConnectOptions:
    return ConnectOptions(
        user=spec.user,
        key=spec.key,
        host_keys=spec.host_keys,
        known_hosts=state.pod_dir(spec.name) / KNOWN_HOSTS_FILE,
        concurrency=spec.connect_concurrency,
        stagger_s=spec.connect_stagger_ms / 1000,
        timeout_s=spec.connect_timeout,
        retries=spec.connect_retries,
        keepalive_s=spec.keepalive_interval,
        keepalive_count=spec.keepalive_count,
    )


def _unreachable_hosts(failures: list[BaseException], total: int) -> TpupodError:
    for failure in failures:
        if not isinstance(failure, TpupodError):
            raise failure  # a bug, not a host: let it surface
    reasons = "; ".join(str(f) for f in failures)
    hints = {f.hint for f in failures if isinstance(f, WorkerError) and f.hint}
    return TpupodError(
        f"{len(failures)} of {total} hosts did not answer, so the pod was not created: {reasons}",
        hint=" / ".join(sorted(hints)) or "check the hosts and try again",
    )
