// Quantized matrix-vector products (decode) and dequantization (prefill GEMM through cuBLAS).
//
// gemv: y[t][r] = sum_c W[r][c] x[t][c] for NT tokens at once, W in any supported block type, decoded in
// registers 32 values at a time (16-byte loads where the layout allows), f32 accumulation. A group of `lanes`
// threads (a power of two up to 128) owns one row and strides over its 32-value chunks; the group's partial sums
// meet through warp shuffles and, for groups wider
// than a warp, through shared memory in warp order, so each row is one fixed-order sum (deterministic, and the
// same whatever NT: a row's value does not depend on how many tokens share the launch).
#include "common.cuh"
#include "lowbit.cuh"

// Sums acc[t] over the `lanes` threads of each row group (lanes a power of two, at most 256, dividing blockDim.x,
// uniform over the block): a shuffle tree inside the warp, then for groups wider than a warp the warps' partial
// sums added in warp order. The group's first thread holds the totals; the other threads' values are unspecified.
// Every thread of the block must call it (it synchronises the block when lanes > 32), at most once per kernel.
template <int NT>
__device__ __forceinline__ void row_group_sum(float (&acc)[NT], int lanes) {
    if (lanes <= 32) {
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t], lanes);
        return;
    }
    __shared__ float part[8][NT];
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t], 32);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++) part[warp][t] = acc[t];
    }
    __syncthreads();
    if (threadIdx.x % lanes == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = 0.f;
            for (int w = 0; w < lanes / 32; w++) v += part[warp + w][t];
            acc[t] = v;
        }
    }
}

// The dot product of a chunk w (32 dequantized weights) with the 32 activations at x (16-byte aligned).
__device__ __forceinline__ float f32_chunk_dot(const float (&w)[32], const float* __restrict__ x) {
    const float4* xp = reinterpret_cast<const float4*>(x);
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float4 v = __ldg(xp + i);
        a += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
    }
    return a;
}

// acc[t] += chunk w times token t's 32 activations at x + t * x_stride + 32 * c.
template <int NT>
__device__ __forceinline__ void f32_chunk_accumulate(float (&acc)[NT], const float (&w)[32],
                                                     const float* __restrict__ x, long long x_stride, int c) {
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] += f32_chunk_dot(w, x + t * x_stride + 32 * c);
}

template <int T, int NT>
__device__ __forceinline__ void gemv_body(const uint8_t* __restrict__ W, long long row_bytes, int rows, int cols,
                                          const float* __restrict__ x, long long x_stride, float* __restrict__ y,
                                          long long y_stride, int lanes) {
    const int rows_per_block = blockDim.x / lanes;
    const int r = blockIdx.x * rows_per_block + threadIdx.x / lanes;
    const int lane = threadIdx.x % lanes;
    // No early return: the whole warp takes part in the shuffles below.
    const bool valid = r < rows;
    const uint8_t* row = W + (long long)(valid ? r : 0) * row_bytes;
    const int nchunks = valid ? cols / 32 : 0;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    float w[32];
    for (int c = lane; c < nchunks; c += lanes) {
        dequant_chunk<T>(row, c, w);
        f32_chunk_accumulate<NT>(acc, w, x, x_stride, c);
    }
    if constexpr (Block<T>::elems == 1) {
        for (int i = 32 * nchunks + lane; valid && i < cols; i += lanes) {
            const float wv = load_one<T>(row, i);
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] += wv * x[t * x_stride + i];
        }
    }
    row_group_sum<NT>(acc, lanes);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (lane == 0 && valid) y[t * y_stride + r] = acc[t];
    }
}

// Routed experts for decode: slot s multiplies expert ids[s] (matrices `expert_bytes` apart) with input
// x + (s / slots_per_x) * x_stride into y + s * rows. grid.y = slots. (Gate/up: slots_per_x = top-k so the k
// slots of a token share its input; down: slots_per_x = 1, each slot its own hidden vector.)
template <int T>
__device__ __forceinline__ void moe_gemv_body(const uint8_t* __restrict__ W, long long expert_bytes,
                                              long long row_bytes, int rows, int cols, const int* __restrict__ ids,
                                              const float* __restrict__ x, long long x_stride, int slots_per_x,
                                              float* __restrict__ y, int lanes) {
    const int s = blockIdx.y;
    const int e = ids[s];
    if (e < 0) return;  // a slot computed elsewhere (the CPU, in hybrid decode): its output is not read
    gemv_body<T, 1>(W + (long long)e * expert_bytes, row_bytes, rows, cols, x + (s / slots_per_x) * x_stride, 0,
                    y + (long long)s * rows, 0, lanes);
}

// One thread per 32-value chunk: W (rows x cols, row_bytes apart) to dense f32 or bf16.
template <int T, typename O>
__device__ __forceinline__ void dequant_body(const uint8_t* __restrict__ W, long long row_bytes, int rows, int cols,
                                             O* __restrict__ out) {
    const long long nchunks = (long long)rows * (cols / 32);
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nchunks) return;
    const int per_row = cols / 32;
    const int r = (int)(i / per_row), c = (int)(i % per_row);
    float w[32];
    dequant_chunk<T>(W + (long long)r * row_bytes, c, w);
    O* o = out + (long long)r * cols + 32 * c;
#pragma unroll
    for (int k = 0; k < 32; k++) {
        if constexpr (sizeof(O) == 4) o[k] = w[k];
        else o[k] = f32_to_bf16_bits(w[k]);
    }
}

#define GEMV(NAME, T)                                                                                          \
    extern "C" __global__ void gemv_##NAME##_1(const uint8_t* W, long long rb, int rows, int cols, const float* x, \
                                               long long xs, float* y, long long ys, int lanes) { pdl_entry(); \
        gemv_body<T, 1>(W, rb, rows, cols, x, xs, y, ys, lanes);                                             \
    }                                                                                                          \
    extern "C" __global__ void gemv_##NAME##_2(const uint8_t* W, long long rb, int rows, int cols, const float* x, \
                                               long long xs, float* y, long long ys, int lanes) { pdl_entry(); \
        gemv_body<T, 2>(W, rb, rows, cols, x, xs, y, ys, lanes);                                             \
    }                                                                                                          \
    extern "C" __global__ void gemv_##NAME##_4(const uint8_t* W, long long rb, int rows, int cols, const float* x, \
                                               long long xs, float* y, long long ys, int lanes) { pdl_entry(); \
        gemv_body<T, 4>(W, rb, rows, cols, x, xs, y, ys, lanes);                                             \
    }                                                                                                          \
    extern "C" __global__ void gemv_##NAME##_8(const uint8_t* W, long long rb, int rows, int cols, const float* x, \
                                               long long xs, float* y, long long ys, int lanes) { pdl_entry(); \
        gemv_body<T, 8>(W, rb, rows, cols, x, xs, y, ys, lanes);                                             \
    }                                                                                                          \
    extern "C" __global__ void moe_gemv_##NAME(const uint8_t* W, long long eb, long long rb, int rows, int cols,  \
                                               const int* ids, const float* x, long long xs, int spx, float* y, \
                                               int lanes) { pdl_entry();                          \
        moe_gemv_body<T>(W, eb, rb, rows, cols, ids, x, xs, spx, y, lanes);                                  \
    }                                                                                                          \
    extern "C" __global__ void dequant_f32_##NAME(const uint8_t* W, long long rb, int rows, int cols, float* out) { pdl_entry(); \
        dequant_body<T, float>(W, rb, rows, cols, out);                                                      \
    }                                                                                                          \
    extern "C" __global__ void dequant_bf16_##NAME(const uint8_t* W, long long rb, int rows, int cols,          \
                                                   unsigned short* out) { pdl_entry();            \
        dequant_body<T, unsigned short>(W, rb, rows, cols, out);                                             \
    }

GEMV(f32, T_F32)
GEMV(f16, T_F16)
GEMV(bf16, T_BF16)
GEMV(q4_0, T_Q4_0)
GEMV(q5_0, T_Q5_0)
GEMV(q8_0, T_Q8_0)
GEMV(iq4_nl, T_IQ4_NL)
GEMV(q4_k, T_Q4_K)
GEMV(q5_k, T_Q5_K)
GEMV(q6_k, T_Q6_K)
GEMV(iq4_xs, T_IQ4_XS)
GEMV(q4_1, T_Q4_1)
GEMV(q5_1, T_Q5_1)
GEMV(mxfp4, T_MXFP4)
GEMV(q2_k, T_Q2_K)
GEMV(q3_k, T_Q3_K)
GEMV(iq1_s, T_IQ1_S)
GEMV(iq1_m, T_IQ1_M)
GEMV(iq2_xxs, T_IQ2_XXS)
GEMV(iq2_xs, T_IQ2_XS)
GEMV(iq2_s, T_IQ2_S)
GEMV(iq3_xxs, T_IQ3_XXS)
GEMV(iq3_s, T_IQ3_S)

