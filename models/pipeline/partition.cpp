#include "models/pipeline/partition.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "models/nn/sequential.h"
#include "tensor/error.h"

namespace distgrad::models::pipeline {
namespace {

std::string formatCost(double cost, BalanceBy by) {
  char buf[32];
  if (by == BalanceBy::kTime) {
    std::snprintf(buf, sizeof(buf), "%.3g ms", cost * 1e3);
  } else if (cost >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.3gM params", cost / 1e6);
  } else if (cost >= 1e3) {
    std::snprintf(buf, sizeof(buf), "%.3gk params", cost / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f params", cost);
  }
  return buf;
}

// "unit 3" or "units 3-5" for [first, end).
std::string unitRange(int64_t first, int64_t end) {
  return end - first == 1 ? "unit " + std::to_string(first)
                          : "units " + std::to_string(first) + "-" + std::to_string(end - 1);
}

void checkStages(int64_t units, int64_t stages) {
  DG_CHECK(stages >= 1, "pipeline stages must be >= 1, got ", stages);
  DG_CHECK(stages <= units, "pipeline stages must be <= the number of units (", units, "), got ", stages);
}

// Seconds of one forward + backward of `unit` on `input` (whose requires-grad decides whether the input
// gradient is computed, as in a pipeline stage); returns the output, detached, in `output`.
double timeForwardBackward(Module& unit, const Tensor& input, Tensor& output) {
  const auto t0 = std::chrono::steady_clock::now();
  Tensor y = unit.forward(input);
  if (y.requiresGrad()) distgrad::backward(y, Tensor::ones(y.shape(), y.dtype()));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  output = y.detach();
  return seconds;
}

}  // namespace

BalanceBy parseBalanceBy(const std::string& name) {
  if (name == "params") return BalanceBy::kParameters;
  if (name == "time") return BalanceBy::kTime;
  DG_CHECK(false, "balance must be \"params\" or \"time\", got \"", name, "\"");
  return BalanceBy::kParameters;
}

const char* balanceByName(BalanceBy by) { return by == BalanceBy::kParameters ? "params" : "time"; }

std::string Partition::describe() const {
  std::ostringstream out;
  for (int64_t s = 0; s < numStages(); ++s) {
    const auto i = static_cast<size_t>(s);
    out << (s ? ", " : "") << "stage " << s << ": " << unitRange(bounds[i], bounds[i + 1]);
    if (i < cost.size()) out << " (" << formatCost(cost[i], by) << ")";
  }
  return out.str();
}

Partition balanceCosts(const std::vector<double>& unitCosts, int64_t stages, BalanceBy by) {
  const auto n = static_cast<int64_t>(unitCosts.size());
  checkStages(n, stages);
  for (size_t i = 0; i < unitCosts.size(); ++i) {
    DG_CHECK(std::isfinite(unitCosts[i]) && unitCosts[i] >= 0, "balance: unit ", i,
             " cost must be finite and >= 0, got ", unitCosts[i]);
  }
  std::vector<double> prefix(static_cast<size_t>(n) + 1, 0.0);
  for (int64_t i = 0; i < n; ++i)
    prefix[static_cast<size_t>(i + 1)] = prefix[static_cast<size_t>(i)] + unitCosts[static_cast<size_t>(i)];
  auto rangeCost = [&](int64_t a, int64_t b) {
    return prefix[static_cast<size_t>(b)] - prefix[static_cast<size_t>(a)];
  };

  // best[k][i]: the smallest possible largest stage cost splitting units [0, i) into k stages;
  // cut[k][i]: where the last of those k stages starts. O(stages * n^2), n is tens of units.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto rows = static_cast<size_t>(stages) + 1;
  const auto cols = static_cast<size_t>(n) + 1;
  std::vector<std::vector<double>> best(rows, std::vector<double>(cols, kInf));
  std::vector<std::vector<int64_t>> cut(rows, std::vector<int64_t>(cols, -1));
  best[0][0] = 0;
  for (int64_t k = 1; k <= stages; ++k) {
    for (int64_t i = k; i <= n; ++i) {
      // The last stage is [j, i); scanning j downwards and keeping the first strict improvement prefers the
      // largest j, i.e. the shortest last stage, among equal optima.
      for (int64_t j = i - 1; j >= k - 1; --j) {
        const double prev = best[static_cast<size_t>(k - 1)][static_cast<size_t>(j)];
        if (prev == kInf) continue;
        const double candidate = std::max(prev, rangeCost(j, i));
        if (candidate < best[static_cast<size_t>(k)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(k)][static_cast<size_t>(i)] = candidate;
          cut[static_cast<size_t>(k)][static_cast<size_t>(i)] = j;
        }
      }
    }
  }
  Partition p;
  p.by = by;
  p.bounds.assign(rows, 0);
  p.bounds[static_cast<size_t>(stages)] = n;
  for (int64_t k = stages; k >= 1; --k) {
    const int64_t start = cut[static_cast<size_t>(k)][static_cast<size_t>(p.bounds[static_cast<size_t>(k)])];
    DG_ASSERT(start >= 0, "balance: no split for stage ", k - 1);
    p.bounds[static_cast<size_t>(k - 1)] = start;
  }
  DG_ASSERT(p.bounds[0] == 0, "balance: the first stage starts at unit ", p.bounds[0]);
  for (int64_t s = 0; s < stages; ++s) {
    p.cost.push_back(rangeCost(p.bounds[static_cast<size_t>(s)], p.bounds[static_cast<size_t>(s + 1)]));
  }
  return p;
}

std::vector<double> unitCosts(const std::vector<std::shared_ptr<Module>>& units, BalanceBy by, const Tensor& sample,
                              int repeats) {
  DG_CHECK(!units.empty(), "unitCosts: no units");
  for (size_t i = 0; i < units.size(); ++i) DG_CHECK(units[i] != nullptr, "unitCosts: unit ", i, " is null");
  if (by == BalanceBy::kParameters) {
    std::vector<double> costs;
    for (const auto& u : units) costs.push_back(static_cast<double>(u->numParameters()));
    return costs;
  }
  DG_CHECK(sample.defined(), "balance by time needs a sample batch of inputs");
  DG_CHECK(repeats >= 1, "unitCosts: repeats must be >= 1, got ", repeats);
  autograd::EnableGradGuard enableGrad;
  // Forward passes in training mode update BatchNorm running statistics, and backward passes accumulate
  // gradients: keep copies to put back, so that measuring leaves the model exactly as built (workers
  // building the same stage must agree).
  std::vector<std::vector<Tensor>> buffers, savedBuffers, params, savedGrads;
  for (const auto& unit : units) {
    buffers.push_back(unit->buffers());
    savedBuffers.emplace_back();
    for (const Tensor& b : buffers.back()) savedBuffers.back().push_back(b.cloneData());
    params.push_back(unit->parameters());
    savedGrads.emplace_back();
    for (const Tensor& p : params.back()) savedGrads.back().push_back(p.grad());
  }
  // One warm-up run of every unit in order (first-touch allocations, oneDNN primitive caches), which also
  // gives each unit its input: the previous unit's output. Later stages receive an input that requires
  // grad (they must send its gradient back); the first does not.
  std::vector<Tensor> inputs;
  Tensor x = sample.detach();
  for (size_t i = 0; i < units.size(); ++i) {
    Tensor input = x.detach();
    if (i > 0) input.setRequiresGrad();
    timeForwardBackward(*units[i], input, x);
    inputs.push_back(input);
  }
  // Note [Interleaved repeats]: the repeats go round the units (unit 0, 1, ..., then again), not unit by
  // unit, so a burst of other load (another process, the hypervisor taking the vCPU) slows one repeat of
  // several units instead of every repeat of one, which the minimum then discards. Measured on a busy
  // 2-vCPU host, 14 runs each of local_pipeline's balancing, alternated: unit by unit with 5 repeats, 4 of
  // 14 runs chose another split than the other 10 (units 0-3 or 0-5 instead of 0-4) and the two stages'
  // cost ratio spread by 11.5% (standard deviation of its log); interleaved with 9 repeats, 14 of 14 chose
  // the same split, spread 5.4%.
  std::vector<double> costs(units.size(), std::numeric_limits<double>::infinity());
  Tensor output;
  for (int r = 0; r < repeats; ++r) {
    for (size_t i = 0; i < units.size(); ++i) {
      costs[i] = std::min(costs[i], timeForwardBackward(*units[i], inputs[i], output));  // see the header
    }
  }
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t b = 0; b < buffers[u].size(); ++b) buffers[u][b].copyFrom(savedBuffers[u][b]);
    for (size_t p = 0; p < params[u].size(); ++p) params[u][p].setGrad(savedGrads[u][p]);
  }
  return costs;
}

