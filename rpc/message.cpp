#include "rpc/message.h"

#include "rpc/autograd_hook.h"

#include <algorithm>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/array.h>
#include <kj/io.h>

#include <cstring>
#include <optional>

namespace distgrad::rpc {

const char* messageKindName(MessageKind kind) {
  switch (kind) {
    case MessageKind::kCall: return "call";
    case MessageKind::kResponse: return "response";
    case MessageKind::kError: return "error";
    case MessageKind::kCancel: return "cancel";
    case MessageKind::kRrefControl: return "rrefControl";
    case MessageKind::kAutogradControl: return "autogradControl";
    case MessageKind::kHeartbeat: return "heartbeat";
    case MessageKind::kHandshake: return "handshake";
  }
  return "unknown";
}

namespace {

constexpr unsigned kNumMessageKinds = 8;
constexpr unsigned kNumErrorKinds = 7;

capnp::Text::Reader textOf(const std::string& s) { return capnp::Text::Reader(s.data(), s.size()); }
std::string stringOf(capnp::Text::Reader t) { return std::string(t.begin(), t.size()); }

// A Cap'n Proto reader over envelope bytes. FlatArrayMessageReader needs 8-byte aligned words: an
// unaligned span is copied once into `aligned`.
// The reader lives in place (no allocation of its own); an EnvelopeReader is never moved once opened.
struct EnvelopeReader {
  kj::Array<capnp::word> aligned;
  std::optional<capnp::FlatArrayMessageReader> reader;
};

void openEnvelope(EnvelopeReader& out, std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  if (bytes.empty()) throw CodecError("empty envelope");
  if (bytes.size() % sizeof(capnp::word) != 0) {
    throw CodecError("envelope of " + std::to_string(bytes.size()) + " bytes is not a whole number of 8-byte words");
  }
  const size_t words = bytes.size() / sizeof(capnp::word);
  const capnp::word* begin = reinterpret_cast<const capnp::word*>(bytes.data());
  if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(capnp::word) != 0) {
    out.aligned = kj::heapArray<capnp::word>(words);
    std::memcpy(out.aligned.begin(), bytes.data(), bytes.size());
    begin = out.aligned.begin();
  }
  capnp::ReaderOptions options;
  options.traversalLimitInWords =
      std::max<uint64_t>(limits.minTraversalWords, words * limits.traversalWordsPerEnvelopeWord);
  // Two pointer hops per value level (a list, then the struct in it) plus the envelope's own.
  options.nestingLimit = 2 * limits.maxValueDepth + 8;
  out.reader.emplace(kj::arrayPtr(begin, words), options);
  if (out.reader->getEnd() != begin + words) {
    throw CodecError("envelope has " + std::to_string((begin + words - out.reader->getEnd()) * 8) +
                     " trailing bytes after the message");
  }
}

// The envelope's device map, validated (CodecError naming the bad entry).
DeviceMap readDeviceMap(wire::Envelope::Reader env) {
  DeviceMap map;
  if (!env.hasDeviceMap()) return map;
  auto pairs = env.getDeviceMap();
  if (pairs.size() > static_cast<unsigned>(kMaxCudaDevices)) {
    throw CodecError("device map has " + std::to_string(pairs.size()) + " entries (at most " +
                     std::to_string(kMaxCudaDevices) + ")");
  }
  for (auto pair : pairs) {
    try {
      map.setIndex(pair.getSource(), pair.getTarget(), "the envelope's device map");
    } catch (const ValueError& e) {
      throw CodecError(e.what());
    }
  }
  return map;
}

// Checks everything in the envelope that does not depend on the payloads' contents; payloadSizes are
// the frame's. Throws CodecError or kj::Exception. `gradLayouts` (optional) receives the tensors that
// require grad, in payload order.
void checkEnvelope(wire::Envelope::Reader env, std::span<const uint64_t> payloadSizes, const DecodeLimits& limits,
                   std::vector<detail::TensorLayout>* gradLayouts = nullptr) {
  const auto kind = static_cast<unsigned>(env.getKind());
  if (kind >= kNumMessageKinds) throw CodecError("unknown message kind " + std::to_string(kind));
  if (env.getPayloadCount() != payloadSizes.size()) {
    throw CodecError("envelope declares " + std::to_string(env.getPayloadCount()) + " payloads, the frame has " +
                     std::to_string(payloadSizes.size()));
  }
  (void)env.getFunctionName();
  const auto closure = env.getAutogradClosure();
  if (closure.size() > kMaxAutogradClosure) {
    throw CodecError("autograd closure of " + std::to_string(closure.size()) + " message ids exceeds the limit of " +
                     std::to_string(kMaxAutogradClosure));
  }
  // The carried references (Note [Carried references] in rpc/agent.cpp): read whole here, so the allocator
  // and decodeMessage agree on them.
  for (auto ref : env.getReferences()) {
    (void)ref.getId().getOwnerWorkerId();
    (void)ref.getId().getLocalId();
    (void)ref.getFork();
  }
  // The device map (docs/wire_protocol.md): indices in range, one-to-one. readDeviceMap throws naming the entry.
  (void)readDeviceMap(env);
  if (env.getKind() == wire::Envelope::Kind::ERROR) {
    auto error = env.getError();
    if (static_cast<unsigned>(error.getKind()) >= kNumErrorKinds) {
      throw CodecError("unknown error kind " + std::to_string(static_cast<unsigned>(error.getKind())));
    }
    (void)error.getMessage();
    (void)error.getWorker();
    (void)error.getRemoteType();
  }
  std::vector<bool> referenced(payloadSizes.size(), false);
  auto onTensor = [&](const detail::TensorLayout& layout) {
    if (referenced[layout.payloadIndex]) {
      throw CodecError("tensor payload " + std::to_string(layout.payloadIndex) + " is referenced twice");
    }
    referenced[layout.payloadIndex] = true;
    if (layout.requiresGrad) {
      if (!env.getHasAutogradContext()) {
        throw CodecError("tensor payload " + std::to_string(layout.payloadIndex) +
                         " requires grad but the message belongs to no autograd context");
      }
      if (gradLayouts) gradLayouts->push_back(layout);
    }
    if (payloadSizes[layout.payloadIndex] != layout.byteLength) {
      throw CodecError("tensor payload " + std::to_string(layout.payloadIndex) + " has " +
                       std::to_string(payloadSizes[layout.payloadIndex]) + " bytes, its descriptor says " +
                       std::to_string(layout.byteLength));
    }
  };
  detail::walkValue(env.getValue(), payloadSizes.size(), 0, limits.maxValueDepth, onTensor);
  for (size_t i = 0; i < referenced.size(); ++i) {
    if (!referenced[i]) throw CodecError("payload " + std::to_string(i) + " is not referenced by any tensor");
  }
}

// The autograd closure fields of an envelope (rpc/autograd_hook.h); nothing when the closure is unknown.
void setClosure(wire::Envelope::Builder env, bool known, const std::vector<uint64_t>& ids) {
  if (!known) return;
  DG_CHECK(ids.size() <= kMaxAutogradClosure, "autograd closure of ", ids.size(), " ids exceeds the limit of ",
           kMaxAutogradClosure);
  env.setAutogradClosureKnown(true);
  auto closure = env.initAutogradClosure(static_cast<uint32_t>(ids.size()));
  for (uint32_t i = 0; i < ids.size(); ++i) closure.set(i, ids[i]);
}

// The calling thread's first segment for encodeMessage (see there); taken() is false when a caller further
// up this thread's stack holds it.
class ScratchSegment {
 public:
  ScratchSegment() : taken_(!tInUse) { tInUse = true; }
  ~ScratchSegment() {
    if (taken_) tInUse = false;
  }
  ScratchSegment(const ScratchSegment&) = delete;
  ScratchSegment& operator=(const ScratchSegment&) = delete;
  bool taken() const { return taken_; }
  kj::ArrayPtr<capnp::word> words() const { return kj::arrayPtr(tWords, kWords); }