// out[t][copy*cols + i] = row ids[t] of W for copy in [0, copies): embedding and n-gram table lookups.
template <int T>
__device__ __forceinline__ void get_rows_body(const uint8_t* __restrict__ W, long long row_bytes, int cols,
                                              const int* __restrict__ ids, int n, float* out, long long out_stride,
                                              int copies) {
    const int per_row = cols / 32;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * per_row) return;
    const int t = i / per_row, c = i % per_row;
    float w[32];
    dequant_chunk<T>(W + (long long)ids[t] * row_bytes, c, w);
    for (int k = 0; k < copies; k++) {
        float* o = out + t * out_stride + (long long)k * cols + 32 * c;
#pragma unroll
        for (int j = 0; j < 32; j++) o[j] = w[j];
    }
}

#define GET_ROWS(NAME, T)                                                                                   \
    extern "C" __global__ void get_rows_##NAME(const uint8_t* W, long long rb, int cols, const int* ids, int n, \
                                               float* out, long long os, int copies) { pdl_entry();        \
        get_rows_body<T>(W, rb, cols, ids, n, out, os, copies);                                           \
    }
GET_ROWS(f32, T_F32)
GET_ROWS(f16, T_F16)
GET_ROWS(bf16, T_BF16)
GET_ROWS(q4_0, T_Q4_0)
GET_ROWS(q5_0, T_Q5_0)
GET_ROWS(q8_0, T_Q8_0)
GET_ROWS(iq4_nl, T_IQ4_NL)
GET_ROWS(q4_k, T_Q4_K)
GET_ROWS(q5_k, T_Q5_K)
GET_ROWS(q6_k, T_Q6_K)
GET_ROWS(iq4_xs, T_IQ4_XS)
GET_ROWS(q4_1, T_Q4_1)
GET_ROWS(q5_1, T_Q5_1)
GET_ROWS(mxfp4, T_MXFP4)
GET_ROWS(q2_k, T_Q2_K)
GET_ROWS(q3_k, T_Q3_K)
GET_ROWS(iq1_s, T_IQ1_S)
GET_ROWS(iq1_m, T_IQ1_M)
GET_ROWS(iq2_xxs, T_IQ2_XXS)
GET_ROWS(iq2_xs, T_IQ2_XS)
GET_ROWS(iq2_s, T_IQ2_S)
GET_ROWS(iq3_xxs, T_IQ3_XXS)
GET_ROWS(iq3_s, T_IQ3_S)

// Element paths for plain float rows of any width (n-gram tables and weights narrower than 32 or not a multiple).
template <int T>
__device__ __forceinline__ void get_rows_elem_body(const uint8_t* __restrict__ W, long long row_bytes, int cols,
                                                   const int* __restrict__ ids, int n, float* out,
                                                   long long out_stride, int copies) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * cols) return;
    const int t = i / cols, c = i % cols;
    const float v = load_one<T>(W + (long long)ids[t] * row_bytes, c);
    for (int k = 0; k < copies; k++) out[t * out_stride + (long long)k * cols + c] = v;
}

template <int T>
__device__ __forceinline__ void dequant_elem_body(const uint8_t* __restrict__ W, long long row_bytes, int rows,
                                                  int cols, float* out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    const int r = i / cols, c = i % cols;
    out[i] = load_one<T>(W + (long long)r * row_bytes, c);
}

#define ELEM(NAME, T)                                                                                            \
    extern "C" __global__ void get_rows_elem_##NAME(const uint8_t* W, long long rb, int cols, const int* ids, int n, \
                                                    float* out, long long os, int copies) { pdl_entry();        \
        get_rows_elem_body<T>(W, rb, cols, ids, n, out, os, copies);                                           \
    }                                                                                                            \
    extern "C" __global__ void dequant_elem_f32_##NAME(const uint8_t* W, long long rb, int rows, int cols, float* out) { pdl_entry(); \
        dequant_elem_body<T>(W, rb, rows, cols, out);                                                          \
    }
ELEM(f32, T_F32)
ELEM(f16, T_F16)
ELEM(bf16, T_BF16)

// Grouped expert products for prefill: block (row group, weight slot j = blockIdx.y) multiplies the rows of the
// matrix at W + j * expert_bytes, which holds expert e = slot_expert[j] (e = j when slot_expert is null; slots
// with e < 0 are skipped), with the inputs of every slot routed to e (perm[offsets[e] .. offsets[e+1]], from
// moe_sort), 8 slots per pass so each weight chunk is decoded once per 8 tokens. Slot s reads
// x + (s / x_div) * x_stride and writes y + s * rows. The map lets one launch cover the GPU-resident experts of
// a layer or one group of experts streamed over PCIe (hybrid prefill).
template <int T>
__device__ __forceinline__ void moe_grouped_body(const uint8_t* __restrict__ W, long long expert_bytes,
                                                 long long row_bytes, int rows, int cols,
                                                 const int* __restrict__ offsets, const int* __restrict__ perm,
                                                 const int* __restrict__ slot_expert, const float* __restrict__ x,
                                                 int x_div, long long x_stride, float* __restrict__ y, int lanes) {
    const int e = slot_expert ? slot_expert[blockIdx.y] : blockIdx.y;
    if (e < 0) return;
    const int start = offsets[e], end = offsets[e + 1];
    if (start == end) return;
    const int rows_per_block = blockDim.x / lanes;
    const int r = blockIdx.x * rows_per_block + threadIdx.x / lanes;
    const int lane = threadIdx.x % lanes;
    if (r >= rows) return;
    const uint8_t* row = W + (long long)blockIdx.y * expert_bytes + (long long)r * row_bytes;
    const int nchunks = cols / 32;
    float w[32];
    for (int base = start; base < end; base += 8) {
        const int nt = min(8, end - base);
        int slot[8];
        const float* xs[8];
        for (int t = 0; t < 8; t++) {
            slot[t] = t < nt ? perm[base + t] : perm[base];
            xs[t] = x + (long long)(slot[t] / x_div) * x_stride;
        }
        float acc[8];
#pragma unroll
        for (int t = 0; t < 8; t++) acc[t] = 0.f;
        for (int c = lane; c < nchunks; c += lanes) {
            dequant_chunk<T>(row, c, w);
#pragma unroll
            for (int t = 0; t < 8; t++) acc[t] += f32_chunk_dot(w, xs[t] + 32 * c);
        }
        if constexpr (Block<T>::elems == 1) {
            for (int i = 32 * nchunks + lane; i < cols; i += lanes) {
                const float wv = load_one<T>(row, i);
#pragma unroll
                for (int t = 0; t < 8; t++) acc[t] += wv * xs[t][i];
            }
        }
#pragma unroll
        for (int t = 0; t < 8; t++) {
            const float s = warp_sum(acc[t], lanes);
            if (lane == 0 && t < nt) y[(long long)slot[t] * rows + r] = s;
        }
    }
}

#define GROUPED(NAME, T)                                                                                          \
    extern "C" __global__ void moe_grouped_##NAME(const uint8_t* W, long long eb, long long rb, int rows, int cols,   \
                                                  const int* offsets, const int* perm, const int* se, const float* x, \
                                                  int x_div, long long xs, float* y, int lanes) { pdl_entry();       \
        moe_grouped_body<T>(W, eb, rb, rows, cols, offsets, perm, se, x, x_div, xs, y, lanes);                     \
    }
GROUPED(f32, T_F32)
GROUPED(f16, T_F16)
GROUPED(bf16, T_BF16)
GROUPED(q4_0, T_Q4_0)
GROUPED(q5_0, T_Q5_0)
GROUPED(q8_0, T_Q8_0)
GROUPED(iq4_nl, T_IQ4_NL)
GROUPED(q4_k, T_Q4_K)
GROUPED(q5_k, T_Q5_K)
GROUPED(q6_k, T_Q6_K)
GROUPED(iq4_xs, T_IQ4_XS)
GROUPED(q4_1, T_Q4_1)
GROUPED(q5_1, T_Q5_1)
GROUPED(mxfp4, T_MXFP4)
GROUPED(q2_k, T_Q2_K)
GROUPED(q3_k, T_Q3_K)
GROUPED(iq1_s, T_IQ1_S)
GROUPED(iq1_m, T_IQ1_M)
GROUPED(iq2_xxs, T_IQ2_XXS)
GROUPED(iq2_xs, T_IQ2_XS)
GROUPED(iq2_s, T_IQ2_S)
GROUPED(iq3_xxs, T_IQ3_XXS)
GROUPED(iq3_s, T_IQ3_S)

