// Helpers for benchmarks: timing loops and the JSON-lines output contract
// {"bench":..., "metric":..., "unit":..., "median":..., "p10":..., "p90":..., "n":..., extra keys...}.
// Thread-safety: none needed (benchmarks are single-threaded drivers).
#pragma once

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace distgrad::bench {

struct Stats {
  double median = 0, p10 = 0, p90 = 0;
  size_t n = 0;
};

inline Stats statsOf(std::vector<double> samples) {
  Stats s;
  s.n = samples.size();
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  auto pick = [&](double q) { return samples[static_cast<size_t>(q * static_cast<double>(samples.size() - 1) + 0.5)]; };
  s.median = pick(0.5);
  s.p10 = pick(0.1);
  s.p90 = pick(0.9);
  return s;
}

// Seconds taken by each of `reps` calls of fn, after `warmup` untimed calls.
inline std::vector<double> timeSeconds(const std::function<void()>& fn, int reps, int warmup = 1) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> out;
  out.reserve(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return out;
}

// CPU seconds consumed by the calling thread: on a shared, loaded machine this moves far less than wall
// time, so single-threaded comparisons use it next to wall-clock figures.
inline double threadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// CPU seconds consumed by the whole process (every thread), e.g. an RPC agent's background threads.
inline double processCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Wall and thread-CPU seconds of each of `reps` calls of fn, after `warmup` untimed calls.
struct Timings {
  std::vector<double> wall, cpu;
};
inline Timings timeWallAndCpu(const std::function<void()>& fn, int reps, int warmup = 1) {
  for (int i = 0; i < warmup; ++i) fn();
  Timings t;
  for (int i = 0; i < reps; ++i) {
    auto w0 = std::chrono::steady_clock::now();
    double c0 = threadCpuSeconds();
    fn();
    t.cpu.push_back(threadCpuSeconds() - c0);
    t.wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count());
  }
  return t;
}

// Converts per-call seconds into a rate: units of work per second (e.g. GFLOP/s when work = GFLOP).
inline std::vector<double> ratesOf(const std::vector<double>& seconds, double workPerCall) {
  std::vector<double> r;
  for (double s : seconds) r.push_back(workPerCall / s);
  return r;
}

// Prints one JSON line. `extra` values are emitted verbatim (pass numbers, or strings with quotes).
inline void emit(const std::string& bench, const std::string& metric, const std::string& unit, const Stats& s,
                 const std::map<std::string, std::string>& extra = {}) {
  std::printf("{\"bench\":\"%s\",\"metric\":\"%s\",\"unit\":\"%s\",\"median\":%.6g,\"p10\":%.6g,\"p90\":%.6g,\"n\":%zu",
              bench.c_str(), metric.c_str(), unit.c_str(), s.median, s.p10, s.p90, s.n);
  for (const auto& [k, v] : extra) std::printf(",\"%s\":%s", k.c_str(), v.c_str());
  std::printf("}\n");
  std::fflush(stdout);
}

inline std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// A number for an `extra` value (4 significant digits), e.g. a ratio.
inline std::string number(double v) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.4g", v);
  return text;
}

}  // namespace distgrad::bench
