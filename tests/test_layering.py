"""Issue 10 / 26: one artifact model, read once; layers point one way.

format (errors, flags, artifact/*, format/*: the MLX-free config and key tables) -> admission ->
graph (models/, kernels/, the machine profile) -> streaming (stream/) -> load (loading/* with the
Hub resolver, loader, text/) -> generation (generate, sampling, the prompt cache, speculative/,
traces/, pipeline/, and the libraries the verbs sit on: convert/, verify, qualify, bench/,
simulate/, ...) -> serving (the serve/ package: the HTTP server's routes, worker, sampling and output
parsing) -> the command lines (commands/ with the flags the verbs share, the CLI). The test oracles (testing/) sit above everything: no product
module imports them (one named exception). Checked on the source (an AST scan that also sees
function-local imports, where hidden cycles live) and by importing the lower layers in a fresh
interpreter.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hebrus_mlx"

FORMAT = (
    "hebrus_mlx.errors",
    "hebrus_mlx.flags",
    "hebrus_mlx.output_files",
    "hebrus_mlx.artifact",
    "hebrus_mlx.artifact.",
    "hebrus_mlx.format",
    "hebrus_mlx.format.",
    "hebrus_mlx.pipeline.split",
)
FORMAT_R, ADMISSION_R, GRAPH_R, STREAMING_R, LOAD_R, GENERATION_R, SERVING_R, COMMANDS_R, TESTING_R = range(9)
RANKS = [  # (names, rank): "pkg." is every module below pkg, anything else one module
    (FORMAT, FORMAT_R),
    (("hebrus_mlx.admission",), ADMISSION_R),
    (
        (
            "hebrus_mlx.models",
            "hebrus_mlx.models.",
            "hebrus_mlx.kernels",
            "hebrus_mlx.kernels.",
            "hebrus_mlx.machine_profile",
        ),
        GRAPH_R,
    ),
    (("hebrus_mlx.stream", "hebrus_mlx.stream."), STREAMING_R),
    (
        (
            "hebrus_mlx.loading",
            "hebrus_mlx.loading.",
            "hebrus_mlx.loader",
            "hebrus_mlx.text",
            "hebrus_mlx.text.",
        ),
        LOAD_R,
    ),
    # Replay prefills through generate's loop; the traces verb and eval sit on replay.
    (
        (
            "hebrus_mlx.generate",
            "hebrus_mlx.sample_utils",
            "hebrus_mlx.constrain",
            "hebrus_mlx.prompt_cache",
            "hebrus_mlx.batch",
            "hebrus_mlx.batch_generate",
            "hebrus_mlx.prompt_cache_disk",
            "hebrus_mlx.perplexity",
            "hebrus_mlx.cache_prompt",
            "hebrus_mlx.speculative",
            "hebrus_mlx.speculative.",
            "hebrus_mlx.traces",
            "hebrus_mlx.traces.",
            "hebrus_mlx.pipeline",
            "hebrus_mlx.pipeline.stage",
            "hebrus_mlx.pipeline.ranks",
            "hebrus_mlx.verify",
            "hebrus_mlx.upgrade",
            "hebrus_mlx.convert",
            "hebrus_mlx.convert.",
            "hebrus_mlx.qualify",
            "hebrus_mlx.qualify_report",
            "hebrus_mlx.bench",
            "hebrus_mlx.bench.",
            "hebrus_mlx.simulate",
            "hebrus_mlx.simulate.",
        ),
        GENERATION_R,
    ),
    (("hebrus_mlx.serve", "hebrus_mlx.serve."), SERVING_R),
    (("hebrus_mlx.cli", "hebrus_mlx", "hebrus_mlx.commands", "hebrus_mlx.commands."), COMMANDS_R),
    (("hebrus_mlx.testing", "hebrus_mlx.testing."), TESTING_R),
]
# The one product use of the oracles: `hebrus-mlx qualify` runs the shipped MSL sources through the
# emulator as an opt-in check (never counted as qualified).
UP_ALLOWED = {("hebrus_mlx.qualify", "hebrus_mlx.testing.kernel_emulation")}


def _modules():
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module, node):
    """Modules of ours an import statement in `module` names (function-local ones included)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("hebrus_mlx")]
    pkg = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    if node.level:
        base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    if not base.startswith("hebrus_mlx"):
        return []
    names = [f"{base}.{a.name}" for a in node.names]
    subs = [n for n in names if n in MODULES]
    native = [n for n in names if list(ROOT.glob(n.replace(".", "/") + ".*.so"))]  # hebrus_mlx._ext
    return subs if subs else ([] if native else [base])


