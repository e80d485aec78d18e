// rpc::Function<R(Args...)>: the typed name of a remote function, and CallContext, what a handler learns
// about the call it serves.
//
// A Function is declared once in a header both caller and callee include:
//   inline const rpc::Function<Tensor(Tensor, Tensor)> kAdd{"add"};
// The caller's arguments and the handler's parameters are checked against Args at compile time on each
// side; on the wire the call carries the name and rpc::signatureHash<R(Args...)>(), so peers built from
// different declarations get an `unimplemented` error naming both signatures instead of garbage.
// Thread-safety: value types; a CallContext is read-only for the handler.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "rpc/cancellation.h"
#include "rpc/codec.h"

namespace distgrad::rpc {

class Agent;

template <typename Sig>
class Function;

template <typename R, typename... Args>
class Function<R(Args...)> {
 public:
  using Result = R;
  using Signature = R(Args...);
  explicit Function(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }
  static std::string signature() { return signatureText<R(Args...)>(); }
  static uint64_t hash() { return signatureHash<R(Args...)>(); }

 private:
  std::string name_;
};

// What a handler taking `const CallContext&` as its first parameter sees.
struct CallContext {
  std::string caller;       // the calling worker's name
  std::string callee;       // this worker's name
  std::string function;     // the function's name
  uint64_t messageId = 0;   // the call's id (unique per caller)
  // Cancelled (reason kTimeout) when the caller's deadline expired, (kCancelled) when the caller cancelled
  // the call, and (kDisconnected) when the caller's connection closed. Handlers doing long work poll it or
  // register onCancel() to stop early; the caller has already given up on the result.
  CancellationToken token;
  std::chrono::microseconds timeout{0};  // the caller's timeout, 0 if none
  // The distributed autograd context the call carries (0: none). The handler's synchronous part runs with
  // it active; a continuation that makes calls belonging to the same pass re-activates it with
  // rpc::AutogradContextScope(ctx.autogradContext) (rpc/autograd_hook.h).
  uint64_t autogradContext = 0;
  // The agent serving the call (for nested calls and the per-agent state of layers above rpc/, e.g.
  // rref::RRefContext::of(*ctx.agent)). Valid while the handler runs and the agent lives.
  Agent* agent = nullptr;
};

}  // namespace distgrad::rpc
