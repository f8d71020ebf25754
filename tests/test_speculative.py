"""Speculative decoding (hebrus_mlx/speculative): greedy identity for every drafter and block size
(resident and with experts streamed at a 5% cache), golden replay of the protocol (AFN-020),
rejection sampling's distribution (chi-square), the draft-model compatibility gate, the CLI.

Provenance: every reference is plain decoding (`generate_step`, one token per forward, no
speculation code involved) or a direct target forward; golden-replay paths are built by hand from
that plain continuation (contract controls), never by the protocol under test (AFN-014).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.generate import generate_step, speculative_generate_step, stream_generate
from hebrus_mlx.loader import DEMO_DIR, load
from hebrus_mlx.sample_utils import make_sampler
from hebrus_mlx.speculative import DRAFTERS, CompatibilityError, DrafterError, Proposal, SpeculativeStats, make_drafter
from hebrus_mlx.speculative import protocol as P
from hebrus_mlx.speculative.drafters import DraftModelDrafter, NGramDrafter, load_draft_model
from hebrus_mlx.speculative.governor import FixedSchedule
from hebrus_mlx.testing.drafters import OracleDrafter

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a"
N = 24


@pytest.fixture(scope="module")
def demo():
    return load("demo")


@pytest.fixture(scope="module")
def plain(demo):
    model, tok = demo
    ids = tok.encode(CODE)
    out = [
        t for t, _ in generate_step(mx.array(ids), model, effective_vocab_size=tok.effective_vocab_size, max_tokens=N)
    ]
    return ids, out


class Perturbed(OracleDrafter):
    """The recorded future with every third proposed token wrong: partial and zero acceptance."""

    name = "perturbed"

    def propose(self, n):
        p = super().propose(n)
        toks = [(t + 1) % 4000 if (len(self.done) + i) % 3 == 2 else t for i, t in enumerate(p.tokens)]
        return Proposal(toks)


class Garbage(NGramDrafter):
    """Deterministic wrong tokens: every block is rejected at its first position."""

    name = "garbage"

    def propose(self, n):
        return Proposal([(len(self.seq) * 7 + i) % 4000 for i in range(n)])


def _spec(model, tok, ids, drafter, n, **kw):
    stats = SpeculativeStats()
    out = [
        t
        for t, _, _ in speculative_generate_step(
            mx.array(ids),
            model,
            drafter,
            effective_vocab_size=tok.effective_vocab_size,
            max_tokens=N,
            num_draft_tokens=n,
            stats=stats,
            **kw,
        )
    ]
    return out, stats


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_greedy_identical_every_drafter_and_block(demo, plain, n):
    model, tok = demo
    ids, want = plain
    for drafter in (NGramDrafter(), OracleDrafter(want), Perturbed(want), Garbage()):
        got, stats = _spec(model, tok, ids, drafter, n, governor=None)
        assert got == want, (drafter.name, n)
        if drafter.name == "oracle":
            assert stats.accepted == stats.drafted > 0
        if drafter.name in ("perturbed", "garbage"):
            assert stats.reruns > 0 and stats.accepted < stats.drafted


def test_greedy_identical_with_governor_and_draft_model(demo, plain):
    model, tok = demo
    ids, want = plain
    got, stats = _spec(model, tok, ids, Perturbed(want), 4)  # governor on (default)
    assert got == want and len(stats.block_sizes) > 1  # it tried several lengths
    # The demo itself as a draft model: the same argmax, so nearly everything is accepted.
    got, stats = _spec(model, tok, ids, DraftModelDrafter(model, tok.effective_vocab_size), 3, governor=None)
    assert got == want and stats.accepted >= 0.9 * stats.drafted


def test_speculative_step_trace_records_every_verify_step(demo, plain):
    """speculative_generate_step's `trace` (mlx-lm's name) is the golden-replay record: one StepTrace
    per verify step, and the accepted drafts it records are the stats'."""
    model, tok = demo
    ids, want = plain
    steps = []
    got, stats = _spec(model, tok, ids, OracleDrafter(want), 3, governor=None, trace=steps)
    assert got == want and stats.verify_steps > 0
    assert len(steps) == stats.verify_steps and all(isinstance(t, P.StepTrace) for t in steps)
    assert sum(t.accepted for t in steps) == stats.accepted