def import_graph():
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        deps = set()
        # `if __name__ == "__main__":` is the program's entry (python -m), not a library import.
        entry = {
            id(n)
            for top in tree.body
            if isinstance(top, ast.If) and "__main__" in ast.unparse(top.test)
            for n in ast.walk(top)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in entry:
                deps.update(d for d in _resolve(module, node) if d != module)
            elif id(node) not in entry and (name := _string_import(node)) is not None:
                deps.add(_nearest_module(name))
        graph[module] = deps
    return graph


def _string_import(node):
    """`importlib.import_module("hebrus_mlx.x")` with a literal name: an import the statement scan
    would miss (the verbs' dispatch in cli.py names its modules through a table, not a literal)."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        arg = node.args[0].value
        if name == "import_module" and isinstance(arg, str) and arg.startswith("hebrus_mlx"):
            return arg
    return None


def _nearest_module(name):
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def test_string_imports_are_counted():
    """Control: a literal import_module of one of ours is an edge of the graph, so hiding an import
    in a string (as six modules once did for hebrus_mlx.generate) cannot hide a cycle."""
    tree = ast.parse('import importlib\nm = importlib.import_module("hebrus_mlx.serve.app")')
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call))
    assert _string_import(call) == "hebrus_mlx.serve.app"
    assert _string_import(ast.parse('import_module("numpy")').body[0].value) is None


def _verb_modules():
    """The module behind each `hebrus-mlx` verb (cli.VERBS), read from the source: no import."""
    tree = ast.parse((PKG / "cli.py").read_text())
    table = next(
        n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "VERBS"
    )
    return {v.value for v in table.values}


def test_a_verb_never_imports_another_verb():
    """Each verb sits on the library and the shared flags (commands/verb_flags, commands/cli_args),
    never on another verb's module (bench once took a flag parser from the traces verb)."""
    verbs = _verb_modules()
    assert "hebrus_mlx.commands.generate" in verbs and "hebrus_mlx.commands.bench" in verbs
    graph = import_graph()
    bad = sorted((m, d) for m in verbs for d in graph.get(m, ()) if d in verbs and d != m)
    assert bad == []


def test_traces_never_import_bench():
    graph = import_graph()
    assert sorted((m, d) for m, deps in graph.items() if m.startswith("hebrus_mlx.traces") for d in deps
                  if d.startswith("hebrus_mlx.bench")) == []  # fmt: skip


def _rank(module):
    ranks = {rank for names, rank in RANKS for n in names if module == n or (n.endswith(".") and module.startswith(n))}
    assert len(ranks) == 1, f"{module} is in layers {ranks}: give it exactly one"
    return ranks.pop()


def test_no_import_cycles_even_through_function_local_imports():
    graph = import_graph()
    assert {"hebrus_mlx.admission", "hebrus_mlx.loading.build_model", "hebrus_mlx.stream.experts"} <= set(graph)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_scan_sees_a_planted_cycle(tmp_path, monkeypatch):
    """Control: the scan is not vacuous - a function-local import back up is a cycle."""
    graph = import_graph()
    graph["hebrus_mlx.artifact.constants"] = graph["hebrus_mlx.artifact.constants"] | {"hebrus_mlx.loading.build_model"}
    reach, todo = set(), ["hebrus_mlx.loading.build_model"]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in reach:
                reach.add(w)
                todo.append(w)
    assert "hebrus_mlx.loading.build_model" in reach


def _up_edges(graph):
    return sorted(
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if d in MODULES and _rank(d) > _rank(m) and (m, d) not in UP_ALLOWED
    )


def test_layers_point_one_way():
    assert {_rank(m) for m in MODULES} == set(range(9))  # every module has exactly one layer
    assert _up_edges(import_graph()) == []


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("hebrus_mlx.artifact.manifest", "hebrus_mlx.models.qwen4exp"),  # format reads the graph's config
        ("hebrus_mlx.admission", "hebrus_mlx.models.cache"),  # admission reaches into the graph
        ("hebrus_mlx.kernels.hc_mix", "hebrus_mlx.testing.msl_emulator"),  # a kernel imports the emulator
        ("hebrus_mlx.models.qwen4exp", "hebrus_mlx.testing.tiny_configs"),  # the graph imports test configs
        ("hebrus_mlx.stream.streaming", "hebrus_mlx.testing.stream_reference"),
        ("hebrus_mlx.speculative.drafters", "hebrus_mlx.testing.drafters"),
        ("hebrus_mlx.models.qwen4exp", "hebrus_mlx.stream.streaming"),  # the graph past its protocol
        ("hebrus_mlx.stream.engine", "hebrus_mlx.loader"),  # streaming reaches up into load
        ("hebrus_mlx.loader", "hebrus_mlx.generate"),  # load reaches up into generation
        ("hebrus_mlx.generate", "hebrus_mlx.serve.app"),  # generation reaches up into serving
        ("hebrus_mlx.serve.worker", "hebrus_mlx.commands.server"),  # serving reaches up into a verb's CLI
    ],
)
def test_each_layer_violation_fails(importer, imported):
    """Control: the ranks separate format, admission, graph, streaming, load, generation, serving and
    the command lines, so each of these imports (the boundaries issue 26 names) would be an upward
    edge."""
    graph = import_graph()
    graph[importer] = graph[importer] | {imported}
    assert (importer, imported) in _up_edges(graph)


