#include "tensor/cuda/math_mode.h"

#include <atomic>

#include "tensor/error.h"

namespace distgrad::tensor::cuda {

namespace {
std::atomic<MathMode> gMatmulMode{MathMode::kFp32};
std::atomic<MathMode> gConvMode{MathMode::kFp32};
std::atomic<ConvAlgorithmSearch> gConvSearch{ConvAlgorithmSearch::kHeuristic};

void checkMode(MathMode mode, const char* what) {
  DG_CHECK(mode == MathMode::kFp32 || mode == MathMode::kTf32 || mode == MathMode::kBf16, what,
           ": unknown MathMode value ", static_cast<int>(mode));
}
}  // namespace

const char* mathModeName(MathMode mode) {
  switch (mode) {
    case MathMode::kFp32: return "fp32";
    case MathMode::kTf32: return "tf32";
    case MathMode::kBf16: return "bf16";
  }
  return "unknown";
}

MathMode parseMathMode(const std::string& name) {
  if (name == "fp32") return MathMode::kFp32;
  if (name == "tf32") return MathMode::kTf32;
  if (name == "bf16") return MathMode::kBf16;
  DG_CHECK(false, "parseMathMode: expected \"fp32\", \"tf32\" or \"bf16\", got \"", name, "\"");
  return MathMode::kFp32;
}

void setMatmulMathMode(MathMode mode) {
  checkMode(mode, "setMatmulMathMode");
  gMatmulMode.store(mode, std::memory_order_relaxed);
}

MathMode matmulMathMode() { return gMatmulMode.load(std::memory_order_relaxed); }

void setConvMathMode(MathMode mode) {
  checkMode(mode, "setConvMathMode");
  DG_CHECK(mode != MathMode::kBf16,
           "setConvMathMode: bf16 is not available for convolutions (cuDNN's convolutions take float32 "
           "inputs as fp32 or tf32 only); use fp32 or tf32");
  gConvMode.store(mode, std::memory_order_relaxed);
}

MathMode convMathMode() { return gConvMode.load(std::memory_order_relaxed); }

void setConvAlgorithmSearch(ConvAlgorithmSearch search) {
  DG_CHECK(search == ConvAlgorithmSearch::kHeuristic || search == ConvAlgorithmSearch::kBenchmark,
           "setConvAlgorithmSearch: unknown ConvAlgorithmSearch value ", static_cast<int>(search));
  gConvSearch.store(search, std::memory_order_relaxed);
}

ConvAlgorithmSearch convAlgorithmSearch() { return gConvSearch.load(std::memory_order_relaxed); }

}  // namespace distgrad::tensor::cuda