 private:
  static constexpr size_t kWords = 512;  // 4 KiB: a call's envelope is ~100-200 bytes
  static thread_local bool tInUse;
  alignas(64) static thread_local capnp::word tWords[kWords];  // zero-initialised, kept zero between uses
  bool taken_;
};
thread_local bool ScratchSegment::tInUse = false;
alignas(64) thread_local capnp::word ScratchSegment::tWords[ScratchSegment::kWords] = {};

}  // namespace

Result<transport::OutgoingFrame> encodeMessage(const EnvelopeFields& fields, const EncodeValueFn& encodeValue,
                                               const CodecScope* scope) {
  return detail::guard("cannot encode message", [&] {
    DG_CHECK((fields.kind == MessageKind::kError) == fields.error.has_value(),
             "encodeMessage: an error message needs EnvelopeFields::error and no other kind may carry one (kind ",
             messageKindName(fields.kind), ")");
    // Small envelopes (every no-op call and reply) are built in this thread's zeroed scratch segment
    // instead of a fresh calloc'ed 8 KiB one per message; the builder zeroes what it used when it dies, and
    // bigger messages continue in heap segments. A nested encode on this thread (a codec encoding another
    // message) gets a heap segment: the scratch is in use.
    ScratchSegment scratch;
    std::optional<capnp::MallocMessageBuilder> storage;
    if (scratch.taken()) {
      storage.emplace(scratch.words());
    } else {
      storage.emplace();
    }
    capnp::MallocMessageBuilder& builder = *storage;
    auto env = builder.initRoot<wire::Envelope>();
    env.setMessageId(fields.messageId);
    env.setKind(static_cast<wire::Envelope::Kind>(fields.kind));
    env.setFunctionName(textOf(fields.functionName));
    env.setSignatureHash(fields.signatureHash);
    env.setDeadlineUnixMicros(fields.deadlineUnixMicros);
    env.setTimeoutMicros(fields.timeoutMicros);
    env.setTraceId(fields.traceId);
    env.setSpanId(fields.spanId);
    if (fields.autograd) {
      env.setHasAutogradContext(true);
      env.setAutogradContextId(fields.autograd->contextId);
      env.setAutogradMessageId(fields.autograd->messageId);
      setClosure(env, fields.autograd->closureKnown, fields.autograd->closure);
    }
    if (fields.error) {
      auto error = env.initError();
      error.setKind(static_cast<wire::ErrorInfo::ErrorKind>(fields.error->kind));
      error.setMessage(textOf(fields.error->message));
      error.setWorker(textOf(fields.error->worker));
      error.setRemoteType(textOf(fields.error->remoteType));
    }
    if (scope != nullptr && scope->deviceMap && !scope->deviceMap->empty()) {
      // The map this message's CUDA tensors were sent with: the receiver answers with its inverse.
      auto pairs = env.initDeviceMap(static_cast<unsigned>(scope->deviceMap->size()));
      unsigned i = 0;
      for (const auto& [from, to] : scope->deviceMap->entries()) {
        pairs[i].setSource(static_cast<int16_t>(from));
        pairs[i].setTarget(static_cast<int16_t>(to));
        ++i;
      }
    }
    EncodeContext ctx(scope != nullptr ? *scope : CodecScope{});
    auto value = env.initValue();
    try {
      if (encodeValue) {
        encodeValue(value, ctx);
      } else {
        value.setNull();
      }
    } catch (...) {
      // References already written registered forks at the sender for a message that will not leave.
      ctx.abandon();
      throw;
    }
    if (!ctx.references().empty()) {
      auto refs = env.initReferences(static_cast<unsigned>(ctx.references().size()));
      for (size_t i = 0; i < ctx.references().size(); ++i) {
        const CarriedReference& ref = ctx.references()[i];
        auto out = refs[static_cast<unsigned>(i)];
        out.initId().setOwnerWorkerId(ref.id.ownerWorkerId);
        out.getId().setLocalId(ref.id.localId);
        out.setFork(ref.fork);
      }
    }
    if (scope != nullptr && scope->autogradHook != nullptr && scope->autogradContext != 0) {
      // Distributed autograd (rpc/autograd_hook.h): the hook records the send (and its grad tensors).
      DG_ASSERT(!fields.autograd, "a message with explicit autograd ids was encoded inside a context");
      const AutogradSend sent = scope->autogradHook->onSend(scope->autogradContext, scope->peer, ctx.gradTensors());
      if (sent.messageId != 0) {
        env.setHasAutogradContext(true);
        env.setAutogradContextId(scope->autogradContext);
        env.setAutogradMessageId(sent.messageId);
        setClosure(env, sent.closureKnown, sent.closure);
      }
    }
    transport::OutgoingFrame frame;
    frame.payloads = ctx.takePayloads();
    env.setPayloadCount(static_cast<uint32_t>(frame.payloads.size()));
    // Serialise straight into the frame's buffer (one copy of the envelope, none of the payloads).
    const size_t words = capnp::computeSerializedSizeInWords(builder);
    frame.envelope.resize(words * sizeof(capnp::word));
    kj::ArrayOutputStream stream(kj::arrayPtr(frame.envelope.data(), frame.envelope.size()));
    capnp::writeMessage(stream, builder);
    DG_ASSERT(stream.getArray().size() == frame.envelope.size(), "envelope size mismatch");
    return frame;
  });
}

