"""The Cloud TPU provider: requests, and (against a local stand-in of the API) the lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult, tpupod_argv
from tests.fakes.tpu_api import TpuApiStandIn
from tpupod.sim import SimPod


def dry_run_body(out: str) -> dict[str, object]:
    body: dict[str, object] = json.loads(out[out.index("{") :])
    return body


@pytest.mark.parametrize(
    ("tpu_type", "workers", "runtime"),
    [("v4-16", 2, "tpu-ubuntu2204-base"), ("v5litepod-64", 16, "v2-alpha-tpuv5-lite")],
)
def test_dry_run_shows_the_request_and_the_workers(
    tpu_type: str, workers: int, runtime: str, cli_in_process: Callable[..., CliResult]
) -> None:
    result = cli_in_process(
        "up",
        "--name",
        "dry",
        "--gcp",
        "--tpu-type",
        tpu_type,
        "--zone",
        "us-central2-b",
        "--project",
        "my-proj",
        "--dry-run",
        env={"GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent"},
    )
    assert result.code == 0, result.err
    assert f"{workers} workers" in result.out
    assert "API: Cloud TPU v2, TPU VM (nodes)" in result.out
    assert (
        "POST https://tpu.googleapis.com/v2/projects/my-proj/locations/us-central2-b/nodes?nodeId=dry"
        in result.out
    )
    body = dry_run_body(result.out)
    assert body["acceleratorType"] == tpu_type and body["runtimeVersion"] == runtime
    assert "ssh-keys" in body["metadata"]  # type: ignore[operator]
    assert cli_in_process("list").out == ""  # nothing was created


def test_multislice_and_spot_go_through_queued_resources(
    cli_in_process: Callable[..., CliResult],
) -> None:
    result = cli_in_process(
        "up",
        "--name",
        "ms",
        "--tpu-type",
        "v6e-16",
        "--zone",
        "europe-west4-a",
        "--project",
        "p",
        "--node-count",
        "2",
        "--capacity",
        "spot",
        "--dry-run",
    )
    assert result.code == 0, result.err
    assert "8 workers" in result.out and "API: Cloud TPU v2, Queued Resources" in result.out
    body = dry_run_body(result.out)
    spec = body["tpu"]["nodeSpec"][0]  # type: ignore[index]
    assert spec["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "ms"}
    assert body["spot"] == {}


def test_best_effort_uses_v2alpha1(cli_in_process: Callable[..., CliResult]) -> None:
    result = cli_in_process(
        "up",
        "--name",
        "be",
        "--tpu-type",
        "v5litepod-8",
        "--zone",
        "us-west4-a",
        "--capacity",
        "best-effort",
        "--dry-run",
    )
    assert "API: Cloud TPU v2alpha1, Queued Resources" in result.out
    assert "/v2alpha1/projects/" in result.out


def test_a_wrong_type_names_the_right_one(cli_in_process: Callable[..., CliResult]) -> None:
    result = cli_in_process(
        "up", "--name", "x", "--tpu-type", "v5e-256", "--zone", "us-west4-a", "--dry-run"
    )
    assert result.code == 2
    assert "the API calls it v5litepod-256" in result.err


UP = ("up", "--gcp", "--zone", "us-central2-b", "--project", "proj", "--user", "root")


def test_a_single_slice_from_create_to_delete(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult], sim: SimPod, state_home: Path
) -> None:
    made = cli(*UP, "--name", "tpu1", "--tpu-type", "v4-16")
    assert made.code == 0, made.err
    assert "tpu1: CREATING" in made.err and "tpu1: READY" in made.err
    assert ("POST", "nodes/") in tpu_api.calls and not any(
        k.startswith("queued") for _, k in tpu_api.calls
    )
    key = state_home / "pods" / "tpu1" / "id_ed25519"
    assert key.stat().st_mode & 0o777 == 0o600
    rows = [line.split() for line in cli("hosts", "--pod", "tpu1").out.splitlines()[1:]]
    assert [row[1] for row in rows] == ["host-0", "host-1"]  # hostnames as the workers report them
    result = cli("exec", "--pod", "tpu1", "--", "hostname")
    assert result.code == 0, result.err
    assert sorted(result.out.split()) == ["[w0]", "[w1]", "host-0", "host-1"]
    gone = cli("down", "--pod", "tpu1")
    assert gone.code == 0, gone.err
    assert ("DELETE", "nodes/tpu1") in tpu_api.calls
    assert not tpu_api.resources


def test_a_multislice_queued_resource_lists_every_slice(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    made = cli(*UP, "--name", "ms", "--tpu-type", "v4-8", "--node-count", "2")
    assert made.code == 0, made.err
    for state in ("WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"):
        assert f"ms: {state}" in made.err
    hosts = json.loads(cli("hosts", "--pod", "ms", "--format", "json").out)
    assert [(w["id"], w["slice"]) for w in hosts] == [(0, 0), (1, 1)]
    assert cli("exec", "--pod", "ms", "--", "true").code == 0
    assert cli("down", "--pod", "ms").code == 0
    assert ("DELETE", "queuedResources/ms") in tpu_api.calls and not tpu_api.resources


@pytest.mark.parametrize(
    ("status", "message", "hint", "capacity"),
    [
        ("RESOURCE_EXHAUSTED", "Quota 'TPUV4sPerProjectPerZone' exceeded", "ask for TPU quota", ()),
        ("PERMISSION_DENIED", "Permission 'tpu.nodes.create' denied", "roles/tpu.admin", ()),
        ("ALREADY_EXISTS", "Resource exists", "pick another --name", ()),
        # best-effort: v2alpha1, POSTed by hand, its errors read the same way
        ("RESOURCE_EXHAUSTED", "Quota exceeded", "ask for TPU quota", ("--best-effort",)),
        ("PERMISSION_DENIED", "Permission denied", "roles/tpu.admin", ("--best-effort",)),
    ],
)
def test_api_errors_are_one_line_with_what_to_do(
    status: str,
    message: str,
    hint: str,
    capacity: tuple[str, ...],
    tpu_api: TpuApiStandIn,
    cli_in_process: Callable[..., CliResult],
    state_home: Path,
) -> None:
    tpu_api.fail("POST", "queuedResources" if capacity else "nodes", status, message)
    result = cli_in_process(*UP, "--name", "err", "--tpu-type", "v4-8", *capacity)
    assert result.code == 1
    lines = result.err.strip().splitlines()
    assert lines[-2].startswith("error: Cloud TPU API (err)") and message in lines[-2]
    assert lines[-1].startswith("hint: ") and hint in lines[-1]
    assert "Traceback" not in result.err
    assert not (state_home / "pods" / "err").exists()


def test_a_preempted_tpu_is_reported_plainly(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    tpu_api.steps = 50  # slow enough to preempt it while it is created
    proc = subprocess.Popen(
        tpupod_argv(*UP, "--name", "pre", "--tpu-type", "v4-8", "--preemptible"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    deadline = time.monotonic() + 10
    while not tpu_api.resources and time.monotonic() < deadline:
        time.sleep(0.02)
    tpu_api.preempt("pre")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "error: TPU 'pre' is PREEMPTED" in err and "--recreate" in err


@pytest.mark.parametrize(
    ("capacity", "preempted", "ready"),
    [
        (("--preemptible",), ("PREEMPTED",), "READY"),  # a TPU VM: its node is preempted
        (("--spot", "--node-count", "2"), ("SUSPENDING", "SUSPENDED"), "ACTIVE"),  # suspended
    ],
)
def test_status_shows_the_cloud_state_and_recreate_replaces_a_preempted_tpu(
    capacity: tuple[str, ...],
    preempted: tuple[str, ...],
    ready: str,
    tpu_api: TpuApiStandIn,
    cli_in_process: Callable[..., CliResult],
) -> None:
    pt = (*UP, "--name", "pt", "--tpu-type", "v4-8", *capacity)
    assert cli_in_process(*pt).code == 0
    assert f"cloud state {ready}" in cli_in_process("status", "--pod", "pt").out
    tpu_api.preempt("pt")
    status = cli_in_process("status", "--pod", "pt", "--format", "json")
    assert json.loads(status.out)["cloud_state"] in preempted
    assert not [key for key in tpu_api.resources if "/nodes/pt-" in key]  # a suspended one's went
    again = cli_in_process(*pt)
    assert again.code == 0 and "was already up" in again.out  # the record is unchanged...
    refused = cli_in_process(*UP, "--name", "pt2", "--tpu-type", "v4-8")
    assert refused.code == 0  # another name is another TPU
    with pytest.raises(ValueError, match="never preempts"):
        tpu_api.preempt("pt2")  # an on-demand TPU is not preempted
    recreated = cli_in_process(*pt, "--recreate")
    assert recreated.code == 0, recreated.err
    assert any(
        f"pt: {state}; deleting it to create it again" in recreated.err for state in preempted
    )
    assert f"cloud state {ready}" in cli_in_process("status", "--pod", "pt").out


def test_adopt_records_a_tpu_made_elsewhere_and_down_leaves_it(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult], sim: SimPod, state_home: Path
) -> None:
    # A TPU someone made elsewhere: the API has it, tpupod has no record of it.
    made = cli(*UP, "--name", "elsewhere", "--tpu-type", "v4-16")
    assert made.code == 0
    (state_home / "pods" / "elsewhere" / "pod.json").unlink()  # tpupod forgets it
    adopted = cli(
        "up",
        "--adopt",
        "elsewhere",
        "--zone",
        "us-central2-b",
        "--project",
        "proj",
        "--user",
        "root",
        "--key",
        str(sim.key),
    )
    assert adopted.code == 0, adopted.err
    assert "v4-16 in us-central2-b, 2 workers" in adopted.out
    assert cli("exec", "--pod", "elsewhere", "--", "true").code == 0
    listed = cli("list", "--all", "--zone", "us-central2-b", "--project", "proj")
    assert "node  elsewhere  v4-16  READY" in " ".join(listed.out.split("\n"))
    gone = cli("down", "--pod", "elsewhere")
    assert gone.code == 0 and "not deleting the TPU" in gone.err
    assert any(key.endswith("/nodes/elsewhere") for key in tpu_api.resources)


def test_status_of_any_tpu_by_name_tries_queued_resources_then_nodes(
    tpu_api: TpuApiStandIn, cli_in_process: Callable[..., CliResult]
) -> None:
    assert cli_in_process(*UP, "--name", "plain", "--tpu-type", "v4-8").code == 0
    assert (
        cli_in_process(*UP, "--name", "queued", "--tpu-type", "v4-8", "--capacity", "spot").code
        == 0
    )
    plain = cli_in_process(
        "status", "--tpu", "plain", "--zone", "us-central2-b", "--project", "proj"
    )
    assert plain.code == 0 and plain.out.split() == ["plain:", "node,", "v4-8,", "READY"]
    queued = cli_in_process(
        "status", "--tpu", "queued", "--zone", "us-central2-b", "--project", "proj"
    )
    assert queued.out.split() == ["queued:", "queued", "resource,", "v4-8,", "ACTIVE"]
    missing = cli_in_process(
        "status", "--tpu", "nope", "--zone", "us-central2-b", "--project", "proj"
    )
    assert missing.code == 1 and "NotFound" in missing.err


def test_down_dry_run_shows_the_delete(
    tpu_api: TpuApiStandIn, cli_in_process: Callable[..., CliResult]
) -> None:
    assert cli_in_process(*UP, "--name", "dd", "--tpu-type", "v4-8", "--node-count", "2").code == 0
    shown = cli_in_process("down", "--pod", "dd", "--dry-run")
    assert (
        "DELETE https://tpu.googleapis.com/v2/projects/proj/locations/us-central2-b/queuedResources/dd?force=true"
        in shown.out
    )
    assert "dd" in cli_in_process("list").out  # still there


def test_missing_credentials_say_what_to_run(
    cli_in_process: Callable[..., CliResult], tmp_path: Path
) -> None:
    env = {
        "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "none.json"),
        "NO_GCE_CHECK": "True",
        "TPUPOD_TPU_API_ENDPOINT": "",
    }
    result = cli_in_process(
        "up",
        "--name",
        "nocreds",
        "--tpu-type",
        "v4-8",
        "--zone",
        "us-central2-b",
        "--project",
        "p",
        env=env,
    )
    assert result.code == 1
    assert "error: no Google Cloud credentials" in result.err
    assert "gcloud auth application-default login" in result.err


def test_a_zone_that_does_not_offer_the_type_names_what_it_offers(
    tpu_api: TpuApiStandIn, cli_in_process: Callable[..., CliResult]
) -> None:
    tpu_api.offered = {"us-central2-b": ["v4-8", "v4-16", "v4-32"]}
    result = cli_in_process(*UP, "--name", "nz", "--tpu-type", "v5litepod-8")
    assert result.code == 1
    assert "error: zone us-central2-b does not offer v5litepod-8" in result.err
    assert "types offered there include v4-8" in result.err
    assert not [k for k in tpu_api.resources if k.endswith("/nz")]


def test_capacity_shorthands(cli_in_process: Callable[..., CliResult]) -> None:
    base = ("up", "--name", "c", "--tpu-type", "v4-8", "--zone", "us-central2-b", "--dry-run")
    assert '"preemptible": true' in cli_in_process(*base, "--preemptible").out
    assert "Queued Resources" in cli_in_process(*base, "--reserved").out
    both = cli_in_process(*base, "--spot", "--preemptible")
    assert both.code == 2 and "preemptible and spot contradict each other" in both.err


def test_internal_addresses(tpu_api: TpuApiStandIn, cli: Callable[..., CliResult]) -> None:
    shown = cli(*UP, "--name", "in", "--tpu-type", "v4-8", "--internal", "--dry-run")
    assert '"enableExternalIps": false' in shown.out
    assert cli(*UP, "--name", "in", "--tpu-type", "v4-8", "--internal").code == 0
    assert cli("exec", "--pod", "in", "--", "true").code == 0


BLOCK_GCP_EXTRA = """
import sys


