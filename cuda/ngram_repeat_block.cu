// Repeated n-gram blocking for fairseq-fastgen, compiled at first use by CuPy (NVRTC).
//
// Semantics (fairseq's ngram_repeat_block_cuda): at step `step`, for each row, every start
// position i in [0, step-n+2) whose n-1 tokens equal the row's last n-1 tokens
// (positions step-n+2 .. step) bans the token at i+n-1 by writing -inf to lprobs.
// One block per row; threads stride over start positions, so any step length works
// (fairseq's kernel launches one thread per position and fails past 1024).
// Duplicate bans write the same value: the result is deterministic.
// 16-bit lprobs are written as raw bit patterns, so no fp16/bf16 headers are needed.

#define NGRAM_KERNEL(NAME, T, NEG_INF)                                                    \
extern "C" __global__ void NAME(const long long* __restrict__ tokens,                     \
                                T* __restrict__ lprobs, const int step, const int n,      \
                                const long long tok_stride, const long long lp_stride,    \
                                const long long vocab) {                                  \
    const long long row = blockIdx.x;                                                     \
    const long long* t = tokens + row * tok_stride;                                       \
    const int starts = step - n + 2;                                                      \
    for (int i = threadIdx.x; i < starts; i += blockDim.x) {                              \
        bool match = true;                                                                \
        for (int k = 0; k < n - 1; ++k) {                                                 \
            if (t[i + k] != t[starts + k]) { match = false; break; }                      \
        }                                                                                 \
        if (match) {                                                                      \
            const long long tok = t[i + n - 1];                                           \
            if (tok >= 0 && tok < vocab) lprobs[row * lp_stride + tok] = NEG_INF;         \
        }                                                                                 \
    }                                                                                     \
}

NGRAM_KERNEL(ban_ngrams_f32, float, __int_as_float(0xff800000))
NGRAM_KERNEL(ban_ngrams_f16, unsigned short, (unsigned short)0xFC00)
NGRAM_KERNEL(ban_ngrams_bf16, unsigned short, (unsigned short)0xFF80)
