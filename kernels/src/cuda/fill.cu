// Fills a bf16 buffer with uniform values in [-scale, scale) from a counter-based hash, so large
// benchmark inputs are random (never zeros) without a host round trip.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

extern "C" __global__ void fill_uniform_bf16(bf16_t* __restrict__ x, i64 n, unsigned long long seed, float scale) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const unsigned long long h = mix64(seed ^ mix64((unsigned long long)i));
        const float u = (float)(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        x[i] = f2bf((2.0f * u - 1.0f) * scale);
    }
}

// Copies whole blocks of `block_bytes` (a multiple of 16) from `src` to `dst` by block id:
// dst block dst_ids[i] <- src block src_ids[i]. `src` may be mapped pinned host memory, so
// this is also the zero-copy swap-in path (SMs read the host over PCIe). grid: blocks, any size.
extern "C" __global__ void gather_blocks(const uint4* __restrict__ src, const int* __restrict__ src_ids,
                                         uint4* __restrict__ dst, const int* __restrict__ dst_ids,
                                         i64 block_bytes) {
    const i64 words = block_bytes / 16;
    const uint4* s = src + (i64)src_ids[blockIdx.x] * words;
    uint4* d = dst + (i64)dst_ids[blockIdx.x] * words;
    for (i64 i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
}
