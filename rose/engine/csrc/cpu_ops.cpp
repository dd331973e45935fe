// The decoder's element-wise steps between its matrix products, each one pass over its rows in
// place of the several PyTorch ops (and their dispatch) it replaces on the CPU: the residual add
// with RMSNorm, the q/k norms with RoPE and the K/V store into the pool's pages, SiLU times up,
// and the sampler's log-normaliser with the greedy token. Built with cpu_attention.cpp by
// rose/engine/cpu_kernels.py; rose/engine/fused_forward.py says how the forward uses them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

// Rows a parallel_for hands one thread at least: below this the work runs on the calling thread.
constexpr int64_t GRAIN_ELEMENTS = 1 << 15;

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(1, row_elements)); }

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, "cpu ops: ", name,
              " must be a float32 matrix with contiguous rows");
}

// x *= weight / rms(x), as Hugging Face's RMSNorm: x * rsqrt(mean(x^2) + eps), then the weight.
inline void normalise(const float* x, const float* weight, float* out, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

// residual += x (the decoder's residual stream), then out = rms_norm(residual); out may be x.
void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                  const at::Tensor& out) {
  check_float_rows(x, "x");
  check_float_rows(residual, "residual");
  check_float_rows(out, "out");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(out.sizes() == x.sizes() && residual.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == n && weight.scalar_type() == at::kFloat,
              "cpu ops: residual and out shaped like x and a float32 weight of ", n, " expected");
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = x.data_ptr<float>() + r * x.stride(0);
      float* acc = residual.data_ptr<float>() + r * residual.stride(0);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) acc[i] += src[i];
      normalise(acc, w, out.data_ptr<float>() + r * out.stride(0), n, static_cast<float>(eps));
    }
  });
}

// Rotate one head in place by RoPE's (cos, sin), half-split as Hugging Face's rotate_half:
// x * cos + cat(-x2, x1) * sin.
inline void rotate(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// qkv [T, (heads + 2 kv_heads) * D], the fused projection's output, in place: each q and k head
// normed (Qwen3's q/k norms, when given) and rotated; then each token's K and V heads copied to
// its slot in the pool (rows [R, block * D]): K head h to row slot_rows[t] + h, V head h to row
// slot_rows[t] + kv_heads + h, at slot_offsets[t] * D.
void rope_store(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                const at::Tensor& sin, const std::optional<at::Tensor>& q_norm,
                const std::optional<at::Tensor>& k_norm, double eps, const at::Tensor& rows,
                const at::Tensor& slot_rows, const at::Tensor& slot_offsets) {
  check_float_rows(qkv, "qkv");
  check_float_rows(rows, "the pool's rows");
  const int64_t tokens = qkv.size(0), dim = cos.size(-1);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim && dim % 2 == 0,
              "cpu ops: qkv must be [tokens, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
                  cos.size(0) == tokens && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cpu ops: float32 cos and sin [tokens, head_dim] expected");
  for (const auto* norm : {&q_norm, &k_norm})
    TORCH_CHECK(!*norm || ((*norm)->is_contiguous() && (*norm)->numel() == dim && (*norm)->scalar_type() == at::kFloat),
                "cpu ops: q/k norm weights of head_dim float32 expected");
  TORCH_CHECK(slot_rows.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_rows.is_contiguous() && slot_offsets.is_contiguous() && slot_rows.numel() == tokens &&
                  slot_offsets.numel() == tokens, "cpu ops: int64 slot rows and offsets, one per token, expected");
  const int64_t block = rows.size(1) / dim, num_rows = rows.size(0);
  const int64_t* row_of = slot_rows.data_ptr<int64_t>();
  const int64_t* offset_of = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)  // a bad slot would write outside the pool
    TORCH_CHECK(row_of[t] >= 0 && row_of[t] + 2 * kv_heads <= num_rows && offset_of[t] >= 0 && offset_of[t] < block,
                "cpu ops: token ", t, "'s slot (row ", row_of[t], ", offset ", offset_of[t], ") is outside the pool's ",
                num_rows, " rows of ", block, " tokens");
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, tokens, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* x = qkv.data_ptr<float>() + t * qkv.stride(0);
      const float* c = cos.data_ptr<float>() + t * dim;
      const float* s = sin.data_ptr<float>() + t * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* head = x + h * dim;
        const auto& norm = h < heads ? q_norm : k_norm;
        if (norm) normalise(head, norm->data_ptr<float>(), head, dim, eps_f);
        rotate(head, c, s, dim);
      }
      float* slot = rows.data_ptr<float>() + row_of[t] * rows.stride(0) + offset_of[t] * dim;
      for (int64_t h = 0; h < 2 * kv_heads; ++h)
        std::memcpy(slot + h * rows.stride(0), x + (heads + h) * dim, dim * sizeof(float));
    }
  });
}

// out [T, I] = silu(gate) * up, from the fused projection's [T, 2I] (gate, then up).
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  check_float_rows(gate_up, "gate_up");
  check_float_rows(out, "out");
  const int64_t n = out.size(1);
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * n, "cpu ops: gate_up [T, 2I], out [T, I] expected");
  at::parallel_for(0, out.size(0), grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
      float* o = out.data_ptr<float>() + r * out.stride(0);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * g[n + i];
    }
  });
}

// Per row of logits [B, V]: the first index of its largest value and log(sum(exp(x / scale))),
// two passes where the sampler ran log_softmax and argmax (four). Rows must be finite or -inf
// (the engine sets aside NaN and +inf rows first: this file is built with -ffast-math).
void logsumexp_argmax(const at::Tensor& logits, const at::Tensor& scale, const at::Tensor& lse,
                      const at::Tensor& argmax) {
  check_float_rows(logits, "logits");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0 && scale.is_contiguous() && scale.numel() == rows && lse.is_contiguous() && lse.numel() == rows &&
                  argmax.is_contiguous() && argmax.numel() == rows && scale.scalar_type() == at::kFloat &&
                  lse.scalar_type() == at::kFloat && argmax.scalar_type() == at::kLong,
              "cpu ops: float32 scale and lse and int64 argmax, one per row, expected");
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = logits.data_ptr<float>() + r * logits.stride(0);
      float top = x[0];
#pragma omp simd reduction(max : top)
      for (int64_t i = 0; i < n; ++i) top = std::max(top, x[i]);
      int64_t first = 0;
      while (x[first] != top) ++first;
      const float inv = 1.f / scale.data_ptr<float>()[r], shift = top * inv;
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < n; ++i) total += std::exp(x[i] * inv - shift);
      lse.data_ptr<float>()[r] = shift + std::log(total);
      argmax.data_ptr<int64_t>()[r] = first;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rose, m) {
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_store", &rope_store);
  m.def("silu_mul", &silu_mul);
  m.def("logsumexp_argmax", &logsumexp_argmax);
}
