// A gradient hook registered on an intermediate (non-leaf) tensor must fire even when the caller drops its
// handle to that tensor before backward, as in PyTorch (which keeps tensor hooks on the grad_fn): the hook
// lives on the node that produced the tensor (Node::addTensorHook), not in the tensor. Found by a helper
// (issue 6) when a module registered a hook on its output and returned it through a Sequential.
#include <gtest/gtest.h>

#include "autograd/engine.h"
#include "autograd/ops.h"

namespace distgrad::autograd {
namespace {

TEST(HookLifetime, HookOnDroppedIntermediateStillFires) {
  Tensor x = Tensor::ones({2, 3});
  x.setRequiresGrad();
  Tensor w = Tensor::ones({4, 3});
  w.setRequiresGrad();
  int fired = 0;
  Tensor z;
  {
    Tensor y = mul(x, 2.0);
    y.registerHook([&](const Tensor&) {
      ++fired;
      return Tensor();
    });
    z = linear(y, w);
  }  // the handle to y is gone; the graph still runs y's gradient through MulBackward
  distgrad::backward(sum(z));
  EXPECT_EQ(fired, 1);
}

TEST(HookLifetime, HookOnKeptIntermediateFires) {
  Tensor x = Tensor::ones({2, 3});
  x.setRequiresGrad();
  int fired = 0;
  Tensor y = mul(x, 2.0);
  y.registerHook([&](const Tensor&) {
    ++fired;
    return Tensor();
  });
  distgrad::backward(sum(y));
  EXPECT_EQ(fired, 1);
}

// Each piece of a multi-output op keeps its own hook, for its own gradient only, and a replacement returned
// by a dropped piece's hook reaches the input's gradient.
TEST(HookLifetime, HooksOnDroppedPiecesOfASplitSeeTheirOwnGradient) {
  Tensor x = Tensor::arange(6);
  x.setRequiresGrad();
  std::vector<double> seen;
  Tensor total;
  {
    std::vector<Tensor> pieces = split(x, 2, 0);  // three pieces of two
    pieces[1].registerHook([&](const Tensor& g) {
      seen.push_back(g.at({0}));
      return mul(g, 10.0);
    });
    total = sum(add(mul(pieces[0], 1.0), add(mul(pieces[1], 2.0), mul(pieces[2], 3.0))));
  }
  distgrad::backward(total);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], 2.0);
  const std::vector<float> expected = {1, 1, 20, 20, 3, 3};
  EXPECT_EQ(x.grad().toVector<float>(), expected);
}

// With retainGraph, the second backward runs the kept hook again.
TEST(HookLifetime, KeptHookRunsOnEveryBackward) {
  Tensor x = Tensor::ones({3});
  x.setRequiresGrad();
  int fired = 0;
  Tensor z;
  {
    Tensor y = mul(x, 3.0);
    y.registerHook([&](const Tensor&) {
      ++fired;
      return Tensor();
    });
    z = sum(y);
  }
  distgrad::backward(z, Tensor(), /*retainGraph=*/true);
  distgrad::backward(z);
  EXPECT_EQ(fired, 2);
}

}  // namespace
}  // namespace distgrad::autograd
