// Note [Call order] and Note [Copying objects]: the method calls one reference issues on its RRef run at
// the owner in issue order (also while the object does not exist yet and its calls wait there), and
// toHere of an object is a copy made by its class's codec, taken after those calls; a class without a
// codec gives a clear error. Over inproc and tcp.
#include <gtest/gtest.h>

#include <map>
#include <thread>

#include "rref_test_util.h"

namespace distgrad::rref::testing {
namespace {

// Records the order its calls ran in. Copyable with a codec (visitFields), so toHere copies it.
class Log {
 public:
  Log() = default;
  explicit Log(std::string name) : name_(std::move(name)) {}
  Log(const Log& other) : name_(other.name_), seen_(other.snapshot()) {}
  Log& operator=(const Log&) = delete;

  int64_t append(int64_t v) {
    std::lock_guard<std::mutex> lock(mutex_);
    seen_.push_back(v);
    return static_cast<int64_t>(seen_.size());
  }
  std::vector<int64_t> seen() const { return snapshot(); }
  const std::string& name() const { return name_; }

  template <class V>
  void visitFields(V& v) {
    v("name", name_);
    v("seen", seen_);
  }

 private:
  std::vector<int64_t> snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }
  std::string name_;
  mutable std::mutex mutex_;
  std::vector<int64_t> seen_;
};
const rpc::Class<Log> kLog = rpc::Class<Log>("Log").method("append", &Log::append).method("seen", &Log::seen);

// The same with a constructor that waits for a test's gate (so calls queue while the object does not exist).
// Blocking an executor thread is what a real owner never does; here it holds one of the owner's four
// threads while the calls arrive on the others.
class GatedLog : public Log {
 public:
  GatedLog() = default;
  explicit GatedLog(std::string name) : Log(std::move(name)) {}
};
const rpc::Class<GatedLog> kGatedLog =
    rpc::Class<GatedLog>("GatedLog").method("append", &GatedLog::append).method("seen", &GatedLog::seen);
rpc::testing::Event* gGate = nullptr;

}  // namespace
}  // namespace distgrad::rref::testing

DG_RREF_CLASS(distgrad::rref::testing::Log, distgrad::rref::testing::kLog);
DG_RREF_CLASS(distgrad::rref::testing::GatedLog, distgrad::rref::testing::kGatedLog);

namespace distgrad::rref::testing {
namespace {

const rpc::Function<int64_t(RRef<Log>)> kKeepLog{"keep_log"};  // the callee keeps its reference
const rpc::Function<int64_t(RRef<Log>)> kCopyLog{"copy_log"};  // the callee copies it: how many entries

static_assert(rpc::CopyableObject<Log>);
static_assert(!rpc::CopyableObject<Counter>);  // no codec (and an atomic member)
template <typename T>
concept HasToHere = requires(const RRef<T>& r) { r.toHere(); };
static_assert(HasToHere<Log> && HasToHere<int64_t> && HasToHere<Tensor>);
static_assert(!HasToHere<Counter>);  // objects without a codec stay at their owner

class RRefOrder : public RRefFixture {
 protected:
  void bindExtra(rpc::Registry& registry) override {
    registry.bindClass(kLog).ctor<std::string>();
    registry.bind(kKeepLog, [this](const rpc::CallContext& ctx, RRef<Log> log) {
      std::lock_guard<std::mutex> lock(keptMutex_);
      kept_[ctx.callee] = log;
      return int64_t{0};
    });
    registry.bind(kCopyLog, [](RRef<Log> log) -> rpc::Future<int64_t> {
      return log.toHereAsync().then([](Log copy) { return static_cast<int64_t>(copy.seen().size()); });
    });
    registry.bindClass(kGatedLog).factory<std::string>([](std::string name) {
      EXPECT_TRUE(gGate->waitFor());
      return std::make_shared<GatedLog>(std::move(name));
    });
  }
  void TearDown() override {
    RRefFixture::TearDown();
    gGate = nullptr;
  }

