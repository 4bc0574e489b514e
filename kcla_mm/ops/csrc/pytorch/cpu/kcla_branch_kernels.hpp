// CPU kernels of the fused KCLA branch (see common/kcla_branch_impl.hpp),
// compiled twice: for the baseline ISA (kcla_branch.cpp) and with AVX2 +
// FMA (kcla_branch_avx2.cpp, chosen at run time). Each includer defines
// KCLA_CPU_NS, the namespace of its copy (the AVX2 one also KCLA_CPU_LANES:
// kcla_branch_lanes.hpp's kernels for small planes), and includes the
// headers below first (so only the code of this file is built for its
// ISA); hence no include guard.
//
// One task per (b, c) plane. A plane is copied into a flat buffer with a
// zero row (and one more zero) on each side, so the 3x3 depthwise
// convolution and its gradients become flat, branch-free loops over the
// H * W values that vectorise for any plane size (per-column 0/1 masks drop
// the neighbours a flat index finds across a row's ends); the element-wise
// parts are flat loops over the plane, with bit masks unpacked to / packed
// from one byte per element. Sums over a plane are accumulated in T and
// written per plane; the callers reduce over batch and heads (in double).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "kcla_branch_cpu.hpp"
#include "kcla_head_math.hpp"
#include "pytorch_cpp_helper.hpp"