def test_generate_step_takes_a_drafter(demo, plain):
    model, tok = demo
    ids, want = plain
    got = [
        t
        for t, _ in generate_step(
            mx.array(ids),
            model,
            effective_vocab_size=tok.effective_vocab_size,
            max_tokens=N,
            draft_model=Perturbed(want),
            num_draft_tokens=2,
        )
    ]
    assert got == want
    with pytest.raises(DrafterError, match="draft_model"):
        next(generate_step(mx.array(ids), model, effective_vocab_size=tok.effective_vocab_size, draft_model="ngram"))


def test_stream_generate_marks_drafted_tokens(demo, plain):
    model, tok = demo
    ids, want = plain
    stats = SpeculativeStats()
    rs = list(
        stream_generate(
            model, tok, ids, max_tokens=N, draft_model=OracleDrafter(want), num_draft_tokens=3, speculative_stats=stats
        )
    )
    assert [r.token for r in rs] == want
    assert sum(r.from_draft for r in rs) == stats.accepted > 0
    assert stats.summary().startswith(f"Speculative: accepted {stats.accepted}/{stats.drafted} draft tokens")


# -- hidden capture alignment (the contract MTP follows) ---------------------------------------------


class Recorder(NGramDrafter):
    needs_hidden = True
    name = "recorder"

    def begin(self, prompt, hidden):
        super().begin(prompt, hidden)
        self.begin_hidden, self.commits = hidden, []

    def commit(self, accepted, hidden):
        super().commit(accepted, hidden)
        self.commits.append((list(accepted), hidden))


def test_hidden_rows_are_predecessor_states(demo, plain):
    model, tok = demo
    ids, want = plain
    rec = Recorder()
    got, _ = _spec(model, tok, ids, rec, 3, governor=None)
    assert got == want
    # Reference: one plain forward over prompt + output, streams before the mixer.
    full = ids + want
    _, h = model(mx.array(full)[None], cache=model.make_cache(), return_hidden=True)
    h = np.array(h[0])
    D = model.args.hc_count * model.args.hidden_size
    assert rec.begin_hidden.shape == (len(ids), D)
    np.testing.assert_allclose(np.array(rec.begin_hidden), h[: len(ids)], atol=2e-4)
    first, hid0 = rec.commits[0]
    assert first == want[:1] and hid0.shape == (0, D)  # its predecessor's state came with begin
    pos = len(ids) + 1  # sequence index of the next committed token
    for accepted, hid in rec.commits[1:]:
        assert hid.shape == (len(accepted), D)
        # hidden[j] is h at the position of accepted[j]'s predecessor.
        np.testing.assert_allclose(np.array(hid), h[pos - 1 : pos - 1 + len(accepted)], atol=2e-4)
        pos += len(accepted)


# -- golden replay (AFN-020) -------------------------------------------------------------------------


def test_golden_replay_zero_partial_full_and_rollback(demo, plain):
    model, tok = demo
    ids, G = plain
    V = tok.effective_vocab_size
    wrong = lambda t: (t + 11) % V  # noqa: E731
    # y = G[0] (from the prompt); each step verifies [y] + path.
    steps = [
        # zero acceptance, several candidates per position (the right token only ranked second)
        ([wrong(G[1]), G[2]], [[wrong(G[1]), G[1]], [G[2], wrong(G[2])]], 0, G[1]),
        # partial: two accepted, the third wrong -> bonus is the target's own third token
        ([G[2], G[3], wrong(G[4])], [[G[2]], [G[3], 5], [wrong(G[4]), G[4], 9]], 2, G[4]),
        # full: every draft accepted -> bonus is the token after them
        ([G[5], G[6], G[7]], None, 3, G[8]),
    ]
    cache = model.make_cache()
    ref = model.make_cache()  # fed only committed tokens, never a rejected one
    mx.eval(model(mx.array(ids)[None], cache=cache), model(mx.array(ids)[None], cache=ref))
    y = G[0]
    for path, cands, want_a, want_bonus in steps:
        a, bonus, committed = P.replay_step(model, cache, y, Proposal(path, cands), V)
        assert (a, bonus) == (want_a, want_bonus)
        mx.eval(model(mx.array([y] + committed[:-1])[None], cache=ref))
        # The rejected suffix left nothing: GDN/conv state, QSA K/V + index keys, PLE history + tail.
        assert cache.digest() == ref.digest()
        y = bonus

    trace = {
        "header": P.target_contract(model),
        "prompt": ids,
        "steps": [{"path": p, "candidates": c} for p, c, _, _ in steps],
    }
    replayed = P.replay(model, trace, V)
    assert [(s.accepted, s.bonus) for s in replayed] == [(a, b) for _, _, a, b in steps]


