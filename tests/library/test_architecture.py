"""The shape of ``course_utils``: no import cycles, imports at the top, no private names across modules.

These hold the promises of the package's docstring: one obvious place for each thing, and a reader
who opens a module sees at its top what it depends on.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "course_utils"
# Imported lazily, where used, because the course runs without them or they are slow to import.
OPTIONAL = ("IPython", "ipywidgets", "pynvml", "matplotlib")
# Parts of torch that take about a second each to import: the functions that need them import them,
# so that ``import course_utils.checks`` (every kernel, fork server and worker) does not wait for them.
SLOW_TORCH = ("torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp",
              "torch.testing._internal.distributed")
# Imports inside a function that are the point of the function.
DELIBERATE = {("course_utils.workarounds", "torch._dynamo")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom | ast.Import, is_pkg: bool) -> list[str]:
    """The course_utils modules an import statement names (``from . import x`` names ``pkg.x``)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module if is_pkg else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = node.module or ""
        if node.level:
            target = f"{base}.{target}" if target else base
        names = [target] + [f"{target}.{a.name}" for a in node.names]
    found = []
    for n in names:
        while n and n not in MODULES:
            n = n.rpartition(".")[0] if "." in n else ""
        if n and n != module:
            found.append(n)
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_resolve(mod, node, path.name == "__init__.py"))
        graph[mod] = deps
    return graph


def test_no_import_cycles_among_course_utils_modules_counting_imports_inside_functions():
    graph = _graph()
    # The package __init__ re-exports the public names: it may import anything, and nothing may
    # import it back (that would be a cycle through the package).
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _function_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    out.append((node.lineno, "." * node.level + (node.module or "")))
    return out


def test_importing_the_checkers_leaves_the_slow_parts_of_torch_unimported():
    code = ("import sys, course_utils.checks, course_utils.measure.ch11, course_utils.measure.ch12, "
            "course_utils.measure.ch13\n"
            f"print([m for m in sys.modules if m.startswith({SLOW_TORCH!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported at import time: {out.stdout}"


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_are_at_the_top_except_optional_dependencies_with_a_reason(mod):
    path = MODULES[mod]
    lines = path.read_text().splitlines()
    bad = []
    for lineno, name in _function_imports(path):
        if (mod, name) in DELIBERATE:
            continue
        if name.split(".")[0] not in OPTIONAL and not name.startswith(SLOW_TORCH):
            bad.append(f"line {lineno}: import of {name} inside a function (move it to the top)")
            continue
        # The reason: a comment on the line, or above the block of imports it belongs to.
        i = lineno - 1
        while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
            i -= 1
        if "#" not in lines[lineno - 1] and not (i > 0 and lines[i - 1].strip().startswith("#")):
            bad.append(f"line {lineno}: lazy import of {name} without a one-line reason")
    assert not bad, f"{path.relative_to(PKG.parent)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_module_reads_another_modules_private_names(mod):
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    bad = []
    aliases: dict[str, str] = {}  # local name -> course_utils module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for target in _resolve(mod, node, path.name == "__init__.py"):
                for a in node.names:
                    if target.endswith("." + a.name):
                        aliases[a.asname or a.name] = target
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"line {node.lineno}: imports private {a.name} from {target}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            bad.append(f"line {node.lineno}: reads {node.value.id}.{node.attr}")
    assert not bad, f"{path.relative_to(PKG.parent)}:\n" + "\n".join(sorted(set(bad)))


def test_the_package_docstring_maps_every_module():
    doc = ast.get_docstring(ast.parse((PKG / "__init__.py").read_text())) or ""
    listed = set(re.findall(r"``(\w+)``", doc))
    top = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    missing = sorted(n for n in top if not n.startswith("_") and n not in listed)
    assert not missing, f"course_utils/__init__.py's module map does not list: {missing}"


def test_the_learners_package_holds_no_maintainer_tool():
    """The GPU check and the exercise generator are scripts in ``tools/``, not modules a learner imports."""
    tools = sorted(m for m in MODULES if m.rpartition(".")[2] in ("gpu_check", "exercises"))
    assert not tools, f"maintainers' tools belong in tools/, not in course_utils/: {tools}"


def test_the_launcher_package_imports_nothing_of_the_display():
    """``course_utils.workers`` takes its display from its caller: no import of ``course_utils.monitor``
    under ``course_utils/workers/``, also not inside a function, nor by name (``import_module``)."""
    graph = _graph()
    bad = []
    for mod, deps in sorted(graph.items()):
        if mod != "course_utils.workers" and not mod.startswith("course_utils.workers."):
            continue
        bad += [f"{mod} imports {d}" for d in sorted(deps)
                if d == "course_utils.monitor" or d.startswith("course_utils.monitor.")]
        for node in ast.walk(ast.parse(MODULES[mod].read_text())):
            if (isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                   and "monitor" in a.value.split(".") for a in node.args)):
                bad.append(f"{mod} line {node.lineno}: names the monitor in a call")
    assert not bad, "the launcher must take its display from its caller:\n" + "\n".join(bad)


