/* A step's call records -> per-slot aggregates, or straight to their rtx.kernel spans' bytes.
 *
 * aggregate(calls, bins) reads flat int64 (slot, start_ns, duration_ns) triples from any
 * contiguous buffer and returns {slot: (count, total, min, max, first start, last end, hist)}
 * in slot order: what rtxops/telemetry/spans.py's _aggregate_loop returns (hist: counts of the
 * durations' bit lengths, capped at bins - 1, trailing zeros cut). None -- the caller adds up
 * in Python -- for what it does not take: a slot outside [0, MAX_SLOT), a sum past int64.
 *
 * kernel_spans(...) aggregates the same way and writes each slot's rtx.kernel span as OTLP Span
 * fields (see spans.py's SpanBuilder._kernel_spans_encoded for the arguments): the bytes
 * rtxops/telemetry/encode.py writes for the ReadableSpan the builder would have made, without
 * making it. None where it cannot: the caller builds the spans in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SLOT (1 << 16)
#define MAX_BINS 64

typedef struct { int64_t count, total, lo, hi, first, last; } Acc;

typedef struct {
    Acc *acc;
    int64_t *hist;   /* slots * bins */
    int64_t slots;
} Sums;

static int bit_length(int64_t v) {
    return v > 0 ? 64 - __builtin_clzll((uint64_t)v) : 0;
}

static void sums_free(Sums *s) {
    free(s->acc);
    free(s->hist);
    s->acc = NULL; s->hist = NULL;
}

/* 0: summed; 1: not taken (the caller's Python path decides); -1: an exception is set */
static int accumulate(const Py_buffer *view, int bins, Sums *out) {
    memset(out, 0, sizeof *out);
    if (bins < 1 || bins > MAX_BINS || view->len % (3 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "expected int64 triples and 1..64 bins");
        return -1;
    }
    const int64_t *rows = (const int64_t *)view->buf;
    Py_ssize_t n = view->len / (Py_ssize_t)(3 * sizeof(int64_t));
    int64_t slots = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = rows[3 * i];
        if (s < 0 || s >= MAX_SLOT) return 1;
        if (s + 1 > slots) slots = s + 1;
    }
    out->slots = slots;
    out->acc = calloc(slots ? slots : 1, sizeof(Acc));
    out->hist = calloc((slots ? slots : 1) * bins, sizeof(int64_t));
    if (!out->acc || !out->hist) { sums_free(out); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = rows[3 * i], start = rows[3 * i + 1], dur = rows[3 * i + 2], end;
        Acc *a = &out->acc[s];
        if (__builtin_add_overflow(start, dur, &end)) { sums_free(out); return 1; }
        if (a->count == 0) {
            a->lo = a->hi = dur; a->first = start; a->last = end;
        } else {
            if (dur < a->lo) a->lo = dur;
            if (dur > a->hi) a->hi = dur;
            if (start < a->first) a->first = start;
            if (end > a->last) a->last = end;
        }
        a->count++;
        if (__builtin_add_overflow(a->total, dur, &a->total)) { sums_free(out); return 1; }
        int b = bit_length(dur);
        out->hist[s * bins + (b < bins ? b : bins - 1)]++;
    }
    return 0;
}

/* the histogram's bins up to its last nonzero one */
static int used_bins(const int64_t *h, int bins) {
    int used = bins;
    while (used > 0 && h[used - 1] == 0) used--;
    return used;
}

static PyObject *aggregate(PyObject *self, PyObject *args) {
    Py_buffer view;
    int bins;
    if (!PyArg_ParseTuple(args, "y*i", &view, &bins)) return NULL;
    Sums sums;
    int got = accumulate(&view, bins, &sums);
    PyBuffer_Release(&view);
    if (got) return got > 0 ? Py_NewRef(Py_None) : NULL;
    PyObject *out = PyDict_New();
    if (!out) goto done;
    for (int64_t s = 0; s < sums.slots; s++) {
        Acc *a = &sums.acc[s];
        if (!a->count) continue;
        int64_t *h = &sums.hist[s * bins];
        int used = used_bins(h, bins);
        PyObject *ht = PyTuple_New(used);
        if (!ht) { Py_CLEAR(out); goto done; }
        for (int b = 0; b < used; b++) {
            PyObject *v = PyLong_FromLongLong(h[b]);
            if (!v) { Py_DECREF(ht); Py_CLEAR(out); goto done; }
            PyTuple_SET_ITEM(ht, b, v);
        }
        PyObject *key = PyLong_FromLongLong(s);
        PyObject *value = key ? Py_BuildValue("(LLLLLLN)", (long long)a->count, (long long)a->total,
                                              (long long)a->lo, (long long)a->hi,
                                              (long long)a->first, (long long)a->last, ht)
                              : (Py_DECREF(ht), NULL);
        if (!value || PyDict_SetItem(out, key, value)) {
            Py_XDECREF(key); Py_XDECREF(value); Py_CLEAR(out); goto done;
        }
        Py_DECREF(key); Py_DECREF(value);
    }
done:
    sums_free(&sums);
    return out;
}