namespace KCLA_CPU_NS {

struct Dims {
  int64_t B, C, G, d, H, W, HW, bytes;
  Dims(const at::Tensor& x, int64_t groups)
      : B(x.size(0)), C(x.size(1)), G(groups), d(x.size(1) / groups),
        H(x.size(2)), W(x.size(3)), HW(x.size(2) * x.size(3)),
        bytes((x.size(2) * x.size(3) + 7) / 8) {}
  int64_t head(int64_t plane) const {  // index into (B, G) tensors
    return (plane / C) * G + (plane % C) / d;
  }
};

// rows x cols planes of a (B, C) grid, row by row: first + r * stride + j
// for j < cols. A contiguous range (one row), or a block of channels
// across the batch (B rows, stride C).
struct PlaneRange {
  int64_t first, cols, stride, rows;
  int64_t count() const { return rows * cols; }
  int64_t operator[](int64_t k) const {
    return first + (k / cols) * stride + k % cols;
  }
};

inline PlaneRange contiguous_planes(int64_t begin, int64_t end) {
  return {begin, end - begin, 0, 1};
}

inline PlaneRange channel_block(const Dims& dm, int64_t c0, int64_t c1) {
  return {c0, c1 - c0, dm.C, dm.B};
}

// A per-thread buffer of at least n values, reused by later calls (a fresh
// allocation of this size would page-fault each time).
template <typename T>
T* thread_buffer(int64_t n) {
  thread_local std::vector<T> buf;
  if (int64_t(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// Values per plane in a flat loop: H * W rounded up to whole 8-lane
// vectors (no scalar remainder in the conv loops).
constexpr int64_t kLanes = 8;
inline int64_t padded_plane(int64_t hw) {
  return (hw + kLanes - 1) / kLanes * kLanes;
}

template <typename T>
struct FlatPlane {
  // the flat loops run over n = padded_plane(H * W); the slack is zero
  int64_t W, hw, n;
  std::vector<T> buf;    // W + 1 zeros, the plane (n values), W + 1 zeros
  std::vector<T> left;   // n: 0 in column 0 and the slack, else 1
  std::vector<T> right;  // n: 0 in column W - 1 and the slack, else 1
  std::vector<T> out;    // n: the conv output (its slack unspecified)
  FlatPlane(int64_t h, int64_t w)
      : W(w), hw(h * w), n(padded_plane(h * w)),
        buf(n + 2 * (w + 1), T(0)), left(n, T(0)), right(n, T(0)),
        out(n, T(0)) {
    for (int64_t i = 0; i < hw; ++i) {
      left[i] = T(i % W != 0);
      right[i] = T(i % W != W - 1);
    }
  }
  // the plane, row-major; the values around it (and its slack) stay zero
  T* data() { return buf.data() + W + 1; }
  const T* data() const { return buf.data() + W + 1; }
};

// The zero-padded 3x3 convolution of a FlatPlane at flat index i:
// sum_{k,l} w9[3k+l] * p(i / W + k - 1, i % W + l - 1). Rows outside the
// plane read its zero guards, and the column masks drop what a flat index
// would read across a row's ends; so the flat loops over i vectorise.
template <typename T>
struct Conv3x3 {
  const T* __restrict__ a;
  const T* __restrict__ ml;
  const T* __restrict__ mr;
  int64_t W;
  T w0, w1, w2, w3, w4, w5, w6, w7, w8;
  Conv3x3(const FlatPlane<T>& p, const T* w9)
      : a(p.data()), ml(p.left.data()), mr(p.right.data()), W(p.W),
        w0(w9[0]), w1(w9[1]), w2(w9[2]), w3(w9[3]), w4(w9[4]), w5(w9[5]),
        w6(w9[6]), w7(w9[7]), w8(w9[8]) {}
  T operator()(int64_t i) const {
    const T l = w0 * a[i - W - 1] + w3 * a[i - 1] + w6 * a[i + W - 1];
    const T c = w1 * a[i - W] + w4 * a[i] + w7 * a[i + W];
    const T r = w2 * a[i - W + 1] + w5 * a[i + 1] + w8 * a[i + W + 1];
    return ml[i] * l + c + mr[i] * r;
  }
};

// The plane's Conv3x3 at every i < p.n into out (default p.out; its slack
// gets unspecified values). With the plane zero outside it, the same call
// with the flipped kernel is the exact transpose.
template <typename T>
inline void conv3x3(FlatPlane<T>& p, const T* w9, T* out_ptr = nullptr) {
  const Conv3x3<T> conv(p, w9);
  T* __restrict__ out = out_ptr != nullptr ? out_ptr : p.out.data();
  for (int64_t i = 0; i < p.n; ++i) out[i] = conv(i);
}

// out[i] = x[i] + keep * ReLU(scale * Conv3x3(p, w9)(i) + shift) over the
// plane's H * W values (out may be x: in place).
template <typename T>
inline void conv3x3_relu_add(const FlatPlane<T>& p, const T* w9, T scale,
                             T shift, T keep, const T* x, T* out) {
  const Conv3x3<T> conv(p, w9);
  const auto branch = [&](int64_t i) {
    return keep * std::max(scale * conv(i) + shift, T(0));
  };
  T* __restrict__ op = out;
  if (out == x) {
    for (int64_t i = 0; i < p.hw; ++i) op[i] += branch(i);
  } else {
    const T* __restrict__ xp = x;
    for (int64_t i = 0; i < p.hw; ++i) op[i] = xp[i] + branch(i);
  }
}

// gw9[3k+l] = sum_i g[i] * p(i / W + k - 1, i % W + l - 1) over the plane,
// for g (n values) with a zero slack. One pass with 9 x kLanes independent
// accumulators (nine single-accumulator dot products would each wait on the
// FMA latency).
template <typename T>
inline void conv3x3_weight_grad(const T* __restrict__ g,
                                const FlatPlane<T>& p, T* gw9) {
  constexpr int64_t L = kLanes;  // p.n is a multiple of L
  const int64_t n = p.n, W = p.W;
  const T* __restrict__ a = p.data();
  const T* __restrict__ ml = p.left.data();
  const T* __restrict__ mr = p.right.data();
  T acc[9][L] = {};
  for (int64_t i0 = 0; i0 < n; i0 += L) {
    for (int64_t l = 0; l < L; ++l) {
      const int64_t i = i0 + l;
      const T gv = g[i], gl = gv * ml[i], gr = gv * mr[i];
      acc[0][l] += gl * a[i - W - 1];
      acc[1][l] += gv * a[i - W];
      acc[2][l] += gr * a[i - W + 1];
      acc[3][l] += gl * a[i - 1];
      acc[4][l] += gv * a[i];
      acc[5][l] += gr * a[i + 1];
      acc[6][l] += gl * a[i + W - 1];
      acc[7][l] += gv * a[i + W];
      acc[8][l] += gr * a[i + W + 1];
    }
  }
  for (int k = 0; k < 9; ++k) {
    T sum = 0;
    for (int64_t l = 0; l < L; ++l) sum += acc[k][l];
    gw9[k] = sum;
  }
}

// The 3x3 kernel rotated by 180 degrees: convolving with it is the transpose.
template <typename T>
inline void flip3x3(const T* w9, T* flipped) {
  for (int i = 0; i < 9; ++i) flipped[i] = w9[8 - i];
}

// The plane src * scale into dst.
template <typename T>
inline void load_plane(const T* __restrict__ src, FlatPlane<T>& dst,
                       T scale) {
  T* __restrict__ d = dst.data();
  for (int64_t i = 0; i < dst.hw; ++i) d[i] = src[i] * scale;
}

// u_next = u + w x over a plane of hw values (u may be u_next: in place;
// null: 0). In-place cases get their own loops: a runtime overlap check
// would send them to scalar code.
template <typename T>
inline void update_state(const T* __restrict__ x, const T* u, T* u_next,
                         T wv, int64_t hw) {
  T* __restrict__ un = u_next;
  if (u == u_next) {
    for (int64_t i = 0; i < hw; ++i) un[i] += wv * x[i];
  } else if (u != nullptr) {
    const T* __restrict__ ur = u;
    for (int64_t i = 0; i < hw; ++i) un[i] = ur[i] + wv * x[i];
  } else {
    for (int64_t i = 0; i < hw; ++i) un[i] = wv * x[i];
  }
}

// update_state, and u_next / (z + eps) into the plane agg, in one loop.
template <typename T>
inline void update_plane(const T* __restrict__ x, const T* u, T* u_next,
                         FlatPlane<T>& agg, T wv, T inv) {
  T* __restrict__ un = u_next;
  T* __restrict__ d = agg.data();
  if (u == u_next) {
    for (int64_t i = 0; i < agg.hw; ++i) {
      const T v = un[i] + wv * x[i];
      un[i] = v;
      d[i] = v * inv;
    }
  } else if (u != nullptr) {
    const T* __restrict__ ur = u;
    for (int64_t i = 0; i < agg.hw; ++i) {
      const T v = ur[i] + wv * x[i];
      un[i] = v;
      d[i] = v * inv;
    }
  } else {
    for (int64_t i = 0; i < agg.hw; ++i) {
      const T v = wv * x[i];
      un[i] = v;
      d[i] = v * inv;
    }
  }
}

// The state before a layer from the one after it, u_prev = u_next - w x,
// over a plane of hw values (u_prev may be u_next: in place; null: none).
template <typename T>
inline void invert_state(const T* u_next, T* u_prev, const T* __restrict__ x,
                         T wv, int64_t hw) {
  if (u_prev == u_next) {
    T* __restrict__ up = u_prev;
    for (int64_t i = 0; i < hw; ++i) up[i] -= wv * x[i];
  } else if (u_prev != nullptr) {
    T* __restrict__ up = u_prev;
    const T* __restrict__ un = u_next;
    for (int64_t i = 0; i < hw; ++i) up[i] = un[i] - wv * x[i];
  }
}

// From ga, the gradient of the plane's agg: gu = gun + ga / (z + eps), the
// whole gradient of u_next (gun: its direct one; gu may be gun, in place),
// and gx = go + w gu, the gradient of x; with the sums s_z = <ga, u_next>
// and s_w = <gu, x>.
template <typename T>
inline void state_grads_plane(const T* __restrict__ ga,
                              const T* __restrict__ un, const T* gun,
                              const T* __restrict__ go, const T* __restrict__ x,
                              T* gu, T* __restrict__ gx, T inv, T wv,
                              int64_t n, T& s_z, T& s_w) {
  T sz = 0, sw = 0;
  if (gu == gun) {  // own loop: an overlap check would make it scalar
    T* __restrict__ g = gu;
    for (int64_t i = 0; i < n; ++i) {
      sz += ga[i] * un[i];
      const T t = g[i] + ga[i] * inv;
      g[i] = t;
      gx[i] = go[i] + t * wv;
      sw += t * x[i];
    }
  } else {
    const T* __restrict__ gn = gun;
    T* __restrict__ g = gu;
    for (int64_t i = 0; i < n; ++i) {
      sz += ga[i] * un[i];
      const T t = gn[i] + ga[i] * inv;
      g[i] = t;
      gx[i] = go[i] + t * wv;
      sw += t * x[i];
    }
  }
  s_z = sz;
  s_w = sw;
}

// One byte (0 or 1) per element <-> bit k of byte j for element 8 j + k.
struct BitTable {
  uint64_t unpack[256];
  BitTable() {
    for (int v = 0; v < 256; ++v) {
      uint64_t bytes = 0;
      for (int k = 0; k < 8; ++k) bytes |= uint64_t((v >> k) & 1) << (8 * k);
      unpack[v] = bytes;
    }
  }
};

inline void unpack_bits(const uint8_t* __restrict__ bits, int64_t hw,
                        uint8_t* __restrict__ on) {
  static const BitTable table;
  const int64_t full = hw / 8;
  for (int64_t j = 0; j < full; ++j) {
    std::memcpy(on + 8 * j, &table.unpack[bits[j]], 8);
  }
  for (int64_t i = 8 * full; i < hw; ++i) on[i] = (bits[full] >> (i & 7)) & 1;
}

inline void pack_bits(const uint8_t* __restrict__ on, int64_t hw,
                      uint8_t* __restrict__ bits) {
  const int64_t full = hw / 8;
  for (int64_t j = 0; j < full; ++j) {
    uint64_t bytes;
    std::memcpy(&bytes, on + 8 * j, 8);
    // moves byte k's low bit to bit 56 + k without carries (bytes are 0/1)
    bits[j] = uint8_t((bytes * 0x0102040810204080ULL) >> 56);
  }
  if (8 * full < hw) {
    uint8_t byte = 0;
    for (int64_t i = 8 * full; i < hw; ++i) byte |= on[i] << (i & 7);
    bits[full] = byte;
  }
}

// Per-thread scratch of one plane.
template <typename T>
struct Scratch {
  FlatPlane<T> agg;         // the aggregate; its conv output
  std::vector<uint8_t> on;  // H * W: a mask, one byte per element
  explicit Scratch(const Dims& dm) : agg(dm.H, dm.W), on(dm.HW) {}
};

// Per-thread scratch of the backward kernels.
template <typename T>
struct BackwardScratch : Scratch<T> {
  FlatPlane<T> g_pad;     // the gradient of o, gated; its conv
  std::vector<T> x_rec;   // H * W: x recovered from out
  std::vector<T> zeros;   // H * W zeros: an absent grad_u_next
  std::vector<T> gu;      // H * W: grad_u where it is not wanted
  explicit BackwardScratch(const Dims& dm)
      : Scratch<T>(dm), g_pad(dm.H, dm.W), x_rec(dm.HW), zeros(dm.HW, T(0)),
        gu(dm.HW) {}
};

// The one-call training kernels' two passes: first(planes, scratch, conv)
// (BN's sums, keeping each plane's conv in its row of conv), fold(c) once
// channel c's planes have had it, then second(planes, scratch, conv).
// Maps up to kWholeMapBytes stay in cache between two passes over all
// planes, handed out in runs of kGroup planes (so that both passes split
// them into the same lane groups); larger ones make both passes over one
// block of channels at a time, each block small enough (kBlockBytes for
// about three maps) that the second pass still finds its maps in cache.
constexpr int64_t kWholeMapBytes = int64_t(4) << 20;
constexpr int64_t kBlockBytes = int64_t(512) << 10;
constexpr int64_t kGroup = 8;  // planes per lane group
constexpr int64_t kLanePlaneMax = 64;  // H * W of the largest lane planes

template <typename T, typename S, typename First, typename Fold,
          typename Second>
void two_passes(const Dims& dm, const First& first, const Fold& fold,
                const Second& second) {
  const int64_t n = padded_plane(dm.HW), planes = dm.B * dm.C;
  if (planes * dm.HW * int64_t(sizeof(T)) <= kWholeMapBytes) {
    T* conv = thread_buffer<T>(planes * n);
    const auto pass = [&](const auto& fn) {
      at::parallel_for(0, (planes + kGroup - 1) / kGroup, 1,
                       [&](int64_t begin, int64_t end) {
                         S s(dm);
                         const int64_t p0 = begin * kGroup;
                         const int64_t p1 = std::min(planes, end * kGroup);
                         fn(contiguous_planes(p0, p1), s, conv + p0 * n);
                       });
    };
    pass(first);
    for (int64_t c = 0; c < dm.C; ++c) fold(c);
    pass(second);
    return;
  }
  const int64_t channel_bytes = 3 * dm.B * dm.HW * int64_t(sizeof(T));
  const int64_t block = std::min<int64_t>(
      std::max<int64_t>(1, kBlockBytes / channel_bytes),
      std::max<int64_t>(1, dm.C / (2 * int64_t(at::get_num_threads()))));
  const int64_t blocks = (dm.C + block - 1) / block;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    S s(dm);
    T* conv = thread_buffer<T>(dm.B * block * n);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c0 = i * block, c1 = std::min(dm.C, c0 + block);
      const PlaneRange range = channel_block(dm, c0, c1);
      first(range, s, conv);
      for (int64_t c = c0; c < c1; ++c) fold(c);
      second(range, s, conv);
    }
  });
}

// The operands of the forward kernels (optional ones null).
template <typename T>
struct ForwardOperands {
  const T *x, *u, *w, *z, *gate, *weight, *scale, *shift, *keep;
  T *u_next, *out;
  uint8_t* mask;
  T eps;
};

// The operands of the backward kernels (optional ones null): those of
// kcla_branch_backward_impl.
template <typename T>
struct BackwardOperands {
  const T *grad_out, *grad_u_next, *out, *w, *z, *gate, *weight, *scale;
  const T *shift, *keep, *alpha, *beta, *mean;
  const uint8_t* mask;
  T* u_next;  // u_prev may alias it: each plane is read before it is written
  T *grad_x, *grad_u, *u_prev;  // grad_u may alias grad_u_next, likewise
  T eps;
};

// Whether this copy has kcla_branch_lanes.hpp's kernels for T (the lane
// groups, relu_pool's chunks).
template <typename T>
constexpr bool kHasLanes =
#ifdef KCLA_CPU_LANES
    std::is_same<T, float>::value;
#else
    false;
#endif

// Whether the one-call kernels run dm's planes in lane groups.
template <typename T>
bool lanes_apply(const Dims& dm) {
  return kHasLanes<T> && dm.HW <= kLanePlaneMax;
}

#ifdef KCLA_CPU_LANES
#include "kcla_branch_lanes.hpp"
#else
// Declared only, for relu_pool_planes' discarded lane branch: C++17 (torch
// before 2.12 compiles extensions with -std=c++17) parses a call with
// template arguments only where a template of that name is declared.
template <bool Residual, bool Affine, bool Mask>
float relu_pool_chunks(float* v, const float* res, float sc, float sh,
                       uint8_t* bits, int64_t n);
#endif

// One pass of a one-call kernel over `planes`, with their kept convs
// (rows of padded_plane(H * W) values, as two_passes hands out) or null:
// in lane groups where they apply (each row's planes in runs of kGroup
// from the row's start, as group(p0, the run's rows of conv); the rest of
// the row plane by plane), else plane by plane, as planes_fn(range, rows).
// `group` is a generic lambda (its call to the lane functions depends on
// its parameters), so the copies and types without lanes never compile
// its body.
template <typename T, typename Planes, typename Group>
void over_planes(const Dims& dm, PlaneRange planes, T* conv,
                 const Planes& planes_fn, const Group& group) {
  if constexpr (kHasLanes<T>) {
    if (lanes_apply<T>(dm)) {
      const int64_t n = padded_plane(dm.HW);
      const auto rows = [&](int64_t k) {
        return conv != nullptr ? conv + k * n : nullptr;
      };
      for (int64_t r = 0; r < planes.rows; ++r) {
        const int64_t first = planes.first + r * planes.stride;
        const int64_t k0 = r * planes.cols;
        int64_t j = 0;
        for (; j + kGroup <= planes.cols; j += kGroup) {
          group(first + j, rows(k0 + j));
        }
        for (; j < planes.cols; ++j) {
          planes_fn(PlaneRange{first + j, 1, 0, 1}, rows(k0 + j));
        }
      }
      return;
    }
  }
  planes_fn(planes, conv);
}

// ReLU(sc * v + sh + res) over one plane of n values, in place, with its
// byte mask where Mask; returns the plane's sum. One copy per operand set,
// so that every loop is alias-free.
template <typename T, bool Residual, bool Affine, bool Mask>
inline T relu_pool_plane(T* __restrict__ v, const T* __restrict__ res, T sc,
                         T sh, uint8_t* __restrict__ o, int64_t n) {
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    T a = v[i];
    if (Affine) a = sc * a + sh;
    if (Residual) a += res[i];
    const T r = std::max(a, T(0));
    v[i] = r;
    sum += r;
    if (Mask) o[i] = r > T(0);
  }
  return sum;
}

