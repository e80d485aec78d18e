// The value codec: C++ values <-> the Cap'n Proto value tree of rpc/schema/envelope.capnp, with tensor
// bytes carried beside the envelope as raw payload buffers (never copied into it).
//
// Codec<T> has, for every supported T:
//   static std::string signature();                               // wire type name, e.g. "list<f64>"
//   static void encode(wire::Value::Builder, const T&, EncodeContext&);
//   static T decode(wire::Value::Reader, DecodeContext&);         // throws CodecError on bad input
// Supported: bool; integer types (range-checked on decode: a value that does not fit is an error); float
// and double; std::string (text); std::vector<uint8_t> (bytes); std::vector<T>; std::map and
// std::unordered_map (same wire form: a list of entries, duplicate keys rejected); std::optional<T>;
// std::tuple and std::pair (a struct with empty field names); Tensor (a descriptor + one payload; an
// undefined Tensor travels as null; a CUDA tensor is staged through host memory and lands on the device its
// CodecScope's device map names, see docs/cuda.md); RRefId; and user structs that declare a field visitor:
//
//   struct TrainConfig {
//     double lr = 0.1;
//     int64_t steps = 0;
//     template <class V> void visitFields(V& v) { v("lr", lr); v("steps", steps); }
//   };
//
// The visitor is called with (name, member) for each field in wire order; the struct must be default-
// constructible (decode fills a default-constructed value). Encoding calls visitFields on a const_cast
// copy-free alias of the value, with a visitor that only reads (const F&), so the value is never written.
// Field names and order are part of the signature hash, so peers that disagree on a struct are rejected
// before any field is read. Add your own types by specialising Codec<T> with the three members above.
//
// Decode entry points (decodeValue, rpc/message.h) turn every failure, including Cap'n Proto's
// kj::Exception on malformed bytes, into an Error value: nothing escapes to the caller as an exception.
// Thread-safety: stateless functions; an EncodeContext/DecodeContext belongs to one encode/decode call.
#pragma once

#include <capnp/list.h>
#include <kj/exception.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "rpc/device_map.h"
#include "rpc/error.h"
#include "rpc/schema/envelope.capnp.h"
#include "autograd/node.h"
#include "rpc/transport/transport.h"
#include "tensor/tensor.h"

namespace distgrad::rpc {

// Deepest value tree a receiver accepts (containers within containers). Cap'n Proto's own nesting limit
// is set above this (two pointer hops per level), so our clearer message fires first.
inline constexpr int kMaxValueDepth = 64;

// Thrown inside codecs; the decode/encode entry points convert it to an Error.
class CodecError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Id of a remote reference (owner worker id + owner-local counter), see issue 4.
struct RRefId {
  uint32_t ownerWorkerId = 0;
  uint64_t localId = 0;
  friend bool operator==(const RRefId&, const RRefId&) = default;
};

class Agent;
class AutogradHook;

// A remote reference carried by a message (an RRef's fork, rref/): listed in the envelope by the sender
// (EncodeContext::addReference), so the receiver can settle the ones it never decodes.
struct CarriedReference {
  RRefId id;
  uint64_t fork = 0;
};

// Where a received message's unclaimed references go (rref/ implements it; Registry::setReferenceSink).
class ReferenceSink {
 public:
  virtual ~ReferenceSink() = default;
  // `refs` were carried by a message from `peer` that died without a codec claiming them (the call was
  // refused or failed before decoding its arguments, a reply came after its caller stopped waiting, ...).
  // Runs on the thread that dropped the message's last view; must not block.
  virtual void onUnclaimedReferences(const std::string& peer, std::vector<CarriedReference> refs) = 0;
};

// The references one received message carries (its envelope's list) and which of them a codec claimed.
// Shared by every view of the message (DecodedMessage, fieldView, CodecScope copies); when the last one
// goes, the unclaimed ones are handed to the sink the agent bound (Note [Unclaimed references] in
// rref/context.cpp): a message dropped anywhere between arrival and decoding cannot leak a reference.
// Thread-safety: claim and bind may be called from any thread.
class CarriedReferences {
 public:
  explicit CarriedReferences(std::vector<CarriedReference> refs);
  ~CarriedReferences();
  CarriedReferences(const CarriedReferences&) = delete;
  CarriedReferences& operator=(const CarriedReferences&) = delete;
  // A codec decoded the reference `fork` (it now has a handle for it). False when the message does not
  // list it or it was claimed already.
  bool claim(uint64_t fork);
  // Where the unclaimed references go (the receiving agent's sink, the sender's name). Unbound: nowhere.
  void bind(std::shared_ptr<ReferenceSink> sink, std::string peer);
  size_t size() const { return refs_.size(); }

