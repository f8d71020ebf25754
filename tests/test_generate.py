"""hebrus_mlx.generate: generate_step / stream_generate / generate and the CLI.

The model here is a stand-in defined in this file only: a deterministic next-token rule that
depends on the whole cached history, so wrong cache or prefill chunking changes the output. The
expected tokens come from an independent uncached Python loop (independent cross-check).
"""

import importlib
import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import mlx.core as mx
import pytest
from support.qwen_asset import PHYSICAL_VOCAB, qwen_tokenizer_dir

from hebrus_mlx.generate import generate, generate_step, stream_generate
from hebrus_mlx.testing.processes import cli_argv
from hebrus_mlx.text.tokenizer import load_tokenizer

gen = importlib.import_module("hebrus_mlx.generate")  # the package attribute is the function

EFFECTIVE = 248077
IM_END = 248046


class _Args:
    def __init__(self, ctx):
        self.vocab_size = PHYSICAL_VOCAB
        self.max_position_embeddings = ctx


class _Cache:
    def __init__(self):
        self.tokens = mx.zeros((0,), dtype=mx.int32)


class _Caches(list):
    """The sequence-cache face generate_step uses: the layer caches plus their live arrays."""

    @property
    def arrays(self):
        return [c.tokens for c in self]


class HistoryModel:
    """next = (7 * sum(history) + 3) mod 1000 + 500; unassigned rows are made dominant."""

    streaming = None  # resident

    def __init__(self, ctx=256):
        self.args = _Args(ctx)
        self.calls = []

    def make_cache(self):
        return _Caches([_Cache()])

    def __call__(self, inputs, cache):
        self.calls.append(inputs.shape[1])
        c = cache[0]
        c.tokens = mx.concatenate([c.tokens, inputs[0].astype(mx.int32)])
        sums = mx.cumsum(c.tokens.astype(mx.int64))[-inputs.shape[1] :]
        nxt = (7 * sums + 3) % 1000 + 500
        cols = mx.arange(PHYSICAL_VOCAB)
        logits = mx.where(cols[None] == nxt[:, None], 10.0, 0.0)
        logits = mx.where(cols[None] >= EFFECTIVE, 50.0, logits)
        return logits[None].astype(mx.float32)


class ScriptModel:
    """Emits `script` after the prompt, one token per step, whatever the input."""

    streaming = None  # resident

    def __init__(self, script, ctx=256):
        self.args = _Args(ctx)
        self.script = script

    def make_cache(self):
        return _Caches([_Cache()])

    def __call__(self, inputs, cache):
        c = cache[0]
        start = c.tokens.size
        c.tokens = mx.concatenate([c.tokens, inputs[0].astype(mx.int32)])
        rows = []
        for pos in range(start, c.tokens.size):
            k = pos - self.prompt_len + 1
            tok = self.script[min(max(k, 0), len(self.script) - 1)]
            rows.append(mx.where(mx.arange(PHYSICAL_VOCAB) == tok, 10.0, 0.0))
        return mx.stack(rows)[None]


def reference_tokens(prompt, n):
    hist = list(prompt)
    out = []
    for _ in range(n):
        t = (7 * sum(hist) + 3) % 1000 + 500
        out.append(t)
        hist.append(t)
    return out


@pytest.fixture(scope="session")
def tok(request):
    return load_tokenizer(qwen_tokenizer_dir(request.config.cache.mkdir("hebrus_qwen_tokenizer")), PHYSICAL_VOCAB)


@pytest.mark.parametrize("step", [1, 3, 2048])
def test_generate_step_matches_uncached_reference(step):
    """Chunked prefill + cached decode reproduce the uncached rule; invalid rows never win (AFN-005)."""
    prompt = [11, 22, 33, 44, 55, 66, 77]
    model = HistoryModel()
    got = [
        t
        for t, _ in generate_step(
            mx.array(prompt), model, effective_vocab_size=EFFECTIVE, max_tokens=6, prefill_step_size=step
        )
    ]
    assert got == reference_tokens(prompt, 6)
    prefill = model.calls[: len(model.calls) - 7]  # 6 decode steps + 1 queued ahead
    assert max(prefill) <= step and sum(prefill) == len(prompt) - 1
    assert model.calls[len(prefill) :] == [1] * 7


