// ZeroRedundancyOptimizer: ZeRO stage 1 (optimizer state sharding) over a ProcessGroup, like PyTorch's
// torch.distributed.optim.ZeroRedundancyOptimizer.
//
//   DistributedDataParallel ddp(*model, group);            // gradients averaged over ranks
//   ZeroRedundancyOptimizer zero(model->parameters(), group, [](std::vector<Tensor> shard) {
//     return std::make_unique<optim::Adam>(std::move(shard), optim::AdamOptions{.learningRate = 1e-3});
//   });
//   ... ddp.backward(loss); zero.step(); ...
//
// Every rank owns a disjoint shard of the parameters and keeps the inner optimizer's state (momentum, Adam
// moments) for its shard only. ZeroPartition::kElements (the default, DeepSpeed's flat partitioning) cuts
// the parameters, laid end to end, into N ranges of equal element count (within one element): a rank's
// shard is a list of pieces, contiguous element ranges of parameters (views sharing their storage, so the
// inner optimizer updates the parameters in place), and each rank holds 1/N of the state even when one
// tensor dominates the model (an embedding table, LeNet's first fully connected layer). kTensors assigns
// whole tensors, largest first to the rank with the fewest bytes so far (PyTorch's ZeroRedundancyOptimizer),
// which can be far from 1/N. Both assignments are deterministic, so every rank computes the same one.
// kElements is exact for element-wise optimizers (SGD, Adam: every element's update depends on that element
// alone); an optimizer that looks at a whole tensor (a per-tensor norm, as LAMB's trust ratio) needs
// kTensors, since a split tensor's pieces are stepped separately.
// step() updates the rank's shard from the parameters' .grad (which must already be the same on every
// rank, e.g. averaged by DDP), then every piece is broadcast from its owner so all replicas agree.
// Thread-safety: like an Optimizer, one step at a time; step() is a collective (every rank calls it).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "models/optim/optimizer.h"
#include "rpc/collectives/process_group.h"

namespace distgrad::models {

enum class ZeroPartition {
  kElements,  // equal element ranges of the parameters laid end to end (tensors may be split)
  kTensors,   // whole tensors, largest first to the least-loaded rank
};

struct ZeroOptions {
  ZeroPartition partition = ZeroPartition::kElements;
};

class ZeroRedundancyOptimizer {
 public:
  using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

  // A contiguous range of one parameter's elements (in its row-major order) and the rank that owns it.
  struct Piece {
    size_t parameter = 0;  // index into the constructor's list
    int64_t offset = 0;    // first element
    int64_t length = 0;    // elements
    int owner = 0;
    bool operator==(const Piece&) const = default;
  };

  // `parameters`: the same list (same order and shapes) on every rank; contiguous CPU float tensors.
  // makeOptimizer receives this rank's pieces as tensors (whole parameters, or 1-D views of parts of them)
  // and is not called when the rank owns nothing (more ranks than elements, or than tensors with kTensors).
  ZeroRedundancyOptimizer(std::vector<Tensor> parameters, rpc::collectives::ProcessGroup& group,
                          MakeOptimizer makeOptimizer, ZeroOptions options = {});

  // Steps this rank's pieces (skipping parameters without .grad), then broadcasts every piece from its
  // owner. Throws RpcError when a broadcast fails (naming the worker).
  void step();
  // Sets every parameter's .grad to undefined (all of them, not only the shard).
  void zeroGrad();

  // The rank that owns the first element of parameters[i] (with kTensors: all of it).
  int ownerOf(size_t i) const;
  // Every rank's pieces, in parameter order (the same list on every rank).
  const std::vector<Piece>& pieces() const { return pieces_; }
  // The parameters this rank owns a part of, as indices into the constructor's list.
  const std::vector<size_t>& shard() const { return shard_; }
  // Elements of the parameters whose optimizer state this rank holds.
  int64_t shardElements() const { return shardElements_; }
  // Bytes of optimizer state this rank holds now: the inner optimizer's floating-point state tensors (Adam's
  // moments; not its int64 step counters, one per piece).
  size_t stateBytes() const;
  optim::Optimizer& inner() { return *inner_; }

 private:
  std::vector<Tensor> parameters_;
  rpc::collectives::ProcessGroup* group_;
  std::vector<Piece> pieces_;
  std::vector<size_t> mine_;   // indices into pieces_ of this rank's pieces, in the inner optimizer's order
  std::vector<size_t> shard_;
  int64_t shardElements_ = 0;
  std::unique_ptr<optim::Optimizer> inner_;  // null when this rank owns no parameter
};

}  // namespace distgrad::models
