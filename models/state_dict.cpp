#include "models/state_dict.h"

namespace distgrad::models {

void StateDict::insert(std::string name, Tensor value) {
  DG_CHECK(!name.empty(), "StateDict::insert: empty name");
  DG_CHECK(value.defined(), "StateDict::insert: undefined tensor for '", name, "'");
  DG_CHECK(!contains(name), "StateDict::insert: duplicate name '", name, "'");
  index_.emplace(name, entries_.size());
  entries_.emplace_back(std::move(name), std::move(value));
}

const Tensor& StateDict::at(const std::string& name) const {
  const Tensor* t = find(name);
  DG_CHECK(t != nullptr, "StateDict: no entry named '", name, "'");
  return *t;
}

const Tensor* StateDict::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, value] : entries_) out.push_back(name);
  return out;
}

}  // namespace distgrad::models
