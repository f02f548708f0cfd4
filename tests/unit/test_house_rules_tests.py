"""House rules for the tests themselves (issue 49), read from their source by AST:
- no wall-clock ceiling: an assert never puts an upper bound on an elapsed time (elapsed under 2 s), except
  by the hang deadline HANG_S (tests/fakes/deadlines.py). Timings flake on loaded cores and belong
  in benchmarks; a test checks the order of events, a fake clock, or only that nothing hangs.
- every integration test that starts a run with a fault schedule, a kill, a storage fault, a site
  change or a drill reaches the shared invariant checker (`check_run`, tests/integration/invariants.py):
  in its body, a helper of its module it calls, or a fixture it takes (a shared run: its teardown).
- no test module imports another test module (shared fakes and helpers live in tests/fakes/).
Each rule is shown catching a new offender, fed as a snippet."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CHECKED = ("unit", "integration")

# files another change owns now; each goes when that change lands
CEILINGS_NOT_YET: dict[str, str] = {}

_TIME_NAME = re.compile(r"elapsed|wall|took|seconds|stall|duration|latency|(^|_)wait$|_s$", re.IGNORECASE)
_CLOCK_CALLS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}
_TIMESTAMP = re.compile(r"^(t\d*|t_\w+|start\w*|began|begin\w*|when|now|then|since)$|_at$")


def _identifier(node: ast.AST) -> str | None:
    """The name a value goes by: a variable, an attribute, or a subscript's string key."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    return None


def _is_clock_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _identifier(node.func) in _CLOCK_CALLS and not node.args


def _is_elapsed(node: ast.AST) -> bool:
    """An elapsed time: a time-named value, a clock reading minus another, or max/min/sum of those."""
    name = _identifier(node)
    if name is not None and _TIME_NAME.search(name) and not name.isupper():
        return True
    if isinstance(node, ast.Subscript):  # stalls["c1r0"]
        return _is_elapsed(node.value)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Sub):
            sides = (node.left, node.right)
            return any(_is_clock_call(s) or _is_elapsed(s) or _is_timestamp(s) for s in sides)
        return _is_elapsed(node.left) or _is_elapsed(node.right)
    if isinstance(node, ast.Call) and _identifier(node.func) in ("max", "min", "sum", "round"):
        return any(_is_elapsed(a) for a in node.args)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # stalls.values(), o.get("took_s")
        key = node.args[0] if node.func.attr == "get" and node.args else None
        return _is_elapsed(node.func.value) or (isinstance(key, ast.Constant) and _is_elapsed(ast.Name(str(key.value))))
    if isinstance(node, ast.GeneratorExp | ast.ListComp):
        return _is_elapsed(node.elt)
    return False


def _is_timestamp(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and bool(_TIMESTAMP.search(node.id))


def _is_hang_deadline_or_measured(bound: ast.AST) -> bool:
    """The bound is HANG_S, or another measurement of the same run (an accounting identity such as
    `link_s <= total_s`), not a number the machine must beat."""
    nodes = list(ast.walk(bound))
    if "HANG_S" in map(_identifier, nodes):
        return True
    return any(_is_clock_call(n) or _is_elapsed(n) or _is_timestamp(n) for n in nodes)


def _ceilings_in(test: ast.AST) -> list[ast.Compare]:
    """The comparisons of an assert that bound an elapsed time from above."""
    found = []
    for cmp in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
        values = [cmp.left, *cmp.comparators]
        for op, a, b in zip(cmp.ops, values, values[1:], strict=False):
            if isinstance(op, ast.Gt | ast.GtE):
                a, b = b, a
            elif not isinstance(op, ast.Lt | ast.LtE):
                continue
            if _is_elapsed(a) and not _is_hang_deadline_or_measured(b):
                found.append(cmp)
    return found


def ceilings(source: str) -> list[int]:
    """The lines of `source` whose assert puts an upper bound other than HANG_S on an elapsed time."""
    return sorted(
        cmp.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assert)
        for cmp in _ceilings_in(node.test)
    )


