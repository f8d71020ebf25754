"""Issue 22 §2: a chat template is untrusted code; every render is bounded in steps (loop
iterations, calls, operators), time, and the size of its output and of every value it builds
(text/chat_template.py TemplateLimits). A hostile template ends in a TemplateError naming the limit, at the
CLI in one line (exit 2), never a hang, a memory blow-up or a traceback (the OverflowError of
Jinja's range guard included).

Provenance (AFN-014): the hostile templates are contract controls written here; the demo artifact
copy gets one of them with a matching manifest digest (digest-valid, as the issue's case).
"""

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hebrus_mlx.loader import DEMO_DIR
from hebrus_mlx.text.chat_template import ChatRenderer, TemplateError, qwen_template

ROOT = Path(__file__).resolve().parents[1]
M = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "nested_loops": "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    "nested_silent": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "range_overflow": "{{ range(10**10) }}",
    "str_times": "{{ 'a' * 10**10 }}",
    "doubling_tilde": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling_plus": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "join_of_refs": "{% set big = 'a' * 1000000 %}{{ ([big] * 100000)|join }}",
    "print_of_refs": "{% set big = 'a' * 1000000 %}{{ [big] * 100000 }}",
    "macro_buffer": "{% macro m() %}{% for i in range(100000) %}{{ big }}{% endfor %}{% endmacro %}"
    "{% set big = 'a' * 1000000 %}{% set x = m() %}{{ x|length }}",
    "center": "{{ 'a'.center(10**9) }}",
    "center_filter": "{{ 'a'|center(10**9) }}",
    "replace": "{% set s = 'a' * 100000 %}{{ s.replace('', s) }}",
    "replace_filter": "{% set s = 'a' * 100000 %}{{ s|replace('', s) }}",
    "pow": "{{ 2 ** 100000000 }}",
    "percent_width": "{{ '%1000000000s' % 'x' }}",
    "format_width": "{{ '{:1000000000}'.format('x') }}",
    "macro_recursion": "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}",
    "loop_recursion": "{% for m in messages recursive %}{{ loop([m]) }}{% endfor %}",
    "type_error": "{{ 1 + 'a' }}",
    "tojson_indent": "{{ messages|tojson(indent=10**9) }}",
    "indent": "{% set s = '\\n' * 100000 %}{{ s|indent(100000) }}",
    "expandtabs": "{% set s = '\\t' * 100000 %}{{ s.expandtabs(100000) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_a_typed_error_quickly(name):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tic = time.monotonic()
    with pytest.raises(TemplateError) as e:
        ChatRenderer(HOSTILE[name]).render(M)
    assert time.monotonic() - tic < 10
    assert e.value.field == "chat_template" and "chat template" in e.value.message
    # KiB; the cap is 16 Mi characters: a few of them at most, never gigabytes.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 << 10


def test_limits_keep_a_large_legit_conversation():
    """The shipped template over 2000 turns and a 4 MB message renders unchanged by the limits."""
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(1000):
        msgs += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    msgs.append({"role": "user", "content": "x" * (4 << 20)})
    r = ChatRenderer(qwen_template()).render(msgs)
    assert r.text.endswith("<|im_start|>assistant\n") and r.text.count("<|im_start|>user") == 1001