def test_oracles_only_for_tests():
    """No product module imports hebrus_mlx.testing (but qualify's opt-in emulation check)."""
    users = sorted(
        (m, d)
        for m, deps in import_graph().items()
        for d in deps
        if d.startswith("hebrus_mlx.testing") and not m.startswith("hebrus_mlx.testing")
    )
    assert set(users) == UP_ALLOWED


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            yield f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def test_no_flag_definitions_below_the_verbs():
    """argparse flags are defined by the verbs (commands/), never in graph, streaming or load."""
    bad = []
    for m, path in MODULES.items():
        if _rank(m) in (GRAPH_R, STREAMING_R, LOAD_R):
            tree = ast.parse(path.read_text())
            names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            if "argparse" in names or "add_argument" in set(_calls(tree)):
                bad.append(m)
    assert bad == []


# Outside hebrus_mlx/commands/: the `hebrus-mlx` entry point (cli: it dispatches to the verbs), and
# flags, whose range-checked value types are argparse `type=` callables (their BadValue is an
# argparse.ArgumentTypeError, so argparse shows its message as it is). The library parses with
# them too (simulate.run's and qualify_report's comma-separated lists; loading.plan, generate and
# serve.api_fields take their bounds), so they sit in the format layer; flags builds no parser.
CLI_OUTSIDE_COMMANDS = {"hebrus_mlx.cli", "hebrus_mlx.flags"}