// fn(std::true_type()) if flag, else fn(std::false_type()): a run-time
// flag as a compile-time one.
template <typename Fn>
inline void with_flag(bool flag, const Fn& fn) {
  if (flag) {
    fn(std::true_type());
  } else {
    fn(std::false_type());
  }
}

// relu_pool over planes [begin, end) of s (B, C, H, W): in place, with the
// residual and a per-channel affine (scale, shift) before the ReLU where
// given; the mean of each plane into pooled[p], its bit mask into mask
// where given.
template <typename T>
void relu_pool_planes(T* ps, const T* pr, const T* pscale, const T* pshift,
                      uint8_t* pmask, T* pp, int64_t C, int64_t hw,
                      int64_t begin, int64_t end) {
  const int64_t bytes = (hw + 7) / 8;
  std::vector<uint8_t> on(!kHasLanes<T> && pmask != nullptr ? hw : 0);
  with_flag(pr != nullptr, [&](auto residual) {
    with_flag(pscale != nullptr, [&](auto affine) {
      with_flag(pmask != nullptr, [&](auto mask) {
        for (int64_t p = begin; p < end; ++p) {
          const T sc = affine ? pscale[p % C] : T(1);
          const T sh = affine ? pshift[p % C] : T(0);
          T* v = ps + p * hw;
          const T* res = residual ? pr + p * hw : nullptr;
          T sum;
          if constexpr (kHasLanes<T>) {  // the bits straight from vectors
            sum = relu_pool_chunks<residual, affine, mask>(
                v, res, sc, sh, mask ? pmask + p * bytes : nullptr, hw);
          } else {
            sum = relu_pool_plane<T, residual, affine, mask>(v, res, sc, sh,
                                                             on.data(), hw);
            if (mask) pack_bits(on.data(), hw, pmask + p * bytes);
          }
          pp[p] = sum / T(hw);
        }
      });
    });
  });
}

template <typename T>
void relu_pool_forward(at::Tensor& s, const at::Tensor& residual,
                       at::Tensor& mask, at::Tensor& pooled) {
  const int64_t C = s.size(1), hw = s.size(2) * s.size(3);
  T* ps = s.data_ptr<T>();
  const T* pr = data_ptr_or_null<T>(residual);
  uint8_t* pmask = data_ptr_or_null<uint8_t>(mask);
  T* pp = pooled.data_ptr<T>();
  at::parallel_for(0, s.size(0) * C, 1, [&](int64_t begin, int64_t end) {
    relu_pool_planes<T>(ps, pr, nullptr, nullptr, pmask, pp, C, hw, begin,
                        end);
  });
}

template <typename T>
void relu_pool_backward(const at::Tensor& grad_x, const at::Tensor& grad_pooled,
                        const at::Tensor& mask, at::Tensor& grad_s) {
  const int64_t planes = grad_x.size(0) * grad_x.size(1);
  const int64_t hw = grad_x.size(2) * grad_x.size(3), bytes = (hw + 7) / 8;
  const T *pgx = grad_x.data_ptr<T>(), *pgp = grad_pooled.data_ptr<T>();
  const uint8_t* pmask = mask.data_ptr<uint8_t>();
  T* pgs = grad_s.data_ptr<T>();
  at::parallel_for(0, planes, 1, [&, hw](int64_t begin, int64_t end) {
    const int64_t n_hw = hw;
    if constexpr (kHasLanes<T>) {  // the bits straight into vector masks
      for (int64_t p = begin; p < end; ++p) {
        relu_pool_grad_chunks(pgx + p * n_hw, pgp[p] / T(n_hw),
                              pmask + p * bytes, pgs + p * n_hw, n_hw);
      }
      return;
    }
    std::vector<uint8_t> on(n_hw);
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* __restrict__ o = on.data();
      unpack_bits(pmask + p * bytes, n_hw, on.data());
      const T gp = pgp[p] / T(n_hw);
      if (pgs == pgx) {  // grad_s over grad_x, in place
        T* __restrict__ gs = pgs + p * n_hw;
        for (int64_t i = 0; i < n_hw; ++i) gs[i] = o[i] ? gs[i] + gp : T(0);
      } else {
        const T* __restrict__ g = pgx + p * n_hw;
        T* __restrict__ gs = pgs + p * n_hw;
        for (int64_t i = 0; i < n_hw; ++i) gs[i] = o[i] ? g[i] + gp : T(0);
      }
    }
  });
}

// branch_stats over `planes`: u_next, and stats[p] = (mean, sum of squared
// deviations) of o over plane p; where conv is given, the k-th plane's
// DWConv3x3(u_next / (z + eps)) into its row k (of s.agg.n values).
template <typename T>
void stats_planes(const Dims& dm, const ForwardOperands<T>& a, T* stats,
                  PlaneRange planes, Scratch<T>& s, T* conv) {
  // operands in locals: the byte stores below may alias `a` and `dm`
  const T *px = a.x, *pu = a.u, *pw = a.w, *pz = a.z, *pg = a.gate;
  const T* pk = a.weight;
  T* pun = a.u_next;
  const T eps = a.eps;
  const int64_t hw = dm.HW, C = dm.C;
  for (int64_t k = 0; k < planes.count(); ++k) {
    const int64_t p = planes[k];
    const int64_t n = dm.head(p), off = p * hw;
    update_plane<T>(px + off, pu ? pu + off : nullptr, pun + off, s.agg,
                    pw[n], T(1) / (pz[n] + eps));
    T* cv = conv != nullptr ? conv + k * s.agg.n : s.agg.out.data();
    conv3x3<T>(s.agg, pk + (p % C) * 9, cv);
    const T gt = pg[n];
    T sum = 0, m2 = 0;
    for (int64_t i = 0; i < hw; ++i) sum += gt * cv[i];
    const T mu = sum / T(hw);
    for (int64_t i = 0; i < hw; ++i) {
      const T o = gt * cv[i] - mu;
      m2 += o * o;
    }
    stats[2 * p] = mu;
    stats[2 * p + 1] = m2;
  }
}

template <typename T>
void branch_stats(const at::Tensor& x, const at::Tensor& u, const at::Tensor& w,
                  const at::Tensor& z, const at::Tensor& gate,
                  const at::Tensor& weight, at::Tensor& u_next,
                  at::Tensor& stats, double eps) {
  const Dims dm(x, w.size(1));
  const ForwardOperands<T> a{x.data_ptr<T>(), data_ptr_or_null<T>(u),
                             w.data_ptr<T>(), z.data_ptr<T>(),
                             gate.data_ptr<T>(), weight.data_ptr<T>(),
                             nullptr, nullptr, nullptr, u_next.data_ptr<T>(),
                             nullptr, nullptr, T(eps)};
  T* pst = stats.data_ptr<T>();
  at::parallel_for(0, dm.B * dm.C, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> s(dm);
    stats_planes<T>(dm, a, pst, contiguous_planes(begin, end), s, nullptr);
  });
}

