/* A step's call records -> per-slot aggregates, for the export thread's kernel spans.
 *
 * aggregate(calls, bins) reads flat int64 (slot, start_ns, duration_ns) triples from any
 * contiguous buffer and returns {slot: (count, total, min, max, first start, last end, hist)}
 * in slot order: what rtxops/telemetry/spans.py's _aggregate_loop returns (hist: counts of the
 * durations' bit lengths, capped at bins - 1, trailing zeros cut). None -- the caller adds up
 * in Python -- for what it does not take: a slot outside [0, MAX_SLOT), a sum past int64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_SLOT (1 << 16)
#define MAX_BINS 64

typedef struct { int64_t count, total, lo, hi, first, last; } Acc;

static int bit_length(int64_t v) {
    return v > 0 ? 64 - __builtin_clzll((uint64_t)v) : 0;
}

static PyObject *aggregate(PyObject *self, PyObject *args) {
    Py_buffer view;
    int bins;
    if (!PyArg_ParseTuple(args, "y*i", &view, &bins)) return NULL;
    PyObject *out = NULL;
    Acc *acc = NULL;
    int64_t *hist = NULL;
    if (bins < 1 || bins > MAX_BINS || view.len % (3 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "expected int64 triples and 1..64 bins");
        goto done;
    }
    const int64_t *rows = (const int64_t *)view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)(3 * sizeof(int64_t));
    int64_t slots = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = rows[3 * i];
        if (s < 0 || s >= MAX_SLOT) { out = Py_NewRef(Py_None); goto done; }
        if (s + 1 > slots) slots = s + 1;
    }
    acc = calloc(slots ? slots : 1, sizeof(Acc));
    hist = calloc((slots ? slots : 1) * bins, sizeof(int64_t));
    if (!acc || !hist) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = rows[3 * i], start = rows[3 * i + 1], dur = rows[3 * i + 2], end;
        Acc *a = &acc[s];
        if (__builtin_add_overflow(start, dur, &end)) { out = Py_NewRef(Py_None); goto done; }
        if (a->count == 0) {
            a->lo = a->hi = dur; a->first = start; a->last = end;
        } else {
            if (dur < a->lo) a->lo = dur;
            if (dur > a->hi) a->hi = dur;
            if (start < a->first) a->first = start;
            if (end > a->last) a->last = end;
        }
        a->count++;
        if (__builtin_add_overflow(a->total, dur, &a->total)) { out = Py_NewRef(Py_None); goto done; }
        int b = bit_length(dur);
        hist[s * bins + (b < bins ? b : bins - 1)]++;
    }
    out = PyDict_New();
    if (!out) goto done;
    for (int64_t s = 0; s < slots; s++) {
        Acc *a = &acc[s];
        if (!a->count) continue;
        int64_t *h = &hist[s * bins];
        int used = bins;
        while (used > 0 && h[used - 1] == 0) used--;
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
    free(acc);
    free(hist);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"aggregate", aggregate, METH_VARARGS,
     "aggregate(calls, bins) -> {slot: (count, total, min, max, first, last, hist)} or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_aggregate", NULL, -1, methods};

PyMODINIT_FUNC PyInit__aggregate(void) { return PyModule_Create(&module); }
