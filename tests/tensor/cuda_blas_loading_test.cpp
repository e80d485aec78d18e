// cuBLAS is loaded on first use, not linked (Note [Lazy cuBLAS] in tensor/cuda/cublas_api.cpp). These run
// without a GPU: loading needs only the libraries, which every CUDA-enabled build has.
#ifdef DG_WITH_CUDA

#include <gtest/gtest.h>

#include "tensor/cpu/conv.h"
#include "tensor/cpu/linalg.h"
#include "tensor/cuda/cublas_api.h"
#include "tensor/random.h"
#include "tensor/tensor.h"
#include "test_util.h"

namespace distgrad::tensor {
namespace {

TEST(CublasLoading, CpuWorkLeavesCublasUnloaded) {
  // ctest runs each case in its own process; run by hand with other cases, an earlier one may have loaded it.
  if (cuda::cublasLoaded()) GTEST_SKIP() << "an earlier test in this process loaded cuBLAS";
  Generator gen(7);
  Tensor a = normal({64, 32}, 0.0, 1.0, gen);
  Tensor b = normal({32, 16}, 0.0, 1.0, gen);
  Tensor c = kernels::matmul(a, b);
  Tensor image = normal({2, 3, 8, 8}, 0.0, 1.0, gen);
  Tensor weight = normal({4, 3, 3, 3}, 0.0, 1.0, gen);
  kernels::Conv2dParams params;
  params.padding = {1, 1};
  Tensor out = kernels::conv2d(image, weight, Tensor(), params);
  EXPECT_EQ(c.shape(), (Shape{64, 16}));
  EXPECT_EQ(out.shape(), (Shape{2, 4, 8, 8}));
  EXPECT_FALSE(cuda::cublasLoaded()) << "CPU kernels mapped cuBLAS into the process";
}

TEST(CublasLoading, FirstUseLoadsEveryEntryPoint) {
  const cuda::CublasApi& api = cuda::cublasApi();
  EXPECT_TRUE(cuda::cublasLoaded());
  EXPECT_NE(api.cublasCreate, nullptr);
  EXPECT_NE(api.cublasGemmStridedBatchedEx, nullptr);
  EXPECT_NE(api.cublasLtMatmul, nullptr);
  EXPECT_NE(api.cublasLtMatmulPreferenceSetAttribute, nullptr);
  // A status name needs no GPU: the loaded functions are callable.
  EXPECT_STREQ(api.cublasGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_EQ(&cuda::cublasApi(), &api) << "loaded once per process";
}

TEST(CublasLoading, MissingLibraryIsAClearError) {
  testing::expectThrowsWith(
      [] { (void)cuda::loadCublasApi("libdistgrad_no_such_cublasLt.so.13", "libdistgrad_no_such_cublas.so.13"); },
      {"libdistgrad_no_such_cublasLt.so.13", "LD_LIBRARY_PATH"});
}

TEST(CublasLoading, LibraryWithoutTheSymbolsIsAClearError) {
  // libm loads fine but holds no cuBLAS: the error names the library and the missing symbol.
  testing::expectThrowsWith([] { (void)cuda::loadCublasApi("libm.so.6", "libm.so.6"); },
                            {"libm.so.6 has no symbol cublasCreate_v2"});
}

}  // namespace
}  // namespace distgrad::tensor

#endif  // DG_WITH_CUDA
