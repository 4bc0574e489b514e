// The one-call kernels' passes (training forward and backward, and the
// inference op's branch) for small float32 planes, eight consecutive
// planes at a time, one per vector lane (AVX2 + FMA). A 7x7 plane fills
// six 8-wide vectors and leaves one value over, and each of its sums ends
// in a horizontal reduction; with a plane per lane, every pixel is one
// vector, the 3x3 convolutions read a zero-bordered grid without masks,
// and one vector holds the eight planes' sums. The planes' values go in
// and out through 8x8 transposes in registers, their bit masks through 8x8
// bit transposes; the element-wise work with per-plane scalars stays in
// the planes' own layout. Also relu_pool's plane loops (any plane size),
// in 8-value chunks with each mask byte straight from a vector compare.
//
// Part of kcla_branch_kernels.hpp (its namespace, after its operand
// structs), in the AVX2 copy only (KCLA_CPU_LANES); the includer brings
// <immintrin.h>. The group functions take the group's first plane p0 and,
// where the caller keeps it, the group's conv in lanes (H * W vectors).

// r[k] <- lane k of r[0..7] (an 8x8 transpose).
inline void transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]);
  const __m256 t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]);
  const __m256 t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]);
  const __m256 t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]);
  const __m256 t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44);
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44);
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44);
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44);
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Bit c of byte r <-> bit r of byte c (an 8x8 bit-matrix transpose).
inline uint64_t transpose_bits8x8(uint64_t x) {
  uint64_t t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAULL;
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCULL;
  x ^= t ^ (t << 14);
  t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ULL;
  return x ^ t ^ (t << 28);
}

// A lane group's planes p0 + j: their channel c[j], sample b[j] and index
// n[j] into (B, G) tensors (two divisions per group, not per value read).
struct Group {
  int64_t p0, c[8], b[8], n[8];
  Group(const Dims& dm, int64_t first) : p0(first) {
    int64_t bj = first / dm.C, cj = first % dm.C;
    for (int64_t j = 0; j < 8; ++j) {
      c[j] = cj;
      b[j] = bj;
      n[j] = bj * dm.G + cj / dm.d;
      if (++cj == dm.C) {
        cj = 0;
        ++bj;
      }
    }
  }
  // planes j, j + 1, ... in the same (sample, head) as plane j
  int64_t run(int64_t j) const {
    int64_t k = j + 1;
    while (k < 8 && n[k] == n[j]) ++k;
    return k - j;
  }
  // a vector of f(j) in lane j
  template <typename F>
  __m256 lanes(const F& f) const {
    alignas(32) float v[8];
    for (int64_t j = 0; j < 8; ++j) v[j] = f(j);
    return _mm256_load_ps(v);
  }
};

// Per-thread scratch of the lane kernels for one plane size; the grids'
// borders are zero and stay so (only cells grid[i] are written).
struct LaneScratch {
  int64_t H, W, hw;
  std::vector<int32_t> grid;     // hw: pixel i's cell in the grid
  std::vector<int32_t> dense;    // hw: i
  std::vector<float> agg, grad;  // (H + 2) x (W + 2) cells of 8 lanes
  std::vector<float> conv, go, y, ga;  // hw x 8 lanes
  std::vector<float> y_planes, ga_planes, x_rec;  // 8 planes of hw
  std::vector<float> zeros;      // hw x 8: an absent grad_u_next
  std::vector<float> gu;         // hw x 8: grad_u where it is not wanted
  std::vector<uint8_t> on;       // hw: bit j = plane j's mask bit
  LaneScratch(int64_t h, int64_t w)
      : H(h), W(w), hw(h * w), grid(hw), dense(hw),
        agg((h + 2) * (w + 2) * 8, 0.f), grad(agg.size(), 0.f),
        conv(hw * 8), go(hw * 8), y(hw * 8), ga(hw * 8), y_planes(hw * 8),
        ga_planes(hw * 8), x_rec(hw * 8), zeros(hw * 8, 0.f), gu(hw * 8),
        on(hw) {
    for (int64_t i = 0; i < hw; ++i) {
      grid[i] = int32_t((i / W + 1) * (W + 2) + i % W + 1);
      dense[i] = int32_t(i);
    }
  }
};

