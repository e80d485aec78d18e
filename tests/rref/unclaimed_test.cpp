// Note [Unclaimed references]: an RRef passed inside a message that is dropped before its value is decoded
// (unknown function, signature mismatch, malformed arguments, a pipelined call whose receiver failed, a
// constructor that does not exist, a reply whose caller stopped waiting) must not leak its fork: the
// receiver settles it, and every table of every worker ends empty. Each scenario runs over inproc and tcp,
// for every direction a fork can travel (user -> user, user -> owner, owner -> user, a worker to itself).
#include <gtest/gtest.h>

#include "rref_test_util.h"

namespace distgrad::rref::testing {
namespace {

// Bound nowhere: every worker answers `unimplemented` without decoding the RRef.
const rpc::Function<int64_t(RRef<int64_t>)> kNotBound{"not_bound"};
// Bound as kReadRef(RRef) everywhere: the extra parameter makes the signature hash differ.
const rpc::Function<int64_t(RRef<int64_t>, int64_t)> kReadRefMismatch{"read_ref"};
// Bound with this signature; a raw call sends (RRef, text, RRef) under its hash: the first RRef decodes,
// the text fails, the second RRef is never reached.
const rpc::Function<int64_t(RRef<int64_t>, int64_t, RRef<int64_t>)> kTakeTwo{"take_two"};
// Returns a new RRef owned by the callee once World::gate opens (the reply may come after the caller gave up).
const rpc::Function<RRef<int64_t>(int64_t)> kGatedOwn{"gated_own"};

// A class whose method takes an RRef: calls on a receiver that failed to construct never decode it.
class Sink {
 public:
  explicit Sink(int64_t start) : start_(start) {}
  int64_t take(RRef<int64_t> r) { return start_ + (r.valid() ? 1 : 0); }

 private:
  int64_t start_;
};
const rpc::Class<Sink> kSink = rpc::Class<Sink>("Sink").method("take", &Sink::take);

}  // namespace
}  // namespace distgrad::rref::testing

DG_RREF_CLASS(distgrad::rref::testing::Sink, distgrad::rref::testing::kSink);

namespace distgrad::rref::testing {
namespace {

class RRefUnclaimed : public RRefFixture {
 protected:
  void bindExtra(rpc::Registry& registry) override {
    registry.bindClass(kSink).ctor<int64_t>();
    registry.bind(kTakeTwo, [](RRef<int64_t> a, int64_t n, RRef<int64_t> b) { return n + (a.valid() && b.valid()); });
    registry.bind(kGatedOwn, [this](const rpc::CallContext& ctx, int64_t n) -> rpc::Future<RRef<int64_t>> {
      auto promise = std::make_shared<rpc::Promise<int64_t>>(*rpc::Executor::current());
      auto context = RRefContext::of(*ctx.agent);
      auto future = promise->getFuture().then([context, n](int64_t v) { return context->own(v + n); });
      {
        std::lock_guard<std::mutex> lock(world_.mutex);
        world_.gate = promise;
      }
      world_.gateEntered.set();
      return future;
    });
  }

