// Registry: the explicit table of functions and classes an Agent serves (no static self-registration).
//
//   rpc::Registry reg;
//   reg.bind(kAdd, [](Tensor a, Tensor b) { return a + b; });                          // returns R
//   reg.bind(kSlow, [](const rpc::CallContext& ctx, int64_t n) -> rpc::Future<int64_t> {  // async
//     ...co_await / then, no executor thread held while waiting...
//   });
// A handler takes the function's Args (by value or const&), optionally preceded by `const CallContext&`,
// and returns R or Future<R> (void / Future<void> for R = void). It runs on an executor worker, or with
// Dispatch::kInline on the thread that decoded the call (short, never-blocking handlers only). Its result
// travels back with Codec<R>; an exception it throws becomes an Error of kind `remote` with the
// exception's type, message and this worker's name (an RpcError it lets escape, e.g. from a nested call,
// keeps its own kind).
// Classes (rpc/class.h): reg.bindClass(kLinear).ctor<int64_t, int64_t>() serves every method kLinear
// declares and the constructors the binder adds; findClass() gives the type-erased ClassEntry.
// The Agent copies the Registry at start(); binding afterwards does not affect running agents.
// Thread-safety: bind() and bindClass() are not thread-safe (build the registry before starting agents); find() and the
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

#include "rpc/class.h"
#include "rpc/codec.h"
#include "rpc/detail/handler.h"
#include "rpc/error.h"
#include "rpc/executor.h"
#include "rpc/function.h"
#include "rpc/future.h"
#include "rpc/message.h"
#include "tensor/error.h"

namespace distgrad::rpc {

class Agent;
class AutogradHook;

// Where a bound function's handler runs (Note [Inline handlers] in rpc/agent.cpp).
enum class Dispatch {
  kExecutor,  // on an executor worker (the default)
  kInline,    // where the call is decoded: a transport's loop thread, so the reply leaves with no thread
              // hand-off on the callee. Only for short handlers that never block: a blocking wait for a
              // future throws there, and anything else that blocks stalls every connection of the loop.
};

// One bound function, type-erased: invoke() decodes the arguments, runs the handler (on the calling
// thread) and returns a future of the result's encoder.
struct BoundFunction {
  std::string name;
  std::string signature;  // signatureText<R(Args...)>()
  uint64_t hash = 0;
  Dispatch dispatch = Dispatch::kExecutor;
  std::function<Future<EncodeValueFn>(const DecodedMessage&, const CallContext&, Executor&)> invoke;
};

template <typename T>
class ClassBinder;

class Registry {
 public:
  template <typename R, typename... Args, typename F>
  void bind(const Function<R(Args...)>& fn, F handler, Dispatch dispatch = Dispatch::kExecutor) {
    constexpr bool kTakesContext = std::is_invocable_v<F&, const CallContext&, Args&&...>;
    static_assert(kTakesContext || std::is_invocable_v<F&, Args&&...>,
                  "Registry::bind: the handler must take the function's Args, optionally preceded by "
                  "const CallContext&");
    auto entry = std::make_shared<BoundFunction>();
    entry->name = fn.name();
    entry->signature = fn.signature();
    entry->hash = fn.hash();
    entry->dispatch = dispatch;
    entry->invoke = [handler = std::move(handler), what = "function '" + fn.name() + "'"](
                        const DecodedMessage& message, const CallContext& ctx,
                        Executor& executor) -> Future<EncodeValueFn> {
      return detail::invokeDecoded<R>(detail::TypeList<Args...>{}, what, message, ctx, executor, nullptr,
                                      [&](auto&&... a) -> decltype(auto) {
                                        if constexpr (kTakesContext) {
                                          return handler(ctx, std::forward<decltype(a)>(a)...);
                                        } else {
                                          return handler(std::forward<decltype(a)>(a)...);
                                        }
                                      });
    };
    DG_CHECK(functions_.find(entry->name) == functions_.end(), "Registry::bind: function '", entry->name,
             "' is already bound");
    functions_.emplace(entry->name, std::move(entry));
  }

  // Binds a type-erased entry: for layers above rpc/ whose calls carry their own value layout (rref/'s
  // "dg.rref.*" functions read a header and hand the rest to a bound function or method). Callers reach it
  // with Agent::rpcRaw and entry.hash. Throws ValueError when the name is already bound.
  void bindEntry(BoundFunction entry);

  // The entry bound under `name`, or nullptr.
  std::shared_ptr<const BoundFunction> find(const std::string& name) const;
  std::vector<std::string> names() const;
  size_t size() const { return functions_.size(); }

