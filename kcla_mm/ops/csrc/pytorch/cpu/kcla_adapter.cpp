// CPU kernels of the adapter's per-head scalars in training
// (common/kcla_adapter_impl.hpp has the maths): scalar double loops over
// B * C values and the (ci, ci) Gram matrices, beside the two batched
// matmuls over the maps that kcla_mm/ops/kcla_adapter.py runs in ATen.
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "kcla_adapter_impl.hpp"
#include "kcla_head_math.hpp"
#include "pytorch_cpp_helper.hpp"
#include "pytorch_device_registry.hpp"

namespace {

// The shapes and raw operands of one call, and W_b = weight / Z per input
// channel as doubles, (B, G, co, ci).
template <typename T>
struct AdapterView {
  int64_t B, G, ci, co, C, Gi, din, k;
  const T *um, *cov, *z_in, *weight, *gamma, *beta, *kk, *norm_d;
  std::vector<double> wb;

  explicit AdapterView(const AdapterHeads& a)
      : B(a.um.size(0)), G(a.um.size(1)), ci(a.um.size(2)),
        co(a.weight.defined() ? a.weight.size(1) : a.um.size(2)),
        C(G * co), Gi(a.z_in.size(1)), din(G * ci / Gi),
        k(a.k_kernel.numel()), um(a.um.data_ptr<T>()),
        cov(data_ptr_or_null<T>(a.cov)), z_in(a.z_in.data_ptr<T>()),
        weight(data_ptr_or_null<T>(a.weight)),
        gamma(a.bn_weight.data_ptr<T>()), beta(a.bn_bias.data_ptr<T>()),
        kk(a.k_kernel.data_ptr<T>()), norm_d(a.norm_d.data_ptr<T>()),
        wb(B * G * co * ci) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t o = 0; o < co; ++o)
          for (int64_t i = 0; i < ci; ++i)
            wb[((b * G + g) * co + o) * ci + i] = w(g, o, i) * inv_z(b, g, i);
  }
  // the conv weight (identity where there is none)
  double w(int64_t g, int64_t o, int64_t i) const {
    if (weight == nullptr) return o == i ? 1.0 : 0.0;
    return double(weight[(g * co + o) * ci + i]);
  }
  // 1 / Z of input channel i of group g
  double inv_z(int64_t b, int64_t g, int64_t i) const {
    return 1.0 / double(z_in[b * Gi + (g * ci + i) / din]);
  }
  const double* wb_row(int64_t b, int64_t g, int64_t o) const {
    return wb.data() + ((b * G + g) * co + o) * ci;
  }
  // w^T cov v / hw for rows w, v of W_b (batch statistics)
  double cov_form(int64_t b, int64_t g, const double* w, const double* v,
                  int64_t hw) const {
    const T* m = cov + (b * G + g) * ci * ci;
    double sum = 0;
    for (int64_t i = 0; i < ci; ++i) {
      double row = 0;
      for (int64_t j = 0; j < ci; ++j) row += double(m[i * ci + j]) * v[j];
      sum += w[i] * row;
    }
    return sum / double(hw);
  }
};

template <typename T>
void adapter_heads_forward(const AdapterHeads& a, const AdapterHeadsOut& out) {
  const AdapterView<T> m(a);
  const int64_t B = m.B, G = m.G, ci = m.ci, co = m.co, C = m.C;
  const bool bs = a.batch_stats;
  std::vector<double> y(B * C), v(bs ? B * C : 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t o = 0; o < co; ++o) {
        const double* w = m.wb_row(b, g, o);
        double sum = 0;
        for (int64_t i = 0; i < ci; ++i)
          sum += w[i] * double(m.um[(b * G + g) * ci + i]);
        y[b * C + g * co + o] = sum;
        if (bs) v[b * C + g * co + o] = m.cov_form(b, g, w, w, a.hw);
      }
  T* mean = out.bn_stats[0].data_ptr<T>();
  T* invstd = out.bn_stats[1].data_ptr<T>();
  T* rm = data_ptr_or_null<T>(a.running_mean);
  T* rv = data_ptr_or_null<T>(a.running_var);
  for (int64_t c = 0; c < C; ++c) {
    double mu, var;
    if (bs) {
      mu = var = 0;
      for (int64_t b = 0; b < B; ++b) mu += y[b * C + c];
      mu /= double(B);
      for (int64_t b = 0; b < B; ++b) {
        const double dy = y[b * C + c] - mu;
        var += v[b * C + c] + dy * dy;
      }
      var /= double(B);
      if (rm != nullptr && a.momentum >= 0) {  // as nn.BatchNorm2d
        const double n = double(B * a.hw), mom = a.momentum;
        rm[c] = T((1 - mom) * double(rm[c]) + mom * mu);
        rv[c] = T((1 - mom) * double(rv[c]) +
                  mom * var * n / std::max(n - 1, 1.0));
      }
    } else {
      mu = double(rm[c]);
      var = double(rv[c]);
    }
    mean[c] = T(mu);
    invstd[c] = T(1.0 / std::sqrt(var + a.bn_eps));
  }
  T *py = out.aux[0].data_ptr<T>(), *pp = out.aux[1].data_ptr<T>();
  T* pkey = out.aux[2].data_ptr<T>();
  T *pmat = out.mat.data_ptr<T>(), *pbias = out.bias.data_ptr<T>();
  T* pz = out.z_out.data_ptr<T>();
  std::vector<double> pooled(C), key(C), scale(C);
  for (int64_t c = 0; c < C; ++c)
    scale[c] = double(m.gamma[c]) * double(invstd[c]);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < C; ++c)
      pooled[c] = scale[c] * (y[b * C + c] - double(mean[c])) +
                  double(m.beta[c]);
    eca(m.kk, m.k, pooled.data(), C, key.data());
    for (int64_t g = 0; g < G; ++g) {
      double k2 = 0;
      for (int64_t c = g * co; c < (g + 1) * co; ++c) k2 += key[c] * key[c];
      const double z = layer_weight(std::sqrt(k2), double(m.norm_d[g]),
                                    a.max_log);
      pz[b * G + g] = T(z);
      for (int64_t o = 0; o < co; ++o) {
        const int64_t c = g * co + o, bc = b * C + c;
        const double* w = m.wb_row(b, g, o);
        for (int64_t i = 0; i < ci; ++i)
          pmat[bc * ci + i] = T(z * scale[c] * w[i]);
        pbias[bc] = T(z * (bs ? pooled[c] : pooled[c] - scale[c] * y[bc]));
        py[bc] = T(y[bc]);
        pp[bc] = T(pooled[c]);
        pkey[bc] = T(key[c]);
      }
    }
  }
}

