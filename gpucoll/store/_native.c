/* The store loop's repeated ADD, compiled (gpucoll/store/_native.py builds it on first use).
 *
 * run(epfd, timeout, conns, data, rbuf, heads) waits on the server's epoll set (the GIL
 * released, as Python's poll does) and serves each connection whose read is the
 * connection's last ADD frame again, on a counter holding decimal text, exactly as
 * StoreServer._run's Python loop does: the same tests, in the same order, the same reply.
 * It waits again while every event was served here and the timeout (seconds; negative:
 * none) has not passed, and returns (events, kind, fd, x) at the first event it leaves to
 * Python: events are the poller's (fd, ev) pairs still to serve, as poll() gives them, and
 * kind says what Python does first:
 *   NONE    nothing (events[0], if any, has not been read);
 *   INPUT   x bytes were read from fd into rbuf and are not a repeated ADD: _on_input;
 *   PARTIAL the reply to fd went out only in part: x is the rest, to queue.
 * A connection that is not a plain readable one, that the peer closed or whose read
 * failed, and a descriptor that is not a connection (a listener, the wake-up) are left
 * unread in events: Python reads them again and finds the same. The GIL is held while
 * serving: reads and sends never block (MSG_DONTWAIT). A failed call into Python's objects
 * hands the event over instead (unread, or INPUT with nothing changed); only a failed
 * epoll_wait other than EINTR raises (OSError). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>

enum { NONE = 0, INPUT = 1, PARTIAL = 2 };
#define MAX_EVENTS 256

/* The counter text this module wrote last, and its value: a counter holding that very object
 * is not parsed again. A strong reference, so the object cannot be freed and its address
 * reused. Shared by every server of the process, all of which call in holding the GIL. */
static PyObject *hot_text = NULL;
static long long hot_value = 0;

/* Where the connection class keeps each attribute this reads (its __slots__): found once
 * per class from the class's member descriptors, so that a read is a load, not a look-up.
 * A class without them (not gpucoll's Conn) is read with PyObject_GetAttr. */
enum { A_AUTHED, A_CLOSING, A_LATER, A_INBUF, A_OUT, A_WRITING, A_BIG, A_WAITER, A_LAST_ADD, N_ATTRS };
static PyTypeObject *slots_of = NULL;  /* a strong reference: the class cannot be replaced at its address */
static Py_ssize_t offsets[N_ATTRS];

static const char *const ATTR_NAMES[N_ATTRS] = {"authed", "closing", "later", "inbuf", "out", "writing",
                                                "big", "waiter", "last_add"};
static PyObject *attr_names[N_ATTRS];  /* interned at the module's import */

static int find_slots(PyTypeObject *type) {
    Py_ssize_t found[N_ATTRS];
    for (int k = 0; k < N_ATTRS; k++) {
        PyObject *d = PyObject_GetAttr((PyObject *)type, attr_names[k]);  /* the class's descriptor */
        if (!d) { PyErr_Clear(); return 0; }
        int ok = Py_TYPE(d) == &PyMemberDescr_Type && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX
                 && ((PyMemberDescrObject *)d)->d_common.d_type == type;
        if (ok) found[k] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        if (!ok) return 0;
    }
    memcpy(offsets, found, sizeof offsets);
    Py_INCREF(type);
    Py_XSETREF(slots_of, type);
    return 1;
}

/* A new reference to conn's attribute k, or NULL (an error set). */
static PyObject *attr(PyObject *conn, int k) {
    if (Py_TYPE(conn) == slots_of || (!slots_of && find_slots(Py_TYPE(conn)))) {
        PyObject *v = *(PyObject **)((char *)conn + offsets[k]);
        if (!v) { PyErr_SetObject(PyExc_AttributeError, attr_names[k]); return NULL; }
        Py_INCREF(v);
        return v;
    }
    return PyObject_GetAttr(conn, attr_names[k]);
}

/* 1: the connection must go to Python before any read; 0: it may be read here. */
static int not_plain(PyObject *conn) {
    int t = 1;
    for (int k = A_AUTHED; k <= A_WAITER; k++) {
        PyObject *v = attr(conn, k);
        if (!v) { PyErr_Clear(); return 1; }
        if (k >= A_BIG) t = v != Py_None;  /* big, waiter: each must be None */
        else t = PyObject_IsTrue(v) != (k == A_AUTHED);  /* authed true; closing..writing false */
        Py_DECREF(v);
        if (t) { PyErr_Clear(); return 1; }
    }
    return 0;
}

/* The new counter text, or NULL (with no error set) to leave the frame to Python. */
static PyObject *add_in_place(PyObject *conn, PyObject *data, Py_ssize_t n, const char *buf,
                              Py_ssize_t heads_n) {
    PyObject *la = attr(conn, A_LAST_ADD), *total = NULL;
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
    goto done;
fail:
    PyErr_Clear();
done:
    Py_XDECREF(la);
    return total;  /* a new reference, or NULL */
}