class _NoGcpExtra:
    # As if google-cloud-tpu (the gcp extra) and what it brings were not installed.
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("google.cloud.tpu", "google.api_core")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoGcpExtra())
"""


@pytest.mark.parametrize(
    "command",
    [
        ("status", "--tpu", "x", "--zone", "us-central2-b", "--project", "p"),
        ("list", "--all", "--zone", "us-central2-b", "--project", "p"),
        ("up", "--name", "x", "--tpu-type", "v4-8", "--zone", "us-central2-b", "--project", "p"),
    ],
)
def test_without_the_gcp_extra_says_what_to_install(
    command: tuple[str, ...], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCK_GCP_EXTRA)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = cli(*command, env=env)
    assert result.code == 1, result.err
    lines = result.err.strip().splitlines()
    assert lines[-2].startswith("error: talking to Cloud TPUs needs the gcp extra (not installed:")
    assert lines[-1] == "hint: pip install 'tpupod[gcp]'", result.err
    assert "Traceback" not in result.err
    # said before any output (list --all printed its pods and a heading first)
    assert len(lines) == 2 and "Cloud TPUs in" not in result.out, result
    dry = cli("up", "--name", "x", "--tpu-type", "v4-8", "--zone", "us-central2-b", "--dry-run")
    assert dry.code == 0, dry.err  # a dry run needs no client library


def test_the_provider_holds_one_client(
    tpu_api: TpuApiStandIn, state_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.cloud import tpu_v2

    from tpupod.pod.lifecycle import down, up
    from tpupod.pod.spec import GcpPodSpec
    from tpupod.pod.state import StateDir
    from tpupod.providers.gcp import GcpProvider

    made: list[object] = []
    original = tpu_v2.TpuClient.__init__

    def counting(self: object, *args: object, **kwargs: object) -> None:
        made.append(self)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tpu_v2.TpuClient, "__init__", counting)
    tpu_api.steps = 4  # several polls
    spec = GcpPodSpec(
        name="one", provider="gcp", tpu_type="v4-8", zone="us-central2-b", project="proj",
        user="root",
    )  # fmt: skip
    pod = up(spec, StateDir()).pod
    reads = [call for call in tpu_api.calls if call[0] == "GET"]
    assert len(reads) > 3 and len(made) == 1
    provider = GcpProvider()
    asyncio.run(provider.live_state(pod))
    asyncio.run(provider.live_state(pod))
    assert len(made) == 2  # one more provider, one more client
    down(pod, StateDir())
    assert not tpu_api.resources


# -- every capacity x {TPU VM, queued resource, multislice}, as gcloud sends it --------------

SHAPES = {
    "tpu-vm": ("--api", "tpu-vm"),
    "queued": ("--api", "queued-resource"),
    "multislice": ("--node-count", "2"),
    "separate": ("--slices", "2"),  # two TPUs, NAME-0 and NAME-1: each one of the above
}
CAPACITIES = ("on-demand", "preemptible", "spot", "reserved", "best-effort")
# What neither API makes: (capacity, shape) -> the error's words.
REFUSED = {
    ("best-effort", "tpu-vm"): "best-effort capacity exists only for queued resources",
    ("preemptible", "queued"): "preemptible capacity exists only for TPU VMs",
    ("preemptible", "multislice"): "preemptible capacity exists only for TPU VMs",
}
COMBINATIONS = [(c, s) for c in CAPACITIES for s in SHAPES if (c, s) not in REFUSED]
# gcloud 578: `compute tpus tpu-vm create --spot` etc. set the node's schedulingConfig;
# `compute tpus queued-resources create --spot` etc. set the queued resource's tier.
NODE_SCHEDULING = {"preemptible": {"preemptible": True}, "spot": {"spot": True}}
NODE_SCHEDULING["reserved"] = {"reserved": True}
QUEUED_TIER = {
    "on-demand": {},
    "spot": {"spot": {}},
    "reserved": {"reservationName": "projects/proj/locations/us-central2-b/reservations/-"},
    "best-effort": {"bestEffort": {}},
}


def capacity_args(name: str, capacity: str, shape: str) -> tuple[str, ...]:
    return ("--name", name, "--tpu-type", "v4-8", "--capacity", capacity, *SHAPES[shape])


def one_tpu_shape(capacity: str, shape: str) -> str:
    """What each TPU of a pod of separate slices is: a TPU VM where the capacity lets it,
    else a queued resource (as for a pod of one slice)."""
    if shape != "separate":
        return shape
    return "tpu-vm" if capacity in ("on-demand", "preemptible") else "queued"


def shown_requests(out: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(API line, method, url, body) of each request a dry run printed."""
    chunks = out.split("API: ")[1:]
    found = []
    for chunk in chunks:
        api, request, body = chunk.split("\n", 2)
        method, url = request.split()
        found.append((api, method, url, json.loads(body)))
    return found


