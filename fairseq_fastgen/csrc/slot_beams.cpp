// One beam-search step of every sentence slot after its candidates are chosen
// (continuous batching): fairseq_fastgen/search/continuous/beams.py, SlotBeams.step's
// statements after _candidates, in one pass instead of ~60 small tensor operations.
// What it pays (benchmarks/before_after.py, this pass vs the Python statements, es->en,
// beam 5, one process, Intel Xeon, 2026-12-08): batch 8 14.4 s vs 16.0 s (11%); batch
// 64 10.7 vs 10.8 s (within noise).
//
// Per slot i (its rows i*k .. i*k+k-1; nothing couples two slots), as stock's
// SequenceGenerator._generate does for a sentence:
//  * eos candidates: word eos, score not -inf, among the first k not ignored;
//  * finalize_hypos: each accepted eos candidate (in candidate order, until the slot has
//    k) becomes a finished hypothesis: tokens with eos at the slot's step, positional
//    scores (score differences), the score divided by (step + 1) ** lenpen when
//    normalizing, -inf past the source length with --match-source-len;
//  * the next hypotheses: the first k candidates that are not eos-or-ignored, then the
//    rest in order (the active_mask top-k); ignore[i] says which were taken from the rest;
//    tokens/scores rows follow their hypotheses, and the chosen word and score are set;
//  * each candidate's role, as bits (the margin guard reads them: margins.py): 1
//    finalized, 2 taken as a next hypothesis.
// The arithmetic is the Python's operation for operation (float32 adds and divisions),
// so the results are bitwise the same.
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

void check(const Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(),
              "slot_beams_step: ", name, " must be a contiguous CPU tensor of ", type);
}

