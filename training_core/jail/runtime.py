"""The jail's Python at neutral paths: no host path of the runtime, the virtualenv, the checkout
or a home directory is readable in the jail.

Binding the host's interpreter, virtualenv and ``training_core`` into the jail showed their host
paths everywhere: in ``/proc/self/maps``, ``sys.path``, ``sys.executable``, every module's
``__file__``, ``pyvenv.cfg``, compiled files (``co_filename``), and in ``/proc/self/mountinfo``
even when mounted elsewhere (its root field is the bind source's path within its filesystem).

So the jail gets images instead, built once per runtime and cached (``OOLONG_CACHE/jail-runtime``):

- ``py-<digest>``, mounted at ``/opt/oolong/python``: the interpreter and ``libpython``, the
  standard library (without tests, IDLE, tkinter, ensurepip) and the packages of
  :data:`PACKAGES` with their dependencies (without their test suites), copied out of the
  virtualenv. The host's prefix in the binaries' strings (RUNPATH, the compiled-in prefix) is
  overwritten in place by a path of the same length naming the image (``_neutral_bytes``); text
  files naming it are rewritten; every compiled file names its neutral path. It is a plain
  installation (no ``pyvenv.cfg``): Python finds its prefix from the interpreter's location.
- ``tc-<digest>``, mounted at ``/opt/oolong/lib``: ``training_core``'s Python files (the
  built-in rewards), keyed by their sizes and times, so an edited checkout gets a fresh one.

Images no jail used for a day are removed.

A root caller keeps the images on a tmpfs of their own (``images_root``): a bind of a directory
there shows ``/py-<digest>`` as its root in mountinfo, not a host path. A non-root caller cannot
mount one: its images are plain directories, and mountinfo shows their path within their
filesystem (the ``OOLONG_CACHE`` path, never the runtime's, the virtualenv's or the checkout's).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import marshal
import os
import py_compile
import re
import shutil
import subprocess
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import training_core
from training_core.cache import cache_root
from training_core.jail.errors import SandboxUnavailable

PYTHON_DIR = "/opt/oolong/python"  # the jail's sys.prefix
LIB_DIR = "/opt/oolong/lib"  # where training_core is importable from (built-in rewards)
# What jailed code may import beyond the standard library: what the built-in rewards use
# (math-verify, reasoning-gym), what agents use (openai, httpx) and the common ones rewards use;
# with their dependencies. OOLONG_JAIL_PACKAGES replaces the list (package_names). Distributions
# not installed here are left out.
PACKAGES = ("math-verify", "reasoning-gym", "numpy", "sympy", "requests", "httpx", "openai")
STDLIB_LEFT_OUT = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo",
                   "ensurepip", "tests", "__pycache__"}
BUILD = 2  # the image layout's version: a change builds every image again
TMPFS_MB = 8192  # the root caller's image tmpfs (a bound: it holds only what is written)
STALE_S = 86400  # an image no jail used this long is removed
IMAGE_FS = "oolong-jail-runtime"  # the image tmpfs's source name, as mountinfo shows it


@dataclass(frozen=True)
class Runtime:
    """The host directories bound at :data:`PYTHON_DIR` and :data:`LIB_DIR`, and the jail's
    interpreter path."""

    python_image: Path
    lib_image: Path
    interpreter: str
    env: tuple[tuple[str, str], ...] = ()


def cache_dir() -> Path:
    return cache_root() / "jail-runtime"


def _python_name() -> str:
    return f"python{sys.version_info[0]}.{sys.version_info[1]}"


def interpreter() -> str:
    """The jail's Python, in the image."""
    return f"{PYTHON_DIR}/bin/{_python_name()}"


def host_prefixes() -> list[str]:
    """The host paths the images must not name: the interpreter's prefix and the virtualenv's,
    as given and resolved (longest first, so a longer one is replaced whole)."""
    found = {sys.base_prefix, sys.prefix, str(Path(sys.base_prefix).resolve()),
             str(Path(sys.prefix).resolve())}
    return sorted((p for p in found if p not in ("/", "/usr")), key=len, reverse=True)


