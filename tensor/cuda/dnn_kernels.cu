// Hand-written CUDA kernels behind tensor/cuda/dnn_ops.cpp; see dnn_kernels.h for the contracts. Each
// kernel mirrors the CPU loop of the same name in tensor/cpu/ (pool.cpp, batch_norm.cpp, nn_kernels.cpp):
// same window rules, same NaN handling, double accumulation where the CPU accumulates in double.
// Compiled, untested on hardware in the session that wrote it (no GPU was available).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/dnn_kernels.h"

namespace distgrad::tensor::cuda::dnn_detail {

namespace {

constexpr int kThreads = 256;
// Grid-stride loops cover any element count; more blocks than this only add scheduling overhead.
constexpr int64_t kMaxBlocks = 65535;

int blocksFor(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks)));
}

void checkLaunch(const char* what) { checkCuda(cudaGetLastError(), what); }

__device__ inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ inline int64_t globalIndex() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline int64_t globalStride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

template <typename T>
__device__ inline bool isNan(T v) {
  return v != v;
}

// Block-wide sum of a double per thread; the result is valid in thread 0. blockDim.x == kThreads.
__device__ inline double blockSum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  double r = shared[0];
  __syncthreads();  // shared may be reused right after
  return r;
}

__device__ inline double blockMax(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) shared[threadIdx.x] = fmax(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  double r = shared[0];
  __syncthreads();
  return r;
}

// ------------------------------------------------------------------------------------------- pooling

template <typename T>
__global__ void maxPoolKernel(const T* x, T* y, int64_t* argmax, PoolGeometry g) {
  const int64_t total = g.planes * g.outH * g.outW;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t ow = i % g.outW;
    const int64_t oh = (i / g.outW) % g.outH;
    const int64_t plane = i / (g.outW * g.outH);
    const int64_t h0 = imax(oh * g.strideH - g.padH, int64_t{0});
    const int64_t h1 = imin(oh * g.strideH - g.padH + g.kernelH, g.inH);
    const int64_t w0 = imax(ow * g.strideW - g.padW, int64_t{0});
    const int64_t w1 = imin(ow * g.strideW - g.padW + g.kernelW, g.inW);
    const T* src = x + plane * g.inH * g.inW;
    T best = -std::numeric_limits<T>::infinity();
    int64_t bestAt = h0 * g.inW + w0;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t w = w0; w < w1; ++w) {
        const T v = src[h * g.inW + w];
        if (v > best || isNan(v)) {  // NaN wins and sticks, as on the CPU and in PyTorch
          best = v;
          bestAt = h * g.inW + w;
        }
      }
    }
    y[i] = best;
    if (argmax != nullptr) argmax[i] = bestAt;
  }
}

// The outputs whose windows can contain input row `in` (PyTorch's gather bounds): [first, last).
__device__ inline void coveringOutputs(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t outLen,
                                       int64_t* first, int64_t* last) {
  *first = (in + pad < kernel) ? 0 : (in + pad - kernel) / stride + 1;
  *last = imin((in + pad) / stride + 1, outLen);
}

// A gather (one thread per input cell) instead of a scatter with atomics: deterministic sums.
template <typename T>
__global__ void maxPoolBackwardKernel(const T* gradOut, const int64_t* argmax, T* gradIn, PoolGeometry g) {
  const int64_t total = g.planes * g.inH * g.inW;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t iw = i % g.inW;
    const int64_t ih = (i / g.inW) % g.inH;
    const int64_t plane = i / (g.inW * g.inH);
    int64_t ph0, ph1, pw0, pw1;
    coveringOutputs(ih, g.kernelH, g.strideH, g.padH, g.outH, &ph0, &ph1);
    coveringOutputs(iw, g.kernelW, g.strideW, g.padW, g.outW, &pw0, &pw1);
    const int64_t self = ih * g.inW + iw;
    const T* go = gradOut + plane * g.outH * g.outW;
    const int64_t* arg = argmax + plane * g.outH * g.outW;
    T sum = 0;
    for (int64_t ph = ph0; ph < ph1; ++ph) {
      for (int64_t pw = pw0; pw < pw1; ++pw) {
        if (arg[ph * g.outW + pw] == self) sum += go[ph * g.outW + pw];
      }
    }
    gradIn[i] = sum;
  }
}

struct AvgWindow {
  int64_t h0, h1, w0, w1, divisor;
};