@pytest.mark.parametrize(
    "field,value",
    [
        ("target_revision", "0" * 64),
        ("vocab_size", 4225),
        ("hidden_shape", [256]),
        ("captured_stage", "layers.6.output.pre_mixer"),
        ("owner", 7),
        ("generation", 3),
        ("schema_version", 2),
    ],
)
def test_replay_refuses_foreign_trace(demo, plain, field, value):
    model, tok = demo
    ids, _ = plain
    header = P.target_contract(model)
    header[field] = value
    with pytest.raises(P.TraceMismatchError, match=f"^{field}:"):
        P.replay(model, {"header": header, "prompt": ids, "steps": []}, tok.effective_vocab_size)


def test_target_revision_tells_models_apart(demo):
    from support.parity_fixtures import model as tiny

    assert P.target_contract(demo[0])["target_revision"] != P.target_contract(tiny("tiny_a"))["target_revision"]


def test_proposal_shape_errors():
    with pytest.raises(DrafterError, match="candidates"):
        Proposal([1, 2], [[1], [3]])
    with pytest.raises(DrafterError, match="probs"):
        Proposal([1, 2], None, mx.zeros((3, 5)))


# -- streamed experts, 5% cache -----------------------------------------------------------------------


def test_streamed_5pct_greedy_identical_and_tickets_retired(plain):
    from hebrus_mlx.stream import engine as se

    if not se.available():
        pytest.skip("extension not built")
    from test_stream_model import _cache_gb

    from hebrus_mlx.stream.errors import StreamError, translate

    gb, _ = _cache_gb(str(DEMO_DIR))
    model, tok = load("demo", expert_cache_gb=gb)
    ids, want = plain
    seen = []
    sw = model.layers[0].mlp.switch_mlp
    orig = sw.__call__.__func__

    class Spy(type(sw)):
        def __call__(self, x, indices):
            seen.append((self.owner, self.generation))
            return orig(self, x, indices)

    for layer in model.layers:
        layer.mlp.switch_mlp.__class__ = Spy
    got, stats = _spec(model, tok, ids, Perturbed(want), 3, governor=None)
    assert got == want and stats.reruns > 0
    owner = seen[-1][0]
    # The run's ticket scope: one fresh generation per rejected suffix.
    gens = sorted({g for o, g in seen if o == owner})
    assert owner != 0 and gens == list(range(gens[0], gens[0] + stats.reruns + 1))
    assert (sw.owner, sw.generation) == (0, 0)  # the idle identity is restored
    # A read of a retired generation is refused: a late speculative read cannot publish.
    with pytest.raises(Exception) as info:
        rows, lease = model.streaming.experts.resolve(0, mx.array([[1, 2, 3, 4]]), owner, gens[0])
        mx.eval(rows)
    typed = translate(info.value)
    assert isinstance(typed, StreamError) and "stale" in str(typed)
    # `info` holds a traceback into this frame, which holds `info`: the model sits in a reference
    # cycle and its 8 reader threads lived on into a later test until the cyclic GC ran (a thread
    # census of the suite showed it). Close the engine here instead.
    model.streaming.engine.close()


