"""Asks a server's grpc.health.v1 service for the status of some services, with the
grpcio-health-checking package.

Usage: health_check.py HOST:PORT --service NAME [--service NAME ...] --expect serving|down
  [--timeout SECONDS]
  serving: every service answers SERVING.
  down:    every service answers NOT_SERVING, or the server is unreachable (it has exited).
The status is polled until the expectation holds or the timeout passes (a server turns NOT_SERVING
a moment after it receives SIGTERM). Prints one JSON object {"target", "statuses": {service:
status}, "ok"} and exits 1 when the expectation does not hold in time.
"""

import argparse
import json
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target, service):
    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as e:
        return e.code().name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--service", action="append", required=True)
    ap.add_argument("--expect", choices=["serving", "down"], required=True)
    ap.add_argument("--timeout", type=float, default=15)
    a = ap.parse_args()
    accept = {"serving": {"SERVING"}, "down": {"NOT_SERVING", "UNAVAILABLE"}}[a.expect]
    deadline = time.monotonic() + a.timeout
    while True:
        statuses = {s: check(a.target, s) for s in a.service}
        ok = all(v in accept for v in statuses.values())
        if ok or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    print(json.dumps({"target": a.target, "statuses": statuses, "ok": ok}))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