__device__ inline AvgWindow avgWindow(const PoolGeometry& g, int64_t oh, int64_t ow) {
  const int64_t h0 = oh * g.strideH - g.padH;
  const int64_t w0 = ow * g.strideW - g.padW;
  const int64_t h1 = imin(h0 + g.kernelH, g.inH + g.padH);
  const int64_t w1 = imin(w0 + g.kernelW, g.inW + g.padW);
  return {imax(h0, int64_t{0}), imin(h1, g.inH), imax(w0, int64_t{0}), imin(w1, g.inW), (h1 - h0) * (w1 - w0)};
}

template <typename T>
__global__ void avgPoolKernel(const T* x, T* y, PoolGeometry g) {
  const int64_t total = g.planes * g.outH * g.outW;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t ow = i % g.outW;
    const int64_t oh = (i / g.outW) % g.outH;
    const int64_t plane = i / (g.outW * g.outH);
    const AvgWindow win = avgWindow(g, oh, ow);
    const T* src = x + plane * g.inH * g.inW;
    T sum = 0;
    for (int64_t h = win.h0; h < win.h1; ++h) {
      for (int64_t w = win.w0; w < win.w1; ++w) sum += src[h * g.inW + w];
    }
    y[i] = sum / static_cast<T>(win.divisor);
  }
}

template <typename T>
__global__ void avgPoolBackwardKernel(const T* gradOut, T* gradIn, PoolGeometry g) {
  const int64_t total = g.planes * g.inH * g.inW;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t iw = i % g.inW;
    const int64_t ih = (i / g.inW) % g.inH;
    const int64_t plane = i / (g.inW * g.inH);
    int64_t ph0, ph1, pw0, pw1;
    coveringOutputs(ih, g.kernelH, g.strideH, g.padH, g.outH, &ph0, &ph1);
    coveringOutputs(iw, g.kernelW, g.strideW, g.padW, g.outW, &pw0, &pw1);
    const T* go = gradOut + plane * g.outH * g.outW;
    T sum = 0;
    for (int64_t ph = ph0; ph < ph1; ++ph) {
      for (int64_t pw = pw0; pw < pw1; ++pw) {
        const AvgWindow win = avgWindow(g, ph, pw);
        // The clipped window must contain the cell (the covering bounds include padding-only overlaps).
        if (ih >= win.h0 && ih < win.h1 && iw >= win.w0 && iw < win.w1) {
          sum += go[ph * g.outW + pw] / static_cast<T>(win.divisor);
        }
      }
    }
    gradIn[i] = sum;
  }
}

// Adaptive window of output cell o over an input of length `in` split into `out` cells.
__device__ inline int64_t adaptiveStart(int64_t o, int64_t in, int64_t out) { return (o * in) / out; }
__device__ inline int64_t adaptiveEnd(int64_t o, int64_t in, int64_t out) { return ((o + 1) * in + out - 1) / out; }

template <typename T>
__global__ void adaptiveAvgPoolKernel(const T* x, T* y, PoolGeometry g) {
  const int64_t total = g.planes * g.outH * g.outW;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t ow = i % g.outW;
    const int64_t oh = (i / g.outW) % g.outH;
    const int64_t plane = i / (g.outW * g.outH);
    const int64_t h0 = adaptiveStart(oh, g.inH, g.outH), h1 = adaptiveEnd(oh, g.inH, g.outH);
    const int64_t w0 = adaptiveStart(ow, g.inW, g.outW), w1 = adaptiveEnd(ow, g.inW, g.outW);
    const T* src = x + plane * g.inH * g.inW;
    T sum = 0;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t w = w0; w < w1; ++w) sum += src[h * g.inW + w];
    }
    y[i] = sum / static_cast<T>((h1 - h0) * (w1 - w0));
  }
}

