#include "rpc/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <optional>
#include <unordered_map>

#include "rpc/error.h"
#include "rpc/options.h"
#include "tensor/error.h"

namespace distgrad::rpc {

namespace {

using Clock = std::chrono::steady_clock;

enum class Opcode : uint8_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kCheck = 5,
  kWait = 6,
  kDeleteKey = 7,
  kNumKeys = 8,
};

enum class Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

// The longest wait a request may ask for; longer values are clamped (a week is "forever" for a job).
constexpr uint64_t kMaxWaitMs = uint64_t{7} * 24 * 3600 * 1000;
// How long past the server-enforced deadline a client waits before giving up on a silent server.
constexpr std::chrono::milliseconds kClientGrace{30'000};
// Largest response a client accepts (values are bounded by the server's limits, far below this).
constexpr uint32_t kMaxResponseBytes = 1u << 30;

std::string errnoText(int err) { return std::string(std::strerror(err)); }

// --- Encoding ---------------------------------------------------------------------------------------------

class Writer {
 public:
  Writer() { bytes_.resize(4); }  // room for the length prefix
  Writer& u8(uint8_t v) {
    bytes_.push_back(v);
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Writer& u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Writer& i64(int64_t v) { return u64(static_cast<uint64_t>(v)); }
  Writer& bytes(std::span<const uint8_t> b) {
    u32(static_cast<uint32_t>(b.size()));
    bytes_.insert(bytes_.end(), b.begin(), b.end());
    return *this;
  }
  Writer& str(std::string_view s) { return bytes(std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size())); }
  // The finished message: the length prefix filled in.
  std::vector<uint8_t> finish() {
    const auto body = static_cast<uint32_t>(bytes_.size() - 4);
    for (int i = 0; i < 4; ++i) bytes_[i] = static_cast<uint8_t>(body >> (8 * i));
    return std::move(bytes_);
  }

 private:
  std::vector<uint8_t> bytes_;
};

uint32_t loadU32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

// Bounds-checked reads over an untrusted body; any failure sets ok() to false and returns empty values.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> body) : body_(body) {}
  bool ok() const { return ok_; }
  bool atEnd() const { return pos_ == body_.size(); }
  // Why reading failed, when more specific than "malformed" (e.g. a field over its limit), else empty.
  const std::string& problem() const { return problem_; }
  uint8_t u8() {
    if (!need(1)) return 0;
    return body_[pos_++];
  }
  uint32_t u32() {
    if (!need(4)) return 0;
    const uint32_t v = loadU32(body_.data() + pos_);
    pos_ += 4;
    return v;
  }
  uint64_t u64() {
    if (!need(8)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{body_[pos_ + i]} << (8 * i);
    pos_ += 8;
    return v;
  }
  std::span<const uint8_t> bytes(uint32_t maxLength) {
    const uint32_t length = u32();
    if (ok_ && length > maxLength) {
      problem_ = ": a field of " + std::to_string(length) + " bytes exceeds the limit of " + std::to_string(maxLength);
      ok_ = false;
    }
    if (!ok_ || !need(length)) {
      ok_ = false;
      return {};
    }
    auto out = body_.subspan(pos_, length);
    pos_ += length;
    return out;
  }

 private:
  bool need(size_t n) {
    if (!ok_ || body_.size() - pos_ < n) ok_ = false;
    return ok_;
  }
  std::span<const uint8_t> body_;
  size_t pos_ = 0;
  bool ok_ = true;
  std::string problem_;
};

// A response body without its status byte.
std::span<const uint8_t> afterStatus(const std::vector<uint8_t>& body) {
  return std::span<const uint8_t>(body).subspan(1);
}

std::string asString(std::span<const uint8_t> b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }
std::span<const uint8_t> asBytes(std::string_view s) {
  return std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

std::string formatAddress(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

void setNonBlocking(int fd, bool on) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

// --- Server -----------------------------------------------------------------------------------------------

struct StoreServer::Impl {
  struct Client {
    int fd = -1;
    std::vector<uint8_t> in;
    std::vector<uint8_t> out;
    size_t outOffset = 0;
    // A get/wait whose keys were missing: answered when they all exist or at the deadline.
    bool parked = false;
    Opcode parkedOp = Opcode::kWait;
    std::vector<std::string> parkedKeys;
    Clock::time_point deadline;
    bool dead = false;
  };

  StoreLimits limits;
  size_t maxRequestBytes = 0;
  int listenFd = -1;
  int wakeFd = -1;
  std::atomic<bool> stopping{false};
  std::unordered_map<std::string, std::vector<uint8_t>> data;
  std::vector<std::unique_ptr<Client>> clients;
  bool mutated = false;  // a key was created or changed: parked clients may be ready

  ~Impl() {
    for (auto& c : clients) {
      if (c->fd >= 0) ::close(c->fd);
    }
    if (listenFd >= 0) ::close(listenFd);
    if (wakeFd >= 0) ::close(wakeFd);
  }

  bool allExist(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data.count(k) != 0; });
  }

  static void respond(Client& c, std::vector<uint8_t> message) {
    c.out.insert(c.out.end(), message.begin(), message.end());
  }
  static void respondOk(Client& c) { respond(c, Writer().u8(uint8_t(Status::kOk)).finish()); }
  static void respondError(Client& c, std::string_view message) {
    respond(c, Writer().u8(uint8_t(Status::kError)).str(message).finish());
  }

  // Answers a parked request whose keys all exist.
  void completeParked(Client& c) {
    if (c.parkedOp == Opcode::kGet) {
      respond(c, Writer().u8(uint8_t(Status::kOk)).bytes(data.at(c.parkedKeys.front())).finish());
    } else {
      respondOk(c);
    }
    c.parked = false;
    c.parkedKeys.clear();
  }

  void timeoutParked(Client& c) {
    Writer w;
    w.u8(uint8_t(Status::kTimeout));
    std::vector<std::string> missing;
    for (const auto& k : c.parkedKeys) {
      if (data.count(k) == 0) missing.push_back(k);
    }
    w.u32(static_cast<uint32_t>(missing.size()));
    for (const auto& k : missing) w.str(k);
    respond(c, w.finish());
    c.parked = false;
    c.parkedKeys.clear();
  }

  // Closes a client whose bytes broke the protocol; tells it why on a best-effort basis.
  void reject(Client& c, std::string_view why, std::atomic<size_t>& rejectedCounter) {
    // Count first: a test (or monitor) that reads the counter after seeing the reply must see it.
    rejectedCounter.fetch_add(1);
    // Queue the reason behind any answers still pending for this client, push out what the socket takes now,
    // and drop the connection without waiting for a slow reader.
    respond(c, Writer().u8(uint8_t(Status::kError)).str(why).finish());
    (void)flush(c);
    c.dead = true;
  }

  // Executes one well-framed request body. Returns an error text for a malformed body (the caller closes
  // the client), or nullopt when the request was answered or parked.
  std::optional<std::string> execute(Client& c, std::span<const uint8_t> body) {
    Reader r(body);
    const uint8_t opcode = r.u8();
    // An empty key, a zero key count or a malformed key list all come back empty; callers reject those.
    auto readKey = [&]() -> std::string { return asString(r.bytes(limits.maxKeyBytes)); };
    auto readKeys = [&]() -> std::vector<std::string> {
      const uint32_t count = r.u32();
      std::vector<std::string> keys;
      if (!r.ok() || count == 0 || count > limits.maxKeysPerRequest) return {};
      for (uint32_t i = 0; i < count; ++i) {
        std::string key = readKey();
        if (!r.ok() || key.empty()) return {};
        keys.push_back(std::move(key));
      }
      return keys;
    };
    switch (static_cast<Opcode>(opcode)) {
      case Opcode::kSet: {
        std::string key = readKey();
        auto value = r.bytes(limits.maxValueBytes);
        if (!r.ok() || key.empty() || !r.atEnd()) return "malformed set request" + r.problem();
        data[key].assign(value.begin(), value.end());
        mutated = true;
        respondOk(c);
        return std::nullopt;
      }
      case Opcode::kGet:
      case Opcode::kWait: {
        std::vector<std::string> keys;
        if (static_cast<Opcode>(opcode) == Opcode::kGet) {
          std::string key = readKey();
          if (!key.empty()) keys.push_back(std::move(key));
        } else {
          keys = readKeys();
        }
        const uint64_t timeoutMs = std::min(r.u64(), kMaxWaitMs);
        if (!r.ok() || keys.empty() || !r.atEnd()) return "malformed get/wait request" + r.problem();
        c.parkedOp = static_cast<Opcode>(opcode);
        c.parkedKeys = std::move(keys);
        if (allExist(c.parkedKeys)) {
          completeParked(c);
        } else {
          c.parked = true;
          c.deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
        }
        return std::nullopt;
      }
      case Opcode::kAdd: {
        std::string key = readKey();
        const auto delta = static_cast<int64_t>(r.u64());
        if (!r.ok() || key.empty() || !r.atEnd()) return "malformed add request" + r.problem();
        int64_t current = 0;
        auto it = data.find(key);
        if (it != data.end()) {
          const auto& v = it->second;
          const char* begin = reinterpret_cast<const char*>(v.data());
          auto [ptr, ec] = std::from_chars(begin, begin + v.size(), current);
          if (v.empty() || ec != std::errc() || ptr != begin + v.size()) {
            respondError(c, "add: key '" + key + "' holds a value that is not a decimal integer");
            return std::nullopt;
          }
        }
        int64_t next = 0;
        if (__builtin_add_overflow(current, delta, &next)) {
          respondError(c, "add: counter '" + key + "' would overflow int64 (" + std::to_string(current) + " + " +
                              std::to_string(delta) + ")");
          return std::nullopt;
        }
        const std::string text = std::to_string(next);
        data[key].assign(text.begin(), text.end());
        mutated = true;
        respond(c, Writer().u8(uint8_t(Status::kOk)).i64(next).finish());
        return std::nullopt;
      }
      case Opcode::kCompareSet: {
        std::string key = readKey();
        auto expected = r.bytes(limits.maxValueBytes);
        auto desired = r.bytes(limits.maxValueBytes);
        if (!r.ok() || key.empty() || !r.atEnd()) return "malformed compareSet request" + r.problem();
        auto it = data.find(key);
        if (it == data.end()) {
          if (expected.empty()) {
            data[key].assign(desired.begin(), desired.end());
            mutated = true;
            respond(c, Writer().u8(uint8_t(Status::kOk)).bytes(desired).finish());
          } else {
            respond(c, Writer().u8(uint8_t(Status::kOk)).bytes({}).finish());
          }
        } else if (std::equal(it->second.begin(), it->second.end(), expected.begin(), expected.end())) {
          it->second.assign(desired.begin(), desired.end());
          mutated = true;
          respond(c, Writer().u8(uint8_t(Status::kOk)).bytes(desired).finish());
        } else {
          respond(c, Writer().u8(uint8_t(Status::kOk)).bytes(it->second).finish());
        }
        return std::nullopt;
      }
      case Opcode::kCheck: {
        std::vector<std::string> keys = readKeys();
        if (!r.ok() || keys.empty() || !r.atEnd()) return "malformed check request" + r.problem();
        respond(c, Writer().u8(uint8_t(Status::kOk)).u8(allExist(keys) ? 1 : 0).finish());
        return std::nullopt;
      }
      case Opcode::kDeleteKey: {
        std::string key = readKey();
        if (!r.ok() || key.empty() || !r.atEnd()) return "malformed deleteKey request" + r.problem();
        const bool existed = data.erase(key) != 0;
        respond(c, Writer().u8(uint8_t(Status::kOk)).u8(existed ? 1 : 0).finish());
        return std::nullopt;
      }
      case Opcode::kNumKeys: {
        if (!r.ok() || !r.atEnd()) return "malformed numKeys request" + r.problem();
        respond(c, Writer().u8(uint8_t(Status::kOk)).u64(data.size()).finish());
        return std::nullopt;
      }
    }
    return "unknown opcode " + std::to_string(opcode);
  }

  // Runs every complete request buffered for `c` until it parks or the buffer runs dry.
  void processInput(Client& c, std::atomic<size_t>& rejectedCounter) {
    size_t consumed = 0;
    while (!c.parked && !c.dead && c.in.size() - consumed >= 4) {
      const uint32_t bodyBytes = loadU32(c.in.data() + consumed);
      if (bodyBytes == 0 || bodyBytes > maxRequestBytes) {
        reject(c, "request of " + std::to_string(bodyBytes) + " bytes is outside [1, " +
                      std::to_string(maxRequestBytes) + "]",
               rejectedCounter);
        return;
      }
      if (c.in.size() - consumed - 4 < bodyBytes) break;
      std::span<const uint8_t> body(c.in.data() + consumed + 4, bodyBytes);
      std::optional<std::string> problem;
      try {
        problem = execute(c, body);
      } catch (const std::exception& e) {
        problem = std::string("request failed: ") + e.what();
      }
      if (problem) {
        reject(c, *problem, rejectedCounter);
        return;
      }
      consumed += 4 + bodyBytes;
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(consumed));
  }

  // Reads what the socket has; false when the peer closed or the connection failed.
  bool readFrom(Client& c, std::atomic<size_t>& rejectedCounter) {
    uint8_t chunk[64 * 1024];
    while (true) {
      const ssize_t n = ::recv(c.fd, chunk, sizeof(chunk), MSG_DONTWAIT);
      if (n > 0) {
        c.in.insert(c.in.end(), chunk, chunk + n);
        processInput(c, rejectedCounter);
        if (c.dead) return false;
        // A parked client has nothing legitimate to send; bound what it may buffer.
        if (c.in.size() > maxRequestBytes + 4) {
          reject(c, "client sent more than one request's worth of bytes while waiting", rejectedCounter);
          return false;
        }
        continue;
      }
      if (n == 0) return false;
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
  }

  bool flush(Client& c) {
    while (c.outOffset < c.out.size()) {
      const ssize_t n =
          ::send(c.fd, c.out.data() + c.outOffset, c.out.size() - c.outOffset, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.outOffset += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      return false;
    }
    c.out.clear();
    c.outOffset = 0;
    return true;
  }

  // Answers parked requests whose keys now exist, then lets those clients continue with buffered input
  // (which may mutate more keys, hence the loop).
  void wakeParked(std::atomic<size_t>& rejectedCounter) {
    while (mutated) {
      mutated = false;
      for (auto& c : clients) {
        if (c->dead || !c->parked || !allExist(c->parkedKeys)) continue;
        completeParked(*c);
        processInput(*c, rejectedCounter);
      }
    }
  }

  void expireParked(std::atomic<size_t>& rejectedCounter) {
    const auto now = Clock::now();
    for (auto& c : clients) {
      if (c->dead || !c->parked || c->deadline > now) continue;
      timeoutParked(*c);
      processInput(*c, rejectedCounter);
    }
  }

  int pollTimeoutMs() const {
    std::optional<Clock::time_point> nearest;
    for (const auto& c : clients) {
      if (c->parked && !c->dead && (!nearest || c->deadline < *nearest)) nearest = c->deadline;
    }
    if (!nearest) return -1;
    const auto remaining = std::chrono::ceil<std::chrono::milliseconds>(*nearest - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(remaining, 0, 60'000));
  }
};

std::unique_ptr<StoreServer> StoreServer::start(const std::string& address, StoreLimits limits) {
  auto [host, port] = parseHostPort(address, "StoreServer address");
  DG_CHECK(limits.maxKeyBytes >= 1 && limits.maxValueBytes >= 1 && limits.maxKeysPerRequest >= 1 &&
               limits.maxClients >= 1,
           "StoreServer: every StoreLimits field must be >= 1");
  DG_CHECK(uint64_t{limits.maxValueBytes} * 2 + limits.maxKeyBytes < (1ull << 31),
           "StoreServer: StoreLimits.maxValueBytes ", limits.maxValueBytes, " is too large (max 1 GiB)");

  auto server = std::unique_ptr<StoreServer>(new StoreServer());
  server->impl_ = std::make_unique<Impl>();
  Impl& impl = *server->impl_;
  impl.limits = limits;
  // compareSet is the largest request: opcode, a key and two values with their length prefixes.
  impl.maxRequestBytes = 1 + 3 * 4 + size_t{limits.maxKeyBytes} + 2 * size_t{limits.maxValueBytes};

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string portText = std::to_string(port);
  const int gai = getaddrinfo(host.c_str(), portText.c_str(), &hints, &found);
  if (gai != 0) {
    throw RpcError(Error::failed("StoreServer: cannot resolve '" + address + "': " + gai_strerror(gai)));
  }
  std::string lastError = "no usable address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      lastError = errnoText(errno);
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
      lastError = errnoText(errno);
      ::close(fd);
      continue;
    }
    impl.listenFd = fd;
    break;
  }
  freeaddrinfo(found);
  if (impl.listenFd < 0) {
    throw RpcError(Error::failed("StoreServer: cannot listen on '" + address + "': " + lastError));
  }
  sockaddr_storage bound{};
  socklen_t boundLen = sizeof(bound);
  getsockname(impl.listenFd, reinterpret_cast<sockaddr*>(&bound), &boundLen);
  server->port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                               : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  server->host_ = host;
  impl.wakeFd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  DG_ASSERT(impl.wakeFd >= 0, "eventfd failed: ", errnoText(errno));
  server->thread_ = std::thread([s = server.get()] { s->run(); });
  return server;
}

StoreServer::~StoreServer() {
  if (impl_) {
    impl_->stopping.store(true);
    const uint64_t one = 1;
    (void)!::write(impl_->wakeFd, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
}

std::string StoreServer::address() const { return formatAddress(host_, port_); }

void StoreServer::run() {
  Impl& impl = *impl_;
  std::vector<pollfd> fds;
  while (!impl.stopping.load()) {
    fds.clear();
    fds.push_back({impl.wakeFd, POLLIN, 0});
    const bool acceptMore = impl.clients.size() < impl.limits.maxClients;
    fds.push_back({acceptMore ? impl.listenFd : -1, POLLIN, 0});
    for (const auto& c : impl.clients) {
      short events = POLLIN;
      if (c->outOffset < c->out.size()) events |= POLLOUT;
      fds.push_back({c->fd, events, 0});
    }
    const int ready = ::poll(fds.data(), fds.size(), impl.pollTimeoutMs());
    if (ready < 0 && errno != EINTR) {
      // poll only fails on programming errors (EFAULT, EINVAL); nothing sensible to do but stop serving.
      break;
    }
    if (impl.stopping.load()) break;

    // Clients first (indices in fds match impl.clients as they were when fds was built).
    const size_t existing = fds.size() - 2;
    for (size_t i = 0; i < existing; ++i) {
      auto& c = *impl.clients[i];
      const short revents = fds[i + 2].revents;
      if (revents == 0 || c.dead) continue;
      if (revents & (POLLIN | POLLHUP | POLLERR)) {
        if (!impl.readFrom(c, rejectedClients_)) c.dead = true;
      }
    }
    if (ready > 0 && (fds[1].revents & POLLIN)) {
      while (impl.clients.size() < impl.limits.maxClients) {
        const int fd = ::accept4(impl.listenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;  // EAGAIN, or a transient error (ECONNABORTED, EMFILE): try again next round
        setNoDelay(fd);
        auto client = std::make_unique<Impl::Client>();
        client->fd = fd;
        impl.clients.push_back(std::move(client));
      }
    }
    if (fds[0].revents & POLLIN) {
      uint64_t drained = 0;
      (void)!::read(impl.wakeFd, &drained, sizeof(drained));
    }

    impl.wakeParked(rejectedClients_);
    impl.expireParked(rejectedClients_);
    impl.wakeParked(rejectedClients_);

    // Publish before answering, so whoever sees an answer also sees the count that goes with it.
    parkedRequests_.store(static_cast<size_t>(std::count_if(impl.clients.begin(), impl.clients.end(),
                                                            [](const auto& c) { return c->parked && !c->dead; })));
    for (auto& c : impl.clients) {
      if (!c->dead && !impl.flush(*c)) c->dead = true;
    }
    // Drop closed clients.
    auto firstDead = std::stable_partition(impl.clients.begin(), impl.clients.end(),
                                           [](const auto& c) { return !c->dead; });
    for (auto it = firstDead; it != impl.clients.end(); ++it) ::close((*it)->fd);
    impl.clients.erase(firstDead, impl.clients.end());
    clientCount_.store(impl.clients.size());
  }
}

// --- Client -----------------------------------------------------------------------------------------------

std::unique_ptr<StoreClient> StoreClient::connect(const std::string& address, std::chrono::milliseconds timeout) {
  DG_CHECK(timeout.count() > 0, "StoreClient::connect: timeout must be > 0 ms, got ", timeout.count());
  auto [host, port] = parseHostPort(address, "StoreClient address");
  DG_CHECK(port != 0, "StoreClient::connect: address '", address, "' has port 0");
  const auto deadline = Clock::now() + timeout;
  const std::string portText = std::to_string(port);
  std::string lastError = "no attempt made";
  auto backoff = std::chrono::milliseconds(5);
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int gai = getaddrinfo(host.c_str(), portText.c_str(), &hints, &found);
    if (gai != 0) {
      lastError = std::string("cannot resolve host: ") + gai_strerror(gai);
    } else {
      for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
        const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
          lastError = errnoText(errno);
          continue;
        }
        int err = 0;
        if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
          err = errno;
          if (err == EINPROGRESS) {
            const auto remaining = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
            pollfd p{fd, POLLOUT, 0};
            const int r = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(remaining, 0)));
            if (r <= 0) {
              err = ETIMEDOUT;
            } else {
              socklen_t len = sizeof(err);
              getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            }
          }
        }
        if (err == 0) {
          freeaddrinfo(found);
          setNonBlocking(fd, false);
          setNoDelay(fd);
          return std::unique_ptr<StoreClient>(new StoreClient(fd, address));
        }
        lastError = errnoText(err);
        ::close(fd);
      }
      freeaddrinfo(found);
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    // The server may simply not be up yet: retry with a capped exponential backoff.
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
  throw RpcError(Error::timeout("could not connect to the store at " + address + " within " +
                                std::to_string(timeout.count()) + " ms: " + lastError));
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<uint8_t> StoreClient::roundTrip(const std::vector<uint8_t>& request,
                                            std::chrono::milliseconds serverTimeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0) throw RpcError(Error::disconnected("the connection to the store at " + address_ + " was lost"));
  auto fail = [&](Error error) -> RpcError {
    ::close(fd_);
    fd_ = -1;
    return RpcError(std::move(error));
  };
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd_, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw fail(Error::disconnected("sending to the store at " + address_ + " failed: " + errnoText(errno)));
    }
    sent += static_cast<size_t>(n);
  }
  const auto deadline = Clock::now() + serverTimeout + kClientGrace;
  auto readExact = [&](uint8_t* out, size_t size) {
    size_t got = 0;
    while (got < size) {
      const auto remaining = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (remaining <= 0) {
        throw fail(Error::timeout("the store at " + address_ + " did not answer within " +
                                  std::to_string((serverTimeout + kClientGrace).count()) + " ms"));
      }
      pollfd p{fd_, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(remaining, 60'000)));
      if (r < 0 && errno == EINTR) continue;
      if (r == 0) continue;
      const ssize_t n = ::recv(fd_, out + got, size - got, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) throw fail(Error::disconnected("the store at " + address_ + " closed the connection"));
      if (n < 0) {
        throw fail(Error::disconnected("receiving from the store at " + address_ + " failed: " + errnoText(errno)));
      }
      got += static_cast<size_t>(n);
    }
  };
  uint8_t header[4];
  readExact(header, 4);
  const uint32_t bodyBytes = loadU32(header);
  if (bodyBytes == 0 || bodyBytes > kMaxResponseBytes) {
    throw fail(Error::failed("the store at " + address_ + " sent a response of " + std::to_string(bodyBytes) +
                             " bytes"));
  }
  std::vector<uint8_t> body(bodyBytes);
  readExact(body.data(), body.size());
  if (body[0] == uint8_t(Status::kError)) {
    Reader r(afterStatus(body));
    const std::string message = asString(r.bytes(kMaxResponseBytes));
    throw RpcError(Error::failed("store at " + address_ + ": " + (r.ok() ? message : "malformed error response")));
  }
  if (body[0] != uint8_t(Status::kOk) && body[0] != uint8_t(Status::kTimeout)) {
    throw fail(Error::failed("the store at " + address_ + " sent an unknown status " + std::to_string(body[0])));
  }
  return body;
}

namespace {

void checkKey(std::string_view key, const char* op) {
  DG_CHECK(!key.empty(), "StoreClient::", op, ": the key must not be empty");
  DG_CHECK(key.size() <= std::numeric_limits<uint32_t>::max(), "StoreClient::", op, ": key is too long");
}

uint64_t timeoutMs(std::chrono::milliseconds timeout, const char* op) {
  DG_CHECK(timeout.count() >= 0, "StoreClient::", op, ": timeout must be >= 0 ms, got ", timeout.count());
  return std::min<uint64_t>(static_cast<uint64_t>(timeout.count()), kMaxWaitMs);
}

// A malformed ok response is the server's (or the network's) fault, never the caller's.
[[noreturn]] void badResponse(const std::string& address, const char* op) {
  throw RpcError(Error::failed("the store at " + address + " sent a malformed " + op + " response"));
}

std::string joinKeys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    if (!out.empty()) out += ", ";
    out += "'" + k + "'";
  }
  return out;
}

}  // namespace

void StoreClient::set(std::string_view key, std::span<const uint8_t> value) {
  checkKey(key, "set");
  DG_CHECK(value.size() <= std::numeric_limits<uint32_t>::max(), "StoreClient::set: value is too large");
  (void)roundTrip(Writer().u8(uint8_t(Opcode::kSet)).str(key).bytes(value).finish(), {});
}

void StoreClient::set(std::string_view key, std::string_view value) { set(key, asBytes(value)); }

std::vector<uint8_t> StoreClient::get(std::string_view key, std::chrono::milliseconds timeout) {
  checkKey(key, "get");
  const uint64_t ms = timeoutMs(timeout, "get");
  auto body = roundTrip(Writer().u8(uint8_t(Opcode::kGet)).str(key).u64(ms).finish(), std::chrono::milliseconds(ms));
  if (body[0] == uint8_t(Status::kTimeout)) {
    throw RpcError(Error::timeout("store get of key '" + std::string(key) + "' timed out after " +
                                  std::to_string(ms) + " ms (store " + address_ + ")"));
  }
  Reader r(afterStatus(body));
  auto value = r.bytes(kMaxResponseBytes);
  if (!r.ok() || !r.atEnd()) badResponse(address_, "get");
  return std::vector<uint8_t>(value.begin(), value.end());
}

std::string StoreClient::getString(std::string_view key, std::chrono::milliseconds timeout) {
  auto bytes = get(key, timeout);
  return asString(bytes);
}

int64_t StoreClient::add(std::string_view key, int64_t delta) {
  checkKey(key, "add");
  auto body = roundTrip(Writer().u8(uint8_t(Opcode::kAdd)).str(key).i64(delta).finish(), {});
  Reader r(afterStatus(body));
  const auto value = static_cast<int64_t>(r.u64());
  if (body[0] != uint8_t(Status::kOk) || !r.ok() || !r.atEnd()) badResponse(address_, "add");
  return value;
}

std::vector<uint8_t> StoreClient::compareSet(std::string_view key, std::span<const uint8_t> expected,
                                             std::span<const uint8_t> desired) {
  checkKey(key, "compareSet");
  auto body = roundTrip(Writer().u8(uint8_t(Opcode::kCompareSet)).str(key).bytes(expected).bytes(desired).finish(), {});
  Reader r(afterStatus(body));
  auto value = r.bytes(kMaxResponseBytes);
  if (body[0] != uint8_t(Status::kOk) || !r.ok() || !r.atEnd()) badResponse(address_, "compareSet");
  return std::vector<uint8_t>(value.begin(), value.end());
}

std::string StoreClient::compareSet(std::string_view key, std::string_view expected, std::string_view desired) {
  return asString(compareSet(key, asBytes(expected), asBytes(desired)));
}

namespace {
Writer& writeKeys(Writer& w, const std::vector<std::string>& keys, const char* op) {
  DG_CHECK(!keys.empty(), "StoreClient::", op, ": at least one key is required");
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) {
    checkKey(k, op);
    w.str(k);
  }
  return w;
}
}  // namespace

