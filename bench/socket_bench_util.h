// Raw-socket measurements shared by bench/raw_socket.cpp, bench/transport.cpp and bench/rpc.cpp: a 64-byte
// ping-pong round trip, a 64 MB message stream and an echo of any size between two processes (fork) on
// 127.0.0.1, plus the emit helper that tags every line with its placement ("free" or "one_core").
// Every measurement forks a fresh child before any thread exists in the parent's measurement (fork and
// threads do not mix); the child gets PR_SET_PDEATHSIG. `pinned` puts both processes on CPU 0.
// Thread-safety: single-threaded drivers.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench_util.h"

namespace distgrad::bench {

inline constexpr size_t kPingBytes = 64;
inline constexpr size_t kStreamBytes = 64u << 20;

inline void pinToCpu0() {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(0, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) std::perror("sched_setaffinity");
}

inline void check(bool ok, const char* what) {
  if (!ok) {
    std::perror(what);
    std::_Exit(2);
  }
}

inline void setNoDelay(int fd) {
  int one = 1;
  check(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) == 0, "TCP_NODELAY");
}

inline void readFully(int fd, void* data, size_t size) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, 0);
    check(n > 0, "recv");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

inline void writeFully(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    check(n > 0, "send");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

// Forks; the child runs childMain (after PR_SET_PDEATHSIG and optional pinning) and exits.
template <typename F>
pid_t forkChild(bool pinned, F&& childMain) {
  pid_t pid = fork();
  check(pid >= 0, "fork");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (pinned) pinToCpu0();
    childMain();
    std::fflush(stdout);
    std::_Exit(0);
  }
  return pid;
}

inline void reap(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
}

// A listening socket on 127.0.0.1 with an ephemeral port.
inline int listenEphemeral(int& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  check(fd >= 0, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  check(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "bind");
  check(::listen(fd, 16) == 0, "listen");
  socklen_t len = sizeof(addr);
  check(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0, "getsockname");
  port = ntohs(addr.sin_port);
  return fd;
}

inline int connectLoopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  check(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "connect");
  setNoDelay(fd);
  return fd;
}

struct Measurement {
  Stats stats;
  double p99 = 0;
};

inline Measurement measurementOf(std::vector<double> samples) {
  Measurement m;
  m.stats = statsOf(samples);
  std::sort(samples.begin(), samples.end());
  if (!samples.empty()) m.p99 = samples[static_cast<size_t>(0.99 * static_cast<double>(samples.size() - 1) + 0.5)];
  return m;
}

// Plain blocking sockets: 64 B ping-pong round trips, in microseconds.
inline Measurement rawPingPong(int rounds, bool pinned) {
  int port = 0;
  int listener = listenEphemeral(port);
  pid_t child = forkChild(pinned, [&] {
    int fd = connectLoopback(port);
    char buf[kPingBytes];
    for (int i = 0; i < rounds; ++i) {
      readFully(fd, buf, sizeof(buf));
      writeFully(fd, buf, sizeof(buf));
    }
    ::close(fd);
  });
  if (pinned) pinToCpu0();
  int fd = ::accept(listener, nullptr, nullptr);
  check(fd >= 0, "accept");
  setNoDelay(fd);
  char buf[kPingBytes] = {1};
  std::vector<double> us;
  us.reserve(static_cast<size_t>(rounds));
  for (int i = 0; i < rounds; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    writeFully(fd, buf, sizeof(buf));
    readFully(fd, buf, sizeof(buf));
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  ::close(fd);
  ::close(listener);
  reap(child);
  us.erase(us.begin(), us.begin() + std::min<size_t>(us.size() / 10, 1000));  // warm-up
  return measurementOf(us);
}

// Plain blocking sockets: `rounds` messages of `bytes` bytes, each answered by `replyBytes` bytes (after
// the whole message arrived) before the next is sent; one untimed warm-up message first. Returns GB/s per
// message counting the bytes of both directions. replyBytes = 1 is a one-way stream with an acknowledgement;
// replyBytes = bytes is an echo, the raw reference of an RPC that returns its argument.
inline Measurement rawExchange(size_t bytes, size_t replyBytes, int rounds, bool pinned) {
  int port = 0;
  int listener = listenEphemeral(port);
  pid_t child = forkChild(pinned, [&] {
    int fd = connectLoopback(port);
    std::vector<uint8_t> buf(std::max(bytes, replyBytes));
    for (int i = 0; i < rounds + 1; ++i) {
      readFully(fd, buf.data(), bytes);
      writeFully(fd, buf.data(), replyBytes);
    }
    ::close(fd);
  });
  if (pinned) pinToCpu0();
  int fd = ::accept(listener, nullptr, nullptr);
  check(fd >= 0, "accept");
  setNoDelay(fd);
  std::vector<uint8_t> data(bytes, 7);
  std::vector<uint8_t> reply(replyBytes);
  std::vector<double> rates;
  for (int i = 0; i < rounds + 1; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    writeFully(fd, data.data(), data.size());
    readFully(fd, reply.data(), reply.size());
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) rates.push_back(static_cast<double>(bytes + replyBytes) / s / 1e9);  // first one is warm-up
  }
  ::close(fd);
  ::close(listener);
  reap(child);
  return measurementOf(rates);
}

// Plain blocking sockets: 64 MB messages, each acknowledged by one byte; GB/s per message.
inline Measurement rawStream(int messages, bool pinned) { return rawExchange(kStreamBytes, 1, messages, pinned); }

// The process's CPU affinity now, to restore after pinToCpu0().
inline cpu_set_t currentAffinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  check(sched_getaffinity(0, sizeof(set), &set) == 0, "sched_getaffinity");
  return set;
}

inline void restoreAffinity(const cpu_set_t& set) {
  if (sched_setaffinity(0, sizeof(set), &set) != 0) std::perror("sched_setaffinity");
}

inline void emitMeasurement(const std::string& bench, const std::string& metric, const std::string& unit,
                            const Measurement& m, bool pinned, std::map<std::string, std::string> extra = {}) {
  char p99[64];
  std::snprintf(p99, sizeof(p99), "%.6g", m.p99);
  extra["p99"] = p99;
  extra["pinned_cpu0"] = pinned ? "true" : "false";
  extra["placement"] = pinned ? quoted("one_core") : quoted("free");
  emit(bench, metric, unit, m.stats, extra);
}

}  // namespace distgrad::bench