template <typename T>
__global__ void adaptiveAvgPoolBackwardKernel(const T* gradOut, T* gradIn, PoolGeometry g) {
  const int64_t total = g.planes * g.inH * g.inW;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t iw = i % g.inW;
    const int64_t ih = (i / g.inW) % g.inH;
    const int64_t plane = i / (g.inW * g.inH);
    // Output cells whose window [start, end) contains ih: start(o) <= ih  <=>  o <= (ih*out + out-1)/in ...
    // bounded loosely and checked exactly below.
    const int64_t oh0 = (ih * g.outH) / g.inH, oh1 = imin(((ih + 1) * g.outH + g.inH - 1) / g.inH, g.outH);
    const int64_t ow0 = (iw * g.outW) / g.inW, ow1 = imin(((iw + 1) * g.outW + g.inW - 1) / g.inW, g.outW);
    const T* go = gradOut + plane * g.outH * g.outW;
    T sum = 0;
    for (int64_t oh = oh0; oh < oh1; ++oh) {
      const int64_t h0 = adaptiveStart(oh, g.inH, g.outH), h1 = adaptiveEnd(oh, g.inH, g.outH);
      if (ih < h0 || ih >= h1) continue;
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const int64_t w0 = adaptiveStart(ow, g.inW, g.outW), w1 = adaptiveEnd(ow, g.inW, g.outW);
        if (iw < w0 || iw >= w1) continue;
        sum += go[oh * g.outW + ow] / static_cast<T>((h1 - h0) * (w1 - w0));
      }
    }
    gradIn[i] = sum;
  }
}

// ------------------------------------------------------------------------------------------- batch norm

// Element e of channel c (e in [0, outer*inner)) lives at (e / inner) * channels * inner + c * inner + e % inner.
__device__ inline int64_t channelElement(const ChannelGeometry& g, int64_t c, int64_t e) {
  return (e / g.inner) * g.channels * g.inner + c * g.inner + e % g.inner;
}

// One block per channel (grid-stride over channels): two passes, mean then the sum of squared deviations.
template <typename T>
__global__ void batchNormStatsKernel(const T* x, T* mean, T* var, ChannelGeometry g) {
  __shared__ double shared[kThreads];
  const int64_t count = g.outer * g.inner;
  for (int64_t c = blockIdx.x; c < g.channels; c += gridDim.x) {
    double s = 0;
    for (int64_t e = threadIdx.x; e < count; e += blockDim.x) s += static_cast<double>(x[channelElement(g, c, e)]);
    const double m = blockSum(s, shared) / static_cast<double>(count);
    double q = 0;
    for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
      const double d = static_cast<double>(x[channelElement(g, c, e)]) - m;
      q += d * d;
    }
    const double v = blockSum(q, shared) / static_cast<double>(count);
    if (threadIdx.x == 0) {
      mean[c] = static_cast<T>(m);
      var[c] = static_cast<T>(v);
    }
  }
}

template <typename T>
__global__ void batchNormApplyKernel(const T* x, const T* mean, const T* var, const T* weight, const T* bias,
                                     double eps, T* y, ChannelGeometry g) {
  const int64_t total = g.outer * g.channels * g.inner;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t c = (i / g.inner) % g.channels;
    const T invStd = static_cast<T>(1.0 / sqrt(static_cast<double>(var[c]) + eps));
    T v = (x[i] - mean[c]) * invStd;
    if (weight != nullptr) v *= weight[c];
    if (bias != nullptr) v += bias[c];
    y[i] = v;
  }
}

template <typename T>
__global__ void batchNormGradSumsKernel(const T* gradOut, const T* x, const T* mean, const T* var, double eps,
                                        double* sumG, double* sumGXhat, ChannelGeometry g) {
  __shared__ double shared[kThreads];
  const int64_t count = g.outer * g.inner;
  for (int64_t c = blockIdx.x; c < g.channels; c += gridDim.x) {
    const double m = static_cast<double>(mean[c]);
    const double invStd = 1.0 / sqrt(static_cast<double>(var[c]) + eps);
    double sg = 0, sgx = 0;
    for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
      const int64_t at = channelElement(g, c, e);
      const double go = static_cast<double>(gradOut[at]);
      sg += go;
      sgx += go * (static_cast<double>(x[at]) - m) * invStd;
    }
    const double totalG = blockSum(sg, shared);
    const double totalGX = blockSum(sgx, shared);
    if (threadIdx.x == 0) {
      sumG[c] = totalG;
      sumGXhat[c] = totalGX;
    }
  }
}

template <typename T>
__global__ void batchNormInputGradKernel(const T* gradOut, const T* x, const T* mean, const T* var, const T* weight,
                                         double eps, const double* sumG, const double* sumGXhat, bool training,
                                         T* gradIn, ChannelGeometry g) {
  const int64_t total = g.outer * g.channels * g.inner;
  const double count = static_cast<double>(g.outer * g.inner);
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t c = (i / g.inner) % g.channels;
    const double invStd = 1.0 / sqrt(static_cast<double>(var[c]) + eps);
    const double scale = (weight != nullptr ? static_cast<double>(weight[c]) : 1.0) * invStd;
    double go = static_cast<double>(gradOut[i]);
    if (training) {
      const double xhat = (static_cast<double>(x[i]) - static_cast<double>(mean[c])) * invStd;
      go = go - sumG[c] / count - xhat * sumGXhat[c] / count;
    }
    gradIn[i] = static_cast<T>(scale * go);
  }
}

