"""Run by tests/test_pipeline.py in each rank's process (MLX_HOSTFILE / MLX_RANK set by the test).

argv: MODEL OUT MODE [SPLIT]. Rank 0 writes OUT (npz) with the tokens and log-probabilities it
generated; the other ranks serve. Modes:
  generate   greedy generate_step with chunked prefill (step 5)
  restore    forward A, snapshot, B, restore, B again, then C: all logits (exercises RESTORE/FREE)
  kill       rank 1 exits hard after 3 forwards
  stall      rank 1 sleeps forever after 3 forwards (rank 0's watchdog must end the run)
  kill_at_finish  rank 1 exits hard when its serve loop ends, before the final counters are
             gathered; rank 0 generates, then reports the counters as the CLI does (pipeline.ranks.finish)
  stream     as generate, each rank streaming its experts and PLE pages through a small cache;
             every rank also writes OUT.rank<r>.json: the layers its engine read records of
  spec       greedy speculative decoding with each drafter in $DRAFT (comma-separated: ngram, mtp, a
             directory) in turn on the prompt $PROMPT_IDS; OUT holds tokens, counters, state bytes each
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: `support`

import mlx.core as mx
import numpy as np

from hebrus_mlx.pipeline import load_pipeline
from hebrus_mlx.pipeline import stage as S
from support import families  # noqa: F401 (registers the test-only families, e.g. the tiny converted checkpoint's)

model_path, out, mode = sys.argv[1:4]
split = sys.argv[4] if len(sys.argv) > 4 else None
timeout = float(os.environ.get("PIPELINE_TIMEOUT", "60"))

if mode in ("kill", "stall") and os.environ["MLX_RANK"] == "1":
    real, calls = S._run_layers, [0]

    def faulty(*a):
        calls[0] += 1
        if calls[0] > 3:
            if mode == "kill":
                os._exit(7)
            time.sleep(3600)
        return real(*a)

    S._run_layers = faulty

streamed = mode == "stream"
pipe = load_pipeline(
    model_path,
    split=split,
    timeout=timeout,
    mtp="mtp" in os.environ.get("DRAFT", "").split(","),
    expert_cache_gb=0.0005 if streamed else None,
    ple_cache_gb=0.0005 if streamed else None,
)
engine = pipe.model.streaming.engine if pipe.model.streaming is not None else None
if streamed:
    engine.enable_trace(1 << 16)


def dump_layers():
    import json

    ev, _ = engine.trace_events()
    reads = ev[ev["kind"] == "read"]
    with open(f"{out}.rank{pipe.rank}.json", "w") as f:
        json.dump(
            {
                "stage": [pipe.stage.start, pipe.stage.stop],
                "expert_layers": sorted({int(x) for x in reads["layer"] if x >= 0}),  # PLE pages: layer -1
                "reads": int(len(reads)),
            },
            f,
        )


if pipe.rank != 0:
    pipe.serve()
    if mode == "kill_at_finish":
        os._exit(7)
    if streamed:
        dump_layers()
    sys.exit(0)

from hebrus_mlx.generate import generate_step  # noqa: E402

model = pipe.model
vocab = model.args.vocab_size
if mode == "restore":
    a, b, c = (mx.array([[int(t) % vocab for t in row]], dtype=mx.int32) for row in ([5, 9, 13, 2, 7], [3, 3, 8], [11]))
    cache = model.make_cache()
    la = model(a, cache, all_logits=True)
    snap = cache.snapshot()
    lb1 = model(b, cache, all_logits=True)
    cache.restore(snap)
    lb2 = model(b, cache, all_logits=True)
    lc = model(c, cache, all_logits=True)
    model.stop()
    np.savez(out, a=np.array(la), b1=np.array(lb1), b2=np.array(lb2), c=np.array(lc))
    sys.exit(0)

if mode == "spec":
    from hebrus_mlx.generate import stream_generate
    from hebrus_mlx.speculative import SpeculativeStats
    from hebrus_mlx.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path, physical_vocab_size=vocab)
    ids = [int(t) for t in os.environ["PROMPT_IDS"].split(",")]
    saved = {}
    for i, draft in enumerate(os.environ["DRAFT"].split(",")):
        stats, hidden0 = SpeculativeStats(), model.hidden_bytes
        toks = [
            r.token
            for r in stream_generate(
                model,
                tok,
                ids,
                max_tokens=int(os.environ.get("MAX_TOKENS", "24")),
                draft_model=draft,
                num_draft_tokens=3,
                governor=None,
                speculative_stats=stats,
            )
        ]
        saved.update(
            {
                f"tokens{i}": np.array(toks),
                f"stats{i}": np.array([stats.drafted, stats.accepted, stats.reruns]),
                f"hidden_bytes{i}": model.hidden_bytes - hidden0,
            }
        )
    model.stop()
    np.savez(out, **saved)
    sys.exit(0)

prompt = mx.array([(7 * i + 3) % 97 + 4 for i in range(13)], dtype=mx.int32)
tokens, logprobs = [], []
t0 = time.monotonic()
try:
    for tok, lp in generate_step(prompt, model, effective_vocab_size=vocab, max_tokens=12, prefill_step_size=5):
        tokens.append(tok)
        logprobs.append(np.array(lp))
except S.PipelineError as e:
    print(f"TYPED {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
    sys.exit(0)
if mode == "kill_at_finish":
    from hebrus_mlx.pipeline.ranks import finish

    try:
        finish(model)
    except S.PipelineError as e:
        print(f"TYPED {type(e).__name__}: {e}", flush=True)
    sys.exit(0)
model.stop()
if streamed:
    dump_layers()
np.savez(out, tokens=np.array(tokens), logprobs=np.stack(logprobs))
