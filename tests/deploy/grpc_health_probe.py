#!/usr/bin/python3
"""The kubelet's gRPC readiness probe, for tests: grpc.health.v1.Health/Check for service "".

  grpc_health_probe.py HOST:PORT [--wait SECONDS]

Prints the serving status and exits 0 on SERVING, 1 otherwise. With --wait it polls (every 50 ms)
until SERVING or the time is up. The request and response are encoded by hand (the request for
service "" is empty; the response's field 1 is the status varint), so no health stubs are needed.
"""

import argparse
import sys
import time

import grpc

STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def check(channel):
    """The status name, or the RPC error code's name."""
    call = channel.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=lambda raw: raw,
                               response_deserializer=lambda raw: raw)
    try:
        response = call(b"", timeout=2.0)
    except grpc.RpcError as e:
        return e.code().name
    if response == b"":
        return "UNKNOWN"
    if len(response) != 2 or response[0] != 0x08:
        return "MALFORMED(%s)" % response.hex()
    return STATUS_NAMES.get(response[1], "STATUS_%d" % response[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--wait", type=float, default=0.0)
    args = parser.parse_args()
    give_up = time.monotonic() + args.wait
    with grpc.insecure_channel(args.address) as channel:
        while True:
            status = check(channel)
            if status == "SERVING" or time.monotonic() >= give_up:
                break
            time.sleep(0.05)
    print("%s %s" % (args.address, status))
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
