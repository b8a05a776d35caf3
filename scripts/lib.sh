# Shared helpers for scripts/*: dependency installation, paths, logging.
# Sourced, not executed.  Everything here is idempotent and quiet when done.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${NVMEOF_FUSE_VENV:-$REPO/.venv}
STATE=${NVMEOF_FUSE_STATE:-$REPO/.testbed}

APT_PACKAGES=(
  qemu-system-x86 busybox-static kmod udev iproute2 rdma-core ibverbs-utils
  ibverbs-providers libibverbs1 librdmacm1 rdmacm-utils perftest nvme-cli
  fuse3 libfuse3-dev pkg-config fio e2fsprogs xfsprogs fdisk jq bsdextrautils procps dmsetup
)  # libfuse3-dev and pkg-config: to build pyfuse3 (the pyfuse3 extra, which the tests run too)
BACKPORTS_SUITE=bookworm-backports

log() { printf '%s\n' "$*" >&2; }
die() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }

# The backports kernel (6.12): on 6.1, kernel nvme-tcp writes at QD16 hung
# and rxe was slower.  We add the backports suite to the Debian apt source
# that is already configured, reusing its URIs (never naming a host here).
ensure_backports_source() {
  local list=/etc/apt/sources.list.d/nvmeof-fuse-backports.sources
  [[ -e $list ]] && return 0
  local uris
  uris=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null)
  [[ -n $uris ]] || uris=$(awk '$1=="deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
  [[ -n $uris ]] || die "cannot find a configured Debian apt source to add $BACKPORTS_SUITE to"
  cat >"$list" <<SRC
Types: deb
URIs: $uris
Suites: $BACKPORTS_SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  APT_UPDATED=
}

# Newest installed Debian kernel image of at least 6.12 (the backports one,
# e.g. /boot/vmlinuz-6.12.95+deb12-amd64); empty when there is none.
testbed_kernel() {
  local k
  k=$(ls -1 /boot/vmlinuz-*-amd64 2>/dev/null | sort -V | tail -n 1)
  [[ -n $k ]] || return 0
  printf '%s\n' "${k#/boot/vmlinuz-}" 6.12 | sort -V -C && return 0
  printf '%s\n' "$k"
}

apt_missing() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}