// branch_forward over `planes`: Update = true from x and u, else (apply)
// from u_next, or where given from conv (stats_planes' rows).
template <typename T, bool Update>
void forward_planes(const Dims& dm, const ForwardOperands<T>& a,
                    PlaneRange planes, Scratch<T>& s, const T* conv) {
  // operands in locals: the byte stores below may alias `a` and `dm`
  const T *px = a.x, *pu = a.u, *pw = a.w, *pz = a.z, *pg = a.gate;
  const T *pk = a.weight, *ps = a.scale, *pb = a.shift, *pkeep = a.keep;
  const T* pconv = Update ? nullptr : conv;
  T *pun = a.u_next, *pout = a.out;
  uint8_t* pmask = a.mask;
  const T eps = a.eps;
  const int64_t hw = dm.HW, C = dm.C, bytes = dm.bytes;
  for (int64_t k = 0; k < planes.count(); ++k) {
    const int64_t p = planes[k];
    const int64_t c = p % C, n = dm.head(p), off = p * hw;
    const T* __restrict__ cv = s.agg.out.data();
    if (pconv != nullptr) {
      cv = pconv + k * s.agg.n;
    } else {
      const T inv = T(1) / (pz[n] + eps);
      if (Update) {
        update_plane<T>(px + off, pu ? pu + off : nullptr, pun + off, s.agg,
                        pw[n], inv);
      } else {
        load_plane<T>(pun + off, s.agg, inv);
      }
    }
    // y = scale * gate * conv + shift; out = x + keep * ReLU(y)
    const T scg = ps[c] * pg[n], sh = pb[c];
    const T kp = pkeep ? pkeep[p / C] : T(1);
    if (pconv == nullptr && pmask == nullptr) {  // the conv fused, no mask
      conv3x3_relu_add<T>(s.agg, pk + c * 9, scg, sh, kp, px + off,
                          pout + off);
      continue;
    }
    if (pconv == nullptr) conv3x3<T>(s.agg, pk + c * 9);
    uint8_t* __restrict__ on = s.on.data();
    T* __restrict__ op = pout + off;
    if (pout == px) {  // out over x, in place
      for (int64_t i = 0; i < hw; ++i) {
        const T v = scg * cv[i] + sh;
        op[i] += kp * std::max(v, T(0));
        on[i] = v > T(0);
      }
    } else {
      const T* __restrict__ xp = px + off;
      for (int64_t i = 0; i < hw; ++i) {
        const T v = scg * cv[i] + sh;
        op[i] = xp[i] + kp * std::max(v, T(0));
        on[i] = v > T(0);
      }
    }
    if (pmask != nullptr) pack_bits(on, hw, pmask + p * bytes);
  }
}

template <typename T, bool Update>
void branch_forward(const at::Tensor& x, const at::Tensor& u,
                    const at::Tensor& w, const at::Tensor& z,
                    const at::Tensor& gate, const at::Tensor& weight,
                    const at::Tensor& scale, const at::Tensor& shift,
                    const at::Tensor& keep, at::Tensor& u_next,
                    at::Tensor& out, at::Tensor& mask, double eps) {
  const Dims dm(x, z.size(1));
  const ForwardOperands<T> a{
      x.data_ptr<T>(),         data_ptr_or_null<T>(u),
      data_ptr_or_null<T>(w),  z.data_ptr<T>(),
      gate.data_ptr<T>(),      weight.data_ptr<T>(),
      scale.data_ptr<T>(),     shift.data_ptr<T>(),
      data_ptr_or_null<T>(keep), u_next.data_ptr<T>(),
      out.data_ptr<T>(),       data_ptr_or_null<uint8_t>(mask),
      T(eps)};
  at::parallel_for(0, dm.B * dm.C, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> s(dm);
    forward_planes<T, Update>(dm, a, contiguous_planes(begin, end), s,
                              nullptr);
  });
}

// BN's batch statistics of channel c from stats (B, C, 2) (Chan et al.'s
// parallel combination, in double): mean[c] and invstd[c], the folded
// scale[c] and shift[c] (BN(o) = scale * o + shift) and, where running_mean
// is given, nn.BatchNorm2d's running-statistics update (unbiased variance)
// with `momentum`.
template <typename T>
void fold_channel_stats(const Dims& dm, const T* stats, int64_t c,
                        const T* bn_weight, const T* bn_bias, T* running_mean,
                        T* running_var, double momentum, double bn_eps,
                        T* mean, T* invstd, T* scale, T* shift) {
  const int64_t B = dm.B, C = dm.C, n = B * dm.HW;
  double mu = 0;
  for (int64_t b = 0; b < B; ++b) mu += double(stats[2 * (b * C + c)]);
  mu /= double(B);
  double m2 = 0;
  for (int64_t b = 0; b < B; ++b) {
    const double d = double(stats[2 * (b * C + c)]) - mu;
    m2 += double(stats[2 * (b * C + c) + 1]) + double(dm.HW) * d * d;
  }
  const double var = m2 / double(n);
  if (running_mean != nullptr) {
    running_mean[c] =
        T((1 - momentum) * double(running_mean[c]) + momentum * mu);
    running_var[c] =
        T((1 - momentum) * double(running_var[c]) +
          momentum * var * double(n) / double(std::max<int64_t>(n - 1, 1)));
  }
  const T inv = T(1) / std::sqrt(T(var) + T(bn_eps));
  mean[c] = T(mu);
  invstd[c] = inv;
  scale[c] = bn_weight[c] * inv;
  shift[c] = bn_bias[c] - T(mu) * scale[c];
}

// The training forward with batch statistics in one call, channel by
// channel (so that the second pass finds the channel's maps in cache):
// stats_planes over its B planes (keeping their convs),
// fold_channel_stats, then the apply pass from the kept convs.
template <typename T>
void branch_train_forward(
    const at::Tensor& x, const at::Tensor& u, const at::Tensor& w,
    const at::Tensor& z, const at::Tensor& gate, const at::Tensor& weight,
    const at::Tensor& bn_weight, const at::Tensor& bn_bias,
    const at::Tensor& running_mean, const at::Tensor& running_var,
    const at::Tensor& keep, at::Tensor& u_next, at::Tensor& out,
    at::Tensor& mask, at::Tensor& mean, at::Tensor& invstd,
    at::Tensor& scale, at::Tensor& shift, double momentum, double bn_eps,
    double eps) {
  const Dims dm(x, w.size(1));
  const ForwardOperands<T> a{
      x.data_ptr<T>(),     data_ptr_or_null<T>(u), w.data_ptr<T>(),
      z.data_ptr<T>(),     gate.data_ptr<T>(),     weight.data_ptr<T>(),
      scale.data_ptr<T>(), shift.data_ptr<T>(),    keep.data_ptr<T>(),
      u_next.data_ptr<T>(), out.data_ptr<T>(),     mask.data_ptr<uint8_t>(),
      T(eps)};
  const T *pbw = bn_weight.data_ptr<T>(), *pbb = bn_bias.data_ptr<T>();
  T* prm = data_ptr_or_null<T>(running_mean);
  T* prv = data_ptr_or_null<T>(running_var);
  T *pmean = mean.data_ptr<T>(), *pinv = invstd.data_ptr<T>();
  T *psc = scale.data_ptr<T>(), *psh = shift.data_ptr<T>();
  std::vector<T> stats(2 * dm.B * dm.C);
  two_passes<T, Scratch<T>>(
      dm,
      [&](PlaneRange planes, Scratch<T>& s, T* conv) {
        over_planes<T>(
            dm, planes, conv,
            [&](PlaneRange range, T* cv) {
              stats_planes<T>(dm, a, stats.data(), range, s, cv);
            },
            [&](int64_t p0, auto* cv) {
              stats_group(dm, a, stats.data(), p0, cv);
            });
      },
      [&](int64_t c) {
        fold_channel_stats<T>(dm, stats.data(), c, pbw, pbb, prm, prv,
                              momentum, bn_eps, pmean, pinv, psc, psh);
      },
      [&](PlaneRange planes, Scratch<T>& s, T* conv) {
        over_planes<T>(
            dm, planes, conv,
            [&](PlaneRange range, T* cv) {
              forward_planes<T, false>(dm, a, range, s, cv);
            },
            [&](int64_t p0, auto* cv) { apply_group(dm, a, p0, cv); });
      });
}

// The heads' parameters (docs/method.md §2, steps 1-3): ECA kernels kq, kk
// of an odd number k of elements, the temperatures norm_d (G elements) and
// gate_w (G, G), raw.
template <typename T>
struct HeadOperands {
  const T *kq, *kk;
  int64_t k;
  const T *norm_d, *gate_w;
  double key_eps, max_log;
  HeadOperands(const at::Tensor& q_kernel, const at::Tensor& k_kernel,
               const at::Tensor& norm_d_, const at::Tensor& gate_weight,
               double key_eps_, double max_log_)
      : kq(q_kernel.data_ptr<T>()), kk(k_kernel.data_ptr<T>()),
        k(q_kernel.numel()), norm_d(norm_d_.data_ptr<T>()),
        gate_w(gate_weight.data_ptr<T>()), key_eps(key_eps_),
        max_log(max_log_) {}
};

// q, key (C,) = the ECA cross-correlations of pooled (C,) with kq, kk.
template <typename T>
void eca_pair(const HeadOperands<T>& h, const T* pooled, int64_t C,
              double* q, double* key) {
  eca<T>(h.kq, h.k, pooled, C, q);
  eca<T>(h.kk, h.k, pooled, C, key);
}

// Over head g's d channels: (|K_g|, <Q_g, K_g>).
inline std::pair<double, double> head_norm_dot(const double* q,
                                               const double* key, int64_t g,
                                               int64_t d) {
  double k2 = 0, qk = 0;
  for (int64_t c = g * d; c < (g + 1) * d; ++c) {
    k2 += key[c] * key[c];
    qk += q[c] * key[c];
  }
  return {std::sqrt(k2), qk};
}