def package_names() -> list[str]:
    """``OOLONG_JAIL_PACKAGES`` (comma-separated; ``default`` is :data:`PACKAGES`, ``none`` the
    standard library alone), else :data:`PACKAGES`."""
    names: list[str] = []
    for name in os.environ.get("OOLONG_JAIL_PACKAGES", "default").split(","):
        name = name.strip()
        names += list(PACKAGES) if name == "default" else [] if name in ("none", "") else [name]
    return names


def _required(line: str) -> str | None:
    """The distribution a ``Requires-Dist`` line names, or None for an extra's. Other markers
    (Python version, platform) are not evaluated: what they name is taken where installed."""
    spec, _, marker = line.partition(";")
    if "extra" in marker:
        return None
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    return match.group(1) if match else None


def distributions() -> list[metadata.Distribution]:
    """:func:`package_names` and what they require (no extras), those installed here."""
    seen: dict[str, metadata.Distribution] = {}
    todo = package_names()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        todo += [req for line in dist.requires or [] if (req := _required(line))]
    return [seen[k] for k in sorted(seen)]


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _interpreter_file() -> Path:
    base = Path(sys.base_prefix) / "bin" / _python_name()
    return base.resolve() if base.exists() else Path(sys.executable).resolve()


def python_digest(dists: list[metadata.Distribution]) -> str:
    exe = _interpreter_file().stat()
    return _digest([str(BUILD), sys.version, str(_interpreter_file()), str(exe.st_size),
                    str(exe.st_mtime_ns)] + [f"{d.metadata['Name']}=={d.version}" for d in dists])