bool StoreClient::check(const std::vector<std::string>& keys) {
  Writer w;
  w.u8(uint8_t(Opcode::kCheck));
  writeKeys(w, keys, "check");
  auto body = roundTrip(w.finish(), {});
  Reader r(afterStatus(body));
  const uint8_t exists = r.u8();
  if (body[0] != uint8_t(Status::kOk) || !r.ok() || !r.atEnd() || exists > 1) badResponse(address_, "check");
  return exists == 1;
}

void StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const uint64_t ms = timeoutMs(timeout, "wait");
  Writer w;
  w.u8(uint8_t(Opcode::kWait));
  writeKeys(w, keys, "wait");
  w.u64(ms);
  auto body = roundTrip(w.finish(), std::chrono::milliseconds(ms));
  if (body[0] == uint8_t(Status::kTimeout)) {
    Reader r(afterStatus(body));
    const uint32_t count = r.u32();
    std::vector<std::string> missing;
    for (uint32_t i = 0; i < count && r.ok() && i < keys.size(); ++i) missing.push_back(asString(r.bytes(kMaxResponseBytes)));
    if (!r.ok()) missing = keys;
    throw RpcError(Error::timeout("store wait timed out after " + std::to_string(ms) + " ms; missing keys: " +
                                  joinKeys(missing) + " (store " + address_ + ")"));
  }
  if (body.size() != 1) badResponse(address_, "wait");
}

