// Element-wise helpers of the engine's forward pass. Grid-stride loops, any launch size.

// y[i] = float(x[i])
extern "C" __global__ void bf16_to_f32(const bf16_t* __restrict__ x, float* __restrict__ y, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = bf2f(x[i]);
}

// Gated activation of a fused gate|up projection: gu [rows, 2 * ffn] -> y [rows, ffn],
// y = silu(gate) * up with silu(g) = g / (1 + e^-g).
extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gu, bf16_t* __restrict__ y, i64 rows, int ffn) {
    const i64 n = rows * ffn;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / ffn;
        const int c = (int)(i % ffn);
        const float g = bf2f(gu[r * 2 * ffn + c]);
        const float u = bf2f(gu[r * 2 * ffn + ffn + c]);
        y[i] = f2bf(g / (1.f + __expf(-g)) * u);
    }
}

// x[i] += y[i] (residual), rounded to bf16.
extern "C" __global__ void add_inplace(bf16_t* __restrict__ x, const bf16_t* __restrict__ y, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}

// dst[i, :] = src[rows[i], :] for rows of `dim` bf16 (selects the rows that need logits).
extern "C" __global__ void select_rows(const bf16_t* __restrict__ src, const int* __restrict__ rows,
                                       bf16_t* __restrict__ dst, int dim) {
    const bf16_t* s = src + (i64)rows[blockIdx.x] * dim;
    bf16_t* d = dst + (i64)blockIdx.x * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) d[c] = s[c];
}
