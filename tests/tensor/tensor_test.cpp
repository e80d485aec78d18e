// Tensor basics (tensor/tensor.h, storage.h, random.h): factories, strides and contiguity, dtype
// conversions including the 16-bit storage types, storage views and their bounds checks, printing, RNG.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tensor/random.h"
#include "test_util.h"
#include "tensor/storage.h"
#include "tensor/tensor.h"

namespace distgrad::tensor {
namespace {

using namespace distgrad::testing;

TEST(TensorFactories, ShapesValuesAndDtypes) {
  Tensor z = Tensor::zeros({2, 3});
  EXPECT_EQ(z.shape(), (Shape{2, 3}));
  EXPECT_EQ(z.numel(), 6);
  EXPECT_EQ(z.dim(), 2);
  EXPECT_EQ(z.dtype(), DType::kFloat32);
  EXPECT_EQ(z.nbytes(), 24u);
  EXPECT_EQ(z.toVector<float>(), std::vector<float>(6, 0.0f));
  EXPECT_EQ(Tensor::ones({3}, DType::kFloat64).toVector<double>(), (std::vector<double>{1, 1, 1}));
  EXPECT_EQ(Tensor::full({2}, 7, DType::kInt64).toVector<int64_t>(), (std::vector<int64_t>{7, 7}));
  Tensor s = Tensor::scalar(2.5);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.item(), 2.5);
  EXPECT_EQ(Tensor::arange(4, DType::kInt64).toVector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(Tensor::arange(0).numel(), 0);
  Tensor v = Tensor::fromVector<double>({1, 2, 3, 4, 5, 6}, {3, 2});
  EXPECT_EQ(v.dtype(), DType::kFloat64);
  EXPECT_EQ(v.at({2, 1}), 6);
  EXPECT_EQ(v.at({1, 0}), 3);
  Tensor e = Tensor::empty({0, 4});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_TRUE(e.isContiguous());
  expectThrowsWith([] { Tensor::fromVector({1, 2, 3}, {2, 2}); }, {"fromVector", "3 values", "[2, 2]"});
  expectThrowsWith([] { Tensor::empty({2, -1}); }, {"negative", "[2, -1]"});
  expectThrowsWith([] { Tensor::arange(-1); }, {"arange"});
}

TEST(TensorFactories, StorageIsAlignedAndAccounted) {
  const size_t before = cpuBytesInUse();
  {
    Tensor t = Tensor::empty({1000});
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.rawData()) % kStorageAlignment, 0u);
    EXPECT_GE(cpuBytesInUse(), before + 4000);
  }
  EXPECT_EQ(cpuBytesInUse(), before);
}

TEST(TensorFactories, LargeFreedBlocksAreCachedAndReused) {
  emptyCpuCache();
  const size_t bytes = (size_t{3} << 20) + 100;  // rounds up to a 4 MiB block
  void* first = nullptr;
  {
    Storage s = Storage::allocate(bytes);
    first = s.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % kStorageAlignment, 0u);
    EXPECT_EQ(cpuBytesCached(), 0u);
  }
  EXPECT_EQ(cpuBytesCached(), size_t{4} << 20);
  {
    // Any size that rounds to the same block reuses it; the cache no longer holds it meanwhile.
    Storage again = Storage::allocate((size_t{4} << 20) - 1);
    EXPECT_EQ(again.data(), first);
    EXPECT_EQ(cpuBytesCached(), 0u);
    Storage other = Storage::allocate(size_t{2} << 20);  // another size: a fresh block
    EXPECT_NE(other.data(), first);
  }
  EXPECT_EQ(cpuBytesCached(), size_t{6} << 20);
  emptyCpuCache();
  EXPECT_EQ(cpuBytesCached(), 0u);
  {
    Storage small = Storage::allocate(4096);  // below 64 KiB: never cached
  }
  EXPECT_EQ(cpuBytesCached(), 0u);
}

