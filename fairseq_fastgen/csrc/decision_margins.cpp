// The margin guard's per-step test (continuous batching on a kernel that rounds otherwise
// than stock's): fairseq_fastgen/search/continuous/margins.py, tight_slots, in one pass.
// The module docstring there carries the argument; this is its statement for statement.
//
// Per slot i, with the candidates best first (C = 2k decide, column C, when present, is
// the best candidate after them):
//  * masked[j]: word eos, score not -inf, and not an ignored position (j < k);
//  * accepted[j] (j < k): masked, in order, while the slot has fewer than k hypotheses;
//  * taken[j]: the first k positions not (masked or ignored), then the rest in order,
//    unless the slot is done after this step (k hypotheses, or at its length limit);
//  * role: accepted 1, taken 2, else 0 (column C: 0);
//  * tight: two neighbours j, j+1 of different roles (any two with an ignored position in
//    the slot) whose scores differ by less than margin * (1 + |second| / score_scale),
//    the first one finite.
#include <torch/extension.h>

#include <cmath>
#include <vector>

namespace {

using at::Tensor;

// cand_scores (s, W) float32, cand_words (s, W) int64 with W = C or C + 1, C = 2k;
// ignore (>= s, k) bool, fin_count (>= s,) int64 (before this step's finalization),
// at_limit (s,) bool.  Returns tight (s,) bool.
Tensor slot_margins(const Tensor& cand_scores_in, const Tensor& cand_words_in,
                    const Tensor& ignore_in, const Tensor& fin_count_in,
                    const Tensor& at_limit_in, int64_t eos, int64_t decide, double margin,
                    double score_scale) {
  const Tensor cs = cand_scores_in.contiguous(), cw = cand_words_in.contiguous(),
               ig = ignore_in.contiguous(), fc = fin_count_in.contiguous(),
               al = at_limit_in.contiguous();
  TORCH_CHECK(cs.scalar_type() == at::kFloat && cw.scalar_type() == at::kLong &&
              ig.scalar_type() == at::kBool && fc.scalar_type() == at::kLong &&
              al.scalar_type() == at::kBool && cs.device().is_cpu(),
              "slot_margins: CPU float32 scores, int64 words/counts, bool ignore/at_limit");
  const int64_t s = cs.size(0), w = cs.size(1), k = ig.size(1);
  TORCH_CHECK(cw.sizes() == cs.sizes() && decide >= k && (w == decide || w == decide + 1) &&
              ig.size(0) >= s && fc.size(0) >= s && al.numel() == s, "slot_margins: shapes");
  Tensor tight = at::zeros({s}, ig.options());
  const float* sp = cs.data_ptr<float>();
  const int64_t* wp = cw.data_ptr<int64_t>();
  const bool* igp = ig.data_ptr<bool>();
  const int64_t* fcp = fc.data_ptr<int64_t>();
  const bool* alp = al.data_ptr<bool>();
  bool* tp = tight.data_ptr<bool>();
  const float m = static_cast<float>(margin), inv_scale = static_cast<float>(1.0 / score_scale);
  std::vector<char> masked(decide), role(w);
  for (int64_t i = 0; i < s; ++i) {
    const float* sc = sp + i * w;
    const int64_t* wd = wp + i * w;
    bool any_ignored = false;
    for (int64_t j = 0; j < k; ++j) any_ignored = any_ignored || igp[i * k + j];
    for (int64_t j = 0; j < decide; ++j)
      masked[j] = wd[j] == eos && !std::isinf(sc[j]) && !(j < k && igp[i * k + j]);
    std::fill(role.begin(), role.end(), 0);
    int64_t count = fcp[i];
    for (int64_t j = 0; j < k; ++j) {
      if (masked[j] && count < k) {
        role[j] = 1;
        ++count;
      }
    }
    if (count < k && !alp[i]) {  // the slot goes on: its next hypotheses matter
      int64_t taken = 0;
      for (int pass = 0; pass < 2 && taken < k; ++pass) {
        for (int64_t j = 0; j < decide && taken < k; ++j) {
          const bool out = masked[j] || (j < k && igp[i * k + j]);
          if (out != (pass == 1)) continue;
          role[j] = 2;
          ++taken;
        }
      }
    }
    for (int64_t j = 0; j + 1 < w; ++j) {
      if (role[j] == role[j + 1] && !any_ignored) continue;
      if (std::isinf(sc[j])) continue;  // -inf neighbours: the same bans either way
      // the bound grows with the scores' size (their last places do)
      if (sc[j] - sc[j + 1] < m * (1.f + std::fabs(sc[j + 1]) * inv_scale)) {
        tp[i] = true;
        break;
      }
    }
  }
  return tight;
}

}  // namespace

void register_decision_margins(pybind11::module& m) {
  m.def("slot_margins", &slot_margins,
        "continuous batching: slots whose step decided between candidates closer than a margin");
}
