// The 8-bit-activation path (gemv.cu's QRaw: one task = one 32-value chunk, decoded into packed int8 levels q, a
// scale s and a min m, value = s * q - m) for every type the CPU reads beyond Q8_0, Q4_0, IQ4_NL and Q4_K: Q4_1,
// Q5_0, Q5_1 and MXFP4 (blocks of 32; activations in blocks of 32, as the CPU pairs them); IQ2_XXS, IQ3_XXS, IQ3_S,
// IQ1_S, IQ4_XS and Q5_K (one scale per 32 values of a 256 super-block; activations in blocks of 256); and Q2_K,
// Q3_K, Q6_K, IQ2_XS, IQ2_S and IQ1_M, with a scale per 16 values (Sub16, at the end). The integer levels are the
// CPU decoders' (engine/src/quant/*.rs), so the integer dot products equal the CPU kernels'. Included by gemv.cu
// after its QRaw template; the grids are in iq_grids.cuh.
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

// Q5_0: the f16 d, the 32 high bits qh and 16 nibble bytes (22-byte blocks, 2-byte aligned); level
// nibble | bit i of qh << 4 in 0..32, value d * (level - 16): the -16 goes into the min.
template <>
struct QRaw<T_Q5_0> {
    static constexpr int chunks = 1;
    unsigned int d, qh;
    unsigned int w[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 22 * t;
        d = ld_u16(b);
        qh = ld_u32(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = ld_u32(b + 6 + 4 * i);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*) const {
        s[0] = half_bits_to_f32((unsigned short)d);
        m[0] = 16.f * s[0];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[0][i] = (int)((w[i] & 0x0F0F0F0Fu) | (bits_to_bytes4_(qh >> (4 * i)) << 4));
            q[0][i + 4] = (int)(((w[i] >> 4) & 0x0F0F0F0Fu) | (bits_to_bytes4_(qh >> (16 + 4 * i)) << 4));
        }
    }
};

// Q5_K task t (64 values, as Q4_K's): the 16-byte header, the 32 high-bit bytes and the 32 quant bytes of
// sub-blocks 2 pair and 2 pair + 1 (pair = t % 4); level of sub-block j: its nibble | bit j of the high byte << 4.
template <>
struct QRaw<T_Q5_K> {
    static constexpr int chunks = 2;
    Q4KHeader hdr;
    uint4 ha, hb, qa, qb;
    int pair;
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 176 * (t >> 2);
        pair = t & 3;
        hdr.load(b);
        const uint4* hp = reinterpret_cast<const uint4*>(b + 16);
        ha = __ldg(hp);
        hb = __ldg(hp + 1);
        const uint4* qp = reinterpret_cast<const uint4*>(b + 48 + 32 * pair);
        qa = __ldg(qp);
        qb = __ldg(qp + 1);
    }
    __device__ __forceinline__ void decode(int (&q)[2][8], float (&s)[2], float (&m)[2], const uint16_t*) const {
        const float d = hdr.d(), dmin = hdr.dmin();
#pragma unroll
        for (int h = 0; h < 2; h++) hdr.scale_min(2 * pair + h, d, dmin, s[h], m[h]);
        const unsigned int w[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const unsigned int hi[8] = {ha.x, ha.y, ha.z, ha.w, hb.x, hb.y, hb.z, hb.w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const unsigned int h = hi[i] >> (2 * pair);
            q[0][i] = (int)((w[i] & 0x0F0F0F0Fu) | ((h & 0x01010101u) << 4));
            q[1][i] = (int)(((w[i] >> 4) & 0x0F0F0F0Fu) | (((h >> 1) & 0x01010101u) << 4));
        }
    }
};

