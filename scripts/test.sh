#!/usr/bin/env bash
# Builds everything with warnings as errors (preset "ci": Release, build-test/) and runs the test suites.
# This is exactly what CI runs (.ci/run). Exits non-zero when the build or any test fails.
#
#   ./scripts/test.sh [--slow] [--preset ci|asan|tsan|debug] [CTEST_ARG...]
#
#   --slow          also run tests labelled "slow" (same as DG_TEST_SLOW=1)
#   --preset NAME   build and test another configure preset from CMakePresets.json (e.g. asan)
#   CTEST_ARG       passed to ctest, e.g. -R Conv2d, -L autograd, --repeat until-fail:3
#
# Environment: DG_JOBS (build and test jobs, default 2), DG_SKIP_DEPS=1 (do not check/install packages).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "$0")/common.sh"

preset=ci
slow="${DG_TEST_SLOW:-0}"
ctest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --slow) slow=1 ;;
    --preset) [[ $# -ge 2 ]] || dg_die "--preset needs a name"; preset=$2; shift ;;
    --preset=*) preset=${1#--preset=} ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) ctest_args+=("$1") ;;
  esac
  shift
done
[[ "$slow" == 1 ]] || ctest_args=(-LE slow "${ctest_args[@]}")

start=$SECONDS
dg_deps
dg_configure "$preset"
dg_build "$preset"

cd "$DG_ROOT"
# How many tests the selection holds: zero is fine while the checkout has no test sources yet, but once
# tests/ has some, finding none means discovery or the filter is broken, which must not pass quietly.
listing=$(ctest --preset "$preset" -N "${ctest_args[@]}" 2>&1) || {
  echo "$listing" >&2
  dg_die "ctest could not list the tests"
}
count=$(sed -n 's/^Total Tests: \([0-9]*\)$/\1/p' <<<"$listing")
if [[ "${count:-0}" -eq 0 ]]; then
  if compgen -G "tests/*/*.cpp" >/dev/null; then
    dg_die "ctest selected no tests (filters: ${ctest_args[*]}) although tests/ has test sources"
  fi
  dg_log "no tests in this checkout yet (tests/*/*.cpp is empty): build checked, nothing to run"
  exit 0
fi

dg_log "test: $count tests, ctest --preset $preset -j$DG_JOBS ${ctest_args[*]}"
status=0
ctest --preset "$preset" -j "$DG_JOBS" --no-tests=error "${ctest_args[@]}" || status=$?
elapsed=$((SECONDS - start))
if [[ $status -ne 0 ]]; then
  dg_log "FAILED (ctest exit $status) after ${elapsed}s"
  exit "$status"
fi
dg_log "all $count tests passed in ${elapsed}s"
