// Shared device helpers: ggml block decoding in registers and warp reductions.
//
// Block layouts are ggml's (`ggml-common.h`), the same ones the CPU path decodes (engine/src/quant) and the PyPI
// `gguf` package documents. Every quantized row is decoded in chunks of 32 values: `dequant_chunk<T>(row, c, out)`
// writes values [32c, 32c + 32) of the row. For 32-blocks a chunk is one block; for 256-blocks (K-quants,
// IQ4_XS) a chunk is one sub-block.
#pragma once
// No headers: the same source compiles with nvcc and with NVRTC on machines that have only the driver and
// libnvrtc (no toolkit headers).
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Programmatic dependent launch (sm_90+; a no-op before): the first statement of every kernel. `wait` blocks until
// the previous kernel of the stream has completed and its writes are visible, so a kernel launched early (the host
// sets CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, engine/src/backend/cuda/ops.rs) reads nothing stale;
// and because every kernel waits before it can finish, the order stays transitive across the whole stream.
// `launch_dependents` then lets the next kernel's blocks be scheduled while this one runs, which hides the launch
// gap between the ~400 small kernels of a decode step (CUDA Programming Guide, "Programmatic Dependent Launch").
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The first statement of a kernel that loads immutable weights (never written by a kernel: dense matrices) before
// it waits: a no-op that marks the kernel for the pdl_entry check (nebula-kernels tests); the kernel's body calls
// pdl_wait() after those loads and before it reads any activation or writes anything, which overlaps the weights'
// first DRAM round trip with the previous kernel's tail.
__device__ __forceinline__ void pdl_deferred() {}

// pdl_entry's wait and launch, for a kernel that began with pdl_deferred().
__device__ __forceinline__ void pdl_wait() { pdl_entry(); }

// IEEE half bits to f32 (exact), through the PTX conversion instruction.
__device__ __forceinline__ float half_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 to bfloat16 bits, round to nearest even (NaN stays NaN).
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float x) {
    const unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 64);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// ggml type ids (ggml.h `enum ggml_type`).
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q5_0 6
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30

__device__ __forceinline__ float ld_f16(const uint8_t* p) { return half_bits_to_f32((unsigned short)(p[0] | (p[1] << 8))); }

__device__ __forceinline__ float bf16_bits_to_f32(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }

// IQ4_NL / IQ4_XS non-linear grid (ggml `kvalues_iq4nl`).
__constant__ signed char kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K / Q5_K packed 6-bit scale and min of sub-block j (ggml `get_scale_min_k4`).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <int T>
struct Block;
template <> struct Block<T_F32> { static constexpr int elems = 1, bytes = 4; };
template <> struct Block<T_F16> { static constexpr int elems = 1, bytes = 2; };
template <> struct Block<T_BF16> { static constexpr int elems = 1, bytes = 2; };
template <> struct Block<T_Q4_0> { static constexpr int elems = 32, bytes = 18; };
template <> struct Block<T_Q5_0> { static constexpr int elems = 32, bytes = 22; };
template <> struct Block<T_Q8_0> { static constexpr int elems = 32, bytes = 34; };
template <> struct Block<T_IQ4_NL> { static constexpr int elems = 32, bytes = 18; };
template <> struct Block<T_Q4_K> { static constexpr int elems = 256, bytes = 144; };
template <> struct Block<T_Q5_K> { static constexpr int elems = 256, bytes = 176; };
template <> struct Block<T_Q6_K> { static constexpr int elems = 256, bytes = 210; };
template <> struct Block<T_IQ4_XS> { static constexpr int elems = 256, bytes = 136; };

// Values [32c, 32c + 32) of a row into out[32].
template <int T>
__device__ __forceinline__ void dequant_chunk(const uint8_t* __restrict__ row, int c, float* out);

template <>
__device__ __forceinline__ void dequant_chunk<T_F32>(const uint8_t* __restrict__ row, int c, float* out) {
    const float4* p = reinterpret_cast<const float4*>(row) + 8 * c;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 v = __ldg(p + i);
        out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_F16>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint4* p = reinterpret_cast<const uint4*>(row) + 4 * c;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 v = __ldg(p + i);
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            out[8 * i + 2 * k] = half_bits_to_f32((unsigned short)(w[k] & 0xFFFF));
            out[8 * i + 2 * k + 1] = half_bits_to_f32((unsigned short)(w[k] >> 16));
        }
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_BF16>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint4* p = reinterpret_cast<const uint4*>(row) + 4 * c;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 v = __ldg(p + i);
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            out[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
            out[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        }
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_Q8_0>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 34 * c;
    const float d = ld_f16(b);
#pragma unroll
    for (int i = 0; i < 32; i++) out[i] = d * (float)(signed char)b[2 + i];
}