 private:
  std::mutex mutex_;
  std::vector<CarriedReference> refs_;
  std::vector<bool> claimed_;                 // GUARDED_BY(mutex_)
  std::shared_ptr<ReferenceSink> sink_;       // GUARDED_BY(mutex_)
  std::string peer_;                          // GUARDED_BY(mutex_)
};

// Which agent encodes or decodes a message and the worker at the other end (the callee of a call, the
// caller of a reply; the sender of a received message). Codecs of values that stand for per-worker state
// (rref::RRef<T>) need both: an RRef is registered with the agent's reference table and forked to `peer`.
// Empty (agent == nullptr) outside an agent (tests, tools): such codecs then refuse to run.
// Distributed autograd (rpc/autograd_hook.h) adds the rest: on the sending side the context the message
// belongs to and the hook that records it; on the receiving side the RecvBackward node received grad tensors
// hang from and, per payload, the output of that node it feeds (-1: none).
struct CodecScope {
  Agent* agent = nullptr;
  std::string peer;
  uint64_t autogradContext = 0;
  AutogradHook* autogradHook = nullptr;
  std::shared_ptr<autograd::Node> recvNode = nullptr;
  std::shared_ptr<const std::vector<int32_t>> gradIndexOfPayload = nullptr;
  // Receiving side: the references the message carries (null when none); codecs claim what they decode.
  std::shared_ptr<CarriedReferences> references = nullptr;
  // CUDA tensors over RPC (rpc/device_map.h). Sending side: where this message's CUDA tensors land at
  // `peer` (null: nowhere, a CUDA tensor is refused). Receiving side: whether a received CUDA tensor is
  // waited for on the host before the decoder returns it (Note [Received CUDA tensors] in rpc/codec.cpp).
  std::shared_ptr<const DeviceMap> deviceMap = nullptr;
  bool cudaWaitOnHost = true;
};

// Collects the payload buffers of one message while its value tree is encoded.
class EncodeContext {
 public:
  EncodeContext() = default;
  explicit EncodeContext(CodecScope scope);
  const CodecScope& scope() const { return scope_; }
  // Appends a payload; returns its index.
  uint32_t addPayload(transport::SendBuffer buffer);
  const std::vector<transport::SendBuffer>& payloads() const { return payloads_; }
  std::vector<transport::SendBuffer> takePayloads() { return std::move(payloads_); }
  // Nesting guard for recursive user types (a struct holding a vector of itself).
  void enter();
  void leave() { --depth_; }
  // Whether tensors that require grad are recorded (a message of an autograd context, grad mode on).
  bool recordsGrad() const { return recordsGrad_; }
  void addGradTensor(const Tensor& t) { gradTensors_.push_back(t); }
  const std::vector<Tensor>& gradTensors() const { return gradTensors_; }
  // A remote reference written into this message (listed in its envelope). `abandon` undoes what writing
  // it registered at the sender, and runs if the message fails to encode (a later value throws).
  void addReference(CarriedReference ref, std::function<void()> abandon);
  const std::vector<CarriedReference>& references() const { return references_; }
  // The message will not be sent: runs the abandon callbacks (once).
  void abandon();

