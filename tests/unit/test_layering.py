"""House rules from ARCHITECTURE.md "Layers and folders", checked on the source text (no imports)."""
import ast
from pathlib import Path

HSGD = Path(__file__).resolve().parents[2] / "hsgd"


def _sources():
    files = sorted(HSGD.rglob("*.py"))
    assert files, f"no sources found under {HSGD}"
    return files


def _ray_imports(path):
    """(line, text) for every `import ray[...]`, `from ray[...] import`, or importlib/__import__ of ray."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "ray"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "ray":
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(target, str) and target.split(".")[0] == "ray":
                found.append((node.lineno, f"{name}({target!r})"))
    return found


def test_hsgd_package_never_imports_ray():
    offenders = [f"{p.relative_to(HSGD.parent)}:{line}: {text}" for p in _sources() for line, text in _ray_imports(p)]
    assert not offenders, ("layering rule broke: hsgd/ must be importable and testable without Ray "
                           "(decisions live in hsgd, actors carry them out):\n" + "\n".join(offenders))


def test_layering_scan_detects_ray_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nimport ray\nfrom ray.util import placement_group\n"
                     "def f():\n    import ray.exceptions as e\n    return __import__('ray')\n"
                     "from rayon import x\nimport raylib\n")
    assert [line for line, _ in _ray_imports(probe)] == [2, 3, 5, 6], "the scan itself must catch every form"


def test_hsgd_package_has_no_utils_grab_bag():
    names = {p.name for p in _sources()}
    assert not names & {"utils.py", "util.py", "helpers.py", "misc.py"}, \
        "rule broke: one module, one job; no utils.py grab bags"


ROOT = HSGD.parent
PACKAGES = ("hsgd", "actors", "jobs")
LAYER = {"hsgd": 0, "actors": 1, "jobs": 2}  # an import may only point to the same or a lower layer


def _module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _import_graph():
    """module -> set of project modules it imports (module level and inside functions alike)."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] in PACKAGES and target in modules and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_nothing_imports_upward():
    offenders = [f"{m} imports {d}" for m, deps in _import_graph().items() for d in sorted(deps)
                 if LAYER[d.split(".")[0]] > LAYER[m.split(".")[0]]]
    assert not offenders, "layering rule broke (hsgd < actors < jobs):\n" + "\n".join(offenders)


def test_there_are_no_import_cycles():
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_checks_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
