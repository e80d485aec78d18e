#include "models/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>

namespace distgrad::models::data {
namespace {

bool validType(uint8_t code) {
  switch (code) {
    case 0x08: case 0x09: case 0x0B: case 0x0C: case 0x0D: case 0x0E: return true;
    default: return false;
  }
}

// Closes the gz handle on every path out.
class GzFile {
 public:
  GzFile(const std::string& path, const char* mode) : path_(path), file_(gzopen(path.c_str(), mode)) {}
  ~GzFile() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;
  gzFile get() const { return file_; }
  explicit operator bool() const { return file_ != nullptr; }

  // Reads up to n bytes; returns how many were read (short only at end of data). Throws on a stream error
  // (a corrupted or truncated gzip member).
  size_t read(void* out, size_t n, const char* what) {
    auto* p = static_cast<char*>(out);
    size_t got = 0;
    while (got < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - got, 1u << 30));
      const int r = gzread(file_, p + got, chunk);
      if (r < 0) fail(what);
      if (r == 0) {
        // gzread reports a truncated gzip stream as a short read with Z_BUF_ERROR set.
        int err = Z_OK;
        gzerror(file_, &err);
        if (err != Z_OK && err != Z_STREAM_END) fail(what);
        break;
      }
      got += static_cast<size_t>(r);
    }
    return got;
  }
  // Closes explicitly to surface errors found at the end (gzip trailer CRC or length mismatch).
  int close() {
    int rc = gzclose(file_);
    file_ = nullptr;
    return rc;
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    int err = Z_OK;
    const char* msg = gzerror(file_, &err);
    throw ValueError(detail::concatMessage("readIdx: '", path_, "': reading the ", what,
                                           " failed: ", (msg && *msg) ? msg : "unknown zlib error",
                                           " (corrupted or truncated gzip data?)"));
  }
  std::string path_;
  gzFile file_;
};

void byteSwapInPlace(uint8_t* data, size_t count, size_t itemSize) {
  if (itemSize == 1) return;
  for (size_t i = 0; i < count; ++i) std::reverse(data + i * itemSize, data + (i + 1) * itemSize);
}

}  // namespace

size_t idxItemSize(IdxType type) {
  switch (type) {
    case IdxType::kUInt8: case IdxType::kInt8: return 1;
    case IdxType::kInt16: return 2;
    case IdxType::kInt32: case IdxType::kFloat32: return 4;
    case IdxType::kFloat64: return 8;
  }
  return 0;
}

const char* idxTypeName(IdxType type) {
  switch (type) {
    case IdxType::kUInt8: return "uint8";
    case IdxType::kInt8: return "int8";
    case IdxType::kInt16: return "int16";
    case IdxType::kInt32: return "int32";
    case IdxType::kFloat32: return "float32";
    case IdxType::kFloat64: return "float64";
  }
  return "?";
}

IdxArray readIdx(const std::string& path, uint64_t maxBytes) {
  errno = 0;
  GzFile file(path, "rb");
  if (!file) {
    throw ValueError(detail::concatMessage("readIdx: cannot open '", path, "': ",
                                           errno ? std::strerror(errno) : "out of memory"));
  }
  // Larger buffer than zlib's 8 KiB default: data sets are tens of megabytes.
  gzbuffer(file.get(), 1 << 18);

  uint8_t magic[4];
  size_t got = file.read(magic, 4, "header");
  if (got < 4) {
    throw ValueError(detail::concatMessage("readIdx: '", path, "': truncated: ", got,
                                           " bytes, shorter than the 4-byte IDX magic"));
  }
  if (magic[0] != 0 || magic[1] != 0) {
    throw ValueError(detail::concatMessage("readIdx: '", path, "': not an IDX file (magic starts with 0x", std::hex,
                                           int{magic[0]}, " 0x", int{magic[1]}, ", expected 0x0 0x0)"));
  }
  if (!validType(magic[2])) {
    throw ValueError(detail::concatMessage("readIdx: '", path, "': unknown IDX type code 0x", std::hex,
                                           int{magic[2]}, " (expected 08, 09, 0B, 0C, 0D or 0E)"));
  }
  const int ndim = magic[3];
  if (ndim == 0) throw ValueError("readIdx: '" + path + "': the header declares 0 dimensions");

  IdxArray out;
  out.type = static_cast<IdxType>(magic[2]);
  std::vector<uint8_t> dimBytes(static_cast<size_t>(ndim) * 4);
  got = file.read(dimBytes.data(), dimBytes.size(), "header");
  if (got < dimBytes.size()) {
    throw ValueError(detail::concatMessage("readIdx: '", path, "': truncated header: ", ndim, " dimensions need ",
                                           dimBytes.size(), " bytes of sizes, found ", got));
  }
  const size_t itemSize = idxItemSize(out.type);
  // The limit applies to the product of the non-zero dims too: a 0 dim must not let later dims grow
  // without bound (the shape is used to size tensors).
  uint64_t payload = itemSize;
  uint64_t nonZeroPayload = itemSize;
  out.shape.resize(static_cast<size_t>(ndim));
  for (int d = 0; d < ndim; ++d) {
    const uint8_t* b = dimBytes.data() + 4 * d;
    const uint32_t size = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
    out.shape[static_cast<size_t>(d)] = size;
    if (size != 0 && nonZeroPayload > maxBytes / size) {
      throw ValueError(detail::concatMessage("readIdx: '", path, "': declared shape ", tensor::shapeStr(out.shape),
                                             "... exceeds the ", maxBytes, "-byte limit"));
    }
    if (size != 0) nonZeroPayload *= size;
    payload *= size;
  }
  // Grow the buffer as data arrives: a forged header must not make us allocate (and zero) gigabytes
  // before the short file is noticed.
  constexpr uint64_t kChunk = uint64_t{1} << 24;
  got = 0;
  while (got < payload) {
    const uint64_t want = std::min<uint64_t>(kChunk, payload - got);
    out.bytes.resize(static_cast<size_t>(got + want));
    const size_t n = file.read(out.bytes.data() + got, static_cast<size_t>(want), "data");
    got += n;
    if (n < want) break;
  }
  out.bytes.resize(static_cast<size_t>(got));
  if (got < payload) {
    throw ValueError(detail::concatMessage("readIdx: '", path, "': truncated: header declares ",
                                           idxTypeName(out.type), " ", tensor::shapeStr(out.shape), " (", payload,
                                           " data bytes) but the file holds only ", got));
  }
  uint8_t extra[64];
  const size_t trailing = file.read(extra, sizeof(extra), "data");
  if (trailing > 0) {
    throw ValueError(detail::concatMessage("readIdx: '", path, "': size mismatch: header declares ",
                                           idxTypeName(out.type), " ", tensor::shapeStr(out.shape), " (", payload,
                                           " data bytes) but the file has extra bytes after them"));
  }
  if (file.close() != Z_OK) {
    throw ValueError("readIdx: '" + path + "': the gzip stream is corrupted (trailer check failed)");
  }
  if constexpr (std::endian::native == std::endian::little) {
    byteSwapInPlace(out.bytes.data(), out.bytes.size() / itemSize, itemSize);
  }
  return out;
}

