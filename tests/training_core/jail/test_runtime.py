"""The jail's runtime image: which packages it holds and how a host prefix is overwritten in a
binary (``training_core/jail/runtime.py``). The image in a jail: tests/security/
test_jail_runtime_paths.py."""

from __future__ import annotations

import os

import pytest

from training_core.jail import runtime

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def _names(monkeypatch, value: str | None) -> set[str]:
    if value is None:
        monkeypatch.delenv("OOLONG_JAIL_PACKAGES", raising=False)
    else:
        monkeypatch.setenv("OOLONG_JAIL_PACKAGES", value)
    return {d.metadata["Name"].lower().replace("_", "-") for d in runtime.distributions()}


def test_the_package_list_and_what_it_requires(monkeypatch):
    default = _names(monkeypatch, None)
    # What the built-in rewards and agents import, and their dependencies.
    assert {"numpy", "sympy", "math-verify", "openai", "httpx", "pydantic", "mpmath"} <= default
    assert "torch" not in default and "django" not in default and "oolong" not in default
    assert _names(monkeypatch, "default") == default
    assert _names(monkeypatch, "none") == set()
    assert _names(monkeypatch, "default, filelock") == default | {"filelock"}
    assert _names(monkeypatch, "filelock,not-installed-anywhere") == {"filelock"}


def test_a_binary_names_the_neutral_prefix_by_a_path_of_the_same_length():
    prefix = "/root/.pyenv/versions/3.11.7"
    padded = runtime._neutral_bytes(prefix, runtime.PYTHON_DIR)
    assert padded is not None and len(padded) == len(prefix)
    # Its tail stays (libpython's version string is the tail of its prefix string); the image
    # links that name to itself, so the path is the image's.
    assert padded.endswith(b"/3.11.7")
    assert os.path.normpath(padded.decode()) == runtime.PYTHON_DIR + "/3.11.7"
    assert runtime._tails([prefix, "/opt/py"]) == {"3.11.7"}
    # No room, or a name that would hide a directory of the image: left to LD_LIBRARY_PATH.
    assert runtime._neutral_bytes("/opt/py", runtime.PYTHON_DIR) is None
    assert runtime._neutral_bytes("/some/long/enough/prefix/lib", runtime.PYTHON_DIR) is None


def test_a_binary_keeps_its_length_and_text_names_the_neutral_path(tmp_path, monkeypatch):
    prefix = "/home/someone/.pyenv/versions/3.11.7"
    binary = tmp_path / "libx.so"
    binary.write_bytes(b"\x7fELF\0\0" + prefix.encode() + b"/lib\0" + b"3.11.7\0")
    text = tmp_path / "_sysconfigdata.py"
    text.write_text(f"build = {{'prefix': '{prefix}', 'LIBDIR': '{prefix}/lib'}}\n")
    untouched = tmp_path / "plain.py"
    untouched.write_text("x = 1\n")
    size = binary.stat().st_size
    assert runtime._scrub(binary, [prefix]) and runtime._scrub(text, [prefix])
    assert not runtime._scrub(untouched, [prefix])
    data = binary.read_bytes()
    assert len(data) == size and prefix.encode() not in data
    assert b"/opt/oolong/python" in data and data.endswith(b"3.11.7\0")
    assert text.read_text() == ("build = {'prefix': '/opt/oolong/python', "
                                "'LIBDIR': '/opt/oolong/python/lib'}\n")


def test_a_requirement_line_names_its_distribution_unless_it_is_an_extras():
    assert runtime._required('numpy>=1.21') == "numpy"
    assert runtime._required('typing-extensions (>=4.6) ; python_version < "3.13"') == "typing-extensions"
    assert runtime._required("pydantic_core[x]==2.1") == "pydantic_core"
    assert runtime._required('pytest; extra == "test"') is None


def test_a_mount_is_found_by_its_real_path(tmp_path):
    # A link to a mount point is that mount (mountinfo names the real path).
    (tmp_path / "link").symlink_to("/dev/shm")
    shm_is_tmpfs = any(line.split()[4] == "/dev/shm" and " - tmpfs " in line
                       for line in open("/proc/self/mountinfo"))
    assert runtime._is_tmpfs_mount(tmp_path / "link") == shm_is_tmpfs
    assert not runtime._is_tmpfs_mount(tmp_path)
    assert runtime._unescape(r"/a\040b\134c") == "/a b\\c"
