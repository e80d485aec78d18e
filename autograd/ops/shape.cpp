// View and join differentiable ops (autograd/ops.h).
//
// Views are new TensorImpls over the input's storage (kernels::asStrided), so writes through either are
// visible in both. Each view op is written once as a raw geometry function (no recording) used by both the
// forward and, where the backward needs "the same view of a zero buffer", the backward.
#include <algorithm>
#include <numeric>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/shape_kernels.h"

namespace distgrad {
namespace kernels = tensor::kernels;
using tensor::shapeStr;

namespace {

// Views only rewrite metadata, so they accept tensors on any device; the copying paths (reshape of a
// non-viewable layout, contiguous, clone, cat) check for CPU inside the kernels.
void requireInput(const Tensor& a, const char* op) { DG_CHECK(a.defined(), op, ": input is an undefined tensor"); }

// Resolves one -1 in `shape` against numel; names `op` in errors.
Shape inferShape(const Shape& shape, int64_t numel, const char* op, const Shape& from) {
  Shape out = shape;
  int64_t inferAt = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      DG_CHECK(inferAt < 0, op, ": only one dimension can be -1, got ", shapeStr(shape));
      inferAt = static_cast<int64_t>(i);
    } else {
      DG_CHECK(shape[i] >= 0, op, ": invalid size ", shape[i], " in shape ", shapeStr(shape));
      known *= shape[i];
    }
  }
  if (inferAt >= 0) {
    DG_CHECK(known != 0, op, ": cannot infer the -1 in ", shapeStr(shape), " when the other sizes multiply to 0");
    DG_CHECK(numel % known == 0, op, ": shape ", shapeStr(shape), " is invalid for input of shape ", shapeStr(from),
             " (", numel, " elements are not divisible by ", known, ")");
    out[inferAt] = numel / known;
  } else {
    DG_CHECK(known == numel, op, ": shape ", shapeStr(shape), " (", known, " elements) is invalid for input of shape ",
             shapeStr(from), " (", numel, " elements)");
  }
  return out;
}

// ---- raw geometry (no recording) ----

Tensor rawTranspose(const Tensor& a, int64_t d0, int64_t d1) {
  Shape shape = a.shape(), strides = a.strides();
  std::swap(shape[d0], shape[d1]);
  std::swap(strides[d0], strides[d1]);
  return kernels::asStrided(a, shape, strides, a.offset());
}

Tensor rawPermute(const Tensor& a, const std::vector<int64_t>& perm) {
  Shape shape(perm.size()), strides(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    shape[i] = a.shape()[perm[i]];
    strides[i] = a.strides()[perm[i]];
  }
  return kernels::asStrided(a, shape, strides, a.offset());
}

// dim wrapped, 0 <= start <= start + length*step... : the validated slice geometry.
Tensor rawSlice(const Tensor& a, int64_t dim, int64_t start, int64_t length, int64_t step) {
  Shape shape = a.shape(), strides = a.strides();
  shape[dim] = length;
  const int64_t offset = a.offset() + (length > 0 ? start * strides[dim] : 0);
  strides[dim] *= step;
  return kernels::asStrided(a, shape, strides, offset);
}

Tensor rawSelect(const Tensor& a, int64_t dim, int64_t index) {
  Shape shape = a.shape(), strides = a.strides();
  const int64_t offset = a.offset() + index * strides[dim];
  shape.erase(shape.begin() + dim);
  strides.erase(strides.begin() + dim);
  return kernels::asStrided(a, shape, strides, offset);
}

// A reshape of `g` to `shape`: a view when possible, else a contiguous copy (used by backward formulas).
Tensor rawReshape(const Tensor& g, const Shape& shape) {
  if (auto strides = kernels::viewStrides(g.shape(), g.strides(), shape)) {
    return kernels::asStrided(g, shape, *strides, g.offset());
  }
  Tensor c = kernels::contiguous(g);
  return kernels::asStrided(c, shape, tensor::contiguousStrides(shape), c.offset());
}

// Gradient of a view that picks part of the input: zeros of the input's shape with `g` written through the
// same view of them.
template <typename MakeView>
Tensor scatterIntoZeros(const Tensor& g, const Shape& inputShape, MakeView makeView) {
  Tensor out = Tensor::zeros(inputShape, g.dtype(), g.device());
  kernels::copyInto(makeView(out), g, "view backward");
  return out;
}

Tensor recordReshapeLike(const char* name, const Tensor& a, Tensor out) {
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp(name, {a}, out, [shape = a.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
    return std::vector<Tensor>{rawReshape(g[0], shape)};
  });
}

}  // namespace

