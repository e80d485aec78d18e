// Registered classes: objects a worker constructs and calls methods on for its peers (the base of RRefs and
// RemoteModule, ARCHITECTURE §1 and §6).
//
// A class is declared once in a header both caller and callee include, with the name of every method peers
// may call:
//   inline const rpc::Class<Linear> kLinear = rpc::Class<Linear>("Linear")
//       .method("forward", &Linear::forward)
//       .method("weight", &Linear::weight);
// The callee binds it and says how peers may construct it:
//   reg.bindClass(kLinear).ctor<int64_t, int64_t>();        // Linear(int64_t, int64_t)
//   reg.bindClass(kNet).factory<std::string>([](std::string cfg) { return makeNet(cfg); });
// A caller holding a member pointer finds the method's wire identity in the declaration:
//   const rpc::MethodInfo& m = kLinear.methodFor(&Linear::forward);   // m.name, m.hash, m.signature
//   uint64_t ctor = kLinear.ctorHash<int64_t, int64_t>();
//
// Why the method names live in the declaration: a call like `rref.rpcSync(&Linear::forward, x)` has only a
// member pointer, a runtime value from which C++ cannot recover a name, so the name must be written once
// where both sides see it. Listing (name, member pointer) pairs in the shared Class<T> gives the caller its
// (name, hash) lookup and gives the callee everything it needs to serve the method (bindClass serves every
// declared method), so nothing is written twice and the two sides cannot drift apart silently. Constructors
// are the callee's choice (which ones it offers, or a factory); a caller names one by its argument types.
//
// Wire identity. Constructor: "Linear(i64,i64)" (class name + the argument types' signatures), hashed
// (FNV-1a 64) into ctorHash. Method: "<result> Class::method(<args>)" plus " const" for const member
// functions, e.g. "tensor Linear::forward(tensor) const", hashed into MethodInfo::hash. A method returning
// Future<R> has result R on the wire (async and sync implementations are interchangeable); a leading
// `const CallContext&` parameter is not part of the wire arguments (it gives the method the call's
// cancellation token, caller and deadline, as for functions). A caller sends (class, method, hash); the
// callee's ClassEntry::findMethod / findConstructor answer an `unimplemented` Error naming the class, the
// method and the worker when the name is unknown or the hash differs.
//
// Calling with the wrong number or types of arguments is a compile error on both sides: the callee's
// invoker is generated from the member function type, and callers encode the argument types the declaration
// fixes (MethodTraits<M>::WireArgs): the rref layer's call entry points must static_assert the count
// against it, as Agent::rpcAsync does for functions.
//
// Objects. A constructor returns an ObjectHandle: a std::shared_ptr<void> to the T plus its class name and
// type id. Methods take the handle and check the type id (a handle of another class is an error, never a
// wrong cast). An async method's object is kept alive until its Future completes.
//
// A declaration like kLinear above is initialised dynamically (it allocates): use it from main() or later,
// never from another static initialiser.
// Thread-safety: Class<T> is built once (declaration) and then read-only; its const methods may be called
// from any thread. The Registry's bindClass/ClassBinder are not thread-safe (build the registry before
// starting agents). ClassEntry and its bound constructors and methods are immutable and safe from any
// thread. Methods of one object may run concurrently on several executor threads (exactly as the same
// handler may): a class whose methods mutate state must synchronise them itself (or its callers must
// serialise their calls); the registry adds no per-object lock.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

#include "rpc/codec.h"
#include "rpc/detail/handler.h"
#include "rpc/error.h"
#include "rpc/executor.h"
#include "rpc/function.h"
#include "rpc/future.h"
#include "rpc/message.h"
#include "tensor/error.h"