// This thread's LaneScratch for dm's plane size. Not inlined: GCC would
// recompute an inlined thread_local's address (a call) inside loops.
__attribute__((noinline)) inline LaneScratch& lane_scratch(const Dims& dm) {
  thread_local std::optional<LaneScratch> s;
  if (!s || s->H != dm.H || s->W != dm.W) s.emplace(dm.H, dm.W);
  return *s;
}

// dst cell off[i] (8 lanes) = pixel i of the 8 planes at src (hw apart),
// times scale.
inline void planes_to_lanes(const float* src, int64_t hw, const int32_t* off,
                            __m256 scale, float* dst) {
  int64_t i0 = 0;
  for (; i0 + 8 <= hw; i0 += 8) {
    __m256 r[8];
    for (int64_t j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + j * hw + i0);
    transpose8x8(r);
    for (int64_t k = 0; k < 8; ++k) {
      _mm256_storeu_ps(dst + off[i0 + k] * 8, _mm256_mul_ps(r[k], scale));
    }
  }
  alignas(32) float s[8];
  _mm256_store_ps(s, scale);
  for (int64_t i = i0; i < hw; ++i) {
    for (int64_t j = 0; j < 8; ++j) {
      dst[off[i] * 8 + j] = src[j * hw + i] * s[j];
    }
  }
}

// The inverse for dense lanes: pixel i of plane j (at dst + j * hw) =
// src[8 i + j].
inline void lanes_to_planes(const float* src, int64_t hw, float* dst) {
  int64_t i0 = 0;
  for (; i0 + 8 <= hw; i0 += 8) {
    __m256 r[8];
    for (int64_t k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(src + (i0 + k) * 8);
    transpose8x8(r);
    for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(dst + j * hw + i0, r[j]);
  }
  for (int64_t i = i0; i < hw; ++i) {
    for (int64_t j = 0; j < 8; ++j) dst[j * hw + i] = src[i * 8 + j];
  }
}

// on[i] (bit j: plane j) -> the 8 planes' bit masks at mask (bytes apart),
// in pack_bits' layout.
inline void pack_lane_bits(const uint8_t* on, int64_t hw, int64_t bytes,
                           uint8_t* mask) {
  for (int64_t b = 0; b < bytes; ++b) {
    uint64_t x = 0;
    for (int64_t k = 0; k < 8 && 8 * b + k < hw; ++k) {
      x |= uint64_t(on[8 * b + k]) << (8 * k);
    }
    x = transpose_bits8x8(x);
    for (int64_t j = 0; j < 8; ++j) mask[j * bytes + b] = uint8_t(x >> (8 * j));
  }
}

// The inverse of pack_lane_bits.
inline void unpack_lane_bits(const uint8_t* mask, int64_t hw, int64_t bytes,
                             uint8_t* on) {
  for (int64_t b = 0; b < bytes; ++b) {
    uint64_t x = 0;
    for (int64_t j = 0; j < 8; ++j) {
      x |= uint64_t(mask[j * bytes + b]) << (8 * j);
    }
    x = transpose_bits8x8(x);
    for (int64_t k = 0; k < 8 && 8 * b + k < hw; ++k) {
      on[8 * b + k] = uint8_t(x >> (8 * k));
    }
  }
}

// All-ones in the lanes whose bit is set in `bits`, else zero.
inline __m256 lane_mask(uint8_t bits) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i v = _mm256_and_si256(_mm256_set1_epi32(bits), lane_bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, lane_bit));
}

// relu_pool's planes in the AVX2 copy (float), eight values per vector,
// each chunk's mask byte from one compare (pack_bits' layout); a plane's
// last values short of a chunk (7x7: one) in scalar code.

