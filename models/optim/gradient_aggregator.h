// GradientAggregator<R>: the batched update of a synchronous parameter server (the "batch RPC processing"
// pattern of PyTorch's parameter-server tutorial), with no thread held by a waiting worker.
//
//   GradientAggregator<Snapshot> agg(numTrainers, [&](std::vector<Tensor> avg, int64_t round) {
//     optimizer.step(avg);               // ONE step per round
//     return snapshotOfParameters();     // what every trainer of the round gets back
//   });
//   reg.bind(kPush, [&](const rpc::CallContext& ctx, int64_t trainer, int64_t round, int64_t batch,
//                       std::vector<Tensor> grads) {
//     return agg.submit(ctx.agent->executor(), trainer, round, std::move(grads), double(batch));
//   });
//
// Each of `contributors` workers submits its gradients (one tensor per parameter) for round k. submit()
// never blocks: it returns a Future<R> at once, so an RPC handler returns it and frees its executor thread.
// When the round's last submission arrives, the gradients are averaged, weighted by each submission's
// weight (pass the batch size: the average is then the gradient of the mean loss over every sample of the
// round, exactly what one worker with the union of the batches computes), `apply` runs once with the
// average and the round number, and the R it returns completes every contributor's future (each gets a
// copy: make R cheap to copy, e.g. tensor handles); then the aggregator moves to round k + 1.
//
// Buffers. A model's buffers (BatchNorm's running mean and variance, num_batches_tracked) change in each
// worker's training forward, never in the server's, so a server that only steps on gradients would keep them
// at their initial values. A submission may carry the worker's buffers (`buffers`, after its forward); with
// the ApplyWithBuffers constructor, `apply` also receives the round's buffers merged by averageBuffers:
// floating buffers averaged with the same weights in contributor order (for running means, exactly the
// running mean one worker with the union of the batches would have, as each worker started the round from
// the server's buffers; running variances average the workers' per-batch variances, which leaves out the
// spread between the workers' batch means: close, not exact), integer buffers (counters such as
// num_batches_tracked) take the maximum.
//
// The weighted sum runs in contributor order, not arrival order, so the result is bit-for-bit the same
// whichever worker is fastest. An undefined gradient counts as zeros (a parameter a worker's batch did not
// reach); a parameter with no gradient from anybody stays undefined in the average.
//
// Errors come back as failed futures (kFailed, the message names contributor and round) and leave the round
// as it was: a contributor outside [0, contributors), a round other than the current one, a second
// submission of one contributor in a round, a submission while the round is being applied, gradients whose
// count, shapes or dtypes differ from the round's other submissions, non-float gradients, a gradient on another device
// than the round's first one for that parameter, a weight that is not finite and > 0, buffers whose count, shapes or
// dtypes differ from the round's first submission's (or that are undefined, or on another device than the first
// submission's). abort(error) fails the open round's futures and every later submission with `error`: call it when a
// contributor died (its round could never complete, and the others must not wait forever). If `apply` throws, the
// round's futures fail with its error and the aggregator aborts (the parameters are in an unknown state).
//
// Thread-safety: submit() and abort() may be called from any threads at once. `apply` runs on the thread of
// the round's last submit() (an RPC executor thread in a server), outside the aggregator's lock, and never
// concurrently with itself. Each future is bound to the executor given to its submit().
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rpc/error.h"
#include "rpc/executor.h"
#include "rpc/future.h"
#include "tensor/tensor.h"