struct DecodedMessage::State {
  EnvelopeFields fields;
  std::vector<uint8_t> envelopeBytes;
  EnvelopeReader envelope;
  std::vector<transport::PayloadBuffer> payloads;
  DecodeLimits limits;
  // Distributed autograd: the received tensors that require grad (payload order) and, per payload, its
  // index among them (-1: none); null when there are none.
  std::vector<autograd::TensorMeta> gradMetas;
  std::shared_ptr<const std::vector<int32_t>> gradIndexOfPayload;
};

DecodedMessage::DecodedMessage(std::shared_ptr<State> state) : state_(std::move(state)) {}
DecodedMessage::DecodedMessage(DecodedMessage&&) noexcept = default;
DecodedMessage& DecodedMessage::operator=(DecodedMessage&&) noexcept = default;
DecodedMessage::~DecodedMessage() = default;

// In the shared state, not a member: a message is moved several times on its way to its handler, and every
// move moved every field (strings, the error, the autograd ids); field views copied them.
const EnvelopeFields& DecodedMessage::fields() const { return state_->fields; }

wire::Value::Reader DecodedMessage::value() const {
  return selectValue(state_->envelope.reader->getRoot<wire::Envelope>().getValue());
}

wire::Value::Reader DecodedMessage::selectValue(wire::Value::Reader root) const {
  for (uint32_t index : fieldPath_) {
    if (!root.isStruct()) detail::throwKindMismatch("struct", root);
    auto fields = root.getStruct();
    if (index >= fields.size()) {
      throw CodecError("expected a struct with at least " + std::to_string(index + 1) + " fields, got " +
                       std::to_string(fields.size()));
    }
    root = fields[index].getValue();
  }
  return root;
}

