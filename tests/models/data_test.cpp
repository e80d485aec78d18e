// Data: IDX reader (plain and gzip, damaged files), Fashion-MNIST, synthetic sets, samplers, DataLoader.
#include <gtest/gtest.h>

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <functional>
#include <set>

#include "models/data/data_loader.h"
#include "models/data/fashion_mnist.h"
#include "models/data/idx.h"
#include "models/data/sampler.h"
#include "models/data/synthetic.h"
#include "test_util.h"

namespace distgrad::models::data {
namespace {

using testing::TempDir;
using testing::readBytes;
using testing::writeBytes;

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}

// Raw big-endian IDX bytes, written by hand (independently of writeIdx).
std::vector<char> idxBytes(uint8_t type, const std::vector<uint32_t>& dims, const std::vector<uint8_t>& payload) {
  std::vector<char> out{0, 0, static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((d >> shift) & 0xFF));
  }
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

void writeGz(const std::string& path, const std::vector<char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

TEST(Idx, ReadsPlainUint8) {
  TempDir dir;
  std::vector<uint8_t> pixels(2 * 3 * 4);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 10);
  writeBytes(dir.file("a.idx"), idxBytes(0x08, {2, 3, 4}, pixels));
  IdxArray a = readIdx(dir.file("a.idx"));
  EXPECT_EQ(a.type, IdxType::kUInt8);
  EXPECT_EQ(a.shape, (Shape{2, 3, 4}));
  EXPECT_EQ(a.bytes, pixels);
  Tensor t = a.toTensor();
  EXPECT_EQ(t.dtype(), DType::kInt64);
  EXPECT_EQ(t.at({1, 2, 3}), 230.0);
}

TEST(Idx, ReadsGzippedBigEndianTypes) {
  TempDir dir;
  // int32 [3]: 1, -2, 70000 big-endian.
  std::vector<uint8_t> ints{0, 0, 0, 1, 0xFF, 0xFF, 0xFF, 0xFE, 0x00, 0x01, 0x11, 0x70};
  writeGz(dir.file("i.idx.gz"), idxBytes(0x0C, {3}, ints));
  EXPECT_EQ(readIdx(dir.file("i.idx.gz")).toTensor().toVector<int64_t>(), (std::vector<int64_t>{1, -2, 70000}));
  // float32 [2]: 1.5 (0x3FC00000), -2 (0xC0000000).
  std::vector<uint8_t> floats{0x3F, 0xC0, 0, 0, 0xC0, 0, 0, 0};
  writeGz(dir.file("f.idx.gz"), idxBytes(0x0D, {1, 2}, floats));
  Tensor f = readIdx(dir.file("f.idx.gz")).toTensor();
  EXPECT_EQ(f.dtype(), DType::kFloat32);
  EXPECT_EQ(f.toVector<float>(), (std::vector<float>{1.5f, -2.0f}));
  // int16 and float64.
  writeBytes(dir.file("s.idx"), idxBytes(0x0B, {2}, {0x80, 0x00, 0x01, 0x02}));
  EXPECT_EQ(readIdx(dir.file("s.idx")).toTensor().toVector<int64_t>(), (std::vector<int64_t>{-32768, 258}));
  writeBytes(dir.file("d.idx"), idxBytes(0x0E, {1}, {0x40, 0x09, 0x21, 0xFB, 0x54, 0x44, 0x2D, 0x18}));
  EXPECT_DOUBLE_EQ(readIdx(dir.file("d.idx")).toTensor(DType::kFloat64).item(), 3.141592653589793);
}

TEST(Idx, WriteIdxRoundTrip) {
  TempDir dir;
  std::vector<int32_t> values{5, -7, 1 << 20, 0, 42, -1};
  for (bool gz : {false, true}) {
    const std::string path = dir.file(gz ? "w.idx.gz" : "w.idx");
    writeIdx(path, IdxType::kInt32, {2, 3}, values.data(), gz);
    IdxArray a = readIdx(path);
    EXPECT_EQ(a.shape, (Shape{2, 3}));
    EXPECT_EQ(a.toTensor().toVector<int64_t>(), (std::vector<int64_t>{5, -7, 1 << 20, 0, 42, -1}));
  }
  // The plain file really is plain (big-endian header bytes as written by hand).
  const auto bytes = readBytes(dir.file("w.idx"));
  EXPECT_EQ(bytes.size(), 4u + 8u + 24u);
  EXPECT_EQ(bytes[2], 0x0C);
}

TEST(Idx, DamagedFilesFailWithTheFileName) {
  TempDir dir;
  const std::string path = dir.file("bad.idx");
  auto errFor = [&](const std::vector<char>& bytes) {
    writeBytes(path, bytes);
    return errorOf([&] { readIdx(path); });
  };
  auto expectError = [&](const std::string& err, const std::string& what) {
    EXPECT_NE(err.find("bad.idx"), std::string::npos) << err;
    EXPECT_NE(err.find(what), std::string::npos) << "expected '" << what << "' in: " << err;
  };
  expectError(errFor({}), "truncated");
  expectError(errFor({0, 0, 8}), "truncated");
  expectError(errFor({1, 0, 8, 1, 0, 0, 0, 1, 9}), "not an IDX file");
  expectError(errFor(idxBytes(0x07, {1}, {9})), "unknown IDX type code 0x7");
  expectError(errFor({0, 0, 8, 0}), "0 dimensions");
  expectError(errFor({0, 0, 8, 3, 0, 0, 0, 2, 0, 0}), "truncated header");
  expectError(errFor(idxBytes(0x08, {2, 3}, {1, 2, 3, 4, 5})), "holds only 5");
  expectError(errFor(idxBytes(0x08, {2, 2}, {1, 2, 3, 4, 5})), "extra bytes");
  expectError(errFor(idxBytes(0x0C, {2}, {0, 0, 0, 1, 0, 0})), "truncated");
  // A forged header asking for 2^32 * 2^32 elements is refused before allocating.
  expectError(errFor(idxBytes(0x08, {0xFFFFFFFF, 0xFFFFFFFF}, {})), "limit");
  // Missing file.
  const std::string err = errorOf([&] { readIdx(dir.file("missing.idx")); });
  EXPECT_NE(err.find("missing.idx"), std::string::npos) << err;
}

TEST(Idx, DamagedGzipFails) {
  TempDir dir;
  std::vector<uint8_t> pixels(4000);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>((i * 7919) % 251);
  const std::string good = dir.file("good.idx.gz");
  writeGz(good, idxBytes(0x08, {40, 100}, pixels));
  const auto gz = readBytes(good);
  ASSERT_EQ(readIdx(good).numel(), 4000);

  const std::string cut = dir.file("cut.idx.gz");
  writeBytes(cut, std::vector<char>(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2)));
  std::string err = errorOf([&] { readIdx(cut); });
  EXPECT_NE(err.find("cut.idx.gz"), std::string::npos) << err;
  EXPECT_FALSE(err.empty());

