#include "rpc/codec.h"

#include <cmath>
#include <cstring>

#include "autograd/grad_mode.h"

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
  Tensor out = Tensor::fromStorage(std::move(storage), layout.shape, strides, 0, layout.dtype);
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

void encodeTensor(wire::Value::Builder out, const Tensor& tensor, EncodeContext& ctx) {
  if (!tensor.defined()) {
    out.setNull();
    return;
  }
  if (!tensor.device().isCpu()) {
    // TODO(cuda): send CUDA tensors (staged through pinned memory or read by the transport directly).
    throw CodecError("cannot send a tensor on " + tensor.device().str() +
                     ": only CPU tensors travel over RPC for now; move it with .to(Device::cpu())");
  }
  Tensor src = needsCompaction(tensor) ? tensor.cloneData() : tensor;
  const size_t nbytes = src.nbytes();
  auto desc = out.initTensor();
  desc.setDtype(static_cast<uint8_t>(src.dtype()));
  const Shape& shape = src.shape();
  auto shapeOut = desc.initShape(checkedListSize(shape.size()));
  auto stridesOut = desc.initStrides(checkedListSize(shape.size()));
  Shape strides = tensor::contiguousStrides(shape);
  for (size_t i = 0; i < shape.size(); ++i) {
    shapeOut.set(static_cast<uint32_t>(i), shape[i]);
    stridesOut.set(static_cast<uint32_t>(i), strides[i]);
  }
  desc.setDeviceType(static_cast<uint8_t>(tensor::DeviceType::kCPU));
  desc.setDeviceIndex(-1);
  desc.setByteLength(nbytes);
  if (ctx.recordsGrad() && tensor.requiresGrad() && tensor::isFloatingPoint(tensor.dtype())) {
    // The edge of the SendBackward node goes to the caller's tensor (not the compacted copy).
    desc.setRequiresGrad(true);
    ctx.addGradTensor(tensor);
  }
  // The SendBuffer's owner keeps the storage alive until the transport is done with the bytes.
  auto owner = std::make_shared<const tensor::Storage>(src.storage());
  desc.setPayloadIndex(ctx.addPayload(transport::SendBuffer{nbytes > 0 ? src.rawData() : nullptr, nbytes, owner}));
}

TensorLayout checkTensorDesc(wire::TensorDesc::Reader desc, size_t payloadCount) {
  TensorLayout layout;
  const unsigned dtypeCode = desc.getDtype();
  if (dtypeCode >= static_cast<unsigned>(tensor::kNumDTypes)) {
    throw CodecError("tensor descriptor has unknown dtype code " + std::to_string(dtypeCode));
  }
  layout.dtype = static_cast<DType>(dtypeCode);
  if (desc.getDeviceType() != static_cast<uint8_t>(tensor::DeviceType::kCPU)) {
    throw CodecError("tensor descriptor names device type " + std::to_string(desc.getDeviceType()) +
                     ": only CPU tensors travel over RPC for now");
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
