/* The store loop's repeated ADD, compiled (gpucoll/store/_native.py builds it on first use).
 *
 * serve(events, i, conns, data, rbuf, heads) walks the poller's events from index i and
 * serves each connection whose read is the connection's last ADD frame again, on a counter
 * holding decimal text, exactly as StoreServer._run's Python loop does: the same tests, in
 * the same order, the same reply. It returns (i, code, x, y) at the first event it leaves
 * to Python, or at the end (code DONE):
 *   OTHER   events[i] is not a connection (a listener, the wake-up);
 *   EVENT   not a plain readable connection (nothing read): StoreServer._on_event;
 *   INPUT   x bytes were read into rbuf and are not a repeated ADD: StoreServer._on_input;
 *   DROP    the peer closed, or a read or send failed: StoreServer._drop;
 *   PARTIAL the reply x was sent only up to byte y: the rest is queued.
 * It holds the GIL throughout: its reads and sends never block (MSG_DONTWAIT). It raises
 * nothing for one event: a failed call into Python's objects hands the event over instead
 * (EVENT before the read, INPUT after it, with nothing changed). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

enum { DONE = 0, OTHER = 1, EVENT = 2, INPUT = 3, DROP = 4, PARTIAL = 5 };

static PyObject *s_authed, *s_flags[5], *s_none[2], *s_last_add;

/* The counter text this module wrote last, and its value: a counter holding that very object
 * is not parsed again. A strong reference, so the object cannot be freed and its address
 * reused. Shared by every server of the process, all of which call in holding the GIL. */
static PyObject *hot_text = NULL;
static long long hot_value = 0;

static PyObject *result(Py_ssize_t i, int code, Py_ssize_t n) {
    return Py_BuildValue("(nini)", i, code, n, 0);
}

/* 1: the connection must go to Python before any read; 0: it may be read here. */
static int not_plain(PyObject *conn) {
    PyObject *v = PyObject_GetAttr(conn, s_authed);
    if (!v) goto fail;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (t != 1) goto fail_or_true;
    for (int k = 0; k < 5; k++) {  /* closing, later, inbuf, out, writing: each must be false */
        v = PyObject_GetAttr(conn, s_flags[k]);
        if (!v) goto fail;
        t = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (t != 0) goto fail_or_true;
    }
    for (int k = 0; k < 2; k++) {  /* big, waiter: each must be None */
        v = PyObject_GetAttr(conn, s_none[k]);
        if (!v) goto fail;
        t = v != Py_None;
        Py_DECREF(v);
        if (t) return 1;
    }
    return 0;
fail_or_true:
    if (t >= 0) return 1;
fail:
    PyErr_Clear();
    return 1;
}

/* The new counter text, or NULL (with no error set) to leave the frame to Python. */
static PyObject *add_in_place(PyObject *conn, PyObject *data, Py_ssize_t n, const char *buf,
                              Py_ssize_t heads_n, long long *out_value) {
    PyObject *la = PyObject_GetAttr(conn, s_last_add), *total = NULL;
    if (!la) goto fail;
    if (!PyTuple_CheckExact(la) || PyTuple_GET_SIZE(la) != 4) goto done;
    PyObject *frame = PyTuple_GET_ITEM(la, 0), *key = PyTuple_GET_ITEM(la, 2);
    if (!PyBytes_CheckExact(frame) || !PyBytes_CheckExact(key)) goto done;
    Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(la, 1));
    if (size == -1 && PyErr_Occurred()) goto fail;
    Py_ssize_t flen = PyBytes_GET_SIZE(frame);
    if (n != size || flen > n || memcmp(buf, PyBytes_AS_STRING(frame), (size_t)flen) != 0) goto done;
    int overflow = 0;
    long long amount = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(la, 3), &overflow);
    if (PyErr_Occurred()) goto fail;
    if (overflow) goto done;
    PyObject *current = PyDict_GetItemWithError(data, key);  /* borrowed */
    if (!current) goto fail;  /* deleted (or an error): the general path adds it anew */
    long long value;
    if (current == hot_text) {
        value = hot_value;
    } else {
        /* Only plain decimal text of at most 18 digits (no sign but '-', no spaces, no
         * underscores): anything else goes to the general path, which reads it as int(). */
        if (!PyBytes_CheckExact(current)) goto done;
        Py_ssize_t len = PyBytes_GET_SIZE(current), j = 0;
        const char *c = PyBytes_AS_STRING(current);
        int neg = len > 0 && c[0] == '-';
        j = neg;
        if (len - j < 1 || len - j > 18) goto done;
        value = 0;
        for (; j < len; j++) {
            if (c[j] < '0' || c[j] > '9') goto done;
            value = value * 10 + (c[j] - '0');
        }
        if (neg) value = -value;
    }
    if (__builtin_add_overflow(value, amount, &value)) goto done;
    char text[32];
    int tl = snprintf(text, sizeof text, "%lld", value);
    if (tl < 0 || tl >= heads_n) goto done;
    total = PyBytes_FromStringAndSize(text, tl);
    if (!total) goto fail;
    if (PyDict_SetItem(data, key, total) < 0) { Py_CLEAR(total); goto fail; }
    Py_INCREF(total);
    Py_XSETREF(hot_text, total);
    hot_value = value;
    *out_value = value;
    goto done;
