"""Import direction: appliance/ (the UI-free core) never imports tui/; appliance's modules import each other
without any cycle; and the rooms (appliance's packages, one per stage of the data walk) import only the rooms
their ``__init__`` docstring names on its ``May import:`` line, plus the shared leaves (the top-level modules),
so the rooms form one direction: settings -> policy/model/inventory/wire -> twin -> plan -> install/proxy/... ->
views -> cli.

Every import counts, function-level ones too (a lazy import still runs, and still ties the two modules
together); only imports under ``if TYPE_CHECKING:`` are left out of the cycle check, since they never run.
Edges go to the module named (``from .pkg import mod`` -> pkg.mod when mod is a module, else pkg); the
implicit import of a parent package is not an edge.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

def modules(root: Path, package: str) -> dict:
    """{dotted name: (path, is_package)} for every .py file under root/package."""
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def _type_checking_nodes(tree: ast.AST) -> set:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports(path: Path, name: str, is_pkg: bool, known: set) -> list:
    """[(imported module, line, runs at runtime)] for every import statement in one file, relative ones
    resolved, plus importlib.import_module("literal") calls."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    pkg = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        targets: list = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        out += [(t, node.lineno, id(node) not in skip) for t in targets]
    return out


def ui_imports(root: Path) -> list:
    """'file:line imports X' for each import of tui (or anything under it) by a module of appliance/."""
    mods = modules(root, "appliance")
    return [f"{p.relative_to(root)}:{line} imports {t}"
            for m, (p, is_pkg) in mods.items() for t, line, _ in imports(p, m, is_pkg, set(mods))
            if t == "tui" or t.startswith("tui.")]


