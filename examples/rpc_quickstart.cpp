// The RPC quick start of README.md, as a program: two workers, a remote function, an async call and a
// module living on the other worker. Run it on local workers with the launcher:
//   build/tools/distgrad-run --nproc 2 -- build/examples/rpc_quickstart
// Rank 0 drives; rank 1 serves until rank 0 is done (the graceful shutdown is a barrier of both).
#include <cstdio>

#include "autograd/ops.h"
#include "models/nn/linear.h"
#include "rpc/agent.h"
#include "rref/remote_module.h"
#include "rref/rref.h"

namespace distgrad::examples {
// A header every worker includes: functions and classes by name, checked by a signature hash on the wire.
inline const rpc::Function<Tensor(Tensor, Tensor)> kAdd{"add"};
inline const rpc::Class<models::Linear> kLinear = rref::moduleClass<models::Linear>("Linear");
}  // namespace distgrad::examples
DG_REMOTE_MODULE(distgrad::models::Linear, distgrad::examples::kLinear);

int main() {
  using namespace distgrad;
  using examples::kAdd;
  using examples::kLinear;
  rpc::Registry reg;  // explicit, no static self-registration
  reg.bind(kAdd, [](Tensor a, Tensor b) { return a + b; });
  rref::RRefContext::install(reg);  // the RRef protocol's own functions
  rref::bindRemoteModule(reg, kLinear).factory<int64_t, int64_t, uint64_t>([](int64_t in, int64_t out, uint64_t seed) {
    tensor::Generator gen(seed);
    return std::make_shared<models::Linear>(in, out, gen);
  });
  auto agent = rpc::Agent::start(rpc::Options::fromEnv(), reg);  // RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...

  if (agent->rank() == 0) {
    Tensor a = Tensor::full({2, 2}, 1.0);
    Tensor b = Tensor::full({2, 2}, 2.0);
    Tensor c = agent->rpcSync("worker1", kAdd, a, b);                // errors throw rpc::RpcError
    rpc::Future<Tensor> f = agent->rpcAsync("worker1", kAdd, c, b);  // then() / wait() / co_await
    std::printf("add on worker1: %g, then %g\n", c.toVector<float>()[0], f.get().toVector<float>()[0]);

    auto rrefs = rref::RRefContext::of(*agent);
    auto layer = rref::RemoteModule<models::Linear>::create(rrefs, "worker1", int64_t{4}, int64_t{3}, uint64_t{7});
    Tensor y = layer.forward(Tensor::full({1, 4}, 1.0));  // runs on worker1
    std::vector<rref::RRef<Tensor>> params = layer.remoteParameters();
    std::printf("Linear(4, 3) on %s: output of shape [%lld, %lld], %zu parameter RRefs owned by %s\n",
                layer.owner().c_str(), static_cast<long long>(y.shape()[0]), static_cast<long long>(y.shape()[1]),
                params.size(), params.at(0).owner().c_str());
  }
  agent->shutdown();  // graceful: barrier of every worker, drain in-flight calls
  return 0;
}
