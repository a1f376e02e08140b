// The decoder layer stack of one incremental step over rows at their own steps,
// fairseq_fastgen's lossless-mode arithmetic (fairseq_fastgen/models/layers.py,
// slot_decoder.py) operation for operation, called from C++ instead of Python.
//
// Why: a step of the Python layers makes ~100 eager calls, each parsed and dispatched
// from Python. The same ATen calls with the same shapes, made here, cost less dispatch
// (figures: fairseq_fastgen/models/native_step.py); the norms, projections, FFN and
// batched encoder-decoder attention give the Python step's bits (tests/test_native_step.py
// checks it at a first step). The self-attention is this file's own kernel reading the
// caches through an ancestor table (ancestor_attention), and with cfg.fused the
// encoder-decoder attention is fused_cross_attention; both sum in another order.
//
// Layout of the per-layer inputs (see fairseq_fastgen/models/native_step.py):
//   weights: per layer kWeights tensors (undefined = absent), in the order of enum W;
//   caches:  per layer (k, v) self-attention buffers (capacity, rows, C);
//   cross:   per layer (k, v, pad) encoder-decoder keys/values (bsz*H, S, hd) and
//            padding mask (bsz, S) (k undefined: the layer has no encoder attention).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

// The attention kernels (csrc/attention_kernels.cpp).
namespace fastgen_kernels {
at::Tensor ancestor_attention(const at::Tensor& q, const at::Tensor& kbuf,
                              const at::Tensor& vbuf, const at::Tensor& anc, int64_t t1,
                              int64_t heads, const at::Tensor& lens);
std::tuple<at::Tensor, at::Tensor> fused_cross_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pad,
    int64_t beam, int64_t heads, bool need_attn);
}  // namespace fastgen_kernels

namespace {

using fastgen_kernels::ancestor_attention;
using fastgen_kernels::fused_cross_attention;

enum W {
  kLn1W, kLn1B, kQkvWt, kQkvB, kQkvPack, kSaOutWt, kSaOutB, kSaOutPack,
  kLn2W, kLn2B, kEaQWt, kEaQB, kEaQPack, kEaOutWt, kEaOutB, kEaOutPack,
  kLn3W, kLn3B, kFc1Wt, kFc1B, kFc1Pack, kFc2Wt, kFc2B, kFc2Pack,
  kWeights
};

using at::Tensor;

Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  return at::layer_norm(x, {x.size(-1)}, w, b, eps);
}

struct Config {
  int64_t heads;
  int64_t head_dim;
  double sa_scaling;
  double ea_scaling;
  bool normalize_before;
  int64_t activation;  // 0: relu (in place), 1: fairseq's gelu (in float)
  double eps1, eps2, eps3;
  bool fused;  // encoder-decoder attention by fused_cross_attention (fp32)
  bool onednn;  // fp32 projections on oneDNN (fairseq_fastgen/models/gemm_kernel.py)
};

// addmm(b, x, wt) (mm without bias), MKL's packed GEMM when a pack for x's row count is
// given, or oneDNN's linear (cfg.onednn, fp32): exactly TransposedLinear.__call__.
Tensor linear(const Config& cfg, const Tensor& x, const Tensor& wt, const Tensor& b,
              const Tensor& pack) {
  std::optional<Tensor> bias = b.defined() ? std::optional<Tensor>(b) : std::nullopt;
  if (cfg.onednn && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(0) > 0) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                         .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                       c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                       std::optional<c10::string_view>)>();
    return op.call(x, wt.t(), bias, "none", c10::List<std::optional<c10::Scalar>>(), "");
  }
  if (pack.defined()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkl::_mkl_linear", "")
                         .typed<Tensor(const Tensor&, const Tensor&, const Tensor&,
                                       const std::optional<Tensor>&, int64_t)>();
    return op.call(x.contiguous(), pack, wt.t(), bias, x.size(0));
  }
  return b.defined() ? at::addmm(b, x, wt) : at::mm(x, wt);
}

