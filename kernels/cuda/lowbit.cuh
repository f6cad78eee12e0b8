// Block decoding of the low-bit ggml types in registers: Q4_1, Q5_1, MXFP4 (32-value blocks), Q2_K, Q3_K (k-quant
// super-blocks of 256) and the i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (super-blocks of 256,
// grids in iq_grids.cuh). Layouts are ggml's (`ggml-common.h`), the same the CPU decodes (engine/src/quant/*.rs,
// whose module docs give each layout). `dequant_chunk<T>(row, c, out)` writes values [32c, 32c + 32) of a row, with
// the CPU decoder's f32 operations in its order and unfused (__fmul_rn, __fadd_rn), so each value is bit for bit
// the CPU's. These blocks are only 2-byte aligned (MXFP4: 1), so they are read with byte and 16-bit loads.
#pragma once
#include "common.cuh"
#include "iq_grids.cuh"

#define T_Q4_1 3
#define T_Q5_1 7
#define T_Q2_K 10
#define T_Q3_K 11
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18
#define T_IQ1_S 19
#define T_IQ3_S 21
#define T_IQ2_S 22
#define T_IQ1_M 29
#define T_MXFP4 39

template <> struct Block<T_Q4_1> { static constexpr int elems = 32, bytes = 20; };
template <> struct Block<T_Q5_1> { static constexpr int elems = 32, bytes = 24; };
template <> struct Block<T_MXFP4> { static constexpr int elems = 32, bytes = 17; };
template <> struct Block<T_Q2_K> { static constexpr int elems = 256, bytes = 84; };
template <> struct Block<T_Q3_K> { static constexpr int elems = 256, bytes = 110; };
template <> struct Block<T_IQ2_XXS> { static constexpr int elems = 256, bytes = 66; };
template <> struct Block<T_IQ2_XS> { static constexpr int elems = 256, bytes = 74; };
template <> struct Block<T_IQ2_S> { static constexpr int elems = 256, bytes = 82; };
template <> struct Block<T_IQ3_XXS> { static constexpr int elems = 256, bytes = 98; };
template <> struct Block<T_IQ3_S> { static constexpr int elems = 256, bytes = 110; };
template <> struct Block<T_IQ1_S> { static constexpr int elems = 256, bytes = 50; };
template <> struct Block<T_IQ1_M> { static constexpr int elems = 256, bytes = 56; };

// Little-endian 16- and 32-bit values at a 2-byte aligned address.
__device__ __forceinline__ unsigned int ld_u16(const uint8_t* p) { return __ldg(reinterpret_cast<const uint16_t*>(p)); }
__device__ __forceinline__ unsigned int ld_u32(const uint8_t* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

// MXFP4's e8m0 scale halved (the grid holds the e2m1 values doubled): 2^(e - 128) as f32, subnormal below e = 2
// (engine/src/quant/mxfp4.rs `e8m0_half`).
__device__ __forceinline__ float e8m0_half(unsigned int e) {
    return __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
}

// v or -v: the i-quants' sign bit (exact).
__device__ __forceinline__ float signed_(float v, unsigned int sign_bit) { return sign_bit ? -v : v; }

template <>
__device__ __forceinline__ void dequant_chunk<T_Q4_1>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 20 * c;
    const float d = ld_f16(b), m = ld_f16(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const uint8_t q = b[4 + j];
        out[j] = __fadd_rn(__fmul_rn(d, (float)(q & 0xF)), m);
        out[j + 16] = __fadd_rn(__fmul_rn(d, (float)(q >> 4)), m);
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_Q5_1>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 24 * c;
    const float d = ld_f16(b), m = ld_f16(b + 2);
    const unsigned int qh = ld_u32(b + 4);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const uint8_t q = b[8 + j];
        const int lo = (q & 0xF) | (((qh >> j) & 1) << 4);
        const int hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        out[j] = __fadd_rn(__fmul_rn(d, (float)lo), m);
        out[j + 16] = __fadd_rn(__fmul_rn(d, (float)hi), m);
    }
}

template <>
__device__ __forceinline__ void dequant_chunk<T_MXFP4>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 17 * c;
    const float d = e8m0_half(b[0]);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const uint8_t q = b[1 + j];
        out[j] = __fmul_rn(d, (float)kvalues_mxfp4[q & 0xF]);
        out[j + 16] = __fmul_rn(d, (float)kvalues_mxfp4[q >> 4]);
    }
}

// Q2_K chunk `sub` of a super-block: values 32 sub + l, l < 32: 2-bit level (bits 2 (sub % 4) of byte
// 16 + 32 (sub / 4) + l), scale/min byte 2 sub + l / 16 (scale low nibble, min high).
template <>
__device__ __forceinline__ void dequant_chunk<T_Q2_K>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 84 * (c >> 3);
    const int sub = c & 7;
    const float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
    const uint8_t* q = b + 16 + 32 * (sub >> 2);
    const int shift = 2 * (sub & 3);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int s = b[2 * sub + h];
        const float dl = __fmul_rn(d, (float)(s & 15)), ml = __fmul_rn(dmin, (float)(s >> 4));