// relu_pool_plane<float, Residual, Affine, Mask> with the plane's bit mask
// into bits (where Mask); returns the plane's sum.
template <bool Residual, bool Affine, bool Mask>
inline float relu_pool_chunks(float* v, const float* res, float sc, float sh,
                              uint8_t* bits, int64_t n) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 vsc = _mm256_set1_ps(sc), vsh = _mm256_set1_ps(sh);
  __m256 sum = zero;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_loadu_ps(v + i);
    if (Affine) a = _mm256_fmadd_ps(vsc, a, vsh);
    if (Residual) a = _mm256_add_ps(a, _mm256_loadu_ps(res + i));
    const __m256 r = _mm256_max_ps(zero, a);  // NaN stays NaN, as std::max
    _mm256_storeu_ps(v + i, r);
    sum = _mm256_add_ps(sum, r);
    if (Mask) {
      bits[i / 8] = uint8_t(
          _mm256_movemask_ps(_mm256_cmp_ps(r, zero, _CMP_GT_OQ)));
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0;
  for (float l : lanes) total += l;
  if (i < n) {
    uint8_t byte = 0;
    for (int64_t k = 0; i + k < n; ++k) {
      float a = v[i + k];
      if (Affine) a = sc * a + sh;
      if (Residual) a += res[i + k];
      const float r = std::max(a, 0.f);
      v[i + k] = r;
      total += r;
      byte |= uint8_t(r > 0.f) << k;
    }
    if (Mask) bits[i / 8] = byte;
  }
  return total;
}

// relu_pool's backward over one plane: gs = bit ? g + gp : 0 (gs may be g).
inline void relu_pool_grad_chunks(const float* g, float gp,
                                  const uint8_t* bits, float* gs, int64_t n) {
  const __m256 vgp = _mm256_set1_ps(gp);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i), vgp);
    _mm256_storeu_ps(gs + i, _mm256_and_ps(lane_mask(bits[i / 8]), v));
  }
  for (int64_t k = 0; i + k < n; ++k) {
    gs[i + k] = (bits[i / 8] >> k) & 1 ? g[i + k] + gp : 0.f;
  }
}

// The group's 3x3 kernels (flipped: rotated by 180 degrees, the
// transpose's), tap t in w9[t].
inline void lane_kernels(const float* weight, const Group& g, bool flipped,
                         __m256 w9[9]) {
  for (int64_t t = 0; t < 9; ++t) {
    const int64_t tap = flipped ? 8 - t : t;
    w9[t] = g.lanes([&](int64_t j) { return weight[g.c[j] * 9 + tap]; });
  }
}

// out[i] (dense lanes) = the zero-padded 3x3 convolution of the grid.
inline void conv3x3_lanes(const LaneScratch& s, const float* grid,
                          const __m256 w9[9], float* out) {
  const int64_t row = (s.W + 2) * 8;
  for (int64_t r = 0; r < s.H; ++r) {
    for (int64_t c = 0; c < s.W; ++c) {
      const float* q = grid + r * row + c * 8;  // the window's corner
      __m256 a = _mm256_mul_ps(w9[0], _mm256_loadu_ps(q));
      __m256 b = _mm256_mul_ps(w9[3], _mm256_loadu_ps(q + row));
      __m256 d = _mm256_mul_ps(w9[6], _mm256_loadu_ps(q + 2 * row));
      a = _mm256_fmadd_ps(w9[1], _mm256_loadu_ps(q + 8), a);
      b = _mm256_fmadd_ps(w9[4], _mm256_loadu_ps(q + row + 8), b);
      d = _mm256_fmadd_ps(w9[7], _mm256_loadu_ps(q + 2 * row + 8), d);
      a = _mm256_fmadd_ps(w9[2], _mm256_loadu_ps(q + 16), a);
      b = _mm256_fmadd_ps(w9[5], _mm256_loadu_ps(q + row + 16), b);
      d = _mm256_fmadd_ps(w9[8], _mm256_loadu_ps(q + 2 * row + 16), d);
      _mm256_storeu_ps(out + (r * s.W + c) * 8,
                       _mm256_add_ps(_mm256_add_ps(a, b), d));
    }
  }
}

// acc[t] = sum over pixels of s.grad * the s.agg value under tap t: the
// 3x3 kernels' gradients, per plane.
inline void conv3x3_weight_grad_lanes(const LaneScratch& s, __m256 acc[9]) {
  const int64_t row = (s.W + 2) * 8;
  for (int64_t t = 0; t < 9; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t r = 0; r < s.H; ++r) {
    for (int64_t c = 0; c < s.W; ++c) {
      const float* q = s.agg.data() + r * row + c * 8;
      const __m256 g =
          _mm256_loadu_ps(s.grad.data() + r * row + row + c * 8 + 8);
      for (int64_t k = 0; k < 3; ++k) {
        for (int64_t l = 0; l < 3; ++l) {
          acc[3 * k + l] = _mm256_fmadd_ps(
              g, _mm256_loadu_ps(q + k * row + l * 8), acc[3 * k + l]);
        }
      }
    }
  }
}

