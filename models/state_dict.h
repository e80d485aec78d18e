// StateDict: the ordered name -> Tensor mapping that describes a model's persistent state.
//
// Modules produce one (parameters, then buffers, in registration order, with dotted names such as
// "layer1.0.conv1.weight"), checkpoints write and read one, and Module::loadStateDict copies one back into a
// model. Order is kept because it is part of what a user sees (printing, checkpoint layout) and lookups are
// by name through an index. The tensors are handles: a StateDict taken from a module aliases the module's
// storage, exactly like PyTorch's state_dict().
// Thread-safety: a value type; concurrent reads are safe, mutation needs external synchronisation.
#pragma once

#include <cstddef>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace distgrad::models {

class StateDict {
 public:
  using Entry = std::pair<std::string, Tensor>;

  StateDict() = default;

  // Appends an entry; a duplicate or empty name, or an undefined tensor, is a ValueError.
  void insert(std::string name, Tensor value);
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // The tensor stored under `name`; a missing name is a ValueError that names it.
  const Tensor& at(const std::string& name) const;
  // nullptr when absent.
  const Tensor* find(const std::string& name) const;

  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  std::vector<std::string> keys() const;
  const std::vector<Entry>& entries() const { return entries_; }
  std::vector<Entry>::const_iterator begin() const { return entries_.begin(); }
  std::vector<Entry>::const_iterator end() const { return entries_.end(); }

 private:
  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace distgrad::models
