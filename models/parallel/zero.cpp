// ZeroRedundancyOptimizer: deterministic partition into pieces, shard step, owner broadcasts.
#include "models/parallel/zero.h"

#include <algorithm>
#include <numeric>

namespace distgrad::models {

namespace {

// A 1-D view of elements [offset, offset + length) of contiguous `t` (sharing its storage), or `t` itself
// when the piece is all of it.
Tensor pieceOf(const Tensor& t, int64_t offset, int64_t length) {
  if (offset == 0 && length == t.numel()) return t;
  return Tensor::fromStorage(t.storage(), {length}, {1}, t.offset() + offset, t.dtype());
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<Tensor> parameters, rpc::collectives::ProcessGroup& group,
                                                 MakeOptimizer makeOptimizer, ZeroOptions options)
    : parameters_(std::move(parameters)), group_(&group) {
  DG_CHECK(!parameters_.empty(), "ZeroRedundancyOptimizer: no parameters");
  DG_CHECK(makeOptimizer != nullptr, "ZeroRedundancyOptimizer: makeOptimizer is empty");
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const Tensor& p = parameters_[i];
    DG_CHECK(p.defined() && p.isContiguous() && p.device().isCpu(), "ZeroRedundancyOptimizer: parameter ", i,
             " must be a contiguous CPU tensor");
  }
  const auto n = static_cast<size_t>(group.size());
  if (options.partition == ZeroPartition::kTensors) {
    // Largest first to the least-loaded rank (ties: the lower rank; equal sizes: the lower index).
    std::vector<size_t> order(parameters_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return parameters_[a].nbytes() > parameters_[b].nbytes(); });
    std::vector<size_t> load(n, 0);
    std::vector<int> owner(parameters_.size(), 0);
    for (size_t i : order) {
      const auto least = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      owner[i] = static_cast<int>(least);
      load[least] += parameters_[i].nbytes();
    }
    for (size_t i = 0; i < parameters_.size(); ++i) pieces_.push_back({i, 0, parameters_[i].numel(), owner[i]});
  } else {
    // Rank r owns elements [total * r / n, total * (r + 1) / n) of the parameters laid end to end; each
    // parameter is cut where those boundaries fall inside it.
    int64_t total = 0;
    for (const Tensor& p : parameters_) total += p.numel();
    auto boundary = [&](size_t r) { return total * static_cast<int64_t>(r) / static_cast<int64_t>(n); };
    int64_t start = 0;
    size_t rank = 0;
    for (size_t i = 0; i < parameters_.size(); ++i) {
      const int64_t end = start + parameters_[i].numel();
      int64_t at = start;
      while (at < end) {
        while (boundary(rank + 1) <= at) ++rank;  // empty ranges (n > total) own nothing
        const int64_t stop = std::min(end, boundary(rank + 1));
        pieces_.push_back({i, at - start, stop - at, static_cast<int>(rank)});
        at = stop;
      }
      start = end;
    }
  }
  std::vector<Tensor> mine;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& piece = pieces_[k];
    if (piece.owner != group.rank()) continue;
    mine_.push_back(k);
    mine.push_back(pieceOf(parameters_[piece.parameter], piece.offset, piece.length));
    shardElements_ += piece.length;
    if (shard_.empty() || shard_.back() != piece.parameter) shard_.push_back(piece.parameter);
  }
  if (!mine.empty()) inner_ = makeOptimizer(std::move(mine));
}

int ZeroRedundancyOptimizer::ownerOf(size_t i) const {
  DG_CHECK(i < parameters_.size(), "ZeroRedundancyOptimizer::ownerOf: parameter ", i, " of ", parameters_.size());
  for (const Piece& piece : pieces_) {
    if (piece.parameter == i) return piece.owner;
  }
  return 0;  // a parameter without elements has no piece (and no state)
}

void ZeroRedundancyOptimizer::step() {
  if (inner_) {
    // The shard's gradients: the same pieces of the parameters' .grad (views, no copy).
    std::vector<Tensor> grads;
    grads.reserve(mine_.size());
    for (size_t k : mine_) {
      const Piece& piece = pieces_[k];
      const Tensor& grad = parameters_[piece.parameter].grad();
      if (!grad.defined()) {
        grads.emplace_back();
        continue;
      }
      const Tensor flat = grad.isContiguous() ? grad : grad.cloneData();
      DG_CHECK(flat.numel() == parameters_[piece.parameter].numel(), "ZeroRedundancyOptimizer: gradient of parameter ",
               piece.parameter, " has ", flat.numel(), " elements, the parameter ",
               parameters_[piece.parameter].numel());
      grads.push_back(pieceOf(flat, piece.offset, piece.length));  // shaped like the piece given to the inner
    }
    inner_->step(grads);
  }
  std::vector<rpc::Future<void>> futures;
  for (const Piece& piece : pieces_) {
    if (piece.length == 0) continue;  // an empty parameter (kTensors): nothing to send
    futures.push_back(group_->broadcast(pieceOf(parameters_[piece.parameter].detach(), piece.offset, piece.length),
                                        piece.owner));
  }
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
    // Per-parameter fields ("<index>.<field>") of floating type: the state shaped like the parameters.
    if (name.find('.') != std::string::npos && tensor::isFloatingPoint(value.dtype())) bytes += value.nbytes();
  }
  return bytes;
}

}  // namespace distgrad::models
