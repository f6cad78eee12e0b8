// Mid-size products on 8-bit activations: a few to a few dozen rows of activations (a batched decode pass over
// several sequences, an MTP chain outside the exact mode), where the one-row decode GEMVs would read every weight
// once per row (or per group of up to 8 rows) and the prefill kernels, tuned for hundreds of rows, leave most of the
// GPU idle.
//
// gemvqm_*: a dense matrix, y[t][r] = sum_c W[r][c] x[t][c] for n rows of activations. A group of `lanes` threads
// (a power of two, at most 32) owns one weight row and strides over its tasks (QRaw: a 32-value chunk, two for
// Q4_K and Q5_K; the types with a scale per 16 values with their integer run scales, Sub16); each task is loaded and decoded once per tile of MID_TILE activation rows and multiplied with every row
// of the tile by dp4a, the tile's accumulators in registers. Tiles after the first re-read the block's weight rows
// from L1/L2, not DRAM (a block's rows are a few KiB).
//
// moe_gemvqg_*: routed experts grouped by expert (offsets / perm from moe_sort, `active` its list of the experts
// that have slots): block (row group, j = blockIdx.y) multiplies expert active[j]'s rows with the activations of
// every slot routed to it, GROUPED_TILE slots per pass, so an expert that several tokens chose is read once.
// blockIdx.z picks (W0, y0) or (W1, y1): gate and up in one launch. Slot s reads row s / x_div of the activations
// (gate/up: x_div = the slots per token; down: 1) and writes y + s * rows.
//
// The integer dot products are those of the one-row kernels and of the CPU kernels (same decoded levels, same
// 8-bit activations); each chunk adds dx * (s * sum(q * x) - m * sum(x)) in f32, the chunks of a row in the
// thread's task order and the threads' partial sums through a shuffle tree, so the results differ from the one-row
// kernels' only in the f32 summation order. Not used in the exact mode (verify passes), whose rows must be bit for
// bit a decode step's.
#include "common.cuh"
#include "lowbit.cuh"
#include "qraw.cuh"
#include "lowbit_q8.cuh"

// Activation rows per register tile: dense (gemvqm_*) and per expert (moe_gemvqg_*, where most experts of a batched
// decode step have one to three slots).
#define MID_TILE 16
#define GROUPED_TILE 8

// Tasks whose raw weight bytes a thread keeps in flight (task i + 1's loads issued before task i is decoded).
#define MID_DEPTH 2

// One weight row (`row`, `ntasks` tasks; ntasks = 0 for a thread past the matrix, which still takes part in the
// shuffles) times `n` activation rows, NT at a time: activation row t at qx + xo(t) (scales dx + xo(t) / 32), its
// result to y[yo(t)] (written by the group's first thread when `valid`). `lanes` threads per row (a power of two,
// at most 32, dividing the warp).
template <int T, int NT, typename XO, typename YO>
__device__ __forceinline__ void mid_rows_body(const uint8_t* __restrict__ row, int ntasks, bool valid, int lanes,
                                              int n, const signed char* __restrict__ qx,
                                              const float* __restrict__ dx, float* __restrict__ y, XO xo, YO yo,
                                              const uint16_t* pairs) {
    constexpr int C = QRaw<T>::chunks;
    const int lane = threadIdx.x % lanes;
    for (int t0 = 0; t0 < n; t0 += NT) {
        const int nt = min(NT, n - t0);
        int xoff[NT];  // activation offsets (int8 values) of the tile's rows
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            xoff[t] = (int)xo(t0 + (t < nt ? t : 0));
            acc[t] = 0.f;
        }
        QRaw<T> raw[MID_DEPTH];
#pragma unroll
        for (int k = 0; k < MID_DEPTH; k++) {
            if (lane + k * lanes < ntasks) raw[k].load(row, lane + k * lanes);
        }
        for (int base = lane; base < ntasks; base += MID_DEPTH * lanes) {
#pragma unroll
            for (int k = 0; k < MID_DEPTH; k++) {
                const int task = base + k * lanes;
                if (task < ntasks) {
                    int q[C][8];
                    float s[C], m[C];
                    if constexpr (Sub16<T>::value) {
                        int ks[C][2], ns[C][2];
                        raw[k].decode(q, s, m, pairs, ks, ns);
                        if (task + MID_DEPTH * lanes < ntasks) raw[k].load(row, task + MID_DEPTH * lanes);
#pragma unroll
                        for (int t = 0; t < NT; t++) {
                            if (t < nt)
                                q8_task_accumulate_sub16<T, C>(acc[t], q, s, m, ks, ns, qx + xoff[t],
                                                                dx + xoff[t] / 32, task);
                        }
                    } else {
                        raw[k].decode(q, s, m, pairs);
                        if (task + MID_DEPTH * lanes < ntasks) raw[k].load(row, task + MID_DEPTH * lanes);
#pragma unroll
                        for (int t = 0; t < NT; t++) {
                            if (t < nt)
                                q8_task_accumulate<C>(acc[t], q, s, m, qx + xoff[t], dx + xoff[t] / 32, task);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t], lanes);
        if (lane == 0 && valid) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) y[yo(t0 + t)] = acc[t];
            }
        }
    }
}

