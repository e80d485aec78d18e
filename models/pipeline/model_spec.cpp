#include "models/pipeline/model_spec.h"

#include <sstream>

#include "models/nn/flatten.h"
#include "models/nn/sequential.h"
#include "models/zoo/lenet.h"
#include "models/zoo/mlp.h"
#include "models/zoo/resnet.h"
#include "tensor/error.h"
#include "tensor/random.h"

namespace distgrad::models::pipeline {
namespace {

bool isResNet(const std::string& name) { return name == "resnet18" || name == "resnet50"; }

std::vector<int64_t> mlpSizes(const ModelSpec& spec) {
  std::vector<int64_t> sizes{spec.inChannels * spec.imageSize * spec.imageSize};
  sizes.insert(sizes.end(), spec.hidden.begin(), spec.hidden.end());
  sizes.push_back(spec.numClasses);
  return sizes;
}

// A Sequential of `modules` (shared, not copied).
std::shared_ptr<Module> group(std::vector<std::shared_ptr<Module>> modules) {
  return std::make_shared<Sequential>(std::move(modules));
}

}  // namespace

void ModelSpec::validate() const {
  DG_CHECK(name == "resnet18" || name == "resnet50" || name == "mlp" || name == "lenet5",
           "ModelSpec.name must be \"resnet18\", \"resnet50\", \"mlp\" or \"lenet5\", got \"", name, "\"");
  DG_CHECK(numClasses > 0, "ModelSpec.numClasses must be > 0, got ", numClasses);
  DG_CHECK(inChannels > 0, "ModelSpec.inChannels must be > 0, got ", inChannels);
  DG_CHECK(imageSize > 0, "ModelSpec.imageSize must be > 0, got ", imageSize);
  if (isResNet(name)) {
    DG_CHECK(baseWidth > 0, "ModelSpec.baseWidth must be > 0, got ", baseWidth);
    DG_CHECK(stem == "cifar" || stem == "imagenet", "ModelSpec.stem must be \"cifar\" or \"imagenet\", got \"", stem,
             "\"");
  }
  if (name == "mlp") {
    for (size_t i = 0; i < hidden.size(); ++i) {
      DG_CHECK(hidden[i] > 0, "ModelSpec.hidden[", i, "] must be > 0, got ", hidden[i]);
    }
  }
  // LeNet-5's first Linear expects 16x5x5 features, which only 28x28 inputs produce.
  DG_CHECK(name != "lenet5" || imageSize == 28, "ModelSpec.imageSize must be 28 for lenet5, got ", imageSize);
}

std::string ModelSpec::describe() const {
  std::ostringstream out;
  out << name << "(";
  if (isResNet(name)) {
    out << "width " << baseWidth << ", " << stem << " stem, " << numClasses << " classes";
  } else if (name == "mlp") {
    const std::vector<int64_t> sizes = mlpSizes(*this);
    for (size_t i = 0; i < sizes.size(); ++i) out << (i ? "-" : "") << sizes[i];
  } else {
    out << numClasses << " classes";
  }
  out << ")";
  return out.str();
}

std::shared_ptr<Module> buildModel(const ModelSpec& spec) {
  spec.validate();
  tensor::Generator gen(spec.seed);
  if (isResNet(spec.name)) {
    const ResNetConfig config{.numClasses = spec.numClasses,
                              .inChannels = spec.inChannels,
                              .baseWidth = spec.baseWidth,
                              .stem = parseResNetStem(spec.stem)};
    return spec.name == "resnet18" ? std::shared_ptr<Module>(resnet18(gen, config))
                                   : std::shared_ptr<Module>(resnet50(gen, config));
  }
  if (spec.name == "mlp") return std::make_shared<MLP>(mlpSizes(spec), gen);
  return std::make_shared<LeNet5>(gen, spec.numClasses, spec.inChannels);
}

int64_t numUnits(const ModelSpec& spec) {
  spec.validate();
  if (spec.name == "resnet18") return 1 + 2 * 4 + 1;
  if (spec.name == "resnet50") return 1 + (3 + 4 + 6 + 3) + 1;
  if (spec.name == "mlp") return static_cast<int64_t>(spec.hidden.size()) + 1;
  return 5;
}

std::vector<std::shared_ptr<Module>> modelUnits(const ModelSpec& spec, const std::shared_ptr<Module>& model) {
  spec.validate();
  DG_CHECK(model != nullptr, "modelUnits: model is null");
  std::vector<std::shared_ptr<Module>> units;
  if (isResNet(spec.name)) {
    auto net = std::dynamic_pointer_cast<ResNet>(model);
    DG_CHECK(net != nullptr, "modelUnits: spec ", spec.describe(), " needs a ResNet, got a ", model->typeName());
    const auto& stages = net->stages();  // stem, layer1..layer4, head
    DG_ASSERT(stages.size() == 6, "ResNet has ", stages.size(), " stages");
    units.push_back(stages.front());
    for (size_t layer = 1; layer <= 4; ++layer) {
      auto seq = std::dynamic_pointer_cast<Sequential>(stages[layer]);
      DG_ASSERT(seq != nullptr, "ResNet layer", layer, " is not a Sequential");
      for (const auto& block : seq->modules()) units.push_back(block);
    }
    units.push_back(stages.back());
  } else if (spec.name == "mlp") {
    auto mlp = std::dynamic_pointer_cast<MLP>(model);
    DG_CHECK(mlp != nullptr, "modelUnits: spec ", spec.describe(), " needs an MLP, got a ", model->typeName());
    DG_CHECK(mlp->sizes() == mlpSizes(spec), "modelUnits: the MLP's layer sizes differ from spec ", spec.describe());
    // MLP::forward flattens inputs of rank > 2; Flatten(1) does the same and leaves [N, D] alone.
    std::vector<std::shared_ptr<Module>> current{std::make_shared<Flatten>(1)};
    for (const auto& m : mlp->modules()) {
      current.push_back(m);
      if (m->typeName() != "Linear") {  // an activation closes the unit of the Linear before it
        units.push_back(group(std::move(current)));
        current.clear();
      }
    }
    units.push_back(group(std::move(current)));  // the last Linear (no activation after it)
  } else {
    auto lenet = std::dynamic_pointer_cast<LeNet5>(model);
    DG_CHECK(lenet != nullptr, "modelUnits: spec ", spec.describe(), " needs a LeNet5, got a ", model->typeName());
    const auto& m = lenet->modules();  // conv relu pool conv relu pool flatten fc relu fc relu fc
    DG_ASSERT(m.size() == 12, "LeNet5 has ", m.size(), " modules");
    units.push_back(group({m[0], m[1], m[2]}));
    units.push_back(group({m[3], m[4], m[5], m[6]}));
    units.push_back(group({m[7], m[8]}));
    units.push_back(group({m[9], m[10]}));
    units.push_back(group({m[11]}));
  }
  DG_ASSERT(static_cast<int64_t>(units.size()) == numUnits(spec), "modelUnits: ", units.size(), " units for ",
            spec.describe());
  return units;
}

}  // namespace distgrad::models::pipeline
