// The decoder layer stack of one incremental step, fairseq_fastgen's lossless-mode
// arithmetic (fairseq_fastgen/models/layers.py, fast_decoder.py, cached_attention.py)
// operation for operation, called from C++ instead of Python.
//
// Why: a step of the Python layers makes ~100 eager calls, each parsed and dispatched
// from Python. The same ATen calls with the same shapes, made here, give the same bits as
// the Python step (tests/test_native_step.py checks it) at less dispatch cost (figures:
// fairseq_fastgen/models/native_step.py). With an ancestor table the self-attention is
// this file's own kernel (ancestor_attention), which sums in another order.
//
// Layout of the per-layer inputs (see fairseq_fastgen/models/native_step.py):
//   weights: per layer kWeights tensors (undefined = absent), in the order of enum W;
//   caches:  per layer (k, v) self-attention buffers (capacity, n, C), step t written;
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

namespace {

enum W {
  kLn1W, kLn1B, kQkvWt, kQkvB, kQkvPack, kSaOutWt, kSaOutB, kSaOutPack,
  kLn2W, kLn2B, kEaQWt, kEaQB, kEaQPack, kEaOutWt, kEaOutB, kEaOutPack,
  kLn3W, kLn3B, kFc1Wt, kFc1B, kFc1Pack, kFc2Wt, kFc2B, kFc2Pack,
  kWeights
};

using at::Tensor;

// addmm(b, x, wt) (mm without bias), or MKL's packed GEMM when a pack for x's row count
// is given: exactly TransposedLinear.__call__.
Tensor linear(const Tensor& x, const Tensor& wt, const Tensor& b, const Tensor& pack) {
  if (pack.defined()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkl::_mkl_linear", "")
                         .typed<Tensor(const Tensor&, const Tensor&, const Tensor&,
                                       const std::optional<Tensor>&, int64_t)>();
    std::optional<Tensor> bias = b.defined() ? std::optional<Tensor>(b) : std::nullopt;
    return op.call(x.contiguous(), pack, wt.t(), bias, x.size(0));
  }
  return b.defined() ? at::addmm(b, x, wt) : at::mm(x, wt);
}

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
};

// A dot product of length n in independent partial sums, so that the compiler can use
// SIMD lanes without reassociating a single sum (no -ffast-math needed).
inline float dot(const float* a, const float* b, int64_t n) {
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

// Self-attention of one query per hypothesis over its own history, read in place: the
// step-s key/value of hypothesis h is row anc[h, s] of kbuf[s]/vbuf[s], so the cache is
// never reordered (a beam reorder only gathers the small anc table).
//   q: (n, C) scaled queries; kbuf, vbuf: (capacity, n0, C); anc: (n, >= t1) int64.
Tensor ancestor_attention(const Tensor& q, const Tensor& kbuf, const Tensor& vbuf,
                          const Tensor& anc, int64_t t1, int64_t heads) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kbuf.is_contiguous() && vbuf.is_contiguous() &&
              anc.scalar_type() == at::kLong && anc.stride(1) == 1, "ancestor attention inputs");
  const Tensor qc = q.contiguous();
  const int64_t n = qc.size(0), c = qc.size(1), n0 = kbuf.size(1), hd = c / heads;
  const int64_t anc_stride = anc.stride(0);
  Tensor out = at::empty({n, c}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kbuf.data_ptr<float>();
  const float* vp = vbuf.data_ptr<float>();
  const int64_t* ap = anc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(t1);
    for (int64_t h = begin; h < end; ++h) {
      const int64_t* ah = ap + h * anc_stride;
      for (int64_t g = 0; g < heads; ++g) {
        const float* qg = qp + h * c + g * hd;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < t1; ++s) {
          scores[s] = dot(qg, kp + (s * n0 + ah[s]) * c + g * hd, hd);
          top = std::max(top, scores[s]);
        }
        float z = 0.f;
        for (int64_t s = 0; s < t1; ++s) {
          scores[s] = std::exp(scores[s] - top);
          z += scores[s];
        }
        float* og = op + h * c + g * hd;
        for (int64_t d = 0; d < hd; ++d) og[d] = 0.f;
        for (int64_t s = 0; s < t1; ++s) {
          const float p = scores[s] / z;
          const float* vs = vp + (s * n0 + ah[s]) * c + g * hd;
          for (int64_t d = 0; d < hd; ++d) og[d] += p * vs[d];
        }
      }
    }
  });
  return out;
}