def check_body(capacity: str, shape: str, name: str, version: str, body: dict[str, Any]) -> None:
    """The body gcloud sends for that capacity and shape."""
    if shape == "tpu-vm":
        assert version == "v2"
        assert body.get("schedulingConfig") == NODE_SCHEDULING.get(capacity), body
        return
    assert version == ("v2alpha1" if capacity == "best-effort" else "v2")
    assert {k: v for k, v in body.items() if k != "tpu"} == QUEUED_TIER[capacity]
    [spec] = body["tpu"]["nodeSpec"]
    assert "schedulingConfig" not in spec["node"]  # a queued resource's tier is its own
    params = "multiNodeParams" if version == "v2alpha1" else "multisliceParams"
    if shape == "multislice":
        assert spec[params] == {"nodeCount": 2, "nodeIdPrefix": name} and "nodeId" not in spec
    else:
        assert spec["nodeId"] == name and params not in spec


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST a body as curl would: no client library in between."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(("capacity", "shape"), [(c, s) for c in CAPACITIES for s in SHAPES])
def test_dry_run_bodies_are_what_gcloud_sends_and_the_api_takes(
    capacity: str,
    shape: str,
    cli_in_process: Callable[..., CliResult],
    bare_tpu_api: tuple[TpuApiStandIn, str],
) -> None:
    """Every capacity x shape: the body gcloud sends, or (what neither API makes) refused
    before any call, dry run or not."""
    api, endpoint = bare_tpu_api
    if (capacity, shape) in REFUSED:
        check_refused(capacity, shape, cli_in_process, endpoint)
        assert api.calls == []
        return
    name = f"d-{capacity}-{shape}"
    shown = cli_in_process(*UP, *capacity_args(name, capacity, shape), "--dry-run")
    assert shown.code == 0, shown.err
    requests = shown_requests(shown.out)
    names = [f"{name}-0", f"{name}-1"] if shape == "separate" else [name]
    assert len(requests) == len(names)
    for tpu, (api_line, method, url, body) in zip(names, requests, strict=True):
        version = api_line.split()[2].rstrip(",")
        tpu_shape = one_tpu_shape(capacity, shape)
        assert ("Queued Resources" in api_line) == (tpu_shape != "tpu-vm") and method == "POST"
        assert ("(slice " in api_line) == (shape == "separate")
        check_body(capacity, tpu_shape, tpu, version, body)
        # The printed request, sent by hand, is one the API takes, with the same capacity.
        status, answer = post(url.replace("https://tpu.googleapis.com", endpoint), body)
        assert status == 200, answer
        assert api.tier(tpu) == capacity