def test_max_kv_size_is_refused_before_any_work():
    """mlx-lm's --max-kv-size has no exact meaning for QSA: refused as a typed one-liner, before the
    model is loaded (a nonexistent model path must not be what the user hears about)."""
    from hebrus_mlx.errors import UsageError

    m = HistoryModel()
    with pytest.raises(UsageError, match="max_kv_size: not supported"):
        next(generate_step(mx.array([1, 2]), m, effective_vocab_size=EFFECTIVE, max_kv_size=8))
    assert m.calls == []
    p = subprocess.run(
        cli_argv(
            "generate",
            "--model",
            "/nonexistent/model",
            "--max-kv-size",
            "64",
            "-p",
            "hi",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "hebrus-mlx generate: error: --max-kv-size: " + gen.MAX_KV_SIZE_UNSUPPORTED + "\n"


def test_mlx_lm_keywords_are_refused_by_name(tok):
    """`hebrus_mlx.generate(model, tok, prompt, kv_bits=4)` (mlx-lm's keyword) is a UsageError naming
    kv_bits with the reason, before any work; an mlx-lm sampling keyword points at make_sampler."""
    import hebrus_mlx
    from hebrus_mlx.errors import UsageError

    m = HistoryModel()
    with pytest.raises(UsageError, match="quantized KV cache") as info:
        hebrus_mlx.generate(m, tok, [1, 2], kv_bits=4)
    assert info.value.field == "kv_bits" and m.calls == []
    with pytest.raises(UsageError, match="make_sampler") as info:
        hebrus_mlx.generate(m, tok, [1, 2], temp=0.7)
    assert info.value.field == "temp"
    with pytest.raises(UsageError, match="not an argument of generate") as info:
        list(stream_generate(m, tok, [1, 2], promt_cache=None))
    assert info.value.field == "promt_cache" and m.calls == []


def test_effective_vocab_size_defaults_to_the_loaded_models(demo):
    """AFN-005: generate_step without effective_vocab_size masks with the width `load` gave the model
    (the demo's tokenizer's), the same tokens and log-probabilities as passing it; a model that does
    not carry one is a UsageError naming the argument, never the physical width."""
    from hebrus_mlx.errors import UsageError

    model, tokenizer = demo
    assert model.tokenizer_vocab_size == tokenizer.effective_vocab_size < model.args.vocab_size
    prompt = mx.array(tokenizer.encode("def fibonacci(n):"))
    given = list(generate_step(prompt, model, effective_vocab_size=tokenizer.effective_vocab_size, max_tokens=4))
    default = list(generate_step(prompt, model, max_tokens=4))
    assert [t for t, _ in default] == [t for t, _ in given]
    assert all(mx.array_equal(a, b, equal_nan=True).item() for (_, a), (_, b) in zip(default, given))
    assert mx.all(default[0][1][tokenizer.effective_vocab_size :] == -mx.inf).item()
    with pytest.raises(UsageError) as info:
        next(generate_step(mx.array([1, 2]), HistoryModel()))
    assert info.value.field == "effective_vocab_size"


def test_logprobs_are_masked_and_normalised():
    """AFN-005: logprobs are -inf past the effective vocabulary and sum to 1 over valid rows."""
    ((_, lp),) = list(generate_step(mx.array([1, 2]), HistoryModel(), effective_vocab_size=EFFECTIVE, max_tokens=1))
    assert lp.shape == (PHYSICAL_VOCAB,)
    assert mx.all(lp[EFFECTIVE:] == -mx.inf).item()
    assert abs(mx.logsumexp(lp[:EFFECTIVE]).item()) < 1e-4


def _script_model(tok, text, tail):
    script = tok.encode(text) + tail
    m = ScriptModel(script)
    return m


def test_stream_generate_stops_on_stop_set(tok):
    """Stops on <|im_end|> from the explicit stop set; the stop token adds no text."""
    prompt = tok.encode("hi")
    model = _script_model(tok, "Hello 世界 नमस्ते", [IM_END, 9419])
    model.prompt_len = len(prompt)
    rs = list(stream_generate(model, tok, prompt, max_tokens=50))
    assert "".join(r.text for r in rs) == "Hello 世界 नमस्ते"
    assert rs[-1].finish_reason == "stop" and rs[-1].token == IM_END
    assert all(r.finish_reason is None for r in rs[:-1])
    assert rs[-1].generation_tokens == len(rs) and rs[-1].prompt_tokens == len(prompt)


def test_stream_generate_length(tok):
    prompt = tok.encode("hi")
    model = _script_model(tok, "one two three four five", [IM_END])
    model.prompt_len = len(prompt)
    rs = list(stream_generate(model, tok, prompt, max_tokens=3))
    assert len(rs) == 3 and rs[-1].finish_reason == "length"
    assert "".join(r.text for r in rs) == tok.decode(model.script[:3])


def test_string_prompt_is_data(tok):
    """AFN-006: a str prompt is caller text; a literal <|im_end|> does not become a special ID."""
    seen = []

    class Spy(HistoryModel):
        def __call__(self, inputs, cache):
            seen.extend(inputs[0].tolist())
            return super().__call__(inputs, cache)

    list(stream_generate(Spy(), tok, "<|im_end|><|im_start|>", max_tokens=1))
    assert seen and not set(seen) & set(range(248044, EFFECTIVE))


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([], "empty"),
        ([1] * 17, "context is 16"),
        ([1, 248100], "unassigned"),
        ([1, PHYSICAL_VOCAB], "outside"),
    ],
)
def test_bad_prompts(tok, prompt, match):
    with pytest.raises(ValueError, match=match):
        list(stream_generate(HistoryModel(ctx=16), tok, prompt, max_tokens=2))


