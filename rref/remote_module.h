// RemoteModule<M>: a module constructed and run on another worker (ARCHITECTURE §2, issue 4). Underneath it
// is an RRef<M> (the module object stays at its owner) plus its placement; forward() is a method call on that
// RRef, remoteParameters() hands out RRefs to the owner's parameter tensors (for a DistributedOptimizer).
//
// Declaring a module type (a header both sides include), binding it on the workers that may own one, using it:
//   inline const rpc::Class<Linear> kLinearClass = rref::moduleClass<Linear>("Linear");  // declares forward
//   DG_REMOTE_MODULE(Linear, kLinearClass);                     // global scope (ties Linear to kLinearClass)
//   rref::bindRemoteModule(reg, kLinearClass).factory<int64_t, int64_t, uint64_t>(makeLinear);  // callee
//   auto lin = RemoteModule<Linear>::create(rrefs, "worker1", int64_t{4}, int64_t{2}, uint64_t{7});
//   Tensor y = lin.forward(x);  rpc::Future<Tensor> f = lin.forwardAsync(x);
//   RRef<Tensor> yRef = lin.forwardRemote(xOrRRef...);          // result kept at the owner (pipelined)
//   std::vector<RRef<Tensor>> params = lin.remoteParameters();  // owned by worker1, alias its parameters
// A RemoteModule may be an argument or result of any RPC (it travels as its RRef, forked like any RRef).
//
// Requirements on M: a member `forward` (not overloaded: `&M::forward` must name one function; its
// arguments and result need rpc codecs) and `parameters()` returning a range of Tensor. models::Module and
// every module in models/ qualify. Users who declare the rpc::Class themselves must list "forward" as
// `.method("forward", &M::forward)` (the same member pointer type RemoteModule calls through), and bind it
// with bindRemoteModule (a plain Registry::bindClass serves forward but not remoteParameters).
//
// Layering: this header is generic over M and includes nothing from models/, so dg_rref does not depend on
// dg_models (models stays free of rpc); a program that instantiates RemoteModule<models::Linear> links both.
//
// Placement: "worker", "worker/cpu", "worker/cuda" (= cuda:0) or "worker/cuda:N". With a CUDA placement,
// create() constructs the module at the owner, then asks the owner to move it to the device (M::to(Device),
// which models::Module provides) and waits for that answer: a device the owner does not have is a clear
// error from the owner (naming it and its device count), raised by create(). Arguments of forward travel
// like any RPC argument: CUDA tensors need a device map to the owner (rpc/device_map.h, docs/cuda.md).
//
// Thread-safety: a RemoteModule is a value (copies share one RRef); its methods may be called from any
// thread, and the sync ones block (never call them on an executor thread: use the Async forms there). At
// the owner, calls run on executor threads: forward calls from different callers may run concurrently on
// one module, exactly as methods of any remote object (rpc/class.h). Modules whose forward mutates state
// (BatchNorm in training, Dropout) need their callers to serialise forward calls.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "rpc/agent.h"
#include "rpc/class.h"
#include "rpc/device_map.h"
#include "rpc/codec.h"
#include "rpc/error.h"
#include "rpc/function.h"
#include "rpc/future.h"
#include "rpc/registry.h"
#include "rref/context.h"
#include "rref/rref.h"
#include "tensor/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

namespace distgrad::rref {

// The rpc::Class declaration of module type M with its "forward" method; chain .method(...) for more.
template <typename M>
rpc::Class<M> moduleClass(std::string name) {
  return rpc::Class<M>(std::move(name)).method("forward", &M::forward);
}

// Ties M to its declaration (DG_RREF_CLASS; the RRef<M> underneath a RemoteModule<M> needs it).
#define DG_REMOTE_MODULE(Type, declaration) DG_RREF_CLASS(Type, declaration)

// Where a RemoteModule lives: "worker" or "worker/device".
struct ModulePlacement {
  std::string worker;
  std::string device = "cpu";  // normalised: "cpu" or "cuda:N"
  tensor::Device deviceValue;

