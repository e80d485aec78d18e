#include "models/data/data_loader.h"

#include <cstring>
#include <numeric>

#include "tensor/cuda/runtime.h"

namespace distgrad::models::data {

DataLoader::DataLoader(TensorDataset dataset, const DataLoaderOptions& options, std::shared_ptr<Sampler> sampler)
    : dataset_(std::move(dataset)), options_(options), sampler_(std::move(sampler)) {
  DG_CHECK(dataset_.inputs().defined(), "DataLoader: the data set is empty (default-constructed)");
  DG_CHECK(options_.batchSize > 0, "DataLoader: batchSize must be > 0, got ", options_.batchSize);
  DG_CHECK(!(sampler_ && options_.shuffle), "DataLoader: shuffle must be false when a sampler is given (the sampler "
                                            "decides the order)");
  if (options_.device.isCuda()) {
    const std::string what = "DataLoader (options.device " + options_.device.str() + ")";
    tensor::cuda::requireDevice(options_.device.index, what.c_str());
  }
  const int64_t n = dataset_.size();
  inputRowBytes_ = n > 0 ? dataset_.inputs().nbytes() / static_cast<size_t>(n) : 0;
  labelRowBytes_ = n > 0 ? dataset_.labels().nbytes() / static_cast<size_t>(n) : 0;
}

void DataLoader::setEpoch(int64_t epoch) {
  DG_CHECK(epoch >= 0, "DataLoader::setEpoch: epoch must be >= 0, got ", epoch);
  epoch_ = epoch;
}

int64_t DataLoader::numSamples() const { return sampler_ ? sampler_->size() : dataset_.size(); }

int64_t DataLoader::numBatches() const {
  const int64_t n = numSamples();
  return options_.dropLast ? n / options_.batchSize : (n + options_.batchSize - 1) / options_.batchSize;
}

std::vector<int64_t> DataLoader::epochOrder(int64_t epoch) const {
  std::vector<int64_t> order;
  if (sampler_) {
    sampler_->setEpoch(epoch);
    order = sampler_->indices();
    for (int64_t i : order) {
      DG_CHECK(i >= 0 && i < dataset_.size(), "DataLoader: the sampler produced index ", i, " for a data set of ",
               dataset_.size(), " samples");
    }
  } else if (options_.shuffle) {
    order = seededPermutation(dataset_.size(), options_.seed + static_cast<uint64_t>(epoch));
  } else {
    order.resize(static_cast<size_t>(dataset_.size()));
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  return order;
}

DataLoader::Iterator DataLoader::begin() {
  auto order = std::make_shared<const std::vector<int64_t>>(epochOrder(epoch_));
  ++epoch_;
  const int64_t n = static_cast<int64_t>(order->size());
  const int64_t batches = options_.dropLast ? n / options_.batchSize : (n + options_.batchSize - 1) / options_.batchSize;
  return Iterator(this, std::move(order), batches);
}

Batch DataLoader::gather(const int64_t* indices, int64_t count) const {
  DG_CHECK(count >= 0, "DataLoader::gather: negative count ", count);
  const Tensor& x = dataset_.inputs();
  const Tensor& y = dataset_.labels();
  Shape xShape = x.shape();
  Shape yShape = y.shape();
  xShape[0] = count;
  yShape[0] = count;
  Batch batch{Tensor::empty(xShape, x.dtype()), Tensor::empty(yShape, y.dtype())};
  const auto* xSrc = static_cast<const char*>(x.rawData());
  const auto* ySrc = static_cast<const char*>(y.rawData());
  auto* xDst = static_cast<char*>(batch.inputs.rawData());
  auto* yDst = static_cast<char*>(batch.labels.rawData());
  const int64_t n = dataset_.size();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = indices[i];
    DG_CHECK(s >= 0 && s < n, "DataLoader::gather: index ", s, " out of range for ", n, " samples");
    std::memcpy(xDst + static_cast<size_t>(i) * inputRowBytes_, xSrc + static_cast<size_t>(s) * inputRowBytes_,
                inputRowBytes_);
    std::memcpy(yDst + static_cast<size_t>(i) * labelRowBytes_, ySrc + static_cast<size_t>(s) * labelRowBytes_,
                labelRowBytes_);
  }
  return batch;
}

Batch Batch::to(Device device) const {
  if (device.isCuda()) tensor::cuda::requireDevice(device.index, ("Batch::to(" + device.str() + ")").c_str());
  Batch out;
  if (inputs.defined()) out.inputs = inputs.device() == device ? inputs : inputs.to(device);
  if (labels.defined()) out.labels = labels.device() == device ? labels : labels.to(device);
  return out;
}

DataLoader::Iterator::Iterator(const DataLoader* loader, std::shared_ptr<const std::vector<int64_t>> order,
                               int64_t numBatches)
    : loader_(loader), order_(std::move(order)), numBatches_(numBatches) {
  load();
}

void DataLoader::Iterator::load() {
  if (done()) {
    batch_ = Batch{};
    return;
  }
  const int64_t bs = loader_->options_.batchSize;
  const int64_t start = index_ * bs;
  const int64_t count = std::min<int64_t>(bs, static_cast<int64_t>(order_->size()) - start);
  batch_ = loader_->gather(order_->data() + start, count);
  if (!loader_->options_.device.isCpu()) batch_ = batch_.to(loader_->options_.device);
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  ++index_;
  load();
  return *this;
}

bool DataLoader::Iterator::operator==(const Iterator& other) const {
  if (done() || other.done()) return done() && other.done();
  return loader_ == other.loader_ && order_ == other.order_ && index_ == other.index_;
}

}  // namespace distgrad::models::data