Tensor view(const Tensor& a, const Shape& shape) {
  requireInput(a, "view");
  const Shape target = inferShape(shape, a.numel(), "view", a.shape());
  auto strides = kernels::viewStrides(a.shape(), a.strides(), target);
  DG_CHECK(strides.has_value(), "view: cannot view a tensor of shape ", shapeStr(a.shape()), " and strides ",
           shapeStr(a.strides()), " as ", shapeStr(target),
           " without copying (its memory layout does not allow it); use reshape, which copies when needed");
  return recordReshapeLike("ViewBackward", a, kernels::asStrided(a, target, *strides, a.offset()));
}

Tensor reshape(const Tensor& a, const Shape& shape) {
  requireInput(a, "reshape");
  const Shape target = inferShape(shape, a.numel(), "reshape", a.shape());
  if (auto strides = kernels::viewStrides(a.shape(), a.strides(), target)) {
    return recordReshapeLike("ViewBackward", a, kernels::asStrided(a, target, *strides, a.offset()));
  }
  Tensor copy = kernels::contiguous(a);
  return recordReshapeLike("ReshapeBackward", a,
                           kernels::asStrided(copy, target, tensor::contiguousStrides(target), copy.offset()));
}

Tensor transpose(const Tensor& a, int64_t dim0, int64_t dim1) {
  requireInput(a, "transpose");
  if (a.dim() == 0) {
    tensor::wrapDim(dim0, 0, "transpose");
    tensor::wrapDim(dim1, 0, "transpose");
    return recordReshapeLike("TransposeBackward", a, kernels::asStrided(a, {}, {}, a.offset()));
  }
  const int64_t d0 = tensor::wrapDim(dim0, a.dim(), "transpose");
  const int64_t d1 = tensor::wrapDim(dim1, a.dim(), "transpose");
  Tensor out = rawTranspose(a, d0, d1);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("TransposeBackward", {a}, out,
                            [d0, d1](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{rawTranspose(g[0], d0, d1)};
                            });
}

Tensor permute(const Tensor& a, const std::vector<int64_t>& dims) {
  requireInput(a, "permute");
  const int64_t nd = a.dim();
  DG_CHECK(static_cast<int64_t>(dims.size()) == nd, "permute: got ", dims.size(), " dims ", shapeStr(dims),
           " for a ", nd, "-d tensor of shape ", shapeStr(a.shape()));
  std::vector<int64_t> perm(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    perm[i] = tensor::wrapDim(dims[i], nd, "permute");
    DG_CHECK(!seen[perm[i]], "permute: dim ", dims[i], " repeats in ", shapeStr(dims), " (expected a permutation)");
    seen[perm[i]] = true;
  }
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[perm[i]] = static_cast<int64_t>(i);
  Tensor out = rawPermute(a, perm);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("PermuteBackward", {a}, out,
                            [inverse](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{rawPermute(g[0], inverse)};
                            });
}

Tensor narrow(const Tensor& a, int64_t dim, int64_t start, int64_t length) {
  requireInput(a, "narrow");
  DG_CHECK(a.dim() > 0, "narrow: cannot narrow a 0-d tensor");
  const int64_t d = tensor::wrapDim(dim, a.dim(), "narrow");
  const int64_t size = a.shape()[d];
  if (start < 0) start += size;  // like PyTorch, a negative start counts from the end
  DG_CHECK(start >= 0 && start <= size, "narrow: start ", start, " out of range for dim ", d, " of size ", size);
  DG_CHECK(length >= 0 && start + length <= size, "narrow: start (", start, ") + length (", length,
           ") exceeds dim ", d, " of size ", size, " (shape ", shapeStr(a.shape()), ")");
  Tensor out = rawSlice(a, d, start, length, 1);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("NarrowBackward", {a}, out,
                            [d, start, length, shape = a.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{scatterIntoZeros(
                                  g[0], shape, [&](const Tensor& z) { return rawSlice(z, d, start, length, 1); })};
                            });
}

Tensor slice(const Tensor& a, int64_t dim, int64_t start, int64_t end, int64_t step) {
  requireInput(a, "slice");
  DG_CHECK(a.dim() > 0, "slice: cannot slice a 0-d tensor");
  DG_CHECK(step > 0, "slice: step must be > 0, got ", step);
  const int64_t d = tensor::wrapDim(dim, a.dim(), "slice");
  const int64_t size = a.shape()[d];
  // Python slicing rules: negative bounds count from the end, then clamp into [0, size].
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<int64_t>(start, 0, size);
  end = std::clamp<int64_t>(end, start, size);
  const int64_t length = (end - start + step - 1) / step;
  Tensor out = rawSlice(a, d, start, length, step);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("SliceBackward", {a}, out,
                            [d, start, length, step, shape = a.shape()](const std::vector<Tensor>& g,
                                                                        const autograd::Node&) {
                              return std::vector<Tensor>{scatterIntoZeros(
                                  g[0], shape, [&](const Tensor& z) { return rawSlice(z, d, start, length, step); })};
                            });
}