/* ---- protobuf writing: each span's size is worked out first, then written in place ---- */

typedef struct { unsigned char *p; Py_ssize_t len, cap; } Buf;

static int reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    unsigned char *p = PyMem_Realloc(b->p, cap);
    if (!p) { PyErr_NoMemory(); return -1; }
    b->p = p; b->cap = cap;
    return 0;
}
static inline Py_ssize_t varint_size(uint64_t v) {
    Py_ssize_t n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}
static inline unsigned char *w_varint(unsigned char *w, uint64_t v) {
    while (v >= 0x80) { *w++ = (unsigned char)((v & 0x7F) | 0x80); v >>= 7; }
    *w++ = (unsigned char)v;
    return w;
}
static inline unsigned char *w_bytes(unsigned char *w, PyObject *bytes) {
    Py_ssize_t n = PyBytes_GET_SIZE(bytes);
    memcpy(w, PyBytes_AS_STRING(bytes), n);
    return w + n;
}
static inline unsigned char *w_fixed64(unsigned char *w, unsigned char tag, uint64_t v) {
    *w++ = tag;
    for (int i = 0; i < 8; i++) *w++ = (unsigned char)(v >> (8 * i));
    return w;
}
/* an attribute KeyValue of an int value (encode.key_value(0x4A, key, v)); `key` holds the
 * KeyValue's key field (0x0A, length, key). Negative values: ten bytes, two's complement, as
 * encode._varint writes them. */
static inline Py_ssize_t int_kv_len(PyObject *key, int64_t v) {
    Py_ssize_t value = 1 + varint_size((uint64_t)v);                /* AnyValue: 0x18 varint */
    return PyBytes_GET_SIZE(key) + 1 + varint_size(value) + value;
}
static inline Py_ssize_t int_attribute_size(PyObject *key, int64_t v) {
    Py_ssize_t kv = int_kv_len(key, v);
    return 1 + varint_size(kv) + kv;
}
static inline unsigned char *w_int_attribute(unsigned char *w, PyObject *key, int64_t v) {
    *w++ = 0x4A;
    w = w_varint(w, int_kv_len(key, v));
    w = w_bytes(w, key);
    *w++ = 0x12;
    w = w_varint(w, 1 + varint_size((uint64_t)v));
    *w++ = 0x18;
    return w_varint(w, (uint64_t)v);
}
/* the histogram: an array AnyValue of int AnyValues (encode.any_value of a tuple) */
static inline Py_ssize_t hist_array_len(const int64_t *h, int used) {
    Py_ssize_t array = 0;
    for (int i = 0; i < used; i++) array += 3 + varint_size((uint64_t)h[i]);
    return array;
}
static inline Py_ssize_t hist_kv_len(PyObject *key, Py_ssize_t array) {
    Py_ssize_t value = 1 + varint_size(array) + array;                /* 0x2A len ArrayValue */
    return PyBytes_GET_SIZE(key) + 1 + varint_size(value) + value;
}
static inline unsigned char *w_hist_attribute(unsigned char *w, PyObject *key, const int64_t *h,
                                              int used, Py_ssize_t array) {
    *w++ = 0x4A;
    w = w_varint(w, hist_kv_len(key, array));
    w = w_bytes(w, key);
    *w++ = 0x12;
    w = w_varint(w, 1 + varint_size(array) + array);
    *w++ = 0x2A;
    w = w_varint(w, array);
    for (int i = 0; i < used; i++) {
        *w++ = 0x0A;
        *w++ = (unsigned char)(1 + varint_size((uint64_t)h[i]));
        *w++ = 0x18;
        w = w_varint(w, (uint64_t)h[i]);
    }
    return w;
}

enum { K_HEAD, K_TAIL, K_SAMPLED, K_COUNT, K_TOTAL, K_MIN, K_MAX, K_HIST, K_PLAN, K_STEP,
       K_MEM_DELTA, K_MEM_PEAK, K_MISSES, K_HITS, K_LAYOUT };

/* an int64 from a dict value; 1: not one (the Python path decides), -1: an exception */
static int as_int64(PyObject *v, int64_t *out) {
    if (!PyLong_CheckExact(v)) return 1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) return 1;
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

typedef struct { int64_t slot, missed; PyObject *memory, *missed_value; } Taken;