template <typename T>
void adapter_heads_backward(const AdapterHeads& a, const AdapterHeadsOut& sv,
                            const AdapterHeadsGrads& gr) {
  const AdapterView<T> m(a);
  const int64_t B = m.B, G = m.G, ci = m.ci, co = m.co, C = m.C;
  const bool bs = a.batch_stats;
  const T *py = sv.aux[0].data_ptr<T>(), *pp = sv.aux[1].data_ptr<T>();
  const T* pkey = sv.aux[2].data_ptr<T>();
  const T* mean = sv.bn_stats[0].data_ptr<T>();
  const T* invstd = sv.bn_stats[1].data_ptr<T>();
  const T* pz = sv.z_out.data_ptr<T>();
  const T *gm = gr.grad_mat.data_ptr<T>(), *gb = gr.grad_bias.data_ptr<T>();
  const T* gz = data_ptr_or_null<T>(gr.grad_z);
  std::vector<double> scale(C), gk(C, 0.0), gbeta(C, 0.0), gmean(C, 0.0);
  std::vector<double> gy(B * C), gwb(B * G * co * ci), gkk(m.k, 0.0);
  std::vector<double> gkey(C), gpool(C), geca(C);
  for (int64_t c = 0; c < C; ++c)
    scale[c] = double(m.gamma[c]) * double(invstd[c]);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      // mat = z k W_b, bias = z (pooled - k y [running statistics])
      const double z = pz[b * G + g];
      double gzt = gz != nullptr ? double(gz[b * G + g]) : 0.0, k2 = 0;
      for (int64_t o = 0; o < co; ++o) {
        const int64_t c = g * co + o, bc = b * C + c;
        const double* w = m.wb_row(b, g, o);
        double* gw = gwb.data() + bc * ci;
        double mw = 0;
        for (int64_t i = 0; i < ci; ++i) {
          mw += double(gm[bc * ci + i]) * w[i];
          gw[i] = double(gm[bc * ci + i]) * z * scale[c];
        }
        const double gbc = gb[bc], yc = py[bc];
        gzt += scale[c] * mw + gbc * (bs ? double(pp[bc])
                                         : double(pp[bc]) - scale[c] * yc);
        gk[c] += z * mw - (bs ? 0.0 : gbc * z * yc);
        gpool[c] = gbc * z;
        gy[bc] = bs ? 0.0 : -gbc * z * scale[c];
        k2 += double(pkey[bc]) * double(pkey[bc]);
      }
      // z = exp(min(|key_g| / norm_d_g, max_log)); |key|'s gradient is 0
      // at 0, as torch's norm
      const double norm = std::sqrt(k2), nd = m.norm_d[g];
      const double gnorm = norm / nd <= a.max_log ? gzt * z / nd : 0.0;
      for (int64_t c = g * co; c < (g + 1) * co; ++c)
        gkey[c] = norm > 0 ? gnorm * double(pkey[b * C + c]) / norm : 0.0;
    }
    eca_backward(m.kk, m.k, pp + b * C, C, gkey.data(), geca.data(),
                 gkk.data());
    for (int64_t c = 0; c < C; ++c) {  // pooled = k (y - mean) + beta
      const int64_t bc = b * C + c;
      const double gp = gpool[c] + geca[c];
      gbeta[c] += gp;
      gk[c] += gp * (double(py[bc]) - double(mean[c]));
      gy[bc] += gp * scale[c];
      gmean[c] -= gp * scale[c];
    }
  }
  // k = gamma / sqrt(var + eps); with batch statistics mean and var are
  // the batch's: var = mean_b(v) + mean_b((y - mean)^2)
  std::vector<double> gv(bs ? C : 0);
  T* ggamma = gr.grad_bn_weight.data_ptr<T>();
  T* gbeta_out = gr.grad_bn_bias.data_ptr<T>();
  for (int64_t c = 0; c < C; ++c) {
    const double is = invstd[c];
    ggamma[c] = T(gk[c] * is);
    gbeta_out[c] = T(gbeta[c]);
    if (!bs) continue;
    const double gvar = -0.5 * gk[c] * scale[c] * is * is;
    gv[c] = gvar / double(B);
    for (int64_t b = 0; b < B; ++b)
      gy[b * C + c] += (2 * gvar * (double(py[b * C + c]) - double(mean[c])) +
                        gmean[c]) / double(B);
  }
  T* pr = gr.r.data_ptr<T>();
  T* ps = data_ptr_or_null<T>(gr.s);
  T* gzin = gr.grad_z_in.data_ptr<T>();
  std::vector<double> gw_total(m.weight ? G * co * ci : 0, 0.0);
  std::vector<double> s_acc(ci * ci), r(ci);
  std::fill(gzin, gzin + B * m.Gi, T(0));
  const double inv_hw = 1.0 / double(a.hw);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      const double z = pz[b * G + g];
      std::fill(r.begin(), r.end(), 0.0);
      std::fill(s_acc.begin(), s_acc.end(), 0.0);
      const T* um = m.um + (b * G + g) * ci;
      for (int64_t o = 0; o < co; ++o) {
        const int64_t c = g * co + o, bc = b * C + c;
        const double* w = m.wb_row(b, g, o);
        double* gw = gwb.data() + bc * ci;
        for (int64_t i = 0; i < ci; ++i) {  // y = W_b um; the centring
          r[i] += w[i] * gy[bc];
          if (bs) r[i] -= z * scale[c] * w[i] * double(gb[bc]);
          gw[i] += gy[bc] * double(um[i]);
        }
        if (!bs) continue;
        // v = w^T cov w / hw: w's gradient 2 gv (cov / hw) w, cov's gv w w^T
        const T* cv = m.cov + (b * G + g) * ci * ci;
        for (int64_t i = 0; i < ci; ++i) {
          double row = 0;
          for (int64_t j = 0; j < ci; ++j) row += double(cv[i * ci + j]) * w[j];
          gw[i] += 2 * gv[c] * row * inv_hw;
        }
        for (int64_t i = 0; i < ci; ++i)
          for (int64_t j = 0; j < ci; ++j)
            s_acc[i * ci + j] += gv[c] * w[i] * w[j];
      }
      for (int64_t i = 0; i < ci; ++i) {
        pr[(b * G + g) * ci + i] = T(r[i] * inv_hw);
        // W_b = weight / Z per input channel
        const double iz = m.inv_z(b, g, i);
        double giz = 0;
        for (int64_t o = 0; o < co; ++o) {
          const double gw = gwb[((b * G + g) * co + o) * ci + i];
          giz += gw * m.w(g, o, i);
          if (m.weight) gw_total[(g * co + o) * ci + i] += gw * iz;
        }
        T& gzi = gzin[b * m.Gi + (g * ci + i) / m.din];
        gzi = T(double(gzi) - giz * iz * iz);
      }
      if (ps != nullptr) {  // cov = Uc Uc^T: d/dUc = 2 (d/dcov) Uc
        T* sm = ps + (b * G + g) * ci * ci;
        for (int64_t i = 0; i < ci * ci; ++i)
          sm[i] = T(2 * s_acc[i] * inv_hw);
      }
    }
  }
  if (m.weight) {
    T* gwo = gr.grad_weight.data_ptr<T>();
    for (size_t i = 0; i < gw_total.size(); ++i) gwo[i] = T(gw_total[i]);
  }
  T* gko = gr.grad_k_kernel.data_ptr<T>();
  for (int64_t t = 0; t < m.k; ++t) gko[t] = T(gkk[t]);
}

void adapter_heads_forward_cpu(const at::Tensor um, const AdapterHeads& a,
                               const AdapterHeadsOut& out) {
  AT_DISPATCH_FLOATING_TYPES(um.scalar_type(), "kcla_adapter_heads_forward",
                             [&] { adapter_heads_forward<scalar_t>(a, out); });
}

void adapter_heads_backward_cpu(const at::Tensor um, const AdapterHeads& a,
                                const AdapterHeadsOut& saved,
                                const AdapterHeadsGrads& g) {
  AT_DISPATCH_FLOATING_TYPES(
      um.scalar_type(), "kcla_adapter_heads_backward",
      [&] { adapter_heads_backward<scalar_t>(a, saved, g); });
}

}  // namespace

REGISTER_DEVICE_IMPL(kcla_adapter_heads_forward_impl, CPU,
                     adapter_heads_forward_cpu);
REGISTER_DEVICE_IMPL(kcla_adapter_heads_backward_impl, CPU,
                     adapter_heads_backward_cpu);
