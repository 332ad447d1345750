"""Issue 47, item 9: the runtime at neutral paths. A jail could read where the host keeps its
Python, its virtualenv and the checkout (``/proc/self/mountinfo`` showed every bind's source
path, ``sys.path``, ``__file__`` and ``/proc/self/maps`` the host's paths, ``/proc/1/cmdline``
bwrap's options with every bind's source). Now the jail runs a
runtime image at ``/opt/oolong`` (``training_core/jail/runtime.py``) and nothing it can read names
a host path: what the kernel shows, what Python says, and every byte of the image's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import training_core
from training_core.jail import FILES_DIR, Limits, python, runtime, spawn

PROBE = r'''
import json, os, re, sys
needles, file_needles = json.loads(sys.stdin.readline())
# A host path as a whole path: not followed by a name's character (a checkout at /tmp/x is
# not named by imaplib's '/tmp/xxx 1').
file_patterns = [(n, re.compile(re.escape(n.encode()) + rb"(?![A-Za-z0-9._-])"))
                 for n in file_needles]
seen = {"mountinfo": open("/proc/self/mountinfo").read(), "maps": open("/proc/self/maps").read(),
        "executable": sys.executable, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
        "exec_prefix": sys.exec_prefix, "path": repr(sys.path), "os": os.__file__,
        "environ": repr(dict(os.environ)), "argv": repr(sys.argv), "version": sys.version}
# Every process's command line: PID 1 is bwrap, whose options name the host paths of the binds.
cmdlines = []
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        cmdlines.append(handle.read().replace(b"\0", b" ").decode())
seen["cmdlines"] = repr(cmdlines)
import numpy, sympy, httpx, openai, math_verify
seen["packages"] = repr([m.__file__ for m in (numpy, sympy, httpx, openai, math_verify)])
seen["code"] = repr([numpy.array.__module__, sympy.simplify.__code__.co_filename,
                     json.dumps.__code__.co_filename])
sys.path.insert(0, "/opt/oolong/lib")
import training_core.rewards.registry as registry
seen["training_core"] = registry.__file__ + registry.resolve_reward.__code__.co_filename
# Every byte of every file the image holds: binaries, compiled files, metadata.
hits = []
for root, dirs, files in os.walk("/opt/oolong"):
    for name in files:
        path = os.path.join(root, name)
        if os.path.islink(path):
            continue
        with open(path, "rb") as handle:
            data = handle.read()
        hits += [(path, n) for n, pattern in file_patterns if pattern.search(data)]
    if "pyvenv.cfg" in files:
        hits.append((root, "pyvenv.cfg"))
seen["files"] = json.dumps(hits)
print(json.dumps(seen))
'''


def _host_paths(home: bool = True) -> list[str]:
    """What the jail must not learn: the virtualenv, the interpreter's real prefix, the
    checkout (training_core's parent), where the images are cached (a root caller's are on a
    tmpfs of their own) and $HOME (not among the bytes of files: ``/root`` is in sympy's
    ``rootoftools`` and in the build paths of wheels built as root elsewhere)."""
    paths = {sys.prefix, str(Path(sys.prefix).resolve()), sys.base_prefix,
             str(Path(sys.base_prefix).resolve()),
             str(Path(training_core.__file__).resolve().parent.parent)}
    if home:
        paths |= {os.environ.get("HOME", str(Path.home())), str(Path.home())}
    if os.geteuid() == 0:
        paths.add(str(runtime.cache_dir()))
    return sorted(p for p in paths if p not in ("/", "/usr", ""))


def _shown(where: str, needle: str) -> bool:
    """Whether ``needle`` may show in ``where``: only a non-root caller's mountinfo, which
    shows the path of its images (plain directories under ``OOLONG_CACHE``)."""
    return (where == "mountinfo" and os.geteuid() != 0
            and str(runtime.cache_dir()).startswith(needle.rstrip("/") + "/"))


def test_nothing_in_the_jail_names_a_host_path_of_the_runtime():
    needles = _host_paths()
    assert str(Path(sys.prefix).resolve()) in needles
    jail = spawn([python(), "-I", f"{FILES_DIR}/probe.py"], files={"probe.py": PROBE},
                 limits=Limits(cpu_s=120), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
    try:
        line = json.dumps([needles, _host_paths(home=False)]).encode() + b"\n"
        out, err = jail.proc.communicate(line, timeout=120)
    finally:
        jail.kill()
    assert jail.proc.returncode == 0, err.decode()[-2000:]
    seen = json.loads(out)
    assert seen["executable"] == python() == f"{runtime.PYTHON_DIR}/bin/python3.{sys.version_info[1]}"
    assert seen["prefix"] == seen["base_prefix"] == runtime.PYTHON_DIR
    assert seen["version"] == sys.version  # the binaries' strings were overwritten, not broken
    assert seen["os"].startswith(runtime.PYTHON_DIR)
    assert "/opt/oolong/lib/training_core/rewards/registry.py" in seen["training_core"]
    assert "/opt/oolong/python" in seen["mountinfo"] and "/opt/oolong/lib" in seen["mountinfo"]
    assert "bwrap --args " in seen["cmdlines"]  # PID 1's options came by file descriptor
    assert json.loads(seen.pop("files")) == []
    leaks = {(where, needle) for where, text in seen.items() for needle in needles
             if needle in text and not _shown(where, needle)}
    assert not leaks, leaks


def test_the_image_is_built_once_and_reused():
    image = runtime.runtime()
    marker = image.python_image / ".complete"
    built = json.loads(marker.read_text())["built"]
    runtime.runtime.cache_clear()
    again = runtime.runtime()
    assert again == image
    assert json.loads(marker.read_text())["built"] == built
    # The jail's interpreter is the image's, not the host's virtualenv.
    assert (image.python_image / "bin" / f"python3.{sys.version_info[1]}").is_file()
    assert not (image.python_image / "pyvenv.cfg").exists()
    for tail in runtime._tails(runtime.host_prefixes()):
        assert (image.python_image / tail).resolve() == image.python_image.resolve()
