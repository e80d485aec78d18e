// The RPC quick start of README.md, as a program: two workers, a remote function, an async call and a
// module living on the other worker. Run it on local workers with the launcher:
//   build/tools/distgrad-run --nproc 2 -- build/examples/rpc_quickstart
// Rank 0 drives; rank 1 serves until rank 0 is done (the graceful shutdown is a barrier of both).
//
//   rpc_quickstart [--device cpu|cuda[:N]]
//
// --device cuda:N puts the operands on rank 0's GPU and the remote module on worker1's ("worker1/cuda:N"):
// that needs CUDA tensors over RPC and CUDA RemoteModule placement (issue 9's RPC part); until those exist
// the run stops with their clear error. Untested on hardware.
#include <cstdio>
#include <iostream>
#include <string>

#include "autograd/ops.h"
#include "examples/example_util.h"
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

int main(int argc, char** argv) {
  using namespace distgrad;
  using examples::kAdd;
  using examples::kLinear;
  std::string deviceName = "cpu";
  examples::Flags flags("rpc_quickstart", "the README's RPC quick start on two workers");
  flags.add("--device", deviceName, examples::kDeviceHelp);
  flags.parse(argc, argv);
  const Device device = examples::deviceFromFlag(flags, deviceName);  // every worker checks its own GPU
  rpc::Registry reg;  // explicit, no static self-registration
  reg.bind(kAdd, [](Tensor a, Tensor b) { return a + b; });
  rref::RRefContext::install(reg);  // the RRef protocol's own functions
  rref::bindRemoteModule(reg, kLinear).factory<int64_t, int64_t, uint64_t>([](int64_t in, int64_t out, uint64_t seed) {
    tensor::Generator gen(seed);
    return std::make_shared<models::Linear>(in, out, gen);
  });
  auto agent = rpc::Agent::start(rpc::Options::fromEnv(), reg);  // RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...

  int status = 0;
  if (agent->rank() == 0) {
    try {
      Tensor a = Tensor::full({2, 2}, 1.0).to(device);
      Tensor b = Tensor::full({2, 2}, 2.0).to(device);
      Tensor c = agent->rpcSync("worker1", kAdd, a, b);                // errors throw rpc::RpcError
      rpc::Future<Tensor> f = agent->rpcAsync("worker1", kAdd, c, b);  // then() / wait() / co_await
      std::printf("add on worker1: %g, then %g\n", c.to(Device::cpu()).toVector<float>()[0],
                  f.get().to(Device::cpu()).toVector<float>()[0]);

      auto rrefs = rref::RRefContext::of(*agent);
      std::string placement = "worker1";  // "worker1/cuda:N" puts the module on worker1's GPU
      if (device.isCuda()) placement.append("/").append(device.str());
      auto layer = rref::RemoteModule<models::Linear>::create(rrefs, placement, int64_t{4}, int64_t{3}, uint64_t{7});
      Tensor y = layer.forward(Tensor::full({1, 4}, 1.0).to(device));  // runs on worker1
      std::vector<rref::RRef<Tensor>> params = layer.remoteParameters();
      std::printf("Linear(4, 3) on %s: output of shape [%lld, %lld], %zu parameter RRefs owned by %s\n",
                  layer.owner().c_str(), static_cast<long long>(y.shape()[0]), static_cast<long long>(y.shape()[1]),
                  params.size(), params.at(0).owner().c_str());
    } catch (const std::exception& e) {
      std::cerr << "rpc_quickstart: error: " << e.what() << "\n";
      status = 1;
    }
  }
  agent->shutdown();  // graceful: barrier of every worker, drain in-flight calls
  return status;
}
