// Process-wide math modes of the CUDA GEMM and convolution kernels: whether float32 products may run on
// tensor cores with reduced-precision inputs. Like torch.backends.cuda.matmul.allow_tf32 /
// torch.set_float32_matmul_precision and torch.backends.cudnn.allow_tf32, but both default to exact
// float32 (distgrad's CUDA results must match its CPU results to float32 rounding unless a user opts in).
//   kFp32: float32 FMA only (cuBLAS CUBLAS_COMPUTE_32F, cuDNN CUDNN_FMA_MATH).
//   kTf32: inputs rounded to TF32 (10-bit mantissa), float32 accumulation (CUBLAS_COMPUTE_32F_FAST_TF32,
//          cuDNN CUDNN_TENSOR_OP_MATH); ~1e-3 relative error, several times faster on A100/H100.
//   kBf16: inputs rounded to bfloat16 (7-bit mantissa), float32 accumulation (CUBLAS_COMPUTE_32F_FAST_16BF);
//          GEMM only: cuDNN's legacy convolutions cannot down-convert float32 to bf16, so setConvMathMode
//          rejects it.
// float64 always runs exact double arithmetic. The header needs no CUDA and works in builds without it (the
// setting is then simply unused).
// Thread-safety: the settings are atomics; a change applies to calls that start after it.
#pragma once

#include <string>

namespace distgrad::tensor::cuda {

enum class MathMode { kFp32, kTf32, kBf16 };

const char* mathModeName(MathMode mode);
// Parses "fp32", "tf32" or "bf16" (ValueError otherwise).
MathMode parseMathMode(const std::string& name);

void setMatmulMathMode(MathMode mode);
MathMode matmulMathMode();
// Throws ValueError for kBf16 (see above).
void setConvMathMode(MathMode mode);
MathMode convMathMode();

// How cuDNN convolution algorithms are chosen for a new shape (the choice is cached per shape either way):
//   kHeuristic: cudnnGet*Algorithm_v7, cuDNN's heuristics; microseconds per new shape (default).
//   kBenchmark: cudnnFind*AlgorithmEx, timing every algorithm on the first call of each shape (like
//               torch.backends.cudnn.benchmark = True); slower first step, possibly faster steady state.
enum class ConvAlgorithmSearch { kHeuristic, kBenchmark };
void setConvAlgorithmSearch(ConvAlgorithmSearch search);
ConvAlgorithmSearch convAlgorithmSearch();

// Sets a mode for the guard's lifetime and restores the previous one (tests and benchmarks). Not a
// per-thread setting: other threads see the change too.
class MatmulMathModeGuard {
 public:
  explicit MatmulMathModeGuard(MathMode mode) : previous_(matmulMathMode()) { setMatmulMathMode(mode); }
  ~MatmulMathModeGuard() { setMatmulMathMode(previous_); }
  MatmulMathModeGuard(const MatmulMathModeGuard&) = delete;
  MatmulMathModeGuard& operator=(const MatmulMathModeGuard&) = delete;

 private:
  MathMode previous_;
};

}  // namespace distgrad::tensor::cuda
