// Decode attention on the CPU, reading K and V in place in the pool's pages. Built on first use
// by rose/engine/cpu_attention.py (with -ffast-math at the compile step only, for a vectorised exp),
// which also says why it exists.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

// Eight floats: one AVX register, or two SSE ones where the build machine has no AVX.
typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int i8 __attribute__((vector_size(32)));

inline v8 load(const float* p) { return *reinterpret_cast<const v8*>(p); }

// The lane sums of eight vectors, as one vector (a transposing add tree: 7 adds, not 56).
inline v8 lane_sums(const v8* a) {
  const i8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
  const i8 low2 = {0, 1, 8, 9, 4, 5, 12, 13}, high2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const i8 low4 = {0, 1, 2, 3, 8, 9, 10, 11}, high4 = {4, 5, 6, 7, 12, 13, 14, 15};
  v8 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)
    pairs[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
  for (int i = 0; i < 2; ++i)
    quads[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], low2) +
               __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], high2);
  return __builtin_shuffle(quads[0], quads[1], low4) + __builtin_shuffle(quads[0], quads[1], high4);
}

// Pages are scattered over the pool: fetching the next one while this one is read hides the
// latency that a jump to a new page costs the hardware prefetcher.
inline void prefetch(const float* row, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(row + i);
}

struct Job {
  const float* q;            // [group, D], this sequence's queries for this KV head
  const float* rows;         // the pool as rows of `row_floats`
  const int64_t* key_rows;   // [pages]: the row of each page's keys; its values lie `kv_heads` rows on
  int64_t row_floats, kv_heads, length, block, group;
  float scale;
  float* out;                // [group, D]
};

