"""Does a big request stall the server's event loop? (issue 22 §3)

Starts `hebrus-mlx server` (the demo) from a source tree, then, side by side in one run:
/health latency while idle, and while one client's 4 MB chat request is being rendered and
tokenized (polled every 20 ms). Prints the latencies, the big request's time and the ratio
worst-/health / big-request (1.0 means /health waited for the whole request).

    python benchmarks/bench_server_stall.py [--root DIR] [--against DIR] [--mb 4]

--root runs another checkout's server (e.g. an older commit's `git archive`); --against DIR runs
both trees A B B A in one run and prints their busy /health p50/p99/max side by side.
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


def run_tree(root, mb):
    """One server of tree `root`: (idle latencies, busy latencies, big request seconds, status)."""
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.Popen([sys.executable, "-m", "hebrus_mlx.cli", "server", "--model", "demo", "--port", "0",
                             "--log-level", "WARNING", "--max-body-bytes", str(int(mb * 1e6) + 4096)],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while "listening on" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise SystemExit(f"server of {root} did not start")
        port = int(line.rsplit(":", 1)[1])
        idle = poll(port, seconds=3)
        content = ("lorem ipsum dolor sit amet " * (int(mb * 1e6) // 27 + 1))[: int(mb * 1e6)]
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
        return idle, busy, out["seconds"], out["status"]
    finally:
        proc.terminate()
        proc.wait(30)


def pct(lat, q):
    lat = sorted(lat)
    return lat[min(len(lat) - 1, int(len(lat) * q))]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--against", default=None,
                   help="another checkout (e.g. `git worktree add /tmp/base main`): both trees run A B B A "
                        "in one run and the busy /health latencies are compared side by side")
    p.add_argument("--mb", type=float, default=4.0)
    a = p.parse_args()
    trees = [a.root] if a.against is None else [a.root, a.against, a.against, a.root]
    runs = {}
    for root in trees:
        idle, busy, seconds, status = run_tree(root, a.mb)
        print(f"tree: {root}")
        print(describe("/health idle", idle))
        print(describe(f"/health during {a.mb:g} MB", busy))
        print(f"{a.mb:g} MB request: {seconds:.2f} s (HTTP {status}); "
              f"worst /health / request = {max(busy) / seconds:.3f}", flush=True)
        runs.setdefault(root, []).append(busy)
    if a.against is not None:
        for q, name in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
            this = statistics.median(pct(b, q) for b in runs[a.root])
            other = statistics.median(pct(b, q) for b in runs[a.against])
            print(f"busy /health {name}: {this * 1e3:.1f} ms vs {other * 1e3:.1f} ms "
                  f"(this / against = {this / other:.2f})")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(a loaded machine's scheduler delays dominate the max)")


if __name__ == "__main__":
    main()
