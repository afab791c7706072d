// Sliding-window attention with a truncation start, for bounded replay.
// Query i sits at absolute position q_pos0 + i; keys live in a contiguous buffer whose row j is
// absolute position k_pos0 + j. Query position p sees keys at positions
// [max(trunc_start, p - window + 1, k_pos0), min(p, k_pos0 + num_k - 1)]: the window, cut
// below at `trunc_start` (the start of the replayed segment: nothing before it is read).
// Layout: q [num_q, KVH * GROUP, D], k and v [num_k, KVH, D], out [num_q, KVH * GROUP, D].
// Compile-time (NVRTC -D): D, GROUP, LPT, CPL, WARPS. One warp per (query, kv head).
#define NCH (D / 8)
#define TPW (32 / LPT)

extern "C" __global__ void __launch_bounds__(WARPS * 32)
swa_attention(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
              int num_q, int num_k, int num_kv_heads, int q_pos0, int k_pos0, int window,
              int trunc_start, float scale, bf16_t* __restrict__ out) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int qi = blockIdx.x * WARPS + warp;
    const int kvh = blockIdx.y;
    if (qi >= num_q) return;
    const int sub = lane % LPT;
    const int grp = lane / LPT;
    const int num_heads = num_kv_heads * GROUP;
    const int p = q_pos0 + qi;
    const int lo_pos = max(max(trunc_start, p - window + 1), k_pos0);
    const int hi_pos = min(p, k_pos0 + num_k - 1);
    const int j0 = lo_pos - k_pos0;
    const int j1 = hi_pos - k_pos0 + 1;  // exclusive; may be <= j0 (no visible key)

    float qr[GROUP][CPL * 8], acc[GROUP][CPL * 8], m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const bf16_t* qp = q + ((i64)qi * num_heads + kvh * GROUP + g) * D;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
            const int c = j * LPT + sub;
            float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (c < NCH) unpack8(*reinterpret_cast<const uint4*>(qp + c * 8), f);
#pragma unroll
            for (int e = 0; e < 8; ++e) { qr[g][j * 8 + e] = f[e] * scale; acc[g][j * 8 + e] = 0.f; }
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    for (int base = j0; base < j1; base += TPW) {
        const int t = base + grp;
        const bool valid = t < j1;
        float kf[CPL * 8], vf[CPL * 8];
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
            const int c = j * LPT + sub;
            uint4 kw = make_uint4(0, 0, 0, 0), vw = make_uint4(0, 0, 0, 0);
            if (valid && c < NCH) {
                const i64 off = ((i64)t * num_kv_heads + kvh) * D + c * 8;
                kw = *reinterpret_cast<const uint4*>(k + off);
                vw = *reinterpret_cast<const uint4*>(v + off);
            }
            unpack8(kw, kf + j * 8);
            unpack8(vw, vf + j * 8);
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < CPL * 8; ++e) s = fmaf(qr[g][e], kf[e], s);
#pragma unroll
            for (int o = LPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (valid) {
                const float mn = fmaxf(m[g], s);
                const float corr = __expf(m[g] - mn);
                const float pr = __expf(s - mn);
                l[g] = l[g] * corr + pr;
#pragma unroll
                for (int e = 0; e < CPL * 8; ++e) acc[g][e] = fmaf(pr, vf[e], acc[g][e] * corr);
                m[g] = mn;
            }
        }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int o = LPT; o < 32; o <<= 1) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mn = fmaxf(m[g], mo);
            const float a = (m[g] == -INFINITY) ? 0.f : __expf(m[g] - mn);
            const float b = (mo == -INFINITY) ? 0.f : __expf(mo - mn);
#pragma unroll
            for (int e = 0; e < CPL * 8; ++e) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
                acc[g][e] = acc[g][e] * a + ao * b;
            }
            l[g] = l[g] * a + lo * b;
            m[g] = mn;
        }
    }
    if (grp != 0) return;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        bf16_t* op = out + ((i64)qi * num_heads + kvh * GROUP + g) * D;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
            const int c = j * LPT + sub;
            if (c < NCH) {
#pragma unroll
                for (int e = 0; e < 8; ++e) op[c * 8 + e] = f2bf(acc[g][j * 8 + e] * inv);
            }
        }
    }
}