// out[2 (p0 + j)], out[2 (p0 + j) + 1] = lane j of first, second: a pair
// of sums per plane of the group.
inline void store_pairs(__m256 first, __m256 second, int64_t p0, float* out) {
  alignas(32) float v1[8], v2[8];
  _mm256_store_ps(v1, first);
  _mm256_store_ps(v2, second);
  for (int64_t j = 0; j < 8; ++j) {
    out[2 * (p0 + j)] = v1[j];
    out[2 * (p0 + j) + 1] = v2[j];
  }
}

// The group's u_next (update_state), and DWConv3x3(u_next / (z + eps))
// into cv (lanes).
inline void update_conv_group(const Dims& dm, const ForwardOperands<float>& a,
                              const Group& g, LaneScratch& s, float* cv) {
  const int64_t hw = dm.HW;
  for (int64_t j = 0; j < 8;) {  // one loop per run of planes in a head
    const int64_t len = g.run(j), off = (g.p0 + j) * hw;
    update_state<float>(a.x + off, a.u ? a.u + off : nullptr, a.u_next + off,
                        a.w[g.n[j]], len * hw);
    j += len;
  }
  const __m256 inv =
      g.lanes([&](int64_t j) { return 1.f / (a.z[g.n[j]] + a.eps); });
  planes_to_lanes(a.u_next + g.p0 * hw, hw, s.grid.data(), inv,
                  s.agg.data());
  __m256 w9[9];
  lane_kernels(a.weight, g, false, w9);
  conv3x3_lanes(s, s.agg.data(), w9, cv);
}

// stats_planes for the group: u_next, then each plane's (mean, M2) of o.
inline void stats_group(const Dims& dm, const ForwardOperands<float>& a,
                        float* stats, int64_t p0, float* conv) {
  LaneScratch& s = lane_scratch(dm);
  const Group g(dm, p0);
  const int64_t hw = dm.HW;
  float* cv = conv != nullptr ? conv : s.conv.data();
  update_conv_group(dm, a, g, s, cv);
  const __m256 gt = g.lanes([&](int64_t j) { return a.gate[g.n[j]]; });
  __m256 sum = _mm256_setzero_ps(), m2 = _mm256_setzero_ps();
  for (int64_t i = 0; i < hw; ++i) {
    sum = _mm256_fmadd_ps(gt, _mm256_loadu_ps(cv + i * 8), sum);
  }
  const __m256 mu = _mm256_div_ps(sum, _mm256_set1_ps(float(hw)));
  for (int64_t i = 0; i < hw; ++i) {
    const __m256 o = _mm256_fmsub_ps(gt, _mm256_loadu_ps(cv + i * 8), mu);
    m2 = _mm256_fmadd_ps(o, o, m2);
  }
  store_pairs(mu, m2, p0, stats);
}

// forward_planes<false> for the group from its conv (lanes).
inline void apply_group(const Dims& dm, const ForwardOperands<float>& a,
                        int64_t p0, const float* cv) {
  LaneScratch& s = lane_scratch(dm);
  const Group g(dm, p0);
  const int64_t hw = dm.HW;
  const __m256 scg =
      g.lanes([&](int64_t j) { return a.scale[g.c[j]] * a.gate[g.n[j]]; });
  const __m256 sh = g.lanes([&](int64_t j) { return a.shift[g.c[j]]; });
  const __m256 kp =
      g.lanes([&](int64_t j) { return a.keep ? a.keep[g.b[j]] : 1.f; });
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < hw; ++i) {
    const __m256 v = _mm256_fmadd_ps(scg, _mm256_loadu_ps(cv + i * 8), sh);
    _mm256_storeu_ps(s.y.data() + i * 8,
                     _mm256_mul_ps(kp, _mm256_max_ps(v, zero)));
    s.on[i] = uint8_t(_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ)));
  }
  lanes_to_planes(s.y.data(), hw, s.y_planes.data());
  const float* __restrict__ y = s.y_planes.data();
  float* __restrict__ out = a.out + p0 * hw;
  if (a.out == a.x) {  // out over x, in place
    for (int64_t i = 0; i < 8 * hw; ++i) out[i] += y[i];
  } else {
    const float* __restrict__ x = a.x + p0 * hw;
    for (int64_t i = 0; i < 8 * hw; ++i) out[i] = x[i] + y[i];
  }
  if (a.mask != nullptr) {
    pack_lane_bits(s.on.data(), hw, dm.bytes, a.mask + p0 * dm.bytes);
  }
}