def _test_files():
    for folder in CHECKED:
        yield from sorted((TESTS / folder).glob("*.py"))


def test_no_test_asserts_a_wall_clock_ceiling():
    found = [
        f"tests/{path.relative_to(TESTS)}:{line}"
        for path in _test_files()
        if str(path.relative_to(TESTS)) not in CEILINGS_NOT_YET
        for line in ceilings(path.read_text())
    ]
    assert not found, f"a wall-clock ceiling in a test (assert behaviour; a hang deadline is HANG_S): {found}"


def test_the_ceiling_rule_catches_a_new_one_and_lets_a_hang_deadline_pass():
    # (the comparisons spelled LT / LE, so the grep over the tests finds no ceiling in this file)
    caught = """
def test_fast():
    t0 = time.monotonic()
    run()
    assert time.monotonic() - t0 LT 2.0
    assert summary["elapsed_s"] LE 5 and ok
    assert 1.0 > took
    assert max(stalls.values()) LE 2.0, stalls
    assert max(f["seconds"] for f in found) LT 5.0
    assert when - t0 LT 0.7
"""
    assert ceilings(_spelled(caught)) == [5, 6, 7, 8, 9, 10]
    allowed = """
def test_fine():
    assert took LT HANG_S
    assert time.monotonic() - t0 LT deadlines.HANG_S
    assert 3.0 LE took
    assert o["allreduce_link_s"] LE o["allreduce_s"]
    assert group.link_s LE time.monotonic() - t0
    assert abs(cost["replan_s"] - 0.2) LT 1e-9
    assert o["max_diff"] LE 1e-6 and TIMEOUT_S LT 10
    if took LT 2.0:
        pass
"""
    assert ceilings(_spelled(allowed)) == []


def _spelled(snippet: str) -> str:
    return snippet.replace(" LT ", " < ").replace(" LE ", " <= ")


# -- one home for fakes ------------------------------------------------------------------------------
_TEST_MODULE = re.compile(r"^tests\.(unit|integration|gpu)\.test_")


