"""What a GPU node installs, read from the cloud-init Terraform renders: the exact build by hash
and never a name from a public index, every requirement pinned, and every environment on the
Python its packages require (their ``Requires-Python`` and wheel tags, from the pinned
releases' metadata: tests/infra/node_packages.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.infra import cloud_init, node_packages

ROOT = Path(__file__).resolve().parents[2]
# What each interpreter a command names is on the node's image (Ubuntu 22.04 + deadsnakes).
INTERPRETERS = {"python3": "3.10", "python3.10": "3.10", "python3.11": "3.11"}
DIST = "/opt/oolong/dist/"


def _pip_lines(cmds: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """(venv, constraints files, requirements) of every ``<venv>/bin/pip install`` line."""
    out = []
    for cmd in cmds:
        words = shlex.split(cmd)
        if len(words) < 2 or not words[0].endswith("/bin/pip") or words[1] != "install":
            continue
        constraints, reqs, args = [], [], iter(words[2:])
        for word in args:
            if word in ("-c", "--constraint"):
                constraints.append(next(args))
            elif word.startswith("-"):
                assert word in ("--no-input", "--no-deps", "--no-build-isolation"), \
                    f"an option this test does not know: {word} in {cmd}"
            else:
                reqs.append(word)
        out.append((words[0].removesuffix("/bin/pip"), constraints, reqs))
    return out


def _venvs(cmds: list[str]) -> dict[str, str]:
    """Each venv's directory -> the interpreter version it was made with."""
    out = {}
    for cmd in cmds:
        if m := re.fullmatch(r"(\S+) -m venv (\S+)", cmd):
            out[m.group(2)] = INTERPRETERS.get(Path(m.group(1)).name, m.group(1))
    return out


