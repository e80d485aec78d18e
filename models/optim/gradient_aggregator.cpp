#include "models/optim/gradient_aggregator.h"

#include <algorithm>
#include <cmath>

#include "models/cuda_kernels.h"
#include "tensor/error.h"

namespace distgrad::models::optim {

std::optional<std::string> gradientMismatch(const std::vector<Tensor>& reference,
                                            const std::vector<Tensor>& candidate) {
  if (!reference.empty() && reference.size() != candidate.size()) {
    return std::to_string(candidate.size()) + " gradients, expected " + std::to_string(reference.size());
  }
  for (size_t i = 0; i < candidate.size(); ++i) {
    const Tensor& g = candidate[i];
    if (!g.defined()) continue;
    const std::string which = "gradient " + std::to_string(i);
    if (g.dtype() != DType::kFloat32 && g.dtype() != DType::kFloat64) {
      return which + " is " + tensor::dtypeName(g.dtype()) + ", expected float32 or float64";
    }
    if (g.device().isCuda() && !g.isContiguous()) return which + " on " + g.device().str() + " is not contiguous";
    if (reference.empty() || !reference[i].defined()) continue;
    if (g.device() != reference[i].device()) {
      return which + " is on " + g.device().str() + ", expected " + reference[i].device().str() +
             " (every submission's gradient of a parameter must be on one device)";
    }
    if (g.shape() != reference[i].shape()) {
      return which + " has shape " + tensor::shapeStr(g.shape()) + ", expected " +
             tensor::shapeStr(reference[i].shape());
    }
    if (g.dtype() != reference[i].dtype()) {
      return which + " is " + tensor::dtypeName(g.dtype()) + ", expected " + tensor::dtypeName(reference[i].dtype());
    }
  }
  return std::nullopt;
}

std::vector<Tensor> weightedAverage(const std::vector<std::vector<Tensor>>& grads, const std::vector<double>& weights) {
  DG_CHECK(!grads.empty(), "weightedAverage: no gradients");
  DG_CHECK(grads.size() == weights.size(), "weightedAverage: ", grads.size(), " gradient sets but ", weights.size(),
           " weights");
  double total = 0;
  for (double w : weights) {
    DG_CHECK(std::isfinite(w) && w > 0, "weightedAverage: weights must be finite and > 0, got ", w);
    total += w;
  }
  std::vector<Tensor> reference(grads[0].size());
  for (size_t k = 0; k < grads.size(); ++k) {
    if (auto problem = gradientMismatch(reference.empty() ? std::vector<Tensor>{} : reference, grads[k])) {
      DG_CHECK(false, "weightedAverage: set ", k, ": ", *problem);
    }
    for (size_t i = 0; i < reference.size(); ++i) {
      if (!reference[i].defined()) reference[i] = grads[k][i];
    }
  }
  std::vector<Tensor> out(reference.size());
  for (size_t i = 0; i < reference.size(); ++i) {
    if (!reference[i].defined()) continue;  // nobody produced this gradient
    const Device device = reference[i].device();
    out[i] = Tensor::empty(reference[i].shape(), reference[i].dtype(), device);
    if (device.isCpu())
      out[i].fill(0.0);
    else
      detail::zeroBytesCuda(device.index, out[i].rawData(), out[i].nbytes());
    tensor::dispatchFloat(out[i].dtype(), "weightedAverage", [&](auto zero) {
      using T = decltype(zero);
      if (device.isCuda()) {  // validated above: every contribution is contiguous on `device`
        for (size_t k = 0; k < grads.size(); ++k) {
          const Tensor& g = grads[k][i];
          if (g.defined())
            detail::axpyCuda<T>(device.index, out[i].data<T>(), g.data<T>(), g.numel(), weights[k] / total);
        }
        return;
      }
      T* acc = out[i].data<T>();
      const int64_t n = out[i].numel();
      for (size_t k = 0; k < grads.size(); ++k) {
        const Tensor& g0 = grads[k][i];
        if (!g0.defined()) continue;
        const Tensor g = g0.isContiguous() ? g0 : g0.cloneData();
        const T* src = g.data<T>();
        // The scale is w / total (0.5 for two equal weights: exact), so equal weights average without an
        // extra rounding from a separate division.
        const T scale = static_cast<T>(weights[k] / total);
        for (int64_t j = 0; j < n; ++j) acc[j] += scale * src[j];
      }
    });
  }
  return out;
}

std::optional<std::string> bufferMismatch(const std::vector<Tensor>& reference, const std::vector<Tensor>& candidate) {
  if (!reference.empty() && reference.size() != candidate.size()) {
    return std::to_string(candidate.size()) + " buffers, expected " + std::to_string(reference.size());
  }
  for (size_t i = 0; i < candidate.size(); ++i) {
    const Tensor& b = candidate[i];
    const std::string which = "buffer " + std::to_string(i);
    if (!b.defined()) return which + " is undefined";
    if (b.device().isCuda() && !b.isContiguous()) return which + " on " + b.device().str() + " is not contiguous";
    if (reference.empty()) continue;
    if (b.device() != reference[i].device()) {
      return which + " is on " + b.device().str() + ", expected " + reference[i].device().str();
    }
    if (b.shape() != reference[i].shape()) {
      return which + " has shape " + tensor::shapeStr(b.shape()) + ", expected " +
             tensor::shapeStr(reference[i].shape());
    }
    if (b.dtype() != reference[i].dtype()) {
      return which + " is " + tensor::dtypeName(b.dtype()) + ", expected " + tensor::dtypeName(reference[i].dtype());
    }
  }
  return std::nullopt;
}

std::vector<Tensor> averageBuffers(const std::vector<std::vector<Tensor>>& buffers,
                                   const std::vector<double>& weights) {
  DG_CHECK(!buffers.empty(), "averageBuffers: no buffers");
  DG_CHECK(buffers.size() == weights.size(), "averageBuffers: ", buffers.size(), " buffer sets but ", weights.size(),
           " weights");
  for (size_t k = 0; k < buffers.size(); ++k) {
    if (auto problem = bufferMismatch(buffers[0], buffers[k]))
      DG_CHECK(false, "averageBuffers: set ", k, ": ", *problem);
  }
  std::vector<Tensor> out;
  for (size_t i = 0; i < buffers[0].size(); ++i) {
    std::vector<std::vector<Tensor>> column;
    for (const auto& set : buffers) column.push_back({set[i]});
    if (tensor::isFloatingPoint(buffers[0][i].dtype())) {
      out.push_back(weightedAverage(column, weights)[0]);
      continue;
    }
    // An integer buffer is a counter (num_batches_tracked): every worker advanced it from the same value by
    // the same number of batches, so the maximum is that value; an average would round.
    DG_CHECK(std::all_of(weights.begin(), weights.end(), [](double w) { return std::isfinite(w) && w > 0; }),
             "averageBuffers: weights must be finite and > 0");
    Tensor merged = buffers[0][i].cloneData();
    int64_t* acc = merged.data<int64_t>();
    if (merged.device().isCuda()) {
      for (size_t k = 1; k < buffers.size(); ++k) {
        detail::maxInt64Cuda(merged.device().index, acc, buffers[k][i].data<int64_t>(), merged.numel());
      }
      out.push_back(std::move(merged));
      continue;
    }
    for (size_t k = 1; k < buffers.size(); ++k) {
      const Tensor b = buffers[k][i].isContiguous() ? buffers[k][i] : buffers[k][i].cloneData();
      const int64_t* src = b.data<int64_t>();
      for (int64_t j = 0; j < merged.numel(); ++j) acc[j] = std::max(acc[j], src[j]);
    }
    out.push_back(std::move(merged));
  }
  return out;
}

}  // namespace distgrad::models::optim