  // Only the 8-byte trailer (CRC + length) missing: all data decodes, the stream is still incomplete.
  writeBytes(cut, std::vector<char>(gz.begin(), gz.end() - 8));
  err = errorOf([&] { readIdx(cut); });
  EXPECT_NE(err.find("cut.idx.gz"), std::string::npos) << err;

  // Corrupted compressed bytes (or a corrupted CRC): the inflate or the trailer check fails.
  auto corrupt = gz;
  corrupt[gz.size() - 6] = static_cast<char>(corrupt[gz.size() - 6] ^ 0xFF);  // inside the CRC-32
  const std::string bad = dir.file("bad.idx.gz");
  writeBytes(bad, corrupt);
  err = errorOf([&] { readIdx(bad); });
  EXPECT_NE(err.find("bad.idx.gz"), std::string::npos) << err;
}

TEST(FashionMnist, MissingDirectoryNamesThePackage) {
  TempDir dir;
  const std::string missing = dir.file("nowhere");
  const std::string err = errorOf([&] { FashionMnist::load(Split::kTrain, missing); });
  EXPECT_NE(err.find("dataset-fashion-mnist"), std::string::npos) << err;
  EXPECT_NE(err.find(missing), std::string::npos) << err;
  EXPECT_NE(err.find("train-images-idx3-ubyte"), std::string::npos) << err;
}