template <>
__device__ __forceinline__ void dequant_chunk<T_Q4_0>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 18 * c;
    const float d = ld_f16(b);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const uint8_t q = b[2 + j];
        out[j] = d * (float)((q & 0xF) - 8);
        out[j + 16] = d * (float)((q >> 4) - 8);
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_Q5_0>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 22 * c;
    const float d = ld_f16(b);
    const unsigned int qh = b[2] | (b[3] << 8) | (b[4] << 16) | ((unsigned int)b[5] << 24);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const uint8_t q = b[6 + j];
        const int h0 = ((qh >> j) << 4) & 0x10;
        const int h1 = (qh >> (j + 12)) & 0x10;
        out[j] = d * (float)(((q & 0xF) | h0) - 16);
        out[j + 16] = d * (float)(((q >> 4) | h1) - 16);
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_IQ4_NL>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 18 * c;
    const float d = ld_f16(b);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const uint8_t q = b[2 + j];
        out[j] = d * (float)kvalues_iq4nl[q & 0xF];
        out[j + 16] = d * (float)kvalues_iq4nl[q >> 4];
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_Q4_K>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 144 * (c >> 3);
    const int sub = c & 7;
    const float d = ld_f16(b), dmin = ld_f16(b + 2);
    int sc, m;
    scale_min_k4(sub, b + 4, sc, m);
    const float dl = d * sc, ml = dmin * m;
    const uint8_t* q = b + 16 + 32 * (sub >> 1);
    const int shift = 4 * (sub & 1);
#pragma unroll
    for (int l = 0; l < 32; l++) out[l] = dl * (float)((q[l] >> shift) & 0xF) - ml;
}

template <>
__device__ __forceinline__ void dequant_chunk<T_Q5_K>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 176 * (c >> 3);
    const int sub = c & 7;
    const float d = ld_f16(b), dmin = ld_f16(b + 2);
    int sc, m;
    scale_min_k4(sub, b + 4, sc, m);
    const float dl = d * sc, ml = dmin * m;
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48 + 32 * (sub >> 1);
    const int shift = 4 * (sub & 1);
    const uint8_t u = (uint8_t)(1 << sub);
#pragma unroll
    for (int l = 0; l < 32; l++) out[l] = dl * (float)(((q[l] >> shift) & 0xF) + ((qh[l] & u) ? 16 : 0)) - ml;
}

template <>
__device__ __forceinline__ void dequant_chunk<T_Q6_K>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 210 * (c >> 3);
    const int sub = c & 7;
    const int n = sub >> 2, g = sub & 3;
    const float d = ld_f16(b + 208);
    const uint8_t* ql = b + 64 * n + ((g & 1) ? 32 : 0);
    const uint8_t* qh = b + 128 + 32 * n;
    const signed char* sc = reinterpret_cast<const signed char*>(b + 192) + 8 * n + 2 * g;
    const int lshift = (g >> 1) ? 4 : 0;
    const int hshift = 2 * g;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        const int q = (((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        out[l] = d * (float)sc[l >> 4] * (float)q;
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_IQ4_XS>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 136 * (c >> 3);
    const int ib = c & 7;
    const float d = ld_f16(b);
    const int scales_h = b[2] | (b[3] << 8);
    const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4);
    const float dl = d * (float)(ls - 32);
    const uint8_t* q = b + 8 + 16 * ib;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        out[j] = dl * (float)kvalues_iq4nl[q[j] & 0xF];
        out[j + 16] = dl * (float)kvalues_iq4nl[q[j] >> 4];
    }
}

// One value of a plain float row (the element path for rows that are not a whole number of 32-value chunks).
template <int T>
__device__ __forceinline__ float load_one(const uint8_t* __restrict__ row, int i) {
    if constexpr (T == T_F32) return reinterpret_cast<const float*>(row)[i];
    else if constexpr (T == T_F16) return ld_f16(row + 2 * i);
    else return bf16_bits_to_f32(reinterpret_cast<const unsigned short*>(row)[i]);
}

__device__ __forceinline__ float warp_sum(float v, int width = 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < width) v += __shfl_xor_sync(0xffffffffu, v, o, width);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? part[lane] : 0.f;
    return warp_sum(t);
}

__device__ __forceinline__ bool nonfinite_(float v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u; }

// 8-bit activations the way ggml pairs weights with activations (engine/src/quant/acts.rs; see gemv.cu):
// consecutive threads in groups of `blk` (32 or 256) form a quantization block of v's, with scale
// d = max|v| / 127 and q = round-half-away(v / d) clamped to +-127; a block holding a NaN or an infinity gets
// d = NaN and q = 0. Thread i of the grid stores q at qx[i] when `store`, and each warp's first storing thread
// the block's scale at dx[i / 32] (a 256-block's scale is repeated over its 8 chunks). Threads past the data pass
// v = 0 and store = false. blockDim.x must be a multiple of blk and every thread of the block must call it
// (blk 256 synchronises the block); the grid's flat index must start each block of blk at a multiple of blk.
__device__ __forceinline__ void quantize_thread(float v, bool store, long long i, int blk, signed char* qx,
                                                float* dx) {
    float amax = warp_max(fabsf(v));
    bool bad = __any_sync(0xffffffffu, nonfinite_(v));
    if (blk == 256) {
        __shared__ float wmax[32];
        __shared__ int wbad[32];
        const int warp = threadIdx.x >> 5, first = warp & ~7;
        __syncthreads();
        if ((threadIdx.x & 31) == 0) {
            wmax[warp] = amax;
            wbad[warp] = bad;
        }
        __syncthreads();
        amax = 0.f;
        int b = 0;
        for (int w = first; w < first + 8; w++) {
            amax = fmaxf(amax, wmax[w]);
            b |= wbad[w];
        }
        bad = b != 0;
    }
    const float d = amax / 127.0f;
    const float id = d > 0.f ? 1.0f / d : 0.f;
    float q = roundf(v * id);
    q = fminf(fmaxf(q, -127.f), 127.f);
    if (store) {
        qx[i] = bad ? 0 : (signed char)(int)q;
        if ((i & 31) == 0) dx[i / 32] = bad ? __int_as_float(0x7fc00000) : d;
    }
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + expf(-x)); }