def check_refused(capacity: str, shape: str, cli: Callable[..., CliResult], endpoint: str) -> None:
    for extra in (("--dry-run",), ()):
        args = (*UP, *capacity_args("no", capacity, shape), *extra)
        result = cli(*args, env={"TPUPOD_TPU_API_ENDPOINT": endpoint})
        assert result.code == 2, result.err
        lines = result.err.strip().splitlines()
        assert lines[-2].startswith(f"error: {REFUSED[capacity, shape]}"), result.err
        assert lines[-1].startswith("hint: ") and "Traceback" not in result.err
        assert result.out == ""  # not even the dry run's first line


@pytest.mark.parametrize(("capacity", "shape"), COMBINATIONS)
def test_create_each_capacity_and_shape(
    capacity: str, shape: str, tpu_api: TpuApiStandIn, cli_in_process: Callable[..., CliResult]
) -> None:
    name = f"c-{capacity}-{shape}"
    made = cli_in_process(*UP, *capacity_args(name, capacity, shape))
    assert made.code == 0, made.err
    assert not tpu_api.invalid
    tpus = [f"{name}-0", f"{name}-1"] if shape == "separate" else [name]
    tpu_shape = one_tpu_shape(capacity, shape)
    kind = "nodes" if tpu_shape == "tpu-vm" else "queuedResources"
    assert tpu_api.calls.count(("POST", f"{kind}/")) == len(tpus)
    for tpu in tpus:
        assert tpu_api.tier(tpu) == capacity
        if tpu_shape != "tpu-vm":  # the states of the tier: reserved capacity waits for nothing
            states = ("ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE")
            seen = [state for state in states if f"{tpu}: {state}" in made.err]
            waits = [] if capacity == "reserved" else ["WAITING_FOR_RESOURCES"]
            assert seen == ["ACCEPTED", *waits, "PROVISIONING", "ACTIVE"], made.err
    hosts = json.loads(cli_in_process("hosts", "--pod", name, "--format", "json").out)
    sliced = shape in ("multislice", "separate")
    assert [(w["id"], w["slice"]) for w in hosts] == ([(0, 0), (1, 1)] if sliced else [(0, None)])
    gone = cli_in_process("down", "--pod", name)
    assert gone.code == 0, gone.err
    assert not tpu_api.resources