TEST(FashionMnist, SearchPathHonoursEnvironment) {
  const char* old = std::getenv("DISTGRAD_DATA_DIR");
  const std::string saved = old ? old : "";
  ::setenv("DISTGRAD_DATA_DIR", "/some/where", 1);
  auto paths = FashionMnist::searchPaths();
  if (old) ::setenv("DISTGRAD_DATA_DIR", saved.c_str(), 1);
  else ::unsetenv("DISTGRAD_DATA_DIR");
  ASSERT_EQ(paths.size(), 3u);
  EXPECT_EQ(paths[0], "/some/where");
  EXPECT_EQ(paths[1], "/some/where/fashion-mnist");
  EXPECT_EQ(paths[2], "/usr/share/datasets/fashion-mnist");
}

TEST(FashionMnist, LoadsSmallSyntheticSplitAndNormalises) {
  TempDir dir;
  std::vector<uint8_t> images(3 * 28 * 28, 0);
  images[0] = 255;
  images[28 * 28 + 5] = 51;
  writeIdx(dir.file("t10k-images-idx3-ubyte.gz"), IdxType::kUInt8, {3, 28, 28}, images.data(), true);
  std::vector<uint8_t> labels{9, 0, 4};
  writeIdx(dir.file("t10k-labels-idx1-ubyte"), IdxType::kUInt8, {3}, labels.data(), false);
  TensorDataset ds = FashionMnist::load(Split::kTest, dir.path());
  EXPECT_EQ(ds.inputs().shape(), (Shape{3, 1, 28, 28}));
  EXPECT_EQ(ds.labels().toVector<int64_t>(), (std::vector<int64_t>{9, 0, 4}));
  EXPECT_NEAR(ds.inputs().at({0, 0, 0, 0}), (1.0 - 0.2860) / 0.3530, 1e-5);
  EXPECT_NEAR(ds.inputs().at({0, 0, 0, 1}), -0.2860 / 0.3530, 1e-5);
  EXPECT_NEAR(ds.inputs().at({1, 0, 0, 5}), (0.2 - 0.2860) / 0.3530, 1e-5);

  // Labels outside 0..9 and mismatched counts are rejected, naming the file.
  labels = {9, 10, 4};
  writeIdx(dir.file("t10k-labels-idx1-ubyte"), IdxType::kUInt8, {3}, labels.data(), false);
  std::string err = errorOf([&] { FashionMnist::load(Split::kTest, dir.path()); });
  EXPECT_NE(err.find("label 10"), std::string::npos) << err;
  writeIdx(dir.file("t10k-labels-idx1-ubyte"), IdxType::kUInt8, {2}, labels.data(), false);
  err = errorOf([&] { FashionMnist::load(Split::kTest, dir.path()); });
  EXPECT_NE(err.find("2 labels"), std::string::npos) << err;
}

TEST(FashionMnist, RealFilesWhenInstalled) {
  std::string dir;
  for (const auto& d : FashionMnist::searchPaths()) {
    if (std::filesystem::exists(d + "/train-images-idx3-ubyte.gz") || std::filesystem::exists(d + "/train-images-idx3-ubyte")) {
      dir = d;
      break;
    }
  }
  if (dir.empty()) GTEST_SKIP() << "Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)";
  TensorDataset train = FashionMnist::load(Split::kTrain);
  TensorDataset test = FashionMnist::load(Split::kTest);
  EXPECT_EQ(train.inputs().shape(), (Shape{60000, 1, 28, 28}));
  EXPECT_EQ(test.inputs().shape(), (Shape{10000, 1, 28, 28}));
  std::vector<int64_t> counts(10, 0);
  for (int64_t y : train.labels().toVector<int64_t>()) {
    ASSERT_GE(y, 0);
    ASSERT_LT(y, 10);
    ++counts[static_cast<size_t>(y)];
  }
  for (int64_t c : counts) EXPECT_EQ(c, 6000);  // Fashion-MNIST is balanced
  // The normalisation constants are the training set's statistics.
  const float* p = train.inputs().data<float>();
  double sum = 0, sq = 0;
  const int64_t n = train.inputs().numel();
  for (int64_t i = 0; i < n; ++i) {
    sum += p[i];
    sq += static_cast<double>(p[i]) * p[i];
  }
  const double mean = sum / static_cast<double>(n);
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(n) - mean * mean), 1.0, 0.01);
}