fail:
    PyErr_Clear();
done:
    Py_XDECREF(la);
    return total;  /* a new reference, or NULL */
}

static PyObject *serve(PyObject *self, PyObject *args) {
    PyObject *events, *conns, *data, *rbuf, *heads;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "O!nO!O!O!O!", &PyList_Type, &events, &i, &PyDict_Type, &conns,
                          &PyDict_Type, &data, &PyByteArray_Type, &rbuf, &PyTuple_Type, &heads))
        return NULL;
    Py_ssize_t nev = PyList_GET_SIZE(events), heads_n = PyTuple_GET_SIZE(heads);
    for (; i < nev; i++) {
        PyObject *item = PyList_GET_ITEM(events, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) return result(i, EVENT, 0);
        PyObject *pfd = PyTuple_GET_ITEM(item, 0);
        PyObject *conn = PyDict_GetItemWithError(conns, pfd);  /* borrowed */
        if (!conn) { PyErr_Clear(); return result(i, OTHER, 0); }
        long ev = PyLong_AsLong(PyTuple_GET_ITEM(item, 1));
        long fd = PyLong_AsLong(pfd);
        if (PyErr_Occurred()) { PyErr_Clear(); return result(i, EVENT, 0); }
        if (ev != 1 /* EPOLLIN alone */ || not_plain(conn)) return result(i, EVENT, 0);
        char *buf = PyByteArray_AS_STRING(rbuf);
        ssize_t n;
        do n = recv((int)fd, buf, (size_t)PyByteArray_GET_SIZE(rbuf), MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;  /* nothing after all */
        if (n <= 0) return result(i, DROP, 0);
        long long value = 0;
        PyObject *total = add_in_place(conn, data, n, buf, heads_n, &value);
        if (!total) return result(i, INPUT, n);
        PyObject *head = PyTuple_GET_ITEM(heads, PyBytes_GET_SIZE(total));
        char out[96];
        Py_ssize_t hl = PyBytes_GET_SIZE(head), tl = PyBytes_GET_SIZE(total);
        if (!PyBytes_CheckExact(head) || hl + tl > (Py_ssize_t)sizeof out) {  /* not OK_HEADS */
            Py_DECREF(total);
            return result(i, DROP, 0);
        }
        memcpy(out, PyBytes_AS_STRING(head), (size_t)hl);
        memcpy(out + hl, PyBytes_AS_STRING(total), (size_t)tl);
        Py_DECREF(total);
        ssize_t sent;
        do sent = send((int)fd, out, (size_t)(hl + tl), MSG_DONTWAIT | MSG_NOSIGNAL);
        while (sent < 0 && errno == EINTR);
        if (sent < 0) return result(i, DROP, 0);  /* as the Python loop: its send raised */
        if (sent != hl + tl) {
            PyObject *reply = PyBytes_FromStringAndSize(out, hl + tl);
            if (!reply) { PyErr_Clear(); return result(i, DROP, 0); }
            return Py_BuildValue("(niNn)", i, PARTIAL, reply, (Py_ssize_t)sent);
        }
    }
    return result(i, DONE, 0);
}

static PyMethodDef methods[] = {
    {"serve", serve, METH_VARARGS, "Serve the repeated ADDs of events[i:] (see the source's head)."},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gpucoll_store_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gpucoll_store_native(void) {
    static const char *flags[5] = {"closing", "later", "inbuf", "out", "writing"};
    static const char *none[2] = {"big", "waiter"};
    if (!(s_authed = PyUnicode_InternFromString("authed"))) return NULL;
    if (!(s_last_add = PyUnicode_InternFromString("last_add"))) return NULL;
    for (int k = 0; k < 5; k++) if (!(s_flags[k] = PyUnicode_InternFromString(flags[k]))) return NULL;
    for (int k = 0; k < 2; k++) if (!(s_none[k] = PyUnicode_InternFromString(none[k]))) return NULL;
    return PyModule_Create(&module);
}
