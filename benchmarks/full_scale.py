"""Full-scale run of the real Qwen3.8-Flash-Next geometry on this machine: a generated checkpoint
(hebrus_mlx/testing/synthetic_source.py: 48 layers, 512 experts top-10 at their real record size,
the PLE table at its real row width with fewer rows) through `convert`, `admit`, `verify`, `load`,
`generate` at several expert-cache sizes, the prompt cache across a restart, the server, and `simulate`.

    python benchmarks/full_scale.py --dir DIR --ple-dtype q4 --tokens 128 --cache-gb 2,4,8

runs every phase in order (free-disk check first, `clean` last); `--phases` picks a subset.
docs/FULL_SCALE.md has the figures, the disk and the time it needs.

Each phase prints one JSON line of what it measured; --json collects them. Random weights: no
quality can be read from the tokens; routing is near uniform (the hardest regime for an expert
cache); the CPU backend is not a Mac's speed."""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

from hebrus_mlx import admission
from hebrus_mlx.convert import artifact_bytes, convert, expert_spec, plan
from hebrus_mlx.testing import synthetic_source as S

PHASES = ("convert", "kill", "admit", "verify", "engine", "load", "generate", "restart", "server", "simulate", "clean")
# The shipped demo's Qwen-style chat template (admission requires one).
TEMPLATE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hebrus_mlx", "demo", "model", "chat_template.jinja"
)
PROMPT_IDS = [9707, 11, 1879, 0, 576, 374, 264]
TAIL_IDS = [1446, 3405, 30]  # the continuation the `restart` phase feeds after the cached prompt


def io_counters(cached=False):
    """(read, written) bytes of this process (/proc/self/io): at the block layer, or with `cached`
    every byte through read/write calls, page-cache hits included (rchar, wchar)."""
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return (int(d["rchar"]), int(d["wchar"])) if cached else (int(d["read_bytes"]), int(d["write_bytes"]))


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def memory_now():
    """GiB: anonymous and file-backed resident memory (/proc/self/smaps_rollup), MLX's live arrays
    and its allocator cache."""
    import mlx.core as mx

    with open("/proc/self/smaps_rollup") as f:
        d = {p[0].rstrip(":"): int(p[1]) for p in (line.split() for line in f) if len(p) == 3}
    return {
        "rss": round(d["Rss"] / 2**20, 2),
        "anonymous": round(d["Anonymous"] / 2**20, 2),
        "file": round((d["Rss"] - d["Anonymous"]) / 2**20, 2),
        "mlx_active": round(mx.get_active_memory() / 2**30, 2),
        "mlx_cache": round(mx.get_cache_memory() / 2**30, 2),
    }


def emit(out, phase, **fields):
    row = {"phase": phase, **fields}
    print(json.dumps(row), flush=True)
    out.append(row)


def qwen_tokenizer(root):
    """The pinned Qwen 248k tokenizer.json (tools/build_qwen_tokenizer.py), built once under `root`."""
    path = os.path.join(root, "tokenizer", "tokenizer.json")
    if not os.path.isfile(path):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
        from build_qwen_tokenizer import build

        build(os.path.dirname(path), check_digest=True)
    return path


def config_of(a):
    """The run's config: the real geometry, or with --layers/--experts a smaller smoke run of it."""
    over = {}
    if a.layers != 48:
        over.update(num_hidden_layers=a.layers, layer_types=S.real_config()["text_config"]["layer_types"][: a.layers])
    if a.experts != 512:
        over.update(num_experts=a.experts)
    return S.real_config(a.ple_base, **over)


def source_dir(root, config, seed):
    path = os.path.join(root, "source")
    S.write(path, config, seed, files=[qwen_tokenizer(root), TEMPLATE])
    S.register_family(config)
    return path, config


def phase_convert(a, src_path, config, art, out):
    profile, args, _, fam = plan(config, 4, 64, None, a.expert_bits, 64, a.ple_dtype)
    need = artifact_bytes(args, fam, profile, expert_spec(config, profile))
    free = shutil.disk_usage(a.dir).free
    emit(out, "disk", need_gb=round(need / 1e9, 2), free_gb=round(free / 1e9, 2), profile=profile)
    # convert() itself refuses when this does not fit, after removing a killed run's temporaries.
    src = S.SyntheticSource(src_path)
    r0, w0 = io_counters()
    t = time.perf_counter()
    convert(
        src_path,
        art,
        q_bits=4,
        q_group_size=64,
        expert_bits=a.expert_bits,
        expert_group_size=64,
        ple_dtype=a.ple_dtype,
        mtp=False,
        overwrite=True,
        source=src,
    )
    wall = time.perf_counter() - t
    r1, w1 = io_counters()
    size = sum(os.path.getsize(os.path.join(art, n)) for n in os.listdir(art))
    emit(
        out,
        "convert",
        wall_s=round(wall, 1),
        peak_rss_gb=round(peak_rss_gb(), 2),
        written_gb=round((w1 - w0) / 1e9, 2),
        read_gb=round((r1 - r0) / 1e9, 2),
        artifact_gb=round(size / 1e9, 2),
        ple_rows=list(fam.ple_rows),
        ple_rows_real=[320_001_536],
        ple_dtype=a.ple_dtype or "bfloat16",
    )


def phase_admit(art, out):
    r0, c0 = io_counters()[0], io_counters(True)[0]
    t = time.perf_counter()
    m = admission.admit(art)
    wall = time.perf_counter() - t
    r1, c1 = io_counters()[0], io_counters(True)[0]
    stores = sum(s.size for s in m.stores)
    emit(
        out,
        "admit",
        wall_s=round(wall, 3),
        disk_read_bytes=r1 - r0,
        read_call_bytes=c1 - c0,
        store_bytes=stores,
        family=m.family.name,
    )


