#include "models/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <unordered_set>
#include <vector>

#include "models/nn/module.h"

namespace distgrad::models {
namespace {

// Tensor bytes are written in host order; every machine we target is little-endian, and the format says so.
static_assert(std::endian::native == std::endian::little, "checkpoint format assumes a little-endian host");

constexpr char kMagic[8] = {'D', 'G', 'C', 'K', 'P', 'T', '\r', '\n'};
constexpr char kFooterMagic[4] = {'D', 'G', 'N', 'D'};
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8;
constexpr size_t kFooterBytes = 4 + 4;
constexpr uint32_t kMaxNameBytes = 1 << 16;
constexpr uint8_t kMaxDims = 32;

std::string osError() { return std::strerror(errno); }

uint32_t crcUpdate(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = static_cast<uint32_t>(::crc32(crc, p, chunk));
    p += chunk;
    n -= chunk;
  }
  return crc;
}

// Buffered writer over a file descriptor that keeps the running CRC of everything written.
class FileWriter {
 public:
  FileWriter(int fd, const std::string& path) : fd_(fd), path_(path) { buffer_.reserve(kBufferBytes); }

  void write(const void* data, size_t n) {
    crc_ = crcUpdate(crc_, data, n);
    if (buffer_.size() + n > kBufferBytes) {
      flush();
      if (n >= kBufferBytes) {  // large tensors go straight to the file
        writeAll(data, n);
        return;
      }
    }
    const auto* p = static_cast<const char*>(data);
    buffer_.insert(buffer_.end(), p, p + n);
  }
  template <typename T>
  void writeValue(T value) {
    write(&value, sizeof(T));
  }
  void flush() {
    if (!buffer_.empty()) writeAll(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  uint32_t crc() const { return crc_; }

 private:
  static constexpr size_t kBufferBytes = 1 << 20;
  void writeAll(const void* data, size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw ValueError("writeCheckpoint: writing '" + path_ + "' failed: " + osError());
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  int fd_;
  const std::string& path_;
  std::vector<char> buffer_;
  uint32_t crc_ = 0;
};

// Closes the descriptor and removes the temporary file unless released (on success it has been renamed).
class TempFile {
 public:
  TempFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!released_) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  void close(const std::string& target) {
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) throw ValueError("writeCheckpoint: closing the temporary file for '" + target + "' failed: " + osError());
  }
  void release() { released_ = true; }

 private:
  int fd_;
  std::string path_;
  bool released_ = false;
};

std::string directoryOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Cursor over the file's bytes; every read is bounds-checked and a short read is reported as truncation.
class Reader {
 public:
  Reader(const std::vector<char>& bytes, size_t end, const std::string& path)
      : bytes_(bytes), end_(end), path_(path) {}
  size_t remaining() const { return end_ - pos_; }
  size_t position() const { return pos_; }
  const char* take(size_t n, const char* what) {
    if (n > remaining()) {
      fail("truncated or corrupted: ", what, " needs ", n, " bytes at offset ", pos_, " but only ", remaining(),
           " remain before the footer");
    }
    const char* p = bytes_.data() + pos_;
    pos_ += n;
    return p;
  }
  template <typename T>
  T readValue(const char* what) {
    T v;
    std::memcpy(&v, take(sizeof(T), what), sizeof(T));
    return v;
  }
  template <typename... Args>
  [[noreturn]] void fail(Args&&... args) const {
    throw ValueError(detail::concatMessage("readCheckpoint: '", path_, "': ", std::forward<Args>(args)...));
  }

 private:
  const std::vector<char>& bytes_;
  size_t end_;
  const std::string& path_;
  size_t pos_ = 0;
};

}  // namespace

void writeCheckpoint(const StateDict& state, const std::string& path) {
  DG_CHECK(!path.empty(), "writeCheckpoint: empty path");
  const std::string dir = directoryOf(path);
  std::string tmpl = path + ".tmp.XXXXXX";
  int fd = ::mkstemp(tmpl.data());
  if (fd < 0) {
    throw ValueError("writeCheckpoint: cannot create a temporary file next to '" + path + "' (directory '" + dir +
                     "'): " + osError());
  }
  TempFile tmp(fd, tmpl);
  // mkstemp creates 0600; a checkpoint is an ordinary data file.
  ::fchmod(fd, 0644);

  FileWriter out(fd, path);
  out.write(kMagic, sizeof(kMagic));
  out.writeValue<uint32_t>(kCheckpointVersion);
  out.writeValue<uint32_t>(0);
  out.writeValue<uint64_t>(state.size());
  for (const auto& [name, value] : state) {
    DG_CHECK(!name.empty(), "writeCheckpoint: an entry has an empty name (readCheckpoint would refuse the file)");
    DG_CHECK(name.size() <= kMaxNameBytes, "writeCheckpoint: name '", name.substr(0, 64), "...' is longer than ",
             kMaxNameBytes, " bytes");
    DG_CHECK(value.dim() <= kMaxDims, "writeCheckpoint: '", name, "' has ", value.dim(), " dims (max ",
             static_cast<int>(kMaxDims), ")");
    Tensor cpu = value.device().isCpu() ? value : value.to(Device::cpu());
    if (!cpu.isContiguous()) cpu = cpu.cloneData();
    out.writeValue<uint32_t>(static_cast<uint32_t>(name.size()));
    out.write(name.data(), name.size());
    out.writeValue<uint8_t>(static_cast<uint8_t>(cpu.dtype()));
    out.writeValue<uint8_t>(static_cast<uint8_t>(cpu.dim()));
    for (int64_t d : cpu.shape()) out.writeValue<int64_t>(d);
    out.writeValue<uint64_t>(cpu.nbytes());
    if (cpu.nbytes() > 0) out.write(cpu.rawData(), cpu.nbytes());
  }
  const uint32_t crc = out.crc();
  out.writeValue<uint32_t>(crc);
  out.write(kFooterMagic, sizeof(kFooterMagic));
  out.flush();

  if (::fsync(fd) != 0) throw ValueError("writeCheckpoint: fsync of the temporary file for '" + path + "' failed: " + osError());
  tmp.close(path);
  if (::rename(tmp.path().c_str(), path.c_str()) != 0) {
    throw ValueError("writeCheckpoint: renaming the temporary file onto '" + path + "' failed: " + osError());
  }
  tmp.release();
  // The rename is durable only once the directory entry is on disk.
  int dirFd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirFd >= 0) {
    ::fsync(dirFd);
    ::close(dirFd);
  }
}