 private:
  std::vector<transport::SendBuffer> payloads_;
  std::vector<CarriedReference> references_;
  std::vector<std::function<void()>> abandons_;
  std::vector<Tensor> gradTensors_;
  bool recordsGrad_ = false;
  int depth_ = 0;
  CodecScope scope_;
};

// The received payloads of one message; hands each to at most one tensor.
class DecodeContext {
 public:
  explicit DecodeContext(std::span<const transport::PayloadBuffer> payloads, int maxDepth = kMaxValueDepth,
                         CodecScope scope = {});
  const CodecScope& scope() const { return scope_; }
  // Validates the descriptor against its payload and wraps the payload's memory as the tensor's storage
  // (no copy; the payload's owner stays alive as long as the tensor's storage).
  Tensor takeTensor(wire::TensorDesc::Reader desc);
  // Throws unless every payload was taken: a frame must not carry bytes nobody references.
  void finish() const;
  void enter();
  void leave() { --depth_; }

 private:
  std::span<const transport::PayloadBuffer> payloads_;
  std::vector<bool> used_;
  int depth_ = 0;
  int maxDepth_;
  CodecScope scope_;
};

namespace detail {

template <typename Context>
class DepthScope {
 public:
  explicit DepthScope(Context& ctx) : ctx_(ctx) { ctx_.enter(); }
  ~DepthScope() { ctx_.leave(); }
  DepthScope(const DepthScope&) = delete;
  DepthScope& operator=(const DepthScope&) = delete;

 private:
  Context& ctx_;
};

// "int64", "text", ... (for error messages).
const char* valueKindName(wire::Value::Which which);
[[noreturn]] void throwKindMismatch(const std::string& expected, wire::Value::Reader value);
void encodeTensor(wire::Value::Builder out, const Tensor& tensor, EncodeContext& ctx);
// Cap'n Proto lists hold at most 2^29 - 1 elements.
uint32_t checkedListSize(size_t n);

// A tensor descriptor checked against the rules of docs/wire_protocol.md (without its payload).
struct TensorLayout {
  DType dtype = DType::kFloat32;
  Device device;  // where the receiver puts it (CPU, or a CUDA index in [0, kMaxCudaDevices))
  Shape shape;
  uint32_t payloadIndex = 0;
  uint64_t byteLength = 0;
  bool requiresGrad = false;
};
// Throws CodecError naming the offending field unless the descriptor is valid for a frame with
// `payloadCount` payloads.
TensorLayout checkTensorDesc(wire::TensorDesc::Reader desc, size_t payloadCount);

// Walks an untrusted value tree: checks the depth limit, union members and every tensor descriptor, and
// calls onTensor(layout) for each. Throws CodecError (or kj::Exception from Cap'n Proto).
template <typename OnTensor>
void walkValue(wire::Value::Reader value, size_t payloadCount, int depth, int maxDepth, OnTensor& onTensor);

// Runs fn, converting every exception into Error::failed("<what>: <message>").
template <typename F>
auto guard(const char* what, F&& fn) -> Result<decltype(fn())>;

inline constexpr uint64_t fnv1a64(std::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

template <typename T>
concept WireInteger = std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char> &&
                      !std::is_same_v<T, wchar_t> && !std::is_same_v<T, char8_t> &&
                      !std::is_same_v<T, char16_t> && !std::is_same_v<T, char32_t>;

template <typename T>
struct IsStdMap : std::false_type {};
template <typename K, typename V, typename C, typename A>
struct IsStdMap<std::map<K, V, C, A>> : std::true_type {};
template <typename K, typename V, typename H, typename E, typename A>
struct IsStdMap<std::unordered_map<K, V, H, E, A>> : std::true_type {};

// Visitors handed to a user struct's visitFields.
struct FieldCounter {
  uint32_t count = 0;
  template <typename F>
  void operator()(const char*, const F&) { ++count; }
};
struct FieldSignature;
class FieldEncoder;
class FieldDecoder;

}  // namespace detail

template <typename T>
concept FieldVisitable = std::is_class_v<T> && requires(T& t, detail::FieldCounter& v) { t.visitFields(v); };

// Primary template: user structs with a field visitor.
template <typename T>
struct Codec {
  static_assert(FieldVisitable<T>,
                "no rpc::Codec for this type: give it `template <class V> void visitFields(V& v)` or "
                "specialise rpc::Codec<T> (see rpc/codec.h)");
  static_assert(std::is_default_constructible_v<T>, "rpc structs with visitFields must be default-constructible");
  static std::string signature();
  static void encode(wire::Value::Builder out, const T& value, EncodeContext& ctx);
  static T decode(wire::Value::Reader in, DecodeContext& ctx);
};

template <>
struct Codec<bool> {
  static std::string signature() { return "bool"; }
  static void encode(wire::Value::Builder out, bool value, EncodeContext&) { out.setBool(value); }
  static bool decode(wire::Value::Reader in, DecodeContext&) {
    if (!in.isBool()) detail::throwKindMismatch("bool", in);
    return in.getBool();
  }
};

template <typename T>
  requires detail::WireInteger<T>
struct Codec<T> {
  static std::string signature() {
    static_assert(sizeof(T) <= 8, "integers wider than 64 bits have no wire form");
    constexpr const char* kNames[2][4] = {{"u8", "u16", "u32", "u64"}, {"i8", "i16", "i32", "i64"}};
    constexpr int kWidth = sizeof(T) == 1 ? 0 : sizeof(T) == 2 ? 1 : sizeof(T) == 4 ? 2 : 3;
    return kNames[std::is_signed_v<T> ? 1 : 0][kWidth];
  }
  static void encode(wire::Value::Builder out, T value, EncodeContext&) {
    if constexpr (std::is_signed_v<T>) {
      out.setInt64(static_cast<int64_t>(value));
    } else {
      out.setUint64(static_cast<uint64_t>(value));
    }
  }
  static T decode(wire::Value::Reader in, DecodeContext&) {
    if (in.isInt64()) return checked(in.getInt64());
    if (in.isUint64()) return checked(in.getUint64());
    detail::throwKindMismatch(signature(), in);
  }

