// Vectorisable float32 exp / tanh / sigmoid / normal CDF for elementwise loops.
//
// glibc's expf/tanhf are scalar calls, so a loop over them never vectorises (tanhf alone costs ~40x a
// vectorised add). These versions are branch-free straight-line code that GCC vectorises with AVX2:
// Cephes-style range reduction and polynomials, accurate to ~1e-7 relative for exp, ~2 ulp for tanh and
// ~6e-6 relative for the normal CDF (Cephes' erff/erfcf polynomials; up to ~1e-5 below x = -9, where
// rounding of x^2 inside e^{-x^2/2} dominates).
// Special values follow libm: exp overflows to inf above ~88.72, underflows to 0 below ~-87.34 (float
// subnormal results are flushed to 0), NaN propagates.
//
// Why no clamps or ternaries: GCC threads jumps through `x < lo ? lo : x` (the clamped path folds to a
// constant), which leaves the polynomial in a conditional block and blocks if-conversion ("control flow
// in loop"). Range handling is therefore done at the end with bitwise selects.
// Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace distgrad::tensor::kernels::vecmath {

// c ? a : b without a branch the optimiser could thread.
inline float select(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & m) | (std::bit_cast<uint32_t>(b) & ~m));
}

inline float expf(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  constexpr float kOverflow = 88.72283905206835f;
  constexpr float kUnderflow = -87.33654475055310f;
  // exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2] (ln2 split in two parts so
  // n * ln2 is exact).
  const float shifted = x * 1.44269504088896341f + kMagic;
  const float n = shifted - kMagic;
  const int32_t ni = static_cast<int32_t>(std::bit_cast<uint32_t>(shifted) - 0x4B400000u);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // n reaches 128 just below the overflow threshold: scale by 2^min(n,127) * 2^(n - min(n,127)).
  const int32_t nLow = ni < 127 ? ni : 127;
  float y = p * std::bit_cast<float>((static_cast<uint32_t>(nLow) + 127u) << 23) *
            std::bit_cast<float>((static_cast<uint32_t>(ni - nLow) + 127u) << 23);
  y = select(x > kOverflow, std::numeric_limits<float>::infinity(), y);
  y = select(x < kUnderflow, 0.0f, y);
  return select(x != x, x, y);
}

inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

inline float tanhf(float x) {
  // Cephes tanhf: an odd polynomial for |x| < 0.625, 1 - 2/(e^{2|x|} + 1) with the sign restored beyond.
  const float ax = select(x < 0.0f, -x, x);
  const float big = 1.0f - 2.0f / (expf(2.0f * ax) + 1.0f);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float signedBig = select(x < 0.0f, -big, big);
  return select(ax < 0.625f, small, signedBig);
}

namespace detail {
// Horner evaluation of c[0] x^(N-1) + ... + c[N-1].
template <size_t N>
inline float polynomial(float x, const float (&c)[N]) {
  float p = c[0];
  for (size_t i = 1; i < N; ++i) p = p * x + c[i];
  return p;
}
}  // namespace detail

// Phi(x) = P(Z <= x) for a standard normal Z, i.e. 0.5 * erfc(-x / sqrt 2). Small |x| uses erf's odd
// polynomial; beyond, erfc(z) = e^{-z^2} / z * P(1/z^2) keeps full relative accuracy in the lower tail
// (GELU's negative side) instead of cancelling in 1 - erf.
inline float normalCdf(float x) {
  static constexpr float kErfSmall[] = {7.853861353153693e-5f, -8.010193625184903e-4f, 5.188327685732524e-3f,
                                        -2.685381193529856e-2f, 1.128358514861418e-1f, -3.761262582423300e-1f,
                                        1.128379165726710e+0f};
  static constexpr float kErfcMid[] = {2.326819970068386e-2f, -1.387039388740657e-1f, 3.687424674597105e-1f,
                                       -5.824733027278666e-1f, 6.210004621745983e-1f, -4.944515323274145e-1f,
                                       3.404879937665872e-1f, -2.741127028184656e-1f, 5.638259427386472e-1f};
  static constexpr float kErfcLarge[] = {-1.047766399936249e+1f, 1.297719955372516e+1f, -7.495518717768503e+0f,
                                         2.921019019210786e+0f, -1.015265279202700e+0f, 4.218463358204948e-1f,
                                         -2.820767439740514e-1f, 5.641895067754075e-1f};
  const float t = x * 0.70710678118654752f;
  const float z = select(t < 0.0f, -t, t);
  // |t| < 1: 0.5 + 0.5 erf(t)
  const float small = 0.5f + 0.5f * (t * detail::polynomial(t * t, kErfSmall));
  // otherwise 0.5 erfc(|t|), mirrored for t > 0
  const float q = 1.0f / z;
  const float q2 = q * q;
  const float p = select(z < 2.0f, detail::polynomial(q2, kErfcMid), detail::polynomial(q2, kErfcLarge));
  const float tail = 0.5f * expf(-z * z) * q * p;
  const float large = select(t > 0.0f, 1.0f - tail, tail);
  // (Cephes switches at |t| = 1: below it, 1 - erf loses nothing since erfc(|t|) >= 0.157.)
  return select(z < 1.0f, small, select(x != x, x, large));
}

}  // namespace distgrad::tensor::kernels::vecmath
