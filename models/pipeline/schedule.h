// Pipeline schedules (the order in which each stage runs the forwards and backwards of a step's
// micro-batches) and the time accounting both pipelines report (StepStats).
//
// GPipe (Huang et al. 2019): every stage runs all its forwards, then all its backwards; a stage holds the
// activations of all M micro-batches at once. 1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM):
// stage s of S runs S - s - 1 warm-up forwards, then alternates one forward and one backward, then drains
// the remaining backwards; it never holds more than S - s micro-batches in flight, with the same bubble.
// Both flush at the end of a step (one optimizer step per batch), so both compute exactly the gradient of
// the full batch.
//
// idealMakespan() replays a schedule with measured compute times and free communication; comparing it with
// the measured wall time splits a step into compute, the bubble the schedule itself forces, and overhead
// (communication, thread hand-offs, RPC): see StepStats.
// Thread-safety: pure functions and plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace distgrad::models::pipeline {

enum class Schedule { kGPipe, k1F1B };
// "gpipe" | "1f1b"; ValueError otherwise.
Schedule parseSchedule(const std::string& name);
const char* scheduleName(Schedule schedule);

struct Op {
  bool forward = true;
  int64_t microBatch = 0;
  bool operator==(const Op&) const = default;
};
// The order of work of stage `stage` of `stages` for `microBatches` micro-batches (ValueError for
// stages < 1, stage outside [0, stages), microBatches < 1). Micro-batches go in increasing order.
std::vector<Op> stageOrder(Schedule schedule, int64_t stage, int64_t stages, int64_t microBatches);
// "F0 F1 B0 ...": for messages and tests.
std::string describeOrder(const std::vector<Op>& order);
// The most micro-batches `order` has forwarded and not yet backwarded at any point.
int64_t maxInFlight(const std::vector<Op>& order);

// Measured seconds of each stage's forward/backward of each micro-batch: [stage][microBatch].
struct StageTimes {
  std::vector<std::vector<double>> forward, backward;
};
// Makespan of the schedule with these compute times and zero communication: each stage runs its
// stageOrder, an op starting once the stage is free and its input is ready (F(s-1,m) -> F(s,m),
// B(s+1,m) -> B(s,m), F(S-1,m) -> B(S-1,m)). ValueError for ragged or negative times.
double idealMakespan(Schedule schedule, const StageTimes& times);

// One training step of a pipeline, measured (or several steps' totals, see accumulate).
struct StepStats {
  double wallSeconds = 0;                    // the step's wall time at the driver
  double idealSeconds = 0;                   // idealMakespan of the measured compute times
  std::vector<double> busySeconds;           // per stage: sum of its forward + backward compute
  std::vector<int64_t> maxInFlight;          // per stage: most micro-batches forwarded, not yet backwarded
  std::vector<int64_t> peakActivationBytes;  // per stage, when measurable (else -1)
  int64_t steps = 0;                         // how many steps these figures cover (1 for one step)

  // Shares of wall x stages; they sum to 1. compute = sum busy / (S * wall); bubble = (S * ideal - sum busy)
  // / (S * wall): the idleness the schedule itself forces; overhead = (wall - ideal) / wall: everything that
  // is neither compute nor schedule bubble (communication, RPC, thread hand-offs, contention). All three
  // are 0 when wall is 0.
  double computeShare() const;
  double bubbleShare() const;
  double overheadShare() const;
  int64_t numStages() const { return static_cast<int64_t>(busySeconds.size()); }
  // Adds `other` (an epoch's totals): seconds and steps sum, in-flight and activation peaks take the
  // maximum. An empty StepStats takes other's number of stages; otherwise they must match (ValueError).
  void accumulate(const StepStats& other);
};

}  // namespace distgrad::models::pipeline
