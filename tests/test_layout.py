"""Guards for the repository layout and the import direction (DESIGN.md §1)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_CORE = {"django", "celery", "prefect", "webapp", "workers", "orchestration"}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_required_top_level_layout_exists():
    for name in ["platform", "webapp", "workers", "training_core", "infra/terraform", "tests",
                 "manage.py", "pyproject.toml", "README.md", "Makefile", ".ci/run"]:
        assert (ROOT / name).exists(), f"{name} is missing"


def test_platform_is_not_a_package():
    assert not (ROOT / "platform" / "__init__.py").exists()
    assert not list((ROOT / "platform").glob("*.py")), "no .py at platform/ top level"


def test_stdlib_platform_is_not_shadowed_from_repo_root():
    out = subprocess.run([sys.executable, "-c", "import platform, uuid; print(platform.system())"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() in {"Linux", "Darwin", "Windows"}


def test_training_core_imports_nothing_of_ours_or_the_platform():
    offenders = []
    for path in (ROOT / "training_core").rglob("*.py"):
        bad = _imported_top_levels(path) & FORBIDDEN_IN_CORE
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, offenders


def test_config_module_stays_light():
    # The web app validates specs with it: importing it must not pull torch or transformers.
    code = ("import sys, training_core.config; "
            "print(any(m in sys.modules for m in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_orchestration_imports_only_training_core_of_ours():
    offenders = []
    for path in (ROOT / "platform" / "orchestration").rglob("*.py"):
        bad = _imported_top_levels(path) & {"webapp", "workers", "django"}
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, offenders


def test_web_side_imports_only_the_trigger_module_of_orchestration():
    offenders = []
    for base in ("webapp", "workers"):
        for path in (ROOT / base).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orchestration"):
                    if node.module != "orchestration.trigger":
                        offenders.append(f"{path.relative_to(ROOT)}: {node.module}")
    assert not offenders, offenders
