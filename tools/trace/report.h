// distgrad-trace report: where each worker's traced time went, and for pipelines the compute / bubble /
// overhead split per stage and the verdict "RPC overhead is X% of the step; local pipelining would gain Y
// ms per step (Z%)" (docs/tracing.md, "distgrad-trace report" defines every figure; the pipeline figures
// follow the pipeline-events contract and models/pipeline/schedule.h's idealMakespan).
//
// Attribution of a worker's time (every instant of its traced wall time gets exactly one activity, so the
// fractions sum to 100%):
//  1. Per thread, the interval covering the instant that began last wins (for spans, which nest per
//     thread, that is the innermost one). A thread's intervals are its spans and, for each call it made,
//     the call's time in flight (rpc.client.wait, moved to the thread that sent the call, from the end of
//     its send span): a thread blocked on a reply is "in flight", and a handler's nested call is not its
//     compute. pipeline.step is a container and counts as nothing by itself.
//  2. Across the worker's threads and its cross-thread waits (server.queue, rref.wait, server.await), the
//     highest-priority activity present wins: compute > serialization > transport > queueing > rref_wait >
//     in_flight > idle.
// Thread-safety: pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tools/trace/trace_data.h"

namespace distgrad::tools::trace {

enum class Activity { kCompute, kSerialization, kTransport, kQueueing, kRRefWait, kInFlight, kIdle };
inline constexpr int kActivityCount = 7;
// "compute", "serialization", "transport", "queueing", "rref_wait", "in_flight", "idle".
const char* activityName(Activity activity);

struct WorkerBreakdown {
  std::string worker;
  int64_t rank = 0;
  int64_t beginNs = 0, endNs = 0;            // traced wall time: first event begin .. last event end (reference clock)
  std::array<int64_t, kActivityCount> ns{};  // time per activity; sums to endNs - beginNs
  size_t threads = 0, events = 0;
  int64_t framesSent = 0, bytesSent = 0, framesReceived = 0, bytesReceived = 0;
  int64_t callsMade = 0, callsServed = 0;

  int64_t wallNs() const { return endNs - beginNs; }
  double fraction(Activity a) const {
    return wallNs() > 0 ? static_cast<double>(ns[static_cast<size_t>(a)]) / static_cast<double>(wallNs()) : 0.0;
  }
};

// One pipeline op found in the trace (pipeline.forward / backward / optimizer).
struct PipelineOp {
  enum class Kind { kForward, kBackward, kOptimizer };
  Kind kind = Kind::kForward;
  int64_t stage = 0, microBatch = -1, step = 0;
  int64_t beginNs = 0, endNs = 0;  // reference clock
  size_t worker = 0;               // index in TraceSet::workers
  int64_t tid = 0;
};

// Bounds on a pipeline's shape as a step span states it: beyond them a trace is taken as corrupt rather than
// allocating stages x micro-batches tables for it.
inline constexpr int64_t kMaxPipelineStages = 4096;
inline constexpr int64_t kMaxPipelineMicroBatches = 65536;
inline constexpr int64_t kMaxPipelineCells = int64_t{1} << 20;  // stages x micro-batches

struct StepAnalysis {
  int64_t step = 0;
  int64_t beginNs = 0, endNs = 0;  // the pipeline.step span (reference clock)
  double wallMs = 0, idealMs = 0;
  std::vector<double> computeMs, bubbleMs, overheadMs;  // per stage; compute + bubble + overhead = wall
};

struct StageSummary {
  int64_t stage = 0;
  std::string worker;                                           // the worker that ran most of the stage's forwards
  double computeMs = 0;                                         // per step, averaged
  double computeShare = 0, bubbleShare = 0, overheadShare = 0;  // per step, averaged over steps
};

struct PipelineAnalysis {
  bool present = false;  // pipeline.step spans were found
  std::string schedule;  // "gpipe" | "1f1b"
  bool rpc = false;      // some op's detail is "rpc"
  int64_t stages = 0, microBatches = 0;
  std::vector<StepAnalysis> steps;  // sorted by step
  std::vector<StageSummary> stageSummaries;
  std::vector<PipelineOp> ops;  // every op, sorted by begin
  double meanStepMs = 0, meanIdealMs = 0;
  double overheadPercent = 0;  // X: mean over steps of (wall - ideal) / wall
  double gainMs = 0;           // Y: mean over steps of wall - ideal
  double gainPercent = 0;      // Z: gainMs / meanStepMs
  std::string verdict;         // the VERDICT line (without the "VERDICT: " prefix)
};

struct Report {
  std::vector<WorkerBreakdown> workers;
  PipelineAnalysis pipeline;
  std::vector<std::string> warnings;  // the TraceSet's and the analysis's
};

// The per-worker breakdown (see the header comment) of one worker.
WorkerBreakdown analyzeWorker(const WorkerTrace& worker);
// The pipeline figures (present == false when the trace has no pipeline.step span). Warnings for ops that
// do not fit the step's shape or are missing go to `warnings`.
PipelineAnalysis analyzePipeline(const TraceSet& set, std::vector<std::string>* warnings);
Report analyze(const TraceSet& set);

// The plain-text report.
std::string formatText(const Report& report, const TraceSet& set);
// The same as flat JSON objects, one per line: {"type":"worker",...}, {"type":"stage",...},
// {"type":"step",...}, {"type":"pipeline",...,"verdict":...}, {"type":"warning","message":...}.
std::string formatJsonLines(const Report& report, const TraceSet& set);

}  // namespace distgrad::tools::trace
