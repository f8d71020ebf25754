"""Worked example: train a small route predictor from a `hebrus-mlx traces export` only.

    python tools/train_route_predictor.py OUT [--controls eval_test.json] [--json result.json]

Needs numpy, safetensors and torch (not hebrus-mlx). Two predictors, each a shared low-rank
trunk with a layer embedding and per-layer expert heads, trained with multi-label BCE on the
train split, epoch chosen on validation, scored on test at the same candidate budgets as
`hebrus-mlx traces eval` (recall@B, precision@B, exact top-k):

- `history` (token-start deadline, before layer 0): the fed token's ID embedding and the previous
  token's routes in every layer (multi-hot). Same deadline as the frequency/LRU/prev_token controls.
- `feature` (one layer ahead): layer l-1's router input (exported with --trace-features 1), the
  fed token's ID embedding and the previous token's layer-l route, predicting layer l for l >= 1. Same deadline as router_reuse_1;
  hc_mix_reuse runs later (at layer l's start) and is reported beside it.

--controls takes `traces eval OUT --split test --model M --json F`; the script then says, per
budget, whether the predictor beats the strongest control (no claim is made without that file).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_route_export import load_export  # noqa: E402


def prev_routes(split):
    """[N, L, k] routes of the previous token in the same sequence; -1 at a sequence start."""
    ids, seq = split["topk_ids"].astype(np.int64), split["sequence_ids"]
    prev = np.full_like(ids, -1)
    same = np.r_[False, seq[1:] == seq[:-1]]
    prev[1:][same[1:]] = ids[:-1][same[1:]]
    return prev


def multi_hot(idx, E):
    """idx [..., k] with -1 = none -> float [..., E]."""
    out = torch.zeros(*idx.shape[:-1], E + 1)
    out.scatter_(-1, torch.as_tensor(np.where(idx < 0, E, idx)), 1.0)
    return out[..., :E]


class Predictor(nn.Module):
    def __init__(self, d_in, L, E, rank=64, vocab=None):
        super().__init__()
        self.tok = nn.Embedding(vocab, rank) if vocab else None
        self.down = nn.Linear(d_in, rank)
        self.layer = nn.Embedding(L, rank)
        self.mid = nn.Linear(rank, rank)
        self.heads = nn.Parameter(torch.randn(L, rank, E) * rank**-0.5)
        self.bias = nn.Parameter(torch.zeros(L, E))

    def forward(self, x, layer, tok=None):
        h = self.down(x) + self.layer(layer)
        if self.tok is not None:
            h = h + self.tok(tok)
        h = torch.nn.functional.gelu(self.mid(torch.nn.functional.gelu(h)))
        return torch.einsum("nr,nre->ne", h, self.heads[layer]) + self.bias[layer]


def examples(split, mode, E, layers):
    """Flattened (x, layer, tok, target top-k) over rows x layers."""
    ids = split["topk_ids"].astype(np.int64)
    N, L, k = ids.shape
    prev = prev_routes(split)
    if mode == "history":
        x = multi_hot(torch.as_tensor(prev), E).reshape(N, L * E)  # every layer of the previous token
        xs = x[:, None].expand(N, len(layers), L * E)
    else:
        if "router_inputs" not in split or len(split["feature_rows"]) != N:
            sys.exit("feature mode needs router inputs for every row (capture with --trace-features 1)")
        feats = torch.zeros(N, L, split["router_inputs"].shape[-1])
        feats[torch.as_tensor(split["feature_rows"]).long()] = torch.as_tensor(split["router_inputs"]).float()
        ph = multi_hot(torch.as_tensor(prev), E)  # [N, L, E]
        xs = torch.cat([feats[:, [l - 1 for l in layers]], ph[:, layers]], dim=-1)
    lay = torch.as_tensor(layers).repeat(N)
    tok = torch.as_tensor(split["token_ids"].astype(np.int64)).repeat_interleave(len(layers))
    tgt = torch.as_tensor(ids[:, layers]).reshape(-1, k)
    return xs.reshape(N * len(layers), -1), lay, tok, tgt


def metrics(scores, tgt, budgets, layer, L):
    k = tgt.shape[1]
    rank = scores.argsort(dim=-1, descending=True)[:, : max(budgets + [k])]
    hit = (rank[:, :, None] == tgt[:, None, :]).any(-1).cumsum(-1).float()
    out = {"recall": {}, "precision": {}, "exact_topk": float((hit[:, k - 1] == k).float().mean())}
    for b in budgets:
        out["recall"][b] = float((hit[:, b - 1] / k).mean())
        out["precision"][b] = float((hit[:, b - 1] / b).mean())
    out["recall_per_layer"] = {l: float((hit[layer == l, k - 1] / k).mean()) for l in range(L) if (layer == l).any()}
    return out


def train(mode, data, E, L, budgets, epochs, seed, vocab):
    torch.manual_seed(seed)
    layers = list(range(L)) if mode == "history" else list(range(1, L))
    tr, va, te = (examples(data[s], mode, E, layers) for s in ("train", "validation", "test"))
    model = Predictor(tr[0].shape[1], L, E, vocab=vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    n = len(tr[0])
    best, best_state, log = -1.0, None, []
    for ep in range(epochs):
        model.train()
        perm = torch.randperm(n)
        for i in range(0, n, 512):
            j = perm[i : i + 512]
            logits = model(tr[0][j], tr[1][j], tr[2][j])
            y = torch.zeros_like(logits).scatter_(1, tr[3][j], 1.0)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            m = metrics(model(*va[:3]), va[3], budgets, va[1], L)
        log.append({"epoch": ep + 1, "loss": loss.item(), "val_recall@k": m["recall"][budgets[0]]})
        print(
            f"  {mode} epoch {ep + 1}: loss {loss.item():.4f} validation recall@{budgets[0]} {m['recall'][budgets[0]]:.3f}"
        )
        if m["recall"][budgets[0]] > best:
            best, best_state = m["recall"][budgets[0]], {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    with torch.no_grad():
        res = metrics(model(*te[:3]), te[3], budgets, te[1], L)
    res.update(layers=layers, params=sum(p.numel() for p in model.parameters()), log=log, train_rows=n)
    return res


def compare(res, controls, budgets, names):
    """Mean over the predictor's layers, for each control (so undefined control layers never count)."""
    lines, verdict = [], {}
    for b in budgets:
        best = None
        for name in names:
            c = controls.get(name)
            if c is None:
                continue
            per = c["recall_per_layer"][str(b)]
            vals = [per[l] for l in res["layers"] if per[l] is not None]
            if len(vals) == len(res["layers"]):
                v = float(np.mean(vals))
                if best is None or v > best[1]:
                    best = (name, v)
        if best is None:
            continue
        mine = res["recall"][b]
        verdict[b] = {"predictor": mine, "strongest_control": best[0], "control": best[1], "beats": mine > best[1]}
        lines.append(
            f"    recall@{b}: predictor {mine:.3f} vs {best[0]} {best[1]:.3f} -> "
            + ("beats it" if mine > best[1] else "does NOT beat it")
        )
    return lines, verdict