#pragma unroll
        for (int l = 16 * h; l < 16 * h + 16; l++) out[l] = __fsub_rn(__fmul_rn(dl, (float)((q[l] >> shift) & 3)), ml);
    }
}

// Q3_K scale j (0..15) of a super-block: 6 bits, minus 32.
__device__ __forceinline__ int q3k_scale(const uint8_t* b, int j) {
    const uint8_t* s = b + 96;
    const int l = j < 8 ? (s[j] & 15) : (s[j - 8] >> 4);
    const int h = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (l | (h << 4)) - 32;
}

// Q3_K chunk `sub`: values 32 sub + l: low 2 bits as Q2_K's, high bit `sub` of hmask[l] (clear: level - 4).
template <>
__device__ __forceinline__ void dequant_chunk<T_Q3_K>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 110 * (c >> 3);
    const int sub = c & 7;
    const float d = ld_f16(b + 108);
    const uint8_t* q = b + 32 + 32 * (sub >> 2);
    const int shift = 2 * (sub & 3);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float dl = __fmul_rn(d, (float)q3k_scale(b, 2 * sub + h));
#pragma unroll
        for (int l = 16 * h; l < 16 * h + 16; l++) {
            const int lv = ((q[l] >> shift) & 3) - (((b[l] >> sub) & 1) ? 0 : 4);
            out[l] = __fmul_rn(dl, (float)lv);
        }
    }
}

// IQ2_XXS chunk ib: two 32-bit words at 2 + 8 ib: four grid indices (8 magnitudes each), then four 7-bit sign
// indices and the 4-bit scale on top.
template <>
__device__ __forceinline__ void dequant_chunk<T_IQ2_XXS>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 66 * (c >> 3);
    const int ib = c & 7;
    const float d = ld_f16(b);
    const unsigned int a0 = ld_u32(b + 2 + 8 * ib), a1 = ld_u32(b + 6 + 8 * ib);
    const float db = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)(a1 >> 28))), 0.25f);
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const unsigned long long g = __ldg(iq2xxs_grid + ((a0 >> (8 * l)) & 255));
        const unsigned int s = __ldg(ksigns_iq2xs + ((a1 >> (7 * l)) & 127));
#pragma unroll
        for (int j = 0; j < 8; j++) out[8 * l + j] = signed_(__fmul_rn(db, (float)((g >> (8 * j)) & 255)), (s >> j) & 1);
    }
}

// IQ2_XS chunk ib: four 16-bit entries at 2 + 8 ib (9-bit grid index, 7-bit sign index), scales: nibbles of
// byte 66 + ib (low: the first 16 values).
template <>
__device__ __forceinline__ void dequant_chunk<T_IQ2_XS>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 74 * (c >> 3);
    const int ib = c & 7;
    const float d = ld_f16(b);
    const int sc = b[66 + ib];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float db = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)((sc >> (4 * (e >> 1))) & 15))), 0.25f);
        const unsigned int q = ld_u16(b + 2 + 8 * ib + 2 * e);
        const unsigned long long g = __ldg(iq2xs_grid + (q & 511));
        const unsigned int s = __ldg(ksigns_iq2xs + (q >> 9));
#pragma unroll
        for (int j = 0; j < 8; j++) out[8 * e + j] = signed_(__fmul_rn(db, (float)((g >> (8 * j)) & 255)), (s >> j) & 1);
    }
}

// IQ2_S chunk ib: entries 4 ib + e: grid index qs[4 ib + e] | 2 bits of qh[ib], sign byte 34 + 4 ib + e,
// scales: nibbles of byte 74 + ib.
template <>
__device__ __forceinline__ void dequant_chunk<T_IQ2_S>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 82 * (c >> 3);
    const int ib = c & 7;
    const float d = ld_f16(b);
    const int sc = b[74 + ib], qh = b[66 + ib];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float db = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)((sc >> (4 * (e >> 1))) & 15))), 0.25f);
        const int idx = b[2 + 4 * ib + e] | (((qh >> (2 * e)) & 3) << 8);
        const unsigned long long g = __ldg(iq2s_grid + idx);
        const unsigned int s = b[34 + 4 * ib + e];
#pragma unroll
        for (int j = 0; j < 8; j++) out[8 * e + j] = signed_(__fmul_rn(db, (float)((g >> (8 * j)) & 255)), (s >> j) & 1);
    }
}