// gemvqm_*: y[t * y_stride + r] = W[r] . x[t] for t < n (activations qx + t * x_stride, scales dx + t * x_stride /
// 32), `lanes` threads per weight row, 128-thread blocks, grid.x = rows / (128 / lanes).
template <int T>
__device__ __forceinline__ void gemvqm_body(const uint8_t* __restrict__ W, long long row_bytes, int rows, int cols,
                                            const signed char* __restrict__ qx, const float* __restrict__ dx,
                                            long long x_stride, float* __restrict__ y, long long y_stride, int n,
                                            int lanes, const uint16_t* pairs) {
    constexpr int C = QRaw<T>::chunks;
    const int r = blockIdx.x * (blockDim.x / lanes) + threadIdx.x / lanes;
    const bool valid = r < rows;
    const uint8_t* row = W + (long long)(valid ? r : 0) * row_bytes;
    const int ntasks = valid ? cols / (32 * C) : 0;
    mid_rows_body<T, MID_TILE>(
        row, ntasks, valid, lanes, n, qx, dx, y, [=](int t) { return (long long)t * x_stride; },
        [=](int t) { return (long long)t * y_stride + r; }, pairs);
}

// moe_gemvqg_*: see the file's head. Blocks whose active[blockIdx.y] is negative (fewer experts with slots than the
// grid's y) return at once.
template <int T>
__device__ __forceinline__ void moe_gemvqg_body(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                                                long long expert_bytes, long long row_bytes, int rows, int cols,
                                                const int* __restrict__ offsets, const int* __restrict__ perm,
                                                const int* __restrict__ active, const signed char* __restrict__ qx,
                                                const float* __restrict__ dx, int x_div, long long x_stride,
                                                float* __restrict__ y0, float* __restrict__ y1, int lanes,
                                                const uint16_t* pairs) {
    constexpr int C = QRaw<T>::chunks;
    const int e = active[blockIdx.y];
    if (e < 0) return;  // uniform over the block
    const int start = offsets[e], n = offsets[e + 1] - start;
    if (n <= 0) return;  // uniform over the block
    const int r = blockIdx.x * (blockDim.x / lanes) + threadIdx.x / lanes;
    const bool valid = r < rows;
    const uint8_t* row =
        (blockIdx.z == 0 ? W0 : W1) + (long long)e * expert_bytes + (long long)(valid ? r : 0) * row_bytes;
    float* y = blockIdx.z == 0 ? y0 : y1;
    const int ntasks = valid ? cols / (32 * C) : 0;
    const int* slots = perm + start;
    mid_rows_body<T, GROUPED_TILE>(
        row, ntasks, valid, lanes, n, qx, dx, y, [=](int t) { return (long long)(slots[t] / x_div) * x_stride; },
        [=](int t) { return (long long)slots[t] * rows + r; }, pairs);
}

#define GEMVQM(NAME, T)                                                                                           \
    extern "C" __global__ void gemvqm_##NAME(const uint8_t* W, long long rb, int rows, int cols,                  \
                                             const signed char* qx, const float* dx, long long xs, float* y,     \
                                             long long ys, int n, int lanes) { pdl_entry();                       \
        __shared__ uint16_t pairs[256];                                                                            \
        if (T == T_IQ4_NL || T == T_IQ4_XS) iq4nl_pairs_(pairs); /* the types whose decode reads `pairs` */      \
        gemvqm_body<T>(W, rb, rows, cols, qx, dx, xs, y, ys, n, lanes, pairs);                                    \
    }                                                                                                             \
    extern "C" __global__ void moe_gemvqg_##NAME(const uint8_t* W0, const uint8_t* W1, long long eb, long long rb, \
                                                 int rows, int cols, const int* offsets, const int* perm,          \
                                                 const int* active, const signed char* qx, const float* dx,        \
                                                 int x_div, long long xs, float* y0, float* y1, int lanes) {       \
        pdl_entry();                                                                                               \
        __shared__ uint16_t pairs[256];                                                                            \
        if (T == T_IQ4_NL || T == T_IQ4_XS) iq4nl_pairs_(pairs);                                                   \
        moe_gemvqg_body<T>(W0, W1, eb, rb, rows, cols, offsets, perm, active, qx, dx, x_div, xs, y0, y1, lanes,  \
                           pairs);                                                                                 \
    }

GEMVQM(q8_0, T_Q8_0)
GEMVQM(q4_0, T_Q4_0)
GEMVQM(iq4_nl, T_IQ4_NL)
GEMVQM(q4_k, T_Q4_K)
GEMVQM(q4_1, T_Q4_1)
GEMVQM(q5_1, T_Q5_1)
GEMVQM(mxfp4, T_MXFP4)
GEMVQM(iq2_xxs, T_IQ2_XXS)
GEMVQM(iq3_xxs, T_IQ3_XXS)
GEMVQM(iq3_s, T_IQ3_S)
GEMVQM(iq1_s, T_IQ1_S)
GEMVQM(q5_0, T_Q5_0)
GEMVQM(q5_k, T_Q5_K)
GEMVQM(iq4_xs, T_IQ4_XS)
GEMVQM(q2_k, T_Q2_K)
GEMVQM(q3_k, T_Q3_K)
GEMVQM(q6_k, T_Q6_K)
GEMVQM(iq2_xs, T_IQ2_XS)
GEMVQM(iq2_s, T_IQ2_S)
GEMVQM(iq1_m, T_IQ1_M)
