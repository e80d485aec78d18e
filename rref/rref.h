// RRef<T>: a reference to a value or object living on another worker (its owner), ARCHITECTURE §1 and §6.
//
//   auto rrefs = rref::RRefContext::of(*agent);
//   RRef<Linear> layer = rrefs->remote<Linear>("worker1", int64_t{4});   // returns at once
//   RRef<Tensor> y = layer.remote(&Linear::forward, x);                 // queued at the owner if needed
//   Tensor v = y.toHere();                                              // a copy of the value
// RRefs may be passed as arguments and results of any RPC (parameters of type RRef<T>), to the owner or
// to a third worker; the protocol that keeps the owner's count right is in docs/rref_protocol.md.
// A class used with remote<T>() or method proxies is declared once with rpc::Class<T> and tied to T with
// DG_RREF_CLASS(T, declaration) at global scope; methods are named by member pointer through it.
// Thread-safety: an RRef<T> is a value (copies share one reference of this process); its methods may be
// called from any thread. toHere() blocks: never call it on an executor thread (use toHereAsync there).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "rpc/agent.h"
#include "rpc/class.h"
#include "rpc/codec.h"
#include "rpc/future.h"
#include "rref/context.h"
#include "tensor/error.h"

namespace distgrad::rref {

// ClassOf<T>::get() is T's shared rpc::Class declaration; DG_RREF_CLASS specialises it.
// (The primary template has no get(): using remote<T>() or a method proxy for a T without DG_RREF_CLASS is
// a compile error naming ClassOf<T>::get.)
template <typename T>
struct ClassOf {};

#define DG_RREF_CLASS(Type, declaration)                                            \
  template <>                                                                       \
  struct distgrad::rref::ClassOf<Type> {                                            \
    static const ::distgrad::rpc::Class<Type>& get() { return declaration; }        \
  }

template <typename T>
concept DeclaredClass = requires { ClassOf<T>::get(); };

// What RRef<T>::toHere can copy (Note [Copying objects]): values, and objects of classes with a codec and a
// copy constructor (rpc::CopyableObject). An RRef<T> of another class has no toHere (a compile error naming
// this concept): its objects stay at their owner, call their methods.
template <typename T>
concept CopyableToHere = !DeclaredClass<T> || rpc::CopyableObject<T>;

namespace detail {

template <typename P, typename X>
decltype(auto) asParam(X&& x) {
  if constexpr (std::is_same_v<std::decay_t<X>, std::decay_t<P>>) {
    return static_cast<const std::decay_t<P>&>(x);
  } else {
    return std::decay_t<P>(std::forward<X>(x));
  }
}

// The arguments of a call as the declared wire types, encoded later as a tuple.
template <typename... P, typename... A>
rpc::EncodeValueFn argsEncoder(rpc::detail::TypeList<P...>, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "rref: wrong number of arguments for the declared signature");
  auto tuple = std::make_shared<std::tuple<std::decay_t<P>...>>(asParam<P>(std::forward<A>(args))...);
  return [tuple](rpc::wire::Value::Builder out, rpc::EncodeContext& ctx) {
    rpc::detail::TupleCodec<std::tuple<std::decay_t<P>...>, std::decay_t<P>...>::encode(out, *tuple, ctx);
  };
}

// A typed view of an owned value.
template <typename T>
std::shared_ptr<T> typedValue(const OwnedValue& owned) {
  if (owned.object) return owned.object.get<T>();
  if (!owned.value) return nullptr;
  if (auto* encoder = owned.value.target<rpc::detail::ResultEncoder<T>>()) return encoder->value;
  return nullptr;
}

}  // namespace detail

template <typename T>
class RRef {
 public:
  using Type = T;
  RRef() = default;
  explicit RRef(std::shared_ptr<detail::RRefState> state) : state_(std::move(state)) {}

  bool valid() const { return state_ != nullptr; }
  const std::string& owner() const { return checked().owner; }
  bool isOwner() const { return checked().isOwner; }
  RRefId id() const { return checked().id; }
  // True once the owner knows this reference (always true on the owner).
  bool confirmedByOwner() const { return checked().isOwner || checked().confirmed.load(); }