TEST(TensorFactories, MidSizeFreedBlocksAreCachedAtTheirOwnSize) {
  // 64 KiB .. 1 MiB (activations and received payloads of small micro-batches): kept at their size rounded
  // to the alignment only, not to a 1 MiB granule.
  emptyCpuCache();
  const size_t bytes = (size_t{200} << 10) + 3;
  const size_t rounded = (bytes + kStorageAlignment - 1) / kStorageAlignment * kStorageAlignment;
  void* first = nullptr;
  {
    Storage s = Storage::allocate(bytes);
    first = s.data();
  }
  EXPECT_EQ(cpuBytesCached(), rounded);
  {
    Storage again = Storage::allocate(rounded);
    EXPECT_EQ(again.data(), first);
    EXPECT_EQ(cpuBytesCached(), 0u);
    Storage other = Storage::allocate(bytes + kStorageAlignment);  // another size: a fresh block
    EXPECT_NE(other.data(), first);
  }
  EXPECT_EQ(cpuBytesCached(), 2 * rounded + kStorageAlignment);
  emptyCpuCache();
  EXPECT_EQ(cpuBytesCached(), 0u);
}

TEST(TensorMetadata, StridesAndContiguity) {
  Tensor t = Tensor::zeros({2, 3, 4});
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.isContiguous());
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.stride(0), 12);
  expectThrowsWith([&] { t.size(3); }, {"dim 3"});
  EXPECT_EQ(contiguousStrides({}), Shape{});
  EXPECT_EQ(contiguousStrides({3, 0, 2}), (Shape{2, 2, 1}));
  // transposed view: not contiguous
  Tensor tr = Tensor::fromStorage(t.storage(), {4, 3}, {1, 4}, 0, DType::kFloat32);
  EXPECT_FALSE(tr.isContiguous());
  // size-1 dims may carry any stride and still be contiguous
  Tensor unit = Tensor::fromStorage(t.storage(), {1, 4}, {99, 1}, 0, DType::kFloat32);
  EXPECT_TRUE(unit.isContiguous());
  // broadcast (stride 0) view: not contiguous
  Tensor bc = Tensor::fromStorage(t.storage(), {5, 4}, {0, 1}, 0, DType::kFloat32);
  EXPECT_FALSE(bc.isContiguous());
  EXPECT_EQ(wrapDim(-1, 3, "op"), 2);
  expectThrowsWith([] { wrapDim(3, 3, "myop"); }, {"myop", "dim 3"});
  EXPECT_EQ(shapeStr({2, 3}), "[2, 3]");
  EXPECT_EQ(shapeStr({}), "[]");
}

