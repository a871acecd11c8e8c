"""A stand-in for libtpu's runtime metrics service (what a TPU host serves on
localhost:8431 while a program holds its chips): real gRPC with local credentials, the
``tpu.monitoring.runtime.RuntimeMetricService/GetRuntimeMetric`` method, and answers
encoded by hand from tpu-info's ``tpu_metric_service.proto`` field numbers, so that the
dashboard's descriptor-built messages are checked against the wire, not against themselves.
"""

from __future__ import annotations

import struct
from concurrent import futures
from dataclasses import dataclass, field

import grpc  # type: ignore[import-untyped]

SERVICE = "tpu.monitoring.runtime.RuntimeMetricService"


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 negatives as protobuf writes them
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _double(number: int, value: float) -> bytes:
    return _varint(number << 3 | 1) + struct.pack("<d", value)


def metric(device: int, value: int | float) -> bytes:
    """Metric{attribute: Attribute{key: "device-id", value: AttrValue{int_attr}}, gauge}."""
    attribute = _bytes(1, b"device-id") + _bytes(2, _int(3, device))
    gauge = _double(1, value) if isinstance(value, float) else _int(2, value)
    return _bytes(1, attribute) + _bytes(3, gauge)


def response(name: str, values: dict[int, int | float]) -> bytes:
    """MetricResponse{metric: TPUMetric{name, metrics}}."""
    body = _bytes(1, name.encode()) + b"".join(_bytes(3, metric(d, v)) for d, v in values.items())
    return _bytes(1, body)


def metric_name(request: bytes) -> str:
    """MetricRequest's field 1 (the only one sent)."""
    assert request[0] == (1 << 3 | 2), request
    length, at, shift = 0, 1, 0
    while True:
        byte = request[at]
        length |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            break
    return request[at : at + length].decode()


@dataclass
class LibtpuMetrics:
    """Per device: HBM used and total (bytes), duty cycle (percent); the names asked."""

    used: dict[int, int] = field(default_factory=dict)
    total: dict[int, int] = field(default_factory=dict)
    duty: dict[int, float] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    def answer(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        name = metric_name(request)
        self.asked.append(name)
        values: dict[str, dict[int, int | float]] = {
            "tpu.runtime.hbm.memory.usage.bytes": dict(self.used),
            "tpu.runtime.hbm.memory.total.bytes": dict(self.total),
            "tpu.runtime.tensorcore.dutycycle.percent": dict(self.duty),
        }
        if name not in values:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no metric {name}")
        return response(name, values[name])

    def serve(self, port: int = 0) -> tuple[grpc.Server, int]:
        """Serve on 127.0.0.1 (local credentials, as libtpu); the server and its port."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(self.answer)  # raw bytes both ways
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"GetRuntimeMetric": handler}),)
        )
        credentials = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        bound = server.add_secure_port(f"127.0.0.1:{port}", credentials)
        server.start()
        return server, bound
