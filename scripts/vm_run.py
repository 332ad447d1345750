"""Run one shell command as root in a KVM virtual machine whose kernel mounts cgroup v2 only.

Test infrastructure: the jail's cgroup v2 code needs a real v2 kernel, and the host (a Docker
container with cgroup v1 controllers) is not one. The guest boots Debian's kernel
(``linux-image-amd64``) with ``cgroup_no_v1=all`` and sees this machine's root filesystem through
9p, read-only: the same Python, virtualenv, repository and users. Writable: tmpfs at /tmp,
/var/tmp, /run and /dev/shm, lost at power-off. cgroup2 is mounted at /sys/fs/cgroup with the
command in the root cgroup and no controller enabled yet (what the command makes of the
hierarchy is its business). No network device.

    python3 scripts/vm_run.py [--memory-mb 2048] [--cpus 2] [--timeout 300] -- 'command ...'

The guest's output streams to stdout; the exit status is the command's (124: timed out, 125:
the VM failed before reporting one). Needs /dev/kvm, qemu-system-x86, and Debian's kernel and
busybox-static unpacked into .cache/vm (``bash scripts/services.sh vm`` does both; a kernel
and busybox installed on the host are used where .cache/vm has none). Stdlib only.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATUS = "oolong-vm-exit-status-{nonce}="  # the nonce: no line the command prints can fake it
# Where scripts/services.sh unpacks Debian's kernel and busybox-static (nothing is installed on
# the host); a kernel and busybox installed on the host itself are used where that has none.
VM_DIR = Path(os.environ.get("OOLONG_VM_DIR", Path(__file__).resolve().parents[1] / ".cache" / "vm"))
ROOTS = (VM_DIR, Path("/"))
# Loaded in this order: the PCI transport, then 9p over it (Debian builds them as modules).
MODULES = ("virtio_pci", "9pnet_virtio", "9p")
KERNEL_ARGS = ("console=ttyS0 loglevel=1 panic=-1 rdinit=/init "
               # No v1 hierarchy can be mounted: the jail has v2 or nothing.
               "cgroup_no_v1=all systemd.unified_cgroup_hierarchy=1")

# PID 1 of the guest (busybox sh). It survives the command so that it can report the status
# and power off; the command runs in the host's tree.
INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "vm_run init: $*"; reboot -f; }
mount -t proc proc /proc && mount -t sysfs sysfs /sys && mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules); do insmod "$m" || fail "insmod $m"; done
R=/newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot $R \
  || fail "mounting the host's root over 9p"
mount -t proc proc $R/proc && mount -t sysfs sysfs $R/sys \
  && mount -t cgroup2 cgroup2 $R/sys/fs/cgroup && mount -t devtmpfs devtmpfs $R/dev \
  || fail "mounting /proc, /sys, /sys/fs/cgroup, /dev"
mkdir -p $R/dev/pts $R/dev/shm && mount -t devpts devpts $R/dev/pts \
  && mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm || fail "mounting /dev/pts, /dev/shm"
# The command's directory (the checkout, with its venv) stays visible where it is, also when
# it lies under a directory that gets a tmpfs (a CI clone in /tmp).
CWD=$(cat /cwd)
mkdir -p /keep && mount --bind "$R$CWD" /keep || fail "binding $CWD"
for d in /tmp /var/tmp /run; do
  mount -t tmpfs -o mode=1777 tmpfs $R$d || fail "mounting tmpfs at $d"
done
[ -d "$R$CWD" ] || mkdir -p "$R$CWD" || fail "recreating $CWD"
mount --bind /keep "$R$CWD" || fail "binding $CWD back"
cp /command $R/run/vm-command
stty -F /dev/console -onlcr 2>/dev/null
# The host's tree becomes the namespace's root, not a chroot: the kernel refuses user namespaces
# (bwrap for a non-root caller) to a chrooted process. PID 1 keeps its own root (busybox).
cd $R && mount --move $R / || fail "moving the root"
chroot . /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/tmp \
  TMPDIR=/tmp LANG=C.UTF-8 /bin/sh -c "cd \"\$1\" && . /run/vm-command" vm-command "$(cat /cwd)" \
  </dev/console >/dev/console 2>&1
echo "oolong-vm-exit-status-$(cat /nonce)=$?"
reboot -f
"""