TEST(TensorData, ItemAtAndToVectorOnViews) {
  Tensor t = Tensor::fromVector({0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor tr = Tensor::fromStorage(t.storage(), {3, 2}, {1, 3}, 0, DType::kFloat32);
  EXPECT_EQ(tr.toVector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(tr.toVector<int64_t>(), (std::vector<int64_t>{0, 3, 1, 4, 2, 5}));
  Tensor col = Tensor::fromStorage(t.storage(), {2}, {3}, 1, DType::kFloat32);
  EXPECT_EQ(col.toVector<double>(), (std::vector<double>{1, 4}));
  EXPECT_EQ(col.at({1}), 4);
  expectThrowsWith([&] { t.item(); }, {"item", "[2, 3]"});
  expectThrowsWith([&] { t.at({2, 0}); }, {"at", "index 2"});
  expectThrowsWith([&] { t.at({0}); }, {"at", "1 indices"});
  expectThrowsWith([&] { t.data<double>(); }, {"data<float64>", "float32"});
}

TEST(TensorData, CopyFromAcrossDtypesAndLayouts) {
  Tensor src = Tensor::fromVector({1.5f, -2.0f, 3.25f, 4.0f}, {2, 2});
  Tensor d = Tensor::empty({2, 2}, DType::kFloat64);
  d.copyFrom(src);
  EXPECT_EQ(d.toVector<double>(), (std::vector<double>{1.5, -2.0, 3.25, 4.0}));
  Tensor i = Tensor::empty({2, 2}, DType::kInt64);
  i.copyFrom(src);  // truncation toward zero, as in C
  EXPECT_EQ(i.toVector<int64_t>(), (std::vector<int64_t>{1, -2, 3, 4}));
  // into a transposed destination
  Tensor dst = Tensor::zeros({2, 2});
  Tensor dstT = Tensor::fromStorage(dst.storage(), {2, 2}, {1, 2}, 0, DType::kFloat32);
  dstT.copyFrom(src);
  EXPECT_EQ(dst.toVector<float>(), (std::vector<float>{1.5f, 3.25f, -2.0f, 4.0f}));
  expectThrowsWith([&] { d.copyFrom(Tensor::zeros({4})); }, {"copyFrom", "[4]", "[2, 2]"});
  // cloneData: new storage, same values, contiguous
  Tensor c = dstT.cloneData();
  EXPECT_FALSE(c.storage().sameAs(dst.storage()));
  EXPECT_TRUE(c.isContiguous());
  EXPECT_EQ(c.toVector<float>(), src.toVector<float>());
  // toDType of the same dtype aliases; of another converts
  EXPECT_TRUE(src.toDType(DType::kFloat32).storage().sameAs(src.storage()));
  EXPECT_EQ(src.toDType(DType::kFloat64).dtype(), DType::kFloat64);
}

TEST(TensorData, FillOnViews) {
  Tensor t = Tensor::zeros({3, 3});
  Tensor diag = Tensor::fromStorage(t.storage(), {3}, {4}, 0, DType::kFloat32);
  diag.fill(2);
  EXPECT_EQ(t.toVector<float>(), (std::vector<float>{2, 0, 0, 0, 2, 0, 0, 0, 2}));
  Tensor i = Tensor::zeros({2}, DType::kInt64);
  i.fill(-3);
  EXPECT_EQ(i.toVector<int64_t>(), (std::vector<int64_t>{-3, -3}));
}

TEST(SixteenBitFloats, RoundTripsAndRounding) {
  // Exactly representable values survive float32 -> 16-bit -> float32 unchanged.
  const std::vector<float> exact = {0.0f, -0.0f, 1.0f, -2.25f, 0.5f, 3.0f, 1024.0f, -0.125f};
  Tensor src = Tensor::fromVector(exact, {static_cast<int64_t>(exact.size())});
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    Tensor h = src.toDType(dt);
    EXPECT_EQ(h.dtype(), dt);
    EXPECT_EQ(h.itemSize(), 2u);
    EXPECT_EQ(h.toDType(DType::kFloat32).toVector<float>(), exact) << dtypeName(dt);
    EXPECT_EQ(h.toVector<float>(), exact) << dtypeName(dt);
    // float64 <-> 16-bit directly
    EXPECT_EQ(src.toDType(DType::kFloat64).toDType(dt).toDType(DType::kFloat64).toVector<float>(), exact);
  }
  // bfloat16: 7 mantissa bits; ties round to even
  EXPECT_EQ(bfloat16ToFloat(floatToBFloat16(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(bfloat16ToFloat(floatToBFloat16(1.0f + 0x1p-8f + 0x1p-10f)), 1.0f + 0x1p-7f);
  EXPECT_EQ(bfloat16ToFloat(floatToBFloat16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);  // tie -> even
  EXPECT_TRUE(std::isnan(bfloat16ToFloat(floatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
  // float16: 10 mantissa bits, max 65504, subnormals down to 2^-24
  EXPECT_EQ(halfToFloat(floatToHalf(1.0f + 0x1p-11f)), 1.0f);
  EXPECT_EQ(halfToFloat(floatToHalf(1.0f + 0x1p-11f + 0x1p-13f)), 1.0f + 0x1p-10f);
  EXPECT_EQ(halfToFloat(floatToHalf(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(halfToFloat(floatToHalf(70000.0f))));
  EXPECT_EQ(halfToFloat(floatToHalf(0x1p-24f)), 0x1p-24f);
  EXPECT_EQ(halfToFloat(floatToHalf(3 * 0x1p-24f)), 3 * 0x1p-24f);
  EXPECT_EQ(halfToFloat(floatToHalf(0x1p-26f)), 0.0f);
  EXPECT_TRUE(std::isnan(halfToFloat(floatToHalf(std::numeric_limits<float>::quiet_NaN()))));
  // every float16 bit pattern that is a number round-trips exactly through float32
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = halfToFloat(h);
    if (std::isnan(f)) continue;
    ASSERT_EQ(floatToHalf(f), h) << "bits " << bits;
  }
}

TEST(TensorStorage, FromStorageViewsAndBoundsErrors) {
  Storage s = Storage::allocate(10 * sizeof(float));
  Tensor base = Tensor::fromStorage(s, {10}, {1}, 0, DType::kFloat32);
  for (int i = 0; i < 10; ++i) static_cast<float*>(base.rawData())[i] = static_cast<float>(i);
  Tensor v = Tensor::fromStorage(s, {2, 3}, {4, 1}, 2, DType::kFloat32);
  EXPECT_EQ(v.toVector<float>(), (std::vector<float>{2, 3, 4, 6, 7, 8}));
  EXPECT_TRUE(v.storage().sameAs(s));
  static_cast<float*>(v.rawData())[0] = 42;
  EXPECT_EQ(base.at({2}), 42);
  // the last element would be past the end of the 40-byte storage
  expectThrowsWith([&] { Tensor::fromStorage(s, {3, 4}, {4, 1}, 0, DType::kFloat32); },
                   {"fromStorage", "does not fit", "40 bytes"});
  expectThrowsWith([&] { Tensor::fromStorage(s, {2}, {1}, 9, DType::kFloat32); }, {"fromStorage", "does not fit"});
  expectThrowsWith([&] { Tensor::fromStorage(s, {6}, {1}, 0, DType::kFloat64); }, {"fromStorage", "does not fit"});
  // sizes that overflow 64-bit arithmetic are rejected, not wrapped into a small in-bounds number
  expectThrowsWith([&] { Tensor::fromStorage(s, {3}, {int64_t{1} << 62}, 0, DType::kFloat32); },
                   {"fromStorage", "does not fit"});
  expectThrowsWith([&] { Tensor::fromStorage(s, {int64_t{1} << 62, 2}, {1, 0}, 0, DType::kFloat32); },
                   {"fromStorage", "does not fit"});
  expectThrowsWith([&] { Tensor::fromStorage(s, {2}, {1}, -1, DType::kFloat32); }, {"fromStorage", "offset"});
  expectThrowsWith([&] { Tensor::fromStorage(s, {2}, {-1}, 1, DType::kFloat32); }, {"fromStorage", "stride"});
  expectThrowsWith([&] { Tensor::fromStorage(s, {2, 2}, {1}, 0, DType::kFloat32); }, {"fromStorage", "rank"});
  // an empty view is fine anywhere
  EXPECT_EQ(Tensor::fromStorage(s, {0, 100}, {100, 1}, 50, DType::kFloat32).numel(), 0);
  // wrapped memory: the deleter runs once, when the last view goes
  int deleted = 0;
  {
    static float buffer[4] = {1, 2, 3, 4};
    Storage w = Storage::wrap(buffer, sizeof(buffer), Device::cpu(), [&](void*) { ++deleted; });
    Tensor a = Tensor::fromStorage(w, {4}, {1}, 0, DType::kFloat32);
    Tensor b = a.detach();
    EXPECT_EQ(b.toVector<float>(), (std::vector<float>{1, 2, 3, 4}));
  }
  EXPECT_EQ(deleted, 1);
}

TEST(TensorFactories, OverflowingShapesAreErrors) {
  expectThrowsWith([] { Tensor::empty({int64_t{1} << 32, int64_t{1} << 32, 2}); }, {"shape", "64 bits"});
  expectThrowsWith([] { Tensor::empty({(int64_t{1} << 62) + 1, 4}); }, {"shape", "64 bits"});
  expectThrowsWith([] { Tensor::empty({int64_t{1} << 61, 1}, DType::kFloat64); }, {"Tensor::empty", "bytes"});
  EXPECT_THROW(Tensor().detach(), ValueError);
  // a zero dim makes numel 0, but the strides of the other dims must still fit
  expectThrowsWith([] { Tensor::empty({0, int64_t{1} << 40, int64_t{1} << 40}); }, {"strides", "64 bits"});
}

TEST(TensorPrinting, ContainsValuesShapeAndDtype) {
  Tensor t = Tensor::fromVector({1.5f, 2.0f, -3.25f, 4.0f, 5.0f, 6.0f}, {2, 3});
  const std::string s = t.toString();
  EXPECT_NE(s.find("1.5"), std::string::npos) << s;
  EXPECT_NE(s.find("-3.25"), std::string::npos) << s;
  EXPECT_NE(s.find("shape=[2, 3]"), std::string::npos) << s;
  EXPECT_NE(s.find("float32"), std::string::npos) << s;
  const std::string i = Tensor::fromVector<int64_t>({7, -8}, {2}).toString();
  EXPECT_NE(i.find("7, -8"), std::string::npos) << i;
  EXPECT_NE(i.find("int64"), std::string::npos) << i;
  EXPECT_NE(Tensor::scalar(3.0).toString().find("3"), std::string::npos);
  EXPECT_NE(Tensor().toString().find("undefined"), std::string::npos);
  // long dims are elided but keep both ends
  const std::string l = Tensor::arange(100).toString();
  EXPECT_NE(l.find("..."), std::string::npos) << l;
  EXPECT_NE(l.find("99"), std::string::npos) << l;
  EXPECT_NE(l.find("shape=[100]"), std::string::npos) << l;
  Tensor g = Tensor::zeros({2});
  g.setRequiresGrad();
  EXPECT_NE(g.toString().find("requires_grad"), std::string::npos);
}

TEST(Random, ReproducibleWithSameSeed) {
  Generator a(42), b(42), c(43);
  Tensor x = normal({100}, 0, 1, a);
  Tensor y = normal({100}, 0, 1, b);
  Tensor z = normal({100}, 0, 1, c);
  EXPECT_EQ(x.toVector<float>(), y.toVector<float>());
  EXPECT_NE(x.toVector<float>(), z.toVector<float>());
  // manualSeed restarts the stream
  a.manualSeed(42);
  EXPECT_EQ(normal({100}, 0, 1, a).toVector<float>(), x.toVector<float>());
  Generator u(7);
  auto vals = uniform({1000}, -2, 3, u, DType::kFloat64).toVector<double>();
  double mean = 0;
  for (double v : vals) {
    EXPECT_GE(v, -2);
    EXPECT_LT(v, 3);
    mean += v / static_cast<double>(vals.size());
  }
  EXPECT_NEAR(mean, 0.5, 0.2);
  Generator n(9);
  auto nv = normal({20000}, 1.0, 2.0, n, DType::kFloat64).toVector<double>();
  double m = 0, sq = 0;
  for (double v : nv) m += v / static_cast<double>(nv.size());
  for (double v : nv) sq += (v - m) * (v - m) / static_cast<double>(nv.size());
  EXPECT_NEAR(m, 1.0, 0.05);
  EXPECT_NEAR(std::sqrt(sq), 2.0, 0.05);
  EXPECT_THROW(uniform({2}, 1, 0, u), ValueError);
  EXPECT_THROW(normal({2}, 0, -1, u), ValueError);
}

TEST(Random, RandpermIsAPermutation) {
  Generator g(5);
  Tensor p = randperm(50, g);
  EXPECT_EQ(p.dtype(), DType::kInt64);
  auto v = p.toVector<int64_t>();
  auto sorted = v;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sorted[i], i);
  std::vector<int64_t> identity(50);
  for (int64_t i = 0; i < 50; ++i) identity[i] = i;
  EXPECT_NE(v, identity);  // 1/50! chance of a false failure
  Generator h(5);
  EXPECT_EQ(randperm(50, h).toVector<int64_t>(), v);
  EXPECT_EQ(randperm(0, h).numel(), 0);
  EXPECT_THROW(randperm(-1, h), ValueError);
}

TEST(Random, KaimingInitScale) {
  Generator g(3);
  Tensor w = kaimingUniform({64, 128}, g);
  const double bound = std::sqrt(2.0) * std::sqrt(3.0 / 128);
  for (float v : w.toVector<float>()) {
    EXPECT_LE(std::abs(v), bound + 1e-6);
  }
  EXPECT_EQ(fanIn({8, 3, 3, 3}), 27);
  EXPECT_THROW(fanIn({8}), ValueError);
}

}  // namespace
}  // namespace distgrad::tensor
