// Paged attention over 128-token blocks of compressed global KV (MLA-like latent rows).
// One kernel serves decode and prefill chunks: every query row carries the key range
// [kv_start, kv_end) it may see (decode: [0, len); a prefill token at position p: [0, p + 1)),
// and the key range is split across warps (flash-decoding) so a few long rows fill the GPU.
// Compile-time shape (NVRTC -D): D_QK (row width, multiple of 8), D_V (value width: the first
// D_V elements of the same row, as in MLA's absorbed form), GROUP (query heads per KV head),
// LPT (lanes per token), CPL (16-byte chunks per lane), WARPS (warps per CTA), UNROLL.
#ifndef D_QK
#error "D_QK must be defined"
#endif
#define NCH (D_QK / 8)
#define TPW (32 / LPT)

extern "C" __global__ void __launch_bounds__(WARPS * 32)
paged_attention_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
                      const int* __restrict__ block_tables, int max_blocks_per_row,
                      const int* __restrict__ q_row, const int* __restrict__ kv_start,
                      const int* __restrict__ kv_end, i64 block_stride, int row_stride,
                      int num_kv_heads, int block_size, int tokens_per_split, int max_splits,
                      float scale, float* __restrict__ part_m, float* __restrict__ part_l,
                      float* __restrict__ part_acc) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int split = blockIdx.x * WARPS + warp;
    const int qi = blockIdx.y;
    const int kvh = blockIdx.z;
    const int start = kv_start[qi];
    const int end = kv_end[qi];
    const int s0 = start + split * tokens_per_split;
    if (split >= max_splits || s0 >= end) return;  // whole warp leaves together
    const int s1 = min(end, s0 + tokens_per_split);
    const int sub = lane % LPT;
    const int grp = lane / LPT;
    const int num_heads = num_kv_heads * GROUP;
    const int* table = block_tables + (i64)q_row[qi] * max_blocks_per_row;

    float qr[GROUP][CPL * 8];
    float acc[GROUP][CPL * 8];
    float m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const bf16_t* qp = q + ((i64)qi * num_heads + kvh * GROUP + g) * D_QK;
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

    for (int base = s0; base < s1; base += TPW * UNROLL) {
        uint4 raw[UNROLL][CPL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = base + u * TPW + grp;
            valid[u] = t < s1;
            if (valid[u]) {
                const int phys = table[t / block_size];
                const bf16_t* row = kv + (i64)phys * block_stride + (i64)(t % block_size) * row_stride + kvh * D_QK;
#pragma unroll
                for (int j = 0; j < CPL; ++j) {
                    const int c = j * LPT + sub;
                    raw[u][j] = c < NCH ? __ldg(reinterpret_cast<const uint4*>(row + c * 8)) : make_uint4(0, 0, 0, 0);
                }
            } else {
#pragma unroll
                for (int j = 0; j < CPL; ++j) raw[u][j] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[CPL * 8];
#pragma unroll
            for (int j = 0; j < CPL; ++j) unpack8(raw[u][j], kf + j * 8);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < CPL * 8; ++e) s = fmaf(qr[g][e], kf[e], s);
                // reduce over the LPT lanes that hold this token (xor offsets stay in the group)
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (valid[u]) {
                    const float mn = fmaxf(m[g], s);
                    const float corr = __expf(m[g] - mn);
                    const float p = __expf(s - mn);
                    l[g] = l[g] * corr + p;
#pragma unroll
                    for (int j = 0; j < CPL; ++j) {
                        const int c = j * LPT + sub;
                        if (c * 8 < D_V) {
#pragma unroll
                            for (int e = 0; e < 8; ++e)
                                acc[g][j * 8 + e] = fmaf(p, kf[j * 8 + e], acc[g][j * 8 + e] * corr);
                        }
                    }
                    m[g] = mn;
                }
            }
        }
    }

    // Merge the TPW token groups of this warp (lanes with the same `sub` hold the same dims).
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
        const i64 slot = ((i64)qi * num_heads + kvh * GROUP + g) * max_splits + split;
        if (sub == 0) { part_m[slot] = m[g]; part_l[slot] = l[g]; }
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
            const int c = j * LPT + sub;
            if (c * 8 < D_V) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const int d = c * 8 + e;
                    if (d < D_V) part_acc[slot * D_V + d] = acc[g][j * 8 + e];
                }
            }
        }
    }
}

// Merge the splits of each (query row, head): grid (num_q, num_heads), any block size.
extern "C" __global__ void paged_attention_reduce(const int* __restrict__ kv_start,
                                                  const int* __restrict__ kv_end, int tokens_per_split,
                                                  int max_splits, int num_heads,
                                                  const float* __restrict__ part_m,
                                                  const float* __restrict__ part_l,
                                                  const float* __restrict__ part_acc,
                                                  bf16_t* __restrict__ out) {
    const int qi = blockIdx.x;
    const int h = blockIdx.y;
    const int len = kv_end[qi] - kv_start[qi];
    const int nsplit = len > 0 ? min(max_splits, (len + tokens_per_split - 1) / tokens_per_split) : 0;
    const i64 base = ((i64)qi * num_heads + h) * max_splits;
    float mx = -INFINITY;
    for (int i = 0; i < nsplit; ++i) mx = fmaxf(mx, part_m[base + i]);
    float den = 0.f;
    for (int i = 0; i < nsplit; ++i) den += part_l[base + i] * __expf(part_m[base + i] - mx);
    const float inv = den > 0.f ? 1.f / den : 0.f;
    for (int d = threadIdx.x; d < D_V; d += blockDim.x) {
        float num = 0.f;
        for (int i = 0; i < nsplit; ++i) num += part_acc[(base + i) * D_V + d] * __expf(part_m[base + i] - mx);
        out[((i64)qi * num_heads + h) * D_V + d] = f2bf(num * inv);
    }
}

// Write new rows into the paged cache: row i of `src` ([n, num_kv_heads * D_QK]) goes to
// logical slot slot_mapping[i] = physical_block * block_size + offset. grid n, any block size.
extern "C" __global__ void paged_kv_write(const bf16_t* __restrict__ src, const i64* __restrict__ slot_mapping,
                                          bf16_t* __restrict__ kv, i64 block_stride, int row_stride,
                                          int num_kv_heads, int block_size) {
    const int i = blockIdx.x;
    const i64 slot = slot_mapping[i];
    if (slot < 0) return;  // padding rows
    bf16_t* dst = kv + (slot / block_size) * block_stride + (slot % block_size) * row_stride;
    const bf16_t* s = src + (i64)i * num_kv_heads * D_QK;
    for (int c = threadIdx.x; c < num_kv_heads * NCH; c += blockDim.x) {
        const int h = c / NCH, k = c % NCH;
        *reinterpret_cast<uint4*>(dst + h * D_QK + k * 8) = *reinterpret_cast<const uint4*>(s + h * D_QK + k * 8);
    }
}