def test_streamed_draft_tokens_are_read_at_p2_never_ahead_of_p0(plain):
    """Before each draft, speculation requests the records its draft tokens are expected to route
    to (the last token's routes, every streamed layer) at P2: such reads run on spare bandwidth
    only, none starting while a P0 read is queued (the trace's issue/start times), and greedy
    tokens stay plain decoding's."""
    from hebrus_mlx.stream import engine as se

    if not se.available():
        pytest.skip("extension not built")
    from test_stream_model import _cache_gb

    gb, _ = _cache_gb(str(DEMO_DIR))
    model, tok = load("demo", expert_cache_gb=gb)
    ids, want = plain
    experts, eng = model.streaming.experts, model.streaming.engine
    requested = []
    prefetch = experts.prefetch

    def spy(layer, indices, priority=se.P1, confidence=1.0):
        requested.append(priority)
        return prefetch(layer, indices, priority, confidence)

    experts.prefetch = spy
    eng.enable_trace(1 << 16)
    try:
        got, stats = _spec(model, tok, ids, Perturbed(want), 3, governor=None)
        ev, dropped = eng.trace_events()
    finally:
        eng.close()
    assert got == want and dropped == 0
    layers = len(model.layers)
    drafted_blocks = sum(v for k, v in stats.block_sizes.items() if k > 0)
    # Every draft requested each layer's predicted records at P2 (the first has no routes yet:
    # the prompt's last token routed them).
    assert drafted_blocks > 0 and requested.count(se.P2) == drafted_blocks * layers
    reads = ev[ev["kind"] == "read"]
    p0 = reads[reads["priority"] == se.P0]
    p2 = reads[reads["priority"] == se.P2]
    assert len(p2) > 0  # some ran from the P2 queue (the rest were hits or joined by P0/P1)
    for r in p2:  # no P0 read was queued when a P2 read started
        assert not ((p0["issue_ns"] < r["start_ns"]) & (p0["start_ns"] > r["start_ns"])).any()


# -- sampling: the target's distribution ------------------------------------------------------------


def _chi2_p(observed, expected):
    from scipy.stats import chisquare

    observed, expected = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    assert observed[expected == 0].sum() == 0  # nothing outside the target's support
    keep = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp / exp.sum()
    return chisquare(obs, exp * obs.sum(), sum_check=False).pvalue


def test_rejection_sampling_keeps_target_distribution():
    """accept_block on real tiny-model rows: p = target sampler's distribution (temp 1, top-k 5),
    q = a sharper draft distribution of the same logits (temp 0.4, top-k 8). The first committed token of a
    2-draft block must follow p[0] exactly; the 'accept if the target's draw equals' shortcut and
    a buggy residual (p instead of (p - q)+) must fail the same test."""
    from support.parity_fixtures import model as tiny

    model = tiny("tiny_a")
    V = model.args.vocab_size
    lp = model(mx.array([[5, 17, 33]]), cache=model.make_cache())[0]
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    target = make_sampler(temp=1.0, top_k=5, effective_vocab_size=V)
    draft = make_sampler(temp=0.4, top_k=8, effective_vocab_size=V).distribution
    q_rows = draft(lp[:2])  # over-confident in p's top tokens: min(p, q) is far from a multiple of p
    p0 = np.array(target.distribution(lp[:1]))[0]
    mx.random.seed(0)
    trials = 2000
    firsts, bonus_cases = np.zeros(V), 0
    for _ in range(trials):
        d = np.array(mx.random.categorical(mx.log(q_rows))).tolist()
        a, bonus, committed = P.accept_block(lp, Proposal(d, None, q_rows), target)
        firsts[committed[0]] += 1
        bonus_cases += a == 0
    assert 0 < bonus_cases < trials  # both branches ran
    assert _chi2_p(firsts, p0 * trials) > 1e-3

    # The same test detects a wrong residual.
    rng = np.random.default_rng(0)
    q0 = np.array(q_rows[0], dtype=np.float64)
    q0 /= q0.sum()
    p64 = p0.astype(np.float64) / p0.sum()
    bad = np.zeros(V)
    for _ in range(trials):
        d = rng.choice(V, p=q0)
        bad[d if rng.random() < min(1.0, p64[d] / q0[d]) else rng.choice(V, p=p64)] += 1
    assert _chi2_p(bad, p0 * trials) < 1e-3