// One sample's heads from its pooled features (C,): w = exp(min(|K_g| /
// norm_d_g, max_log)), z_next = z + w (z null: w), gate = sigmoid(gate_w @
// rel), rel_g = <Q_g, K_g> / max(|K_g|, key_eps); all (G,). In double;
// q, key: (C,) scratch.
template <typename T>
void sample_heads(const HeadOperands<T>& h, const T* pooled, int64_t C,
                  int64_t G, const T* z, T* w, T* z_next, T* gate,
                  std::vector<double>& q, std::vector<double>& key) {
  eca_pair<T>(h, pooled, C, q.data(), key.data());
  std::vector<double> rel(G);
  for (int64_t g = 0; g < G; ++g) {
    const auto [norm, qk] = head_norm_dot(q.data(), key.data(), g, C / G);
    const double wv = layer_weight(norm, double(h.norm_d[g]), h.max_log);
    w[g] = T(wv);
    z_next[g] = z != nullptr ? T(double(z[g]) + wv) : T(wv);
    rel[g] = qk / std::max(norm, h.key_eps);
  }
  for (int64_t g = 0; g < G; ++g) {
    double a = 0;
    for (int64_t j = 0; j < G; ++j) a += double(h.gate_w[g * G + j]) * rel[j];
    gate[g] = T(1.0 / (1.0 + std::exp(-a)));
  }
}

// sample_heads for every sample of pooled (B, C); z optional (B, G).
template <typename T>
void heads_forward(const at::Tensor& pooled, const at::Tensor& z,
                   const at::Tensor& q_kernel, const at::Tensor& k_kernel,
                   const at::Tensor& norm_d, const at::Tensor& gate_weight,
                   at::Tensor& w, at::Tensor& z_next, at::Tensor& gate,
                   double key_eps, double max_log_weight) {
  const int64_t B = pooled.size(0), C = pooled.size(1), G = w.size(1);
  const HeadOperands<T> h(q_kernel, k_kernel, norm_d, gate_weight, key_eps,
                          max_log_weight);
  const T* pz = data_ptr_or_null<T>(z);
  std::vector<double> q(C), key(C);
  for (int64_t b = 0; b < B; ++b) {
    sample_heads<T>(h, pooled.data_ptr<T>() + b * C, C, G,
                    pz ? pz + b * G : nullptr, w.data_ptr<T>() + b * G,
                    z_next.data_ptr<T>() + b * G, gate.data_ptr<T>() + b * G,
                    q, key);
  }
}

// Gradients of heads_forward w.r.t. pooled, the two ECA kernels and
// gate_weight, from those w.r.t. w (grad_w: the direct one plus z_next's,
// since z_next = z + w) and gate; in double. The clamps pass gradient where
// torch.clamp does (x <= max, |K| >= key_eps); |K| = 0 passes none.
template <typename T>
void heads_backward(const at::Tensor& pooled, const at::Tensor& q_kernel,
                    const at::Tensor& k_kernel, const at::Tensor& norm_d,
                    const at::Tensor& gate_weight, const at::Tensor& w,
                    const at::Tensor& gate, const at::Tensor& grad_w,
                    const at::Tensor& grad_gate, at::Tensor& grad_pooled,
                    at::Tensor& grad_q_kernel, at::Tensor& grad_k_kernel,
                    at::Tensor& grad_gate_weight, double key_eps,
                    double max_log_weight) {
  const HeadOperands<T> h(q_kernel, k_kernel, norm_d, gate_weight, key_eps,
                          max_log_weight);
  const int64_t B = pooled.size(0), C = pooled.size(1), G = w.size(1);
  const int64_t k = h.k, pad = (k - 1) / 2, d = C / G;
  const T *pp = pooled.data_ptr<T>(), *pw = w.data_ptr<T>();
  const T *pg = gate.data_ptr<T>(), *pgw = grad_w.data_ptr<T>();
  const T* pgg = grad_gate.data_ptr<T>();
  T* pgp = grad_pooled.data_ptr<T>();
  std::vector<double> q(C), key(C), dq(C), dk(C), rel(G), da(G);
  std::vector<double> gkq(k, 0.0), gkk(k, 0.0), ggw(G * G, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    const T* p = pp + b * C;
    eca_pair<T>(h, p, C, q.data(), key.data());
    for (int64_t g = 0; g < G; ++g) {  // da = dL/d(gate logit)
      const double gt = pg[b * G + g];
      da[g] = double(pgg[b * G + g]) * gt * (1.0 - gt);
    }
    for (int64_t g = 0; g < G; ++g) {
      const auto [norm, qk] = head_norm_dot(q.data(), key.data(), g, d);
      double dr = 0;
      for (int64_t j = 0; j < G; ++j) dr += double(h.gate_w[j * G + g]) * da[j];
      const double den = std::max(norm, key_eps);
      rel[g] = qk / den;
      double dn = 0;  // dL/d|K_g|
      if (norm / double(h.norm_d[g]) <= max_log_weight) {
        dn += double(pgw[b * G + g]) * double(pw[b * G + g]) /
              double(h.norm_d[g]);
      }
      if (norm >= key_eps) dn -= dr * qk / (den * den);
      const double dqk = dr / den, dkn = norm > 0 ? dn / norm : 0.0;
      for (int64_t c = g * d; c < (g + 1) * d; ++c) {
        dq[c] = dqk * key[c];
        dk[c] = dqk * q[c] + dkn * key[c];
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t j = 0; j < G; ++j) ggw[g * G + j] += da[g] * rel[j];
    }
    for (int64_t j = 0; j < C; ++j) {  // the ECA convs' transposes
      double gp = 0;
      for (int64_t t = std::max<int64_t>(0, j + pad - C + 1);
           t < std::min<int64_t>(k, j + pad + 1); ++t) {
        const int64_t c = j - t + pad;
        gp += double(h.kq[t]) * dq[c] + double(h.kk[t]) * dk[c];
        gkq[t] += dq[c] * p[j];
        gkk[t] += dk[c] * p[j];
      }
      pgp[b * C + j] = T(gp);
    }
  }
  for (int64_t t = 0; t < k; ++t) {
    grad_q_kernel.data_ptr<T>()[t] = T(gkq[t]);
    grad_k_kernel.data_ptr<T>()[t] = T(gkk[t]);
  }
  for (int64_t i = 0; i < G * G; ++i) {
    grad_gate_weight.data_ptr<T>()[i] = T(ggw[i]);
  }
}

// An eval BN as an affine, BN(v) = scale[c] * v + shift[c], from its
// parameters and running statistics (C values each), as torch folds it
// (in T).
template <typename T>
struct FoldedBN {
  std::vector<T> scale, shift;
  FoldedBN(const at::Tensor& weight, const at::Tensor& bias,
           const at::Tensor& mean, const at::Tensor& var, double eps)
      : scale(weight.numel()), shift(weight.numel()) {
    const T *pw = weight.data_ptr<T>(), *pb = bias.data_ptr<T>();
    const T *pm = mean.data_ptr<T>(), *pv = var.data_ptr<T>();
    for (size_t c = 0; c < scale.size(); ++c) {
      scale[c] = pw[c] * (T(1) / std::sqrt(pv[c] + T(eps)));
      shift[c] = pb[c] - pm[c] * scale[c];
    }
  }
};

// A whole KCLALayer in inference, one sample at a time (its maps are still
// in cache when the branch reads them): relu_pool with the block's tail BN
// folded, the heads, then branch_forward (keep = 1) with the branch BN
// folded, small planes in lane groups.
template <typename T>
void layer_inference(at::Tensor& s, const LayerInferenceOperands& op) {
  const Dims dm(s, op.w.size(1));
  const int64_t C = dm.C, G = dm.G;
  T* ps = s.data_ptr<T>();
  const T* pr = data_ptr_or_null<T>(op.residual);
  const FoldedBN<T> bn(op.bn_weight, op.bn_bias, op.bn_mean, op.bn_var,
                      op.bn_eps);
  std::optional<FoldedBN<T>> tail;
  if (op.tail_weight.defined()) {
    tail.emplace(op.tail_weight, op.tail_bias, op.tail_mean, op.tail_var,
                 op.tail_eps);
  }
  const T* ptsc = tail ? tail->scale.data() : nullptr;
  const T* ptsh = tail ? tail->shift.data() : nullptr;
  const T* pz = data_ptr_or_null<T>(op.z);
  T *pw = op.w.data_ptr<T>(), *pzn = op.z_next.data_ptr<T>();
  T* pg = op.gate.data_ptr<T>();
  const ForwardOperands<T> a{ps,
                             data_ptr_or_null<T>(op.u),
                             pw,
                             pzn,
                             pg,
                             op.weight.data_ptr<T>(),
                             bn.scale.data(),
                             bn.shift.data(),
                             nullptr,
                             op.u_next.data_ptr<T>(),
                             ps,
                             nullptr,
                             T(op.eps)};
  const HeadOperands<T> h(op.q_kernel, op.k_kernel, op.norm_d,
                          op.gate_weight, op.key_eps, op.max_log_weight);
  std::vector<T> pooled(dm.B * C);
  std::vector<double> q(C), key(C);
  for (int64_t b = 0; b < dm.B; ++b) {
    at::parallel_for(b * C, (b + 1) * C, 1, [&](int64_t begin, int64_t end) {
      relu_pool_planes<T>(ps, pr, ptsc, ptsh, nullptr, pooled.data(), C,
                          dm.HW, begin, end);
    });
    sample_heads<T>(h, pooled.data() + b * C, C, G,
                    pz ? pz + b * G : nullptr, pw + b * G, pzn + b * G,
                    pg + b * G, q, key);
    at::parallel_for(b * C, (b + 1) * C, 1, [&](int64_t begin, int64_t end) {
      Scratch<T> sc(dm);
      over_planes<T>(
          dm, contiguous_planes(begin, end), nullptr,
          [&](PlaneRange range, T*) {
            forward_planes<T, true>(dm, a, range, sc, nullptr);
          },
          [&](auto p0, auto*) { forward_group(dm, a, p0); });
    });
  }
}

