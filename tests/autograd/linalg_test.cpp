// matmul / bmm / linear: values against hand-computed results and straightforward reference loops, the
// float32 (oneDNN sgemm) path against float64, strided operands, float64 gradchecks and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd_test_util.h"
#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tensor/cpu/linalg.h"
#include "tensor/random.h"

namespace distgrad {
namespace {

using autograd_testing::randn;
using autograd_testing::leaf;
using autograd_testing::expectNear;
using autograd_testing::errorOf;

// numpy.matmul in plain loops over float64 copies of the operands.
struct Dense {
  std::vector<double> v;
  Shape shape;
};

Dense referenceMatmul(const Tensor& a, const Tensor& b) {
  Shape as = a.shape(), bs = b.shape();
  const bool av = as.size() == 1, bv = bs.size() == 1;
  if (av) as.insert(as.begin(), 1);
  if (bv) bs.push_back(1);
  const size_t nd = std::max(as.size(), bs.size());
  while (as.size() < nd) as.insert(as.begin(), 1);
  while (bs.size() < nd) bs.insert(bs.begin(), 1);
  const std::vector<double> av_ = a.toVector<double>(), bv_ = b.toVector<double>();
  const int64_t n = as[nd - 2], k = as[nd - 1], m = bs[nd - 1];
  Shape batch(nd - 2);
  for (size_t d = 0; d + 2 < nd; ++d) batch[d] = std::max(as[d], bs[d]);
  const int64_t nb = tensor::numelOf(batch);
  Dense out;
  out.v.assign(static_cast<size_t>(nb * n * m), 0.0);
  for (int64_t bi = 0; bi < nb; ++bi) {
    // Decompose the batch index and map it into each operand (size-1 dims broadcast).
    int64_t rem = bi, offA = 0, offB = 0, strideA = n * k, strideB = k * m;
    for (int64_t d = static_cast<int64_t>(batch.size()) - 1; d >= 0; --d) {
      const int64_t idx = rem % batch[d];
      rem /= batch[d];
      offA += (as[d] == 1 ? 0 : idx) * strideA;
      offB += (bs[d] == 1 ? 0 : idx) * strideB;
      strideA *= as[d];
      strideB *= bs[d];
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) s += av_[offA + i * k + p] * bv_[offB + p * m + j];
        out.v[static_cast<size_t>((bi * n + i) * m + j)] = s;
      }
    }
  }
  out.shape = batch;
  if (!av) out.shape.push_back(n);
  if (!bv) out.shape.push_back(m);
  return out;
}

// A transposed view of a 2-D tensor's storage (strides swapped), for testing strided operands.
Tensor transposedView(const Tensor& t) {
  return Tensor::fromStorage(t.storage(), {t.shape()[1], t.shape()[0]}, {t.strides()[1], t.strides()[0]},
                             t.offset(), t.dtype());
}

// ---------------------------------------------------------------- values

TEST(Matmul, HandComputed2x2) {
  Tensor a = Tensor::fromVector({1, 2, 3, 4}, {2, 2});
  Tensor b = Tensor::fromVector({5, 6, 7, 8}, {2, 2});
  Tensor c = matmul(a, b);
  EXPECT_EQ(c.shape(), (Shape{2, 2}));
  EXPECT_EQ(c.toVector<float>(), (std::vector<float>{19, 22, 43, 50}));
}

TEST(Matmul, HandComputedVectors) {
  Tensor u = Tensor::fromVector({1, 2, 3}, {3});
  Tensor v = Tensor::fromVector({4, 5, 6}, {3});
  Tensor dot = matmul(u, v);
  EXPECT_EQ(dot.shape(), Shape{});
  EXPECT_FLOAT_EQ(static_cast<float>(dot.item()), 32.0f);
  Tensor m = Tensor::fromVector({1, 0, 2, 0, 1, 3}, {2, 3});
  Tensor mv = matmul(m, u);  // [2,3] x [3] -> [2]
  EXPECT_EQ(mv.shape(), Shape{2});
  EXPECT_EQ(mv.toVector<float>(), (std::vector<float>{7, 11}));
  Tensor w = Tensor::fromVector({1, 1}, {2});
  Tensor vm = matmul(w, m);  // [2] x [2,3] -> [3]
  EXPECT_EQ(vm.shape(), Shape{3});
  EXPECT_EQ(vm.toVector<float>(), (std::vector<float>{1, 1, 5}));
}

