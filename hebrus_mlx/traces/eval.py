"""Route-prediction controls at equal candidate budgets, and the expert-cache simulator.

Every control ranks the experts of each (token, layer) before that layer's router runs; at a
budget of B candidates per layer it is scored against the native top-k:

- recall@B = |first B candidates ∩ native top-k| / k;  precision@B = the same / B;
- exact top-k = the first k candidates are the native top-k set.

Controls (histories reset at each sequence start, where every control falls back to frequency):

- random: a uniformly random ranking per row (seeded);
- frequency: experts by selection count per layer, fit on the export's train split (a trace dir
  has no split: counts accumulate online over the tokens already seen);
- token_frequency: experts by selection count per (fed token ID, layer), then frequency; fit on
  train like frequency (online for a trace dir). The token ID is known before layer 0;
- lru: experts by how recently the layer selected them in this sequence, then frequency;
- prev_token: the previous token's same-layer top-k in rank order, then frequency;
- router_reuse_1 / router_reuse_2: layer l's native router applied to layer l-1's / l-2's router
  input (no training; needs --model, routes recomputed by replay); undefined for l < 1 / 2;
- hc_mix_reuse: layer l's own MLP hyper-connection mix applied to the streams entering layer l
  (i.e. before its attention/GDN), then layer l's router (needs --model).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .cachesim import POLICIES, sweep
from .schema import TraceError

HISTORY = ("random", "frequency", "token_frequency", "lru", "prev_token")
REUSE = ("router_reuse_1", "router_reuse_2", "hc_mix_reuse")


def load_source(source, split: str = "test"):
    """(identity, eval sequences [(token_ids, topk_ids)], train (token_ids, topk_ids) or None, description)."""
    from .export import read_export
    from .shards import read_trace

    p = Path(source)
    if (p / "manifest.json").is_file():
        ex = read_export(p)
        if split not in ex["splits"]:
            raise TraceError("split", f"the export has no {split!r} rows; it has {', '.join(ex['splits'])}")
        d = ex["splits"][split]
        seqs = []
        for s in np.unique(d["sequence_ids"]):
            sel = d["sequence_ids"] == s
            seqs.append((d["token_ids"][sel], d["topk_ids"][sel].astype(np.int64)))
        train = ex["splits"].get("train")
        fit = (
            (train["token_ids"], train["topk_ids"].astype(np.int64)) if train is not None and split != "train" else None
        )
        return ex["identity"], seqs, fit, f"export {p} split {split}"
    ts = read_trace(p)
    seqs = [(s.token_ids, s.topk_ids.astype(np.int64)) for s in ts.sequences]
    return ts.identity, seqs, None, f"trace {p} (all sequences; frequency fit online)"


def _counts(topk, L, E):
    c = np.zeros((L, E), np.int64)
    for layer in range(L):
        c[layer] = np.bincount(topk[:, layer].reshape(-1), minlength=E)
    return c


def history_rankings(seqs, L, E, bmax, train=None, seed=0) -> dict:
    """{control: [N, L, bmax]} for the history controls over all sequences (in order)."""
    rng = np.random.default_rng(seed)
    static = _counts(train[1], L, E) if train is not None else None
    online = np.zeros((L, E), np.int64)
    per_token = {}
    if train is not None:
        for tok in np.unique(train[0]):
            per_token[int(tok)] = _counts(train[1][train[0] == tok], L, E)
    out = {name: [] for name in HISTORY}
    eidx = np.arange(E)
    for token_ids, topk in seqs:
        n = len(topk)
        tokf_r = np.empty((n, L, bmax), np.int64)
        out["random"].append(np.argsort(rng.random((n, L, E)), axis=-1)[..., :bmax])
        last = np.full((L, E), -1, np.int64)
        freq_r, lru_r, prev_r = (np.empty((n, L, bmax), np.int64) for _ in range(3))
        for t in range(n):
            counts = static if static is not None else online
            forder = np.argsort(-counts, axis=-1, kind="stable")  # [L, E], ties by expert ID
            frank = np.empty_like(forder)
            np.put_along_axis(frank, forder, eidx[None].repeat(L, 0), axis=-1)
            freq_r[t] = forder[:, :bmax]
            tc = per_token.get(int(token_ids[t])) if token_ids is not None else None
            if tc is None:
                tokf_r[t] = forder[:, :bmax]
            else:
                tokf_r[t] = np.argsort(-(tc * (E + 1) + (E - frank)), axis=-1, kind="stable")[:, :bmax]
            # LRU: most recent first, never-seen experts after them in frequency order.
            key = last * (E + 1) + (E - frank)
            lru_r[t] = np.argsort(-key, axis=-1, kind="stable")[:, :bmax]
            if t == 0:
                prev_r[t] = forder[:, :bmax]
            else:
                prev = topk[t - 1]  # [L, k] rank order
                boost = np.full((L, E), 0, np.int64)
                k = prev.shape[1]
                np.put_along_axis(boost, prev, (2 * E * (k - np.arange(k)))[None].repeat(L, 0), axis=-1)
                prev_r[t] = np.argsort(-(boost + (E - frank)), axis=-1, kind="stable")[:, :bmax]
            np.put_along_axis(last, topk[t], t, axis=-1)
            if static is None:
                where = (np.arange(L)[:, None].repeat(topk.shape[2], 1), topk[t])
                np.add.at(online, where, 1)
                if token_ids is not None:
                    np.add.at(per_token.setdefault(int(token_ids[t]), np.zeros((L, E), np.int64)), where, 1)
        out["frequency"].append(freq_r)
        out["token_frequency"].append(tokf_r)
        out["lru"].append(lru_r)
        out["prev_token"].append(prev_r)
    return {k: np.concatenate(v) for k, v in out.items()}


def reuse_rankings(model, seqs, bmax, chunk) -> tuple:
    """Router-reuse rankings recomputed by replay with the model; also the replay's own top-k."""
    import mlx.core as mx

    from .replay import recompute

    layers = model.model.layers
    L = len(layers)
    out = {name: [] for name in REUSE}
    replayed = []
    for token_ids, _ in seqs:
        got = []

        def on_chunk(start, cap):
            x = cap.router_inputs
            arrs = []
            for d in (1, 2):
                r = [mx.argsort(-layers[l].mlp.gate(x[l - d]), axis=-1)[0, :, :bmax] for l in range(d, L)]
                arrs.append(mx.stack(r, axis=1))
            mixed = [layers[l].mlp_hyper_connection.mix(cap.hidden[l - 1])[0] for l in range(1, L)]
            r = [mx.argsort(-layers[l].mlp.gate(mixed[l - 1]), axis=-1)[0, :, :bmax] for l in range(1, L)]
            arrs.append(mx.stack(r, axis=1))
            got.append(arrs)
            return arrs

        on_chunk.wants_hidden = True
        rep = recompute(model, token_ids, chunk, on_chunk)
        replayed.append(rep.topk_ids)
        n = len(token_ids)
        for i, (name, d) in enumerate(zip(REUSE, (1, 2, 1))):
            full = np.full((n, L, bmax), -1, np.int64)
            full[:, d:] = np.concatenate([np.array(a[i]) for a in got])
            out[name].append(full)
    return {k: np.concatenate(v) for k, v in out.items()}, np.concatenate(replayed)