def main():
    p = argparse.ArgumentParser()
    p.add_argument("export")
    p.add_argument("--controls", default=None, help="`hebrus-mlx traces eval OUT --split test --json` output")
    p.add_argument("--json", default=None)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    m, data = load_export(args.export)
    for s in ("train", "validation", "test"):
        if s not in data:
            sys.exit(f"split {s!r} is empty in {args.export}")
    L, E, k = m["num_layers"], m["num_experts"], m["top_k"]
    budgets = [k, 2 * k, 4 * k]
    controls = json.loads(Path(args.controls).read_text())["controls"] if args.controls else {}
    out = {"rows": {s: int(len(data[s]["token_ids"])) for s in data}, "budgets": budgets, "predictors": {}}
    modes = ["history"] + (["feature"] if "router_inputs" in data["train"] else [])
    same_deadline = {
        "history": ["random", "frequency", "lru", "prev_token", "token_frequency"],
        "feature": ["random", "frequency", "lru", "prev_token", "token_frequency", "router_reuse_1"],
    }
    for mode in modes:
        res = train(
            mode,
            data,
            E,
            L,
            budgets,
            args.epochs,
            args.seed,
            vocab=int(max(d["token_ids"].max() for d in data.values())) + 1,
        )
        print(
            f"{mode} predictor ({res['params']} params, {res['train_rows']} train examples), test split: "
            + ", ".join(f"recall@{b} {res['recall'][b]:.3f}" for b in budgets)
            + f", exact top-k {res['exact_topk']:.3f}"
        )
        if controls:
            for label, names in (
                ("strongest same-deadline control", same_deadline[mode]),
                ("strongest control overall", list(controls)),
            ):
                lines, verdict = compare(res, controls, budgets, names)
                print(f"  vs {label}:")
                print("\n".join(lines))
                res["vs_" + label.replace(" ", "_").replace("-", "_")] = verdict
        out["predictors"][mode] = res
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
