"""Does a big request stall the server's event loop? (issue 22 §3)

Starts `hebrus-mlx server` (the demo) from a source tree, then, side by side in one run:
/health latency while idle, and while one client's 4 MB chat request is being rendered and
tokenized (polled every 20 ms). Prints the latencies, the big request's time and the ratio
worst-/health / big-request (1.0 means /health waited for the whole request).

    python benchmarks/bench_server_stall.py [--root DIR] [--mb 4]

--root runs another checkout's server (e.g. an older commit's `git archive`), so two trees can be
compared on the same machine.
"""

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def request(port, method, path, body=None, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    c.close()
    return r.status


def poll(port, seconds=None, until=None):
    lat = []
    end = time.monotonic() + (seconds or 0)
    while (until.is_alive() if until is not None else time.monotonic() < end):
        tic = time.monotonic()
        request(port, "GET", "/health")
        lat.append(time.monotonic() - tic)
        time.sleep(0.02)
    return lat


def describe(name, lat):
    lat = sorted(lat)
    return (f"{name:28s} n={len(lat):4d}  p50 {statistics.median(lat) * 1e3:7.1f} ms  "
            f"p99 {lat[int(len(lat) * 0.99)] * 1e3:7.1f} ms  max {lat[-1] * 1e3:8.1f} ms")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--mb", type=float, default=4.0)
    a = p.parse_args()
    env = dict(os.environ, PYTHONPATH=a.root)
    proc = subprocess.Popen([sys.executable, "-m", "hebrus_mlx.cli", "server", "--model", "demo", "--port", "0",
                             "--log-level", "WARNING", "--max-body-bytes", str(int(a.mb * 1e6) + 4096)],
                            cwd=a.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while "listening on" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise SystemExit("server did not start")
        port = int(line.rsplit(":", 1)[1])
        idle = poll(port, seconds=3)
        content = ("lorem ipsum dolor sit amet " * (int(a.mb * 1e6) // 27 + 1))[: int(a.mb * 1e6)]
        body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()
        out = {}

        def big():
            tic = time.monotonic()
            out["status"] = request(port, "POST", "/v1/chat/completions", body)
            out["seconds"] = time.monotonic() - tic

        t = threading.Thread(target=big)
        t.start()
        busy = poll(port, until=t)
        t.join()
        print(f"tree: {a.root}")
        print(describe("/health idle", idle))
        print(describe(f"/health during {a.mb:g} MB", busy))
        print(f"{a.mb:g} MB request: {out['seconds']:.2f} s (HTTP {out['status']}); "
              f"worst /health / request = {max(busy) / out['seconds']:.3f}")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