def test_sampled_generation_follows_target_end_to_end():
    """Whole loop on the tiny model with a sampling draft model: the joint of the first three
    tokens against the exact target probabilities (enumerated by direct forwards). Fails for a
    verifier that accepts drafts without the p/q test; the residual's exact form is checked with
    more power by the accept_block test above."""
    from support.parity_fixtures import model as tiny

    model = tiny("tiny_a")
    V = model.args.vocab_size
    target = make_sampler(temp=1.0, top_k=2, effective_vocab_size=V)  # 2 x 2 x 2 cells: power from few runs
    qdist = make_sampler(temp=0.4, top_k=3, effective_vocab_size=V).distribution  # over-confident draft
    prompt = [5, 17, 33]

    def probs(seq):
        lp = model(mx.array(seq)[None], cache=model.make_cache())[0, -1:]
        return np.array(target.distribution(lp - mx.logsumexp(lp, axis=-1, keepdims=True)))[0]

    exact = {}
    p0 = probs(prompt)
    for t0 in np.flatnonzero(p0).tolist():
        p1 = probs(prompt + [t0])
        for t1 in np.flatnonzero(p1).tolist():
            p2 = probs(prompt + [t0, t1])
            for t2 in np.flatnonzero(p2).tolist():
                exact[(t0, t1, t2)] = p0[t0] * p1[t1] * p2[t2]
    keys = sorted(exact)
    mx.random.seed(1)
    counts = dict.fromkeys(keys, 0)
    runs = 150
    for _ in range(runs):
        drafter = DraftModelDrafter(model, V, qdist)
        out = [
            t
            for t, _, _ in speculative_generate_step(
                mx.array(prompt),
                model,
                drafter,
                effective_vocab_size=V,
                max_tokens=3,
                sampler=target,
                num_draft_tokens=2,
                governor=None,
            )
        ]
        counts[tuple(out)] += 1
    obs = np.array([counts[k] for k in keys], dtype=float)
    exp = np.array([exact[k] for k in keys]) * runs
    assert _chi2_p(obs, exp) > 1e-3


# -- draft model compatibility gate --------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def _tiny_hebrus_draft(dirpath: Path, demo_model):
    """A second, smaller Qwen4Exp (2 layers, random weights) sharing the demo tokenizer, in the
    runtime tensor layout the loader accepts."""
    from mlx.utils import tree_flatten

    from hebrus_mlx.models.qwen4exp import Model, ModelArgs

    cfg = json.loads((DEMO_DIR / "config.json").read_text())
    cfg.update(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], ple_layer_ids=[1])
    dirpath.mkdir(parents=True, exist_ok=True)
    mx.random.seed(3)
    m = Model(ModelArgs.from_dict(cfg))
    mx.save_safetensors(str(dirpath / "model.safetensors"), dict(tree_flatten(m.parameters())))
    (dirpath / "config.json").write_text(json.dumps(cfg))
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO_DIR / f, dirpath / f)
    return dirpath