  // A copy of the value (on the owner: the local value), once it is resolved. `timeout` bounds the wait on
  // a user (0: the agent's default). Errors: the creating call's error, OwnerLost, timeout.
  // Objects of a DG_RREF_CLASS (Note [Copying objects]): a copy through the class's codec, taken after
  // this reference's earlier method calls ran (Note [Call order]); a class without a codec (visitFields)
  // or a copy constructor has no toHere (CopyableToHere; the owner refuses such a copy with an error too).
  rpc::Future<T> toHereAsync(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const
    requires CopyableToHere<T>;
  T toHere(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const
    requires CopyableToHere<T>
  {
    return waitForOwner(toHereAsync(timeout));
  }
  // Owner only: the value itself (shared, not copied) once resolved. Throws ValueError on a user, or
  // while the value is not resolved yet; RpcError when creating it failed.
  std::shared_ptr<T> localValue() const;

  // Calls a method declared in ClassOf<T> on the object, at the owner, once the object exists.
  template <typename M, typename... A>
  auto rpcAsync(M method, A&&... args) const;
  template <typename M, typename... A>
  auto rpcSync(M method, A&&... args) const {
    return waitForOwner(rpcAsync(method, std::forward<A>(args)...));
  }
  // future.get() for an answer from the owner; on a user, the thread reads its connection to the owner
  // meanwhile (RRefContext::readWhileWaiting), as rpc::Agent::rpcSync does.
  template <typename R>
  R waitForOwner(rpc::Future<R>&& future) const {
    const detail::RRefState& state = checked();
    if (!state.isOwner) state.context->readWhileWaiting(state.owner, [&future] { return future.isReady(); });
    return future.get();
  }
  // The method's result as a new RRef owned by the same owner (Note [Promise pipelining]).
  template <typename M, typename... A>
  auto remote(M method, A&&... args) const;

  const std::shared_ptr<detail::RRefState>& state() const { return state_; }

 private:
  const detail::RRefState& checked() const {
    DG_CHECK(state_ != nullptr, "RRef: used an empty RRef");
    return *state_;
  }
  // The header of a call of `method` (declared in ClassOf<T>) on this RRef's object.
  template <typename M>
  detail::CallHeader methodHeader(M method, detail::CallKind kind) const {
    const rpc::Class<T>& cls = ClassOf<T>::get();
    const rpc::MethodInfo& info = cls.methodFor(method);
    detail::CallHeader header;
    header.kind = static_cast<int64_t>(kind);
    header.target = cls.name();
    header.method = info.name;
    header.hash = info.hash;
    header.receiver = checked().id;
    return header;
  }
  // toHere of a value: a fetch (a user) or a copy of the local value (the owner).
  rpc::Future<T> valueHere(std::chrono::milliseconds timeout) const;
  std::shared_ptr<detail::RRefState> state_;
};

// ---- templates ----

template <typename T>
rpc::Future<T> RRef<T>::toHereAsync(std::chrono::milliseconds timeout) const
  requires CopyableToHere<T>
{
  if constexpr (DeclaredClass<T>) {
    // An object (Note [Copying objects]): a copy made by its class, ordered after this reference's earlier
    // method calls (so on the owner too: the call goes through the owner's own queue).
    const auto& state = checked();
    auto context = state.context;
    auto promise = std::make_shared<rpc::Promise<T>>(context->executor());
    rpc::Future<T> future = promise->getFuture();
    detail::CallHeader header;
    header.kind = static_cast<int64_t>(detail::CallKind::kCopy);
    header.target = ClassOf<T>::get().name();
    header.receiver = state.id;
    rpc::CallOptions options;
    options.timeout = timeout;
    context->callOwner(
        state.owner, header, {},
        [promise, keep = state_](rpc::Result<rpc::DecodedMessage>&& reply) {
          if (!reply.ok()) return promise->setError(reply.error());
          promise->setResult(reply.value().decodeValue<T>());
        },
        state_.get(), options);
    return future;
  } else {
    return valueHere(timeout);
  }
}

template <typename T>
rpc::Future<T> RRef<T>::valueHere(std::chrono::milliseconds timeout) const {
  const auto& state = checked();
  auto context = state.context;
  auto promise = std::make_shared<rpc::Promise<T>>(context->executor());
  rpc::Future<T> future = promise->getFuture();
  if (state.isOwner) {
    // Only completes the promise (its continuations run where they belong): inline-safe.
    context->whenResolved(
        state.id,
        [promise, keep = state_](rpc::Result<detail::OwnedValue> owned) {
          if (!owned.ok()) return promise->setError(owned.error());
          auto typed = detail::typedValue<T>(owned.value());
          if (!typed) {
            return promise->setError(rpc::Error::failed("RRef::toHere: the owned value is not of the RRef's type"));
          }
          if constexpr (std::is_copy_constructible_v<T>) {
            promise->setValue(T(*typed));
          } else {
            promise->setError(rpc::Error::failed("RRef::toHere: the value's type is not copyable (use localValue)"));
          }
        },
        rpc::kInlineSafe);
    return future;
  }
  // The creation reply's value (Note [Value in creation reply]) or a fetch.
  context->valueOf(state_, timeout, [promise](rpc::Result<rpc::DecodedMessage>&& reply) {
    if (!reply.ok()) return promise->setError(reply.error());
    promise->setResult(reply.value().decodeValue<T>());
  });
  return future;
}

template <typename T>
std::shared_ptr<T> RRef<T>::localValue() const {
  const auto& state = checked();
  DG_CHECK(state.isOwner, "RRef::localValue: this worker (", state.context->name(), ") is a user of the RRef; its ",
           "owner is ", state.owner, " (use toHere() for a copy)");
  auto owned = state.context->tryValue(state.id);
  DG_CHECK(owned.has_value(), "RRef::localValue: the value of the RRef is not resolved yet (use toHere(), which ",
           "waits)");
  if (!owned->ok()) throw rpc::RpcError(owned->error());
  auto typed = detail::typedValue<T>(owned->value());
  DG_CHECK(typed != nullptr, "RRef::localValue: the owned value is not of the RRef's type");
  return typed;
}

template <typename T>
template <typename M, typename... A>
auto RRef<T>::rpcAsync(M method, A&&... args) const {
  using Traits = rpc::MethodTraits<M>;
  using R = typename Traits::Result;
  const auto& state = checked();
  detail::CallHeader header = methodHeader(method, detail::CallKind::kMethodValue);
  auto encoder = detail::argsEncoder(typename Traits::WireArgs{}, std::forward<A>(args)...);
  auto promise = std::make_shared<rpc::Promise<R>>(state.context->executor());
  rpc::Future<R> future = promise->getFuture();
  // The receiver's reference is kept until the reply, so the owner cannot free it while the call waits
  // in its queue (Note [Promise pipelining]).
  state.context->callOwner(state.owner, header, std::move(encoder),
                           [promise, keep = state_](rpc::Result<rpc::DecodedMessage>&& reply) {
                             if (!reply.ok()) return promise->setError(reply.error());
                             if constexpr (std::is_void_v<R>) {
                               promise->setValue();
                             } else {
                               promise->setResult(reply.value().template decodeValue<R>());
                             }
                           },
                           state_.get());
  return future;
}

namespace detail {

// Starts a call that stores its result as a new RRef owned by `owner`; returns the caller's reference.
template <typename R>
RRef<R> storeAt(const std::shared_ptr<RRefContext>& context, const std::string& owner, CallHeader header,
                rpc::EncodeValueFn args, std::shared_ptr<RRefState> keep) {
  const bool callerOwns = owner == context->name();
  header.result = RRefId{context->rankOf(owner), context->nextId()};
  std::shared_ptr<RRefState> result;
  if (callerOwns) {
    result = context->makeOwnerHandle(header.result);
    header.resultFork = 0;
  } else {
    header.resultFork = context->nextId();
    result = context->makeUserHandle(header.result, header.resultFork, /*confirmed=*/false);
  }
  const ForkId fork = header.resultFork;
  // Note [Value in creation reply]: the owner answers the creation of a value with the value when it is
  // small and plain; a toHere issued meanwhile waits for that answer instead of fetching. (Objects stay at
  // their owner: toHere of one is an ordered copy call.)
  std::shared_ptr<CreationReply> creation;
  if constexpr (!DeclaredClass<R>) {
    if (!callerOwns) {
      creation = std::make_shared<CreationReply>();
      result->creation = creation;
    }
  }
  RRefState* receiver = keep.get();  // method calls are ordered through their receiver's reference
  context->callOwner(owner, header, std::move(args),
                     [context, fork, creation, keep = std::move(keep)](rpc::Result<rpc::DecodedMessage>&& reply) {
                       // Note [Creation confirms]: the reply means the owner registered the caller's fork.
                       // A timed-out call may still have arrived: the deletion is sent anyway (idempotent).
                       bool known = reply.ok() || reply.error().kind == rpc::ErrorKind::kTimeout;
                       if (fork != 0) context->confirmUser(fork, known);
                       if (creation) creation->complete(std::move(reply));
                     },
                     receiver);
  return RRef<R>(std::move(result));
}

}  // namespace detail

template <typename T>
template <typename M, typename... A>
auto RRef<T>::remote(M method, A&&... args) const {
  using Traits = rpc::MethodTraits<M>;
  using R = typename Traits::Result;
  static_assert(!std::is_void_v<R>, "RRef::remote: a method returning void has no value to keep (use rpcAsync)");
  const auto& state = checked();
  detail::CallHeader header = methodHeader(method, detail::CallKind::kMethodStore);
  auto encoder = detail::argsEncoder(typename Traits::WireArgs{}, std::forward<A>(args)...);
  return detail::storeAt<R>(state.context, state.owner, std::move(header), std::move(encoder), state_);
}

template <typename T, typename... A>
RRef<T> RRefContext::remoteWith(const std::string& worker, const rpc::Class<T>& cls, A&&... ctorArgs) {
  detail::CallHeader header;
  header.kind = static_cast<int64_t>(detail::CallKind::kConstruct);
  header.target = cls.name();
  header.hash = cls.template ctorHash<A...>();
  auto encoder = detail::argsEncoder(rpc::detail::TypeList<std::decay_t<A>...>{}, std::forward<A>(ctorArgs)...);
  return detail::storeAt<T>(shared_from_this(), worker, std::move(header), std::move(encoder), nullptr);
}

template <typename T, typename... A>
RRef<T> RRefContext::remote(const std::string& worker, A&&... ctorArgs) {
  return remoteWith<T>(worker, ClassOf<T>::get(), std::forward<A>(ctorArgs)...);
}

template <typename R, typename... P, typename... A>
RRef<R> RRefContext::remote(const std::string& worker, const rpc::Function<R(P...)>& fn, A&&... args) {
  static_assert(!std::is_void_v<R>, "RRefContext::remote: a function returning void has no value to keep");
  detail::CallHeader header;
  header.kind = static_cast<int64_t>(detail::CallKind::kFunction);
  header.target = fn.name();
  header.hash = fn.hash();
  auto encoder = detail::argsEncoder(rpc::detail::TypeList<P...>{}, std::forward<A>(args)...);
  return detail::storeAt<R>(shared_from_this(), worker, std::move(header), std::move(encoder), nullptr);
}

template <typename T>
RRef<T> RRefContext::own(T value) {
  detail::OwnedValue owned;
  owned.value = rpc::detail::makeResultEncoder<T>(std::move(value));
  return RRef<T>(makeOwned(std::move(owned)));
}

// Free-function spellings of RRefContext::remote.
template <typename T, typename... A>
RRef<T> remote(rpc::Agent& agent, const std::string& worker, A&&... ctorArgs) {
  return RRefContext::of(agent)->remote<T>(worker, std::forward<A>(ctorArgs)...);
}
template <typename R, typename... P, typename... A>
RRef<R> remote(rpc::Agent& agent, const std::string& worker, const rpc::Function<R(P...)>& fn, A&&... args) {
  return RRefContext::of(agent)->remote(worker, fn, std::forward<A>(args)...);
}

}  // namespace distgrad::rref

namespace distgrad::rpc {

// An RRef travels as (id, fork, parent): Note [Fork on send] / Note [Fork on receive] in rref/context.cpp.
template <typename T>
struct Codec<rref::RRef<T>> {
  static std::string signature() { return "rref<" + typeSignatureOf() + ">"; }
  static void encode(wire::Value::Builder out, const rref::RRef<T>& value, EncodeContext& ctx) {
    if (!value.valid()) throw CodecError("cannot send an empty RRef");
    if (ctx.scope().agent == nullptr) throw CodecError("an RRef can only be sent by an agent");
    const auto& context = value.state()->context;
    rref::detail::WireRRef wire = context->fork(value.state(), ctx.scope().peer);
    // Listed in the envelope (Note [Unclaimed references]); undone if the message fails to encode.
    ctx.addReference(CarriedReference{wire.id, wire.fork},
                     [context, state = value.state(), fork = wire.fork] { context->unfork(state, fork); });
    Codec<rref::detail::WireRRef>::encode(out, wire, ctx);
  }
  static rref::RRef<T> decode(wire::Value::Reader in, DecodeContext& ctx) {
    if (ctx.scope().agent == nullptr) throw CodecError("an RRef can only be received by an agent");
    auto wire = Codec<rref::detail::WireRRef>::decode(in, ctx);
    auto context = rref::RRefContext::of(*ctx.scope().agent);
    auto handle = context->receive(wire, ctx.scope().peer);
    // This fork has a handle now (whose release settles it): no longer the message's to settle.
    if (ctx.scope().references) ctx.scope().references->claim(wire.fork);
    return rref::RRef<T>(std::move(handle));
  }

 private:
  static std::string typeSignatureOf() {
    if constexpr (rref::DeclaredClass<T>) {
      return "class:" + rref::ClassOf<T>::get().name();
    } else {
      return Codec<T>::signature();
    }
  }
};

}  // namespace distgrad::rpc
