"""Issue 47, item 9 (the jail): io_uring and socket families outside Unix/IPv4/IPv6 (AF_VSOCK
ignores network namespaces) refused; a uid per concurrent jail, so one jail cannot exhaust
another's per-user kernel limits; nothing of a reward runs between calls (its threads frozen,
zombie leaders with live threads killed); the kernel's boot line, configuration and symbols
masked. Run as root, as CI does."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from training_core.jail import jail_user
from training_core.jail.uids import uid_range
from training_core.sandbox import JailedWorker


def _worker(body: str) -> JailedWorker:
    """A worker whose reward runs ``body`` and reports ``out`` (JSON) as its error text."""
    source = ("import ctypes, errno, json, os, socket, sys, threading, time\n"
              "libc = ctypes.CDLL(None, use_errno=True)\nkept = []\n"
              "def reward(c, i):\n    out = {}\n" + body
              + "    raise RuntimeError('OUT' + json.dumps(out))\n")
    return JailedWorker({"kind": "source", "entrypoint": "reward"}, source=source)


def _call(worker: JailedWorker) -> dict:
    status, answer = worker.call("x", {}, 30)
    assert status == "ok" and "OUT" in answer.get("error", ""), (status, answer)
    return json.loads(answer["error"].split("OUT", 1)[1])


def _once(body: str) -> dict:
    worker = _worker(body)
    try:
        return _call(worker)
    finally:
        worker.kill()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 syscall numbers")
def test_io_uring_is_refused():
    found = _once("    params = ctypes.create_string_buffer(120)\n"
                  "    out['rc'] = libc.syscall(425, 8, params)\n"  # io_uring_setup
                  "    out['errno'] = ctypes.get_errno()\n")
    assert found == {"rc": -1, "errno": errno.EPERM}, found


def test_sockets_only_for_unix_and_ip():
    found = _once("    for name, family in (('unix', 1), ('inet', 2), ('inet6', 10), ('netlink', 16),\n"
                  "                         ('packet', 17), ('vsock', 40), ('bluetooth', 31),\n"
                  "                         ('alg', 38), ('big', 1000)):\n"
                  "        try:\n"
                  "            socket.socket(family, socket.SOCK_DGRAM if family == 16 else\n"
                  "                          socket.SOCK_STREAM).close()\n"
                  "            out[name] = 'opened'\n"
                  "        except OSError as e:\n"
                  "            out[name] = e.errno\n"
                  "    a, b = socket.socketpair()\n"
                  "    out['pair'] = a.fileno() > 0\n"
                  "    try:\n"
                  "        socket.socketpair(40)\n"
                  "        out['vsock_pair'] = 'opened'\n"
                  "    except OSError as e:\n"
                  "        out['vsock_pair'] = e.errno\n")
    assert found.pop("pair") is True
    assert {k: found[k] for k in ("unix", "inet", "inet6")} == dict.fromkeys(("unix", "inet", "inet6"), "opened")
    refused = {k: v for k, v in found.items() if k not in ("unix", "inet", "inet6")}
    assert refused == dict.fromkeys(refused, errno.EAFNOSUPPORT), found


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root caller's jails are user namespaces")
def test_each_concurrent_jail_has_its_own_uid_and_per_user_limits():
    """The inotify instances one jail opens (up to fs.inotify.max_user_instances, per uid) used to
    leave none for every other jail on the machine."""
    first, last = uid_range()
    hog = _worker("    while True:\n"
                  "        fd = libc.inotify_init1(0)\n"
                  "        if fd < 0:\n"
                  "            out['errno'] = ctypes.get_errno()\n"
                  "            break\n"
                  "        kept.append(fd)\n"
                  "    out['held'] = len(kept)\n"
                  "    out['uid'] = os.getuid()\n")
    other = _worker("    fd = libc.inotify_init1(0)\n"
                    "    out['fd'] = fd\n    out['errno'] = ctypes.get_errno()\n"
                    "    out['uid'] = os.getuid()\n")
    try:
        held = _call(hog)
        limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
        assert held["errno"] == errno.EMFILE and held["held"] <= limit, held
        mine = _call(other)
        assert mine["fd"] >= 0, f"one jail's inotify instances starved another: {mine}"
        uids = {held["uid"], mine["uid"], hog.jail.uid, other.jail.uid}
        assert len(uids) == 2 and all(first <= u <= last for u in uids), uids
        assert jail_user()[0] not in uids and 0 not in uids
    finally:
        hog.kill()
        other.kill()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_rewards_threads_do_not_run_between_calls():
    worker = _worker("    def burn():\n        while True:\n            pass\n"
                     "    threading.Thread(target=burn, daemon=True).start()\n"
                     "    out['started'] = True\n")
    try:
        assert _call(worker) == {"started": True}
        pid = worker.jailed_pid
        assert pid is not None
        before = _cpu_s(pid)
        time.sleep(1.5)
        # Unfrozen, the thread burns up to the jail's whole CPU (1.0) for the 1.5 s.
        assert _cpu_s(pid) - before < 0.3
        assert worker.call("x", {}, 30)[0] == "ok"  # the next call runs as usual
    finally:
        worker.kill()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 syscall numbers")
def test_a_zombie_leader_with_live_threads_is_killed_after_the_call():
    """A child whose main thread exits alone (SYS_exit) is a zombie to /proc/<pid>/stat while
    its other threads run on: the clean-up between calls took it for dead and left it."""
    worker = _worker("    if os.fork() == 0:\n"
                     "        threading.Thread(target=time.sleep, args=(3600,)).start()\n"
                     "        libc.syscall(60, 0)\n"  # exit(2): this thread only
                     "    time.sleep(0.5)\n"
                     "    out['forked'] = True\n")
    try:
        assert _call(worker) == {"forked": True}
        worker.jail.thaw()  # look at it as it would run
        left = []
        for pid in worker.jail.cgroup.pids():
            if pid in worker._keep:
                continue
            tasks = Path(f"/proc/{pid}/task")
            states = [(t / "stat").read_text().rpartition(")")[2].split()[0]
                      for t in (tasks.iterdir() if tasks.exists() else [])]
            if any(s not in ("Z", "X") for s in states):
                left.append((pid, states))
        assert left == [], left
    finally:
        worker.kill()


def test_kernel_boot_line_config_and_symbols_are_masked():
    found = _once("    for path in ('/proc/cmdline', '/proc/kallsyms', '/proc/config.gz',\n"
                  "                 '/proc/timer_list', '/proc/iomem'):\n"
                  "        try:\n"
                  "            out[path] = len(open(path, 'rb').read())\n"
                  "        except OSError as e:\n"
                  "            out[path] = e.strerror\n"
                  "        if not os.path.exists(path):\n"
                  "            out[path] = 'absent'\n")
    for path, seen in found.items():
        # Host: absent, or a non-empty file. Jail: absent there too, empty, or unreadable.
        assert seen in (0, "absent", "Permission denied"), (path, seen)
    assert Path("/proc/cmdline").read_bytes()  # the host's is there, and the jail did not see it
