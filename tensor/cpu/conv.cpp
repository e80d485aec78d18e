#include "tensor/cpu/conv.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <unordered_map>
#include <vector>

#include "tensor/cpu/dnnl_context.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cpu/linalg.h"
#include "tensor/cuda/device_check.h"
#include "tensor/cuda/dnn_ops.h"

namespace distgrad::tensor::kernels {

// ---------------------------------------------------------------- validation

Shape conv2dOutputShape(const Shape& x, const Shape& weight, const Conv2dParams& p, const char* op) {
  DG_CHECK(x.size() == 4, op, ": input must be 4-D [N, C, H, W], got shape ", shapeStr(x));
  DG_CHECK(weight.size() == 4, op, ": weight must be 4-D [O, C/groups, kH, kW], got shape ", shapeStr(weight));
  DG_CHECK(p.groups >= 1, op, ": groups must be >= 1, got ", p.groups);
  for (int i = 0; i < 2; ++i) {
    DG_CHECK(p.stride[i] >= 1, op, ": stride must be >= 1, got [", p.stride[0], ", ", p.stride[1], "]");
    DG_CHECK(p.dilation[i] >= 1, op, ": dilation must be >= 1, got [", p.dilation[0], ", ", p.dilation[1], "]");
    DG_CHECK(p.padding[i] >= 0, op, ": padding must be >= 0, got [", p.padding[0], ", ", p.padding[1], "]");
  }
  const int64_t c = x[1], o = weight[0];
  DG_CHECK(c % p.groups == 0, op, ": groups (", p.groups, ") must divide the input channels (", c,
           ") of input shape ", shapeStr(x));
  DG_CHECK(o % p.groups == 0, op, ": groups (", p.groups, ") must divide the output channels (", o,
           ") of weight shape ", shapeStr(weight));
  DG_CHECK(weight[1] * p.groups == c, op, ": input shape ", shapeStr(x), " does not match weight shape ",
           shapeStr(weight), " (expected weight dim 1 = C/groups = ", c / p.groups, ")");
  DG_CHECK(weight[2] >= 1 && weight[3] >= 1, op, ": kernel must be at least 1x1, got weight shape ",
           shapeStr(weight));
  Shape out{x[0], o, 0, 0};
  for (int i = 0; i < 2; ++i) {
    const int64_t extent = x[2 + i] + 2 * p.padding[i] - p.dilation[i] * (weight[2 + i] - 1) - 1;
    DG_CHECK(extent >= 0, op, ": input shape ", shapeStr(x), " with padding [", p.padding[0], ", ", p.padding[1],
             "] is smaller than the dilated kernel of weight shape ", shapeStr(weight));
    out[2 + i] = extent / p.stride[i] + 1;
  }
  return out;
}

namespace {

void requireConvDTypes(const char* op, std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = *tensors.begin();
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    DG_CHECK(t->device().isCpu(), op, ": expected CPU tensors, got one on ", t->device().str());
    DG_CHECK(t->dtype() == first->dtype(), op, ": dtype mismatch: ", dtypeName(first->dtype()), " ",
             shapeStr(first->shape()), " vs ", dtypeName(t->dtype()), " ", shapeStr(t->shape()));
  }
  DG_CHECK(first->dtype() == DType::kFloat32 || first->dtype() == DType::kFloat64, op,
           ": expected float32 or float64 tensors, got ", dtypeName(first->dtype()));
}

// Everything a convolution's shape depends on.
struct ConvGeometry {
  int64_t n, c, h, w, o, kh, kw, oh, ow;
  Conv2dParams p;

