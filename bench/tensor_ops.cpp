// Tensor-op benchmarks, one thread: GEMM and convolution through distgrad's ops against the same work
// done with direct oneDNN calls in the same run, so the ratios isolate our overhead (allocation, layout
// reorders, autograd recording) from the machine's speed.
//
//   sgemm:   matmul [1024,1024] x [1024,1024] vs dnnl_sgemm into a preallocated C (GFLOP/s, ratio).
//   conv:    forward + backward (input and weight grads) of 3x3/pad-1 ResNet-18 CIFAR layers
//            (N=32, 64->64 at 8x8 and 128->128 at 4x4) through conv2d + autograd::grad vs hand-written
//            oneDNN primitives created once (plain NCHW in and out, reordered operands shared between
//            passes). Also: every memory layout through our kernels and direct (the layout choice in
//            tensor/cpu/conv.h), and what re-creating primitive descriptors each call would cost (why we
//            keep our own plan cache on top of oneDNN's primitive cache).
//
// Prints JSON lines (bench/bench_util.h). Samples of the two sides are interleaved so that load from
// other processes affects both alike. Usage: bench_tensor_ops [--quick] [--wall]
#include <oneapi/dnnl/dnnl.h>

#include <time.h>

#include <chrono>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "bench/bench_util.h"
#include "tensor/cpu/conv.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/random.h"

