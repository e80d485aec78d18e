# shellcheck shell=bash
# Shared helpers for scripts/*.sh. Sourced, never run on its own.
#
# Builds go through the presets in CMakePresets.json so that the scripts, CI and a developer typing
# `cmake --preset X` all get the same flags. DG_JOBS sets build/test parallelism (default 2: the build
# machines have two cores).

DG_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DG_JOBS="${DG_JOBS:-2}"
# shellcheck source=scripts/deps.sh
source "$DG_ROOT/scripts/deps.sh"

dg_log() { printf '[distgrad] %s\n' "$*" >&2; }
dg_die() {
  printf '[distgrad] error: %s\n' "$*" >&2
  exit 1
}

# The build directory of a configure preset (must match "binaryDir" in CMakePresets.json).
dg_preset_dir() {
  case "$1" in
    default) echo "$DG_ROOT/build" ;;
    ci) echo "$DG_ROOT/build-test" ;;
    *) echo "$DG_ROOT/build-$1" ;;
  esac
}

# dg_configure PRESET [CMAKE_ARG...]: (re)configures the preset's build directory. CMake's chatter goes to
# <dir>/configure.log and is shown only when configuring fails.
dg_configure() {
  local preset=$1
  shift
  local dir
  dir=$(dg_preset_dir "$preset")
  if [[ -f "$dir/CMakeCache.txt" ]] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$dir/CMakeCache.txt"; then
    dg_die "$dir was configured with another generator than Ninja; remove it (rm -rf $dir) and rerun"
  fi
  mkdir -p "$dir"
  dg_log "configure: cmake --preset $preset${*:+ $*} (-> ${dir#"$DG_ROOT"/})"
  if ! (cd "$DG_ROOT" && cmake --preset "$preset" "$@") >"$dir/configure.log" 2>&1; then
    cat "$dir/configure.log" >&2
    dg_die "configuring preset $preset failed (log: $dir/configure.log)"
  fi
}

# dg_build PRESET [TARGET...]: builds the given targets (all when none) with $DG_JOBS jobs. Build output
# goes to stderr so that a script's stdout carries only its programs' results (bench.sh: JSON lines).
dg_build() {
  local preset=$1
  shift
  local dir
  dir=$(dg_preset_dir "$preset")
  local -a targets=()
  [[ $# -eq 0 ]] || targets=(--target "$@")
  dg_log "build: ${*:-all} (${dir#"$DG_ROOT"/}, -j$DG_JOBS)"
  cmake --build "$dir" -j "$DG_JOBS" "${targets[@]}" >&2 || dg_die "build failed"
}

# dg_has_target PRESET TARGET: true when the configured build defines TARGET.
dg_has_target() {
  local dir
  dir=$(dg_preset_dir "$1")
  ninja -C "$dir" -t targets all 2>/dev/null | grep -q "^$2:"
}
