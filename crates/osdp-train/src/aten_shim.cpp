// libtorch kernels the trainer needs that tch does not bind: the multi-tensor (fused) AdamW,
// the norm of a list of tensors, and the layer and RMS norms' own backward kernels. Each takes
// tch's tensor handles (`at::Tensor*`), catches every C++ exception and returns 0, or 1 with
// the message kept for `osdp_aten_last_error`, so the caller can fall back to its written-out
// path instead of aborting.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_rms_norm_backward.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <ATen/ops/stack.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace {

thread_local std::string last_error;

std::vector<at::Tensor> to_list(at::Tensor* const* ts, int64_t n) {
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(*ts[i]);
  }
  return out;
}

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return 1;
}

}  // namespace

extern "C" {

// The message of the last call on this thread that returned 1.
const char* osdp_aten_last_error() { return last_error.c_str(); }

// One AdamW step of `n` parameters in place (params, exp_avgs, exp_avg_sqs), PyTorch's fused
// multi-tensor kernel. `step` is a one-element fp32 tensor on the parameters' device holding
// the step number (already counted); `grad_scale`, when not null, is a one-element fp32 tensor
// every gradient is divided by before the update.
int osdp_fused_adamw(at::Tensor* const* params, at::Tensor* const* grads, at::Tensor* const* m,
                     at::Tensor* const* v, int64_t n, const at::Tensor* step, double lr,
                     double beta1, double beta2, double weight_decay, double eps,
                     const at::Tensor* grad_scale) {
  return guarded([&] {
    auto p = to_list(params, n);
    auto g = to_list(grads, n);
    auto mm = to_list(m, n);
    auto vv = to_list(v, n);
    std::vector<at::Tensor> steps(static_cast<size_t>(n), *step);
    std::optional<at::Tensor> scale;
    if (grad_scale != nullptr) {
      scale = *grad_scale;
    }
    at::_fused_adamw_(p, g, mm, vv, {}, steps, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false, scale, std::nullopt);
  });
}

// The sum of squares of `n` tensors, in fp32, as one new one-element tensor in `*out`.
int osdp_sum_of_squares(at::Tensor* const* ts, int64_t n, at::Tensor** out) {
  return guarded([&] {
    auto norms = at::_foreach_norm(to_list(ts, n), 2, at::kFloat);
    *out = new at::Tensor(at::stack(norms).square().sum());
  });
}

// Layer norm's backward over the last dimension from the forward's mean and rstd: dx and dw
// (the bias gradient, a plain sum of dy, is the caller's).
int osdp_layer_norm_backward(const at::Tensor* dy, const at::Tensor* x, const at::Tensor* mean,
                             const at::Tensor* rstd, const at::Tensor* w, at::Tensor** dx,
                             at::Tensor** dw) {
  return guarded([&] {
    const int64_t width = x->size(-1);
    auto r = at::native_layer_norm_backward(*dy, *x, {width}, *mean, *rstd, *w, std::nullopt,
                                            {true, true, false});
    *dx = new at::Tensor(std::get<0>(r));
    *dw = new at::Tensor(std::get<1>(r));
  });
}

// RMS norm's backward over the last dimension from the rstd of `_fused_rms_norm` (CUDA only).
int osdp_rms_norm_backward(const at::Tensor* dy, const at::Tensor* x, const at::Tensor* rstd,
                           const at::Tensor* w, at::Tensor** dx, at::Tensor** dw) {
  return guarded([&] {
    const int64_t width = x->size(-1);
    auto r = at::_fused_rms_norm_backward(*dy, *x, {width}, *rstd, *w, {true, true});
    *dx = new at::Tensor(std::get<0>(r));
    *dw = new at::Tensor(std::get<1>(r));
  });
}
}
