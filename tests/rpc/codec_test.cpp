// Value codec and message encoding: round trips of every supported type, zero-copy payloads, signature
// hashes, and malformed input (each a clear Error, never a crash).
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "rpc/codec.h"
#include "rpc/message.h"

namespace distgrad::rpc {
namespace {

struct Inner {
  std::string name;
  std::optional<int32_t> count;
  template <class V>
  void visitFields(V& v) {
    v("name", name);
    v("count", count);
  }
  friend bool operator==(const Inner&, const Inner&) = default;
};

struct TrainConfig {
  double lr = 0.1;
  int64_t steps = 0;
  std::vector<Inner> stages;
  std::map<std::string, float> scales;
  template <class V>
  void visitFields(V& v) {
    v("lr", lr);
    v("steps", steps);
    v("stages", stages);
    v("scales", scales);
  }
  friend bool operator==(const TrainConfig&, const TrainConfig&) = default;
};

EnvelopeFields kindFields(MessageKind kind, uint64_t messageId = 0) {
  EnvelopeFields fields;
  fields.kind = kind;
  fields.messageId = messageId;
  return fields;
}
EnvelopeFields callFields(const std::string& name) {
  EnvelopeFields fields = kindFields(MessageKind::kCall);
  fields.functionName = name;
  return fields;
}

// Simulates a receiving transport: runs the allocator, copies the sent bytes into the buffers it returned.
Result<DecodedMessage> receive(const transport::OutgoingFrame& sent) {
  std::vector<uint64_t> sizes;
  for (const auto& p : sent.payloads) sizes.push_back(p.size);
  auto allocate = makePayloadAllocator();
  auto buffers = allocate(sent.envelope, sizes);
  if (!buffers) return buffers.error();
  transport::IncomingFrame frame;
  frame.envelope = sent.envelope;
  frame.payloads = std::move(buffers).value();
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > 0) std::memcpy(frame.payloads[i].data, sent.payloads[i].data, sizes[i]);
  }
  return decodeMessage(std::move(frame));
}

template <typename T>
T roundTrip(const T& value) {
  auto frame = encodeMessageWith(kindFields(MessageKind::kResponse, 7), value);
  EXPECT_TRUE(frame.ok()) << (frame.ok() ? "" : frame.error().describe());
  auto message = receive(frame.value());
  EXPECT_TRUE(message.ok()) << (message.ok() ? "" : message.error().describe());
  auto decoded = message.value().template decodeValue<T>();
  EXPECT_TRUE(decoded.ok()) << (decoded.ok() ? "" : decoded.error().describe());
  return std::move(decoded).value();
}

std::string errorOf(const Result<DecodedMessage>& r) { return r.ok() ? "<ok>" : r.error().message; }
template <typename T>
std::string errorOf(const Result<T>& r) {
  return r.ok() ? "<ok>" : r.error().message;
}

template <typename R>
void expectErrorContains(const R& result, const std::string& text) {
  ASSERT_FALSE(result.ok()) << "expected an error containing: " << text;
  EXPECT_NE(result.error().message.find(text), std::string::npos) << result.error().message;
}

// ---------------------------------------------------------------- round trips

