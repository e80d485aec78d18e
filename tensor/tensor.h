// Tensor: a strided view (shape, strides, element offset, dtype) over a Storage.
//
// A Tensor is a handle: copies share the same TensorImpl (so identity, requires-grad and .grad are shared,
// as users of other frameworks expect); `detach()` makes a new impl over the same storage. The math lives
// elsewhere: raw, non-differentiable kernels in tensor/cpu/ (namespace distgrad::tensor::kernels) and the
// differentiable user-facing ops in autograd/ops.h (namespace distgrad). tensor/ knows nothing of autograd
// beyond the opaque AutogradMeta slot defined here, which autograd/ fills.
// Thread-safety: a Tensor may be read from several threads; mutating metadata (requires-grad, grad) or
// bytes concurrently needs external synchronisation.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/storage.h"

namespace distgrad::autograd {
class Node;
}

namespace distgrad::tensor {

using Shape = std::vector<int64_t>;

class Tensor;
struct TensorImpl;

// Autograd state attached to a tensor. Defined here (plain data) so tensor/ can carry it; only autograd/
// gives it meaning.
struct AutogradMeta {
  // Guards grad and gradAccumulator: concurrent backward passes may share a leaf.
  std::mutex mutex;
  bool requiresGrad = false;
  bool retainsGrad = false;
  std::shared_ptr<TensorImpl> grad;            // accumulated gradient of a leaf (or retained non-leaf)
  std::shared_ptr<autograd::Node> gradFn;      // the node that produced this tensor (null for leaves)
  std::weak_ptr<autograd::Node> gradAccumulator;  // AccumulateGrad node of a leaf (owned by the graph)
  uint32_t outputNr = 0;                       // which output of gradFn this tensor is
  // Hooks on a LEAF's gradient (run by its AccumulateGrad). A non-leaf's hooks live on its gradFn node, so
  // they run even after every handle to the tensor is gone (autograd/node.h, Node::addTensorHook).
  std::vector<std::function<Tensor(const Tensor&)>> hooks;
};

struct TensorImpl {
  Storage storage;
  Shape shape;
  Shape strides;  // in elements
  int64_t offset = 0;  // in elements
  DType dtype = DType::kFloat32;
  std::unique_ptr<AutogradMeta> autograd;
};

int64_t numelOf(const Shape& shape);
Shape contiguousStrides(const Shape& shape);
std::string shapeStr(const Shape& shape);
// Wraps a possibly negative dimension index into [0, ndim); names `op` in the error.
int64_t wrapDim(int64_t dim, int64_t ndim, const char* op);

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- factories (not differentiable; set requires-grad afterwards for leaves) ----
  static Tensor empty(const Shape& shape, DType dtype = DType::kFloat32, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::kFloat32, Device device = Device::cpu());
  static Tensor ones(const Shape& shape, DType dtype = DType::kFloat32, Device device = Device::cpu());
  static Tensor full(const Shape& shape, double value, DType dtype = DType::kFloat32);
  static Tensor scalar(double value, DType dtype = DType::kFloat32);
  // 0, 1, ..., n-1
  static Tensor arange(int64_t n, DType dtype = DType::kFloat32);
  // Copies `values` (row-major) into a new tensor of the given shape; numel must match.
  template <typename T>
  static Tensor fromVector(const std::vector<T>& values, const Shape& shape);
  static Tensor fromVector(std::initializer_list<float> values, const Shape& shape) {
    return fromVector(std::vector<float>(values), shape);
  }
  // A view over existing storage; validates that the view stays inside the storage.
  static Tensor fromStorage(Storage storage, const Shape& shape, const Shape& strides, int64_t offset,
                            DType dtype);

  // ---- metadata ----
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t dim() const { return static_cast<int64_t>(impl().shape.size()); }
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t offset() const { return impl().offset; }
  int64_t numel() const { return numelOf(impl().shape); }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage.device(); }
  size_t itemSize() const { return tensor::itemSize(dtype()); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * itemSize(); }
  const Storage& storage() const { return impl().storage; }
  bool isContiguous() const;

  // ---- data access ----
  void* rawData() const;  // pointer to element 0 of this view
  template <typename T>
  T* data() const {
    DG_CHECK(dtype() == DTypeOf<T>::value, "Tensor::data<", dtypeName(DTypeOf<T>::value),
             ">() called on a ", dtypeName(dtype()), " tensor");
    return static_cast<T*>(rawData());
  }
  // The single value of a one-element tensor, as double.
  double item() const;
  // Element at a multi-index, as double (slow; for tests and printing).
  double at(std::initializer_list<int64_t> index) const;
  // All elements in row-major order, converted to T.
  template <typename T>
  std::vector<T> toVector() const;

  // ---- non-differentiable helpers (differentiable versions live in autograd/ops.h) ----
  Tensor detach() const;  // same storage and view, no autograd history
  // A contiguous copy of the bytes (always a new storage), detached.
  Tensor cloneData() const;
  // Copies `src` into this tensor's bytes (same shape; dtype converted); in place, not recorded.
  void copyFrom(const Tensor& src);
  // Fills every element; in place, not recorded.
  void fill(double value);
  // dtype conversion (a new tensor; same dtype returns a detached alias).
  Tensor toDType(DType dtype) const;
  Tensor to(Device device) const;

  // ---- autograd slot (meaning given by autograd/) ----
  bool requiresGrad() const;
  // Marks a leaf as requiring grad. Only floating-point leaves may require grad.
  Tensor& setRequiresGrad(bool enabled = true);
  bool isLeaf() const;
  Tensor grad() const;  // undefined when no gradient has been accumulated
  void setGrad(const Tensor& grad);
  const std::shared_ptr<autograd::Node>& gradFn() const;
  AutogradMeta* autogradMeta() const { return impl().autograd.get(); }
  AutogradMeta& ensureAutogradMeta() const;
  // Registers a hook run on this tensor's gradient during backward; it may return a replacement. A hook on
  // a non-leaf is kept by the node that produced the tensor, so it runs even if this handle is dropped
  // before backward (as in PyTorch). Defined in autograd/node.cpp: only autograd/ knows Node.
  void registerHook(std::function<Tensor(const Tensor&)> hook) const;
  void retainGrad() const;

  bool sameAs(const Tensor& other) const { return impl_ == other.impl_; }
  const std::shared_ptr<TensorImpl>& implPtr() const { return impl_; }
  std::string toString() const;

 private:
  TensorImpl& impl() const {
    DG_CHECK(impl_ != nullptr, "operation on an undefined Tensor");
    return *impl_;
  }
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& out, const Tensor& t);

// Calls f(T{}) with T the C++ type of a computational dtype (float32, float64, int64).
template <typename F>
decltype(auto) dispatchDType(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat64: return f(double{});
    case DType::kInt64: return f(int64_t{});
    default: break;
  }
  DG_CHECK(false, op, ": dtype ", dtypeName(dtype), " is a storage-only type; convert with toDType first");
  return f(float{});
}
// Same, restricted to floating-point dtypes.
template <typename F>
decltype(auto) dispatchFloat(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat64: return f(double{});
    default: break;
  }
  DG_CHECK(false, op, ": expected a float32 or float64 tensor, got ", dtypeName(dtype));
  return f(float{});
}

}  // namespace distgrad::tensor

namespace distgrad {
using tensor::DType;
using tensor::Device;
using tensor::Shape;
using tensor::Tensor;
}  // namespace distgrad