// The cross-stage adapter in inference (docs/method.md §3, Algorithm 1, its
// eval BN folded into scale, shift). With U_s = u at stride s (B, C', h, w),
// W_b = the grouped 1x1 conv weight (C, C' / G) over each input channel's
// incoming Z, per sample: GAP(A') = scale * (W_b GAP(U_s)) + shift (A' is
// affine in U_s), z_out = exp(min(|Conv1d_u(GAP(A'))_g| / norm_d_g,
// max_log)) and u_out = z_out * A' = (z_out scale W_b) U_s + z_out shift,
// one batched matmul over (sample, head).
template <typename T>
void adapter_inference(const at::Tensor& u, const at::Tensor& z,
                       const at::Tensor& weight, int64_t stride,
                       const at::Tensor& bn_weight, const at::Tensor& bn_bias,
                       const at::Tensor& bn_mean, const at::Tensor& bn_var,
                       const at::Tensor& k_kernel, const at::Tensor& norm_d,
                       at::Tensor& u_out, at::Tensor& z_out, double bn_eps,
                       double max_log_weight) {
  const int64_t B = u.size(0), Ci = u.size(1), H = u.size(2), W = u.size(3);
  const int64_t C = u_out.size(1), h = u_out.size(2), w = u_out.size(3);
  const int64_t hw = h * w, G = z_out.size(1), d = C / G, di = Ci / G;
  const int64_t Gi = z.size(1), din = Ci / Gi;  // incoming heads
  const at::Tensor us =
      stride == 1 ? u : at::empty({B, Ci, h, w}, u.options());
  std::vector<T> gap(B * Ci);
  const T* pu = u.data_ptr<T>();
  T* pus = us.data_ptr<T>();
  at::parallel_for(0, B * Ci, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      T sum = 0;
      if (stride == 1) {
        for (int64_t i = p * hw; i < (p + 1) * hw; ++i) sum += pu[i];
      } else {  // gather U_s as the strided conv reads it
        for (int64_t i = 0; i < h; ++i) {
          const T* src = pu + p * H * W + i * stride * W;
          T* dst = pus + p * hw + i * w;
          for (int64_t j = 0; j < w; ++j) {
            dst[j] = src[j * stride];
            sum += dst[j];
          }
        }
      }
      gap[p] = sum / T(hw);
    }
  });
  const FoldedBN<T> bn(bn_weight, bn_bias, bn_mean, bn_var, bn_eps);
  at::Tensor mat = at::empty({B * G, d, di}, u.options());
  at::Tensor bias = at::empty({B * G, d, 1}, u.options());
  const T *pw = weight.data_ptr<T>(), *pz = z.data_ptr<T>();
  const T *pk = k_kernel.data_ptr<T>(), *pnd = norm_d.data_ptr<T>();
  T *pm = mat.data_ptr<T>(), *pb = bias.data_ptr<T>();
  T* pzo = z_out.data_ptr<T>();
  std::vector<T> inv_z(Ci), pooled(C);
  std::vector<double> key(C);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < Ci; ++c) {
      inv_z[c] = T(1) / pz[b * Gi + c / din];
    }
    for (int64_t c = 0; c < C; ++c) {  // W_b's row c, then GAP(A')
      const int64_t c0 = (c / d) * di;
      T* row = pm + (b * C + c) * di;
      T y = 0;
      for (int64_t j = 0; j < di; ++j) {
        row[j] = pw[c * di + j] * inv_z[c0 + j];
        y += row[j] * gap[b * Ci + c0 + j];
      }
      pooled[c] = bn.scale[c] * y + bn.shift[c];
    }
    eca<T>(pk, k_kernel.numel(), pooled.data(), C, key.data());
    for (int64_t g = 0; g < G; ++g) {
      double k2 = 0;
      for (int64_t c = g * d; c < (g + 1) * d; ++c) k2 += key[c] * key[c];
      const T zg = T(layer_weight(std::sqrt(k2), double(pnd[g]),
                                  max_log_weight));
      pzo[b * G + g] = zg;
      for (int64_t c = g * d; c < (g + 1) * d; ++c) {  // z scale W_b
        const T sc = zg * bn.scale[c];
        T* row = pm + (b * C + c) * di;
        for (int64_t j = 0; j < di; ++j) row[j] *= sc;
        pb[b * C + c] = zg * bn.shift[c];
      }
    }
  }
  at::Tensor out = u_out.view({B * G, d, hw});
  at::baddbmm_out(out, bias, mat, us.view({B * G, di, hw}));
}

// branch_bn_sums over `planes`; where conv is given, each plane's conv into
// its row as in stats_planes.
template <typename T>
void bn_sums_planes(const Dims& dm, const BackwardOperands<T>& a, T* bn_sums,
                    PlaneRange planes, Scratch<T>& s, T* conv) {
  // operands in locals: the byte stores below may alias `a` and `dm`
  const T *pgo = a.grad_out, *pun = a.u_next, *pz = a.z, *pg = a.gate;
  const T *pk = a.weight, *pkeep = a.keep, *pm = a.mean;
  const uint8_t* pmask = a.mask;
  const T eps = a.eps;
  const int64_t hw = dm.HW, C = dm.C, bytes = dm.bytes;
  for (int64_t k = 0; k < planes.count(); ++k) {
    const int64_t p = planes[k];
    const int64_t c = p % C, n = dm.head(p), off = p * hw;
    load_plane<T>(pun + off, s.agg, T(1) / (pz[n] + eps));
    T* cv = conv != nullptr ? conv + k * s.agg.n : s.agg.out.data();
    conv3x3<T>(s.agg, pk + c * 9, cv);
    unpack_bits(pmask + p * bytes, hw, s.on.data());
    const T* __restrict__ go = pgo + off;
    const uint8_t* __restrict__ on = s.on.data();
    const T gt = pg[n], kp = pkeep[p / C], mu = pm[c];
    T sg = 0, sgc = 0;
    for (int64_t i = 0; i < hw; ++i) {
      const T gn = on[i] ? go[i] * kp : T(0);
      sg += gn;
      sgc += gn * (gt * cv[i] - mu);
    }
    bn_sums[2 * p] = sg;
    bn_sums[2 * p + 1] = sgc;
  }
}

// branch_backward over `planes`, from conv (bn_sums_planes' rows) where
// given: the per-plane partial sums into bn_sums, head_sums and
// weight_sums.
template <typename T>
void backward_planes(const Dims& dm, const BackwardOperands<T>& a,
                     T* bn_sums, T* head_sums, T* weight_sums,
                     PlaneRange planes, BackwardScratch<T>& s,
                     const T* conv) {
  const T *pgo = a.grad_out, *pgun = a.grad_u_next, *pout = a.out;
  const T *pw = a.w, *pz = a.z, *pg = a.gate, *pk = a.weight;
  const T *ps = a.scale, *pb = a.shift, *pkeep = a.keep, *pal = a.alpha;
  const T *pbe = a.beta, *pm = a.mean, *pconv = conv;
  const uint8_t* pmask = a.mask;
  T *pun = a.u_next, *pgx = a.grad_x, *pgu = a.grad_u, *pup = a.u_prev;
  const T eps = a.eps;
  const int64_t hw = dm.HW, C = dm.C, bytes = dm.bytes;
  FlatPlane<T>& g_pad = s.g_pad;
  T flipped[9];
  for (int64_t k = 0; k < planes.count(); ++k) {
    const int64_t p = planes[k];
    const int64_t c = p % C, n = dm.head(p), off = p * hw;
    const T wv = pw[n], gt = pg[n], inv = T(1) / (pz[n] + eps);
    const T sc = ps[c], sh = pb[c], kp = pkeep[p / C];
    const T al = pal[c], be = pbe[c], mu = pm[c];
    const T* k9 = pk + c * 9;
    load_plane<T>(pun + off, s.agg, inv);
    const T* __restrict__ cv = s.agg.out.data();  // the conv, before the gate
    if (pconv != nullptr) {
      cv = pconv + k * s.agg.n;
    } else {
      conv3x3<T>(s.agg, k9);
    }
    unpack_bits(pmask + p * bytes, hw, s.on.data());
    const T* __restrict__ go = pgo + off;
    const T* __restrict__ o_sum = pout + off;
    const uint8_t* __restrict__ on = s.on.data();
    T* __restrict__ xr = s.x_rec.data();
    T* __restrict__ gc = g_pad.data();
    T sg = 0, sgc = 0, s_gate = 0;
    for (int64_t i = 0; i < hw; ++i) {
      const T o = gt * cv[i];
      const T y = on[i] ? kp * (sc * o + sh) : T(0);
      xr[i] = o_sum[i] - y;
      const T gn = on[i] ? go[i] * kp : T(0);
      sg += gn;
      sgc += gn * (o - mu);
      const T g_o = sc * gn + al + be * (o - mu);
      s_gate += g_o * cv[i];
      gc[i] = g_o * gt;
    }
    conv3x3_weight_grad<T>(gc, s.agg, weight_sums + p * 9);
    flip3x3<T>(k9, flipped);
    conv3x3<T>(g_pad, flipped);  // gradient of agg
    T s_z, s_w;
    state_grads_plane<T>(g_pad.out.data(), pun + off,
                         pgun != nullptr ? pgun + off : s.zeros.data(), go, xr,
                         pgu != nullptr ? pgu + off : s.gu.data(),
                         pgx + off, inv, wv, hw, s_z, s_w);
    invert_state<T>(pun + off, pup != nullptr ? pup + off : nullptr, xr, wv,
                    hw);
    bn_sums[2 * p] = sg;
    bn_sums[2 * p + 1] = sgc;
    head_sums[3 * p] = s_w;
    head_sums[3 * p + 1] = -s_z * inv * inv;
    head_sums[3 * p + 2] = s_gate;
  }
}

