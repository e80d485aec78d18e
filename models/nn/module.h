// Module: the base class of every neural-network layer and model.
//
// A module owns its parameters (leaf tensors that require grad), its buffers (persistent state that is not
// trained, e.g. BatchNorm running statistics) and its child modules (held by shared_ptr, in registration
// order). Subclasses keep their tensors as ordinary members and register them by reference, so the base
// class can enumerate them ("layer1.0.conv1.weight" dotted names), convert them (toDType) and load new values
// into them (loadStateDict) while the subclass's forward() keeps using its own members. Because the base
// class stores pointers to those members, modules are neither copyable nor movable: create them with
// std::make_shared and share them.
// Thread-safety: a module is not thread-safe. forward() may mutate state (BatchNorm running statistics in
// training, Dropout's generator); use one module per thread or synchronise externally.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/state_dict.h"
#include "tensor/tensor.h"

namespace distgrad::models {

class Module {
 public:
  explicit Module(std::string typeName) : typeName_(std::move(typeName)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  Module(Module&&) = delete;
  Module& operator=(Module&&) = delete;

  virtual Tensor forward(const Tensor& input) = 0;
  Tensor operator()(const Tensor& input) { return forward(input); }

  // The class name ("Linear", "ResNet"), used in error messages.
  const std::string& typeName() const { return typeName_; }

  // ---- enumeration (recursive, registration order, parents before children) ----
  std::vector<Tensor> parameters() const;
  std::vector<std::pair<std::string, Tensor>> namedParameters() const;
  std::vector<Tensor> buffers() const;
  std::vector<std::pair<std::string, Tensor>> namedBuffers() const;
  // Direct children only.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> namedChildren() const;
  // Every descendant (not this module itself), depth-first in registration order, with dotted names
  // ("layer1", "layer1.0", "layer1.0.conv1", ...).
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> namedModules() const;
  std::vector<std::shared_ptr<Module>> children() const;
  // Total number of parameter elements.
  int64_t numParameters() const;

  // ---- mode (recursive) ----
  void train(bool enabled = true);
  void eval() { train(false); }
  bool isTraining() const { return training_; }

  // Sets every parameter's gradient to undefined (the cheapest form of zeroing: the next backward
  // allocates fresh gradients instead of adding into stale ones).
  void zeroGrad();

  // Converts floating-point parameters and buffers to `dtype` in place of the module's handles (a new
  // tensor replaces each one; requires-grad is kept, gradients are dropped). Integer buffers are left
  // alone. Tests use this to gradcheck modules in float64.
  void toDType(DType dtype);

  // Moves every parameter and buffer (integer ones too: num_batches_tracked) to `device`, in place: each
  // tensor keeps its identity (the same handle, requires-grad and hooks; like PyTorch's param.data swap),
  // so handles taken before the move (parameters(), an optimizer's list) see the new device; a defined
  // gradient moves along. Tensors already on `device` are left alone; a tensor registered in two places
  // moves once. An unavailable device (no GPU, a bad ordinal, a build without CUDA) is a ValueError naming
  // it, raised before anything moves. Build optimizers after to() (models/optim/optimizer.h says what an
  // optimizer built before does). Do not call it between a forward and its backward: the graph saved the
  // parameters' old storage views. Copies go through Tensor::to (synchronous with respect to the host).
  // Returns *this for chaining.
  Module& to(Device device);
  // The device of the first parameter or buffer (the CPU for a module with neither).
  Device device() const;

  // Parameters then buffers of this module, then each child's, with dotted names. The tensors alias the
  // module's storage (detached), on the module's device: read them for checkpoints (saveCheckpoint copies
  // CUDA tensors to the host), do not expect them to track a later toDType or to().
  StateDict stateDict() const;
  // Copies values from `state` into the module's existing tensors (no reallocation, so optimizers holding
  // the parameters keep working; a CPU state loads into a CUDA module and the reverse, byte for byte). Every entry is
  // validated before anything is copied: a shape or dtype mismatch is always an error; with `strict`, so is a key the
  // module lacks or a module tensor missing from `state`. The error lists every problem found, naming the keys.
  void loadStateDict(const StateDict& state, bool strict = true);

 protected:
  // Registers `slot` (a member of the subclass) as a parameter named `name`; marks it requires-grad.
  // Returns `slot` for convenience.
  Tensor& registerParameter(const std::string& name, Tensor& slot);
  // Registers `slot` as a buffer (saved in stateDict, converted by toDType, never trained).
  Tensor& registerBuffer(const std::string& name, Tensor& slot);
  // Registers a child module; returns it, typed.
  template <typename M>
  std::shared_ptr<M> registerModule(const std::string& name, std::shared_ptr<M> module) {
    addChild(name, module);
    return module;
  }

 private:
  void addChild(const std::string& name, std::shared_ptr<Module> module);
  void checkNewName(const std::string& name, const char* what) const;
  // Visits every tensor slot with its dotted name: parameters and buffers of this module, then children.
  template <typename F>
  void visitSlots(const std::string& prefix, bool params, bool buffers, F&& f) const;

  struct Slot {
    std::string name;
    Tensor* tensor;
  };
  std::string typeName_;
  std::vector<Slot> parameters_;
  std::vector<Slot> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace distgrad::models