/* The poller's events[from:n) as poll() gives them, and what Python does first. */
static PyObject *hand_over(struct epoll_event *evs, int from, int n, int kind, int fd, PyObject *x) {
    PyObject *list = PyList_New(n - from);
    if (!list) { Py_XDECREF(x); return NULL; }
    for (int k = from; k < n; k++) {
        PyObject *pair = Py_BuildValue("(iI)", evs[k].data.fd, (unsigned)evs[k].events);
        if (!pair) { Py_DECREF(list); Py_XDECREF(x); return NULL; }
        PyList_SET_ITEM(list, k - from, pair);
    }
    if (!x) { Py_INCREF(Py_None); x = Py_None; }
    return Py_BuildValue("(NiiN)", list, kind, fd, x);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static PyObject *run(PyObject *self, PyObject *args) {
    int epfd;
    double timeout;
    PyObject *conns, *data, *rbuf, *heads;
    if (!PyArg_ParseTuple(args, "idO!O!O!O!", &epfd, &timeout, &PyDict_Type, &conns, &PyDict_Type, &data,
                          &PyByteArray_Type, &rbuf, &PyTuple_Type, &heads))
        return NULL;
    Py_ssize_t heads_n = PyTuple_GET_SIZE(heads);
    for (Py_ssize_t k = 0; k < heads_n; k++) {  /* OK_HEADS: one short bytes per counter size */
        PyObject *h = PyTuple_GET_ITEM(heads, k);
        if (!PyBytes_CheckExact(h) || PyBytes_GET_SIZE(h) > 64 || heads_n > 32) {
            PyErr_SetString(PyExc_TypeError, "heads: at most 32 bytes objects of at most 64 bytes");
            return NULL;
        }
    }
    double deadline = timeout >= 0 ? now() + timeout : 0;
    struct epoll_event evs[MAX_EVENTS];
    for (int first = 1;; first = 0) {
        int ms = -1;
        if (timeout >= 0) {
            double left = deadline - now();
            if (left <= 0 && !first) return hand_over(evs, 0, 0, NONE, -1, NULL);
            ms = left <= 0 ? 0 : left > 2e6 ? 2000000000 : (int)(left * 1000.0 + 0.999);  /* rounded up */
        }
        int n;
        Py_BEGIN_ALLOW_THREADS
        n = epoll_wait(epfd, evs, MAX_EVENTS, ms);
        Py_END_ALLOW_THREADS
        if (n < 0) {
            if (errno == EINTR) return hand_over(evs, 0, 0, NONE, -1, NULL);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (n == 0) return hand_over(evs, 0, 0, NONE, -1, NULL);
        for (int k = 0; k < n; k++) {
            int fd = evs[k].data.fd;
            PyObject *pfd = PyLong_FromLong(fd);
            if (!pfd) { PyErr_Clear(); return hand_over(evs, k, n, NONE, -1, NULL); }
            PyObject *conn = PyDict_GetItemWithError(conns, pfd);  /* borrowed */
            Py_DECREF(pfd);
            if (!conn) { PyErr_Clear(); return hand_over(evs, k, n, NONE, -1, NULL); }
            if (evs[k].events != EPOLLIN || not_plain(conn)) return hand_over(evs, k, n, NONE, -1, NULL);
            char *buf = PyByteArray_AS_STRING(rbuf);
            ssize_t got;
            do got = recv(fd, buf, (size_t)PyByteArray_GET_SIZE(rbuf), MSG_DONTWAIT);
            while (got < 0 && errno == EINTR);
            if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;  /* nothing after all */
            if (got <= 0) return hand_over(evs, k, n, NONE, -1, NULL);  /* Python reads the same */
            PyObject *total = add_in_place(conn, data, got, buf, heads_n);
            if (!total) return hand_over(evs, k + 1, n, INPUT, fd, PyLong_FromSsize_t(got));
            PyObject *head = PyTuple_GET_ITEM(heads, PyBytes_GET_SIZE(total));
            char out[96];
            Py_ssize_t hl = PyBytes_GET_SIZE(head), tl = PyBytes_GET_SIZE(total);
            memcpy(out, PyBytes_AS_STRING(head), (size_t)hl);
            memcpy(out + hl, PyBytes_AS_STRING(total), (size_t)tl);
            Py_DECREF(total);
            ssize_t sent;
            do sent = send(fd, out, (size_t)(hl + tl), MSG_DONTWAIT | MSG_NOSIGNAL);
            while (sent < 0 && errno == EINTR);
            if (sent < 0) sent = 0;  /* nothing went: all of it is queued (Python's send finds the error) */
            if (sent != hl + tl)
                return hand_over(evs, k + 1, n, PARTIAL, fd,
                                 PyBytes_FromStringAndSize(out + sent, hl + tl - sent));
        }
        if (timeout == 0) return hand_over(evs, 0, 0, NONE, -1, NULL);
    }
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "Wait and serve the repeated ADDs (see the source's head)."},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gpucoll_store_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gpucoll_store_native(void) {
    for (int k = 0; k < N_ATTRS; k++)
        if (!(attr_names[k] = PyUnicode_InternFromString(ATTR_NAMES[k]))) return NULL;
    return PyModule_Create(&module);
}