 private:
  template <typename W>
  static T checked(W wide) {
    if (!std::in_range<T>(wide)) {
      throw CodecError("integer " + std::to_string(wide) + " does not fit in " + signature());
    }
    return static_cast<T>(wide);
  }
};

template <>
struct Codec<double> {
  static std::string signature() { return "f64"; }
  static void encode(wire::Value::Builder out, double value, EncodeContext&) { out.setFloat64(value); }
  static double decode(wire::Value::Reader in, DecodeContext&) {
    if (!in.isFloat64()) detail::throwKindMismatch("f64", in);
    return in.getFloat64();
  }
};

template <>
struct Codec<float> {
  static std::string signature() { return "f32"; }
  static void encode(wire::Value::Builder out, float value, EncodeContext&) { out.setFloat64(value); }
  static float decode(wire::Value::Reader in, DecodeContext&);  // range-checked: a finite double beyond
                                                                // float's range is an error
};

template <>
struct Codec<std::string> {
  static std::string signature() { return "str"; }
  static void encode(wire::Value::Builder out, const std::string& value, EncodeContext&) {
    out.setText(capnp::Text::Reader(value.data(), value.size()));
  }
  static std::string decode(wire::Value::Reader in, DecodeContext&) {
    if (!in.isText()) detail::throwKindMismatch("str", in);
    auto text = in.getText();
    return std::string(text.begin(), text.size());
  }
};

template <>
struct Codec<std::vector<uint8_t>> {
  static std::string signature() { return "bytes"; }
  static void encode(wire::Value::Builder out, const std::vector<uint8_t>& value, EncodeContext&) {
    out.setData(capnp::Data::Reader(value.data(), value.size()));
  }
  static std::vector<uint8_t> decode(wire::Value::Reader in, DecodeContext&) {
    if (!in.isData()) detail::throwKindMismatch("bytes", in);
    auto data = in.getData();
    return std::vector<uint8_t>(data.begin(), data.end());
  }
};

template <typename E, typename A>
struct Codec<std::vector<E, A>> {
  using Elem = std::decay_t<E>;
  static std::string signature() { return "list<" + Codec<Elem>::signature() + ">"; }
  static void encode(wire::Value::Builder out, const std::vector<E, A>& value, EncodeContext& ctx) {
    detail::DepthScope scope(ctx);
    auto list = out.initList(detail::checkedListSize(value.size()));
    uint32_t i = 0;
    for (const auto& element : value) Codec<Elem>::encode(list[i++], element, ctx);
  }
  static std::vector<E, A> decode(wire::Value::Reader in, DecodeContext& ctx) {
    if (!in.isList()) detail::throwKindMismatch(signature(), in);
    detail::DepthScope scope(ctx);
    auto list = in.getList();
    std::vector<E, A> out;
    out.reserve(list.size());  // bounded: list elements live inside the (size-limited) envelope
    for (auto element : list) out.push_back(Codec<Elem>::decode(element, ctx));
    return out;
  }
};

template <typename M>
  requires detail::IsStdMap<M>::value
struct Codec<M> {
  using Key = typename M::key_type;
  using Mapped = typename M::mapped_type;
  static std::string signature() {
    return "map<" + Codec<Key>::signature() + "," + Codec<Mapped>::signature() + ">";
  }
  static void encode(wire::Value::Builder out, const M& value, EncodeContext& ctx) {
    detail::DepthScope scope(ctx);
    auto entries = out.initMap(detail::checkedListSize(value.size()));
    uint32_t i = 0;
    for (const auto& [key, mapped] : value) {
      auto entry = entries[i++];
      Codec<Key>::encode(entry.initKey(), key, ctx);
      Codec<Mapped>::encode(entry.initValue(), mapped, ctx);
    }
  }
  static M decode(wire::Value::Reader in, DecodeContext& ctx) {
    if (!in.isMap()) detail::throwKindMismatch(signature(), in);
    detail::DepthScope scope(ctx);
    M out;
    for (auto entry : in.getMap()) {
      Key key = Codec<Key>::decode(entry.getKey(), ctx);
      Mapped mapped = Codec<Mapped>::decode(entry.getValue(), ctx);
      if (!out.emplace(std::move(key), std::move(mapped)).second) {
        throw CodecError("duplicate key in " + signature());
      }
    }
    return out;
  }
};

template <typename T>
struct Codec<std::optional<T>> {
  static std::string signature() { return "opt<" + Codec<T>::signature() + ">"; }
  static void encode(wire::Value::Builder out, const std::optional<T>& value, EncodeContext& ctx) {
    detail::DepthScope scope(ctx);
    auto inner = out.initOptional();
    if (value) {
      Codec<T>::encode(inner, *value, ctx);
    } else {
      inner.setNull();
    }
  }
  static std::optional<T> decode(wire::Value::Reader in, DecodeContext& ctx) {
    if (!in.isOptional()) detail::throwKindMismatch(signature(), in);
    detail::DepthScope scope(ctx);
    auto inner = in.getOptional();
    if (inner.isNull()) return std::nullopt;
    return Codec<T>::decode(inner, ctx);
  }
};

namespace detail {

// Tuples and pairs: a struct with empty field names, decoded positionally.
template <typename Tuple, typename... Ts>
struct TupleCodec {
  static std::string signature() {
    std::string out = "tuple<";
    bool first = true;
    ((out += (first ? "" : ","), out += Codec<std::decay_t<Ts>>::signature(), first = false), ...);
    return out + ">";
  }
  template <typename AnyTuple>
  static void encode(wire::Value::Builder out, const AnyTuple& value, EncodeContext& ctx) {
    DepthScope scope(ctx);
    auto fields = out.initStruct(sizeof...(Ts));
    encodeAll(fields, value, ctx, std::index_sequence_for<Ts...>{});
  }
  static Tuple decode(wire::Value::Reader in, DecodeContext& ctx) {
    if (!in.isStruct()) throwKindMismatch(signature(), in);
    DepthScope scope(ctx);
    auto fields = in.getStruct();
    if (fields.size() != sizeof...(Ts)) {
      throw CodecError("expected " + signature() + " with " + std::to_string(sizeof...(Ts)) + " elements, got " +
                       std::to_string(fields.size()));
    }
    return decodeAll(fields, ctx, std::index_sequence_for<Ts...>{});
  }