  static ConvGeometry of(const Shape& x, const Shape& weight, const Conv2dParams& p) {
    Shape y = conv2dOutputShape(x, weight, p);
    return {x[0], x[1], x[2], x[3], weight[0], weight[2], weight[3], y[2], y[3], p};
  }
  Shape inputShape() const { return {n, c, h, w}; }
  Shape weightShape() const { return {o, c / p.groups, kh, kw}; }
  Shape outputShape() const { return {n, o, oh, ow}; }
};

// ---------------------------------------------------------------- float64 reference (im2col + GEMM)

// col [cg*kh*kw, oh*ow] from one image's channels [cg, h, w].
template <typename T>
void im2col(const T* x, int64_t cg, const ConvGeometry& g, T* col) {
  const int64_t l = g.oh * g.ow;
  for (int64_t ci = 0; ci < cg; ++ci) {
    for (int64_t ki = 0; ki < g.kh; ++ki) {
      for (int64_t kj = 0; kj < g.kw; ++kj) {
        T* row = col + ((ci * g.kh + ki) * g.kw + kj) * l;
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          const int64_t iy = oy * g.p.stride[0] - g.p.padding[0] + ki * g.p.dilation[0];
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const int64_t ix = ox * g.p.stride[1] - g.p.padding[1] + kj * g.p.dilation[1];
            const bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
            row[oy * g.ow + ox] = inside ? x[(ci * g.h + iy) * g.w + ix] : T(0);
          }
        }
      }
    }
  }
}

// The adjoint of im2col: adds col back into the image channels dx [cg, h, w].
template <typename T>
void col2imAdd(const T* col, int64_t cg, const ConvGeometry& g, T* dx) {
  const int64_t l = g.oh * g.ow;
  for (int64_t ci = 0; ci < cg; ++ci) {
    for (int64_t ki = 0; ki < g.kh; ++ki) {
      for (int64_t kj = 0; kj < g.kw; ++kj) {
        const T* row = col + ((ci * g.kh + ki) * g.kw + kj) * l;
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          const int64_t iy = oy * g.p.stride[0] - g.p.padding[0] + ki * g.p.dilation[0];
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const int64_t ix = ox * g.p.stride[1] - g.p.padding[1] + kj * g.p.dilation[1];
            if (ix >= 0 && ix < g.w) dx[(ci * g.h + iy) * g.w + ix] += row[oy * g.ow + ox];
          }
        }
      }
    }
  }
}

template <typename T>
void referenceForward(const ConvGeometry& g, const T* x, const T* w, const T* bias, T* y) {
  const int64_t groups = g.p.groups, cg = g.c / groups, og = g.o / groups;
  const int64_t kdim = cg * g.kh * g.kw, l = g.oh * g.ow;
  std::vector<T> col(static_cast<size_t>(kdim * l));
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      im2col(x + (n * g.c + gi * cg) * g.h * g.w, cg, g, col.data());
      T* out = y + (n * g.o + gi * og) * l;
      gemm(false, false, og, l, kdim, T(1), w + gi * og * kdim, kdim, col.data(), l, T(0), out, l);
      if (bias != nullptr) {
        for (int64_t oc = 0; oc < og; ++oc) {
          for (int64_t i = 0; i < l; ++i) out[oc * l + i] += bias[gi * og + oc];
        }
      }
    }
  }
}

template <typename T>
void referenceBackwardInput(const ConvGeometry& g, const T* dy, const T* w, T* dx) {
  const int64_t groups = g.p.groups, cg = g.c / groups, og = g.o / groups;
  const int64_t kdim = cg * g.kh * g.kw, l = g.oh * g.ow;
  std::vector<T> col(static_cast<size_t>(kdim * l));
  std::fill(dx, dx + g.n * g.c * g.h * g.w, T(0));
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      // dcol [kdim, l] = W_g^T [kdim, og] * dY_g [og, l]
      gemm(true, false, kdim, l, og, T(1), w + gi * og * kdim, kdim, dy + (n * g.o + gi * og) * l, l, T(0),
           col.data(), l);
      col2imAdd(col.data(), cg, g, dx + (n * g.c + gi * cg) * g.h * g.w);
    }
  }
}

template <typename T>
void referenceBackwardWeight(const ConvGeometry& g, const T* dy, const T* x, T* dw) {
  const int64_t groups = g.p.groups, cg = g.c / groups, og = g.o / groups;
  const int64_t kdim = cg * g.kh * g.kw, l = g.oh * g.ow;
  std::vector<T> col(static_cast<size_t>(kdim * l));
  std::fill(dw, dw + g.o * kdim, T(0));
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      im2col(x + (n * g.c + gi * cg) * g.h * g.w, cg, g, col.data());
      // dW_g [og, kdim] += dY_g [og, l] * col^T [l, kdim]
      gemm(false, true, og, kdim, l, T(1), dy + (n * g.o + gi * og) * l, l, col.data(), l, T(1),
           dw + gi * og * kdim, kdim);
    }
  }
}