namespace distgrad::rpc {

// ---- member function traits ----

namespace detail {

template <typename... A>
struct StripCallContext {
  static constexpr bool kTakesContext = false;
  using Args = TypeList<A...>;
};
template <typename First, typename... Rest>
  requires std::is_same_v<std::remove_cvref_t<First>, CallContext>
struct StripCallContext<First, Rest...> {
  static_assert(std::is_same_v<First, const CallContext&>, "a method's CallContext parameter must be const CallContext&");
  static constexpr bool kTakesContext = true;
  using Args = TypeList<Rest...>;
};

template <typename Object, typename Ret, bool kConst, typename... A>
struct MemberTraitsBase {
  using ObjectType = Object;
  using Return = Ret;
  using Result = typename WireResult<std::remove_cvref_t<Ret>>::type;  // the value on the wire
  static constexpr bool kIsConst = kConst;
  static constexpr bool kTakesContext = StripCallContext<A...>::kTakesContext;
  using WireArgs = typename StripCallContext<A...>::Args;
};

template <typename R, typename L>
struct SignatureOf;
template <typename R, typename... A>
struct SignatureOf<R, TypeList<A...>> {
  static std::string argsText() {
    std::string out = "(";
    bool first = true;
    ((out += (first ? "" : ","), out += typeSignature<A>(), first = false), ...);
    return out + ")";
  }
};

}  // namespace detail

// What a member function pointer type means on the wire. Supports R (C::*)(A...) with optional const and
// noexcept; ref-qualified (& / &&) and volatile member functions are not supported.
template <typename M>
struct MethodTraits {
  static_assert(sizeof(M) == 0, "rpc::Class::method takes a pointer to a (possibly const) member function");
};
template <typename C, typename R, typename... A>
struct MethodTraits<R (C::*)(A...)> : detail::MemberTraitsBase<C, R, false, A...> {};
template <typename C, typename R, typename... A>
struct MethodTraits<R (C::*)(A...) const> : detail::MemberTraitsBase<C, R, true, A...> {};
template <typename C, typename R, typename... A>
struct MethodTraits<R (C::*)(A...) noexcept> : detail::MemberTraitsBase<C, R, false, A...> {};
template <typename C, typename R, typename... A>
struct MethodTraits<R (C::*)(A...) const noexcept> : detail::MemberTraitsBase<C, R, true, A...> {};

// "tensor Linear::forward(tensor) const"
template <typename M>
std::string methodSignatureText(const std::string& className, const std::string& methodName) {
  using Traits = MethodTraits<M>;
  return typeSignature<typename Traits::Result>() + " " + className + "::" + methodName +
         detail::SignatureOf<void, typename Traits::WireArgs>::argsText() + (Traits::kIsConst ? " const" : "");
}

// "Linear(i64,i64)"
template <typename... Args>
std::string constructorSignatureText(const std::string& className) {
  return className + detail::SignatureOf<void, detail::TypeList<Args...>>::argsText();
}

// ---- objects ----

// A constructed object, type-erased: what the owner of a remote object keeps (the rref layer's table).
struct ObjectHandle {
  std::shared_ptr<void> object;
  std::type_index type = typeid(void);
  std::string className;

  template <typename T>
  static ObjectHandle of(std::string className, std::shared_ptr<T> object) {
    return ObjectHandle{std::static_pointer_cast<void>(std::move(object)), std::type_index(typeid(T)),
                        std::move(className)};
  }
  // The object as a T, or nullptr when the handle is empty or holds another type.
  template <typename T>
  std::shared_ptr<T> get() const {
    if (!object || type != std::type_index(typeid(T))) return nullptr;
    return std::static_pointer_cast<T>(object);
  }
  explicit operator bool() const { return object != nullptr; }
};

// ---- callee side: bound constructors and methods ----

struct BoundConstructor {
  std::string signature;  // constructorSignatureText<Args...>(className)
  uint64_t hash = 0;
  // Decodes the arguments and constructs the object on the calling thread. Errors: bad arguments
  // (`failed`), the constructor or factory threw (`remote`, naming the callee).
  std::function<Result<ObjectHandle>(const DecodedMessage&, const CallContext&)> construct;
};

struct BoundMethod {
  std::string className;
  std::string name;
  std::string signature;  // methodSignatureText<M>(className, name)
  uint64_t hash = 0;
  bool isConst = false;
  // Decodes the arguments and calls the method on `object` (on the calling executor thread), like
  // BoundFunction::invoke. An object of another class is a `failed` error.
  std::function<Future<EncodeValueFn>(const ObjectHandle& object, const DecodedMessage&, const CallContext&,
                                      Executor&)>
      invoke;
};

// One bound class, type-erased, found by name in the Registry.
// Whether objects of class T can be copied into a message (rref's toHere of an object): T has a codec and
// a copy constructor. A codec is a visitFields declaration (rpc/codec.h); a class with its own Codec<T>
// specialisation says so by specialising kHasObjectCodec<T> to true.
template <typename T>
inline constexpr bool kHasObjectCodec = FieldVisitable<T>;
template <typename T>
concept CopyableObject = kHasObjectCodec<T> && std::is_copy_constructible_v<T>;

struct ClassEntry {
  std::string name;
  std::type_index type = typeid(void);
  std::vector<BoundConstructor> constructors;
  std::vector<BoundMethod> methods;
  // A copy of `object` (of this class) taken now, as a message value: set by Registry::bindClass for
  // CopyableObject classes, empty for the others (their objects cannot leave their worker).
  std::function<Result<EncodeValueFn>(const ObjectHandle& object)> copy;

