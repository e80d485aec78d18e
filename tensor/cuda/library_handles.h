// Internal to the CUDA backend (include only from sources built with DG_WITH_CUDA): the cuBLAS, cuBLASLt
// and cuDNN handles, their workspaces and their status checks.
//
// Handles are created lazily, one per (thread, device), and destroyed when the thread exits: a handle is
// not safe to use from two threads at once, and per-thread handles need no locks on the hot path. Each
// accessor binds the handle to the stream the work goes to (the caller passes Stream::current(device)),
// so library calls always follow the thread's current-stream rule, never the legacy stream by accident.
// cuBLAS and cuBLASLt share one workspace per (thread, device, stream) of kBlasWorkspaceBytes, held as a
// CUDA Tensor (so it comes from distgrad's allocator): work on one stream is ordered, so one buffer per
// stream is never used by two kernels at once (PyTorch keys its cuBLAS workspaces the same way). cuDNN
// convolutions ask for their workspace per call (sizes differ by algorithm) via workspaceTensor.
// Thread-safety: everything here is per calling thread.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cudnn.h>

#include <cstddef>

#include "tensor/cuda/cuda_check.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::cuda {

// cuBLAS recommends 32 MiB on Hopper (4 MiB before); one size for every architecture keeps this simple.
inline constexpr size_t kBlasWorkspaceBytes = size_t{32} << 20;

void checkCublas(cublasStatus_t status, const char* what);
void checkCudnn(cudnnStatus_t status, const char* what);

// The calling thread's handles for stream.device(), bound to `stream` (and the cuBLAS workspace of that
// stream). The device must be current (a DeviceGuard for it is live) when the handle is created.
cublasHandle_t cublasHandle(const Stream& stream);
cublasLtHandle_t cublasLtHandle(int device);
cudnnHandle_t cudnnHandle(const Stream& stream);

// The shared cuBLAS/cuBLASLt workspace for (thread, device, stream): kBlasWorkspaceBytes of device memory.
void* blasWorkspace(const Stream& stream);

// A fresh device buffer of at least `bytes` (a CUDA Tensor, so it comes from the allocator and is released
// when the returned tensor dies). Zero bytes gives an undefined-data empty tensor whose rawData may be null.
Tensor workspaceTensor(int device, size_t bytes);

}  // namespace distgrad::tensor::cuda

#define DG_CUBLAS_CHECK(expr) ::distgrad::tensor::cuda::checkCublas((expr), #expr)
#define DG_CUDNN_CHECK(expr) ::distgrad::tensor::cuda::checkCudnn((expr), #expr)