def test_a_multislice_tpu_vm_is_refused(cli_in_process: Callable[..., CliResult]) -> None:
    result = cli_in_process(
        *UP, "--name", "no", "--tpu-type", "v4-8", "--api", "tpu-vm", "--node-count", "2"
    )
    assert result.code == 2 and result.out == ""
    assert "error: multislice (2 slices) needs a queued resource, not a TPU VM" in result.err
    assert "hint: multislice goes through queued resources: drop --api tpu-vm" in result.err


V4_8_NODE = {"acceleratorType": "v4-8", "runtimeVersion": "tpu-ubuntu2204-base"}
QR_URL = "/{version}/projects/p/locations/us-central2-b/queuedResources?queuedResourceId=q"
ANY_RESERVATION = "projects/p/locations/us-central2-b/reservations/-"


def queued_body(
    node: dict[str, Any] = V4_8_NODE, slices: dict[str, Any] | None = None, **top: object
) -> dict[str, Any]:
    """A queued resource in us-central2-b: one slice named q, or ``slices``' params."""
    spec = {"parent": "projects/p/locations/us-central2-b", "node": node, **(slices or {})}
    if not slices:
        spec["nodeId"] = "q"
    return {"tpu": {"nodeSpec": [spec]}, **top}


@pytest.mark.parametrize(
    ("version", "body", "words"),
    [
        # the bodies tpupod sent before: each is refused
        (
            "v2alpha1",
            queued_body(slices={"multisliceParams": {"nodeCount": 2}}, bestEffort={}),
            "multisliceParams",
        ),
        (
            "v2",
            queued_body({**V4_8_NODE, "schedulingConfig": {"spot": True}}, spot={}),
            "one tier; got spot and node.schedulingConfig.spot",
        ),
        ("v2", queued_body(guaranteed={"reserved": True}), "reserved"),
        # and what else the API refuses
        ("v2", queued_body(bestEffort={}), "bestEffort"),
        ("v2", queued_body(spot={}, reservationName=ANY_RESERVATION), "one tier"),
        ("v2", queued_body(reservationName="my-reservation"), "is not projects/PROJECT"),
        (
            "v2",
            queued_body(reservationName=ANY_RESERVATION.replace("us-central2-b", "us-east1-d")),
            "is not projects/PROJECT",
        ),
        ("v2", {"tpu": {"nodeSpec": []}}, "tpu.nodeSpec is required"),
        ("v2alpha1", queued_body(bestEffort={}, spot={}), "tier"),
    ],
)
def test_the_stand_in_refuses_what_the_api_refuses(
    version: str, body: dict[str, Any], words: str, bare_tpu_api: tuple[TpuApiStandIn, str]
) -> None:
    api, endpoint = bare_tpu_api
    status, answer = post(endpoint + QR_URL.format(version=version), body)
    assert status == 400, answer
    assert answer["error"]["status"] == "INVALID_ARGUMENT" and words in answer["error"]["message"]
    assert not api.resources