def test_generate_verbose_output_shape(tok):
    """Same report shape as mlx_lm.generate."""
    prompt = tok.encode("hi")
    model = _script_model(tok, "Hello there", [IM_END])
    model.prompt_len = len(prompt)
    buf = io.StringIO()
    with redirect_stdout(buf):
        text = generate(model, tok, prompt, verbose=True, max_tokens=20)
    lines = buf.getvalue().splitlines()
    assert text == "Hello there"
    assert lines[0] == "=" * 10 and lines[1] == "Hello there" and lines[2] == "=" * 10
    assert re.fullmatch(rf"Prompt: {len(prompt)} tokens, [0-9.]+ tokens-per-sec", lines[3])
    assert re.fullmatch(r"Generation: 3 tokens, [0-9.]+ tokens-per-sec", lines[4])
    assert re.fullmatch(r"Peak memory: \d+\.\d{3} GB", lines[5])


def test_cli_in_process_with_chat_template(tok, monkeypatch, capsys):
    """main() renders the chat template, generates and prints; context overflow exits 2."""
    from hebrus_mlx.text.chat_template import qwen_template

    tok.chat_template = qwen_template()
    model = ScriptModel(tok.encode("ok") + [IM_END])
    ids = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])
    model.prompt_len = len(ids)
    from support.verb_loading import patch_load_from_args

    from hebrus_mlx.cli import main

    patch_load_from_args(monkeypatch, lambda *a, **k: (model, tok))
    assert main(["generate", "-p", "q", "--system-prompt", "s", "--verbose", "false"]) == 0
    assert capsys.readouterr().out == "ok\n"
    model.args.max_position_embeddings = 4
    assert main(["generate", "-p", "q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "context is 4" in err


CLI_ERRORS = [
    (["-p", ""], "", "prompt is empty"),
    (["-p", "-"], "  \n", "prompt is empty"),
    (["--model", "/nonexistent/model", "-p", "hi"], "", "/nonexistent/model"),
    (["--temp", "-1"], "", "--temp"),
    (["--top-p", "1.5"], "", "--top-p"),
    (["--top-k", "-3"], "", "--top-k"),
    (["--min-p", "2"], "", "--min-p"),
    (["--max-tokens", "0"], "", "--max-tokens"),
    (["-m", "ten"], "", "--max-tokens"),
    (["--prefill-step-size", "0"], "", "--prefill-step-size"),
    (["--max-kv-size", "0"], "", "--max-kv-size"),
    (["--verbose", "maybe"], "", "--verbose"),
    (["--expert-cache-gb", "0"], "", "--expert-cache-gb"),
    (["--expert-cache-gb", "-1"], "", "--expert-cache-gb"),
    (["--expert-cache-gb", "nan"], "", "--expert-cache-gb"),
    (["--expert-cache-gb", "inf"], "", "--expert-cache-gb"),
    (["--expert-cache-gb", "lots"], "", "--expert-cache-gb"),
    (["--model", "tests/support/fixtures/parity/tiny_a", "--expert-cache-gb", "1", "-p", "hi"], "", "expert_cache_gb"),
    (["--expert-cache-gb", "1e-9", "-p", "hi"], "", "expert_cache_gb"),
    (["--ple-cache-gb", "0"], "", "--ple-cache-gb"),
    (["--ple-cache-gb", "1e-9", "-p", "hi"], "", "ple_cache_gb"),
    (["--no-such-flag"], "", "--no-such-flag"),
]


@pytest.mark.parametrize("argv,stdin,needle", CLI_ERRORS, ids=[" ".join(a) for a, _, _ in CLI_ERRORS])
def test_cli_errors_exit_2_with_one_line(argv, stdin, needle):
    p = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.commands.generate", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert needle in p.stderr


GREEDY = json.loads((Path(__file__).parent / "support" / "fixtures" / "text" / "greedy_cases.json").read_text())


@pytest.mark.parametrize("case", GREEDY, ids=lambda c: c["checkpoint"].rsplit("/", 1)[-1])
def test_greedy_matches_transformers_generate(case):
    """Issue 4 evidence: greedy generate_step (chunked prefill, cached decode) on the tiny
    reference checkpoints equals transformers' generate token for token (upstream capture)."""
    from hebrus_mlx.loader import load_hf_model

    model = load_hf_model(Path(__file__).parents[1] / case["checkpoint"])
    got = [
        t
        for t, _ in generate_step(
            mx.array(case["prompt"]),
            model,
            effective_vocab_size=model.args.vocab_size,
            max_tokens=len(case["greedy"]),
            prefill_step_size=5,
        )
    ]
    assert got == case["greedy"]


def _byte_tokenizer_checkpoint(dst, src):
    """Contract control: tiny_a's weights (320 logits rows) with a 259-ID byte-level tokenizer
    (256 bytes + 3 specials), the shipped chat template and an explicit eos list."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    t = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    t.save(str(dst / "tokenizer.json"))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 258]}))
    from hebrus_mlx.text.chat_template import QWEN_TEMPLATE_PATH

    shutil.copy(QWEN_TEMPLATE_PATH, dst / "chat_template.jinja")
    return dst


def test_end_to_end_on_tiny_checkpoint(tmp_path):
    """load() + chat template + masked sampling on a real graph: 320 physical rows, 259 IDs;
    then the CLI as a subprocess prints mlx_lm's report shape."""
    from hebrus_mlx.loader import load

    d = _byte_tokenizer_checkpoint(
        tmp_path, Path(__file__).parents[1] / "tests" / "support" / "fixtures" / "parity" / "tiny_a"
    )
    model, tok = load(str(d))
    assert (tok.effective_vocab_size, tok.physical_vocab_size) == (259, 320)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi <|im_end|>"}])
    assert ids.count(258) == 1  # only the template's <|im_end|>; the user's literal stays bytes
    rs = list(stream_generate(model, tok, ids, max_tokens=12))
    assert all(r.token < 259 for r in rs)

    p = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.commands.generate", "--model", str(d), "-p", "hi", "-m", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "=" * 10 and lines[-4] == "=" * 10
    assert re.fullmatch(r"Prompt: \d+ tokens, [0-9.]+ tokens-per-sec", lines[-3])
    assert re.fullmatch(r"Generation: [1-5] tokens, [0-9.]+ tokens-per-sec", lines[-2])
    assert re.fullmatch(r"Peak memory: \d+\.\d{3} GB", lines[-1])


def test_cli_streamed_demo_prints_io_line_and_resident_text():
    """AFN-019 (issue 6 integration): `--expert-cache-gb` streams the demo's routed experts
    (0.0005 GiB = 34 of 512 arena records); the greedy text equals the resident run's and an
    I/O line follows mlx_lm's stats. Control: the same command without the flag."""

    def run(*extra):
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "hebrus_mlx.commands.generate",
                "--model",
                "demo",
                "-p",
                "once upon a time",
                "-m",
                "12",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).parents[1],
        )
        assert p.returncode == 0, p.stderr
        return p.stdout.splitlines()

    from hebrus_mlx.stream.predict import DEFAULT as DEFAULT_PREFETCH
    from hebrus_mlx.stream.predict import parse_prefetch

    resident, streamed = run(), run("--expert-cache-gb", "0.0005")
    hyper = run("--expert-cache-gb", "0.0005", "--prefetch", "hyper-reuse")
    assert re.fullmatch(r"Peak memory: \d+\.\d{3} GB", resident[-1])
    assert not any(line.startswith("I/O:") for line in resident)
    io_line = streamed[-1]
    assert re.fullmatch(
        r"I/O: [0-9.]+ GB read \([0-9.]+ GB predicted, [0-9.]+ GB wasted\), hit rate [0-9.]+%, "
        r"exposed wait [0-9.]+ s, hidden (n/a|-?\d+%), p50/p99 [0-9.]+/[0-9.]+ ms; "
        rf"prefetch {re.escape(parse_prefetch(DEFAULT_PREFETCH).name)}: timely recall [0-9.]+%, "
        r"precision [0-9.]+%",
        io_line,
    ), io_line
    # (The prefill sweep line, stream.sweep, and the expert / PLE split sit between mlx_lm's stats
    # and the I/O line.)
    assert streamed[-4].startswith("Peak memory:") and streamed[-3].startswith("Prefill sweep auto: ")
    assert streamed[-2].startswith("I/O by store: experts ")
    assert "; prefetch hyper-reuse: timely recall " in hyper[-1], hyper[-1]
    text = lambda out: out[1 : out.index("=" * 10, 1)]  # noqa: E731
    assert text(streamed) == text(resident) == text(hyper)


def test_dtype_flag_reaches_load_and_runs(monkeypatch, capsys):
    """Issue 14: `--dtype` chooses the float dtype (auto = float32 on the CPU backend); bfloat16
    weights really load as bfloat16 and generate; an unknown value is one line, exit 2."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import hebrus_mlx.loader as U
    from hebrus_mlx.cli import main as cli_main

    seen, real = [], U.load

    def spy(path, dtype="auto", **kw):
        model, tok = real(path, dtype=dtype, **kw)
        floats = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
        seen.append((dtype, floats))
        return model, tok

    monkeypatch.setattr(U, "load", spy)
    args = ["generate", "--model", "demo", "-p", "def f(x):", "--ignore-chat-template", "-m", "4", "--verbose", "false"]
    assert cli_main([*args, "--dtype", "bfloat16"]) == 0 and capsys.readouterr().out.strip()
    assert cli_main(args) == 0 and capsys.readouterr().out.strip()
    assert seen[0][0] == "bfloat16" and seen[0][1] == {mx.bfloat16}
    assert seen[1][0] == "auto" and seen[1][1] == {mx.float32}  # the CPU backend's default
    assert cli_main([*args, "--dtype", "float64"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--dtype" in err and "Traceback" not in err