struct ShapePair {
  Shape a, b;
};

const std::vector<ShapePair> kMatmulShapes = {
    {{3}, {3}},          {{4}, {4, 5}},          {{4, 5}, {5}},          {{2, 3}, {3, 4}},
    {{2, 3, 4}, {4, 5}}, {{4}, {2, 4, 5}},       {{2, 3, 4}, {4}},       {{3, 4}, {2, 4, 5}},
    {{2, 3, 4}, {2, 4, 5}}, {{2, 1, 3, 4}, {5, 4, 2}}, {{1, 3, 4}, {3, 4, 2}}, {{3, 1, 2, 3}, {1, 2, 3, 2}},
};

TEST(Matmul, Float32MatchesReferenceForAllShapeCases) {
  uint64_t seed = 1;
  for (const auto& s : kMatmulShapes) {
    Tensor a = randn(s.a, seed++, DType::kFloat32), b = randn(s.b, seed++, DType::kFloat32);
    Dense ref = referenceMatmul(a, b);
    Tensor c = matmul(a, b);
    EXPECT_EQ(c.shape(), ref.shape) << tensor::shapeStr(s.a) << " x " << tensor::shapeStr(s.b);
    EXPECT_EQ(c.dtype(), DType::kFloat32);
    expectNear(c, ref.v, 1e-5, tensor::shapeStr(s.a) + " x " + tensor::shapeStr(s.b));
  }
}

TEST(Matmul, Float64MatchesReference) {
  uint64_t seed = 100;
  for (const auto& s : kMatmulShapes) {
    Tensor a = randn(s.a, seed++), b = randn(s.b, seed++);
    Dense ref = referenceMatmul(a, b);
    Tensor c = matmul(a, b);
    EXPECT_EQ(c.dtype(), DType::kFloat64);
    EXPECT_EQ(c.shape(), ref.shape);
    expectNear(c, ref.v, 1e-12, tensor::shapeStr(s.a) + " x " + tensor::shapeStr(s.b));
  }
}

TEST(Matmul, LargerFloat32AgainstFloat64) {
  // Sizes that are not multiples of any vector width, large enough for the JIT kernels' blocking.
  Tensor a64 = randn({67, 130}, 7), b64 = randn({130, 45}, 8);
  Tensor c32 = matmul(a64.toDType(DType::kFloat32), b64.toDType(DType::kFloat32));
  Tensor c64 = matmul(a64, b64);
  expectNear(c32, c64.toVector<double>(), 1e-4, "67x130x45");
}

TEST(Matmul, TransposedAndStridedOperandsNeedNoContiguousInput) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor a = randn({5, 3}, 11, dt), b = randn({4, 5}, 12, dt);
    Tensor at = transposedView(a);  // [3, 5] with strides (1, 3)
    Tensor bt = transposedView(b);  // [5, 4] with strides (1, 5)
    ASSERT_FALSE(at.isContiguous());
    Dense ref = referenceMatmul(at.cloneData(), bt.cloneData());
    expectNear(matmul(at, bt), ref.v, 1e-5, "a^T b^T");
    // Every other column: neither row- nor column-major, so the kernel must copy.
    Tensor wide = randn({3, 10}, 13, dt);
    Tensor everyOther = Tensor::fromStorage(wide.storage(), {3, 5}, {10, 2}, 0, dt);
    Dense ref2 = referenceMatmul(everyOther.cloneData(), bt.cloneData());
    expectNear(matmul(everyOther, bt), ref2.v, 1e-5, "strided columns");
    // A broadcast (stride-0) batch dim on the left operand.
    Tensor row = randn({1, 3, 5}, 14, dt);
    Tensor expanded = Tensor::fromStorage(row.storage(), {4, 3, 5}, {0, 5, 1}, 0, dt);
    Dense ref3 = referenceMatmul(expanded.cloneData(), bt.cloneData());
    expectNear(matmul(expanded, bt), ref3.v, 1e-5, "expanded batch");
  }
}

