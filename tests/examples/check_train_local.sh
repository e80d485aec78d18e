#!/usr/bin/env bash
# Runs train_local and checks its contract: exit 0, a checkpoint written, and a final JSON line whose
# test_accuracy is at least MIN_ACCURACY.
#   check_train_local.sh BINARY MIN_ACCURACY [ARGS...]
set -euo pipefail
binary=$1
min_accuracy=$2
shift 2
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
"$binary" --checkpoint "$workdir/ckpt/model.ckpt" "$@" | tee "$workdir/out.txt"
last=$(tail -n 1 "$workdir/out.txt")
[[ "$last" == '{"example":"train_local"'* ]] || { echo "FAIL: last line is not the JSON summary: $last"; exit 1; }
[[ -s "$workdir/ckpt/model.ckpt" ]] || { echo "FAIL: no checkpoint written"; exit 1; }
accuracy=$(sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p' <<<"$last")
awk -v a="$accuracy" -v m="$min_accuracy" 'BEGIN { exit !(a >= m) }' ||
  { echo "FAIL: test accuracy $accuracy < $min_accuracy"; exit 1; }
echo "OK: test accuracy $accuracy >= $min_accuracy"
