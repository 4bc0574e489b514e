// CPU launchers of the fused KCLA branch: one task per (b, c) plane, with
// plane-sized scratch buffers that stay in cache.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kcla_branch_impl.hpp"
#include "kcla_plane.hpp"
#include "pytorch_cpp_helper.hpp"
#include "pytorch_device_registry.hpp"

namespace {

struct Dims {
  int64_t B, C, G, d, H, W, HW;
  explicit Dims(const at::Tensor& x, const at::Tensor& w)
      : B(x.size(0)), C(x.size(1)), G(w.size(1)), d(x.size(1) / w.size(1)),
        H(x.size(2)), W(x.size(3)), HW(x.size(2) * x.size(3)) {}
  int64_t head(int64_t plane) const {  // index into (B, G) tensors
    return (plane / C) * G + (plane % C) / d;
  }
};

// u_next = u + w x, and u_next / (z + eps) into the padded plane.
template <typename T>
inline void update_plane(const T* __restrict__ x, const T* u, T* u_next,
                         PaddedPlane<T>& agg, T wv, T inv) {  // u may alias
  for (int64_t i = 0; i < agg.H; ++i) {
    T* __restrict__ row = agg.row(i);
    const int64_t off = i * agg.W;
    for (int64_t j = 0; j < agg.W; ++j) {
      T s = wv * x[off + j];
      if (u != nullptr) s += u[off + j];
      u_next[off + j] = s;
      row[j] = s * inv;
    }
  }
}

// The plane u_next / (z + eps) into the padded buffer.
template <typename T>
inline void load_scaled_plane(const T* __restrict__ src, PaddedPlane<T>& dst,
                              T scale) {
  for (int64_t i = 0; i < dst.H; ++i) {
    T* __restrict__ row = dst.row(i);
    const T* __restrict__ src_row = src + i * dst.W;
    for (int64_t j = 0; j < dst.W; ++j) row[j] = src_row[j] * scale;
  }
}

// dst[i * W + j] = scale * conv[i * Wp + j]
template <typename T>
inline void store_plane(const PaddedPlane<T>& p, T* __restrict__ dst,
                        T scale) {
  for (int64_t i = 0; i < p.H; ++i) {
    const T* __restrict__ src = p.out.data() + i * p.Wp;
    for (int64_t j = 0; j < p.W; ++j) dst[i * p.W + j] = scale * src[j];
  }
}

template <typename T>
void forward_kernel(const at::Tensor& x, const at::Tensor& u,
                    const at::Tensor& w, const at::Tensor& z,
                    const at::Tensor& gate, const at::Tensor& weight,
                    at::Tensor& u_next, at::Tensor& o, double eps) {
  const Dims dm(x, w);
  const T *px = x.data_ptr<T>(), *pu = data_ptr_or_null<T>(u);
  const T *pw = w.data_ptr<T>(), *pz = z.data_ptr<T>();
  const T *pg = gate.data_ptr<T>(), *pk = weight.data_ptr<T>();
  T *pun = u_next.data_ptr<T>(), *po = o.data_ptr<T>();
  at::parallel_for(0, dm.B * dm.C, 1, [&](int64_t begin, int64_t end) {
    PaddedPlane<T> agg(dm.H, dm.W);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = dm.head(p), off = p * dm.HW;
      const T inv = T(1) / (pz[n] + T(eps));
      update_plane<T>(px + off, pu ? pu + off : nullptr, pun + off, agg,
                      pw[n], inv);
      conv3x3_padded<T>(agg, pk + (p % dm.C) * 9);
      store_plane<T>(agg, po + off, pg[n]);
    }
  });
}