def worker(art, cache_gb, prefetch, tokens, out_path, trace_dir=None):
    """One load + greedy decode in this (fresh) process through `generate_step`, the loop
    `hebrus-mlx generate` runs (no stop tokens: every run decodes `tokens`); its measurements to
    `out_path` as JSON. `trace_dir`: record the run's expert routes there (hebrus_mlx.traces)."""
    import hashlib

    import mlx.core as mx
    import numpy as np

    from hebrus_mlx.generate import generate_step
    from hebrus_mlx.loader import load
    from hebrus_mlx.loading import build_model, plan
    from hebrus_mlx.traces.capture import TraceRecorder

    m = admission.admit(art)
    avail = plan.available_memory()
    ple_cache = build_model.plan_ple_residency(m)
    rows = build_model.plan_expert_residency(m, expert_cache_gb=cache_gb, ple_cache_bytes=ple_cache)
    r0 = io_counters(True)[0]
    t = time.perf_counter()
    model, tokenizer = load(art, expert_cache_gb=cache_gb, prefetch=prefetch)
    load_s = time.perf_counter() - t
    r1 = io_counters(True)[0]
    rss_load = rss_gb()
    # In-memory bytes (GiB) the plan stands for: the CPU graph runs fp32, so bf16 scales/biases of
    # the arena and the dense store, and bf16 PLE rows, are held widened to fp32.
    g = build_model.em.Geometry(m.family, m.experts.expert_codec)
    row = sum(2 * n if d == "uint16" else n for *_, d, _, _, n in g.layer_layout(0))
    ple_rows = sum(s.size * (2 if s.codec == "bf16" else 1) for s in m.ple)  # affine rows stay packed
    planned = {
        "available_gib": round(avail / 2**30, 2),
        "dense_gib": round(m.dense.size / 2**30, 2),
        "expert_arena_gib": round((g.count if rows is None else rows) * row / 2**30, 2),
        "expert_rows": rows,
        "ple_gib": round((ple_rows if ple_cache is None else ple_cache) / 2**30, 2),
        "ple_resident": ple_cache is None,
    }
    streaming = model.streaming
    # What the loader built (the default plan gives the prefill sweep's two-layer ring its rows out
    # of the arena; a forced cache keeps its rows and the ring comes on top).
    experts = streaming.experts if streaming is not None else None
    if experts is not None:
        planned["expert_rows"] = experts.rows
        planned["expert_arena_gib"] = round(experts.rows * row / 2**30, 2)
    sweep = streaming.sweep if streaming is not None else None
    planned["sweep_ring_gib"] = round((sweep.bytes if sweep is not None else 0) / 2**30, 2)
    # bf16 dense tensors (scales, biases) are held widened to fp32: the store's bytes undercount them.
    planned["dense_widened_gib"] = round(
        sum(t["data_offsets"][1] - t["data_offsets"][0] for t in m.tensors.values() if t["dtype"] == "BF16") / 2**30, 2
    )
    parts = ("dense_gib", "dense_widened_gib", "expert_arena_gib", "ple_gib", "sweep_ring_gib")
    planned["total_gib"] = round(sum(planned[k] for k in parts), 2)
    memory = memory_now()
    trace = None if trace_dir is None else TraceRecorder.for_model(trace_dir, model, tokenizer)
    steps = generate_step(mx.array(PROMPT_IDS), model, max_tokens=tokens, trace=trace)
    ids, per_token, counters, first_s = [], [], [], None
    t = time.perf_counter()
    c0, last = None, None
    try:
        for tok, logprobs in steps:
            last = logprobs
            now = time.perf_counter()
            if first_s is None:
                first_s = now - t
            else:
                per_token.append(now - t)
            ids.append(int(tok))
            if streaming is not None:
                c1 = streaming.counters()
                if c0 is not None:
                    counters.append(
                        {k: c1[k] - c0[k] for k in c1 if isinstance(c1[k], int) and isinstance(c0.get(k), int)}
                    )
                c0 = c1
            t = time.perf_counter()
    finally:
        if trace is not None:
            trace.close()
    # The last step's log-probabilities (log-softmax of the final logits, over the physical width).
    last = np.array(last.astype(mx.float32))
    vocab = model.effective_vocab_size or last.size
    res = {
        "expert_cache_gb_flag": cache_gb,
        "prefetch": prefetch,
        "load_s": round(load_s, 2),
        "load_read_call_bytes": r1 - r0,
        "dense_store_bytes": m.dense.size,
        "rss_after_load_gib": round(rss_load, 2),
        "memory_after_load_gib": memory,
        "plan": planned,
        "first_token_s": round(first_s, 2),
        "decode_s_per_token": [round(x, 2) for x in per_token],
        "tokens": ids,
        # Rows past the tokenizer's vocabulary are masked to -inf by the model (AFN-005): finite
        # means every other logit is, and those rows are exactly -inf.
        "final_logprobs_finite": bool(np.isfinite(last[:vocab]).all() and np.isneginf(last[vocab:]).all()),
        "masked_rows": int(last.size - vocab),
        "final_logprobs_sha256": hashlib.sha256(last.tobytes()).hexdigest(),
        "trace_dir": trace_dir,
        "peak_rss_gib": round(peak_rss_gb(), 2),
        "counters_per_token": counters,
        "counters_total": streaming.counters() if streaming is not None else None,
    }
    with open(out_path, "w") as f:
        json.dump(res, f)


def restart_worker(art, mode, cache_file, tokens, out_path):
    """One leg of the `restart` phase in a fresh process. save: prefill PROMPT_IDS and write the
    prompt cache; resume: load that file, feed TAIL_IDS and decode greedily; whole: the same
    prefill, tail and decode in one process with the cache kept in memory (the uninterrupted run)."""
    import hashlib

    import mlx.core as mx
    import numpy as np

    from hebrus_mlx.loader import load
    from hebrus_mlx.prompt_cache import load_prompt_cache, save_prompt_cache

    t = time.perf_counter()
    model, _ = load(art)
    res = {"mode": mode, "load_s": round(time.perf_counter() - t, 1)}
    t = time.perf_counter()
    if mode == "resume":
        cache = load_prompt_cache(cache_file, model)
        res["cache_load_s"] = round(time.perf_counter() - t, 2)
    else:
        cache = model.make_cache()
        mx.eval(model(mx.array([PROMPT_IDS]), cache))
        res["prefill_s"] = round(time.perf_counter() - t, 1)
    if mode == "save":
        t = time.perf_counter()
        save_prompt_cache(cache_file, cache, model, tokens=PROMPT_IDS, overwrite=False)
        res.update(save_s=round(time.perf_counter() - t, 2), cache_file_bytes=os.path.getsize(cache_file))
    else:
        t = time.perf_counter()
        logits = model(mx.array([TAIL_IDS]), cache)[0, -1]
        ids = [int(logits.argmax())]
        for _ in range(tokens - 1):
            logits = model(mx.array([[ids[-1]]]), cache)[0, -1]
            ids.append(int(logits.argmax()))
        last = np.array(logits.astype(mx.float32))
        res.update(
            decode_s=round(time.perf_counter() - t, 1),
            tokens=ids,
            final_logits_sha256=hashlib.sha256(last.tobytes()).hexdigest(),
        )
    res["peak_rss_gib"] = round(peak_rss_gb(), 2)
    with open(out_path, "w") as f:
        json.dump(res, f)