Tensor select(const Tensor& a, int64_t dim, int64_t index) {
  requireInput(a, "select");
  DG_CHECK(a.dim() > 0, "select: cannot select from a 0-d tensor");
  const int64_t d = tensor::wrapDim(dim, a.dim(), "select");
  const int64_t size = a.shape()[d];
  DG_CHECK(index >= -size && index < size, "select: index ", index, " out of range for dim ", d, " of size ", size,
           " (shape ", shapeStr(a.shape()), ")");
  if (index < 0) index += size;
  Tensor out = rawSelect(a, d, index);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("SelectBackward", {a}, out,
                            [d, index, shape = a.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{scatterIntoZeros(
                                  g[0], shape, [&](const Tensor& z) { return rawSelect(z, d, index); })};
                            });
}

Tensor expand(const Tensor& a, const Shape& shape) {
  requireInput(a, "expand");
  const int64_t nd = static_cast<int64_t>(shape.size());
  DG_CHECK(nd >= a.dim(), "expand: the target shape ", shapeStr(shape), " has fewer dims than the input ",
           shapeStr(a.shape()));
  const int64_t lead = nd - a.dim();
  Shape outShape(nd), strides(nd);
  for (int64_t i = 0; i < nd; ++i) {
    if (i < lead) {
      DG_CHECK(shape[i] >= 0, "expand: size ", shape[i], " at new leading dim ", i, " of ", shapeStr(shape),
               " (-1 is only allowed for existing dims)");
      outShape[i] = shape[i];
      strides[i] = 0;
      continue;
    }
    const int64_t have = a.shape()[i - lead];
    const int64_t want = shape[i] == -1 ? have : shape[i];
    DG_CHECK(want == have || have == 1, "expand: cannot expand ", shapeStr(a.shape()), " to ", shapeStr(shape),
             " (dim ", i, ": size ", have, " must be 1 or equal ", want, ")");
    DG_CHECK(want >= 0, "expand: invalid size ", want, " in ", shapeStr(shape));
    outShape[i] = want;
    strides[i] = (have == 1 && want != 1) ? 0 : a.strides()[i - lead];
  }
  Tensor out = kernels::asStrided(a, outShape, strides, a.offset());
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("ExpandBackward", {a}, out,
                            [shape = a.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{sumToShape(g[0], shape)};
                            });
}

Tensor squeeze(const Tensor& a) {
  requireInput(a, "squeeze");
  Shape shape, strides;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.shape()[d] == 1) continue;
    shape.push_back(a.shape()[d]);
    strides.push_back(a.strides()[d]);
  }
  return recordReshapeLike("SqueezeBackward", a, kernels::asStrided(a, shape, strides, a.offset()));
}

Tensor squeeze(const Tensor& a, int64_t dim) {
  requireInput(a, "squeeze");
  Shape shape = a.shape(), strides = a.strides();
  if (a.dim() == 0) {
    tensor::wrapDim(dim, 0, "squeeze");
  } else {
    const int64_t d = tensor::wrapDim(dim, a.dim(), "squeeze");
    // Like PyTorch, squeezing a dim whose size is not 1 leaves the shape unchanged.
    if (shape[d] == 1) {
      shape.erase(shape.begin() + d);
      strides.erase(strides.begin() + d);
    }
  }
  return recordReshapeLike("SqueezeBackward", a, kernels::asStrided(a, shape, strides, a.offset()));
}

Tensor unsqueeze(const Tensor& a, int64_t dim) {
  requireInput(a, "unsqueeze");
  const int64_t d = tensor::wrapDim(dim, a.dim() + 1, "unsqueeze");
  Shape shape = a.shape(), strides = a.strides();
  const int64_t stride = d < a.dim() ? shape[d] * strides[d] : 1;
  shape.insert(shape.begin() + d, 1);
  strides.insert(strides.begin() + d, stride);
  return recordReshapeLike("UnsqueezeBackward", a, kernels::asStrided(a, shape, strides, a.offset()));
}

Tensor flatten(const Tensor& a, int64_t startDim, int64_t endDim) {
  requireInput(a, "flatten");
  if (a.dim() == 0) {
    tensor::wrapDim(startDim, 0, "flatten");
    tensor::wrapDim(endDim, 0, "flatten");
    return reshape(a, {1});
  }
  const int64_t s = tensor::wrapDim(startDim, a.dim(), "flatten");
  const int64_t e = tensor::wrapDim(endDim, a.dim(), "flatten");
  DG_CHECK(s <= e, "flatten: startDim (", startDim, ") must not come after endDim (", endDim, ") for shape ",
           shapeStr(a.shape()));
  Shape shape(a.shape().begin(), a.shape().begin() + s);
  int64_t merged = 1;
  for (int64_t d = s; d <= e; ++d) merged *= a.shape()[d];
  shape.push_back(merged);
  shape.insert(shape.end(), a.shape().begin() + e + 1, a.shape().end());
  return reshape(a, shape);
}

