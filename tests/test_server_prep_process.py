"""Issue 22 §3: a big request is rendered and tokenized in the server's prep process
(prep_process.py), so the event loop never shares a GIL with it. Same IDs and the same typed
4xx errors as the in-process path; the child exits with the server, by SIGTERM or SIGKILL.

Provenance (AFN-014): every request here is a contract control written in this file.
"""

import multiprocessing
import signal
import time
from pathlib import Path

import mlx.core  # noqa: F401  (the server module needs MLX first)
import pytest
from support.scripted_server import scripted_worker, serving
from test_server_hardening import SHUTDOWN, _chat, _request, _start, _stop

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]
CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}]},
    {"messages": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Bonjour é ✓"}]},
    {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ],
        "tools": TOOLS,
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "two"}]}
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    {"messages": [{"role": "user", "content": "think"}], "chat_template_kwargs": {"enable_thinking": True}},
    {"messages": [{"role": "user", "content": "long ünïcode text 🙂 " * 150}]},
]
BAD_CHATS = [
    {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": []},
]


def _tok():
    from hebrus_mlx.loader import DEMO_DIR
    from hebrus_mlx.text.tokenizer import load_tokenizer

    return load_tokenizer(DEMO_DIR, 4224)


def _no_in_process(tok):
    """`tok` whose own render/encode fail: a 200 through it proves the prep process did the work."""

    def refuse(*a, **k):
        raise AssertionError("prepared in-process")

    tok.apply_chat_template = tok.encode = refuse
    return tok


def _serve_all(tok, **app_kwargs):

    def emit(job):
        job.emit(("text", "ok"))
        job.emit(("done", "stop"))

    worker = scripted_worker(tok, emit)
    answers = []
    with serving(worker, **app_kwargs) as port:
        where = {"port": port}
        for body in CHATS + BAD_CHATS:
            answers.append(_chat(where, dict(body, max_tokens=1), key=None))
        for prompt in ("plain <|im_start|> text", "x" * 3000):
            answers.append(_request(where, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1}, key=None))
        answers.append(
            _request(
                where,
                "POST",
                "/v1/responses",
                {"instructions": "Be terse.", "input": "Hello", "max_output_tokens": 1, "store": False},
                key=None,
            )
        )
        children = multiprocessing.active_children()
    return worker.seen, answers, children


def test_the_prep_process_gives_the_in_process_ids_and_errors():
    thread_ids, thread_answers, _ = _serve_all(_tok())  # App's default: no prep process
    proc_ids, proc_answers, children = _serve_all(_no_in_process(_tok()), prep_process_bytes=1)
    assert children, "no prep process ran"
    assert len(thread_ids) == len(CHATS) + 3 and all(thread_ids)
    assert proc_ids == thread_ids
    statuses = [a[0] for a in thread_answers]
    assert statuses == [200] * len(CHATS) + [400] * len(BAD_CHATS) + [200] * 3, thread_answers
    for t, p in zip(thread_answers, proc_answers):  # same status, same typed error naming the field
        if t[0] == 200:
            assert p[0] == 200
        else:
            assert p == t


def test_a_hostile_template_in_the_prep_process_is_the_same_typed_4xx():

    tok = _no_in_process(_tok())
    tok.chat_template = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"

    def emit(job):
        job.emit(("text", "ok"))
        job.emit(("done", "stop"))

    with serving(scripted_worker(tok, emit), prep_process_bytes=1) as port:
        status, err = _chat({"port": port}, {"messages": [{"role": "user", "content": "hi"}]}, key=None)
        assert status == 400 and "TemplateLimits" in err["error"]["message"], err
        assert err["error"]["type"] == "invalid_request_error"


def _children(pid):
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def _gone(pid, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped by its (dead) parent's reaper
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_the_prep_process_exits_with_the_server(tmp_path, how):
    """No orphan: the child is killed at a clean shutdown, and leaves on its own when the server is
    SIGKILLed (it watches its parent)."""
    srv = _start(tmp_path, [])
    try:
        deadline = time.monotonic() + 60
        while not (kids := _children(srv["proc"].pid)):
            assert time.monotonic() < deadline, "no prep process started"
            time.sleep(0.1)
        assert _chat(srv, {"messages": [{"role": "user", "content": "hi " * 40000}], "max_tokens": 1}, key=None)[0] in (
            200,
            400,
        )
        srv["proc"].send_signal(getattr(signal, how))
        assert srv["proc"].wait(SHUTDOWN + 30) is not None
        assert all(_gone(k, 5.0) for k in kids), (how, kids)
    finally:
        _stop(srv)


def test_typed_errors_pickle_as_they_are():
    """The child sends its errors back pickled: class, field, message and str survive, whatever the
    subclass's __init__ takes (ConfigError prefixes `config.`)."""
    import pickle

    from hebrus_mlx.format.qwen4exp_config import ConfigError
    from hebrus_mlx.serve.api_fields import RequestError
    from hebrus_mlx.text.chat_template import TemplateLimitError
    from hebrus_mlx.text.tokenizer import TokenizerError

    for e in (
        ConfigError("x", "bad"),
        TemplateLimitError("stopped (TemplateLimits)"),
        TokenizerError("tokenizer_config.eos_token", "no"),
        RequestError("m", "p", 413, "k"),
    ):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.__dict__ == e.__dict__


def test_a_dead_prep_process_is_replaced():
    """A child killed mid-service (e.g. for memory) is replaced; the next big request is served."""

    def emit(job):
        job.emit(("text", "ok"))
        job.emit(("done", "stop"))

    with serving(scripted_worker(_no_in_process(_tok()), emit), prep_process_bytes=1) as port:
        where = {"port": port}
        assert _chat(where, CHATS[0], key=None)[0] == 200
        first = multiprocessing.active_children()
        assert first
        for p in first:
            p.kill()
            p.join(10)
        time.sleep(1.0)  # the pool notices its child is gone
        statuses = [_chat(where, CHATS[0], key=None)[0] for _ in range(2)]
        assert statuses == [200, 200], statuses
        assert {p.pid for p in multiprocessing.active_children()} - {p.pid for p in first}