def phase_restart(a, art, out):
    """The prompt cache across a restart: save after the prompt in one process, load it in a new
    one and continue; the tokens and final logits must equal one process that never stopped."""
    cache_file = os.path.join(a.dir, "restart-prompt-cache.safetensors")
    if os.path.lexists(cache_file):
        os.unlink(cache_file)  # this phase's own file from an earlier run
    legs = {}
    for mode in ("save", "resume", "whole"):
        path = os.path.join(a.dir, f"restart-{mode}.json")
        cmd = _self(a) + ["--_restart", json.dumps([art, mode, cache_file, a.restart_tokens, path])]
        subprocess.run(cmd, check=True)
        with open(path) as f:
            legs[mode] = json.load(f)
        os.unlink(path)
    os.unlink(cache_file)
    r, w = legs["resume"], legs["whole"]
    emit(
        out,
        "restart",
        **{k: v for k, v in legs["save"].items() if k != "mode"},
        resume=r,
        whole=w,
        identical=r["tokens"] == w["tokens"] and r["final_logits_sha256"] == w["final_logits_sha256"],
    )


def run_worker(a, art, cache_gb, prefetch, out, trace_dir=None):
    """`worker` in a child process (each load gets a fresh process: the memory it reports is its own)."""
    path = os.path.join(a.dir, f"gen-{cache_gb}-{prefetch}.json")
    cmd = _self(a) + ["--_worker", json.dumps([art, cache_gb, prefetch, a.tokens, path, trace_dir])]
    subprocess.run(cmd, check=True)
    with open(path) as f:
        res = json.load(f)
    os.unlink(path)
    per = res.pop("counters_per_token")
    total = res.pop("counters_total") or {}
    n = max(1, len(per))
    mean = lambda k: sum(c.get(k, 0) for c in per) / n  # noqa: E731
    lookups = sum(c.get("hits", 0) + c.get("joins", 0) + c.get("misses", 0) for c in per)
    hits = sum(c.get("hits", 0) + c.get("joins", 0) for c in per)
    dec = res["decode_s_per_token"]
    res.update(
        tok_s=round(len(dec) / sum(dec), 3) if dec else None,
        read_mb_per_token=round((mean("exact_bytes") + mean("predicted_bytes")) / 1e6, 1),
        exposed_wait_s_per_token=round(mean("exposed_wait_ns") / 1e9, 3),
        hit_rate=round(hits / lookups, 3) if lookups else None,
        engine_read_gb_s=round(
            sum(c.get("exact_bytes", 0) for c in per) / max(1, sum(c.get("exact_read_ns", 0) for c in per)), 3
        ),
        counters_total={k: v for k, v in total.items() if isinstance(v, (int, float))},
    )
    emit(out, "generate", **res)
    return res


def _snapshot(art):
    """Every file of the artifact: (size, mtime_ns, inode), and the manifest's bytes."""
    snap = {
        n: (st.st_size, st.st_mtime_ns, st.st_ino) for n in os.listdir(art) for st in [os.stat(os.path.join(art, n))]
    }
    with open(os.path.join(art, "manifest.json"), "rb") as f:
        return snap, f.read()


def _temps(root):
    return sorted(n for n in os.listdir(root) if n.startswith(".artifact") and ".tmpdir-" in n)


def _tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def phase_kill(a, art, out, at=0.5):
    """A conversion SIGKILLed once its temp directory holds `at` of the artifact's bytes, then run
    again. Where the disk holds the artifact twice: `convert --overwrite` over the finished
    artifact, which must be untouched after the kill (every file's size, mtime and inode, the
    manifest's bytes, admission), and the rerun removes the stale temporary before anything else.
    Where it does not (--kill-mode rebuild, or auto on a disk that holds one): the artifact is
    removed first (its manifest kept), the killed run must publish nothing, and the rerun must
    remove its temporary and rebuild an artifact whose manifest is byte-identical to the kept one."""
    total = _tree_bytes(art)
    mode = a.kill_mode
    if mode == "auto":
        mode = "overwrite" if shutil.disk_usage(a.dir).free > 1.1 * total else "rebuild"
    with open(os.path.join(art, "manifest.json"), "rb") as f:
        manifest = f.read()
    before = _snapshot(art)
    if mode == "rebuild":
        shutil.rmtree(art)
    cmd = _self(a) + ["--phases", "convert", "--expert-bits", str(a.expert_bits)]
    cmd += ["--ple-dtype", a.ple_dtype] if a.ple_dtype else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t, killed_at = time.perf_counter(), None
    while proc.poll() is None:
        temps = _temps(a.dir)
        done = sum(_tree_bytes(os.path.join(a.dir, n)) for n in temps)
        # The disk is shared: kill early rather than leave it under 10 GB free.
        if done >= at * total or shutil.disk_usage(a.dir).free < 10e9:
            proc.kill()  # SIGKILL: no handler, no cleanup
            killed_at = done
            break
        time.sleep(1)
    rc = proc.wait()
    stale = _temps(a.dir)
    row = {
        "mode": mode,
        "killed": killed_at is not None,
        "killed_run_rc": rc,
        "killed_after_s": round(time.perf_counter() - t, 1),
        "killed_at_gb": None if killed_at is None else round(killed_at / 1e9, 2),
        "artifact_gb": round(total / 1e9, 2),
        "stale_temps_after_kill": len(stale),
    }
    if mode == "overwrite":
        row["earlier_artifact_unchanged"] = _snapshot(art) == before
        admission.admit(art)
    else:
        row["nothing_published_by_killed_run"] = not os.path.exists(art)
    t = time.perf_counter()
    rerun = subprocess.run(cmd, capture_output=True, text=True)
    row.update(
        rerun_rc=rerun.returncode,
        rerun_s=round(time.perf_counter() - t, 1),
        rerun_said=[line for line in rerun.stderr.splitlines() if "removed" in line or "free" in line][-3:],
        stale_temps_left=[n for n in stale if n in _temps(a.dir)],
    )
    if rerun.returncode == 0:
        with open(os.path.join(art, "manifest.json"), "rb") as f:
            row["manifest_byte_identical"] = f.read() == manifest
        admission.admit(art)
    elif mode == "overwrite":
        row["artifact_unchanged_after_refused_rerun"] = _snapshot(art) == before
    emit(out, "kill", **row)