namespace distgrad::models::optim {

// sum_i weights[i] * grads[i] / sum_i weights[i], per parameter, accumulated in the order of `grads`
// (float32 gradients accumulate in float32, like an optimizer would see them). Undefined entries count as
// zeros; a parameter undefined in every entry stays undefined. Throws ValueError on count, shape, dtype or
// device mismatches and on weights that are not finite and > 0.
std::vector<Tensor> weightedAverage(const std::vector<std::vector<Tensor>>& grads, const std::vector<double>& weights);

// Why `candidate` cannot be averaged with `reference` (same count, per parameter the same shape and dtype
// and device where both are defined, float32/float64 tensors, contiguous when on CUDA), or nullopt when it
// can. An empty `reference` only checks the dtypes (and contiguity on CUDA). CUDA gradients are averaged by
// a kernel on the parameter's device (the current stream); the result stays on that device.
std::optional<std::string> gradientMismatch(const std::vector<Tensor>& reference, const std::vector<Tensor>& candidate);

// Why `candidate` buffers cannot be merged with `reference` (same count, each defined, with the reference's
// shape, dtype and device; contiguous when on CUDA), or nullopt when they can. An empty `reference` only
// checks that each candidate is defined (and contiguous on CUDA).
std::optional<std::string> bufferMismatch(const std::vector<Tensor>& reference, const std::vector<Tensor>& candidate);

// Merges the workers' buffers, per buffer: floating ones weighted by `weights` and summed in the order of
// `buffers` (like weightedAverage), integer ones the element-wise maximum. New tensors; throws ValueError on
// a mismatch (bufferMismatch) and on weights that are not finite and > 0.
std::vector<Tensor> averageBuffers(const std::vector<std::vector<Tensor>>& buffers, const std::vector<double>& weights);

template <typename R>
class GradientAggregator {
 public:
  using Apply = std::function<R(std::vector<Tensor> averaged, int64_t round)>;
  // `buffers` = averageBuffers of the round's submitted buffers (empty when the submissions carried none).
  using ApplyWithBuffers = std::function<R(std::vector<Tensor> averaged, std::vector<Tensor> buffers, int64_t round)>;

  GradientAggregator(int64_t contributors, Apply apply, int64_t firstRound = 0)
      : GradientAggregator(contributors, wrap(std::move(apply)), firstRound) {}
  GradientAggregator(int64_t contributors, ApplyWithBuffers apply, int64_t firstRound = 0)
      : contributors_(contributors),
        apply_(std::move(apply)),
        round_(firstRound),
        slots_(static_cast<size_t>(contributors > 0 ? contributors : 0)) {
    DG_CHECK(contributors >= 1, "GradientAggregator: contributors must be >= 1, got ", contributors);
    DG_CHECK(apply_ != nullptr, "GradientAggregator: apply must be callable");
  }
  GradientAggregator(const GradientAggregator&) = delete;
  GradientAggregator& operator=(const GradientAggregator&) = delete;

