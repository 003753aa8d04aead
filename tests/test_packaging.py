"""The wheel declares what its packages import: every third-party module that maru_shm/, maru_sglang/ or
tools/ imports (lazily too) is a dependency, comes with an extra, or is listed in UNDECLARED with the reason.
scripts/wheel_check.sh installs the built wheel into a clean venv and runs the command line from it.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = {"maru_shm", "maru_sglang", "tools", "maru_shm_tools"}
UNDECLARED = {
    # tools/sglang_cpu.py asks whether the imported sgl_kernel is its own stand-in (tools/sglang_cpu_path)
    "sgl_kernel",
}


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> one file that imports it."""
    found = {}
    for package in ("maru_shm", "maru_sglang", "tools"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OURS:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r)[0].lower().replace("-", "_") for r in requirements}


def test_every_third_party_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared |= _names(extra)
    missing = {m: where for m, where in _third_party_imports().items() if m not in declared | UNDECLARED}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"



def test_every_package_folder_ships_in_the_wheel():
    """A sub-package missing from pyproject's explicit list would install without its modules."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for package in ("maru_shm", "maru_sglang"):
        for init in sorted((ROOT / package).rglob("__init__.py")):
            name = ".".join(init.parent.relative_to(ROOT).parts)
            assert name in listed, f"{name} is a package but not in pyproject.toml's packages"
    for init in sorted((ROOT / "tools").rglob("__init__.py")):
        name = ".".join(("maru_shm_tools",) + init.parent.relative_to(ROOT / "tools").parts)
        assert name in listed, f"{name} (tools/) is a package but not in pyproject.toml's packages"
