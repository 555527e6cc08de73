"""Talks to Tandem's gRPC API over TLS with grpcio, as any client holding only the CA file would.

Usage: grpc_tls_client.py HOST:PORT --ca CA_PEM --prompt TEXT [--max-tokens N]

Opens a channel with grpc.ssl_channel_credentials(root_certificates=<the CA>), checks that the
standard health service says SERVING, then streams one greedy Tandem.Generate for the prompt.
The messages are encoded and decoded by hand (a few fields of tandem.v1), so no generated stubs
are needed. Prints one JSON object: the generated token ids, the text and the finish reason.

Any failed check raises, so the exit status is 1 and the traceback says which.
"""

import argparse
import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(b, i):
    shift, n = 0, 0
    while True:
        x = b[i]
        i += 1
        n |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return n, i


def generate_request(prompt, max_tokens):
    text = prompt.encode()
    # GenerateRequest: text = 1 (string), max_tokens = 4 (uint32); sampling left out: greedy.
    return b"\x0a" + varint(len(text)) + text + b"\x20" + varint(max_tokens)


def parse_response(b):
    """GenerateResponse: token_ids = 1 (packed uint32), text = 2, finish_reason = 4."""
    ids, text, finish, i = [], "", None, 0
    while i < len(b):
        key, i = read_varint(b, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = read_varint(b, i)
            if field == 1:
                ids.append(v)
        elif wire == 2:
            n, i = read_varint(b, i)
            chunk = b[i:i + n]
            i += n
            if field == 1:
                j = 0
                while j < len(chunk):
                    v, j = read_varint(chunk, j)
                    ids.append(v)
            elif field == 2:
                text += chunk.decode()
            elif field == 4:
                finish = chunk.decode()
        elif wire == 5:
            i += 4
        elif wire == 1:
            i += 8
        else:
            raise AssertionError(f"unexpected wire type {wire}")
    return ids, text, finish


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("--ca", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=8)
    a = ap.parse_args()
    with open(a.ca, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(a.address, creds) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING, health
        call = channel.unary_stream(
            "/tandem.v1.Tandem/Generate", request_serializer=None, response_deserializer=None
        )
        ids, text, finish = [], "", None
        for msg in call(generate_request(a.prompt, a.max_tokens), timeout=120):
            i, t, f = parse_response(msg)
            ids += i
            text += t
            finish = f or finish
        assert ids, "no token generated"
        assert finish in ("length", "stop"), finish
    print(json.dumps({"token_ids": ids, "text": text, "finish_reason": finish}))


if __name__ == "__main__":
    main()
