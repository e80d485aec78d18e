#include "tools/trace/report.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>

#include "models/pipeline/schedule.h"
#include "tensor/error.h"
#include "tools/trace/merge.h"

namespace distgrad::tools::trace {

const char* activityName(Activity activity) {
  switch (activity) {
    case Activity::kCompute: return "compute";
    case Activity::kSerialization: return "serialization";
    case Activity::kTransport: return "transport";
    case Activity::kQueueing: return "queueing";
    case Activity::kRRefWait: return "rref_wait";
    case Activity::kInFlight: return "in_flight";
    case Activity::kIdle: return "idle";
  }
  return "?";
}

namespace {

constexpr int kNoActivity = -1;

// The activity a span stands for on its thread (kNoActivity: a container that counts as nothing itself).
int spanActivity(const Event& ev) {
  const std::string& n = ev.name;
  if (n == "rpc.client.serialize" || n == "rpc.client.deserialize" || n == "rpc.server.deserialize" ||
      n == "rpc.server.serialize") {
    return static_cast<int>(Activity::kSerialization);
  }
  if (n == "rpc.client.send" || n == "rpc.server.send") return static_cast<int>(Activity::kTransport);
  if (n == "pipeline.step") return kNoActivity;
  // rpc.server.execute (its nested calls are carved out by their own spans and waits), autograd nodes,
  // optim.step, pipeline forward/backward/optimizer, user regions and anything else a user recorded.
  return static_cast<int>(Activity::kCompute);
}

struct Interval {
  int64_t b, e;
  int thread;    // index into the worker's thread list, -1: a cross-thread wait (no thread)
  int activity;  // Activity
};

}  // namespace

WorkerBreakdown analyzeWorker(const WorkerTrace& w) {
  WorkerBreakdown out;
  out.worker = w.worker;
  out.rank = w.rank;
  out.events = w.events.size();
  if (w.events.empty()) return out;

  int64_t begin = std::numeric_limits<int64_t>::max(), end = std::numeric_limits<int64_t>::min();
  std::map<int64_t, int> threadIndex;
  // The thread and end of each call's send span, by flow id: where a call's wait belongs.
  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> sendOf;
  for (const auto& ev : w.events) {
    begin = std::min(begin, ev.b);
    end = std::max(end, ev.e);
    threadIndex.emplace(ev.tid, static_cast<int>(threadIndex.size()));
    if (ev.name == "rpc.client.send" && ev.flow != 0) sendOf[ev.flow] = {ev.tid, ev.e};
    if (ev.name == "transport.send") {
      ++out.framesSent;
      out.bytesSent += ev.arg(0);
    } else if (ev.name == "transport.recv") {
      ++out.framesReceived;
      out.bytesReceived += ev.arg(0);
    } else if (ev.name == "rpc.client.send") {
      ++out.callsMade;
    } else if (ev.name == "rpc.server.execute") {
      ++out.callsServed;
    }
  }
  out.beginNs = begin;
  out.endNs = end;
  out.threads = threadIndex.size();

  std::vector<Interval> intervals;
  intervals.reserve(w.events.size());
  for (const auto& ev : w.events) {
    if (ev.kind == EventKind::kInstant) continue;
    if (ev.kind == EventKind::kSpan) {
      const int a = spanActivity(ev);
      if (a != kNoActivity && ev.e > ev.b) intervals.push_back({ev.b, ev.e, threadIndex.at(ev.tid), a});
      continue;
    }
    // Async events.
    if (ev.name == "rpc.client.wait") {
      // The flow id of a call is callFlowId(rank, call): a1 is the call id.
      const uint64_t flow =
          (static_cast<uint64_t>(w.rank + 1) << 48) | (static_cast<uint64_t>(ev.arg(1)) & ((uint64_t{1} << 48) - 1));
      auto it = sendOf.find(flow);
      if (it != sendOf.end()) {
        const int64_t from = std::max(ev.b, it->second.second);
        if (ev.e > from) {
          intervals.push_back({from, ev.e, threadIndex.at(it->second.first), static_cast<int>(Activity::kInFlight)});
        }
      } else if (ev.e > ev.b) {
        intervals.push_back({ev.b, ev.e, -1, static_cast<int>(Activity::kInFlight)});
      }
    } else if (ev.name == "rpc.server.queue") {
      if (ev.e > ev.b) intervals.push_back({ev.b, ev.e, -1, static_cast<int>(Activity::kQueueing)});
    } else if (ev.name == "rref.wait") {
      if (ev.e > ev.b) intervals.push_back({ev.b, ev.e, -1, static_cast<int>(Activity::kRRefWait)});
    } else if (ev.name == "rpc.server.await") {
      if (ev.e > ev.b) intervals.push_back({ev.b, ev.e, -1, static_cast<int>(Activity::kInFlight)});
    }
    // Other async events (a newer recorder's) are shown by merge but attributed to nothing here.
  }

  // Sweep over every begin and end (ends first at equal times). Per thread, the active intervals ordered
  // by (latest begin, then earliest end): the first one is the thread's state.
  struct Point {
    int64_t t;
    bool start;
    size_t index;
  };
  std::vector<Point> points;
  points.reserve(intervals.size() * 2);
  for (size_t i = 0; i < intervals.size(); ++i) {
    points.push_back({intervals[i].b, true, i});
    points.push_back({intervals[i].e, false, i});
  }
  std::sort(points.begin(), points.end(), [](const Point& x, const Point& y) {
    if (x.t != y.t) return x.t < y.t;
    return x.start < y.start;  // ends first
  });
  using Key = std::tuple<int64_t, int64_t, size_t>;  // (-begin, end, index)
  std::vector<std::set<Key>> active(threadIndex.size());
  std::array<int64_t, kActivityCount> present{};  // threads in that state + cross-thread waits of that kind
  auto state = [&](int thread) -> int {
    const auto& s = active[static_cast<size_t>(thread)];
    return s.empty() ? kNoActivity : intervals[std::get<2>(*s.begin())].activity;
  };
  int64_t previous = begin;
  auto account = [&](int64_t until) {
    if (until <= previous) return;
    int winner = static_cast<int>(Activity::kIdle);
    for (int a = 0; a < kActivityCount; ++a) {
      if (present[static_cast<size_t>(a)] > 0) {
        winner = a;  // activities are declared in priority order
        break;
      }
    }
    out.ns[static_cast<size_t>(winner)] += until - previous;
    previous = until;
  };
  for (const Point& p : points) {
    account(p.t);
    const Interval& iv = intervals[p.index];
    if (iv.thread < 0) {
      present[static_cast<size_t>(iv.activity)] += p.start ? 1 : -1;
      continue;
    }
    const int before = state(iv.thread);
    const Key key{-iv.b, iv.e, p.index};
    if (p.start) {
      active[static_cast<size_t>(iv.thread)].insert(key);
    } else {
      active[static_cast<size_t>(iv.thread)].erase(key);
    }
    const int after = state(iv.thread);
    if (before != after) {
      if (before != kNoActivity) --present[static_cast<size_t>(before)];
      if (after != kNoActivity) ++present[static_cast<size_t>(after)];
    }
  }
  account(end);
  return out;
}

PipelineAnalysis analyzePipeline(const TraceSet& set, std::vector<std::string>* warnings) {
  namespace pl = distgrad::models::pipeline;
  PipelineAnalysis out;
  auto warn = [&](const std::string& what) {
    if (warnings) warnings->push_back(what);
  };
  struct StepSpan {
    const Event* event;
    size_t worker;
  };
  std::map<int64_t, StepSpan> stepSpans;
  for (size_t wi = 0; wi < set.workers.size(); ++wi) {
    for (const auto& ev : set.workers[wi].events) {
      if (ev.kind != EventKind::kSpan || ev.cat != "pipeline") continue;
      if (ev.name == "pipeline.step") {
        if (!stepSpans.emplace(ev.arg(0), StepSpan{&ev, wi}).second) {
          warn(set.workers[wi].path + ":" + std::to_string(ev.line) + ": a second pipeline.step for step " +
               std::to_string(ev.arg(0)) + " ignored (one pipeline per trace directory is analysed)");
        }
        continue;
      }
      PipelineOp op;
      if (ev.name == "pipeline.forward") {
        op.kind = PipelineOp::Kind::kForward;
      } else if (ev.name == "pipeline.backward") {
        op.kind = PipelineOp::Kind::kBackward;
      } else if (ev.name == "pipeline.optimizer") {
        op.kind = PipelineOp::Kind::kOptimizer;
      } else {
        continue;
      }
      op.stage = ev.arg(0);
      op.microBatch = op.kind == PipelineOp::Kind::kOptimizer ? -1 : ev.arg(1);
      op.step = ev.arg(2);
      op.beginNs = ev.b;
      op.endNs = ev.e;
      op.worker = wi;
      op.tid = ev.tid;
      if (op.kind != PipelineOp::Kind::kOptimizer && ev.detail == "rpc") out.rpc = true;
      out.ops.push_back(op);
    }
  }
  std::sort(out.ops.begin(), out.ops.end(),
            [](const PipelineOp& a, const PipelineOp& b) { return a.beginNs < b.beginNs; });
  if (stepSpans.empty()) {
    if (!out.ops.empty()) warn("pipeline ops found but no pipeline.step span: no pipeline figures");
    return out;
  }
  out.present = true;
  {
    const Event& first = *stepSpans.begin()->second.event;
    out.microBatches = first.arg(1);
    out.stages = first.arg(2);
    out.schedule = first.detail.empty() ? "gpipe" : first.detail;
  }
  pl::Schedule schedule = pl::Schedule::kGPipe;
  try {
    schedule = pl::parseSchedule(out.schedule);
  } catch (const ValueError&) {
    warn("unknown pipeline schedule \"" + out.schedule + "\": analysed as gpipe");
    out.schedule = "gpipe";
  }
  if (out.stages < 1 || out.microBatches < 1 || out.stages > kMaxPipelineStages ||
      out.microBatches > kMaxPipelineMicroBatches || out.stages * out.microBatches > kMaxPipelineCells) {
    warn("pipeline.step gives " + std::to_string(out.stages) + " stages and " + std::to_string(out.microBatches) +
         " micro-batches (at most " + std::to_string(kMaxPipelineStages) + " and " +
         std::to_string(kMaxPipelineMicroBatches) + ", and " + std::to_string(kMaxPipelineCells) +
         " in all, are analysed): no pipeline figures");
    out.present = false;
    return out;
  }
  const size_t S = static_cast<size_t>(out.stages), M = static_cast<size_t>(out.microBatches);
  // Ops per step.
  std::map<int64_t, std::vector<const PipelineOp*>> opsOfStep;
  for (const auto& op : out.ops) opsOfStep[op.step].push_back(&op);

  std::vector<double> computeShare(S, 0), bubbleShare(S, 0), overheadShare(S, 0), computeMs(S, 0);
  double overheadSum = 0, gainSum = 0, wallSum = 0, idealSum = 0;
  for (const auto& [step, span] : stepSpans) {
    const Event& ev = *span.event;
    if (ev.arg(1) != out.microBatches || ev.arg(2) != out.stages) {
      warn("pipeline step " + std::to_string(step) + " has another shape than step " +
           std::to_string(stepSpans.begin()->first) + ": skipped");
      continue;
    }
    StepAnalysis sa;
    sa.step = step;
    sa.beginNs = ev.b;
    sa.endNs = ev.e;
    sa.wallMs = static_cast<double>(ev.duration()) / 1e6;
    pl::StageTimes times;
    times.forward.assign(S, std::vector<double>(M, 0.0));
    times.backward.assign(S, std::vector<double>(M, 0.0));
    std::vector<std::vector<int>> seenF(S, std::vector<int>(M, 0)), seenB(S, std::vector<int>(M, 0));
    std::vector<double> optMs(S, 0.0);
    for (const PipelineOp* op : opsOfStep[step]) {
      if (op->stage < 0 || op->stage >= out.stages ||
          (op->kind != PipelineOp::Kind::kOptimizer && (op->microBatch < 0 || op->microBatch >= out.microBatches))) {
        warn("pipeline op of stage " + std::to_string(op->stage) + ", micro-batch " + std::to_string(op->microBatch) +
             " is outside step " + std::to_string(step) + "'s shape: ignored");
        continue;
      }
      const double sec = static_cast<double>(op->endNs - op->beginNs) / 1e9;
      const size_t s = static_cast<size_t>(op->stage);
      if (op->kind == PipelineOp::Kind::kOptimizer) {
        optMs[s] += sec * 1e3;
      } else {
        const size_t m = static_cast<size_t>(op->microBatch);
        // Several spans of one (stage, micro-batch) add up (a recomputation, a split backward).
        if (op->kind == PipelineOp::Kind::kForward) {
          times.forward[s][m] += sec;
          seenF[s][m] = 1;
        } else {
          times.backward[s][m] += sec;
          seenB[s][m] = 1;
        }
      }
    }
    int missing = 0;
    for (size_t s = 0; s < S; ++s) {
      for (size_t m = 0; m < M; ++m) missing += (seenF[s][m] == 0) + (seenB[s][m] == 0);
    }
    if (missing > 0) {
      warn("pipeline step " + std::to_string(step) + ": " + std::to_string(missing) +
           " forward/backward spans missing (counted as 0 ms; is a worker's file missing?)");
    }
    const double maxOpt = *std::max_element(optMs.begin(), optMs.end());
    // Stages step their parameters concurrently after the flush, in both pipelines.
    sa.idealMs = pl::idealMakespan(schedule, times) * 1e3 + maxOpt;
    for (size_t s = 0; s < S; ++s) {
      double busy = optMs[s];
      for (size_t m = 0; m < M; ++m) busy += (times.forward[s][m] + times.backward[s][m]) * 1e3;
      sa.computeMs.push_back(busy);
      sa.bubbleMs.push_back(sa.idealMs - busy);
      sa.overheadMs.push_back(sa.wallMs - sa.idealMs);
      if (sa.wallMs > 0) {
        computeShare[s] += busy / sa.wallMs;
        bubbleShare[s] += (sa.idealMs - busy) / sa.wallMs;
        overheadShare[s] += (sa.wallMs - sa.idealMs) / sa.wallMs;
      }
      computeMs[s] += busy;
    }
    if (sa.wallMs > 0) overheadSum += (sa.wallMs - sa.idealMs) / sa.wallMs;
    gainSum += sa.wallMs - sa.idealMs;
    wallSum += sa.wallMs;
    idealSum += sa.idealMs;
    out.steps.push_back(std::move(sa));
  }
  if (out.steps.empty()) {
    out.present = false;
    return out;
  }
  const double n = static_cast<double>(out.steps.size());
  // The worker of each stage: the one that ran most of its forwards.
  std::vector<std::map<size_t, int>> workerVotes(S);
  for (const auto& op : out.ops) {
    if (op.kind == PipelineOp::Kind::kForward && op.stage >= 0 && op.stage < out.stages) {
      ++workerVotes[static_cast<size_t>(op.stage)][op.worker];
    }
  }
  for (size_t s = 0; s < S; ++s) {
    StageSummary summary;
    summary.stage = static_cast<int64_t>(s);
    if (!workerVotes[s].empty()) {
      auto best = std::max_element(workerVotes[s].begin(), workerVotes[s].end(),
                                   [](const auto& a, const auto& b) { return a.second < b.second; });
      summary.worker = set.workers[best->first].worker;
    }
    summary.computeMs = computeMs[s] / n;
    summary.computeShare = computeShare[s] / n;
    summary.bubbleShare = bubbleShare[s] / n;
    summary.overheadShare = overheadShare[s] / n;
    out.stageSummaries.push_back(summary);
  }
  out.meanStepMs = wallSum / n;
  out.meanIdealMs = idealSum / n;
  out.overheadPercent = 100.0 * overheadSum / n;
  out.gainMs = gainSum / n;
  out.gainPercent = out.meanStepMs > 0 ? 100.0 * out.gainMs / out.meanStepMs : 0.0;
  char buf[256];
  if (out.rpc) {
    std::snprintf(buf, sizeof buf,
                  "RPC overhead is %.1f%% of the step; local pipelining would gain %.2f ms per step (%.1f%%)",
                  out.overheadPercent, out.gainMs, out.gainPercent);
  } else {
    std::snprintf(buf, sizeof buf,
                  "Pipeline overhead (a local pipeline: thread hand-offs, no RPC) is %.1f%% of the step; the ideal "
                  "schedule would gain %.2f ms per step (%.1f%%)",
                  out.overheadPercent, out.gainMs, out.gainPercent);
  }
  out.verdict = buf;
  if (out.gainMs < 0) out.verdict += " (negative: already at the ideal schedule)";
  return out;
}

Report analyze(const TraceSet& set) {
  Report report;
  report.warnings = set.warnings;
  for (const auto& w : set.workers) report.workers.push_back(analyzeWorker(w));
  report.pipeline = analyzePipeline(set, &report.warnings);
  return report;
}

namespace {

std::string format(const char* fmt, double a, double b = 0, double c = 0, double d = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, fmt, a, b, c, d);
  return buf;
}

std::string mib(int64_t bytes) { return format("%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0)); }

}  // namespace

std::string formatText(const Report& report, const TraceSet& set) {
  std::string out;
  int64_t first = std::numeric_limits<int64_t>::max(), last = std::numeric_limits<int64_t>::min();
  for (const auto& w : report.workers) {
    if (w.events == 0) continue;
    first = std::min(first, w.beginNs);
    last = std::max(last, w.endNs);
  }
  out += "distgrad-trace report: " + set.directory + ": " + std::to_string(report.workers.size()) +
         " worker(s), times on " + set.reference().worker + "'s clock";
  if (first <= last) out += format(", %.3f ms traced", static_cast<double>(last - first) / 1e6);
  out += "\n";
  for (size_t i = 0; i < report.workers.size(); ++i) {
    const auto& w = report.workers[i];
    const auto& wt = set.workers[i];
    out += "\n" + w.worker + " (rank " + std::to_string(w.rank) + ")" +
           format(": %.3f ms traced", static_cast<double>(w.wallNs()) / 1e6) + ", " + std::to_string(w.threads) +
           " thread(s), " + std::to_string(w.events) + " events";
    if (!wt.aligned) out += " [clock NOT aligned]";
    if (!wt.closed) out += " [no end line]";
    out += "\n";
    if (w.events == 0) {
      out += "  (no events: nothing to attribute)\n";
      continue;
    }
    for (int a = 0; a < kActivityCount; ++a) {
      const double f = w.fraction(static_cast<Activity>(a));
      char line[128];
      std::snprintf(line, sizeof line, "  %-14s %6.1f%%  %10.3f ms\n", activityName(static_cast<Activity>(a)),
                    100.0 * f, static_cast<double>(w.ns[static_cast<size_t>(a)]) / 1e6);
      out += line;
    }
    out += "  calls made " + std::to_string(w.callsMade) + ", served " + std::to_string(w.callsServed) +
           "; frames sent " + std::to_string(w.framesSent) + " (" + mib(w.bytesSent) + "), received " +
           std::to_string(w.framesReceived) + " (" + mib(w.bytesReceived) + ")\n";
  }
  const auto& p = report.pipeline;
  if (p.present) {
    out += "\npipeline: " + std::string(p.rpc ? "RPC" : "local") + ", schedule " + p.schedule + ", " +
           std::to_string(p.stages) + " stage(s), " + std::to_string(p.microBatches) + " micro-batch(es), " +
           std::to_string(p.steps.size()) + " step(s)" +
           format(": step %.3f ms (mean), ideal local %.3f ms\n", p.meanStepMs, p.meanIdealMs);
    out += "  per stage and step (averaged over steps): compute / bubble / overhead\n";
    for (const auto& s : p.stageSummaries) {
      char line[256];
      std::snprintf(line, sizeof line,
                    "  stage %-3lld %-12s compute %5.1f%% (%8.3f ms)  bubble %5.1f%%  overhead %5.1f%%\n",
                    static_cast<long long>(s.stage), s.worker.empty() ? "(no spans)" : s.worker.c_str(),
                    100.0 * s.computeShare, s.computeMs, 100.0 * s.bubbleShare, 100.0 * s.overheadShare);
      out += line;
    }
    out += "\nVERDICT: " + p.verdict + "\n";
  }
  if (!report.warnings.empty()) {
    out += "\nwarnings:\n";
    for (const auto& w : report.warnings) out += "  " + w + "\n";
  }
  return out;
}

std::string formatJsonLines(const Report& report, const TraceSet& set) {
  std::string out;
  auto num = [](double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    return std::string(buf);
  };
  for (size_t i = 0; i < report.workers.size(); ++i) {
    const auto& w = report.workers[i];
    out += "{\"type\":\"worker\",\"worker\":" + jsonString(w.worker) + ",\"rank\":" + std::to_string(w.rank) +
           ",\"aligned\":" + (set.workers[i].aligned ? "true" : "false") +
           ",\"closed\":" + (set.workers[i].closed ? "true" : "false") +
           ",\"wall_ms\":" + num(static_cast<double>(w.wallNs()) / 1e6) + ",\"threads\":" + std::to_string(w.threads) +
           ",\"events\":" + std::to_string(w.events);
    for (int a = 0; a < kActivityCount; ++a) {
      const std::string name = activityName(static_cast<Activity>(a));
      out += ",\"" + name + "\":" + num(w.fraction(static_cast<Activity>(a))) + ",\"" + name +
             "_ms\":" + num(static_cast<double>(w.ns[static_cast<size_t>(a)]) / 1e6);
    }
    out += ",\"calls_made\":" + std::to_string(w.callsMade) + ",\"calls_served\":" + std::to_string(w.callsServed) +
           ",\"frames_sent\":" + std::to_string(w.framesSent) + ",\"bytes_sent\":" + std::to_string(w.bytesSent) +
           ",\"frames_received\":" + std::to_string(w.framesReceived) +
           ",\"bytes_received\":" + std::to_string(w.bytesReceived) + "}\n";
  }
  const auto& p = report.pipeline;
  if (p.present) {
    for (const auto& s : p.stageSummaries) {
      out += "{\"type\":\"stage\",\"stage\":" + std::to_string(s.stage) + ",\"worker\":" + jsonString(s.worker) +
             ",\"compute_ms\":" + num(s.computeMs) + ",\"compute\":" + num(s.computeShare) +
             ",\"bubble\":" + num(s.bubbleShare) + ",\"overhead\":" + num(s.overheadShare) + "}\n";
    }
    for (const auto& st : p.steps) {
      out += "{\"type\":\"step\",\"step\":" + std::to_string(st.step) + ",\"wall_ms\":" + num(st.wallMs) +
             ",\"ideal_ms\":" + num(st.idealMs) + "}\n";
    }
    out += "{\"type\":\"pipeline\",\"rpc\":" + std::string(p.rpc ? "true" : "false") +
           ",\"schedule\":" + jsonString(p.schedule) + ",\"stages\":" + std::to_string(p.stages) +
           ",\"micro_batches\":" + std::to_string(p.microBatches) + ",\"steps\":" + std::to_string(p.steps.size()) +
           ",\"step_ms\":" + num(p.meanStepMs) + ",\"ideal_ms\":" + num(p.meanIdealMs) +
           ",\"overhead_percent\":" + num(p.overheadPercent) + ",\"gain_ms\":" + num(p.gainMs) +
           ",\"gain_percent\":" + num(p.gainPercent) + ",\"verdict\":" + jsonString(p.verdict) + "}\n";
  }
  for (const auto& w : report.warnings) out += "{\"type\":\"warning\",\"message\":" + jsonString(w) + "}\n";
  return out;
}

}  // namespace distgrad::tools::trace
