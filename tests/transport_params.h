// The transports the end-to-end suites (RPC, RRef, dist-autograd, pipeline) run over: inproc, tcp, and ucx
// when a ucx Context can be created here. When ucx is left out, the reason is printed once to stderr, so a
// run without UCX says why it has fewer tests. Used as
//   INSTANTIATE_TEST_SUITE_P(Transports, Fixture, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));
// (gtest evaluates the generator when it registers the tests, inside main: the viability check, which
// creates and closes one ucx Context, never runs during static initialisation).
#pragma once

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "rpc/transport/transport.h"

namespace distgrad::testing {

inline std::vector<std::string> endToEndTransports() {
  auto names = rpc::transport::viableTransports();
  static bool reported = false;
  if (!reported) {
    reported = true;
    std::string reason = rpc::transport::ucxUnavailableReason();
    if (!reason.empty()) std::fprintf(stderr, "distgrad tests: transport 'ucx' left out: %s\n", reason.c_str());
  }
  return names;
}

// Why cross-memory attach cannot serve one-host rendezvous here ("" when it can): UCX uses it only where
// process_vm_readv works and Yama does not restrict ptrace, and only when the user left UCX_TLS alone.
inline std::string crossMemoryAttachUnavailable() {
  if (std::getenv("UCX_TLS") != nullptr) return "UCX_TLS is set, so the lanes are the user's choice";
  if (FILE* yama = std::fopen("/proc/sys/kernel/yama/ptrace_scope", "r")) {
    int scope = -1;
    const bool read = std::fscanf(yama, "%d", &scope) == 1;
    std::fclose(yama);
    if (!read || scope != 0) return "Yama's ptrace_scope is not 0";
  }
  char source[16] = "attach";
  char target[16] = {};
  iovec local{target, sizeof(target)};
  iovec remote{source, sizeof(source)};
  if (::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) != static_cast<ssize_t>(sizeof(source))) {
    return std::string("process_vm_readv fails here: ") + std::strerror(errno);
  }
  return "";
}

}  // namespace distgrad::testing
