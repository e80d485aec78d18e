// Sequential: runs its children in order, each one's output feeding the next. Children are named "0", "1",
// ... unless added with an explicit name, so parameters read "0.weight", "features.3.bias" and so on.
// Thread-safety: see models/nn/module.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/nn/module.h"

namespace distgrad::models {

class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  explicit Sequential(std::vector<std::shared_ptr<Module>> modules);

  // Appends a module named by its position; returns *this for chaining.
  Sequential& add(std::shared_ptr<Module> module);
  Sequential& add(const std::string& name, std::shared_ptr<Module> module);

  Tensor forward(const Tensor& input) override;

  size_t size() const { return modules_.size(); }
  const std::shared_ptr<Module>& operator[](size_t index) const;
  const std::vector<std::shared_ptr<Module>>& modules() const { return modules_; }

 protected:
  explicit Sequential(std::string typeName) : Module(std::move(typeName)) {}

 private:
  std::vector<std::shared_ptr<Module>> modules_;
};

}  // namespace distgrad::models
