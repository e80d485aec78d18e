// Checkpoints: bit-exact round trips, atomic replacement, and clear errors on every kind of damage.
#include "models/checkpoint.h"

#include <gtest/gtest.h>

#include <zlib.h>

#include <cstring>
#include <filesystem>

#include "models/nn/nn.h"
#include "models/zoo/mlp.h"
#include "tensor/random.h"
#include "test_util.h"

namespace distgrad::models {
namespace {

using testing::TempDir;
using testing::readBytes;
using testing::writeBytes;

StateDict sampleState() {
  tensor::Generator gen(7);
  StateDict s;
  s.insert("layer.weight", tensor::normal({3, 4}, 0, 1, gen));
  s.insert("layer.bias", tensor::normal({4}, 0, 1, gen, DType::kFloat64));
  s.insert("steps", Tensor::fromVector(std::vector<int64_t>{1, -2, 1LL << 40}, {3}));
  s.insert("scalar", Tensor::scalar(2.5));
  s.insert("empty", Tensor::zeros({0, 5}));
  s.insert("half", tensor::normal({5}, 0, 1, gen).toDType(DType::kFloat16));
  return s;
}

void expectBitIdentical(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.keys(), b.keys());
  for (const auto& [name, t] : a) {
    const Tensor& u = b.at(name);
    EXPECT_EQ(t.dtype(), u.dtype()) << name;
    EXPECT_EQ(t.shape(), u.shape()) << name;
    Tensor tc = t.cloneData();
    ASSERT_EQ(tc.nbytes(), u.nbytes()) << name;
    if (tc.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(tc.rawData(), u.rawData(), tc.nbytes()), 0) << name;
    }
  }
}

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}

TEST(Checkpoint, RoundTripIsBitIdentical) {
  TempDir dir;
  const StateDict s = sampleState();
  writeCheckpoint(s, dir.file("a.ckpt"));
  expectBitIdentical(s, readCheckpoint(dir.file("a.ckpt")));
}

TEST(Checkpoint, NonContiguousTensorsAreCompacted) {
  TempDir dir;
  Tensor base = Tensor::fromVector({1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f}, {2, 3});
  Tensor transposed = Tensor::fromStorage(base.storage(), {3, 2}, {1, 3}, 0, DType::kFloat32);
  StateDict s;
  s.insert("t", transposed);
  writeCheckpoint(s, dir.file("t.ckpt"));
  StateDict back = readCheckpoint(dir.file("t.ckpt"));
  EXPECT_EQ(back.at("t").toVector<float>(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
}

TEST(Checkpoint, ModuleRoundTrip) {
  TempDir dir;
  tensor::Generator gen(1);
  MLP a({4, 8, 3}, gen);
  MLP b({4, 8, 3}, gen);
  auto bn = std::make_shared<BatchNorm2d>(3);
  Tensor runningMean = bn->runningMean();
  runningMean.fill(0.25);
  Sequential withBuffers({std::make_shared<Linear>(2, 3, gen), bn});
  saveCheckpoint(a, dir.file("mlp.ckpt"));
  ASSERT_NE(a.parameters()[0].toVector<float>(), b.parameters()[0].toVector<float>());
  const void* storageBefore = b.parameters()[0].rawData();
  loadCheckpoint(b, dir.file("mlp.ckpt"));
  expectBitIdentical(a.stateDict(), b.stateDict());
  EXPECT_EQ(b.parameters()[0].rawData(), storageBefore);  // loaded in place

  saveCheckpoint(withBuffers, dir.file("bn.ckpt"));
  StateDict raw = readCheckpoint(dir.file("bn.ckpt"));
  EXPECT_EQ(raw.keys(), (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                                  "1.running_var", "1.num_batches_tracked"}));
  EXPECT_FLOAT_EQ(raw.at("1.running_mean").toVector<float>()[2], 0.25f);
  // Loading an MLP checkpoint into a different architecture names the offending keys.
  const std::string err = errorOf([&] { loadCheckpoint(withBuffers, dir.file("mlp.ckpt")); });
  EXPECT_NE(err.find("missing keys"), std::string::npos) << err;
  EXPECT_NE(err.find("'1.running_mean'"), std::string::npos) << err;
  EXPECT_NE(err.find("'2.weight'"), std::string::npos) << err;
}

TEST(Checkpoint, SaveReplacesAtomicallyAndLeavesNoTemporaries) {
  TempDir dir;
  const std::string path = dir.file("model.ckpt");
  StateDict first;
  first.insert("w", Tensor::full({4}, 1.0));
  writeCheckpoint(first, path);
  StateDict second;
  second.insert("w", Tensor::full({4}, 2.0));
  writeCheckpoint(second, path);
  EXPECT_EQ(readCheckpoint(path).at("w").toVector<float>(), (std::vector<float>{2, 2, 2, 2}));
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    ++files;
    EXPECT_EQ(entry.path().filename(), "model.ckpt");
  }
  EXPECT_EQ(files, 1);
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::others_read,
            std::filesystem::perms::others_read);
}

