// The Horovod-style layer: agent ownership, parameter broadcast, metric average, fused gradient average.
#include "models/parallel/horovod.h"

#include <cstring>

namespace distgrad::models {

std::unique_ptr<Horovod> Horovod::init(rpc::Registry registry) {
  rpc::collectives::install(registry);
  auto agent = rpc::Agent::start(rpc::Options::fromEnv(), registry);
  auto hvd = std::make_unique<Horovod>(*agent);
  hvd->owned_ = std::move(agent);
  return hvd;
}

Horovod::Horovod(rpc::Agent& agent)
    : agent_(&agent), group_(std::make_unique<rpc::collectives::ProcessGroup>(rpc::collectives::ProcessGroup::world(agent))) {}

Horovod::~Horovod() {
  group_.reset();
  if (owned_) owned_->shutdown();
}

void Horovod::broadcastParameters(Module& module, int root) {
  std::vector<rpc::Future<void>> futures;
  for (const Tensor& p : module.parameters()) futures.push_back(group_->broadcast(p.detach(), root));
  for (const Tensor& b : module.buffers()) {
    if (b.defined() && b.numel() > 0) futures.push_back(group_->broadcast(b.detach(), root));
  }
  for (auto& f : futures) f.get();
}

double Horovod::metricAverage(double value) {
  Tensor t = Tensor::fromVector(std::vector<double>{value}, {1});
  group_->allReduceSync(t, {rpc::collectives::ReduceOp::kMean});
  return t.item();
}

HorovodOptimizer::HorovodOptimizer(optim::Optimizer& inner, Horovod& hvd, rpc::collectives::WireCompression compression)
    : inner_(&inner), hvd_(&hvd), compression_(compression) {
  const auto& params = inner.parameters();
  DG_CHECK(!params.empty(), "HorovodOptimizer: the optimizer has no parameters");
  for (const Tensor& p : params) {
    DG_CHECK(p.dtype() == params[0].dtype(), "HorovodOptimizer: parameters must share one dtype");
  }
}

void HorovodOptimizer::step() {
  const auto& params = inner_->parameters();
  int64_t total = 0;
  for (const Tensor& p : params) total += p.numel();
  // Tensor fusion: every gradient in one buffer, one all-reduce.
  Tensor fused = Tensor::zeros({total}, params[0].dtype());
  int64_t offset = 0;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (g.defined()) {
      Tensor slot = Tensor::fromStorage(fused.storage(), p.shape(), tensor::contiguousStrides(p.shape()), offset,
                                        fused.dtype());
      slot.copyFrom(g);
    }
    offset += p.numel();
  }
  hvd_->group().allReduceSync(fused, {rpc::collectives::ReduceOp::kMean, compression_});
  offset = 0;
  for (const Tensor& p : params) {
    Tensor mean = Tensor::fromStorage(fused.storage(), p.shape(), tensor::contiguousStrides(p.shape()), offset,
                                      fused.dtype())
                      .cloneData();
    Tensor param = p;  // shares p's impl: sets p's gradient
    param.setGrad(mean);
    offset += p.numel();
  }
  inner_->step();
}

}  // namespace distgrad::models
