// Model zoo: architecture fidelity (shapes, torchvision parameter counts and names), stage composition,
// and short training runs that must actually learn.
#include <gtest/gtest.h>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/data/data_loader.h"
#include "models/data/synthetic.h"
#include "models/metrics.h"
#include "models/optim/adam.h"
#include "models/optim/sgd.h"
#include "models/zoo/lenet.h"
#include "models/zoo/mlp.h"
#include "models/zoo/resnet.h"
#include "tensor/random.h"

namespace distgrad::models {
namespace {

Tensor composeStages(const ResNet& net, const Tensor& x) {
  Tensor y = x;
  for (const auto& stage : net.stages()) y = stage->forward(y);
  return y;
}

void expectIdentical(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.shape(), b.shape());
  EXPECT_EQ(a.toVector<float>(), b.toVector<float>());
}

struct ZooCase {
  const char* name;
  bool bottleneck;
  ResNetStem stem;
};
// Without this, gtest prints the struct's raw bytes, padding included.
void PrintTo(const ZooCase& c, std::ostream* os) { *os << c.name; }

class ResNetShapes : public ::testing::TestWithParam<ZooCase> {};

TEST_P(ResNetShapes, ForwardShapeAndStageComposition) {
  const ZooCase c = GetParam();
  tensor::Generator gen(1);
  ResNetConfig cfg{.numClasses = 10, .stem = c.stem};
  auto net = c.bottleneck ? resnet50(gen, cfg) : resnet18(gen, cfg);
  Tensor x = tensor::normal({2, 3, 32, 32}, 0, 1, gen);

  ASSERT_EQ(net->stages().size(), 6u);
  // Shapes after each stage: the ImageNet stem divides by 4, the CIFAR stem keeps 32x32.
  const int64_t s = c.stem == ResNetStem::kImageNet ? 8 : 32;
  const int64_t e = c.bottleneck ? 4 : 1;
  const std::vector<Shape> expected{{2, 64, s, s},          {2, 64 * e, s, s},         {2, 128 * e, s / 2, s / 2},
                                    {2, 256 * e, s / 4, s / 4}, {2, 512 * e, s / 8, s / 8}, {2, 10}};
  {
    autograd::NoGradGuard noGrad;
    net->eval();
    Tensor y = x;
    for (size_t i = 0; i < 6; ++i) {
      y = net->stages()[i]->forward(y);
      EXPECT_EQ(y.shape(), expected[i]) << "stage " << i;
    }
    expectIdentical(net->forward(x), y);
  }
  // In training mode too (batch statistics), including the backward graph through every stage.
  net->train();
  Tensor composed = composeStages(*net, x);
  Tensor direct = net->forward(x);
  expectIdentical(direct, composed);
  backward(sum(direct));
  for (const auto& [name, p] : net->namedParameters()) EXPECT_TRUE(p.grad().defined()) << name;
}

INSTANTIATE_TEST_SUITE_P(Zoo, ResNetShapes,
                         ::testing::Values(ZooCase{"resnet18_imagenet", false, ResNetStem::kImageNet},
                                           ZooCase{"resnet18_cifar", false, ResNetStem::kCifar},
                                           ZooCase{"resnet50_imagenet", true, ResNetStem::kImageNet},
                                           ZooCase{"resnet50_cifar", true, ResNetStem::kCifar}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ResNet, MatchesTorchvisionCountsAndNames) {
  tensor::Generator gen(2);
  auto r18 = resnet18(gen);
  EXPECT_EQ(r18->numParameters(), 11689512);  // torchvision.models.resnet18()
  EXPECT_EQ(r18->stateDict().size(), 122u);
  auto r50 = resnet50(gen);
  EXPECT_EQ(r50->numParameters(), 25557032);  // torchvision.models.resnet50()
  EXPECT_EQ(r50->stateDict().size(), 320u);
  EXPECT_EQ(r50->featureDim(), 2048);
  const StateDict s = r50->stateDict();
  for (const char* key : {"conv1.weight", "bn1.running_var", "layer1.0.conv3.weight", "layer1.0.downsample.0.weight",
                          "layer2.3.bn2.num_batches_tracked", "layer4.2.conv2.weight", "layer3.0.downsample.1.bias",
                          "fc.weight", "fc.bias"}) {
    EXPECT_TRUE(s.contains(key)) << key;
  }
  EXPECT_EQ(s.at("layer2.0.conv2.weight").shape(), (Shape{128, 128, 3, 3}));
  EXPECT_EQ(s.at("fc.weight").shape(), (Shape{1000, 2048}));
  int convs = 0, norms = 0;
  for (const auto& [name, m] : r50->namedModules()) {
    convs += m->typeName() == "Conv2d";
    norms += m->typeName() == "BatchNorm2d";
  }
  EXPECT_EQ(convs, 53);  // 1 stem + 16 blocks x 3 + 4 downsample
  EXPECT_EQ(norms, 53);
  EXPECT_FALSE(r18->stateDict().contains("layer1.0.downsample.0.weight"));
  EXPECT_TRUE(r18->stateDict().contains("layer2.0.downsample.0.weight"));
}

TEST(ResNet, ConfigurableWidthChannelsAndStemParsing) {
  tensor::Generator gen(3);
  auto net = resnet18(gen, {.numClasses = 7, .inChannels = 1, .baseWidth = 8, .stem = parseResNetStem("cifar")});
  Tensor y = net->forward(tensor::normal({3, 1, 16, 16}, 0, 1, gen));
  EXPECT_EQ(y.shape(), (Shape{3, 7}));
  EXPECT_EQ(net->featureDim(), 64);
  EXPECT_EQ(parseResNetStem("imagenet"), ResNetStem::kImageNet);
  EXPECT_THROW(parseResNetStem("mnist"), ValueError);
  EXPECT_THROW(net->forward(Tensor::zeros({1, 3, 16, 16})), ValueError);
  // zeroInitResidual zeroes the last BN of every block.
  auto zero = resnet18(gen, {.baseWidth = 8, .zeroInitResidual = true});
  EXPECT_EQ(zero->stateDict().at("layer1.0.bn2.weight").toVector<float>(), std::vector<float>(8, 0.0f));
  EXPECT_EQ(zero->stateDict().at("layer1.0.bn1.weight").toVector<float>(), std::vector<float>(8, 1.0f));
}

TEST(LeNet5, ShapeAndParameterCount) {
  tensor::Generator gen(4);
  LeNet5 net(gen);
  EXPECT_EQ(net.numParameters(), 61706);
  EXPECT_EQ(net.forward(Tensor::zeros({3, 1, 28, 28})).shape(), (Shape{3, 10}));
}

TEST(MLP, StructureAndFlattening) {
  tensor::Generator gen(5);
  MLP mlp({12, 8, 8, 3}, gen, Activation::kTanh);
  EXPECT_EQ(mlp.size(), 5u);
  EXPECT_EQ(mlp[1]->typeName(), "Tanh");
  EXPECT_EQ(mlp.forward(Tensor::zeros({2, 3, 2, 2})).shape(), (Shape{2, 3}));
  EXPECT_THROW(MLP({4}, gen), ValueError);
}

double evaluate(Module& model, const data::TensorDataset& ds) {
  autograd::NoGradGuard noGrad;
  model.eval();
  const double acc = accuracy(model.forward(ds.inputs()), ds.labels());
  model.train();
  return acc;
}

TEST(Training, MlpLearnsSeparableBlobs) {
  tensor::Generator gen(6);
  data::TensorDataset all = data::makeGaussianBlobs(1200, 4, 8, gen, /*clusterStd=*/1.0, /*centerScale=*/3.0);
  data::TensorDataset train = all.slice(0, 1000);
  data::TensorDataset test = all.slice(1000, 200);
  MLP model({8, 32, 4}, gen);
  optim::SGD opt(model.parameters(), {.learningRate = 0.05, .momentum = 0.9});
  data::DataLoader loader(train, {.batchSize = 32, .shuffle = true, .seed = 1});
  const double before = evaluate(model, test);
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (const auto& batch : loader) {
      opt.zeroGrad();
      Tensor loss = crossEntropy(model.forward(batch.inputs), batch.labels);
      backward(loss);
      opt.step();
    }
  }
  const double after = evaluate(model, test);
  EXPECT_GT(after, 0.95) << "accuracy before training " << before;
}

TEST(Training, LeNetWithAdamLearnsRandomImageRule) {
  // The rule (sign of <x, t0 - t1> for white-noise templates) is linear but spread over every pixel, which
  // is hard for a pooled CNN: it takes a few epochs to lock on (loss ~0.69 -> ~0.44 with these seeds).
  tensor::Generator gen(7);
  data::TensorDataset ds = data::makeRandomImages(256, {1, 28, 28}, 2, gen);
  LeNet5 model(gen, 2);
  optim::Adam opt(model.parameters(), {.learningRate = 1e-3});
  data::DataLoader loader(ds, {.batchSize = 32, .shuffle = true, .seed = 2});
  double firstLoss = 0, lastLoss = 0;
  for (int epoch = 0; epoch < 8; ++epoch) {
    double total = 0;
    for (const auto& batch : loader) {
      opt.zeroGrad();
      Tensor loss = crossEntropy(model.forward(batch.inputs), batch.labels);
      backward(loss);
      // Explicit-gradient path, as the distributed optimizer uses it.
      std::vector<Tensor> grads;
      for (const auto& p : model.parameters()) grads.push_back(p.grad());
      opt.step(grads);
      total += loss.item() * static_cast<double>(batch.size());
    }
    if (epoch == 0) firstLoss = total / 256;
    lastLoss = total / 256;
  }
  EXPECT_LT(lastLoss, 0.8 * firstLoss);
  EXPECT_GT(evaluate(model, ds), 0.8);
}

}  // namespace
}  // namespace distgrad::models