static PyObject *kernel_spans(PyObject *self, PyObject *args) {
    Py_buffer view, ids;
    int bins, sampled;
    PyObject *prefixes, *layout, *new_span_id, *memory, *misses;
    long long offset, plan_version, step;
    if (!PyArg_ParseTuple(args, "y*iO!O!y*OLLLOOp", &view, &bins, &PyList_Type, &prefixes,
                          &PyTuple_Type, &layout, &ids, &new_span_id, &offset, &plan_version,
                          &step, &memory, &misses, &sampled))
        return NULL;
    PyObject *out = NULL;
    Sums sums = {0};
    Buf buf = {0};
    Taken *taken = NULL;
    Py_ssize_t made = 0;
    int got;
    if (PyTuple_GET_SIZE(layout) != K_LAYOUT || ids.len != 24
        || (memory != Py_None && !PyDict_CheckExact(memory))
        || (misses != Py_None && !PyDict_CheckExact(misses))) {
        PyErr_SetString(PyExc_ValueError, "kernel_spans: unexpected layout, ids or dicts");
        goto done;
    }
    for (int k = 0; k < K_LAYOUT; k++)
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(layout, k))) {
            PyErr_SetString(PyExc_TypeError, "kernel_spans: the layout holds bytes");
            goto done;
        }
    got = accumulate(&view, bins, &sums);
    if (got) { if (got > 0) out = Py_NewRef(Py_None); goto done; }
    if (sums.slots > PyList_GET_SIZE(prefixes)) { out = Py_NewRef(Py_None); goto done; }
    taken = PyMem_Calloc(sums.slots ? sums.slots : 1, sizeof(Taken));
    if (!taken) { PyErr_NoMemory(); goto done; }
    const unsigned char *trace_parent = ids.buf;
    for (int64_t s = 0; s < sums.slots; s++) {
        Acc *a = &sums.acc[s];
        if (!a->count) continue;
        PyObject *prefix = PyList_GET_ITEM(prefixes, s);
        if (!PyBytes_CheckExact(prefix)) { out = Py_NewRef(Py_None); goto done; }
        PyObject *id = PyObject_CallNoArgs(new_span_id);
        if (!id) goto done;
        unsigned long long span_id = PyLong_Check(id) ? PyLong_AsUnsignedLongLong(id) : (unsigned long long)-1;
        int bad_id = !PyLong_Check(id) || (span_id == (unsigned long long)-1 && PyErr_Occurred());
        Py_DECREF(id);
        if (bad_id) { PyErr_Clear(); out = Py_NewRef(Py_None); goto done; }   /* to_bytes(8) fails too */
        PyObject *key = PyLong_FromLongLong(s);
        if (!key) goto done;
        Taken *t = &taken[made];
        t->slot = s;
        t->memory = memory == Py_None ? NULL : PyDict_GetItemWithError(memory, key);
        t->missed_value = (t->memory == NULL && PyErr_Occurred()) ? NULL
                        : misses == Py_None ? NULL : PyDict_GetItemWithError(misses, key);
        Py_DECREF(key);
        if (PyErr_Occurred()) goto done;
        int64_t delta = 0, peak = 0, missed = 0;
        t->missed = 0;
        if (t->memory) {
            if (!PyTuple_CheckExact(t->memory) || PyTuple_GET_SIZE(t->memory) != 2) {
                out = Py_NewRef(Py_None); goto done;
            }
            int r = as_int64(PyTuple_GET_ITEM(t->memory, 0), &delta);
            if (!r) r = as_int64(PyTuple_GET_ITEM(t->memory, 1), &peak);
            if (r) { if (r > 0) out = Py_NewRef(Py_None); goto done; }
        }
        if (t->missed_value) {
            int r = as_int64(t->missed_value, &missed);
            if (r) { if (r > 0) out = Py_NewRef(Py_None); goto done; }
            t->missed = missed;
        }
        /* the Span message, as encode._span writes it for this ReadableSpan (whose times it
         * packs as unsigned 64-bit: it declines others, and so does this) */
        int64_t start, end;
        if (__builtin_add_overflow(a->first, (int64_t)offset, &start)
            || __builtin_add_overflow(a->last, (int64_t)offset, &end) || start < 0 || end < 0) {
            out = Py_NewRef(Py_None); goto done;
        }
        int64_t *h = &sums.hist[s * bins];
        int used = used_bins(h, bins);
        Py_ssize_t array = hist_array_len(h, used);
        PyObject **k = &PyTuple_GET_ITEM(layout, 0);
        int with_misses = misses != Py_None;
        Py_ssize_t size = 38 + PyBytes_GET_SIZE(k[K_HEAD]) + (start ? 9 : 0) + (end ? 9 : 0)
            + PyBytes_GET_SIZE(prefix) + int_attribute_size(k[K_COUNT], a->count)
            + int_attribute_size(k[K_TOTAL], a->total) + int_attribute_size(k[K_MIN], a->lo)
            + int_attribute_size(k[K_MAX], a->hi)
            + 1 + varint_size(hist_kv_len(k[K_HIST], array)) + hist_kv_len(k[K_HIST], array)
            + int_attribute_size(k[K_PLAN], plan_version) + int_attribute_size(k[K_STEP], step)
            + (t->memory ? int_attribute_size(k[K_MEM_DELTA], delta)
                           + int_attribute_size(k[K_MEM_PEAK], peak) : 0)
            + (with_misses ? int_attribute_size(k[K_MISSES], missed)
                             + int_attribute_size(k[K_HITS], a->count - missed) : 0)
            + (sampled ? PyBytes_GET_SIZE(k[K_SAMPLED]) : 0) + PyBytes_GET_SIZE(k[K_TAIL]);
        if (reserve(&buf, 1 + varint_size(size) + size)) goto done;
        unsigned char *w = buf.p + buf.len, *begin;
        *w++ = 0x12;
        w = w_varint(w, size);
        begin = w;
        *w++ = 0x0A; *w++ = 0x10;
        memcpy(w, trace_parent, 16); w += 16;
        *w++ = 0x12; *w++ = 0x08;
        for (int i = 0; i < 8; i++) *w++ = (unsigned char)(span_id >> (8 * (7 - i)));
        *w++ = 0x22; *w++ = 0x08;
        memcpy(w, trace_parent + 16, 8); w += 8;
        w = w_bytes(w, k[K_HEAD]);
        if (start) w = w_fixed64(w, 0x39, (uint64_t)start);
        if (end) w = w_fixed64(w, 0x41, (uint64_t)end);
        w = w_bytes(w, prefix);
        w = w_int_attribute(w, k[K_COUNT], a->count);
        w = w_int_attribute(w, k[K_TOTAL], a->total);
        w = w_int_attribute(w, k[K_MIN], a->lo);
        w = w_int_attribute(w, k[K_MAX], a->hi);
        w = w_hist_attribute(w, k[K_HIST], h, used, array);
        w = w_int_attribute(w, k[K_PLAN], plan_version);
        w = w_int_attribute(w, k[K_STEP], step);
        if (t->memory) {
            w = w_int_attribute(w, k[K_MEM_DELTA], delta);
            w = w_int_attribute(w, k[K_MEM_PEAK], peak);
        }
        if (with_misses) {
            w = w_int_attribute(w, k[K_MISSES], missed);
            w = w_int_attribute(w, k[K_HITS], a->count - missed);
        }
        if (sampled) w = w_bytes(w, k[K_SAMPLED]);
        w = w_bytes(w, k[K_TAIL]);
        if (w - begin != size) {
            PyErr_SetString(PyExc_SystemError, "kernel_spans: a span's size was miscounted");
            goto done;
        }
        buf.len = w - buf.p;
        made++;
    }
    /* written: now the carried memory readings and build misses are taken, and the totals made */
    /* the run's totals count the forward calls only (misses is None for the backward's) */
    PyObject *totals = PyList_New(misses == Py_None ? 0 : made);
    if (!totals) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(totals); i++) {
        Taken *t = &taken[i];
        Acc *a = &sums.acc[t->slot];
        PyObject *row = Py_BuildValue("(LLLL)", (long long)t->slot, (long long)a->count,
                                      (long long)a->total, (long long)t->missed);
        if (!row) { Py_DECREF(totals); goto done; }
        PyList_SET_ITEM(totals, i, row);
    }
    for (Py_ssize_t i = 0; i < made; i++) {
        PyObject *key = PyLong_FromLongLong(taken[i].slot);
        if (!key) { Py_DECREF(totals); goto done; }
        int failed = (taken[i].memory && PyDict_DelItem(memory, key))
                     || (taken[i].missed_value && PyDict_DelItem(misses, key));
        Py_DECREF(key);
        if (failed) { Py_DECREF(totals); goto done; }
    }
    out = Py_BuildValue("(y#nN)", (const char *)buf.p, buf.len, made, totals);
done:
    sums_free(&sums);
    PyMem_Free(taken);
    PyMem_Free(buf.p);
    PyBuffer_Release(&view);
    PyBuffer_Release(&ids);
    return out;
}

static PyMethodDef methods[] = {
    {"aggregate", aggregate, METH_VARARGS,
     "aggregate(calls, bins) -> {slot: (count, total, min, max, first, last, hist)} or None"},
    {"kernel_spans", kernel_spans, METH_VARARGS,
     "kernel_spans(calls, bins, prefixes, layout, trace_parent, new_span_id, offset, plan_version, "
     "step, memory, misses, sampled) -> (span fields, spans, [(slot, count, total, missed)]) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_aggregate", NULL, -1, methods};

PyMODINIT_FUNC PyInit__aggregate(void) { return PyModule_Create(&module); }