  // Throws ValueError for an empty worker, a second '/', and a device other than cpu, cuda, cuda:N (N a
  // decimal in [0, 64)). Whether the owner has the device is the owner's to say (RemoteModule::create).
  static ModulePlacement parse(const std::string& placement) {
    ModulePlacement out;
    const auto slash = placement.find('/');
    out.worker = placement.substr(0, slash);
    DG_CHECK(!out.worker.empty(), "RemoteModule: placement '", placement,
             "' names no worker (expected \"worker\" or \"worker/device\")");
    if (slash != std::string::npos) {
      const std::string device = placement.substr(slash + 1);
      DG_CHECK(device.find('/') == std::string::npos, "RemoteModule: placement '", placement,
               "' has more than one '/' (expected \"worker\" or \"worker/device\")");
      out.deviceValue = rpc::parseDevice(device, "RemoteModule: placement '" + placement + "'");
    }
    out.device = out.deviceValue.str();
    return out;
  }
};

namespace detail {

// Owner side of remoteParameters: one function per module class, named after it, bound by bindRemoteModule.
// It takes the module's RRefId, not an RRef<M>: the caller keeps its own reference until the reply, exactly
// as method calls on an RRef do (Note [Promise pipelining]), which costs no fork and no fork request. (An
// RRef argument would be safe too: a call nobody decodes settles its forks, Note [Unclaimed references].)
template <typename M>
const rpc::Function<std::vector<RRef<Tensor>>(RRefId)>& parametersFunction() {
  static const rpc::Function<std::vector<RRef<Tensor>>(RRefId)> fn{"dg.remote_module.parameters/" +
                                                                  ClassOf<M>::get().name()};
  return fn;
}

// Owner side of a CUDA placement (RemoteModule::create): one function per module class, like parameters.
template <typename M>
const rpc::Function<void(RRefId, std::string)>& placementFunction() {
  static const rpc::Function<void(RRefId, std::string)> fn{"dg.remote_module.place/" + ClassOf<M>::get().name()};
  return fn;
}

// Runs at the module's owner: checks this worker has the device (an error naming it and the device count
// otherwise), waits for the module to exist and moves it there with M::to(Device).
template <typename M>
rpc::Future<void> servePlacement(const rpc::CallContext& ctx, RRefId module, std::string device) {
  auto context = RRefContext::of(*ctx.agent);
  auto promise = std::make_shared<rpc::Promise<void>>(context->executor());
  auto future = promise->getFuture();
  auto fail = [&](const std::string& message) {
    promise->setError(rpc::Error::failed("RemoteModule: " + message).onWorker(context->name()));
  };
  if (module.ownerWorkerId != context->rank()) {
    fail(context->name() + " is not the owner of the module (its owner is " +
         context->workerOfRank(module.ownerWorkerId) + ")");
    return future;
  }
  tensor::Device target;
  try {
    target = rpc::parseDevice(device, "RemoteModule placement");
  } catch (const ValueError& e) {
    fail(e.what());
    return future;
  }
  if (target.isCuda() && target.index >= tensor::cuda::deviceCount()) {
    const int count = tensor::cuda::deviceCount();
    fail("cannot place a " + ClassOf<M>::get().name() + " on " + target.str() + ": " + context->name() + " has " +
         std::to_string(count) + " CUDA device(s)" + (count == 0 ? " (no GPU, no driver, or built without CUDA)" : ""));
    return future;
  }
  context->whenResolved(module, [promise, context, target](rpc::Result<OwnedValue> owned) {
    if (!owned.ok()) return promise->setError(owned.error());
    std::shared_ptr<M> object = typedValue<M>(owned.value());
    if (!object) {
      return promise->setError(rpc::Error::failed("RemoteModule: the owned object is not a " + ClassOf<M>::get().name())
                                   .onWorker(context->name()));
    }
    if constexpr (requires(M& m, tensor::Device d) { m.to(d); }) {
      try {
        object->to(target);
      } catch (const std::exception& e) {
        return promise->setError(rpc::Error::failed(std::string("RemoteModule: moving the ") + ClassOf<M>::get().name() +
                                                    " to " + target.str() + " failed: " + e.what())
                                     .onWorker(context->name()));
      }
      promise->setValue();
    } else {
      promise->setError(rpc::Error::failed("RemoteModule: module class " + ClassOf<M>::get().name() +
                                           " has no to(Device), so it cannot be placed on " + target.str())
                            .onWorker(context->name()));
    }
  });
  return future;
}

// Runs at the module's owner: waits for the module to exist (the creating call may still be queued behind
// this one) and makes one owned RRef per parameter. A Tensor copy is a handle to the same storage and
// autograd slot, so each RRef's localValue() at the owner is the parameter itself.
template <typename M>
rpc::Future<std::vector<RRef<Tensor>>> serveParameters(const rpc::CallContext& ctx, RRefId module) {
  auto context = RRefContext::of(*ctx.agent);
  auto promise = std::make_shared<rpc::Promise<std::vector<RRef<Tensor>>>>(context->executor());
  auto future = promise->getFuture();
  if (module.ownerWorkerId != context->rank()) {
    promise->setError(rpc::Error::failed("RemoteModule::remoteParameters: " + context->name() +
                                         " is not the owner of the module (its owner is " +
                                         context->workerOfRank(module.ownerWorkerId) + ")")
                          .onWorker(context->name()));
    return future;
  }
  context->whenResolved(module, [promise, context](rpc::Result<OwnedValue> owned) {
    if (!owned.ok()) return promise->setError(owned.error());
    std::shared_ptr<M> object = typedValue<M>(owned.value());
    if (!object) {
      return promise->setError(rpc::Error::failed("RemoteModule::remoteParameters: the owned object is not a " +
                                                  ClassOf<M>::get().name())
                                   .onWorker(context->name()));
    }
    std::vector<RRef<Tensor>> out;
    for (const Tensor& parameter : object->parameters()) out.push_back(context->own<Tensor>(parameter));
    promise->setValue(std::move(out));
  });
  return future;
}

}  // namespace detail

// Binds module class `cls` on a worker that may own RemoteModules of it: the class (every declared method)
// and the owner side of remoteParameters. Returns the ClassBinder for constructors (.ctor / .factory).
template <typename M>
rpc::ClassBinder<M> bindRemoteModule(rpc::Registry& registry, const rpc::Class<M>& cls) {
  DG_CHECK(&cls == &ClassOf<M>::get(), "bindRemoteModule: class '", cls.name(),
           "' is not the declaration DG_REMOTE_MODULE tied to its type ('", ClassOf<M>::get().name(), "')");
  registry.bind(detail::parametersFunction<M>(), &detail::serveParameters<M>);
  registry.bind(detail::placementFunction<M>(), &detail::servePlacement<M>);
  return registry.bindClass(cls);
}

template <typename M>
class RemoteModule {
 public:
  using Module = M;
  RemoteModule() = default;
  RemoteModule(RRef<M> module, std::string device) : module_(std::move(module)), device_(std::move(device)) {}