template <typename T>
void recompute_kernel(const at::Tensor& u_next, const at::Tensor& z,
                      const at::Tensor& gate, const at::Tensor& weight,
                      at::Tensor& o, double eps) {
  const Dims dm(u_next, z);
  const T *pun = u_next.data_ptr<T>(), *pz = z.data_ptr<T>();
  const T *pg = gate.data_ptr<T>(), *pk = weight.data_ptr<T>();
  T* po = o.data_ptr<T>();
  at::parallel_for(0, dm.B * dm.C, 1, [&](int64_t begin, int64_t end) {
    PaddedPlane<T> agg(dm.H, dm.W);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = dm.head(p), off = p * dm.HW;
      const T inv = T(1) / (pz[n] + T(eps));
      load_scaled_plane<T>(pun + off, agg, inv);
      conv3x3_padded<T>(agg, pk + (p % dm.C) * 9);
      store_plane<T>(agg, po + off, pg[n]);
    }
  });
}

// Calls fn(byte, first, count) for each byte of a plane's ReLU mask (bit k
// of byte j is position 8 * j + k); full bytes pass count 8, so their loops
// unroll once inlined.
template <typename Fn>
inline void for_each_mask_byte(int64_t hw, Fn&& fn) {
  const int64_t full = hw / 8;
  for (int64_t j = 0; j < full; ++j) fn(j, 8 * j, int64_t(8));
  if (8 * full < hw) fn(full, 8 * full, hw - 8 * full);
}

template <typename T>
void bn_relu_add_forward_kernel(const at::Tensor& o, const at::Tensor& x,
                                const at::Tensor& scale,
                                const at::Tensor& shift, const at::Tensor& keep,
                                at::Tensor& out, at::Tensor& mask) {
  const int64_t B = o.size(0), C = o.size(1), HW = o.size(2) * o.size(3);
  const int64_t bytes = mask.size(2);
  const T *po = o.data_ptr<T>(), *px = x.data_ptr<T>();
  const T *ps = scale.data_ptr<T>(), *pb = shift.data_ptr<T>();
  const T* pk = keep.data_ptr<T>();
  T* pout = out.data_ptr<T>();
  uint8_t* pmask = mask.data_ptr<uint8_t>();
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const T sc = ps[p % C], sh = pb[p % C], kp = pk[p / C];
      uint8_t* bits = pmask + p * bytes;
      for_each_mask_byte(HW, [&](int64_t j, int64_t i0, int64_t n) {
        uint8_t byte = 0;
        for (int64_t k = 0; k < n; ++k) {
          const int64_t i = p * HW + i0 + k;
          const T y = sc * po[i] + sh;
          pout[i] = px[i] + kp * std::max(y, T(0));
          byte |= uint8_t(y > T(0)) << k;
        }
        bits[j] = byte;
      });
    }
  });
}

template <typename T>
void bn_relu_add_backward_kernel(const at::Tensor& grad_out,
                                 const at::Tensor& o, const at::Tensor& scale,
                                 const at::Tensor& mask,
                                 const at::Tensor& keep, const at::Tensor& mean,
                                 at::Tensor& grad_o, at::Tensor& sum_grad,
                                 at::Tensor& sum_grad_c) {
  using acc_t = at::opmath_type<T>;
  const int64_t B = o.size(0), C = o.size(1), HW = o.size(2) * o.size(3);
  const T *pgo = grad_out.data_ptr<T>(), *po = o.data_ptr<T>();
  const int64_t bytes = mask.size(2);
  const T* ps = scale.data_ptr<T>();
  const T *pk = keep.data_ptr<T>(), *pm = mean.data_ptr<T>();
  const uint8_t* pmask = mask.data_ptr<uint8_t>();
  T *pgrad = grad_o.data_ptr<T>(), *psg = sum_grad.data_ptr<T>();
  T* psgc = sum_grad_c.data_ptr<T>();
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const T sc = ps[c], mu = pm[c];
      acc_t sg = 0, sgc = 0;
      for (int64_t b = 0; b < B; ++b) {
        const T kp = pk[b];
        const int64_t off = (b * C + c) * HW;
        const uint8_t* bits = pmask + (b * C + c) * bytes;
        for_each_mask_byte(HW, [&](int64_t j, int64_t i0, int64_t n) {
          for (int64_t k = 0; k < n; ++k) {
            const int64_t i = off + i0 + k;
            const T gn = pgo[i] * kp * T((bits[j] >> k) & 1);
            pgrad[i] = gn * sc;
            sg += gn;
            sgc += acc_t(gn) * acc_t(po[i] - mu);
          }
        });
      }
      psg[c] = T(sg);
      psgc[c] = T(sgc);
    }
  });
}

