"""Bench outputs: JSON (published atomically), a markdown table, and a PNG (per-configuration bars
with spread, and a per-token timeline of compute vs exposed I/O from the engine trace)."""

from __future__ import annotations

from ..output_files import PNG_METADATA, json_bytes, write_bytes_atomic, write_text_atomic  # noqa: F401 (public here too)

COLUMNS = [  # (metric, header, format, scale)
    ("decode_tok_s", "decode tok/s", "{:.2f}", 1),
    ("prefill_tok_s", "prefill tok/s", "{:.1f}", 1),
    ("ttft_s", "TTFT ms", "{:.1f}", 1e3),
    ("peak_memory_gb", "peak MLX GB", "{:.3f}", 1),
    ("expert_bytes_per_token", "expert KiB/token", "{:.1f}", 1 / 1024),
    ("hit_rate", "hit rate", "{:.1%}", 1),
    ("exposed_wait_ms_per_token", "exposed wait ms/token", "{:.2f}", 1),
    ("ple_bytes_per_token", "PLE KiB/token", "{:.1f}", 1 / 1024),
    ("ple_exposed_wait_ms_per_token", "PLE wait ms/token", "{:.2f}", 1),
    ("hidden_fraction", "I/O hidden", "{:.0%}", 1),
    ("timely_recall", "timely recall", "{:.0%}", 1),
    ("acceptance", "spec. acceptance", "{:.0%}", 1),
    ("tokens_per_step", "tokens/verify", "{:.2f}", 1),
]


def write_json(path, obj, *, field: str = "--out", overwrite: bool = False, schema: str = "hebrus-mlx.report") -> None:
    write_bytes_atomic(path, json_bytes(obj, schema), field=field, overwrite=overwrite)


def _cell(stat, fmt, scale) -> str:
    if stat is None:
        return "n/a"
    med = fmt.format(stat["median"] * scale)
    if stat["n"] > 1 and stat["spread"] > 0:
        return f"{med} ±{stat['spread']:.0%}"
    return med


def markdown(result: dict) -> str:
    """One row per (configuration, prompt, n): medians with the half-range spread."""
    m = result["machine"]
    lines = [
        f"**hebrus-mlx bench** `{result['model']}` ({result['artifact_digest'][:23]}), {m['chip']}, "
        f"{m['memory_gb']:.0f} GiB, {m['os']}, MLX {m['mlx_version']} ({m['backend']}); "
        f"{result['repeats']} repeats interleaved ({result['order_note']}), {result['warmup']} warm-up; "
        f"greedy tokens identical across configurations: {result['tokens_identical']}",
        "",
        "| configuration | prompt | n | " + " | ".join(h for _, h, _, _ in COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for row in result["summary"]:
        cells = [_cell(row["metrics"].get(k), f, s) for k, _, f, s in COLUMNS]
        lines.append(f"| {row['config']} | {row['prompt_tokens']} | {row['n']} | " + " | ".join(cells) + " |")
    probe = m.get("ssd_probe")
    if probe:
        qd = ", ".join(f"QD{k} {v:.2f}" for k, v in probe["gbps_by_qd"].items())
        lines += [
            "",
            f"SSD probe ({probe['record_bytes']} B random reads, "
            f"{'O_DIRECT' if probe['direct'] else 'buffered'}): {qd} GB/s; "
            + (
                f"SHA-256 {probe['sha256_gbps_per_core']:.2f} GB/s per core"
                if probe.get("sha256_gbps_per_core")
                else "SHA-256 not measured"
            )
            + (f"; from {probe['source']}" if probe.get("source") else ""),
        ]
    return "\n".join(lines) + "\n"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(result: dict, path, *, overwrite: bool = False) -> None:
    """Left: decode tok/s per configuration (median bar, min-max whisker) for each (prompt, n).
    Right: per-token wall time split into exposed I/O wait and the rest (compute), from the
    traced run of each streamed configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    timelines = [t for t in result.get("timelines", []) if t["rows"]]
    fig, axes = plt.subplots(1, 2 if timelines else 1, figsize=(13 if timelines else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    labels, med, lo, hi = [], [], [], []
    for r in rows:
        s = r["metrics"].get("decode_tok_s")
        if s is None:
            continue
        labels.append(f"{r['config']}\np{r['prompt_tokens']} n{r['n']}")
        med.append(s["median"])
        lo.append(s["median"] - s["min"])
        hi.append(s["max"] - s["median"])
    ax.bar(range(len(med)), med, yerr=[lo, hi], capsize=4, color="#4c72b0")
    ax.set_xticks(range(len(med)))
    ax.set_xticklabels(labels, fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("decode tok/s (median, min-max)")
    ax.set_title(f"{result['model']}: {result['repeats']} interleaved repeats")
    if timelines:
        ax = axes[0][1]
        for t in timelines:
            wall = [r["wall_ms"] for r in t["rows"]]
            wait = [r["io_wait_ms"] for r in t["rows"]]
            x = range(len(wall))
            (line,) = ax.plot(x, wall, lw=1, label=f"{t['config']}: token wall time")
            ax.fill_between(x, 0, wait, alpha=0.35, color=line.get_color(), label=f"{t['config']}: exposed I/O wait")
        ax.set_xlabel("decode token (after the first)")
        ax.set_ylabel("ms")
        ax.set_title("per-token compute vs exposed I/O (engine trace)")
        ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue(), overwrite=overwrite)
