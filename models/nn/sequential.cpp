#include "models/nn/sequential.h"

namespace distgrad::models {

Sequential::Sequential(std::vector<std::shared_ptr<Module>> modules) : Module("Sequential") {
  for (auto& m : modules) add(std::move(m));
}

Sequential& Sequential::add(std::shared_ptr<Module> module) { return add(std::to_string(modules_.size()), std::move(module)); }

Sequential& Sequential::add(const std::string& name, std::shared_ptr<Module> module) {
  registerModule(name, module);
  modules_.push_back(std::move(module));
  return *this;
}

Tensor Sequential::forward(const Tensor& input) {
  Tensor x = input;
  for (auto& m : modules_) x = m->forward(x);
  return x;
}

const std::shared_ptr<Module>& Sequential::operator[](size_t index) const {
  DG_CHECK(index < modules_.size(), typeName(), ": index ", index, " out of range (", modules_.size(), " modules)");
  return modules_[index];
}

}  // namespace distgrad::models