// IQ4_XS chunk j of a super-block: d, the 6-bit run scale (low nibble j % 2 of byte 4 + j / 2, bits 2j of the
// u16 at 2 on top, minus 32) and the run's 16 index bytes at 8 + 16 j (low nibbles: the first 16 values) through
// the IQ4_NL byte-pair table; value d * (ls - 32) * kvalues[idx].
template <>
struct QRaw<T_IQ4_XS> {
    static constexpr int chunks = 1;
    unsigned int d, ls;
    unsigned int w[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 136 * (t >> 3);
        const int j = t & 7;
        d = ld_u16(b);
        ls = ((ld_u16(b + 4 + 2 * (j >> 2)) >> (4 * (j & 3))) & 15) | (((ld_u16(b + 2) >> (2 * j)) & 3) << 4);
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = ld_u32(b + 8 + 16 * j + 4 * i);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1],
                                           const uint16_t* __restrict__ pairs) const {
        s[0] = half_bits_to_f32((unsigned short)d) * (float)((int)ls - 32);
        m[0] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const unsigned int p0 = pairs[w[i] & 0xFF], p1 = pairs[(w[i] >> 8) & 0xFF];
            const unsigned int p2 = pairs[(w[i] >> 16) & 0xFF], p3 = pairs[w[i] >> 24];
            const unsigned int lo01 = p0 | (p1 << 16), lo23 = p2 | (p3 << 16);
            q[0][i] = (int)__byte_perm(lo01, lo23, 0x6420);
            q[0][i + 4] = (int)__byte_perm(lo01, lo23, 0x7531);
        }
    }
};

// ---------------------------------------------------------------------------------------------------------------
// The types with a scale per 16 values (Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M): a 32-value chunk decodes, besides
// its int8 levels q, f32 scale s and min m, two integer run scales k and two integer run mins n, one per 16 values,
// and its dot with 8-bit activations x is s * (k0 q.x[0,16) + k1 q.x[16,32)) - m * (n0 sum x[0,16) + n1 sum
// x[16,32)): the CPU kernels' exact integer sums (engine/src/quant/unpacked.rs: isum = sum_j scale_j * run dot),
// scaled in f32 per chunk instead of per super-block. `Sub16<T>::value` marks them; their QRaw has
// decode(q, s, m, pairs, k, n).
template <int T>
struct Sub16 {
    static constexpr bool value = false;
    static constexpr bool mins = false;  // whether n can be nonzero (Q2_K alone)
};

// Q2_K chunk sub of a super-block (84 bytes: 16 scale/min bytes, 64 level bytes, f16 d and dmin): levels bits
// 2 (sub % 4) of bytes 16 + 32 (sub / 4) ..; run scales the low nibbles of bytes 2 sub, 2 sub + 1, run mins their
// high nibbles; value d * k * q - dmin * n.
template <>
struct Sub16<T_Q2_K> {
    static constexpr bool value = true;
    static constexpr bool mins = true;
};
template <>
struct QRaw<T_Q2_K> {
    static constexpr int chunks = 1;
    unsigned int dm, sc, sub;
    unsigned int w[8];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 84 * (t >> 3);
        sub = t & 7;
        dm = ld_u32(b + 80);
        sc = ld_u16(b + 2 * sub);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = ld_u32(b + 16 + 32 * (sub >> 2) + 4 * i);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*,
                                           int (&k)[1][2], int (&n)[1][2]) const {
        s[0] = half_bits_to_f32((unsigned short)(dm & 0xFFFF));
        m[0] = half_bits_to_f32((unsigned short)(dm >> 16));
        k[0][0] = sc & 15;
        n[0][0] = (sc >> 4) & 15;
        k[0][1] = (sc >> 8) & 15;
        n[0][1] = sc >> 12;
        const int shift = 2 * (sub & 3);
#pragma unroll
        for (int i = 0; i < 8; i++) q[0][i] = (int)((w[i] >> shift) & 0x03030303u);
    }
};