def score(ranking, truth, budgets) -> dict:
    """ranking [N, L, bmax] (-1 = undefined row), truth [N, L, k] -> per-layer metrics."""
    k = truth.shape[-1]
    defined = ranking[..., 0] >= 0  # [N, L]
    hit = (ranking[..., :, None] == truth[..., None, :]).any(-1)
    cum = np.cumsum(hit, axis=-1)
    cnt = defined.sum(0)

    def per_layer(v):
        s = np.where(defined, v, 0).sum(0)
        return [float(a / c) if c else None for a, c in zip(s, cnt)]

    def mean(v):
        return float(np.where(defined, v, 0).sum() / defined.sum()) if defined.any() else None

    res = {
        "rows": int(defined.sum()),
        "recall": {},
        "precision": {},
        "recall_per_layer": {},
        "exact_topk": mean(cum[..., k - 1] == k),
        "exact_topk_per_layer": per_layer(cum[..., k - 1] == k),
    }
    for b in budgets:
        res["recall"][b] = mean(cum[..., b - 1] / k)
        res["precision"][b] = mean(cum[..., b - 1] / b)
        res["recall_per_layer"][b] = per_layer(cum[..., b - 1] / k)
    return res


def _record_bytes(model_path) -> int | None:
    from ..artifact import constants as C
    from ..artifact import expert_major as em
    from ..artifact import untrusted

    mp = Path(model_path) / "manifest.json"
    if not mp.is_file():
        return None
    m = untrusted.read_json(str(model_path), "manifest.json")  # bounded, strict (issue 22)
    store = next(s for s in m["stores"] if s["role"] == "experts")
    # A per-layer store (codec per layer): the mean record, what a uniformly routed read costs.
    g = em.Geometry(C.family(m["family"]), store.get("layer_codecs") or store["codec"])
    return int(sum(g.layer_record_bytes) // len(g.layer_record_bytes))


def run_eval(
    source,
    *,
    model=None,
    budgets=None,
    split="test",
    chunk=512,
    cache_sim=False,
    cache_sizes=(5, 10, 20, 30, 50),
    seed=0,
    json_path=None,
    plot_path=None,
    overwrite=False,
) -> dict:
    ident, seqs, train, desc = load_source(source, split)
    L, E, k = ident.num_layers, ident.num_experts, ident.top_k
    budgets = sorted(set(budgets or [k, 2 * k, 4 * k]))
    if max(budgets) > E:
        raise TraceError("budgets", f"at most num_experts={E} candidates per layer, got {max(budgets)}")
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise TraceError("plot", "needs matplotlib (pip install matplotlib)") from None
    bmax = max(max(budgets), k)
    truth = np.concatenate([t for _, t in seqs])
    rankings = history_rankings(seqs, L, E, bmax, train, seed)
    record_bytes, parity = None, None
    if model is not None:
        from ..loader import load, resolve_model_path
        from ..traces.schema import model_identity

        mdl, tok = load(model)
        diff = ident.mismatch(model_identity(mdl, tok))
        if diff is not None:
            raise TraceError(diff.split(":", 1)[0], f"the model is not the one the routes were recorded with ({diff})")
        reuse, replayed = reuse_rankings(mdl, seqs, bmax, chunk)
        rankings.update(reuse)
        parity = int((replayed != truth).any(-1).sum())
        record_bytes = _record_bytes(resolve_model_path(model))
    controls = {name: score(r, truth, budgets) for name, r in rankings.items()}
    report = {
        "source": desc,
        "identity": ident.to_dict(),
        "tokens": int(len(truth)),
        "sequences": len(seqs),
        "budgets": budgets,
        "controls": controls,
        "replay_mismatched_rows": parity,
        "record_bytes": record_bytes,
    }
    if cache_sim:
        report["cache_sim"] = sweep(truth, E, cache_sizes, record_bytes or 1)
        report["cache_sim_unit"] = "bytes" if record_bytes else "records"
    report["text"] = render(report)
    if json_path:
        from .export import write_report_json

        write_report_json(
            json_path,
            {k: v for k, v in report.items() if k != "text"},
            field="--json",
            overwrite=overwrite,
            schema="hebrus-mlx.traces-eval",
        )
    if plot_path:
        plot(report, plot_path, overwrite=overwrite)
    return report


def render(r) -> str:
    lines = [
        f"{r['source']}: {r['tokens']} tokens, {r['sequences']} sequences; layers "
        f"{r['identity']['num_layers']}, experts {r['identity']['num_experts']}, top-{r['identity']['top_k']}"
    ]
    if r["replay_mismatched_rows"] is not None:
        lines.append(
            f"replay recomputation vs recorded routes: {r['replay_mismatched_rows']} mismatched (token, layer) rows"
        )
    b = r["budgets"]
    lines.append(
        "control          "
        + "".join(f"  recall@{x:<3d}" for x in b)
        + "".join(f"  prec@{x:<3d}" for x in b)
        + "  exact-top-k"
    )
    fmt = lambda v: f"{v:9.3f}" if v is not None else "      n/a"  # noqa: E731
    for name, c in r["controls"].items():
        lines.append(
            f"{name:16s} "
            + "".join(f"  {fmt(c['recall'][x])}  " for x in b)
            + "".join(f" {fmt(c['precision'][x])}  " for x in b)
            + f" {fmt(c['exact_topk'])}"
        )
    k = r["identity"]["top_k"]
    lines.append(f"recall@{k} per layer:")
    for name, c in r["controls"].items():
        lines.append(
            f"  {name:16s} " + " ".join("  -  " if v is None else f"{v:.3f}" for v in c["recall_per_layer"][k])
        )
    if "cache_sim" in r:
        unit = r["cache_sim_unit"]
        lines.append(f"cache simulator (demand paging; {unit} per token = misses x record size / tokens):")
        sizes = sorted({row["percent"] for row in r["cache_sim"]})
        lines.append("policy  " + "".join(f"  {s:>3d}% hit  {unit}/tok" for s in sizes))
        for pol in POLICIES:
            rows = {row["percent"]: row for row in r["cache_sim"] if row["policy"] == pol}
            lines.append(
                f"{pol:7s} "
                + "".join(f"  {rows[s]['hit_rate']:8.3f} {rows[s]['bytes_per_token']:10.0f}" for s in sizes)
            )
    return "\n".join(lines)


def plot(r, path, overwrite=False) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..output_files import PNG_METADATA, write_bytes_atomic

    k = r["identity"]["top_k"]
    n = 3 if "cache_sim" in r else 2
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.2), dpi=100)
    for name, c in r["controls"].items():
        ys = c["recall_per_layer"][k]
        xs = [i for i, v in enumerate(ys) if v is not None]
        axes[0].plot(xs, [ys[i] for i in xs], "o-", ms=3, label=name)
        axes[1].plot(r["budgets"], [c["recall"][b] for b in r["budgets"]], "o-", ms=3, label=name)
    axes[0].set(xlabel="layer", ylabel=f"recall@{k}", title=f"recall at budget k={k} per layer")
    axes[1].set(xlabel="candidates per layer", ylabel="recall (mean over layers)", title="recall vs budget")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    if n == 3:
        for pol in POLICIES:
            rows = sorted((row for row in r["cache_sim"] if row["policy"] == pol), key=lambda x: x["percent"])
            axes[2].plot([x["percent"] for x in rows], [x["hit_rate"] for x in rows], "o-", ms=3, label=pol)
        axes[2].set(xlabel="cache size (% of expert store)", ylabel="hit rate", title="expert cache, demand paging")
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=7)
    fig.suptitle(f"{r['source']}: {r['tokens']} tokens", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata=PNG_METADATA)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue(), field="--plot", overwrite=overwrite)
