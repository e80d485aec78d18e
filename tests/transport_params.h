// The transports the end-to-end suites (RPC, RRef, dist-autograd, pipeline) run over: inproc, tcp, and ucx
// when a ucx Context can be created here. When ucx is left out, the reason is printed once to stderr, so a
// run without UCX says why it has fewer tests. Used as
//   INSTANTIATE_TEST_SUITE_P(Transports, Fixture, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));
// (gtest evaluates the generator when it registers the tests, inside main: the viability check, which
// creates and closes one ucx Context, never runs during static initialisation).
#pragma once

#include <cstdio>
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

}  // namespace distgrad::testing