// Scores of `group` queries over the context, softmax, then the weighted sum of the values.
// Two passes over the pages, K then V, so that each page row streams once per pass.
template <int D>
void attend(const Job& job, std::vector<float>& scores) {
  constexpr int C = D / 8;
  const int64_t n = job.length, block = job.block, pages = (n + block - 1) / block;
  scores.resize(job.group * n);
  for (int64_t g = 0; g < job.group; ++g) {
    v8 q[C];
    for (int c = 0; c < C; ++c) q[c] = load(job.q + g * D + 8 * c) * job.scale;
    float* s = scores.data() + g * n;
    for (int64_t w = 0; w < pages; ++w) {
      const float* keys = job.rows + job.key_rows[w] * job.row_floats;
      if (g == 0 && w + 1 < pages) prefetch(job.rows + job.key_rows[w + 1] * job.row_floats, job.row_floats);
      const int64_t tokens = std::min(block, n - w * block);
      int64_t j = 0;
      for (; j + 8 <= tokens; j += 8) {  // eight keys at once: eight independent FMA chains
        v8 acc[8] = {};
        for (int c = 0; c < C; ++c)
          for (int t = 0; t < 8; ++t) acc[t] += q[c] * load(keys + (j + t) * D + 8 * c);
        *reinterpret_cast<v8*>(s + w * block + j) = lane_sums(acc);
      }
      for (; j < tokens; ++j) {
        v8 acc = {};
        for (int c = 0; c < C; ++c) acc += q[c] * load(keys + j * D + 8 * c);
        float sum = 0.f;
        for (int l = 0; l < 8; ++l) sum += acc[l];
        s[w * block + j] = sum;
      }
    }
    const float top = *std::max_element(s, s + n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      total += s[t];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
  for (int64_t g = 0; g < job.group; ++g) {
    v8 acc[C] = {};
    const float* p = scores.data() + g * n;
    for (int64_t w = 0; w < pages; ++w) {
      const float* values = job.rows + (job.key_rows[w] + job.kv_heads) * job.row_floats;
      if (g == 0 && w + 1 < pages)
        prefetch(job.rows + (job.key_rows[w + 1] + job.kv_heads) * job.row_floats, job.row_floats);
      const int64_t tokens = std::min(block, n - w * block);
      for (int64_t j = 0; j < tokens; ++j) {
        const float weight = p[w * block + j];
        for (int c = 0; c < C; ++c) acc[c] += weight * load(values + j * D + 8 * c);
      }
    }
    for (int c = 0; c < C; ++c) *reinterpret_cast<v8*>(job.out + g * D + 8 * c) = acc[c];
  }
}

using Kernel = void (*)(const Job&, std::vector<float>&);

Kernel kernel_for(int64_t dim) {
  switch (dim) {
    case 16: return attend<16>;
    case 32: return attend<32>;
    case 64: return attend<64>;
    case 80: return attend<80>;
    case 96: return attend<96>;
    case 128: return attend<128>;
    case 256: return attend<256>;
  }
  TORCH_CHECK(false, "cpu attention: head_dim ", dim, " is not one of 16, 32, 64, 80, 96, 128, 256");
}

// q, out [seqs, kv_heads, group, D]; rows [rows, block_size * D]; pages [kv_heads, seqs, width]:
// each page's K row for layer 0 (`offset` moves it to this layer); lengths [seqs]: tokens attended to.
void paged_decode(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& pages, int64_t offset,
                  const at::Tensor& lengths, int64_t block_size, double scale, int64_t threads,
                  const at::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && rows.is_contiguous() && pages.is_contiguous() &&
                  lengths.is_contiguous(), "cpu attention: contiguous tensors expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && rows.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  pages.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "cpu attention: float32 q, rows and out, int64 pages and lengths expected");
  TORCH_CHECK(q.dim() == 4 && out.sizes() == q.sizes() && pages.dim() == 3 && pages.size(0) == q.size(1) &&
                  pages.size(1) == q.size(0) && lengths.numel() == q.size(0) && rows.dim() == 2 &&
                  rows.size(1) == block_size * q.size(3),
              "cpu attention: q and out [seqs, kv_heads, group, D], pages [kv_heads, seqs, width], lengths [seqs] "
              "and rows [rows, block_size * D] expected");
  const int64_t seqs = q.size(0), kv_heads = q.size(1), group = q.size(2), dim = q.size(3);
  const int64_t width = pages.size(2);
  const Kernel kernel = kernel_for(dim);
  const float* q_data = q.data_ptr<float>();
  const float* row_data = rows.data_ptr<float>();
  const int64_t* page_data = pages.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  // A bad index would read outside the pool: checked here, once, rather than trusted.
  const int64_t num_rows = rows.size(0);
  for (int64_t b = 0; b < seqs; ++b)
    TORCH_CHECK(length_data[b] >= 1 && length_data[b] <= width * block_size, "cpu attention: sequence ", b,
                " attends to ", length_data[b], " tokens; its ", width, " pages hold 1 to ", width * block_size);
  for (int64_t i = 0; i < pages.numel(); ++i)
    TORCH_CHECK(page_data[i] >= 0 && page_data[i] + offset + kv_heads < num_rows, "cpu attention: page row ",
                page_data[i], " + ", offset, " is outside the pool's ", num_rows, " rows");
  const int64_t jobs = seqs * kv_heads;
  // Jobs are handed out one at a time, longest sequences first: a static split would leave a
  // thread idle while another finishes the long contexts.
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    std::vector<float> scores;
    std::vector<int64_t> key_rows(width);
    for (int64_t i; (i = next.fetch_add(1)) < jobs;) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      for (int64_t w = 0; w < width; ++w) key_rows[w] = page_data[(h * seqs + b) * width + w] + offset;
      const int64_t base = (b * kv_heads + h) * group * dim;
      kernel({q_data + base, row_data, key_rows.data(), rows.size(1), kv_heads, length_data[b], block_size, group,
              static_cast<float>(scale), out_data + base}, scores);
    }
  };
  if (threads <= 1)
    worker(0, 1);
  else
    at::parallel_for(0, threads, 1, worker);  // PyTorch's own thread pool
}

}  // namespace

TORCH_LIBRARY(rose, m) { m.def("paged_decode", &paged_decode); }
