// The decoder layer stack of one incremental step, fairseq_fastgen's lossless-mode
// arithmetic (fairseq_fastgen/models/layers.py, fast_decoder.py, cached_attention.py)
// operation for operation, called from C++ instead of Python.
//
// Why: a step of the Python layers makes ~100 eager calls, each parsed and dispatched
// from Python. The same ATen calls with the same shapes, made here, give the same bits as
// the Python step (tests/test_native_step.py checks it) at less dispatch cost (figures:
// fairseq_fastgen/models/native_step.py). With an ancestor table the self-attention is
// this file's own kernel (ancestor_attention), and with cfg.fused the encoder-decoder
// attention is fused_cross_attention; both sum in another order.
//
// Layout of the per-layer inputs (see fairseq_fastgen/models/native_step.py):
//   weights: per layer kWeights tensors (undefined = absent), in the order of enum W;
//   caches:  per layer (k, v) self-attention buffers (capacity, n, C), step t written;
//   cross:   per layer (k, v, pad) encoder-decoder keys/values (bsz*H, S, hd) and
//            padding mask (bsz, S) (k undefined: the layer has no encoder attention).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
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
  bool fused;  // encoder-decoder attention by fused_cross_attention (fp32)
};

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

// Rows at one step t (lens undefined: this step's hypotheses are rows 0..n-1 of step t,
// anc[h, t] == h) or each at its own (lens[h] - 1, written to cache row phys[h]).
Tensor self_attention(const Config& cfg, const Tensor* w, const Tensor& x, Tensor& kbuf,
                      Tensor& vbuf, int64_t t, const Tensor& anc, const Tensor& lens,
                      const Tensor& phys) {
  const int64_t n = x.size(0), c = x.size(1);
  Tensor qkv = linear(x, w[kQkvWt], w[kQkvB], w[kQkvPack]);
  Tensor q = qkv.slice(1, 0, c).mul(cfg.sa_scaling);
  if (anc.defined()) {
    if (lens.defined()) {
      write_at_steps(kbuf, qkv, c, lens, phys);
      write_at_steps(vbuf, qkv, 2 * c, lens, phys);
    } else {
      kbuf.select(0, t).narrow(0, 0, n).copy_(qkv.slice(1, c, 2 * c));
      vbuf.select(0, t).narrow(0, 0, n).copy_(qkv.slice(1, 2 * c, 3 * c));
    }
    Tensor out = ancestor_attention(q, kbuf, vbuf, anc, t + 1, cfg.heads, lens);
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

// cached_attention.CrossAttentionCache.attend, merged (one copy per sentence) path; with
// cfg.fused (fp32) the kernel above instead of its reshapes and batched GEMMs.
std::tuple<Tensor, Tensor> cross_attention(const Config& cfg, const Tensor* w, const Tensor& x,
                                           const Tensor& k, const Tensor& v, const Tensor& pad,
                                           int64_t beam, bool need_attn) {
  const int64_t n = x.size(0), c = x.size(1), h = cfg.heads, hd = cfg.head_dim;
  const int64_t bsz = n / beam, s = k.size(1);
  Tensor q = linear(x, w[kEaQWt], w[kEaQB], w[kEaQPack]);
  q.mul_(cfg.ea_scaling);
  if (cfg.fused && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat) {
    auto [o, a] = fused_cross_attention(q, k, v, pad, beam, h, need_attn);
    return {linear(o, w[kEaOutWt], w[kEaOutB], w[kEaOutPack]), a};
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
  out = linear(out.reshape({n, c}), w[kEaOutWt], w[kEaOutB], w[kEaOutPack]);
  Tensor attn;
  if (need_attn) {
    attn = p.view({bsz, h, beam, s}).transpose(0, 1).reshape({h, n, s}).mean(0);
  }
  return {out, attn};
}

// One decoder layer (TransformerDecoderLayerBase.forward, eval mode, incremental).
struct Rows {  // where this step's rows read and write their self-attention keys/values
  int64_t t;   // the step (the largest one, with lens)
  Tensor anc;  // (n, >= t+1) int64 ancestor table, or undefined: caches in row order
  Tensor lens; // (n,) int64 each row's step + 1, or undefined: every row at step t
  Tensor phys; // (n,) int64 the cache row each row writes (with lens)
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
                                       const std::optional<Tensor>& ancestors,
                                       const std::optional<Tensor>& row_lens,
                                       const std::optional<Tensor>& row_phys) {
  const std::vector<Tensor> weights = defined_or_not(weights_in);
  const std::vector<Tensor> cross = defined_or_not(cross_in);
  const int64_t layers = static_cast<int64_t>(caches.size() / 2);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeights, "weights per layer");
  TORCH_CHECK(static_cast<int64_t>(cross.size()) == layers * 3, "cross per layer");
  TORCH_CHECK(scalars.size() == static_cast<size_t>(layers * 5), "scalars per layer");
  TORCH_CHECK(ints.size() == 5, "heads, head_dim, normalize_before, activation, fused");
  Rows rows{t, ancestors.has_value() ? *ancestors : Tensor(),
            row_lens.has_value() ? *row_lens : Tensor(), row_phys.has_value() ? *row_phys : Tensor()};
  if (rows.lens.defined()) {  // each row's own step reads the key/value it writes now
    TORCH_CHECK(rows.anc.defined() && rows.phys.defined() && rows.lens.is_contiguous() &&
                rows.phys.is_contiguous() && rows.lens.numel() == x.size(0) &&
                rows.phys.numel() == x.size(0) && rows.anc.size(0) == x.size(0) &&
                rows.anc.stride(1) == 1, "per-row steps: ancestors, lens and phys per row");
    int64_t* ap = rows.anc.data_ptr<int64_t>();
    const int64_t* lp = rows.lens.data_ptr<int64_t>();
    const int64_t* pp = rows.phys.data_ptr<int64_t>();
    for (int64_t r = 0; r < x.size(0); ++r) {
      TORCH_CHECK(lp[r] >= 1 && lp[r] <= t + 1 && lp[r] <= rows.anc.size(1), "row step out of range");
      ap[r * rows.anc.stride(0) + lp[r] - 1] = pp[r];
    }
  }
  Tensor attn;
  for (int64_t i = 0; i < layers; ++i) {
    const double* sc = scalars.data() + i * 5;
    Config cfg{ints[0], ints[1], sc[0], sc[1], ints[2] != 0, ints[3],
               sc[2], sc[3], sc[4], ints[4] != 0};
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
