// Sampling: greedy argmax, and Gumbel-max sampling with a counter-based hash (so a seed gives
// the same tokens on every run and the CPU reference reproduces them). Ties go to the lower id.

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Uniform in (0, 1) from (seed, row, column).
__device__ __forceinline__ float uniform01(unsigned long long seed, int row, int col) {
    const unsigned long long h = splitmix64(seed ^ splitmix64(((unsigned long long)row << 32) | (unsigned int)col));
    return ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Block-wide (value, index) max; lower index wins ties.
__device__ void block_argmax(float v, int i, float* sv, int* si, int* out) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = v; si[threadIdx.x >> 5] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (sv[w] > v || (sv[w] == v && si[w] < i)) { v = sv[w]; i = si[w]; }
        *out = i;
    }
}

// ids[r] = argmax_c logits[r, c]; rows of only NaN give 0. grid rows, block 256.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ ids) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* lr = logits + (i64)blockIdx.x * vocab;
    float best = -INFINITY;
    int bi = vocab;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        const float x = lr[c];
        if (x > best || (x == best && c < bi)) { best = x; bi = c; }
    }
    __shared__ int res;
    block_argmax(best, bi, sv, si, &res);
    __syncthreads();
    if (threadIdx.x == 0) ids[blockIdx.x] = res < vocab ? res : 0;
}

// Gumbel-max: ids[r] = argmax_c logits[r, c] / temperature - log(-log(u(seed, r, c))).
extern "C" __global__ void gumbel_sample_rows(const float* __restrict__ logits, int vocab, float temperature,
                                              unsigned long long seed, int* __restrict__ ids) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* lr = logits + (i64)blockIdx.x * vocab;
    const float inv_t = 1.0f / temperature;
    float best = -INFINITY;
    int bi = vocab;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        const float u = uniform01(seed, blockIdx.x, c);
        const float x = lr[c] * inv_t - logf(-logf(u));
        if (x > best || (x == best && c < bi)) { best = x; bi = c; }
    }
    __shared__ int res;
    block_argmax(best, bi, sv, si, &res);
    __syncthreads();
    if (threadIdx.x == 0) ids[blockIdx.x] = res < vocab ? res : 0;
}
