// Optimizer: the base of first-order optimizers that update a fixed list of parameter tensors in place.
//
// step() takes each parameter's .grad (skipping parameters without one); step(grads) takes one gradient per
// parameter explicitly (undefined ones skipped) — the distributed optimizer uses this with the gradients of
// one distributed-autograd context, which never live in .grad. Updates write the parameters' storage
// directly under NoGradGuard with tight loops over raw pointers (parameters must be contiguous float32 or
// float64 leaves), so the autograd graph never sees them and modules keep their tensor handles.
// Per-parameter state (momentum buffers, Adam moments) is allocated lazily on a parameter's first update.
//
// Devices. Parameters may live on the CPU or on CUDA devices (several devices in one optimizer are fine:
// each parameter is updated where it lives). A CUDA parameter is updated by one fused kernel
// (models/cuda_kernels.h) on the calling thread's current stream of its device, with its state on the same
// device; gradients must be on the parameter's device (a CPU gradient for a CUDA parameter, or the reverse,
// is a ValueError naming both devices, raised before anything is updated). As in PyTorch, build the
// optimizer after Module::to(device): Module::to keeps each parameter's identity, so an optimizer built
// before still updates the right tensors, but state it already created stays on the old device and its
// next step() is a clear error (save stateDict, build a new optimizer, load it: loadStateDict puts every
// state tensor on its parameter's device). stateDict() copies state on its device; checkpoints copy it to
// the host when they write (models/checkpoint.h).
// stateDict()/loadStateDict() save and restore it (plus the learning rate and step count) so training can
// resume from a checkpoint: keys are "learning_rate", "step_count" and "<param index>.<field>", e.g.
// "3.momentum_buffer", "3.exp_avg", "3.step".
// Thread-safety: not thread-safe; one step at a time per optimizer. Distinct optimizers over distinct
// parameters may step concurrently.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "models/state_dict.h"
#include "tensor/tensor.h"

namespace distgrad::models::optim {

class Optimizer {
 public:
  Optimizer(std::vector<Tensor> parameters, double learningRate, std::string name);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update from the parameters' .grad.
  void step();
  // One update from explicit gradients, grads[i] for parameters()[i] (same shape and dtype; undefined =
  // no gradient, the parameter is left alone and its state does not advance).
  void step(const std::vector<Tensor>& grads);
  // Sets every parameter's .grad to undefined.
  void zeroGrad();

  double learningRate() const { return learningRate_; }
  void setLearningRate(double learningRate);
  const std::vector<Tensor>& parameters() const { return parameters_; }
  const std::string& name() const { return name_; }
  // Number of step() calls so far.
  int64_t stepCount() const { return stepCount_; }

  // The optimizer's state (copies, safe to keep while training continues).
  StateDict stateDict() const;
  // Restores a state produced by stateDict() of the same kind of optimizer over parameters of the same
  // shapes. Validates everything first (unknown or missing keys, shapes, dtypes, per-parameter state that
  // is only partly present) and changes nothing on error.
  void loadStateDict(const StateDict& state);

 protected:
  // Updates parameters_[index] with `grad` (contiguous, same shape and dtype as the parameter).
  virtual void update(size_t index, const Tensor& param, const Tensor& grad) = 0;

  // Per-parameter state, for stateDict/loadStateDict. A parameter either has every field or none (before
  // its first update).
  struct StateField {
    std::string name;
    bool isStepCounter;  // an int64 scalar; otherwise a tensor shaped and typed like the parameter
  };
  virtual std::vector<StateField> stateFields() const { return {}; }
  // The field's current value (undefined when the parameter has no state yet).
  virtual Tensor getState(size_t index, const std::string& field) const { return Tensor(); }
  // Installs a validated value (the optimizer takes ownership of `value`).
  virtual void setState(size_t index, const std::string& field, const Tensor& value) {}
  // Drops a parameter's state (it restarts as if never updated).
  virtual void resetState(size_t index) {}
  // A state tensor for `param`: its shape, dtype and device; zero-filled when `zeroed` (on a CUDA device on
  // the current stream), otherwise uninitialised.
  Tensor newState(const Tensor& param, bool zeroed) const;

 private:
  // Throws if parameter `index` has state on another device than the parameter (moved after stepping).
  void checkStateDevice(size_t index) const;
  std::vector<Tensor> parameters_;
  double learningRate_;
  std::string name_;
  int64_t stepCount_ = 0;
};

}  // namespace distgrad::models::optim
