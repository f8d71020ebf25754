"""Issue 24 §4: `hebrus-mlx cache-prompt` + `generate --prompt-cache-file` (mlx-lm's pair)."""

import pytest

from hebrus_mlx.cache_prompt import cached_prompt_ids, continuation_ids
from hebrus_mlx.cli import main as cli_main

DOC = "Here is a long document about files and paths. "


@pytest.fixture(scope="module")
def demo():
    from hebrus_mlx import load

    return load("demo")


def _cli(verb, f, *args, quiet=True):
    """`hebrus-mlx VERB --prompt-cache-file F ARGS` (with `--verbose false`): its exit code."""
    return cli_main([verb, "--prompt-cache-file", str(f), *args, *(["--verbose", "false"] if quiet else [])])


def test_generate_continues_the_cached_prompt(demo, tmp_path, capsys):
    from hebrus_mlx import stream_generate

    model, tok = demo
    f = tmp_path / "doc.safetensors"
    assert _cli("cache-prompt", f, "--prompt", DOC, "--system-prompt", "Be brief.") == 0
    assert _cli("generate", f, "--prompt", "Summarize it.", "--max-tokens", "12") == 0
    out = capsys.readouterr().out
    # The same IDs in one in-process run: the cached prefix (system + open user message) + the rest.
    head = cached_prompt_ids(tok, DOC, "Be brief.")
    tail = continuation_ids(tok, "Summarize it.")
    full_msg = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": DOC + "Summarize it."}]
    )
    assert full_msg[: len(head)] == head and full_msg[-3:] == tail[-3:]  # the template's structure around both
    want = "".join(r.text for r in stream_generate(model, tok, head + tail, max_tokens=12))
    assert out == want + "\n"


def test_plain_text_mode_and_refusals(demo, tmp_path, capsys, monkeypatch):
    from hebrus_mlx import stream_generate

    model, tok = demo
    f = tmp_path / "plain.safetensors"
    assert _cli("cache-prompt", f, "--prompt", "def read(path):\n", "--ignore-chat-template") == 0
    assert _cli("generate", f, "--prompt", "    with open", "--ignore-chat-template", "--max-tokens", "8") == 0
    ids = tok.encode("def read(path):\n") + tok.encode("    with open", add_special_tokens=False)
    assert capsys.readouterr().out == "".join(r.text for r in stream_generate(model, tok, ids, max_tokens=8)) + "\n"
    # The other mode, a system prompt, and a file of another artifact: one line each, exit 2.
    assert _cli("generate", f, "--prompt", "x", quiet=False) == 2
    assert "--ignore-chat-template" in capsys.readouterr().err
    assert _cli("generate", f, "--prompt", "x", "--ignore-chat-template", "--system-prompt", "s", quiet=False) == 2
    assert "--system-prompt" in capsys.readouterr().err
    import hebrus_mlx.prompt_cache as pcm

    monkeypatch.setattr(pcm, "model_artifact_digest", lambda model: "0" * 64)
    g = tmp_path / "foreign.safetensors"
    assert cli_main(["cache-prompt", "--prompt", "x", "--prompt-cache-file", str(g), "--verbose", "false"]) == 0
    monkeypatch.undo()
    assert cli_main(["generate", "--prompt-cache-file", str(g), "--prompt", "y"]) == 2
    err = capsys.readouterr().err
    assert "artifact_digest" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["cache-prompt", "--prompt", "x"]) == 2  # the file is required
    assert "--prompt-cache-file" in capsys.readouterr().err
    assert cli_main(["cache-prompt", "--prompt", "x", "--prompt-cache-file", str(g), "--temp", "0.5"]) == 2
    assert "--temp: not supported by `hebrus-mlx cache-prompt`" in capsys.readouterr().err
