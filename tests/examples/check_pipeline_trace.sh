#!/usr/bin/env bash
# Runs a pipeline example with --trace DIR (appended to the command) and checks the trace it wrote against
# the pipeline events of docs/tracing.md: exit status 0, the program says where the trace went, every file
# is complete (header first, end line last), STEPS pipeline.step spans (a0 the step, a1 MICRO, a2 STAGES,
# detail SCHEDULE) in one file, and exactly one pipeline.forward and one pipeline.backward span (detail
# DETAIL) for every (stage, micro-batch, step) over all the files, each stage in one file only. In a file
# that holds the steps, every stage event lies inside its step's span (one process, one clock).
#
#   check_pipeline_trace.sh STAGES MICRO STEPS SCHEDULE DETAIL -- COMMAND [ARGS...]
#
# Example:
#   check_pipeline_trace.sh 2 4 16 1f1b local -- build/examples/local_pipeline --limit 1024 --schedule 1f1b
set -euo pipefail

[[ $# -ge 7 && $6 == -- ]] || { sed -n '2,12p' "$0" >&2; exit 2; }
stages=$1
micro=$2
steps=$3
schedule=$4
detail=$5
shift 6

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
set +e
"$@" --trace "$workdir/trace" | tee "$workdir/out.txt"
status=${PIPESTATUS[0]}
set -e
[[ $status -eq 0 ]] || { echo "FAIL: exited with status $status"; exit 1; }
grep -q "trace written to $workdir/trace/" "$workdir/out.txt" || { echo "FAIL: the program did not say where the trace went"; exit 1; }
shopt -s nullglob
files=("$workdir"/trace/*.trace.jsonl)
[[ ${#files[@]} -ge 1 ]] || { echo "FAIL: no trace files in $workdir/trace"; exit 1; }
for f in "${files[@]}"; do
  head -n 1 "$f" | grep -q '^{"distgrad_trace":1,' || { echo "FAIL: $f has no header line"; exit 1; }
  tail -n 1 "$f" | grep -q '^{"type":"end",' || { echo "FAIL: $f has no end line (not closed)"; exit 1; }
done

awk -v S="$stages" -v M="$micro" -v K="$steps" -v SCHED="$schedule" -v DETAIL="$detail" '
function num(key,   m) {
  if (match($0, "\"" key "\":-?[0-9]+")) return substr($0, RSTART + length(key) + 3, RLENGTH - length(key) - 3) + 0
  return "none"
}
function str(key) {
  if (match($0, "\"" key "\":\"[^\"]*\"")) return substr($0, RSTART + length(key) + 4, RLENGTH - length(key) - 5)
  return "none"
}
function fail(msg) { print "FAIL: " msg; failed = 1 }
/"name":"pipeline\./ {
  name = str("name"); type = str("type")
  if (type != "span") fail(FILENAME ": " name " is a " type ", not a span")
  if (str("cat") != "pipeline") fail(FILENAME ": " name " has cat " str("cat"))
  b = num("b"); e = num("e")
  if (b > e) fail(FILENAME ": " name " ends before it begins")
  if (name == "pipeline.step") {
    k = num("a0")
    if (num("a1") != M || num("a2") != S || str("detail") != SCHED)
      fail("step " k ": args (" num("a1") ", " num("a2") ", " str("detail") ") instead of (" M ", " S ", " SCHED ")")
    if (k in stepB) fail("step " k " recorded twice")
    stepB[k] = b; stepE[k] = e; stepFile[k] = FILENAME; nsteps++
  } else if (name == "pipeline.forward" || name == "pipeline.backward") {
    key = name " " num("a0") " " num("a1") " " num("a2")
    if (str("detail") != DETAIL) fail(key ": detail " str("detail"))
    seen[key]++
    n++; evFile[n] = FILENAME; evStep[n] = num("a2"); evB[n] = b; evE[n] = e; evKey[n] = key
    s = num("a0")
    if ((s in stageFile) && stageFile[s] != FILENAME) fail("stage " s " has events in two files")
    stageFile[s] = FILENAME
  }
}
END {
  if (nsteps != K) fail(nsteps + 0 " pipeline.step spans, expected " K)
  for (k = 0; k < K; k++) if (!(k in stepB)) fail("no pipeline.step for step " k)
  expected = 0
  for (s = 0; s < S; s++) for (m = 0; m < M; m++) for (k = 0; k < K; k++) {
    for (i = 0; i < 2; i++) {
      key = (i ? "pipeline.backward " : "pipeline.forward ") s " " m " " k
      if (seen[key] != 1) fail(key ": recorded " seen[key] + 0 " times")
      expected++
    }
  }
  if (n != expected) fail(n + 0 " stage events, expected " expected)
  nested = 0
  for (i = 1; i <= n; i++) {
    k = evStep[i]
    if (!(k in stepFile) || stepFile[k] != evFile[i]) continue
    if (evB[i] < stepB[k] || evE[i] > stepE[k]) fail(evKey[i] " lies outside its step span")
    nested++
  }
  if (failed) exit 1
  printf "OK: %d steps, %d forward/backward spans over %d stage(s), %d checked inside their step\n", K, n, S, nested
}' "${files[@]}"
