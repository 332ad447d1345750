"""The process lifecycle module: groups stopped whole, one deadline for all, restarts that are
handed back only once brought up."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from training_core.ports import free_port
from training_core.processes import PROCESS_TAG_ENV, Fleet, ManagedProcess, process_env, stop_all

# Ignores SIGTERM and starts a grandchild that would outlive a plain kill of the leader.
STUBBORN = "trap '' TERM; sleep 300 & echo $! > {pidfile}; while true; do sleep 0.1; done"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stop_all_kills_every_group_including_children_that_ignore_sigterm(tmp_path):
    procs = []
    for i in range(3):
        pidfile = tmp_path / f"child{i}"
        procs.append(ManagedProcess(f"p{i}", ["bash", "-c", STUBBORN.format(pidfile=pidfile)],
                                    tmp_path / f"p{i}.log").start())
    for i in range(3):
        for _ in range(100):
            if (tmp_path / f"child{i}").exists() and (tmp_path / f"child{i}").read_text().strip():
                break
            time.sleep(0.05)
    children = [int((tmp_path / f"child{i}").read_text()) for i in range(3)]
    assert all(p.alive() for p in procs) and all(_exists(c) for c in children)

    stop_all(procs, grace_s=0.5)

    assert not any(p.alive() for p in procs)
    for _ in range(50):  # the grandchildren got SIGKILL with their group
        if not any(_exists(c) for c in children):
            break
        time.sleep(0.05)
    assert not any(_exists(c) for c in children)
    stop_all(procs)  # stopping what is stopped is a no-op


# A launcher whose child runs in a session of its own, as torch.distributed.run starts its ranks:
# killing the launcher's group does not reach it.
# The child writes its pid from inside its new session, so the test never sees it before setsid.
LAUNCHER = ("trap '' TERM; setsid bash -c \"echo \\$\\$ > {pidfile}; trap '' TERM; "
            "while true; do sleep 0.1; done\" & while true; do sleep 0.1; done")


def _launcher_with_a_rank(tmp_path) -> tuple[ManagedProcess, int]:
    """LAUNCHER started, and its rank's pid once the rank runs in its own session."""
    pidfile = tmp_path / "rank"
    launcher = ManagedProcess("launcher", ["bash", "-c", LAUNCHER.format(pidfile=pidfile)],
                              tmp_path / "launcher.log").start()
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.05)
    return launcher, int(pidfile.read_text())


def test_stop_all_kills_descendants_in_sessions_of_their_own(tmp_path):
    launcher, rank = _launcher_with_a_rank(tmp_path)
    assert os.getsid(rank) != os.getsid(launcher.pid)  # out of reach of the group's signals

    stop_all([launcher], grace_s=0.5)

    for _ in range(50):
        if not _exists(rank):
            break
        time.sleep(0.05)
    assert not launcher.alive() and not _exists(rank)


def test_stop_all_kills_the_orphans_of_a_launcher_that_died_first(tmp_path):
    """A launcher killed before anyone stopped it (the OOM killer, a crash) leaves its ranks
    re-parented, out of its tree and its group; they still carry its tag."""
    launcher, rank = _launcher_with_a_rank(tmp_path)
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.proc.wait()
        assert _exists(rank) and _parent(rank) != launcher.pid  # an orphan now

        stop_all([launcher], grace_s=0.5)

        for _ in range(50):
            if not _exists(rank):
                break
            time.sleep(0.05)
        assert not _exists(rank)
    finally:  # a failure here must not leave the rank (it ignores SIGTERM) running
        if _exists(rank):
            os.kill(rank, signal.SIGKILL)


def test_the_orphans_of_a_dead_launcher_get_the_grace_period(tmp_path):
    """No leader is left to wait for, yet its orphans still get the deadline to stop on SIGTERM
    (a rank saving its state) before SIGKILL."""
    pidfile, flag = tmp_path / "rank", tmp_path / "cleaned-up"
    rank_script = (f"echo \\$\\$ > {pidfile}; trap 'sleep 0.3; echo done > {flag}; exit 0' TERM; "
                   "while true; do sleep 0.1; done")
    launcher = ManagedProcess("launcher", ["bash", "-c", f'setsid bash -c "{rank_script}" & '
                                           "while true; do sleep 0.1; done"],
                              tmp_path / "launcher.log").start()
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.05)
    rank = int(pidfile.read_text())
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.proc.wait()

        stop_all([launcher], grace_s=5)

        assert flag.exists(), "the orphan was killed before it could stop on SIGTERM"
        for _ in range(50):  # re-parented: its new parent reaps it
            if not _exists(rank):
                break
            time.sleep(0.05)
        assert not _exists(rank)
    finally:
        if _exists(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_tag_marks_only_its_own_processes(tmp_path):
    """Stopping one process does not reach another's children, though both carry tags; a nested
    ManagedProcess's children carry the outer tag too."""
    outer = ManagedProcess("outer", ["sleep", "30"], tmp_path / "outer.log").start()
    other = ManagedProcess("other", ["sleep", "30"], tmp_path / "other.log").start()
    nested = ManagedProcess("nested", ["sleep", "30"], tmp_path / "nested.log",
                            env={PROCESS_TAG_ENV: outer.tag})
    try:
        environ = Path(f"/proc/{outer.pid}/environ").read_bytes().split(b"\0")
        assert f"{PROCESS_TAG_ENV}={outer.tag}".encode() in environ
        nested.start()
        stop_all([outer], grace_s=0.5)
        for _ in range(50):
            if nested.poll() is not None:
                break
            time.sleep(0.05)
        assert nested.poll() is not None and other.alive()
    finally:
        stop_all([outer, other, nested], grace_s=0.5)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _http_server(tmp_path, port: int) -> ManagedProcess:
    return ManagedProcess("web", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                                  str(port)], tmp_path / "web.log",
                          health_url=f"http://127.0.0.1:{port}/")