TEST(Codec, Scalars) {
  EXPECT_EQ(roundTrip(true), true);
  EXPECT_EQ(roundTrip(false), false);
  EXPECT_EQ(roundTrip(std::numeric_limits<int8_t>::min()), std::numeric_limits<int8_t>::min());
  EXPECT_EQ(roundTrip(std::numeric_limits<int32_t>::max()), std::numeric_limits<int32_t>::max());
  EXPECT_EQ(roundTrip(std::numeric_limits<int64_t>::min()), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(roundTrip(std::numeric_limits<uint64_t>::max()), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(roundTrip(uint16_t{65535}), uint16_t{65535});
  EXPECT_EQ(roundTrip(1.5f), 1.5f);
  EXPECT_EQ(roundTrip(-3.25e300), -3.25e300);
  EXPECT_TRUE(std::isnan(roundTrip(std::numeric_limits<double>::quiet_NaN())));
  EXPECT_EQ(roundTrip(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_EQ(roundTrip(std::string()), "");
  EXPECT_EQ(roundTrip(std::string("héllo\0world", 12)), std::string("héllo\0world", 12));
  std::vector<uint8_t> bytes = {0, 1, 255, 0, 42};
  EXPECT_EQ(roundTrip(bytes), bytes);
  EXPECT_EQ(roundTrip(RRefId{3, 1ull << 40}), (RRefId{3, 1ull << 40}));
}

TEST(Codec, Containers) {
  std::vector<std::vector<int32_t>> nested = {{1, 2}, {}, {-3}};
  EXPECT_EQ(roundTrip(nested), nested);
  std::map<std::string, std::vector<double>> m = {{"a", {1.0, 2.0}}, {"b", {}}};
  EXPECT_EQ(roundTrip(m), m);
  std::unordered_map<int64_t, std::string> um = {{-1, "x"}, {5, "y"}};
  EXPECT_EQ(roundTrip(um), um);
  std::optional<std::vector<bool>> some = std::vector<bool>{true, false};
  EXPECT_EQ(roundTrip(some), some);
  std::optional<std::string> none;
  EXPECT_EQ(roundTrip(none), none);
  std::optional<std::optional<int32_t>> innerNone = std::optional<int32_t>{};
  EXPECT_EQ(roundTrip(innerNone), innerNone);
  auto tuple = std::make_tuple(int32_t{1}, std::string("two"), std::vector<double>{3.0});
  EXPECT_EQ(roundTrip(tuple), tuple);
  auto pair = std::make_pair(std::string("k"), uint8_t{9});
  EXPECT_EQ(roundTrip(pair), pair);
  std::vector<std::map<std::string, std::optional<std::tuple<int64_t, bool>>>> deep = {
      {{"x", std::make_tuple(int64_t{4}, true)}, {"y", std::nullopt}}};
  EXPECT_EQ(roundTrip(deep), deep);
}

TEST(Codec, StructsWithVisitors) {
  TrainConfig config{0.01, 1000, {{"warmup", 5}, {"main", std::nullopt}}, {{"a", 0.5f}}};
  EXPECT_EQ(roundTrip(config), config);
  EXPECT_EQ(Codec<Inner>::signature(), "struct{name:str,count:opt<i32>}");
}

Tensor floatTensor(const Shape& shape, float start = 0.0f) {
  Tensor t = Tensor::empty(shape, DType::kFloat32);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = start + static_cast<float>(i) * 0.5f;
  return t;
}

void expectSameValues(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.shape(), b.shape());
  ASSERT_EQ(a.dtype(), b.dtype());
  if (a.dtype() == DType::kBFloat16 || a.dtype() == DType::kFloat16) {
    Tensor ac = a.cloneData(), bc = b.cloneData();
    EXPECT_EQ(std::memcmp(ac.rawData(), bc.rawData(), ac.nbytes()), 0);
    return;
  }
  EXPECT_EQ(a.toVector<double>(), b.toVector<double>());
}

TEST(Codec, TensorsOfEveryDtype) {
  Tensor f32 = floatTensor({2, 3});
  expectSameValues(roundTrip(f32), f32);
  Tensor f64 = Tensor::fromVector(std::vector<double>{1e-300, -2.5, 3.0, 4.0}, {4});
  expectSameValues(roundTrip(f64), f64);
  Tensor i64 = Tensor::fromVector(std::vector<int64_t>{-1, 1ll << 60, 3}, {3, 1});
  expectSameValues(roundTrip(i64), i64);
  Tensor bf16 = floatTensor({5}).toDType(DType::kBFloat16);
  expectSameValues(roundTrip(bf16), bf16);
  Tensor scalar = Tensor::scalar(2.5, DType::kFloat64);
  Tensor back = roundTrip(scalar);
  EXPECT_EQ(back.dim(), 0);
  EXPECT_EQ(back.item(), 2.5);
  Tensor empty = Tensor::empty({0, 3}, DType::kFloat32);
  Tensor emptyBack = roundTrip(empty);
  EXPECT_EQ(emptyBack.shape(), (Shape{0, 3}));
  EXPECT_FALSE(roundTrip(Tensor()).defined());
}

TEST(Codec, TensorsInsideContainersAndTuples) {
  auto args = std::make_tuple(floatTensor({2}), std::string("x"), std::vector<Tensor>{floatTensor({1}, 7), Tensor()});
  auto back = roundTrip(args);
  expectSameValues(std::get<0>(back), std::get<0>(args));
  EXPECT_EQ(std::get<1>(back), "x");
  ASSERT_EQ(std::get<2>(back).size(), 2u);
  expectSameValues(std::get<2>(back)[0], std::get<2>(args)[0]);
  EXPECT_FALSE(std::get<2>(back)[1].defined());
}

TEST(Codec, NonContiguousTensorIsCompacted) {
  Tensor base = floatTensor({2, 3});  // [[0, .5, 1], [1.5, 2, 2.5]]
  Tensor transposed = Tensor::fromStorage(base.storage(), {3, 2}, {1, 3}, 0, DType::kFloat32);
  ASSERT_FALSE(transposed.isContiguous());
  auto frame = encodeMessageWith(kindFields(MessageKind::kResponse), transposed);
  ASSERT_TRUE(frame.ok());
  ASSERT_EQ(frame.value().payloads.size(), 1u);
  EXPECT_EQ(frame.value().payloads[0].size, 6 * sizeof(float));
  EXPECT_NE(frame.value().payloads[0].data, base.rawData());
  Tensor back = receive(frame.value()).value().decodeValue<Tensor>().value();
  EXPECT_EQ(back.toVector<float>(), (std::vector<float>{0, 1.5, 0.5, 2, 1, 2.5}));
}

TEST(Codec, SmallViewOfBigStorageIsCompactedLargeViewIsNot) {
  Tensor base = floatTensor({100});
  Tensor small = Tensor::fromStorage(base.storage(), {10}, {1}, 40, DType::kFloat32);
  auto frame = encodeMessageWith(kindFields(MessageKind::kResponse), small);
  ASSERT_TRUE(frame.ok());
  EXPECT_EQ(frame.value().payloads[0].size, 10 * sizeof(float));
  EXPECT_NE(frame.value().payloads[0].data, small.rawData());
  EXPECT_EQ(receive(frame.value()).value().decodeValue<Tensor>().value().toVector<float>(), small.toVector<float>());

  Tensor large = Tensor::fromStorage(base.storage(), {60}, {1}, 40, DType::kFloat32);
  auto inPlace = encodeMessageWith(kindFields(MessageKind::kResponse), large);
  ASSERT_TRUE(inPlace.ok());
  // Sent in place: the payload is the view's own bytes, and the frame holds the storage alive.
  EXPECT_EQ(inPlace.value().payloads[0].data, large.rawData());
  long before = base.storage().useCount();
  EXPECT_GE(before, 2);
}

TEST(Codec, BigTensorIsNotCopiedIntoTheEnvelopeNorOnReceive) {
  Tensor big = Tensor::zeros({16, 1024, 1024}, DType::kFloat32);  // 64 MiB
  big.data<float>()[12345] = 3.0f;
  auto frame = encodeMessageWith(kindFields(MessageKind::kResponse), big);
  ASSERT_TRUE(frame.ok());
  EXPECT_LT(frame.value().envelope.size(), 512u);
  ASSERT_EQ(frame.value().payloads.size(), 1u);
  EXPECT_EQ(frame.value().payloads[0].data, big.rawData());  // in place, no staging copy
  EXPECT_EQ(frame.value().payloads[0].size, big.nbytes());

  auto message = receive(frame.value());
  ASSERT_TRUE(message.ok()) << errorOf(message);
  void* received = message.value().payloads()[0].data;
  Tensor back = message.value().decodeValue<Tensor>().value();
  EXPECT_EQ(back.rawData(), received);  // the tensor wraps the allocator's buffer: no copy
  EXPECT_EQ(back.data<float>()[12345], 3.0f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(received) % 64, 0u);
}

TEST(Codec, DecodedTensorKeepsPayloadAlive) {
  Tensor back;
  {
    auto message = receive(encodeMessageWith(kindFields(MessageKind::kResponse), floatTensor({4}, 1)).value());
    back = message.value().decodeValue<Tensor>().value();
  }
  EXPECT_EQ(back.toVector<float>(), (std::vector<float>{1, 1.5, 2, 2.5}));
}

TEST(Codec, EnvelopeFieldsRoundTrip) {
  EnvelopeFields fields;
  fields.messageId = 99;
  fields.kind = MessageKind::kCall;
  fields.functionName = "add";
  fields.signatureHash = signatureHash<Tensor(Tensor, Tensor)>();
  fields.deadlineUnixMicros = 1'700'000'000'000'000;
  fields.timeoutMicros = 500'000;
  fields.traceId = 11;
  fields.spanId = 12;
  fields.autograd = AutogradIds{(3ull << 48) | 5, 42, true, {(1ull << 48) | 7, 9}};
  auto frame = encodeCall(fields, floatTensor({2}), 2.0);
  ASSERT_TRUE(frame.ok());
  auto message = receive(frame.value());
  ASSERT_TRUE(message.ok()) << errorOf(message);
  const EnvelopeFields& got = message.value().fields();
  EXPECT_EQ(got.messageId, 99u);
  EXPECT_EQ(got.kind, MessageKind::kCall);
  EXPECT_EQ(got.functionName, "add");
  EXPECT_EQ(got.signatureHash, fields.signatureHash);
  EXPECT_EQ(got.deadlineUnixMicros, fields.deadlineUnixMicros);
  EXPECT_EQ(got.timeoutMicros, fields.timeoutMicros);
  EXPECT_EQ(got.traceId, 11u);
  EXPECT_EQ(got.spanId, 12u);
  EXPECT_EQ(got.autograd, fields.autograd);
  EXPECT_FALSE(got.error.has_value());
  auto args = message.value().decodeArgs<Tensor, double>();
  ASSERT_TRUE(args.ok()) << errorOf(args);
  EXPECT_EQ(std::get<0>(args.value()).toVector<float>(), (std::vector<float>{0, 0.5}));
  EXPECT_EQ(std::get<1>(args.value()), 2.0);
  // The wrong argument types are a clear error naming the element.
  expectErrorContains(message.value().decodeArgs<Tensor, std::string>(), "element 1: expected str");
}

TEST(Codec, ErrorMessagesCarryErrorInfo) {
  EnvelopeFields fields = kindFields(MessageKind::kError, 5);
  fields.error = Error{ErrorKind::kRemote, "boom", "worker1", "std::runtime_error"};
  auto message = receive(encodeMessage(fields).value());
  ASSERT_TRUE(message.ok()) << errorOf(message);
  ASSERT_TRUE(message.value().fields().error.has_value());
  const Error& e = *message.value().fields().error;
  EXPECT_EQ(e.kind, ErrorKind::kRemote);
  EXPECT_EQ(e.message, "boom");
  EXPECT_EQ(e.worker, "worker1");
  EXPECT_EQ(e.remoteType, "std::runtime_error");
  EXPECT_TRUE(message.value().value().isNull());
  // An error kind without ErrorInfo (or ErrorInfo on another kind) is the sender's bug, reported as an Error.
  EXPECT_FALSE(encodeMessage(kindFields(MessageKind::kError)).ok());
}

TEST(Codec, UnalignedEnvelopeIsCopiedAndParsed) {
  auto frame = encodeMessageWith(kindFields(MessageKind::kResponse), std::string("aligned?"));
  std::vector<uint8_t> shifted(frame.value().envelope.size() + 1);
  std::memcpy(shifted.data() + 1, frame.value().envelope.data(), frame.value().envelope.size());
  auto allocate = makePayloadAllocator();
  auto buffers = allocate(std::span<const uint8_t>(shifted.data() + 1, frame.value().envelope.size()), {});
  EXPECT_TRUE(buffers.ok()) << errorOf(buffers);
}

// ---------------------------------------------------------------- signatures

TEST(Codec, SignatureHashes) {
  EXPECT_EQ(signatureText<Tensor(Tensor, Tensor)>(), "tensor(tensor,tensor)");
  EXPECT_EQ(signatureText<void()>(), "void()");
  EXPECT_EQ((signatureText<std::vector<double>(const std::map<std::string, int64_t>&, std::optional<float>)>()),
            "list<f64>(map<str,i64>,opt<f32>)");
  EXPECT_EQ(signatureText<TrainConfig(int32_t)>(),
            "struct{lr:f64,steps:i64,stages:list<struct{name:str,count:opt<i32>}>,scales:map<str,f32>}(i32)");
  // Stable: FNV-1a 64 of the text (reference value computed independently: fnv1a64("") is the offset basis).
  EXPECT_EQ(detail::fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(detail::fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(signatureHash<Tensor(Tensor, Tensor)>(), detail::fnv1a64("tensor(tensor,tensor)"));
  // Different signatures differ (including argument order, widths and signedness).
  std::vector<uint64_t> hashes = {signatureHash<Tensor(Tensor, Tensor)>(), signatureHash<Tensor(Tensor)>(),
                                  signatureHash<void(int32_t, double)>(),   signatureHash<void(double, int32_t)>(),
                                  signatureHash<void(int64_t)>(),           signatureHash<void(uint64_t)>(),
                                  signatureHash<void(std::string)>(),       signatureHash<void(std::vector<uint8_t>)>()};
  for (size_t i = 0; i < hashes.size(); ++i) {
    for (size_t j = i + 1; j < hashes.size(); ++j) EXPECT_NE(hashes[i], hashes[j]) << i << " vs " << j;
  }
}

// ---------------------------------------------------------------- malformed input

std::vector<uint8_t> serialize(capnp::MessageBuilder& builder) {
  auto words = capnp::messageToFlatArray(builder);
  auto bytes = words.asBytes();
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

// Runs both receive paths (allocator and decodeMessage) on a hand-built envelope; both must fail with
// `text` in the message.
void expectRejected(capnp::MessageBuilder& builder, std::vector<uint64_t> sizes, const std::string& text) {
  std::vector<uint8_t> envelope = serialize(builder);
  auto allocate = makePayloadAllocator();
  expectErrorContains(allocate(envelope, sizes), text);
  transport::IncomingFrame frame;
  frame.envelope = envelope;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> keep;
  for (uint64_t s : sizes) {
    auto b = std::make_shared<std::vector<uint8_t>>(s);
    frame.payloads.push_back({b->data(), b->size(), b});
  }
  expectErrorContains(decodeMessage(std::move(frame)), text);
}

wire::TensorDesc::Builder tensorEnvelope(capnp::MallocMessageBuilder& builder, uint8_t dtype, std::vector<int64_t> shape,
                                         uint64_t byteLength, uint32_t payloadIndex = 0, uint32_t payloadCount = 1) {
  auto env = builder.initRoot<wire::Envelope>();
  env.setKind(wire::Envelope::Kind::RESPONSE);
  env.setPayloadCount(payloadCount);
  auto desc = env.initValue().initTensor();
  desc.setDtype(dtype);
  auto s = desc.initShape(static_cast<uint32_t>(shape.size()));
  auto st = desc.initStrides(static_cast<uint32_t>(shape.size()));
  // Row-major strides with wrapping arithmetic: these envelopes are malformed on purpose, so their strides
  // may overflow (tensor::contiguousStrides would refuse them).
  uint64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    s.set(static_cast<uint32_t>(i), shape[i]);
    st.set(static_cast<uint32_t>(i), static_cast<int64_t>(stride));
    stride *= static_cast<uint64_t>(std::max<int64_t>(shape[i], 1));
  }
  desc.setPayloadIndex(payloadIndex);
  desc.setByteLength(byteLength);
  return desc;
}

TEST(CodecMalformed, RandomBytesAreErrors) {
  std::mt19937_64 rng(1234);
  auto allocate = makePayloadAllocator();
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<uint8_t> bytes(8 * (1 + rng() % 64));
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    auto r = allocate(bytes, {});
    transport::IncomingFrame frame;
    frame.envelope = bytes;
    auto m = decodeMessage(std::move(frame));
    // Random bytes are almost always rejected; whatever the outcome, both paths agree and nothing throws.
    EXPECT_EQ(r.ok(), m.ok()) << errorOf(r) << " / " << errorOf(m);
  }
  transport::IncomingFrame odd;
  odd.envelope = {1, 2, 3};
  expectErrorContains(decodeMessage(std::move(odd)), "not a whole number of 8-byte words");
  expectErrorContains(decodeMessage(transport::IncomingFrame{}), "empty envelope");
}

TEST(CodecMalformed, TruncatedEnvelope) {
  auto frame = encodeCall(callFields("f"), std::string(200, 'x'), floatTensor({3})).value();
  auto allocate = makePayloadAllocator();
  for (size_t keep = 8; keep < frame.envelope.size(); keep += 8) {
    std::vector<uint8_t> cut(frame.envelope.begin(), frame.envelope.begin() + keep);
    auto r = allocate(cut, std::vector<uint64_t>{12});
    EXPECT_FALSE(r.ok()) << "accepted an envelope truncated to " << keep << " bytes";
    if (!r.ok()) {
      EXPECT_EQ(r.error().message.rfind("malformed message: ", 0), 0u) << r.error().message;
    }
  }
}

TEST(CodecMalformed, WrongPayloadCount) {
  capnp::MallocMessageBuilder builder;
  tensorEnvelope(builder, 0, {2}, 8, 0, /*payloadCount=*/2);
  expectRejected(builder, {8}, "envelope declares 2 payloads, the frame has 1");
}

TEST(CodecMalformed, ShapeTimesItemSizeMustEqualByteLength) {
  capnp::MallocMessageBuilder builder;
  tensorEnvelope(builder, 0, {2, 3}, 25);
  expectRejected(builder, {25}, "= 24 bytes, but byteLength is 25");
}

TEST(CodecMalformed, PayloadSizeMustEqualByteLength) {
  capnp::MallocMessageBuilder builder;
  tensorEnvelope(builder, 0, {2, 3}, 24);
  expectRejected(builder, {32}, "has 32 bytes, its descriptor says 24");
}

TEST(CodecMalformed, NegativeDimension) {
  capnp::MallocMessageBuilder builder;
  tensorEnvelope(builder, 0, {2, -3}, 0);
  expectRejected(builder, {0}, "negative dimension");
}

TEST(CodecMalformed, OverflowingShapeProduct) {
  capnp::MallocMessageBuilder builder;
  tensorEnvelope(builder, 1, {1ll << 31, 1ll << 31, 4}, 0);
  expectRejected(builder, {0}, "overflows its byte size");
  capnp::MallocMessageBuilder withZero;
  tensorEnvelope(withZero, 1, {0, 1ll << 40, 1ll << 40}, 0);
  expectRejected(withZero, {0}, "overflows its byte size");
}

TEST(CodecMalformed, BadDtypeCode) {
  capnp::MallocMessageBuilder builder;
  tensorEnvelope(builder, 17, {2}, 8);
  expectRejected(builder, {8}, "unknown dtype code 17");
}

// CUDA descriptors are valid on the wire (tests/rpc/cuda_rpc_test.cpp has their cases); unknown device
// types and out-of-range CUDA indices are not.
TEST(CodecMalformed, UnknownDevice) {
  capnp::MallocMessageBuilder builder;
  tensorEnvelope(builder, 0, {2}, 8).setDeviceType(2);
  expectRejected(builder, {8}, "unknown device type 2");
  capnp::MallocMessageBuilder cuda;
  auto desc = tensorEnvelope(cuda, 0, {2}, 8);
  desc.setDeviceType(1);
  desc.setDeviceIndex(100);
  expectRejected(cuda, {8}, "CUDA device index 100");
}

TEST(CodecMalformed, RequiresGradOnlyInsideAnAutogradContextAndForFloats) {
  capnp::MallocMessageBuilder outside;
  tensorEnvelope(outside, 0, {2}, 8).setRequiresGrad(true);
  expectRejected(outside, {8}, "requires grad but the message belongs to no autograd context");
  capnp::MallocMessageBuilder integer;
  tensorEnvelope(integer, static_cast<uint8_t>(DType::kInt64), {2}, 16).setRequiresGrad(true);
  integer.getRoot<wire::Envelope>().setHasAutogradContext(true);
  expectRejected(integer, {16}, "requires grad for dtype int64");
}

TEST(CodecMalformed, AutogradClosureOverTheLimit) {
  capnp::MallocMessageBuilder builder;
  tensorEnvelope(builder, 0, {2}, 8);
  auto env = builder.getRoot<wire::Envelope>();
  env.setHasAutogradContext(true);
  env.setAutogradClosureKnown(true);
  env.initAutogradClosure(static_cast<uint32_t>(kMaxAutogradClosure + 1));
  expectRejected(builder, {8}, "autograd closure of 4097 message ids exceeds the limit of 4096");
}

TEST(CodecMalformed, NonContiguousStrides) {
  capnp::MallocMessageBuilder builder;
  auto desc = tensorEnvelope(builder, 0, {2, 3}, 24);
  desc.getStrides().set(0, 1);
  expectRejected(builder, {24}, "strides are not contiguous");
}

TEST(CodecMalformed, PayloadIndexOutOfRangeOrReused) {
  capnp::MallocMessageBuilder outOfRange;
  tensorEnvelope(outOfRange, 0, {2}, 8, /*payloadIndex=*/3);
  expectRejected(outOfRange, {8}, "references payload 3 of 1");

  capnp::MallocMessageBuilder reused;
  auto env = reused.initRoot<wire::Envelope>();
  env.setKind(wire::Envelope::Kind::RESPONSE);
  env.setPayloadCount(2);
  auto list = env.initValue().initList(2);
  for (uint32_t i = 0; i < 2; ++i) {
    auto desc = list[i].initTensor();
    desc.initShape(1).set(0, 2);
    desc.initStrides(1).set(0, 1);
    desc.setByteLength(8);
    desc.setPayloadIndex(0);
  }
  expectRejected(reused, {8, 8}, "payload 0 is referenced twice");
}

TEST(CodecMalformed, UnreferencedPayload) {
  capnp::MallocMessageBuilder builder;
  auto env = builder.initRoot<wire::Envelope>();
  env.setPayloadCount(1);
  env.initValue().setInt64(3);
  expectRejected(builder, {16}, "payload 0 is not referenced");
}

TEST(CodecMalformed, TooDeepNesting) {
  capnp::MallocMessageBuilder builder;
  auto env = builder.initRoot<wire::Envelope>();
  auto value = env.initValue();
  for (int i = 0; i < kMaxValueDepth + 5; ++i) value = value.initList(1)[0];
  value.setInt64(1);
  expectRejected(builder, {}, "nested deeper than 64 levels");

  // Deeper still: Cap'n Proto's own nesting limit would trip; still an Error, never a crash.
  capnp::MallocMessageBuilder deeper;
  auto v = deeper.initRoot<wire::Envelope>().initValue();
  for (int i = 0; i < 1000; ++i) v = v.initOptional();
  v.setNull();
  expectRejected(deeper, {}, "malformed message");

  // The encoder refuses to build such trees in the first place.
  std::vector<std::vector<std::vector<int32_t>>> fine = {{{1}}};
  EXPECT_TRUE(encodeMessageWith(kindFields(MessageKind::kResponse), fine).ok());
}

TEST(CodecMalformed, UnknownKinds) {
  capnp::MallocMessageBuilder builder;
  auto env = builder.initRoot<wire::Envelope>();
  env.setKind(static_cast<wire::Envelope::Kind>(42));
  expectRejected(builder, {}, "unknown message kind 42");
}

TEST(CodecMalformed, IntegerOutOfRangeAndTypeMismatch) {
  auto message = receive(encodeMessageWith(kindFields(MessageKind::kResponse), int64_t{300}).value());
  ASSERT_TRUE(message.ok());
  expectErrorContains(message.value().decodeValue<int8_t>(), "integer 300 does not fit in i8");
  expectErrorContains(message.value().decodeValue<uint8_t>(), "integer 300 does not fit in u8");
  EXPECT_EQ(message.value().decodeValue<int16_t>().value(), 300);
  auto negative = receive(encodeMessageWith(kindFields(MessageKind::kResponse), int32_t{-1}).value());
  expectErrorContains(negative.value().decodeValue<uint64_t>(), "integer -1 does not fit in u64");
  auto big = receive(encodeMessageWith(kindFields(MessageKind::kResponse), uint64_t{1} << 63).value());
  expectErrorContains(big.value().decodeValue<int64_t>(), "does not fit in i64");
  auto huge = receive(encodeMessageWith(kindFields(MessageKind::kResponse), 1e300).value());
  expectErrorContains(huge.value().decodeValue<float>(), "does not fit in f32");
  expectErrorContains(message.value().decodeValue<std::string>(), "expected str, got a int64 value");
  auto config = receive(encodeMessageWith(kindFields(MessageKind::kResponse), Inner{"a", 1}).value());
  expectErrorContains(config.value().decodeValue<TrainConfig>(), "expected a struct with 4 fields, got 2");
  auto dup = receive(encodeMessageWith(kindFields(MessageKind::kResponse),
                                       std::vector<std::pair<int32_t, int32_t>>{{1, 2}, {1, 3}})
                         .value());
  // A list of pairs is not a map; a map with duplicate keys is built by hand below.
  expectErrorContains(dup.value().decodeValue<std::map<int32_t, int32_t>>(), "expected map<i32,i32>");
  capnp::MallocMessageBuilder builder;
  auto env = builder.initRoot<wire::Envelope>();
  auto entries = env.initValue().initMap(2);
  for (uint32_t i = 0; i < 2; ++i) {
    entries[i].initKey().setInt64(1);
    entries[i].initValue().setInt64(i);
  }
  transport::IncomingFrame frame;
  frame.envelope = serialize(builder);
  auto m = decodeMessage(std::move(frame));
  ASSERT_TRUE(m.ok()) << errorOf(m);
  expectErrorContains(m.value().decodeValue<std::map<int32_t, int32_t>>(), "duplicate key");
}

TEST(CodecMalformed, CudaTensorIsAClearEncodeError) {
  // Without a GPU we cannot make a CUDA tensor; wrap foreign memory labelled as CUDA (never touched).
  float dummy[4] = {};
  Tensor fake = Tensor::fromStorage(tensor::Storage::wrap(dummy, sizeof(dummy), Device::cuda(0), nullptr), {4}, {1},
                                    0, DType::kFloat32);
  auto frame = encodeMessageWith(kindFields(MessageKind::kResponse), fake);
  expectErrorContains(frame, "cannot send a tensor on cuda:0");
}

}  // namespace
}  // namespace distgrad::rpc

namespace distgrad::rpc {
namespace {

// Found by the fuzzer: repeated decodes of one message used to share (and exhaust) one Cap'n Proto
// traversal budget, and the resulting kj::Exception escaped from value(). Each decode now has its own.
TEST(CodecMalformed, RepeatedDecodesDoNotExhaustTheTraversalBudget) {
  std::vector<std::vector<int64_t>> value(200, std::vector<int64_t>{1, 2, 3});
  auto message = decodeMessage(transport::IncomingFrame{0, encodeMessageWith(kindFields(MessageKind::kResponse), value)
                                                                .value()
                                                                .envelope,
                                                        {}});
  ASSERT_TRUE(message.ok());
  for (int i = 0; i < 20; ++i) {
    auto decoded = message.value().decodeValue<std::vector<std::vector<int64_t>>>();
    ASSERT_TRUE(decoded.ok()) << "decode " << i << ": " << decoded.error().message;
    EXPECT_EQ(decoded.value(), value);
    EXPECT_FALSE(message.value().decodeValue<std::string>().ok());
  }
}

}  // namespace
}  // namespace distgrad::rpc