TEST(Synthetic, GaussianBlobsAreBalancedAndReproducible) {
  tensor::Generator g1(3), g2(3);
  TensorDataset a = makeGaussianBlobs(100, 4, 5, g1);
  TensorDataset b = makeGaussianBlobs(100, 4, 5, g2);
  EXPECT_EQ(a.inputs().shape(), (Shape{100, 5}));
  EXPECT_EQ(a.inputs().toVector<float>(), b.inputs().toVector<float>());
  auto labels = a.labels().toVector<int64_t>();
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(labels[static_cast<size_t>(i)], i % 4);
}

TEST(Synthetic, RandomImagesFollowTheirRule) {
  tensor::Generator gen(5);
  TensorDataset ds = makeRandomImages(64, {3, 4, 4}, 5, gen);
  EXPECT_EQ(ds.inputs().shape(), (Shape{64, 3, 4, 4}));
  auto labels = ds.labels().toVector<int64_t>();
  std::set<int64_t> seen(labels.begin(), labels.end());
  EXPECT_GE(seen.size(), 3u);  // the rule spreads samples over classes
  for (int64_t y : labels) {
    EXPECT_GE(y, 0);
    EXPECT_LT(y, 5);
  }
}

TEST(TensorDataset, ValidatesAndSlices) {
  EXPECT_THROW(TensorDataset(Tensor::zeros({3, 2}), Tensor::zeros({4}, DType::kInt64)), ValueError);
  TensorDataset ds(Tensor::arange(12).toDType(DType::kFloat32), Tensor::arange(12, DType::kInt64));
  TensorDataset s = ds.slice(4, 3);
  EXPECT_EQ(s.size(), 3);
  EXPECT_EQ(s.labels().toVector<int64_t>(), (std::vector<int64_t>{4, 5, 6}));
  EXPECT_THROW(ds.slice(10, 3), ValueError);
}

// ---------------------------------------------------------------- DistributedSampler

TEST(DistributedSampler, PartitionsEvenlyAndDisjointly) {
  for (bool shuffle : {false, true}) {
    const int64_t n = 12, world = 4;
    std::multiset<int64_t> all;
    for (int64_t r = 0; r < world; ++r) {
      DistributedSampler s(n, world, r, shuffle, 7);
      auto idx = s.indices();
      EXPECT_EQ(static_cast<int64_t>(idx.size()), 3);
      EXPECT_EQ(s.size(), 3);
      all.insert(idx.begin(), idx.end());
    }
    // Divisible: every index exactly once over all ranks.
    EXPECT_EQ(all.size(), 12u);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(all.count(i), 1u) << "index " << i;
  }
  // Without shuffling, rank r takes r, r + world, ...
  EXPECT_EQ(DistributedSampler(10, 3, 1, false).indices(), (std::vector<int64_t>{1, 4, 7, 0}));
}