template <typename T>
BackwardOperands<T> backward_operands(
    const at::Tensor& grad_out, const at::Tensor& grad_u_next,
    const at::Tensor& out, const at::Tensor& u_next, const at::Tensor& w,
    const at::Tensor& z, const at::Tensor& gate, const at::Tensor& weight,
    const at::Tensor& scale, const at::Tensor& shift, const at::Tensor& keep,
    const at::Tensor& mask, const at::Tensor& mean, at::Tensor& grad_x,
    at::Tensor& grad_u, at::Tensor& u_prev, double eps) {
  return {grad_out.data_ptr<T>(),
          data_ptr_or_null<T>(grad_u_next),
          data_ptr_or_null<T>(out),
          data_ptr_or_null<T>(w),
          z.data_ptr<T>(),
          gate.data_ptr<T>(),
          weight.data_ptr<T>(),
          data_ptr_or_null<T>(scale),
          data_ptr_or_null<T>(shift),
          keep.data_ptr<T>(),
          nullptr,
          nullptr,
          mean.data_ptr<T>(),
          mask.data_ptr<uint8_t>(),
          const_cast<T*>(u_next.data_ptr<T>()),
          data_ptr_or_null<T>(grad_x),
          data_ptr_or_null<T>(grad_u),
          data_ptr_or_null<T>(u_prev),
          T(eps)};
}

template <typename T>
void branch_bn_sums(const at::Tensor& grad_out, const at::Tensor& u_next,
                    const at::Tensor& z, const at::Tensor& gate,
                    const at::Tensor& weight, const at::Tensor& keep,
                    const at::Tensor& mask, const at::Tensor& mean,
                    at::Tensor& bn_sums, double eps) {
  const Dims dm(u_next, z.size(1));
  at::Tensor none;
  const BackwardOperands<T> a = backward_operands<T>(
      grad_out, none, none, u_next, none, z, gate, weight, none, none, keep,
      mask, mean, none, none, none, eps);
  T* psum = bn_sums.data_ptr<T>();
  at::parallel_for(0, dm.B * dm.C, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> s(dm);
    bn_sums_planes<T>(dm, a, psum, contiguous_planes(begin, end), s,
                      nullptr);
  });
}

template <typename T>
void branch_backward(const at::Tensor& grad_out, const at::Tensor& grad_u_next,
                     const at::Tensor& out, const at::Tensor& u_next,
                     const at::Tensor& w, const at::Tensor& z,
                     const at::Tensor& gate, const at::Tensor& weight,
                     const at::Tensor& scale, const at::Tensor& shift,
                     const at::Tensor& keep, const at::Tensor& mask,
                     const at::Tensor& alpha, const at::Tensor& beta,
                     const at::Tensor& mean, at::Tensor& grad_x,
                     at::Tensor& grad_u, at::Tensor& u_prev,
                     at::Tensor& bn_sums, at::Tensor& head_sums,
                     at::Tensor& weight_sums, double eps) {
  const Dims dm(out, w.size(1));
  BackwardOperands<T> a = backward_operands<T>(
      grad_out, grad_u_next, out, u_next, w, z, gate, weight, scale, shift,
      keep, mask, mean, grad_x, grad_u, u_prev, eps);
  a.alpha = alpha.data_ptr<T>();
  a.beta = beta.data_ptr<T>();
  T *pbn = bn_sums.data_ptr<T>(), *phs = head_sums.data_ptr<T>();
  T* pws = weight_sums.data_ptr<T>();
  at::parallel_for(0, dm.B * dm.C, 1, [&](int64_t begin, int64_t end) {
    BackwardScratch<T> s(dm);
    backward_planes<T>(dm, a, pbn, phs, pws, contiguous_planes(begin, end), s,
                       nullptr);
  });
}

// The whole training backward in one call, channel by channel (so that
// the second pass finds the channel's maps in cache): with batch
// statistics, bn_sums_planes over its B planes (keeping their convs) and
// BN's gradient terms alpha, beta; then backward_planes; then the
// per-plane sums reduced (in double) to grad_w, grad_z, grad_gate (B, G),
// grad_weight (C, 1, 3, 3) and BN's grad_bn_weight, grad_bn_bias (C,).
template <typename T>
void branch_train_backward(
    const at::Tensor& grad_out, const at::Tensor& grad_u_next,
    const at::Tensor& out, const at::Tensor& u_next, const at::Tensor& w,
    const at::Tensor& z, const at::Tensor& gate, const at::Tensor& weight,
    const at::Tensor& scale, const at::Tensor& shift, const at::Tensor& keep,
    const at::Tensor& mask, const at::Tensor& mean, const at::Tensor& invstd,
    at::Tensor& grad_x, at::Tensor& grad_u, at::Tensor& u_prev,
    at::Tensor& grad_w, at::Tensor& grad_z, at::Tensor& grad_gate,
    at::Tensor& grad_weight, at::Tensor& grad_bn_weight,
    at::Tensor& grad_bn_bias, bool batch_stats, double eps) {
  const Dims dm(out, w.size(1));
  const int64_t B = dm.B, C = dm.C, G = dm.G, planes = B * C;
  BackwardOperands<T> a = backward_operands<T>(
      grad_out, grad_u_next, out, u_next, w, z, gate, weight, scale, shift,
      keep, mask, mean, grad_x, grad_u, u_prev, eps);
  const T *pinv = invstd.data_ptr<T>(), *psc = scale.data_ptr<T>();
  T *pgbw = grad_bn_weight.data_ptr<T>(), *pgbb = grad_bn_bias.data_ptr<T>();
  std::vector<T> alpha(C, T(0)), beta(C, T(0));
  a.alpha = alpha.data();
  a.beta = beta.data();
  // BN's gradients of channel c: its (B, C, 2) per-plane sums summed over
  // the batch
  const auto bn_grads = [&](const std::vector<T>& sums, int64_t c) {
    double sg = 0, sgc = 0;
    for (int64_t b = 0; b < B; ++b) {
      sg += double(sums[2 * (b * C + c)]);
      sgc += double(sums[2 * (b * C + c) + 1]);
    }
    pgbw[c] = pinv[c] * T(sgc);  // the sum of g * x_hat
    pgbb[c] = T(sg);
  };
  std::vector<T> bn_sums(2 * planes), plane_bn(2 * planes);
  std::vector<T> head_sums(3 * planes), weight_sums(9 * planes);
  const T n = T(B * dm.HW);
  const auto rest = [&](PlaneRange planes, BackwardScratch<T>& s, T* conv) {
    over_planes<T>(
        dm, planes, conv,
        [&](PlaneRange range, T* cv) {
          backward_planes<T>(dm, a, plane_bn.data(), head_sums.data(),
                             weight_sums.data(), range, s, cv);
        },
        [&](int64_t p0, auto* cv) {
          backward_group(dm, a, plane_bn.data(), head_sums.data(),
                         weight_sums.data(), p0, cv);
        });
  };
  if (batch_stats) {
    const auto sums = [&](PlaneRange planes, BackwardScratch<T>& s,
                          T* conv) {
      over_planes<T>(
          dm, planes, conv,
          [&](PlaneRange range, T* cv) {
            bn_sums_planes<T>(dm, a, bn_sums.data(), range, s, cv);
          },
          [&](int64_t p0, auto* cv) {
            bn_sums_group(dm, a, bn_sums.data(), p0, cv);
          });
    };
    const auto fold = [&](int64_t c) {
      bn_grads(bn_sums, c);
      alpha[c] = -psc[c] * pgbb[c] / n;
      beta[c] = -psc[c] * pinv[c] * pgbw[c] / n;
    };
    two_passes<T, BackwardScratch<T>>(dm, sums, fold, rest);
  } else {  // one pass (alpha = beta = 0), recomputing each plane's conv
    at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
      BackwardScratch<T> s(dm);
      rest(contiguous_planes(begin, end), s, nullptr);
    });
    for (int64_t c = 0; c < C; ++c) bn_grads(plane_bn, c);
  }
  T *pgw = grad_w.data_ptr<T>(), *pgz = grad_z.data_ptr<T>();
  T *pgg = grad_gate.data_ptr<T>(), *pgk = grad_weight.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      double sw = 0, sz = 0, sgate = 0;
      for (int64_t c = g * dm.d; c < (g + 1) * dm.d; ++c) {
        const T* h = head_sums.data() + 3 * (b * C + c);
        sw += double(h[0]);
        sz += double(h[1]);
        sgate += double(h[2]);
      }
      pgw[b * G + g] = T(sw);
      pgz[b * G + g] = T(sz);
      pgg[b * G + g] = T(sgate);
    }
  }
  std::vector<double> sum_k(9 * C, 0.0);  // over the batch, in order
  for (int64_t b = 0; b < B; ++b) {
    const T* __restrict__ ws = weight_sums.data() + 9 * b * C;
    for (int64_t i = 0; i < 9 * C; ++i) sum_k[i] += double(ws[i]);
  }
  for (int64_t i = 0; i < 9 * C; ++i) pgk[i] = T(sum_k[i]);
}

