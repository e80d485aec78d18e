// Partition: splitting a model's units (models/pipeline/model_spec.h) into contiguous pipeline stages of
// balanced cost, and StageSpec, one stage described by value so the worker that runs it can build it.
//
//   auto units = modelUnits(spec, buildModel(spec));
//   Partition p = balance(units, 2, BalanceBy::kTime, sampleBatch);   // or kParameters (no sample needed)
//   for (const StageSpec& s : stageSpecs(spec, p)) ... buildStage(s) on the stage's worker ...
//
// balance() minimises the cost of the most expensive stage exactly (dynamic programming over all
// contiguous splits), since a pipeline runs at the pace of its slowest stage. kParameters balances memory
// (parameter counts); kTime balances compute (each unit's forward + backward measured on a sample batch),
// which is what throughput depends on: a ResNet's last layers hold most parameters but little compute.
// Thread-safety: balance() runs the units (kTime), so nothing else may use them meanwhile; the rest are
// pure functions of their arguments.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/nn/module.h"
#include "models/pipeline/model_spec.h"
#include "tensor/tensor.h"

namespace distgrad::models::pipeline {

enum class BalanceBy { kParameters, kTime };
// "params" | "time" (command-line names); ValueError otherwise.
BalanceBy parseBalanceBy(const std::string& name);
const char* balanceByName(BalanceBy by);

struct Partition {
  std::vector<int64_t> bounds;            // size stages+1: stage s = units [bounds[s], bounds[s+1]), none empty
  std::vector<double> cost;               // per stage: parameters, or measured seconds (forward+backward)
  BalanceBy by = BalanceBy::kParameters;  // what `cost` counts
  int64_t numStages() const { return static_cast<int64_t>(bounds.size()) - 1; }
  // "stage 0: units 0-4 (1.2M params), stage 1: units 5-9 (0.9M params)" (or "(12.3 ms)" for kTime).
  std::string describe() const;
};

// Contiguous split of `unitCosts` into `stages` non-empty stages minimising the largest stage cost (exact;
// among optimal splits, the one giving later stages the fewer units: the last stage also computes the
// loss). ValueError for stages < 1 or > units, or a negative or non-finite cost.
Partition balanceCosts(const std::vector<double>& unitCosts, int64_t stages, BalanceBy by = BalanceBy::kParameters);

// Per-unit costs: parameter counts, or seconds of forward + backward of each unit, in the units' current
// mode (training, for a pipeline), on the activations `sample` produces (one warm-up run of every unit, then
// `repeats` rounds over all the units, each unit's fastest run kept: other processes' load only ever adds
// time, so the minimum is the estimate it disturbs least, and going round the units spreads each unit's
// runs over the whole measurement, Note [Interleaved repeats] in partition.cpp, so that programs measuring
// at different moments of a busy machine still agree on the split). Measuring leaves the units as they
// were: gradients and buffers (BatchNorm running statistics) are restored.
std::vector<double> unitCosts(const std::vector<std::shared_ptr<Module>>& units, BalanceBy by,
                              const Tensor& sample = {}, int repeats = 9);

// balanceCosts(unitCosts(units, by, sample), stages, by). kTime needs a sample batch (ValueError without).
Partition balance(const std::vector<std::shared_ptr<Module>>& units, int64_t stages, BalanceBy by,
                  const Tensor& sample = {});

// An even split by unit count, for when no balancing is wanted (ValueError as balanceCosts).
Partition uniformPartition(int64_t units, int64_t stages);

// What one stage is, by value (travels to the worker that builds it).
struct StageSpec {
  ModelSpec model;
  int64_t firstUnit = 0;
  int64_t endUnit = 0;  // units [firstUnit, endUnit)
  template <class V>
  void visitFields(V& v) {
    v("model", model);
    v("firstUnit", firstUnit);
    v("endUnit", endUnit);
  }
  // ValueError: a bad model, or a unit range that is empty or outside the model's units.
  void validate() const;
  // "resnet18(width 16, cifar stem, 10 classes) units 0-4".
  std::string describe() const;
};

// Builds spec.model from its seed and returns units [first, end) as one module (a Sequential sharing
// them). Stages built this way on different workers together hold exactly the weights of buildModel.
std::shared_ptr<Module> buildStage(const StageSpec& spec);
// One StageSpec per stage of `partition` (ValueError if its bounds do not cover model's units).
std::vector<StageSpec> stageSpecs(const ModelSpec& model, const Partition& partition);
// The stages of `partition` as modules sharing `units` (for a pipeline inside one process).
std::vector<std::shared_ptr<Module>> stageModules(const std::vector<std::shared_ptr<Module>>& units,
                                                  const Partition& partition);

}  // namespace distgrad::models::pipeline