// Q3_K chunk sub (110 bytes: 32 hmask bytes, 64 low-level bytes, 12 scale bytes, f16 d): low 2 bits as Q2_K's
// (at 32), high bit sub of hmask[l] (clear: level - 4), levels -4..3; run scales q3k_scale(2 sub), (2 sub + 1),
// signed; value d * k * q.
template <>
struct Sub16<T_Q3_K> {
    static constexpr bool value = true;
    static constexpr bool mins = false;
};
template <>
struct QRaw<T_Q3_K> {
    static constexpr int chunks = 1;
    unsigned int d, sub;
    int k0, k1;
    unsigned int w[8], hm[8];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 110 * (t >> 3);
        sub = t & 7;
        d = ld_u16(b + 108);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            w[i] = ld_u32(b + 32 + 32 * (sub >> 2) + 4 * i);
            hm[i] = ld_u32(b + 4 * i);
        }
        k0 = q3k_scale(b, 2 * sub);
        k1 = q3k_scale(b, 2 * sub + 1);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*,
                                           int (&k)[1][2], int (&n)[1][2]) const {
        s[0] = half_bits_to_f32((unsigned short)d);
        m[0] = 0.f;
        k[0][0] = k0;
        k[0][1] = k1;
        n[0][0] = n[0][1] = 0;
        const int shift = 2 * (sub & 3);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const unsigned int lv = ((w[i] >> shift) & 0x03030303u) | (((hm[i] >> sub) & 0x01010101u) << 2);
            q[0][i] = (int)__vsub4(lv, 0x04040404u);
        }
    }
};

// Q6_K chunk sub (210 bytes: 128 low-nibble bytes ql, 64 high-bit bytes qh, 16 signed scale bytes, f16 d): with
// h = sub / 4, c = sub % 4, nibble c / 2 of ql[64 h + 32 (c % 2) + l] and bits 2c of qh[32 h + l], level
// (low | high << 4) - 32; run scales the signed bytes 192 + 2 sub, + 1; value d * k * q.
template <>
struct Sub16<T_Q6_K> {
    static constexpr bool value = true;
    static constexpr bool mins = false;
};
template <>
struct QRaw<T_Q6_K> {
    static constexpr int chunks = 1;
    unsigned int d, sc, sub;
    unsigned int lo[8], hi[8];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 210 * (t >> 3);
        sub = t & 7;
        const int h = sub >> 2, c = sub & 3;
        d = ld_u16(b + 208);
        sc = ld_u16(b + 192 + 2 * sub);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            lo[i] = ld_u32(b + 64 * h + 32 * (c & 1) + 4 * i);
            hi[i] = ld_u32(b + 128 + 32 * h + 4 * i);
        }
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*,
                                           int (&k)[1][2], int (&n)[1][2]) const {
        s[0] = half_bits_to_f32((unsigned short)d);
        m[0] = 0.f;
        k[0][0] = (int)(signed char)(sc & 0xFF);
        k[0][1] = (int)(signed char)(sc >> 8);
        n[0][0] = n[0][1] = 0;
        const int c = sub & 3;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const unsigned int lv = ((lo[i] >> (4 * (c >> 1))) & 0x0F0F0F0Fu) | (((hi[i] >> (2 * c)) & 0x03030303u) << 4);
            q[0][i] = (int)__vsub4(lv, 0x20202020u);
        }
    }
};

// IQ2_XS chunk ib (74 bytes: f16 d, 32 u16 entries, 8 scale bytes): four u16 entries at 2 + 8 ib (9-bit grid
// index, 7-bit sign index), run scales 2 nibble + 1 of byte 66 + ib; value d / 8 * k * grid * sign.
template <>
struct Sub16<T_IQ2_XS> {
    static constexpr bool value = true;
    static constexpr bool mins = false;
};
template <>
struct QRaw<T_IQ2_XS> {
    static constexpr int chunks = 1;
    unsigned int d, a0, a1, sc;
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 74 * (t >> 3);
        const int ib = t & 7;
        d = ld_u16(b);
        a0 = ld_u32(b + 2 + 8 * ib);
        a1 = ld_u32(b + 6 + 8 * ib);
        sc = __ldg(b + 66 + ib);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*,
                                           int (&k)[1][2], int (&n)[1][2]) const {
        s[0] = __fmul_rn(half_bits_to_f32((unsigned short)d), 0.125f);
        m[0] = 0.f;
        k[0][0] = 2 * (int)(sc & 15) + 1;
        k[0][1] = 2 * (int)(sc >> 4) + 1;
        n[0][0] = n[0][1] = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const unsigned int v = ((e < 2 ? a0 : a1) >> (16 * (e & 1))) & 0xFFFF;
            const unsigned long long g = __ldg(iq2xs_grid + (v & 511));
            const unsigned int sg = __ldg(ksigns_iq2xs + (v >> 9));
            q[0][2 * e] = apply_signs4_((unsigned int)g, sg);
            q[0][2 * e + 1] = apply_signs4_((unsigned int)(g >> 32), sg >> 4);
        }
    }
};

