#include "tensor/tensor.h"

#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "tensor/cpu/shape_kernels.h"
#include "tensor/cpu/strided.h"
#include "tensor/cuda/cuda_memory.h"
#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor {

int64_t numelOf(const Shape& shape) {
  int64_t n = 1;
  bool overflow = false;
  for (int64_t s : shape) overflow |= __builtin_mul_overflow(n, s, &n);
  // Shapes come from users, files and the wire: a product that wraps would size a tiny allocation that
  // kernels then overrun. (A zero dim makes later overflow harmless only if we stop here, so check all.)
  DG_CHECK(!overflow, "shape ", shapeStr(shape), " has more elements than fit in 64 bits");
  return n;
}

Shape contiguousStrides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t acc = 1;
  bool overflow = false;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = acc;
    // With a zero dim the element count is 0, but the other dims still have to fit in 64-bit strides.
    overflow |= __builtin_mul_overflow(acc, std::max<int64_t>(shape[i], 1), &acc);
  }
  DG_CHECK(!overflow, "shape ", shapeStr(shape), " is too large: its strides do not fit in 64 bits");
  return strides;
}

std::string shapeStr(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t wrapDim(int64_t dim, int64_t ndim, const char* op) {
  int64_t lo = ndim == 0 ? -1 : -ndim;
  int64_t hi = ndim == 0 ? 0 : ndim - 1;
  DG_CHECK(dim >= lo && dim <= hi, op, ": dim ", dim, " out of range for a ", ndim, "-d tensor (expected ", lo,
           "..", hi, ")");
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

// ---------------------------------------------------------------- 16-bit floats

uint16_t floatToBFloat16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (std::isnan(v)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float bfloat16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToHalf(float v) {
  uint32_t x;
  std::memcpy(&x, &v, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t mant = x & 0x007FFFFF;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xFF);
  if (exp == 0xFF) return static_cast<uint16_t>(sign | 0x7C00 | (mant ? 0x200 : 0));  // inf / nan
  int32_t e = exp - 127 + 15;
  if (e >= 0x1F) return static_cast<uint16_t>(sign | 0x7C00);  // overflow -> inf
  if (e <= 0) {                                                  // subnormal or zero
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x00800000;
    uint32_t shift = static_cast<uint32_t>(14 - e);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;  // may carry into exponent: correct
  return static_cast<uint16_t>(half);
}

float halfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {

double loadAsDouble(const char* p, DType t) {
  switch (t) {
    case DType::kFloat32: return *reinterpret_cast<const float*>(p);
    case DType::kFloat64: return *reinterpret_cast<const double*>(p);
    case DType::kInt64: return static_cast<double>(*reinterpret_cast<const int64_t*>(p));
    case DType::kBFloat16: return bfloat16ToFloat(*reinterpret_cast<const uint16_t*>(p));
    case DType::kFloat16: return halfToFloat(*reinterpret_cast<const uint16_t*>(p));
  }
  return 0;
}

void storeFromDouble(char* p, DType t, double v) {
  switch (t) {
    case DType::kFloat32: *reinterpret_cast<float*>(p) = static_cast<float>(v); break;
    case DType::kFloat64: *reinterpret_cast<double*>(p) = v; break;
    case DType::kInt64: *reinterpret_cast<int64_t*>(p) = static_cast<int64_t>(v); break;
    case DType::kBFloat16: *reinterpret_cast<uint16_t*>(p) = floatToBFloat16(static_cast<float>(v)); break;
    case DType::kFloat16: *reinterpret_cast<uint16_t*>(p) = floatToHalf(static_cast<float>(v)); break;
  }
}

// Note [CUDA copies]: copyFrom with a CUDA side is ordered on the current streams of the devices involved
// and has the contract of a plain copy: when it returns, the source may be reused and (for a host
// destination) the bytes are there. Conversions and layout changes run on the device side; the
// transfer itself is always one contiguous block of the destination's dtype.
//  - same device: one strided (converting) kernel;
//  - host -> device: a pageable source is staged by the CUDA driver before cudaMemcpyAsync returns; a
//    pinned source is waited for (copyHostToDevice);
//  - device -> host: the source stream is synchronised before returning (also for pinned destinations);
//  - device -> other device: the destination stream waits for an event on the source stream, then a peer
//    copy runs on the destination stream and the source block is recordStream()'d for it.
void copyWithCuda(const Tensor& dst, const Tensor& src) {
  const Device dd = dst.device();
  const Device sd = src.device();
  if (dd.isCuda()) cuda::requireDevice(dd.index, "Tensor::copyFrom");
  if (sd.isCuda()) cuda::requireDevice(sd.index, "Tensor::copyFrom");
  if (dd == sd) {
    cuda::copyConvert(dst, src);
    return;
  }
  const size_t nbytes = dst.nbytes();
  if (nbytes == 0) return;
  // The source as one contiguous block of dst's dtype, converted on its own device.
  Tensor staged = src;
  if (src.dtype() != dst.dtype() || !src.isContiguous()) {
    staged = Tensor::empty(src.shape(), dst.dtype(), sd);
    staged.copyFrom(src);
  }
  Tensor target = dst.isContiguous() ? dst : Tensor::empty(dst.shape(), dst.dtype(), dd);
  if (sd.isCpu()) {
    cuda::copyHostToDevice(target.rawData(), staged.rawData(), nbytes, cuda::Stream::current(dd.index));
  } else if (dd.isCpu()) {
    cuda::Stream stream = cuda::Stream::current(sd.index);
    cuda::copyBytesAsync(target.rawData(), staged.rawData(), nbytes, stream);
    stream.synchronize();
  } else {
    cuda::Stream srcStream = cuda::Stream::current(sd.index);
    cuda::Stream dstStream = cuda::Stream::current(dd.index);
    cuda::Event produced;
    produced.record(srcStream);
    produced.block(dstStream);
    cuda::copyPeerAsync(target.rawData(), dd.index, staged.rawData(), sd.index, nbytes, dstStream);
    cuda::recordStream(staged, dstStream);
  }
  if (!target.sameAs(dst)) Tensor(dst).copyFrom(target);
}

void requireCpu(const Tensor& t, const char* op) {
  DG_CHECK(t.device().isCpu(), op, ": expected a CPU tensor, got one on ", t.device().str(),
           " (move it with .to(Device::cpu()))");
}

}  // namespace

// ---------------------------------------------------------------- factories

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t s : shape) DG_CHECK(s >= 0, "Tensor::empty: negative dimension in shape ", shapeStr(shape));
  int64_t nbytes = 0;
  DG_CHECK(!__builtin_mul_overflow(numelOf(shape), static_cast<int64_t>(tensor::itemSize(dtype)), &nbytes),
           "Tensor::empty: shape ", shapeStr(shape), " of ", dtypeName(dtype), " needs more bytes than fit in 64 bits");
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = Storage::allocate(static_cast<size_t>(nbytes), device);
  impl->shape = shape;
  impl->strides = contiguousStrides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (device.isCpu()) {
    std::memset(t.rawData(), 0, t.nbytes());
  } else {
    cuda::fill(t, 0.0);  // every dtype's zero is all-zero bits
  }
  return t;
}

Tensor Tensor::ones(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill(1.0);
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype) {
  Tensor t = empty(shape, dtype);
  t.fill(value);
  return t;
}

Tensor Tensor::scalar(double value, DType dtype) { return full({}, value, dtype); }

Tensor Tensor::arange(int64_t n, DType dtype) {
  DG_CHECK(n >= 0, "Tensor::arange: n must be >= 0, got ", n);
  Tensor t = empty({n}, dtype);
  char* p = static_cast<char*>(t.rawData());
  for (int64_t i = 0; i < n; ++i) storeFromDouble(p + i * t.itemSize(), dtype, static_cast<double>(i));
  return t;
}

template <typename T>
Tensor Tensor::fromVector(const std::vector<T>& values, const Shape& shape) {
  DG_CHECK(static_cast<int64_t>(values.size()) == numelOf(shape), "Tensor::fromVector: ", values.size(),
           " values do not fill shape ", shapeStr(shape), " (", numelOf(shape), " elements)");
  Tensor t = empty(shape, DTypeOf<T>::value);
  if (!values.empty()) std::memcpy(t.rawData(), values.data(), values.size() * sizeof(T));
  return t;
}
template Tensor Tensor::fromVector<float>(const std::vector<float>&, const Shape&);
template Tensor Tensor::fromVector<double>(const std::vector<double>&, const Shape&);
template Tensor Tensor::fromVector<int64_t>(const std::vector<int64_t>&, const Shape&);

Tensor Tensor::fromStorage(Storage storage, const Shape& shape, const Shape& strides, int64_t offset,
                           DType dtype) {
  DG_CHECK(shape.size() == strides.size(), "Tensor::fromStorage: shape ", shapeStr(shape), " and strides ",
           shapeStr(strides), " differ in rank");
  DG_CHECK(offset >= 0, "Tensor::fromStorage: negative offset ", offset);
  // Every product and sum is overflow-checked: views are built from untrusted descriptors (files, wire).
  int64_t maxIndex = offset;
  bool empty = false;
  bool overflow = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    DG_CHECK(shape[i] >= 0, "Tensor::fromStorage: negative dimension in shape ", shapeStr(shape));
    DG_CHECK(strides[i] >= 0, "Tensor::fromStorage: negative stride in ", shapeStr(strides));
    if (shape[i] == 0) {
      empty = true;
      continue;
    }
    int64_t span = 0;
    overflow |= __builtin_mul_overflow(shape[i] - 1, strides[i], &span);
    overflow |= __builtin_add_overflow(maxIndex, span, &maxIndex);
  }
  if (!empty) {
    int64_t need = 0;
    overflow = overflow || __builtin_add_overflow(maxIndex, 1, &maxIndex) ||
               __builtin_mul_overflow(maxIndex, static_cast<int64_t>(tensor::itemSize(dtype)), &need);
    DG_CHECK(!overflow && static_cast<uint64_t>(need) <= storage.nbytes(), "Tensor::fromStorage: view ",
             shapeStr(shape), " strides ", shapeStr(strides), " offset ", offset, " does not fit in a storage of ",
             storage.nbytes(), " bytes");
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

// ---------------------------------------------------------------- metadata and data

int64_t Tensor::size(int64_t d) const { return shape()[wrapDim(d, dim(), "Tensor::size")]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrapDim(d, dim(), "Tensor::stride")]; }

bool Tensor::isContiguous() const {
  const auto& sh = shape();
  const auto& st = strides();
  int64_t expected = 1;
  for (int64_t i = static_cast<int64_t>(sh.size()) - 1; i >= 0; --i) {
    if (sh[i] == 1) continue;
    if (st[i] != expected) return false;
    expected *= sh[i];
  }
  return true;
}

void* Tensor::rawData() const {
  return static_cast<char*>(impl().storage.data()) + impl().offset * static_cast<int64_t>(itemSize());
}

double Tensor::item() const {
  DG_CHECK(numel() == 1, "Tensor::item: expected a one-element tensor, got shape ", shapeStr(shape()));
  if (device().isCuda()) return to(Device::cpu()).item();  // waits for the device (Note [CUDA copies])
  return loadAsDouble(static_cast<const char*>(rawData()), dtype());
}

double Tensor::at(std::initializer_list<int64_t> index) const {
  DG_CHECK(static_cast<int64_t>(index.size()) == dim(), "Tensor::at: ", index.size(),
           " indices for a tensor of shape ", shapeStr(shape()));
  if (device().isCuda()) return to(Device::cpu()).at(index);  // slow path for tests and printing
  int64_t off = 0;
  int64_t d = 0;
  for (int64_t i : index) {
    DG_CHECK(i >= 0 && i < shape()[d], "Tensor::at: index ", i, " out of range for dim ", d, " of shape ",
             shapeStr(shape()));
    off += i * strides()[d];
    ++d;
  }
  return loadAsDouble(static_cast<const char*>(rawData()) + off * static_cast<int64_t>(itemSize()), dtype());
}

template <typename T>
std::vector<T> Tensor::toVector() const {
  Tensor src = device().isCpu() ? *this : to(Device::cpu());
  std::vector<T> out(static_cast<size_t>(src.numel()));
  if (src.dtype() == DTypeOf<T>::value && src.isContiguous()) {
    if (!out.empty()) std::memcpy(out.data(), src.rawData(), out.size() * sizeof(T));
    return out;
  }
  T* dst = out.data();
  const DType dt = src.dtype();
  kernels::forEachStrided<1>(src.shape(), {kernels::byteStridesOf(src, src.strides())},
                             {static_cast<char*>(src.rawData())}, [&](auto p, auto s, int64_t n) {
                               for (int64_t i = 0; i < n; ++i) {
                                 *dst++ = static_cast<T>(loadAsDouble(p[0] + i * s[0], dt));
                               }
                             });
  return out;
}
template std::vector<float> Tensor::toVector<float>() const;
template std::vector<double> Tensor::toVector<double>() const;
template std::vector<int64_t> Tensor::toVector<int64_t>() const;

Tensor Tensor::detach() const {
  const TensorImpl& self = impl();
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = self.storage;
  impl->shape = self.shape;
  impl->strides = self.strides;
  impl->offset = self.offset;
  impl->dtype = self.dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::cloneData() const {
  Tensor out = empty(shape(), dtype(), device());
  out.copyFrom(*this);
  return out;
}

void Tensor::copyFrom(const Tensor& src) {
  DG_CHECK(src.shape() == shape(), "Tensor::copyFrom: source shape ", shapeStr(src.shape()),
           " does not match destination shape ", shapeStr(shape()));
  if (device().isCuda() || src.device().isCuda()) {
    copyWithCuda(*this, src);
    return;
  }
  if (src.dtype() == dtype() && src.isContiguous() && isContiguous()) {
    if (nbytes() > 0 && rawData() != src.rawData()) std::memmove(rawData(), src.rawData(), nbytes());
    return;
  }
  if (src.dtype() == dtype()) {  // strided, same type: the tiled copy kernel (fast for transposes)
    kernels::copyInto(*this, src, "Tensor::copyFrom");
    return;
  }
  const DType sdt = src.dtype();  // dtype conversion
  const DType ddt = dtype();
  kernels::forEachStrided<2>(
      shape(), {kernels::byteStridesOf(*this, strides()), kernels::byteStridesOf(src, src.strides())},
      {static_cast<char*>(rawData()), static_cast<char*>(src.rawData())}, [&](auto p, auto s, int64_t n) {
        for (int64_t i = 0; i < n; ++i) storeFromDouble(p[0] + i * s[0], ddt, loadAsDouble(p[1] + i * s[1], sdt));
      });
}

void Tensor::fill(double value) {
  if (device().isCuda()) {
    cuda::requireDevice(device().index, "Tensor::fill");
    cuda::fill(*this, value);
    return;
  }
  requireCpu(*this, "Tensor::fill");
  const DType dt = dtype();
  if (dt == DType::kFloat32 && isContiguous()) {
    float* p = data<float>();
    const float v = static_cast<float>(value);
    for (int64_t i = 0, n = numel(); i < n; ++i) p[i] = v;
    return;
  }
  kernels::forEachStrided<1>(shape(), {kernels::byteStridesOf(*this, strides())},
                             {static_cast<char*>(rawData())}, [&](auto p, auto s, int64_t n) {
                               for (int64_t i = 0; i < n; ++i) storeFromDouble(p[0] + i * s[0], dt, value);
                             });
}

Tensor Tensor::toDType(DType target) const {
  if (target == dtype()) return detach();
  Tensor out = empty(shape(), target, device());
  out.copyFrom(*this);
  return out;
}

Tensor Tensor::to(Device target) const {
  if (target == device()) return detach();
  Tensor out = empty(shape(), dtype(), target);
  out.copyFrom(*this);  // any layout (Note [CUDA copies])
  return out;
}

// ---------------------------------------------------------------- autograd slot

bool Tensor::requiresGrad() const {
  auto* m = impl().autograd.get();
  return m != nullptr && m->requiresGrad;
}

Tensor& Tensor::setRequiresGrad(bool enabled) {
  DG_CHECK(isLeaf(), "setRequiresGrad: only leaf tensors can be marked; this tensor was produced by an op "
                     "(use detach() to make a leaf)");
  DG_CHECK(!enabled || isFloatingPoint(dtype()), "setRequiresGrad: only floating-point tensors can require "
                                                  "grad, got ", dtypeName(dtype()));
  ensureAutogradMeta().requiresGrad = enabled;
  return *this;
}

bool Tensor::isLeaf() const {
  auto* m = impl().autograd.get();
  return m == nullptr || m->gradFn == nullptr;
}

Tensor Tensor::grad() const {
  auto* m = impl().autograd.get();
  return (m && m->grad) ? Tensor(m->grad) : Tensor();
}

void Tensor::setGrad(const Tensor& grad) {
  if (grad.defined()) {
    DG_CHECK(grad.shape() == shape(), "setGrad: gradient shape ", shapeStr(grad.shape()),
             " does not match tensor shape ", shapeStr(shape()));
  }
  ensureAutogradMeta().grad = grad.implPtr();
}

const std::shared_ptr<autograd::Node>& Tensor::gradFn() const {
  static const std::shared_ptr<autograd::Node> kNone;
  auto* m = impl().autograd.get();
  return m ? m->gradFn : kNone;
}

AutogradMeta& Tensor::ensureAutogradMeta() const {
  auto& slot = impl().autograd;
  if (!slot) slot = std::make_unique<AutogradMeta>();
  return *slot;
}

void Tensor::retainGrad() const {
  DG_CHECK(requiresGrad(), "retainGrad: the tensor does not require grad");
  ensureAutogradMeta().retainsGrad = true;
}

// ---------------------------------------------------------------- printing

namespace {
void printRecursive(std::ostream& out, const Tensor& t, int64_t d, int64_t off, int indent) {
  const int64_t n = t.shape()[d];
  const bool last = d == t.dim() - 1;
  const int64_t edge = 3;  // elements shown at each end of a long dimension
  out << '[';
  for (int64_t i = 0; i < n; ++i) {
    if (n > 2 * edge + 1 && i == edge) {
      out << (last ? "..., " : "...,\n" + std::string(indent + 1, ' '));
      i = n - edge - 1;
      continue;
    }
    int64_t o = off + i * t.strides()[d];
    if (last) {
      double v = loadAsDouble(static_cast<const char*>(t.storage().data()) + o * t.itemSize(), t.dtype());
      if (t.dtype() == DType::kInt64) out << static_cast<int64_t>(v);
      else out << std::setprecision(4) << v;
    } else {
      printRecursive(out, t, d + 1, o, indent + 1);
    }
    if (i + 1 < n) out << (last ? ", " : ",\n" + std::string(indent + 1, ' '));
  }
  out << ']';
}
}  // namespace

std::string Tensor::toString() const {
  std::ostringstream out;
  out << *this;
  return out.str();
}

std::ostream& operator<<(std::ostream& out, const Tensor& t) {
  if (!t.defined()) return out << "tensor(undefined)";
  Tensor cpu = t.device().isCpu() ? t : t.to(Device::cpu());
  out << "tensor(";
  if (cpu.dim() == 0) {
    out << cpu.item();
  } else {
    printRecursive(out, cpu, 0, cpu.offset(), 7);
  }
  out << ", shape=" << shapeStr(t.shape()) << ", dtype=" << t.dtype();
  if (!t.device().isCpu()) out << ", device=" << t.device();
  if (t.requiresGrad()) out << ", requires_grad";
  return out << ')';
}

}  // namespace distgrad::tensor