Partition balance(const std::vector<std::shared_ptr<Module>>& units, int64_t stages, BalanceBy by,
                  const Tensor& sample) {
  checkStages(static_cast<int64_t>(units.size()), stages);
  return balanceCosts(unitCosts(units, by, sample), stages, by);
}

Partition uniformPartition(int64_t units, int64_t stages) {
  checkStages(units, stages);
  Partition p;
  for (int64_t s = 0; s <= stages; ++s) p.bounds.push_back(s * units / stages);
  for (int64_t s = 0; s < stages; ++s) {
    p.cost.push_back(static_cast<double>(p.bounds[static_cast<size_t>(s + 1)] - p.bounds[static_cast<size_t>(s)]));
  }
  return p;
}

void StageSpec::validate() const {
  model.validate();
  const int64_t units = numUnits(model);
  DG_CHECK(firstUnit >= 0 && firstUnit < endUnit && endUnit <= units, "StageSpec: unit range [", firstUnit, ", ",
           endUnit, ") must be non-empty and within the ", units, " units of ", model.describe());
}

std::string StageSpec::describe() const {
  std::ostringstream out;
  out << model.describe() << " " << unitRange(firstUnit, endUnit);
  return out.str();
}

std::shared_ptr<Module> buildStage(const StageSpec& spec) {
  spec.validate();
  const std::vector<std::shared_ptr<Module>> units = modelUnits(spec.model, buildModel(spec.model));
  // The model's other units (and the model object) are released here: a stage holds only its own weights.
  return std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>(units.begin() + spec.firstUnit, units.begin() + spec.endUnit));
}

