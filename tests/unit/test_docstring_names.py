"""Issue 31, acceptance 7: every CamelCase name a module docstring puts in single backquotes exists
where the docstring says. A dotted name (`hsgd.train.comm.CollectiveError`, `Trainer.step`) is
imported and resolved; a bare one (`RunnerPorts`) must be defined in the module, imported into it,
or found in a module the docstring names (`hsgd.core.round`, hsgd/core/round/messages.py).
Importing actors/* does not start Ray (only ray.init does)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [p for p in ("hsgd", "actors", "jobs", "benchmarks") if (ROOT / p / "__init__.py").exists()]
QUOTED = re.compile(r"(?<!`)`([A-Za-z_][\w.]*)`(?!`)")  # `Name` or `a.b.Name`, never ``literal``
CAMEL = re.compile(r"^_?[A-Z]\w*[a-z]\w*$")  # starts upper case, has a lower-case letter: not CONSTANT
MODULE_MENTION = re.compile(r"\b((?:hsgd|actors|jobs|benchmarks)(?:[./][A-Za-z_]\w*)+)")


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _docstring_names():
    """(module, docstring, quoted name) for every CamelCase name in single backquotes."""
    for module, path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        for name in dict.fromkeys(QUOTED.findall(doc)):
            if any(CAMEL.match(part) for part in name.split(".")):
                yield module, doc, name


def _import(name: str):
    """The module `name`, or None when it is not one."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _attribute(obj, dotted: list[str]) -> bool:
    for part in dotted:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _named_modules(doc: str) -> list:
    """The project's modules the docstring names, as `a.b.c` or as a path a/b/c.py."""
    found = []
    for mention in MODULE_MENTION.findall(doc):
        parts = mention.replace("/", ".").removesuffix(".py").split(".")
        for end in range(len(parts), 0, -1):  # the longest prefix that imports (`a.b.Name` names module a.b)
            module = _import(".".join(parts[:end]))
            if module is not None:
                found.append(module)
                break
    return found


def resolves(module_name: str, doc: str, name: str) -> bool:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):  # a dotted name from an importable prefix
        if "." in name and (module := _import(".".join(parts[:end]))) is not None:
            return _attribute(module, parts[end:])
    places = [importlib.import_module(module_name)] + _named_modules(doc)
    return any(_attribute(place, parts) for place in places)


CASES = sorted(_docstring_names())


def test_the_scan_finds_the_names_it_should():
    names = {(m, n) for m, _, n in CASES}
    assert ("hsgd.config.validate", "ConfigError") in names
    assert not any(n.isupper() for _, n in names), "a CONSTANT is not a CamelCase name"


@pytest.mark.parametrize("module,doc,name", CASES, ids=[f"{m}:{n}" for m, _, n in CASES])
def test_a_docstring_names_only_what_exists(module, doc, name):
    assert resolves(module, doc, name), (
        f"{module}'s docstring names `{name}`, which is neither defined nor "
        f"imported there nor in a module the docstring names: write it dotted "
        f"(`torchft.process_group.ProcessGroupGloo`) or unquoted"
    )