  // Calls `fn` with `r` from `from` to `to` and expects the given error kind.
  template <typename R, typename... P, typename... A>
  void expectRefused(int from, int to, const rpc::Function<R(P...)>& fn, rpc::ErrorKind kind, A&&... args) {
    auto error = rpc::testing::errorOf([&] { (void)agent(from).rpcSync(name(to), fn, std::forward<A>(args)...); });
    EXPECT_EQ(error.kind, kind) << name(from) << " -> " << name(to) << ": " << error.describe();
  }
};

TEST_P(RRefUnclaimed, UnknownFunctionSettlesEveryFork) {
  start();
  {
    RRef<int64_t> user = rrefs(0)->remote(name(1), kAddInt, int64_t{1}, int64_t{2});  // owner 1, held by 0
    RRef<int64_t> owned = rrefs(1)->remote(name(1), kAddInt, int64_t{3}, int64_t{4});  // owner 1, held by 1
    ASSERT_EQ(user.toHere(), 3);
    ASSERT_EQ(owned.toHere(), 7);
    const auto unimplemented = rpc::ErrorKind::kUnimplemented;
    expectRefused(0, 2, kNotBound, unimplemented, user);   // user -> user
    expectRefused(0, 1, kNotBound, unimplemented, user);   // user -> owner
    expectRefused(1, 0, kNotBound, unimplemented, owned);  // owner -> user
    expectRefused(0, 0, kNotBound, unimplemented, user);   // a user to itself
    expectRefused(1, 1, kNotBound, unimplemented, owned);  // the owner to itself
    // The references still work: nothing was freed early.
    EXPECT_EQ(user.toHere(), 3);
    EXPECT_EQ(agent(0).rpcSync(name(2), kReadRef, user), 3);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefUnclaimed, SignatureMismatchSettlesEveryFork) {
  start();
  {
    RRef<int64_t> user = rrefs(0)->remote(name(1), kAddInt, int64_t{1}, int64_t{2});
    RRef<int64_t> owned = rrefs(1)->remote(name(1), kAddInt, int64_t{3}, int64_t{4});
    const auto unimplemented = rpc::ErrorKind::kUnimplemented;
    expectRefused(0, 2, kReadRefMismatch, unimplemented, user, int64_t{1});
    expectRefused(0, 1, kReadRefMismatch, unimplemented, user, int64_t{1});
    expectRefused(1, 2, kReadRefMismatch, unimplemented, owned, int64_t{1});
    EXPECT_EQ(user.toHere(), 3);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefUnclaimed, MalformedArgumentsSettleTheForksNotDecoded) {
  start();
  {
    RRef<int64_t> a = rrefs(0)->remote(name(1), kAddInt, int64_t{1}, int64_t{2});
    RRef<int64_t> b = rrefs(0)->remote(name(1), kAddInt, int64_t{3}, int64_t{4});
    for (int to : {2, 1, 0}) {
      // (RRef, text, RRef) under the hash of (RRef, i64, RRef): decoding fails at the text, after the first
      // RRef got a handle (released normally) and before the second was reached (settled as unclaimed).
      auto promise = std::make_shared<rpc::Promise<int64_t>>(agent(0).executor());
      auto future = promise->getFuture();
      auto encode = [&](rpc::wire::Value::Builder out, rpc::EncodeContext& ctx) {
        using Args = std::tuple<RRef<int64_t>, std::string, RRef<int64_t>>;
        rpc::detail::TupleCodec<Args, RRef<int64_t>, std::string, RRef<int64_t>>::encode(
            out, Args{a, "not an integer", b}, ctx);
      };
      agent(0).rpcRaw(rpc::CallOptions{}, name(to), kTakeTwo.name(), kTakeTwo.hash(), encode,
                      [promise](rpc::Result<rpc::DecodedMessage>&& reply) {
                        if (!reply.ok()) return promise->setError(reply.error());
                        if (reply.value().kind() == rpc::MessageKind::kError) {
                          return promise->setError(*reply.value().fields().error);
                        }
                        promise->setResult(reply.value().decodeValue<int64_t>());
                      });
      auto error = rpc::testing::errorOf([&] { (void)future.get(); });
      EXPECT_NE(error.message.find("take_two"), std::string::npos) << error.describe();
    }
    // A well-formed call still works on the same references.
    EXPECT_EQ(agent(0).rpcSync(name(2), kTakeTwo, a, int64_t{5}, b), 6);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefUnclaimed, CallsThatNeverDecodeTheirArgumentsSettleThem) {
  start();
  {
    RRef<int64_t> r = rrefs(0)->remote(name(2), kAddInt, int64_t{1}, int64_t{2});  // owner 2, held by 0
    // A pipelined call on a receiver whose construction fails (no constructor takes a string): the call
    // waits for the receiver, which resolves to the error, and its arguments are never decoded.
    RRef<Sink> broken = rrefs(0)->remoteWith(name(1), kSink, std::string("no such constructor"));
    auto error = rpc::testing::errorOf([&] { (void)broken.rpcSync(&Sink::take, r); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kUnimplemented) << error.describe();
    RRef<int64_t> stored = broken.remote(&Sink::take, r);
    error = rpc::testing::errorOf([&] { (void)stored.toHere(); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kUnimplemented) << error.describe();
    // A constructor that does not exist, called with an RRef.
    RRef<Sink> noCtor = rrefs(0)->remoteWith(name(1), kSink, r);
    error = rpc::testing::errorOf([&] { (void)noCtor.rpcSync(&Sink::take, r); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kUnimplemented) << error.describe();
    // A function the owner of the RRef does not have, called through rref's remote().
    RRef<int64_t> missing = rrefs(0)->remote(name(2), kNotBound, r);
    error = rpc::testing::errorOf([&] { (void)missing.toHere(); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kUnimplemented) << error.describe();
    // And a working receiver decodes it as usual.
    RRef<Sink> sink = rrefs(0)->remote<Sink>(name(1), int64_t{10});
    EXPECT_EQ(sink.rpcSync(&Sink::take, r), 11);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefUnclaimed, LateReplySettlesItsFork) {
  start();
  rpc::CallOptions options;
  options.timeout = 50ms;
  // worker1 answers with an RRef it owns, after worker0 stopped waiting: worker0 drops the reply undecoded.
  auto error = rpc::testing::errorOf([&] { (void)agent(0).rpcAsyncWith(options, name(1), kGatedOwn, int64_t{1}).get(); });
  EXPECT_EQ(error.kind, rpc::ErrorKind::kTimeout) << error.describe();
  ASSERT_TRUE(world_.gateEntered.waitFor());
  {
    std::lock_guard<std::mutex> lock(world_.mutex);
    world_.gate->setValue(int64_t{41});
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefUnclaimed, EncodingFailureUndoesTheForks) {
  start();
  {
    RRef<int64_t> user = rrefs(0)->remote(name(1), kAddInt, int64_t{1}, int64_t{2});
    RRef<int64_t> owned = rrefs(1)->remote(name(1), kAddInt, int64_t{3}, int64_t{4});
    ASSERT_EQ(user.toHere(), 3);
    for (auto [from, r] : {std::pair{0, user}, std::pair{1, owned}}) {
      // The RRef is encoded (forked) first, then the next argument throws: the message never leaves.
      auto promise = std::make_shared<rpc::Promise<int64_t>>(agent(from).executor());
      auto future = promise->getFuture();
      auto encode = [&](rpc::wire::Value::Builder out, rpc::EncodeContext& ctx) {
        rpc::Codec<RRef<int64_t>>::encode(out.initStruct(1)[0].initValue(), r, ctx);
        throw rpc::CodecError("the next argument cannot be encoded");
      };
      agent(from).rpcRaw(rpc::CallOptions{}, name(2), kReadRef.name(), kReadRef.hash(), encode,
                         [promise](rpc::Result<rpc::DecodedMessage>&& reply) {
                           if (!reply.ok()) return promise->setError(reply.error());
                           promise->setError(rpc::Error::failed("the call was sent"));
                         });
      auto error = rpc::testing::errorOf([&] { (void)future.get(); });
      EXPECT_NE(error.message.find("cannot be encoded"), std::string::npos) << error.describe();
    }
    // An RRef sent to a worker that does not exist is refused before anything is registered.
    auto error = rpc::testing::errorOf([&] { (void)agent(0).rpcSync("nobody", kReadRef, user); });
    EXPECT_NE(error.message.find("nobody"), std::string::npos) << error.describe();
  }
  EXPECT_TRUE(allSettled()) << tables();
}

INSTANTIATE_TEST_SUITE_P(Transports, RRefUnclaimed, ::testing::Values("inproc", "tcp"));

}  // namespace
}  // namespace distgrad::rref::testing