def import_graph(root: Path, package: str = "appliance") -> dict:
    """{module: {modules of the same package it imports at runtime}}."""
    mods = modules(root, package)

    def owner(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict = {m: set() for m in mods}
    for m, (p, is_pkg) in mods.items():
        for t, _, runs in imports(p, m, is_pkg, set(mods)):
            o = owner(t)
            if runs and o and o != m:
                graph[m].add(o)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    out: list = []

    def visit(v: str) -> None:       # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_core_never_imports_the_ui():
    assert ui_imports(ROOT) == []


def test_no_import_cycle_in_appliance():
    found = cycles(import_graph(ROOT))
    assert found == [], f"import cycles in appliance/: {found} (cut them: a leaf module both sides import)"


ENTRY = {"appliance", "appliance.cli", "appliance.__main__"}     # the package and the dispatcher: import anything


def rooms(root: Path) -> dict:
    """{room: set of rooms it may import}, read from each package's ``May import:`` docstring line."""
    out = {}
    for init in sorted((root / "appliance").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        lines = [ln for ln in doc.splitlines() if ln.startswith("May import:")]
        assert len(lines) == 1, f"{init.relative_to(root)}: its docstring needs one 'May import:' line"
        names = lines[0].split(":", 1)[1].strip()
        out[init.parent.name] = set() if names.startswith("(") else {n.strip() for n in names.split(",")}
    return out


def room_violations(root: Path) -> list:
    """'a.b imports c.d' for each import that crosses rooms against the declared directions, or a shared leaf
    (top-level module) that imports a room."""
    allowed = rooms(root)
    unknown = {r: deps - allowed.keys() for r, deps in allowed.items() if deps - allowed.keys()}
    assert not unknown, f"'May import:' names rooms that do not exist: {unknown}"
    out = []
    for m, deps in import_graph(root).items():
        if m in ENTRY:
            continue
        src = m.split(".")[1]
        for d in deps:
            dst = d.split(".")[1] if d.count(".") else None
            if dst is None or dst == src or d in ENTRY:
                continue
            if dst not in allowed:              # a shared leaf: every room may import it
                continue
            if src not in allowed or dst not in allowed[src]:
                out.append(f"{m} imports {d}")
    return sorted(out)


def test_the_rooms_import_only_in_their_declared_direction():
    assert room_violations(ROOT) == []
    declared = rooms(ROOT)
    assert cycles({r: deps for r, deps in declared.items()}) == [], "the declared room directions have a cycle"
    leaves = sorted(p.stem for p in (ROOT / "appliance").glob("*.py") if p.stem not in ("__init__", "__main__", "cli"))
    assert leaves == ["constants", "errors", "metric_names", "percentiles", "sdnotify", "yamlout"], \
        "the top level keeps only the entry and the shared leaves: put a new module in its room"


def test_the_dispatcher_is_imported_by_no_verb_module():
    """cli.py imports the verb groups; none imports it back (errors.py and cliargs.py are the shared leaves)."""
    graph = import_graph(ROOT)
    assert sorted(m for m, deps in graph.items() if "appliance.cli" in deps) == ["appliance.__main__"]
    assert graph["appliance.errors"] == set()
    assert "appliance.cli" not in graph["appliance.settings.cliargs"] | graph["appliance.install.cli"]


def _plant(tmp_path: Path, files: dict) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_guards_see_planted_violations(tmp_path):
    """Each check fails on a violation of the kinds it exists for: a lazy UI import, a relative cycle
    through a function-level import, an importlib call; a TYPE_CHECKING import is no cycle."""
    root = _plant(tmp_path, {
        "appliance/__init__.py": "",
        "appliance/cli.py": "def run():\n    from .install import go\n",
        "appliance/install.py": "from .cli import run\n",
        "appliance/sub/__init__.py": "",
        "appliance/sub/a.py": "from . import b\n",
        "appliance/sub/b.py": "def f():\n    import importlib\n    importlib.import_module('appliance.sub.a')\n",
        "appliance/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .cli import run\n",
        "appliance/view.py": "def show():\n    from tui.app import PdctlApp\n    import tui\n",
        "tui/__init__.py": "",
        "tui/app.py": "from appliance import cli\n",
    })
    assert ui_imports(root) == ["appliance/view.py:2 imports tui.app", "appliance/view.py:3 imports tui"]
    assert cycles(import_graph(root)) == [["appliance.cli", "appliance.install"],
                                          ["appliance.sub.a", "appliance.sub.b"]]


def test_the_room_check_sees_planted_violations(tmp_path):
    """A room importing a room it does not declare, and a shared leaf importing a room, are both caught; a
    declared import, a shared leaf and the dispatcher are not."""
    root = _plant(tmp_path, {
        "appliance/__init__.py": "",
        "appliance/cli.py": "from .low import a\nfrom .high import b\n",
        "appliance/leaf.py": "from .low import a\n",
        "appliance/low/__init__.py": '"""Low.\n\nMay import: (shared leaves only)\n"""\n',
        "appliance/low/a.py": "from ..high import b\nfrom .. import leaf\n",
        "appliance/high/__init__.py": '"""High.\n\nMay import: low\n"""\n',
        "appliance/high/b.py": "from ..low import a\nfrom .. import leaf\n",
    })
    assert rooms(root) == {"high": {"low"}, "low": set()}
    assert room_violations(root) == ["appliance.leaf imports appliance.low.a", "appliance.low.a imports appliance.high.b"]


# --- the UI's verbs come in through the entry point group, and say why when they cannot -------------
def _parser_choices(monkeypatch, eps: list):
    from appliance import cli
    monkeypatch.setattr(cli, "entry_points", lambda group: [e for e in eps if group == cli.ENTRY_POINT_GROUP])
    return cli.build_parser()


def test_the_installed_entry_point_brings_the_tui_and_the_demos_dashboard():
    from appliance.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "--screenshot" in sub.choices["tui"].format_help(), "pdctl tui is not the UI's (reinstall: pip install -e .)"
    assert sub.choices["demo"].get_default("run_ui") is not None, "the demo's dashboard was not registered"


def test_a_missing_or_broken_ui_verb_says_why(monkeypatch, capsys):
    from importlib.metadata import EntryPoint
    from appliance import cli
    _parser_choices(monkeypatch, [])
    assert cli.main(["tui"]) == 1
    assert "the tui package is not installed" in capsys.readouterr().err
    broken = EntryPoint("tui", "tui.no_such_module:register", cli.ENTRY_POINT_GROUP)
    _parser_choices(monkeypatch, [broken])
    assert cli.main(["tui", "--refresh", "1"]) == 1
    err = capsys.readouterr().err
    assert "pdctl tui: error:" in err and "tui.no_such_module:register did not load (ModuleNotFoundError" in err


def test_pdctl_tui_without_textual_names_the_package(monkeypatch, tmp_path, capsys):
    import sys
    from appliance.cli import main
    for mod in [m for m in sys.modules if m == "tui.app" or m.startswith("textual")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "textual", None)      # import textual -> ModuleNotFoundError
    assert main(["tui", "--config", str(tmp_path / "absent.toml")]) == 1
    err = capsys.readouterr().err
    assert "the dashboard needs the textual package" in err and "Traceback" not in err


@pytest.mark.parametrize("verb", ["tui", "demo"])
def test_pdctl_help_of_the_ui_verbs(verb):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "appliance.cli", verb, "--help"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and f"usage: pdctl {verb}" in r.stdout, r.stderr