template <typename T>
void backward_kernel(const at::Tensor& grad_o, const at::Tensor& alpha,
                     const at::Tensor& beta, const at::Tensor& mean,
                     const at::Tensor& grad_u_next,
                     const at::Tensor& grad_residual, const at::Tensor& x,
                     const at::Tensor& u_next, const at::Tensor& w,
                     const at::Tensor& z, const at::Tensor& gate,
                     const at::Tensor& weight, at::Tensor& grad_x,
                     at::Tensor& grad_u, at::Tensor& grad_w,
                     at::Tensor& grad_z, at::Tensor& grad_gate,
                     at::Tensor& grad_weight, double eps) {
  using acc_t = at::opmath_type<T>;
  const Dims dm(x, w);
  const int64_t planes = dm.B * dm.C;
  // per-plane partial sums, reduced over heads / batch below
  std::vector<acc_t> part_w(planes), part_z(planes), part_gate(planes);
  std::vector<acc_t> part_k(planes * 9, acc_t(0));
  const T *pgo = grad_o.data_ptr<T>(), *pal = alpha.data_ptr<T>();
  const T *pbe = beta.data_ptr<T>(), *pgun = grad_u_next.data_ptr<T>();
  const T* pmean = mean.data_ptr<T>();
  const T *pgr = grad_residual.data_ptr<T>(), *px = x.data_ptr<T>();
  const T *pun = u_next.data_ptr<T>(), *pw = w.data_ptr<T>();
  const T *pz = z.data_ptr<T>(), *pg = gate.data_ptr<T>();
  const T* pk = weight.data_ptr<T>();
  T *pgx = grad_x.data_ptr<T>(), *pgu = data_ptr_or_null<T>(grad_u);
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    PaddedPlane<T> agg(dm.H, dm.W), g_conv(dm.H, dm.W);
    std::vector<T> g_flat(dm.H * agg.Wp, T(0));  // g_conv, H x Wp layout
    T flipped[9];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c = p % dm.C, n = dm.head(p), off = p * dm.HW;
      const T wv = pw[n], gt = pg[n];
      const T inv = T(1) / (pz[n] + T(eps));
      const T* k9 = pk + c * 9;
      load_scaled_plane<T>(pun + off, agg, inv);
      conv3x3_padded<T>(agg, k9);  // agg.out: DWConv(agg), H x Wp
      acc_t sum_gate = 0;
      const T al = pal[c], be = pbe[c], mu = pmean[c];
      for (int64_t i = 0; i < dm.H; ++i) {
        const T* __restrict__ cv = agg.out.data() + i * agg.Wp;
        const T* __restrict__ gin = pgo + off + i * dm.W;
        T* __restrict__ grow = g_conv.row(i);
        T* __restrict__ gflat = g_flat.data() + i * agg.Wp;
        for (int64_t j = 0; j < dm.W; ++j) {
          const T go = gin[j] + al + be * (gt * cv[j] - mu);
          sum_gate += acc_t(go) * acc_t(cv[j]);
          grow[j] = go * gt;
          gflat[j] = go * gt;
        }
      }
      flip3x3<T>(k9, flipped);
      conv3x3_padded<T>(g_conv, flipped);  // g_conv.out: gradient of agg
      conv3x3_weight_grad_padded<T, acc_t>(g_flat.data(), agg,
                                           part_k.data() + p * 9);
      acc_t sum_w = 0, sum_z = 0;
      for (int64_t i = 0; i < dm.H; ++i) {
        const T* __restrict__ ga = g_conv.out.data() + i * agg.Wp;
        const T* __restrict__ a = agg.row(i);
        const int64_t o2 = off + i * dm.W;
        for (int64_t j = 0; j < dm.W; ++j) {
          const T g_total = pgun[o2 + j] + ga[j] * inv;
          if (pgu != nullptr) pgu[o2 + j] = g_total;
          pgx[o2 + j] = pgr[o2 + j] + g_total * wv;
          sum_w += acc_t(g_total) * acc_t(px[o2 + j]);
          sum_z += acc_t(ga[j]) * acc_t(a[j]);
        }
      }
      part_w[p] = sum_w;
      part_z[p] = -sum_z * acc_t(inv);
      part_gate[p] = sum_gate;
    }
  });
  T *pgw = grad_w.data_ptr<T>(), *pgz = grad_z.data_ptr<T>();
  T *pgg = grad_gate.data_ptr<T>(), *pgk = grad_weight.data_ptr<T>();
  for (int64_t n = 0; n < dm.B * dm.G; ++n) {
    acc_t sw = 0, sz = 0, sg = 0;
    const int64_t first = (n / dm.G) * dm.C + (n % dm.G) * dm.d;
    for (int64_t p = first; p < first + dm.d; ++p) {
      sw += part_w[p];
      sz += part_z[p];
      sg += part_gate[p];
    }
    pgw[n] = T(sw);
    pgz[n] = T(sz);
    pgg[n] = T(sg);
  }
  for (int64_t ck = 0; ck < dm.C * 9; ++ck) {
    acc_t s = 0;
    for (int64_t b = 0; b < dm.B; ++b) s += part_k[b * dm.C * 9 + ck];
    pgk[ck] = T(s);
  }
}

