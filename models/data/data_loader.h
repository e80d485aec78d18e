// DataLoader: iterates a TensorDataset in mini-batches.
//
//   DataLoader loader(train, {.batchSize = 64, .shuffle = true, .seed = 1});
//   for (int epoch = 0; epoch < 10; ++epoch)
//     for (const Batch& b : loader) { ... b.inputs, b.labels ... }
//
// The visiting order of an epoch comes from the sampler if one is given (e.g. a DistributedSampler, which
// the loader calls setEpoch on), else from a permutation seeded with seed + epoch when shuffling, else the
// natural order. The loader keeps an epoch counter: each begin() (each range-for) uses the current epoch
// and then advances it, so successive epochs see different, reproducible orders; setEpoch(e) makes the
// next iteration use epoch e (e.g. when resuming). Batches are gathered with one memcpy per sample row
// into fresh contiguous tensors; the last short batch is dropped with dropLast.
//
// Devices. The data set stays in host memory (a data set on a GPU is rejected: the gather is a host memcpy).
// With options.device = cuda:i each batch is gathered on the host and then copied to the device as a whole
// (two copies per batch: inputs and labels), so training code receives device tensors. The copy is a plain
// host-to-device copy from pageable memory (Tensor::to): no pinned staging buffer exists in the tensor layer
// yet, so the copy does not overlap the next batch's gather. Batch::to does the same for one batch (use it
// with a loader that yields host batches, e.g. to place micro-batches on different devices).
// Thread-safety: not thread-safe; iterate a loader from one thread at a time. Batches are independent
// tensors, safe to hand to other threads.
#pragma once

#include <cstdint>
#include <iterator>
#include <memory>
#include <vector>

#include "models/data/sampler.h"
#include "models/data/tensor_dataset.h"

namespace distgrad::models::data {

struct Batch {
  Tensor inputs;  // [B, ...sample shape]
  Tensor labels;  // [B, ...label shape]
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
  // The batch on `device` (copies; the same tensors when already there). ValueError if the device is not
  // available.
  Batch to(Device device) const;
};

struct DataLoaderOptions {
  int64_t batchSize = 32;
  bool shuffle = false;  // ignored (must be false) when a sampler is given
  uint64_t seed = 0;
  bool dropLast = false;
  // Where the batches are delivered (see "Devices" above). Checked when the loader is built.
  Device device = Device::cpu();
};

class DataLoader {
 public:
  DataLoader(TensorDataset dataset, const DataLoaderOptions& options, std::shared_ptr<Sampler> sampler = nullptr);

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;

    Iterator() = default;
    const Batch& operator*() const { return batch_; }
    const Batch* operator->() const { return &batch_; }
    Iterator& operator++();
    bool operator==(const Iterator& other) const;
    // Index of the current batch within the epoch.
    int64_t index() const { return index_; }

   private:
    friend class DataLoader;
    Iterator(const DataLoader* loader, std::shared_ptr<const std::vector<int64_t>> order, int64_t numBatches);
    void load();
    bool done() const { return index_ >= numBatches_; }

    const DataLoader* loader_ = nullptr;
    std::shared_ptr<const std::vector<int64_t>> order_;
    int64_t index_ = 0;
    int64_t numBatches_ = 0;
    Batch batch_;
  };

  // Starts an epoch (the current epoch counter), then advances the counter.
  Iterator begin();
  Iterator end() const { return Iterator(); }

  void setEpoch(int64_t epoch);
  // The epoch the next begin() will use.
  int64_t epoch() const { return epoch_; }
  // Batches and samples per epoch.
  int64_t numBatches() const;
  int64_t numSamples() const;
  // The sample order of `epoch` (what begin() would visit), without touching the counter.
  std::vector<int64_t> epochOrder(int64_t epoch) const;
  // Gathers the given samples into one batch.
  Batch gather(const int64_t* indices, int64_t count) const;

  const TensorDataset& dataset() const { return dataset_; }
  const DataLoaderOptions& options() const { return options_; }

 private:
  TensorDataset dataset_;
  DataLoaderOptions options_;
  std::shared_ptr<Sampler> sampler_;
  int64_t epoch_ = 0;
  size_t inputRowBytes_ = 0;
  size_t labelRowBytes_ = 0;
};

}  // namespace distgrad::models::data