template <typename T>
__global__ void castFromDoubleKernel(const double* src, T* out, int64_t n) {
  for (int64_t i = globalIndex(); i < n; i += globalStride()) out[i] = static_cast<T>(src[i]);
}

template <typename T>
__global__ void blendRunningKernel(T* running, const T* batch, int64_t n, double momentum, double factor) {
  for (int64_t i = globalIndex(); i < n; i += globalStride()) {
    running[i] = static_cast<T>((1.0 - momentum) * static_cast<double>(running[i]) +
                                momentum * static_cast<double>(batch[i]) * factor);
  }
}

// ------------------------------------------------------------------------------------------- losses

__global__ void findOutOfRangeKernel(const int64_t* indices, int64_t n, int64_t limit, unsigned long long* firstBad) {
  for (int64_t i = globalIndex(); i < n; i += globalStride()) {
    const int64_t v = indices[i];
    if (v < 0 || v >= limit) atomicMin(firstBad, static_cast<unsigned long long>(i));
  }
}

// One block per row (grid-stride over rows).
template <typename T>
__global__ void crossEntropyKernel(const T* logits, const int64_t* targets, int64_t n, int64_t classes, T* loss,
                                   T* rowMax, T* logSum) {
  __shared__ double shared[kThreads];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* row = logits + r * classes;
    double m = -INFINITY;
    for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) m = fmax(m, static_cast<double>(row[c]));
    T mt = static_cast<T>(blockMax(m, shared));
    if (isinf(static_cast<double>(mt))) mt = mt > T(0) ? mt : T(0);  // as the CPU: an all -inf row uses 0
    // The CPU accumulates the exponentials in T; double here is at least as accurate.
    double s = 0;
    for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) s += static_cast<double>(exp(row[c] - mt));
    const double sum = blockSum(s, shared);
    if (threadIdx.x == 0) {
      const T ls = static_cast<T>(log(sum));
      rowMax[r] = mt;
      logSum[r] = ls;
      loss[r] = ls - (row[targets[r]] - mt);
    }
  }
}

template <typename T>
__device__ inline T lossCoef(const T* gradOut, bool perSample, T scale, int64_t r) {
  return perSample ? gradOut[r] : gradOut[0] * scale;
}

template <typename T>
__global__ void crossEntropyBackwardKernel(const T* gradOut, bool perSample, T scale, const T* logits,
                                           const int64_t* targets, const T* rowMax, const T* logSum, int64_t n,
                                           int64_t classes, T* gradIn) {
  const int64_t total = n * classes;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    const int64_t r = i / classes, c = i % classes;
    const T k = lossCoef(gradOut, perSample, scale, r);
    T v = k * exp((logits[i] - rowMax[r]) - logSum[r]);
    if (c == targets[r]) v -= k;
    gradIn[i] = v;
  }
}

template <typename T>
__global__ void nllLossKernel(const T* logProbs, const int64_t* targets, int64_t n, int64_t classes, T* loss) {
  for (int64_t r = globalIndex(); r < n; r += globalStride()) loss[r] = -logProbs[r * classes + targets[r]];
}

template <typename T>
__global__ void nllLossBackwardKernel(const T* gradOut, bool perSample, T scale, const int64_t* targets, int64_t n,
                                      int64_t classes, T* gradIn) {
  for (int64_t r = globalIndex(); r < n; r += globalStride()) {
    gradIn[r * classes + targets[r]] = -lossCoef(gradOut, perSample, scale, r);
  }
}

// Deterministic two-stage sum: kReduceBlocks partial sums (fixed grid, fixed per-thread striding), then one
// block folds them in a fixed order.
constexpr int kReduceBlocks = 256;

struct Identity {
  template <typename T>
  __device__ double operator()(const T* a, const T*, int64_t i) const {
    return static_cast<double>(a[i]);
  }
};
struct SquaredDiff {
  template <typename T>
  __device__ double operator()(const T* a, const T* b, int64_t i) const {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    return d * d;
  }
};

