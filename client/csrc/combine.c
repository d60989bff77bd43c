/* The client's sum of the shards' answers (client/native.py loads this; client/core.py has the
 * numpy form it replaces where a C compiler is missing).
 *
 * out[m][h] (bf16 bits) = round_to_bf16(0 + a_0 + a_1 + ... in answer order), each answer a
 * holding counts[a] rows of h bf16 values for the output rows rows[a][*] (distinct,
 * ascending). The float32 additions are index_add_'s from zeros, in the same order for every
 * element, so the bits are torch's. One pass over each answer: the rows of a block of
 * `block_rows` output rows are summed into `acc` (sized to stay in cache), then rounded.
 * Build without -ffast-math: the order of the additions is the contract.
 */
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's scalar conversion (c10::BFloat16); NaN -> 0x7FC0. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

static void add_row(float *restrict dst, const uint16_t *restrict src, int64_t h) {
    for (int64_t k = 0; k < h; ++k) dst[k] += bf16_to_f32(src[k]);
}

/* 0 on success; -1 - a when answer a's rows are not distinct, ascending rows of [0, m). */
int expertd_combine_bf16(uint16_t *out, int64_t m, int64_t h, int32_t n,
                         const int64_t *const *rows, const int64_t *counts,
                         const uint16_t *const *bits, float *acc, int64_t block_rows) {
    for (int32_t a = 0; a < n; ++a)
        for (int64_t i = 0; i < counts[a]; ++i)
            if (rows[a][i] < 0 || rows[a][i] >= m || (i > 0 && rows[a][i] <= rows[a][i - 1]))
                return -1 - a;
    int64_t cursor[n > 0 ? n : 1];
    memset(cursor, 0, sizeof cursor);
    for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
        int64_t r1 = r0 + block_rows < m ? r0 + block_rows : m;
        memset(acc, 0, (size_t)((r1 - r0) * h) * sizeof(float));
        for (int32_t a = 0; a < n; ++a) {
            int64_t i = cursor[a];
            for (; i < counts[a] && rows[a][i] < r1; ++i)
                add_row(acc + (rows[a][i] - r0) * h, bits[a] + i * h, h);
            cursor[a] = i;
        }
        uint16_t *o = out + r0 * h;
        for (int64_t k = 0; k < (r1 - r0) * h; ++k) o[k] = f32_to_bf16(acc[k]);
    }
    return 0;
}