TEST(Matmul, EmptyDimensions) {
  Tensor a = Tensor::zeros({3, 0}), b = Tensor::zeros({0, 4});
  Tensor c = matmul(a, b);  // sum over an empty dim is 0
  EXPECT_EQ(c.shape(), (Shape{3, 4}));
  for (float v : c.toVector<float>()) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(matmul(Tensor::zeros({0, 3}), Tensor::zeros({3, 2})).shape(), (Shape{0, 2}));
  EXPECT_EQ(matmul(Tensor::zeros({2, 0, 3}), Tensor::zeros({3, 2})).shape(), (Shape{2, 0, 2}));
}

TEST(Matmul, BatchReducedProductSumsOverBroadcastBatch) {
  // The kernel behind broadcast gradients: [2,3,4]^T x [2,3,5] reduced over the batch -> [1,4,5].
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor a = randn({2, 3, 4}, 21, dt), b = randn({2, 3, 5}, 22, dt);
    Tensor r = tensor::kernels::batchedMatmul(a, true, b, false, {1});
    EXPECT_EQ(r.shape(), (Shape{1, 4, 5}));
    std::vector<double> av = a.toVector<double>(), bv = b.toVector<double>(), expected(20, 0.0);
    for (int bi = 0; bi < 2; ++bi)
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 5; ++j)
          for (int p = 0; p < 3; ++p) expected[i * 5 + j] += av[(bi * 3 + p) * 4 + i] * bv[(bi * 3 + p) * 5 + j];
    expectNear(r, expected, 1e-5, "reduced batch");
  }
}

TEST(Matmul, Float32GradientsMatchFloat64) {
  uint64_t seed = 300;
  for (const auto& s : kMatmulShapes) {
    Tensor a64 = randn(s.a, seed++), b64 = randn(s.b, seed++);
    Tensor a32 = leaf(a64.toDType(DType::kFloat32)), b32 = leaf(b64.toDType(DType::kFloat32));
    a64 = leaf(a64);
    b64 = leaf(b64);
    Tensor y64 = matmul(a64, b64);
    Tensor v64 = randn(y64.shape(), seed++);
    auto g64 = autograd::grad({y64}, {a64, b64}, {v64});
    auto g32 = autograd::grad({matmul(a32, b32)}, {a32, b32}, {v64.toDType(DType::kFloat32)});
    const std::string what = tensor::shapeStr(s.a) + " x " + tensor::shapeStr(s.b);
    EXPECT_EQ(g32[0].shape(), s.a) << what;
    EXPECT_EQ(g32[1].shape(), s.b) << what;
    expectNear(g32[0], g64[0].toVector<double>(), 1e-4, what + " dA");
    expectNear(g32[1], g64[1].toVector<double>(), 1e-4, what + " dB");
  }
}

// ---------------------------------------------------------------- gradchecks

TEST(Matmul, GradcheckAllShapeCases) {
  uint64_t seed = 500;
  for (const auto& s : kMatmulShapes) {
    Tensor a = leaf(randn(s.a, seed++)), b = leaf(randn(s.b, seed++));
    auto r = autograd::gradcheck([](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); }, {a, b});
    EXPECT_TRUE(r.ok) << tensor::shapeStr(s.a) << " x " << tensor::shapeStr(s.b) << ": " << r.message;
  }
}

TEST(Matmul, GradcheckNonContiguousLeavesAndOneSidedGrad) {
  // Leaves that are transposed views (non-contiguous) exercise the strided GEMM operands in backward too.
  Tensor a = leaf(transposedView(randn({4, 3}, 601)));  // [3, 4]
  Tensor b = leaf(transposedView(randn({2, 4}, 602)));  // [4, 2]
  auto r = autograd::gradcheck([](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); }, {a, b});
  EXPECT_TRUE(r.ok) << r.message;
  // Only one operand requires grad: the other gets none.
  Tensor c = randn({4, 2}, 603);
  auto r2 = autograd::gradcheck([](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); }, {a, c});
  EXPECT_TRUE(r2.ok) << r2.message;
  Tensor y = matmul(a, c);
  auto g = autograd::grad({y}, {a}, {Tensor::ones(y.shape(), DType::kFloat64)});
  EXPECT_EQ(g[0].shape(), (Shape{3, 4}));
}