def _self(a):
    """This script with the run's geometry flags (a child process registers the same family)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--dir", a.dir, "--ple-base", str(a.ple_base)]
    return cmd + ["--layers", str(a.layers), "--experts", str(a.experts)]


def _cli(a, args):
    """A hebrus-mlx verb in a child process that registers the run's family first."""
    return _self(a) + ["--_cli", json.dumps(args)]


def _proc_sample(pid):
    """(RSS GiB, open files, threads) of a process from /proc."""
    with open(f"/proc/{pid}/status") as f:
        st = dict(line.split(":", 1) for line in f if ":" in line)
    return (
        int(st["VmRSS"].split()[0]) / 2**20,
        len(os.listdir(f"/proc/{pid}/fd")),
        int(st["Threads"]),
    )


def phase_server(a, art, out, cache_gb=4.0, chats=4, alone_tokens=32):
    """`hebrus-mlx server --decode-concurrency CHATS` on the artifact: one chat alone (the
    reference), then CHATS concurrent chats of --tokens each, the first the lone one's request again
    (its tokens and log-probabilities must be the same inside the batch); expert bytes read per
    token while decoding (from /health's engine counters, between the moment every stream has its
    first token and the end: prefill's reads excluded); the server's RSS, open files and threads
    every 2 s throughout (the soak); then SIGTERM with one more request in flight."""
    import signal
    import threading
    import urllib.request

    pcache = os.path.join(a.dir, "server-prompt-cache")
    shutil.rmtree(pcache, ignore_errors=True)
    server_args = ["server", "--model", art, "--port", "0", "--expert-cache-gb", str(cache_gb)]
    server_args += ["--decode-concurrency", str(chats), "--prompt-cache-dir", pcache]

    def start():
        p = subprocess.Popen(_cli(a, server_args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            if "listening on" in line:
                threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()  # drain the log
                return p, line.strip().rsplit(" ", 1)[-1]
        raise SystemExit(f"full_scale: error: the server exited before listening (rc {p.wait()})")

    t0 = time.perf_counter()
    proc, url = start()
    ready_s = time.perf_counter() - t0
    samples, stop = [], threading.Event()

    def sampler():
        while not stop.is_set():
            try:
                samples.append((round(time.perf_counter() - t0, 1), *_proc_sample(proc.pid)))
            except (OSError, KeyError, ValueError):
                return
            stop.wait(2.0)

    threading.Thread(target=sampler, daemon=True).start()

    def health():
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            return json.load(r)

    def counters():
        return health().get("stream_counters") or {}

    def chat(i, tokens, res, first=None):
        """A streamed greedy chat with log-probabilities: res[i] = its tokens' (text, logprob)."""
        body = {
            "messages": [{"role": "user", "content": f"Say something about the number {i}."}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "logprobs": True,
            "stream_options": {"include_usage": True},
        }
        req = urllib.request.Request(
            url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        t, got, usage = time.perf_counter(), [], None
        try:
            with urllib.request.urlopen(req, timeout=7200) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for c in chunk.get("choices", []):
                        for e in (c.get("logprobs") or {}).get("content") or []:
                            got.append((e["token"], e["logprob"]))
                            if len(got) == 1 and first is not None:
                                first[i] = time.perf_counter()
            cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            res[i] = {"s": round(time.perf_counter() - t, 1), "tokens": got, "cached_tokens": cached}
        except Exception as e:  # noqa: BLE001  (reported, not raised: the row says what failed)
            res[i] = {"s": round(time.perf_counter() - t, 1), "tokens": got, "error": str(e)[:160]}

    def window_rate(c0, c1, tokens):
        moved = {k: c1.get(k, 0) - c0.get(k, 0) for k in ("exact_bytes", "predicted_bytes", "hits", "joins", "misses")}
        looked = moved["hits"] + moved["joins"] + moved["misses"]
        return {
            "decode_tokens": tokens,
            "expert_mb_per_token": round((moved["exact_bytes"] + moved["predicted_bytes"]) / 1e6 / max(1, tokens), 1),
            "hit_rate": round((moved["hits"] + moved["joins"]) / looked, 3) if looked else None,
        }

    # One request alone: the reference tokens and the lone read cost per token.
    alone, first = [None], [None]
    th = threading.Thread(target=chat, args=(0, min(alone_tokens, a.server_tokens), alone, first))
    t_alone = time.perf_counter()
    th.start()
    while first[0] is None and th.is_alive():
        time.sleep(0.2)
    alone_first_token_s = round(first[0] - t_alone, 1) if first[0] else None
    c0, n0 = counters(), 1
    th.join()
    alone_row = window_rate(c0, counters(), len(alone[0]["tokens"]) - n0)
    alone_row.update(s=alone[0]["s"], tokens=len(alone[0]["tokens"]), error=alone[0].get("error"))
    # CHATS at once; chat 0 repeats the lone request.
    results, firsts = [None] * chats, [None] * chats
    threads = [threading.Thread(target=chat, args=(i, a.server_tokens, results, firsts)) for i in range(chats)]
    t_batch = time.perf_counter()
    for th in threads:
        th.start()
    while any(f is None for f in firsts) and any(th.is_alive() for th in threads):
        time.sleep(0.2)
    warm_at = time.perf_counter() - t0
    c0 = counters()
    started = [len(r["tokens"]) if r else 0 for r in results]  # tokens already out (>= 1 each)
    for th in threads:
        th.join()
    batch_s = time.perf_counter() - t_batch
    batch_end = time.perf_counter() - t0
    after = [len(r["tokens"]) for r in results]
    batch_row = window_rate(c0, counters(), sum(after) - sum(started))
    h = health()
    # SIGTERM with one more request in flight: it must end and the process exit cleanly.
    late = {}
    lt = threading.Thread(target=chat, args=(chats, 4, late))
    lt.start()
    time.sleep(5)
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=600)
    sigterm_exit_s = round(time.perf_counter() - t, 1)
    stop.set()
    lt.join()
    # A new server on the same --prompt-cache-dir: the lone request's prefix comes from disk, and
    # its first tokens and log-probabilities are the ones the first server gave.
    t = time.perf_counter()
    proc2, url = start()
    again, again_first = {}, {}
    restart_tokens = min(4, len(alone[0]["tokens"]))
    t_req = time.perf_counter()
    chat(0, restart_tokens, again, again_first)
    proc2.send_signal(signal.SIGTERM)
    restart = {
        "ready_s": round(t_req - t, 1),
        "first_token_s": round(again_first[0] - t_req, 1) if 0 in again_first else None,
        "lone_first_token_s": alone_first_token_s,
        "cached_tokens": again[0].get("cached_tokens"),
        "lone_request_cached_tokens": alone[0].get("cached_tokens"),
        "tokens_equal": again[0]["tokens"] == alone[0]["tokens"][:restart_tokens],
        "error": again[0].get("error"),
        "rc": proc2.wait(timeout=600),
    }
    ref, same = alone[0]["tokens"], results[0]["tokens"][: len(alone[0]["tokens"])]
    # The soak: the batch's decode, from the moment every stream has its first token (prefills and
    # first allocations behind) to the last token; the late request's prefill comes after it.
    warm = [x for x in samples if warm_at <= x[0] <= batch_end] or samples[-1:]
    rss = [x[1] for x in warm]
    peak = max(warm, key=lambda x: x[1])
    with open(os.path.join(a.dir, "server-samples.json"), "w") as f:
        json.dump(
            {
                "columns": ["s", "rss_gib", "open_files", "threads"],
                "warm_at": warm_at,
                "batch_end": batch_end,
                "samples": samples,
            },
            f,
        )
    emit(
        out,
        "server",
        ready_s=round(ready_s, 1),
        expert_cache_gb=cache_gb,
        decode_concurrency=chats,
        alone=alone_row,
        batch={
            **batch_row,
            "s": round(batch_s, 1),
            "tokens_per_chat": after,
            "errors": [r.get("error") for r in results],
            "decode_steps": (h.get("batch") or {}).get("decode_steps"),
            "rows": (h.get("batch") or {}).get("rows"),
        },
        batch_over_alone_mb_per_token=round(batch_row["expert_mb_per_token"] / alone_row["expert_mb_per_token"], 3)
        if alone_row["expert_mb_per_token"]
        else None,
        # Chat 0 inside the batch against the same request alone: every token and its log-probability.
        batch_equals_alone=len(ref) > 0 and same == ref,
        generated_tokens=sum(after) + len(ref),
        soak={
            "samples": len(samples),
            "window_s": [round(warm_at, 1), round(batch_end, 1)],
            "rss_gib_first_last_max": [round(rss[0], 3), round(rss[-1], 3), round(max(rss), 3)],
            "rss_peak_at_s": peak[0],
            "rss_last_over_first": round(rss[-1] / rss[0] - 1, 4),
            "rss_max_over_first": round(max(rss) / rss[0] - 1, 4),
            "rss_gib_after_window_max": round(max([x[1] for x in samples if x[0] > batch_end] or [0]), 3),
            "open_files_first_last_max": [warm[0][2], warm[-1][2], max(x[2] for x in warm)],
            "threads_first_last_max": [warm[0][3], warm[-1][3], max(x[3] for x in warm)],
            "rss_gib_over_time": [(x[0], round(x[1], 3)) for x in samples[:: max(1, len(samples) // 40)]],
        },
        in_flight_at_sigterm={
            "s": late.get(chats, {}).get("s"),
            "tokens": len(late.get(chats, {}).get("tokens", [])),
            "error": late.get(chats, {}).get("error"),
        },
        sigterm_exit_s=sigterm_exit_s,
        sigterm_rc=rc,
        prompt_cache_restart=restart,
    )


def predictor_recall(run) -> dict | None:
    """The read-ahead predictor's recall and precision in one run's engine counters: of the records
    that were not resident when routed, the share a prediction had brought in; of the records
    predicted and read, the share a route then used."""
    c = run.get("counters_total") or {}
    need = c.get("predicted_hits", 0) + c.get("exact_misses", 0)
    if not need or not c.get("predicted_reads"):
        return None
    return {
        "recall": round(c["predicted_hits"] / need, 3),
        "precision": round(min(1.0, c["predicted_hits"] / c["predicted_reads"]), 3),
    }


def phase_simulate(a, art, out, probes=3):
    """`simulate --profile machine` against the generate phase's runs: this machine's qualify
    profile (its SSD probe read from the artifact's expert store; `probes` probes a few minutes
    apart, one projection each: this disk's rate moves by 2x within the hour), the compute per
    layer given by --layer-ms (default: the default plan's run, `run_anchor`, not a run it is
    checked against), the route trace the generate phase's first run recorded and the
    predictor's recall and precision in that run's counters (the default plan's, not a compared
    row's); the predicted tok/s at each cache size beside the measured one, at the same read-ahead."""
    import statistics

    from hebrus_mlx.stream.predict import DEFAULT as DEFAULT_PREFETCH

    with open(os.path.join(a.dir, "generate-rows.json")) as f:
        measured = json.load(f)
    anchor = None
    if a.layer_ms is None:
        anchor = run_anchor(measured, admission.admit(art).family.num_hidden_layers)
        if anchor is None:
            emit(
                out,
                "simulate",
                error="no default-plan run to take the compute from (--cache-gb without 'default'); pass --layer-ms",
            )
            return
        a.layer_ms = anchor["layer_ms"]
    traced = next((r for r in measured if r.get("trace_dir")), None)
    recall = predictor_recall(traced) if traced is not None else None
    m = admission.admit(art)
    sizes = sorted({r["expert_cache_gb_flag"] for r in measured if r["expert_cache_gb_flag"] is not None})
    profile = os.path.join(a.dir, "profile.json")
    env = {**os.environ, "HEBRUS_PROFILE": profile}
    projections = []
    for i in range(probes):
        t = time.perf_counter()
        q = subprocess.run(
            _cli(a, ["qualify", "--out", profile, "--overwrite", "--store", m.file(m.experts)]),
            capture_output=True,
            text=True,
            env=env,
        )
        qualify_s = time.perf_counter() - t
        if q.returncode != 0:
            emit(out, "simulate", qualify_rc=q.returncode, stderr=q.stderr[-800:])
            return
        with open(profile) as f:
            pread = json.load(f)["io"]["pread"]
        path = os.path.join(a.dir, "simulate.json")
        args = ["simulate", "--profile", "machine", "--layer-ms", str(a.layer_ms), "--family", m.family.name]
        args += ["--expert-bits", str(a.expert_bits), "--trace", os.path.join(a.dir, "trace")]
        args += ["--cache-gb", ",".join(str(x) for x in sizes), "--policies", "clock", "--draft-depths", "0"]
        args += ["--json", path, "--overwrite", "--quiet"]
        if recall is not None:
            args += ["--predictor-recall", f"{DEFAULT_PREFETCH}={recall['recall']}/{recall['precision']}"]
        r = subprocess.run(_cli(a, args), capture_output=True, text=True, env=env)
        if r.returncode != 0:
            emit(out, "simulate", qualify_s=round(qualify_s, 1), rc=r.returncode, stderr=r.stderr[-800:])
            return
        with open(path) as f:
            res = json.load(f)
        projections.append(
            {
                "qualify_s": round(qualify_s, 1),
                "ssd_gbps": {k: round(pread[f"qd{k}_GBps"], 3) for k in (1, 8, 32)},
                "sources": [x for x in res["profile"].get("sources", []) if x.startswith("experts' share")],
                "rows": res["rows"],
            }
        )
        if i + 1 < probes:
            time.sleep(60)
    compare = []
    for run in measured:
        gb, mode = run["expert_cache_gb_flag"], run["prefetch"] or DEFAULT_PREFETCH
        if gb is None or not run.get("tok_s"):
            continue
        # Without the predictor's counters (a run that read nothing ahead) its runs are set beside
        # the projection without read-ahead, said in the row.
        preds, pred_mode = [], mode
        for want in (mode, "off"):
            for proj in projections:
                p = [x for x in proj["rows"] if x["cache_gb"] == gb and x["prefetch"] == want and x["draft_depth"] == 0]
                preds += p[:1]
            if preds:
                pred_mode = want
                break
        if not preds:
            continue
        errors = [p["tok_s"] / run["tok_s"] - 1 for p in preds]
        mid = preds[errors.index(statistics.median_low(errors))]
        compute_s = statistics.mean(run["decode_s_per_token"]) - run["exposed_wait_s_per_token"]
        compare.append(
            {
                "cache_gb": gb,
                "prefetch": mode,
                "predicted_with_prefetch": pred_mode,
                "measured_tok_s": run["tok_s"],
                "predicted_tok_s": [round(p["tok_s"], 4) for p in preds],
                "error": [round(e, 3) for e in errors],
                "error_median": round(statistics.median_low(errors), 3),
                "within_15pct": all(abs(e) <= 0.15 for e in errors),
                "predicted_hit_rate": round(mid["hit_rate"], 3),
                "measured_hit_rate": run["hit_rate"],
                "predicted_mb_per_token": round(mid["bytes_per_token"] / 1e6, 1),
                "measured_mb_per_token": run["read_mb_per_token"],
                "predicted_compute_ms": round(mid["compute_ms"], 1),
                "measured_compute_ms": round(compute_s * 1e3, 1),
                "predicted_exposed_ms": [round(p["exposed_ms"], 1) for p in preds],
                "measured_exposed_ms": round(run["exposed_wait_s_per_token"] * 1e3, 1),
            }
        )
    emit(
        out,
        "simulate",
        layer_ms=a.layer_ms,
        anchor=anchor,
        predictor=recall,
        probes=[{k: v for k, v in p.items() if k != "rows"} for p in projections],
        rows=compare,
    )


def run_anchor(measured, layers):
    """The compute per layer `simulate` takes: the default plan's run (the one that recorded the
    trace; its cache size is not one the projection is checked at), its mean decode time per token
    less its exposed read wait, over the model's layers (simulate has one compute term per layer;
    the embeddings, PLE and head are folded in). Measured on the full model in the same sitting as
    the runs it is checked against: a straight line through short stacks extrapolated to 48 layers
    missed this model's compute by 27% on one host and by under 5% on another."""
    import statistics

    run = next((r for r in measured if r["expert_cache_gb_flag"] is None and r["prefetch"] is None), None)
    if run is None or not run.get("decode_s_per_token"):
        return None
    compute_ms = (statistics.mean(run["decode_s_per_token"]) - run["exposed_wait_s_per_token"]) * 1e3
    return {
        "run": "default plan",
        "tokens": len(run["decode_s_per_token"]),
        "compute_ms_per_token": round(compute_ms, 1),
        "layers": layers,
        "layer_ms": round(compute_ms / layers, 2),
    }


def phase_engine(a, art, out, turns=40, batches_per_turn=8):
    """The engine's cold read rate against a raw O_DIRECT pread of the same kind of records at the
    same queue depth, on the artifact's own expert store, the two interleaved in short turns (this
    disk's rate moves by tens of percent within seconds, so runs a second apart compared noise):
    each turn `batches_per_turn` layer batches of top-k experts (records no earlier turn read
    in that layer until every expert was read), one turn raw - `_bench.raw_pread` by 8 C threads,
    batch by batch, no check - then one turn the engine - resolved batch by batch into its arena
    (8 reader threads, every record checked against its digest; one engine for the phase, as in a
    decode) - alternating which goes first. The rate of each arm over all its turns, their ratio,
    and the median of the per-turn-pair ratios."""
    import random
    import statistics

    import mlx.core as mx

    from hebrus_mlx import _bench
    from hebrus_mlx.artifact.expert_major import ExpertMajorReader
    from hebrus_mlx.stream.engine import StreamEngine
    from hebrus_mlx.stream.experts import StreamedExperts

    m = admission.admit(art)
    fam = m.family
    L, E, k = fam.num_hidden_layers, fam.num_experts, fam.num_experts_per_tok
    store = m.file(m.experts)
    reader = ExpertMajorReader(store, fam, m.experts.expert_codec)
    geom = reader.geometry
    reader.close()
    rng = random.Random(a.seed)
    unread = [[] for _ in range(L)]  # each layer's experts, read once each before any is read again
    cursor = [0]  # the layer the next turn's first batch reads

    def pick(layer):
        if len(unread[layer]) < k:
            unread[layer] = rng.sample(range(E), E)
        return sorted(unread[layer].pop() for _ in range(k))

    def turn_plan():
        batches = []
        for _ in range(batches_per_turn):
            batches.append((cursor[0], pick(cursor[0])))
            cursor[0] = (cursor[0] + 1) % L
        return batches

    turn_bytes = batches_per_turn * k * geom.record_bytes
    eng = StreamEngine(cache_bytes=64 << 20, threads=8, backend="pread")
    try:
        ex = StreamedExperts.from_artifact(m, rows=k, engine=eng)

        def raw(batches):
            offsets = [[geom.record_offset(geom.index(lay, e)) for e in es] for lay, es in batches]
            return _bench.raw_pread(store, offsets, geom.record_bytes, threads=8, direct=True)["elapsed_ns"] / 1e9

        def engine(batches):
            s = 0.0
            for lay, es in batches:
                t = time.perf_counter()
                got, lease = ex.resolve(lay, mx.array(es, dtype=mx.uint32))
                mx.eval(got)
                s += time.perf_counter() - t
                mx.eval(eng.release_after(mx.array(0.0), lease))
            return s

        load_before = os.getloadavg()[0]
        _drop_cache([store])
        seconds = {"raw": [], "engine": []}
        cpu = {"raw": 0.0, "engine": 0.0}
        for i in range(turns):
            for name in ("raw", "engine") if i % 2 == 0 else ("engine", "raw"):
                c = _cpu_s()
                seconds[name].append((raw if name == "raw" else engine)(turn_plan()))
                cpu[name] += _cpu_s() - c
        counters = eng.counters()
    finally:
        eng.close()
    gb = turns * turn_bytes / 1e9
    rate = {name: gb / sum(v) for name, v in seconds.items()}
    _drop_cache([store])
    split = resolve_split(m, [(lay % L, pick(lay % L)) for lay in range(4 * L)], k, geom.record_bytes)
    emit(
        out,
        "engine",
        record_bytes=geom.record_bytes,
        threads=8,
        turns=turns,
        mb_per_turn=round(turn_bytes / 1e6, 1),
        raw_gb_s=round(rate["raw"], 3),
        engine_gb_s=round(rate["engine"], 3),
        engine_over_raw=round(rate["engine"] / rate["raw"], 3),
        engine_over_raw_turn_median=round(
            statistics.median(r / e for r, e in zip(seconds["raw"], seconds["engine"])), 3
        ),
        raw_gb_s_range=[
            round(turn_bytes / 1e9 / max(seconds["raw"]), 2),
            round(turn_bytes / 1e9 / min(seconds["raw"]), 2),
        ],
        engine_hits=counters["hits"] + counters["joins"],  # 0: every resolve read its records
        cpu_s_per_gb={name: round(v / gb, 3) for name, v in cpu.items()},
        resolve_split=split,
        load_avg_before=load_before,
        load_avg_after=os.getloadavg()[0],
    )


def resolve_split(m, batches, rows, record_bytes):
    """Where a resolve's time goes: each batch resolved cold (reads), then the same records again
    (all hits: the op's own cost - the graph, the engine's bookkeeping, the wake-up - without a
    read); ms per resolve, median over the batches."""
    import statistics

    import mlx.core as mx

    from hebrus_mlx.stream.engine import StreamEngine
    from hebrus_mlx.stream.experts import StreamedExperts

    eng = StreamEngine(cache_bytes=64 << 20, threads=8, backend="pread")
    try:
        ex = StreamedExperts.from_artifact(m, rows=rows, engine=eng)
        cold, hit = [], []
        cpu0 = _cpu_s()
        for layer, experts in batches:
            ids = mx.array(experts, dtype=mx.uint32)
            for times in (cold, hit):
                t = time.perf_counter()
                got, lease = ex.resolve(layer, ids)
                mx.eval(got)
                times.append(time.perf_counter() - t)
                mx.eval(eng.release_after(mx.array(0.0), lease))
        cpu = _cpu_s() - cpu0
        c, h = statistics.median(cold), statistics.median(hit)
        n = statistics.median(len(e) for _, e in batches)
        gb = sum(len(e) for _, e in batches) * record_bytes / 1e9
        return {
            # every thread's CPU over the cold and hit resolves, per GB read: the readers' check
            # and widening, the op's graph and bookkeeping
            "cpu_s_per_gb": round(cpu / gb, 3),
            "resolves": len(batches),
            "cold_ms": round(c * 1e3, 2),
            "hit_ms": round(h * 1e3, 2),
            "cold_gb_s": round(n * record_bytes / c / 1e9, 3),
            "reads_only_gb_s": round(n * record_bytes / max(c - h, 1e-9) / 1e9, 3),
        }
    finally:
        eng.close()


def _cpu_s():
    """This process's user + system CPU seconds, every thread's."""
    return sum(os.times()[:2])


def _drop_cache(paths):
    """Evict the files' pages from the page cache (clean pages only: they were written and synced
    by convert), so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_read(paths, chunk=16 << 20):
    """Bytes/s of a plain sequential read of every file, front to back (no hashing)."""
    n, t = 0, time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while b := os.read(fd, chunk):
                n += len(b)
        finally:
            os.close(fd)
    return n, time.perf_counter() - t


def phase_verify(art, out):
    """`verify` (default: one SHA-256 pass, a reader thread checking XXH3-128 two reads ahead;
    the same read and checked inline; then `--deep`) against a raw sequential read of the same store files, side by side: page cache
    dropped before each, raw first (the same bytes in the same order, no hashing). Each verify
    includes admission (its time alone, with the store files unread, is `admit_s`)."""
    from hebrus_mlx import verify as V

    m = admission.admit(art)
    paths = [m.file(s) for s in m.stores]
    size = sum(s.size for s in m.stores)
    load_before = os.getloadavg()[0]
    t = time.perf_counter()
    admission.admit(art)
    admit_s = time.perf_counter() - t
    _drop_cache(paths)
    n, raw_s = _raw_read(paths)
    row = dict(bytes=size, admit_s=round(admit_s, 1), raw_s=round(raw_s, 1), raw_read_gb_s=round(n / raw_s / 1e9, 3))
    ahead = V.READ_AHEAD
    for name, deep, depth in (("default", False, ahead), ("inline", False, 0), ("deep", True, ahead)):
        V.READ_AHEAD = depth
        _drop_cache(paths)
        c0 = os.times()
        t = time.perf_counter()
        V.verify(art, deep=deep)
        wall = time.perf_counter() - t
        c1 = os.times()
        cpu = c1.user + c1.system - c0.user - c0.system
        row.update(
            {
                f"{name}_wall_s": round(wall, 1),
                f"{name}_cpu_s_per_gb": round(cpu / (size / 1e9), 2),
                f"{name}_ratio": round((size / wall) / (n / raw_s), 3),
                f"{name}_ratio_less_admit": round((size / (wall - admit_s)) / (n / raw_s), 3),
            }
        )
    V.READ_AHEAD = ahead
    _drop_cache(paths)
    emit(out, "verify", **row, load_avg_before=load_before, load_avg_after=os.getloadavg()[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="work directory (source config, artifact); emptied by 'clean'")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {','.join(PHASES)}")
    p.add_argument("--tokens", type=int, default=4, help="tokens per generate run (~5 s each here)")
    p.add_argument("--restart-tokens", type=int, default=8, help="tokens each restart leg decodes")
    p.add_argument(
        "--server-tokens", type=int, default=80, help="tokens per chat in the batch of 4 (the soak: 4x this + 32)"
    )
    p.add_argument("--ple-base", type=int, default=200_000, help="ngram_vocab_size_base (real: 20,000,000)")
    p.add_argument("--ple-dtype", default=None, help="PLE codec passed to convert (default bf16)")
    p.add_argument("--expert-bits", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=48, help="smoke runs only: fewer layers than the real 48")
    p.add_argument("--experts", type=int, default=512, help="smoke runs only: fewer experts than the real 512")
    p.add_argument("--json", default=None, help="write every phase's row here")
    p.add_argument(
        "--kill-mode",
        choices=("auto", "overwrite", "rebuild"),
        default="auto",
        help="kill: convert over the artifact (needs it twice on disk) or rebuild it (auto: what fits)",
    )
    p.add_argument("--cache-gb", default="default,2,4,8", help="expert caches for generate ('default': the plan)")
    p.add_argument(
        "--layer-ms",
        type=float,
        default=None,
        help="simulate: compute per layer at the run's widths (ms; default: the default-plan run's)",
    )
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_cli", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_restart", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-name", default="artifact", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._worker or a._cli or a._restart:
        # The config the parent wrote (not rebuilt: that imports transformers and torch, whose
        # memory would count in the RSS the worker reports).
        with open(os.path.join(a.dir, "source", "config.json")) as f:
            S.register_family(json.load(f))
        if a._cli:
            from hebrus_mlx.cli import main as cli_main

            return cli_main(json.loads(a._cli))
        if a._restart:
            restart_worker(*json.loads(a._restart))
            return 0
        worker(*json.loads(a._worker))
        return 0
    phases = a.phases.split(",")
    bad = sorted(set(phases) - set(PHASES))
    if bad:
        p.error(f"--phases: unknown {bad}; known {list(PHASES)}")
    os.makedirs(a.dir, exist_ok=True)
    out = []
    src_path, config = source_dir(a.dir, config_of(a), a.seed)
    art = os.path.join(a.dir, a.out_name)
    if "convert" in phases:
        phase_convert(a, src_path, config, art, out)
    if "kill" in phases:
        phase_kill(a, art, out)
    if "admit" in phases:
        phase_admit(art, out)
    if "verify" in phases:
        phase_verify(art, out)
    if "engine" in phases:
        phase_engine(a, art, out)
    if "generate" in phases or "load" in phases:
        sizes = [None if c == "default" else float(c) for c in a.cache_gb.split(",")]
        if "generate" not in phases:
            a.tokens, sizes = 1, sizes[:1]
        # The first run records its routes: the trace `simulate` replays (the routes of every run
        # are the same when the tokens are).
        trace = os.path.join(a.dir, "trace") if "generate" in phases else None
        if trace is not None and os.path.exists(trace):
            shutil.rmtree(trace)
        runs = [run_worker(a, art, gb, None, out, trace if i == 0 else None) for i, gb in enumerate(sizes)]
        if "generate" in phases:
            runs.append(run_worker(a, art, sizes[-1], "off", out))
            with open(os.path.join(a.dir, "generate-rows.json"), "w") as f:
                json.dump(runs, f)
            same = {(tuple(r["tokens"]), r["final_logprobs_sha256"]) for r in runs}
            emit(out, "exactness", runs=len(runs), identical=len(same) == 1)
    if "restart" in phases:
        phase_restart(a, art, out)
    if "server" in phases:
        phase_server(a, art, out)
    if "simulate" in phases:
        phase_simulate(a, art, out)
    if "clean" in phases:
        # Only what this script made (the source, tokenizer, artifact and its temporaries).
        for name in os.listdir(a.dir):
            full = os.path.join(a.dir, name)
            made = (
                "source",
                "tokenizer",
                "artifact",
                "artifact-killed",
                "trace",
                "profile.json",
                "simulate.json",
                "generate-rows.json",
                "server-prompt-cache",
                "server-samples.json",
            )
            if name in made or name.startswith(".artifact"):
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full)
                else:
                    os.remove(full)
        emit(out, "clean", left=os.listdir(a.dir))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    from hebrus_mlx.errors import HebrusError

    try:
        sys.exit(main())
    except HebrusError as e:  # e.g. not enough free disk: one line, not a traceback
        print(f"full_scale: error: {e}", file=sys.stderr)
        sys.exit(2)
