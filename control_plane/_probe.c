/* The replica table's probe (control_plane.replica_table.BlockTable), in one native call.
 *
 * A table is two arrays of buckets of BUCKET slots, keys (uint64, 0 = empty) and vids (uint32), with a bucket
 * mask, plus a sorted overflow (the "stash": keys and vids). A key sits in one of its two buckets, named by its
 * low and its high 32 bits under the mask, or in the stash. A block's key is the first 8 bytes of its hash read
 * as a little-endian uint64, 0 made 1 (replica_table.block_keys).
 *
 * vids(...) gives the vid of each key of an array; leading_runs(...) reads the keys straight from concatenated
 * hashes and gives the runs of one vid along the prefix of present blocks: what a lookup needs, with no array
 * and no Python object per block. Built by pyproject.toml ([tool.setuptools] ext-modules).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BUCKET 4

typedef struct {
    const uint64_t *keys;
    const uint32_t *vids;
    uint64_t mask;
    const uint64_t *stash_keys;
    const uint32_t *stash_vids;
    Py_ssize_t stash_len;
} Table;

static inline uint32_t in_bucket(const Table *t, uint64_t bucket, uint64_t key, int *found) {
    const uint64_t *row = t->keys + bucket * BUCKET;
    for (int i = 0; i < BUCKET; i++) {
        if (row[i] == key) {
            *found = 1;
            return t->vids[bucket * BUCKET + i];
        }
    }
    return 0;
}

static inline uint32_t probe(const Table *t, uint64_t key) {
    int found = 0;
    uint32_t vid = in_bucket(t, key & t->mask, key, &found);
    if (found)
        return vid;
    vid = in_bucket(t, (key >> 32) & t->mask, key, &found);
    if (found)
        return vid;
    Py_ssize_t lo = 0, hi = t->stash_len;  /* the stash is sorted: binary search */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (t->stash_keys[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < t->stash_len && t->stash_keys[lo] == key ? t->stash_vids[lo] : 0;
}

static inline uint64_t key_of(const unsigned char *hash) {
    uint64_t key = 0;
    for (int j = 7; j >= 0; j--)
        key = key << 8 | hash[j];
    return key ? key : 1;
}

/* Fills ``t`` from the buffers; 0 on success, -1 with an exception set. */
static int table_of(Table *t, Py_buffer *keys, Py_buffer *vids, unsigned long long mask, Py_buffer *stash_keys,
                    Py_buffer *stash_vids) {
    Py_ssize_t slots = ((Py_ssize_t)mask + 1) * BUCKET;
    if (mask & (mask + 1) || keys->len != slots * 8 || vids->len != slots * 4 || stash_keys->len % 8
        || stash_vids->len != stash_keys->len / 2) {
        PyErr_SetString(PyExc_ValueError, "table arrays do not match the bucket mask");
        return -1;
    }
    t->keys = keys->buf;
    t->vids = vids->buf;
    t->mask = mask;
    t->stash_keys = stash_keys->buf;
    t->stash_vids = stash_vids->buf;
    t->stash_len = stash_keys->len / 8;
    return 0;
}

static PyObject *vids(PyObject *self, PyObject *args) {
    Py_buffer keys, vids, stash_keys, stash_vids, probes, out;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "y*y*Ky*y*y*w*", &keys, &vids, &mask, &stash_keys, &stash_vids, &probes, &out))
        return NULL;
    PyObject *result = NULL;
    Table t;
    if (table_of(&t, &keys, &vids, mask, &stash_keys, &stash_vids) == 0) {
        Py_ssize_t n = probes.len / 8;
        if (probes.len % 8 || out.len != n * 4) {
            PyErr_SetString(PyExc_ValueError, "vids: give uint64 keys and a uint32 array of as many vids");
        } else {
            const uint64_t *in = probes.buf;
            uint32_t *dst = out.buf;
            for (Py_ssize_t i = 0; i < n; i++)
                dst[i] = probe(&t, in[i]);
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&vids);
    PyBuffer_Release(&stash_keys);
    PyBuffer_Release(&stash_vids);
    PyBuffer_Release(&probes);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *runs_list(const Table *t, const unsigned char *hashes, Py_ssize_t n, Py_ssize_t hash_len) {
    PyObject *runs = PyList_New(0);
    if (runs == NULL)
        return NULL;
    uint32_t current = 0;
    Py_ssize_t times = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        uint32_t vid = i < n ? probe(t, key_of(hashes + i * hash_len)) : 0;
        if (vid == current && vid) {
            times++;
            continue;
        }
        if (current) {
            PyObject *run = Py_BuildValue("(kn)", (unsigned long)current, times);
            if (run == NULL || PyList_Append(runs, run) < 0) {
                Py_XDECREF(run);
                Py_DECREF(runs);
                return NULL;
            }
            Py_DECREF(run);
        }
        if (!vid)
            break;  /* the prefix ends at the first absent block */
        current = vid;
        times = 1;
    }
    return runs;
}

static PyObject *leading_runs(PyObject *self, PyObject *args) {
    Py_buffer keys, vids, stash_keys, stash_vids, hashes;
    unsigned long long mask;
    Py_ssize_t hash_len;
    if (!PyArg_ParseTuple(args, "y*y*Ky*y*y*n", &keys, &vids, &mask, &stash_keys, &stash_vids, &hashes, &hash_len))
        return NULL;
    PyObject *result = NULL;
    Table t;
    if (table_of(&t, &keys, &vids, mask, &stash_keys, &stash_vids) == 0) {
        if (hash_len < 8 || hashes.len % hash_len)
            PyErr_SetString(PyExc_ValueError, "leading_runs: give whole hashes of at least 8 bytes");
        else
            result = runs_list(&t, hashes.buf, hashes.len / hash_len, hash_len);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&vids);
    PyBuffer_Release(&stash_keys);
    PyBuffer_Release(&stash_vids);
    PyBuffer_Release(&hashes);
    return result;
}

static PyMethodDef methods[] = {
    {"vids", vids, METH_VARARGS,
     "vids(keys, vids, mask, stash_keys, stash_vids, probes, out): out[i] = the vid of probes[i] (0: absent)"},
    {"leading_runs", leading_runs, METH_VARARGS,
     "leading_runs(keys, vids, mask, stash_keys, stash_vids, hashes, hash_len): [(vid, blocks), ...] along the "
     "leading present blocks of the concatenated hashes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "control_plane._probe",
                                    "The replica table's probe in one native call (see _probe.c).", -1, methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