// forward_planes<true> for the group (the inference branch: u_next, out,
// the mask where given).
inline void forward_group(const Dims& dm, const ForwardOperands<float>& a,
                          int64_t p0) {
  LaneScratch& s = lane_scratch(dm);
  update_conv_group(dm, a, Group(dm, p0), s, s.conv.data());
  apply_group(dm, a, p0, s.conv.data());
}

// The group's backward inputs in lanes, into s: agg (u_next / (z + eps))
// on s.agg, grad_out in s.go, the mask's lane bits in s.on; where conv is
// given, agg's conv into it.
inline void backward_inputs(const Dims& dm, const BackwardOperands<float>& a,
                            const Group& g, const float* inv, LaneScratch& s,
                            float* conv) {
  const int64_t hw = dm.HW, off = g.p0 * hw;
  planes_to_lanes(a.u_next + off, hw, s.grid.data(), _mm256_loadu_ps(inv),
                  s.agg.data());
  if (conv != nullptr) {
    __m256 w9[9];
    lane_kernels(a.weight, g, false, w9);
    conv3x3_lanes(s, s.agg.data(), w9, conv);
  }
  planes_to_lanes(a.grad_out + off, hw, s.dense.data(), _mm256_set1_ps(1.f),
                  s.go.data());
  unpack_lane_bits(a.mask + g.p0 * dm.bytes, hw, dm.bytes, s.on.data());
}

// 1 / (z + eps) of the group's planes.
inline void inverse_norms(const BackwardOperands<float>& a, const Group& g,
                          float* inv) {
  for (int64_t j = 0; j < 8; ++j) inv[j] = 1.f / (a.z[g.n[j]] + a.eps);
}

// bn_sums_planes for the group; its conv (lanes) into conv where given.
inline void bn_sums_group(const Dims& dm, const BackwardOperands<float>& a,
                          float* bn_sums, int64_t p0, float* conv) {
  LaneScratch& s = lane_scratch(dm);
  const Group g(dm, p0);
  const int64_t hw = dm.HW;
  alignas(32) float inv[8];
  inverse_norms(a, g, inv);
  float* cv = conv != nullptr ? conv : s.conv.data();
  backward_inputs(dm, a, g, inv, s, cv);
  const __m256 gt = g.lanes([&](int64_t j) { return a.gate[g.n[j]]; });
  const __m256 kp = g.lanes([&](int64_t j) { return a.keep[g.b[j]]; });
  const __m256 mu = g.lanes([&](int64_t j) { return a.mean[g.c[j]]; });
  __m256 sg = _mm256_setzero_ps(), sgc = _mm256_setzero_ps();
  for (int64_t i = 0; i < hw; ++i) {
    const __m256 gn =
        _mm256_and_ps(lane_mask(s.on[i]),
                      _mm256_mul_ps(_mm256_loadu_ps(s.go.data() + i * 8), kp));
    sg = _mm256_add_ps(sg, gn);
    const __m256 oc = _mm256_fmsub_ps(gt, _mm256_loadu_ps(cv + i * 8), mu);
    sgc = _mm256_fmadd_ps(gn, oc, sgc);
  }
  store_pairs(sg, sgc, p0, bn_sums);
}

