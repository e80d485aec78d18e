// GEMM throughput on one GPU: distgrad's matmul (kernels::matmul on CUDA tensors: cuBLASLt via
// tensor/cuda/blas_linalg.cpp, output allocated per call) and its raw GEMM (cuda::dnn::gemm into a
// preallocated output) against cuBLAS called directly (cublasGemmEx on its own handle), same shapes,
// same stream, same inputs, in one run. Modes: fp32 (exact, CUBLAS_COMPUTE_32F) and tf32
// (CUBLAS_COMPUTE_32F_FAST_TF32; distgrad via setMatmulMathMode). Each sample is one call timed with CUDA
// events on the current stream (device time, so host load does not enter). Lines:
//   {"bench":"cuda_gemm","metric":"tflops","unit":"TFLOP/s",...,"impl":"cublas"|"distgrad_matmul"|
//    "distgrad_gemm","mode":"fp32"|"tf32","m":..,"n":..,"k":..,"ratio_vs_cublas":..}
// Usage: bench_cuda_gemm [reps=20] [sizes=4096,8192]. Without CUDA or a GPU: one "skipped" line, exit 0.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "tensor/cuda/runtime.h"

#ifdef DG_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "tensor/cpu/linalg.h"
#include "tensor/cuda/dnn_ops.h"
#include "tensor/cuda/math_mode.h"
#include "tensor/tensor.h"
#endif

namespace {

constexpr const char* kBench = "cuda_gemm";

void skip(const std::string& reason) {
  std::printf("{\"bench\":\"%s\",\"impl\":\"distgrad\",\"skipped\":\"%s\"}\n", kBench, reason.c_str());
}

}  // namespace

#ifdef DG_WITH_CUDA
namespace {

using distgrad::Device;
using distgrad::DType;
using distgrad::Tensor;
namespace bench = distgrad::bench;
namespace cuda = distgrad::tensor::cuda;

#define BENCH_CHECK(expr)                                                               \
  do {                                                                                  \
    if (!(expr)) {                                                                      \
      std::fprintf(stderr, "bench_cuda_gemm: %s failed at line %d\n", #expr, __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// A device matrix of pseudo-random values in [-1, 1) (an LCG on the host: fast, and no denormals or zeros
// that would change the GPU's power draw and clocks).
Tensor deviceMatrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> host(static_cast<size_t>(rows * cols));
  uint32_t s = seed;
  for (float& v : host) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(s >> 8) * (2.0f / 16777216.0f) - 1.0f;
  }
  return Tensor::fromVector(host, {rows, cols}).to(Device::cuda(0));
}

// Device seconds of each of `reps` calls, after `warmup` untimed ones.
std::vector<double> deviceSeconds(const std::function<void()>& fn, int reps, int warmup) {
  const cuda::Stream stream = cuda::Stream::current(0);
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> out;
  for (int i = 0; i < reps; ++i) {
    cuda::Event start(true), end(true);
    start.record(stream);
    fn();
    end.record(stream);
    end.synchronize();
    out.push_back(static_cast<double>(start.elapsedMs(end)) * 1e-3);
  }
  return out;
}

void run(int reps, const std::vector<int64_t>& sizes) {
  cublasHandle_t handle = nullptr;
  BENCH_CHECK(cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS);
  BENCH_CHECK(cublasSetStream(handle, static_cast<cudaStream_t>(cuda::Stream::current(0).handle())) ==
              CUBLAS_STATUS_SUCCESS);
  for (int64_t n : sizes) {
    Tensor a = deviceMatrix(n, n, 1), b = deviceMatrix(n, n, 2), c = deviceMatrix(n, n, 3);
    const double tflop = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) * 1e-12;
    for (cuda::MathMode mode : {cuda::MathMode::kFp32, cuda::MathMode::kTf32}) {
      cuda::MatmulMathModeGuard guard(mode);
      const cublasComputeType_t compute =
          mode == cuda::MathMode::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
      const float alpha = 1.f, beta = 0.f;
      const int ni = static_cast<int>(n);
      // Row-major C = A B is column-major C^T = B^T A^T: the same call distgrad makes.
      auto cublas = [&] {
        BENCH_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, ni, ni, ni, &alpha, b.rawData(), CUDA_R_32F, ni,
                                 a.rawData(), CUDA_R_32F, ni, &beta, c.rawData(), CUDA_R_32F, ni, compute,
                                 CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
      };
      auto ourGemm = [&] {
        cuda::dnn::gemm(0, false, false, n, n, n, 1.f, a.data<float>(), n, b.data<float>(), n, 0.f, c.data<float>(), n);
      };
      auto ourMatmul = [&] { Tensor out = distgrad::tensor::kernels::matmul(a, b); };
      const bench::Stats ref = bench::statsOf(bench::ratesOf(deviceSeconds(cublas, reps, 3), tflop));
      const bench::Stats gemm = bench::statsOf(bench::ratesOf(deviceSeconds(ourGemm, reps, 3), tflop));
      const bench::Stats mm = bench::statsOf(bench::ratesOf(deviceSeconds(ourMatmul, reps, 3), tflop));
      const std::string modeName = cuda::mathModeName(mode);
      auto extra = [&](const char* impl, const bench::Stats& s) {
        return std::map<std::string, std::string>{
            {"impl", bench::quoted(impl)}, {"mode", bench::quoted(modeName)},
            {"m", std::to_string(n)},      {"n", std::to_string(n)},
            {"k", std::to_string(n)},      {"ratio_vs_cublas", bench::number(s.median / ref.median)}};
      };
      bench::emit(kBench, "tflops", "TFLOP/s", ref, extra("cublas", ref));
      bench::emit(kBench, "tflops", "TFLOP/s", gemm, extra("distgrad_gemm", gemm));
      bench::emit(kBench, "tflops", "TFLOP/s", mm, extra("distgrad_matmul", mm));
    }
  }
  cublasDestroy(handle);
}

}  // namespace
#endif

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  std::vector<int64_t> sizes{4096, 8192};
  if (argc > 2) {
    sizes.clear();
    std::stringstream list(argv[2]);
    for (std::string item; std::getline(list, item, ',');) sizes.push_back(std::atoll(item.c_str()));
  }
  if (reps < 1 || sizes.empty()) {
    std::fprintf(stderr, "usage: bench_cuda_gemm [reps>=1] [sizes=4096,8192]\n");
    return 2;
  }
#ifdef DG_WITH_CUDA
  if (!distgrad::tensor::cuda::isAvailable()) {
    skip("no CUDA device");
    return 0;
  }
  run(reps, sizes);
#else
  (void)reps;
  skip("built without CUDA (DG_WITH_CUDA=OFF)");
#endif
  return 0;
}