  rpc::Future<R> submit(rpc::Executor& executor, int64_t contributor, int64_t round, std::vector<Tensor> grads,
                        double weight = 1.0, std::vector<Tensor> buffers = {}) {
    rpc::Promise<R> promise(executor);
    rpc::Future<R> future = promise.getFuture();
    std::vector<std::vector<Tensor>> roundGrads, roundBuffers;
    std::vector<double> roundWeights;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) {
        promise.setError(*aborted_);
        return future;
      }
      const std::string who =
          "GradientAggregator: contributor " + std::to_string(contributor) + ", round " + std::to_string(round) + ": ";
      std::optional<std::string> problem;
      if (contributor < 0 || contributor >= contributors_) {
        problem = "no such contributor (expected 0.." + std::to_string(contributors_ - 1) + ")";
      } else if (applying_) {
        problem = "round " + std::to_string(round_) + " is being applied; submit after its future completes";
      } else if (round != round_) {
        problem = "the aggregator is at round " + std::to_string(round_);
      } else if (slots_[static_cast<size_t>(contributor)].has_value()) {
        problem = "submitted twice in this round";
      } else if (!(std::isfinite(weight) && weight > 0)) {
        problem = "weight must be finite and > 0, got " + std::to_string(weight);
      } else {
        problem = gradientMismatch(reference_, grads);
        if (!problem && arrived_ > 0 && buffers.size() != referenceBuffers_.size()) {
          problem = std::to_string(buffers.size()) + " buffers, expected " + std::to_string(referenceBuffers_.size());
        }
        if (!problem) problem = bufferMismatch(referenceBuffers_, buffers);
      }
      if (problem) {
        promise.setError(rpc::Error::failed(who + *problem));
        return future;
      }
      if (arrived_ == 0) referenceBuffers_ = buffers;
      if (reference_.empty()) reference_.resize(grads.size());
      for (size_t i = 0; i < grads.size(); ++i) {
        if (!reference_[i].defined()) reference_[i] = grads[i];
      }
      slots_[static_cast<size_t>(contributor)] = Slot{std::move(grads), std::move(buffers), weight, std::move(promise)};
      if (++arrived_ < contributors_) return future;
      // The round is full: this thread applies it, outside the lock (Note in the header: apply may take
      // milliseconds; abort() and rejected submissions must not wait for it).
      applying_ = true;
      for (auto& slot : slots_) {
        roundGrads.push_back(std::move(slot->grads));
        roundBuffers.push_back(std::move(slot->buffers));
        roundWeights.push_back(slot->weight);
      }
    }
    finishRound(std::move(roundGrads), std::move(roundBuffers), roundWeights);
    return future;
  }

  // Fails the open round's futures and every later submission with `error`. The first abort wins.
  void abort(rpc::Error error) {
    std::vector<rpc::Promise<R>> waiting;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) return;
      aborted_ = error;
      // While a round is being applied its promises belong to finishRound, which fails them itself.
      if (!applying_) waiting = takePromisesLocked();
    }
    for (auto& promise : waiting) promise.setError(error);
  }

  int64_t contributors() const { return contributors_; }
  // The round submissions are accepted for (completed rounds + firstRound).
  int64_t round() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return round_;
  }
  // Submissions of the open round so far.
  int64_t arrived() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return arrived_;
  }
  bool aborted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborted_.has_value();
  }

 private:
  struct Slot {
    std::vector<Tensor> grads;
    std::vector<Tensor> buffers;
    double weight;
    rpc::Promise<R> promise;
  };

  static ApplyWithBuffers wrap(Apply apply) {
    if (!apply) return nullptr;
    return [apply = std::move(apply)](std::vector<Tensor> averaged, std::vector<Tensor>, int64_t round) {
      return apply(std::move(averaged), round);
    };
  }

  void finishRound(std::vector<std::vector<Tensor>> grads, std::vector<std::vector<Tensor>> buffers,
                   const std::vector<double>& weights) {
    std::optional<R> result;
    std::optional<rpc::Error> failure;
    try {
      std::vector<Tensor> mergedBuffers;
      if (!buffers.front().empty()) mergedBuffers = averageBuffers(buffers, weights);
      // round_ is stable while applying_
      result.emplace(apply_(weightedAverage(grads, weights), std::move(mergedBuffers), round_));
    } catch (...) {
      failure = rpc::errorFromException(std::current_exception());
    }
    grads.clear();  // release the gradients and buffers before the trainers get their answers
    buffers.clear();
    std::vector<rpc::Promise<R>> waiting;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      applying_ = false;
      waiting = takePromisesLocked();
      if (failure && !aborted_) aborted_ = *failure;
      if (!failure && aborted_) failure = *aborted_;  // aborted meanwhile: nobody may rely on this round
      if (!failure) ++round_;
    }
    // Completed outside the lock: an inline-safe continuation may submit again.
    for (auto& promise : waiting) {
      if (failure) {
        promise.setError(*failure);
      } else {
        promise.setValue(*result);
      }
    }
  }

  std::vector<rpc::Promise<R>> takePromisesLocked() {
    std::vector<rpc::Promise<R>> out;
    for (auto& slot : slots_) {
      if (slot) out.push_back(std::move(slot->promise));
      slot.reset();
    }
    arrived_ = 0;
    reference_.clear();
    referenceBuffers_.clear();
    return out;
  }

  const int64_t contributors_;
  const ApplyWithBuffers apply_;
  mutable std::mutex mutex_;
  int64_t round_;                           // GUARDED_BY(mutex_); stable while applying_
  int64_t arrived_ = 0;                     // GUARDED_BY(mutex_)
  bool applying_ = false;                   // GUARDED_BY(mutex_)
  std::vector<std::optional<Slot>> slots_;  // GUARDED_BY(mutex_): one per contributor
  std::vector<Tensor> reference_;           // GUARDED_BY(mutex_): per parameter, the round's first defined gradient
  std::vector<Tensor> referenceBuffers_;    // GUARDED_BY(mutex_): the round's first submission's buffers
  std::optional<rpc::Error> aborted_;       // GUARDED_BY(mutex_)
};

}  // namespace distgrad::models::optim