#define KCLA_DISPATCH_CPU(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES(TYPE, NAME, [&] { __VA_ARGS__; })

// The launchers of this ISA's copy, with the *_impl signatures.
void relu_pool_forward_cpu(at::Tensor s, const at::Tensor residual,
                           at::Tensor mask, at::Tensor pooled) {
  KCLA_DISPATCH_CPU(s.scalar_type(), "kcla_relu_pool_forward_cpu",
                    relu_pool_forward<scalar_t>(s, residual, mask, pooled));
}

void relu_pool_backward_cpu(const at::Tensor grad_x,
                                   const at::Tensor grad_pooled,
                                   const at::Tensor mask, at::Tensor grad_s) {
  KCLA_DISPATCH_CPU(grad_x.scalar_type(), "kcla_relu_pool_backward_cpu",
                    relu_pool_backward<scalar_t>(grad_x, grad_pooled, mask,
                                                 grad_s));
}

void branch_stats_cpu(const at::Tensor x, const at::Tensor u,
                             const at::Tensor w, const at::Tensor z,
                             const at::Tensor gate, const at::Tensor weight,
                             at::Tensor u_next, at::Tensor stats, double eps) {
  KCLA_DISPATCH_CPU(x.scalar_type(), "kcla_branch_stats_cpu",
                    branch_stats<scalar_t>(x, u, w, z, gate, weight, u_next,
                                           stats, eps));
}

void branch_forward_cpu(const at::Tensor x, const at::Tensor u,
                               const at::Tensor w, const at::Tensor z,
                               const at::Tensor gate, const at::Tensor weight,
                               const at::Tensor scale, const at::Tensor shift,
                               const at::Tensor keep, at::Tensor u_next,
                               at::Tensor out, at::Tensor mask, double eps) {
  KCLA_DISPATCH_CPU(x.scalar_type(), "kcla_branch_forward_cpu",
                    branch_forward<scalar_t, true>(x, u, w, z, gate, weight,
                                                   scale, shift, keep, u_next,
                                                   out, mask, eps));
}

void branch_apply_cpu(const at::Tensor x, const at::Tensor u_next,
                             const at::Tensor z, const at::Tensor gate,
                             const at::Tensor weight, const at::Tensor scale,
                             const at::Tensor shift, const at::Tensor keep,
                             at::Tensor out, at::Tensor mask, double eps) {
  at::Tensor u_next_t = u_next;
  KCLA_DISPATCH_CPU(x.scalar_type(), "kcla_branch_apply_cpu",
                    branch_forward<scalar_t, false>(
                        x, at::Tensor(), at::Tensor(), z, gate, weight, scale,
                        shift, keep, u_next_t, out, mask, eps));
}

void branch_bn_sums_cpu(const at::Tensor grad_out,
                               const at::Tensor u_next, const at::Tensor z,
                               const at::Tensor gate, const at::Tensor weight,
                               const at::Tensor keep, const at::Tensor mask,
                               const at::Tensor mean, at::Tensor bn_sums,
                               double eps) {
  KCLA_DISPATCH_CPU(u_next.scalar_type(), "kcla_branch_bn_sums_cpu",
                    branch_bn_sums<scalar_t>(grad_out, u_next, z, gate,
                                             weight, keep, mask, mean,
                                             bn_sums, eps));
}

void branch_backward_cpu(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, at::Tensor grad_x, at::Tensor grad_u,
    at::Tensor u_prev, at::Tensor bn_sums, at::Tensor head_sums,
    at::Tensor weight_sums, double eps) {
  KCLA_DISPATCH_CPU(out.scalar_type(), "kcla_branch_backward_cpu",
                    branch_backward<scalar_t>(
                        grad_out, grad_u_next, out, u_next, w, z, gate,
                        weight, scale, shift, keep, mask, alpha, beta, mean,
                        grad_x, grad_u, u_prev, bn_sums, head_sums,
                        weight_sums, eps));
}

void branch_train_forward_cpu(
    const at::Tensor x, const at::Tensor u, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor bn_weight, const at::Tensor bn_bias,
    at::Tensor running_mean, at::Tensor running_var, const at::Tensor keep,
    at::Tensor u_next, at::Tensor out, at::Tensor mask, at::Tensor mean,
    at::Tensor invstd, at::Tensor scale, at::Tensor shift, double momentum,
    double bn_eps, double eps) {
  KCLA_DISPATCH_CPU(x.scalar_type(), "kcla_branch_train_forward_cpu",
                    branch_train_forward<scalar_t>(
                        x, u, w, z, gate, weight, bn_weight, bn_bias,
                        running_mean, running_var, keep, u_next, out, mask,
                        mean, invstd, scale, shift, momentum, bn_eps, eps));
}

void branch_train_backward_cpu(
    const at::Tensor grad_out, const at::Tensor grad_u_next,
    const at::Tensor out, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    const at::Tensor scale, const at::Tensor shift, const at::Tensor keep,
    const at::Tensor mask, const at::Tensor mean, const at::Tensor invstd,
    at::Tensor grad_x, at::Tensor grad_u, at::Tensor u_prev,
    at::Tensor grad_w, at::Tensor grad_z, at::Tensor grad_gate,
    at::Tensor grad_weight, at::Tensor grad_bn_weight,
    at::Tensor grad_bn_bias, bool batch_stats, double eps) {
  KCLA_DISPATCH_CPU(out.scalar_type(), "kcla_branch_train_backward_cpu",
                    branch_train_backward<scalar_t>(
                        grad_out, grad_u_next, out, u_next, w, z, gate,
                        weight, scale, shift, keep, mask, mean, invstd,
                        grad_x, grad_u, u_prev, grad_w, grad_z, grad_gate,
                        grad_weight, grad_bn_weight, grad_bn_bias,
                        batch_stats, eps));
}

void layer_inference_cpu(at::Tensor s, const LayerInferenceOperands& a) {
  KCLA_DISPATCH_CPU(s.scalar_type(), "kcla_layer_inference_cpu",
                    layer_inference<scalar_t>(s, a));
}

void adapter_inference_cpu(const at::Tensor u, const at::Tensor z,
                           const at::Tensor weight, int64_t stride,
                           const at::Tensor bn_weight,
                           const at::Tensor bn_bias, const at::Tensor bn_mean,
                           const at::Tensor bn_var, const at::Tensor k_kernel,
                           const at::Tensor norm_d, at::Tensor u_out,
                           at::Tensor z_out, double bn_eps,
                           double max_log_weight) {
  KCLA_DISPATCH_CPU(u.scalar_type(), "kcla_adapter_inference_cpu",
                    adapter_inference<scalar_t>(
                        u, z, weight, stride, bn_weight, bn_bias, bn_mean,
                        bn_var, k_kernel, norm_d, u_out, z_out, bn_eps,
                        max_log_weight));
}

void heads_forward_cpu(const at::Tensor pooled, const at::Tensor z,
                       const at::Tensor q_kernel, const at::Tensor k_kernel,
                       const at::Tensor norm_d, const at::Tensor gate_weight,
                       at::Tensor w, at::Tensor z_next, at::Tensor gate,
                       double key_eps, double max_log_weight) {
  KCLA_DISPATCH_CPU(pooled.scalar_type(), "kcla_heads_forward_cpu",
                    heads_forward<scalar_t>(pooled, z, q_kernel, k_kernel,
                                            norm_d, gate_weight, w, z_next,
                                            gate, key_eps, max_log_weight));
}

void heads_backward_cpu(
    const at::Tensor pooled, const at::Tensor q_kernel,
    const at::Tensor k_kernel, const at::Tensor norm_d,
    const at::Tensor gate_weight, const at::Tensor w, const at::Tensor gate,
    const at::Tensor grad_w, const at::Tensor grad_gate,
    at::Tensor grad_pooled, at::Tensor grad_q_kernel,
    at::Tensor grad_k_kernel, at::Tensor grad_gate_weight, double key_eps,
    double max_log_weight) {
  KCLA_DISPATCH_CPU(pooled.scalar_type(), "kcla_heads_backward_cpu",
                    heads_backward<scalar_t>(
                        pooled, q_kernel, k_kernel, norm_d, gate_weight, w,
                        gate, grad_w, grad_gate, grad_pooled, grad_q_kernel,
                        grad_k_kernel, grad_gate_weight, key_eps,
                        max_log_weight));
}

#undef KCLA_DISPATCH_CPU

inline BranchKernels kernels() {
  return {relu_pool_forward_cpu, relu_pool_backward_cpu, branch_stats_cpu,
          branch_forward_cpu,    branch_apply_cpu,       branch_bn_sums_cpu,
          branch_backward_cpu,   branch_train_forward_cpu,
          branch_train_backward_cpu, layer_inference_cpu, heads_forward_cpu,
          heads_backward_cpu, adapter_inference_cpu};
}

}  // namespace KCLA_CPU_NS
