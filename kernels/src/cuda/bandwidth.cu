// Read-only streaming bandwidth: every thread XORs 16-byte words of a buffer (grid-stride, four
// independent loads in flight per iteration, non-coherent loads that do not allocate in L1) and
// each block writes the XOR of its words to sink[blockIdx.x]. A kernel that only reads is the
// fair ceiling for attention, which reads its KV and writes almost nothing; a device-to-device
// copy also pays for the writes. The per-block XOR lets a check prove that every word was read.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

extern "C" __global__ void read_stream(const uint4* __restrict__ x, i64 n16, unsigned int* __restrict__ sink) {
    __shared__ unsigned int warp_acc[32];
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = ld_stream(x + i), b = ld_stream(x + i + stride);
        const uint4 c = ld_stream(x + i + 2 * stride), d = ld_stream(x + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 a = ld_stream(x + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int v = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) v ^= warp_acc[w];
        sink[blockIdx.x] = v;
    }
}