 private:
  template <typename AnyTuple, size_t... Is>
  static void encodeAll([[maybe_unused]] capnp::List<wire::Field>::Builder fields, const AnyTuple& value,
                        EncodeContext& ctx, std::index_sequence<Is...>) {  // unused for the empty tuple
    (Codec<std::decay_t<Ts>>::encode(fields[Is].initValue(), std::get<Is>(value), ctx), ...);
  }
  template <size_t I, typename E>
  static E decodeElement(capnp::List<wire::Field>::Reader fields, DecodeContext& ctx) {
    try {
      return Codec<E>::decode(fields[I].getValue(), ctx);
    } catch (const CodecError& e) {
      throw CodecError("element " + std::to_string(I) + ": " + e.what());
    }
  }
  template <size_t... Is>
  static Tuple decodeAll([[maybe_unused]] capnp::List<wire::Field>::Reader fields, [[maybe_unused]] DecodeContext& ctx,
                         std::index_sequence<Is...>) {
    // Braced initialisation evaluates left to right, so payloads are taken in wire order.
    return Tuple{decodeElement<Is, std::decay_t<Ts>>(fields, ctx)...};
  }
};

}  // namespace detail

template <typename... Ts>
struct Codec<std::tuple<Ts...>> : detail::TupleCodec<std::tuple<Ts...>, Ts...> {};
template <typename A, typename B>
struct Codec<std::pair<A, B>> : detail::TupleCodec<std::pair<A, B>, A, B> {};

template <>
struct Codec<Tensor> {
  static std::string signature() { return "tensor"; }
  static void encode(wire::Value::Builder out, const Tensor& value, EncodeContext& ctx) {
    detail::encodeTensor(out, value, ctx);
  }
  static Tensor decode(wire::Value::Reader in, DecodeContext& ctx) {
    if (in.isNull()) return Tensor();
    if (!in.isTensor()) detail::throwKindMismatch("tensor", in);
    return ctx.takeTensor(in.getTensor());
  }
};

template <>
struct Codec<RRefId> {
  static std::string signature() { return "rref"; }
  static void encode(wire::Value::Builder out, const RRefId& value, EncodeContext&) {
    auto id = out.initRrefId();
    id.setOwnerWorkerId(value.ownerWorkerId);
    id.setLocalId(value.localId);
  }
  static RRefId decode(wire::Value::Reader in, DecodeContext&) {
    if (!in.isRrefId()) detail::throwKindMismatch("rref", in);
    auto id = in.getRrefId();
    return RRefId{id.getOwnerWorkerId(), id.getLocalId()};
  }
};

// ---- user structs ----

namespace detail {

struct FieldSignature {
  std::string out;
  template <typename F>
  void operator()(const char* name, const F&) {
    if (!out.empty()) out += ",";
    out += std::string(name) + ":" + Codec<F>::signature();
  }
};

class FieldEncoder {
 public:
  FieldEncoder(capnp::List<wire::Field>::Builder fields, EncodeContext& ctx) : fields_(fields), ctx_(ctx) {}
  template <typename F>
  void operator()(const char* name, const F& value) {
    auto field = fields_[index_++];
    field.setName(name);
    Codec<F>::encode(field.initValue(), value, ctx_);
  }

