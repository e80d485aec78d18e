// The parameter-server side the model-parallel examples share (rnn_model_parallel, rpc_ddp_hybrid): the
// zoo modules they place on another worker, built there from their sizes and a seed, and the registry setup
// every worker of such a job needs (the RRef protocol, distributed autograd, DistributedOptimizer).
//
//   rpc::Registry reg;
//   examples::installRemoteModules(reg);
//   auto agent = rpc::Agent::start(rpc::Options::fromEnv(), reg);
//   auto table = rref::RemoteModule<models::Embedding>::create(*agent, "worker1", rows, dim, seed);
//
// Every worker of the job includes this header and calls installRemoteModules (the classes and functions
// must be bound alike everywhere). Header-only, like example_util.h.
// Thread-safety: installRemoteModules runs before the agent starts; the factories it binds run on the
// agent's executor and share nothing.
#pragma once

#include <cstdint>
#include <memory>

#include "autograd/distributed/dist_autograd.h"
#include "models/nn/embedding.h"
#include "models/nn/linear.h"
#include "models/optim/distributed_optimizer.h"
#include "rpc/registry.h"
#include "rref/remote_module.h"
#include "tensor/random.h"

namespace distgrad::examples {

// Embedding(rows, dim, seed) and Linear(in, out, seed) as RemoteModules.
inline const rpc::Class<models::Embedding> kRemoteEmbedding = rref::moduleClass<models::Embedding>("Embedding");
inline const rpc::Class<models::Linear> kRemoteLinear = rref::moduleClass<models::Linear>("Linear");

// Installs the RRef protocol, distributed autograd and the DistributedOptimizer's functions, and binds the
// two classes' factories (weights drawn from a Generator seeded with the last argument, so a module built
// remotely is the same as one built locally from the same seed).
inline void installRemoteModules(rpc::Registry& reg) {
  rref::RRefContext::install(reg);
  autograd::distributed::install(reg);
  models::optim::DistributedOptimizer::install(reg);
  rref::bindRemoteModule(reg, kRemoteEmbedding)
      .factory<int64_t, int64_t, uint64_t>([](int64_t rows, int64_t dim, uint64_t seed) {
        tensor::Generator gen(seed);
        return std::make_shared<models::Embedding>(rows, dim, gen);
      });
  rref::bindRemoteModule(reg, kRemoteLinear)
      .factory<int64_t, int64_t, uint64_t>([](int64_t in, int64_t out, uint64_t seed) {
        tensor::Generator gen(seed);
        return std::make_shared<models::Linear>(in, out, gen);
      });
}

}  // namespace distgrad::examples

DG_REMOTE_MODULE(distgrad::models::Embedding, distgrad::examples::kRemoteEmbedding);
DG_REMOTE_MODULE(distgrad::models::Linear, distgrad::examples::kRemoteLinear);
