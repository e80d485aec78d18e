// CpuImpl: which implementation a CPU kernel with more than one uses (pooling, batch norm).
// kAuto picks the one measured faster for the shapes we train; the others let tests compare implementations
// against each other and benchmarks time them. Thread-safety: a value type.
#pragma once

namespace distgrad::tensor::kernels {

enum class CpuImpl { kAuto, kOneDnn, kLoops };

}  // namespace distgrad::tensor::kernels