// ---------------------------------------------------------------------------------------------------------------
// Quantized-activation GEMV ("q8 path"), the way ggml pairs weights with activations (engine/src/quant/acts.rs):
// the activation vector is quantized once to 8 bits (per block of 32 values for the 32-value formats, per 256
// for Q4_K, each block's scale d = max|x| / 127 in f32, q = round-half-away(x / d)), and the weight chunks are
// multiplied as integers with dp4a. Each 32-value chunk contributes dx * (dw * sum(qw * qx) - mw * sum(qx)).
// The integer sums equal the CPU kernels' exactly; only the f32 accumulation order differs.

// x [n][cols] f32 -> qx [n][cols] int8 and dx [n][cols / 32] f32 (a 256-block's scale repeated over its 8 chunks).
// grid (cols / blk, n), blockDim = blk (32 or 256). A block with a NaN or an infinity gets d = NaN and q = 0.
extern "C" __global__ void quantize_act(const float* __restrict__ x, int cols, signed char* __restrict__ qx,
                                        float* __restrict__ dx) {
    pdl_entry();
    const long long i = (long long)blockIdx.y * cols + (long long)blockIdx.x * blockDim.x + threadIdx.x;
    quantize_thread(x[i], true, i, blockDim.x, qx, dx);
}

#include "qraw.cuh"

// The low-bit types, Q5_0, Q5_K and IQ4_XS, the types with a scale per 16 values, and the chunk dot products
// (q8_task_accumulate, q8_task_accumulate_sub16): lowbit_q8.cuh.
#include "lowbit_q8.cuh"

// The decoded task t of a row (QRaw's load, then decode).
template <int T, int C>
__device__ __forceinline__ void qtask_load(const uint8_t* row, int t, int (&q)[C][8], float (&s)[C], float (&m)[C],
                                           const uint16_t* pairs) {
    QRaw<T> r;
    r.load(row, t);
    r.decode(q, s, m, pairs);
}

// Whether type T's 8-bit decode reads the IQ4_NL byte-pair table (`pairs`, filled by iq4nl_pairs_).
__host__ __device__ constexpr bool uses_pairs(int t) { return t == T_IQ4_NL || t == T_IQ4_XS; }

// The most activations a GEMV prologue quantizes into shared memory (quantize_prologue): an expert's or the shared
// expert's hidden layer, a hyper-connection's low-rank activation.
#define PRO_MAX_COLS 2560

// What a decode GEMV's input is: 8-bit activations quantized by an earlier kernel (PRO_Q8: qx, dx in global
// memory), or an f32 row that the GEMV's own blocks turn into its activation and quantize into shared memory
// (PRO_ACT: ProIn), which saves the launch of the activation kernel before it.
#define PRO_Q8 0
#define PRO_ACT 1

// A prologue's input row: with x2, the SwiGLU hidden layer silu(x) * x2 (bit for bit the silu_mul kernel's
// value); without, the hyper-connection's low-rank activation silu(x * scale) (hc_acts' value), and then aux[s] =
// 2 sigmoid(x[cols + s] * scale) for s < aux_n (its injection weights, written by block 0 when aux is set).
struct ProIn {
    const float* x;
    const float* x2;
    float scale;
    int blk;
    float* aux;
    int aux_n;
};

// A GEMV prologue: the block computes one row of `cols` activations (ProIn) and quantizes it into sq (int8) and
// sd (one f32 scale per 32 values) exactly as quantize_thread does (blocks of blk = 32 or 256 values, d = max|v| /
// 127, q = round(v / d) clamped to +-127, a block with a NaN or an infinity: d = NaN, q = 0). A warp takes 256
// values at a time, 8 per lane. cols a multiple of blk and at most PRO_MAX_COLS; x, x2 16-byte aligned. Every
// thread of the block must call it; the block is synchronised on return.
__device__ __forceinline__ void quantize_prologue(const ProIn& in, int cols, signed char* sq, float* sd) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (in.aux && blockIdx.x == 0 && threadIdx.x < in.aux_n)
        in.aux[threadIdx.x] = 2.f * sigmoidf_(in.x[cols + threadIdx.x] * in.scale);
    for (int g0 = 256 * warp; g0 < cols; g0 += 256 * nw) {
        const int i = g0 + 8 * lane;
        const bool live = i < cols;
        float v[8];
        if (live) {
            const float4 a = *reinterpret_cast<const float4*>(in.x + i);
            const float4 b = *reinterpret_cast<const float4*>(in.x + i + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
            if (in.x2) {
                const float4 c = *reinterpret_cast<const float4*>(in.x2 + i);
                const float4 e = *reinterpret_cast<const float4*>(in.x2 + i + 4);
                const float u[8] = {c.x, c.y, c.z, c.w, e.x, e.y, e.z, e.w};
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = siluf_(v[j]) * u[j];
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = siluf_(v[j] * in.scale);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = 0.f;
        }
        float amax = 0.f;
        int bad = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            amax = fmaxf(amax, fabsf(v[j]));
            bad |= nonfinite_(v[j]);
        }
        // The quantization block: 4 lanes (32 values) or the whole warp (256).
        for (int o = 1; o < (in.blk == 256 ? 32 : 4); o <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            bad |= __shfl_xor_sync(0xffffffffu, bad, o);
        }
        const float d = amax / 127.0f;
        const float id = d > 0.f ? 1.0f / d : 0.f;
        unsigned int w[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float q = roundf(v[j] * id);
            q = fminf(fmaxf(q, -127.f), 127.f);
            const unsigned int b8 = bad ? 0u : (unsigned int)(unsigned char)(signed char)(int)q;
            w[j / 4] |= b8 << (8 * (j % 4));
        }
        if (live) {
            *reinterpret_cast<uint2*>(sq + i) = make_uint2(w[0], w[1]);
            if ((i & 31) == 0) sd[i / 32] = bad ? __int_as_float(0x7fc00000) : d;
        }
    }
    __syncthreads();
}

// Tasks whose raw weight bytes a decode-GEMV thread keeps in flight (QRaw): task i + 1's loads are issued before
// task i is decoded. (3 took more registers than 7 blocks of 128 threads per SM leave: the 800-block expert
// launches no longer fitted in one wave and ran slower, H200 ncu.)
#define GEMVQ_DEPTH 2
// The deeper prefetch of the one-token dense GEMVs gemvqd_* (no launch-size pressure there): with at most this many
// tasks per thread, a thread's weight loads are all issued before the first is used (one DRAM round trip).
#define GEMVQ_DEEP 4

// y[t][r] for NT tokens: a group of `lanes` threads per row, each taking tasks lane, lane + lanes, ... in that
// order (the f32 sums, hence the results, do not depend on the prefetch). With WAIT, the kernel's dependent-launch
// wait (pdl_wait) comes after the first tasks' weight loads: only for weights no kernel writes (dense matrices; a
// routed expert's address depends on the router, so those kernels wait first).
// With PRO_ACT (NT = 1), the block first computes and quantizes its input row (pro) into shared memory
// (quantize_prologue) and qx, dx are ignored.
// D: tasks in flight per thread (GEMVQ_DEPTH or GEMVQ_DEEP). For IQ4_NL, `pairs` (shared memory) is filled here
// after the first weight loads are issued (iq4nl_pairs_), so the table's constant loads and barrier overlap them.
template <int T, int NT, bool WAIT, int PRO = PRO_Q8, int D = GEMVQ_DEPTH>
__device__ __forceinline__ void gemvq_body(const uint8_t* __restrict__ W, long long row_bytes, int rows, int cols,
                                           const signed char* __restrict__ qx, const float* __restrict__ dx,
                                           long long x_stride, float* __restrict__ y, long long y_stride, int lanes,
                                           uint16_t* pairs, ProIn pro = {}) {
    static_assert(PRO == PRO_Q8 || NT == 1, "a prologue quantizes one input row");
    __shared__ __align__(16) signed char sq[PRO == PRO_Q8 ? 16 : PRO_MAX_COLS];
    __shared__ float sd[PRO == PRO_Q8 ? 1 : PRO_MAX_COLS / 32];
    constexpr int C = QRaw<T>::chunks;
    const int rows_per_block = blockDim.x / lanes;
    const int r = blockIdx.x * rows_per_block + threadIdx.x / lanes;
    const int lane = threadIdx.x % lanes;
    // No early return: the whole warp takes part in the shuffles below.
    const bool valid = r < rows;
    const uint8_t* row = W + (long long)(valid ? r : 0) * row_bytes;
    const int ntasks = valid ? cols / (32 * C) : 0;
    QRaw<T> raw[D];
#pragma unroll
    for (int k = 0; k < D; k++) {
        if (lane + k * lanes < ntasks) raw[k].load(row, lane + k * lanes);
    }
    if constexpr (uses_pairs(T)) iq4nl_pairs_(pairs);
    if constexpr (WAIT) pdl_wait();
    if constexpr (PRO != PRO_Q8) {
        quantize_prologue(pro, cols, sq, sd);
        qx = sq;
        dx = sd;
    }
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    for (int base = lane; base < ntasks; base += D * lanes) {
#pragma unroll
        for (int k = 0; k < D; k++) {
            const int task = base + k * lanes;
            if (task < ntasks) {
                int q[C][8];
                float s[C], m[C];
                if constexpr (Sub16<T>::value) {
                    int ks[C][2], ns[C][2];
                    raw[k].decode(q, s, m, pairs, ks, ns);
                    if (task + D * lanes < ntasks) raw[k].load(row, task + D * lanes);
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        q8_task_accumulate_sub16<T, C, PRO != PRO_Q8>(acc[t], q, s, m, ks, ns, qx + t * x_stride,
                                                                   dx + t * (x_stride / 32), task);
                    }
                } else {
                    raw[k].decode(q, s, m, pairs);
                    if (task + D * lanes < ntasks) raw[k].load(row, task + D * lanes);
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        q8_task_accumulate<C, PRO != PRO_Q8>(acc[t], q, s, m, qx + t * x_stride,
                                                             dx + t * (x_stride / 32), task);
                    }
                }
            }
        }
    }
    row_group_sum<NT>(acc, lanes);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (lane == 0 && valid) y[t * y_stride + r] = acc[t];
    }
}