namespace distgrad {
namespace {

using bench::emit;
using bench::quoted;
using bench::Stats;
using bench::statsOf;
namespace kernels = tensor::kernels;
using dnnl::memory;
using Tag = memory::format_tag;

// Everything runs on this thread (one kernel thread), so by default we time with this thread's CPU clock:
// on a shared machine it leaves out the time other processes hold the core, which wall time would add to
// whichever side happened to be preempted. --wall switches to wall-clock time.
bool gWallClock = false;

double nowSeconds() {
  if (gWallClock) return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double secondsOf(const std::function<void()>& fn) {
  const double t0 = nowSeconds();
  fn();
  return nowSeconds() - t0;
}

std::string clockName() { return gWallClock ? "\"wall\"" : "\"thread_cpu\""; }

// Runs the candidates round-robin `reps` times after one warm-up each; returns per-candidate seconds.
std::vector<std::vector<double>> interleaved(const std::vector<std::function<void()>>& fns, int reps) {
  for (const auto& f : fns) f();
  std::vector<std::vector<double>> out(fns.size());
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) out[i].push_back(secondsOf(fns[i]));
  }
  return out;
}

std::vector<double> scaled(const std::vector<double>& v, double factor) {
  std::vector<double> out;
  for (double x : v) out.push_back(x * factor);
  return out;
}

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// ---------------------------------------------------------------- GEMM

void benchSgemm(int reps) {
  const int64_t n = 1024;
  tensor::Generator gen(1);
  Tensor a = tensor::normal({n, n}, 0, 1, gen), b = tensor::normal({n, n}, 0, 1, gen);
  std::vector<float> c(static_cast<size_t>(n * n));
  const double gflop = 2.0 * n * n * n / 1e9;
  (void)kernels::dnnlStream();  // applies the thread count to this thread
  auto ours = [&] { Tensor y = matmul(a, b); };
  auto direct = [&] {
    dnnl_sgemm('N', 'N', n, n, n, 1.0f, a.data<float>(), n, b.data<float>(), n, 0.0f, c.data(), n);
  };
  // a^T as a strided view: exercises the no-copy transposed-operand path.
  Tensor at = Tensor::fromStorage(a.storage(), {n, n}, {1, n}, 0, DType::kFloat32);
  auto oursTransposed = [&] { Tensor y = matmul(at, b); };
  auto t = interleaved({ours, direct, oursTransposed}, reps);
  Stats sOurs = statsOf(bench::ratesOf(t[0], gflop)), sDirect = statsOf(bench::ratesOf(t[1], gflop));
  Stats sT = statsOf(bench::ratesOf(t[2], gflop));
  const std::string shape = quoted("1024x1024x1024");
  emit("sgemm", "direct_dnnl_sgemm", "GFLOP/s", sDirect, {{"shape", shape}, {"threads", "1"}, {"clock", clockName()}});
  emit("sgemm", "matmul", "GFLOP/s", sOurs,
       {{"shape", shape}, {"threads", "1"}, {"clock", clockName()}, {"ratio_vs_direct", num(sOurs.median / sDirect.median)}});
  emit("sgemm", "matmul_transposed_lhs", "GFLOP/s", sT,
       {{"shape", shape}, {"threads", "1"}, {"clock", clockName()}, {"ratio_vs_direct", num(sT.median / sDirect.median)}});
}

// ---------------------------------------------------------------- convolution, direct oneDNN

const char* layoutName(kernels::ConvLayout l) {
  switch (l) {
    case kernels::ConvLayout::kAuto: return "auto";
    case kernels::ConvLayout::kBlocked: return "blocked";
    case kernels::ConvLayout::kPlain: return "plain";
    case kernels::ConvLayout::kChannelsLast: return "channels_last";
  }
  return "?";
}

struct ConvShape {
  int64_t n, c, h, o, k, pad;
  std::string name() const {
    char buf[96];
    std::snprintf(buf, sizeof buf, "N%lld_C%lld_O%lld_%lldx%lld_k%lld", static_cast<long long>(n),
                  static_cast<long long>(c), static_cast<long long>(o), static_cast<long long>(h),
                  static_cast<long long>(h), static_cast<long long>(k));
    return buf;
  }
  double gflopPerPass() const { return 2.0 * n * o * h * h * c * k * k / 1e9; }  // stride 1, same padding
};

// Forward + backward-data + backward-weights with primitives created once, plain NCHW/OIHW buffers in
// and out, and each reordered operand computed once per step and shared between the passes that want the
// same layout (which our per-kernel calls cannot do).
class DirectConv {
 public:
  DirectConv(const ConvShape& s, kernels::ConvLayout layout) : eng_(kernels::dnnlEngine()), stream_(eng_) {
    const memory::dims src{s.n, s.c, s.h, s.h}, wei{s.o, s.c, s.k, s.k}, dst{s.n, s.o, s.h, s.h};
    const memory::dims strides{1, 1}, dil{0, 0}, pad{s.pad, s.pad};
    auto md = [](const memory::dims& d, Tag t) { return memory::desc(d, memory::data_type::f32, t); };
    xPlain_ = md(src, Tag::nchw);
    wPlain_ = md(wei, Tag::oihw);
    yPlain_ = md(dst, Tag::nchw);
    memory::desc xReq = xPlain_, wReq = wPlain_, yReq = yPlain_;
    if (layout == kernels::ConvLayout::kBlocked) {
      xReq = md(src, Tag::any);
      wReq = md(wei, Tag::any);
      yReq = md(dst, Tag::any);
    } else if (layout == kernels::ConvLayout::kChannelsLast) {
      xReq = md(src, Tag::nhwc);
      wReq = md(wei, Tag::any);
      yReq = md(dst, Tag::nhwc);
    }
    const auto algo = dnnl::algorithm::convolution_direct;
    dnnl::convolution_forward::desc fd(dnnl::prop_kind::forward_training, algo, xReq, wReq, yReq, strides, dil,
                                       pad, pad);
    fwdPd_ = dnnl::convolution_forward::primitive_desc(fd, eng_);
    dnnl::convolution_backward_data::desc bd(algo, xReq, wReq, yReq, strides, dil, pad, pad);
    bwdDataPd_ = dnnl::convolution_backward_data::primitive_desc(bd, eng_, fwdPd_);
    dnnl::convolution_backward_weights::desc bw(algo, xReq, wReq, yReq, strides, dil, pad, pad);
    bwdWeightsPd_ = dnnl::convolution_backward_weights::primitive_desc(bw, eng_, fwdPd_);
    fwd_ = dnnl::convolution_forward(fwdPd_);
    bwdData_ = dnnl::convolution_backward_data(bwdDataPd_);
    bwdWeights_ = dnnl::convolution_backward_weights(bwdWeightsPd_);
    // Plain user buffers.
    tensor::Generator gen(7);
    x_ = tensor::normal({s.n, s.c, s.h, s.h}, 0, 1, gen);
    w_ = tensor::normal({s.o, s.c, s.k, s.k}, 0, 0.1, gen);
    g_ = tensor::normal({s.n, s.o, s.h, s.h}, 0, 1, gen);
    y_ = Tensor::empty({s.n, s.o, s.h, s.h});
    dx_ = Tensor::empty({s.n, s.c, s.h, s.h});
    dw_ = Tensor::empty({s.o, s.c, s.k, s.k});
  }