def imported_test_modules(source: str) -> list[str]:
    """The test modules `source` imports from."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] if _TEST_MODULE.match(node.module) else []
            if node.module in ("tests.unit", "tests.integration", "tests.gpu"):
                found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("test_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if _TEST_MODULE.match(a.name)]
    return found


def test_no_test_module_imports_another():
    found = {
        f"tests/{path.relative_to(TESTS)}": names
        for path in sorted(TESTS.rglob("*.py"))
        if (names := imported_test_modules(path.read_text()))
    }
    assert not found, f"move what they share to tests/fakes/: {found}"


def test_the_import_rule_catches_a_new_one():
    unit = "tests.unit."  # (split, so the grep for such imports finds none in this file)
    source = (
        f"from {unit}test_checkpoint import _state\nfrom tests.integration import test_drill\nimport tests.gpu.test_x\n"
    )
    assert imported_test_modules(source) == [
        "tests.unit.test_checkpoint",
        "tests.integration.test_drill",
        "tests.gpu.test_x",
    ]
    assert imported_test_modules("from tests.fakes.checkpoints import write_checkpoint\n") == []


# -- every faulty run reaches check_run -------------------------------------------------------------
CHECK_NOT_YET: dict[str, str] = {}
_RUN_STARTS = {"train", "_train", "train_cli", "run_training", "background_drills"}
_FAULT_CALLS = {
    "inject",  # a drill's fault
    "add_site",  # site changes
    "drain_site",
    "write_request",
    "prlimit",  # storage faults: a write quota, a folder moved away or replaced
    "rename",
    "rmtree",
}
_REFUSED = re.compile(r"exits?_2")
_FAULT_KEYS = ("faults.schedule", "faults.mtbf_s", "faults.kinds")
_FATAL = {"SIGKILL", "SIGTERM", "SIGSTOP", "SIGSEGV", "SIGABRT"}  # not SIGINT: Ctrl-C, a clean stop
_TEARDOWN = {"stop", "close", "shutdown", "teardown", "cleanup", "give_back", "__exit__", "__del__"}


def _strings(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


def _calls(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            owner = _identifier(n.func.value) if isinstance(n.func, ast.Attribute) else None
            yield n, owner, _identifier(n.func)


def _is_fault_call(call: ast.Call, owner: str | None, name: str | None) -> bool:
    if name in _FAULT_CALLS:
        return True
    if name in ("kill", "killpg"):  # os.kill, ray.kill; not p.kill() of a process the test started itself
        return owner in ("os", "ray")
    if name == "send_signal":
        return any(_identifier(a) in _FATAL for a in call.args)
    if name == "write_bytes":  # a file cut short: path.write_bytes(path.read_bytes()[:n])
        return any(isinstance(n, ast.Slice) for a in call.args for n in ast.walk(a))
    return name == "background_drills"  # a drill


def _starts_a_drill(node: ast.AST) -> bool:
    """Drill(...).start(), or d = Drill(...) then d.start() (not a Drill that only reads a folder
    written by hand)."""
    drills = {
        t.id
        for n in ast.walk(node)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _identifier(n.value.func) == "Drill"
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    return any(
        name == "start"
        and (
            owner in drills or (isinstance(call.func.value, ast.Call) and _identifier(call.func.value.func) == "Drill")
        )
        for call, owner, name in _calls(node)
    )


def _starts_a_run(nodes) -> bool:
    return any(
        any(name in _RUN_STARTS for _, _, name in _calls(node))
        or any("jobs.train" in text for text in _strings(node))
        or _starts_a_drill(node)
        for node in nodes
    )


def _is_faulty(nodes) -> bool:
    return any(
        any(text.startswith(_FAULT_KEYS) for text in _strings(node))
        or any(_is_fault_call(*call) for call in _calls(node))
        or _starts_a_drill(node)
        for node in nodes
    )


def _check_names(tree: ast.Module) -> set[str]:
    """check_run under the names this module imports it as."""
    names = {"check_run"}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "tests.integration.invariants":
            names |= {a.asname or a.name for a in node.names if a.name == "check_run"}
    return names


def _is_fixture(node: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in node.decorator_list)


def _module_parts(tree: ast.Module) -> tuple[dict[str, ast.AST], dict[str, ast.AST], dict[str, list[ast.AST]]]:
    """The module's fixtures; its functions, classes (their constructors) and constants by name; its
    classes' methods by name (not their teardown: stopping what the test started is no fault)."""
    fixtures: dict[str, ast.AST] = {}
    parts: dict[str, ast.AST] = {}
    methods: dict[str, list[ast.AST]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            (fixtures if _is_fixture(node) else parts)[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, ast.FunctionDef) and m.name not in _TEARDOWN:
                    methods.setdefault(m.name, []).append(m)
                    if m.name == "__init__":
                        parts[node.name] = m
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    parts[target.id] = node
    return fixtures, parts, methods


def _reach(start: ast.FunctionDef, fixtures, parts, methods) -> list[ast.AST]:
    """start and every part of its module it reaches: fixtures it (or a fixture) takes by parameter
    name, functions and constants it names, methods it calls."""
    seen, todo = [], [start]
    while todo:
        node = todo.pop()
        if any(node is s for s in seen):
            continue
        seen.append(node)
        if node is start or any(node is f for f in fixtures.values()):
            todo += [fixtures[a.arg] for a in node.args.args if a.arg in fixtures]
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        todo += [parts[name] for name in names if name in parts]
        todo += [m for _, owner, name in _calls(node) if owner for m in methods.get(name, [])]
    return seen


def unchecked_fault_tests(source: str) -> list[str]:
    """The tests of a module that start a run with a fault, a kill, a storage fault, a site change
    or a drill, and never reach check_run."""
    tree = ast.parse(source)
    (fixtures, parts, methods), checks = _module_parts(tree), _check_names(tree)
    found = []
    for node in tree.body:
        # a test named for exit 2 checks a refused config: no run starts (this suite's naming)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and not _REFUSED.search(node.name):
            reached = _reach(node, fixtures, parts, methods)
            checked = any(name in checks for part in reached for _, _, name in _calls(part))
            if _starts_a_run(reached) and _is_faulty(reached) and not checked:
                found.append(node.name)
    return found


def test_every_integration_test_with_a_fault_reaches_the_invariant_checker():
    found = [
        f"tests/{path.relative_to(TESTS)}::{name}"
        for path in sorted((TESTS / "integration").glob("test_*.py"))
        if str(path.relative_to(TESTS)) not in CHECK_NOT_YET
        for name in unchecked_fault_tests(path.read_text())
    ]
    assert not found, f"a run with a fault never asks the shared invariant checker (check_run): {found}"


def test_the_check_rule_names_a_fault_run_that_never_reaches_check_run():
    source = """
from tests.integration.invariants import check_run as checked

@pytest.fixture(scope="module")
def shared(background_drills, tmp_path_factory):
    d = background_drills(["train.rounds=9"], tmp_path_factory.mktemp("d"))
    yield d
    checked(d.run_dir, rounds=9, steps_per_round=2, expect_status="stopped")

def _kill(pid):
    os.kill(pid, signal.SIGKILL)

def _check(run_dir):
    checked(run_dir, rounds=2, steps_per_round=2)

def test_a_schedule_unchecked(tmp_path):
    train(tmp_path, ["faults.schedule=[{kind:kill,target:c0r1,round:1}]"])

def test_a_kill_through_a_helper_unchecked(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "jobs.train"])
    _kill(proc.pid)

def test_a_drill_unchecked(background_drills, tmp_path):
    background_drills([], tmp_path).stop()

def test_a_checked_schedule(tmp_path):
    train(tmp_path, ["faults.schedule=[{kind:kill,target:c0r1,round:1}]"])
    _check(tmp_path)

def test_a_shared_run_checked_at_its_teardown(shared):
    shared.inject("kill", "c0r1")

def test_no_fault(tmp_path):
    train(tmp_path, ["train.rounds=2"])
    proc = subprocess.Popen(["sleep", "9"])
    proc.kill()

def test_a_refused_config_exits_2(tmp_path):
    train_cli(["faults.schedule=[{kind:zap}]"], cwd=tmp_path)
"""
    assert unchecked_fault_tests(source) == [
        "test_a_schedule_unchecked",
        "test_a_kill_through_a_helper_unchecked",
        "test_a_drill_unchecked",
    ]


class _NoCheck(ast.NodeTransformer):
    def visit_Call(self, node):
        return ast.Constant(None) if _identifier(node.func) in ("check_run", "check_invariants") else node


def test_every_fault_test_is_named_once_its_modules_check_run_calls_are_gone():
    """Acceptance 1: the rule sees each fault test's check; without it, it names that test."""
    for path in sorted((TESTS / "integration").glob("test_*.py")):
        if str(path.relative_to(TESTS)) in CHECK_NOT_YET:
            continue
        tree = ast.parse(path.read_text())
        (fixtures, parts, methods), names = _module_parts(tree), []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and not _REFUSED.search(node.name):
                reached = _reach(node, fixtures, parts, methods)
                if _starts_a_run(reached) and _is_faulty(reached):
                    names.append(node.name)
        stripped = ast.unparse(_NoCheck().visit(tree))
        assert unchecked_fault_tests(stripped) == names, path.name


def test_files_not_yet_under_the_rules_exist():
    assert all((TESTS / name).exists() for name in {**CEILINGS_NOT_YET, **CHECK_NOT_YET}), "drop a name that is gone"
