/* The recorder's call buffer: what rtxops/telemetry/recorder.py's _make_buffer makes in Python,
 * with record() a C method, so that a routed call costs no Python frame to record.
 *
 * CallBuffer(capacity, on_full=None, every_ns=None) holds capacity (slot, start_ns, duration_ns)
 * int64 triples. record(slot, start_ns, duration_ns) stores one (record_since(slot, start_ns):
 * one that ends now, the clock read in C); a call that finds the buffer full, or that starts
 * every_ns after the last take(), first has on_full() empty it (through take()); one that
 * finds it full again (on_full failed, or is the caller) is dropped and counted. take() ->
 * (array('q') of the triples stored, records dropped), and starts over.
 * stop_timer() ends the every_ns hand-overs. Pickled, it is an empty one with no on_full: a
 * wrapper shipped to another process (dispatcher._Live) takes record() with it, not the calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

#define NEVER INT64_MAX

typedef struct {
    PyObject_HEAD
    int64_t *buf;
    Py_ssize_t pos, limit;   /* in int64s */
    int64_t dropped;
    int64_t every_ns, due;   /* every_ns < 0: no timer */
    int emptying;
    PyObject *on_full;       /* or NULL */
} CallBuffer;

static PyObject *array_type;   /* array.array */

static int64_t now_ns(void) {   /* time.perf_counter_ns()'s clock on Linux */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int CallBuffer_init(CallBuffer *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"capacity", "on_full", "every_ns", NULL};
    Py_ssize_t capacity;
    PyObject *on_full = Py_None, *every = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|OO", names, &capacity, &on_full, &every))
        return -1;
    if (capacity < 0 || capacity > PY_SSIZE_T_MAX / (3 * (Py_ssize_t)sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "capacity out of range");
        return -1;
    }
    int64_t every_ns = -1;
    if (every != Py_None) {
        every_ns = PyLong_AsLongLong(every);
        if (every_ns == -1 && PyErr_Occurred()) return -1;
        if (every_ns < 0) {
            PyErr_SetString(PyExc_ValueError, "every_ns must be >= 0");
            return -1;
        }
    }
    PyMem_Free(self->buf);
    self->buf = PyMem_Calloc(capacity ? (size_t)capacity * 3 : 1, sizeof(int64_t));
    if (!self->buf) { PyErr_NoMemory(); return -1; }
    self->pos = 0;
    self->limit = capacity * 3;
    self->dropped = 0;
    self->emptying = 0;
    Py_XSETREF(self->on_full, on_full == Py_None ? NULL : Py_NewRef(on_full));
    if (self->on_full == NULL) every_ns = -1;
    self->every_ns = every_ns;
    self->due = every_ns < 0 ? NEVER : now_ns() + every_ns;
    return 0;
}

/* on_full() empties the buffer if it can; whatever it raises is not the job's failure */
static void make_room(CallBuffer *self) {
    if (self->on_full == NULL || self->emptying) return;
    self->emptying = 1;
    PyObject *r = PyObject_CallNoArgs(self->on_full);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    self->emptying = 0;
}

static PyObject *store(CallBuffer *self, int64_t slot, int64_t start_ns, int64_t duration_ns) {
    if (self->pos >= self->limit || start_ns >= self->due) {
        make_room(self);
        if (self->pos >= self->limit) {
            self->dropped++;
            Py_RETURN_NONE;
        }
    }
    int64_t *row = self->buf + self->pos;
    row[0] = slot; row[1] = start_ns; row[2] = duration_ns;
    self->pos += 3;
    Py_RETURN_NONE;
}

/* args[0..n) as int64s into v; -1 with a Python error set where one is not */
static int as_int64s(PyObject *const *args, int n, int64_t *v) {
    for (int i = 0; i < n; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *CallBuffer_record(CallBuffer *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[3];
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "record(slot, start_ns, duration_ns)");
        return NULL;
    }
    if (as_int64s(args, 3, v) < 0) return NULL;
    return store(self, v[0], v[1], v[2]);
}

/* record_since(slot, start_ns): record(slot, start_ns, now - start_ns) with the clock read here
 * (a routed call's end: one C call where reading the clock and recording were two) */
static PyObject *CallBuffer_record_since(CallBuffer *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t now = now_ns(), v[2];
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "record_since(slot, start_ns)");
        return NULL;
    }
    if (as_int64s(args, 2, v) < 0) return NULL;
    return store(self, v[0], v[1], now - v[1]);
}

static PyObject *CallBuffer_take(CallBuffer *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *calls = PyObject_CallFunction(array_type, "sy#", "q", (const char *)self->buf,
                                            (Py_ssize_t)(self->pos * sizeof(int64_t)));
    if (calls == NULL) return NULL;
    PyObject *out = Py_BuildValue("(NL)", calls, (long long)self->dropped);
    if (out == NULL) return NULL;
    self->pos = 0;
    self->dropped = 0;
    if (self->every_ns >= 0) self->due = now_ns() + self->every_ns;
    return out;
}

static PyObject *CallBuffer_stop_timer(CallBuffer *self, PyObject *Py_UNUSED(ignored)) {
    self->every_ns = -1;
    self->due = NEVER;
    Py_RETURN_NONE;
}

static PyObject *CallBuffer_reduce(CallBuffer *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(O(n))", (PyObject *)Py_TYPE(self), (Py_ssize_t)0);
}

static int CallBuffer_traverse(CallBuffer *self, visitproc visit, void *arg) {
    Py_VISIT(self->on_full);
    return 0;
}

static int CallBuffer_clear(CallBuffer *self) {
    Py_CLEAR(self->on_full);
    return 0;
}

static void CallBuffer_dealloc(CallBuffer *self) {
    PyObject_GC_UnTrack(self);
    CallBuffer_clear(self);
    PyMem_Free(self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef CallBuffer_methods[] = {
    {"record", (PyCFunction)(void (*)(void))CallBuffer_record, METH_FASTCALL,
     "record(slot, start_ns, duration_ns): one call's record"},
    {"record_since", (PyCFunction)(void (*)(void))CallBuffer_record_since, METH_FASTCALL,
     "record_since(slot, start_ns): one call's record, from start_ns to now"},
    {"take", (PyCFunction)CallBuffer_take, METH_NOARGS,
     "take() -> (array('q') of the records since the last take, records dropped)"},
    {"stop_timer", (PyCFunction)CallBuffer_stop_timer, METH_NOARGS,
     "stop_timer(): no more hand-overs every every_ns"},
    {"__reduce__", (PyCFunction)CallBuffer_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CallBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rtxops.telemetry._call_buffer.CallBuffer",
    .tp_basicsize = sizeof(CallBuffer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Preallocated (slot, start_ns, duration_ns) records; see the module's docstring.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)CallBuffer_init,
    .tp_dealloc = (destructor)CallBuffer_dealloc,
    .tp_traverse = (traverseproc)CallBuffer_traverse,
    .tp_clear = (inquiry)CallBuffer_clear,
    .tp_methods = CallBuffer_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_call_buffer",
    "The recorder's call buffer, record() in C (see recorder.py's _make_buffer).", -1, NULL,
};

PyMODINIT_FUNC PyInit__call_buffer(void) {
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) return NULL;
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (array_type == NULL) return NULL;
    if (PyType_Ready(&CallBufferType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "CallBuffer", (PyObject *)&CallBufferType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
