// Internal to the CUDA backend (include only from sources built with DG_WITH_CUDA): the cuBLAS and cuBLASLt
// entry points distgrad calls, loaded with dlopen on first use instead of linked.
//
// Why: libcublasLt is over 500 MB, and linking it costs every process of a CUDA-enabled build ~150 MiB of
// resident memory and 0.1–0.25 s at start-up (the dynamic loader maps and relocates it), even a process that
// never touches a GPU: every test, every CPU worker of an RPC job (Note [Lazy cuBLAS] in cublas_api.cpp).
// cuDNN needs no such treatment: its front library is small and loads its engines itself when first used.
//
// Members are named after the API functions and typed from the installed headers, so a call reads
// `cublasApi().cublasLtMatmul(...)` and is checked against the same prototypes as a linked call (the
// headers' `_v2` macros rename member and call alike).
// Thread-safety: cublasApi() may be called from any thread; the first call loads, the others wait for it.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <string>

namespace distgrad::tensor::cuda {

struct CublasApi {
  decltype(&::cublasCreate) cublasCreate;
  decltype(&::cublasDestroy) cublasDestroy;
  decltype(&::cublasSetAtomicsMode) cublasSetAtomicsMode;
  decltype(&::cublasSetStream) cublasSetStream;
  decltype(&::cublasSetWorkspace) cublasSetWorkspace;
  // The header overloads this one (a C++ shim taking a cudaDataType compute type): name the exported one.
  cublasStatus_t (*cublasGemmStridedBatchedEx)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                               const void*, const void*, cudaDataType, int, long long, const void*,
                                               cudaDataType, int, long long, const void*, void*, cudaDataType, int,
                                               long long, int, cublasComputeType_t, cublasGemmAlgo_t);
  decltype(&::cublasGetStatusName) cublasGetStatusName;
  decltype(&::cublasGetStatusString) cublasGetStatusString;
  decltype(&::cublasLtCreate) cublasLtCreate;
  decltype(&::cublasLtDestroy) cublasLtDestroy;
  decltype(&::cublasLtMatmul) cublasLtMatmul;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) cublasLtMatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmulDescCreate) cublasLtMatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) cublasLtMatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) cublasLtMatmulDescSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) cublasLtMatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) cublasLtMatrixLayoutDestroy;
  decltype(&::cublasLtMatrixLayoutSetAttribute) cublasLtMatrixLayoutSetAttribute;
  decltype(&::cublasLtMatmulPreferenceCreate) cublasLtMatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) cublasLtMatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) cublasLtMatmulPreferenceSetAttribute;
};

// The process's cuBLAS, loaded on the first call. Throws ValueError naming the library, the places tried
// and the loader's reason when it cannot be loaded (later calls retry, so installing it is enough).
const CublasApi& cublasApi();

// Loads the API from the given library files (a name the loader searches for, or a path; the cuBLASLt one
// first, cuBLAS needs it). For tests; cublasApi() uses the sonames of the cuBLAS the build compiled against.
CublasApi loadCublasApi(const std::string& ltLibrary, const std::string& blasLibrary);

// Whether the calling process has cuBLAS or cuBLASLt mapped (from /proc/self/maps): tests check that CPU
// work leaves it unloaded.
bool cublasLoaded();

}  // namespace distgrad::tensor::cuda
