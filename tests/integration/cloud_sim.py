"""A cloud GPU node, simulated on this machine from the cloud-init Terraform renders for it.

What a booted instance does, done here: the ``write_files`` are written and the ``runcmd``
commands are executed as rendered, under the node's own directory (``/etc/oolong`` becomes
``<node>/etc/oolong``, ``/opt/oolong`` ``<node>/opt/oolong``), with a cloud-init-like environment
(the system ``PATH``, no variable of this test process). The node's worker is then started the
way systemd starts the unit: its ``ExecStart``, with the ``EnvironmentFile``'s variables and in
its ``WorkingDirectory``.

What cannot happen here is named, each with why (``SKIPPED``), and the test asserts that exactly
those were left out:

- the instance metadata service (169.254.169.254) cannot be reached: ``FakeIMDS`` speaks
  IMDSv2 (a session token from ``PUT /latest/api/token``, ``401`` without it) on the node's own
  loopback address, and only that URL is rewritten in the command;
- ``apt`` (``packages``, ``apt.sources``): this machine is not Ubuntu; the packages are asserted
  installed here instead;
- ``systemctl``: systemd is not PID 1 here (see above);
- ``chown ubuntu``: there is no ``ubuntu`` user; the nodes run as this test's user;
- the GPU pins: a node installs the build with the constraints the control plane published
  beside its wheel, ``constraints-gpu.txt`` on a GPU node (SGLang's CUDA torch); this CPU machine
  publishes ``constraints.txt`` instead (``publish_build(gpu=False)``), whose torch it has.

The third-party dependencies are this machine's: ``dependency_dir`` links every distribution of
the project venv except Oolong itself and pip's own tools, and each node venv gets a ``.pth``
line naming it, so pip finds torch, DeepSpeed, Prefect... "already satisfied" instead of
downloading gigabytes. A plain path line in a ``.pth`` does not process the ``.pth`` files of
that directory, and the editable install of the checkout (a finder in a ``.pth``) is not linked
at all: Oolong's own modules come only from the wheel installed into the node's venv.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "infra" / "terraform" / "modules" / "gpu_node_pool" / "cloud-init.yaml.tftpl"
IMDS = "http://169.254.169.254"
# cloud-init's and systemd's PATH on an Ubuntu node (no pyenv shim, no venv of this test).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The node's python3.11: the one the project venv was made with, whose dependencies the nodes
# reuse (a 3.11 of another patch level asks for others: redis wants async-timeout below 3.11.3).
NODE_PYTHON = str(Path(sys.base_prefix) / "bin")
# Paths the node's cloud-init writes to, re-rooted under the node's own directory.
NODE_PATHS = ("/etc/oolong", "/etc/systemd", "/opt/oolong", "/opt/sglang")
SKIPPED = {
    "systemctl": "systemd is not PID 1 here: the test starts the unit's ExecStart as systemd would",
    "chown": "there is no ubuntu user on this machine: the node runs as the test's user",
}
# Not Oolong's third-party dependencies but the tools pip and venv install into every venv.
OWN_TOOLS = ("pip", "setuptools", "_distutils_hack", "pkg_resources", "oolong")


# ---- rendering ---------------------------------------------------------------------------------

def render_cloud_init(values: dict[str, str | int], workdir: Path) -> str:
    """The template rendered by Terraform itself (``templatefile`` in ``terraform console``, as
    the gpu_node_pool module renders each instance's user_data)."""
    args = ", ".join(f"{k}={json.dumps(v)}" for k, v in values.items())
    workdir.mkdir(parents=True, exist_ok=True)  # empty: console leaves no state in the repository
    out = subprocess.run(["terraform", "console"], input=f'templatefile("{TEMPLATE}", {{{args}}})',
                         cwd=workdir, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TF_CLI_CONFIG_FILE": "/dev/null"})
    if out.returncode != 0:
        raise RuntimeError(f"terraform console failed: {out.stderr}")
    return out.stdout.strip().removeprefix("<<EOT").removesuffix("EOT").strip() + "\n"


def dependency_dir(dest: Path) -> Path:
    """Every distribution of the project venv but Oolong and pip's own tools, linked (see the
    module docstring): what the node's pip finds already installed."""
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir(parents=True)
    for entry in site.iterdir():
        name = entry.name
        stem = re.split(r"[-.]", name, maxsplit=1)[0].lower()
        if (name.endswith(".pth") or name.startswith("__editable__") or name == "__pycache__"
                or stem in OWN_TOOLS):
            continue
        (dest / name).symlink_to(entry)
    return dest


# ---- the instance metadata service ---------------------------------------------------------------

class FakeIMDS:
    """IMDSv2 on one loopback address: ``PUT /latest/api/token`` with
    ``X-aws-ec2-metadata-token-ttl-seconds`` (1-21600) gives a token; ``GET /latest/meta-data/
    local-ipv4`` with ``X-aws-ec2-metadata-token`` answers the address the request came in on
    (the instance's own), ``401`` without a valid token, as the real service does."""

    def __init__(self, address: str):
        tokens: dict[str, float] = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):  # noqa: N802 - http.server's naming
                if self.path != "/latest/api/token":
                    return self._reply(404)
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return self._reply(400)
                token = secrets.token_urlsafe(32)
                tokens[token] = time.monotonic() + int(ttl)
                self._reply(200, token)

            def do_GET(self):  # noqa: N802
                token = self.headers.get("X-aws-ec2-metadata-token", "")
                if tokens.get(token, 0.0) < time.monotonic():
                    return self._reply(401)
                if self.path != "/latest/meta-data/local-ipv4":
                    return self._reply(404)
                self._reply(200, self.server.server_address[0])

            def log_message(self, *args):  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer((address, 0), Handler)
        self.url = f"http://{address}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeIMDS:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- a node --------------------------------------------------------------------------------------

@dataclass
class SimulatedNode:
    index: int
    address: str
    root: Path  # the node's disk: everything of the node lives under it
    doc: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def reroot(self, text: str) -> str:
        """The node's absolute paths, moved under its own directory."""
        pattern = r"(?<![\w./-])(" + "|".join(map(re.escape, NODE_PATHS)) + r")(?=[/\s\"']|$)"
        return re.sub(pattern, lambda m: f"{self.root}{m.group(1)}", text)

    def boot(self, rendered: str, imds_url: str, env: dict[str, str],
             after_venv: Callable[[], None] | None = None) -> None:
        """cloud-init's modules that run here: write_files, then runcmd, in order. ``env``:
        what this machine adds to cloud-init's environment (its package index); ``after_venv``
        runs once the command that creates the node's venv did."""
        import yaml

        self.doc = yaml.safe_load(rendered)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "cloud-init.yaml").write_text(rendered)
        for f in self.doc["write_files"]:
            path = Path(self.reroot(f["path"]))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.reroot(f["content"]))
            if "permissions" in f:
                path.chmod(int(f["permissions"], 8))
        log = (self.root / "cloud-init-output.log").open("a")
        home = self.root / "root"
        home.mkdir(exist_ok=True)
        shell_env = {"PATH": f"{NODE_PYTHON}:{SYSTEM_PATH}", "HOME": str(home), "LANG": "C.UTF-8",
                     **env}
        for item in self.doc["runcmd"]:
            cmd = item if isinstance(item, str) else shlex.join(item)
            word = cmd.split()[0]
            if word in SKIPPED:
                self.skipped.append(cmd)
                log.write(f"## skipped ({SKIPPED[word]}): {cmd}\n")
                continue
            cmd = self.reroot(cmd).replace(IMDS, imds_url)
            log.write(f"## {cmd}\n")
            log.flush()
            out = subprocess.run(["sh", "-c", cmd], cwd="/", env=shell_env, stdout=log,
                                 stderr=subprocess.STDOUT, timeout=300)
            if out.returncode != 0:
                raise RuntimeError(f"node-{self.index}: `{cmd}` exited {out.returncode} "
                                   f"(see {self.root / 'cloud-init-output.log'})")
            if after_venv and re.search(rf"-m venv {re.escape(str(self.venv))}$", cmd):
                after_venv()

    @property
    def venv(self) -> Path:
        return self.root / "opt" / "oolong" / "venv"

    def unit(self, name: str = "oolong-prefect-worker.service") -> dict[str, str]:
        text = (self.root / "etc" / "systemd" / "system" / name).read_text()
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def environment_file(self) -> dict[str, str]:
        """systemd's EnvironmentFile: KEY=VALUE lines, comments and blanks ignored."""
        path = Path(self.unit()["EnvironmentFile"])
        return dict(line.split("=", 1) for line in path.read_text().splitlines()
                    if line.strip() and not line.startswith("#"))

    def start_unit(self, name: str, machine_env: dict[str, str]) -> subprocess.Popen:
        """The unit's ExecStart as systemd runs it: its EnvironmentFile's variables (and
        systemd's own few, ``${VAR}`` expanded in its arguments), in its WorkingDirectory, its
        output in ``<unit>.log``. ``machine_env``: what this CPU machine without network needs
        and a GPU node would not (see the test)."""
        unit = self.unit(name)
        home = self.root / "home" / "ubuntu"
        home.mkdir(parents=True, exist_ok=True)
        env = {"PATH": SYSTEM_PATH, "HOME": str(home), "LANG": "C.UTF-8", **machine_env,
               **self.environment_file()}
        argv = [re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word)
                for word in shlex.split(unit["ExecStart"])]
        log = self.root / f"{name.removesuffix('.service')}.log"
        return subprocess.Popen(argv, cwd=unit["WorkingDirectory"], env=env,
                                stdout=log.open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start_worker(self, machine_env: dict[str, str]) -> subprocess.Popen:
        return self.start_unit("oolong-prefect-worker.service", machine_env)


def link_dependencies(venv: Path, deps: Path) -> None:
    """The node venv sees this machine's third-party distributions (module docstring)."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "machine-dependencies.pth").write_text(f"{deps}\n")


def console_script(venv: Path, name: str, module: str, attr: str) -> Path:
    """The console script pip writes for an installed distribution (pip installed none for
    the dependencies it found already satisfied)."""
    path = venv / "bin" / name
    path.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {module} import {attr}\n"
                    f"if __name__ == '__main__':\n    sys.exit({attr}())\n")
    path.chmod(0o755)
    return path


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def process_view(pid: int) -> dict | None:
    """What a process runs, where, with which PYTHONPATH and GPUs (None: it is gone)."""
    proc = Path("/proc") / str(pid)
    try:
        cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        environ = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0")
                       if b"=" in e)
        cwd = os.readlink(proc / "cwd")
    except OSError:
        return None
    return {"argv0": cmdline[0].decode(), "cmdline": b" ".join(cmdline).decode(errors="replace"),
            "cwd": cwd, "pythonpath": environ.get(b"PYTHONPATH", b"").decode(),
            "gpus": environ.get(b"CUDA_VISIBLE_DEVICES", b"").decode()}