template <typename T>
void biasGrad(const ConvGeometry& g, const T* dy, T* db) {
  const int64_t l = g.oh * g.ow;
  for (int64_t oc = 0; oc < g.o; ++oc) db[oc] = T(0);
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t oc = 0; oc < g.o; ++oc) {
      const T* p = dy + (n * g.o + oc) * l;
      T s = T(0);
      for (int64_t i = 0; i < l; ++i) s += p[i];
      db[oc] += s;
    }
  }
}

// ---------------------------------------------------------------- float32 on oneDNN

using dnnl::memory;
using Tag = memory::format_tag;

enum class ConvPass : int64_t { kForward = 0, kBackwardData = 1, kBackwardWeights = 2 };

// 64-byte aligned, grow-only buffer (one per role per thread).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }
  void* ensure(size_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      size_ = (bytes + 63) / 64 * 64;
      data_ = std::aligned_alloc(64, size_);
      if (data_ == nullptr) {
        size_ = 0;
        throw std::bad_alloc();
      }
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// One operand of a pass: the plain layout our tensor has, the layout the primitive wants, and the reorder
// between them (plain -> primitive for inputs, primitive -> plain for the output) when they differ.
struct Operand {
  int arg = 0;
  memory::desc plain;
  memory::desc inner;
  bool reordered = false;
  dnnl::reorder reorder;
  size_t reorderScratchpadBytes = 0;
};

// A cached pass: primitive + operands (two inputs, one output) + optional bias (input of forward, output
// of backward-weights; always plain [O]).
struct ConvPlan {
  dnnl::primitive primitive;
  Operand in0, in1, out;
  int biasArg = 0;  // 0 = no bias
  memory::desc biasMd;
  size_t scratchpadBytes = 0;
};

struct ThreadBuffers {
  AlignedBuffer in0, in1, out, scratchpad;
};

ThreadBuffers& threadBuffers() {
  thread_local ThreadBuffers buffers;
  return buffers;
}

using PlanKey = std::array<int64_t, 18>;
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

PlanKey planKey(const ConvGeometry& g, ConvPass pass, bool bias, ConvLayout layout) {
  return {g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.p.stride[0], g.p.stride[1], g.p.padding[0], g.p.padding[1],
          g.p.dilation[0], g.p.dilation[1], g.p.groups, static_cast<int64_t>(pass), bias ? 1 : 0,
          static_cast<int64_t>(layout), numThreads()};
}

memory::desc md(const memory::dims& dims, Tag tag) { return memory::desc(dims, memory::data_type::f32, tag); }

Operand makeOperand(int arg, const memory::desc& plain, const memory::desc& inner, bool isInput) {
  Operand op;
  op.arg = arg;
  op.plain = plain;
  op.inner = inner;
  op.reordered = !(plain == inner);
  if (op.reordered) {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto& eng = dnnlEngine();
    auto pd = isInput ? dnnl::reorder::primitive_desc(eng, plain, eng, inner, attr)
                      : dnnl::reorder::primitive_desc(eng, inner, eng, plain, attr);
    op.reorder = dnnl::reorder(pd);
    op.reorderScratchpadBytes = pd.scratchpad_desc().get_size();
  }
  return op;
}

std::unique_ptr<ConvPlan> createPlan(const ConvGeometry& g, ConvPass pass, bool bias, ConvLayout layout) {
  auto& eng = dnnlEngine();
  const memory::dims src{g.n, g.c, g.h, g.w}, dst{g.n, g.o, g.oh, g.ow};
  const bool grouped = g.p.groups > 1;
  const memory::dims wei = grouped ? memory::dims{g.p.groups, g.o / g.p.groups, g.c / g.p.groups, g.kh, g.kw}
                                   : memory::dims{g.o, g.c, g.kh, g.kw};
  const memory::dims strides{g.p.stride[0], g.p.stride[1]};
  const memory::dims dilates{g.p.dilation[0] - 1, g.p.dilation[1] - 1};  // oneDNN counts the gaps
  const memory::dims pad{g.p.padding[0], g.p.padding[1]};
  // Integer division in oneDNN's output-size rule floors like ours, so symmetric padding is consistent.
  const memory::desc srcPlain = md(src, Tag::nchw), dstPlain = md(dst, Tag::nchw);
  const memory::desc weiPlain = md(wei, grouped ? Tag::goihw : Tag::oihw);
  const memory::desc biasMd = md({g.o}, Tag::x);
  memory::desc srcReq = srcPlain, dstReq = dstPlain, weiReq = weiPlain;
  if (layout == ConvLayout::kBlocked) {
    srcReq = md(src, Tag::any);
    dstReq = md(dst, Tag::any);
    weiReq = md(wei, Tag::any);
  } else if (layout == ConvLayout::kChannelsLast) {
    srcReq = md(src, Tag::nhwc);
    dstReq = md(dst, Tag::nhwc);
    weiReq = md(wei, Tag::any);
  }
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const auto algo = dnnl::algorithm::convolution_direct;
  auto fwdDesc = bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, algo, srcReq, weiReq,
                                                        biasMd, dstReq, strides, dilates, pad, pad)
                      : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, algo, srcReq, weiReq,
                                                        dstReq, strides, dilates, pad, pad);
  dnnl::convolution_forward::primitive_desc fwdPd(fwdDesc, attr, eng);
  auto plan = std::make_unique<ConvPlan>();
  switch (pass) {
    case ConvPass::kForward:
      plan->primitive = dnnl::convolution_forward(fwdPd);
      plan->in0 = makeOperand(DNNL_ARG_SRC, srcPlain, fwdPd.src_desc(), true);
      plan->in1 = makeOperand(DNNL_ARG_WEIGHTS, weiPlain, fwdPd.weights_desc(), true);
      plan->out = makeOperand(DNNL_ARG_DST, dstPlain, fwdPd.dst_desc(), false);
      if (bias) plan->biasArg = DNNL_ARG_BIAS;
      plan->scratchpadBytes = fwdPd.scratchpad_desc().get_size();
      break;
    case ConvPass::kBackwardData: {
      dnnl::convolution_backward_data::desc desc(algo, srcReq, weiReq, dstReq, strides, dilates, pad, pad);
      dnnl::convolution_backward_data::primitive_desc pd(desc, attr, eng, fwdPd);
      plan->primitive = dnnl::convolution_backward_data(pd);
      plan->in0 = makeOperand(DNNL_ARG_DIFF_DST, dstPlain, pd.diff_dst_desc(), true);
      plan->in1 = makeOperand(DNNL_ARG_WEIGHTS, weiPlain, pd.weights_desc(), true);
      plan->out = makeOperand(DNNL_ARG_DIFF_SRC, srcPlain, pd.diff_src_desc(), false);
      plan->scratchpadBytes = pd.scratchpad_desc().get_size();
      break;
    }
    case ConvPass::kBackwardWeights: {
      auto desc = bias ? dnnl::convolution_backward_weights::desc(algo, srcReq, weiReq, biasMd, dstReq, strides,
                                                                   dilates, pad, pad)
                       : dnnl::convolution_backward_weights::desc(algo, srcReq, weiReq, dstReq, strides, dilates,
                                                                   pad, pad);
      dnnl::convolution_backward_weights::primitive_desc pd(desc, attr, eng, fwdPd);
      plan->primitive = dnnl::convolution_backward_weights(pd);
      plan->in0 = makeOperand(DNNL_ARG_SRC, srcPlain, pd.src_desc(), true);
      plan->in1 = makeOperand(DNNL_ARG_DIFF_DST, dstPlain, pd.diff_dst_desc(), true);
      plan->out = makeOperand(DNNL_ARG_DIFF_WEIGHTS, weiPlain, pd.diff_weights_desc(), false);
      if (bias) plan->biasArg = DNNL_ARG_DIFF_BIAS;
      plan->scratchpadBytes = pd.scratchpad_desc().get_size();
      break;
    }
  }
  plan->biasMd = biasMd;
  return plan;
}