def test_adopt_a_reserved_queued_resource_reads_it_as_one(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult], sim: SimPod, state_home: Path
) -> None:
    made = cli(*UP, "--name", "rq", "--tpu-type", "v4-8", "--reserved")
    assert made.code == 0, made.err
    (state_home / "pods" / "rq" / "pod.json").unlink()
    adopt = ("up", "--adopt", "rq", "--zone", "us-central2-b", "--project", "proj")
    adopted = cli(*adopt, "--user", "root", "--key", str(sim.key))
    assert adopted.code == 0, adopted.err
    assert "(reserved)" in adopted.out
    assert "cloud state ACTIVE" in cli("status", "--pod", "rq").out  # the queued resource's


def test_recreate_checks_before_it_changes_anything_and_keeps_the_history(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult], state_home: Path
) -> None:
    """Issue 37: `up --recreate` of a pod whose TPU is ACTIVE removed the pod's folder and
    then failed: the TPU orphaned, the key, run logs and recovery records gone. It is
    refused before anything changes; a recreate that is due keeps the pod's history."""
    sp = (*UP, "--name", "sp", "--tpu-type", "v4-16", "--spot")
    assert cli(*sp).code == 0
    ran = cli("run", "--pod", "sp", "--rendezvous-on", "launcher", "--retries", "1", "--", "uname")
    assert ran.code == 0, ran.err
    folder = state_home / "pods" / "sp"
    [record] = folder.glob("runs/*/recovery.json")
    run_id = record.parent.name
    files = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    refused = cli(*sp, "--recreate")
    assert refused.code == 1, refused.err
    lines = refused.err.strip().splitlines()
    assert lines[-2] == "error: TPU 'sp' is ACTIVE: --recreate replaces a preempted or failed one"
    assert lines[-1].startswith("hint: ") and "tpupod down --pod sp" in lines[-1]
    assert {p: p.read_bytes() for p in files if p.is_file()} == files  # nothing changed
    assert not [call for call in tpu_api.calls if call[0] in ("POST", "DELETE")][1:]
    assert cli("exec", "--pod", "sp", "--", "true").code == 0
    tpu_api.preempt("sp")
    recreated = cli("up", "--recreate", "--name", "sp")  # the pod's recorded flags
    assert recreated.code == 0, recreated.err
    assert ("DELETE", "queuedResources/sp") in tpu_api.calls
    assert record.is_file() and (folder / "id_ed25519").read_bytes() == files[folder / "id_ed25519"]
    shown = cli("logs", "--pod", "sp", run_id)
    assert shown.code == 0 and "Linux" in shown.out, shown.err  # the run's logs are kept
    assert cli("exec", "--pod", "sp", "--", "true").code == 0  # the new TPU takes the key
    assert cli("down", "--pod", "sp").code == 0 and not tpu_api.resources