Tensor contiguous(const Tensor& a) {
  requireInput(a, "contiguous");
  if (a.isContiguous()) return a;
  return clone(a);
}

Tensor clone(const Tensor& a) {
  requireInput(a, "clone");
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  kernels::copyInto(out, a, "clone");
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("CloneBackward", {a}, out, [](const std::vector<Tensor>& g, const autograd::Node&) {
    return std::vector<Tensor>{g[0]};
  });
}

Tensor toDevice(const Tensor& a, Device device) {
  requireInput(a, "toDevice");
  if (a.device() == device) return a;
  Tensor out = a.to(device);
  if (!autograd::anyRequiresGrad({a})) return out;
  const Device from = a.device();
  return autograd::recordOp("ToDeviceBackward", {a}, out, [from](const std::vector<Tensor>& g, const autograd::Node&) {
    return std::vector<Tensor>{g[0].to(from)};
  });
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  DG_CHECK(!tensors.empty(), "cat: expected at least one tensor");
  DG_CHECK(tensors[0].defined(), "cat: tensor 0 is undefined");
  DG_CHECK(tensors[0].dim() > 0, "cat: cannot concatenate 0-d tensors (unsqueeze them or use stack)");
  const int64_t d = tensor::wrapDim(dim, tensors[0].dim(), "cat");
  Tensor out = kernels::cat(tensors, d, "cat");
  std::vector<int64_t> sizes;
  for (const auto& t : tensors) sizes.push_back(t.shape()[d]);
  return autograd::recordOp("CatBackward", tensors, out,
                            [d, sizes](const std::vector<Tensor>& g, const autograd::Node& self) {
                              std::vector<Tensor> grads(sizes.size());
                              int64_t start = 0;
                              for (size_t i = 0; i < sizes.size(); ++i) {
                                if (self.needsInputGrad(i)) grads[i] = rawSlice(g[0], d, start, sizes[i], 1);
                                start += sizes[i];
                              }
                              return grads;
                            });
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  DG_CHECK(!tensors.empty(), "stack: expected at least one tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    DG_CHECK(tensors[i].defined(), "stack: tensor ", i, " is undefined");
    DG_CHECK(tensors[i].shape() == tensors[0].shape(), "stack: tensor ", i, " has shape ",
             shapeStr(tensors[i].shape()), " but tensor 0 has shape ", shapeStr(tensors[0].shape()),
             " (all must match)");
  }
  const int64_t d = tensor::wrapDim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> expanded;
  expanded.reserve(tensors.size());
  for (const auto& t : tensors) expanded.push_back(unsqueeze(t, d));
  return cat(expanded, d);
}

std::vector<Tensor> split(const Tensor& a, int64_t splitSize, int64_t dim) {
  requireInput(a, "split");
  DG_CHECK(a.dim() > 0, "split: cannot split a 0-d tensor");
  DG_CHECK(splitSize > 0, "split: splitSize must be > 0, got ", splitSize);
  const int64_t d = tensor::wrapDim(dim, a.dim(), "split");
  const int64_t size = a.shape()[d];
  std::vector<Tensor> pieces;
  std::vector<int64_t> starts;
  for (int64_t start = 0; start < size || (size == 0 && pieces.empty()); start += splitSize) {
    const int64_t len = std::min(splitSize, size - start);
    pieces.push_back(rawSlice(a, d, start, len, 1));
    starts.push_back(start);
  }
  // One node for all pieces: its backward writes every piece's gradient into one buffer (the engine
  // zero-fills pieces that got none), instead of one full-size zero buffer per piece.
  autograd::recordOp("SplitBackward", {a}, pieces,
                     [d](const std::vector<Tensor>& g, const autograd::Node&) {
                       std::vector<Tensor> parts(g.begin(), g.end());
                       return std::vector<Tensor>{kernels::cat(parts, d, "split backward")};
                     });
  return pieces;
}

std::vector<Tensor> chunk(const Tensor& a, int64_t chunks, int64_t dim) {
  requireInput(a, "chunk");
  DG_CHECK(chunks > 0, "chunk: chunks must be > 0, got ", chunks);
  DG_CHECK(a.dim() > 0, "chunk: cannot chunk a 0-d tensor");
  const int64_t d = tensor::wrapDim(dim, a.dim(), "chunk");
  const int64_t size = a.shape()[d];
  // Like PyTorch: pieces of ceil(size / chunks), so there may be fewer than `chunks` pieces.
  const int64_t splitSize = std::max<int64_t>(1, (size + chunks - 1) / chunks);
  return split(a, splitSize, d);
}

}  // namespace distgrad
