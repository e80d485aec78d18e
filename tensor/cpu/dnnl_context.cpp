#include "tensor/cpu/dnnl_context.h"

#include <omp.h>

#include <atomic>

#include "tensor/error.h"

namespace distgrad::tensor {
namespace {
// Process-wide on purpose (an exception to "no singletons"): OpenMP's thread pool, which oneDNN and our
// loops run on, is itself process-wide, and the oneDNN CPU engine below is a stateless handle.
std::atomic<int> gNumThreads{0};  // 0 = not yet applied (default 1)

void applyDefaultThreads() {
  int expected = 0;
  if (gNumThreads.compare_exchange_strong(expected, 1)) omp_set_num_threads(1);
}
}  // namespace

void setNumThreads(int n) {
  DG_CHECK(n >= 1, "setNumThreads: thread count must be >= 1, got ", n);
  gNumThreads.store(n);
  omp_set_num_threads(n);
}

int numThreads() {
  applyDefaultThreads();
  return gNumThreads.load();
}

namespace kernels {
dnnl::engine& dnnlEngine() {
  applyDefaultThreads();
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& dnnlStream() {
  thread_local dnnl::stream stream(dnnlEngine());
  // OpenMP's thread count is per thread (ICV): apply ours to every thread that runs kernels.
  thread_local int applied = 0;
  int want = numThreads();
  if (applied != want) {
    omp_set_num_threads(want);
    applied = want;
  }
  return stream;
}
}  // namespace kernels

}  // namespace distgrad::tensor
