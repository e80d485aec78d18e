// models/cuda_kernels.h in a build without CUDA: every entry point is a clear error, so the library links
// and a caller that somehow reaches one learns why. (With DG_WITH_CUDA the definitions come from
// models/cuda_kernels.cu and this file is empty.)
#include "models/cuda_kernels.h"

#ifndef DG_WITH_CUDA

#include "tensor/error.h"

namespace distgrad::models::detail {
namespace {
[[noreturn]] void noCuda(const char* what) {
  throw ValueError(
      ::distgrad::detail::concatMessage(what, " on a CUDA device: distgrad was built without CUDA (DG_WITH_CUDA=OFF)"));
}
}  // namespace

template <typename T>
void sgdStepCuda(int, T*, const T*, T*, int64_t, const SgdStepArgs&) {
  noCuda("SGD step");
}
template <typename T>
void adamStepCuda(int, T*, const T*, T*, T*, T*, int64_t, const AdamStepArgs&) {
  noCuda("Adam step");
}
template <typename T>
void addSumOfSquaresCuda(int, const T*, int64_t, double*) {
  noCuda("gradient norm");
}
double readDeviceDouble(int, const double*) { noCuda("reading a device value"); }
template <typename T>
void scaleCuda(int, T*, int64_t, double) {
  noCuda("gradient scaling");
}
template <typename T>
void axpyCuda(int, T*, const T*, int64_t, double) {
  noCuda("weighted average");
}
void maxInt64Cuda(int, int64_t*, const int64_t*, int64_t) { noCuda("buffer maximum"); }
void incrementInt64Cuda(int, int64_t*) { noCuda("counter increment"); }
void zeroBytesCuda(int, void*, size_t) { noCuda("zero fill"); }

#define DG_INSTANTIATE_MODEL_KERNELS(T)                                                       \
  template void sgdStepCuda<T>(int, T*, const T*, T*, int64_t, const SgdStepArgs&);           \
  template void adamStepCuda<T>(int, T*, const T*, T*, T*, T*, int64_t, const AdamStepArgs&); \
  template void addSumOfSquaresCuda<T>(int, const T*, int64_t, double*);                      \
  template void scaleCuda<T>(int, T*, int64_t, double);                                       \
  template void axpyCuda<T>(int, T*, const T*, int64_t, double);
DG_INSTANTIATE_MODEL_KERNELS(float)
DG_INSTANTIATE_MODEL_KERNELS(double)
#undef DG_INSTANTIATE_MODEL_KERNELS

}  // namespace distgrad::models::detail

#endif  // DG_WITH_CUDA