// The measured rule documented at chooseConvLayout (conv.h).
ConvLayout resolveLayout(const ConvGeometry& g, ConvLayout requested) {
  if (requested != ConvLayout::kAuto) return requested;
  // Grouped and depthwise convolutions were not part of the measurements; oneDNN's own choice (blocked).
  if (g.p.groups > 1) return ConvLayout::kBlocked;
  if (g.c < 16) return ConvLayout::kPlain;
  const bool spatialKernel = g.kh > 1 || g.kw > 1;
  const bool unitStride = g.p.stride[0] == 1 && g.p.stride[1] == 1;
  if (spatialKernel && unitStride && g.oh >= 4 && g.ow >= 4) return ConvLayout::kChannelsLast;
  return ConvLayout::kBlocked;
}

// Per-thread plan cache. A training loop touches a few dozen distinct layers; the cap only guards against
// unbounded growth when shapes keep changing (e.g. variable batch sizes), by starting over.
ConvPlan& planFor(const ConvGeometry& g, ConvPass pass, bool bias, ConvLayout layout) {
  constexpr size_t kMaxPlans = 512;
  thread_local std::unordered_map<PlanKey, std::unique_ptr<ConvPlan>, PlanKeyHash> cache;
  // oneDNN sizes its work split and scratchpad for the thread count current at creation: apply ours to this
  // thread first, and key plans by it so a later setNumThreads gets fresh ones.
  (void)dnnlStream();
  layout = resolveLayout(g, layout);
  const PlanKey key = planKey(g, pass, bias, layout);
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  if (cache.size() >= kMaxPlans) cache.clear();
  std::unique_ptr<ConvPlan> plan;
  try {
    plan = createPlan(g, pass, bias, layout);
  } catch (const dnnl::error& e) {
    // Shapes and options were validated, so oneDNN refusing them is our bug, not the caller's.
    DG_ASSERT(false, "oneDNN could not create a convolution primitive for input ", shapeStr(g.inputShape()),
              " weight ", shapeStr(g.weightShape()), ": ", e.what());
  }
  return *cache.emplace(key, std::move(plan)).first->second;
}