template <typename T, typename F>
__global__ void partialSumKernel(const T* a, const T* b, int64_t n, double* partial, F f) {
  __shared__ double shared[kThreads];
  double s = 0;
  for (int64_t i = globalIndex(); i < n; i += globalStride()) s += f(a, b, i);
  const double total = blockSum(s, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

template <typename T>
__global__ void finishSumKernel(const double* partial, int blocks, double scale, T* out) {
  __shared__ double shared[kThreads];
  double s = 0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) s += partial[i];
  const double total = blockSum(s, shared);
  if (threadIdx.x == 0) out[0] = static_cast<T>(total * scale);
}

template <typename T>
__global__ void squaredDiffKernel(const T* a, const T* b, int64_t n, T* out) {
  for (int64_t i = globalIndex(); i < n; i += globalStride()) {
    const T d = a[i] - b[i];
    out[i] = d * d;
  }
}

template <typename T>
__global__ void mseBackwardKernel(const T* gradOut, bool perElement, T scale, const T* a, const T* b, int64_t n,
                                  T* gradA, T* gradB) {
  for (int64_t i = globalIndex(); i < n; i += globalStride()) {
    const T k = perElement ? T(2) * gradOut[i] : T(2) * gradOut[0] * scale;
    const T v = perElement ? T(2) * (a[i] - b[i]) * gradOut[i] : k * (a[i] - b[i]);
    if (gradA != nullptr) gradA[i] = v;
    if (gradB != nullptr) gradB[i] = -v;
  }
}

// ------------------------------------------------------------------------------------------- dropout

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), the generator
// cuRAND and PyTorch use on the GPU: counter = element group, key = the per-call seed.
__device__ inline uint4 philox4x32(uint4 counter, uint2 key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kMul0, counter.x), lo0 = kMul0 * counter.x;
    const uint32_t hi1 = __umulhi(kMul1, counter.z), lo1 = kMul1 * counter.z;
    counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
    key.x += kWeyl0;
    key.y += kWeyl1;
  }
  return counter;
}

template <typename T>
__global__ void dropoutKernel(const T* x, int64_t n, double p, uint64_t seed, T* out, T* mask) {
  const T scale = static_cast<T>(1.0 / (1.0 - p));
  const uint2 key = make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const int64_t groups = (n + 3) / 4;
  for (int64_t gi = globalIndex(); gi < groups; gi += globalStride()) {
    const auto g = static_cast<uint64_t>(gi);
    const uint4 r = philox4x32(make_uint4(static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32), 0u, 0u), key);
    const uint32_t draws[4] = {r.x, r.y, r.z, r.w};
    for (int j = 0; j < 4; ++j) {
      const int64_t i = gi * 4 + j;
      if (i >= n) break;
      const double u = static_cast<double>(draws[j]) * 2.3283064365386963e-10;  // [0, 1) in steps of 2^-32
      const T m = u < p ? T(0) : scale;
      mask[i] = m;
      out[i] = x[i] * m;
    }
  }
}

// ------------------------------------------------------------------------------------------- embedding

template <typename T>
__global__ void embeddingKernel(const T* weight, const int64_t* indices, int64_t count, int64_t dim, T* out) {
  const int64_t total = count * dim;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    out[i] = weight[indices[i / dim] * dim + i % dim];
  }
}

