"""A route trace recorded the way a user records one: `hebrus-mlx generate --trace-out DIR` on the
shipped demo, greedy, quiet. Shared by the traces and simulate tests."""

from hebrus_mlx import cli


def generate_demo_trace(out, max_tokens) -> None:
    """Record `max_tokens` greedy tokens of the demo after "def f(x):" (no chat template) into `out`."""
    argv = ["generate", "--model", "demo", "-p", "def f(x):", "--ignore-chat-template", "-m", str(max_tokens)]
    assert cli.main([*argv, "--trace-out", str(out), "--verbose", "false"]) == 0