TEST(Bmm, ValuesAndGradcheck) {
  Tensor a = randn({3, 2, 4}, 701), b = randn({3, 4, 5}, 702);
  Tensor c = bmm(a, b);
  EXPECT_EQ(c.shape(), (Shape{3, 2, 5}));
  expectNear(c, referenceMatmul(a, b).v, 1e-12, "bmm f64");
  Tensor c32 = bmm(a.toDType(DType::kFloat32), b.toDType(DType::kFloat32));
  expectNear(c32, referenceMatmul(a, b).v, 1e-5, "bmm f32");
  auto r = autograd::gradcheck([](const std::vector<Tensor>& in) { return bmm(in[0], in[1]); },
                               {leaf(a), leaf(b)});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Linear, HandComputed) {
  Tensor x = Tensor::fromVector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor w = Tensor::fromVector({1, 0, -1, 2, 1, 0}, {2, 3});
  Tensor b = Tensor::fromVector({0.5f, -1.0f}, {2});
  EXPECT_EQ(linear(x, w).toVector<float>(), (std::vector<float>{-2, 4, -2, 13}));
  EXPECT_EQ(linear(x, w, b).toVector<float>(), (std::vector<float>{-1.5f, 3, -1.5f, 12}));
}

TEST(Linear, MatchesMatmulForBatchedAndStridedInputs) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    const double tol = dt == DType::kFloat32 ? 1e-5 : 1e-12;
    Tensor x = randn({2, 3, 7}, 801, dt), w = randn({5, 7}, 802, dt), b = randn({5}, 803, dt);
    Dense ref = referenceMatmul(x, transposedView(w).cloneData());
    std::vector<double> bv = b.toVector<double>();
    for (size_t i = 0; i < ref.v.size(); ++i) ref.v[i] += bv[i % 5];
    Tensor y = linear(x, w, b);
    EXPECT_EQ(y.shape(), (Shape{2, 3, 5}));
    expectNear(y, ref.v, tol, "linear 3-D");
    // 1-D input: one sample.
    Tensor x1 = randn({7}, 804, dt);
    Tensor y1 = linear(x1, w, b);
    EXPECT_EQ(y1.shape(), Shape{5});
    Dense ref1 = referenceMatmul(x1, transposedView(w).cloneData());
    for (size_t i = 0; i < 5; ++i) ref1.v[i] += bv[i];
    expectNear(y1, ref1.v, tol, "linear 1-D");
    // Non-contiguous input (a transposed view) and weight.
    Tensor xt = transposedView(randn({7, 4}, 805, dt));
    Tensor wt = transposedView(randn({7, 5}, 806, dt));
    Dense ref2 = referenceMatmul(xt.cloneData(), transposedView(wt.cloneData()).cloneData());
    expectNear(linear(xt, wt), ref2.v, tol, "linear strided");
  }
}

TEST(Linear, GradcheckWithAndWithoutBias) {
  Tensor x = leaf(randn({2, 3, 4}, 901)), w = leaf(randn({5, 4}, 902)), b = leaf(randn({5}, 903));
  auto withBias = autograd::gradcheck(
      [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); }, {x, w, b});
  EXPECT_TRUE(withBias.ok) << withBias.message;
  auto noBias = autograd::gradcheck([](const std::vector<Tensor>& in) { return linear(in[0], in[1]); }, {x, w});
  EXPECT_TRUE(noBias.ok) << noBias.message;
  Tensor x1 = leaf(randn({4}, 904));
  auto vec = autograd::gradcheck(
      [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); }, {x1, w, b});
  EXPECT_TRUE(vec.ok) << vec.message;
}

