#!/usr/bin/env bash
# Runs an example program and checks its contract: exit status 0, a final JSON line
# {"example":"NAME",...} (directly, or as rank 0's "[0] {...}" line under distgrad-run), and a
# test_accuracy of at least MIN_ACCURACY. Works for any launcher: the command is everything after "--".
#
#   check_example.sh [OPTIONS] NAME MIN_ACCURACY -- COMMAND [ARGS...]
#
# Options (before NAME, repeatable):
#   --require KEY        the JSON line must have KEY (e.g. --require images_per_s)
#   --expect KEY=VALUE   KEY's value must be exactly VALUE as printed (strings without quotes:
#                        --expect mode=local_pipeline, --expect stages=2)
#   --at-least KEY=MIN   KEY's numeric value must be >= MIN (e.g. --at-least peak_rss_mib_max=1)
#   --at-most KEY=MAX    KEY's numeric value must be <= MAX (e.g. --at-most optimizer_state_fraction=0.75)
#   --file KEY           KEY's value names a file that must exist and not be empty (e.g. --file checkpoint)
#
# Examples:
#   check_example.sh --expect mode=single single_worker 0.3 -- build/examples/single_worker --limit 512
#   check_example.sh rpc_pipeline 0.3 -- build/tools/distgrad-run --nproc 3 -- build/examples/rpc_pipeline
set -euo pipefail

usage() {
  sed -n '2,18p' "$0" >&2
  exit 2
}

requires=()
expects=()
atleasts=()
atmosts=()
files=()
while [[ $# -gt 0 && $1 == --* && $1 != -- ]]; do
  [[ $# -ge 2 ]] || usage
  case $1 in
    --require) requires+=("$2") ;;
    --expect) expects+=("$2") ;;
    --at-least) atleasts+=("$2") ;;
    --at-most) atmosts+=("$2") ;;
    --file) files+=("$2") ;;
    *) echo "check_example.sh: unknown option $1" >&2; usage ;;
  esac
  shift 2
done
[[ $# -ge 4 && $3 == -- ]] || usage
name=$1
min_accuracy=$2
shift 3

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
set +e
"$@" | tee "$workdir/out.txt"
status=${PIPESTATUS[0]}
set -e
[[ $status -eq 0 ]] || { echo "FAIL: $name exited with status $status"; exit 1; }

json=$(grep -E '^(\[0\] )?\{"example":"'"$name"'"' "$workdir/out.txt" | tail -n 1 | sed -E 's/^\[0\] //') || true
[[ -n "$json" ]] || { echo "FAIL: no JSON line {\"example\":\"$name\",...} in the output"; exit 1; }

# The printed value of KEY in the JSON line (strings without their quotes), or nothing if absent.
field() {
  sed -nE 's/.*[{,]"'"$1"'":("([^"\\]|\\.)*"|[^,}]*).*/\1/p' <<<"$json" | sed -E 's/^"(.*)"$/\1/'
}

accuracy=$(field test_accuracy)
[[ -n "$accuracy" ]] || { echo "FAIL: the JSON line has no test_accuracy: $json"; exit 1; }
awk -v a="$accuracy" -v m="$min_accuracy" 'BEGIN { exit !(a + 0 >= m + 0) }' ||
  { echo "FAIL: test accuracy $accuracy < $min_accuracy"; exit 1; }
for key in "${requires[@]+"${requires[@]}"}"; do
  grep -q '[{,]"'"$key"'":' <<<"$json" || { echo "FAIL: the JSON line has no $key: $json"; exit 1; }
done
for pair in "${expects[@]+"${expects[@]}"}"; do
  key=${pair%%=*}
  want=${pair#*=}
  got=$(field "$key")
  [[ "$got" == "$want" ]] || { echo "FAIL: $key is '$got', expected '$want'"; exit 1; }
done
for pair in "${atleasts[@]+"${atleasts[@]}"}"; do
  key=${pair%%=*}
  min=${pair#*=}
  got=$(field "$key")
  [[ -n "$got" ]] && awk -v a="$got" -v m="$min" 'BEGIN { exit !(a + 0 >= m + 0) }' ||
    { echo "FAIL: $key is '$got', expected >= $min"; exit 1; }
done
for pair in "${atmosts[@]+"${atmosts[@]}"}"; do
  key=${pair%%=*}
  max=${pair#*=}
  got=$(field "$key")
  [[ -n "$got" ]] && awk -v a="$got" -v m="$max" 'BEGIN { exit !(a + 0 <= m + 0) }' ||
    { echo "FAIL: $key is '$got', expected <= $max"; exit 1; }
done
for key in "${files[@]+"${files[@]}"}"; do
  path=$(field "$key")
  [[ -n "$path" && -s "$path" ]] || { echo "FAIL: $key '$path' is not a non-empty file"; exit 1; }
done
echo "OK: $name test accuracy $accuracy >= $min_accuracy"