def _tiny_mlx_lm_draft(dirpath: Path):
    """An mlx-lm llama (2 layers) with the demo's vocabulary width and tokenizer files."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config

    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 4224,
        "tie_word_embeddings": False,
    }
    dirpath.mkdir(parents=True, exist_ok=True)
    mx.random.seed(4)
    m = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.save_safetensors(str(dirpath / "model.safetensors"), dict(tree_flatten(m.parameters())))
    save_config(cfg, dirpath / "config.json")
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO_DIR / f, dirpath / f)
    return dirpath


def test_draft_model_dirs_load_and_stay_exact(demo, plain, tmp_path):
    model, tok = demo
    ids, want = plain
    for path in (_tiny_hebrus_draft(tmp_path / "hebrus", model), _tiny_mlx_lm_draft(tmp_path / "mlxlm")):
        drafter = make_drafter(str(path), model, tok)
        assert isinstance(drafter, DraftModelDrafter)
        got, stats = _spec(model, tok, ids, drafter, 3, governor=None)
        assert got == want and stats.drafted > 0


def test_draft_model_gate_names_the_field(demo, tmp_path):
    model, tok = demo
    base = _tiny_hebrus_draft(tmp_path / "ok", model)

    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(base, d)
        edit(d)
        return d

    def swap_ids(d):  # same token strings, two IDs exchanged (merges stay valid)
        t = json.loads((d / "tokenizer.json").read_text())
        vocab = t["model"]["vocab"]
        a = next(k for k in vocab if vocab[k] == 300)
        b = next(k for k in vocab if vocab[k] == 301)
        vocab[a], vocab[b] = 301, 300
        (d / "tokenizer.json").write_text(json.dumps(t))

    def wider(d):
        c = json.loads((d / "config.json").read_text())
        c["vocab_size"] = 4352
        (d / "config.json").write_text(json.dumps(c))

    def other_eos(d):
        g = json.loads((d / "generation_config.json").read_text())
        g["eos_token_id"] = [4096, 4097, 4098]  # one more stop token
        (d / "generation_config.json").write_text(json.dumps(g))

    for name, edit, field in (
        ("vocab", swap_ids, "tokenizer.vocab"),
        ("wide", wider, "vocab_size"),
        ("eos", other_eos, "stop_token_ids"),
    ):
        with pytest.raises(CompatibilityError, match=f"draft_model: {field}"):
            load_draft_model(variant(name, edit), tok, model.args.vocab_size)


def test_drafter_registry_and_typed_errors(demo, monkeypatch):
    model, tok = demo
    assert isinstance(make_drafter("ngram", model, tok), NGramDrafter)
    monkeypatch.setitem(sys.modules, "hebrus_mlx.speculative.mtp_drafter", None)  # the module is absent
    with pytest.raises(DrafterError, match="draft_model: 'mtp'"):
        make_drafter("mtp", model, tok)
    with pytest.raises(DrafterError, match="draft_model"):
        make_drafter("/nonexistent/draft", model, tok)
    monkeypatch.setitem(DRAFTERS, "mine", lambda m, a: OracleDrafter([1, 2]))
    assert isinstance(make_drafter("mine", model, tok), OracleDrafter)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", "generate", "--model", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_speculative_stats_and_errors(demo):
    from hebrus_mlx.generate import generate

    r = _cli("-p", CODE, "--ignore-chat-template", "-m", "12", "--draft-model", "ngram", "--num-draft-tokens", "2")
    assert r.returncode == 0, r.stderr
    text = r.stdout.split("=" * 10)[1].strip("\n")
    assert text == generate(*demo, demo[1].encode(CODE), max_tokens=12)  # plain decoding's text
    assert "Speculative: accepted " in r.stdout and "tokens per verify step" in r.stdout
    for args, field in (
        (("--draft-model", "/nonexistent/x"), "draft_model"),
        (("--num-draft-tokens", "2"), "--num-draft-tokens"),
        (("--draft-model", "ngram", "--num-draft-tokens", "0"), "--num-draft-tokens"),
    ):
        r = _cli("-p", "x", *args)
        assert r.returncode == 2 and field in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stdout == "", r.stdout


# -- governor -----------------------------------------------------------------------------------------


def test_cost_model_is_h7_when_io_bound():
    """All cost exposed I/O, every draft accepted: a block pays iff U(B+1) < k * tau(B) (AFN-019 H7),
    so the choice follows the unique experts a block reads."""
    from hebrus_mlx.speculative.governor import CostModel

    k, layers, miss, read = 10, 8, 1.0, 1e-3

    def model(unique):
        return CostModel(
            accept=[1.0] * 4, step_s=layers * k * miss * read, unique=unique, layers=layers, miss_rate=miss, read_s=read
        )

    # tau(B) = B + 1; speed ~ (B+1) / U(B+1): 1/10, 2/14, 3/30, 4/45, 5/60 -> B = 1.
    m = model([10, 14, 30, 45, 60])
    assert m.best() == 1
    for b in range(1, 5):
        assert (m.speed(b) > m.speed(0)) == (m.unique[b] < k * (b + 1)), b
        assert m.extra_unique(b) == m.unique[b] - k
    # More route overlap: 1/10, 2/12, 3/15, 4/18, 5/48 -> B = 3.
    assert model([10, 12, 15, 18, 48]).best() == 3
    # No overlap at all (every token reads k new experts): nothing pays, a plain step.
    assert model([10, 20, 30, 40, 50]).best() == 0


def test_cost_model_resident_vs_streamed_and_acceptance_flip():
    """Resident: U_B costs no I/O, only compute; the same block at a cold cache does not pay; a
    drafter that is rarely right backs off to B = 0 even resident."""
    from hebrus_mlx.speculative.governor import CostModel

    base = dict(accept=[0.8] * 4, step_s=0.010, token_s=0.001, unique=[10, 19, 28, 37, 46], layers=8)
    resident = CostModel(**base)
    assert resident.io_s(4) == 0.0
    # tau(4) = 1+.8+.64+.512+.4096 = 3.36 in 0.010+0.004+rerun(<=0.0064) s vs 1 token in 0.010 s.
    assert resident.best() == 4
    # Streamed, half the unique reads miss at 2 ms each: one extra token's 9 experts x 8 layers
    # cost 72 ms of reads, far more than the 10 ms a plain step takes.
    streamed = CostModel(**base, miss_rate=0.5, read_s=0.002)
    assert streamed.io_s(1) == pytest.approx(8 * 9 * 0.5 * 0.002)
    assert streamed.best() == 0
    # Warm cache (1% misses at 0.1 ms): speculation pays again.
    assert CostModel(**base, miss_rate=0.01, read_s=1e-4).best() > 0
    # Acceptance 0.05: tau barely above 1 never pays for the verify's extra compute.
    assert CostModel(**{**base, "accept": [0.05] * 4}).best() == 0


def _feed(gov, steps, accept, plain_s, verify_s, routes_of, misses_per_unique=0.0, read_s=0.0):
    """Drive a Governor with synthetic observations: a step of B drafts accepts `accept(B)` of them,
    a plain step takes plain_s, a verify of n tokens verify_s(n) plus its exposed reads; routes_of(t)
    is token t's [layers, k] experts. Returns the choices."""
    choices, t = [], 0
    for _ in range(steps):
        b = gov.block_size()
        choices.append(b)
        n = b + 1
        r = np.stack([routes_of(t + i) for i in range(n)], axis=1)  # [layers, n, k]
        from hebrus_mlx.speculative.governor import unique_per_layer

        unique_reads = r.shape[0] * unique_per_layer(r)
        misses = int(round(misses_per_unique * unique_reads))
        if b == 0:
            gov.observe_step(1, plain_s, misses=misses, exposed_s=misses * read_s, unique_reads=unique_reads)
            gov.observe_routes(r)
            t += 1
        else:
            a = accept(b)
            gov.observe_block(b, a)
            gov.observe_step(n, verify_s(n) + misses * read_s, 0.0, b, misses, misses * read_s, unique_reads)
            gov.observe_routes(r[:, : a + 1])
            t += a + 1
    return choices