memory scratchpadMemory(size_t bytes) {
  const memory::desc scratchMd({static_cast<memory::dim>(bytes)}, memory::data_type::u8, Tag::x);
  return memory(scratchMd, dnnlEngine(), threadBuffers().scratchpad.ensure(bytes));
}

// Runs a cached reorder (with its scratchpad, when it needs one).
void runReorder(const Operand& op, const memory& from, const memory& to) {
  std::unordered_map<int, memory> args{{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
  if (op.reorderScratchpadBytes > 0) args.emplace(DNNL_ARG_SCRATCHPAD, scratchpadMemory(op.reorderScratchpadBytes));
  op.reorder.execute(dnnlStream(), args);
}

// Our plain bytes as the memory an operand of `plan` wants: the user memory itself, or a reorder of it
// into `buffer`.
memory prepareInput(const Operand& op, const void* data, AlignedBuffer& buffer) {
  auto& eng = dnnlEngine();
  memory user(op.plain, eng, const_cast<void*>(data));
  if (!op.reordered) return user;
  memory inner(op.inner, eng, buffer.ensure(op.inner.get_size()));
  runReorder(op, user, inner);
  return inner;
}

// Runs the primitive on prepared inputs and leaves the result in our plain `out` bytes.
void execute(ConvPlan& plan, const memory& in0, const memory& in1, void* out, void* bias) {
  auto& eng = dnnlEngine();
  auto& stream = dnnlStream();
  ThreadBuffers& buffers = threadBuffers();
  memory userOut(plan.out.plain, eng, out);
  memory innerOut = plan.out.reordered ? memory(plan.out.inner, eng, buffers.out.ensure(plan.out.inner.get_size()))
                                       : userOut;
  std::unordered_map<int, memory> args{{plan.in0.arg, in0}, {plan.in1.arg, in1}, {plan.out.arg, innerOut}};
  if (plan.biasArg != 0) args.emplace(plan.biasArg, memory(plan.biasMd, eng, bias));
  if (plan.scratchpadBytes > 0) args.emplace(DNNL_ARG_SCRATCHPAD, scratchpadMemory(plan.scratchpadBytes));
  plan.primitive.execute(stream, args);
  if (plan.out.reordered) runReorder(plan.out, innerOut, userOut);
  stream.wait();
}

}  // namespace

// ---------------------------------------------------------------- entry points

ConvLayout chooseConvLayout(const Shape& x, const Shape& weight, const Conv2dParams& params) {
  return resolveLayout(ConvGeometry::of(x, weight, params), ConvLayout::kAuto);
}

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& params,
              ConvLayout layout) {
  if (cuda::onCuda("conv2d", {{"x", &x}, {"weight", &weight}, {"bias", &bias}}))
    return cuda::dnn::conv2d(x, weight, bias, params);
  requireConvDTypes("conv2d", {&x, &weight, &bias});
  const ConvGeometry g = ConvGeometry::of(x.shape(), weight.shape(), params);
  if (bias.defined()) {
    DG_CHECK(bias.dim() == 1 && bias.shape()[0] == g.o, "conv2d: bias shape ", shapeStr(bias.shape()),
             " does not match weight shape ", shapeStr(weight.shape()), " (expected [", g.o, "])");
  }
  Tensor y = Tensor::empty(g.outputShape(), x.dtype());
  if (y.numel() == 0) return y;
  if (x.numel() == 0 || weight.numel() == 0) {
    // Zero input channels: nothing to sum over, only the bias remains (oneDNN rejects empty operands).
    y.fill(0.0);
    if (bias.defined()) {
      dispatchFloat(y.dtype(), "conv2d", [&](auto tag) {
        using T = decltype(tag);
        Tensor bc = contiguous(bias);
        const int64_t l = g.oh * g.ow;
        T* out = y.data<T>();
        for (int64_t i = 0; i < g.n * g.o; ++i) std::fill(out + i * l, out + (i + 1) * l, bc.data<T>()[i % g.o]);
      });
    }
    return y;
  }
  Tensor xc = contiguous(x), wc = contiguous(weight), bc = bias.defined() ? contiguous(bias) : Tensor();
  if (x.dtype() == DType::kFloat64) {
    referenceForward<double>(g, xc.data<double>(), wc.data<double>(), bc.defined() ? bc.data<double>() : nullptr,
                             y.data<double>());
    return y;
  }
  ConvPlan& plan = planFor(g, ConvPass::kForward, bias.defined(), layout);
  ThreadBuffers& buffers = threadBuffers();
  execute(plan, prepareInput(plan.in0, xc.rawData(), buffers.in0), prepareInput(plan.in1, wc.rawData(), buffers.in1),
          y.rawData(), bc.defined() ? bc.rawData() : nullptr);
  return y;
}

