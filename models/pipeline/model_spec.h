// ModelSpec: a model of the zoo described by value, so that every worker of a pipeline can build the same
// one (same architecture, same initial weights from the same seed) without shipping weights, and the
// model cut into "units": a flat list of modules whose composition, in order, is exactly model.forward.
// Pipelines split the units into contiguous stages (models/pipeline/partition.h).
//
//   ModelSpec spec{.name = "resnet18", .baseWidth = 16, .seed = 7};
//   auto model = buildModel(spec);
//   auto units = modelUnits(spec, model);   // stem, 8 BasicBlocks, head: 10 units sharing model's weights
//
// Units: ResNet-18/50 = the stem, every block of layer1..layer4, the head (avgpool, flatten, fc); MLP = each
// Linear with the activation that follows it (the first unit also flattens image inputs, as MLP::forward
// does); LeNet-5 = [conv, relu, pool], [conv, relu, pool, flatten], [fc, relu], [fc, relu], [fc].
// Thread-safety: ModelSpec is a plain value. The modules built are ordinary modules (models/nn/module.h:
// not thread-safe); the units of one model share its submodules, so units of one model may run on
// different threads at once only if they are different units.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/nn/module.h"

namespace distgrad::models::pipeline {

struct ModelSpec {
  std::string name = "resnet18";  // "resnet18" | "resnet50" | "mlp" | "lenet5"
  int64_t numClasses = 10;
  int64_t inChannels = 1;
  int64_t imageSize = 28;                    // input side (MLP input = inChannels * imageSize^2; LeNet-5 needs 28)
  int64_t baseWidth = 16;                    // ResNets (64 = torchvision's; small widths keep CPU runs short)
  std::string stem = "cifar";                // ResNets: "cifar" (3x3, no pool: right for 28x28) | "imagenet"
  std::vector<int64_t> hidden = {256, 128};  // MLP hidden sizes
  uint64_t seed = 0;                         // same seed -> same initial weights on every worker

  template <class V>
  void visitFields(V& v) {
    v("name", name);
    v("numClasses", numClasses);
    v("inChannels", inChannels);
    v("imageSize", imageSize);
    v("baseWidth", baseWidth);
    v("stem", stem);
    v("hidden", hidden);
    v("seed", seed);
  }
  // Throws ValueError naming the field, its value and what is expected.
  void validate() const;
  // "resnet18(width 16, cifar stem, 10 classes)", "mlp(784-256-128-10)", "lenet5(10 classes)".
  std::string describe() const;
};

// The model `spec` describes, initialised from spec.seed (validates the spec first).
std::shared_ptr<Module> buildModel(const ModelSpec& spec);

// The model as a flat list of units whose composition (in order) is exactly model->forward (same values,
// same autograd graph). The units share the model's submodules and parameters. `model` must be what
// buildModel(spec) returns (ValueError otherwise).
std::vector<std::shared_ptr<Module>> modelUnits(const ModelSpec& spec, const std::shared_ptr<Module>& model);

// Number of units modelUnits returns for `spec` (without building the model).
int64_t numUnits(const ModelSpec& spec);

}  // namespace distgrad::models::pipeline