def _command_line(tree) -> list:
    """What makes a module a command line: importing argparse, or a top-level `main`."""
    found = [
        f"import {a.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name.split(".")[0] == "argparse"
    ]
    found += [
        f"from {n.module} import" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "argparse"
    ]
    found += [f"def {n.name}" for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    return found


def test_library_modules_hold_no_command_line():
    """argparse and each verb's `main(argv)` live in hebrus_mlx/commands/ (cli.VERBS), as in mlx-lm
    the library (generate, verify, qualify, simulate, ...) has none."""
    assert _command_line(ast.parse("import argparse\ndef main(argv=None):\n    pass")) == [
        "import argparse",
        "def main",
    ]
    bad = {
        m: found
        for m, path in MODULES.items()
        if not m.startswith("hebrus_mlx.commands") and m not in CLI_OUTSIDE_COMMANDS
        if (found := _command_line(ast.parse(path.read_text())))
    }
    assert bad == {}
    verbs = _verb_modules()
    assert verbs and all(v.startswith("hebrus_mlx.commands.") for v in verbs), sorted(verbs)


def test_the_product_executes_no_source_file():
    """Nothing in the package loads a script by path (simulate once exec'd benchmarks/bench_stream.py)."""
    bad = [
        m
        for m, path in MODULES.items()
        if {"spec_from_file_location", "exec_module", "run_path", "exec"} & set(_calls(ast.parse(path.read_text())))
    ]
    assert bad == []


def test_verbs_chat_and_server_are_leaves():
    """Nothing imports the chat or server verb modules (chat once took its flags from server)."""
    verbs = {"hebrus_mlx.commands.chat", "hebrus_mlx.commands.server"}
    users = sorted(m for m, deps in import_graph().items() if deps & verbs)
    assert users == []


LOWER = [
    "hebrus_mlx.errors",
    "hebrus_mlx.cli",
    "hebrus_mlx.admission",
    "hebrus_mlx.verify",
    "hebrus_mlx.commands.verify",
    "hebrus_mlx.commands.cli_args",
    "hebrus_mlx.loading.plan",
    "hebrus_mlx.stream.errors",
] + sorted(m for m in MODULES if m.startswith(FORMAT))


def test_format_and_admission_import_no_mlx():
    code = (
        "import importlib, json, sys\n"
        "for m in sys.argv[1:]: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm')))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *LOWER],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert json.loads(out.stdout) == []
    assert "hebrus_mlx.artifact.manifest" in LOWER and "hebrus_mlx.artifact.safetensors" in LOWER


# ---- one artifact model, read once --------------------------------------------------------------


def _opened(monkeypatch):
    import builtins

    seen = []
    real = builtins.open

    def spy(file, *a, **k):
        seen.append(os.path.basename(str(file)))
        return real(file, *a, **k)

    monkeypatch.setattr(builtins, "open", spy)
    return seen


def test_load_reads_manifest_and_config_once(monkeypatch):
    """The loader, the streamed experts and PLE use admission's Manifest object: manifest.json and
    config.json are opened once each (by admission), even with experts and PLE streamed."""
    from hebrus_mlx.loader import DEMO_DIR, load_model

    seen = _opened(monkeypatch)
    model = load_model(DEMO_DIR, expert_cache_gb=0.001, ple_cache_gb=2 * 65536 / 2**30)
    assert model.streaming is not None and model.streaming.experts is not None
    assert seen.count("manifest.json") == 1 and seen.count("config.json") == 1, seen


def _rchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux /proc/self/io")
def test_verify_reads_each_store_once():
    """verify's record/page checks feed the whole-file digest: the bytes read are about one pass over
    the stores (two passes were 1.7x on the demo)."""
    from hebrus_mlx.loader import DEMO_DIR
    from hebrus_mlx.verify import verify

    total = sum(p.stat().st_size for p in DEMO_DIR.iterdir())
    before = _rchar()
    verify(str(DEMO_DIR), stream=open(os.devnull, "w"))
    read = _rchar() - before
    assert total <= read < 1.15 * total, (read, total)


def test_product_family_registry_holds_only_the_real_family_and_the_demo():
    """Test-only descriptors (tiny, parity, bulk) are registered by tests/support/families.py, not shipped."""
    code = (
        "import json; from hebrus_mlx.artifact import constants as C; "
        "print(json.dumps([sorted(C.FAMILIES), sorted(C.FAMILIES_BY_ID)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    names, ids = json.loads(out.stdout)
    assert names == ["qwen3.8-flash-next", "qwen4exp-demo"] and ids == [4, 0xDE70]


def test_register_family_refuses_a_clash():
    import dataclasses

    from hebrus_mlx.artifact import constants as C
    from hebrus_mlx.artifact.errors import FamilyError

    assert C.register_family(C.QWEN4EXP_DEMO) is C.QWEN4EXP_DEMO  # identical: no-op
    with pytest.raises(FamilyError, match="already registered"):
        C.register_family(dataclasses.replace(C.QWEN4EXP_DEMO, hidden_size=256))
    with pytest.raises(FamilyError, match="already registered"):
        C.register_family(dataclasses.replace(C.QWEN4EXP_DEMO, name="other"))  # same id
    assert C.FAMILIES["qwen4exp-demo"] is C.QWEN4EXP_DEMO


def test_load_reads_every_source_file_once(monkeypatch):
    """load("demo"): admission reads each source identity file once and checks its digest; the
    graph and the tokenizer use those bytes (no check-then-use window on tokenizer files either)."""
    from hebrus_mlx.loader import load

    seen = _opened(monkeypatch)
    model, tok = load("demo")
    assert tok.chat_template is not None and tok.stop_token_ids
    for name in (
        "manifest.json",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        assert seen.count(name) == 1, (name, seen)


# Compiled extension modules, imported from the package itself: their names start with "_" by
# convention, they are not private names (reaching one through another module's global is).
EXTENSIONS = {"_ext", "_hash", "_bench", "_testing"}


def private_uses(root: Path, package: str = "hebrus_mlx") -> list:
    """(module, name) for every private name one module takes from another of the package:
    `from pkg.mod import _x` and `mod._x` on an imported package module (issue 35 §1: the calls
    into other modules' private names became a small public surface)."""
    files = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    found = []
    for name, p in files.items():
        tree = ast.parse(p.read_text())
        here = name if p.name == "__init__.py" else name.rpartition(".")[0]
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if not base.startswith(package):
                    continue
                for a in node.names:
                    if f"{base}.{a.name}" in files:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif _private(a.name) and not (base == package and a.name in EXTENSIONS):
                        found.append((name, f"{base}.{a.name}"))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(package) and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                attr, target = node.attr, aliases[node.value.id]
                if _private(attr) and target != name and not (target == package and attr in EXTENSIONS):
                    found.append((name, f"{target}.{attr}"))
    return sorted(set(found))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_names():
    assert private_uses(PKG) == []


def test_the_private_name_scan_sees_both_spellings(tmp_path):
    """Control: a planted `from .a import _x` and `a._y` are both found; extensions are not."""
    pkg = tmp_path / "hebrus_mlx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_x = 1\n_y = 2\n")
    (pkg / "b.py").write_text(
        "from .a import _x\nfrom . import a\nfrom hebrus_mlx import _ext\nz = a._y + _x + a._ext\n"
    )
    assert private_uses(pkg) == [
        ("hebrus_mlx.b", "hebrus_mlx.a._ext"),
        ("hebrus_mlx.b", "hebrus_mlx.a._x"),
        ("hebrus_mlx.b", "hebrus_mlx.a._y"),
    ]