// Slots of a routed-expert decode launch that multiply a dense matrix instead (the shared expert's gate and up):
// slot nr + v (v >= 0) is part v % parts (rows [part * rows, +rows)) of (w0, w1) for token v / parts. nr = the
// grid's slot count: none.
struct MoeShared {
    const uint8_t* w0;
    const uint8_t* w1;
    int nr;
    int parts;
};

// Routed experts, decode: slot s = blockIdx.y multiplies expert ids[s] with token s / slots_per_x's activations
// (slots from sh.nr on: the dense parts of MoeShared). blockIdx.z picks (W0, y0) or (W1, y1) so gate and up run in
// one launch. With PRO_ACT the slot's input row is pro's row xt (x and x2 advanced by xt * x_stride), computed and
// quantized by the block (gemvq_body).
// Tasks in flight per thread in the routed-expert GEMVs (7 blocks of 128 threads per SM leave 72 registers): one
// for the types whose raw task exceeds 64 bytes (Q3_K, Q5_K, Q6_K), which spilled with two (ptxas -v).
template <int T>
__host__ __device__ constexpr int moe_gemvq_depth() {
    return sizeof(QRaw<T>) > 64 ? 1 : GEMVQ_DEPTH;
}

template <int T, int PRO = PRO_Q8>
__device__ __forceinline__ void moe_gemvq_body(const uint8_t* W0, const uint8_t* W1, long long expert_bytes,
                                               long long row_bytes, int rows, int cols, const int* __restrict__ ids,
                                               const signed char* qx, const float* dx, long long x_stride,
                                               int slots_per_x, float* y0, float* y1, int lanes,
                                               uint16_t* pairs, ProIn pro = {},
                                               MoeShared sh = {nullptr, nullptr, 0x7fffffff, 1}) {
    const int s = blockIdx.y;
    const uint8_t* W;
    long long xt;
    if (s < sh.nr) {
        const long long e = ids[s];
        if (e < 0) return;  // a slot computed elsewhere (the CPU, in hybrid decode): its output is not read
        W = (blockIdx.z == 0 ? W0 : W1) + e * expert_bytes;
        xt = s / slots_per_x;
    } else {
        const int v = s - sh.nr;
        W = (blockIdx.z == 0 ? sh.w0 : sh.w1) + (long long)(v % sh.parts) * expert_bytes;
        xt = v / sh.parts;
    }
    float* y = blockIdx.z == 0 ? y0 : y1;
    if constexpr (PRO == PRO_Q8) {
        gemvq_body<T, 1, false, PRO_Q8, moe_gemvq_depth<T>()>(W, row_bytes, rows, cols, qx + xt * x_stride,
                                                              dx + xt * (x_stride / 32), 0,
                                                              y + (long long)s * rows, 0, lanes, pairs);
    } else {
        pro.x += xt * x_stride;
        if (pro.x2) pro.x2 += xt * x_stride;
        gemvq_body<T, 1, false, PRO, moe_gemvq_depth<T>()>(W, row_bytes, rows, cols, nullptr, nullptr, 0,
                                                           y + (long long)s * rows, 0, lanes, pairs, pro);
    }
}

#define GEMVQ(NAME, T)                                                                                            \
    extern "C" __global__ void gemvq_##NAME##_1(const uint8_t* W, long long rb, int rows, int cols,              \
                                                const signed char* qx, const float* dx, long long xs, float* y,  \
                                                long long ys, int lanes) { pdl_deferred();          \
        __shared__ uint16_t pairs[256];                                                                            \
        gemvq_body<T, 1, true>(W, rb, rows, cols, qx, dx, xs, y, ys, lanes, pairs);                               \
    }                                                                                                             \
    extern "C" __global__ void gemvq_##NAME##_2(const uint8_t* W, long long rb, int rows, int cols,              \
                                                const signed char* qx, const float* dx, long long xs, float* y,  \
                                                long long ys, int lanes) { pdl_deferred();          \
        __shared__ uint16_t pairs[256];                                                                            \
        gemvq_body<T, 2, true>(W, rb, rows, cols, qx, dx, xs, y, ys, lanes, pairs);                               \
    }                                                                                                             \
    extern "C" __global__ void gemvq_##NAME##_4(const uint8_t* W, long long rb, int rows, int cols,              \
                                                const signed char* qx, const float* dx, long long xs, float* y,  \
                                                long long ys, int lanes) { pdl_deferred();          \
        __shared__ uint16_t pairs[256];                                                                            \
        gemvq_body<T, 4, true>(W, rb, rows, cols, qx, dx, xs, y, ys, lanes, pairs);                               \
    }                                                                                                             \
    extern "C" __global__ void gemvq_##NAME##_8(const uint8_t* W, long long rb, int rows, int cols,              \
                                                const signed char* qx, const float* dx, long long xs, float* y,  \
                                                long long ys, int lanes) { pdl_deferred();          \
        __shared__ uint16_t pairs[256];                                                                            \
        gemvq_body<T, 8, true>(W, rb, rows, cols, qx, dx, xs, y, ys, lanes, pairs);                               \
    }                                                                                                             \
    extern "C" __global__ void gemvqd_##NAME(const uint8_t* W, long long rb, int rows, int cols,                \
                                             const signed char* qx, const float* dx, long long xs, float* y,     \
                                             long long ys, int lanes) { pdl_deferred();                          \
        __shared__ uint16_t pairs[256];                                                                            \
        gemvq_body<T, 1, true, PRO_Q8, GEMVQ_DEEP>(W, rb, rows, cols, qx, dx, xs, y, ys, lanes, pairs);           \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(128, 7) moe_gemvq_##NAME(const uint8_t* W0, const uint8_t* W1, long long eb, long long rb, \
                                                int rows, int cols, const int* ids, const signed char* qx,         \
                                                const float* dx, long long xs, int spx, float* y0, float* y1,      \
                                                int lanes, const uint8_t* S0, const uint8_t* S1, int nr,           \
                                                int parts) { pdl_entry();                                          \
        __shared__ uint16_t pairs[256];                                                                            \
        moe_gemvq_body<T>(W0, W1, eb, rb, rows, cols, ids, qx, dx, xs, spx, y0, y1, lanes, pairs, {},            \
                          MoeShared{S0, S1, nr, parts});                                                           \
    }

GEMVQ(q8_0, T_Q8_0)
GEMVQ(q4_0, T_Q4_0)
GEMVQ(iq4_nl, T_IQ4_NL)
GEMVQ(q4_k, T_Q4_K)
GEMVQ(q4_1, T_Q4_1)
GEMVQ(q5_1, T_Q5_1)
GEMVQ(mxfp4, T_MXFP4)
GEMVQ(iq2_xxs, T_IQ2_XXS)
GEMVQ(iq3_xxs, T_IQ3_XXS)
GEMVQ(iq3_s, T_IQ3_S)
GEMVQ(iq1_s, T_IQ1_S)
GEMVQ(q5_0, T_Q5_0)
GEMVQ(q5_k, T_Q5_K)
GEMVQ(iq4_xs, T_IQ4_XS)
GEMVQ(q2_k, T_Q2_K)
GEMVQ(q3_k, T_Q3_K)
GEMVQ(q6_k, T_Q6_K)
GEMVQ(iq2_xs, T_IQ2_XS)
GEMVQ(iq2_s, T_IQ2_S)
GEMVQ(iq1_m, T_IQ1_M)

