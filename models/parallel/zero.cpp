// ZeroRedundancyOptimizer: deterministic shard assignment, shard step, owner broadcasts.
#include "models/parallel/zero.h"

#include <algorithm>
#include <numeric>

namespace distgrad::models {

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<Tensor> parameters, rpc::collectives::ProcessGroup& group,
                                                 MakeOptimizer makeOptimizer)
    : parameters_(std::move(parameters)), group_(&group) {
  DG_CHECK(!parameters_.empty(), "ZeroRedundancyOptimizer: no parameters");
  DG_CHECK(makeOptimizer != nullptr, "ZeroRedundancyOptimizer: makeOptimizer is empty");
  // Largest first to the least-loaded rank (ties: the lower rank; equal sizes: the lower index), so every
  // rank computes the same assignment from the same list.
  std::vector<size_t> order(parameters_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return parameters_[a].nbytes() > parameters_[b].nbytes(); });
  std::vector<size_t> load(static_cast<size_t>(group.size()), 0);
  owner_.assign(parameters_.size(), 0);
  for (size_t i : order) {
    const auto least = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owner_[i] = static_cast<int>(least);
    load[least] += parameters_[i].nbytes();
  }
  std::vector<Tensor> mine;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (owner_[i] == group.rank()) {
      shard_.push_back(i);
      mine.push_back(parameters_[i]);
    }
  }
  if (!mine.empty()) inner_ = makeOptimizer(std::move(mine));
}

void ZeroRedundancyOptimizer::step() {
  if (inner_) inner_->step();
  std::vector<rpc::Future<void>> futures;
  for (size_t i = 0; i < parameters_.size(); ++i) futures.push_back(group_->broadcast(parameters_[i].detach(), owner_[i]));
  for (auto& f : futures) f.get();
}

void ZeroRedundancyOptimizer::zeroGrad() {
  for (Tensor& p : parameters_) {
    if (p.grad().defined()) p.setGrad(Tensor());
  }
}

size_t ZeroRedundancyOptimizer::stateBytes() const {
  if (!inner_) return 0;
  size_t bytes = 0;
  for (const auto& [name, value] : inner_->stateDict()) {
    if (name.find('.') != std::string::npos) bytes += value.nbytes();  // per-parameter fields only
  }
  return bytes;
}

}  // namespace distgrad::models
