// libFuzzer target for the envelope decoder: build with clang and -DDG_FUZZ=ON, then run
//   ./build/tests/fuzz_envelope -max_total_time=60 corpus/
// Input format: see fuzz_envelope_input.h. A finding is a crash, a sanitizer report, or a trap below.
#include <cstdio>

#include "rpc/fuzz_envelope_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string problem = distgrad::rpc::fuzz::runEnvelopeFuzzInput(data, size);
  if (!problem.empty()) {
    std::fprintf(stderr, "fuzz_envelope: %s\n", problem.c_str());
    __builtin_trap();
  }
  return 0;
}