Tensor IdxArray::toTensor(DType floatDType) const {
  DG_CHECK(floatDType == DType::kFloat32 || floatDType == DType::kFloat64,
           "IdxArray::toTensor: floatDType must be float32 or float64, got ", tensor::dtypeName(floatDType));
  const bool isFloat = type == IdxType::kFloat32 || type == IdxType::kFloat64;
  const int64_t n = numel();
  DG_CHECK(bytes.size() == static_cast<size_t>(n) * idxItemSize(type), "IdxArray::toTensor: ", bytes.size(),
           " bytes do not hold shape ", tensor::shapeStr(shape), " of ", idxTypeName(type));
  Tensor out = Tensor::empty(shape, isFloat ? floatDType : DType::kInt64);
  const uint8_t* src = bytes.data();
  auto convert = [&](auto* dst) {
    using D = std::remove_pointer_t<decltype(dst)>;
    auto load = [&](auto tag) {
      using S = decltype(tag);
      for (int64_t i = 0; i < n; ++i) {
        S v;
        std::memcpy(&v, src + i * sizeof(S), sizeof(S));
        dst[i] = static_cast<D>(v);
      }
    };
    switch (type) {
      case IdxType::kUInt8: load(uint8_t{}); break;
      case IdxType::kInt8: load(int8_t{}); break;
      case IdxType::kInt16: load(int16_t{}); break;
      case IdxType::kInt32: load(int32_t{}); break;
      case IdxType::kFloat32: load(float{}); break;
      case IdxType::kFloat64: load(double{}); break;
    }
  };
  if (!isFloat) convert(out.data<int64_t>());
  else if (floatDType == DType::kFloat32) convert(out.data<float>());
  else convert(out.data<double>());
  return out;
}

void writeIdx(const std::string& path, IdxType type, const Shape& shape, const void* bytes, bool gzip) {
  DG_CHECK(validType(static_cast<uint8_t>(type)), "writeIdx: invalid type code ", static_cast<int>(type));
  DG_CHECK(!shape.empty() && shape.size() <= 255, "writeIdx: expected 1..255 dims, got ", shape.size());
  std::vector<uint8_t> header{0, 0, static_cast<uint8_t>(type), static_cast<uint8_t>(shape.size())};
  for (int64_t s : shape) {
    DG_CHECK(s >= 0 && s <= std::numeric_limits<uint32_t>::max(), "writeIdx: dimension ", s, " does not fit in u32");
    const auto u = static_cast<uint32_t>(s);
    for (int shift = 24; shift >= 0; shift -= 8) header.push_back(static_cast<uint8_t>(u >> shift));
  }
  const size_t itemSize = idxItemSize(type);
  std::vector<uint8_t> body(static_cast<size_t>(tensor::numelOf(shape)) * itemSize);
  DG_CHECK(body.empty() || bytes != nullptr, "writeIdx: null data for shape ", tensor::shapeStr(shape));
  if (!body.empty()) std::memcpy(body.data(), bytes, body.size());
  if constexpr (std::endian::native == std::endian::little) byteSwapInPlace(body.data(), body.size() / itemSize, itemSize);

  // "wb" compresses; "wbT" writes plain bytes through the same API.
  GzFile file(path, gzip ? "wb" : "wbT");
  DG_CHECK(static_cast<bool>(file), "writeIdx: cannot open '", path, "' for writing: ", std::strerror(errno));
  auto put = [&](const std::vector<uint8_t>& v) {
    size_t off = 0;
    while (off < v.size()) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(v.size() - off, 1u << 30));
      DG_CHECK(gzwrite(file.get(), v.data() + off, chunk) == static_cast<int>(chunk), "writeIdx: writing '", path,
               "' failed");
      off += chunk;
    }
  };
  put(header);
  put(body);
  DG_CHECK(file.close() == Z_OK, "writeIdx: closing '", path, "' failed");
}

}  // namespace distgrad::models::data
