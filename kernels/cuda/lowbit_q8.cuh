// The 8-bit-activation path (gemv.cu's QRaw: one task = one 32-value chunk, decoded into packed int8 levels q, a
// scale s and a min m, value = s * q - m) for the low-bit types whose chunks have one scale each: Q4_1, Q5_1 and
// MXFP4 (blocks of 32; activations in blocks of 32, as the CPU pairs them) and IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S (one
// scale per 32 values of a 256 super-block; activations in blocks of 256). The integer levels are the CPU
// decoders' (engine/src/quant/*.rs), so the integer dot products equal the CPU kernels'. Included by gemv.cu after
// its QRaw template; the grids are in iq_grids.cuh.
#pragma once

// The four bits of x (0..15) as the low bits of four bytes (bit k in byte k).
__device__ __forceinline__ unsigned int bits_to_bytes4_(unsigned int x) { return ((x & 15) * 0x00204081u) & 0x01010101u; }

// The four bytes of g (magnitudes below 128) negated where bit k of `signs` is set (two's complement per byte).
__device__ __forceinline__ int apply_signs4_(unsigned int g, unsigned int signs) {
    const unsigned int m = bits_to_bytes4_(signs) * 0xFFu;
    return (int)__vsub4(g ^ m, m);
}

// MXFP4 levels of four nibbles (one per byte of x, each 0..15): the doubled e2m1 values of `kvalues_mxfp4`, the
// magnitude looked up with one byte permute (8 entries: 0 1 2 3 4 6 8 12), bit 3 the sign.
__device__ __forceinline__ int mxfp4_levels4_(unsigned int x) {
    const unsigned int idx = x & 0x07070707u;
    const unsigned int y = idx | (idx >> 4);
    const unsigned int sel = (y & 0xFFu) | ((y >> 8) & 0xFF00u);
    const unsigned int mag = __byte_perm(0x03020100u, 0x0C080604u, sel);
    const unsigned int m = ((x >> 3) & 0x01010101u) * 0xFFu;
    return (int)__vsub4(mag ^ m, m);
}

// Q4_1: d and m (two f16 in the first word), 16 nibble bytes; value d * q + m, so s = d and the min is -m.
template <>
struct QRaw<T_Q4_1> {
    static constexpr int chunks = 1;
    unsigned int dm;
    unsigned int w[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const unsigned int* b = reinterpret_cast<const unsigned int*>(row + 20 * t);
        dm = __ldg(b);
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = __ldg(b + 1 + i);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        s[0] = half_bits_to_f32((unsigned short)(dm & 0xFFFF));
        m[0] = -half_bits_to_f32((unsigned short)(dm >> 16));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[0][i] = (int)(w[i] & 0x0F0F0F0Fu);
            q[0][i + 4] = (int)((w[i] >> 4) & 0x0F0F0F0Fu);
        }
    }
};

// Q5_1: d and m, the 32 high bits qh, 16 nibble bytes; level i = nibble | bit i of qh << 4.
template <>
struct QRaw<T_Q5_1> {
    static constexpr int chunks = 1;
    unsigned int dm, qh;
    unsigned int w[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const unsigned int* b = reinterpret_cast<const unsigned int*>(row + 24 * t);
        dm = __ldg(b);
        qh = __ldg(b + 1);
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = __ldg(b + 2 + i);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        s[0] = half_bits_to_f32((unsigned short)(dm & 0xFFFF));
        m[0] = -half_bits_to_f32((unsigned short)(dm >> 16));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[0][i] = (int)((w[i] & 0x0F0F0F0Fu) | (bits_to_bytes4_(qh >> (4 * i)) << 4));
            q[0][i + 4] = (int)(((w[i] >> 4) & 0x0F0F0F0Fu) | (bits_to_bytes4_(qh >> (16 + 4 * i)) << 4));
        }
    }
};

// MXFP4: the e8m0 exponent byte and 16 nibble bytes, 17-byte blocks (byte loads).
template <>
struct QRaw<T_MXFP4> {
    static constexpr int chunks = 1;
    unsigned int e;
    unsigned int w[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 17 * t;
        e = __ldg(b);
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = (unsigned int)__ldg(b + 1 + 4 * i) | ((unsigned int)__ldg(b + 2 + 4 * i) << 8) |
                   ((unsigned int)__ldg(b + 3 + 4 * i) << 16) | ((unsigned int)__ldg(b + 4 + 4 * i) << 24);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        s[0] = e8m0_half(e);
        m[0] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[0][i] = mxfp4_levels4_(w[i] & 0x0F0F0F0Fu);
            q[0][i + 4] = mxfp4_levels4_((w[i] >> 4) & 0x0F0F0F0Fu);
        }
    }
};

