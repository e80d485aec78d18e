// CUDA reductions: the device side of tensor/cpu/reduce.h.
//
// Note [CUDA reductions]: a reduction maps each output element o (row-major over the kept dims) to a run
// of nRed input elements (row-major over the reduced dims); both index spaces go through OffsetCalc, so
// any strides work without a copy. Two shapes of work:
//  - many outputs, short runs (a bias gradient over N of [N, C], a row sum of a tall matrix): one thread
//    per output walks its run (reduceThreadPerOutput); neighbouring threads read neighbouring outputs, so
//    reading reduced leading dims is coalesced;
//  - long runs: a block per output (reduceBlockPerOutput) with a shared-memory tree; when there are too few
//    outputs to fill the GPU (sumAll, maxAll), each run is split over gridDim.y blocks that write partial
//    results, and reducePartials combines them.
// Sums accumulate float32 in float64 like the CPU kernel (and int64 in int64); the order of additions
// differs from the CPU's, so float32 results agree to rounding, not bit for bit. max/argmax propagate NaN
// and report the first occurrence of the maximum, as on the CPU; the combine step is commutative with an
// index tie-break, so the result does not depend on the split.
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "tensor/cpu/reduce.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor::cuda {
namespace {

template <typename T>
struct SumReducer {
  using Acc = std::conditional_t<std::is_same_v<T, float>, double, T>;
  __device__ static Acc identity() { return Acc(0); }
  __device__ static Acc lift(T v, int64_t) { return Acc(v); }
  __device__ static Acc combine(Acc a, Acc b) { return a + b; }
};

template <typename T>
struct ArgMaxAcc {
  T value;
  int64_t index;
};

template <typename T>
struct ArgMaxReducer {
  using Acc = ArgMaxAcc<T>;
  __device__ static Acc identity() {
    if constexpr (std::is_floating_point_v<T>) return Acc{-std::numeric_limits<T>::infinity(), INT64_MAX};
    else return Acc{std::numeric_limits<T>::lowest(), INT64_MAX};
  }
  __device__ static Acc lift(T v, int64_t r) { return Acc{v, r}; }
  // NaN beats everything (the first NaN wins); otherwise the larger value, and the smaller index on ties.
  __device__ static Acc combine(Acc a, Acc b) {
    const bool aNan = a.value != a.value;
    const bool bNan = b.value != b.value;
    if (aNan || bNan) {
      if (aNan && bNan) return a.index <= b.index ? a : b;
      return aNan ? a : b;
    }
    if (a.value > b.value) return a;
    if (b.value > a.value) return b;
    return a.index <= b.index ? a : b;
  }
};

template <typename T>
struct SumStore {
  T* out;
  template <typename Acc>
  __device__ void operator()(int64_t o, Acc acc) const { out[o] = static_cast<T>(acc); }
};

template <typename T>
struct ArgMaxStore {
  T* values;
  int64_t* indices;
  __device__ void operator()(int64_t o, ArgMaxAcc<T> acc) const {
    if (values != nullptr) values[o] = acc.value;
    if (indices != nullptr) indices[o] = acc.index;
  }
};

template <typename T, typename R, typename Store>
__global__ void reduceThreadPerOutput(const T* in, int64_t nOut, int64_t nRed, OffsetCalc<1> outCalc,
                                      OffsetCalc<1> redCalc, Store store) {
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < nOut;
       o += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    int64_t base[1];
    outCalc.get(o, base);
    typename R::Acc acc = R::identity();
    for (int64_t r = 0; r < nRed; ++r) {
      int64_t off[1];
      redCalc.get(r, off);
      acc = R::combine(acc, R::lift(in[base[0] + off[0]], r));
    }
    store(o, acc);
  }
}

