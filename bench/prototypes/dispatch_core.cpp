// A prototype, not part of rtxops: the routing of one function site (``F.linear``) done in C++
// where the runtime does it in Python, to measure what a native dispatch core would save a call
// (``bench/dispatch_core_prototype.py``, issue #3). What it leaves out (keyword arguments,
// scalar arguments, a route's on_error, the module class sites, keeping its table in step with
// the site's routes) is what a real one has to add.
//
// call(*args): a signature of the call (each argument None or a plain tensor or parameter:
// dtype, device, requires_grad, sizes, strides; grad mode and autocast), its route looked up in
// a table filled by insert(); a hit times the route's function and records it through the
// recorder's record_since(slot, t0); anything else goes to the Python wrapper (fallback).
#include <Python.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <time.h>

#include <unordered_map>
#include <vector>

namespace {

struct Entry {
  PyObject* fn;
  long slot;
  std::vector<int64_t> signature;
};

std::unordered_map<uint64_t, Entry> routes;
PyObject* record_since = nullptr;
PyObject* fallback = nullptr;
PyTypeObject* parameter_type = nullptr;

int64_t now_ns() {  // time.perf_counter_ns()'s clock on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// False: a call the prototype does not describe (the Python wrapper takes it).
bool describe(PyObject* const* args, Py_ssize_t n, std::vector<int64_t>& out) {
  out.clear();
  out.push_back(n);
  out.push_back(c10::GradMode::is_enabled());
  out.push_back(at::autocast::is_autocast_enabled(at::kCPU));
  out.push_back(at::autocast::is_autocast_enabled(at::kCUDA));
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* a = args[i];
    if (a == Py_None) {
      out.push_back(-1);
      continue;
    }
    bool parameter = Py_TYPE(a) == parameter_type;
    if (!parameter && !THPVariable_CheckExact(a)) return false;
    const at::Tensor& t = THPVariable_Unpack(a);
    if (t.layout() != at::kStrided || t.is_nested()) return false;
    out.push_back(parameter);
    out.push_back(static_cast<int64_t>(t.scalar_type()));
    out.push_back(static_cast<int64_t>(t.device().type()) * 1000 + t.device().index());
    out.push_back(t.requires_grad());
    out.push_back(static_cast<int64_t>(t.dim()));
    for (int64_t s : t.sizes()) out.push_back(s);
    for (int64_t s : t.strides()) out.push_back(s);
  }
  return true;
}

uint64_t hash_of(const std::vector<int64_t>& signature) {  // FNV-1a over the words
  uint64_t h = 1469598103934665603ULL;
  for (int64_t v : signature) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ULL;
  }
  return h;
}

std::vector<int64_t> scratch;  // the GIL guards it

PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!describe(args, nargs, scratch)) return PyObject_Vectorcall(fallback, args, nargs, nullptr);
  auto it = routes.find(hash_of(scratch));
  if (it == routes.end() || it->second.signature != scratch)
    return PyObject_Vectorcall(fallback, args, nargs, nullptr);
  const Entry& e = it->second;
  int64_t t0 = now_ns();
  PyObject* out = PyObject_Vectorcall(e.fn, args, nargs, nullptr);
  if (out == nullptr || e.slot < 0) return out;
  PyObject* record_args[2] = {PyLong_FromLong(e.slot), PyLong_FromLongLong(t0)};
  PyObject* recorded = nullptr;
  if (record_args[0] && record_args[1])
    recorded = PyObject_Vectorcall(record_since, record_args, 2, nullptr);
  Py_XDECREF(record_args[0]);
  Py_XDECREF(record_args[1]);
  if (recorded == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  Py_DECREF(recorded);
  return out;
}

// insert(args, fn, slot): route calls shaped like ``args`` to ``fn``, recorded under ``slot``.
PyObject* insert(PyObject*, PyObject* a) {
  PyObject *call_args, *fn;
  long slot;
  if (!PyArg_ParseTuple(a, "O!Ol", &PyTuple_Type, &call_args, &fn, &slot)) return nullptr;
  std::vector<int64_t> signature;
  if (!describe(&PyTuple_GET_ITEM(call_args, 0), PyTuple_GET_SIZE(call_args), signature))
    Py_RETURN_FALSE;
  Py_INCREF(fn);
  routes[hash_of(signature)] = Entry{fn, slot, signature};
  Py_RETURN_TRUE;
}

// setup(record_since, fallback, parameter_type)
PyObject* setup(PyObject*, PyObject* a) {
  PyObject *record, *python_path, *parameter;
  if (!PyArg_ParseTuple(a, "OOO!", &record, &python_path, &PyType_Type, &parameter)) return nullptr;
  Py_INCREF(record);
  Py_INCREF(python_path);
  Py_INCREF(parameter);
  record_since = record;
  fallback = python_path;
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call)), METH_FASTCALL, ""},
    {"insert", insert, METH_VARARGS, ""},
    {"setup", setup, METH_VARARGS, ""},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dispatch_core_prototype", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__dispatch_core_prototype(void) { return PyModule_Create(&module); }