StateDict readCheckpoint(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ValueError("readCheckpoint: cannot open '" + path + "': " + osError());
  std::vector<char> bytes;
  {
    struct FdCloser {
      int fd;
      ~FdCloser() { ::close(fd); }
    } closer{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw ValueError("readCheckpoint: cannot stat '" + path + "': " + osError());
    DG_CHECK(S_ISREG(st.st_mode), "readCheckpoint: '", path, "' is not a regular file");
    bytes.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < bytes.size()) {
      ssize_t r = ::read(fd, bytes.data() + got, bytes.size() - got);
      if (r < 0) {
        if (errno == EINTR) continue;
        throw ValueError("readCheckpoint: reading '" + path + "' failed: " + osError());
      }
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    bytes.resize(got);
  }

  const size_t size = bytes.size();
  Reader header(bytes, size, path);
  if (size < kHeaderBytes + kFooterBytes) {
    header.fail("truncated: ", size, " bytes is shorter than the smallest checkpoint (",
                kHeaderBytes + kFooterBytes, " bytes)");
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) header.fail("not a distgrad checkpoint (bad magic)");
  header.take(sizeof(kMagic), "magic");
  const auto version = header.readValue<uint32_t>("version");
  if (version != kCheckpointVersion) {
    header.fail("unsupported checkpoint version ", version, " (this build reads version ", kCheckpointVersion, ")");
  }
  const auto flags = header.readValue<uint32_t>("flags");
  if (flags != 0) header.fail("unknown flags 0x", std::hex, flags);
  const auto count = header.readValue<uint64_t>("entry count");

  const size_t footer = size - kFooterBytes;
  if (std::memcmp(bytes.data() + footer + 4, kFooterMagic, sizeof(kFooterMagic)) != 0) {
    header.fail("truncated or corrupted: the footer is missing (file is ", size, " bytes)");
  }
  uint32_t storedCrc;
  std::memcpy(&storedCrc, bytes.data() + footer, 4);
  const uint32_t actualCrc = crcUpdate(0, bytes.data(), footer);
  if (storedCrc != actualCrc) {
    header.fail("corrupted: checksum mismatch (stored 0x", std::hex, storedCrc, ", computed 0x", actualCrc, ")");
  }

  // The checksum matched, but a file written by someone else (or crafted) can still lie; check everything.
  Reader in(bytes, footer, path);
  in.take(kHeaderBytes, "header");
  // Each entry takes at least 4 + 1 + 1 + 1 + 8 bytes, which bounds a forged count before any allocation.
  if (count > in.remaining() / 15) in.fail("corrupted: entry count ", count, " cannot fit in ", size, " bytes");
  StateDict state;
  for (uint64_t e = 0; e < count; ++e) {
    const auto nameLen = in.readValue<uint32_t>("name length");
    if (nameLen == 0 || nameLen > kMaxNameBytes) in.fail("corrupted: entry ", e, " has name length ", nameLen);
    std::string name(in.take(nameLen, "name"), nameLen);
    if (state.contains(name)) in.fail("corrupted: duplicate entry '", name, "'");
    const auto dtypeCode = in.readValue<uint8_t>("dtype");
    if (dtypeCode >= tensor::kNumDTypes) in.fail("corrupted: entry '", name, "' has unknown dtype code ", int{dtypeCode});
    const auto dtype = static_cast<DType>(dtypeCode);
    const auto ndim = in.readValue<uint8_t>("ndim");
    if (ndim > kMaxDims) in.fail("corrupted: entry '", name, "' has ", int{ndim}, " dims (max ", int{kMaxDims}, ")");
    Shape shape(ndim);
    uint64_t numel = 1;
    bool overflow = false;
    for (auto& d : shape) {
      d = in.readValue<int64_t>("dims");
      if (d < 0) in.fail("corrupted: entry '", name, "' has negative dimension ", d);
      if (d != 0 && numel > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) overflow = true;
      numel *= static_cast<uint64_t>(d);
    }
    const auto nbytes = in.readValue<uint64_t>("byte count");
    if (overflow || numel > nbytes || nbytes != numel * tensor::itemSize(dtype)) {
      in.fail("corrupted: entry '", name, "' of shape ", tensor::shapeStr(shape), " and dtype ",
              tensor::dtypeName(dtype), " declares ", nbytes, " bytes");
    }
    const char* data = in.take(nbytes, "tensor data");
    Tensor t = Tensor::empty(shape, dtype);
    if (nbytes > 0) std::memcpy(t.rawData(), data, nbytes);
    state.insert(std::move(name), std::move(t));
  }
  if (in.remaining() != 0) in.fail("corrupted: ", in.remaining(), " unexpected bytes after the last entry");
  return state;
}

void saveCheckpoint(const Module& module, const std::string& path) { writeCheckpoint(module.stateDict(), path); }

void loadCheckpoint(Module& module, const std::string& path, bool strict) {
  module.loadStateDict(readCheckpoint(path), strict);
}

}  // namespace distgrad::models
