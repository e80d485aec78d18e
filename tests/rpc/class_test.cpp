// Registered classes (rpc/class.h): declarations and their wire identity, construction from encoded
// arguments, method calls (const, non-const, void, async, with CallContext, inherited), the errors for
// unknown or mismatched names, and concurrent calls on one object.
//
// Calling a method or constructor with the wrong number of arguments cannot be tested at run time: the
// invoker is generated from the member function type (the argument tuple's arity is fixed), and callers
// encode the declared argument types, so a wrong count is a compile error (static_assert in the rref layer,
// as in Agent::rpcAsync) rather than a wire error.
#include "rpc/class.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "async_test_util.h"
#include "autograd/ops.h"
#include "rpc/registry.h"
#include "tensor/error.h"

namespace distgrad::rpc {
namespace {

using testing::Event;

class Counter {
 public:
  explicit Counter(int64_t start) : value_(start) {}
  Counter(std::string label, int64_t start) : label_(std::move(label)), value_(start) {}

  int64_t add(int64_t n) { return value_.fetch_add(n) + n; }
  int64_t value() const { return value_.load(); }
  void reset() { value_.store(0); }
  std::string label() const noexcept { return label_; }
  std::string whoCalls(const CallContext& ctx, std::string prefix) const {
    return prefix + ":" + ctx.caller + "->" + ctx.callee;
  }
  // Completes when the test opens the gate; reads the object only then (it must still be alive).
  Future<int64_t> addWhenOpen(int64_t n) {
    auto promise = std::make_shared<Promise<int64_t>>(*Executor::current());
    Future<int64_t> out = promise->getFuture();
    {
      std::lock_guard<std::mutex> lock(gateMutex_);
      gate_ = [this, promise, n] { promise->setValue(add(n)); };
    }
    gateArmed_.set();
    return out;
  }
  void openGate() {
    std::function<void()> gate;
    {
      std::lock_guard<std::mutex> lock(gateMutex_);
      gate = std::move(gate_);
    }
    gate();
  }
  Future<void> resetAsync() {
    reset();
    Promise<void> promise(*Executor::current());
    promise.setValue();
    return promise.getFuture();
  }
  int64_t fail(int64_t n) { throw std::out_of_range("no slot " + std::to_string(n)); }
  Tensor scaled(const Tensor& x) const { return x * static_cast<double>(value_.load()); }

  Event gateArmed_;

 private:
  std::string label_ = "none";
  std::atomic<int64_t> value_;
  std::mutex gateMutex_;
  std::function<void()> gate_;
};

class Shape2d {
 public:
  virtual ~Shape2d() = default;
  std::string kind() const { return kind_; }
  virtual double area() const = 0;

 protected:
  std::string kind_ = "shape";
};

class Square : public Shape2d {
 public:
  explicit Square(double side) : side_(side) { kind_ = "square"; }
  double area() const override { return side_ * side_; }

 private:
  double side_;
};

inline const Class<Counter> kCounter = Class<Counter>("Counter")
                                           .method("add", &Counter::add)
                                           .method("value", &Counter::value)
                                           .method("reset", &Counter::reset)
                                           .method("label", &Counter::label)
                                           .method("whoCalls", &Counter::whoCalls)
                                           .method("addWhenOpen", &Counter::addWhenOpen)
                                           .method("resetAsync", &Counter::resetAsync)
                                           .method("fail", &Counter::fail)
                                           .method("scaled", &Counter::scaled);

// Inherited methods (one non-virtual from the base, one virtual overridden in Square).
inline const Class<Square> kSquare = Class<Square>("Square").method("kind", &Square::kind).method("area", &Square::area);

// ---- helpers: what the agent does around these calls ----

template <typename... A>
DecodedMessage callMessage(const A&... args) {
  EnvelopeFields fields;
  fields.kind = MessageKind::kCall;
  fields.messageId = 1;
  auto frame = encodeCall(fields, args...);
  EXPECT_TRUE(frame.ok()) << frame.error().describe();
  auto message = decodeLoopback(std::move(frame).value());
  EXPECT_TRUE(message.ok()) << message.error().describe();
  return std::move(message).value();
}

// The value an invoke's result encoder sends back, decoded as R (as the caller would).
template <typename R>
Result<R> replyValue(Future<EncodeValueFn> future) {
  Result<EncodeValueFn> encoder = future.result();
  if (!encoder.ok()) return encoder.error();
  EnvelopeFields fields;
  fields.kind = MessageKind::kResponse;
  auto frame = encodeMessage(fields, encoder.value());
  if (!frame.ok()) return frame.error();
  auto message = decodeLoopback(std::move(frame).value());
  if (!message.ok()) return message.error();
  if constexpr (std::is_void_v<R>) {
    return Result<void>();
  } else {
    return message.value().decodeValue<R>();
  }
}

class ClassTest : public ::testing::Test {
 protected:
  ClassTest() : executor_(2, "class-test") {
    ctx_.caller = "worker1";
    ctx_.callee = "worker0";
    reg_.bindClass(kCounter).ctor<int64_t>().ctor<std::string, int64_t>();
    reg_.bindClass(kSquare).factory<double>([](double side) -> std::shared_ptr<Square> {
      if (side < 0) throw std::invalid_argument("negative side " + std::to_string(side));
      return std::make_shared<Square>(side);
    });
  }
  ~ClassTest() override { executor_.shutdown(); }