 private:
  capnp::List<wire::Field>::Builder fields_;
  EncodeContext& ctx_;
  uint32_t index_ = 0;
};

class FieldDecoder {
 public:
  FieldDecoder(capnp::List<wire::Field>::Reader fields, DecodeContext& ctx) : fields_(fields), ctx_(ctx) {}
  template <typename F>
  void operator()(const char* name, F& value) {
    auto field = fields_[index_++];
    const auto got = field.getName();  // one read: each is a bounds-checked pointer walk
    if (std::string_view(got.cStr(), got.size()) != name) {
      throw CodecError(std::string("expected field '") + name + "', got '" + got.cStr() + "'");
    }
    try {
      value = Codec<F>::decode(field.getValue(), ctx_);
    } catch (const CodecError& e) {
      throw CodecError(std::string("field '") + name + "': " + e.what());
    }
  }

 private:
  capnp::List<wire::Field>::Reader fields_;
  DecodeContext& ctx_;
  uint32_t index_ = 0;
};

}  // namespace detail

template <typename T>
std::string Codec<T>::signature() {
  T probe{};
  detail::FieldSignature visitor;
  probe.visitFields(visitor);
  return "struct{" + visitor.out + "}";
}

template <typename T>
void Codec<T>::encode(wire::Value::Builder out, const T& value, EncodeContext& ctx) {
  detail::DepthScope scope(ctx);
  // visitFields is non-const so one declaration serves encode and decode; the encoding visitors take
  // fields as const F&, so the value is only read.
  T& readable = const_cast<T&>(value);
  detail::FieldCounter counter;
  readable.visitFields(counter);
  detail::FieldEncoder encoder(out.initStruct(counter.count), ctx);
  readable.visitFields(encoder);
}

template <typename T>
T Codec<T>::decode(wire::Value::Reader in, DecodeContext& ctx) {
  if (!in.isStruct()) detail::throwKindMismatch(signature(), in);
  detail::DepthScope scope(ctx);
  T out{};
  detail::FieldCounter counter;
  out.visitFields(counter);
  auto fields = in.getStruct();
  if (fields.size() != counter.count) {
    throw CodecError("expected a struct with " + std::to_string(counter.count) + " fields, got " +
                     std::to_string(fields.size()));
  }
  detail::FieldDecoder decoder(fields, ctx);
  out.visitFields(decoder);
  return out;
}

// Note [Positional structs]: Codec<T> for a visitFields struct that travels as the list of its field values
// in declaration order, without names: for internal messages decoded on every call (the RRef call header,
// Note [Positional call header] in rref/context.h), where a named field's decode reads its name (a
// bounds-checked text read, and the envelope check reads it again) and a field record around the value.
// The count and every value (its field's codec) are still checked; an error names the field. Use:
//   template <> struct rpc::Codec<Header> : rpc::PositionalCodec<Header> {};
template <typename T>
struct PositionalCodec {
  static std::string signature() {
    T probe{};
    detail::FieldSignature visitor;
    probe.visitFields(visitor);
    return "positional{" + visitor.out + "}";
  }
  static void encode(wire::Value::Builder out, const T& value, EncodeContext& ctx) {
    detail::DepthScope scope(ctx);
    T& readable = const_cast<T&>(value);  // the visitor only reads (as Codec<T>::encode)
    detail::FieldCounter counter;
    readable.visitFields(counter);
    auto list = out.initList(counter.count);
    uint32_t index = 0;
    auto write = [&](const char*, const auto& field) {
      Codec<std::decay_t<decltype(field)>>::encode(list[index++], field, ctx);
    };
    readable.visitFields(write);
  }
  static T decode(wire::Value::Reader in, DecodeContext& ctx) {
    if (!in.isList()) detail::throwKindMismatch(signature(), in);
    detail::DepthScope scope(ctx);
    T out{};
    detail::FieldCounter counter;
    out.visitFields(counter);
    auto list = in.getList();
    if (list.size() != counter.count) {
      throw CodecError("expected " + std::to_string(counter.count) + " positional fields, got " +
                       std::to_string(list.size()));
    }
    uint32_t index = 0;
    auto read = [&](const char* name, auto& field) {
      try {
        field = Codec<std::decay_t<decltype(field)>>::decode(list[index++], ctx);
      } catch (const CodecError& e) {
        throw CodecError(std::string("field '") + name + "': " + e.what());
      }
    };
    out.visitFields(read);
    return out;
  }
};

// ---- signatures ----

template <typename T>
std::string typeSignature() {
  if constexpr (std::is_void_v<T>) {
    return "void";
  } else {
    return Codec<std::decay_t<T>>::signature();
  }
}

template <typename Sig>
struct FunctionSignature;
template <typename R, typename... Args>
struct FunctionSignature<R(Args...)> {
  static std::string text() {
    std::string out = typeSignature<R>() + "(";
    bool first = true;
    ((out += (first ? "" : ","), out += typeSignature<Args>(), first = false), ...);
    return out + ")";
  }
};

// The type signature of a function type as text, e.g. "tensor(tensor,f64)".
template <typename Sig>
std::string signatureText() {
  return FunctionSignature<Sig>::text();
}

// FNV-1a 64 of signatureText<Sig>(); computed once per signature.
template <typename Sig>
uint64_t signatureHash() {
  static const uint64_t hash = detail::fnv1a64(signatureText<Sig>());
  return hash;
}

// ---- entry points that never throw ----

// Encodes `value` into `out`, appending payloads to ctx. Errors (a CUDA tensor, nesting too deep) come
// back as Error values.
template <typename T>
Result<void> encodeValue(wire::Value::Builder out, const T& value, EncodeContext& ctx);

// Decodes a value tree as T using `payloads`; every payload must be taken by exactly one tensor.
template <typename T>
Result<T> decodeValue(wire::Value::Reader in, std::span<const transport::PayloadBuffer> payloads);

// ---- template definitions ----

namespace detail {

template <typename F>
auto guard(const char* what, F&& fn) -> Result<decltype(fn())> {
  using R = decltype(fn());
  try {
    if constexpr (std::is_void_v<R>) {
      fn();
      return Result<void>();
    } else {
      return Result<R>(fn());
    }
  } catch (const kj::Exception& e) {
    return Error::failed(std::string(what) + ": " + e.getDescription().cStr());
  } catch (const std::exception& e) {
    return Error::failed(std::string(what) + ": " + e.what());
  }
}

template <typename OnTensor>
void walkValue(wire::Value::Reader value, size_t payloadCount, int depth, int maxDepth, OnTensor& onTensor) {
  if (depth > maxDepth) {
    throw CodecError("value tree nested deeper than " + std::to_string(maxDepth) + " levels");
  }
  switch (value.which()) {
    case wire::Value::NULL_:
    case wire::Value::BOOL:
    case wire::Value::INT64:
    case wire::Value::UINT64:
    case wire::Value::FLOAT64:
    case wire::Value::DATA:
    case wire::Value::RREF_ID:
      return;
    case wire::Value::TEXT:
      (void)value.getText();  // validates the NUL terminator
      return;
    case wire::Value::LIST:
      for (auto element : value.getList()) walkValue(element, payloadCount, depth + 1, maxDepth, onTensor);
      return;
    case wire::Value::MAP:
      for (auto entry : value.getMap()) {
        walkValue(entry.getKey(), payloadCount, depth + 1, maxDepth, onTensor);
        walkValue(entry.getValue(), payloadCount, depth + 1, maxDepth, onTensor);
      }
      return;
    case wire::Value::STRUCT:
      for (auto field : value.getStruct()) {
        (void)field.getName();
        walkValue(field.getValue(), payloadCount, depth + 1, maxDepth, onTensor);
      }
      return;
    case wire::Value::OPTIONAL:
      walkValue(value.getOptional(), payloadCount, depth + 1, maxDepth, onTensor);
      return;
    case wire::Value::TENSOR:
      onTensor(checkTensorDesc(value.getTensor(), payloadCount));
      return;
  }
  throw CodecError("unknown value kind " + std::to_string(static_cast<unsigned>(value.which())));
}

}  // namespace detail

template <typename T>
Result<void> encodeValue(wire::Value::Builder out, const T& value, EncodeContext& ctx) {
  return detail::guard("cannot encode value", [&] { Codec<std::decay_t<T>>::encode(out, value, ctx); });
}

template <typename T>
Result<T> decodeValue(wire::Value::Reader in, std::span<const transport::PayloadBuffer> payloads) {
  return detail::guard("malformed value", [&]() -> T {
    DecodeContext ctx(payloads);
    T out = Codec<T>::decode(in, ctx);
    ctx.finish();
    return out;
  });
}

}  // namespace distgrad::rpc