// cand_scores (s, C) float32, cand_words/cand_beams (s, C) int64 (C >= k, each slot's
// candidates best first); steps/src_len (s,) int64; the state tensors as SlotBeams keeps
// them (tokens (>= s*k, L+2) int64, scores (>= s*k, L+1) float32, ignore (>= s, k) bool,
// fin_tokens (>= s, k, L+1) int64, fin_pos (>= s, k, L+1) float32, fin_score (>= s, k)
// float32, fin_len (>= s, k) int64, fin_count (>= s,) int64), updated in place.
// Returns order (s*k,) int64 (the row each next hypothesis continues), had_eos (s,) and
// roles (s, C) int8.
std::tuple<Tensor, Tensor, Tensor> slot_beams_step(
    const Tensor& cand_scores_in, const Tensor& cand_words_in, const Tensor& cand_beams_in,
    const Tensor& steps_in, const Tensor& src_len_in, Tensor tokens, Tensor scores,
    Tensor ignore, Tensor fin_tokens, Tensor fin_pos, Tensor fin_score, Tensor fin_len,
    Tensor fin_count, int64_t eos, bool normalize, double len_penalty, bool match_source_len) {
  const Tensor cs = cand_scores_in.contiguous(), cw = cand_words_in.contiguous(),
               cb = cand_beams_in.contiguous(), st = steps_in.contiguous(),
               sl = src_len_in.to(at::kLong).contiguous();
  check(cs, at::kFloat, "cand_scores");
  check(cw, at::kLong, "cand_words");
  check(cb, at::kLong, "cand_beams");
  check(st, at::kLong, "steps");
  check(tokens, at::kLong, "tokens");
  check(scores, at::kFloat, "scores");
  check(ignore, at::kBool, "ignore");
  check(fin_tokens, at::kLong, "fin_tokens");
  check(fin_pos, at::kFloat, "fin_pos");
  check(fin_score, at::kFloat, "fin_score");
  check(fin_len, at::kLong, "fin_len");
  check(fin_count, at::kLong, "fin_count");
  const int64_t s = cs.size(0), c = cs.size(1), k = ignore.size(1);
  const int64_t tw = tokens.size(1), sw = scores.size(1), fw = fin_tokens.size(2);
  TORCH_CHECK(c >= k && tokens.size(0) >= s * k && scores.size(0) >= s * k &&
              ignore.size(0) >= s && fin_count.size(0) >= s && st.numel() == s &&
              sl.numel() == s && fin_pos.size(2) == fw && fw + 1 == tw && sw == fw,
              "slot_beams_step: shapes");
  Tensor order = at::empty({s * k}, tokens.options());
  Tensor had_eos = at::zeros({s}, ignore.options());
  Tensor roles = at::zeros({s, c}, cs.options().dtype(at::kChar));
  const float* csp = cs.data_ptr<float>();
  const int64_t* cwp = cw.data_ptr<int64_t>();
  const int64_t* cbp = cb.data_ptr<int64_t>();
  const int64_t* stp = st.data_ptr<int64_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* sp = scores.data_ptr<float>();
  bool* ig = ignore.data_ptr<bool>();
  int64_t* ftp = fin_tokens.data_ptr<int64_t>();
  float* fpp = fin_pos.data_ptr<float>();
  float* fsp = fin_score.data_ptr<float>();
  int64_t* flp = fin_len.data_ptr<int64_t>();
  int64_t* fcp = fin_count.data_ptr<int64_t>();
  int64_t* op = order.data_ptr<int64_t>();
  bool* hp = had_eos.data_ptr<bool>();
  int8_t* rp = roles.data_ptr<int8_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<char> masked(c);
  std::vector<int64_t> old_tokens(k * tw);
  std::vector<float> old_scores(k * sw);
  for (int64_t i = 0; i < s; ++i) {
    const float* sc = csp + i * c;
    const int64_t* wd = cwp + i * c;
    const int64_t* bm = cbp + i * c;
    const int64_t step = stp[i];
    TORCH_CHECK(step >= 0 && step + 1 < tw, "slot_beams_step: step out of range");
    for (int64_t j = 0; j < c; ++j) {
      masked[j] = wd[j] == eos && sc[j] != neg_inf && !(j < k && ig[i * k + j]);
      TORCH_CHECK(bm[j] >= 0 && bm[j] < k, "slot_beams_step: candidate beam out of range");
    }
    int64_t count = fcp[i];
    for (int64_t j = 0; j < k; ++j) {
      if (!masked[j]) continue;
      hp[i] = true;
      if (count >= k) continue;  // the slot has its k hypotheses: stock accepts no more
      const int64_t row = i * k + bm[j], p = count++;
      rp[i * c + j] = 1;
      int64_t* ft = ftp + (i * k + p) * fw;
      const int64_t* tr = tp + row * tw + 1;
      for (int64_t x = 0; x < step; ++x) ft[x] = tr[x];
      ft[step] = eos;
      // positional scores: cumulative scores with the eos score at the step, differenced
      float* fp = fpp + (i * k + p) * fw;
      const float* sr = sp + row * sw;
      float prev = 0.f;
      for (int64_t x = 0; x <= step; ++x) {
        const float cur = x == step ? sc[j] : sr[x];
        fp[x] = x == 0 ? cur : cur - prev;
        prev = cur;
      }
      float score = sc[j];
      if (normalize) score = score / static_cast<float>(std::pow(static_cast<double>(step) + 1.0, len_penalty));
      if (match_source_len && step > slp[i]) score = neg_inf;
      fsp[i * k + p] = score;
      flp[i * k + p] = step + 1;
    }
    fcp[i] = count;
    // the next hypotheses: the first k of (not masked in order, then masked in order)
    for (int64_t j = 0; j < k; ++j) masked[j] = masked[j] || ig[i * k + j];
    int64_t taken = 0;
    for (int pass = 0; pass < 2 && taken < k; ++pass) {
      for (int64_t j = 0; j < c && taken < k; ++j) {
        if (static_cast<bool>(masked[j]) != (pass == 1)) continue;
        op[i * k + taken] = j;  // candidate index for now
        rp[i * c + j] |= 2;
        ig[i * k + taken] = pass == 1;
        ++taken;
      }
    }
    std::copy(tp + i * k * tw, tp + (i + 1) * k * tw, old_tokens.begin());
    std::copy(sp + i * k * sw, sp + (i + 1) * k * sw, old_scores.begin());
    for (int64_t b = 0; b < k; ++b) {
      const int64_t j = op[i * k + b], src = bm[j], row = i * k + b;
      std::copy(old_tokens.begin() + src * tw, old_tokens.begin() + (src + 1) * tw, tp + row * tw);
      std::copy(old_scores.begin() + src * sw, old_scores.begin() + (src + 1) * sw, sp + row * sw);
      tp[row * tw + step + 1] = wd[j];
      sp[row * sw + step] = sc[j];
      op[row] = i * k + src;
    }
  }
  return {order, had_eos, roles};
}

}  // namespace

void register_slot_beams(pybind11::module& m) {
  m.def("slot_beams_step", &slot_beams_step,
        "continuous batching: finalization and next hypotheses of every slot, in place");
}
