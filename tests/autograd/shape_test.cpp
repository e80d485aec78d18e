// Views and joins: views share storage and reflect writes both ways, copies happen only when the layout
// demands, values, errors naming the op, and float64 gradchecks for every differentiable op.
#include <gtest/gtest.h>

#include <functional>

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tensor/random.h"
#include "test_util.h"

namespace distgrad {
namespace {

using namespace distgrad::testing;

Tensor arange6() { return Tensor::fromVector({0, 1, 2, 3, 4, 5}, {2, 3}); }

// Writes v at a multi-index through t's own strides (the test's way to mutate a view).
void setAt(const Tensor& t, std::initializer_list<int64_t> index, float v) {
  int64_t off = 0;
  int64_t d = 0;
  for (int64_t i : index) off += i * t.strides()[d++];
  static_cast<float*>(t.rawData())[off] = v;
}

// ---------------------------------------------------------------- views

TEST(Views, ReshapeAndViewShareStorage) {
  Tensor a = arange6();
  Tensor r = reshape(a, {3, 2});
  EXPECT_TRUE(r.storage().sameAs(a.storage()));
  expectValues(r, {3, 2}, {0, 1, 2, 3, 4, 5});
  setAt(r, {2, 1}, 50);
  EXPECT_EQ(a.at({1, 2}), 50);  // a write through the view shows in the base
  setAt(a, {0, 0}, -1);
  EXPECT_EQ(r.at({0, 0}), -1);  // and the other way round
  Tensor v = view(a, {6});
  EXPECT_TRUE(v.storage().sameAs(a.storage()));
  EXPECT_EQ(v.at({5}), 50);
  // -1 inference
  EXPECT_EQ(reshape(a, {-1}).shape(), (Shape{6}));
  EXPECT_EQ(reshape(a, {3, -1}).shape(), (Shape{3, 2}));
  EXPECT_EQ(view(a, {-1, 1, 2}).shape(), (Shape{3, 1, 2}));
  EXPECT_EQ(reshape(Tensor::scalar(1), {1, 1}).shape(), (Shape{1, 1}));
  EXPECT_EQ(reshape(Tensor::zeros({1}), {}).shape(), (Shape{}));
}

TEST(Views, ReshapeCopiesOnlyWhenNeeded) {
  Tensor a = arange6();
  Tensor t = transpose(a, 0, 1);  // [3,2], not contiguous
  Tensor flat = reshape(t, {6});
  EXPECT_FALSE(flat.storage().sameAs(a.storage()));
  expectValues(flat, {6}, {0, 3, 1, 4, 2, 5});
  // a transposed tensor can still be viewed when the reshape only splits or adds unit dims
  Tensor split = reshape(t, {3, 1, 2});
  EXPECT_TRUE(split.storage().sameAs(a.storage()));
  expectValues(split, {3, 1, 2}, {0, 3, 1, 4, 2, 5});
  // a column slice: merging dims is impossible, splitting the row dim is fine
  Tensor big = reshape(Tensor::arange(24), {4, 6});
  Tensor cols = narrow(big, 1, 1, 2);  // [4,2]
  EXPECT_TRUE(reshape(cols, {2, 2, 2}).storage().sameAs(big.storage()));
  EXPECT_FALSE(reshape(cols, {8}).storage().sameAs(big.storage()));
  expectValues(reshape(cols, {8}), {8}, {1, 2, 7, 8, 13, 14, 19, 20});
  expectThrowsWith([&] { view(t, {6}); }, {"view", "[3, 2]", "reshape"});
}

TEST(Views, ToDeviceOnItsOwnDeviceIsTheTensorItself) {
  // CUDA crossings are in cuda_autograd_test.cpp (skipped without a GPU).
  Tensor a = randn({2, 3}, 1);
  Tensor same = toDevice(a, Device::cpu());
  EXPECT_EQ(same.rawData(), a.rawData());
  EXPECT_EQ(same.gradFn(), a.gradFn());
  backward(sum(same));
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().toVector<double>(), std::vector<double>(6, 1.0));
  EXPECT_THROW(toDevice(Tensor(), Device::cpu()), ValueError);
}

TEST(Views, ReshapeErrors) {
  Tensor a = arange6();
  expectThrowsWith([&] { reshape(a, {4, -1}); }, {"reshape", "[4, -1]", "[2, 3]"});
  expectThrowsWith([&] { reshape(a, {-1, -1}); }, {"reshape", "only one"});
  expectThrowsWith([&] { reshape(a, {7}); }, {"reshape", "[7]", "[2, 3]"});
  expectThrowsWith([&] { view(a, {2, -2}); }, {"view", "-2"});
  expectThrowsWith([] { reshape(Tensor::zeros({0, 3}), {0, -1}); }, {"reshape", "-1"});
}

TEST(Views, TransposePermute) {
  Tensor a = arange6();
  Tensor t = transpose(a, 0, 1);
  EXPECT_TRUE(t.storage().sameAs(a.storage()));
  expectValues(t, {3, 2}, {0, 3, 1, 4, 2, 5});
  EXPECT_EQ(t.strides(), (Shape{1, 3}));
  setAt(t, {2, 0}, 20);
  EXPECT_EQ(a.at({0, 2}), 20);
  Tensor x = reshape(Tensor::arange(24), {2, 3, 4});
  Tensor p = permute(x, {2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.at({3, 1, 2}), x.at({1, 2, 3}));
  EXPECT_EQ(permute(x, {-1, 0, 1}).shape(), (Shape{4, 2, 3}));
  EXPECT_TRUE(transpose(x, -1, 0).storage().sameAs(x.storage()));
  expectThrowsWith([&] { permute(x, {0, 0, 1}); }, {"permute", "repeats"});
  expectThrowsWith([&] { permute(x, {0, 1}); }, {"permute", "2 dims"});
  expectThrowsWith([&] { transpose(x, 0, 3); }, {"transpose", "dim 3"});
}

TEST(Views, NarrowSliceSelect) {
  Tensor x = reshape(Tensor::arange(12), {3, 4});
  Tensor n = narrow(x, 1, 1, 2);
  EXPECT_TRUE(n.storage().sameAs(x.storage()));
  expectValues(n, {3, 2}, {1, 2, 5, 6, 9, 10});
  setAt(n, {1, 0}, 100);
  EXPECT_EQ(x.at({1, 1}), 100);
  expectValues(narrow(x, 0, -1, 1), {1, 4}, {8, 9, 10, 11});
  expectValues(slice(x, 1, 0, 4, 2), {3, 2}, {0, 2, 4, 6, 8, 10});
  expectValues(slice(x, 1, 1, 100, 2), {3, 2}, {1, 3, 100, 7, 9, 11});
  expectValues(slice(x, 0, -2, 3), {2, 4}, {4, 100, 6, 7, 8, 9, 10, 11});
  EXPECT_EQ(slice(x, 1, 3, 1).shape(), (Shape{3, 0}));  // empty, like Python
  EXPECT_TRUE(slice(x, 1, 0, 4, 3).storage().sameAs(x.storage()));
  Tensor s = select(x, 0, 2);
  expectValues(s, {4}, {8, 9, 10, 11});
  expectValues(select(x, 1, -1), {3}, {3, 7, 11});
  setAt(s, {0}, -8);
  EXPECT_EQ(x.at({2, 0}), -8);
  expectThrowsWith([&] { narrow(x, 1, 3, 2); }, {"narrow", "length", "4"});
  expectThrowsWith([&] { slice(x, 1, 0, 4, 0); }, {"slice", "step"});
  expectThrowsWith([&] { select(x, 0, 3); }, {"select", "index 3"});
  expectThrowsWith([&] { select(x, 2, 0); }, {"select", "dim 2"});
}

TEST(Views, ExpandSqueezeUnsqueezeFlatten) {
  Tensor col = Tensor::fromVector({1, 2}, {2, 1});
  Tensor e = expand(col, {3, 2, 4});
  EXPECT_TRUE(e.storage().sameAs(col.storage()));
  EXPECT_EQ(e.strides(), (Shape{0, 1, 0}));
  EXPECT_EQ(e.at({2, 1, 3}), 2);
  EXPECT_EQ(expand(col, {-1, 5}).shape(), (Shape{2, 5}));
  expectThrowsWith([&] { expand(col, {3, 4}); }, {"expand", "[2, 1]", "[3, 4]"});
  expectThrowsWith([&] { expand(col, {4}); }, {"expand", "fewer dims"});

  Tensor x = Tensor::zeros({1, 3, 1, 2});
  EXPECT_EQ(squeeze(x).shape(), (Shape{3, 2}));
  EXPECT_EQ(squeeze(x, 0).shape(), (Shape{3, 1, 2}));
  EXPECT_EQ(squeeze(x, -2).shape(), (Shape{1, 3, 2}));
  EXPECT_EQ(squeeze(x, 1).shape(), (Shape{1, 3, 1, 2}));  // not size 1: unchanged
  EXPECT_TRUE(squeeze(x).storage().sameAs(x.storage()));
  EXPECT_EQ(unsqueeze(x, 0).shape(), (Shape{1, 1, 3, 1, 2}));
  EXPECT_EQ(unsqueeze(x, -1).shape(), (Shape{1, 3, 1, 2, 1}));
  EXPECT_EQ(unsqueeze(Tensor::scalar(1), 0).shape(), (Shape{1}));
  expectThrowsWith([&] { unsqueeze(x, 5); }, {"unsqueeze", "dim 5"});
  // unsqueeze of a transposed view stays a view with consistent strides
  Tensor t = transpose(arange6(), 0, 1);
  Tensor u = unsqueeze(t, 1);
  EXPECT_TRUE(u.storage().sameAs(t.storage()));
  expectValues(u, {3, 1, 2}, {0, 3, 1, 4, 2, 5});

  Tensor y = reshape(Tensor::arange(24), {2, 3, 4});
  EXPECT_EQ(flatten(y).shape(), (Shape{24}));
  EXPECT_EQ(flatten(y, 1).shape(), (Shape{2, 12}));
  EXPECT_EQ(flatten(y, 0, 1).shape(), (Shape{6, 4}));
  EXPECT_EQ(flatten(Tensor::scalar(3)).shape(), (Shape{1}));
  EXPECT_TRUE(flatten(y, 1).storage().sameAs(y.storage()));
  expectThrowsWith([&] { flatten(y, 2, 1); }, {"flatten", "endDim"});
}

TEST(Views, ContiguousAndClone) {
  Tensor a = arange6();
  EXPECT_TRUE(contiguous(a).sameAs(a));
  Tensor t = transpose(a, 0, 1);
  Tensor c = contiguous(t);
  EXPECT_TRUE(c.isContiguous());
  EXPECT_FALSE(c.storage().sameAs(a.storage()));
  expectValues(c, {3, 2}, {0, 3, 1, 4, 2, 5});
  Tensor k = clone(a);
  EXPECT_FALSE(k.storage().sameAs(a.storage()));
  setAt(k, {0, 0}, 42);
  EXPECT_EQ(a.at({0, 0}), 0);
  expectValues(clone(t), {3, 2}, {0, 3, 1, 4, 2, 5});
  // int64 and 16-bit dtypes are copied bit-exactly
  Tensor i = transpose(Tensor::fromVector<int64_t>({1, 2, 3, 4}, {2, 2}), 0, 1);
  EXPECT_EQ(contiguous(i).toVector<int64_t>(), (std::vector<int64_t>{1, 3, 2, 4}));
  Tensor h = transpose(Tensor::fromVector({1.5f, 2, 3, 4}, {2, 2}).toDType(DType::kBFloat16), 0, 1);
  expectValues(contiguous(h), {2, 2}, {1.5, 3, 2, 4});
}

// ---------------------------------------------------------------- joins

TEST(Joins, CatStack) {
  Tensor a = arange6();                              // [2,3]
  Tensor b = Tensor::fromVector({10, 11, 12}, {1, 3});
  expectValues(cat({a, b}, 0), {3, 3}, {0, 1, 2, 3, 4, 5, 10, 11, 12});
  Tensor c = Tensor::fromVector({7, 8}, {2, 1});
  expectValues(cat({a, c, a}, 1), {2, 7}, {0, 1, 2, 7, 0, 1, 2, 3, 4, 5, 8, 3, 4, 5});
  expectValues(cat({a, c}, -1), {2, 4}, {0, 1, 2, 7, 3, 4, 5, 8});
  // non-contiguous pieces
  expectValues(cat({transpose(a, 0, 1), transpose(a, 0, 1)}, 1), {3, 4}, {0, 3, 0, 3, 1, 4, 1, 4, 2, 5, 2, 5});
  expectValues(stack({b, b}, 0), {2, 1, 3}, {10, 11, 12, 10, 11, 12});
  Tensor v1 = Tensor::fromVector({1, 2}, {2});
  Tensor v2 = Tensor::fromVector({3, 4}, {2});
  expectValues(stack({v1, v2}, 1), {2, 2}, {1, 3, 2, 4});
  expectValues(stack({v1, v2}, -1), {2, 2}, {1, 3, 2, 4});
  expectValues(stack({Tensor::scalar(1), Tensor::scalar(2)}, 0), {2}, {1, 2});
  expectThrowsWith([&] { cat({a, b}, 1); }, {"cat", "[1, 3]", "[2, 3]"});
  expectThrowsWith([&] { cat({a, v1}, 0); }, {"cat", "rank"});
  expectThrowsWith([&] { cat({a, a.toDType(DType::kFloat64)}, 0); }, {"cat", "float64"});
  expectThrowsWith([] { cat({}, 0); }, {"cat", "at least one"});
  expectThrowsWith([&] { cat({a}, 2); }, {"cat", "dim 2"});
  expectThrowsWith([&] { stack({v1, b}, 0); }, {"stack", "[1, 3]"});
}

TEST(Joins, SplitChunk) {
  Tensor x = reshape(Tensor::arange(10), {5, 2});
  auto parts = split(x, 2, 0);
  ASSERT_EQ(parts.size(), 3u);
  expectValues(parts[0], {2, 2}, {0, 1, 2, 3});
  expectValues(parts[2], {1, 2}, {8, 9});
  for (const auto& p : parts) EXPECT_TRUE(p.storage().sameAs(x.storage()));
  auto cols = split(x, 1, -1);
  ASSERT_EQ(cols.size(), 2u);
  expectValues(cols[1], {5, 1}, {1, 3, 5, 7, 9});
  auto ch = chunk(x, 2, 0);  // sizes 3, 2
  ASSERT_EQ(ch.size(), 2u);
  EXPECT_EQ(ch[0].shape(), (Shape{3, 2}));
  EXPECT_EQ(ch[1].shape(), (Shape{2, 2}));
  EXPECT_EQ(chunk(x, 4, 0).size(), 3u);  // ceil(5/4) = 2 per piece -> 3 pieces, as in PyTorch
  EXPECT_EQ(chunk(x, 10, 0).size(), 5u);
  expectThrowsWith([&] { split(x, 0, 0); }, {"split", "splitSize"});
  expectThrowsWith([&] { chunk(x, 0, 0); }, {"chunk", "chunks"});
  expectThrowsWith([&] { split(x, 1, 2); }, {"split", "dim 2"});
}

// ---------------------------------------------------------------- autograd

TEST(ShapeGrad, Views) {
  Tensor a = randn({2, 3, 4}, 1);
  expectGradcheck([](const std::vector<Tensor>& in) { return reshape(in[0], {4, -1}); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return view(in[0], {6, 4}); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return reshape(transpose(in[0], 0, 2), {24}); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return transpose(in[0], 0, 2); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return permute(in[0], {1, 2, 0}); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return narrow(in[0], 2, 1, 2); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return slice(in[0], 2, 0, 4, 3); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return select(in[0], 1, -1); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return flatten(in[0], 1); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return contiguous(transpose(in[0], 1, 2)); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return clone(in[0]); }, {a});
  Tensor b = randn({3, 1, 2}, 2);
  expectGradcheck([](const std::vector<Tensor>& in) { return expand(in[0], {2, 3, 4, 2}); }, {b});
  expectGradcheck([](const std::vector<Tensor>& in) { return squeeze(in[0]); }, {b});
  expectGradcheck([](const std::vector<Tensor>& in) { return squeeze(in[0], 1); }, {b});
  expectGradcheck([](const std::vector<Tensor>& in) { return unsqueeze(in[0], 0); }, {b});
  // chained views and overlapping uses of one input
  expectGradcheck(
      [](const std::vector<Tensor>& in) { return narrow(in[0], 1, 0, 2) * unsqueeze(select(in[0], 1, 2), 1); },
      {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return transpose(narrow(view(in[0], {6, 4}), 0, 1, 4), 0, 1); },
                  {a});
}

TEST(ShapeGrad, Joins) {
  Tensor a = randn({2, 3}, 3);
  Tensor b = randn({2, 1}, 4);
  Tensor c = randn({2, 2}, 5);
  expectGradcheck([](const std::vector<Tensor>& in) { return cat({in[0], in[1], in[2]}, 1); }, {a, b, c});
  expectGradcheck([](const std::vector<Tensor>& in) { return cat({in[0], in[0]}, 0); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return cat({transpose(in[0], 0, 1), in[1]}, 0); },
                  {a, randn({1, 2}, 6)});
  expectGradcheck([](const std::vector<Tensor>& in) { return stack({in[0], in[1]}, 1); }, {a, randn({2, 3}, 7)});
  // only some inputs require grad
  Tensor constant = Tensor::ones({2, 3}, DType::kFloat64);
  expectGradcheck([constant](const std::vector<Tensor>& in) { return cat({constant, in[0]}, 0); }, {a});
  Tensor x = randn({5, 2}, 8);
  // every piece used, with different weights so each piece's gradient is distinguishable
  expectGradcheck(
      [](const std::vector<Tensor>& in) {
        auto p = split(in[0], 2, 0);
        return cat({p[0] * 2.0, p[1] * 3.0, p[2] * 4.0}, 0);
      },
      {x});
  // only one piece used: the engine zero-fills the others' gradients
  expectGradcheck([](const std::vector<Tensor>& in) { return exp(chunk(in[0], 2, 1)[1]); }, {x});
}

TEST(ShapeGrad, SplitGradientOfUnusedPiecesIsZero) {
  Tensor x = Tensor::fromVector<double>({1, 2, 3, 4, 5, 6}, {3, 2});
  x.setRequiresGrad();
  auto p = split(x, 1, 0);
  backward(sum(p[1] * 3.0));
  expectValues(x.grad(), {3, 2}, {0, 0, 3, 3, 0, 0});
}

}  // namespace
}  // namespace distgrad

