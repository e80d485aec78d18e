#!/usr/bin/env python3
# pipeline_gap.py TRACE_DIR: the last stage's wait between a micro-batch's forward end and its backward
# start, from the trace files of an rpc_pipeline --trace run (docs/tracing.md, "Pipeline events"; the last
# stage's worker has the highest-numbered file): the latency Note [Loss on the last stage] (models/pipeline/
# rpc_pipeline.cpp) removed from 1F1B's critical path. Step 0 (warm-up) is left out. Prints one JSON line:
# pairs, median_ms, p90_ms, mean_ms.
#   tools/distgrad-run --nproc 3 -- examples/rpc_pipeline --schedule 1f1b --limit 1536 --trace /tmp/t
#   python3 ../bench/pipeline_gap.py /tmp/t
import glob, json, re, statistics, sys
d = sys.argv[1]
files = sorted(glob.glob(d + '/worker*.trace.jsonl'), key=lambda f: int(re.findall(r'worker(\d+)', f)[-1]))
last = files[-1]
fwd, bwd = {}, {}
for line in open(last):
    if '"pipeline.' not in line: continue
    e = json.loads(line)
    key = (e.get('a2'), e.get('a1'))
    if e['name'] == 'pipeline.forward': fwd[key] = e['e']
    elif e['name'] == 'pipeline.backward': bwd[key] = e['b']
gaps = sorted((bwd[k] - fwd[k]) / 1e6 for k in fwd if k in bwd and k[0] is not None and k[0] >= 1)
if not gaps: sys.exit('no pairs')
print(json.dumps({"trace": d, "file": last.split('/')[-1], "pairs": len(gaps),
                  "median_ms": round(statistics.median(gaps), 3), "p90_ms": round(gaps[int(0.9 * (len(gaps) - 1))], 3),
                  "mean_ms": round(statistics.mean(gaps), 3)}))