namespace {
void checkBounds(const Partition& partition, int64_t units) {
  const int64_t stages = partition.numStages();
  DG_CHECK(stages >= 1, "partition has no stages (bounds size ", partition.bounds.size(), ")");
  DG_CHECK(partition.bounds.front() == 0 && partition.bounds.back() == units, "partition bounds must run from 0 to ",
           units, " units, got ", partition.bounds.front(), " to ", partition.bounds.back());
  for (int64_t s = 0; s < stages; ++s) {
    DG_CHECK(partition.bounds[static_cast<size_t>(s)] < partition.bounds[static_cast<size_t>(s + 1)],
             "partition stage ", s, " is empty or reversed: units [", partition.bounds[static_cast<size_t>(s)], ", ",
             partition.bounds[static_cast<size_t>(s + 1)], ")");
  }
}
}  // namespace

std::vector<StageSpec> stageSpecs(const ModelSpec& model, const Partition& partition) {
  checkBounds(partition, numUnits(model));
  std::vector<StageSpec> specs;
  for (int64_t s = 0; s < partition.numStages(); ++s) {
    specs.push_back(StageSpec{.model = model,
                              .firstUnit = partition.bounds[static_cast<size_t>(s)],
                              .endUnit = partition.bounds[static_cast<size_t>(s + 1)]});
  }
  return specs;
}

std::vector<std::shared_ptr<Module>> stageModules(const std::vector<std::shared_ptr<Module>>& units,
                                                  const Partition& partition) {
  checkBounds(partition, static_cast<int64_t>(units.size()));
  std::vector<std::shared_ptr<Module>> stages;
  for (int64_t s = 0; s < partition.numStages(); ++s) {
    stages.push_back(std::make_shared<Sequential>(
        std::vector<std::shared_ptr<Module>>(units.begin() + partition.bounds[static_cast<size_t>(s)],
                                             units.begin() + partition.bounds[static_cast<size_t>(s + 1)])));
  }
  return stages;
}

}  // namespace distgrad::models::pipeline