// backward_planes for the group, from its conv (lanes) where given.
inline void backward_group(const Dims& dm, const BackwardOperands<float>& a,
                           float* bn_sums, float* head_sums,
                           float* weight_sums, int64_t p0, const float* conv) {
  LaneScratch& s = lane_scratch(dm);
  const Group g(dm, p0);
  const int64_t hw = dm.HW, off = p0 * hw;
  alignas(32) float inv[8];
  inverse_norms(a, g, inv);
  backward_inputs(dm, a, g, inv, s, conv != nullptr ? nullptr : s.conv.data());
  const float* cv = conv != nullptr ? conv : s.conv.data();
  const __m256 gt = g.lanes([&](int64_t j) { return a.gate[g.n[j]]; });
  const __m256 sc = g.lanes([&](int64_t j) { return a.scale[g.c[j]]; });
  const __m256 sh = g.lanes([&](int64_t j) { return a.shift[g.c[j]]; });
  const __m256 kp = g.lanes([&](int64_t j) { return a.keep[g.b[j]]; });
  const __m256 al = g.lanes([&](int64_t j) { return a.alpha[g.c[j]]; });
  const __m256 be = g.lanes([&](int64_t j) { return a.beta[g.c[j]]; });
  const __m256 mu = g.lanes([&](int64_t j) { return a.mean[g.c[j]]; });
  __m256 sg = _mm256_setzero_ps(), sgc = sg, s_gate = sg;
  for (int64_t i = 0; i < hw; ++i) {
    const __m256 on = lane_mask(s.on[i]);
    const __m256 c = _mm256_loadu_ps(cv + i * 8);
    const __m256 o = _mm256_mul_ps(gt, c);
    const __m256 y =
        _mm256_and_ps(on, _mm256_mul_ps(kp, _mm256_fmadd_ps(sc, o, sh)));
    _mm256_storeu_ps(s.y.data() + i * 8, y);
    const __m256 gn = _mm256_and_ps(
        on, _mm256_mul_ps(_mm256_loadu_ps(s.go.data() + i * 8), kp));
    const __m256 oc = _mm256_sub_ps(o, mu);
    sg = _mm256_add_ps(sg, gn);
    sgc = _mm256_fmadd_ps(gn, oc, sgc);
    const __m256 g_o = _mm256_fmadd_ps(be, oc, _mm256_fmadd_ps(sc, gn, al));
    s_gate = _mm256_fmadd_ps(g_o, c, s_gate);
    _mm256_storeu_ps(s.grad.data() + s.grid[i] * 8, _mm256_mul_ps(g_o, gt));
  }
  __m256 gw9[9], flipped[9];
  conv3x3_weight_grad_lanes(s, gw9);
  lane_kernels(a.weight, g, true, flipped);
  conv3x3_lanes(s, s.grad.data(), flipped, s.ga.data());  // gradient of agg
  lanes_to_planes(s.y.data(), hw, s.y_planes.data());
  lanes_to_planes(s.ga.data(), hw, s.ga_planes.data());
  {  // x recovered from out, for the 8 planes at once
    const float* __restrict__ o_sum = a.out + off;
    const float* __restrict__ y = s.y_planes.data();
    float* __restrict__ xr = s.x_rec.data();
    for (int64_t i = 0; i < 8 * hw; ++i) xr[i] = o_sum[i] - y[i];
  }
  store_pairs(sg, sgc, p0, bn_sums);
  alignas(32) float v_gate[8], v_gw[9][8];
  _mm256_store_ps(v_gate, s_gate);
  for (int64_t t = 0; t < 9; ++t) _mm256_store_ps(v_gw[t], gw9[t]);
  // the state's gradients and inversion, one loop per run of planes with
  // the same head (its sums s_z, s_w in the run's first plane, zero in the
  // others: the callers sum them over the head)
  for (int64_t j = 0; j < 8;) {
    const int64_t len = g.run(j), p = p0 + j, po = p * hw;
    const float wv = a.w[g.n[j]];
    const float* xr = s.x_rec.data() + j * hw;
    float s_z, s_w;
    state_grads_plane<float>(
        s.ga_planes.data() + j * hw, a.u_next + po,
        a.grad_u_next != nullptr ? a.grad_u_next + po : s.zeros.data(),
        a.grad_out + po, xr, a.grad_u != nullptr ? a.grad_u + po : s.gu.data(),
        a.grad_x + po, inv[j], wv, len * hw, s_z, s_w);
    invert_state<float>(a.u_next + po, a.u_prev ? a.u_prev + po : nullptr, xr,
                        wv, len * hw);
    for (int64_t k = 0; k < len; ++k) {
      head_sums[3 * (p + k)] = k == 0 ? s_w : 0.f;
      head_sums[3 * (p + k) + 1] = k == 0 ? -s_z * inv[j] * inv[j] : 0.f;
    }
    j += len;
  }
  for (int64_t j = 0; j < 8; ++j) {
    const int64_t p = p0 + j;
    head_sums[3 * p + 2] = v_gate[j];
    for (int64_t t = 0; t < 9; ++t) weight_sums[9 * p + t] = v_gw[t][j];
  }
}