// IQ2_XXS chunk t: the super-block's f16 d and the chunk's two words (grid indices; sign indices and scale).
template <>
struct QRaw<T_IQ2_XXS> {
    static constexpr int chunks = 1;
    unsigned int d, a0, a1;
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 66 * (t >> 3);
        const int ib = t & 7;
        d = ld_u16(b);
        a0 = ld_u32(b + 2 + 8 * ib);
        a1 = ld_u32(b + 6 + 8 * ib);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        s[0] = __fmul_rn(__fmul_rn(half_bits_to_f32((unsigned short)d), __fadd_rn(0.5f, (float)(a1 >> 28))), 0.25f);
        m[0] = 0.f;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const unsigned long long g = __ldg(iq2xxs_grid + ((a0 >> (8 * l)) & 255));
            const unsigned int sg = __ldg(ksigns_iq2xs + ((a1 >> (7 * l)) & 127));
            q[0][2 * l] = apply_signs4_((unsigned int)g, sg);
            q[0][2 * l + 1] = apply_signs4_((unsigned int)(g >> 32), sg >> 4);
        }
    }
};

// IQ3_XXS chunk t: d, the chunk's 8 grid index bytes and its word of sign indices and scale.
template <>
struct QRaw<T_IQ3_XXS> {
    static constexpr int chunks = 1;
    unsigned int d, i0, i1, a;
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 98 * (t >> 3);
        const int ib = t & 7;
        d = ld_u16(b);
        i0 = ld_u32(b + 2 + 8 * ib);
        i1 = ld_u32(b + 6 + 8 * ib);
        a = ld_u32(b + 66 + 4 * ib);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        s[0] = __fmul_rn(__fmul_rn(half_bits_to_f32((unsigned short)d), __fadd_rn(0.5f, (float)(a >> 28))), 0.5f);
        m[0] = 0.f;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const unsigned int idx = l < 2 ? i0 : i1;
            const int sh = 16 * (l & 1);
            const unsigned int sg = __ldg(ksigns_iq2xs + ((a >> (7 * l)) & 127));
            q[0][2 * l] = apply_signs4_(__ldg(iq3xxs_grid + ((idx >> sh) & 255)), sg);
            q[0][2 * l + 1] = apply_signs4_(__ldg(iq3xxs_grid + ((idx >> (sh + 8)) & 255)), sg >> 4);
        }
    }
};

// IQ3_S chunk t: d, the chunk's 8 grid index bytes, its index-high byte, its 4 sign bytes and its scale nibble.
template <>
struct QRaw<T_IQ3_S> {
    static constexpr int chunks = 1;
    unsigned int d, i0, i1, signs, hs;  // hs: the index-high byte, then the scale nibble << 8
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 110 * (t >> 3);
        const int ib = t & 7;
        d = ld_u16(b);
        i0 = ld_u32(b + 2 + 8 * ib);
        i1 = ld_u32(b + 6 + 8 * ib);
        signs = ld_u32(b + 74 + 4 * ib);
        hs = (unsigned int)__ldg(b + 66 + ib) | ((((unsigned int)__ldg(b + 106 + ib / 2) >> (4 * (ib & 1))) & 15) << 8);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        s[0] = __fmul_rn(half_bits_to_f32((unsigned short)d), (float)(1 + 2 * (hs >> 8)));
        m[0] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const unsigned int idx = ((k < 4 ? i0 : i1) >> (8 * (k & 3))) & 255;
            const unsigned int g = __ldg(iq3s_grid + (idx | (((hs >> k) & 1) << 8)));
            q[0][k] = apply_signs4_(g, signs >> (4 * k));
        }
    }
};

// IQ1_S chunk t: d, the chunk's 4 grid index bytes and its 16-bit word (index highs, scale, delta sign); levels
// are the grid's -1, 0, 1 and the delta goes into the min: value = dl * q + dl * delta.
template <>
struct QRaw<T_IQ1_S> {
    static constexpr int chunks = 1;
    unsigned int d, idx, h;
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 50 * (t >> 3);
        const int ib = t & 7;
        d = ld_u16(b);
        idx = ld_u32(b + 2 + 4 * ib);
        h = ld_u16(b + 34 + 2 * ib);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        const float dl = __fmul_rn(half_bits_to_f32((unsigned short)d), (float)(2 * ((h >> 12) & 7) + 1));
        s[0] = dl;
        m[0] = -__fmul_rn(dl, (h & 0x8000) ? -0.125f : 0.125f);
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const unsigned long long g = __ldg(iq1s_grid + (((idx >> (8 * l)) & 255) | (((h >> (3 * l)) & 7) << 8)));
            q[0][2 * l] = (int)(unsigned int)g;
            q[0][2 * l + 1] = (int)(unsigned int)(g >> 32);
        }
    }
};
