#include "rpc/codec.h"

#include <cmath>
#include <cstring>

#include "autograd/grad_mode.h"
#include "rpc/agent.h"
#include "tensor/cuda/pinned.h"
#include "tensor/cuda/runtime.h"

namespace distgrad::rpc {

namespace {

// Note [Compacting views]: a tensor goes on the wire as one contiguous payload. A non-contiguous view is
// copied into a contiguous buffer first; so is a contiguous view that covers less than half of its
// storage, so that sending a slice of a large buffer never pins (or, on transports that read whole
// storages, ships) the rest of it.
bool needsCompaction(const Tensor& t) {
  if (!t.isContiguous()) return true;
  return t.nbytes() * 2 < t.storage().nbytes();
}

std::string shapeText(capnp::List<int64_t>::Reader shape) {
  std::string out = "[";
  for (uint32_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// "worker 'name'" of the agent a codec runs in, or "this process" outside one (tests, tools).
std::string selfName(const CodecScope& scope) {
  return scope.agent != nullptr ? "worker '" + scope.agent->name() + "'" : std::string("this process");
}

std::string peerName(const CodecScope& scope) {
  return scope.peer.empty() ? std::string("the receiver") : "worker '" + scope.peer + "'";
}

// Note [Received CUDA tensors]
// A received CUDA tensor's bytes arrive in host memory (the frame's payload). The decoder allocates the
// tensor on the target device and copies host -> pinned -> device on a stream from the device's pool,
// which first waits for the decoding thread's current stream (so memory the caching allocator hands out in
// that stream's order is not written early). Then:
//   - a call's arguments (CodecScope::cudaWaitOnHost false) are decoded on the executor thread that runs
//     the handler: the thread's current stream waits for the copy's event, so the handler's work, queued
//     on its current stream, runs after the copy (no host wait; the receiver's computation waits on the
//     copy, which waited on the sender's event);
//   - everything else (replies, decoded on a transport thread and consumed by whoever waits on the future,
//     on streams the decoder cannot know) waits on the host for the copy's event before it is handed out.
//     That adds at most the DMA of the last chunks: the host copies into pinned memory, which run on the
//     same thread first, take longer than the DMA they overlap with.
// Never a device-wide synchronisation.
Tensor receiveCudaTensor(const transport::PayloadBuffer& payload, const detail::TensorLayout& layout,
                         const CodecScope& scope) {
  const int device = layout.device.index;
  const int available = tensor::cuda::deviceCount();
  if (device >= available) {
    throw CodecError("tensor payload " + std::to_string(layout.payloadIndex) + " targets cuda:" +
                     std::to_string(device) + " but " + selfName(scope) + " has " + std::to_string(available) +
                     " CUDA device(s)" + (available == 0 ? " (no GPU, no driver, or built without CUDA)" : "") +
                     ": fix the sender's device map");
  }
  tensor::Storage storage = tensor::Storage::allocate(payload.size, layout.device);
  if (payload.size > 0) {
    const tensor::cuda::Stream current = tensor::cuda::Stream::current(device);
    const tensor::cuda::Stream copyStream = tensor::cuda::Stream::fromPool(device);
    tensor::cuda::Event allocated;
    allocated.record(current);
    allocated.block(copyStream);
    tensor::cuda::copyHostToDeviceStaged(storage.data(), payload.data, payload.size, copyStream);
    tensor::cuda::Event copied;
    copied.record(copyStream);
    if (scope.cudaWaitOnHost) {
      copied.synchronize();
    } else {
      copied.block(current);
    }
  }
  return Tensor::fromStorage(std::move(storage), layout.shape, tensor::contiguousStrides(layout.shape), 0,
                             layout.dtype);
}

}  // namespace

EncodeContext::EncodeContext(CodecScope scope)
    : recordsGrad_(scope.autogradHook != nullptr && scope.autogradContext != 0 && autograd::isGradEnabled()),
      scope_(std::move(scope)) {}

uint32_t EncodeContext::addPayload(transport::SendBuffer buffer) {
  payloads_.push_back(std::move(buffer));
  return static_cast<uint32_t>(payloads_.size() - 1);
}

void EncodeContext::addReference(CarriedReference ref, std::function<void()> abandon) {
  references_.push_back(ref);
  if (abandon) abandons_.push_back(std::move(abandon));
}

void EncodeContext::abandon() {
  auto abandons = std::move(abandons_);
  abandons_.clear();
  for (auto& undo : abandons) {
    try {
      undo();
    } catch (const std::exception&) {
      // Undoing is best effort (the agent may be closing); the encode error is what the caller sees.
    }
  }
}

CarriedReferences::CarriedReferences(std::vector<CarriedReference> refs)
    : refs_(std::move(refs)), claimed_(refs_.size(), false) {}

CarriedReferences::~CarriedReferences() {
  if (!sink_) return;
  std::vector<CarriedReference> unclaimed;
  for (size_t i = 0; i < refs_.size(); ++i) {
    if (!claimed_[i]) unclaimed.push_back(refs_[i]);
  }
  if (unclaimed.empty()) return;
  try {
    sink_->onUnclaimedReferences(peer_, std::move(unclaimed));
  } catch (const std::exception&) {
    // A destructor must not throw; the sink reports its own failures.
  }
}

bool CarriedReferences::claim(uint64_t fork) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < refs_.size(); ++i) {
    if (refs_[i].fork == fork) {
      if (claimed_[i]) return false;
      claimed_[i] = true;
      return true;
    }
  }
  return false;
}

void CarriedReferences::bind(std::shared_ptr<ReferenceSink> sink, std::string peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  sink_ = std::move(sink);
  peer_ = std::move(peer);
}

void EncodeContext::enter() {
  if (++depth_ > kMaxValueDepth) {
    --depth_;
    throw CodecError("value nested deeper than " + std::to_string(kMaxValueDepth) + " levels");
  }
}

DecodeContext::DecodeContext(std::span<const transport::PayloadBuffer> payloads, int maxDepth, CodecScope scope)
    : payloads_(payloads), used_(payloads.size(), false), maxDepth_(maxDepth), scope_(std::move(scope)) {}

void DecodeContext::enter() {
  if (++depth_ > maxDepth_) {
    --depth_;
    throw CodecError("value tree nested deeper than " + std::to_string(maxDepth_) + " levels");
  }
}

Tensor DecodeContext::takeTensor(wire::TensorDesc::Reader desc) {
  detail::TensorLayout layout = detail::checkTensorDesc(desc, payloads_.size());
  if (used_[layout.payloadIndex]) {
    throw CodecError("tensor payload " + std::to_string(layout.payloadIndex) + " is referenced twice");
  }
  const transport::PayloadBuffer& payload = payloads_[layout.payloadIndex];
  if (payload.size != layout.byteLength) {
    throw CodecError("tensor payload " + std::to_string(layout.payloadIndex) + " has " +
                     std::to_string(payload.size) + " bytes, its descriptor says " +
                     std::to_string(layout.byteLength));
  }
  if (payload.size > 0 && payload.data == nullptr) {
    throw CodecError("tensor payload " + std::to_string(layout.payloadIndex) + " has no memory");
  }
  used_[layout.payloadIndex] = true;
  Tensor out;
  if (layout.device.isCuda()) {
    out = receiveCudaTensor(payload, layout, scope_);
  } else {
    const size_t item = tensor::itemSize(layout.dtype);
    tensor::Storage storage;
    if (reinterpret_cast<uintptr_t>(payload.data) % item == 0) {
      // Zero copy: the tensor's storage is the received buffer; the deleter holds the buffer's owner.
      storage = tensor::Storage::wrap(payload.data, payload.size, Device::cpu(),
                                      [owner = payload.owner](void*) mutable { owner.reset(); });
    } else {
      // Only a misaligned in-process buffer lands here (transports allocate 64-byte aligned payloads):
      // element access needs natural alignment, so copy once.
      storage = tensor::Storage::allocate(payload.size);
      if (payload.size > 0) std::memcpy(storage.data(), payload.data, payload.size);
    }
    Shape strides = tensor::contiguousStrides(layout.shape);
    out = Tensor::fromStorage(std::move(storage), layout.shape, strides, 0, layout.dtype);
  }
  if (layout.requiresGrad && scope_.recvNode && scope_.gradIndexOfPayload) {
    // Distributed autograd: the tensor is an output of the message's RecvBackward node (rpc/autograd_hook.h).
    const int32_t output = scope_.gradIndexOfPayload->at(layout.payloadIndex);
    DG_ASSERT(output >= 0, "payload ", layout.payloadIndex, " requires grad but has no RecvBackward output");
    auto& meta = out.ensureAutogradMeta();
    meta.requiresGrad = true;
    meta.gradFn = scope_.recvNode;
    meta.outputNr = static_cast<uint32_t>(output);
    scope_.recvNode->outputs().at(static_cast<size_t>(output)) = out.implPtr();
  }
  return out;
}

void DecodeContext::finish() const {
  for (size_t i = 0; i < used_.size(); ++i) {
    if (!used_[i]) throw CodecError("payload " + std::to_string(i) + " is not referenced by any tensor");
  }
}

float Codec<float>::decode(wire::Value::Reader in, DecodeContext&) {
  if (!in.isFloat64()) detail::throwKindMismatch("f32", in);
  double v = in.getFloat64();
  // Converting a finite double outside float's range is undefined behaviour.
  if (std::isfinite(v) && std::fabs(v) > static_cast<double>(std::numeric_limits<float>::max())) {
    throw CodecError("float64 " + std::to_string(v) + " does not fit in f32");
  }
  return static_cast<float>(v);
}

namespace detail {

const char* valueKindName(wire::Value::Which which) {
  switch (which) {
    case wire::Value::NULL_: return "null";
    case wire::Value::BOOL: return "bool";
    case wire::Value::INT64: return "int64";
    case wire::Value::UINT64: return "uint64";
    case wire::Value::FLOAT64: return "float64";
    case wire::Value::TEXT: return "text";
    case wire::Value::DATA: return "data";
    case wire::Value::LIST: return "list";
    case wire::Value::MAP: return "map";
    case wire::Value::STRUCT: return "struct";
    case wire::Value::OPTIONAL: return "optional";
    case wire::Value::TENSOR: return "tensor";
    case wire::Value::RREF_ID: return "rrefId";
  }
  return "unknown";
}

void throwKindMismatch(const std::string& expected, wire::Value::Reader value) {
  throw CodecError("expected " + expected + ", got a " + valueKindName(value.which()) + " value");
}

uint32_t checkedListSize(size_t n) {
  if (n > (1u << 29) - 1) throw CodecError("a list of " + std::to_string(n) + " elements is too long for the wire");
  return static_cast<uint32_t>(n);
}

namespace {

void writeDescriptor(wire::TensorDesc::Builder desc, const Tensor& src, Device target, uint32_t payloadIndex) {
  desc.setDtype(static_cast<uint8_t>(src.dtype()));
  const Shape& shape = src.shape();
  auto shapeOut = desc.initShape(checkedListSize(shape.size()));
  auto stridesOut = desc.initStrides(checkedListSize(shape.size()));
  Shape strides = tensor::contiguousStrides(shape);
  for (size_t i = 0; i < shape.size(); ++i) {
    shapeOut.set(static_cast<uint32_t>(i), shape[i]);
    stridesOut.set(static_cast<uint32_t>(i), strides[i]);
  }
  desc.setDeviceType(static_cast<uint8_t>(target.type));
  desc.setDeviceIndex(target.isCpu() ? int16_t{-1} : target.index);
  desc.setByteLength(src.nbytes());
  desc.setPayloadIndex(payloadIndex);
}

// A CUDA tensor: its device goes through the scope's device map (refused without an entry), its bytes are
// staged into a host payload (tensor/cuda/pinned.h: chunked through pinned memory, after the work queued
// on the tensor's current stream). Note [Received CUDA tensors] has the receiving side.
void encodeCudaTensor(wire::Value::Builder out, const Tensor& tensor, EncodeContext& ctx) {
  const CodecScope& scope = ctx.scope();
  const int device = tensor.device().index;
  const std::optional<int> target = scope.deviceMap ? scope.deviceMap->target(device) : std::nullopt;
  if (!target) {
    throw CodecError("cannot send a tensor on " + tensor.device().str() + " to " + peerName(scope) +
                     ": the device map for it has no entry for " + tensor.device().str() + " (map " +
                     (scope.deviceMap ? scope.deviceMap->str() : std::string("{}")) +
                     "); set Options::deviceMaps[\"" + scope.peer + "\"] or CallOptions::deviceMap (a reply uses "
                     "the inverse of its call's map), or move the tensor to the CPU first");
  }
  if (scope.agent != nullptr && !scope.peer.empty()) {
    const std::optional<int> peerDevices = scope.agent->peerCudaDevices(scope.peer);
    if (peerDevices && *target >= *peerDevices) {
      throw CodecError("cannot send a tensor on " + tensor.device().str() + " to " + peerName(scope) +
                       ": the device map sends it to cuda:" + std::to_string(*target) + " but " + scope.peer +
                       " has " + std::to_string(*peerDevices) + " CUDA device(s)");
    }
  }
  // The payload is contiguous; a view is made contiguous on the device first (a device-side copy).
  Tensor src = tensor.isContiguous() ? tensor : tensor.cloneData();
  const size_t nbytes = src.nbytes();
  tensor::Storage staged = tensor::Storage::allocate(nbytes);
  if (nbytes > 0) {
    tensor::cuda::copyDeviceToHostStaged(staged.data(), src.rawData(), nbytes, tensor::cuda::Stream::current(device));
  }
  auto desc = out.initTensor();
  auto owner = std::make_shared<const tensor::Storage>(staged);
  const uint32_t index = ctx.addPayload(transport::SendBuffer{nbytes > 0 ? staged.data() : nullptr, nbytes, owner});
  writeDescriptor(desc, src, Device::cuda(*target), index);
  if (ctx.recordsGrad() && tensor.requiresGrad() && tensor::isFloatingPoint(tensor.dtype())) {
    desc.setRequiresGrad(true);
    ctx.addGradTensor(tensor);
  }
}

}  // namespace

void encodeTensor(wire::Value::Builder out, const Tensor& tensor, EncodeContext& ctx) {
  if (!tensor.defined()) {
    out.setNull();
    return;
  }
  if (tensor.device().isCuda()) {
    encodeCudaTensor(out, tensor, ctx);
    return;
  }
  DG_ASSERT(tensor.device().isCpu(), "encodeTensor: unknown device ", tensor.device().str());
  Tensor src = needsCompaction(tensor) ? tensor.cloneData() : tensor;
  const size_t nbytes = src.nbytes();
  auto desc = out.initTensor();
  // The SendBuffer's owner keeps the storage alive until the transport is done with the bytes.
  auto owner = std::make_shared<const tensor::Storage>(src.storage());
  const uint32_t index =
      ctx.addPayload(transport::SendBuffer{nbytes > 0 ? src.rawData() : nullptr, nbytes, owner});
  writeDescriptor(desc, src, Device::cpu(), index);
  if (ctx.recordsGrad() && tensor.requiresGrad() && tensor::isFloatingPoint(tensor.dtype())) {
    // The edge of the SendBackward node goes to the caller's tensor (not the compacted copy).
    desc.setRequiresGrad(true);
    ctx.addGradTensor(tensor);
  }
}

TensorLayout checkTensorDesc(wire::TensorDesc::Reader desc, size_t payloadCount) {
  TensorLayout layout;
  const unsigned dtypeCode = desc.getDtype();
  if (dtypeCode >= static_cast<unsigned>(tensor::kNumDTypes)) {
    throw CodecError("tensor descriptor has unknown dtype code " + std::to_string(dtypeCode));
  }
  layout.dtype = static_cast<DType>(dtypeCode);
  const int deviceIndex = desc.getDeviceIndex();
  if (desc.getDeviceType() == static_cast<uint8_t>(tensor::DeviceType::kCPU)) {
    // -1 is what senders write; 0 is Cap'n Proto's default for a writer that leaves the field unset.
    if (deviceIndex != -1 && deviceIndex != 0) {
      throw CodecError("tensor descriptor names cpu with device index " + std::to_string(deviceIndex) +
                       " (expected -1)");
    }
    layout.device = Device::cpu();
  } else if (desc.getDeviceType() == static_cast<uint8_t>(tensor::DeviceType::kCUDA)) {
    if (deviceIndex < 0 || deviceIndex >= kMaxCudaDevices) {
      throw CodecError("tensor descriptor names CUDA device index " + std::to_string(deviceIndex) + " (expected [0, " +
                       std::to_string(kMaxCudaDevices) + "))");
    }
    layout.device = Device::cuda(deviceIndex);
  } else {
    throw CodecError("tensor descriptor names unknown device type " + std::to_string(desc.getDeviceType()) +
                     " (expected 0 = cpu or 1 = cuda)");
  }
  auto shape = desc.getShape();
  auto strides = desc.getStrides();
  if (shape.size() > 64) {
    throw CodecError("tensor descriptor has " + std::to_string(shape.size()) + " dimensions (at most 64)");
  }
  if (strides.size() != shape.size()) {
    throw CodecError("tensor descriptor has " + std::to_string(strides.size()) + " strides for " +
                     std::to_string(shape.size()) + " dimensions");
  }
  // Product of the shape times the item size, overflow-checked. Zero dimensions are left out of the
  // check's product so that no later stride or numel computation over this shape can overflow either.
  uint64_t nonzeroBytes = tensor::itemSize(layout.dtype);
  bool hasZero = false;
  layout.shape.resize(shape.size());
  for (uint32_t i = 0; i < shape.size(); ++i) {
    const int64_t dim = shape[i];
    if (dim < 0) throw CodecError("tensor descriptor has a negative dimension in shape " + shapeText(shape));
    layout.shape[i] = dim;
    if (dim == 0) {
      hasZero = true;
      continue;
    }
    if (__builtin_mul_overflow(nonzeroBytes, static_cast<uint64_t>(dim), &nonzeroBytes) ||
        nonzeroBytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw CodecError("tensor descriptor shape " + shapeText(shape) + " overflows its byte size");
    }
  }
  const uint64_t bytes = hasZero ? 0 : nonzeroBytes;
  if (bytes != desc.getByteLength()) {
    throw CodecError("tensor descriptor shape " + shapeText(shape) + " x " + std::to_string(tensor::itemSize(layout.dtype)) +
                     " bytes (" + dtypeName(layout.dtype) + ") = " + std::to_string(bytes) + " bytes, but byteLength is " +
                     std::to_string(desc.getByteLength()));
  }
  Shape contiguous = tensor::contiguousStrides(layout.shape);
  for (uint32_t i = 0; i < strides.size(); ++i) {
    // Size-1 dimensions may carry any stride; every other stride must be the contiguous one.
    if (layout.shape[i] != 1 && strides[i] != contiguous[i]) {
      throw CodecError("tensor descriptor strides are not contiguous for shape " + shapeText(shape));
    }
  }
  if (desc.getPayloadIndex() >= payloadCount) {
    throw CodecError("tensor descriptor references payload " + std::to_string(desc.getPayloadIndex()) + " of " +
                     std::to_string(payloadCount));
  }
  layout.payloadIndex = desc.getPayloadIndex();
  layout.byteLength = bytes;
  layout.requiresGrad = desc.getRequiresGrad();
  if (layout.requiresGrad && !tensor::isFloatingPoint(layout.dtype)) {
    throw CodecError(std::string("tensor descriptor requires grad for dtype ") + dtypeName(layout.dtype) +
                     " (only floating-point tensors carry gradients)");
  }
  return layout;
}

}  // namespace detail

}  // namespace distgrad::rpc
