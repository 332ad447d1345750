"""Guards for the repository layout (docs/design.md §1).

The import direction (training_core imports nothing of ours, orchestration never the Django side,
the web side only orchestration.trigger, layers inside each web app) is checked by import-linter's
contracts in pyproject.toml, run by `lint-imports` in the test command; it is not restated here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_required_top_level_layout_exists():
    # The layout the developers' guide requires, each part holding what its name says.
    for package in ("webapp", "workers", "training_core"):
        assert (ROOT / package / "__init__.py").is_file(), f"{package} is not a package"
    assert list((ROOT / "platform" / "orchestration" / "flows").glob("*.py")), "no Prefect flows"
    assert list((ROOT / "infra" / "terraform" / "modules").glob("*/main.tf")), "no Terraform modules"
    assert list((ROOT / "tests").rglob("test_*.py")), "no tests"
    for name in ("manage.py", "pyproject.toml", "README.md", "Makefile", ".ci/run"):
        assert (ROOT / name).is_file(), f"{name} is missing"


def test_platform_is_not_a_package():
    assert not (ROOT / "platform" / "__init__.py").exists()
    assert not list((ROOT / "platform").glob("*.py")), "no .py at platform/ top level"


def test_stdlib_platform_is_not_shadowed_from_repo_root():
    out = subprocess.run([sys.executable, "-c", "import platform, uuid; print(platform.system())"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() in {"Linux", "Darwin", "Windows"}


def test_config_module_stays_light():
    # The web app validates specs with it: importing it must not pull torch or transformers.
    code = ("import sys, training_core.config; "
            "print(any(m in sys.modules for m in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_ruff_reads_every_tracked_python_file():
    # An exclude pattern without a slash matches every directory of that name (`runs` once hid
    # webapp/runs from the linter); list what ruff would read and compare with what git tracks.
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    if not tracked:  # not a git checkout (an sdist): nothing to compare
        return
    shown = subprocess.run([str(BIN / "ruff"), "check", "--show-files", "."], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    read = {str(Path(p).resolve().relative_to(ROOT)) for p in shown if p.endswith(".py")}
    skipped = sorted(set(tracked) - read)
    assert not skipped, f"ruff skips tracked files: {skipped}"


def test_docs_layout_names_every_engine_module_and_only_paths_that_exist():
    """docs/layout.md is where a newcomer looks a module up: every module and folder of
    training_core is in its map, and every path it names exists."""
    import re

    text = (ROOT / "docs" / "layout.md").read_text()
    folder_map = text[text.index("```"):text.index("```", text.index("```") + 3)]
    engine = ROOT / "training_core"
    names = [p.name for p in engine.glob("*.py") if p.name != "__init__.py"] + \
        [p.name + "/" for p in engine.iterdir() if (p / "__init__.py").is_file()]
    missing = [n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", folder_map)]
    assert missing == [], f"docs/layout.md's map lacks {missing}"
    named = re.findall(r"`((?:training_core|webapp|tests|infra|platform|benchmarks)/[\w./-]+)`",
                       text)
    assert named and [p for p in named if not (ROOT / p).exists()] == []
