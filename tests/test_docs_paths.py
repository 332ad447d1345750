"""Every file of this repository that the README and docs name in backticks exists: a moved test,
script or benchmark must take its mentions along (a reader runs them as written). A file kept
only in git's history is named so: `path` (in git history)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

ROOT = Path(__file__).resolve().parents[1]
# Paths of this repository, as the docs write them: `tests/...py`, `scripts/x.sh`, `benchmarks/...`.
NAMED = re.compile(r"`((?:tests|scripts|benchmarks|training_core|platform|webapp|workers|docs|infra)"
                   r"/[\w./-]+\.(?:py|sh|md|json|tf|tftpl|png|yaml|toml))(?:::[\w\[\]-]+)?`")


def test_every_file_the_docs_name_exists():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = doc.read_text()
        for match in NAMED.finditer(text):
            path = match.group(1)
            if text.startswith(" (in git history)", match.end()):
                continue
            if "*" not in path and "<" not in path and not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "files named in the docs but absent:\n" + "\n".join(missing)
