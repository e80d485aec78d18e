// Tests of the local autograd engine: graph recording, dependency counting, accumulation, retain_graph,
// hooks, grad(), no-grad mode and graph lifetime.
#include <gtest/gtest.h>

#include <thread>

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "autograd/ops.h"

namespace distgrad::autograd {
namespace {

Tensor leaf(std::vector<double> values) {
  Tensor t = Tensor::fromVector(values, {static_cast<int64_t>(values.size())});
  t.setRequiresGrad();
  return t;
}

TEST(Engine, ChainAndProductRule) {
  Tensor a = leaf({2.0, 3.0});
  Tensor b = leaf({5.0, 7.0});
  Tensor y = sum(a * b + a);  // dy/da = b + 1, dy/db = a
  EXPECT_FALSE(y.isLeaf());
  EXPECT_TRUE(y.requiresGrad());
  distgrad::backward(y);
  EXPECT_EQ(a.grad().toVector<double>(), (std::vector<double>{6.0, 8.0}));
  EXPECT_EQ(b.grad().toVector<double>(), (std::vector<double>{2.0, 3.0}));
}

TEST(Engine, DiamondSumsBothPaths) {
  Tensor x = leaf({1.5});
  Tensor h = x * 2.0;
  Tensor y = sum(h * h + h);  // y = 4x^2 + 2x, dy/dx = 8x + 2
  distgrad::backward(y);
  EXPECT_DOUBLE_EQ(x.grad().item(), 8 * 1.5 + 2);
}

TEST(Engine, GradientsAccumulateAcrossBackwardCalls) {
  Tensor x = leaf({1.0, 2.0});
  distgrad::backward(sum(x * 3.0));
  distgrad::backward(sum(x * 3.0));
  EXPECT_EQ(x.grad().toVector<double>(), (std::vector<double>{6.0, 6.0}));
}

TEST(Engine, SecondBackwardNeedsRetainGraph) {
  Tensor x = leaf({1.0, 2.0});
  Tensor y = sum(x * x);
  distgrad::backward(y, Tensor(), /*retainGraph=*/true);
  distgrad::backward(y);
  EXPECT_EQ(x.grad().toVector<double>(), (std::vector<double>{4.0, 8.0}));
  try {
    distgrad::backward(y);
    FAIL() << "expected an error for a third backward through a freed graph";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("retainGraph"), std::string::npos) << e.what();
  }
}

TEST(Engine, ExplicitGradientAndShapeChecks) {
  Tensor x = leaf({1.0, 2.0, 3.0});
  Tensor y = x * 2.0;
  EXPECT_THROW(distgrad::backward(y), ValueError);  // non-scalar needs an explicit gradient
  EXPECT_THROW(distgrad::backward(y, Tensor::ones({2}, DType::kFloat64)), ValueError);
  EXPECT_THROW(distgrad::backward(y, Tensor::ones({3}, DType::kFloat32)), ValueError);  // dtype mismatch
  distgrad::backward(y, Tensor::fromVector(std::vector<double>{1.0, 10.0, 100.0}, {3}));
  EXPECT_EQ(x.grad().toVector<double>(), (std::vector<double>{2.0, 20.0, 200.0}));
}

TEST(Engine, BackwardOnTensorWithoutGraphFails) {
  Tensor x = Tensor::ones({1}, DType::kFloat64);
  EXPECT_THROW(distgrad::backward(x), ValueError);
}

TEST(Engine, GradDoesNotTouchLeafGrads) {
  Tensor x = leaf({3.0});
  Tensor y = sum(x * x * x);
  auto g = grad({y}, {x});
  ASSERT_EQ(g.size(), 1u);
  EXPECT_DOUBLE_EQ(g[0].item(), 27.0);
  EXPECT_FALSE(x.grad().defined());
}

TEST(Engine, GradWithRespectToIntermediate) {
  Tensor x = leaf({2.0});
  Tensor h = x * 3.0;
  Tensor y = sum(h * h);  // dy/dh = 2h = 12
  auto g = grad({y}, {h});
  EXPECT_DOUBLE_EQ(g[0].item(), 12.0);
}

TEST(Engine, NoGradGuardStopsRecording) {
  Tensor x = leaf({1.0});
  {
    NoGradGuard guard;
    Tensor y = x * 2.0;
    EXPECT_FALSE(y.requiresGrad());
    EXPECT_TRUE(y.isLeaf());
    {
      EnableGradGuard enable;
      EXPECT_TRUE((x * 2.0).requiresGrad());
    }
  }
  EXPECT_TRUE(isGradEnabled());
  EXPECT_TRUE((x * 2.0).requiresGrad());
}

TEST(Engine, DetachCutsTheGraph) {
  Tensor x = leaf({2.0});
  Tensor y = sum(x.detach() * x);  // only the second factor carries gradient: dy/dx = x.detach() = 2
  distgrad::backward(y);
  EXPECT_DOUBLE_EQ(x.grad().item(), 2.0);
  EXPECT_FALSE(x.detach().requiresGrad());
}

TEST(Engine, TensorHooksCanReplaceGradients) {
  Tensor x = leaf({1.0, 1.0});
  Tensor h = x * 2.0;
  int calls = 0;
  h.registerHook([&](const Tensor& g) {
    ++calls;
    return g * 10.0;
  });
  x.registerHook([&](const Tensor& g) {
    ++calls;
    return Tensor();  // undefined: keep the gradient unchanged
  });
  distgrad::backward(sum(h));
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(x.grad().toVector<double>(), (std::vector<double>{20.0, 20.0}));
}

TEST(Engine, RetainGradOnIntermediate) {
  Tensor x = leaf({1.0, 2.0});
  Tensor h = x * 3.0;
  h.retainGrad();
  distgrad::backward(sum(h * h));
  EXPECT_EQ(h.grad().toVector<double>(), (std::vector<double>{6.0, 12.0}));
}

TEST(Engine, NodeHooksSeeGradients) {
  Tensor x = leaf({1.0});
  Tensor y = x * 4.0;
  std::vector<double> seen;
  y.gradFn()->addPostHook([&](const std::vector<Tensor>& gradInputs, const std::vector<Tensor>& gradOutputs) {
    seen.push_back(gradOutputs[0].item());
    seen.push_back(gradInputs[0].item());
  });
  distgrad::backward(sum(y));
  EXPECT_EQ(seen, (std::vector<double>{1.0, 4.0}));
}

TEST(Engine, SetRequiresGradOnlyOnFloatLeaves) {
  Tensor x = leaf({1.0});
  Tensor y = x * 2.0;
  EXPECT_THROW(y.setRequiresGrad(), ValueError);
  EXPECT_THROW(Tensor::zeros({2}, DType::kInt64).setRequiresGrad(), ValueError);
}

TEST(Engine, GraphIsFreedWithItsOutputs) {
  Tensor x = leaf({1.0});
  std::weak_ptr<Node> node;
  {
    Tensor y = x * 2.0;
    node = y.gradFn();
    EXPECT_FALSE(node.expired());
  }
  EXPECT_TRUE(node.expired()) << "a node must not outlive the tensors that reference it (no cycles)";
}

TEST(Engine, UnusedOutputOfMultiOutputNodeGetsZeros) {
  Tensor x = leaf({1.0, 2.0, 3.0, 4.0});
  auto parts = split(x, 2, 0);
  distgrad::backward(sum(parts[1] * 5.0));
  EXPECT_EQ(x.grad().toVector<double>(), (std::vector<double>{0.0, 0.0, 5.0, 5.0}));
}

TEST(Engine, LeafStealsAnUnsharedGradientInsteadOfCopying) {
  Tensor x = leaf({1.0, 2.0});
  void* produced = nullptr;
  Tensor y = recordOp("Probe", {x}, x.detach().cloneData(), [&](const std::vector<Tensor>& g, const Node&) {
    Tensor fresh = g[0].cloneData();
    produced = fresh.rawData();
    return std::vector<Tensor>{fresh};
  });
  distgrad::backward(y, Tensor::ones({2}, DType::kFloat64));
  ASSERT_NE(produced, nullptr);
  EXPECT_EQ(x.grad().rawData(), produced) << "the gradient buffer was copied into .grad";
}

TEST(Engine, ConcurrentBackwardsIntoSharedLeaf) {
  Tensor w = leaf({1.0, 1.0});
  constexpr int kThreads = 4;
  constexpr int kIters = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kIters; ++i) distgrad::backward(sum(w * 2.0));
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(w.grad().toVector<double>(), (std::vector<double>(2, 2.0 * kThreads * kIters)));
}

TEST(Gradcheck, DetectsAWrongFormula) {
  Tensor x = leaf({0.3, -0.7});
  // A node whose backward is deliberately wrong (returns 2g instead of 3g for y = 3x).
  auto wrong = [](const std::vector<Tensor>& in) {
    Tensor out = in[0].detach().cloneData();
    out.copyFrom(mul(in[0].detach(), 3.0));
    return recordOp("WrongBackward", {in[0]}, out,
                    [](const std::vector<Tensor>& g, const Node&) { return std::vector<Tensor>{mul(g[0], 2.0)}; });
  };
  auto r = gradcheck(wrong, {x});
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("mismatch"), std::string::npos) << r.message;
  auto right = [](const std::vector<Tensor>& in) { return mul(in[0], 3.0); };
  EXPECT_TRUE(gradcheck(right, {x}).ok);
}

}  // namespace
}  // namespace distgrad::autograd
