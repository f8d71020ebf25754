"""Full-scale run of the real Qwen3.8-Flash-Next geometry on this machine: a generated checkpoint
(hebrus_mlx/testing/synthetic_source.py: 48 layers, 512 experts top-10 at their real record size,
the PLE table at its real row width with fewer rows) through `convert`, `admit`, `verify`, `load`,
`generate` at several expert-cache sizes, the server, and `simulate`.

    nice -n 10 python benchmarks/full_scale.py --dir /work/fullscale --phases convert,admit,verify,load,generate

Each phase prints one JSON line of what it measured; --json collects them. Random weights: no
quality can be read from the tokens; routing is near uniform (the hardest regime for an expert
cache); the CPU backend is not a Mac's speed."""

import argparse
import json
import os
import resource
import shutil
import sys
import time

from hebrus_mlx import admission, hub
from hebrus_mlx.convert import artifact_bytes, convert, expert_spec, plan
from hebrus_mlx.testing import synthetic_source as S

PHASES = ("convert", "admit", "verify", "load", "generate", "server", "simulate", "clean")
# The shipped demo's Qwen-style chat template (admission requires one).
TEMPLATE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hebrus_mlx", "demo", "model", "chat_template.jinja"
)
PROMPT_IDS = [9707, 11, 1879, 0, 576, 374, 264]


def io_counters():
    """(read_bytes, write_bytes) this process caused at the block layer (/proc/self/io)."""
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


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


def source_dir(root, ple_base, seed):
    path = os.path.join(root, "source")
    config = S.real_config(ple_base)
    S.write(path, config, seed, files=[qwen_tokenizer(root), TEMPLATE])
    S.register_family(config)
    return path, config


def phase_convert(a, src_path, config, art, out):
    profile, args, _, fam = plan(config, 4, 64, None, a.expert_bits, 64, a.ple_dtype)
    need = artifact_bytes(args, fam, profile, expert_spec(config, profile))
    free = shutil.disk_usage(a.dir).free
    emit(out, "disk", need_gb=round(need / 1e9, 2), free_gb=round(free / 1e9, 2), profile=profile)
    hub.check_free(need, art, f"converting into {art}", field="--dir")
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
    r0, _ = io_counters()
    t = time.perf_counter()
    m = admission.admit(art)
    wall = time.perf_counter() - t
    r1, _ = io_counters()
    emit(out, "admit", wall_s=round(wall, 3), read_bytes=r1 - r0, family=m.family.name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="work directory (source config, artifact); emptied by 'clean'")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {','.join(PHASES)}")
    p.add_argument("--tokens", type=int, default=4, help="tokens per generate run (~3.5 s each here)")
    p.add_argument("--ple-base", type=int, default=200_000, help="ngram_vocab_size_base (real: 20,000,000)")
    p.add_argument("--ple-dtype", default=None, help="PLE codec passed to convert (default bf16)")
    p.add_argument("--expert-bits", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every phase's row here")
    a = p.parse_args(argv)
    phases = a.phases.split(",")
    bad = sorted(set(phases) - set(PHASES))
    if bad:
        p.error(f"--phases: unknown {bad}; known {list(PHASES)}")
    os.makedirs(a.dir, exist_ok=True)
    out = []
    src_path, config = source_dir(a.dir, a.ple_base, a.seed)
    art = os.path.join(a.dir, "artifact")
    if "convert" in phases:
        phase_convert(a, src_path, config, art, out)
    if "admit" in phases:
        phase_admit(art, out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
