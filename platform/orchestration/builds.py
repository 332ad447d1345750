"""The exact build the nodes install: the wheel of the tree the control plane runs (or a
release's), with the pins its dependencies install at, published in the run's store by hash.

Nodes never install Oolong by name from a package index (on the public index ``oolong`` is
somebody else's project, and pip would run it as root). The control plane publishes:

- the wheel: ``$OOLONG_BUILD_DIR``'s (a release: a folder holding ``oolong-*.whl`` and the
  constraints files beside it), else one built from this checkout's tracked files (cached by
  their content, so one tree is built once);
- ``constraints-gpu.txt``, the trainer's environment on GPU nodes (``constraints.txt`` with
  SGLang's torch), or ``constraints.txt`` for nodes without GPUs;
- ``constraints-sglang.txt``, SGLang's own environment.

Each goes to ``<store>/builds/<sha256>/<file name>`` (content-addressed: published once, the same
for every run of one tree; the node role may only read there), and the result is the value of
the Terraform variable ``oolong_build``: each file's URL and sha256, which cloud-init checks
before it installs anything (infra/terraform/modules/gpu_node_pool/cloud-init.yaml.tftpl).

By hand, for a standing pool (envs/): ``python -m orchestration.builds --store s3://bucket/prefix``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR_ENV = "OOLONG_BUILD_DIR"
# What the wheel is made of (pyproject.toml's packages and their data).
TREE = ("pyproject.toml", "README.md", "training_core", "platform", "webapp", "workers")
GPU_CONSTRAINTS, CPU_CONSTRAINTS, SGLANG_CONSTRAINTS = (
    "constraints-gpu.txt", "constraints.txt", "constraints-sglang.txt")


class BuildError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_files(root: Path = ROOT) -> list[str]:
    """The checkout's files the wheel is built from: tracked, and untracked but not ignored."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *TREE], cwd=root,
                                capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BuildError(f"cannot list the source tree at {root} ({exc}): set {BUILD_DIR_ENV} to "
                         "a release's folder (its oolong-*.whl and constraints files)") from None
    return sorted(rel for rel in listed.split("\n") if rel and (root / rel).is_file())


def tree_digest(root: Path, files: list[str]) -> str:
    digest = hashlib.sha256()
    for rel in files:
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return digest.hexdigest()


def build_wheel(root: Path = ROOT, cache: Path | None = None) -> Path:
    """The wheel of the tree at ``root``, built once per content (from a copy of its files: the
    build leaves nothing in the checkout)."""
    from training_core.cache import cache_root

    files = tree_files(root)
    out = (cache or cache_root() / "builds") / tree_digest(root, files)[:24]
    found = sorted(out.glob("oolong-*.whl"))
    if found:
        return found[-1]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="oolong-build-", dir=out.parent) as tmp:
        src = Path(tmp) / "src"
        for rel in files:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, src / rel)
        dist = Path(tmp) / "dist"
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                               "--no-build-isolation", "-q", str(src), "-w", str(dist)],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise BuildError(f"building the wheel of {root} failed:\n{done.stderr[-2000:]}")
        try:
            dist.rename(out)
        except OSError:  # another build of the same tree won: identical
            pass
    return next(out.glob("oolong-*.whl"))


def local_build(*, gpu: bool = True) -> dict[str, Path]:
    """The files to publish: the wheel and the two constraints files, from ``$OOLONG_BUILD_DIR``
    (a release) or this checkout."""
    release = os.environ.get(BUILD_DIR_ENV)
    source = Path(release) if release else ROOT
    if release:
        wheels = sorted(source.glob("oolong-*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"{BUILD_DIR_ENV}={release} must hold exactly one oolong-*.whl "
                             f"(found {[w.name for w in wheels]})")
        wheel = wheels[0]
    else:
        wheel = build_wheel(source)
    files = {"wheel": wheel,
             "constraints": source / (GPU_CONSTRAINTS if gpu else CPU_CONSTRAINTS),
             "sglang_constraints": source / SGLANG_CONSTRAINTS}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise BuildError(f"the build is missing {missing}" + (
            f" (a release's folder, {BUILD_DIR_ENV}, holds its constraints files beside the "
            "wheel)" if release else ""))
    return files


def publish_file(store_url: str, path: Path) -> dict[str, str]:
    """``path`` at ``<store>/builds/<sha256>/<name>`` (once: a file already there by that hash
    is left as it is); its URL and sha256."""
    import fsspec

    digest = sha256_file(path)
    fs, root = fsspec.core.url_to_fs(store_url.rstrip("/"))
    remote = f"{root.rstrip('/')}/builds/{digest}/{path.name}"
    if not (fs.exists(remote) and fs.size(remote) == path.stat().st_size):
        fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path), remote)
    return {"url": fs.unstrip_protocol(remote), "sha256": digest}


def publish_build(store_url: str, *, gpu: bool = True) -> dict[str, dict[str, str]]:
    """Publish the build in the store; returns the Terraform variable ``oolong_build``."""
    return {name: publish_file(store_url, path) for name, path in local_build(gpu=gpu).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="publish the build nodes install (by hash)")
    parser.add_argument("--store", required=True, help="the store's URL, e.g. s3://bucket/prefix")
    parser.add_argument("--cpu", action="store_true",
                        help="nodes without GPUs: constraints.txt instead of constraints-gpu.txt")
    args = parser.parse_args(argv)
    print(json.dumps(publish_build(args.store, gpu=not args.cpu), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
