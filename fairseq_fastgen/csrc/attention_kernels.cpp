// The attention kernels of the C++ decoder step (csrc/decoder_layers.cpp calls them):
// self-attention read in place through an ancestor table, and encoder-decoder attention
// in one pass per sentence.  Both sum in another order than ATen's batched GEMMs (the
// last bit may differ: lossless mode); the order is fixed for a given build, so a run
// repeats its own bits.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// A dot product of length n: SIMD lanes of partial sums, then their sum (no -ffast-math
// needed; the order is fixed for a given build).
inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) {
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
#endif
  constexpr int kLanes = 16;
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// p[0:m] = softmax(p[0:m]) in place (float, as at::softmax computes it up to rounding)
inline void softmax_inplace(float* p, int64_t m) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < m; ++i) top = std::max(top, p[i]);
  float z = 0.f;
  for (int64_t i = 0; i < m; ++i) {
    p[i] = std::exp(p[i] - top);
    z += p[i];
  }
  for (int64_t i = 0; i < m; ++i) p[i] /= z;
}

// y[0:n] += w * x[0:n]
inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += w * x[d];
}

}  // namespace

namespace fastgen_kernels {

using at::Tensor;

// Self-attention of one query per hypothesis over its own history, read in place: the
// step-s key/value of hypothesis h is row anc[h, s] of kbuf[s]/vbuf[s], so the cache is
// never reordered (a beam reorder only gathers the small anc table).
//   q: (n, C) scaled queries; kbuf, vbuf: (capacity, n0, C); anc: (n, >= t1) int64;
//   lens: (n,) int64 history length of each row (<= t1; continuous batching, where rows
//   stand at different steps), or undefined: t1 for every row.
Tensor ancestor_attention(const Tensor& q, const Tensor& kbuf, const Tensor& vbuf,
                          const Tensor& anc, int64_t t1, int64_t heads, const Tensor& lens) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kbuf.is_contiguous() && vbuf.is_contiguous() &&
              anc.scalar_type() == at::kLong && anc.stride(1) == 1, "ancestor attention inputs");
  TORCH_CHECK(t1 <= kbuf.size(0) && t1 <= anc.size(1), "ancestor attention: history too long");
  const Tensor qc = q.contiguous();
  const int64_t n = qc.size(0), c = qc.size(1), n0 = kbuf.size(1), hd = c / heads;
  const int64_t anc_stride = anc.stride(0);
  Tensor out = at::zeros({n, c}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kbuf.data_ptr<float>();
  const float* vp = vbuf.data_ptr<float>();
  const int64_t* ap = anc.data_ptr<int64_t>();
  const int64_t* lp = lens.defined() ? lens.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  // Step-major: the rows a step's hypotheses read lie close together (a sentence's
  // beam), so each pass streams kbuf[s] / vbuf[s] in memory order.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const int64_t rows = end - begin;
    std::vector<float> p(rows * heads * t1);  // [row][head][step]
    auto len = [&](int64_t h) { return lp != nullptr ? lp[h] : t1; };
    for (int64_t s = 0; s < t1; ++s) {
      for (int64_t h = begin; h < end; ++h) {
        if (s >= len(h)) continue;
        const float* kr = kp + (s * n0 + ap[h * anc_stride + s]) * c;
        float* ph = p.data() + (h - begin) * heads * t1 + s;
        for (int64_t g = 0; g < heads; ++g) ph[g * t1] = dot(qp + h * c + g * hd, kr + g * hd, hd);
      }
    }
    for (int64_t i = 0; i < rows * heads; ++i) {
      softmax_inplace(p.data() + i * t1, len(begin + i / heads));
    }
    for (int64_t s = 0; s < t1; ++s) {
      for (int64_t h = begin; h < end; ++h) {
        if (s >= len(h)) continue;
        const float* vr = vp + (s * n0 + ap[h * anc_stride + s]) * c;
        const float* ph = p.data() + (h - begin) * heads * t1 + s;
        for (int64_t g = 0; g < heads; ++g) axpy(ph[g * t1], vr + g * hd, op + h * c + g * hd, hd);
      }
    }
  });
  return out;
}

// Encoder-decoder attention of a beam's queries against its sentence's keys/values,
// read where they lie: no (bsz*H, beam, hd) copies of the queries or the output, no
// score tensor, padded positions skipped (they weigh exactly 0 in the softmax).
//   q: (n, C) scaled queries, n = bsz*beam; k, v: (bsz*H, S, hd); pad: (bsz, S) bool or
//   undefined. Returns (n, C) and, if need_attn, the head average of the weights (n, S),
//   heads summed in order as mean(0) sums them.
std::tuple<Tensor, Tensor> fused_cross_attention(const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& pad,
                                                 int64_t beam, int64_t heads, bool need_attn) {
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const int64_t n = qc.size(0), c = qc.size(1), hd = c / heads, s = kc.size(1);
  const int64_t bsz = n / beam;
  Tensor out = at::empty({n, c}, qc.options());
  Tensor attn = need_attn ? at::zeros({n, s}, qc.options()) : Tensor();
  const Tensor padc = pad.defined() ? pad.contiguous() : pad;
  const bool* pp = padc.defined() ? padc.data_ptr<bool>() : nullptr;
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* ap = need_attn ? attn.data_ptr<float>() : nullptr;
  at::parallel_for(0, bsz, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(beam * s);
    std::vector<int64_t> keep(s);
    for (int64_t b = begin; b < end; ++b) {
      int64_t m = 0;  // the sentence's unpadded positions
      for (int64_t j = 0; j < s; ++j) {
        if (pp == nullptr || !pp[b * s + j]) keep[m++] = j;
      }
      for (int64_t g = 0; g < heads; ++g) {
        const float* kg = kp + (b * heads + g) * s * hd;
        const float* vg = vp + (b * heads + g) * s * hd;
        for (int64_t r = 0; r < beam; ++r) {
          const int64_t h = b * beam + r;
          const float* qr = qp + h * c + g * hd;
          float* pr = p.data() + r * s;
          for (int64_t i = 0; i < m; ++i) pr[i] = dot(qr, kg + keep[i] * hd, hd);
          softmax_inplace(pr, m);
          float* og = op + h * c + g * hd;
          for (int64_t d = 0; d < hd; ++d) og[d] = 0.f;
          for (int64_t i = 0; i < m; ++i) {
            axpy(pr[i], vg + keep[i] * hd, og, hd);
            if (ap != nullptr) ap[h * s + keep[i]] += pr[i];
          }
        }
      }
      if (ap != nullptr) {
        for (int64_t r = 0; r < beam; ++r) {
          float* ar = ap + (b * beam + r) * s;
          for (int64_t j = 0; j < s; ++j) ar[j] /= static_cast<float>(heads);
        }
      }
    }
  });
  return {out, attn};
}

}  // namespace fastgen_kernels