// IQ3_XXS chunk ib: 8 grid index bytes at 2 + 8 ib (4 magnitudes each), the 32-bit word at 66 + 4 ib: four 7-bit
// sign indices and the 4-bit scale on top.
template <>
__device__ __forceinline__ void dequant_chunk<T_IQ3_XXS>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 98 * (c >> 3);
    const int ib = c & 7;
    const float d = ld_f16(b);
    const unsigned int a = ld_u32(b + 66 + 4 * ib);
    const float db = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)(a >> 28))), 0.5f);
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const unsigned int s = __ldg(ksigns_iq2xs + ((a >> (7 * l)) & 127));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const unsigned int g = __ldg(iq3xxs_grid + b[2 + 8 * ib + 2 * l + h]);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k;
                out[8 * l + j] = signed_(__fmul_rn(db, (float)((g >> (8 * k)) & 255)), (s >> j) & 1);
            }
        }
    }
}

// IQ3_S chunk ib: entries 8 ib + k (4 values): grid index qs[8 ib + k] | bit k of qh[ib]; sign bits: bytes
// 74 + 4 ib ..; scale: nibble ib % 2 of byte 106 + ib / 2, value d * (1 + 2 s).
template <>
__device__ __forceinline__ void dequant_chunk<T_IQ3_S>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 110 * (c >> 3);
    const int ib = c & 7;
    const float d = ld_f16(b);
    const float db = __fmul_rn(d, (float)(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib & 1))) & 15)));
    const int qh = b[66 + ib];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const unsigned int g = __ldg(iq3s_grid + (b[2 + 8 * ib + k] | (((qh >> k) & 1) << 8)));
        const unsigned int s = b[74 + 4 * ib + k / 2] >> (4 * (k & 1));
#pragma unroll
        for (int j = 0; j < 4; j++) out[4 * k + j] = signed_(__fmul_rn(db, (float)((g >> (8 * j)) & 255)), (s >> j) & 1);
    }
}

// IQ1_S chunk ib: the 16-bit word at 34 + 2 ib: four 3-bit grid index highs, the 3-bit scale s (bits 12-14) and the
// delta's sign (bit 15); value d (2 s + 1) (grid + delta), grid values -1, 0, 1.
template <>
__device__ __forceinline__ void dequant_chunk<T_IQ1_S>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 50 * (c >> 3);
    const int ib = c & 7;
    const float d = ld_f16(b);
    const unsigned int h = ld_u16(b + 34 + 2 * ib);
    const float dl = __fmul_rn(d, (float)(2 * ((h >> 12) & 7) + 1));
    const float delta = (h & 0x8000) ? -0.125f : 0.125f;
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const unsigned long long g = __ldg(iq1s_grid + (b[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8)));
#pragma unroll
        for (int j = 0; j < 8; j++)
            out[8 * l + j] = __fmul_rn(dl, __fadd_rn((float)(signed char)((g >> (8 * j)) & 255), delta));
    }
}

// IQ1_M: the super-block's f16 scale spread over the top nibbles of the four 16-bit scale words at 48.
__device__ __forceinline__ float iq1m_d(const uint8_t* b) {
    const unsigned int s0 = ld_u16(b + 48), s1 = ld_u16(b + 50), s2 = ld_u16(b + 52), s3 = ld_u16(b + 54);
    return half_bits_to_f32((unsigned short)((s0 >> 12) | ((s1 >> 8) & 0x00f0) | ((s2 >> 4) & 0x0f00) | (s3 & 0xf000)));
}

// IQ1_M chunk ib: entries 4 ib + e: grid index qs[4 ib + e] | (nibble & 7) << 8 with the nibble e % 2 of byte
// 32 + 2 ib + e / 2 (bit 3: the delta's sign); 3-bit scales one per 16 values, bits 3 (j % 4) of scale word j / 4.
template <>
__device__ __forceinline__ void dequant_chunk<T_IQ1_M>(const uint8_t* __restrict__ row, int c, float* out) {
    const uint8_t* b = row + 56 * (c >> 3);
    const int ib = c & 7;
    const float d = iq1m_d(b);
    const unsigned int sw = ld_u16(b + 48 + 2 * (ib >> 1));
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int j = 2 * ib + (e >> 1);  // the 16-value scale index
        const float dl = __fmul_rn(d, (float)(2 * ((sw >> (3 * (j & 3))) & 7) + 1));
        const int nib = (b[32 + 2 * ib + (e >> 1)] >> (4 * (e & 1))) & 15;
        const float delta = (nib & 8) ? -0.125f : 0.125f;
        const unsigned long long g = __ldg(iq1s_grid + (b[4 * ib + e] | ((nib & 7) << 8)));
#pragma unroll
        for (int k = 0; k < 8; k++)
            out[8 * e + k] = __fmul_rn(dl, __fadd_rn((float)(signed char)((g >> (8 * k)) & 255), delta));
    }
}