def test_governor_estimates_pick_the_rule_and_flip_with_routes():
    """From observations alone: drafts always right and cheap verify -> the longest block; the same
    drafter with costly misses flips on the routes: shared experts across tokens (U_B = 0) keep
    speculating, disjoint experts (U_B = k per extra token) fall back to plain steps."""
    from collections import Counter

    from hebrus_mlx.speculative import Governor

    layers, k = 4, 10
    same = lambda t: np.tile(np.arange(k), (layers, 1))  # noqa: E731
    disjoint = lambda t: np.tile(np.arange(k) + k * (t % 50), (layers, 1))  # noqa: E731
    cheap = lambda n: 0.010 + 0.001 * (n - 1)  # noqa: E731
    top = lambda c: Counter(c[10:]).most_common(1)[0][0]  # noqa: E731
    # No misses (resident-like), drafts always right: the longest block.
    assert top(_feed(Governor(4), 120, lambda b: b, 0.010, cheap, disjoint)) == 4
    # Half the unique reads miss at 1 ms (a plain step: 10 ms compute + 20 ms reads), half the
    # drafts right. Shared experts: a block reads nothing extra, tau(3) = 1.875 in ~42 ms beats
    # 1 token in 30 ms. Disjoint experts: one extra token reads 20 ms more, tau(1) = 1.5 in ~56 ms.
    costly = dict(misses_per_unique=0.5, read_s=0.001)
    assert top(_feed(Governor(4), 160, _half(), 0.030, cheap, same, **costly)) > 0
    assert top(_feed(Governor(4), 160, _half(), 0.030, cheap, disjoint, **costly)) == 0


def _half():
    """Each drafted position accepted every other time (a fixed pattern; a rejection ends the block)."""
    state = {"n": 0}

    def accept(b):
        a = 0
        while a < b:
            state["n"] += 1
            if state["n"] % 2:
                break
            a += 1
        return a

    return accept


