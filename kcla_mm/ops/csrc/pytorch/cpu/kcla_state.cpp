// CPU launchers of the KCLA state op: contiguous chunk loops the compiler
// vectorises, parallel over chunks with at::parallel_for.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "kcla_state_impl.hpp"
#include "pytorch_cpp_helper.hpp"
#include "pytorch_device_registry.hpp"

namespace {

template <typename scalar_t>
void state_forward_cpu_kernel(const scalar_t* x, const scalar_t* u,
                              const scalar_t* w, const scalar_t* z,
                              scalar_t* u_next, scalar_t* agg, int64_t chunks,
                              int64_t length, double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(length, 1));
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const acc_t wn = static_cast<acc_t>(w[n]);
      const acc_t inv = acc_t(1) / (static_cast<acc_t>(z[n]) + acc_t(eps));
      const int64_t offset = n * length;
      for (int64_t i = offset; i < offset + length; ++i) {
        acc_t s = wn * static_cast<acc_t>(x[i]);
        if (u != nullptr) s += static_cast<acc_t>(u[i]);
        u_next[i] = static_cast<scalar_t>(s);
        agg[i] = static_cast<scalar_t>(s * inv);
      }
    }
  });
}

template <typename scalar_t>
void state_backward_cpu_kernel(const scalar_t* grad_u_next,
                               const scalar_t* grad_agg, const scalar_t* x,
                               const scalar_t* w, const scalar_t* z,
                               const scalar_t* agg, scalar_t* grad_x,
                               scalar_t* grad_u, scalar_t* grad_w,
                               scalar_t* grad_z, int64_t chunks,
                               int64_t length, double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(length, 1));
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const acc_t wn = static_cast<acc_t>(w[n]);
      const acc_t inv = acc_t(1) / (static_cast<acc_t>(z[n]) + acc_t(eps));
      acc_t sum_gx = 0, sum_ga = 0;
      const int64_t offset = n * length;
      for (int64_t i = offset; i < offset + length; ++i) {
        const acc_t ga = static_cast<acc_t>(grad_agg[i]);
        // total gradient reaching u_next (directly and through agg)
        const acc_t g = static_cast<acc_t>(grad_u_next[i]) + ga * inv;
        if (grad_u != nullptr) grad_u[i] = static_cast<scalar_t>(g);
        grad_x[i] = static_cast<scalar_t>(g * wn);
        sum_gx += g * static_cast<acc_t>(x[i]);
        sum_ga += ga * static_cast<acc_t>(agg[i]);
      }
      grad_w[n] = static_cast<scalar_t>(sum_gx);
      grad_z[n] = static_cast<scalar_t>(-sum_ga * inv);
    }
  });
}

}  // namespace

void kcla_state_forward_cpu(const at::Tensor x, const at::Tensor u,
                            const at::Tensor w, const at::Tensor z,
                            at::Tensor u_next, at::Tensor agg, double eps) {
  const int64_t chunks = w.numel();
  const int64_t length = chunks == 0 ? 0 : x.numel() / chunks;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
      "kcla_state_forward_cpu", [&] {
        state_forward_cpu_kernel<scalar_t>(
            x.data_ptr<scalar_t>(), data_ptr_or_null<scalar_t>(u),
            w.data_ptr<scalar_t>(), z.data_ptr<scalar_t>(),
            u_next.data_ptr<scalar_t>(), agg.data_ptr<scalar_t>(), chunks,
            length, eps);
      });
}

void kcla_state_backward_cpu(const at::Tensor grad_u_next,
                             const at::Tensor grad_agg, const at::Tensor x,
                             const at::Tensor w, const at::Tensor z,
                             const at::Tensor agg, at::Tensor grad_x,
                             at::Tensor grad_u, at::Tensor grad_w,
                             at::Tensor grad_z, double eps) {
  const int64_t chunks = w.numel();
  const int64_t length = chunks == 0 ? 0 : x.numel() / chunks;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
      "kcla_state_backward_cpu", [&] {
        state_backward_cpu_kernel<scalar_t>(
            grad_u_next.data_ptr<scalar_t>(), grad_agg.data_ptr<scalar_t>(),
            x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
            z.data_ptr<scalar_t>(), agg.data_ptr<scalar_t>(),
            grad_x.data_ptr<scalar_t>(), data_ptr_or_null<scalar_t>(grad_u),
            grad_w.data_ptr<scalar_t>(), grad_z.data_ptr<scalar_t>(), chunks,
            length, eps);
      });
}

void kcla_state_growth_cpu(const at::Tensor z, const at::Tensor floor,
                           at::Tensor floor_out, at::Tensor flag,
                           double limit) {
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "kcla_state_growth_cpu", [&] {
    const scalar_t* pz = z.data_ptr<scalar_t>();
    const scalar_t* pf = floor.data_ptr<scalar_t>();
    const scalar_t bound = static_cast<scalar_t>(limit);
    const int64_t n = z.numel();
    bool grew = false;
    for (int64_t i = 0; i < n; ++i) grew |= pz[i] > bound * pf[i];
    std::copy(grew ? pz : pf, (grew ? pz : pf) + n,
              floor_out.data_ptr<scalar_t>());
    *flag.data_ptr<bool>() = grew;
  });
}

REGISTER_DEVICE_IMPL(kcla_state_forward_impl, CPU, kcla_state_forward_cpu);
REGISTER_DEVICE_IMPL(kcla_state_backward_impl, CPU, kcla_state_backward_cpu);
REGISTER_DEVICE_IMPL(kcla_state_growth_impl, CPU, kcla_state_growth_cpu);