  // Issues n calls on `log` alternating rpcAsync and remote (method-store), without waiting, and checks
  // each saw its own position.
  template <typename L>
  void issue(const RRef<L>& log, int64_t first, int64_t n) {
    std::vector<rpc::Future<int64_t>> direct;
    std::vector<RRef<int64_t>> stored;
    for (int64_t i = first; i < first + n; ++i) {
      if (i % 2 == 0) {
        direct.push_back(log.rpcAsync(&L::append, i));
      } else {
        stored.push_back(log.remote(&L::append, i));
      }
    }
    int64_t position = 0;
    for (int64_t i = first; i < first + n; ++i) {
      const int64_t got = i % 2 == 0 ? direct[static_cast<size_t>(position / 2)].get()
                                     : stored[static_cast<size_t>(position / 2)].toHere();
      ++position;
      positions_.push_back(got);
    }
  }
  RRef<Log> kept(const std::string& worker) {
    std::lock_guard<std::mutex> lock(keptMutex_);
    return kept_.at(worker);
  }
  void clearKept() {
    std::lock_guard<std::mutex> lock(keptMutex_);
    kept_.clear();
  }
  std::vector<int64_t> positions_;
  std::mutex keptMutex_;
  std::map<std::string, RRef<Log>> kept_;  // references a worker's kKeepLog handler kept
};

std::vector<int64_t> iota(int64_t first, int64_t n) {
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = first + i;
  return out;
}

TEST_P(RRefOrder, CallsRunInIssueOrderWhileTheObjectIsNotThereYet) {
  rpc::testing::Event gate;
  gGate = &gate;
  start();
  constexpr int64_t kCalls = 256;
  {
    const auto before = agent(1).metrics(name(0)).callsReceived;
    RRef<GatedLog> log = rrefs(0)->remote<GatedLog>(name(1), std::string("gated"));
    std::vector<rpc::Future<int64_t>> direct;
    std::vector<RRef<int64_t>> stored;
    for (int64_t i = 0; i < kCalls; ++i) {
      if (i % 2 == 0) {
        direct.push_back(log.rpcAsync(&GatedLog::append, i));
      } else {
        stored.push_back(log.remote(&GatedLog::append, i));
      }
    }
    // Every call reached the owner (and waits there: the constructor has not returned) before it opens.
    EXPECT_TRUE(eventually([&] { return agent(1).metrics(name(0)).callsReceived - before >= kCalls + 1; }));
    EXPECT_FALSE(direct.front().isReady());
    gate.set();
    for (int64_t i = 0; i < kCalls; ++i) {
      const int64_t position = i % 2 == 0 ? direct[static_cast<size_t>(i / 2)].get() : stored[static_cast<size_t>(i / 2)].toHere();
      EXPECT_EQ(position, i + 1) << "call " << i;
    }
    EXPECT_EQ(log.rpcSync(&GatedLog::seen), iota(0, kCalls));
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefOrder, CallsRunInIssueOrderPerReference) {
  start();
  constexpr int64_t kCalls = 200;
  {
    RRef<Log> log = rrefs(0)->remote<Log>(name(1), std::string("shared"));
    issue(log, 0, kCalls);
    EXPECT_EQ(positions_, iota(1, kCalls));
    EXPECT_EQ(log.rpcSync(&Log::seen), iota(0, kCalls));
    // The owner's own reference and a second user's (a fork) are streams of their own: each runs in its
    // own order while the three issue concurrently.
    EXPECT_EQ(agent(0).rpcSync(name(1), kKeepLog, log), 0);
    EXPECT_EQ(agent(0).rpcSync(name(2), kKeepLog, log), 0);
    std::vector<RRef<Log>> refs{log, kept(name(1)), kept(name(2))};
    EXPECT_TRUE(refs[1].isOwner());
    EXPECT_FALSE(refs[2].isOwner());
    std::vector<std::vector<rpc::Future<int64_t>>> calls(refs.size());
    std::vector<std::thread> issuers;
    for (size_t who = 0; who < refs.size(); ++who) {
      issuers.emplace_back([&, who] {
        const int64_t base = static_cast<int64_t>(who + 1) * 1000;
        for (int64_t i = 0; i < kCalls; ++i) calls[who].push_back(refs[who].rpcAsync(&Log::append, base + i));
      });
    }
    for (auto& t : issuers) t.join();
    for (auto& list : calls) {
      for (auto& f : list) (void)f.get();
    }
    const std::vector<int64_t> seen = log.rpcSync(&Log::seen);
    ASSERT_EQ(seen.size(), static_cast<size_t>(4 * kCalls));
    for (size_t who = 0; who < refs.size(); ++who) {
      const int64_t base = static_cast<int64_t>(who + 1) * 1000;
      std::vector<int64_t> mine;
      for (int64_t v : seen) {
        if (v / 1000 == base / 1000) mine.push_back(v);
      }
      EXPECT_EQ(mine, iota(base, kCalls)) << "reference " << who;
    }
    refs.clear();
    clearKept();
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefOrder, ToHereOfAnObjectIsACopyAfterTheEarlierCalls) {
  start();
  {
    RRef<Log> log = rrefs(0)->remote<Log>(name(1), std::string("copied"));
    for (int64_t i = 0; i < 50; ++i) (void)log.rpcAsync(&Log::append, i);  // not waited for
    Log copy = log.toHere();  // after the 50 calls of this reference
    EXPECT_EQ(copy.name(), "copied");
    EXPECT_EQ(copy.seen(), iota(0, 50));
    // The copy is the caller's own: changing it changes nothing at the owner.
    copy.append(99);
    EXPECT_EQ(log.rpcSync(&Log::seen), iota(0, 50));
    EXPECT_EQ(log.toHereAsync().get().seen(), iota(0, 50));
    // On the owner: a copy as well (through the owner's own queue).
    RRef<Log> local = rrefs(1)->remote<Log>(name(1), std::string("local"));
    (void)local.rpcAsync(&Log::append, int64_t{7});
    EXPECT_EQ(local.toHere().seen(), std::vector<int64_t>{7});
    EXPECT_NE(local.localValue().get(), nullptr);
    // A third worker gets its copy from the owner too.
    EXPECT_EQ(agent(0).rpcSync(name(2), kCopyLog, log), 50);
    // A failed construction: toHere reports its error.
    RRef<Log> broken = rrefs(0)->remoteWith(name(1), kLog, int64_t{1});
    auto error = rpc::testing::errorOf([&] { (void)broken.toHere(); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kUnimplemented) << error.describe();
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefOrder, ToHereOfAnObjectWithoutACodecIsAClearError) {
  start();
  {
    // RRef<Counter> has no toHere at all (HasToHere above); a caller that asks anyway (another build's
    // type, a raw call) gets the owner's error, and the object is untouched.
    RRef<Counter> user = rrefs(0)->remote<Counter>(name(1), int64_t{3});
    detail::CallHeader header;
    header.kind = static_cast<int64_t>(detail::CallKind::kCopy);
    header.target = "Counter";
    header.receiver = user.id();
    auto promise = std::make_shared<rpc::Promise<int64_t>>(agent(0).executor());
    auto future = promise->getFuture();
    rrefs(0)->callOwner(name(1), header, {}, [promise](rpc::Result<rpc::DecodedMessage>&& reply) {
      if (!reply.ok()) return promise->setError(reply.error());
      promise->setValue(int64_t{0});
    });
    auto error = rpc::testing::errorOf([&] { (void)future.get(); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kFailed) << error.describe();
    EXPECT_NE(error.message.find("class 'Counter', which cannot be copied"), std::string::npos) << error.describe();
    EXPECT_EQ(error.worker, name(1));
    EXPECT_EQ(user.rpcSync(&Counter::get), 3);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

// Note [Positional call header]: a "dg.rref.call" whose header is not the nine positional values (the
// named struct of earlier builds, a short list, a value of the wrong kind) is answered with an error that
// says so; nothing is stored, and the owner goes on serving.
TEST_P(RRefOrder, MalformedCallHeadersAreAnsweredWithAClearError) {
  start();
  using Build = std::function<void(rpc::wire::Value::Builder)>;
  const std::vector<std::pair<Build, std::string>> malformed = {
      {[](rpc::wire::Value::Builder h) { h.initStruct(9); }, "expected positional{kind:i64"},
      {[](rpc::wire::Value::Builder h) { h.initList(8); }, "expected 9 positional fields, got 8"},
      {[](rpc::wire::Value::Builder h) {
         auto list = h.initList(9);
         for (uint32_t i = 0; i < 9; ++i) list[i].setUint64(0);
         list[0].setText("function");
       },
       "field 'kind': expected i64"},
  };
  for (const auto& [build, says] : malformed) {
    auto promise = std::make_shared<rpc::Promise<void>>(agent(0).executor());
    auto future = promise->getFuture();
    auto encode = [&build](rpc::wire::Value::Builder out, rpc::EncodeContext&) {
      auto fields = out.initStruct(2);
      build(fields[0].initValue());
      fields[1].initValue().setNull();
    };
    agent(0).rpcRaw(rpc::CallOptions{}, name(1), detail::kCallFunction, detail::kCallHash, encode,
                    [promise](rpc::Result<rpc::DecodedMessage>&& reply) {
                      if (!reply.ok()) return promise->setError(reply.error());
                      if (reply.value().kind() == rpc::MessageKind::kError) {
                        return promise->setError(*reply.value().fields().error);
                      }
                      promise->setValue();
                    });
    auto error = rpc::testing::errorOf([&] { future.get(); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kFailed) << error.describe();
    EXPECT_NE(error.message.find("malformed rref call header"), std::string::npos) << error.describe();
    EXPECT_NE(error.message.find(says), std::string::npos) << error.describe();
    EXPECT_EQ(error.worker, name(1));
  }
  EXPECT_EQ(rrefs(0)->remote(name(1), kAddInt, int64_t{2}, int64_t{3}).toHere(), 5);
  EXPECT_TRUE(allSettled()) << tables();
}

INSTANTIATE_TEST_SUITE_P(Transports, RRefOrder, ::testing::Values("inproc", "tcp"));

}  // namespace
}  // namespace distgrad::rref::testing