def _cpio(entries: list[tuple[str, int, bytes, int]]) -> bytes:
    """A ``newc`` archive (the initramfs format) of ``(name, mode, data, rdev)`` entries, written
    here so that no root-owned staging directory or device node is needed."""
    out = bytearray()
    for ino, (name, mode, data, rdev) in enumerate([*entries, ("TRAILER!!!", 0, b"", 0)], 1):
        raw = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, os.major(rdev), os.minor(rdev), len(raw), 0)
        out += b"070701" + b"".join(b"%08x" % f for f in fields) + raw
        out += b"\0" * (-len(out) % 4) + data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def find_kernel() -> tuple[Path, str, Path]:
    """The newest ``boot/vmlinuz-*`` whose modules include 9p (Debian's cloud kernel has none),
    its version and the root its modules are under: .cache/vm first, then the host's /boot."""
    for root in ROOTS:
        images = sorted((root / "boot").glob("vmlinuz-*"), key=lambda p: p.stat().st_mtime,
                        reverse=True)
        for image in images:
            version = image.name.removeprefix("vmlinuz-")
            modules = root / "lib" / "modules" / version
            if (modules / "modules.dep").exists() and list(modules.rglob("9p.ko*")):
                return image, version, root
    raise SystemExit("vm_run: no kernel with 9p modules in .cache/vm or /boot "
                     "(bash scripts/services.sh vm)")


def busybox() -> Path | None:
    """A static busybox for the initramfs (Debian's busybox-static), or None."""
    for root in ROOTS:
        path = root / "bin" / "busybox"
        if path.exists() and _static(path):
            return path
    return None


def module_files(version: str, root: Path) -> list[str]:
    files: list[str] = []
    for module in MODULES:
        lines = subprocess.run(["modprobe", "-d", str(root), "-S", version, "--show-depends",
                                module], check=True, capture_output=True, text=True).stdout
        files += [line.split()[1] for line in lines.splitlines() if line.startswith("insmod ")]
    return list(dict.fromkeys(files))


def accel() -> list[str]:
    """KVM where the CPU has hardware virtualisation; otherwise qemu's own JIT (TCG). A /dev/kvm
    without vmx/svm (a PVM host, as in some sandboxed CI machines) runs only paravirtualised
    kernels at speed: a stock kernel there creeps through emulation for minutes."""
    flags = set(re.findall(r"\b(vmx|svm)\b", Path("/proc/cpuinfo").read_text()))
    if flags and os.access("/dev/kvm", os.R_OK | os.W_OK):
        # ARCH_CAPABILITIES is refused by some nested KVM hosts (qemu aborts at start).
        return ["-accel", "kvm", "-cpu", "host,-arch-capabilities"]
    return ["-accel", "tcg,thread=multi", "-cpu", "max"]


def initramfs(version: str, root: Path, command: str, cwd: str, nonce: str) -> bytes:
    modules = module_files(version, root)
    dirs = ["bin", "dev", "proc", "sys", "newroot", "lib"]
    entries = [(d, 0o40755, b"", 0) for d in dirs]
    entries.append(("dev/console", 0o20600, b"", os.makedev(5, 1)))  # init's stdio before devtmpfs
    static = busybox()
    if static is None:
        raise SystemExit("vm_run: no static busybox (bash scripts/services.sh vm)")
    entries.append(("bin/busybox", 0o100755, static.read_bytes(), 0))
    entries.append(("init", 0o100755, INIT.encode(), 0))
    entries.append(("command", 0o100644, command.encode() + b"\n", 0))
    entries.append(("cwd", 0o100644, cwd.encode(), 0))
    entries.append(("nonce", 0o100644, nonce.encode(), 0))
    names = [f"lib/m{i}.ko" for i in range(len(modules))]
    entries.append(("modules", 0o100644, "\n".join("/" + n for n in names).encode(), 0))
    entries += [(n, 0o100644, Path(f).read_bytes(), 0) for n, f in zip(names, modules, strict=True)]
    return _cpio(entries)