namespace distgrad {
namespace {

TEST(ShapeGrad, RecordsOnlyWhenAnInputRequiresGrad) {
  Tensor plain = Tensor::zeros({2, 3}, DType::kFloat64);
  EXPECT_EQ(transpose(plain, 0, 1).gradFn(), nullptr);
  EXPECT_EQ(reshape(plain, {6}).gradFn(), nullptr);
  EXPECT_EQ(sum(plain).gradFn(), nullptr);
  EXPECT_EQ((plain * plain).gradFn(), nullptr);
  Tensor leaf = Tensor::zeros({2, 3}, DType::kFloat64);
  leaf.setRequiresGrad();
  EXPECT_NE(transpose(leaf, 0, 1).gradFn(), nullptr);
  EXPECT_NE(reshape(leaf, {6}).gradFn(), nullptr);
  EXPECT_NE(sum(leaf).gradFn(), nullptr);
  EXPECT_NE((plain * leaf).gradFn(), nullptr);
  EXPECT_EQ(transpose(leaf, 0, 1).gradFn()->name(), "TransposeBackward");
  // a view of a grad-requiring tensor still shares its storage
  EXPECT_TRUE(transpose(leaf, 0, 1).storage().sameAs(leaf.storage()));
}

}  // namespace
}  // namespace distgrad