bool StoreClient::deleteKey(std::string_view key) {
  checkKey(key, "deleteKey");
  auto body = roundTrip(Writer().u8(uint8_t(Opcode::kDeleteKey)).str(key).finish(), {});
  Reader r(afterStatus(body));
  const uint8_t existed = r.u8();
  if (body[0] != uint8_t(Status::kOk) || !r.ok() || !r.atEnd() || existed > 1) badResponse(address_, "deleteKey");
  return existed == 1;
}

uint64_t StoreClient::numKeys() {
  auto body = roundTrip(Writer().u8(uint8_t(Opcode::kNumKeys)).finish(), {});
  Reader r(afterStatus(body));
  const uint64_t count = r.u64();
  if (body[0] != uint8_t(Status::kOk) || !r.ok() || !r.atEnd()) badResponse(address_, "numKeys");
  return count;
}

void StoreClient::barrier(std::string_view name, int worldSize, std::chrono::milliseconds timeout) {
  DG_CHECK(!name.empty(), "StoreClient::barrier: the name must not be empty");
  DG_CHECK(worldSize >= 1, "StoreClient::barrier: worldSize must be >= 1, got ", worldSize);
  const std::string prefix = "barrier/" + std::string(name);
  // The n-th arrival overall belongs to round (n-1)/worldSize; the last arrival of a round opens it. This
  // makes the same name reusable as long as every participant calls it the same number of times.
  const int64_t arrival = add(prefix + "/arrived", 1);
  const int64_t round = (arrival - 1) / worldSize;
  const std::string doneKey = prefix + "/done/" + std::to_string(round);
  if (arrival % worldSize == 0) {
    // The last arrival opens the round and need not wait. This also makes a barrier usable as the final
    // check-out before the host stops the store: every other participant is already parked, and the server
    // sends all their answers in the same loop turn as this set's reply.
    set(doneKey, std::string_view("1"));
    return;
  }
  try {
    wait({doneKey}, timeout);
  } catch (const RpcError& e) {
    if (e.kind() != ErrorKind::kTimeout) throw;
    const int64_t arrived = add(prefix + "/arrived", 0) - round * worldSize;
    throw RpcError(Error::timeout("barrier '" + std::string(name) + "' timed out after " +
                                  std::to_string(timeout.count()) + " ms: " + std::to_string(arrived) + " of " +
                                  std::to_string(worldSize) + " participants arrived"));
  }
}

}  // namespace distgrad::rpc
