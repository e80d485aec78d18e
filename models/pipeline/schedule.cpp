#include "models/pipeline/schedule.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "tensor/error.h"

namespace distgrad::models::pipeline {

Schedule parseSchedule(const std::string& name) {
  if (name == "gpipe") return Schedule::kGPipe;
  if (name == "1f1b") return Schedule::k1F1B;
  DG_CHECK(false, "schedule must be \"gpipe\" or \"1f1b\", got \"", name, "\"");
  return Schedule::kGPipe;
}

const char* scheduleName(Schedule schedule) { return schedule == Schedule::kGPipe ? "gpipe" : "1f1b"; }

std::vector<Op> stageOrder(Schedule schedule, int64_t stage, int64_t stages, int64_t microBatches) {
  DG_CHECK(stages >= 1, "stageOrder: stages must be >= 1, got ", stages);
  DG_CHECK(stage >= 0 && stage < stages, "stageOrder: stage must be in [0, ", stages, "), got ", stage);
  DG_CHECK(microBatches >= 1, "stageOrder: micro-batches must be >= 1, got ", microBatches);
  std::vector<Op> order;
  order.reserve(static_cast<size_t>(2 * microBatches));
  if (schedule == Schedule::kGPipe) {
    for (int64_t m = 0; m < microBatches; ++m) order.push_back({true, m});
    for (int64_t m = 0; m < microBatches; ++m) order.push_back({false, m});
    return order;
  }
  // 1F1B: the warm-up fills the pipeline below this stage so that the backward of micro-batch 0 arrives
  // just as the steady state starts; then every forward is followed by the oldest pending backward.
  const int64_t warmUp = std::min(stages - stage - 1, microBatches);
  int64_t nextForward = 0;
  int64_t nextBackward = 0;
  for (; nextForward < warmUp; ++nextForward) order.push_back({true, nextForward});
  while (nextForward < microBatches) {
    order.push_back({true, nextForward++});
    order.push_back({false, nextBackward++});
  }
  while (nextBackward < microBatches) order.push_back({false, nextBackward++});
  return order;
}

std::string describeOrder(const std::vector<Op>& order) {
  std::ostringstream out;
  for (size_t i = 0; i < order.size(); ++i)
    out << (i ? " " : "") << (order[i].forward ? 'F' : 'B') << order[i].microBatch;
  return out.str();
}

int64_t maxInFlight(const std::vector<Op>& order) {
  int64_t inFlight = 0;
  int64_t most = 0;
  for (const Op& op : order) {
    inFlight += op.forward ? 1 : -1;
    most = std::max(most, inFlight);
  }
  return most;
}

double idealMakespan(Schedule schedule, const StageTimes& times) {
  const auto stages = static_cast<int64_t>(times.forward.size());
  DG_CHECK(stages >= 1 && times.backward.size() == times.forward.size(),
           "idealMakespan: forward and backward times need the same number (>= 1) of stages, got ",
           times.forward.size(), " and ", times.backward.size());
  const auto micro = static_cast<int64_t>(times.forward[0].size());
  DG_CHECK(micro >= 1, "idealMakespan: no micro-batch times");
  for (int64_t s = 0; s < stages; ++s) {
    for (const auto* row : {&times.forward[static_cast<size_t>(s)], &times.backward[static_cast<size_t>(s)]}) {
      DG_CHECK(static_cast<int64_t>(row->size()) == micro, "idealMakespan: stage ", s, " has ", row->size(),
               " micro-batch times, stage 0 has ", micro);
      for (double t : *row) DG_CHECK(std::isfinite(t) && t >= 0, "idealMakespan: stage ", s, " has time ", t);
    }
  }
  // List scheduling: repeatedly start each stage's next op once its input is ready. Every op's
  // dependency comes from a neighbouring stage's earlier op in a valid schedule, so each sweep over the
  // stages makes progress; a sweep without progress means the orders deadlock (a bug).
  const auto S = static_cast<size_t>(stages);
  const auto M = static_cast<size_t>(micro);
  constexpr double kPending = -1;
  std::vector<std::vector<double>> forwardEnd(S, std::vector<double>(M, kPending));
  std::vector<std::vector<double>> backwardEnd(S, std::vector<double>(M, kPending));
  std::vector<std::vector<Op>> orders;
  for (int64_t s = 0; s < stages; ++s) orders.push_back(stageOrder(schedule, s, stages, micro));
  std::vector<size_t> next(S, 0);
  std::vector<double> freeAt(S, 0.0);
  size_t remaining = S * 2 * M;
  while (remaining > 0) {
    bool progress = false;
    for (size_t s = 0; s < S; ++s) {
      while (next[s] < orders[s].size()) {
        const Op op = orders[s][next[s]];
        const auto m = static_cast<size_t>(op.microBatch);
        double ready = 0;
        if (op.forward) {
          ready = s == 0 ? 0.0 : forwardEnd[s - 1][m];
        } else {
          ready = s + 1 == S ? forwardEnd[s][m] : backwardEnd[s + 1][m];
        }
        if (ready == kPending) break;
        const double start = std::max(ready, freeAt[s]);
        const double end = start + (op.forward ? times.forward[s][m] : times.backward[s][m]);
        (op.forward ? forwardEnd : backwardEnd)[s][m] = end;
        freeAt[s] = end;
        ++next[s];
        --remaining;
        progress = true;
      }
    }
    DG_ASSERT(progress, "idealMakespan: the ", scheduleName(schedule), " stage orders deadlock");
  }
  return *std::max_element(freeAt.begin(), freeAt.end());
}

namespace {
double sumBusy(const StepStats& s) { return std::accumulate(s.busySeconds.begin(), s.busySeconds.end(), 0.0); }
}  // namespace

double StepStats::computeShare() const {
  if (wallSeconds <= 0 || busySeconds.empty()) return 0;
  return sumBusy(*this) / (static_cast<double>(numStages()) * wallSeconds);
}

double StepStats::bubbleShare() const {
  if (wallSeconds <= 0 || busySeconds.empty()) return 0;
  const auto S = static_cast<double>(numStages());
  return (S * idealSeconds - sumBusy(*this)) / (S * wallSeconds);
}

double StepStats::overheadShare() const {
  if (wallSeconds <= 0 || busySeconds.empty()) return 0;
  return (wallSeconds - idealSeconds) / wallSeconds;
}

void StepStats::accumulate(const StepStats& other) {
  if (busySeconds.empty() && steps == 0) {
    busySeconds.assign(other.busySeconds.size(), 0.0);
    maxInFlight.assign(other.maxInFlight.size(), 0);
    peakActivationBytes.assign(other.peakActivationBytes.size(), -1);
  }
  DG_CHECK(busySeconds.size() == other.busySeconds.size() && maxInFlight.size() == other.maxInFlight.size() &&
               peakActivationBytes.size() == other.peakActivationBytes.size(),
           "StepStats::accumulate: ", other.busySeconds.size(), " stages added to stats of ", busySeconds.size());
  wallSeconds += other.wallSeconds;
  idealSeconds += other.idealSeconds;
  steps += other.steps;
  for (size_t s = 0; s < busySeconds.size(); ++s) busySeconds[s] += other.busySeconds[s];
  for (size_t s = 0; s < maxInFlight.size(); ++s) maxInFlight[s] = std::max(maxInFlight[s], other.maxInFlight[s]);
  for (size_t s = 0; s < peakActivationBytes.size(); ++s) {
    peakActivationBytes[s] = std::max(peakActivationBytes[s], other.peakActivationBytes[s]);
  }
}

}  // namespace distgrad::models::pipeline