TEST(Checkpoint, FailedSaveLeavesExistingCheckpointIntact) {
  TempDir dir;
  const std::string path = dir.file("model.ckpt");
  writeCheckpoint(sampleState(), path);
  const auto before = readBytes(path);

  // A destination whose directory does not exist fails clearly.
  const std::string missing = dir.file("no/such/dir/model.ckpt");
  const std::string err = errorOf([&] { writeCheckpoint(sampleState(), missing); });
  EXPECT_NE(err.find(missing), std::string::npos) << err;
  EXPECT_NE(err.find("No such file or directory"), std::string::npos) << err;

  // A save that fails half-way (undefined tensors cannot be inserted, so use a name that is too long) never
  // touches the existing file and leaves no temporary behind.
  StateDict bad;
  bad.insert("ok", Tensor::full({1000}, 3.0));
  bad.insert(std::string(70000, 'x'), Tensor::full({1}, 3.0));
  EXPECT_THROW(writeCheckpoint(bad, path), ValueError);
  EXPECT_EQ(readBytes(path), before);
  int files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path())) ++files;
  EXPECT_EQ(files, 1);

  // Renaming onto a directory fails after the temporary was written: the temporary is removed.
  std::filesystem::create_directory(dir.file("adir"));
  std::filesystem::create_directory(dir.file("adir/x"));  // non-empty, so rename(2) cannot replace it
  EXPECT_THROW(writeCheckpoint(sampleState(), dir.file("adir")), ValueError);
  files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path())) ++files;
  EXPECT_EQ(files, 2);
}

TEST(Checkpoint, MissingFile) {
  TempDir dir;
  const std::string err = errorOf([&] { readCheckpoint(dir.file("nope.ckpt")); });
  EXPECT_NE(err.find("nope.ckpt"), std::string::npos) << err;
  EXPECT_NE(err.find("No such file"), std::string::npos) << err;
}

TEST(Checkpoint, TruncatedFilesFailClearly) {
  TempDir dir;
  const std::string path = dir.file("full.ckpt");
  writeCheckpoint(sampleState(), path);
  const auto bytes = readBytes(path);
  // Every prefix must be rejected (no crash, no partial state) with a message naming the file.
  for (size_t len : {size_t{0}, size_t{5}, size_t{24}, size_t{31}, bytes.size() / 2, bytes.size() - 9,
                     bytes.size() - 1}) {
    const std::string cut = dir.file("cut.ckpt");
    writeBytes(cut, std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(len)));
    const std::string err = errorOf([&] { readCheckpoint(cut); });
    EXPECT_NE(err.find("cut.ckpt"), std::string::npos) << "length " << len << ": " << err;
    EXPECT_TRUE(err.find("truncated") != std::string::npos || err.find("bad magic") != std::string::npos)
        << "length " << len << ": " << err;
  }
}