// buf[lens[r] - 1, phys[r]] = src[r, col:col+C] for every row r: each row's key or value
// at its own step, in the cache row it owns.  buf: (capacity, n0, C); src: (n, >= col+C).
void write_at_steps(Tensor& buf, const Tensor& src, int64_t col, const Tensor& lens,
                    const Tensor& phys) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == at::kFloat &&
              src.scalar_type() == at::kFloat && src.stride(1) == 1, "cache rows");
  const int64_t n = src.size(0), cap = buf.size(0), n0 = buf.size(1), c = buf.size(2);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* pp = phys.data_ptr<int64_t>();
  const float* sp = src.data_ptr<float>() + col;
  float* bp = buf.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= cap && pp[r] >= 0 && pp[r] < n0, "cache row out of range");
    std::copy(sp + r * src.stride(0), sp + r * src.stride(0) + c, bp + ((lp[r] - 1) * n0 + pp[r]) * c);
  }
}

// Each row at its own step lens[h] - 1, written to cache row phys[h] and read through
// the ancestor table (the buffers are never reordered).
Tensor self_attention(const Config& cfg, const Tensor* w, const Tensor& x, Tensor& kbuf,
                      Tensor& vbuf, int64_t t, const Tensor& anc, const Tensor& lens,
                      const Tensor& phys) {
  const int64_t c = x.size(1);
  Tensor qkv = linear(cfg, x, w[kQkvWt], w[kQkvB], w[kQkvPack]);
  Tensor q = qkv.slice(1, 0, c).mul(cfg.sa_scaling);
  write_at_steps(kbuf, qkv, c, lens, phys);
  write_at_steps(vbuf, qkv, 2 * c, lens, phys);
  Tensor out = ancestor_attention(q, kbuf, vbuf, anc, t + 1, cfg.heads, lens);
  return linear(cfg, out, w[kSaOutWt], w[kSaOutB], w[kSaOutPack]);
}

// cached_attention.CrossAttentionCache.attend, merged (one copy per sentence) path; with
// cfg.fused (fp32) the kernel above instead of its reshapes and batched GEMMs.
std::tuple<Tensor, Tensor> cross_attention(const Config& cfg, const Tensor* w, const Tensor& x,
                                           const Tensor& k, const Tensor& v, const Tensor& pad,
                                           int64_t beam, bool need_attn) {
  const int64_t n = x.size(0), c = x.size(1), h = cfg.heads, hd = cfg.head_dim;
  const int64_t bsz = n / beam, s = k.size(1);
  Tensor q = linear(cfg, x, w[kEaQWt], w[kEaQB], w[kEaQPack]);
  q.mul_(cfg.ea_scaling);
  if (cfg.fused && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat) {
    auto [o, a] = fused_cross_attention(q, k, v, pad, beam, h, need_attn);
    return {linear(cfg, o, w[kEaOutWt], w[kEaOutB], w[kEaOutPack]), a};
  }
  q = q.view({bsz, beam, h, hd}).transpose(1, 2).reshape({bsz * h, beam, hd});
  Tensor sc = at::bmm(q, k.transpose(1, 2));  // (bsz*H, beam, S)
  if (pad.defined()) {
    sc = sc.view({bsz, h, beam, s})
             .masked_fill(pad.view({bsz, 1, 1, s}), -std::numeric_limits<double>::infinity())
             .view({-1, beam, s});
  }
  Tensor p = at::softmax(sc, -1, at::kFloat);
  Tensor out = at::bmm(p.to(sc.scalar_type()), v);  // (bsz*H, beam, hd)
  out = out.view({bsz, h, beam, hd}).transpose(1, 2);
  out = linear(cfg, out.reshape({n, c}), w[kEaOutWt], w[kEaOutB], w[kEaOutPack]);
  Tensor attn;
  if (need_attn) {
    attn = p.view({bsz, h, beam, s}).transpose(0, 1).reshape({h, n, s}).mean(0);
  }
  return {out, attn};
}

// One decoder layer (TransformerDecoderLayerBase.forward, eval mode, incremental).
struct Rows {  // where this step's rows read and write their self-attention keys/values
  int64_t t;   // the largest step
  Tensor anc;  // (n, >= t+1) int64 ancestor table
  Tensor lens; // (n,) int64 each row's step + 1
  Tensor phys; // (n,) int64 the cache row each row writes
};