TEST(DistributedSampler, PadsByRepeatingFromTheStart) {
  // 10 samples over 4 ranks: 3 each, total 12, padded with indices 0 and 1.
  std::multiset<int64_t> all;
  for (int64_t r = 0; r < 4; ++r) {
    auto idx = DistributedSampler(10, 4, r, false).indices();
    EXPECT_EQ(idx.size(), 3u);
    all.insert(idx.begin(), idx.end());
  }
  EXPECT_EQ(all.size(), 12u);
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(all.count(i), i < 2 ? 2u : 1u) << "index " << i;
  EXPECT_EQ(DistributedSampler(10, 4, 2, false).indices(), (std::vector<int64_t>{2, 6, 0}));
  EXPECT_EQ(DistributedSampler(10, 4, 3, false).indices(), (std::vector<int64_t>{3, 7, 1}));
  // Fewer samples than ranks: the list repeats as often as needed.
  EXPECT_EQ(DistributedSampler(2, 5, 4, false).indices(), (std::vector<int64_t>{0}));
  EXPECT_EQ(DistributedSampler(2, 5, 3, false).indices(), (std::vector<int64_t>{1}));
}

TEST(DistributedSampler, DropLastTruncates) {
  // 10 over 4 with dropLast: ceil((10 - 4) / 4) = 2 each, indices 0..7 used.
  std::set<int64_t> all;
  for (int64_t r = 0; r < 4; ++r) {
    DistributedSampler s(10, 4, r, true, 3, /*dropLast=*/true);
    auto idx = s.indices();
    EXPECT_EQ(idx.size(), 2u);
    EXPECT_EQ(s.totalSize(), 8);
    for (int64_t i : idx) EXPECT_TRUE(all.insert(i).second) << "index " << i << " repeated";
  }
  EXPECT_EQ(all.size(), 8u);
  EXPECT_EQ(DistributedSampler(3, 4, 0, false, 0, true).size(), 0);
}

TEST(DistributedSampler, SetEpochReshufflesReproducibly) {
  DistributedSampler a(100, 2, 0, true, 11);
  DistributedSampler b(100, 2, 0, true, 11);
  auto e0 = a.indices();
  EXPECT_EQ(e0, b.indices());
  a.setEpoch(1);
  auto e1 = a.indices();
  EXPECT_NE(e0, e1);
  b.setEpoch(1);
  EXPECT_EQ(e1, b.indices());
  a.setEpoch(0);
  EXPECT_EQ(a.indices(), e0);
  // Ranks of the same epoch stay disjoint.
  DistributedSampler other(100, 2, 1, true, 11);
  other.setEpoch(1);
  std::set<int64_t> s0(e1.begin(), e1.end());
  for (int64_t i : other.indices()) EXPECT_FALSE(s0.count(i)) << i;
  // A different seed gives a different order.
  EXPECT_NE(DistributedSampler(100, 2, 0, true, 12).indices(), e0);
}

TEST(DistributedSampler, Validation) {
  EXPECT_THROW(DistributedSampler(10, 0, 0), ValueError);
  EXPECT_THROW(DistributedSampler(10, 2, 2), ValueError);
  EXPECT_THROW(DistributedSampler(10, 2, -1), ValueError);
  EXPECT_THROW(DistributedSampler(-1, 2, 0), ValueError);
  const std::string err = errorOf([] { DistributedSampler(10, 4, 4); });
  EXPECT_NE(err.find("rank 4"), std::string::npos) << err;
}

// ---------------------------------------------------------------- DataLoader

TensorDataset rangeDataset(int64_t n) {
  // inputs[i] = [i, 100 + i], labels[i] = i.
  Tensor x = Tensor::empty({n, 2});
  float* p = x.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    p[2 * i] = static_cast<float>(i);
    p[2 * i + 1] = static_cast<float>(100 + i);
  }
  return TensorDataset(x, Tensor::arange(n, DType::kInt64));
}

std::vector<int64_t> visitLabels(DataLoader& loader, std::vector<int64_t>* batchSizes = nullptr) {
  std::vector<int64_t> out;
  for (const Batch& b : loader) {
    if (batchSizes) batchSizes->push_back(b.size());
    auto labels = b.labels.toVector<int64_t>();
    auto inputs = b.inputs.toVector<float>();
    for (size_t i = 0; i < labels.size(); ++i) {
      // Inputs and labels stay paired.
      EXPECT_EQ(inputs[2 * i], static_cast<float>(labels[i]));
      EXPECT_EQ(inputs[2 * i + 1], static_cast<float>(100 + labels[i]));
    }
    out.insert(out.end(), labels.begin(), labels.end());
  }
  return out;
}