def _pins(constraint_paths: list[str]) -> dict[str, str]:
    """name -> version of every ``==`` pin in the node's constraints files (the files the build
    publishes are this checkout's, by name)."""
    pins = {}
    for path in constraint_paths:
        assert path.startswith(DIST), path
        for line in (ROOT / Path(path).name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                req = Requirement(line)
                pins[req.name.lower()] = next(iter(req.specifier)).version
    return pins


def _installs(doc: dict) -> list[tuple[str, str, str]]:
    """(venv, what, pin) for every requirement a pip line names: ``name==version``, or the
    build's wheel by its path."""
    out = []
    for venv, constraints, reqs in _pip_lines(cloud_init.commands(doc)):
        pins = _pins(constraints)
        for raw in reqs:
            if raw.startswith(DIST):
                out.append((venv, raw, "wheel"))
                continue
            req = Requirement(raw)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            version = exact[0] if exact else pins.get(req.name.lower())
            assert version, f"{raw} in {venv} is pinned neither on its line nor by {constraints}"
            out.append((venv, raw, f"{req.name}=={version}"))
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    return cloud_init.render(tmp_path_factory.mktemp("console"))


def test_nodes_install_the_exact_build_by_hash_and_no_name_from_an_index(rendered, tmp_path):
    cmds = cloud_init.commands(rendered)
    build = cloud_init.VALUES["oolong_build"]
    sums = cloud_init.files(rendered)[DIST + "SHA256SUMS"].split("\n")
    # every file of the build is fetched from its URL, and its hash is checked before any pip
    check = next(i for i, c in enumerate(cmds) if "sha256sum --strict --check SHA256SUMS" in c)
    assert cmds[check].startswith(f"cd {DIST.rstrip('/')} && ")
    first_pip = next(i for i, c in enumerate(cmds) if "/bin/pip " in c)
    assert check < first_pip
    for f in build.values():
        name = Path(f["url"]).name
        assert f"{f['sha256']}  {name}" in sums
        fetch = next(i for i, c in enumerate(cmds) if f["url"] in c)
        assert fetch < check, cmds[fetch]
        assert cmds[fetch].endswith(f" {DIST}{name}") or f" -o {DIST}{name} " in cmds[fetch]
    # the wheel is installed from that file; Oolong never by a name an index resolves
    wheel = [what for _, what, pin in _installs(rendered) if pin == "wheel"]
    assert wheel == [f"{DIST}{Path(build['wheel']['url']).name}[core,orchestration]"]
    for _, what, pin in _installs(rendered):
        assert pin == "wheel" or not pin.lower().startswith("oolong"), what
    # the grep of the issue, on the rendered text: no bare-name install, no venv on python3
    text = cloud_init.render_text(tmp_path, sglang_version="0.5.23")
    assert not re.search(r"pip install[^\n]*[\"' ]oolong[\[=\"' \n]", text)
    assert "python3 -m venv" not in text


def test_no_install_by_name_in_the_infra_or_the_flows():
    """The grep of the issue: nothing in infra/ or the orchestration installs Oolong by a
    project name (an index would resolve it to somebody else's package)."""
    bare = re.compile(r"pip3?\s+install\b[^\n]*?(?<![/\w.-])oolong(?:\[|==|\s|\"|'|$)")
    found = []
    for folder in (ROOT / "infra", ROOT / "platform"):
        for path in folder.rglob("*"):
            if path.is_file() and path.suffix in (".tf", ".tftpl", ".py", ".yaml", ".sh", ".md"):
                found += [f"{path.relative_to(ROOT)}: {m.group(0)}"
                          for m in bare.finditer(path.read_text())]
    assert not found, found
    variables = (ROOT / "infra" / "terraform" / "modules" / "gpu_node_pool" / "variables.tf").read_text()
    assert 'variable "oolong_package"' not in variables


def test_every_requirement_is_pinned_and_every_environment_runs_the_python_it_needs(rendered):
    """Each venv's interpreter against what is installed into it: Requires-Python and the
    wheel's tag, from the pinned releases' metadata (the fixture, checked against the releases
    where they are at hand by test_the_recorded_metadata_is_the_releases)."""
    venvs = _venvs(cloud_init.commands(rendered))
    assert set(venvs) == {"/opt/oolong/venv", "/opt/sglang/venv"}, venvs
    facts = node_packages.recorded()
    problems = []
    for venv, _what, pin in _installs(rendered):
        python = venvs[venv]
        if pin == "wheel":
            fact = _oolong_wheel_facts()
        else:
            assert pin in facts, f"{pin} is not in {node_packages.FIXTURE.name}: refresh it " \
                                 "(python -m tests.infra.node_packages)"
            fact = facts[pin]
        if fact["requires_python"] and python not in SpecifierSet(fact["requires_python"]):
            problems.append(f"{venv} runs Python {python}, {pin} requires "
                            f"{fact['requires_python']}")
        cp = [t.split("-")[0] for t in fact.get("tags", []) if t.startswith("cp")]
        if cp and f"cp{python.replace('.', '')}" not in cp:
            problems.append(f"{venv} runs Python {python}, {pin} ships wheels for {cp} only")
    assert not problems, problems


def test_the_old_python3_sglang_environment_is_what_this_test_refuses(rendered):
    """The check above fails on what cloud-init did before: SGLang's venv on the AMI's python3."""
    cmds = [c.replace("python3.11 -m venv /opt/sglang/venv", "python3 -m venv /opt/sglang/venv")
            for c in cloud_init.commands(rendered)]
    venvs = _venvs(cmds)
    sglang = node_packages.recorded()["sglang==0.5.23"]
    assert venvs["/opt/sglang/venv"] not in SpecifierSet(sglang["requires_python"])


def test_the_recorded_metadata_is_the_releases():
    """The fixture against every pinned release this machine has (installed at that version,
    or the SGLang wheel): the same Requires-Python, the same tags."""
    checked = []
    for pin, fact in node_packages.recorded().items():
        here = node_packages.at_hand(pin)
        if here is None:
            continue
        assert here["requires_python"] == fact["requires_python"], pin
        if "tags" in here:
            assert here["tags"] == fact["tags"], pin
        checked.append(pin)
    if not checked:
        pytest.skip("none of the pinned releases is at hand here")


def _oolong_wheel_facts() -> dict:
    """The build's own metadata: the wheel the control plane publishes (orchestration/builds.py),
    built from this checkout."""
    from orchestration.builds import build_wheel

    return node_packages._wheel_facts(build_wheel())


def test_the_efa_environment_only_where_the_type_has_efa(tmp_path):
    with_efa = cloud_init.env_file(cloud_init.render(tmp_path / "a", efa=True))
    assert with_efa["FI_PROVIDER"] == "efa" and with_efa["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "/opt/amazon/efa/lib" in with_efa["LD_LIBRARY_PATH"]
    without = cloud_init.env_file(cloud_init.render(tmp_path / "b", efa=False))
    assert not [k for k in without if k.startswith("FI_")]
    # the node's secrets: its run's node key and the Prefect credential, in a root-only file
    doc = cloud_init.render(tmp_path / "c")
    node_env = next(f for f in doc["write_files"] if f["path"] == "/etc/oolong/node.env")
    assert node_env["permissions"] == "0600"
    assert without["OOLONG_NODE_KEY"] == cloud_init.NODE_KEY
    assert without["PREFECT_API_AUTH_STRING"] == cloud_init.PREFECT_AUTH
