// A Horovod-style layer over rpc/collectives, for converting a single-worker training program with a
// handful of lines (docs/collectives.md, "Converting a single-worker program"):
//
//   auto hvd = models::Horovod::init();                       // agent from the environment (distgrad-run)
//   models::optim::Adam inner(model->parameters(), {.learningRate = 1e-3 * hvd->size()});
//   models::HorovodOptimizer optimizer(inner, *hvd);            // step(): all-reduce .grad (mean), then step
//   hvd->broadcastParameters(*model);                          // every rank starts from rank 0's weights
//   ... optimizer.zeroGrad(); backward(loss); optimizer.step(); ...
//   double loss = hvd->metricAverage(localLoss);               // the mean over ranks
//   if (hvd->rank() == 0) saveCheckpoint(*model, path);
//
// Not a singleton (distgrad has none): init() returns the object that owns the agent and the world group,
// and the program passes it where it is needed. HorovodOptimizer all-reduces every gradient after
// backward in one flat buffer (Horovod's tensor fusion); DistributedDataParallel overlaps that with
// backward instead and is the faster choice for one model.
// Thread-safety: collectives must be issued in the same order on every rank, so one thread drives it.
#pragma once

#include <memory>
#include <vector>

#include "models/nn/module.h"
#include "models/optim/optimizer.h"
#include "rpc/agent.h"
#include "rpc/collectives/process_group.h"

namespace distgrad::models {

class Horovod {
 public:
  // Starts an agent from the environment (rpc::Options::fromEnv(): distgrad-run, torchrun, Slurm, Open MPI)
  // with `registry` plus the collectives' functions, and makes the world group.
  static std::unique_ptr<Horovod> init(rpc::Registry registry = {});
  // Uses an agent started elsewhere (its registry must have rpc::collectives::install).
  explicit Horovod(rpc::Agent& agent);
  ~Horovod();  // shuts the owned agent down (gracefully)
  Horovod(const Horovod&) = delete;
  Horovod& operator=(const Horovod&) = delete;

  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  rpc::Agent& agent() { return *agent_; }
  rpc::collectives::ProcessGroup& group() { return *group_; }

  // Overwrites every parameter and buffer of `module` with root's.
  void broadcastParameters(Module& module, int root = 0);
  // The mean of `value` over ranks.
  double metricAverage(double value);

 private:
  std::unique_ptr<rpc::Agent> owned_;
  rpc::Agent* agent_;
  std::unique_ptr<rpc::collectives::ProcessGroup> group_;
};

// Wraps an optimizer: step() averages the parameters' .grad over ranks (one all-reduce of all gradients
// packed together), then steps the wrapped optimizer. A parameter without .grad on this rank contributes
// zeros (and gets the average), so ranks never disagree on the collective.
class HorovodOptimizer {
 public:
  HorovodOptimizer(optim::Optimizer& inner, Horovod& hvd,
                   rpc::collectives::WireCompression compression = rpc::collectives::WireCompression::kNone);
  void step();
  void zeroGrad() { inner_->zeroGrad(); }
  optim::Optimizer& inner() { return *inner_; }

 private:
  optim::Optimizer* inner_;
  Horovod* hvd_;
  rpc::collectives::WireCompression compression_;
};

}  // namespace distgrad::models
