"""Streamed vs resident decode of an artifact, and memory over a long run.

Loads the artifact resident (the loader), decodes a fixed greedy sequence,
then swaps every layer's routed experts for StreamedSwitchGLU over a small
arena and decodes the same tokens: prints tok/s side by side, whether the
tokens match, the engine's I/O line, and resident memory (RSS) every
--report tokens of a long run (the cache is reset whenever the model's
position limit would be passed; the arena and engine persist).

    python benchmarks/bench_stream_decode.py [--artifact DIR] [--rows 2]
        [--tokens 2000] [--ple-cache-kib 256] [--long-resident]

With --wavefront-ab N it only compares the two streamed decode paths (AFN-019 H4): the
wavefront (each routed expert computed as its record lands) and the resolve-all path (every
top-k record waited for before any expert runs), N interleaved rounds of --compare tokens each,
the same arena size, a fresh engine and arena (cold) per run; prints the engine's exposed wait
per token and tok/s of each, medians, and the ratios. Tokens must match the resident run.
--read-delay-us keeps every read in flight that much longer (the tests' fault-injection engine,
tests/support/fault_injection.py): SSD-like latency for a store that sits in the page cache here.

    python benchmarks/bench_stream_decode.py --artifact hebrus_mlx/demo/model --rows 26 \
        --compare 32 --wavefront-ab 6 [--wave-widths 1,2,5] [--read-delay-us 2000]

With --ple-cache-kib the PLE rows stream too (page cache of that size,
through the same engine) in the streamed runs and the long run.

Without --artifact a tiny checkpoint is built and converted (needs torch and
transformers, as the tests do).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import mlx.core as mx

from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import expert_major as em
from hebrus_mlx.loader import load_model
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.experts import StreamedExperts
from hebrus_mlx.stream.ple import attach_ple
from hebrus_mlx.stream.streaming import Streaming
from hebrus_mlx.stream.switch import attach


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def decode(model, first, n, limit, report=None):
    cache, tok, tokens = model.make_cache(), first, []
    t0 = time.perf_counter()
    for i in range(n):
        if (i + 1) % limit == 0:
            cache = model.make_cache()
        out = model(mx.array([[tok]]), cache)
        tok = int(out[0, -1].argmax())  # one sync per token, none per layer
        tokens.append(tok)
        if report and (i + 1) % report[0] == 0:
            report[1](i + 1, cache)
    return tokens, time.perf_counter() - t0


def wavefront_ab(model, reader, args, resident, limit):
    """Interleaved rounds of the resolve-all path and the wavefront at each --wave-widths, one arena
    size: prints exposed wait ms/token and tok/s (medians) and their ratios to resolve-all."""
    engine_cls = se.StreamEngine
    if args.read_delay_us:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from support.fault_injection import FaultyEngine as engine_cls
    variants = [("resolve-all", None)] + [(f"wavefront, width {w}", w) for w in args.wave_widths]
    stats = {name: [] for name, _ in variants}
    for r in range(args.wavefront_ab):
        # Each round in another order, so drift in the machine's load hits every variant alike.
        for name, width in variants[r % len(variants) :] + variants[: r % len(variants)]:
            eng = engine_cls(cache_bytes=1 << 20, threads=4)
            if args.read_delay_us:
                eng.set_read_delay_us(args.read_delay_us)
            experts = StreamedExperts(eng, reader, rows=args.rows, wavefront=width is not None)
            experts.wave_width = width or 1
            model.streaming = Streaming(eng, experts, attach([layer.mlp for layer in model.model.layers], experts))
            tokens, dt = decode(model, 3, args.compare, limit)
            if tokens != resident:
                raise SystemExit(f"{name}: tokens differ from the resident run")
            stats[name].append((eng.counters()["exposed_wait_ns"] / 1e6 / args.compare, args.compare / dt))
            eng.close()
    med = {n: [statistics.median(v[i] for v in stats[n]) for i in range(2)] for n in stats}
    base = med["resolve-all"]
    for name, _ in variants:
        wait, tps = med[name]
        ratio = f" (x{wait / base[0]:.2f} wait, x{tps / base[1]:.2f} tok/s)" if name != "resolve-all" else ""
        print(f"  {name:20s}: exposed wait {wait:6.2f} ms/token, {tps:5.1f} tok/s, medians{ratio}")
    print("  tokens identical to resident in every run")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifact")
    p.add_argument("--rows", type=int, default=2, help="arena slots (records)")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--compare", type=int, default=64, help="tokens timed both ways")
    p.add_argument("--report", type=int, default=250)
    p.add_argument("--long-resident", action="store_true", help="long run on the resident model (the RSS control)")
    p.add_argument(
        "--ple-cache-kib", type=int, default=0, help="also stream PLE rows with a page cache this size (0: resident)"
    )
    p.add_argument(
        "--wavefront-ab", type=int, default=0, help="only compare wavefront on/off, this many interleaved rounds"
    )
    p.add_argument(
        "--wave-widths", type=lambda t: [int(w) for w in t.split(",")], default=[1], help="(--wavefront-ab) e.g. 1,2,5"
    )
    p.add_argument("--read-delay-us", type=int, default=0, help="(--wavefront-ab) added latency of every read")
    args = p.parse_args()

    art = args.artifact
    if art is None:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from support.artifact_fixture import tiny_artifact

        _, art = tiny_artifact(tempfile.mkdtemp(prefix="hebrus_bench_"), "float32", 4)
    model = load_model(art)
    limit = model.args.max_position_embeddings - 1
    resident, t_res = decode(model, 3, args.compare, limit)

    with open(os.path.join(art, C.MANIFEST_NAME)) as f:
        m = json.load(f)
    s = next(s for s in m["stores"] if s["role"] == "experts")
    fam = C.family(m["family"])
    reader = em.ExpertMajorReader(os.path.join(art, s["path"]), fam, s["codec"])
    records = fam.num_hidden_layers * fam.num_experts
    print(
        f"artifact {art}: arena {args.rows} of {records} records "
        f"({100 * args.rows / records:.1f}% of the expert store); PLE "
        f"{f'streamed, {args.ple_cache_kib} KiB page cache' if args.ple_cache_kib else 'resident'}; "
        f"resident {args.compare / t_res:.1f} tok/s"
    )
    if args.wavefront_ab:
        wavefront_ab(model, reader, args, resident, limit)
        return
    for prefetch in (False, True):
        eng = se.StreamEngine(cache_bytes=max(1 << 20, args.ple_cache_kib << 10), threads=4)
        if args.ple_cache_kib:
            attach_ple(model, art, eng)
        experts = StreamedExperts(eng, reader, rows=args.rows, prefetch_previous=prefetch)
        # The model's declared streaming face runs each layer's P1 hint (prefetch) when it starts.
        model.streaming = Streaming(eng, experts, attach([layer.mlp for layer in model.model.layers], experts))
        streamed, t_str = decode(model, 3, args.compare, limit)
        c = eng.counters()
        print(
            f"  streamed, previous-token prefetch {'on ' if prefetch else 'off'}: "
            f"{args.compare / t_str:.1f} tok/s ({t_res / t_str:.3f}x resident), "
            f"tokens identical: {streamed == resident}, predicted hits/joins "
            f"{c['predicted_hits']}/{c['predicted_joins']}"
        )
        print("    " + se.io_summary(c))

    eng.reset_counters()
    if args.long_resident:
        model, eng = load_model(art), None
    base = rss_mib()
    print(
        f"  long run ({'resident' if args.long_resident else 'streamed'}): "
        f"{args.tokens} tokens, RSS MiB every {args.report}:"
    )

    def report(i, cache):
        # The sequence's own state (QSA K/V grows with the context) is
        # shown apart, so RSS minus it is what streaming adds.
        kv = sum(a.nbytes for a in cache.arrays) / 2**20
        line = f"    {i:6d}  RSS {rss_mib():8.1f}  (+{rss_mib() - base:6.1f})  sequence cache {kv:6.1f} MiB"
        if eng is not None:
            mem = eng.memory()
            line += f"  engine slab bytes {mem['allocated']}  arena rows {mem['arena_rows']}  tickets {mem['tickets']}"
        print(line)

    _, dt = decode(model, 3, args.tokens, limit, (args.report, report))
    print(f"  {args.tokens / dt:.1f} tok/s" + ("" if eng is None else "; " + se.io_summary(eng.counters())))


if __name__ == "__main__":
    main()