TEST(Linear, Float32GradientsMatchFloat64) {
  Tensor x64 = randn({6, 9}, 1001), w64 = randn({4, 9}, 1002), b64 = randn({4}, 1003), v = randn({6, 4}, 1004);
  Tensor x32 = leaf(x64.toDType(DType::kFloat32)), w32 = leaf(w64.toDType(DType::kFloat32)),
         b32 = leaf(b64.toDType(DType::kFloat32));
  x64 = leaf(x64);
  w64 = leaf(w64);
  b64 = leaf(b64);
  auto g64 = autograd::grad({linear(x64, w64, b64)}, {x64, w64, b64}, {v});
  auto g32 = autograd::grad({linear(x32, w32, b32)}, {x32, w32, b32}, {v.toDType(DType::kFloat32)});
  for (size_t i = 0; i < 3; ++i) expectNear(g32[i], g64[i].toVector<double>(), 1e-4, "grad " + std::to_string(i));
}

// ---------------------------------------------------------------- bad inputs

TEST(Matmul, BadInputsNameTheOpAndShapes) {
  std::string msg = errorOf([] { matmul(Tensor::zeros({2, 3}), Tensor::zeros({4, 5})); });
  EXPECT_NE(msg.find("matmul"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 5]"), std::string::npos) << msg;
  msg = errorOf([] { matmul(Tensor::scalar(1.0), Tensor::zeros({3})); });
  EXPECT_NE(msg.find("matmul"), std::string::npos) << msg;
  EXPECT_NE(msg.find("at least 1 dimension"), std::string::npos) << msg;
  msg = errorOf([] { matmul(Tensor::zeros({2, 3, 4}), Tensor::zeros({3, 4, 5})); });
  EXPECT_NE(msg.find("broadcast"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3, 4]"), std::string::npos) << msg;
  msg = errorOf([] { matmul(Tensor::zeros({2, 3}), Tensor::zeros({3, 2}, DType::kFloat64)); });
  EXPECT_NE(msg.find("matmul"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dtype"), std::string::npos) << msg;
  msg = errorOf([] { matmul(Tensor::zeros({2, 3}, DType::kInt64), Tensor::zeros({3, 2}, DType::kInt64)); });
  EXPECT_NE(msg.find("float32 or float64"), std::string::npos) << msg;
}

TEST(Bmm, BadInputs) {
  std::string msg = errorOf([] { bmm(Tensor::zeros({2, 3}), Tensor::zeros({2, 3, 4})); });
  EXPECT_NE(msg.find("bmm"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3-D"), std::string::npos) << msg;
  msg = errorOf([] { bmm(Tensor::zeros({2, 3, 4}), Tensor::zeros({3, 4, 5})); });
  EXPECT_NE(msg.find("batch"), std::string::npos) << msg;
  msg = errorOf([] { bmm(Tensor::zeros({2, 3, 4}), Tensor::zeros({2, 5, 5})); });
  EXPECT_NE(msg.find("[2, 3, 4]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 5, 5]"), std::string::npos) << msg;
  msg = errorOf([] { bmm(Tensor::zeros({2, 3, 4}), Tensor::zeros({2, 4, 5}, DType::kFloat64)); });
  EXPECT_NE(msg.find("dtype"), std::string::npos) << msg;
}

TEST(Linear, BadInputs) {
  std::string msg = errorOf([] { linear(Tensor::zeros({2, 3}), Tensor::zeros({4, 5})); });
  EXPECT_NE(msg.find("linear"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 5]"), std::string::npos) << msg;
  msg = errorOf([] { linear(Tensor::zeros({2, 3}), Tensor::zeros({3})); });
  EXPECT_NE(msg.find("2-D"), std::string::npos) << msg;
  msg = errorOf([] { linear(Tensor::zeros({2, 3}), Tensor::zeros({4, 3}), Tensor::zeros({5})); });
  EXPECT_NE(msg.find("bias"), std::string::npos) << msg;
  msg = errorOf([] { linear(Tensor::zeros({2, 3}), Tensor::zeros({4, 3}, DType::kFloat64)); });
  EXPECT_NE(msg.find("dtype"), std::string::npos) << msg;
  msg = errorOf([] { linear(Tensor::scalar(1.0), Tensor::zeros({4, 1})); });
  EXPECT_NE(msg.find("linear"), std::string::npos) << msg;
}

}  // namespace
}  // namespace distgrad
