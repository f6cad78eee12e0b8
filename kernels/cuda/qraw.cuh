// QRaw<T>: one task of a quantized weight row (a 32-value chunk, two for Q4_K) loaded raw and decoded into packed
// int8 levels, a scale and a min per chunk (value = s * q - m), the weight side of every 8-bit-activation kernel
// (the decode GEMVs, the grouped expert kernels of gemv.cu and gemv_grouped.cu). Q8_0, Q4_0, IQ4_NL and Q4_K here;
// the low-bit types in lowbit_q8.cuh, which the includer includes after this header.
#pragma once
#include "common.cuh"
#include "lowbit.cuh"


__device__ __forceinline__ int dp4a_(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// The 16 nibble bytes of an 18-byte block (2-byte aligned) as four words.
__device__ __forceinline__ void nibble_words_(const uint16_t* __restrict__ b, unsigned int (&w)[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (unsigned int)__ldg(b + 1 + 2 * i) | ((unsigned int)__ldg(b + 2 + 2 * i) << 16);
}

// One task of a weight row (the unit one thread multiplies at a time: one 32-value chunk, two for Q4_K), loaded raw
// (`load`: plain 16-, 4- or 2-byte loads, nothing decoded) so that several tasks' loads can be in flight before the
// first is decoded, then decoded (`decode`) into packed int8 (8 words = 32 values per chunk), a scale and a min per
// chunk (value = s * q - m). Q8_0: the f16 scale and the 32 int8 values of a block.
template <int T>
struct QRaw;
template <>
struct QRaw<T_Q8_0> {
    static constexpr int chunks = 1;
    unsigned short d;
    int w[8];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint16_t* b = reinterpret_cast<const uint16_t*>(row + 34 * t);
        d = __ldg(b);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = (int)__ldg(b + 1 + 2 * i) | ((int)__ldg(b + 2 + 2 * i) << 16);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        s[0] = half_bits_to_f32(d);
        m[0] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) q[0][i] = w[i];
    }
};

// Q4_0 / IQ4_NL: the f16 scale and the 16 nibble bytes of an 18-byte block (2-byte aligned); values nibble - 8
// (the -8 goes into the min), or for IQ4_NL the non-linear grid through the byte -> (grid[low], grid[high])
// table `pairs` in shared memory (iq4nl_pairs_).
template <int T>
struct QRawNibble32 {
    static constexpr int chunks = 1;
    unsigned short d;
    unsigned int w[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint16_t* b = reinterpret_cast<const uint16_t*>(row + 18 * t);
        d = __ldg(b);
        nibble_words_(b, w);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1],
                                           const uint16_t* __restrict__ pairs) const {
        s[0] = half_bits_to_f32(d);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if constexpr (T == T_IQ4_NL) {
                const unsigned int p0 = pairs[w[i] & 0xFF], p1 = pairs[(w[i] >> 8) & 0xFF];
                const unsigned int p2 = pairs[(w[i] >> 16) & 0xFF], p3 = pairs[w[i] >> 24];
                const unsigned int lo01 = p0 | (p1 << 16), lo23 = p2 | (p3 << 16);
                q[0][i] = (int)__byte_perm(lo01, lo23, 0x6420);
                q[0][i + 4] = (int)__byte_perm(lo01, lo23, 0x7531);
            } else {
                q[0][i] = (int)(w[i] & 0x0F0F0F0Fu);
                q[0][i + 4] = (int)((w[i] >> 4) & 0x0F0F0F0Fu);
            }
        }
        m[0] = T == T_IQ4_NL ? 0.f : 8.f * s[0];
    }
};
template <>
struct QRaw<T_Q4_0> : QRawNibble32<T_Q4_0> {};
template <>
struct QRaw<T_IQ4_NL> : QRawNibble32<T_IQ4_NL> {};

// A Q4_K super-block's 16-byte header (f16 d and dmin, then the 12 packed scale bytes) in registers, shared by the
// decode GEMVs (QRaw) and the tensor-core matmul (QStep). scale_min unpacks sub-block j's 6-bit scale and min as
// scale_min_k4 does: bytes j & 3 of the three scale words.
struct Q4KHeader {
    unsigned int w[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ b) {
        const uint4 h = __ldg(reinterpret_cast<const uint4*>(b));
        w[0] = h.x;
        w[1] = h.y;
        w[2] = h.z;
        w[3] = h.w;
    }
    __device__ __forceinline__ float d() const { return half_bits_to_f32((unsigned short)(w[0] & 0xFFFF)); }
    __device__ __forceinline__ float dmin() const { return half_bits_to_f32((unsigned short)(w[0] >> 16)); }
    // s = d * scale, m = dmin * min of sub-block j (d and dmin from d() and dmin(), converted once by the caller).
    __device__ __forceinline__ void scale_min(int j, float d, float dmin, float& s, float& m) const {
        const int sh = 8 * (j & 3);
        const int b1 = (int)((w[1] >> sh) & 0xFF), b2 = (int)((w[2] >> sh) & 0xFF), b3 = (int)((w[3] >> sh) & 0xFF);
        const int sc = j < 4 ? (b1 & 63) : ((b3 & 0xF) | ((b1 >> 6) << 4));
        const int mn = j < 4 ? (b2 & 63) : ((b3 >> 4) | ((b2 >> 6) << 4));
        s = d * (float)sc;
        m = dmin * (float)mn;
    }
};

// Q4_K: the super-block's 16-byte header (d, dmin, 12 packed scale bytes) and the task's 32 quant bytes (sub-blocks
// 2 * pair and 2 * pair + 1, pair = t % 4). decode unpacks the scales as scale_min_k4 does, from registers.
template <>
struct QRaw<T_Q4_K> {
    static constexpr int chunks = 2;
    Q4KHeader hdr;
    uint4 qa, qb;
    int pair;
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 144 * (t >> 2);
        pair = t & 3;
        hdr.load(b);
        const uint4* qp = reinterpret_cast<const uint4*>(b + 16 + 32 * pair);
        qa = __ldg(qp);
        qb = __ldg(qp + 1);
    }
    __device__ __forceinline__ void decode(int (&q)[2][8], float (&s)[2], float (&m)[2], const uint16_t*) const {
        const float d = hdr.d(), dmin = hdr.dmin();
#pragma unroll
        for (int h = 0; h < 2; h++) hdr.scale_min(2 * pair + h, d, dmin, s[h], m[h]);  // sub-blocks 2 pair, 2 pair + 1
        const unsigned int w[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            q[0][i] = (int)(w[i] & 0x0F0F0F0Fu);
            q[1][i] = (int)((w[i] >> 4) & 0x0F0F0F0Fu);
        }
    }
};

// Fills the IQ4_NL byte -> (grid[low], grid[high]) table (every thread of the block must call it).
__device__ __forceinline__ void iq4nl_pairs_(uint16_t* pairs) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x)
        pairs[i] = (uint16_t)((uint8_t)kvalues_iq4nl[i & 15] | ((uint16_t)(uint8_t)kvalues_iq4nl[i >> 4] << 8));
    __syncthreads();
}
