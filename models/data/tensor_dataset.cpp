#include "models/data/tensor_dataset.h"

namespace distgrad::models::data {

TensorDataset::TensorDataset(Tensor inputs, Tensor labels) {
  DG_CHECK(inputs.defined() && labels.defined(), "TensorDataset: inputs and labels must be defined");
  DG_CHECK(inputs.dim() >= 1 && labels.dim() >= 1, "TensorDataset: inputs and labels need a leading sample dim, got ",
           tensor::shapeStr(inputs.shape()), " and ", tensor::shapeStr(labels.shape()));
  DG_CHECK(inputs.size(0) == labels.size(0), "TensorDataset: inputs have ", inputs.size(0), " samples but labels have ",
           labels.size(0));
  DG_CHECK(inputs.device().isCpu() && labels.device().isCpu(), "TensorDataset: tensors must be in host memory, got ",
           "inputs on ", inputs.device().str(), " and labels on ", labels.device().str(),
           " (DataLoaderOptions::device delivers the batches on a GPU)");
  inputs_ = inputs.isContiguous() ? inputs.detach() : inputs.cloneData();
  labels_ = labels.isContiguous() ? labels.detach() : labels.cloneData();
}

Shape TensorDataset::sampleShape() const {
  DG_CHECK(inputs_.defined(), "TensorDataset::sampleShape: empty data set");
  return Shape(inputs_.shape().begin() + 1, inputs_.shape().end());
}

TensorDataset TensorDataset::slice(int64_t start, int64_t length) const {
  DG_CHECK(start >= 0 && length >= 0 && start + length <= size(), "TensorDataset::slice: rows [", start, ", ",
           start + length, ") out of range for ", size(), " samples");
  auto rows = [&](const Tensor& t) {
    Shape shape = t.shape();
    shape[0] = length;
    return Tensor::fromStorage(t.storage(), shape, t.strides(), t.offset() + start * t.stride(0), t.dtype());
  };
  return TensorDataset(rows(inputs_), rows(labels_));
}

}  // namespace distgrad::models::data