Tensor self_attention(const Config& cfg, const Tensor* w, const Tensor& x, Tensor& kbuf,
                      Tensor& vbuf, int64_t t, const Tensor& anc) {
  const int64_t n = x.size(0), c = x.size(1);
  Tensor qkv = linear(x, w[kQkvWt], w[kQkvB], w[kQkvPack]);
  Tensor q = qkv.slice(1, 0, c).mul(cfg.sa_scaling);
  if (anc.defined()) {  // rows 0..n-1 of step t: this step's hypotheses (anc[h, t] == h)
    kbuf.select(0, t).narrow(0, 0, n).copy_(qkv.slice(1, c, 2 * c));
    vbuf.select(0, t).narrow(0, 0, n).copy_(qkv.slice(1, 2 * c, 3 * c));
    Tensor out = ancestor_attention(q, kbuf, vbuf, anc, t + 1, cfg.heads);
    return linear(out, w[kSaOutWt], w[kSaOutB], w[kSaOutPack]);
  }
  kbuf.select(0, t).copy_(qkv.slice(1, c, 2 * c));
  vbuf.select(0, t).copy_(qkv.slice(1, 2 * c, 3 * c));
  const int64_t t1 = t + 1, bh = n * cfg.heads;
  Tensor keys = kbuf.slice(0, 0, t1).reshape({t1, bh, cfg.head_dim}).transpose(0, 1);
  Tensor values = vbuf.slice(0, 0, t1).reshape({t1, bh, cfg.head_dim}).transpose(0, 1);
  Tensor s = at::bmm(q.reshape({bh, 1, cfg.head_dim}), keys.transpose(1, 2));
  Tensor p = at::softmax(s, -1, at::kFloat).to(s.scalar_type());
  Tensor out = at::bmm(p, values).view({n, c});
  return linear(out, w[kSaOutWt], w[kSaOutB], w[kSaOutPack]);
}

// cached_attention.CrossAttentionCache.attend, merged (one copy per sentence) path.
std::tuple<Tensor, Tensor> cross_attention(const Config& cfg, const Tensor* w, const Tensor& x,
                                           const Tensor& k, const Tensor& v, const Tensor& pad,
                                           int64_t beam, bool need_attn) {
  const int64_t n = x.size(0), c = x.size(1), h = cfg.heads, hd = cfg.head_dim;
  const int64_t bsz = n / beam, s = k.size(1);
  Tensor q = linear(x, w[kEaQWt], w[kEaQB], w[kEaQPack]);
  q.mul_(cfg.ea_scaling);
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
  out = linear(out.reshape({n, c}), w[kEaOutWt], w[kEaOutB], w[kEaOutPack]);
  Tensor attn;
  if (need_attn) {
    attn = p.view({bsz, h, beam, s}).transpose(0, 1).reshape({h, n, s}).mean(0);
  }
  return {out, attn};
}

// One decoder layer (TransformerDecoderLayerBase.forward, eval mode, incremental).
std::tuple<Tensor, Tensor> layer(const Config& cfg, const Tensor* w, Tensor x, Tensor& kbuf,
                                 Tensor& vbuf, int64_t t, const Tensor& anc, const Tensor* cross,
                                 int64_t beam, bool need_attn) {
  const bool nb = cfg.normalize_before;
  Tensor residual = x;
  if (nb) x = layer_norm(x, w[kLn1W], w[kLn1B], cfg.eps1);
  x = residual + self_attention(cfg, w, x, kbuf, vbuf, t, anc);
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
  x = linear(x, w[kFc1Wt], w[kFc1B], w[kFc1Pack]);
  if (cfg.activation == 0) {
    x.relu_();
  } else {
    x = at::gelu(x.to(at::kFloat)).to(residual.scalar_type());
  }
  x = residual + linear(x, w[kFc2Wt], w[kFc2B], w[kFc2Pack]);
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
                                       const std::optional<Tensor>& ancestors) {
  const std::vector<Tensor> weights = defined_or_not(weights_in);
  const std::vector<Tensor> cross = defined_or_not(cross_in);
  const int64_t layers = static_cast<int64_t>(caches.size() / 2);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeights, "weights per layer");
  TORCH_CHECK(static_cast<int64_t>(cross.size()) == layers * 3, "cross per layer");
  TORCH_CHECK(scalars.size() == static_cast<size_t>(layers * 5), "scalars per layer");
  TORCH_CHECK(ints.size() == 4, "heads, head_dim, normalize_before, activation");
  const Tensor anc = ancestors.has_value() ? *ancestors : Tensor();
  Tensor attn;
  for (int64_t i = 0; i < layers; ++i) {
    const double* sc = scalars.data() + i * 5;
    Config cfg{ints[0], ints[1], sc[0], sc[1], ints[2] != 0, ints[3], sc[2], sc[3], sc[4]};
    auto [y, a] = layer(cfg, weights.data() + i * kWeights, x, caches[2 * i], caches[2 * i + 1],
                        t, anc, cross.data() + 3 * i, beam, need_attn && i == layers - 1);
    x = y;
    if (a.defined()) attn = a;
  }
  return {x, attn};
}

}  // namespace

void register_beam_candidates(pybind11::module& m);  // beam_candidates.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_beam_candidates(m);
  m.def("layers_step", &layers_step, "fairseq_fastgen decoder layers, one incremental step");
  m.attr("WEIGHTS_PER_LAYER") = static_cast<int>(kWeights);
}