// IQ2_S chunk ib (82 bytes: f16 d, 32 low index bytes, 32 sign bytes, 8 index-high bytes, 8 scale bytes): entry
// e's grid index byte 2 + 4 ib + e | bits 2e of byte 66 + ib << 8, its signs byte 34 + 4 ib + e; run scales 2 nibble
// + 1 of byte 74 + ib; value d / 8 * k * grid * sign.
template <>
struct Sub16<T_IQ2_S> {
    static constexpr bool value = true;
    static constexpr bool mins = false;
};
template <>
struct QRaw<T_IQ2_S> {
    static constexpr int chunks = 1;
    unsigned int d, idx, signs, hs;  // hs: the index-high byte, then the scale byte << 8
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 82 * (t >> 3);
        const int ib = t & 7;
        d = ld_u16(b);
        idx = ld_u32(b + 2 + 4 * ib);
        signs = ld_u32(b + 34 + 4 * ib);
        hs = (unsigned int)__ldg(b + 66 + ib) | ((unsigned int)__ldg(b + 74 + ib) << 8);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*,
                                           int (&k)[1][2], int (&n)[1][2]) const {
        s[0] = __fmul_rn(half_bits_to_f32((unsigned short)d), 0.125f);
        m[0] = 0.f;
        k[0][0] = 2 * (int)((hs >> 8) & 15) + 1;
        k[0][1] = 2 * (int)((hs >> 12) & 15) + 1;
        n[0][0] = n[0][1] = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const unsigned int gi = ((idx >> (8 * e)) & 255) | (((hs >> (2 * e)) & 3) << 8);
            const unsigned long long g = __ldg(iq2s_grid + gi);
            const unsigned int sg = signs >> (8 * e);
            q[0][2 * e] = apply_signs4_((unsigned int)g, sg);
            q[0][2 * e + 1] = apply_signs4_((unsigned int)(g >> 32), sg >> 4);
        }
    }
};

// IQ1_M chunk ib (56 bytes: 32 low index bytes, 16 bytes of index-high + delta-sign nibbles, four u16 scale words
// with the f16 d in their top nibbles): entry e's grid index byte 4 ib + e | (nibble & 7) << 8 with nibble e of
// the u16 at 32 + 2 ib, grid values -1, 0, 1 and delta -1/8 when the nibble's bit 3 is set, else 1/8; levels
// 8 (grid + delta) = 8 grid +- 1 (the CPU's unpacked levels); run scales 2 s + 1 with s bits 3 (j % 4) of scale
// word j / 4, j = 2 ib, 2 ib + 1; value d / 8 * k * level.
template <>
struct Sub16<T_IQ1_M> {
    static constexpr bool value = true;
    static constexpr bool mins = false;
};
template <>
struct QRaw<T_IQ1_M> {
    static constexpr int chunks = 1;
    unsigned int idx, qh, ib;
    unsigned int sw[4];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int t) {
        const uint8_t* b = row + 56 * (t >> 3);
        ib = t & 7;
        idx = ld_u32(b + 4 * ib);
        qh = ld_u16(b + 32 + 2 * ib);
#pragma unroll
        for (int i = 0; i < 4; i++) sw[i] = ld_u16(b + 48 + 2 * i);
    }
    __device__ __forceinline__ void decode(int (&q)[1][8], float (&s)[1], float (&m)[1], const uint16_t*,
                                           int (&k)[1][2], int (&n)[1][2]) const {
        const unsigned short dbits =
            (unsigned short)((sw[0] >> 12) | ((sw[1] >> 8) & 0x00f0) | ((sw[2] >> 4) & 0x0f00) | (sw[3] & 0xf000));
        s[0] = __fmul_rn(half_bits_to_f32(dbits), 0.125f);
        m[0] = 0.f;
        const unsigned int w = sw[ib >> 1];
        const int j0 = (2 * ib) & 3;
        k[0][0] = 2 * (int)((w >> (3 * j0)) & 7) + 1;
        k[0][1] = 2 * (int)((w >> (3 * (j0 + 1))) & 7) + 1;
        n[0][0] = n[0][1] = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const unsigned int nib = (qh >> (4 * e)) & 15;
            const unsigned long long g = __ldg(iq1s_grid + (((idx >> (8 * e)) & 255) | ((nib & 7) << 8)));
            const unsigned int delta = (nib & 8) ? 0xFFFFFFFFu : 0x01010101u;
            q[0][2 * e] = (int)__vadd4(((unsigned int)g << 3) & 0xF8F8F8F8u, delta);
            q[0][2 * e + 1] = (int)__vadd4(((unsigned int)(g >> 32) << 3) & 0xF8F8F8F8u, delta);
        }
    }
};