template <typename T>
__global__ void embeddingBackwardKernel(const T* gradOut, const int64_t* indices, int64_t count, int64_t dim,
                                        T* gradWeight) {
  const int64_t total = count * dim;
  for (int64_t i = globalIndex(); i < total; i += globalStride()) {
    atomicAdd(gradWeight + indices[i / dim] * dim + i % dim, gradOut[i]);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------- launchers

template <typename T>
void launchMaxPool2d(const T* x, T* y, int64_t* argmax, const PoolGeometry& g, cudaStream_t stream) {
  const int64_t total = g.planes * g.outH * g.outW;
  if (total == 0) return;
  maxPoolKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(x, y, argmax, g);
  checkLaunch("maxPool2d kernel launch");
}

template <typename T>
void launchMaxPool2dBackward(const T* gradOut, const int64_t* argmax, T* gradIn, const PoolGeometry& g,
                             cudaStream_t stream) {
  const int64_t total = g.planes * g.inH * g.inW;
  if (total == 0) return;
  maxPoolBackwardKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(gradOut, argmax, gradIn, g);
  checkLaunch("maxPool2d backward kernel launch");
}

template <typename T>
void launchAvgPool2d(const T* x, T* y, const PoolGeometry& g, cudaStream_t stream) {
  const int64_t total = g.planes * g.outH * g.outW;
  if (total == 0) return;
  avgPoolKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(x, y, g);
  checkLaunch("avgPool2d kernel launch");
}

template <typename T>
void launchAvgPool2dBackward(const T* gradOut, T* gradIn, const PoolGeometry& g, cudaStream_t stream) {
  const int64_t total = g.planes * g.inH * g.inW;
  if (total == 0) return;
  avgPoolBackwardKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(gradOut, gradIn, g);
  checkLaunch("avgPool2d backward kernel launch");
}

template <typename T>
void launchAdaptiveAvgPool2d(const T* x, T* y, const PoolGeometry& g, cudaStream_t stream) {
  const int64_t total = g.planes * g.outH * g.outW;
  if (total == 0) return;
  adaptiveAvgPoolKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(x, y, g);
  checkLaunch("adaptiveAvgPool2d kernel launch");
}

template <typename T>
void launchAdaptiveAvgPool2dBackward(const T* gradOut, T* gradIn, const PoolGeometry& g, cudaStream_t stream) {
  const int64_t total = g.planes * g.inH * g.inW;
  if (total == 0) return;
  adaptiveAvgPoolBackwardKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(gradOut, gradIn, g);
  checkLaunch("adaptiveAvgPool2d backward kernel launch");
}

namespace {
int channelBlocks(int64_t channels) { return static_cast<int>(std::max<int64_t>(1, std::min(channels, kMaxBlocks))); }
}  // namespace

template <typename T>
void launchBatchNormStats(const T* x, T* mean, T* var, const ChannelGeometry& g, cudaStream_t stream) {
  if (g.channels == 0) return;
  batchNormStatsKernel<T><<<channelBlocks(g.channels), kThreads, 0, stream>>>(x, mean, var, g);
  checkLaunch("batchNorm statistics kernel launch");
}

template <typename T>
void launchBatchNormApply(const T* x, const T* mean, const T* var, const T* weight, const T* bias, double eps, T* y,
                          const ChannelGeometry& g, cudaStream_t stream) {
  const int64_t total = g.outer * g.channels * g.inner;
  if (total == 0) return;
  batchNormApplyKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(x, mean, var, weight, bias, eps, y, g);
  checkLaunch("batchNorm kernel launch");
}

template <typename T>
void launchBatchNormGradSums(const T* gradOut, const T* x, const T* mean, const T* var, double eps, double* sumG,
                             double* sumGXhat, const ChannelGeometry& g, cudaStream_t stream) {
  if (g.channels == 0) return;
  batchNormGradSumsKernel<T>
      <<<channelBlocks(g.channels), kThreads, 0, stream>>>(gradOut, x, mean, var, eps, sumG, sumGXhat, g);
  checkLaunch("batchNorm backward reduction kernel launch");
}

template <typename T>
void launchBatchNormInputGrad(const T* gradOut, const T* x, const T* mean, const T* var, const T* weight, double eps,
                              const double* sumG, const double* sumGXhat, bool training, T* gradIn,
                              const ChannelGeometry& g, cudaStream_t stream) {
  const int64_t total = g.outer * g.channels * g.inner;
  if (total == 0) return;
  batchNormInputGradKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(gradOut, x, mean, var, weight, eps, sumG,
                                                                         sumGXhat, training, gradIn, g);
  checkLaunch("batchNorm backward kernel launch");
}

template <typename T>
void launchCastFromDouble(const double* src, T* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  castFromDoubleKernel<T><<<blocksFor(n), kThreads, 0, stream>>>(src, out, n);
  checkLaunch("cast kernel launch");
}

template <typename T>
void launchBlendRunning(T* running, const T* batch, int64_t n, double momentum, double factor, cudaStream_t stream) {
  if (n == 0) return;
  blendRunningKernel<T><<<blocksFor(n), kThreads, 0, stream>>>(running, batch, n, momentum, factor);
  checkLaunch("running statistics kernel launch");
}

void launchFindOutOfRange(const int64_t* indices, int64_t n, int64_t limit, unsigned long long* firstBad,
                          cudaStream_t stream) {
  checkCuda(cudaMemsetAsync(firstBad, 0xFF, sizeof(unsigned long long), stream), "cudaMemsetAsync(index check)");
  if (n == 0) return;
  findOutOfRangeKernel<<<blocksFor(n), kThreads, 0, stream>>>(indices, n, limit, firstBad);
  checkLaunch("index check kernel launch");
}

template <typename T>
void launchCrossEntropy(const T* logits, const int64_t* targets, int64_t n, int64_t classes, T* loss, T* rowMax,
                        T* logSum, cudaStream_t stream) {
  if (n == 0) return;
  crossEntropyKernel<T><<<static_cast<int>(std::min(n, kMaxBlocks)), kThreads, 0, stream>>>(logits, targets, n, classes,
                                                                                            loss, rowMax, logSum);
  checkLaunch("crossEntropy kernel launch");
}

template <typename T>
void launchCrossEntropyBackward(const T* gradOut, bool perSample, T scale, const T* logits, const int64_t* targets,
                                const T* rowMax, const T* logSum, int64_t n, int64_t classes, T* gradIn,
                                cudaStream_t stream) {
  const int64_t total = n * classes;
  if (total == 0) return;
  crossEntropyBackwardKernel<T><<<blocksFor(total), kThreads, 0, stream>>>(gradOut, perSample, scale, logits, targets,
                                                                           rowMax, logSum, n, classes, gradIn);
  checkLaunch("crossEntropy backward kernel launch");
}

template <typename T>
void launchNllLoss(const T* logProbs, const int64_t* targets, int64_t n, int64_t classes, T* loss,
                   cudaStream_t stream) {
  if (n == 0) return;
  nllLossKernel<T><<<blocksFor(n), kThreads, 0, stream>>>(logProbs, targets, n, classes, loss);
  checkLaunch("nllLoss kernel launch");
}

template <typename T>
void launchNllLossBackward(const T* gradOut, bool perSample, T scale, const int64_t* targets, int64_t n,
                           int64_t classes, T* gradIn, cudaStream_t stream) {
  if (n == 0) return;
  nllLossBackwardKernel<T>
      <<<blocksFor(n), kThreads, 0, stream>>>(gradOut, perSample, scale, targets, n, classes, gradIn);
  checkLaunch("nllLoss backward kernel launch");
}

int64_t reduceWorkspaceDoubles() { return kReduceBlocks; }

template <typename T>
void launchSumScaled(const T* values, int64_t n, double scale, T* out, double* workspace, cudaStream_t stream) {
  // n == 0 still runs: the sum of nothing is 0 (and 0 * NaN-scale gives the CPU's 0/0 for a mean).
  partialSumKernel<T, Identity><<<kReduceBlocks, kThreads, 0, stream>>>(values, values, n, workspace, Identity{});
  checkLaunch("sum kernel launch");
  finishSumKernel<T><<<1, kThreads, 0, stream>>>(workspace, kReduceBlocks, scale, out);
  checkLaunch("sum kernel launch");
}

template <typename T>
void launchSumSquaredDiffScaled(const T* a, const T* b, int64_t n, double scale, T* out, double* workspace,
                                cudaStream_t stream) {
  partialSumKernel<T, SquaredDiff><<<kReduceBlocks, kThreads, 0, stream>>>(a, b, n, workspace, SquaredDiff{});
  checkLaunch("mseLoss sum kernel launch");
  finishSumKernel<T><<<1, kThreads, 0, stream>>>(workspace, kReduceBlocks, scale, out);
  checkLaunch("mseLoss sum kernel launch");
}

template <typename T>
void launchSquaredDiff(const T* a, const T* b, int64_t n, T* out, cudaStream_t stream) {
  if (n == 0) return;
  squaredDiffKernel<T><<<blocksFor(n), kThreads, 0, stream>>>(a, b, n, out);
  checkLaunch("mseLoss kernel launch");
}

template <typename T>
void launchMseBackward(const T* gradOut, bool perElement, T scale, const T* a, const T* b, int64_t n, T* gradA,
                       T* gradB, cudaStream_t stream) {
  if (n == 0) return;
  mseBackwardKernel<T><<<blocksFor(n), kThreads, 0, stream>>>(gradOut, perElement, scale, a, b, n, gradA, gradB);
  checkLaunch("mseLoss backward kernel launch");
}

template <typename T>
void launchDropout(const T* x, int64_t n, double p, uint64_t seed, T* out, T* mask, cudaStream_t stream) {
  if (n == 0) return;
  dropoutKernel<T><<<blocksFor((n + 3) / 4), kThreads, 0, stream>>>(x, n, p, seed, out, mask);
  checkLaunch("dropout kernel launch");
}

template <typename T>
void launchEmbedding(const T* weight, const int64_t* indices, int64_t count, int64_t dim, T* out, cudaStream_t stream) {
  if (count * dim == 0) return;
  embeddingKernel<T><<<blocksFor(count * dim), kThreads, 0, stream>>>(weight, indices, count, dim, out);
  checkLaunch("embedding kernel launch");
}

template <typename T>
void launchEmbeddingBackward(const T* gradOut, const int64_t* indices, int64_t count, int64_t dim, T* gradWeight,
                             cudaStream_t stream) {
  if (count * dim == 0) return;
  embeddingBackwardKernel<T><<<blocksFor(count * dim), kThreads, 0, stream>>>(gradOut, indices, count, dim, gradWeight);
  checkLaunch("embedding backward kernel launch");
}

#define DG_INSTANTIATE_DNN_KERNELS(T)                                                                                \
  template void launchMaxPool2d<T>(const T*, T*, int64_t*, const PoolGeometry&, cudaStream_t);                       \
  template void launchMaxPool2dBackward<T>(const T*, const int64_t*, T*, const PoolGeometry&, cudaStream_t);         \
  template void launchAvgPool2d<T>(const T*, T*, const PoolGeometry&, cudaStream_t);                                 \
  template void launchAvgPool2dBackward<T>(const T*, T*, const PoolGeometry&, cudaStream_t);                         \
  template void launchAdaptiveAvgPool2d<T>(const T*, T*, const PoolGeometry&, cudaStream_t);                         \
  template void launchAdaptiveAvgPool2dBackward<T>(const T*, T*, const PoolGeometry&, cudaStream_t);                 \
  template void launchBatchNormStats<T>(const T*, T*, T*, const ChannelGeometry&, cudaStream_t);                     \
  template void launchBatchNormApply<T>(const T*, const T*, const T*, const T*, const T*, double, T*,                \
                                        const ChannelGeometry&, cudaStream_t);                                       \
  template void launchBatchNormGradSums<T>(const T*, const T*, const T*, const T*, double, double*, double*,         \
                                           const ChannelGeometry&, cudaStream_t);                                    \
  template void launchBatchNormInputGrad<T>(const T*, const T*, const T*, const T*, const T*, double, const double*, \
                                            const double*, bool, T*, const ChannelGeometry&, cudaStream_t);          \
  template void launchCastFromDouble<T>(const double*, T*, int64_t, cudaStream_t);                                   \
  template void launchBlendRunning<T>(T*, const T*, int64_t, double, double, cudaStream_t);                          \
  template void launchCrossEntropy<T>(const T*, const int64_t*, int64_t, int64_t, T*, T*, T*, cudaStream_t);         \
  template void launchCrossEntropyBackward<T>(const T*, bool, T, const T*, const int64_t*, const T*, const T*,       \
                                              int64_t, int64_t, T*, cudaStream_t);                                   \
  template void launchNllLoss<T>(const T*, const int64_t*, int64_t, int64_t, T*, cudaStream_t);                      \
  template void launchNllLossBackward<T>(const T*, bool, T, const int64_t*, int64_t, int64_t, T*, cudaStream_t);     \
  template void launchSumScaled<T>(const T*, int64_t, double, T*, double*, cudaStream_t);                            \
  template void launchSumSquaredDiffScaled<T>(const T*, const T*, int64_t, double, T*, double*, cudaStream_t);       \
  template void launchSquaredDiff<T>(const T*, const T*, int64_t, T*, cudaStream_t);                                 \
  template void launchMseBackward<T>(const T*, bool, T, const T*, const T*, int64_t, T*, T*, cudaStream_t);          \
  template void launchDropout<T>(const T*, int64_t, double, uint64_t, T*, T*, cudaStream_t);                         \
  template void launchEmbedding<T>(const T*, const int64_t*, int64_t, int64_t, T*, cudaStream_t);                    \
  template void launchEmbeddingBackward<T>(const T*, const int64_t*, int64_t, int64_t, T*, cudaStream_t);

DG_INSTANTIATE_DNN_KERNELS(float)
DG_INSTANTIATE_DNN_KERNELS(double)
#undef DG_INSTANTIATE_DNN_KERNELS

}  // namespace distgrad::tensor::cuda::dnn_detail