def _package_files(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def lib_digest(package: Path) -> str:
    parts = [str(BUILD)]
    for path in _package_files(package):
        st = path.stat()
        parts.append(f"{path.relative_to(package)} {st.st_size} {st.st_mtime_ns}")
    return _digest(parts)


# --- the image tmpfs -----------------------------------------------------------------------

def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are octal escapes there."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _tmpfs_mounts() -> list[tuple[str, str]]:
    """Each tmpfs in this process's mount table: (mount point, source name)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "tmpfs":
            found.append((_unescape(fields[4]), fields[sep + 2]))
    return found


def _is_tmpfs_mount(path: Path) -> bool:
    target = str(path.resolve())
    return any(point == target for point, _ in _tmpfs_mounts())


def images_root() -> Path:
    """Where the images are: a root caller's own tmpfs (mounted here once), else a directory."""
    root = cache_dir() / "images"
    root.mkdir(parents=True, exist_ok=True)
    root = root.resolve()  # as mountinfo names it (a cache reached through a link)
    if os.geteuid() == 0 and not _is_tmpfs_mount(root):
        with _lock():
            if not _is_tmpfs_mount(root):
                result = subprocess.run(
                    [shutil.which("mount") or "/bin/mount", "-t", "tmpfs", "-o", f"mode=0755,nosuid,nodev,size={TMPFS_MB}m",
                     IMAGE_FS, str(root)], capture_output=True, text=True)
                if result.returncode != 0:
                    raise SandboxUnavailable(f"could not mount the jail runtime's tmpfs at {root}: "
                                             f"{result.stderr.strip()}")
    return root


def release_images(under: Path) -> list[str]:
    """Unmount every image tmpfs mounted at or below ``under`` (lazily: a running jail keeps its
    binds), deepest first, and return their paths. A root caller's tmpfs outlives the process that
    mounted it, and a directory holding one cannot be removed: a test session releases those
    under its temporary directory, else the next session cannot empty it."""
    top = Path(under).resolve()
    found = {point for point, source in _tmpfs_mounts()
             if source == IMAGE_FS and Path(point).is_relative_to(top)}
    released = []
    for point in sorted(found, key=len, reverse=True):
        result = subprocess.run([shutil.which("umount") or "/bin/umount", "-l", point],
                                capture_output=True, text=True)
        if result.returncode == 0:
            released.append(point)
    runtime.cache_clear()
    return released


@contextlib.contextmanager
def _lock():
    cache_dir().mkdir(parents=True, exist_ok=True)
    os.chmod(cache_dir(), 0o700)
    with open(cache_dir() / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# --- building ------------------------------------------------------------------------------

def _neutral_bytes(prefix: str, neutral: str) -> bytes | None:
    """The bytes that overwrite ``prefix`` in a binary: as long as it, naming ``neutral``, and
    ending in the prefix's last component (``/root/.pyenv/versions/3.11.7`` ->
    ``/opt/oolong/python////3.11.7``; the image links ``3.11.7`` to itself). The ending stays
    because the linker shares storage between strings: libpython's version string ``3.11.7`` is
    the tail of its prefix string. None where ``neutral`` does not fit."""
    head, _, tail = prefix.rpartition("/")
    if len(neutral) > len(head) or tail in ("", ".", "..", "bin", "lib", "include", "share"):
        return None  # no room, or the link would hide a directory of the image
    return f"{neutral}{'/' * (len(head) - len(neutral))}/{tail}".encode()


def _tails(prefixes: list[str]) -> set[str]:
    """The last components the binaries' overwritten prefixes end in (each a link to ``.``)."""
    return {p.rpartition("/")[2] for p in prefixes if _neutral_bytes(p, PYTHON_DIR) is not None}


def _scrub(path: Path, prefixes: list[str]) -> bool:
    """Overwrite the host prefixes in one copied file; True if it changed. In a binary only by a
    same-length replacement (strings and offsets stay valid); in text by the neutral path."""
    data = path.read_bytes()
    if not any(p.encode() in data for p in prefixes):
        return False
    binary = data.startswith(b"\x7fELF") or b"\0" in data[:8192]
    for prefix in prefixes:
        if binary:
            padded = _neutral_bytes(prefix, PYTHON_DIR)
            if padded is not None:
                data = data.replace(prefix.encode(), padded)
        else:
            data = data.replace(prefix.encode(), PYTHON_DIR.encode())
    mode = path.stat().st_mode
    path.chmod(mode | 0o200)
    path.write_bytes(data)
    path.chmod(mode)
    return True


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        target = os.readlink(src)
        if not os.path.isabs(target):  # a link within the tree (libpython.so -> .so.1.0)
            os.symlink(target, dst)
            return
    shutil.copy2(src, dst)


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _compiled(src: Path, dst: Path, neutral: str, scrubbed: bool) -> None:
    """``dst``'s compiled file, naming ``neutral``: the host's own compiled file with its file
    names rewritten where it matches the source, else compiled here."""
    tag = sys.implementation.cache_tag
    cfile = dst.parent / "__pycache__" / f"{dst.stem}.{tag}.pyc"
    host = src.parent / "__pycache__" / f"{src.stem}.{tag}.pyc"
    cfile.parent.mkdir(exist_ok=True)
    if not scrubbed and host.exists():
        data = host.read_bytes()
        st = src.stat()
        flags = int.from_bytes(data[4:8], "little")
        if data[:4] == importlib.util.MAGIC_NUMBER and (
                flags != 0 or (int.from_bytes(data[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                               and int.from_bytes(data[12:16], "little") == st.st_size & 0xFFFFFFFF)):
            try:
                code = marshal.loads(data[16:])
            except (ValueError, EOFError, TypeError):
                code = None
            if isinstance(code, types.CodeType):
                cfile.write_bytes(data[:16] + marshal.dumps(_renamed(code, neutral)))
                return
    with contextlib.suppress(py_compile.PyCompileError, SyntaxError, ValueError), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings of old code: compiled all the same
        py_compile.compile(str(dst), cfile=str(cfile), dfile=neutral, doraise=True)


def _tree(src_root: Path, dst_root: Path, neutral_root: str, files: list[Path],
          prefixes: list[str]) -> None:
    """Copy ``files`` (relative to ``src_root``), scrub them, compile their Python."""
    for rel in files:
        src, dst = src_root / rel, dst_root / rel
        if dst.exists() or dst.is_symlink():
            continue
        _copy(src, dst)
        if dst.is_symlink():
            continue
        scrubbed = _scrub(dst, prefixes)
        if dst.suffix == ".py":
            _compiled(src, dst, f"{neutral_root}/{rel.as_posix()}", scrubbed)


def _readable(root: Path) -> None:
    """Everything readable (and directories walkable) by the jail's uid, nothing writable."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode & 0o777
                os.chmod(path, (mode | 0o444) & ~0o222)


def _stdlib_files(stdlib: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel_dir = Path(dirpath).relative_to(stdlib)
        dirnames[:] = [d for d in dirnames if d not in STDLIB_LEFT_OUT and not d.startswith("config-")]
        files += [rel_dir / f for f in filenames if not f.endswith((".pyc", ".pyo"))]
    return files


def _build_python(dst: Path, dists: list[metadata.Distribution]) -> None:
    prefixes = host_prefixes()
    for tail in _tails(prefixes):
        os.symlink(".", dst / tail)
    name = _python_name()
    exe = _interpreter_file()
    _copy(exe, dst / "bin" / name)
    _scrub(dst / "bin" / name, prefixes)
    libdir = Path(sys.base_prefix) / "lib"
    for lib in sorted(libdir.glob("libpython*.so*")):
        _copy(lib, dst / "lib" / lib.name)
        if not (dst / "lib" / lib.name).is_symlink():
            _scrub(dst / "lib" / lib.name, prefixes)
    stdlib = Path(os.__file__).resolve().parent
    lib_neutral = f"{PYTHON_DIR}/lib/{name}"
    _tree(stdlib, dst / "lib" / name, lib_neutral, _stdlib_files(stdlib), prefixes)
    site = dst / "lib" / name / "site-packages"
    for dist in dists:
        root = Path(str(dist.locate_file(""))).resolve()
        files = []
        for entry in dist.files or []:
            rel = Path(str(entry))
            if (rel.is_absolute() or ".." in rel.parts or "__pycache__" in rel.parts
                    or "tests" in rel.parts  # the packages' own test suites: 59 MB of 430
                    or rel.name == "direct_url.json" or rel.suffix in (".pyc", ".pth")):
                continue
            if (root / rel).is_file():
                files.append(rel)
        _tree(root, site, f"{lib_neutral}/site-packages", files, prefixes)


def _build_lib(dst: Path, package: Path) -> None:
    files = [p.relative_to(package.parent) for p in _package_files(package)]
    _tree(package.parent, dst, LIB_DIR, files, host_prefixes())


def _built(root: Path, name: str, build) -> Path:
    """``root/name``, built by ``build(tmp_dir)`` unless it is there (one builder at a time)."""
    final = root / name
    if not (final / ".complete").exists():
        with _lock():
            if not (final / ".complete").exists():
                tmp = root / f".{name}.{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(final, ignore_errors=True)
                tmp.mkdir()
                build(tmp)
                (tmp / ".complete").write_text(json.dumps({"built": time.time()}))
                _readable(tmp)
                tmp.rename(final)
    with contextlib.suppress(OSError):
        os.utime(final / ".complete")  # used: not stale
    return final


def _prune(root: Path, keep: set[Path]) -> None:
    """Remove images nobody used for a day (each edit of the checkout makes a training_core
    image; a jail started touches its images), and builds a dead builder left."""
    for old in root.glob("*"):
        marker = old / ".complete" if not old.name.startswith(".") else old
        with contextlib.suppress(OSError):
            if old not in keep and time.time() - marker.stat().st_mtime > STALE_S:
                shutil.rmtree(old)


@functools.cache
def runtime() -> Runtime:
    """The images for this interpreter, package set and training_core (built on first use)."""
    dists = distributions()
    root = images_root()
    python_image = _built(root, f"py-{python_digest(dists)}", lambda d: _build_python(d, dists))
    package = Path(training_core.__file__).resolve().parent
    lib_image = _built(root, f"tc-{lib_digest(package)}", lambda d: _build_lib(d, package))
    _prune(root, {python_image, lib_image})
    env: tuple[tuple[str, str], ...] = ()
    base = str(Path(sys.base_prefix).resolve())
    if _neutral_bytes(base, PYTHON_DIR) is None:
        # The interpreter's prefix was too short to overwrite (its RUNPATH still names it):
        # libpython is found by the environment.
        env = (("LD_LIBRARY_PATH", f"{PYTHON_DIR}/lib"),)
    return Runtime(python_image, lib_image, interpreter(), env)


def current() -> Runtime:
    """:func:`runtime`, marked used (the images a long-lived process uses are never pruned), and
    built again where they are gone (a root caller's tmpfs is lost at a reboot)."""
    image = runtime()
    try:
        for path in (image.python_image, image.lib_image):
            os.utime(path / ".complete")
    except OSError:
        runtime.cache_clear()
        image = runtime()
    return image

