// DistributedDataParallel: data-parallel training of one Module replicated on every member of a
// ProcessGroup (rpc/collectives), PyTorch DDP's algorithm.
//
//   auto group = rpc::collectives::ProcessGroup::world(*agent);
//   models::DistributedDataParallel ddp(*model, group);    // broadcasts rank 0's parameters and buffers
//   for (...) {
//     model->zeroGrad();
//     Tensor loss = crossEntropy(ddp.forward(x), y);         // this rank's share of the batch
//     ddp.backward(loss);                                    // backward + all-reduce: .grad = mean over ranks
//     optimizer.step();
//   }
//   { auto guard = ddp.noSync(); ddp.backward(lossOfMicroBatch1); }   // gradient accumulation, no all-reduce
//   ddp.backward(lossOfMicroBatch2);                                   // all-reduces the accumulated sum
//   // Inside distributed autograd (the RPC + DDP hybrid): gradients live in the context, not in .grad.
//   { DistContext ctx(*agent); Tensor loss = ...ddp.forward(x)...; ddp.backward(ctx, loss); opt.step(ctx); }
//
// Gradients are packed into buckets of about DdpOptions::bucketBytes in reverse parameter order (the order
// backward produces them). A hook on each parameter (Tensor::registerHook, which runs in the local and
// the distributed backward alike) copies its gradient into its bucket; a bucket whose gradients are all
// in is all-reduced asynchronously right away, while backward goes on computing earlier layers' gradients
// (overlap). Buckets are launched strictly in bucket order so every rank issues the same collectives in
// the same order. synchronize() (backward() calls it) launches what is left (a parameter that got no
// gradient contributes zeros), waits, and writes the averaged gradients: .grad = previous .grad + mean of
// this backward's gradients over ranks, so zeroGrad() before each step gives exactly the mean.
//
// Thread-safety: one training loop drives a DistributedDataParallel; its hooks may run on the autograd
// engine's threads. The module and the group must outlive it; every rank must wrap the same architecture.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "models/nn/module.h"
#include "rpc/collectives/process_group.h"

namespace distgrad::models {

struct DdpOptions {
  // Target size of one gradient bucket (PyTorch's bucket_cap_mb default is 25 MB). A parameter larger than
  // this gets a bucket of its own.
  size_t bucketBytes = size_t{25} << 20;
  // Make every rank start from rank 0's parameters and buffers.
  bool broadcastParameters = true;
  // Overwrite the buffers (BatchNorm's running statistics) with rank 0's at every forward(), as PyTorch's
  // broadcast_buffers does, so replicas that update buffers in forward stay identical.
  bool broadcastBuffers = true;
  // Element type of gradients on the wire (float32 models only).
  rpc::collectives::WireCompression compression = rpc::collectives::WireCompression::kNone;
};

namespace detail {
struct DdpState;
}

class DistributedDataParallel {
 public:
  // Registers gradient hooks on `module`'s parameters (all must be float32 or all float64) and, with
  // broadcastParameters, overwrites them and the buffers with rank 0's (a collective: every rank constructs
  // its DistributedDataParallel at the same point).
  DistributedDataParallel(Module& module, rpc::collectives::ProcessGroup& group, DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // The module's forward, after rank 0's buffers were broadcast (broadcastBuffers; a collective); also
  // notes the gradients the parameters hold now (in .grad, or in the active distributed autograd context)
  // as the base synchronize() adds the mean to.
  Tensor forward(const Tensor& input);
  // loss.backward() (resp. ctx.backward({loss})) then synchronize().
  void backward(const Tensor& loss);
  void backward(autograd::distributed::DistContext& ctx, const Tensor& loss);
  // Completes the gradient all-reduce of the backward that just ran: launches the buckets not yet
  // launched, waits for all, and writes the mean into .grad (resp. into ctx's gradients). Throws RpcError
  // when a collective failed (a rank died, or ranks disagree), naming the worker.
  void synchronize();
  void synchronize(autograd::distributed::DistContext& ctx);

  // PyTorch's no_sync(): while the returned guard lives, backward() runs the backward pass only, and the
  // gradients accumulate locally (in .grad, or in the distributed autograd context) without any
  // communication. The first synchronised backward after it all-reduces each parameter's accumulated
  // gradient plus its own, so after K passes under noSync() and one without, every rank holds the mean
  // over ranks of the sum of its K + 1 gradients (gradient accumulation over micro-batches with one
  // all-reduce). Inside distributed autograd, run all K + 1 passes in the same DistContext (its gradients
  // accumulate over passes); synchronising in another context (or outside one) throws ValueError. Guards
  // nest; synchronize() inside one throws ValueError.
  class NoSyncGuard {
   public:
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    ~NoSyncGuard();

   private:
    friend class DistributedDataParallel;
    explicit NoSyncGuard(std::shared_ptr<detail::DdpState> state);
    std::shared_ptr<detail::DdpState> state_;
  };
  [[nodiscard]] NoSyncGuard noSync();

  // The buckets: parameter indices (into module.parameters()) of each, in launch order.
  std::vector<std::vector<size_t>> buckets() const;
  // Buckets whose all-reduce started during the last backward, before synchronize() was called: how much
  // communication overlapped with computation.
  size_t bucketsLaunchedDuringBackward() const;
  Module& module() { return *module_; }

 private:
  void finish(const std::function<void(size_t, const Tensor&)>& write);
  bool syncDisabled() const;

  Module* module_;
  std::shared_ptr<detail::DdpState> state_;
};

}  // namespace distgrad::models
