// Attention on the CPU, decodes and prefill chunks, reading K and V in place in the pool's pages.
// Built on first use by rose/engine/cpu_kernels.py (with -ffast-math at the compile step only, for a
// vectorised exp); rose/engine/cpu_attention.py says why it exists.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
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

// The 8 x 8 block at column `col` of eight rows, transposed into `out` (rows `stride` apart).
inline void transpose8(const float* const* rows, int col, float* out, int64_t stride) {
  const i8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
  const i8 low2 = {0, 1, 8, 9, 4, 5, 12, 13}, high2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const i8 low4 = {0, 1, 2, 3, 8, 9, 10, 11}, high4 = {4, 5, 6, 7, 12, 13, 14, 15};
  v8 a[8], b[8];
  for (int i = 0; i < 8; ++i) a[i] = load(rows[i] + col);
  for (int i = 0; i < 8; i += 2) {  // b[i]: columns 0, 2, 4, 6 of rows i, i+1; b[i+1]: 1, 3, 5, 7
    b[i] = __builtin_shuffle(a[i], a[i + 1], even);
    b[i + 1] = __builtin_shuffle(a[i], a[i + 1], odd);
  }
  for (int i = 0; i < 8; i += 4)  // a[i + c]: rows i..i+3 of columns c and c + 4 (c = 0, 1, 2, 3)
    for (int c = 0; c < 2; ++c) {
      a[i + c] = __builtin_shuffle(b[i + c], b[i + c + 2], low2);
      a[i + c + 2] = __builtin_shuffle(b[i + c], b[i + c + 2], high2);
    }
  for (int c = 0; c < 4; ++c) {
    *reinterpret_cast<v8*>(out + c * stride) = __builtin_shuffle(a[c], a[c + 4], low4);
    *reinterpret_cast<v8*>(out + (c + 4) * stride) = __builtin_shuffle(a[c], a[c + 4], high4);
  }
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
// Two passes over the pages, K then V, each page streamed once for all the group's queries (the
// group's other queries find it in L1): a pass per query kept memory idle while it re-read pages
// from L2, and read K/V at 12-15 GB/s on one core.
template <int D>
void attend(const Job& job, std::vector<float>& work) {
  constexpr int C = D / 8;
  const int64_t n = job.length, block = job.block, pages = (n + block - 1) / block, group = job.group;
  work.resize(group * n + group * D);
  float* scores = work.data();
  v8* out = reinterpret_cast<v8*>(scores + group * n);  // [group, C]: the weighted sums so far
  v8 q[C];
  for (int64_t w = 0; w < pages; ++w) {
    const float* keys = job.rows + job.key_rows[w] * job.row_floats;
    if (w + 1 < pages) prefetch(job.rows + job.key_rows[w + 1] * job.row_floats, job.row_floats);
    const int64_t tokens = std::min(block, n - w * block);
    for (int64_t g = 0; g < group; ++g) {
      for (int c = 0; c < C; ++c) q[c] = load(job.q + g * D + 8 * c) * job.scale;
      float* s = scores + g * n + w * block;
      int64_t j = 0;
      for (; j + 8 <= tokens; j += 8) {  // eight keys at once: eight independent FMA chains
        v8 acc[8] = {};
        for (int c = 0; c < C; ++c)
          for (int t = 0; t < 8; ++t) acc[t] += q[c] * load(keys + (j + t) * D + 8 * c);
        *reinterpret_cast<v8*>(s + j) = lane_sums(acc);
      }
      for (; j < tokens; ++j) {
        v8 acc = {};
        for (int c = 0; c < C; ++c) acc += q[c] * load(keys + j * D + 8 * c);
        float sum = 0.f;
        for (int l = 0; l < 8; ++l) sum += acc[l];
        s[j] = sum;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
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
    for (int c = 0; c < C; ++c) out[g * C + c] = v8{};
  }
  for (int64_t w = 0; w < pages; ++w) {
    const float* values = job.rows + (job.key_rows[w] + job.kv_heads) * job.row_floats;
    if (w + 1 < pages) prefetch(job.rows + (job.key_rows[w + 1] + job.kv_heads) * job.row_floats, job.row_floats);
    const int64_t tokens = std::min(block, n - w * block);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * n + w * block;
      v8 acc[C];
      for (int c = 0; c < C; ++c) acc[c] = out[g * C + c];
      for (int64_t j = 0; j < tokens; ++j)
        for (int c = 0; c < C; ++c) acc[c] += p[j] * load(values + j * D + 8 * c);
      for (int c = 0; c < C; ++c) out[g * C + c] = acc[c];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) *reinterpret_cast<v8*>(job.out + g * D + 8 * c) = out[g * C + c];
}

// Jobs 0 .. jobs - 1 handed out one at a time, in order (callers number the longest first: a
// static split would leave a thread idle while another finishes the long ones), on `threads` of
// PyTorch's own pool; `run(job, work, key_rows)` with scratch of its thread's, key_rows of `width`.
template <typename Run>
void run_jobs(int64_t jobs, int64_t width, int64_t threads, Run run) {
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    std::vector<float> work;
    std::vector<int64_t> key_rows(width);
    for (int64_t i; (i = next.fetch_add(1)) < jobs;) run(i, work, key_rows);
  };
  if (threads <= 1)
    worker(0, 1);
  else
    at::parallel_for(0, threads, 1, worker);
}

// `pick(std::integral_constant<int, D>)`: a kernel's instance for one of the head sizes built.
template <typename Pick>
auto for_head_dim(int64_t dim, Pick pick) {
  switch (dim) {
    case 16: return pick(std::integral_constant<int, 16>{});
    case 32: return pick(std::integral_constant<int, 32>{});
    case 64: return pick(std::integral_constant<int, 64>{});
    case 80: return pick(std::integral_constant<int, 80>{});
    case 96: return pick(std::integral_constant<int, 96>{});
    case 128: return pick(std::integral_constant<int, 128>{});
    case 256: return pick(std::integral_constant<int, 256>{});
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
  const auto kernel = for_head_dim(dim, [](auto d) { return &attend<decltype(d)::value>; });
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
  // Sequences come longest first, so the jobs do.
  run_jobs(seqs * kv_heads, width, threads, [&](int64_t i, std::vector<float>& work, std::vector<int64_t>& key_rows) {
    const int64_t b = i / kv_heads, h = i % kv_heads;
    for (int64_t w = 0; w < width; ++w) key_rows[w] = page_data[(h * seqs + b) * width + w] + offset;
    const int64_t base = (b * kv_heads + h) * group * dim;
    kernel({q_data + base, row_data, key_rows.data(), rows.size(1), kv_heads, length_data[b], block_size, group,
            static_cast<float>(scale), out_data + base}, work);
  });
}

// Prefill: one sequence's chunk of n queries at positions start .. start + n - 1, each attending
// to the keys up to its own position, all of them (prefix and chunk) read in the pool's pages.
// A job is (KV head, tile of QT queries): its QT x group query rows against key tiles of 16, as
// small matrix products (the keys transposed into a [D, 16] tile, so that every FMA is a full
// vector), with the online softmax of flash attention; tiles past the job's last query skipped.
constexpr int QT = 16, KT = 16;
constexpr float MASKED = -1e30f;  // not -inf: -ffast-math assumes finite arithmetic

struct PrefillJob {
  const float* q;            // [n, kv_heads, group, D]
  const float* rows;
  const int64_t* key_rows;   // [pages] for this KV head, this layer's
  int64_t row_floats, kv_heads, head, group, block, start, first, count;  // queries first .. first + count - 1
  float scale;
  float* out;                // [n, kv_heads, group, D]
};

template <int D>
void prefill_tile(const PrefillJob& job, std::vector<float>& work) {
  constexpr int C = D / 8;
  const int64_t m = job.count * job.group;  // query rows, row r: query first + r / group, head r % group
  const int64_t padded = (m + 3) / 4 * 4;   // scores are computed four rows at a time
  work.resize(padded * D + padded * KT + 2 * m + D * KT + m * D);
  float* q = work.data();
  float *s = q + padded * D, *top = s + padded * KT, *total = top + m, *kt = total + m;
  v8* o = reinterpret_cast<v8*>(kt + D * KT);
  for (int64_t r = 0; r < padded; ++r) {
    if (r >= m) {
      std::fill(q + r * D, q + (r + 1) * D, 0.f);
      continue;
    }
    const float* src = job.q + (((job.first + r / job.group) * job.kv_heads + job.head) * job.group + r % job.group) * D;
    for (int d = 0; d < D; ++d) q[r * D + d] = src[d] * job.scale;
    top[r] = MASKED;
    total[r] = 0.f;
    for (int c = 0; c < C; ++c) o[r * C + c] = v8{};
  }
  const int64_t last = job.start + job.first + job.count;  // keys [0, last) are seen by some row
  const float* values[KT];
  const std::vector<float> zeros(D, 0.f);  // the rows of a tile past the last key
  std::vector<int64_t> seen(m);  // of the tile's keys, how many each row sees
  for (int64_t k0 = 0; k0 < last; k0 += KT) {
    const int64_t keys = std::min<int64_t>(KT, last - k0);
    // Keys k0 .. k0 + keys - 1 transposed into kt [D, KT] (a tile may span pages when block < 16).
    const float* key_of[KT];
    for (int64_t j = 0; j < KT; ++j) {
      if (j < keys) {
        const int64_t pos = k0 + j, page = job.key_rows[pos / job.block], at = (pos % job.block) * D;
        key_of[j] = job.rows + page * job.row_floats + at;
        values[j] = job.rows + (page + job.kv_heads) * job.row_floats + at;
      } else {
        key_of[j] = zeros.data();
      }
    }
    for (int j = 0; j < KT; j += 8)
      for (int d = 0; d < D; d += 8) transpose8(key_of + j, d, kt + d * KT + j, KT);
    for (int64_t r0 = 0; r0 < padded; r0 += 4) {  // scores, four rows at a time
      v8 acc[4][2] = {};
      const float* a = q + r0 * D;
      for (int d = 0; d < D; ++d) {
        const v8 b0 = load(kt + d * KT), b1 = load(kt + d * KT + 8);
        for (int i = 0; i < 4; ++i) {
          acc[i][0] += a[i * D + d] * b0;
          acc[i][1] += a[i * D + d] * b1;
        }
      }
      for (int i = 0; i < 4; ++i) {
        *reinterpret_cast<v8*>(s + (r0 + i) * KT) = acc[i][0];
        *reinterpret_cast<v8*>(s + (r0 + i) * KT + 8) = acc[i][1];
      }
    }
    for (int64_t r = 0; r < m; ++r) {  // mask, online softmax
      const int64_t pos = job.start + job.first + r / job.group;
      seen[r] = std::clamp<int64_t>(pos - k0 + 1, 0, keys);
      float* p = s + r * KT;
      if (!seen[r]) {  // every key of the tile lies after this query
        std::fill(p, p + KT, 0.f);
        continue;
      }
      float tile_top = MASKED;
      for (int64_t j = 0; j < KT; ++j) {
        if (j >= seen[r]) p[j] = MASKED;
        tile_top = std::max(tile_top, p[j]);
      }
      const float new_top = std::max(top[r], tile_top), rescale = std::exp(top[r] - new_top);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < KT; ++j) {
        p[j] = std::exp(p[j] - new_top);  // 0 where masked
        sum += p[j];
      }
      top[r] = new_top;
      total[r] = total[r] * rescale + sum;
      for (int c = 0; c < C; ++c) o[r * C + c] *= rescale;
    }
    for (int64_t r = 0; r < m; r += 2) {  // o += p v, two rows sharing each value's loads
      const int64_t pair = std::min<int64_t>(2, m - r), keys_seen = std::max(seen[r], pair > 1 ? seen[r + 1] : 0);
      if (!keys_seen) continue;
      const float* p0 = s + r * KT;
      const float* p1 = pair > 1 ? p0 + KT : p0;  // a lone last row: its own weights twice, one result kept
      v8 a0[C], a1[C];
      for (int c = 0; c < C; ++c) a0[c] = o[r * C + c], a1[c] = pair > 1 ? o[(r + 1) * C + c] : v8{};
      for (int64_t j = 0; j < keys_seen; ++j)
        for (int c = 0; c < C; ++c) {
          const v8 value = load(values[j] + 8 * c);
          a0[c] += p0[j] * value;
          a1[c] += p1[j] * value;
        }
      for (int c = 0; c < C; ++c) {
        o[r * C + c] = a0[c];
        if (pair > 1) o[(r + 1) * C + c] = a1[c];
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    float* dst = job.out + (((job.first + r / job.group) * job.kv_heads + job.head) * job.group + r % job.group) * D;
    const float inv = 1.f / total[r];
    for (int c = 0; c < C; ++c) *reinterpret_cast<v8*>(dst + 8 * c) = o[r * C + c] * inv;
  }
}

// q, out [n, kv_heads, group, D]: a chunk of one sequence at positions start .. start + n - 1;
// pages [kv_heads, width]: its pages' K rows for layer 0 (`offset` moves them to this layer).
void paged_prefill(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& pages, int64_t offset,
                   int64_t start, int64_t block_size, double scale, int64_t threads, const at::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && rows.is_contiguous() && pages.is_contiguous(),
              "cpu attention: contiguous tensors expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && rows.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  pages.scalar_type() == at::kLong, "cpu attention: float32 q, rows and out, int64 pages expected");
  TORCH_CHECK(q.dim() == 4 && out.sizes() == q.sizes() && pages.dim() == 2 && pages.size(0) == q.size(1) &&
                  rows.dim() == 2 && rows.size(1) == block_size * q.size(3),
              "cpu attention: q and out [tokens, kv_heads, group, D], pages [kv_heads, width] and rows "
              "[rows, block_size * D] expected");
  const int64_t n = q.size(0), kv_heads = q.size(1), group = q.size(2), dim = q.size(3), width = pages.size(1);
  TORCH_CHECK(start >= 0 && start + n <= width * block_size, "cpu attention: a chunk of ", n, " tokens from ", start,
              " does not fit its ", width, " pages of ", block_size);
  const int64_t* page_data = pages.data_ptr<int64_t>();
  const int64_t num_rows = rows.size(0);
  for (int64_t i = 0; i < pages.numel(); ++i)
    TORCH_CHECK(page_data[i] >= 0 && page_data[i] + offset + kv_heads < num_rows, "cpu attention: page row ",
                page_data[i], " + ", offset, " is outside the pool's ", num_rows, " rows");
  const auto kernel = for_head_dim(dim, [](auto d) { return &prefill_tile<decltype(d)::value>; });
  const int64_t tiles = (n + QT - 1) / QT;
  run_jobs(tiles * kv_heads, width, threads, [&](int64_t i, std::vector<float>& work, std::vector<int64_t>& key_rows) {
    const int64_t tile = tiles - 1 - i / kv_heads, h = i % kv_heads;  // the longest (last) tiles first
    for (int64_t w = 0; w < width; ++w) key_rows[w] = page_data[h * width + w] + offset;
    const int64_t first = tile * QT;
    kernel({q.data_ptr<float>(), rows.data_ptr<float>(), key_rows.data(), rows.size(1), kv_heads, h, group,
            block_size, start, first, std::min<int64_t>(QT, n - first), static_cast<float>(scale),
            out.data_ptr<float>()}, work);
  });
}

}  // namespace

TORCH_LIBRARY(rose, m) {
  m.def("paged_decode", &paged_decode);
  m.def("paged_prefill", &paged_prefill);
}
