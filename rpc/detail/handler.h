// Internal: the one place that turns "decoded call arguments + something to call" into the
// Future<EncodeValueFn> an agent replies with. Shared by bound functions (rpc/registry.h) and bound class
// constructors/methods (rpc/class.h) so that both have the same semantics: the arguments are decoded as the
// declared wire types, the callable runs on the calling executor thread, it may return R, Future<R> or
// void, and an exception it throws becomes an Error of kind `remote` naming this worker.
// Thread-safety: stateless free functions.
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "rpc/codec.h"
#include "rpc/error.h"
#include "rpc/executor.h"
#include "rpc/function.h"
#include "rpc/future.h"
#include "rpc/message.h"

namespace distgrad::rpc::detail {

template <typename... Ts>
struct TypeList {};

// (IsFuture<X> comes from rpc/future.h.)
// The value a callable returning X sends back: X itself, or V for Future<V>.
template <typename X>
struct WireResult {
  using type = X;
};
template <typename X>
struct WireResult<Future<X>> {
  using type = X;
};

// The Error a handler's exception turns into (see rpc/registry.h). Defined in registry.cpp.
Error handlerError(Error error, const std::string& callee);
Error handlerError(std::exception_ptr exception, const std::string& callee);

// The encoder of a handler's result. A named type (not a lambda) so that a layer keeping results instead of
// sending them (the rref owner table) can recover the typed value: fn.target<ResultEncoder<R>>()->value.
template <typename R>
struct ResultEncoder {
  std::shared_ptr<R> value;
  void operator()(wire::Value::Builder out, EncodeContext& ctx) const { Codec<R>::encode(out, *value, ctx); }
};

template <typename R>
EncodeValueFn makeResultEncoder(R value) {
  return ResultEncoder<R>{std::make_shared<R>(std::move(value))};
}

template <typename R>
Result<EncodeValueFn> encoderFromResult(Result<R>&& result, const std::string& callee) {
  if (!result.ok()) return handlerError(result.error(), callee);
  if constexpr (std::is_void_v<R>) {
    return EncodeValueFn{};
  } else {
    return makeResultEncoder<R>(std::move(result).value());
  }
}

// Decodes the call's arguments as Args (decayed), then runs call(args...) with each argument as an rvalue.
// `call` returns R, Future<R> or (for R = void) void. `what` names the callee in a bad-arguments error
// ("function 'add'"). `keepAlive` (may be null) is held until an async result completes: a method's object
// must outlive the work it started.
template <typename R, typename... Args, typename Call>
Future<EncodeValueFn> invokeDecoded(TypeList<Args...>, const std::string& what, const DecodedMessage& message,
                                    const CallContext& ctx, Executor& executor, std::shared_ptr<const void> keepAlive,
                                    Call&& call) {
  Promise<EncodeValueFn> promise(executor);
  Future<EncodeValueFn> out = promise.getFuture();
  auto args = message.decodeArgs<std::decay_t<Args>...>();
  if (!args.ok()) {
    Error error = args.error();
    error.message = "bad arguments for " + what + ": " + error.message;
    error.worker = ctx.callee;
    promise.setError(std::move(error));
    return out;
  }
  try {
    auto run = [&]() -> decltype(auto) {
      return std::apply([&](auto&... a) -> decltype(auto) { return call(std::move(a)...); }, args.value());
    };
    using Ret = std::remove_cvref_t<decltype(run())>;
    if constexpr (IsFuture<Ret>::value) {
      static_assert(std::is_same_v<Ret, Future<R>>, "an async handler must return Future<R>");
      // Inline-safe: it only wraps the value in its encoder (no encoding, no blocking), so a handler
      // future that is already complete stays complete and the agent replies without another hop.
      return run().then(kInlineSafe, [callee = ctx.callee, keepAlive = std::move(keepAlive)](Result<R>&& result) {
        return encoderFromResult<R>(std::move(result), callee);
      });
    } else if constexpr (std::is_void_v<R>) {
      run();
      promise.setValue(EncodeValueFn{});
    } else {
      static_assert(std::is_convertible_v<Ret, R>, "a handler must return R or Future<R>");
      promise.setValue(makeResultEncoder<R>(R(run())));
    }
  } catch (...) {
    promise.trySetError(handlerError(std::current_exception(), ctx.callee));
  }
  return out;
}

}  // namespace distgrad::rpc::detail
