// Per-plane building blocks of the CPU KCLA kernels. A plane (H x W) is
// copied into a zero-padded scratch buffer of row stride Wp = W + 2, so the
// 3x3 depthwise convolution and its gradients become flat, branch-free
// loops over H * Wp elements that vectorise for any plane size (the two
// extra columns per row are computed and discarded).
#ifndef KCLA_PLANE_HPP
#define KCLA_PLANE_HPP
#include <algorithm>
#include <cstdint>
#include <vector>

template <typename T>
struct PaddedPlane {
  int64_t H, W, Wp;
  std::vector<T> pad;  // (H + 2) x Wp, plus 2 elements of slack
  std::vector<T> out;  // H x Wp
  PaddedPlane(int64_t h, int64_t w)
      : H(h), W(w), Wp(w + 2), pad((h + 2) * (w + 2) + 2, T(0)),
        out(h * (w + 2), T(0)) {}
  // interior element (i, j) of the padded input
  T* row(int64_t i) { return pad.data() + (i + 1) * Wp + 1; }
};

// p.out[i * Wp + j] = sum_{k,l} w9[3k+l] * p.pad[(i + k) * Wp + j + l],
// i.e. the zero-padded 3x3 convolution of the plane held in p.pad.
template <typename T>
inline void conv3x3_padded(PaddedPlane<T>& p, const T* w9) {
  const int64_t n = p.H * p.Wp;
  T* __restrict__ out = p.out.data();
  std::fill(out, out + n, T(0));
  for (int k = 0; k < 3; ++k) {
    for (int l = 0; l < 3; ++l) {
      const T wk = w9[3 * k + l];
      const T* __restrict__ src = p.pad.data() + k * p.Wp + l;
      for (int64_t i = 0; i < n; ++i) out[i] += wk * src[i];
    }
  }
}

// gw9[3k+l] += sum_{i,j} g[i * Wp + j] * p.pad[(i + k) * Wp + j + l], for g
// in the H x Wp layout with its two extra columns zero.
template <typename T, typename Acc>
inline void conv3x3_weight_grad_padded(const T* g, const PaddedPlane<T>& p,
                                       Acc* gw9) {
  const int64_t n = p.H * p.Wp;
  for (int k = 0; k < 3; ++k) {
    for (int l = 0; l < 3; ++l) {
      const T* __restrict__ src = p.pad.data() + k * p.Wp + l;
      Acc sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += Acc(g[i]) * Acc(src[i]);
      gw9[3 * k + l] += sum;
    }
  }
}

// The 3x3 kernel rotated by 180 degrees: convolving with it is the transpose.
template <typename T>
inline void flip3x3(const T* w9, T* flipped) {
  for (int i = 0; i < 9; ++i) flipped[i] = w9[8 - i];
}

#endif  // KCLA_PLANE_HPP