  ObjectHandle construct(const std::string& className, uint64_t hash, const DecodedMessage& args) {
    auto entry = reg_.findClass(className);
    EXPECT_NE(entry, nullptr);
    auto ctor = entry->findConstructor(hash, "worker0");
    EXPECT_TRUE(ctor.ok()) << ctor.error().describe();
    auto object = ctor.value()->construct(args, ctx_);
    EXPECT_TRUE(object.ok()) << object.error().describe();
    return object.ok() ? object.value() : ObjectHandle{};
  }

  // Looks the method up by the caller's identity and invokes it on an executor thread (as the agent does).
  template <typename R, typename C, typename M, typename... A>
  Result<R> call(const Class<C>& cls, const ObjectHandle& object, M member, const A&... args) {
    const MethodInfo& info = cls.methodFor(member);
    auto entry = reg_.findClass(cls.name());
    auto method = entry->findMethod(info.name, info.hash, "worker0");
    if (!method.ok()) return method.error();
    return invoke<R>(*method.value(), object, callMessage(args...));
  }

  template <typename R>
  Result<R> invoke(const BoundMethod& method, const ObjectHandle& object, DecodedMessage message) {
    return replyValue<R>(invokeOnExecutor(method, object, std::move(message)));
  }

  // BoundMethod::invoke on an executor thread; returns its future once invoke returned.
  Future<EncodeValueFn> invokeOnExecutor(const BoundMethod& method, const ObjectHandle& object,
                                         DecodedMessage message) {
    std::optional<Future<EncodeValueFn>> slot;
    Event invoked;
    EXPECT_TRUE(executor_.post([&] {
      slot.emplace(method.invoke(object, message, ctx_, executor_));
      invoked.set();
    }));
    EXPECT_TRUE(invoked.waitFor());
    return std::move(*slot);
  }