// blockDim.x == kThreads. With gridDim.y > 1, block (x, y) covers elements y*kThreads + t + k*kThreads*gridDim.y
// of its run and writes partial[o * gridDim.y + y]; with gridDim.y == 1 it stores the result.
template <typename T, typename R, typename Store>
__global__ void reduceBlockPerOutput(const T* in, int64_t nOut, int64_t nRed, OffsetCalc<1> outCalc,
                                     OffsetCalc<1> redCalc, typename R::Acc* partial, Store store) {
  using Acc = typename R::Acc;
  __shared__ Acc shared[kThreads];
  const int64_t splits = gridDim.y;
  for (int64_t o = blockIdx.x; o < nOut; o += gridDim.x) {
    int64_t base[1];
    outCalc.get(o, base);
    Acc acc = R::identity();
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; r < nRed;
         r += static_cast<int64_t>(blockDim.x) * splits) {
      int64_t off[1];
      redCalc.get(r, off);
      acc = R::combine(acc, R::lift(in[base[0] + off[0]], r));
    }
    shared[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) shared[threadIdx.x] = R::combine(shared[threadIdx.x], shared[threadIdx.x + s]);
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      if (partial != nullptr) partial[o * splits + blockIdx.y] = shared[0];
      else store(o, shared[0]);
    }
    __syncthreads();  // shared[] is reused for the next output
  }
}

template <typename R, typename Store>
__global__ void reducePartials(const typename R::Acc* partial, int64_t nOut, int64_t splits, Store store) {
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < nOut;
       o += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    typename R::Acc acc = R::identity();
    for (int64_t s = 0; s < splits; ++s) acc = R::combine(acc, partial[o * splits + s]);
    store(o, acc);
  }
}

// Reduces `a` over the dims flagged in `mask`; store(o, acc) receives output o (row-major over kept dims).
template <typename T, typename R, typename Store>
void launchReduce(const char* op, const Tensor& a, const std::vector<bool>& mask, Store store) {
  using Acc = typename R::Acc;
  Shape outShape, outStrides, redShape, redStrides;
  for (int64_t d = 0; d < a.dim(); ++d) {
    (mask[d] ? redShape : outShape).push_back(a.shape()[d]);
    (mask[d] ? redStrides : outStrides).push_back(a.strides()[d]);
  }
  const int64_t nOut = numelOf(outShape);
  const int64_t nRed = numelOf(redShape);
  if (nOut == 0) return;
  const OffsetCalc<1> outCalc = makeOffsetCalc<1>(outShape, {outStrides}, op);
  const OffsetCalc<1> redCalc = makeOffsetCalc<1>(redShape, {redStrides}, op);
  DeviceGuard guard(a.device().index);
  cudaStream_t stream = currentStream(a.device());
  const T* in = typed<T>(a);
  if (nRed <= 32 || (nOut >= 16384 && nRed <= 1024)) {
    reduceThreadPerOutput<T, R, Store><<<blocksFor(nOut), kThreads, 0, stream>>>(in, nOut, nRed, outCalc, redCalc, store);
    checkLaunch(op);
    return;
  }
  // Enough blocks to fill the GPU; each thread still gets at least 8 elements of its run.
  constexpr int64_t kTargetBlocks = 2048;
  int64_t splits = 1;
  if (nOut < kTargetBlocks) {
    splits = std::min(kTargetBlocks / nOut, (nRed + kThreads * 8 - 1) / (kThreads * 8));
    splits = std::clamp<int64_t>(splits, 1, 1024);
  }
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(nOut, int64_t{1} << 20)), static_cast<unsigned>(splits));
  if (splits == 1) {
    reduceBlockPerOutput<T, R, Store><<<grid, kThreads, 0, stream>>>(in, nOut, nRed, outCalc, redCalc, nullptr, store);
    checkLaunch(op);
    return;
  }
  // Scratch on the same stream: freeing it right after queueing is safe (Note [Stream-ordered reuse]).
  Storage scratch = Storage::allocate(static_cast<size_t>(nOut * splits) * sizeof(Acc), a.device());
  Acc* partial = static_cast<Acc*>(scratch.data());
  reduceBlockPerOutput<T, R, Store><<<grid, kThreads, 0, stream>>>(in, nOut, nRed, outCalc, redCalc, partial, store);
  checkLaunch(op);
  reducePartials<R, Store><<<blocksFor(nOut), kThreads, 0, stream>>>(partial, nOut, splits, store);
  checkLaunch(op);
}