  void step() {
    memory xU(xPlain_, eng_, x_.rawData()), wU(wPlain_, eng_, w_.rawData()), yU(yPlain_, eng_, y_.rawData());
    memory gU(yPlain_, eng_, g_.rawData()), dxU(xPlain_, eng_, dx_.rawData()), dwU(wPlain_, eng_, dw_.rawData());
    // forward
    memory xF = in(xU, fwdPd_.src_desc(), 0), wF = in(wU, fwdPd_.weights_desc(), 1);
    memory yF = out(yU, fwdPd_.dst_desc(), 2);
    fwd_.execute(stream_, {{DNNL_ARG_SRC, xF}, {DNNL_ARG_WEIGHTS, wF}, {DNNL_ARG_DST, yF}});
    finish(yF, yU);
    // backward data (reuses forward's reordered weights when the layouts agree)
    memory gD = in(gU, bwdDataPd_.diff_dst_desc(), 3);
    memory wD = bwdDataPd_.weights_desc() == wF.get_desc() ? wF : in(wU, bwdDataPd_.weights_desc(), 4);
    memory dxD = out(dxU, bwdDataPd_.diff_src_desc(), 5);
    bwdData_.execute(stream_, {{DNNL_ARG_DIFF_DST, gD}, {DNNL_ARG_WEIGHTS, wD}, {DNNL_ARG_DIFF_SRC, dxD}});
    finish(dxD, dxU);
    // backward weights (reuses the reordered input and gradient)
    memory xW = bwdWeightsPd_.src_desc() == xF.get_desc() ? xF : in(xU, bwdWeightsPd_.src_desc(), 6);
    memory gW = bwdWeightsPd_.diff_dst_desc() == gD.get_desc() ? gD : in(gU, bwdWeightsPd_.diff_dst_desc(), 7);
    memory dwW = out(dwU, bwdWeightsPd_.diff_weights_desc(), 8);
    bwdWeights_.execute(stream_, {{DNNL_ARG_SRC, xW}, {DNNL_ARG_DIFF_DST, gW}, {DNNL_ARG_DIFF_WEIGHTS, dwW}});
    finish(dwW, dwU);
    stream_.wait();
  }

  // The cost of building the three primitive descriptors + primitives again (oneDNN's primitive cache
  // then returns the primitive, but descriptor creation and implementation dispatch still run).
  void recreate() {
    const memory::dims strides{1, 1}, dil{0, 0};
    const auto algo = dnnl::algorithm::convolution_direct;
    const memory::dims pad{pad_, pad_};
    dnnl::convolution_forward::desc d(dnnl::prop_kind::forward_training, algo, reqX_, reqW_, reqY_, strides, dil,
                                      pad, pad);
    dnnl::convolution_forward::primitive_desc pd(d, eng_);
    dnnl::convolution_forward p(pd);
    dnnl::convolution_backward_data::desc bd(algo, reqX_, reqW_, reqY_, strides, dil, pad, pad);
    dnnl::convolution_backward_data::primitive_desc bpd(bd, eng_, pd);
    dnnl::convolution_backward_data bp(bpd);
    dnnl::convolution_backward_weights::desc wd(algo, reqX_, reqW_, reqY_, strides, dil, pad, pad);
    dnnl::convolution_backward_weights::primitive_desc wpd(wd, eng_, pd);
    dnnl::convolution_backward_weights wp(wpd);
  }
  void setRecreateDescs(const ConvShape& s) {
    reqX_ = memory::desc({s.n, s.c, s.h, s.h}, memory::data_type::f32, Tag::any);
    reqW_ = memory::desc({s.o, s.c, s.k, s.k}, memory::data_type::f32, Tag::any);
    reqY_ = memory::desc({s.n, s.o, s.h, s.h}, memory::data_type::f32, Tag::any);
    pad_ = s.pad;
  }

 private:
  memory buffer(const memory::desc& d, int slot) {
    // 64-byte aligned like our own buffers (a std::vector's 16-byte alignment slows the JIT kernels).
    Tensor& buf = buffers_[slot];
    if (!buf.defined() || buf.nbytes() < d.get_size()) {
      buf = Tensor::empty({static_cast<int64_t>(d.get_size())}, DType::kBFloat16);  // 2-byte elements
    }
    return memory(d, eng_, buf.rawData());
  }
  memory in(const memory& user, const memory::desc& want, int slot) {
    if (want == user.get_desc()) return user;
    memory m = buffer(want, slot), u = user;
    dnnl::reorder(u, m).execute(stream_, u, m);
    return m;
  }
  memory out(const memory& user, const memory::desc& want, int slot) {
    return want == user.get_desc() ? user : buffer(want, slot);
  }
  void finish(memory inner, memory user) {
    if (inner.get_data_handle() != user.get_data_handle()) dnnl::reorder(inner, user).execute(stream_, inner, user);
  }

