#!/usr/bin/env bash
# Installs what distgrad needs to build, test and run its demo on Debian 12 (bookworm) / Ubuntu, using apt.
#
#   scripts/deps.sh [--torch] [EXTRA_PACKAGE...]      # run it
#   source scripts/deps.sh; dg_deps [EXTRA_PACKAGE...] # or source it (defines functions, runs nothing)
#
# Idempotent and fast when everything is present: one dpkg-query call, no network. `apt-get update` runs
# only when a package is missing. Uses sudo only when not root. --torch adds python3-torch, which only the
# PyTorch comparison in scripts/bench.sh needs. CUDA is never installed here: CMake finds nvcc under
# /usr/local/cuda when present. Set DG_SKIP_DEPS=1 to skip all of this (other distros, no root access).

# Every package the build needs, including those later modules use (rpc: capnproto, libuv, ucx; boost
# headers; cairo for `distgrad-trace plot`), so a machine is set up once.
DG_DEPS_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  # Debian's oneDNN is built with its OpenCL GPU runtime: its CMake config (find_package(dnnl)) fails without
  # the OpenCL headers and library, which libdnnl-dev only recommends (and we install without recommends).
  libdnnl-dev ocl-icd-opencl-dev zlib1g-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  dataset-fashion-mnist
  capnproto libcapnp-dev libuv1-dev libssl-dev libboost-dev libucx-dev
  libcairo2-dev
)
DG_DEPS_TORCH_PACKAGES=(python3-torch)

# Prints the packages among "$@" that are not installed, one per line.
dg_missing_packages() {
  local installed
  # One dpkg-query call for all names; names dpkg does not know produce an error on stderr (ignored) and
  # simply do not appear as installed.
  # dpkg-query exits non-zero when any name is unknown: tolerate it (callers may run under set -e/pipefail).
  installed=$({ dpkg-query -W -f='${Package} ${Status}\n' "$@" 2>/dev/null || true; } |
    awk '$NF == "installed" {print $1}')
  local pkg
  for pkg in "$@"; do
    grep -qxF "$pkg" <<<"$installed" || echo "$pkg"
  done
}

# Installs the base packages plus "$@" when any is missing.
dg_deps() {
  if [[ "${DG_SKIP_DEPS:-0}" == 1 ]]; then
    echo "[distgrad] deps: skipped (DG_SKIP_DEPS=1)" >&2
    return 0
  fi
  local wanted=("${DG_DEPS_PACKAGES[@]}" "$@")
  if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "[distgrad] deps: not a Debian/Ubuntu system; make sure these (or your distro's equivalents) are" \
         "installed: ${wanted[*]}" >&2
    return 0
  fi
  local -a missing=()
  local list
  list=$(dg_missing_packages "${wanted[@]}") || return 1
  [[ -z "$list" ]] || mapfile -t missing <<<"$list"
  if [[ ${#missing[@]} -eq 0 ]]; then
    echo "[distgrad] deps: all ${#wanted[@]} packages present" >&2
    return 0
  fi
  echo "[distgrad] deps: installing ${missing[*]}" >&2
  local -a asRoot=()
  if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "[distgrad] deps: missing ${missing[*]}, and not root without sudo: install them as root" \
           "(apt-get install ${missing[*]}) or set DG_SKIP_DEPS=1" >&2
      return 1
    fi
    asRoot=(sudo)
  fi
  # Wait for a dpkg lock held by another apt (unattended upgrades on a fresh machine) instead of failing.
  local -a apt=("${asRoot[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=600)
  "${apt[@]}" update || return 1
  "${apt[@]}" install -y --no-install-recommends "${missing[@]}" || return 1
  list=$(dg_missing_packages "${wanted[@]}") || return 1
  if [[ -n "$list" ]]; then
    echo "[distgrad] deps: still missing after apt-get install: ${list//$'\n'/ }" >&2
    return 1
  fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  extra=()
  for arg in "$@"; do
    case "$arg" in
      --torch) extra+=("${DG_DEPS_TORCH_PACKAGES[@]}") ;;
      -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
      -*) echo "deps.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
      *) extra+=("$arg") ;;
    esac
  done
  dg_deps "${extra[@]}"
fi
