"""Does a big request stall the server's event loop? (issue 22 §3)

Starts `hebrus-mlx server` (the demo) from a source tree, then, side by side in one run:
/health latency while idle, and while one client's 4 MB chat request is being rendered and
tokenized (polled every 20 ms). Prints the latencies, the big request's time and the ratio
worst-/health / big-request (1.0 means /health waited for the whole request).

    python benchmarks/bench_server_stall.py [--root DIR] [--against DIR | --prep] [--mb 4]

--root runs another checkout's server (e.g. an older commit's `git archive`); --against DIR runs
both trees A B B A in one run and prints their busy /health p50/p99/max side by side. --prep
compares, A B B A in one run, the big request prepared in the server's prep process (the
default) with it prepared on a thread (`--prep-process-bytes 0`). --small N times N small chat
requests (1 KB) through the prep process (`--prep-process-bytes 1`) and on a thread, A B B A: the
round trip the default threshold (64 KiB) keeps off small requests.

Alongside each phase a probe process with no server work (sleep 5 ms, measure how late it
wakes) shows the OS scheduler's own delay on this machine at its current load: what /health
cannot beat whatever the server does.
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

from hebrus_mlx.testing.processes import server_argv


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
    while until.is_alive() if until is not None else time.monotonic() < end:
        tic = time.monotonic()
        request(port, "GET", "/health")
        lat.append(time.monotonic() - tic)
        time.sleep(0.02)
    return lat


def describe(name, lat):
    lat = sorted(lat)
    return (
        f"{name:28s} n={len(lat):4d}  p50 {statistics.median(lat) * 1e3:7.1f} ms  "
        f"p99 {lat[int(len(lat) * 0.99)] * 1e3:7.1f} ms  max {lat[-1] * 1e3:8.1f} ms"
    )


PROBE = """
import signal, sys, time
late = [0.0]
def done(*_):
    print(max(late), sorted(late)[len(late) // 2], flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
while True:
    t = time.monotonic()
    time.sleep(0.005)
    late.append(time.monotonic() - t - 0.005)
"""


class Probe:
    """A process that only sleeps 5 ms at a time and records how late it wakes: the OS
    scheduler's delay at the machine's current load, with no server work in it."""

    def __init__(self):
        self.p = subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True)

    def stop(self):
        """(max, median) lateness in seconds."""
        self.p.terminate()
        out, _ = self.p.communicate(timeout=30)
        worst, median = map(float, out.split())
        return worst, median


def start(root, args):
    """A server of tree `root` with `args`: (process, port)."""
    proc = subprocess.Popen(
        server_argv(*args),
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"server of {root} did not start")
    return proc, int(line.rsplit(":", 1)[1])


def run_small(root, n, extra):
    """Median seconds of `n` small chat requests (after 3 warm-ups). Each is refused after it is
    rendered and tokenized (max_tokens past the context: a 400), so no generation is timed."""
    proc, port = start(root, extra)
    try:
        body = json.dumps(
            {"messages": [{"role": "user", "content": "lorem ipsum " * 85}], "max_tokens": 10**7}
        ).encode()
        times = []
        for _ in range(n + 3):
            tic = time.monotonic()
            assert request(port, "POST", "/v1/chat/completions", body) == 400
            times.append(time.monotonic() - tic)
        return statistics.median(times[3:])
    finally:
        proc.terminate()
        proc.wait(30)


def run_tree(root, mb, extra=()):
    """One server of tree `root`: (idle latencies, busy latencies, big request seconds, status,
    scheduler probe's max lateness while busy)."""
    proc, port = start(root, ["--max-body-bytes", str(int(mb * 1e6) + 4096), *extra])
    try:
        pr = Probe()
        idle = poll(port, seconds=3)
        idle_probe = pr.stop()
        content = ("lorem ipsum dolor sit amet " * (int(mb * 1e6) // 27 + 1))[: int(mb * 1e6)]
        body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()
        out = {}

        def big():
            tic = time.monotonic()
            out["status"] = request(port, "POST", "/v1/chat/completions", body)
            out["seconds"] = time.monotonic() - tic

        t = threading.Thread(target=big)
        pr = Probe()
        t.start()
        busy = poll(port, until=t)
        t.join()
        return {
            "idle": idle,
            "busy": busy,
            "seconds": out["seconds"],
            "status": out["status"],
            "idle_probe": idle_probe,
            "busy_probe": pr.stop(),
        }
    finally:
        proc.terminate()
        proc.wait(30)


def pct(lat, q):
    lat = sorted(lat)
    return lat[min(len(lat) - 1, int(len(lat) * q))]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument(
        "--against",
        default=None,
        help="another checkout (e.g. `git worktree add /tmp/base main`): both trees run A B B A "
        "in one run and the busy /health latencies are compared side by side",
    )
    p.add_argument(
        "--prep",
        action="store_true",
        help="compare, A B B A, the big request prepared in the prep process (the default) "
        "and on a thread (--prep-process-bytes 0)",
    )
    p.add_argument(
        "--small",
        type=int,
        default=0,
        metavar="N",
        help="time N small requests through the prep process and on a thread, A B B A",
    )
    p.add_argument("--mb", type=float, default=4.0)
    a = p.parse_args()
    if a.small:
        got = {}
        for name, extra in (("process", "1"), ("thread", "0"), ("thread", "0"), ("process", "1")):
            got.setdefault(name, []).append(run_small(a.root, a.small, ["--prep-process-bytes", extra]))
            print(f"{name:8s} small request median {got[name][-1] * 1e3:.1f} ms", flush=True)
        pr, th = statistics.median(got["process"]), statistics.median(got["thread"])
        print(
            f"small request: {pr * 1e3:.1f} ms (process) vs {th * 1e3:.1f} ms (thread), "
            f"ratio {pr / th:.2f}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        return
    if a.prep:
        A, B = ("process prep", a.root, ()), ("thread prep", a.root, ("--prep-process-bytes", "0"))
    else:
        A, B = (a.root, a.root, ()), (a.against, a.against, ())
    variants = [A] if a.against is None and not a.prep else [A, B, B, A]
    runs = {}
    for name, root, extra in variants:
        r = run_tree(root, a.mb, extra)
        print(f"{name}:")
        print(describe("/health idle", r["idle"]))
        print(describe(f"/health during {a.mb:g} MB", r["busy"]))
        print(
            f"{a.mb:g} MB request: {r['seconds']:.2f} s (HTTP {r['status']}); "
            f"worst /health / request = {max(r['busy']) / r['seconds']:.3f}"
        )
        print(
            f"scheduler probe (a process sleeping 5 ms, no server work): late by max "
            f"{r['idle_probe'][0] * 1e3:.1f} ms idle, {r['busy_probe'][0] * 1e3:.1f} ms during the request "
            f"(median {r['busy_probe'][1] * 1e3:.2f} ms)",
            flush=True,
        )
        runs.setdefault(name, []).append(r)
    if len(variants) > 1:
        for q, label in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
            this = statistics.median(pct(r["busy"], q) for r in runs[A[0]])
            other = statistics.median(pct(r["busy"], q) for r in runs[B[0]])
            print(
                f"busy /health {label}: {this * 1e3:.1f} ms ({A[0]}) vs {other * 1e3:.1f} ms ({B[0]}) "
                f"(ratio {this / other:.2f})"
            )
        for name, _, _ in (A, B):
            rs = runs[name]
            print(
                f"{name}: idle /health max {statistics.median(max(r['idle']) for r in rs) * 1e3:.1f} ms; "
                f"scheduler probe max {statistics.median(r['busy_probe'][0] for r in rs) * 1e3:.1f} ms during "
                f"the request, {statistics.median(r['idle_probe'][0] for r in rs) * 1e3:.1f} ms idle (medians of runs)"
            )
    print(
        f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
        "(a loaded machine's scheduler delays dominate the max)"
    )


if __name__ == "__main__":
    main()
