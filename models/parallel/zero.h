// ZeroRedundancyOptimizer: ZeRO stage 1 (optimizer state sharding) over a ProcessGroup, like PyTorch's
// torch.distributed.optim.ZeroRedundancyOptimizer.
//
//   DistributedDataParallel ddp(*model, group);            // gradients averaged over ranks
//   ZeroRedundancyOptimizer zero(model->parameters(), group, [](std::vector<Tensor> shard) {
//     return std::make_unique<optim::Adam>(std::move(shard), optim::AdamOptions{.learningRate = 1e-3});
//   });
//   ... ddp.backward(loss); zero.step(); ...
//
// Every rank owns a disjoint shard of the parameters (whole tensors, assigned largest first to the rank
// with the fewest bytes so far: deterministic, so every rank computes the same assignment) and keeps the
// inner optimizer's state (momentum, Adam moments) for its shard only: about 1/N of the state per rank.
// step() updates the rank's shard from the parameters' .grad (which must already be the same on every
// rank, e.g. averaged by DDP), then every parameter is broadcast from its owner so all replicas agree.
// Thread-safety: like an Optimizer, one step at a time; step() is a collective (every rank calls it).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "models/optim/optimizer.h"
#include "rpc/collectives/process_group.h"

namespace distgrad::models {

class ZeroRedundancyOptimizer {
 public:
  using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

  // `parameters`: the same list (same order and shapes) on every rank.
  ZeroRedundancyOptimizer(std::vector<Tensor> parameters, rpc::collectives::ProcessGroup& group,
                          MakeOptimizer makeOptimizer);

  // Steps this rank's shard (skipping parameters without .grad), then broadcasts every parameter from its
  // owner. Throws RpcError when a broadcast fails (naming the worker).
  void step();
  // Sets every parameter's .grad to undefined (all of them, not only the shard).
  void zeroGrad();

  // The rank that owns parameters[i] (and keeps its optimizer state).
  int ownerOf(size_t i) const { return owner_.at(i); }
  // The parameters this rank owns, as indices into the constructor's list.
  const std::vector<size_t>& shard() const { return shard_; }
  // Bytes of optimizer state this rank holds now (the inner optimizer's stateDict tensors).
  size_t stateBytes() const;
  optim::Optimizer& inner() { return *inner_; }

 private:
  std::vector<Tensor> parameters_;
  rpc::collectives::ProcessGroup* group_;
  std::vector<int> owner_;
  std::vector<size_t> shard_;
  std::unique_ptr<optim::Optimizer> inner_;  // null when this rank owns no parameter
};

}  // namespace distgrad::models
