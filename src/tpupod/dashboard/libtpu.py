"""A TPU host's HBM and duty cycle, read from libtpu's runtime metrics service, as Google's
``tpu-info`` reads them: gRPC on ``localhost:8431`` with local credentials,
``tpu.monitoring.runtime.RuntimeMetricService/GetRuntimeMetric`` for
``tpu.runtime.hbm.memory.usage.bytes``, ``...hbm.memory.total.bytes`` and
``tpu.runtime.tensorcore.dutycycle.percent``. libtpu serves it inside the program that holds
the chips, so nothing answering means no program holds them: "idle".

The messages are the subset of tpu-info's ``tpu_metric_service.proto`` these calls use (same
package, names and field numbers, so the wire format is the same), built from a descriptor
here instead of generated code: no protoc at build time, no tpu-info on the hosts.

``python -m tpupod.dashboard.libtpu [ADDR]`` is what the dashboard's probe runs on a worker
that has TPU devices; it prints ``tpu idle`` or one ``tpu DEVICE USED TOTAL DUTY`` line per
device (probe.py reads them); on a host without grpcio or protobuf (the ``tpu`` extra),
``tpu missing PACKAGE``: the page says there are no TPU metrics and how to get them.

Deferred imports: grpcio and protobuf (the tpu extra) are imported where used, so a host
without them still runs this module and answers ``tpu missing PACKAGE``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

ADDRESS = "localhost:8431"
SERVICE = "tpu.monitoring.runtime.RuntimeMetricService"
USAGE = "tpu.runtime.hbm.memory.usage.bytes"
TOTAL = "tpu.runtime.hbm.memory.total.bytes"
DUTY = "tpu.runtime.tensorcore.dutycycle.percent"
EXTRA = "tpupod[tpu]"  # grpcio and protobuf, on the TPU hosts (pyproject.toml)

# message -> its fields: (name, number, type, label, message type); the proto's subset
_STRING, _BOOL, _INT64, _DOUBLE, _MESSAGE = 9, 8, 3, 1, 11
_OPTIONAL, _REPEATED = 1, 3
_MESSAGES: dict[str, list[tuple[str, int, int, int, str]]] = {
    "MetricRequest": [
        ("metric_name", 1, _STRING, _OPTIONAL, ""),
        ("skip_node_aggregation", 2, _BOOL, _OPTIONAL, ""),
    ],
    "MetricResponse": [("metric", 1, _MESSAGE, _OPTIONAL, "TPUMetric")],
    "TPUMetric": [
        ("name", 1, _STRING, _OPTIONAL, ""),
        ("description", 2, _STRING, _OPTIONAL, ""),
        ("metrics", 3, _MESSAGE, _REPEATED, "Metric"),
    ],
    "Metric": [
        ("attribute", 1, _MESSAGE, _OPTIONAL, "Attribute"),
        ("gauge", 3, _MESSAGE, _OPTIONAL, "Gauge"),
    ],
    "Attribute": [
        ("key", 1, _STRING, _OPTIONAL, ""),
        ("value", 2, _MESSAGE, _OPTIONAL, "AttrValue"),
    ],
    "AttrValue": [
        ("string_attr", 1, _STRING, _OPTIONAL, ""),
        ("bool_attr", 2, _BOOL, _OPTIONAL, ""),
        ("int_attr", 3, _INT64, _OPTIONAL, ""),
        ("double_attr", 4, _DOUBLE, _OPTIONAL, ""),
    ],
    "Gauge": [
        ("as_double", 1, _DOUBLE, _OPTIONAL, ""),
        ("as_int", 2, _INT64, _OPTIONAL, ""),
        ("as_string", 3, _STRING, _OPTIONAL, ""),
        ("as_bool", 4, _BOOL, _OPTIONAL, ""),
    ],
}
_ONEOFS = {"AttrValue": "attr", "Gauge": "value"}  # every field of these is in one oneof


@dataclass(frozen=True)
class Chip:
    device: int
    hbm_used: int  # bytes
    hbm_total: int  # bytes
    duty_cycle: float  # percent of the last period the TensorCore was busy


@cache
def messages() -> dict[str, Any]:
    """The message classes, by name."""
    from google.protobuf import (  # type: ignore[import-untyped]  # no stubs installed
        descriptor_pb2,
        descriptor_pool,
        message_factory,
    )

    package = SERVICE.rsplit(".", 1)[0]
    proto = descriptor_pb2.FileDescriptorProto(
        name="tpupod/libtpu_metrics.proto", package=package, syntax="proto3"
    )
    for name, fields in _MESSAGES.items():
        message = proto.message_type.add(name=name)
        if name in _ONEOFS:
            message.oneof_decl.add(name=_ONEOFS[name])
        for field, number, kind, label, type_name in fields:
            added = message.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                added.type_name = f".{package}.{type_name}"
            if name in _ONEOFS:
                added.oneof_index = 0
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
        for name in _MESSAGES
    }


def read(address: str = ADDRESS, timeout: float = 2.0) -> list[Chip] | None:
    """Every device's HBM and duty cycle; None when nothing serves the metrics (idle)."""
    import grpc  # type: ignore[import-untyped]  # grpcio ships no stubs

    kinds = messages()
    with grpc.secure_channel(address, grpc.local_channel_credentials()) as channel:
        call = channel.unary_unary(
            f"/{SERVICE}/GetRuntimeMetric",
            request_serializer=kinds["MetricRequest"].SerializeToString,
            response_deserializer=kinds["MetricResponse"].FromString,
        )

        def values(name: str) -> dict[int, Any]:
            answer = call(kinds["MetricRequest"](metric_name=name), timeout=timeout)
            return {m.attribute.value.int_attr: m.gauge for m in answer.metric.metrics}

        try:
            used, total, duty = values(USAGE), values(TOTAL), values(DUTY)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return None
            raise
    return [
        Chip(d, used[d].as_int, total[d].as_int, _number(duty[d]) if d in duty else 0.0)
        for d in sorted(used)
        if d in total
    ]