// Decode GEMVs of one token whose blocks compute and quantize their own input (quantize_prologue: x2 set,
// silu(x) * x2; x2 null, silu(x * scale) and the injection weights into aux): gemvqp_* (dense) and moe_gemvqp_*
// (routed experts as moe_gemvq_*, slot s reading row s / spx of x and x2; x2 set). No SiLU kernel before a down
// projection, no hc_acts before a hyper-connection's up projection.
#define GEMVQP(NAME, T)                                                                                           \
    extern "C" __global__ void gemvqp_##NAME(const uint8_t* W, long long rb, int rows, int cols, const float* x,  \
                                             const float* x2, float scale, int blk, float* aux, int aux_n,       \
                                             float* y, int lanes) { pdl_deferred();                               \
        __shared__ uint16_t pairs[256];                                                                            \
        gemvq_body<T, 1, true, PRO_ACT>(W, rb, rows, cols, nullptr, nullptr, 0, y, 0, lanes, pairs,              \
                                        ProIn{x, x2, scale, blk, aux, aux_n});                                     \
    }                                                                                                             \
    extern "C" __global__ void moe_gemvqp_##NAME(const uint8_t* W0, const uint8_t* W1, long long eb, long long rb, \
                                                 int rows, int cols, const int* ids, const float* x,               \
                                                 const float* x2, int blk, long long xs, int spx, float* y0,        \
                                                 float* y1, int lanes) { pdl_entry();                              \
        __shared__ uint16_t pairs[256];                                                                            \
        moe_gemvq_body<T, PRO_ACT>(W0, W1, eb, rb, rows, cols, ids, nullptr, nullptr, xs, spx, y0, y1, lanes, pairs, \
                                   ProIn{x, x2, 1.f, blk, nullptr, 0});                                            \
    }

GEMVQP(q8_0, T_Q8_0)
GEMVQP(q4_0, T_Q4_0)
GEMVQP(iq4_nl, T_IQ4_NL)
GEMVQP(q4_k, T_Q4_K)
GEMVQP(q4_1, T_Q4_1)
GEMVQP(q5_1, T_Q5_1)
GEMVQP(mxfp4, T_MXFP4)
GEMVQP(iq2_xxs, T_IQ2_XXS)
GEMVQP(iq3_xxs, T_IQ3_XXS)
GEMVQP(iq3_s, T_IQ3_S)
GEMVQP(iq1_s, T_IQ1_S)
GEMVQP(q5_0, T_Q5_0)
GEMVQP(q5_k, T_Q5_K)
GEMVQP(iq4_xs, T_IQ4_XS)
GEMVQP(q2_k, T_Q2_K)
GEMVQP(q3_k, T_Q3_K)
GEMVQP(q6_k, T_Q6_K)
GEMVQP(iq2_xs, T_IQ2_XS)
GEMVQP(iq2_s, T_IQ2_S)
GEMVQP(iq1_m, T_IQ1_M)

// Routed experts, prefill, on 8-bit activations: as moe_grouped (blockIdx.y = expert e, its slots
// perm[offsets[e] .. offsets[e+1]] 8 at a time) with each weight task decoded once per 8 slots and multiplied by
// dp4a. Slot s reads activations (qx, dx) + (s / x_div) * x_stride and writes y + s * rows.
template <int T>
__device__ __forceinline__ void moe_groupedq_body(const uint8_t* __restrict__ W, long long expert_bytes,
                                                  long long row_bytes, int rows, int cols,
                                                  const int* __restrict__ offsets, const int* __restrict__ perm,
                                                  const int* __restrict__ slot_expert,
                                                  const signed char* __restrict__ qx, const float* __restrict__ dx,
                                                  int x_div, long long x_stride, float* __restrict__ y, int lanes,
                                                  const uint16_t* pairs) {
    constexpr int C = QRaw<T>::chunks;
    const int e = slot_expert ? slot_expert[blockIdx.y] : blockIdx.y;
    if (e < 0) return;  // uniform over the block
    const int start = offsets[e], end = offsets[e + 1];
    if (start == end) return;  // uniform over the block
    const int rows_per_block = blockDim.x / lanes;
    const int r = blockIdx.x * rows_per_block + threadIdx.x / lanes;
    const int lane = threadIdx.x % lanes;
    const bool valid = r < rows;
    const uint8_t* row = W + (long long)blockIdx.y * expert_bytes + (long long)(valid ? r : 0) * row_bytes;
    const int ntasks = valid ? cols / (32 * C) : 0;
    for (int base = start; base < end; base += 8) {
        const int nt = min(8, end - base);
        int slot[8];
        long long xo[8];
#pragma unroll
        for (int t = 0; t < 8; t++) {
            slot[t] = t < nt ? perm[base + t] : perm[base];
            xo[t] = (long long)(slot[t] / x_div) * x_stride;
        }
        float acc[8];
#pragma unroll
        for (int t = 0; t < 8; t++) acc[t] = 0.f;
        for (int task = lane; task < ntasks; task += lanes) {
            int q[C][8];
            float s[C], m[C];
            QRaw<T> r;
            r.load(row, task);
            if constexpr (Sub16<T>::value) {
                int ks[C][2], ns[C][2];
                r.decode(q, s, m, pairs, ks, ns);
#pragma unroll
                for (int t = 0; t < 8; t++) {
                    if (t >= nt) break;
                    q8_task_accumulate_sub16<T, C>(acc[t], q, s, m, ks, ns, qx + xo[t], dx + xo[t] / 32, task);
                }
            } else {
                r.decode(q, s, m, pairs);
#pragma unroll
                for (int t = 0; t < 8; t++) {
                    if (t >= nt) break;
                    q8_task_accumulate<C>(acc[t], q, s, m, qx + xo[t], dx + xo[t] / 32, task);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < 8; t++) {
            const float v = warp_sum(acc[t], lanes);
            if (lane == 0 && valid && t < nt) y[(long long)slot[t] * rows + r] = v;
        }
    }
}

#define GROUPEDQ(NAME, T)                                                                                         \
    extern "C" __global__ void moe_groupedq_##NAME(const uint8_t* W, long long eb, long long rb, int rows,        \
                                                   int cols, const int* offsets, const int* perm, const int* se,   \
                                                   const signed char* qx, const float* dx, int x_div, long long xs, \
                                                   float* y, int lanes) { pdl_entry();                \
        __shared__ uint16_t pairs[256];                                                                            \
        if (uses_pairs(T)) iq4nl_pairs_(pairs);                                                                    \
        moe_groupedq_body<T>(W, eb, rb, rows, cols, offsets, perm, se, qx, dx, x_div, xs, y, lanes, pairs);      \
    }

GROUPEDQ(q8_0, T_Q8_0)
GROUPEDQ(q4_0, T_Q4_0)
GROUPEDQ(iq4_nl, T_IQ4_NL)
GROUPEDQ(q4_k, T_Q4_K)
GROUPEDQ(q4_1, T_Q4_1)
GROUPEDQ(q5_1, T_Q5_1)
GROUPEDQ(mxfp4, T_MXFP4)
GROUPEDQ(iq2_xxs, T_IQ2_XXS)
GROUPEDQ(iq3_xxs, T_IQ3_XXS)
GROUPEDQ(iq3_s, T_IQ3_S)
GROUPEDQ(iq1_s, T_IQ1_S)
GROUPEDQ(q5_0, T_Q5_0)
GROUPEDQ(q5_k, T_Q5_K)
GROUPEDQ(iq4_xs, T_IQ4_XS)
GROUPEDQ(q2_k, T_Q2_K)
GROUPEDQ(q3_k, T_Q3_K)
GROUPEDQ(q6_k, T_Q6_K)
GROUPEDQ(iq2_xs, T_IQ2_XS)
GROUPEDQ(iq2_s, T_IQ2_S)
GROUPEDQ(iq1_m, T_IQ1_M)

// ---------------------------------------------------------------------------------------------------------------
// Routed experts, prefill, on tensor cores (sm_80+): the integer products of moe_groupedq (8-bit weights decoded
// by QRaw, 8-bit activations, 32-value chunks, each chunk's int32 dot scaled in f32 as dx * s * dot - m * dx *
// sum(qx)) computed with mma.sync.m16n8k32 (s8 x s8 -> s32). A block of 128 threads (4 warps) owns MMA_ROWS rows
// of one expert (blockIdx.y as in moe_grouped) and takes that expert's slots MMA_SLOTS at a time (tiles
// blockIdx.z, blockIdx.z + gridDim.z, ...); per MMA_K columns it decodes the weight tile and the slots'
// activation tile into shared memory, then each warp multiplies its 32 rows by the 32 slots (2 x 4 MMA tiles per
// chunk). The integer dots equal the dp4a kernel's exactly; the f32 sums run in chunk order per (row, slot).
// Requires cols % MMA_K == 0. With offsets null the launch is one dense matrix (blockIdx.y = 0) whose slots are
// 0 .. nslots - 1 (perm null: slot i is perm entry i): a prefill matmul y[n][rows] = x[n][cols] . W^T.
#define MMA_ROWS 128
#define MMA_SLOTS 32
#define MMA_K 128
#define MMA_LD 36  // 32-bit words per shared row: 32 of data + 4 of padding (conflict-free fragment loads)

// d = A (16 x 32 int8, row-major fragments) . B (32 x 8 int8, column-major fragments), int32 (PTX ISA,
// "Matrix Fragments for mma.m16n8k32").
__device__ __forceinline__ void mma_s8_16832(int (&d)[4], const int (&a)[4], const int (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
#else
    d[0] = d[1] = d[2] = d[3] = 0;
    __trap();
#endif
}

// d = A (16 x 16 int8) . B (16 x 8 int8), int32: each half of mma_s8_16832 (a0, a1 with b0: the first 16 of k; a2,
// a3 with b1: the second), for the types with a scale per 16 values (PTX ISA, "Matrix Fragments for
// mma.m16n8k16" with .s8).
__device__ __forceinline__ void mma_s8_16816(int (&d)[4], int a0, int a1, int b0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0));
#else
    d[0] = d[1] = d[2] = d[3] = 0;
    __trap();
#endif
}

