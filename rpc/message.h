// Whole RPC messages: EnvelopeFields + a value tree + payloads <-> transport frames, and the
// PayloadAllocator that lets a transport read tensor bytes straight into their final storage.
//
// Sending: the agent fills EnvelopeFields and encodes the value in the same call:
//   call      value = the arguments as a tuple (encodeCall / Codec<std::tuple<...>>)
//   response  value = the result (null for void)
//   error     fields.error set, value null
//   others    a value defined by that message kind's owner (rref/, autograd/distributed/, the agent).
// Receiving: a transport calls the allocator from makePayloadAllocator() when an envelope arrives (it
// parses and validates the envelope and allocates one CPU Storage per payload, exactly its size), then
// hands the IncomingFrame to decodeMessage(), which validates again (inproc frames skip the allocator) and
// returns a DecodedMessage; the handler decodes the value with the types it expects (decodeValue<T> /
// decodeArgs<Args...>), and the tensors it gets wrap the received buffers without a copy.
// Every failure is an Error value (kind failed, message starting "malformed message:" for bad bytes).
// Thread-safety: free functions are reentrant; a DecodedMessage is a value owned by one thread at a time
// (it may be moved between threads), and its const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <capnp/message.h>

#include "rpc/codec.h"
#include "rpc/device_map.h"
#include "rpc/error.h"
#include "rpc/transport/transport.h"

namespace distgrad::rpc {

enum class MessageKind : uint8_t {
  kCall = 0,
  kResponse = 1,
  kError = 2,
  kCancel = 3,
  kRrefControl = 4,
  kAutogradControl = 5,
  kHeartbeat = 6,
  kHandshake = 7,
};

const char* messageKindName(MessageKind kind);

// Longest autograd closure a message may carry (rpc/autograd_hook.h); a sender with more sends none.
inline constexpr size_t kMaxAutogradClosure = 4096;

// Distributed autograd ids carried by messages sent inside a context, and (messages with grad tensors) the
// closure of messages upstream of this one, when the sender knew it (rpc/autograd_hook.h).
struct AutogradIds {
  uint64_t contextId = 0;
  uint64_t messageId = 0;
  bool closureKnown = false;
  std::vector<uint64_t> closure = {};
  // Receiving side: the device map the sender applied to the message (EnvelopeFields::deviceMap); the
  // gradients of its tensors go back with the inverse.
  DeviceMap senderDeviceMap = {};
  friend bool operator==(const AutogradIds&, const AutogradIds&) = default;
};

// The envelope's header: everything but the value tree.
struct EnvelopeFields {
  uint64_t messageId = 0;
  MessageKind kind = MessageKind::kCall;
  std::string functionName;
  uint64_t signatureHash = 0;
  int64_t deadlineUnixMicros = 0;  // 0: no deadline
  int64_t timeoutMicros = 0;       // 0: no timeout
  uint64_t traceId = 0;
  uint64_t spanId = 0;
  std::optional<AutogradIds> autograd;
  std::optional<Error> error;  // set for kind == kError (and only then)
  // Receiving side: the device map the sender applied to the message's CUDA tensors (empty: none). The
  // sending side writes the map of its CodecScope instead.
  DeviceMap deviceMap;
};

// Limits applied to untrusted envelopes (on top of the transport's FrameLimits).
struct DecodeLimits {
  int maxValueDepth = kMaxValueDepth;
  // Cap'n Proto traversal budget per envelope word (each word is normally visited once per walk).
  uint64_t traversalWordsPerEnvelopeWord = 4;
  uint64_t minTraversalWords = 1024;
};

// Writes the message's value tree (may throw CodecError; encodeMessage converts it to an Error).
using EncodeValueFn = std::function<void(wire::Value::Builder, EncodeContext&)>;

// Serialises fields + value into a frame whose payloads are the tensors' bytes in place (their storages
// are held by the SendBuffers). An empty encodeValue writes a null value.
// `scope` (optional) is handed to the codecs (see CodecScope): the agent passes itself and the peer.
Result<transport::OutgoingFrame> encodeMessage(const EnvelopeFields& fields, const EncodeValueFn& encodeValue = {},
                                               const CodecScope* scope = nullptr);

// encodeMessage with `value` encoded by Codec<T>.
template <typename T>
Result<transport::OutgoingFrame> encodeMessageWith(const EnvelopeFields& fields, const T& value) {
  return encodeMessage(fields, [&value](wire::Value::Builder out, EncodeContext& ctx) {
    Codec<std::decay_t<T>>::encode(out, value, ctx);
  });
}

// A call message: the arguments travel as a tuple (a struct with empty field names).
template <typename... Args>
Result<transport::OutgoingFrame> encodeCallIn(const CodecScope* scope, const EnvelopeFields& fields,
                                              const Args&... args) {
  return encodeMessage(
      fields,
      [&](wire::Value::Builder out, EncodeContext& ctx) {
        detail::TupleCodec<std::tuple<std::decay_t<Args>...>, std::decay_t<Args>...>::encode(
            out, std::forward_as_tuple(args...), ctx);
      },
      scope);
}
template <typename... Args>
Result<transport::OutgoingFrame> encodeCall(const EnvelopeFields& fields, const Args&... args) {
  return encodeCallIn(nullptr, fields, args...);
}

// A parsed, validated message. Owns the envelope bytes, the Cap'n Proto reader over them and the
// payload buffers; move-only.
class DecodedMessage {
 public:
  DecodedMessage(DecodedMessage&&) noexcept;
  DecodedMessage& operator=(DecodedMessage&&) noexcept;
  ~DecodedMessage();

