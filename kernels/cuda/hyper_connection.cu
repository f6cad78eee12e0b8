// Hyper-connections (engine/src/model/hyper_connection.rs): the 4-stream residual bundle's mixer and injection.
#include "common.cuh"

// X[t][s*d + i] = e[t][i] for every stream s (the embedding enters every stream).
extern "C" __global__ void broadcast_streams(const float* __restrict__ e, float* X, int n, int streams, int d) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * streams * d) return;
    const int i = idx % d;
    const int t = idx / ((long long)streams * d);
    X[idx] = e[(long long)t * d + i];
}

// low = silu(low / streams).
extern "C" __global__ void hc_low_act(float* low, long long count, float inv_streams) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) low[i] = siluf_(low[i] * inv_streams);
}

// m[t][i] = (1/S) sum_s sigmoid(g[t][s*d+i]) * xn[t][s*d+i]   (the block input).
extern "C" __global__ void hc_mix(const float* __restrict__ g, const float* __restrict__ xn, float* m, int n,
                                  int streams, int d) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    const int i = idx % d, t = idx / d;
    const long long base = (long long)t * streams * d + i;
    float acc = 0.f;
    for (int s = 0; s < streams; s++) acc += sigmoidf_(g[base + s * d]) * xn[base + s * d];
    m[idx] = acc * (1.f / streams);
}

// a = 2 sigmoid(a / S)   (injection weights, one per stream).
extern "C" __global__ void hc_inject_act(float* a, long long count, float inv_streams) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) a[i] = 2.f * sigmoidf_(a[i] * inv_streams);
}

// X[t][s*d + i] += a[t][s] * y[t][i]   (residual update after a block).
extern "C" __global__ void hc_residual(float* X, const float* __restrict__ y, const float* __restrict__ a, int n,
                                       int streams, int d) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * streams * d) return;
    const int i = idx % d;
    const int s = (idx / d) % streams;
    const int t = idx / ((long long)streams * d);
    X[idx] += y[(long long)t * d + i] * a[t * streams + s];
}