  dnnl::engine eng_;
  dnnl::stream stream_;
  memory::desc xPlain_, wPlain_, yPlain_, reqX_, reqW_, reqY_;
  int64_t pad_ = 0;
  dnnl::convolution_forward::primitive_desc fwdPd_;
  dnnl::convolution_backward_data::primitive_desc bwdDataPd_;
  dnnl::convolution_backward_weights::primitive_desc bwdWeightsPd_;
  dnnl::convolution_forward fwd_;
  dnnl::convolution_backward_data bwdData_;
  dnnl::convolution_backward_weights bwdWeights_;
  Tensor x_, w_, g_, y_, dx_, dw_;
  std::unordered_map<int, Tensor> buffers_;
};

// ---------------------------------------------------------------- convolution, through distgrad

void benchConv(const ConvShape& s, int reps) {
  const double gflop = 3 * s.gflopPerPass();
  tensor::Generator gen(3);
  Tensor x = tensor::normal({s.n, s.c, s.h, s.h}, 0, 1, gen).setRequiresGrad(true);
  Tensor w = tensor::normal({s.o, s.c, s.k, s.k}, 0, 0.1, gen).setRequiresGrad(true);
  Tensor g = tensor::normal({s.n, s.o, s.h, s.h}, 0, 1, gen);
  Conv2dOptions opts;
  opts.padding = {s.pad, s.pad};
  // The differentiable op + the autograd engine (the default layout).
  auto ours = [&] {
    Tensor y = conv2d(x, w, Tensor(), opts);
    auto grads = autograd::grad({y}, {x, w}, {g});
  };
  // Our raw kernels in each layout.
  kernels::Conv2dParams p;
  p.padding = {s.pad, s.pad};
  Tensor xd = x.detach(), wd = w.detach();
  auto kernelsIn = [&](kernels::ConvLayout layout) {
    return [&, layout] {
      Tensor y = kernels::conv2d(xd, wd, Tensor(), p, layout);
      Tensor dx = kernels::conv2dBackwardInput(g, wd, xd.shape(), p, layout);
      auto dw = kernels::conv2dBackwardWeight(g, xd, wd.shape(), p, false, layout);
    };
  };
  const std::vector<kernels::ConvLayout> layouts = {kernels::ConvLayout::kBlocked, kernels::ConvLayout::kPlain,
                                                    kernels::ConvLayout::kChannelsLast};
  std::vector<std::unique_ptr<DirectConv>> direct;
  std::vector<std::function<void()>> fns{ours};
  for (auto l : layouts) {
    direct.push_back(std::make_unique<DirectConv>(s, l));
    fns.push_back([d = direct.back().get()] { d->step(); });
    fns.push_back(kernelsIn(l));
  }
  auto t = interleaved(fns, reps);
  const std::map<std::string, std::string> common{{"shape", quoted(s.name())}, {"threads", "1"}, {"clock", clockName()},
                                                  {"passes", quoted("fwd+bwd_data+bwd_weights")}};
  auto with = [&](std::map<std::string, std::string> extra) {
    extra.insert(common.begin(), common.end());
    return extra;
  };
  // Direct baseline = the fastest direct layout (the best one can do with oneDNN from plain tensors).
  size_t bestDirect = 0;
  std::vector<Stats> directStats, kernelStats;
  for (size_t i = 0; i < layouts.size(); ++i) {
    directStats.push_back(statsOf(t[1 + 2 * i]));
    kernelStats.push_back(statsOf(t[2 + 2 * i]));
    if (directStats[i].median < directStats[bestDirect].median) bestDirect = i;
  }
  for (size_t i = 0; i < layouts.size(); ++i) {
    emit("conv2d", std::string("direct_onednn_") + layoutName(layouts[i]), "ms",
         statsOf(scaled(t[1 + 2 * i], 1e3)), with({{"gflops", num(gflop / directStats[i].median)}}));
    emit("conv2d", std::string("kernels_") + layoutName(layouts[i]), "ms",
         statsOf(scaled(t[2 + 2 * i], 1e3)),
         with({{"gflops", num(gflop / kernelStats[i].median)},
               {"ratio_vs_direct_same_layout", num(directStats[i].median / kernelStats[i].median)}}));
  }
  Stats oursStats = statsOf(t[0]);
  emit("conv2d", "conv2d_op_autograd", "ms", statsOf(scaled(t[0], 1e3)),
       with({{"gflops", num(gflop / oursStats.median)},
             {"layout", quoted(layoutName(kernels::chooseConvLayout(x.shape(), w.shape(), p)))},
             {"best_direct_layout", quoted(layoutName(layouts[bestDirect]))},
             {"ratio_vs_best_direct", num(directStats[bestDirect].median / oursStats.median)}}));

  // Primitive (re)creation cost per training step, with oneDNN's primitive cache warm.
  DirectConv rec(s, kernels::ConvLayout::kBlocked);
  rec.setRecreateDescs(s);
  auto tr = interleaved({[&] { rec.recreate(); }}, reps);
  emit("conv2d", "recreate_3_primitives_per_step", "us", statsOf(scaled(tr[0], 1e6)),
       with({{"step_ms_ours", num(oursStats.median * 1e3)},
             {"overhead_fraction", num(statsOf(tr[0]).median / oursStats.median)}}));
}


// Every ResNet-18 convolution shape for 32x32 inputs (ImageNet-style stem: 7x7/2 conv, then a 3x3/2 max
// pool), N=32, through our kernels in each layout: the data behind kDefaultConvLayout beyond the two
// layer shapes compared against direct oneDNN above.
void benchLayoutSweep(int reps) {
  struct Layer {
    const char* name;
    int64_t c, h, o, k, stride, pad;
  };
  const std::vector<Layer> layers = {
      {"stem_3to64_32x32_k7s2", 3, 32, 64, 7, 2, 3},      {"layer1_64_8x8_k3", 64, 8, 64, 3, 1, 1},
      {"layer2_down_64to128_8x8_k3s2", 64, 8, 128, 3, 2, 1}, {"layer2_shortcut_64to128_8x8_k1s2", 64, 8, 128, 1, 2, 0},
      {"layer2_128_4x4_k3", 128, 4, 128, 3, 1, 1},       {"layer3_down_128to256_4x4_k3s2", 128, 4, 256, 3, 2, 1},
      {"layer3_256_2x2_k3", 256, 2, 256, 3, 1, 1},       {"layer4_down_256to512_2x2_k3s2", 256, 2, 512, 3, 2, 1},
      {"layer4_512_1x1_k3", 512, 1, 512, 3, 1, 1},
  };
  const int64_t n = 32;
  const std::vector<kernels::ConvLayout> layouts = {kernels::ConvLayout::kBlocked, kernels::ConvLayout::kPlain,
                                                    kernels::ConvLayout::kChannelsLast};
  for (const auto& l : layers) {
    tensor::Generator gen(5);
    kernels::Conv2dParams p;
    p.stride = {l.stride, l.stride};
    p.padding = {l.pad, l.pad};
    Tensor x = tensor::normal({n, l.c, l.h, l.h}, 0, 1, gen), w = tensor::normal({l.o, l.c, l.k, l.k}, 0, 0.1, gen);
    const Shape yShape = kernels::conv2dOutputShape(x.shape(), w.shape(), p);
    Tensor g = tensor::normal(yShape, 0, 1, gen);
    const double gflop = 3 * 2.0 * n * l.o * yShape[2] * yShape[3] * l.c * l.k * l.k / 1e9;
    std::vector<std::function<void()>> fns;
    for (auto layout : layouts) {
      fns.push_back([&, layout] {
        Tensor y = kernels::conv2d(x, w, Tensor(), p, layout);
        kernels::Conv2dGrads grads = kernels::conv2dBackward(g, x, w, p, true, true, false, layout);
      });
    }
    auto t = interleaved(fns, reps);
    double best = 1e30;
    for (const auto& v : t) best = std::min(best, statsOf(v).median);
    for (size_t i = 0; i < layouts.size(); ++i) {
      Stats st = statsOf(t[i]);
      emit("conv2d_layout_sweep", std::string("kernels_") + layoutName(layouts[i]), "ms", statsOf(scaled(t[i], 1e3)),
           {{"shape", quoted(l.name)}, {"batch", std::to_string(n)}, {"threads", "1"}, {"clock", clockName()},
            {"passes", quoted("fwd+bwd_data+bwd_weights")}, {"gflops", num(gflop / st.median)},
            {"auto_picks", quoted(layoutName(kernels::chooseConvLayout(x.shape(), w.shape(), p)))},
            {"time_vs_best_layout", num(st.median / best)}});
    }
  }
}

}  // namespace
}  // namespace distgrad

int main(int argc, char** argv) {
  using namespace distgrad;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--wall") == 0) gWallClock = true;
  }
  tensor::setNumThreads(1);
  benchSgemm(quick ? 3 : 15);
  benchConv({32, 64, 8, 64, 3, 1}, quick ? 3 : 30);
  benchConv({32, 128, 4, 128, 3, 1}, quick ? 3 : 30);
  distgrad::benchLayoutSweep(quick ? 2 : 10);
  return 0;
}