template <typename T>
struct GatherGradFn {
  T* out;
  const T* grad;
  const int64_t* indices;
  int64_t inner, size;
  __device__ void operator()(const int64_t (&o)[1]) const {
    const int64_t i = o[0];
    const int64_t outer = i / inner;
    const int64_t j = i - outer * inner;
    const int64_t k = indices[i];
    if (k >= 0 && k < size) out[(outer * size + k) * inner + j] = grad[i];  // argmax indices are in range
  }
};

}  // namespace

Tensor sumDims(const Tensor& a, const std::vector<bool>& mask, bool keepDim) {
  DG_ASSERT(static_cast<int64_t>(mask.size()) == a.dim(), "reduction mask rank mismatch");
  return dispatchDType(a.dtype(), "sum", [&](auto tag) {
    using T = decltype(tag);
    Tensor out = Tensor::empty(kernels::reducedShape(a.shape(), mask, keepDim), a.dtype(), a.device());
    launchReduce<T, SumReducer<T>>("sum", a, mask, SumStore<T>{typed<T>(out)});
    return out;
  });
}

Tensor maxAll(const Tensor& a) {
  DG_CHECK(a.numel() > 0, "max: cannot take the max of an empty tensor (shape ", shapeStr(a.shape()), ")");
  return dispatchDType(a.dtype(), "max", [&](auto tag) {
    using T = decltype(tag);
    Tensor out = Tensor::empty({}, a.dtype(), a.device());
    std::vector<bool> mask(static_cast<size_t>(a.dim()), true);
    launchReduce<T, ArgMaxReducer<T>>("max", a, mask, ArgMaxStore<T>{typed<T>(out), nullptr});
    return out;
  });
}

void maxDim(const Tensor& a, int64_t dim, bool keepDim, Tensor* values, Tensor* indices, const char* op) {
  // A 0-d tensor has one element; dim 0 / -1 reduce over it, as in PyTorch.
  const int64_t d = wrapDim(dim, a.dim(), op);
  Tensor src = a.dim() == 0 ? Tensor::fromStorage(a.storage(), {1}, {1}, a.offset(), a.dtype()) : a;
  DG_CHECK(src.shape()[d] > 0, op, ": cannot reduce over dim ", dim, " of size 0 (shape ", shapeStr(a.shape()), ")");
  std::vector<bool> mask(static_cast<size_t>(src.dim()), false);
  mask[d] = true;
  const Shape outShape = a.dim() == 0 ? Shape{} : kernels::reducedShape(src.shape(), mask, keepDim);
  Tensor idx = Tensor::empty(outShape, DType::kInt64, a.device());
  Tensor vals = dispatchDType(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    Tensor v = Tensor::empty(outShape, a.dtype(), a.device());
    launchReduce<T, ArgMaxReducer<T>>(op, src, mask, ArgMaxStore<T>{typed<T>(v), typed<int64_t>(idx)});
    return v;
  });
  if (values) *values = vals;
  if (indices) *indices = idx;
}

Tensor maxDimBackward(const Tensor& grad, const Tensor& indices, const Shape& inputShape, int64_t outer,
                      int64_t size, int64_t inner) {
  Tensor out = Tensor::zeros(inputShape, grad.dtype(), grad.device());
  Tensor g = kernels::contiguous(grad);
  Tensor idx = kernels::contiguous(indices);
  dispatchDType(grad.dtype(), "max backward", [&](auto tag) {
    using T = decltype(tag);
    const Shape flat{outer * inner};
    launchPointwise<1>("max backward", grad.device(), flat, {Shape{1}},
                       GatherGradFn<T>{typed<T>(out), typed<T>(g), typed<int64_t>(idx), inner, size});
  });
  return out;
}

}  // namespace distgrad::tensor::cuda