def _number(gauge: Any) -> float:
    return float(gauge.as_double if gauge.WhichOneof("value") == "as_double" else gauge.as_int)


def lines(chips: list[Chip] | None) -> list[str]:
    """What the probe prints."""
    if chips is None:
        return ["tpu idle"]
    return [f"tpu {c.device} {c.hbm_used} {c.hbm_total} {c.duty_cycle:g}" for c in chips]


def summary(found: list[str]) -> str | None:
    """The probe's ``tpu`` lines as the pod page shows them (None: the probe printed none,
    the host has no TPU)."""
    chips = [line.split()[1:] for line in found if line.startswith("tpu ")]
    if not chips:
        return None
    if chips == [["idle"]]:
        return "idle"
    if chips[0][:1] == ["missing"]:  # a host without the extra: a state, not a failure
        return f"no TPU metrics ({' '.join(chips[0][1:])} missing: pip install '{EXTRA}')"
    if chips[0][:1] == ["error"]:
        return f"TPU metrics: {' '.join(chips[0][1:])}"
    try:
        used = sum(int(c[1]) for c in chips)
        total = sum(int(c[2]) for c in chips)
        duty = sum(float(c[3]) for c in chips) / len(chips)
    except (IndexError, ValueError):
        return "TPU metrics unreadable"
    return f"HBM {used / 2**30:.1f}/{total / 2**30:.1f} GiB, duty {duty:.0f} % ({len(chips)} dev)"


def main(argv: list[str]) -> int:
    try:
        chips = read(argv[0] if argv else ADDRESS)
    except ImportError as exc:  # grpcio or protobuf: the host lacks the tpu extra
        print(f"tpu missing {'grpcio' if (exc.name or '').startswith('grpc') else 'protobuf'}")
        return 0
    except Exception as exc:  # one line for the dashboard, never a traceback
        print(f"tpu error {type(exc).__name__}")
        return 1
    print("\n".join(lines(chips)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