  // The constructor whose signature hash is `hash`, or an `unimplemented` Error naming the class, `worker`
  // (this worker, for the message) and the constructors it has.
  Result<const BoundConstructor*> findConstructor(uint64_t hash, const std::string& worker) const;
  // The method `method` whose signature hash is `hash`, or an `unimplemented` Error naming the class, the
  // method, `worker`, and the signatures of that name (hash mismatch) or the methods there are (unknown).
  Result<const BoundMethod*> findMethod(const std::string& method, uint64_t hash, const std::string& worker) const;
};

// ---- the shared declaration ----

// The wire identity of one declared method (what a caller sends).
struct MethodInfo {
  std::string name;
  std::string signature;
  uint64_t hash = 0;
  bool isConst = false;
};

template <typename T>
class Class {
 public:
  using Type = T;
  explicit Class(std::string name) : name_(std::move(name)) {
    DG_CHECK(!name_.empty(), "rpc::Class: the class name must not be empty");
  }

  // Declares a method peers may call: `member` is a pointer to a member function of T (or of a base of T).
  // Two methods may share a name when their signatures differ (overloads are told apart by hash).
  template <typename M>
  Class& method(std::string methodName, M member) & {
    addMethod(std::move(methodName), member);
    return *this;
  }
  template <typename M>
  Class&& method(std::string methodName, M member) && {
    addMethod(std::move(methodName), member);
    return std::move(*this);
  }

  const std::string& name() const { return name_; }

  // The wire identity of the method `member` points to. Throws ValueError when the declaration does not
  // list it (the message says how to add it).
  template <typename M>
  const MethodInfo& methodFor(M member) const {
    static_assert(std::is_member_function_pointer_v<M>, "Class::methodFor takes a pointer to a member function");
    for (const auto& declared : methods_) {
      if (declared.memberType == std::type_index(typeid(M)) && declared.matches(&member)) return declared.info;
    }
    DG_CHECK(false, "rpc::Class '", name_, "' declares no method for this member function pointer (",
             methodSignatureText<M>(name_, "?"), "); list it in the declaration with .method(\"name\", &",
             name_, "::name)");
    return methods_.front().info;  // unreachable
  }

  // The constructor a caller passing arguments of types Args names.
  template <typename... Args>
  std::string ctorSignature() const {
    return constructorSignatureText<std::decay_t<Args>...>(name_);
  }
  template <typename... Args>
  uint64_t ctorHash() const {
    return detail::fnv1a64(ctorSignature<Args...>());
  }

  // Every declared method's wire identity, in declaration order.
  std::vector<MethodInfo> methods() const {
    std::vector<MethodInfo> out;
    for (const auto& declared : methods_) out.push_back(declared.info);
    return out;
  }
  // Callee side (Registry::bindClass): the invokers of every declared method.
  std::vector<BoundMethod> boundMethods() const {
    std::vector<BoundMethod> out;
    for (const auto& declared : methods_) out.push_back(declared.bind());
    return out;
  }

 private:
  struct Declared {
    MethodInfo info;
    std::type_index memberType = typeid(void);
    std::function<bool(const void* member)> matches;  // *member (of memberType) == the declared pointer
    std::function<BoundMethod()> bind;
  };

