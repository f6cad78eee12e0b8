#!/usr/bin/env python3
"""Measures how much long request bodies delay an unrelated small chat completion on a running Nebula server.

It times a small chat request (`max_tokens: 1`) alone, then again while `--count` long bodies (`--mib` MiB of
text each) are being sent to `/v1/chat/completions` at the same time, and prints both latencies and the delay.
It also times one body too long for the context by its size alone (refused before it is encoded). Standard
library only; a benchmark, not a test (no pass/fail).

Usage: python3 scripts/bench_big_bodies.py [--url http://127.0.0.1:8080] [--count 4] [--mib 10] [--key KEY]
"""

import argparse
import json
import threading
import time
import urllib.error
import urllib.request


def post(url, body, key):
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            status = resp.status
            resp.read()
    except urllib.error.HTTPError as e:
        status = e.code
        e.read()
    return status, time.perf_counter() - t0


def small(url, key):
    return post(url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}, key)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--mib", type=float, default=10.0)
    ap.add_argument("--key", default=None)
    args = ap.parse_args()

    small(args.url, args.key)  # warm up
    status, alone = small(args.url, args.key)
    print(f"small request alone: {alone * 1e3:.0f} ms (HTTP {status})")

    words = "alpha beta gamma delta nebula 7 Zürich 🙂 ".split(" ")
    text = " ".join(words[(i * 31 + 7) % len(words)] for i in range(int(args.mib * (1 << 20) / 6)))
    long_body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    results = []

    def send_long():
        results.append(post(args.url, long_body, args.key))

    threads = [threading.Thread(target=send_long) for _ in range(args.count)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    status, loaded = small(args.url, args.key)
    for t in threads:
        t.join()
    print(f"small request during {args.count} x {args.mib:g} MiB bodies: {loaded * 1e3:.0f} ms (HTTP {status}); "
          f"delay {(loaded - alone) * 1e3:.0f} ms")
    for status, seconds in results:
        print(f"  long body: HTTP {status} after {seconds:.2f} s")


if __name__ == "__main__":
    main()