  Executor executor_;
  CallContext ctx_;
  Registry reg_;
};

TEST_F(ClassTest, DeclarationGivesEachMethodItsWireIdentity) {
  EXPECT_EQ(kCounter.name(), "Counter");
  const MethodInfo& add = kCounter.methodFor(&Counter::add);
  EXPECT_EQ(add.name, "add");
  EXPECT_EQ(add.signature, "i64 Counter::add(i64)");
  EXPECT_EQ(add.hash, detail::fnv1a64("i64 Counter::add(i64)"));
  EXPECT_FALSE(add.isConst);
  EXPECT_EQ(kCounter.methodFor(&Counter::value).signature, "i64 Counter::value() const");
  EXPECT_TRUE(kCounter.methodFor(&Counter::value).isConst);
  EXPECT_EQ(kCounter.methodFor(&Counter::reset).signature, "void Counter::reset()");
  EXPECT_EQ(kCounter.methodFor(&Counter::label).signature, "str Counter::label() const");  // noexcept
  // The CallContext parameter is not on the wire; a Future<R> result is R on the wire.
  EXPECT_EQ(kCounter.methodFor(&Counter::whoCalls).signature, "str Counter::whoCalls(str) const");
  EXPECT_EQ(kCounter.methodFor(&Counter::addWhenOpen).signature, "i64 Counter::addWhenOpen(i64)");
  EXPECT_EQ(kCounter.methodFor(&Counter::resetAsync).signature, "void Counter::resetAsync()");
  EXPECT_EQ(kCounter.methodFor(&Counter::scaled).signature, "tensor Counter::scaled(tensor) const");
  // Same arguments, other names or constness: other hashes.
  EXPECT_NE(kCounter.methodFor(&Counter::add).hash, kCounter.methodFor(&Counter::fail).hash);
  EXPECT_EQ(kSquare.methodFor(&Square::kind).signature, "str Square::kind() const");  // from the base
  EXPECT_EQ(kCounter.methods().size(), 9u);

  EXPECT_EQ(kCounter.ctorSignature<int64_t>(), "Counter(i64)");
  EXPECT_EQ((kCounter.ctorSignature<const std::string&, int64_t>()), "Counter(str,i64)");
  EXPECT_EQ(kCounter.ctorHash<int64_t>(), detail::fnv1a64("Counter(i64)"));
  EXPECT_NE(kCounter.ctorHash<int64_t>(), kCounter.ctorHash<int32_t>());

  // A member function the declaration does not list is a caller-side error naming the class.
  try {
    (void)kCounter.methodFor(&Counter::openGate);
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'Counter' declares no method"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("void Counter::?()"), std::string::npos) << e.what();
  }
}

TEST_F(ClassTest, ConstructFromEncodedArgumentsAndCallMethods) {
  ObjectHandle counter = construct("Counter", kCounter.ctorHash<int64_t>(), callMessage(int64_t{5}));
  ASSERT_TRUE(counter);
  EXPECT_EQ(counter.className, "Counter");
  EXPECT_EQ(counter.type, std::type_index(typeid(Counter)));
  ASSERT_NE(counter.get<Counter>(), nullptr);
  EXPECT_EQ(counter.get<Square>(), nullptr);
  EXPECT_EQ(counter.get<Counter>()->value(), 5);

  EXPECT_EQ(call<int64_t>(kCounter, counter, &Counter::add, int64_t{3}).value(), 8);   // non-const
  EXPECT_EQ(call<int64_t>(kCounter, counter, &Counter::value).value(), 8);             // const
  EXPECT_TRUE(call<void>(kCounter, counter, &Counter::reset).ok());                    // void
  EXPECT_EQ(counter.get<Counter>()->value(), 0);
  EXPECT_EQ(call<std::string>(kCounter, counter, &Counter::label).value(), "none");
  EXPECT_EQ(call<std::string>(kCounter, counter, &Counter::whoCalls, std::string("p")).value(), "p:worker1->worker0");
  EXPECT_EQ(call<int64_t>(kCounter, counter, &Counter::add, int64_t{2}).value(), 2);
  Tensor x = Tensor::fromVector({1, 2, 3}, {3});
  Tensor y = call<Tensor>(kCounter, counter, &Counter::scaled, x).value();
  ASSERT_EQ(y.shape(), (Shape{3}));
  EXPECT_FLOAT_EQ(y.data<float>()[2], 6.0f);

  // The two-argument constructor makes a distinct object.
  ObjectHandle labelled =
      construct("Counter", kCounter.ctorHash<std::string, int64_t>(), callMessage(std::string("c2"), int64_t{-1}));
  EXPECT_EQ(call<std::string>(kCounter, labelled, &Counter::label).value(), "c2");
  EXPECT_EQ(call<int64_t>(kCounter, labelled, &Counter::value).value(), -1);
  EXPECT_EQ(counter.get<Counter>()->value(), 2);

  // A factory, and methods inherited from a base class (one virtual).
  ObjectHandle square = construct("Square", kSquare.ctorHash<double>(), callMessage(1.5));
  EXPECT_EQ(call<std::string>(kSquare, square, &Square::kind).value(), "square");
  EXPECT_DOUBLE_EQ(call<double>(kSquare, square, &Square::area).value(), 2.25);
}

TEST_F(ClassTest, AsyncMethodsReplyWhenTheirFutureCompletesAndKeepTheObjectAlive) {
  ObjectHandle counter = construct("Counter", kCounter.ctorHash<int64_t>(), callMessage(int64_t{10}));
  std::weak_ptr<void> alive = counter.object;
  Counter* raw = counter.get<Counter>().get();
  auto entry = reg_.findClass("Counter");
  const MethodInfo& info = kCounter.methodFor(&Counter::addWhenOpen);
  const BoundMethod* method = entry->findMethod(info.name, info.hash, "worker0").value();

  Future<EncodeValueFn> reply = invokeOnExecutor(*method, counter, callMessage(int64_t{7}));
  ASSERT_TRUE(raw->gateArmed_.waitFor());
  EXPECT_FALSE(reply.isReady());
  counter = ObjectHandle{};  // the owner drops the object while its method is still running
  EXPECT_FALSE(alive.expired());
  raw->openGate();
  EXPECT_EQ(replyValue<int64_t>(std::move(reply)).value(), 17);
  EXPECT_TRUE(testing::eventually([&] { return alive.expired(); }));

  // Future<void> methods.
  ObjectHandle other = construct("Counter", kCounter.ctorHash<int64_t>(), callMessage(int64_t{3}));
  EXPECT_TRUE(call<void>(kCounter, other, &Counter::resetAsync).ok());
  EXPECT_EQ(other.get<Counter>()->value(), 0);
}

TEST_F(ClassTest, UnknownOrMismatchedNamesAreUnimplementedNamingClassMethodAndWorker) {
  auto entry = reg_.findClass("Counter");
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(reg_.classNames(), (std::vector<std::string>{"Counter", "Square"}));

  auto unknownClass = reg_.resolveClass("Linear", "worker0");
  ASSERT_FALSE(unknownClass.ok());
  EXPECT_EQ(unknownClass.error().kind, ErrorKind::kUnimplemented);
  EXPECT_EQ(unknownClass.error().worker, "worker0");
  EXPECT_NE(unknownClass.error().message.find("no class 'Linear' on worker0 (classes: Counter, Square)"),
            std::string::npos)
      << unknownClass.error().message;
  EXPECT_EQ(reg_.findClass("Linear"), nullptr);
  EXPECT_TRUE(reg_.resolveClass("Counter", "worker0").ok());

  auto unknownMethod = entry->findMethod("forward", kCounter.methodFor(&Counter::add).hash, "worker0");
  ASSERT_FALSE(unknownMethod.ok());
  EXPECT_EQ(unknownMethod.error().kind, ErrorKind::kUnimplemented);
  EXPECT_EQ(unknownMethod.error().worker, "worker0");
  EXPECT_NE(unknownMethod.error().message.find("class 'Counter' on worker0 has no method 'forward' (methods: add,"),
            std::string::npos)
      << unknownMethod.error().message;

  // A caller built from another declaration of `add`: same name, other hash.
  uint64_t otherAdd = detail::fnv1a64("f64 Counter::add(f64)");
  auto mismatch = entry->findMethod("add", otherAdd, "worker0");
  ASSERT_FALSE(mismatch.ok());
  EXPECT_EQ(mismatch.error().kind, ErrorKind::kUnimplemented);
  EXPECT_NE(mismatch.error().message.find("method 'Counter::add' on worker0 has signature i64 Counter::add(i64), "
                                          "which does not match the caller's"),
            std::string::npos)
      << mismatch.error().message;

  auto noCtor = entry->findConstructor(kCounter.ctorHash<int32_t>(), "worker0");
  ASSERT_FALSE(noCtor.ok());
  EXPECT_EQ(noCtor.error().kind, ErrorKind::kUnimplemented);
  EXPECT_NE(noCtor.error().message.find("class 'Counter' on worker0 has no constructor matching"), std::string::npos)
      << noCtor.error().message;
  EXPECT_NE(noCtor.error().message.find("its constructors: Counter(i64), Counter(str,i64)"), std::string::npos)
      << noCtor.error().message;
}

TEST_F(ClassTest, BadArgumentsThrowingMethodsAndWrongObjectsAreErrors) {
  ObjectHandle counter = construct("Counter", kCounter.ctorHash<int64_t>(), callMessage(int64_t{1}));
  auto entry = reg_.findClass("Counter");
  const MethodInfo& add = kCounter.methodFor(&Counter::add);
  const BoundMethod* addMethod = entry->findMethod(add.name, add.hash, "worker0").value();

  // Right hash, wrong bytes (a corrupt or hostile caller): a clear error, the object untouched.
  Result<int64_t> bad = invoke<int64_t>(*addMethod, counter, callMessage(std::string("seven")));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().kind, ErrorKind::kFailed);
  EXPECT_EQ(bad.error().worker, "worker0");
  EXPECT_NE(bad.error().message.find("bad arguments for method 'Counter::add'"), std::string::npos)
      << bad.error().message;
  EXPECT_EQ(counter.get<Counter>()->value(), 1);