template <typename T>
void inference_kernel(const at::Tensor& x, const at::Tensor& u,
                      const at::Tensor& w, const at::Tensor& z,
                      const at::Tensor& gate, const at::Tensor& weight,
                      const at::Tensor& scale, const at::Tensor& shift,
                      at::Tensor& u_next, at::Tensor& out, double eps) {
  const Dims dm(x, w);
  const T *px = x.data_ptr<T>(), *pu = data_ptr_or_null<T>(u);
  const T *pw = w.data_ptr<T>(), *pz = z.data_ptr<T>();
  const T *pg = gate.data_ptr<T>(), *pk = weight.data_ptr<T>();
  const T *ps = scale.data_ptr<T>(), *pb = shift.data_ptr<T>();
  T *pun = u_next.data_ptr<T>(), *pout = out.data_ptr<T>();
  at::parallel_for(0, dm.B * dm.C, 1, [&](int64_t begin, int64_t end) {
    PaddedPlane<T> agg(dm.H, dm.W);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c = p % dm.C, n = dm.head(p), off = p * dm.HW;
      const T inv = T(1) / (pz[n] + T(eps));
      update_plane<T>(px + off, pu ? pu + off : nullptr, pun + off, agg,
                      pw[n], inv);
      conv3x3_padded<T>(agg, pk + c * 9);
      const T sc = ps[c] * pg[n], sh = pb[c];
      for (int64_t i = 0; i < dm.H; ++i) {
        const T* __restrict__ cv = agg.out.data() + i * agg.Wp;
        const int64_t o2 = off + i * dm.W;
        for (int64_t j = 0; j < dm.W; ++j) {
          pout[o2 + j] = px[o2 + j] + std::max(sc * cv[j] + sh, T(0));
        }
      }
    }
  });
}

}  // namespace

#define KCLA_DISPATCH_CPU(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES(TYPE, NAME, [&] { __VA_ARGS__; })

void kcla_branch_forward_cpu(const at::Tensor x, const at::Tensor u,
                             const at::Tensor w, const at::Tensor z,
                             const at::Tensor gate, const at::Tensor weight,
                             at::Tensor u_next, at::Tensor o, double eps) {
  KCLA_DISPATCH_CPU(x.scalar_type(), "kcla_branch_forward_cpu",
                    forward_kernel<scalar_t>(x, u, w, z, gate, weight, u_next,
                                             o, eps));
}

