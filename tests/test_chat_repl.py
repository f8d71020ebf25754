"""`hebrus-mlx chat` driven through stdin: replies equal in-process generation over the same
provenance-safe IDs, turn 2 restores turn 1 (prompt + reply) instead of prefilling it, /reset
forgets the conversation, a bad turn prints one error line and the session goes on."""

import io
import re

import pytest
from support.verb_loading import patch_load_from_args

from hebrus_mlx import load, stream_generate
from hebrus_mlx.cli import main as cli_main
from hebrus_mlx.commands import chat


@pytest.fixture(scope="module")
def demo():
    return load("demo")


def _run(monkeypatch, capsys, demo, stdin, *argv):
    patch_load_from_args(monkeypatch, lambda *a, **k: demo)
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert chat.main(["--model", "demo", *argv]) == 0
    return capsys.readouterr().out


def _reference(demo, messages, n):
    model, tok = demo
    return "".join(r.text for r in stream_generate(model, tok, tok.apply_chat_template(messages), max_tokens=n))


def test_turns_reset_and_prefix_reuse(monkeypatch, capsys, demo):
    out = _run(
        monkeypatch,
        capsys,
        demo,
        "Open a file.\nClose it.\n/reset\nOpen a file.\n",
        "--max-tokens",
        "10",
        "--system-prompt",
        "Be brief.",
    )
    stats = [
        tuple(map(int, m))
        for m in re.findall(
            r"\[prompt: (\d+) tokens \((\d+) cached, \d+ prefilled.*?"
            r"generation: (\d+) tokens",
            out,
        )
    ]
    assert len(stats) == 3
    sys_msg = [{"role": "system", "content": "Be brief."}]
    t1 = _reference(demo, sys_msg + [{"role": "user", "content": "Open a file."}], 10)
    t2 = _reference(
        demo,
        sys_msg
        + [
            {"role": "user", "content": "Open a file."},
            {"role": "assistant", "content": t1},
            {"role": "user", "content": "Close it."},
        ],
        10,
    )
    replies = [line[3:] for line in out.splitlines() if line.startswith(">> ") and not line.startswith(">> [")]
    assert replies[:2] == [t1.split("\n")[0], t2.split("\n")[0]]
    assert t1 in out and t2 in out
    (p1, c1, g1), (p2, c2, _), (p3, c3, _) = stats
    assert c1 == 0 and c2 == p1 + g1  # turn 2 restores turn 1's prompt and reply
    assert "conversation cleared" in out and p3 == p1 and c3 == p1 - 1  # after /reset: the first prompt again


def test_bad_turn_is_one_line_and_session_continues(monkeypatch, capsys, demo):
    long = "word " * 5000  # beyond the demo's 4096-token context
    out = _run(monkeypatch, capsys, demo, long + "\nhello\n", "--max-tokens", "3", "--verbose", "false")
    errors = [line for line in out.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "context" in errors[0]
    assert _reference(demo, [{"role": "user", "content": "hello"}], 3) in out


def test_bad_flag_exits_2(capsys):
    assert cli_main(["chat", "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