DecodedMessage DecodedMessage::fieldView(uint32_t index) const {
  DecodedMessage view(state_);
  view.fieldPath_ = fieldPath_;
  view.fieldPath_.push_back(index);
  view.scope_ = scope_;
  return view;
}

Result<void> DecodedMessage::withReader(const std::function<void(capnp::MessageReader&)>& use) const {
  EnvelopeReader reader;  // in place: no allocation (an unaligned envelope gets its aligned copy inside)
  Result<void> opened =
      detail::guard("malformed message", [&] { openEnvelope(reader, state_->envelopeBytes, state_->limits); });
  if (opened.ok()) use(*reader.reader);
  return opened;
}

const std::vector<transport::PayloadBuffer>& DecodedMessage::payloads() const { return state_->payloads; }

const std::vector<autograd::TensorMeta>& DecodedMessage::gradMetas() const { return state_->gradMetas; }

void DecodedMessage::attachRecvNode(std::shared_ptr<autograd::Node> node) {
  scope_.recvNode = std::move(node);
  scope_.gradIndexOfPayload = scope_.recvNode ? state_->gradIndexOfPayload : nullptr;
}

Result<DecodedMessage> decodeMessage(transport::IncomingFrame frame, const DecodeLimits& limits) {
  return detail::guard("malformed message", [&] {
    auto state = std::make_shared<DecodedMessage::State>();
    state->envelopeBytes = std::move(frame.envelope);
    state->payloads = std::move(frame.payloads);
    state->limits = limits;
    openEnvelope(state->envelope, state->envelopeBytes, limits);
    auto env = state->envelope.reader->getRoot<wire::Envelope>();
    std::vector<uint64_t> sizes;
    sizes.reserve(state->payloads.size());
    for (const auto& payload : state->payloads) {
      if (payload.size > 0 && payload.data == nullptr) throw CodecError("payload without memory");
      sizes.push_back(payload.size);
    }
    std::vector<detail::TensorLayout> gradLayouts;
    checkEnvelope(env, sizes, limits, &gradLayouts);
    if (!gradLayouts.empty()) {
      std::sort(gradLayouts.begin(), gradLayouts.end(),
                [](const auto& a, const auto& b) { return a.payloadIndex < b.payloadIndex; });
      auto index = std::make_shared<std::vector<int32_t>>(state->payloads.size(), -1);
      for (size_t i = 0; i < gradLayouts.size(); ++i) {
        (*index)[gradLayouts[i].payloadIndex] = static_cast<int32_t>(i);
        state->gradMetas.push_back(autograd::TensorMeta{gradLayouts[i].shape, gradLayouts[i].dtype, gradLayouts[i].device});
      }
      state->gradIndexOfPayload = std::move(index);
    }

    EnvelopeFields& fields = state->fields;
    fields.messageId = env.getMessageId();
    fields.kind = static_cast<MessageKind>(env.getKind());
    fields.functionName = stringOf(env.getFunctionName());
    fields.signatureHash = env.getSignatureHash();
    fields.deadlineUnixMicros = env.getDeadlineUnixMicros();
    fields.timeoutMicros = env.getTimeoutMicros();
    fields.traceId = env.getTraceId();
    fields.spanId = env.getSpanId();
    fields.deviceMap = readDeviceMap(env);
    if (env.getHasAutogradContext()) {
      fields.autograd = AutogradIds{env.getAutogradContextId(), env.getAutogradMessageId(), false, {}};
      auto closure = env.getAutogradClosure();  // its size was checked by checkEnvelope
      fields.autograd->closureKnown = env.getAutogradClosureKnown();
      fields.autograd->closure.reserve(closure.size());
      for (uint64_t id : closure) fields.autograd->closure.push_back(id);
      fields.autograd->senderDeviceMap = fields.deviceMap;
    }
    if (fields.kind == MessageKind::kError) {
      auto error = env.getError();
      fields.error = Error{static_cast<ErrorKind>(error.getKind()), stringOf(error.getMessage()),
                           stringOf(error.getWorker()), stringOf(error.getRemoteType())};
    }
    std::shared_ptr<CarriedReferences> references;
    if (env.hasReferences() && env.getReferences().size() > 0) {
      std::vector<CarriedReference> refs;
      refs.reserve(env.getReferences().size());
      for (auto ref : env.getReferences()) {
        refs.push_back(CarriedReference{RRefId{ref.getId().getOwnerWorkerId(), ref.getId().getLocalId()}, ref.getFork()});
      }
      references = std::make_shared<CarriedReferences>(std::move(refs));
    }
    const bool call = fields.kind == MessageKind::kCall;
    DecodedMessage message(std::move(state));
    message.scope_.references = std::move(references);
    // Note [Received CUDA tensors] (rpc/codec.cpp): a call's arguments are decoded on the thread that runs
    // its handler, which then waits for their copies in stream order; anything else waits on the host.
    message.scope_.cudaWaitOnHost = !call;
    return message;
  });
}

