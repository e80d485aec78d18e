// Samplers decide which sample indices an epoch visits, and in what order.
//
// DistributedSampler follows PyTorch's torch.utils.data.DistributedSampler exactly in its partitioning:
// the (optionally shuffled, seeded with seed + epoch) index list is padded by repeating its beginning until
// its length divides evenly by worldSize (or, with dropLast, truncated to the largest such length), and rank
// r takes positions r, r + worldSize, r + 2 * worldSize, ... So every rank gets the same number of samples,
// every index is covered, and for a data set divisible by worldSize the ranks' shares are disjoint. The
// permutation comes from distgrad's Generator, so the order differs from PyTorch's while its properties match.
// Thread-safety: not thread-safe (setEpoch mutates); indices() is const.
#pragma once

#include <cstdint>
#include <vector>

namespace distgrad::models::data {

class Sampler {
 public:
  virtual ~Sampler() = default;
  // Selects the epoch whose order indices() returns (shuffling samplers reseed with it).
  virtual void setEpoch(int64_t epoch) = 0;
  // The indices of the current epoch, in visiting order.
  virtual std::vector<int64_t> indices() const = 0;
  // Number of indices per epoch.
  virtual int64_t size() const = 0;
};

// 0, 1, ..., size - 1 every epoch.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t size);
  void setEpoch(int64_t) override {}
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return size_; }

 private:
  int64_t size_;
};

// A permutation of 0..size-1 drawn from a Generator seeded with seed + epoch.
class RandomSampler : public Sampler {
 public:
  RandomSampler(int64_t size, uint64_t seed = 0);
  void setEpoch(int64_t epoch) override { epoch_ = epoch; }
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return size_; }

 private:
  int64_t size_;
  uint64_t seed_;
  int64_t epoch_ = 0;
};

class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t datasetSize, int64_t worldSize, int64_t rank, bool shuffle = true, uint64_t seed = 0,
                     bool dropLast = false);
  void setEpoch(int64_t epoch) override { epoch_ = epoch; }
  std::vector<int64_t> indices() const override;
  // Samples per rank per epoch.
  int64_t size() const override { return numSamples_; }
  // Samples over all ranks per epoch (numSamples * worldSize).
  int64_t totalSize() const { return numSamples_ * worldSize_; }
  int64_t epoch() const { return epoch_; }

 private:
  int64_t datasetSize_;
  int64_t worldSize_;
  int64_t rank_;
  bool shuffle_;
  uint64_t seed_;
  bool dropLast_;
  int64_t numSamples_;
  int64_t epoch_ = 0;
};

// A permutation of 0..n-1 from a Generator seeded with `seed` (the shuffling rule every sampler uses).
std::vector<int64_t> seededPermutation(int64_t n, uint64_t seed);

}  // namespace distgrad::models::data
