// Element-wise helpers of the engine's forward pass. Grid-stride loops, any launch size.

// y[i] = float(x[i])
extern "C" __global__ void bf16_to_f32(const bf16_t* __restrict__ x, float* __restrict__ y, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = bf2f(x[i]);
}

// Gated activation of a fused gate|up projection: gu [rows, 2 * ffn] -> y [rows, ffn],
// y = silu(gate) * up with silu(g) = g / (1 + e^-g). When ffn is a multiple of 8 and the
// buffers are 16-byte aligned, each thread does 8 elements with uint4 loads and stores (same
// per-element arithmetic, so the same results).
__device__ __forceinline__ float silu_mul1(float g, float u) { return g / (1.f + __expf(-g)) * u; }

extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gu, bf16_t* __restrict__ y, i64 rows, int ffn) {
    if ((ffn & 7) == 0 && ((((unsigned long long)gu) | ((unsigned long long)y)) & 15) == 0) {
        const int f8 = ffn >> 3;
        const i64 n8 = rows * f8;
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (i64)gridDim.x * blockDim.x) {
            const i64 r = i / f8;
            const int c = (int)(i % f8);
            const uint4 g4 = reinterpret_cast<const uint4*>(gu + r * 2 * ffn)[c];
            const uint4 u4 = reinterpret_cast<const uint4*>(gu + r * 2 * ffn + ffn)[c];
            const unsigned int g[4] = {g4.x, g4.y, g4.z, g4.w};
            const unsigned int u[4] = {u4.x, u4.y, u4.z, u4.w};
            unsigned int o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bf16_t lo = f2bf(silu_mul1(bf2f((bf16_t)(g[e] & 0xffffu)), bf2f((bf16_t)(u[e] & 0xffffu))));
                const bf16_t hi = f2bf(silu_mul1(bf2f((bf16_t)(g[e] >> 16)), bf2f((bf16_t)(u[e] >> 16))));
                o[e] = (unsigned int)lo | ((unsigned int)hi << 16);
            }
            uint4 ov;
            ov.x = o[0];
            ov.y = o[1];
            ov.z = o[2];
            ov.w = o[3];
            reinterpret_cast<uint4*>(y + r * ffn)[c] = ov;
        }
        return;
    }
    const i64 n = rows * ffn;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / ffn;
        const int c = (int)(i % ffn);
        y[i] = f2bf(silu_mul1(bf2f(gu[r * 2 * ffn + c]), bf2f(gu[r * 2 * ffn + ffn + c])));
    }
}

// x[i] += y[i] (residual), rounded to bf16. When both buffers are 16-byte aligned, 8 elements
// per thread and step (uint4), the tail past the last multiple of 8 element by element.
extern "C" __global__ void add_inplace(bf16_t* __restrict__ x, const bf16_t* __restrict__ y, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 head = 0;
    if (((((unsigned long long)x) | ((unsigned long long)y)) & 15) == 0) {
        head = n & ~(i64)7;
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < head / 8; i += stride) {
            float a[8], b[8];
            unpack8(reinterpret_cast<const uint4*>(x)[i], a);
            unpack8(reinterpret_cast<const uint4*>(y)[i], b);
            unsigned int o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[e] = (unsigned int)f2bf(a[2 * e] + b[2 * e]) | ((unsigned int)f2bf(a[2 * e + 1] + b[2 * e + 1]) << 16);
            reinterpret_cast<uint4*>(x)[i] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    for (i64 i = head + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}

// dst[i, :] = src[rows[i], :] for rows of `dim` bf16 (embeddings; the rows that need logits),
// 16 bytes at a time when dim is a multiple of 8 and both buffers are 16-byte aligned.
extern "C" __global__ void select_rows(const bf16_t* __restrict__ src, const int* __restrict__ rows,
                                       bf16_t* __restrict__ dst, int dim) {
    const bf16_t* s = src + (i64)rows[blockIdx.x] * dim;
    bf16_t* d = dst + (i64)blockIdx.x * dim;
    if ((dim & 7) == 0 && ((((unsigned long long)src) | ((unsigned long long)dst)) & 15) == 0) {
        for (int c = threadIdx.x; c < dim / 8; c += blockDim.x)
            reinterpret_cast<uint4*>(d)[c] = reinterpret_cast<const uint4*>(s)[c];
        return;
    }
    for (int c = threadIdx.x; c < dim; c += blockDim.x) d[c] = s[c];
}