TEST(DataLoader, BatchCountsAndDropLast) {
  DataLoader keep(rangeDataset(10), {.batchSize = 4});
  std::vector<int64_t> sizes;
  EXPECT_EQ(keep.numBatches(), 3);
  auto labels = visitLabels(keep, &sizes);
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 4, 2}));
  EXPECT_EQ(labels, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));

  DataLoader drop(rangeDataset(10), {.batchSize = 4, .dropLast = true});
  sizes.clear();
  EXPECT_EQ(drop.numBatches(), 2);
  visitLabels(drop, &sizes);
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 4}));

  DataLoader exact(rangeDataset(8), {.batchSize = 4, .dropLast = true});
  EXPECT_EQ(exact.numBatches(), 2);
  EXPECT_THROW(DataLoader(rangeDataset(8), {.batchSize = 0}), ValueError);
}

TEST(DataLoader, ShuffleIsReproducibleAndChangesPerEpoch) {
  DataLoader a(rangeDataset(50), {.batchSize = 8, .shuffle = true, .seed = 42});
  DataLoader b(rangeDataset(50), {.batchSize = 8, .shuffle = true, .seed = 42});
  auto a0 = visitLabels(a);
  auto a1 = visitLabels(a);  // the epoch counter advanced
  EXPECT_EQ(a.epoch(), 2);
  EXPECT_NE(a0, a1);
  EXPECT_EQ(a0, visitLabels(b));
  EXPECT_EQ(a1, visitLabels(b));
  // Each epoch is a permutation.
  auto sorted = a0;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);
  // setEpoch replays an epoch.
  a.setEpoch(1);
  EXPECT_EQ(visitLabels(a), a1);
  EXPECT_EQ(a.epochOrder(0), a0);
  // Without shuffling the order is natural every epoch.
  DataLoader plain(rangeDataset(5), {.batchSize = 2});
  EXPECT_EQ(visitLabels(plain), visitLabels(plain));
}

TEST(DataLoader, WithDistributedSampler) {
  auto sampler = std::make_shared<DistributedSampler>(10, 3, 2, true, 5);
  DataLoader loader(rangeDataset(10), {.batchSize = 2}, sampler);
  EXPECT_EQ(loader.numSamples(), 4);
  EXPECT_EQ(loader.numBatches(), 2);
  auto e0 = visitLabels(loader);
  EXPECT_EQ(e0, sampler->indices());  // the loader set the sampler to epoch 0
  auto e1 = visitLabels(loader);
  sampler->setEpoch(1);
  EXPECT_EQ(e1, sampler->indices());
  EXPECT_NE(e0, e1);
  EXPECT_THROW(DataLoader(rangeDataset(10), {.batchSize = 2, .shuffle = true}, sampler), ValueError);
}

TEST(DataLoader, GathersMultiDimensionalSamples) {
  Tensor x = Tensor::arange(4 * 2 * 3).toDType(DType::kFloat32);
  TensorDataset ds(Tensor::fromStorage(x.storage(), {4, 2, 3}, {6, 3, 1}, 0, DType::kFloat32),
                   Tensor::fromVector(std::vector<int64_t>{7, 8, 9, 10}, {4}));
  DataLoader loader(ds, {.batchSize = 3});
  const int64_t idx[2] = {3, 1};
  Batch b = loader.gather(idx, 2);
  EXPECT_EQ(b.inputs.shape(), (Shape{2, 2, 3}));
  EXPECT_EQ(b.inputs.toVector<float>(), (std::vector<float>{18, 19, 20, 21, 22, 23, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(b.labels.toVector<int64_t>(), (std::vector<int64_t>{10, 8}));
  const int64_t badIdx[1] = {4};
  EXPECT_THROW(loader.gather(badIdx, 1), ValueError);
}

}  // namespace
}  // namespace distgrad::models::data
