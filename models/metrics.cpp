#include "models/metrics.h"

namespace distgrad::models {

int64_t countCorrect(const Tensor& logits, const Tensor& labels) {
  DG_CHECK(logits.dim() == 2 && labels.dim() == 1 && labels.size(0) == logits.size(0),
           "countCorrect: expected logits [N, C] and labels [N], got ", tensor::shapeStr(logits.shape()), " and ",
           tensor::shapeStr(labels.shape()));
  DG_CHECK(labels.dtype() == DType::kInt64, "countCorrect: labels must be int64, got ", tensor::dtypeName(labels.dtype()));
  const Tensor l = logits.device().isCpu() && logits.isContiguous() ? logits : logits.to(Device::cpu()).cloneData();
  const Tensor y = labels.device().isCpu() && labels.isContiguous() ? labels : labels.to(Device::cpu()).cloneData();
  const int64_t n = l.size(0);
  const int64_t c = l.size(1);
  const int64_t* yp = y.data<int64_t>();
  int64_t correct = 0;
  tensor::dispatchFloat(l.dtype(), "countCorrect", [&](auto zero) {
    using T = decltype(zero);
    const T* p = l.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = p + i * c;
      int64_t best = 0;
      for (int64_t j = 1; j < c; ++j) {
        if (row[j] > row[best]) best = j;
      }
      if (best == yp[i]) ++correct;
    }
  });
  return correct;
}

double accuracy(const Tensor& logits, const Tensor& labels) {
  DG_CHECK(logits.dim() >= 1 && logits.size(0) > 0, "accuracy: empty batch");
  return static_cast<double>(countCorrect(logits, labels)) / static_cast<double>(logits.size(0));
}

}  // namespace distgrad::models
