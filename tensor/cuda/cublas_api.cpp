// Built only with DG_WITH_CUDA (see cublas_api.h); an empty translation unit otherwise.
#ifdef DG_WITH_CUDA

#include "tensor/cuda/cublas_api.h"

#include <dlfcn.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tensor/error.h"

// Note [Lazy cuBLAS]
// cuBLAS is not linked: the first GEMM on a GPU (or the first cuBLAS handle) loads libcublasLt and libcublas
// with dlopen and resolves the few entry points distgrad calls (CublasApi). A process that never runs a GPU
// GEMM never maps them, which keeps a CPU worker of a CUDA-enabled build as small and as quick to start as
// one of a CPU-only build (measured here: linking cost 150 MiB of RSS and 0.1–0.25 s per process start).
// The sonames carry the major version the build compiled against (an ABI break between majors must not
// load silently); the loader's own search comes first (LD_LIBRARY_PATH, the executable's run path, the
// system cache), then the toolkit's library directory found at configure time, so a build-tree binary
// works without any environment. The libraries stay loaded for the life of the process: per-thread handles
// are destroyed at thread exit, possibly after every user of the API has returned.

namespace distgrad::tensor::cuda {

namespace {

#define DG_STRINGIFY(x) #x
#define DG_STRINGIFY_EXPANDED(x) DG_STRINGIFY(x)

// A dlopen handle closed on destruction unless released (a failed load leaves nothing behind).
class LibraryHandle {
 public:
  explicit LibraryHandle(void* handle) : handle_(handle) {}
  ~LibraryHandle() {
    if (handle_ != nullptr) dlclose(handle_);
  }
  LibraryHandle(const LibraryHandle&) = delete;
  LibraryHandle& operator=(const LibraryHandle&) = delete;
  void* get() const { return handle_; }
  void release() { handle_ = nullptr; }

 private:
  void* handle_;
};

void* openLibrary(const std::string& name) {
  std::string tried;
  std::string reasons;
  std::vector<std::string> candidates{name};
#ifdef DG_CUDA_LIBRARY_DIR
  if (name.find('/') == std::string::npos) candidates.push_back(std::string(DG_CUDA_LIBRARY_DIR) + "/" + name);
#endif
  for (const std::string& candidate : candidates) {
    if (void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
    const char* why = dlerror();
    reasons += detail::concatMessage(reasons.empty() ? "" : "; ", why != nullptr ? why : candidate + ": unknown error");
  }
  throw ValueError(detail::concatMessage("the CUDA backend needs ", name, " (cuBLAS ", CUBLAS_VER_MAJOR,
                                         ") for GPU matrix products, and it could not be loaded: ", reasons,
                                         ". Install the CUDA toolkit's cuBLAS or add its directory to "
                                         "LD_LIBRARY_PATH"));
}

template <typename Fn>
void resolve(void* library, const char* symbol, Fn& slot, const std::string& libraryName) {
  dlerror();
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    throw ValueError(detail::concatMessage(libraryName, " has no symbol ", symbol, " (cuBLAS ", CUBLAS_VER_MAJOR,
                                           " expected): a different cuBLAS than the one distgrad was built with?"));
  }
  slot = reinterpret_cast<Fn>(address);
}

std::string soname(const char* stem) { return detail::concatMessage("lib", stem, ".so.", CUBLAS_VER_MAJOR); }

}  // namespace

CublasApi loadCublasApi(const std::string& ltLibrary, const std::string& blasLibrary) {
  // cuBLAS depends on cuBLASLt: opening Lt first makes the dependency resolve to this very copy.
  LibraryHandle lt(openLibrary(ltLibrary));
  LibraryHandle blas(openLibrary(blasLibrary));
  CublasApi api{};
#define DG_RESOLVE(handle, member) resolve(handle.get(), DG_STRINGIFY_EXPANDED(member), api.member, handle##Library)
  DG_RESOLVE(blas, cublasCreate);
  DG_RESOLVE(blas, cublasDestroy);
  DG_RESOLVE(blas, cublasSetAtomicsMode);
  DG_RESOLVE(blas, cublasSetStream);
  DG_RESOLVE(blas, cublasSetWorkspace);
  DG_RESOLVE(blas, cublasGemmStridedBatchedEx);
  DG_RESOLVE(blas, cublasGetStatusName);
  DG_RESOLVE(blas, cublasGetStatusString);
  DG_RESOLVE(lt, cublasLtCreate);
  DG_RESOLVE(lt, cublasLtDestroy);
  DG_RESOLVE(lt, cublasLtMatmul);
  DG_RESOLVE(lt, cublasLtMatmulAlgoGetHeuristic);
  DG_RESOLVE(lt, cublasLtMatmulDescCreate);
  DG_RESOLVE(lt, cublasLtMatmulDescDestroy);
  DG_RESOLVE(lt, cublasLtMatmulDescSetAttribute);
  DG_RESOLVE(lt, cublasLtMatrixLayoutCreate);
  DG_RESOLVE(lt, cublasLtMatrixLayoutDestroy);
  DG_RESOLVE(lt, cublasLtMatrixLayoutSetAttribute);
  DG_RESOLVE(lt, cublasLtMatmulPreferenceCreate);
  DG_RESOLVE(lt, cublasLtMatmulPreferenceDestroy);
  DG_RESOLVE(lt, cublasLtMatmulPreferenceSetAttribute);
#undef DG_RESOLVE
  lt.release();  // Note [Lazy cuBLAS]: loaded for the life of the process
  blas.release();
  return api;
}

const CublasApi& cublasApi() {
  static std::atomic<const CublasApi*> loaded{nullptr};
  if (const CublasApi* api = loaded.load(std::memory_order_acquire)) return *api;
  static std::mutex mutex;
  static std::optional<CublasApi> api;
  std::lock_guard<std::mutex> lock(mutex);
  if (!api.has_value()) api = loadCublasApi(soname("cublasLt"), soname("cublas"));  // a throw leaves it empty
  loaded.store(&*api, std::memory_order_release);
  return *api;
}

bool cublasLoaded() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("/libcublas") != std::string::npos) return true;
  }
  return false;
}

}  // namespace distgrad::tensor::cuda

#endif  // DG_WITH_CUDA
