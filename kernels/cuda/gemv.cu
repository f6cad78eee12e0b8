// Quantized matrix-vector products (decode) and dequantization (prefill GEMM through cuBLAS).
//
// gemv: y[t][r] = sum_c W[r][c] x[t][c] for NT tokens at once, W in any supported block type, decoded in
// registers 32 values at a time (16-byte loads where the layout allows), f32 accumulation. A group of `lanes`
// threads (16 or 32) owns one row and strides over its 32-value chunks; the group's partial sums meet through
// warp shuffles, so each row is one fixed-order sum (deterministic).
#include "common.cuh"

template <int T, int NT>
__device__ __forceinline__ void gemv_body(const uint8_t* __restrict__ W, long long row_bytes, int rows, int cols,
                                          const float* __restrict__ x, long long x_stride, float* __restrict__ y,
                                          long long y_stride, int lanes) {
    const int rows_per_block = blockDim.x / lanes;
    const int r = blockIdx.x * rows_per_block + threadIdx.x / lanes;
    const int lane = threadIdx.x % lanes;
    if (r >= rows) return;
    const uint8_t* row = W + (long long)r * row_bytes;
    const int nchunks = cols / 32;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    float w[32];
    for (int c = lane; c < nchunks; c += lanes) {
        dequant_chunk<T>(row, c, w);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float4* xp = reinterpret_cast<const float4*>(x + t * x_stride + 32 * c);
            float a = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float4 v = __ldg(xp + i);
                a += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
            }
            acc[t] += a;
        }
    }
    if constexpr (Block<T>::elems == 1) {
        for (int i = 32 * nchunks + lane; i < cols; i += lanes) {
            const float wv = load_one<T>(row, i);
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] += wv * x[t * x_stride + i];
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const float s = warp_sum(acc[t], lanes);
        if (lane == 0) y[t * y_stride + r] = s;
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
                                               long long xs, float* y, long long ys, int lanes) {             \
        gemv_body<T, 1>(W, rb, rows, cols, x, xs, y, ys, lanes);                                             \
    }                                                                                                          \
    extern "C" __global__ void gemv_##NAME##_2(const uint8_t* W, long long rb, int rows, int cols, const float* x, \
                                               long long xs, float* y, long long ys, int lanes) {             \
        gemv_body<T, 2>(W, rb, rows, cols, x, xs, y, ys, lanes);                                             \
    }                                                                                                          \
    extern "C" __global__ void gemv_##NAME##_4(const uint8_t* W, long long rb, int rows, int cols, const float* x, \
                                               long long xs, float* y, long long ys, int lanes) {             \
        gemv_body<T, 4>(W, rb, rows, cols, x, xs, y, ys, lanes);                                             \
    }                                                                                                          \
    extern "C" __global__ void gemv_##NAME##_8(const uint8_t* W, long long rb, int rows, int cols, const float* x, \
                                               long long xs, float* y, long long ys, int lanes) {             \
        gemv_body<T, 8>(W, rb, rows, cols, x, xs, y, ys, lanes);                                             \
    }                                                                                                          \
    extern "C" __global__ void moe_gemv_##NAME(const uint8_t* W, long long eb, long long rb, int rows, int cols,  \
                                               const int* ids, const float* x, long long xs, int spx, float* y, \
                                               int lanes) {                                                    \
        moe_gemv_body<T>(W, eb, rb, rows, cols, ids, x, xs, spx, y, lanes);                                  \
    }                                                                                                          \
    extern "C" __global__ void dequant_f32_##NAME(const uint8_t* W, long long rb, int rows, int cols, float* out) { \
        dequant_body<T, float>(W, rb, rows, cols, out);                                                      \
    }                                                                                                          \
    extern "C" __global__ void dequant_bf16_##NAME(const uint8_t* W, long long rb, int rows, int cols,          \
                                                   unsigned short* out) {                                      \
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
                                               float* out, long long os, int copies) {                     \
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
                                                    float* out, long long os, int copies) {                     \
        get_rows_elem_body<T>(W, rb, cols, ids, n, out, os, copies);                                           \
    }                                                                                                            \
    extern "C" __global__ void dequant_elem_f32_##NAME(const uint8_t* W, long long rb, int rows, int cols, float* out) { \
        dequant_elem_body<T>(W, rb, rows, cols, out);                                                          \
    }
ELEM(f32, T_F32)
ELEM(f16, T_F16)
ELEM(bf16, T_BF16)

// Grouped expert products for prefill: block (row group, expert e) multiplies expert e's rows with the inputs of
// every slot routed to it (perm[offsets[e] .. offsets[e+1]], from moe_sort), 8 slots per pass so each weight
// chunk is decoded once per 8 tokens. Slot s reads x + (s / x_div) * x_stride and writes y + s * rows.
template <int T>
__device__ __forceinline__ void moe_grouped_body(const uint8_t* __restrict__ W, long long expert_bytes,
                                                 long long row_bytes, int rows, int cols,
                                                 const int* __restrict__ offsets, const int* __restrict__ perm,
                                                 const float* __restrict__ x, int x_div, long long x_stride,
                                                 float* __restrict__ y, int lanes) {
    const int e = blockIdx.y;
    const int start = offsets[e], end = offsets[e + 1];
    if (start == end) return;
    const int rows_per_block = blockDim.x / lanes;
    const int r = blockIdx.x * rows_per_block + threadIdx.x / lanes;
    const int lane = threadIdx.x % lanes;
    if (r >= rows) return;
    const uint8_t* row = W + (long long)e * expert_bytes + (long long)r * row_bytes;
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
            for (int t = 0; t < 8; t++) {
                const float4* xp = reinterpret_cast<const float4*>(xs[t] + 32 * c);
                float a = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float4 v = __ldg(xp + i);
                    a += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
                }
                acc[t] += a;
            }
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
                                                  const int* offsets, const int* perm, const float* x, int x_div,    \
                                                  long long xs, float* y, int lanes) {                               \
        moe_grouped_body<T>(W, eb, rb, rows, cols, offsets, perm, x, x_div, xs, y, lanes);                         \
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