def test_up_and_down_wait_out_an_api_that_fails_for_a_while(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    """Issue 37: an API call that fails for a passing reason (no answer at all, a 503) is
    tried again with backoff for the probe budget (120 s), in every phase: up's first
    call, its polls of a TPU being made, down's delete. Other errors are not retried."""
    tpu_api.steps = 20  # a TPU that takes a few seconds of polls to be made
    tpu_api.unanswered(3)  # up's first call (the zone's types) gets no answer for 3 s
    up = subprocess.Popen(
        tpupod_argv(*UP, "--name", "fl", "--tpu-type", "v4-16"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ},
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while ("POST", "nodes/") not in tpu_api.calls and time.monotonic() < deadline:
        time.sleep(0.02)
    tpu_api.unavailable(3)  # then its polls get 503s for 3 s
    _, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    assert tpu_api.dropped and tpu_api.unavailable_answers, err
    assert err.count("retrying for up to 120s") == 2 and "answers again" in err, err
    assert cli("exec", "--pod", "fl", "--", "true").code == 0
    tpu_api.unavailable(3)
    down = cli("down", "--pod", "fl")
    assert down.code == 0 and "answers again" in down.err, down.err
    assert not tpu_api.resources
    tpu_api.fail("POST", "nodes", "PERMISSION_DENIED", "Permission 'tpu.nodes.create' denied")
    refused = cli(*UP, "--name", "fl", "--tpu-type", "v4-16")
    assert refused.code == 1 and "retrying" not in refused.err  # not a passing failure