def test_a_restart_is_handed_back_only_after_bring_up_succeeds(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _http_server(tmp_path, port).start()
    fleet = Fleet(urls=[url], servers=[server])
    fleet.wait_healthy(30)
    first_pid = server.pid

    def refuse(u: str) -> None:
        assert httpx.get(u + "/").status_code == 200  # it was up when asked
        raise RuntimeError("weights did not load")

    with pytest.raises(RuntimeError, match="weights did not load"):
        fleet.restart(0, bring_up=refuse, timeout_s=30)
    assert fleet.alive() == [False], "a server that failed its bring-up is stopped again"

    seen: list[str] = []
    fleet.restart(0, bring_up=seen.append, timeout_s=30)
    assert seen == [url] and fleet.alive() == [True] and server.pid != first_pid
    fleet.stop()
    assert fleet.alive() == [False]


def test_a_server_that_dies_while_starting_says_so_with_its_log(tmp_path):
    proc = ManagedProcess("broken", [sys.executable, "-c", "import sys; print('no model here');"
                                     " sys.exit(3)"], tmp_path / "b.log",
                          health_url=f"http://127.0.0.1:{free_port()}/health").start()
    with pytest.raises(RuntimeError, match="broken exited with 3:\nno model here"):
        proc.wait_healthy(30)


def test_run_processes_get_an_allow_listed_environment():
    from training_core.processes import process_env

    parent = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2", "NCCL_SOCKET_IFNAME": "eth1",
              "AWS_ACCESS_KEY_ID": "store-key", "OOLONG_CHECKPOINT_STORE": "s3://b/p",
              "DATABASE_URL": "postgres://secret", "CELERY_BROKER_URL": "redis://x",
              "DJANGO_SECRET_KEY": "k", "OOLONG_INGEST_TOKEN": "t", "SOMETHING_ELSE": "1"}
    env = process_env({"PYTHONPATH": "/run"}, parent=parent)
    assert env == {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2", "NCCL_SOCKET_IFNAME": "eth1",
                   "AWS_ACCESS_KEY_ID": "store-key", "OOLONG_CHECKPOINT_STORE": "s3://b/p",
                   "PYTHONPATH": "/run"}


def test_an_embedded_fleet_does_not_inherit_secrets(tiny_model_dir, tmp_path, monkeypatch):
    from training_core.launch import start_embedded_fleet

    monkeypatch.setenv("DJANGO_SECRET_KEY", "do-not-leak")
    fleet = start_embedded_fleet(str(tiny_model_dir), 1, tmp_path, dtype="float32")
    try:
        environ = open(f"/proc/{fleet.servers[0].pid}/environ", "rb").read().split(b"\0")
    finally:
        fleet.stop()
    assert not any(e.startswith(b"DJANGO_SECRET_KEY=") for e in environ)
    assert any(e.startswith(b"PATH=") for e in environ)


def _free_window(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now, below the kernel's ephemeral range.

    A fixed window raced: the platform lane's simulated cloud listens in 41000-41499, and any
    outgoing connection may take an ephemeral port (32768-60999 by default) for a while."""
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    for low in range(21000, ephemeral_low - n, n):
        socks = []
        try:
            for port in range(low, low + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return low
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.skip(f"no {n} consecutive free ports below {ephemeral_low}")


def test_ports_come_from_the_nodes_open_range(monkeypatch):
    """Cloud nodes open a fixed port range to each other and the control plane; every port a
    run's process listens on (servers, rendezvous, weight group) is taken from it."""
    import socket

    low = _free_window(4)
    high = low + 3
    span = f"{low}-{high}"
    monkeypatch.setenv("OOLONG_PORT_RANGE", span)
    held = []
    try:
        for _ in range(4):
            port = free_port()
            assert low <= port <= high and port not in [h.getsockname()[1] for h in held]
            s = socket.socket()
            s.bind(("0.0.0.0", port))
            held.append(s)
        with pytest.raises(RuntimeError, match=f"no free port in OOLONG_PORT_RANGE={span}"):
            free_port()
    finally:
        for s in held:
            s.close()
    monkeypatch.setenv("OOLONG_PORT_RANGE", str(low))
    with pytest.raises(ValueError, match="expected LOW-HIGH"):
        free_port()
    assert "OOLONG_PORT_RANGE" in process_env(parent={"OOLONG_PORT_RANGE": "1-2", "SECRET": "x"})
