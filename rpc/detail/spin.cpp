#include "rpc/detail/spin.h"

#include <sched.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace distgrad::rpc::detail {

std::chrono::nanoseconds spinBudget() {
  static const std::chrono::nanoseconds budget = [] {
    int64_t micros = kDefaultSpinMicros;
    if (const char* text = std::getenv("DISTGRAD_SPIN_US"); text != nullptr && *text != '\0') {
      char* end = nullptr;
      long long value = std::strtoll(text, &end, 10);
      if (end != nullptr && *end == '\0' && value >= 0 && value <= 1'000'000) {
        micros = value;
      } else {
        std::fprintf(stderr, "[distgrad] ignoring DISTGRAD_SPIN_US='%s' (want 0..1000000 microseconds)\n", text);
      }
    }
    return std::chrono::nanoseconds(micros * 1000);
  }();
  return budget;
}

void yieldThread() { sched_yield(); }

}  // namespace distgrad::rpc::detail