namespace {
// x is needed (defined) only for the weight gradient and weight only for the input gradient; the shapes
// are always given.
Conv2dGrads backwardImpl(const Tensor& gradOut, const Tensor& x, const Shape& xShape, const Tensor& weight,
                         const Shape& weightShape, const Conv2dParams& params, bool needInput, bool needWeight,
                         bool needBias, ConvLayout layout) {
  requireConvDTypes("conv2d backward", {&gradOut, &x, &weight});
  DG_ASSERT(!needWeight || x.defined(), "conv2d backward: the weight gradient needs the input");
  DG_ASSERT(!needInput || weight.defined(), "conv2d backward: the input gradient needs the weight");
  const ConvGeometry g = ConvGeometry::of(xShape, weightShape, params);
  DG_CHECK(gradOut.shape() == g.outputShape(), "conv2d backward: gradient shape ", shapeStr(gradOut.shape()),
           " does not match the output shape ", shapeStr(g.outputShape()));
  Conv2dGrads grads;
  if (needInput) grads.input = Tensor::empty(g.inputShape(), gradOut.dtype());
  if (needWeight) grads.weight = Tensor::empty(g.weightShape(), gradOut.dtype());
  // Alone, the bias gradient is a plain reduction; with the weight gradient it comes out of the same pass.
  if (needBias && !needWeight) grads.bias = conv2dBackwardBias(gradOut);
  if (needBias && needWeight) grads.bias = Tensor::empty({g.o}, gradOut.dtype());
  const bool empty = gradOut.numel() == 0 || numelOf(xShape) == 0 || numelOf(weightShape) == 0;
  if (empty) {  // some dim is 0: every sum is empty (oneDNN rejects empty operands)
    if (needInput) grads.input.fill(0.0);
    if (needWeight) grads.weight.fill(0.0);
    if (needBias && needWeight) grads.bias = conv2dBackwardBias(gradOut);
    return grads;
  }
  Tensor gc = contiguous(gradOut);
  if (gradOut.dtype() == DType::kFloat64) {
    if (needInput) referenceBackwardInput<double>(g, gc.data<double>(), contiguous(weight).data<double>(),
                                                  grads.input.data<double>());
    if (needWeight) {
      Tensor xc = contiguous(x);
      referenceBackwardWeight<double>(g, gc.data<double>(), xc.data<double>(), grads.weight.data<double>());
      if (needBias) biasGrad<double>(g, gc.data<double>(), grads.bias.data<double>());
    }
    return grads;
  }
  ThreadBuffers& buffers = threadBuffers();
  memory gradData;  // gradOut as the backward-data pass consumed it, reused by backward-weights if it fits
  bool haveGradData = false;
  if (needInput) {
    ConvPlan& plan = planFor(g, ConvPass::kBackwardData, false, layout);
    Tensor wc = contiguous(weight);
    gradData = prepareInput(plan.in0, gc.rawData(), buffers.in0);
    haveGradData = true;
    execute(plan, gradData, prepareInput(plan.in1, wc.rawData(), buffers.in1), grads.input.rawData(), nullptr);
  }
  if (needWeight) {
    ConvPlan& plan = planFor(g, ConvPass::kBackwardWeights, needBias, layout);
    Tensor xc = contiguous(x);
    // gradOut was reordered into buffers.in0 for backward-data; reuse it when this pass wants the same layout.
    memory gradWeights = haveGradData && gradData.get_desc() == plan.in1.inner
                             ? gradData
                             : prepareInput(plan.in1, gc.rawData(), buffers.in0);
    execute(plan, prepareInput(plan.in0, xc.rawData(), buffers.in1), gradWeights, grads.weight.rawData(),
            needBias ? grads.bias.rawData() : nullptr);
  }
  return grads;
}

}  // namespace