ensure_apt() {
  local missing
  mapfile -t missing < <(apt_missing "${APT_PACKAGES[@]}")
  if [[ -z $(testbed_kernel) ]]; then
    ensure_backports_source
  fi
  if [[ ${#missing[@]} -gt 0 || -z $(testbed_kernel) ]]; then
    log "installing system packages (${missing[*]:-} kernel)..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    if [[ ${#missing[@]} -gt 0 ]]; then
      apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    if [[ -z $(testbed_kernel) ]]; then
      apt-get install -y -qq --no-install-recommends -t "$BACKPORTS_SUITE" linux-image-amd64 >/dev/null
    fi
    [[ -n $(testbed_kernel) ]] || die "no $BACKPORTS_SUITE kernel under /boot after install"
  fi
}

# The venv holds the project (editable), its test and pyfuse3 extras and virtme-ng.  Editable
# in setuptools' compat mode: a plain path in a .pth file.  The default mode's import hook
# imports pathlib and friends at every interpreter start, which the testbed VM pays for each of
# the hundreds of Python processes the suite starts (docs/testbed.md).
EDITABLE_MODE=compat
ensure_venv() {
  local stamp=$VENV/.nvmeof-fuse-stamp want
  want=$({ cat "$REPO/pyproject.toml"; echo "$EDITABLE_MODE"; } | sha1sum | cut -c1-12)
  [[ -f $stamp && $(cat "$stamp") == "$want" ]] && return 0
  log "preparing python venv in $VENV..."
  [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
  local piplog=$VENV/pip.log
  if ! { "$VENV/bin/pip" install -q --upgrade pip && \
         "$VENV/bin/pip" install -q --config-settings editable_mode=$EDITABLE_MODE \
           -e "$REPO[test,pyfuse3]" virtme-ng; } >"$piplog" 2>&1; then
    tail -n 30 "$piplog" >&2
    die "pip install failed (full log: $piplog)"
  fi
  echo "$want" >"$stamp"
}

ensure_deps() {
  ensure_apt
  ensure_venv
  export PATH=$VENV/bin:$PATH
}

# The testbed's TLS target: nvmet hands its TLS handshakes to tlshd (ktls-utils), which Debian
# packages from trixie on only, and the kernel initiator's `nvme connect --tls` and
# `gen-tls-key --insert` need nvme-cli 2.x newer than Debian 12's 2.3.  The guest boots this
# host's root, so trixie's binaries and their whole library closure, unpacked under TLS_ROOT,
# run there through trixie's own loader (scripts/vm/testbed-guest).  apt, with directories of
# its own, fetches them and checks their signatures and hashes; nothing is installed here.
# nvme-cli comes without its dependencies: it depends on uuid-runtime, which pulls in systemd,
# while the binary needs only libnvme (whose closure is fetched) and libc.
TLS_ROOT=$STATE/trixie/root
TLS_UNAVAILABLE=$STATE/trixie/unavailable  # one line: why there is no TLS target
TLS_SUITE=trixie
TLS_PACKAGES=(ktls-utils libnvme1t64)
TLS_ALONE=(nvme-cli)
ensure_tls_target() {
  local d=$STATE/trixie want stamp
  want="$TLS_SUITE ${TLS_PACKAGES[*]} ${TLS_ALONE[*]}"
  stamp=$d/complete
  [[ -f $stamp && $(cat "$stamp") == "$want" ]] && return 0
  rm -rf "$d"
  mkdir -p "$d"/{lists/partial,cache/archives/partial,etc}
  touch "$d/status"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $TLS_SUITE main" \
    >"$d/etc/sources.list"
  local apt=(apt-get -qq -o Dir::Etc::SourceList="$d/etc/sources.list"
    -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists="$d/lists"
    -o Dir::State::status="$d/status" -o Dir::Cache="$d/cache" -o Debug::NoLocking=1
    -o APT::Get::Download-Only=1 -o APT::Sandbox::User=root -o Acquire::Retries=1
    -o Acquire::http::Timeout=30 -o APT::Update::Error-Mode=any)
  local err=$d/apt.log deb
  if ! { "${apt[@]}" update && "${apt[@]}" install -y --no-install-recommends "${TLS_PACKAGES[@]}" \
         && (cd "$d/cache/archives" && "${apt[@]}" download "${TLS_ALONE[@]}"); } >"$err" 2>&1; then
    printf 'no TLS target: fetching %s from Debian %s failed: %s\n' "${TLS_PACKAGES[*]} ${TLS_ALONE[*]}" \
      "$TLS_SUITE" "$(grep -m1 -E '^(E|W):' "$err" || tail -n 1 "$err")" >"$TLS_UNAVAILABLE"
    log "testbed: $(cat "$TLS_UNAVAILABLE") (the TLS VM tests skip; full log: $err)"
    return 0
  fi
  for deb in "$d"/cache/archives/*.deb; do dpkg-deb -x "$deb" "$TLS_ROOT"; done
  rm -rf "$d/cache" "$d/lists"
  # The closure must be whole: each program runs by trixie's loader with trixie's libraries only.
  local lib=$TLS_ROOT/usr/lib/x86_64-linux-gnu prog
  for prog in sbin/tlshd sbin/nvme; do
    if ! "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$TLS_ROOT/usr/$prog" --version \
         >"$err" 2>&1; then
      printf 'no TLS target: %s from Debian %s does not run here: %s\n' "${prog#sbin/}" \
        "$TLS_SUITE" "$(tail -n 1 "$err")" >"$TLS_UNAVAILABLE"
      log "testbed: $(cat "$TLS_UNAVAILABLE") (the TLS VM tests skip)"
      return 0
    fi
  done
  echo "$want" >"$stamp"
}

# The `nvmeof` reference initiator, the benches' peer on RDMA, at the version they were measured with.
NVMEOF_VERSION=2026.10.22
ensure_nvmeof() {
  "$VENV/bin/python" -c "import nvmeof, sys; sys.exit(nvmeof.__version__ != '$NVMEOF_VERSION')" \
    2>/dev/null && return
  log "installing nvmeof==$NVMEOF_VERSION (the reference initiator) into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "nvmeof==$NVMEOF_VERSION" \
    || die "pip install nvmeof==$NVMEOF_VERSION failed"
}

# What a side of an A/B runs: the package, the benches and the RAM namespace they mount.
AB_PATHS=(nvmeof_fuse scripts/benches tests/ramdisk.py)

# The two sides of a same-boot A/B (scripts/bench-ab-*): $2 gets AB_PATHS as of git REF $1 (those
# it has: the benches were in the package before), $3 a copy of the working tree's, both
# compiled, so the tree may change while the VM runs.
ab_snapshots() {
  local ref=$1 old=$2 new=$3 p paths=()
  rm -rf "$old" "$new"; mkdir -p "$old" "$new"
  for p in "${AB_PATHS[@]}"; do
    git -C "$REPO" cat-file -e "$ref:$p" 2>/dev/null && paths+=("$p")
  done
  git -C "$REPO" archive "$ref" "${paths[@]}" | tar -x -C "$old"
  for p in "${AB_PATHS[@]}"; do
    mkdir -p "$new/$(dirname "$p")"
    cp -r "$REPO/$p" "$new/$(dirname "$p")/"
  done
  "$VENV/bin/python" -m compileall -q "$old" "$new" >/dev/null 2>&1 || true
}