# ---- The checker skeleton's rules (one shape for every checker) -------------------------------

CHECKER_FILES = sorted(p for p in (PKG / "checks").rglob("*.py")) + sorted((PKG / "checking").rglob("*.py"))


def _calls(path: Path, dotted: str) -> list[int]:
    """Line numbers where ``path`` calls ``dist.X``/``torch.distributed.X`` named by ``dotted``."""
    tree = ast.parse(path.read_text())
    name = dotted.rpartition(".")[2]
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and ((isinstance(n.func, ast.Attribute) and n.func.attr == name)
                 or (isinstance(n.func, ast.Name) and n.func.id == name))]


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_module_passes_600_lines(mod):
    n = len(MODULES[mod].read_text().splitlines())
    assert n <= 600, f"{MODULES[mod].relative_to(PKG.parent)} has {n} lines: split it by job (600 at most)"


def test_at_most_two_checker_files_open_a_process_group():
    files = [p.relative_to(PKG.parent).as_posix() for p in CHECKER_FILES if _calls(p, "init_process_group")]
    assert len(files) <= 2, f"these files call init_process_group (use checking.process_group()): {files}"


def _assigned_dist_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AugAssign) else [])
        for t in targets:
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id in ("dist", "c10d")):
                out.append(f"line {node.lineno}: {t.value.id}.{t.attr} = ...")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in ("dist", "c10d")):
            out.append(f"line {node.lineno}: setattr({node.args[0].id}, ...)")
    return out


def test_only_the_collective_spy_replaces_torch_distributed_functions():
    patching = {p.relative_to(PKG.parent).as_posix(): _assigned_dist_functions(p)
                for p in sorted(PKG.rglob("*.py"))}
    patching = {k: v for k, v in patching.items() if v}
    assert set(patching) <= {"course_utils/checking/spy.py"}, (
        f"replace torch.distributed functions only through checking.CollectiveSpy: {patching}")


def test_checks_package_lists_its_checkers_with_plain_imports():
    tree = ast.parse((PKG / "checks" / "__init__.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not defined, f"course_utils/checks/__init__.py defines {defined}: it only imports checkers"
    exported = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    not_checkers = [n for n in exported
                    if n.startswith(("measure", "fit_", "ring_")) or n.endswith("_verdicts")]
    assert not not_checkers, f"measurements belong in course_utils.measure, not checks: {not_checkers}"


def test_rng_state_is_saved_with_fork_rng_not_by_hand():
    bad = [f"{p.relative_to(PKG.parent)}:{i}" for p in sorted(PKG.rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if "set_rng_state(" in line]
    assert not bad, f"use torch.random.fork_rng() instead of restoring RNG state by hand: {bad}"


def test_fork_rng_names_the_generators_it_forks():
    """``fork_rng()`` without ``devices=`` forks every GPU's generator, which initialises CUDA on
    all of them (in the notebook process, before workers fork, that breaks the workers' CUDA)."""
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "fork_rng"
                    and not any(k.arg == "devices" for k in n.keywords)):
                bad.append(f"{p.relative_to(PKG.parent)}:{n.lineno}")
    assert not bad, f"pass devices=[] (CPU only) or the rank's GPU to fork_rng: {bad}"