Conv2dGrads conv2dBackward(const Tensor& gradOut, const Tensor& x, const Tensor& weight, const Conv2dParams& params,
                           bool needInput, bool needWeight, bool needBias, ConvLayout layout) {
  if (cuda::onCuda("conv2d backward", {{"gradOut", &gradOut}, {"x", &x}, {"weight", &weight}}))
    return cuda::dnn::conv2dBackward(gradOut, x, weight, params, needInput, needWeight, needBias);
  return backwardImpl(gradOut, x, x.shape(), weight, weight.shape(), params, needInput, needWeight, needBias, layout);
}

Tensor conv2dBackwardInput(const Tensor& gradOut, const Tensor& weight, const Shape& inputShape,
                           const Conv2dParams& params, ConvLayout layout) {
  if (cuda::onCuda("conv2d backward", {{"gradOut", &gradOut}, {"weight", &weight}}))
    return cuda::dnn::conv2dBackwardInput(gradOut, weight, inputShape, params);
  return backwardImpl(gradOut, Tensor(), inputShape, weight, weight.shape(), params, true, false, false, layout).input;
}

std::pair<Tensor, Tensor> conv2dBackwardWeight(const Tensor& gradOut, const Tensor& x, const Shape& weightShape,
                                               const Conv2dParams& params, bool withBias, ConvLayout layout) {
  if (cuda::onCuda("conv2d backward", {{"gradOut", &gradOut}, {"x", &x}}))
    return cuda::dnn::conv2dBackwardWeight(gradOut, x, weightShape, params, withBias);
  Conv2dGrads grads = backwardImpl(gradOut, x, x.shape(), Tensor(), weightShape, params, false, true, withBias, layout);
  return {grads.weight, grads.bias};
}

Tensor conv2dBackwardBias(const Tensor& gradOut) {
  if (cuda::onCuda("conv2d backward", {{"gradOut", &gradOut}})) return cuda::dnn::conv2dBackwardBias(gradOut);
  DG_CHECK(gradOut.dim() == 4, "conv2d backward: gradient must be 4-D [N, O, OH, OW], got shape ",
           shapeStr(gradOut.shape()));
  Tensor gc = contiguous(gradOut);
  ConvGeometry g{};
  g.n = gc.shape()[0];
  g.o = gc.shape()[1];
  g.oh = gc.shape()[2];
  g.ow = gc.shape()[3];
  Tensor db = Tensor::empty({g.o}, gc.dtype());
  dispatchFloat(gc.dtype(), "conv2d backward", [&](auto tag) {
    using T = decltype(tag);
    biasGrad<T>(g, gc.data<T>(), db.data<T>());
  });
  return db;
}

}  // namespace distgrad::tensor::kernels