  const EnvelopeFields& fields() const;  // decoded once, shared with field views
  MessageKind kind() const { return fields().kind; }
  // The raw value tree (valid while this object lives). Reads through it count against this message's
  // Cap'n Proto traversal budget and may throw kj::Exception; prefer decodeValue, which cannot.
  wire::Value::Reader value() const;
  const std::vector<transport::PayloadBuffer>& payloads() const;
  // Distributed autograd: shape/dtype of the received tensors that require grad, in payload order (empty
  // when none do), and the RecvBackward node they become outputs of when decoded (rpc/autograd_hook.h).
  const std::vector<autograd::TensorMeta>& gradMetas() const;
  void attachRecvNode(std::shared_ptr<autograd::Node> node);

  // Decodes the value as T. Tensors wrap the payload buffers (no copy). May be called more than once
  // (each call wraps the same buffers again).
  template <typename T>
  Result<T> decodeValue() const {
    // A fresh reader per decode, so each decode has the full traversal budget (repeated decodes of one
    // message must not exhaust it), and nothing it throws escapes. The reader lives on withReader's stack
    // (no allocation per decode).
    std::optional<Result<T>> out;
    Result<void> opened = withReader([&](capnp::MessageReader& reader) {
      out.emplace(detail::guard("malformed value", [&]() -> T {
        DecodeContext ctx(payloads(), kMaxValueDepth, scope_);
        T value = Codec<T>::decode(selectValue(reader.getRoot<wire::Envelope>().getValue()), ctx);
        ctx.finish();
        return value;
      }));
    });
    if (!opened.ok()) return opened.error();
    return std::move(*out);
  }
  // Decodes a call's arguments.
  template <typename... Args>
  Result<std::tuple<Args...>> decodeArgs() const {
    return decodeValue<std::tuple<Args...>>();
  }

  // The agent and peer handed to codecs when this message is decoded (see CodecScope); the agent sets it
  // on every message it receives.
  const CodecScope& scope() const { return scope_; }
  // The references the message carries (scope().references) stay: they belong to its bytes.
  void setScope(CodecScope scope) {
    scope.references = std::move(scope_.references);
    scope.cudaWaitOnHost = scope_.cudaWaitOnHost;
    scope_ = std::move(scope);
  }
  // The references this message carries (null when none): the agent binds them to its ReferenceSink.
  const std::shared_ptr<CarriedReferences>& references() const { return scope_.references; }

  // A view of this message (same fields, bytes, payloads and scope) whose value is field `index` of this
  // message's value, which must be a struct (a tuple). Layers above rpc/ wrap a call as (header, arguments)
  // and hand the arguments view to a bound function or method, which decodes it as its own call. Reading a
  // missing field is an Error when decoding, never undefined behaviour.
  DecodedMessage fieldView(uint32_t index) const;

 private:
  friend Result<DecodedMessage> decodeMessage(transport::IncomingFrame frame, const DecodeLimits& limits);
  struct State;
  explicit DecodedMessage(std::shared_ptr<State> state);
  // Opens a fresh reader over the envelope and runs `use` with it (an Error, and `use` not run, when the
  // envelope does not open). `use` must not throw.
  Result<void> withReader(const std::function<void(capnp::MessageReader&)>& use) const;
  // The value this message stands for inside the envelope's value (itself, or the fieldView path). Throws
  // CodecError when a field of the path is missing.
  wire::Value::Reader selectValue(wire::Value::Reader root) const;
  std::shared_ptr<State> state_;  // shared with field views (immutable once decoded), the fields included
  std::vector<uint32_t> fieldPath_;
  CodecScope scope_;
};

// Parses and validates a received frame: the envelope (alignment, Cap'n Proto limits), its kind, the
// payload count, and the whole value tree (depth, union members, every tensor descriptor against its
// payload: index in range and used once, dtype, shape x itemsize == byteLength == payload size).
Result<DecodedMessage> decodeMessage(transport::IncomingFrame frame, const DecodeLimits& limits = {});

// Replaces every payload of `frame` by a private copy in fresh 64-byte aligned CPU storage: value semantics
// for frames whose payloads alias the sender's memory (the inproc transport shares them), so a receiver's
// tensor never changes when the sender later writes its own (a parameter it steps, a value it stores).
void copyPayloads(transport::IncomingFrame& frame);

// A frame this process encoded, received without a transport (calls of an agent to itself, tests): the
// payloads are copied into freshly allocated, 64-byte aligned CPU storage, exactly as a network hop would
// leave them, so the receiver's tensors never alias the sender's (value semantics; the inproc transport
// instead shares them). Then validated and decoded as decodeMessage does.
Result<DecodedMessage> decodeLoopback(transport::OutgoingFrame frame, const DecodeLimits& limits = {});

// The allocator transports call with a frame's envelope and payload sizes: validates as decodeMessage
// does and returns one freshly allocated, 64-byte aligned CPU Storage per payload, exactly its size.
transport::PayloadAllocator makePayloadAllocator(DecodeLimits limits = {});

}  // namespace distgrad::rpc