std::tuple<Tensor, Tensor> layer(const Config& cfg, const Tensor* w, Tensor x, Tensor& kbuf,
                                 Tensor& vbuf, const Rows& rows, const Tensor* cross,
                                 int64_t beam, bool need_attn) {
  const bool nb = cfg.normalize_before;
  Tensor residual = x;
  if (nb) x = layer_norm(x, w[kLn1W], w[kLn1B], cfg.eps1);
  x = residual + self_attention(cfg, w, x, kbuf, vbuf, rows.t, rows.anc, rows.lens, rows.phys);
  if (!nb) x = layer_norm(x, w[kLn1W], w[kLn1B], cfg.eps1);
  Tensor attn;
  if (cross[0].defined()) {
    residual = x;
    if (nb) x = layer_norm(x, w[kLn2W], w[kLn2B], cfg.eps2);
    auto [out, a] = cross_attention(cfg, w, x, cross[0], cross[1], cross[2], beam, need_attn);
    attn = a;
    x = residual + out;
    if (!nb) x = layer_norm(x, w[kLn2W], w[kLn2B], cfg.eps2);
  }
  residual = x;
  if (nb) x = layer_norm(x, w[kLn3W], w[kLn3B], cfg.eps3);
  x = linear(cfg, x, w[kFc1Wt], w[kFc1B], w[kFc1Pack]);
  if (cfg.activation == 0) {
    x.relu_();
  } else {
    x = at::gelu(x.to(at::kFloat)).to(residual.scalar_type());
  }
  x = residual + linear(cfg, x, w[kFc2Wt], w[kFc2B], w[kFc2Pack]);
  if (!nb) x = layer_norm(x, w[kLn3W], w[kLn3B], cfg.eps3);
  return {x, attn};
}

// x: (n, C) embedded queries, one per hypothesis; returns the last layer's output (n, C)
// and, if need_attn, its head-averaged encoder-decoder attention (n, S).
std::vector<Tensor> defined_or_not(const std::vector<std::optional<Tensor>>& ts) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(t.has_value() ? *t : Tensor());
  return out;
}

std::tuple<Tensor, Tensor> layers_step(Tensor x,
                                       const std::vector<std::optional<Tensor>>& weights_in,
                                       std::vector<Tensor> caches,
                                       const std::vector<std::optional<Tensor>>& cross_in,
                                       int64_t t,
                                       int64_t beam, std::vector<double> scalars,
                                       std::vector<int64_t> ints, bool need_attn,
                                       Tensor ancestors, Tensor row_lens, Tensor row_phys) {
  const std::vector<Tensor> weights = defined_or_not(weights_in);
  const std::vector<Tensor> cross = defined_or_not(cross_in);
  const int64_t layers = static_cast<int64_t>(caches.size() / 2);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeights, "weights per layer");
  TORCH_CHECK(static_cast<int64_t>(cross.size()) == layers * 3, "cross per layer");
  TORCH_CHECK(scalars.size() == static_cast<size_t>(layers * 5), "scalars per layer");
  TORCH_CHECK(ints.size() == 6, "heads, head_dim, normalize_before, activation, fused, onednn");
  Rows rows{t, ancestors, row_lens, row_phys};
  // each row's own step reads the key/value it writes now
  TORCH_CHECK(rows.lens.is_contiguous() && rows.phys.is_contiguous() &&
              rows.lens.numel() == x.size(0) && rows.phys.numel() == x.size(0) &&
              rows.anc.size(0) == x.size(0) && rows.anc.stride(1) == 1,
              "per-row steps: ancestors, lens and phys per row");
  int64_t* ap = rows.anc.data_ptr<int64_t>();
  const int64_t* lp = rows.lens.data_ptr<int64_t>();
  const int64_t* pp = rows.phys.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) {
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= t + 1 && lp[r] <= rows.anc.size(1), "row step out of range");
    ap[r * rows.anc.stride(0) + lp[r] - 1] = pp[r];
  }
  Tensor attn;
  for (int64_t i = 0; i < layers; ++i) {
    const double* sc = scalars.data() + i * 5;
    Config cfg{ints[0], ints[1], sc[0], sc[1], ints[2] != 0, ints[3],
               sc[2], sc[3], sc[4], ints[4] != 0, ints[5] != 0};
    auto [y, a] = layer(cfg, weights.data() + i * kWeights, x, caches[2 * i], caches[2 * i + 1],
                        rows, cross.data() + 3 * i, beam, need_attn && i == layers - 1);
    x = y;
    if (a.defined()) attn = a;
  }
  return {x, attn};
}

}  // namespace

void register_beam_candidates(pybind11::module& m);  // beam_candidates.cpp
void register_slot_beams(pybind11::module& m);  // slot_beams.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_beam_candidates(m);
  register_slot_beams(m);
  m.def("layers_step", &layers_step, "fairseq_fastgen decoder layers, one incremental step");
  m.attr("WEIGHTS_PER_LAYER") = static_cast<int>(kWeights);
}
