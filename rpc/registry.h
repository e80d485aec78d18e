// Registry: the explicit table of functions an Agent serves (no static self-registration).
//
//   rpc::Registry reg;
//   reg.bind(kAdd, [](Tensor a, Tensor b) { return a + b; });                          // returns R
//   reg.bind(kSlow, [](const rpc::CallContext& ctx, int64_t n) -> rpc::Future<int64_t> {  // async
//     ...co_await / then, no executor thread held while waiting...
//   });
// A handler takes the function's Args (by value or const&), optionally preceded by `const CallContext&`,
// and returns R or Future<R> (void / Future<void> for R = void). Its result travels back with Codec<R>; an
// exception it throws becomes an Error of kind `remote` with the exception's type, message and this
// worker's name (an RpcError it lets escape, e.g. from a nested call, keeps its own kind).
// The Agent copies the Registry at start(); binding afterwards does not affect running agents.
// Thread-safety: bind() is not thread-safe (build the registry before starting agents); find() and the
// invoke functions of bound entries are safe from any thread (a handler may run on several executor threads at
// once, so it must be safe to call concurrently; it is copied, so it must be copyable).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "rpc/codec.h"
#include "rpc/error.h"
#include "rpc/executor.h"
#include "rpc/function.h"
#include "rpc/future.h"
#include "rpc/message.h"
#include "tensor/error.h"

namespace distgrad::rpc {

// One bound function, type-erased: invoke() decodes the arguments, runs the handler (on the calling
// executor thread) and returns a future of the result's encoder.
struct BoundFunction {
  std::string name;
  std::string signature;  // signatureText<R(Args...)>()
  uint64_t hash = 0;
  std::function<Future<EncodeValueFn>(const DecodedMessage&, const CallContext&, Executor&)> invoke;
};

namespace detail {

// The Error a handler's exception turns into (see the header comment).
Error handlerError(Error error, const std::string& callee);
Error handlerError(std::exception_ptr exception, const std::string& callee);

template <typename R>
EncodeValueFn makeResultEncoder(R value) {
  return [v = std::make_shared<R>(std::move(value))](wire::Value::Builder out, EncodeContext& ctx) {
    Codec<R>::encode(out, *v, ctx);
  };
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

}  // namespace detail

class Registry {
 public:
  template <typename R, typename... Args, typename F>
  void bind(const Function<R(Args...)>& fn, F handler) {
    constexpr bool kTakesContext = std::is_invocable_v<F&, const CallContext&, Args&&...>;
    static_assert(kTakesContext || std::is_invocable_v<F&, Args&&...>,
                  "Registry::bind: the handler must take the function's Args, optionally preceded by "
                  "const CallContext&");
    auto entry = std::make_shared<BoundFunction>();
    entry->name = fn.name();
    entry->signature = fn.signature();
    entry->hash = fn.hash();
    entry->invoke = [handler = std::move(handler), name = fn.name()](
                        const DecodedMessage& message, const CallContext& ctx,
                        Executor& executor) -> Future<EncodeValueFn> {
      Promise<EncodeValueFn> promise(executor);
      Future<EncodeValueFn> out = promise.getFuture();
      auto args = message.decodeArgs<std::decay_t<Args>...>();
      if (!args.ok()) {
        Error error = args.error();
        error.message = "bad arguments for '" + name + "': " + error.message;
        error.worker = ctx.callee;
        promise.setError(std::move(error));
        return out;
      }
      try {
        auto call = [&]() -> decltype(auto) {
          return std::apply(
              [&](auto&... a) -> decltype(auto) {
                if constexpr (kTakesContext) {
                  return handler(ctx, std::move(a)...);
                } else {
                  return handler(std::move(a)...);
                }
              },
              args.value());
        };
        using Ret = std::remove_cvref_t<decltype(call())>;
        if constexpr (IsFutureType<Ret>::value) {
          static_assert(std::is_same_v<Ret, Future<R>>, "an async handler must return Future<R>");
          // Inline-safe: it only wraps the value in its encoder (no encoding, no blocking), so a handler
          // future that is already complete stays complete and the agent replies without another hop.
          return call().then(kInlineSafe, [callee = ctx.callee](Result<R>&& result) {
            return detail::encoderFromResult<R>(std::move(result), callee);
          });
        } else if constexpr (std::is_void_v<R>) {
          call();
          promise.setValue(EncodeValueFn{});
        } else {
          static_assert(std::is_convertible_v<Ret, R>, "a handler must return R or Future<R>");
          promise.setValue(detail::makeResultEncoder<R>(R(call())));
        }
      } catch (...) {
        promise.trySetError(detail::handlerError(std::current_exception(), ctx.callee));
      }
      return out;
    };
    DG_CHECK(functions_.find(entry->name) == functions_.end(), "Registry::bind: function '", entry->name,
             "' is already bound");
    functions_.emplace(entry->name, std::move(entry));
  }

  // The entry bound under `name`, or nullptr.
  std::shared_ptr<const BoundFunction> find(const std::string& name) const;
  std::vector<std::string> names() const;
  size_t size() const { return functions_.size(); }

 private:
  template <typename X>
  struct IsFutureType : std::false_type {};
  template <typename X>
  struct IsFutureType<Future<X>> : std::true_type {};

  std::map<std::string, std::shared_ptr<const BoundFunction>> functions_;
};

}  // namespace distgrad::rpc