def _static(path: Path) -> bool:
    """An ELF64 executable without a PT_INTERP header (no dynamic loader: it runs in the initramfs)."""
    data = path.read_bytes()
    if len(data) < 0x40 or data[:4] != b"\x7fELF":
        return False
    phoff, = struct.unpack_from("<Q", data, 0x20)
    size, count = struct.unpack_from("<HH", data, 0x36)
    return all(struct.unpack_from("<I", data, phoff + i * size)[0] != 3 for i in range(count))


def missing() -> str | None:
    """Why no VM can be started here, or None. /dev/kvm is asked for even where TCG will run
    the guest (see :func:`accel`): a machine without it gets no VM tools from services.sh."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "/dev/kvm is missing or not usable by this user"
    for tool in ("qemu-system-x86_64", "modprobe"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (bash scripts/services.sh vm)"
    if busybox() is None:
        return "no static busybox in .cache/vm or /bin (bash scripts/services.sh vm)"
    try:
        find_kernel()
    except SystemExit as exc:
        return str(exc)
    return None


def run(command: str, *, memory_mb: int = 2048, cpus: int = 2, timeout_s: float = 300,
        cwd: str | None = None, out=sys.stdout) -> int:
    """Boot, run ``command`` (sh) as root in ``cwd`` (default: ours), stream its output to
    ``out``; its exit status, 124 on timeout, 125 if the VM gave none."""
    image, version, root = find_kernel()
    nonce = secrets.token_hex(8)
    marker = STATUS.format(nonce=nonce)
    with tempfile.TemporaryDirectory(prefix="oolong-vm-") as tmp:
        initrd = Path(tmp, "initramfs")
        initrd.write_bytes(initramfs(version, root, command, cwd or os.getcwd(), nonce))
        qemu = ["qemu-system-x86_64", *accel(), "-m", str(memory_mb),
                "-smp", str(cpus), "-nodefaults", "-display", "none", "-no-reboot",
                "-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console",
                "-kernel", str(image), "-initrd", str(initrd), "-append", KERNEL_ARGS,
                "-fsdev", "local,id=hostroot,path=/,security_model=passthrough,readonly=on,"
                "multidevs=remap",
                "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot"]
        # qemu dies with us (a test's timeout kills this process with SIGKILL, which runs no
        # finally): a guest left behind would hold 2 GB and two busy vCPUs.
        proc = subprocess.Popen(qemu, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        status = None
        deadline = time.monotonic() + timeout_s
        try:
            assert proc.stdout is not None
            for raw in _lines(proc, deadline):
                line = raw.decode(errors="replace").replace("\r", "")
                match = re.fullmatch(re.escape(marker) + r"(\d+)\n?", line)
                if match:
                    status = int(match.group(1))
                elif status is None:  # after it: the kernel's power-off notice
                    out.write(line)
                    out.flush()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    if time.monotonic() > deadline and status is None:
        out.write(f"vm_run: timed out after {timeout_s:.0f}s\n")
        return 124
    if status is None:
        out.write(f"vm_run: the VM stopped without an exit status (qemu exit {proc.returncode})\n")
        return 125
    return status


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _lines(proc: subprocess.Popen, deadline: float):
    """qemu's output line by line until it exits or the deadline passes (then it is killed)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    while (left := deadline - time.monotonic()) > 0:
        if not sel.select(timeout=min(left, 1.0)):
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        buf += chunk
        *done, buf = buf.split(b"\n")
        yield from (line + b"\n" for line in done)
    if buf:
        yield buf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-mb", type=int, default=2048)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300, help="seconds, boot included")
    parser.add_argument("--check", action="store_true", help="only say whether a VM can start here")
    parser.add_argument("command", nargs="*", help="shell command (after --)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that qemu and the tmp dir go
    if args.check:
        reason = missing()
        print(reason or "ok")
        return 1 if reason else 0
    if not args.command:
        parser.error("no command")
    reason = missing()
    if reason:
        print(f"vm_run: {reason}", file=sys.stderr)
        return 125
    return run(" ".join(args.command), memory_mb=args.memory_mb, cpus=args.cpus,
               timeout_s=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
