"""What each package a node installs requires of its Python: ``Requires-Python`` and the tags of
the file pip takes for CPython 3.11 on x86_64 Linux, for the exact pins the nodes install.

Recorded in ``fixtures/node_packages.json`` (the GPU pins cannot be installed here: torch 2.14.1's
CUDA build, SGLang), re-derived by the tests wherever the metadata is at hand (an installed
distribution of that exact version, the pinned SGLang wheel at ``$OOLONG_SGLANG_WHEEL`` or
``/tmp/sgl``), and refreshed from the package index's metadata (PEP 658: no wheel is
downloaded) with ``python -m tests.infra.node_packages``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "node_packages.json"
SGLANG_WHEEL_DIRS = (os.environ.get("OOLONG_SGLANG_WHEEL", ""), "/tmp/sgl")


def recorded() -> dict[str, dict]:
    return json.loads(FIXTURE.read_text())["packages"]


def _wheel_facts(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        info = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(info).decode()
        tags = [line.split(": ", 1)[1] for line in
                zf.read(info.replace("METADATA", "WHEEL")).decode().splitlines()
                if line.startswith("Tag: ")]
    requires = next((line.split(": ", 1)[1] for line in meta.splitlines()
                     if line.startswith("Requires-Python: ")), None)
    return {"requires_python": requires, "tags": tags}


def at_hand(pin: str) -> dict | None:
    """The facts of ``name==version`` from this machine, None where it has not got them: an
    installed distribution gives Requires-Python (not the tags), a wheel file both."""
    name, _, version = pin.partition("==")
    for folder in filter(None, SGLANG_WHEEL_DIRS):
        for wheel in Path(folder).glob(f"{name.replace('-', '_')}-{version}-*.whl"):
            return _wheel_facts(wheel)
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    return {"requires_python": dist.metadata.get("Requires-Python")}


def derive(pins: list[str]) -> dict[str, dict]:
    """From the index, metadata only: what pip would install for this Python (3.11)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                        "--ignore-installed", "--quiet", "--report", str(report), *pins],
                       check=True, capture_output=True, timeout=600)
        items = json.loads(report.read_text())["install"]
    out = {}
    for item in items:
        meta = item["metadata"]
        name = item["download_info"]["url"].rsplit("/", 1)[-1]
        tags = (["-".join(name.removesuffix(".whl").split("-")[-3:])] if name.endswith(".whl")
                else ["sdist"])
        out[f"{meta['name']}=={meta['version']}"] = {
            "requires_python": meta.get("requires_python"), "tags": tags, "file": name}
    return out


if __name__ == "__main__":
    pins = sorted(recorded())
    FIXTURE.write_text(json.dumps({
        "_how": "python -m tests.infra.node_packages (pip's dry-run report: metadata only)",
        "packages": derive(pins)}, indent=2, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
