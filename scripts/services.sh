#!/usr/bin/env bash
# Make sure the services the tests talk to run on 127.0.0.1: PostgreSQL (trust auth for
# 127.0.0.1, user postgres), Redis, and Chromium for browser tests; and that bubblewrap, the jail
# every reward runs in, is installed (`services.sh jail` alone is what the demo needs), and qemu
# with a kernel for the cgroup v2 VM test (`services.sh vm`). Installs from Debian's packages when
# missing. `services.sh up` records what it started; `down` stops it.
set -euo pipefail
STATE=${OOLONG_SERVICES_STATE:-/tmp/oolong-services-started}
APT_UPDATED=0

apt_install() {
  if [ "$APT_UPDATED" = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pg_up() {
  if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then return; fi
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    echo "services: installing PostgreSQL"; apt_install postgresql
  fi
  local ver; ver=$(ls /etc/postgresql | sort -V | tail -1)
  local hba=/etc/postgresql/$ver/main/pg_hba.conf
  if ! grep -q "oolong-trust" "$hba"; then
    # Tests connect as postgres over TCP without a password (as on the dev machines).
    sed -i '1i host all all 127.0.0.1/32 trust # oolong-trust\nhost all all ::1/128 trust # oolong-trust' "$hba"
  fi
  echo "services: starting PostgreSQL $ver"
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start
  echo "pg $ver" >> "$STATE"
  for _ in $(seq 60); do pg_isready -q -h 127.0.0.1 && return; sleep 0.5; done
  echo "services: PostgreSQL did not come up" >&2; exit 1
}

redis_up() {
  if redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then return; fi
  command -v redis-server >/dev/null || { echo "services: installing Redis"; apt_install redis-server; }
  mkdir -p /var/lib/redis /var/log/redis
  echo "services: starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  echo "redis" >> "$STATE"
  for _ in $(seq 40); do redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && return; sleep 0.25; done
  echo "services: Redis did not come up" >&2; exit 1
}

jail_up() {
  if ! command -v bwrap >/dev/null; then
    echo "services: installing bubblewrap (the reward sandbox)"; apt_install bubblewrap
  fi
  # The seccomp filter is built with libseccomp (PyPI pyseccomp loads Debian's libseccomp2).
  if ! ldconfig -p | grep -q 'libseccomp\.so\.2'; then
    echo "services: installing libseccomp2 (the jail's seccomp filter)"; apt_install libseccomp2
  fi
  # A root caller starts the jail as this unprivileged user, never as uid 0 (see
  # training_core/jail/). No home, no shell, no password: it only ever runs bwrap.
  if [ "$(id -u)" = 0 ] && ! id -u oolong-jail >/dev/null 2>&1; then
    echo "services: creating the system user oolong-jail (the reward jail runs as it)"
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
      --user-group oolong-jail
  fi
}

# tests/security/test_jail_cgroup_v2_vm.py boots Debian's kernel (cgroup v2 only) under qemu
# (scripts/vm_run.py), only where /dev/kvm exists (elsewhere that test skips). The kernel and a
# static busybox are unpacked into .cache/vm, not installed: no boot entry, no initramfs hook and
# no bootloader change on the host. Best effort: whatever fails, the test skips and says why.
VM_DIR=${OOLONG_VM_DIR:-$(cd "$(dirname "$0")/.." && pwd)/.cache/vm}
vm_up() {
  [ -e /dev/kvm ] && [ "$(uname -m)" = x86_64 ] && command -v apt-get >/dev/null || return 0
  vm_unpack || echo "services: the cgroup v2 VM test's tools are missing; that test will skip"
}
vm_unpack() (
  # Each step checks its own exit: set -e does not hold in a function called as `vm_unpack ||`,
  # and a half-unpacked kernel (no modules.dep) must not be left looking finished.
  if ! command -v qemu-system-x86_64 >/dev/null; then
    echo "services: installing qemu (the cgroup v2 VM test)"
    apt_install --no-install-recommends qemu-system-x86 || exit 1
  fi
  if ! command -v depmod >/dev/null; then  # a slim image has no kmod; qemu does not pull it in
    echo "services: installing kmod (depmod indexes the VM kernel's modules)"
    apt_install --no-install-recommends kmod || exit 1
  fi
  ls "$VM_DIR"/lib/modules/*/modules.dep "$VM_DIR"/bin/busybox >/dev/null 2>&1 && exit 0
  if [ "$APT_UPDATED" = 0 ]; then apt-get update -qq || exit 1; fi
  local kernel
  kernel=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  [ -n "$kernel" ] || exit 1
  echo "services: unpacking $kernel and busybox-static into $VM_DIR (the cgroup v2 VM test)"
  local tmp; tmp=$(mktemp -d) && chmod 777 "$tmp" || exit 1  # apt-get download writes as _apt
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download -qq "$kernel" busybox-static) || exit 1
  rm -rf "$VM_DIR.tmp" && mkdir -p "$VM_DIR.tmp" || exit 1
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$VM_DIR.tmp" || exit 1; done
  depmod -b "$VM_DIR.tmp" "$(ls "$VM_DIR.tmp/lib/modules")" || exit 1
  rm -rf "$VM_DIR" && mv "$VM_DIR.tmp" "$VM_DIR"
)

chromium_up() {
  command -v chromium >/dev/null && return
  echo "services: installing Chromium (browser tests)"; apt_install chromium
}

down() {
  [ -f "$STATE" ] || return 0
  while read -r what ver; do
    case "$what" in
      pg) pg_ctlcluster --skip-systemctl-redirect "$ver" main stop || true ;;
      redis) redis-cli -h 127.0.0.1 shutdown nosave >/dev/null 2>&1 || true ;;
    esac
  done < "$STATE"
  rm -f "$STATE"
}

case "${1:-up}" in
  up) rm -f "$STATE"; pg_up; redis_up; chromium_up; jail_up; vm_up ;;
  jail) jail_up ;;
  vm) vm_up ;;
  down) down ;;
  *) echo "usage: $0 up|jail|vm|down" >&2; exit 2 ;;
esac
