"""Streamed vs resident decode of an artifact, and memory over a long run.

Loads the artifact resident (the loader), decodes a fixed greedy sequence,
then swaps every layer's routed experts for StreamedSwitchGLU over a small
arena and decodes the same tokens: prints tok/s side by side, whether the
tokens match, the engine's I/O line, and resident memory (RSS) every
--report tokens of a long run (the cache is reset whenever the model's
position limit would be passed; the arena and engine persist).

    python benchmarks/bench_stream_decode.py [--artifact DIR] [--rows 2]
        [--tokens 2000] [--ple-cache-kib 256] [--long-resident]

With --ple-cache-kib the PLE rows stream too (page cache of that size,
through the same engine) in the streamed runs and the long run.

Without --artifact a tiny checkpoint is built and converted (needs torch and
transformers, as the tests do).
"""

import argparse
import json
import os
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
    args = p.parse_args()

    art = args.artifact
    if art is None:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from artifact_fixture import tiny_artifact

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