def test_governor_backs_off_from_a_losing_drafter():
    """Every draft rejected: after warmup the governor plays B = 0, and its probes of B = 1 get rarer."""
    from hebrus_mlx.speculative import Governor

    gov = Governor(4, explore_every=8)
    choices = _feed(
        gov, 400, lambda b: 0, 0.010, lambda n: 0.010 + 0.002 * (n - 1), lambda t: np.zeros((2, 4), dtype=np.int64)
    )
    late = choices[3:]
    assert sum(b == 0 for b in late) >= 0.97 * len(late)
    probes = [i for i, b in enumerate(choices) if i >= 3 and b > 0]
    gaps = np.diff(probes)
    assert len(probes) >= 3 and gaps[-1] > gaps[0]


SCHEDULE = [2, 0, 0, 3, 0, 1, 0, 0, 0, 4, 1, 0]


def _drafters(model, tok, want, draft_model=None):
    """Every drafter kind; the draft model is `draft_model` (default: the target itself)."""
    return [
        NGramDrafter(),
        OracleDrafter(want),
        Perturbed(want),
        Garbage(),
        make_drafter("mtp", model, tok),
        DraftModelDrafter(draft_model or model, tok.effective_vocab_size),
    ]


def test_greedy_identical_across_plain_and_block_switches(demo, plain):
    model, tok = demo
    ids, want = plain
    for drafter in _drafters(model, tok, want):
        got, stats = _spec(model, tok, ids, drafter, 4, governor=FixedSchedule(SCHEDULE, repeat=True))
        assert got == want, drafter.name
        assert stats.block_sizes.get(0, 0) > 0 and stats.verify_steps > 0, (drafter.name, stats.block_sizes)


def test_plain_steps_are_pipelined(demo, plain):
    """A B = 0 token is yielded with the next plain step already queued (the cache holds its input),
    as generate_step does; a verify step's bonus is yielded before it is fed."""
    model, tok = demo
    ids, want = plain
    cache = model.make_cache()
    seen = []
    for _t, _, _from_draft in speculative_generate_step(
        mx.array(ids),
        model,
        Garbage(),
        effective_vocab_size=tok.effective_vocab_size,
        max_tokens=N,
        num_draft_tokens=3,
        governor=FixedSchedule([0, 0, 0, 0, 2], repeat=True),
        prompt_cache=cache,
    ):
        seen.append(cache.next_position - len(ids) - len(seen))  # inputs fed past this token
    # Token 0 comes from the prefill. Tokens 1..3 are plain with a plain successor: already fed (1);
    # token 4 is plain but the next step is a block (0); the block's bonus token 5 is not fed (0).
    assert seen[1:4] == [1, 1, 1] and seen[4] == 0 and seen[5] == 0, seen


def test_governor_falls_back_on_the_demo(demo, plain):
    """The real governor with a drafter that is always wrong: greedy identical, mostly plain steps."""
    model, tok = demo
    ids, want = plain
    got, stats = _spec(model, tok, ids, Garbage(), 4)
    assert got == want
    assert stats.block_sizes.get(0, 0) >= 0.75 * N and stats.verify_steps <= 3, stats.block_sizes


def test_streamed_5pct_greedy_identical_across_switches(demo, plain):
    """Experts streamed through a 5% cache: every drafter, a forced B=0 <-> B>0 schedule and the real
    governor (which reads the engine's misses and the routes) give plain decoding's tokens."""
    from hebrus_mlx.stream import engine as se

    if not se.available():
        pytest.skip("extension not built")
    from test_stream_model import _cache_gb

    gb, _ = _cache_gb(str(DEMO_DIR))
    model, tok = load("demo", expert_cache_gb=gb)
    ids, want = plain
    try:
        # The draft model is a resident copy (a streamed target's arena is sized for its own steps).
        for drafter in _drafters(model, tok, want, draft_model=demo[0]):
            for gov in (FixedSchedule(SCHEDULE, repeat=True), "auto"):
                got, stats = _spec(model, tok, ids, drafter, 4, governor=gov)
                assert got == want, (drafter.name, gov)
                assert stats.block_sizes.get(0, 0) > 0, (drafter.name, stats.block_sizes)
    finally:
        model.streaming.engine.close()
