// Beam-search candidates in one pass over the log-probabilities
// (fairseq_fastgen/search/candidates.py's top_candidates, for CPU float32).
//
// fairseq's BeamSearch.step adds each hypothesis's score to its (vocab,) row and takes the
// top 2*beam of the beam*vocab sums of a sentence. Here each sentence keeps its k best
// sums so far, sorted; a block of kBlock words is scanned only if some sum in it beats
// the k-th best (sums computed as stock computes them: lprob + score in float32, so an
// element is kept exactly when its sum is among the k largest). Values are stock's; among
// exactly equal sums the lower (beam, word) comes first, which may differ from
// torch.topk's order (a tie, see docs/lossless.md).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;

// A sentence's k best (sum, flat index): sums descending, equal sums by index ascending.
struct Best {
  int64_t k;
  int64_t size = 0;
  float* val;
  int64_t* idx;

  bool full() const { return size == k; }
  float worst() const { return val[k - 1]; }
  // v must beat worst() when full (indices come in ascending order, so an equal sum
  // never displaces an earlier one)
  void push(float v, int64_t i) {
    int64_t p = full() ? k - 1 : size++;
    while (p > 0 && val[p - 1] < v) {
      val[p] = val[p - 1];
      idx[p] = idx[p - 1];
      --p;
    }
    val[p] = v;
    idx[p] = i;
  }
};

// Whether some row[j] + score (j < kBlock) is above worst: the same float additions as
// the scalar loop (no fused operation), kBlock at a time where the CPU has the lanes.
inline bool block_beats(const float* row, float score, float worst) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_add_ps(_mm512_loadu_ps(row), _mm512_set1_ps(score));
  return _mm512_cmp_ps_mask(v, _mm512_set1_ps(worst), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
  const __m256 sc = _mm256_set1_ps(score), wo = _mm256_set1_ps(worst);
  const __m256 a = _mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(row), sc), wo, _CMP_GT_OQ);
  const __m256 b = _mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(row + 8), sc), wo, _CMP_GT_OQ);
  return _mm256_movemask_ps(_mm256_or_ps(a, b)) != 0;
#else
  bool any = false;
  for (int64_t j = 0; j < kBlock; ++j) any |= (row[j] + score > worst);
  return any;
#endif
}

// Offers row's sums (flat indices base + w) to best. Without a score the sums are the
// log-probabilities themselves (adding 0 could turn -0 into +0).
void scan_row(Best& best, const float* row, int64_t vocab, float score, bool has_score,
              int64_t base) {
  const float add = has_score ? score : 0.f;
  int64_t w = 0;
  for (; w < vocab && !best.full(); ++w) best.push(has_score ? row[w] + score : row[w], base + w);
  for (; w + kBlock <= vocab; w += kBlock) {
    if (!block_beats(row + w, add, best.worst())) continue;  // (-0 + 0 > x iff -0 > x)
    for (int64_t j = 0; j < kBlock; ++j) {
      const float v = has_score ? row[w + j] + score : row[w + j];
      if (v > best.worst()) best.push(v, base + w + j);
    }
  }
  for (; w < vocab; ++w) {
    const float v = has_score ? row[w] + score : row[w];
    if (v > best.worst()) best.push(v, base + w);
  }
}

// lprobs: (bsz, beams, V) float32, last dimension contiguous; scores: (bsz, beams) or
// None (the sums are the log-probabilities); first: (bsz,) bool or None, sentences at
// their first step (continuous batching): only their first beam, without a score, as
// with scores None. Returns the k best sums of each sentence (bsz, k) descending, their
// words (bsz, k) and beams (bsz, k), int64.
std::tuple<at::Tensor, at::Tensor, at::Tensor> beam_candidates(
    const at::Tensor& lprobs, const std::optional<at::Tensor>& scores_in, int64_t k,
    const std::optional<at::Tensor>& first_in) {
  TORCH_CHECK(lprobs.dim() == 3 && lprobs.scalar_type() == at::kFloat && lprobs.stride(2) == 1,
              "beam_candidates: lprobs (bsz, beams, V) float32, last dimension contiguous");
  const int64_t bsz = lprobs.size(0), beams = lprobs.size(1), vocab = lprobs.size(2);
  TORCH_CHECK(k >= 1 && k <= beams * vocab, "beam_candidates: k out of range");
  const bool has_score = scores_in.has_value();
  at::Tensor scores;
  if (has_score) {
    scores = scores_in->to(at::kFloat).contiguous();
    TORCH_CHECK(scores.dim() == 2 && scores.size(0) == bsz && scores.size(1) == beams,
                "beam_candidates: scores (bsz, beams)");
  }
  at::Tensor first;
  if (first_in.has_value()) {
    first = first_in->to(at::kBool).contiguous();
    TORCH_CHECK(first.numel() == bsz && has_score && k <= vocab, "beam_candidates: first (bsz,)");
  }
  const bool* fp = first.defined() ? first.data_ptr<bool>() : nullptr;
  at::Tensor values = at::empty({bsz, k}, lprobs.options());
  at::Tensor flat = at::empty({bsz, k}, lprobs.options().dtype(at::kLong));
  const float* lp = lprobs.data_ptr<float>();
  const float* sp = has_score ? scores.data_ptr<float>() : nullptr;
  float* vp = values.data_ptr<float>();
  int64_t* ip = flat.data_ptr<int64_t>();
  const int64_t s0 = lprobs.stride(0), s1 = lprobs.stride(1);
  at::parallel_for(0, bsz, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      Best best{k, 0, vp + s * k, ip + s * k};
      const bool once = fp != nullptr && fp[s];
      const bool scored = has_score && !once;
      for (int64_t b = 0; b < (once ? 1 : beams); ++b) {
        scan_row(best, lp + s * s0 + b * s1, vocab, scored ? sp[s * beams + b] : 0.f, scored,
                 b * vocab);
      }
    }
  });
  at::Tensor beam = at::div(flat, vocab, "trunc");
  return {values, flat - beam * vocab, beam};
}

}  // namespace

void register_beam_candidates(pybind11::module& m) {
  m.def("beam_candidates", &beam_candidates,
        "the k best lprob + score sums of each sentence (fairseq BeamSearch.step's top-k)",
        pybind11::arg("lprobs"), pybind11::arg("scores"), pybind11::arg("k"),
        pybind11::arg("first") = pybind11::none());
}