void copyPayloads(transport::IncomingFrame& frame) {
  for (auto& payload : frame.payloads) {
    auto storage = std::make_shared<tensor::Storage>(tensor::Storage::allocate(payload.size));
    if (payload.size > 0) std::memcpy(storage->data(), payload.data, payload.size);
    payload = transport::PayloadBuffer{storage->data(), payload.size, storage};
  }
}

Result<DecodedMessage> decodeLoopback(transport::OutgoingFrame frame, const DecodeLimits& limits) {
  transport::IncomingFrame incoming;
  incoming.flags = frame.flags;
  incoming.envelope = std::move(frame.envelope);
  incoming.payloads.reserve(frame.payloads.size());
  for (const auto& buffer : frame.payloads) {
    incoming.payloads.push_back(
        transport::PayloadBuffer{const_cast<void*>(buffer.data), buffer.size, std::const_pointer_cast<void>(buffer.owner)});
  }
  copyPayloads(incoming);
  frame.payloads.clear();  // the sender's buffers are no longer needed
  return decodeMessage(std::move(incoming), limits);
}

transport::PayloadAllocator makePayloadAllocator(DecodeLimits limits) {
  return [limits](std::span<const uint8_t> envelope,
                  std::span<const uint64_t> sizes) -> Result<std::vector<transport::PayloadBuffer>> {
    return detail::guard("malformed message", [&] {
      EnvelopeReader reader;
      openEnvelope(reader, envelope, limits);
      checkEnvelope(reader.reader->getRoot<wire::Envelope>(), sizes, limits);
      std::vector<transport::PayloadBuffer> buffers;
      buffers.reserve(sizes.size());
      for (uint64_t size : sizes) {
        // Sizes were checked against the descriptors and (by the transport) against FrameLimits.
        auto storage = std::make_shared<tensor::Storage>(tensor::Storage::allocate(static_cast<size_t>(size)));
        buffers.push_back(transport::PayloadBuffer{storage->data(), static_cast<size_t>(size), storage});
      }
      return buffers;
    });
  };
}

}  // namespace distgrad::rpc