_CHILD = """
import resource, subprocess, sys
r = subprocess.run([sys.executable, "-m", "hebrus_mlx.cli", *sys.argv[1:]], capture_output=True, text=True)
print(r.returncode)
print(r.stderr, end="")
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.mark.parametrize("name", ["nested_loops", "range_overflow"])
def test_generate_with_a_digest_valid_hostile_template_is_one_line(tmp_path, name):
    """Today: nested loops grow `generate` past 4 GB and hang; the range guard's OverflowError is
    a traceback. Both: one line naming the chat template, exit 2, bounded memory."""
    d = tmp_path / "model"
    shutil.copytree(DEMO_DIR, d)
    data = HOSTILE[name].encode()
    (d / "chat_template.jinja").write_bytes(data)
    m = json.loads((d / "manifest.json").read_text())
    m["source"]["files"]["chat_template.jinja"] = hashlib.sha256(data).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, "generate", "--model", str(d), "-p", "hi", "-m", "2", "--verbose", "false"],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    rc, *err, rss_kib = r.stdout.splitlines()
    assert rc == "2" and len(err) == 1 and "Traceback" not in r.stdout, r.stdout
    assert err[0].startswith("hebrus-mlx generate: error: chat_template: chat template "), err
    assert int(rss_kib) < 2 << 20  # < 2 GiB (the model and MLX included)


# -- the template's size cap, wherever the template comes from (issue 22 §2, audit) ----------------


def _checkpoint(tmp_path, **files):
    d = tmp_path / "ckpt"
    d.mkdir(parents=True)
    shutil.copy(DEMO_DIR / "tokenizer.json", d / "tokenizer.json")
    for name, data in files.items():
        (d / name.replace("__", ".")).write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return d


BIG = "{# " + "x" * (2 << 20) + " #}hi"  # 2 MiB: over the 1 MiB template cap, under tokenizer_config's 16 MiB


@pytest.mark.parametrize("form", ["string", "named_list"])
def test_template_inside_tokenizer_config_has_the_template_cap(tmp_path, form):
    """Embedded in tokenizer_config.json a template escaped the template cap (only the 16 MiB cap of
    its container applied): now it is refused naming the field and the cap, before any render."""
    from hebrus_mlx.text.tokenizer import TokenizerError, load_tokenizer

    tpl = BIG if form == "string" else [{"name": "default", "template": BIG}]
    d = _checkpoint(tmp_path, tokenizer_config__json={"chat_template": tpl})
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(d, 1 << 20)
    assert e.value.field.endswith("tokenizer_config.json.chat_template"), e.value.field
    assert "template cap of 1 MiB" in e.value.message


def test_template_file_and_override_have_the_template_cap(tmp_path):
    from hebrus_mlx.artifact.untrusted import UntrustedFileError
    from hebrus_mlx.text.tokenizer import TokenizerError, load_tokenizer

    d = _checkpoint(tmp_path, chat_template__jinja=BIG.encode())
    with pytest.raises(UntrustedFileError, match="template cap of 1 MiB"):
        load_tokenizer(d, 1 << 20)
    d2 = _checkpoint(tmp_path / "2", tokenizer_config__json={"chat_template": "{{ 'ok' }}"})
    with pytest.raises(TokenizerError, match="template cap of 1 MiB"):
        load_tokenizer(d2, 1 << 20, chat_template=BIG)
    assert load_tokenizer(d2, 1 << 20).chat_template == "{{ 'ok' }}"  # a small one still loads


# -- the time budget holds inside one costly filter call (issue 22 §2, audit) ----------------------

COSTLY = {
    "wordwrap_4mb": "{% set s = 'a b ' * 1000000 %}{{ s|wordwrap(3)|length }}",
    "wordwrap_loop": "{% set s = 'a b ' * 50000 %}{% for i in range(100) %}{{ s|wordwrap(3)|length }}{% endfor %}",
    "urlize_loop": "{% set s = 'ab ' * 30000 %}{% for i in range(1000) %}{{ s|urlize|length }}{% endfor %}",
    "striptags": "{% set s = '<a>b ' * 200000 %}{{ s|striptags|length }}",
    "sort_chars": "{% set s = 'ab ' * 1000000 %}{{ s|sort|length }}",
    "title_loop": "{% set s = 'ab ' * 300000 %}{% for i in range(100) %}{{ s|title|length }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(COSTLY))
def test_costly_filters_stay_inside_the_time_budget(name):
    """`wordwrap` on a 4 MB string ran ~16 s in one call, past the 5 s budget (checked only between
    steps). Now such a call is charged per element and refused before it would pass the deadline;
    the bound is relative to the budget: within max_seconds plus half a second of slack."""
    from hebrus_mlx.text.chat_template import TemplateLimitError, TemplateLimits

    limits = TemplateLimits(max_seconds=1.0)
    tic = time.monotonic()
    with pytest.raises(TemplateLimitError):
        ChatRenderer(COSTLY[name], limits=limits).render(M)
    assert time.monotonic() - tic < limits.max_seconds + 0.5


def test_both_render_passes_share_one_time_budget(monkeypatch):
    """render() runs the template twice (plain and provenance-tracked): the budget covers both, so
    a template taking ~0.5 of it per pass but 1.0 for the render is stopped in the second pass.

    The clock is injected (it advances one unit per reading), so the test counts budget checks
    and does not depend on the machine's speed; per-pass deadlines would let this render finish."""
    from types import SimpleNamespace

    from hebrus_mlx.text import chat_template
    from hebrus_mlx.text.chat_template import TemplateLimitError, TemplateLimits

    readings = [0]

    def monotonic():
        readings[0] += 1
        return float(readings[0])

    monkeypatch.setattr(chat_template, "time", SimpleNamespace(monotonic=monotonic))
    template = "{% for i in range(400) %}x{% endfor %}"
    ChatRenderer(template, limits=TemplateLimits(max_seconds=1e9)).render(M)
    both = readings[0]  # clock readings of one whole render: both passes
    assert both > 800  # every loop step reads the clock, in each pass
    readings[0] = 0
    with pytest.raises(TemplateLimitError, match="rendering took more than"):
        ChatRenderer(template, limits=TemplateLimits(max_seconds=0.75 * both)).render(M)
    assert 0.75 * both < readings[0] <= both  # stopped in the second pass, at the shared deadline
