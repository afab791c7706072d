// Rotary position embedding, in place, rotate-half (GPT-NeoX) layout over the rot_dim elements
// of each head from rot_start on (MLA rotates only the latent's last elements, which are not
// part of the value): pairs (i, i + rot_dim/2) rotate by angle pos * theta^(-2i/rot_dim).
// The angle is formed in double precision: positions reach 10^6 and a float angle would be off.
// x [n, heads, head_dim]; positions [n]. One thread per (token, pair), over every head: the
// double-precision pow and sincos are the kernel's cost, and every head of a token shares them.
extern "C" __global__ void rope(bf16_t* __restrict__ x, const int* __restrict__ positions, int n,
                                int heads, int head_dim, int rot_start, int rot_dim, double theta) {
    const int half = rot_dim / 2;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 total = (i64)n * half;
    if (idx >= total) return;
    const int i = (int)(idx % half);
    const int t = (int)(idx / half);
    const double inv_freq = pow(theta, -2.0 * (double)i / (double)rot_dim);
    double s, c;
    sincos((double)positions[t] * inv_freq, &s, &c);
    for (int h = 0; h < heads; ++h) {
        bf16_t* row = x + ((i64)t * heads + h) * head_dim + rot_start;
        const float a = bf2f(row[i]), b = bf2f(row[i + half]);
        row[i] = f2bf((float)(a * c - b * s));
        row[i + half] = f2bf((float)(b * c + a * s));
    }
}
