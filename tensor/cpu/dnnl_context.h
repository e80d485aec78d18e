// The oneDNN engine and stream our CPU kernels submit primitives to, plus thread-count control.
// oneDNN streams are not thread-safe, so each thread gets its own (thread_local); the engine is shared.
// oneDNN here uses the OpenMP runtime, so setNumThreads sets OpenMP's thread count for this process.
// Thread-safety: all functions are thread-safe.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

namespace distgrad::tensor {

// Threads used by CPU kernels (oneDNN and our parallel loops). Default: 1 per process (distributed jobs
// run one process per core); call this to use more.
void setNumThreads(int n);
int numThreads();

namespace kernels {
dnnl::engine& dnnlEngine();
dnnl::stream& dnnlStream();  // this thread's stream
}  // namespace kernels

}  // namespace distgrad::tensor