// One thread's share of a weight tile: one row's MMA_K values (4 chunks) of a k-step, loaded raw (`load`, issued a
// step ahead so the loads overlap the previous step's MMAs) and decoded into packed int8 words, scales and mins
// (`decode`, value = s * q - m, as QRaw). Generic form: decoded at load time.
template <int T>
struct QStep {
    static constexpr int C = QRaw<T>::chunks;
    int q[4][8];
    float s[4], m[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int k0, const uint16_t* pairs) {
#pragma unroll
        for (int tk = 0; tk < 4 / C; tk++) {
            int qq[C][8];
            float ss[C], mm[C];
            qtask_load<T, C>(row, k0 / (32 * C) + tk, qq, ss, mm, pairs);
#pragma unroll
            for (int h = 0; h < C; h++) {
#pragma unroll
                for (int i = 0; i < 8; i++) q[tk * C + h][i] = qq[h][i];
                s[tk * C + h] = ss[h];
                m[tk * C + h] = mm[h];
            }
        }
    }
    __device__ __forceinline__ void decode(int (&qo)[4][8], float (&so)[4], float (&mo)[4], const uint16_t*) const {
#pragma unroll
        for (int c = 0; c < 4; c++) {
#pragma unroll
            for (int i = 0; i < 8; i++) qo[c][i] = q[c][i];
            so[c] = s[c];
            mo[c] = m[c];
        }
    }
};

// The four 32-value chunks' raw blocks (QRaw), decoded one after another: Q4_0 and IQ4_NL, and the types with a
// scale per 16 values whose chunks share no bytes (IQ2_XS, IQ2_S), with their run scales k and mins n.
template <int T>
struct QStepChunks {
    QRaw<T> c[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int k0, const uint16_t*) {
#pragma unroll
        for (int i = 0; i < 4; i++) c[i].load(row, k0 / 32 + i);
    }
    __device__ __forceinline__ void decode(int (&q)[4][8], float (&s)[4], float (&m)[4],
                                           const uint16_t* pairs) const {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int qq[1][8];
            float ss[1], mm[1];
            c[i].decode(qq, ss, mm, pairs);
            put(i, qq, ss, mm, q, s, m);
        }
    }
    __device__ __forceinline__ void decode(int (&q)[4][8], float (&s)[4], float (&m)[4], const uint16_t* pairs,
                                           int (&k)[4][2], int (&n)[4][2]) const {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int qq[1][8], kk[1][2], nn[1][2];
            float ss[1], mm[1];
            c[i].decode(qq, ss, mm, pairs, kk, nn);
            put(i, qq, ss, mm, q, s, m);
            k[i][0] = kk[0][0];
            k[i][1] = kk[0][1];
            n[i][0] = nn[0][0];
            n[i][1] = nn[0][1];
        }
    }
    __device__ __forceinline__ static void put(int i, const int (&qq)[1][8], const float (&ss)[1],
                                               const float (&mm)[1], int (&q)[4][8], float (&s)[4], float (&m)[4]) {
#pragma unroll
        for (int j = 0; j < 8; j++) q[i][j] = qq[0][j];
        s[i] = ss[0];
        m[i] = mm[0];
    }
};
template <>
struct QStep<T_Q4_0> : QStepChunks<T_Q4_0> {};
template <>
struct QStep<T_IQ4_NL> : QStepChunks<T_IQ4_NL> {};

// Q4_K: a k-step is half a super-block (sub-blocks 4h .. 4h + 3, h = (k0 / 128) % 2): the 16-byte header (d, dmin,
// the 12 packed scale bytes) and 64 quant bytes (low nibbles of 32 bytes: sub-block 2p, high: 2p + 1).
template <>
struct QStep<T_Q4_K> {
    Q4KHeader hdr;
    uint4 qv[4];
    int half;
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int k0, const uint16_t*) {
        const uint8_t* b = row + 144 * (k0 / 256);
        half = (k0 / 128) & 1;
        hdr.load(b);
        const uint4* qp = reinterpret_cast<const uint4*>(b + 16 + 64 * half);
#pragma unroll
        for (int i = 0; i < 4; i++) qv[i] = __ldg(qp + i);
    }
    template <int H>
    __device__ __forceinline__ void scales(float (&s)[4], float (&m)[4]) const {
        const float d = hdr.d(), dmin = hdr.dmin();
#pragma unroll
        for (int c = 0; c < 4; c++) hdr.scale_min(4 * H + c, d, dmin, s[c], m[c]);
    }
    __device__ __forceinline__ void decode(int (&q)[4][8], float (&s)[4], float (&m)[4], const uint16_t*) const {
        if (half == 0) scales<0>(s, m);
        else scales<1>(s, m);
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const unsigned int w[8] = {qv[2 * p].x, qv[2 * p].y, qv[2 * p].z, qv[2 * p].w,
                                       qv[2 * p + 1].x, qv[2 * p + 1].y, qv[2 * p + 1].z, qv[2 * p + 1].w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                q[2 * p][i] = (int)(w[i] & 0x0F0F0F0Fu);
                q[2 * p + 1][i] = (int)((w[i] >> 4) & 0x0F0F0F0Fu);
            }
        }
    }
};

// Q2_K: a k-step is half h of a super-block, whose four chunks share their 32 level bytes (bits 2c for chunk c) and
// take the scale/min bytes 8h .. 8h + 7.
template <>
struct QStep<T_Q2_K> {
    unsigned int dm, sc[2], w[8];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int k0, const uint16_t*) {
        const uint8_t* b = row + 84 * (k0 / 256);
        const int h = (k0 / 128) & 1;
        dm = ld_u32(b + 80);
        sc[0] = ld_u32(b + 8 * h);
        sc[1] = ld_u32(b + 8 * h + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = ld_u32(b + 16 + 32 * h + 4 * i);
    }
    __device__ __forceinline__ void decode(int (&q)[4][8], float (&s)[4], float (&m)[4], const uint16_t*,
                                           int (&k)[4][2], int (&n)[4][2]) const {
        const float d = half_bits_to_f32((unsigned short)(dm & 0xFFFF));
        const float dmin = half_bits_to_f32((unsigned short)(dm >> 16));
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const unsigned int b2 = (sc[c >> 1] >> (16 * (c & 1))) & 0xFFFF;
            s[c] = d;
            m[c] = dmin;
            k[c][0] = b2 & 15;
            n[c][0] = (b2 >> 4) & 15;
            k[c][1] = (b2 >> 8) & 15;
            n[c][1] = b2 >> 12;
#pragma unroll
            for (int i = 0; i < 8; i++) q[c][i] = (int)((w[i] >> (2 * c)) & 0x03030303u);
        }
    }
};