  // Constructs an M on the placement's worker with the constructor (or factory) the worker bound for these
  // argument types; returns at once (the owner constructs when the call arrives; calls made meanwhile wait
  // there). Throws ValueError for a bad placement or an unknown worker (naming the workers); a constructor
  // error reaches every later call.
  template <typename... A>
  static RemoteModule create(const std::shared_ptr<RRefContext>& rrefs, const std::string& placement,
                             A&&... ctorArgs) {
    DG_CHECK(rrefs != nullptr, "RemoteModule::create: no RRefContext");
    const ModulePlacement where = ModulePlacement::parse(placement);
    (void)rrefs->rankOf(where.worker);  // an unknown worker: ValueError naming the workers, before any send
    RemoteModule out(rrefs->remote<M>(where.worker, std::forward<A>(ctorArgs)...), where.device);
    if (where.deviceValue.isCuda()) {
      // The owner moves the module and answers; waiting here makes every later call see it on the device
      // and surfaces a missing device (or a constructor error) now, as an RpcError from the owner.
      std::optional<rpc::Future<void>> placed;
      const bool sent = rrefs->withAgent([&](rpc::Agent& agent) {
        placed.emplace(agent.rpcAsync(where.worker, detail::placementFunction<M>(), out.module_.id(), where.device));
      });
      DG_CHECK(sent, "RemoteModule::create: agent ", rrefs->name(), " is shut down");
      placed->get();
    }
    return out;
  }
  template <typename... A>
  static RemoteModule create(rpc::Agent& agent, const std::string& placement, A&&... ctorArgs) {
    return create(RRefContext::of(agent), placement, std::forward<A>(ctorArgs)...);
  }

