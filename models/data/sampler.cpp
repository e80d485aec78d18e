#include "models/data/sampler.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "tensor/error.h"
#include "tensor/random.h"

namespace distgrad::models::data {

std::vector<int64_t> seededPermutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> out(static_cast<size_t>(n));
  std::iota(out.begin(), out.end(), int64_t{0});
  tensor::Generator gen(seed);
  // Fisher-Yates, as tensor::randperm does, without the tensor round trip.
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(out[static_cast<size_t>(i)], out[gen.below(static_cast<uint64_t>(i + 1))]);
  }
  return out;
}

SequentialSampler::SequentialSampler(int64_t size) : size_(size) {
  DG_CHECK(size >= 0, "SequentialSampler: size must be >= 0, got ", size);
}

std::vector<int64_t> SequentialSampler::indices() const {
  std::vector<int64_t> out(static_cast<size_t>(size_));
  std::iota(out.begin(), out.end(), int64_t{0});
  return out;
}

RandomSampler::RandomSampler(int64_t size, uint64_t seed) : size_(size), seed_(seed) {
  DG_CHECK(size >= 0, "RandomSampler: size must be >= 0, got ", size);
}

std::vector<int64_t> RandomSampler::indices() const {
  return seededPermutation(size_, seed_ + static_cast<uint64_t>(epoch_));
}

DistributedSampler::DistributedSampler(int64_t datasetSize, int64_t worldSize, int64_t rank, bool shuffle,
                                       uint64_t seed, bool dropLast)
    : datasetSize_(datasetSize), worldSize_(worldSize), rank_(rank), shuffle_(shuffle), seed_(seed), dropLast_(dropLast) {
  DG_CHECK(datasetSize >= 0, "DistributedSampler: datasetSize must be >= 0, got ", datasetSize);
  DG_CHECK(worldSize > 0, "DistributedSampler: worldSize must be > 0, got ", worldSize);
  DG_CHECK(rank >= 0 && rank < worldSize, "DistributedSampler: rank ", rank, " is out of range for worldSize ",
           worldSize, " (expected 0..", worldSize - 1, ")");
  if (dropLast && datasetSize % worldSize != 0) {
    // PyTorch: ceil((len - world) / world), the largest share every rank can get without padding.
    numSamples_ = datasetSize < worldSize ? 0 : (datasetSize - worldSize + worldSize - 1) / worldSize;
  } else {
    numSamples_ = (datasetSize + worldSize - 1) / worldSize;
  }
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> all;
  if (shuffle_) {
    all = seededPermutation(datasetSize_, seed_ + static_cast<uint64_t>(epoch_));
  } else {
    all.resize(static_cast<size_t>(datasetSize_));
    std::iota(all.begin(), all.end(), int64_t{0});
  }
  const auto total = static_cast<size_t>(totalSize());
  if (!dropLast_ && total > all.size() && !all.empty()) {
    // Pad by repeating from the start (several times over when the data set is smaller than the padding).
    const size_t n = all.size();
    all.reserve(total);
    for (size_t i = 0; all.size() < total; ++i) all.push_back(all[i % n]);
  } else {
    all.resize(std::min(all.size(), total));
  }
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(numSamples_));
  for (size_t i = static_cast<size_t>(rank_); i < all.size(); i += static_cast<size_t>(worldSize_)) mine.push_back(all[i]);
  DG_ASSERT(static_cast<int64_t>(mine.size()) == numSamples_, "rank ", rank_, " got ", mine.size(), " samples, expected ",
            numSamples_);
  return mine;
}

}  // namespace distgrad::models::data
