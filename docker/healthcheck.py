"""Container healthcheck: ``python healthcheck.py grpc HOST:PORT`` or ``python healthcheck.py http URL``.

gRPC: the standard health service answers SERVING; http: the URL answers 200.
"""

import sys
import urllib.request


def main(kind: str, target: str) -> int:
    if kind == "grpc":
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
    with urllib.request.urlopen(target, timeout=2) as response:
        return 0 if response.status == 200 else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1], sys.argv[2]))
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
        print(f"unhealthy: {exc}", file=sys.stderr)
        sys.exit(1)