  // The method throws: `remote`, with the exception's type and this worker.
  Result<int64_t> thrown = call<int64_t>(kCounter, counter, &Counter::fail, int64_t{4});
  ASSERT_FALSE(thrown.ok());
  EXPECT_EQ(thrown.error().kind, ErrorKind::kRemote);
  EXPECT_EQ(thrown.error().worker, "worker0");
  EXPECT_NE(thrown.error().remoteType.find("out_of_range"), std::string::npos) << thrown.error().remoteType;
  EXPECT_NE(thrown.error().message.find("no slot 4"), std::string::npos) << thrown.error().message;

  // A handle of another class never reaches the method.
  ObjectHandle square = construct("Square", kSquare.ctorHash<double>(), callMessage(2.0));
  Result<int64_t> wrongObject = invoke<int64_t>(*addMethod, square, callMessage(int64_t{1}));
  ASSERT_FALSE(wrongObject.ok());
  EXPECT_NE(wrongObject.error().message.find("method 'Counter::add' called on an object of class 'Square'"),
            std::string::npos)
      << wrongObject.error().message;
  Result<int64_t> empty = invoke<int64_t>(*addMethod, ObjectHandle{}, callMessage(int64_t{1}));
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.error().message.find("an empty object"), std::string::npos) << empty.error().message;

