// Bounded spinning before a thread blocks, for the hand-offs on an RPC's critical path.
//
// A blocked thread that is woken pays the scheduler's wake-up latency, which on virtual machines (an idle
// vCPU halts and must be kicked) costs several microseconds per hand-off, and an RPC round trip has four
// hand-offs between threads on top of the two socket wake-ups a raw ping-pong has (docs/thread_model.md,
// "Latency"). A waiter that expects its event within microseconds therefore polls for a short budget first
// and only then blocks. The budget is process-wide: DISTGRAD_SPIN_US (default kDefaultSpinMicros; 0 turns
// spinning off, e.g. when processes are pinned to one core). Spinning only ever follows activity (a thread
// waiting for a result it just asked for), so an idle agent stays at ~0% CPU.
// Thread-safety: all functions may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>

namespace distgrad::rpc::detail {

inline constexpr int64_t kDefaultSpinMicros = 20;

// The budget (read from the environment once).
std::chrono::nanoseconds spinBudget();
// sched_yield().
void yieldThread();

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls `ready` until it returns true (→ true) or `budget` passed (→ false). Yields the CPU now and then so
// a spinner never starves the thread it waits for when both share a core.
template <typename Pred>
bool spinUntil(Pred&& ready, std::chrono::nanoseconds budget = spinBudget()) {
  if (budget.count() <= 0) return ready();
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (uint32_t i = 1;; ++i) {
    if (ready()) return true;
    cpuRelax();
    if ((i & 63) == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return ready();
      yieldThread();
    }
  }
}

}  // namespace distgrad::rpc::detail
