#!/usr/bin/env bash
# Builds the benchmarks (Release, build/) and runs them, printing one JSON object per line on stdout and
# saving the same lines to build/bench-results/<UTC time>.jsonl (with a .meta.json beside it: commit, CPU).
#
#   ./scripts/bench.sh [--no-torch] [NAME...]
#
# NAME is a benchmark: bench/NAME.cpp (built as build/bench/bench_NAME) and/or its PyTorch counterpart
# bench/NAME_torch.py, which runs right after it for comparison (python3-torch is installed for it).
# Without NAME every benchmark runs. --no-torch skips the PyTorch side.
#
# Environment: DG_JOBS (build jobs, default 2), DG_SKIP_DEPS=1, DG_PYTHON (default /usr/bin/python3: Debian's
# interpreter, which python3-torch installs into).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "$0")/common.sh"

torch=1
names=()
for arg in "$@"; do
  case "$arg" in
    --no-torch) torch=0 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    -*) dg_die "unknown option $arg (try --help)" ;;
    *) names+=("${arg#bench_}") ;;
  esac
done
python="${DG_PYTHON:-/usr/bin/python3}"

cd "$DG_ROOT"
if [[ ${#names[@]} -eq 0 ]]; then
  mapfile -t names < <(for f in bench/*.cpp bench/*_torch.py; do
    [[ -e "$f" ]] || continue
    f=${f#bench/}
    f=${f%.cpp}
    echo "${f%_torch.py}"
  done | sort -u)
  [[ ${#names[@]} -gt 0 ]] || dg_die "no benchmarks in bench/ yet"
fi
cpp_targets=()
want_torch=0
for name in "${names[@]}"; do
  has_cpp=0 has_py=0
  [[ -f "bench/$name.cpp" ]] && has_cpp=1 && cpp_targets+=("bench_$name")
  [[ -f "bench/${name}_torch.py" ]] && has_py=1 && [[ $torch == 1 ]] && want_torch=1
  [[ $has_cpp == 1 || $has_py == 1 ]] || dg_die "no benchmark '$name' (neither bench/$name.cpp nor bench/${name}_torch.py)"
done

if [[ $want_torch == 1 ]]; then dg_deps "${DG_DEPS_TORCH_PACKAGES[@]}"; else dg_deps; fi
dg_configure default
[[ ${#cpp_targets[@]} -eq 0 ]] || dg_build default "${cpp_targets[@]}"

results_dir="$(dg_preset_dir default)/bench-results"
stamp=$(date -u +%Y-%m-%dT%H%M%SZ)
results="$results_dir/$stamp.jsonl"
mkdir -p "$results_dir"
: >"$results"
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
[[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] || commit="$commit-dirty"
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)
printf '{"date":"%s","commit":"%s","cpu":"%s","cores":%s,"host":"%s"}\n' "$stamp" "$commit" "${cpu//\"/}" \
  "$(nproc)" "$(hostname)" >"$results_dir/$stamp.meta.json"

# Echoes a program's stdout and appends its JSON lines to the results file.
tee_json() {
  local line
  while IFS= read -r line; do
    printf '%s\n' "$line"
    [[ "$line" != \{* ]] || printf '%s\n' "$line" >>"$results"
  done
}

failed=()
for name in "${names[@]}"; do
  if [[ -f "bench/$name.cpp" ]]; then
    dg_log "run: build/bench/bench_$name"
    "$(dg_preset_dir default)/bench/bench_$name" | tee_json || failed+=("bench_$name")
  else
    dg_log "$name: no C++ side (bench/$name.cpp) in this checkout"
  fi
  if [[ -f "bench/${name}_torch.py" && $torch == 1 ]]; then
    dg_log "run: $python bench/${name}_torch.py"
    "$python" "bench/${name}_torch.py" | tee_json || failed+=("${name}_torch.py")
    # Same-run ratio distgrad / pytorch for every metric both sides reported (medians).
    "$python" - "$results" "$name" <<'PY' | tee_json
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
side = {}
for r in rows:
    if r.get("bench") == sys.argv[2] and "median" in r and r.get("impl") in ("distgrad", "pytorch"):
        side[(r["impl"], r["metric"])] = r
for (impl, metric), ours in side.items():
    theirs = side.get(("pytorch", metric))
    if impl == "distgrad" and theirs and theirs["median"]:
        print(json.dumps({"bench": sys.argv[2], "metric": metric + "_ratio", "unit": "distgrad/pytorch",
                          "median": round(ours["median"] / theirs["median"], 4), "p10": None, "p90": None,
                          "n": 1}, separators=(",", ":")))
PY
  fi
done

dg_log "results: ${results#"$DG_ROOT"/} ($(wc -l <"$results") lines)"
[[ ${#failed[@]} -eq 0 ]] || dg_die "failed: ${failed[*]}"