  // Constructors: bad arguments and a throwing factory.
  auto squareEntry = reg_.findClass("Square");
  const BoundConstructor* squareCtor = squareEntry->findConstructor(kSquare.ctorHash<double>(), "worker0").value();
  auto badCtor = squareCtor->construct(callMessage(std::string("wide")), ctx_);
  ASSERT_FALSE(badCtor.ok());
  EXPECT_NE(badCtor.error().message.find("bad arguments for constructor Square(f64)"), std::string::npos)
      << badCtor.error().message;
  auto negative = squareCtor->construct(callMessage(-1.0), ctx_);
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.error().kind, ErrorKind::kRemote);
  EXPECT_EQ(negative.error().worker, "worker0");
  EXPECT_NE(negative.error().message.find("negative side"), std::string::npos) << negative.error().message;
}

TEST_F(ClassTest, BindingRulesAndRegistryCopiesAreIndependent) {
  EXPECT_THROW(reg_.bindClass(kCounter), ValueError);                   // bound twice
  Registry other;
  auto binder = other.bindClass(kCounter);
  binder.ctor<int64_t>();
  EXPECT_THROW(binder.ctor<int64_t>(), ValueError);                     // same constructor twice
  EXPECT_THROW((Class<Counter>("Counter").method("add", &Counter::add).method("add", &Counter::add)),
               ValueError);                                             // same method twice
  EXPECT_THROW(Class<Counter>(""), ValueError);

  // An agent copies its registry at start: constructors added later must not change the copy.
  Registry copy = other;
  binder.ctor<std::string, int64_t>();
  EXPECT_EQ(copy.findClass("Counter")->constructors.size(), 1u);
  EXPECT_EQ(other.findClass("Counter")->constructors.size(), 2u);
  EXPECT_EQ(other.findClass("Counter")->methods.size(), kCounter.methods().size());
}

TEST_F(ClassTest, MethodsOfOneObjectMayRunConcurrently) {
  // The registry adds no per-object lock: concurrent calls run in parallel on the executor threads, so
  // Counter keeps its state in an atomic. Every call must be applied exactly once.
  ObjectHandle counter = construct("Counter", kCounter.ctorHash<int64_t>(), callMessage(int64_t{0}));
  auto entry = reg_.findClass("Counter");
  const MethodInfo& add = kCounter.methodFor(&Counter::add);
  const BoundMethod* method = entry->findMethod(add.name, add.hash, "worker0").value();
  constexpr int kCalls = 400;
  auto message = std::make_shared<DecodedMessage>(callMessage(int64_t{1}));
  Event done(kCalls);
  std::atomic<int> failures{0};
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(executor_.post([&, message] {
      Result<EncodeValueFn> r = method->invoke(counter, *message, ctx_, executor_).result();
      if (!r.ok()) failures.fetch_add(1);
      done.set();
    }));
  }
  ASSERT_TRUE(done.waitFor());
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(counter.get<Counter>()->value(), kCalls);
}

}  // namespace
}  // namespace distgrad::rpc