TEST(Checkpoint, CorruptedFilesFailClearly) {
  TempDir dir;
  const std::string path = dir.file("full.ckpt");
  writeCheckpoint(sampleState(), path);
  const auto bytes = readBytes(path);
  const std::string bad = dir.file("bad.ckpt");

  auto mutate = [&](size_t offset, char value) {
    auto copy = bytes;
    copy[offset] = value;
    writeBytes(bad, copy);
    return errorOf([&] { readCheckpoint(bad); });
  };
  EXPECT_NE(mutate(0, 'X').find("bad magic"), std::string::npos);
  EXPECT_NE(mutate(8, 7).find("unsupported checkpoint version 7"), std::string::npos);
  // A flipped bit in tensor data: only the checksum can tell.
  std::string err = mutate(bytes.size() - 12, static_cast<char>(bytes[bytes.size() - 12] ^ 0x10));
  EXPECT_NE(err.find("checksum mismatch"), std::string::npos) << err;
  // Garbage appended after the footer.
  auto longer = bytes;
  longer.insert(longer.end(), {'j', 'u', 'n', 'k'});
  writeBytes(bad, longer);
  err = errorOf([&] { readCheckpoint(bad); });
  EXPECT_NE(err.find("footer"), std::string::npos) << err;
  // Not a file at all.
  err = errorOf([&] { readCheckpoint(dir.path()); });
  EXPECT_NE(err.find("not a regular file"), std::string::npos) << err;
}

// Re-computes the footer CRC so structural validation (not just the checksum) is exercised.
void writeWithValidCrc(const std::string& path, std::vector<char> bytes) {
  const size_t footer = bytes.size() - 8;
  const auto crc = static_cast<uint32_t>(::crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(footer)));
  std::memcpy(&bytes[footer], &crc, 4);
  writeBytes(path, bytes);
}

TEST(Checkpoint, StructurallyInvalidFilesWithValidChecksumFail) {
  TempDir dir;
  StateDict s;
  s.insert("w", Tensor::full({2, 3}, 1.0));
  writeCheckpoint(s, dir.file("ok.ckpt"));
  const auto bytes = readBytes(dir.file("ok.ckpt"));
  // Layout: header 24 | u32 nameLen=1 | 'w' | u8 dtype | u8 ndim | i64 x2 | u64 nbytes | 24 data | footer 8.
  const size_t dtypeOffset = 24 + 4 + 1;
  const size_t ndimOffset = dtypeOffset + 1;
  const size_t dim0Offset = ndimOffset + 1;
  const size_t nbytesOffset = dim0Offset + 16;
  const std::string bad = dir.file("bad.ckpt");

  auto check = [&](std::vector<char> copy, const std::string& expected) {
    writeWithValidCrc(bad, std::move(copy));
    const std::string err = errorOf([&] { readCheckpoint(bad); });
    EXPECT_NE(err.find(expected), std::string::npos) << "expected '" << expected << "' in: " << err;
  };
  {
    auto c = bytes;
    c[dtypeOffset] = 42;
    check(c, "unknown dtype code 42");
  }
  {
    auto c = bytes;
    c[ndimOffset] = 100;
    check(c, "100 dims");
  }
  {
    auto c = bytes;
    int64_t dim = 4;  // 4 x 3 float32 = 48 bytes, but 24 declared
    std::memcpy(&c[dim0Offset], &dim, 8);
    check(c, "declares 24 bytes");
  }
  {
    auto c = bytes;
    int64_t dim = -1;
    std::memcpy(&c[dim0Offset], &dim, 8);
    check(c, "negative dimension");
  }
  {
    auto c = bytes;
    uint64_t n = 1ULL << 62;
    std::memcpy(&c[nbytesOffset], &n, 8);
    check(c, "declares");
  }
  {
    auto c = bytes;
    uint64_t count = 2;  // claims two entries but holds one
    std::memcpy(&c[16], &count, 8);
    check(c, "truncated or corrupted");
  }
  {
    auto c = bytes;
    uint64_t count = 0;  // claims none: the entry becomes trailing garbage
    std::memcpy(&c[16], &count, 8);
    check(c, "unexpected bytes after the last entry");
  }
}

}  // namespace
}  // namespace distgrad::models
