"""Container healthcheck: ``python healthcheck.py grpc HOST:PORT [--tls DIR NAME]`` or
``python healthcheck.py http URL``.

gRPC: the standard health service answers SERVING; with ``--tls DIR NAME`` over mutual TLS, with the container's
own certificate (``DIR``/tls.crt, tls.key, ca.crt: docker/init_secrets.py) and ``NAME`` checked in the server's
certificate (the service name: the check dials 127.0.0.1). http: the URL answers 200.
"""

import sys
import urllib.request
from pathlib import Path


def main(kind: str, target: str, *tls: str) -> int:
    if kind == "grpc":
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if tls:
            flag, directory, name = tls
            if flag != "--tls":
                raise ValueError(f"unknown argument {flag}")
            files = [(Path(directory) / f).read_bytes() for f in ("ca.crt", "tls.key", "tls.crt")]
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(*files),
                                          options=[("grpc.ssl_target_name_override", name)])
        else:
            channel = grpc.insecure_channel(target)
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
    with urllib.request.urlopen(target, timeout=2) as response:
        return 0 if response.status == 200 else 1


if __name__ == "__main__":
    try:
        sys.exit(main(*sys.argv[1:]))
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
        print(f"unhealthy: {exc}", file=sys.stderr)
        sys.exit(1)