void kcla_branch_recompute_cpu(const at::Tensor u_next, const at::Tensor z,
                               const at::Tensor gate, const at::Tensor weight,
                               at::Tensor o, double eps) {
  KCLA_DISPATCH_CPU(u_next.scalar_type(), "kcla_branch_recompute_cpu",
                    recompute_kernel<scalar_t>(u_next, z, gate, weight, o,
                                               eps));
}

void kcla_bn_relu_add_forward_cpu(const at::Tensor o, const at::Tensor x,
                                  const at::Tensor scale,
                                  const at::Tensor shift, const at::Tensor keep,
                                  at::Tensor out, at::Tensor mask) {
  KCLA_DISPATCH_CPU(o.scalar_type(), "kcla_bn_relu_add_forward_cpu",
                    bn_relu_add_forward_kernel<scalar_t>(o, x, scale, shift,
                                                         keep, out, mask));
}

void kcla_bn_relu_add_backward_cpu(const at::Tensor grad_out,
                                   const at::Tensor o, const at::Tensor scale,
                                   const at::Tensor mask,
                                   const at::Tensor keep,
                                   const at::Tensor mean, at::Tensor grad_o,
                                   at::Tensor sum_grad,
                                   at::Tensor sum_grad_centered) {
  KCLA_DISPATCH_CPU(o.scalar_type(), "kcla_bn_relu_add_backward_cpu",
                    bn_relu_add_backward_kernel<scalar_t>(
                        grad_out, o, scale, mask, keep, mean, grad_o,
                        sum_grad, sum_grad_centered));
}

void kcla_branch_backward_cpu(
    const at::Tensor grad_o, const at::Tensor alpha, const at::Tensor beta,
    const at::Tensor mean, const at::Tensor grad_u_next, const at::Tensor grad_residual,
    const at::Tensor x, const at::Tensor u_next, const at::Tensor w,
    const at::Tensor z, const at::Tensor gate, const at::Tensor weight,
    at::Tensor grad_x, at::Tensor grad_u, at::Tensor grad_w, at::Tensor grad_z,
    at::Tensor grad_gate, at::Tensor grad_weight, double eps) {
  KCLA_DISPATCH_CPU(x.scalar_type(), "kcla_branch_backward_cpu",
                    backward_kernel<scalar_t>(
                        grad_o, alpha, beta, mean, grad_u_next, grad_residual, x,
                        u_next, w, z, gate, weight, grad_x, grad_u, grad_w,
                        grad_z, grad_gate, grad_weight, eps));
}

void kcla_branch_inference_cpu(const at::Tensor x, const at::Tensor u,
                               const at::Tensor w, const at::Tensor z,
                               const at::Tensor gate, const at::Tensor weight,
                               const at::Tensor scale, const at::Tensor shift,
                               at::Tensor u_next, at::Tensor out, double eps) {
  KCLA_DISPATCH_CPU(x.scalar_type(), "kcla_branch_inference_cpu",
                    inference_kernel<scalar_t>(x, u, w, z, gate, weight,
                                               scale, shift, u_next, out,
                                               eps));
}

REGISTER_DEVICE_IMPL(kcla_branch_forward_impl, CPU, kcla_branch_forward_cpu);
REGISTER_DEVICE_IMPL(kcla_branch_recompute_impl, CPU,
                     kcla_branch_recompute_cpu);
REGISTER_DEVICE_IMPL(kcla_bn_relu_add_forward_impl, CPU,
                     kcla_bn_relu_add_forward_cpu);
REGISTER_DEVICE_IMPL(kcla_bn_relu_add_backward_impl, CPU,
                     kcla_bn_relu_add_backward_cpu);
REGISTER_DEVICE_IMPL(kcla_branch_backward_impl, CPU, kcla_branch_backward_cpu);
REGISTER_DEVICE_IMPL(kcla_branch_inference_impl, CPU,
                     kcla_branch_inference_cpu);