  template <typename M>
  void addMethod(std::string methodName, M member) {
    using Traits = MethodTraits<M>;
    static_assert(std::is_base_of_v<typename Traits::ObjectType, T>,
                  "rpc::Class<T>::method: the member function must belong to T or a base of T");
    DG_CHECK(!methodName.empty(), "rpc::Class '", name_, "': a method name must not be empty");
    DG_CHECK(member != nullptr, "rpc::Class '", name_, "': method '", methodName, "' has a null member pointer");
    Declared declared;
    declared.info.name = std::move(methodName);
    declared.info.signature = methodSignatureText<M>(name_, declared.info.name);
    declared.info.hash = detail::fnv1a64(declared.info.signature);
    declared.info.isConst = Traits::kIsConst;
    for (const auto& other : methods_) {
      DG_CHECK(other.info.name != declared.info.name || other.info.hash != declared.info.hash, "rpc::Class '",
               name_, "': method '", declared.info.name, "' is declared twice with signature ",
               declared.info.signature);
    }
    declared.memberType = std::type_index(typeid(M));
    declared.matches = [member](const void* other) { return *static_cast<const M*>(other) == member; };
    declared.bind = [member, info = declared.info, className = name_] {
      return makeBoundMethod(className, info, member);
    };
    methods_.push_back(std::move(declared));
  }

  template <typename M>
  static BoundMethod makeBoundMethod(const std::string& className, const MethodInfo& info, M member) {
    using Traits = MethodTraits<M>;
    BoundMethod bound;
    bound.className = className;
    bound.name = info.name;
    bound.signature = info.signature;
    bound.hash = info.hash;
    bound.isConst = info.isConst;
    bound.invoke = [member, className, what = "method '" + className + "::" + info.name + "'"](
                       const ObjectHandle& handle, const DecodedMessage& message, const CallContext& ctx,
                       Executor& executor) -> Future<EncodeValueFn> {
      std::shared_ptr<T> object = handle.get<T>();
      if (!object) {
        Promise<EncodeValueFn> promise(executor);
        Error error = Error::failed(what + " called on " +
                                    (handle ? "an object of class '" + handle.className + "'" : "an empty object"));
        error.worker = ctx.callee;
        promise.setError(std::move(error));
        return promise.getFuture();
      }
      T& self = *object;
      return detail::invokeDecoded<typename Traits::Result>(
          typename Traits::WireArgs{}, what, message, ctx, executor, object, [&](auto&&... a) -> decltype(auto) {
            if constexpr (Traits::kTakesContext) {
              return (self.*member)(ctx, std::forward<decltype(a)>(a)...);
            } else {
              return (self.*member)(std::forward<decltype(a)>(a)...);
            }
          });
    };
    return bound;
  }

  std::string name_;
  std::vector<Declared> methods_;
};

namespace detail {

// Builds the BoundConstructor of T from a factory callable taking Args (optionally preceded by
// const CallContext&) and returning std::shared_ptr<T> (or something convertible to it).
template <typename T, typename... Args, typename F>
BoundConstructor makeBoundConstructor(const std::string& className, F factory) {
  constexpr bool kTakesContext = std::is_invocable_v<F&, const CallContext&, Args&&...>;
  static_assert(kTakesContext || std::is_invocable_v<F&, Args&&...>,
                "ClassBinder::factory: the factory must take the constructor's Args, optionally preceded by "
                "const CallContext&");
  BoundConstructor bound;
  bound.signature = constructorSignatureText<std::decay_t<Args>...>(className);
  bound.hash = fnv1a64(bound.signature);
  bound.construct = [factory = std::move(factory), className, signature = bound.signature](
                        const DecodedMessage& message, const CallContext& ctx) -> Result<ObjectHandle> {
    auto args = message.decodeArgs<std::decay_t<Args>...>();
    if (!args.ok()) {
      Error error = args.error();
      error.message = "bad arguments for constructor " + signature + ": " + error.message;
      error.worker = ctx.callee;
      return error;
    }
    try {
      std::shared_ptr<T> object = std::apply(
          [&](auto&... a) -> std::shared_ptr<T> {
            if constexpr (kTakesContext) {
              return factory(ctx, std::move(a)...);
            } else {
              return factory(std::move(a)...);
            }
          },
          args.value());
      if (!object) {
        Error error = Error::failed("constructor " + signature + " returned no object");
        error.worker = ctx.callee;
        return error;
      }
      return ObjectHandle::of<T>(className, std::move(object));
    } catch (...) {
      return handlerError(std::current_exception(), ctx.callee);
    }
  };
  return bound;
}

}  // namespace detail

}  // namespace distgrad::rpc