// acc += the task's C chunks times one row's 8-bit activations (xq: its int8 values, xd: its scales, one per 32),
// chunk by chunk in order: dx * (s * sum(q * x) - m * sum(x)); the activation sum is skipped where m is 0 (the
// same value). With SMEM, xq and xd point at shared memory (a GEMV prologue's quantization: gemv.cu
// quantize_prologue), read with plain loads. Shared by the decode GEMVs (gemv.cu) and the mid-size kernels
// (gemv_grouped.cu).
template <int C, bool SMEM = false>
__device__ __forceinline__ void q8_task_accumulate(float& acc, const int (&q)[C][8], const float (&s)[C],
                                                   const float (&m)[C], const signed char* __restrict__ xq,
                                                   const float* __restrict__ xd, int task) {
#pragma unroll
    for (int h = 0; h < C; h++) {
        const int chunk = task * C + h;
        const int4* xp = reinterpret_cast<const int4*>(xq + 32 * chunk);
        const int4 a = SMEM ? xp[0] : __ldg(xp), b = SMEM ? xp[1] : __ldg(xp + 1);
        const int xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        int dot = 0, sum = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) dot = dp4a_(q[h][i], xs[i], dot);
        if (m[h] != 0.f) {
#pragma unroll
            for (int i = 0; i < 8; i++) sum = dp4a_(0x01010101, xs[i], sum);
        }
        acc += (SMEM ? xd[chunk] : __ldg(xd + chunk)) * (s[h] * (float)dot - m[h] * (float)sum);
    }
}

// As q8_task_accumulate for the types with a scale per 16 values (Sub16<T>): the integer dot and the activation
// sum of each half of a chunk are weighted by its run scale k and run min n before the f32 step:
// dx * (s * (k0 dot0 + k1 dot1) - m * (n0 sum0 + n1 sum1)); the sums only for the types with mins (Q2_K).
template <int T, int C, bool SMEM = false>
__device__ __forceinline__ void q8_task_accumulate_sub16(float& acc, const int (&q)[C][8], const float (&s)[C],
                                                         const float (&m)[C], const int (&k)[C][2],
                                                         const int (&n)[C][2], const signed char* __restrict__ xq,
                                                         const float* __restrict__ xd, int task) {
#pragma unroll
    for (int h = 0; h < C; h++) {
        const int chunk = task * C + h;
        const int4* xp = reinterpret_cast<const int4*>(xq + 32 * chunk);
        const int4 a = SMEM ? xp[0] : __ldg(xp), b = SMEM ? xp[1] : __ldg(xp + 1);
        const int xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        int dot[2] = {0, 0}, sum[2] = {0, 0};
#pragma unroll
        for (int i = 0; i < 8; i++) dot[i >> 2] = dp4a_(q[h][i], xs[i], dot[i >> 2]);
        if constexpr (Sub16<T>::mins) {
#pragma unroll
            for (int i = 0; i < 8; i++) sum[i >> 2] = dp4a_(0x01010101, xs[i], sum[i >> 2]);
        }
        const int idot = k[h][0] * dot[0] + k[h][1] * dot[1];
        const int isum = n[h][0] * sum[0] + n[h][1] * sum[1];
        acc += (SMEM ? xd[chunk] : __ldg(xd + chunk)) * (s[h] * (float)idot - m[h] * (float)isum);
    }
}