  // Serves class T under cls.name(): every method cls declares. Constructors are added through the returned
  // binder (a class without one can still be served: its objects are made locally, e.g. by an RRef owner).
  // Throws ValueError when the name is already bound.
  template <typename T>
  ClassBinder<T> bindClass(const Class<T>& cls);

  // The class bound under `name`, or nullptr.
  std::shared_ptr<const ClassEntry> findClass(const std::string& name) const;
  // The class bound under `name`, or an `unimplemented` Error naming it, `worker` and the bound classes.
  Result<std::shared_ptr<const ClassEntry>> resolveClass(const std::string& name, const std::string& worker) const;
  std::vector<std::string> classNames() const;

  // Distributed autograd (rpc/autograd_hook.h): `make` runs once in Agent::start, before the agent talks to
  // anyone, and gives the agent its AutogradHook. autograd::distributed::install(registry) sets it.
  using AutogradHookFactory = std::function<std::shared_ptr<AutogradHook>(Agent&)>;
  void setAutogradHook(AutogradHookFactory make) { autogradHook_ = std::move(make); }
  const AutogradHookFactory& autogradHookFactory() const { return autogradHook_; }

  // Remote references (rpc/codec.h CarriedReferences): `make` gives the agent the sink of the references a
  // received message carried and nobody decoded; called for each such message (after start), so it should
  // be cheap. rref::RRefContext::install(registry) sets it.
  using ReferenceSinkFactory = std::function<std::shared_ptr<ReferenceSink>(Agent&)>;
  void setReferenceSink(ReferenceSinkFactory make) { referenceSink_ = std::move(make); }
  const ReferenceSinkFactory& referenceSinkFactory() const { return referenceSink_; }

 private:
  template <typename T>
  friend class ClassBinder;
  // Copy-on-write: entries already shared with a running agent (which copied this registry) never change.
  void addConstructor(const std::string& className, BoundConstructor constructor);

  std::map<std::string, std::shared_ptr<const BoundFunction>> functions_;
  std::map<std::string, std::shared_ptr<const ClassEntry>> classes_;
  AutogradHookFactory autogradHook_;
  ReferenceSinkFactory referenceSink_;
};

// Adds constructors to a class bound with Registry::bindClass. Valid while its Registry lives.
template <typename T>
class ClassBinder {
 public:
  // Peers may construct T from Args (the caller's argument types must be exactly these, after decay).
  template <typename... Args>
  ClassBinder& ctor() {
    static_assert(std::is_constructible_v<T, Args&&...>, "ClassBinder::ctor<Args...>: T is not constructible from Args");
    return factory<Args...>([](Args&&... args) { return std::make_shared<T>(std::forward<Args>(args)...); });
  }
  // Peers may construct T from Args through `make`, which takes Args (optionally preceded by
  // const CallContext&) and returns std::shared_ptr<T>; it runs on an executor thread and may throw (the
  // caller gets a `remote` error).
  template <typename... Args, typename F>
  ClassBinder& factory(F make) {
    registry_->addConstructor(name_, detail::makeBoundConstructor<T, Args...>(name_, std::move(make)));
    return *this;
  }

 private:
  friend class Registry;
  ClassBinder(Registry* registry, std::string name) : registry_(registry), name_(std::move(name)) {}
  Registry* registry_;
  std::string name_;
};

template <typename T>
ClassBinder<T> Registry::bindClass(const Class<T>& cls) {
  DG_CHECK(classes_.find(cls.name()) == classes_.end(), "Registry::bindClass: class '", cls.name(),
           "' is already bound");
  auto entry = std::make_shared<ClassEntry>();
  entry->name = cls.name();
  entry->type = std::type_index(typeid(T));
  entry->methods = cls.boundMethods();
  if constexpr (CopyableObject<T>) {
    entry->copy = [name = cls.name()](const ObjectHandle& object) -> Result<EncodeValueFn> {
      std::shared_ptr<T> typed = object.get<T>();
      if (!typed) return Error::failed("the object is not of class '" + name + "'");
      // A snapshot now (the caller's order, Note [Call order] in rref/context.cpp), encoded later with the reply.
      return detail::guard("cannot copy the object",
                           [&] { return detail::makeResultEncoder<T>(T(*typed)); });
    };
  }
  classes_.emplace(cls.name(), std::move(entry));
  return ClassBinder<T>(this, cls.name());
}

}  // namespace distgrad::rpc