// Q3_K: half h of a super-block: its four chunks share 32 low-level bytes (bits 2c) and the 32 hmask bytes (bit
// 4h + c); the 12 scale bytes are kept raw.
template <>
struct QStep<T_Q3_K> {
    unsigned int d, h, sw[3], w[8], hm[8];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int k0, const uint16_t*) {
        const uint8_t* b = row + 110 * (k0 / 256);
        h = (k0 / 128) & 1;
        d = ld_u16(b + 108);
#pragma unroll
        for (int i = 0; i < 3; i++) sw[i] = ld_u32(b + 96 + 4 * i);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            w[i] = ld_u32(b + 32 + 32 * h + 4 * i);
            hm[i] = ld_u32(b + 4 * i);
        }
    }
    // Scale j (0..15), as q3k_scale from the raw words.
    __device__ __forceinline__ int scale(int j) const {
        const auto byte = [&](int x) { return (int)((sw[x >> 2] >> (8 * (x & 3))) & 255); };
        const int l = j < 8 ? (byte(j) & 15) : (byte(j - 8) >> 4);
        const int hb = (byte(8 + (j & 3)) >> (2 * (j >> 2))) & 3;
        return (l | (hb << 4)) - 32;
    }
    __device__ __forceinline__ void decode(int (&q)[4][8], float (&s)[4], float (&m)[4], const uint16_t*,
                                           int (&k)[4][2], int (&n)[4][2]) const {
        const float df = half_bits_to_f32((unsigned short)d);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int sub = 4 * h + c;
            s[c] = df;
            m[c] = 0.f;
            k[c][0] = scale(2 * sub);
            k[c][1] = scale(2 * sub + 1);
            n[c][0] = n[c][1] = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const unsigned int lv = ((w[i] >> (2 * c)) & 0x03030303u) | (((hm[i] >> sub) & 0x01010101u) << 2);
                q[c][i] = (int)__vsub4(lv, 0x04040404u);
            }
        }
    }
};

// Q6_K: half h of a super-block: chunk c takes nibble c / 2 of the 32 ql bytes at 64h + 32 (c % 2) and bits 2c of
// the 32 qh bytes at 128 + 32h; run scales the signed bytes 192 + 8h + 2c, + 1.
template <>
struct QStep<T_Q6_K> {
    unsigned int d, sc[2], lo[16], hi[8];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int k0, const uint16_t*) {
        const uint8_t* b = row + 210 * (k0 / 256);
        const int h = (k0 / 128) & 1;
        d = ld_u16(b + 208);
        sc[0] = ld_u32(b + 192 + 8 * h);
        sc[1] = ld_u32(b + 196 + 8 * h);
#pragma unroll
        for (int i = 0; i < 16; i++) lo[i] = ld_u32(b + 64 * h + 4 * i);
#pragma unroll
        for (int i = 0; i < 8; i++) hi[i] = ld_u32(b + 128 + 32 * h + 4 * i);
    }
    __device__ __forceinline__ void decode(int (&q)[4][8], float (&s)[4], float (&m)[4], const uint16_t*,
                                           int (&k)[4][2], int (&n)[4][2]) const {
        const float df = half_bits_to_f32((unsigned short)d);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const unsigned int b2 = (sc[c >> 1] >> (16 * (c & 1))) & 0xFFFF;
            s[c] = df;
            m[c] = 0.f;
            k[c][0] = (int)(signed char)(b2 & 0xFF);
            k[c][1] = (int)(signed char)(b2 >> 8);
            n[c][0] = n[c][1] = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const unsigned int lv =
                    ((lo[8 * (c & 1) + i] >> (4 * (c >> 1))) & 0x0F0F0F0Fu) | (((hi[i] >> (2 * c)) & 0x03030303u) << 4);
                q[c][i] = (int)__vsub4(lv, 0x20202020u);
            }
        }
    }
};

// IQ1_M: half h of a super-block (chunks ib = 4h + c): their 16 index bytes at 16h, their 8 nibble bytes at
// 32 + 8h and the four scale words.
template <>
struct QStep<T_IQ1_M> {
    unsigned int h, idx[4], qh[2], sw[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int k0, const uint16_t*) {
        const uint8_t* b = row + 56 * (k0 / 256);
        h = (k0 / 128) & 1;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            idx[i] = ld_u32(b + 16 * h + 4 * i);
            sw[i] = ld_u16(b + 48 + 2 * i);
        }
        qh[0] = ld_u32(b + 32 + 8 * h);
        qh[1] = ld_u32(b + 36 + 8 * h);
    }
    __device__ __forceinline__ void decode(int (&q)[4][8], float (&s)[4], float (&m)[4], const uint16_t*,
                                           int (&k)[4][2], int (&n)[4][2]) const {
        const unsigned short dbits =
            (unsigned short)((sw[0] >> 12) | ((sw[1] >> 8) & 0x00f0) | ((sw[2] >> 4) & 0x0f00) | (sw[3] & 0xf000));
        const float df = __fmul_rn(half_bits_to_f32(dbits), 0.125f);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int ib = 4 * h + c;
            const unsigned int w = sw[ib >> 1];
            const int j0 = (2 * ib) & 3;
            s[c] = df;
            m[c] = 0.f;
            k[c][0] = 2 * (int)((w >> (3 * j0)) & 7) + 1;
            k[c][1] = 2 * (int)((w >> (3 * (j0 + 1))) & 7) + 1;
            n[c][0] = n[c][1] = 0;
            const unsigned int nibs = (qh[c >> 1] >> (16 * (c & 1))) & 0xFFFF;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const unsigned int nib = (nibs >> (4 * e)) & 15;
                const unsigned long long g = __ldg(iq1s_grid + (((idx[c] >> (8 * e)) & 255) | ((nib & 7) << 8)));
                const unsigned int delta = (nib & 8) ? 0xFFFFFFFFu : 0x01010101u;
                q[c][2 * e] = (int)__vadd4(((unsigned int)g << 3) & 0xF8F8F8F8u, delta);
                q[c][2 * e + 1] = (int)__vadd4(((unsigned int)(g >> 32) << 3) & 0xF8F8F8F8u, delta);
            }
        }
    }
};
template <>
struct QStep<T_IQ2_XS> : QStepChunks<T_IQ2_XS> {};
template <>
struct QStep<T_IQ2_S> : QStepChunks<T_IQ2_S> {};

