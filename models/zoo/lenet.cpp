#include "models/zoo/lenet.h"

#include "models/nn/activation.h"
#include "models/nn/conv.h"
#include "models/nn/flatten.h"
#include "models/nn/linear.h"
#include "models/nn/pooling.h"

namespace distgrad::models {

LeNet5::LeNet5(tensor::Generator& gen, int64_t numClasses, int64_t inChannels) : Sequential("LeNet5") {
  DG_CHECK(numClasses > 0 && inChannels > 0, "LeNet5: numClasses and inChannels must be > 0, got ", numClasses,
           " and ", inChannels);
  add(std::make_shared<Conv2d>(inChannels, 6, 5, gen, /*stride=*/1, /*padding=*/2));
  add(std::make_shared<ReLU>());
  add(std::make_shared<MaxPool2d>(2));
  add(std::make_shared<Conv2d>(6, 16, 5, gen));
  add(std::make_shared<ReLU>());
  add(std::make_shared<MaxPool2d>(2));
  add(std::make_shared<Flatten>());
  add(std::make_shared<Linear>(16 * 5 * 5, 120, gen));
  add(std::make_shared<ReLU>());
  add(std::make_shared<Linear>(120, 84, gen));
  add(std::make_shared<ReLU>());
  add(std::make_shared<Linear>(84, numClasses, gen));
}

}  // namespace distgrad::models
