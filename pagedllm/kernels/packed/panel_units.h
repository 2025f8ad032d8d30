/* How the packed-panel matmuls (panel_f32.h, panel_bf16.h: packed_linear.cpp
 * and packed_linear_bf16.cpp) split
 * their work: units of (panel, row chunk), panel-major, so a thread runs all
 * row chunks of a panel back to back and reads the panel from memory once;
 * each row chunk also prefetches its share of the NEXT panel's cache lines
 * into L2, one line per k step, so the stream from memory overlaps the
 * arithmetic.
 *
 *   unit u:  panel p = u / num_chunks, chunk c = u % num_chunks
 *   rows [c * mr, c * mr + num_rows), columns [p * panel, p * panel + num_cols)
 *   prefetch: lines [c * lines_per_chunk, + num_prefetch) of panel p + 1
 */
#ifndef PAGEDLLM_PANEL_UNITS_H
#define PAGEDLLM_PANEL_UNITS_H

#include <stdint.h>

typedef struct {
    int64_t num_panels, num_chunks, num_units;
    int64_t panel_lines;     /* cache lines in one panel */
    int64_t lines_per_chunk; /* of the next panel, prefetched by each row chunk */
} panel_split;

typedef struct {
    int64_t panel, row0;
    int num_rows, num_cols;
    int64_t first_line;   /* of panel + 1, where this unit's prefetch starts */
    int64_t num_prefetch; /* 0: nothing to prefetch (the last panel, or past its end) */
} panel_unit;

static inline panel_split panel_split_of(int64_t m, int64_t n, int mr, int panel, int64_t panel_bytes) {
    panel_split s;
    s.num_panels = (n + panel - 1) / panel;
    s.num_chunks = (m + mr - 1) / mr;
    s.num_units = s.num_panels * s.num_chunks;
    s.panel_lines = panel_bytes / 64; /* 64-byte cache lines */
    s.lines_per_chunk = (s.panel_lines + s.num_chunks - 1) / s.num_chunks;
    return s;
}

static inline panel_unit panel_unit_at(const panel_split *s, int64_t u, int64_t m, int64_t n, int mr, int panel) {
    panel_unit w;
    int64_t chunk = u % s->num_chunks;
    w.panel = u / s->num_chunks;
    w.row0 = chunk * mr;
    w.num_rows = (int)(m - w.row0 < mr ? m - w.row0 : mr);
    w.num_cols = (int)(n - w.panel * panel < panel ? n - w.panel * panel : panel);
    w.first_line = chunk * s->lines_per_chunk;
    w.num_prefetch = 0;
    if (w.panel + 1 < s->num_panels && w.first_line < s->panel_lines) {
        int64_t left = s->panel_lines - w.first_line;
        w.num_prefetch = left < s->lines_per_chunk ? left : s->lines_per_chunk;
    }
    return w;
}

#endif