// With a scale per 16 values (Sub16) each chunk's product is two m16n8k16 MMAs whose integer dots are weighted by
// the row's run scales before the f32 step, and the min term takes the slot's integer sums per 16 (the dp4a
// kernel's integers).
template <int T>
__device__ __forceinline__ void moe_groupedmma_body(const uint8_t* __restrict__ W, long long expert_bytes,
                                                    long long row_bytes, int rows, int cols,
                                                    const int* __restrict__ offsets, const int* __restrict__ perm,
                                                    const int* __restrict__ slot_expert,
                                                    const signed char* __restrict__ qx,
                                                    const float* __restrict__ dx, int x_div, long long x_stride,
                                                    float* __restrict__ y, int nslots, const uint16_t* pairs) {
    constexpr int KC = MMA_K / 32;  // chunks per step
    static_assert(KC == 4, "QStep holds 4 chunks");
    __shared__ __align__(16) int ws[MMA_ROWS * MMA_LD];
    __shared__ float wsc[MMA_ROWS][KC], wmn[MMA_ROWS][KC];
    __shared__ __align__(16) int xs[MMA_SLOTS * MMA_LD];
    __shared__ float xd[MMA_SLOTS][KC], xds[MMA_SLOTS][KC];  // dx and dx * sum(qx) per slot and chunk
    __shared__ int slot_sh[MMA_SLOTS];
    constexpr bool SUB = Sub16<T>::value, MINS = Sub16<T>::mins;
    // Sub16: the rows' run scales and mins (k0 | k1 << 16 as int16 halves, and n likewise) and the slots' integer
    // activation sums per 16.
    __shared__ int wk[SUB ? MMA_ROWS : 1][KC], wnn[MINS ? MMA_ROWS : 1][KC];
    __shared__ int xsum[MINS ? MMA_SLOTS : 1][KC][2];
    const int e = slot_expert ? slot_expert[blockIdx.y] : blockIdx.y;
    if (e < 0) return;  // uniform over the block
    const int start = offsets ? offsets[e] : 0, end = offsets ? offsets[e + 1] : nslots;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
    const int r0 = blockIdx.x * MMA_ROWS;
    const bool lvalid = r0 + tid < rows;  // thread tid decodes row r0 + tid
    const uint8_t* lrow = W + (long long)blockIdx.y * expert_bytes + (long long)(lvalid ? r0 + tid : 0) * row_bytes;
    const int xsl = tid / KC, xc = tid % KC;  // the activation chunk this thread loads: 128 = MMA_SLOTS x KC
    for (int base = start + blockIdx.z * MMA_SLOTS; base < end; base += gridDim.z * MMA_SLOTS) {
        const int nt = min(MMA_SLOTS, end - base);
        if (tid < MMA_SLOTS) slot_sh[tid] = tid < nt ? (perm ? perm[base + tid] : base + tid) : -1;
        float acc[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[mt][j][i] = 0.f;
        __syncthreads();  // slot_sh written; the previous tile's reads of the shared tiles done
        const int xslot = slot_sh[xsl];
        const signed char* xrow = xslot >= 0 ? qx + (long long)(xslot / x_div) * x_stride + 32 * xc : nullptr;
        // Step k0's raw weights and activations, loaded one step ahead.
        QStep<T> wn;
        int4 an = make_int4(0, 0, 0, 0), bn = an;
        float dn = 0.f;
        auto load_step = [&](int k0) {
            if (lvalid) wn.load(lrow, k0, pairs);
            if (xrow) {
                const int4* xp = reinterpret_cast<const int4*>(xrow + k0);
                an = __ldg(xp);
                bn = __ldg(xp + 1);
                dn = __ldg(dx + ((xrow + k0) - qx) / 32);
            }
        };
        load_step(0);
        for (int k0 = 0; k0 < cols; k0 += MMA_K) {
            {
                int q[4][8];
                float s[4], m[4];
                int ks[4][2], ns[4][2];
                if (lvalid) {
                    if constexpr (SUB) wn.decode(q, s, m, pairs, ks, ns);
                    else wn.decode(q, s, m, pairs);
                } else {
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        s[c] = 0.f;
                        m[c] = 0.f;
                        ks[c][0] = ks[c][1] = ns[c][0] = ns[c][1] = 0;
#pragma unroll
                        for (int i = 0; i < 8; i++) q[c][i] = 0;
                    }
                }
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int4* dst = reinterpret_cast<int4*>(ws + tid * MMA_LD + 8 * c);
                    dst[0] = make_int4(q[c][0], q[c][1], q[c][2], q[c][3]);
                    dst[1] = make_int4(q[c][4], q[c][5], q[c][6], q[c][7]);
                    wsc[tid][c] = s[c];
                    wmn[tid][c] = m[c];
                    if constexpr (SUB) wk[tid][c] = (ks[c][0] & 0xFFFF) | (ks[c][1] << 16);
                    if constexpr (MINS) wnn[tid][c] = (ns[c][0] & 0xFFFF) | (ns[c][1] << 16);
                }
                int sum0 = 0, sum1 = 0;
                sum0 = dp4a_(0x01010101, an.x, sum0);
                sum0 = dp4a_(0x01010101, an.y, sum0);
                sum0 = dp4a_(0x01010101, an.z, sum0);
                sum0 = dp4a_(0x01010101, an.w, sum0);
                sum1 = dp4a_(0x01010101, bn.x, sum1);
                sum1 = dp4a_(0x01010101, bn.y, sum1);
                sum1 = dp4a_(0x01010101, bn.z, sum1);
                sum1 = dp4a_(0x01010101, bn.w, sum1);
                int4* xdst = reinterpret_cast<int4*>(xs + xsl * MMA_LD + 8 * xc);
                xdst[0] = an;
                xdst[1] = bn;
                xd[xsl][xc] = dn;
                xds[xsl][xc] = dn * (float)(sum0 + sum1);
                if constexpr (MINS) {
                    xsum[xsl][xc][0] = sum0;
                    xsum[xsl][xc][1] = sum1;
                }
            }
            __syncthreads();
            if (k0 + MMA_K < cols) load_step(k0 + MMA_K);  // in flight during this step's MMAs
#pragma unroll 1
            for (int c = 0; c < KC; c++) {
                int a[2][4];
                float sa[2][2], ma[2][2];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    const int ra = warp * 32 + mt * 16 + g;
                    a[mt][0] = ws[ra * MMA_LD + 8 * c + tig];
                    a[mt][1] = ws[(ra + 8) * MMA_LD + 8 * c + tig];
                    a[mt][2] = ws[ra * MMA_LD + 8 * c + 4 + tig];
                    a[mt][3] = ws[(ra + 8) * MMA_LD + 8 * c + 4 + tig];
                    sa[mt][0] = wsc[ra][c];
                    sa[mt][1] = wsc[ra + 8][c];
                    ma[mt][0] = wmn[ra][c];
                    ma[mt][1] = wmn[ra + 8][c];
                }
                if constexpr (SUB) {
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        const int ra = warp * 32 + mt * 16 + g;
                        int ka[2][2], na[2][2];  // [row g, g + 8][half]
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int kw = wk[ra + 8 * h][c];
                            ka[h][0] = (int)(short)(kw & 0xFFFF);
                            ka[h][1] = kw >> 16;
                            if constexpr (MINS) {
                                const int nw = wnn[ra + 8 * h][c];
                                na[h][0] = nw & 0xFFFF;
                                na[h][1] = nw >> 16;
                            }
                        }
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            const int b0 = xs[(j * 8 + g) * MMA_LD + 8 * c + tig];
                            const int b1 = xs[(j * 8 + g) * MMA_LD + 8 * c + 4 + tig];
                            const int t0 = j * 8 + 2 * tig;
                            const float dxv[2] = {xd[t0][c], xd[t0 + 1][c]};
                            int d0[4], d1[4];
                            mma_s8_16816(d0, a[mt][0], a[mt][1], b0);
                            mma_s8_16816(d1, a[mt][2], a[mt][3], b1);
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                const int h = i >> 1, t = i & 1;
                                const int idot = ka[h][0] * d0[i] + ka[h][1] * d1[i];
                                if constexpr (MINS) {
                                    const int isum = na[h][0] * xsum[t0 + t][c][0] + na[h][1] * xsum[t0 + t][c][1];
                                    acc[mt][j][i] += dxv[t] * (sa[mt][h] * (float)idot - ma[mt][h] * (float)isum);
                                } else {
                                    acc[mt][j][i] += dxv[t] * (sa[mt][h] * (float)idot);
                                }
                            }
                        }
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const int b[2] = {xs[(j * 8 + g) * MMA_LD + 8 * c + tig], xs[(j * 8 + g) * MMA_LD + 8 * c + 4 + tig]};
                        const int t0 = j * 8 + 2 * tig;
                        const float dxv[2] = {xd[t0][c], xd[t0 + 1][c]}, dsv[2] = {xds[t0][c], xds[t0 + 1][c]};
#pragma unroll
                        for (int mt = 0; mt < 2; mt++) {
                            int d[4];
                            mma_s8_16832(d, a[mt], b);
#pragma unroll
                            for (int i = 0; i < 4; i++)
                                acc[mt][j][i] += dxv[i & 1] * sa[mt][i >> 1] * (float)d[i] - ma[mt][i >> 1] * dsv[i & 1];
                        }
                    }
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int r = r0 + warp * 32 + mt * 16 + g + 8 * (i >> 1);
                    const int s = slot_sh[j * 8 + 2 * tig + (i & 1)];
                    if (r < rows && s >= 0) y[(long long)s * rows + r] = acc[mt][j][i];
                }
        __syncthreads();  // every thread has read slot_sh before the next tile overwrites it
    }
}

#define GROUPEDMMA(NAME, T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(128, 4) moe_groupedmma_##NAME(const uint8_t* W, long long eb, long long rb, int rows,     \
                                                     int cols, const int* offsets, const int* perm, const int* se, \
                                                     const signed char* qx, const float* dx, int x_div,           \
                                                     long long xs, float* y, int nslots) { pdl_entry();           \
        __shared__ uint16_t pairs[256];                                                                            \
        if (uses_pairs(T)) iq4nl_pairs_(pairs);                                                                    \
        moe_groupedmma_body<T>(W, eb, rb, rows, cols, offsets, perm, se, qx, dx, x_div, xs, y, nslots, pairs);   \
    }

GROUPEDMMA(q8_0, T_Q8_0)
GROUPEDMMA(q4_0, T_Q4_0)
GROUPEDMMA(iq4_nl, T_IQ4_NL)
GROUPEDMMA(q4_k, T_Q4_K)
GROUPEDMMA(q4_1, T_Q4_1)
GROUPEDMMA(q5_1, T_Q5_1)
GROUPEDMMA(mxfp4, T_MXFP4)
GROUPEDMMA(iq2_xxs, T_IQ2_XXS)
GROUPEDMMA(iq3_xxs, T_IQ3_XXS)
GROUPEDMMA(iq3_s, T_IQ3_S)
GROUPEDMMA(iq1_s, T_IQ1_S)
GROUPEDMMA(q5_0, T_Q5_0)
GROUPEDMMA(q5_k, T_Q5_K)
GROUPEDMMA(iq4_xs, T_IQ4_XS)
GROUPEDMMA(q2_k, T_Q2_K)
GROUPEDMMA(q3_k, T_Q3_K)
GROUPEDMMA(q6_k, T_Q6_K)
GROUPEDMMA(iq2_xs, T_IQ2_XS)
GROUPEDMMA(iq2_s, T_IQ2_S)
GROUPEDMMA(iq1_m, T_IQ1_M)