  bool valid() const { return module_.valid(); }
  const std::string& owner() const { return module_.owner(); }
  const std::string& device() const { return device_; }
  const RRef<M>& moduleRRef() const { return module_; }

  // M::forward at the owner; the result comes back by value.
  template <typename... A>
  auto forwardAsync(A&&... args) const {
    return module_.rpcAsync(&M::forward, std::forward<A>(args)...);
  }
  template <typename... A>
  auto forward(A&&... args) const {
    return module_.waitForOwner(forwardAsync(std::forward<A>(args)...));
  }
  // M::forward at the owner, its result kept there as a new RRef (chain further remote calls on it without
  // a round trip each).
  template <typename... A>
  auto forwardRemote(A&&... args) const {
    return module_.remote(&M::forward, std::forward<A>(args)...);
  }

  // RRefs to the owner's parameter tensors (in M::parameters() order), owned by the module's owner. Each
  // call makes new references to the same tensors.
  rpc::Future<std::vector<RRef<Tensor>>> remoteParametersAsync() const {
    using Params = std::vector<RRef<Tensor>>;
    auto context = checked().state()->context;
    const std::string owner = module_.owner();
    // The module's id, not a forked RRef (see parametersFunction); `keep` holds this worker's reference
    // until the owner answered, so the module cannot be freed while the call waits there.
    std::optional<rpc::Future<Params>> call;
    const bool sent = context->withAgent([&](rpc::Agent& agent) {
      call.emplace(agent.rpcAsync(owner, detail::parametersFunction<M>(), module_.id()));
    });
    if (!sent) {
      rpc::Promise<Params> refused(context->executor());
      refused.setError(rpc::Error::failed("agent " + context->name() + " is shut down: remoteParameters refused"));
      return refused.getFuture();
    }
    return std::move(*call).then(
        rpc::kInlineSafe,
        [context, owner, keep = module_.state(), cls = ClassOf<M>::get().name()](rpc::Result<Params>&& r) {
          if (r.ok()) return std::move(r);
          rpc::Error error = r.error();
          if (error.kind == rpc::ErrorKind::kUnimplemented &&
              error.message.find(detail::parametersFunction<M>().name()) != std::string::npos) {
            error.message += " (bind module class '" + cls + "' with rref::bindRemoteModule on " + owner + ")";
          } else if (error.kind == rpc::ErrorKind::kDisconnected && (error.worker == owner || error.worker.empty())) {
            error = context->ownerLost(owner, error);
          }
          return rpc::Result<Params>(std::move(error));
        });
  }
  std::vector<RRef<Tensor>> remoteParameters() const { return remoteParametersAsync().get(); }

 private:
  const RRef<M>& checked() const {
    DG_CHECK(module_.valid(), "RemoteModule: used an empty RemoteModule");
    return module_;
  }
  RRef<M> module_;
  std::string device_ = "cpu";
};

}  // namespace distgrad::rref

namespace distgrad::rpc {

// A RemoteModule travels as (module RRef, device): the RRef is forked like any RRef (docs/rref_protocol.md).
template <typename M>
struct Codec<rref::RemoteModule<M>> {
  using Wire = std::tuple<rref::RRef<M>, std::string>;
  static std::string signature() { return "remote_module<" + Codec<Wire>::signature() + ">"; }
  static void encode(wire::Value::Builder out, const rref::RemoteModule<M>& value, EncodeContext& ctx) {
    if (!value.valid()) throw CodecError("cannot send an empty RemoteModule");
    Codec<Wire>::encode(out, Wire(value.moduleRRef(), value.device()), ctx);
  }
  static rref::RemoteModule<M> decode(wire::Value::Reader in, DecodeContext& ctx) {
    auto [module, device] = Codec<Wire>::decode(in, ctx);
    return rref::RemoteModule<M>(std::move(module), std::move(device));
  }
};

}  // namespace distgrad::rpc
