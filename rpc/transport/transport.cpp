#include "rpc/transport/transport.h"

#include <cstdio>

#include "rpc/transport/inproc/context.h"
#include "rpc/transport/tcp/context.h"
#ifdef DG_HAVE_UCX
#include "rpc/transport/ucx/context.h"
#endif

namespace distgrad::rpc::transport {

std::string reportCallbackException(const std::string& what, const char* consequence) {
  std::string message = what + " threw: ";
  try {
    throw;
  } catch (const std::exception& e) {
    message += e.what();
  } catch (...) {
    message += "a non-standard exception";
  }
  std::fprintf(stderr, "distgrad: %s; %s\n", message.c_str(), consequence);
  return message;
}

size_t paddingTo64(size_t n) { return (kPayloadAlignment - n % kPayloadAlignment) % kPayloadAlignment; }

Result<void> validatePrefix(const FramePrefix& prefix, const FrameLimits& limits) {
  auto bad = [](std::string what) { return Error::failed("malformed frame: " + what); };
  if (prefix.magic != kFrameMagic) return bad("bad magic " + std::to_string(prefix.magic));
  if (prefix.version != kProtocolVersion) {
    return bad("protocol version " + std::to_string(prefix.version) + ", this build speaks " +
               std::to_string(kProtocolVersion));
  }
  if (prefix.envelopeBytes > limits.maxEnvelopeBytes) {
    return bad("envelope of " + std::to_string(prefix.envelopeBytes) + " bytes exceeds the limit of " +
               std::to_string(limits.maxEnvelopeBytes));
  }
  if (prefix.payloadCount > limits.maxPayloadCount) {
    return bad(std::to_string(prefix.payloadCount) + " payloads exceed the limit of " +
               std::to_string(limits.maxPayloadCount));
  }
  if (prefix.payloadBytes > limits.maxPayloadBytes) {
    return bad(std::to_string(prefix.payloadBytes) + " payload bytes exceed the limit of " +
               std::to_string(limits.maxPayloadBytes));
  }
  return {};
}

Result<std::unique_ptr<Context>> createContext(const std::string& name, const ContextOptions& options) {
  if (name == "inproc") {
    // A private hub: this context reaches only its own listeners (see inproc/context.h).
    return inproc::createInprocContext(std::make_shared<inproc::InprocHub>(), options);
  }
  if (name == "tcp") return tcp::createTcpContext(options);
  if (name == "ucx") {
#ifdef DG_HAVE_UCX
    return ucx::createUcxContext(options);
#else
    return Error::unimplemented("transport 'ucx': this build has no UCX (libucx-dev was not found at configure time)");
#endif
  }
  return Error::unimplemented("unknown transport '" + name + "'; known transports: inproc, tcp, ucx");
}

std::string ucxUnavailableReason() {
#ifdef DG_HAVE_UCX
  std::string reason;
  return ucx::ucxViable(&reason) ? std::string() : reason;
#else
  return "this build has no UCX (libucx-dev was not found at configure time)";
#endif
}

std::vector<std::string> viableTransports() {
  std::vector<std::string> names = {"inproc", "tcp"};
  if (ucxUnavailableReason().empty()) names.push_back("ucx");
  return names;
}

}  // namespace distgrad::rpc::transport
