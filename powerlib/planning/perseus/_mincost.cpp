// Min-cost circulation by cost scaling push-relabel, and residual shortest distances.
//
// A plain CPython extension (no pybind11, no numpy headers): arrays arrive as C-contiguous int64
// buffers through the buffer protocol, results are written into caller-provided int64 buffers,
// and every entry point returns an integer status (0 = ok, see STATUS_* below) rather than
// raising for a bad instance. The GIL is released while the solvers run.
//
// solve(): Goldberg's cost scaling push-relabel with partial augment-relabel (A. V. Goldberg, "An
// efficient implementation of a scaling minimum-cost flow algorithm", J. Algorithms 22(1), 1997),
// in the style of LEMON's CostScaling (AUGMENT method). Costs are multiplied by (n + 1) so that an
// epsilon-optimal flow with epsilon = 1 (scaled) is optimal for the integer costs. Epsilon falls
// by ALPHA = 8 per phase, with a global price update every n relabels; active nodes are taken in
// FIFO order.
//
// residual_distances(): shortest distances from a source in the residual network of a given flow
// with the original costs, by a queue-based Bellman-Ford (SPFA) that re-scans only improved nodes.
// A shortest path with n or more arcs means a negative cycle: the flow is not optimal.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <new>
#include <vector>

namespace {

constexpr int STATUS_OK = 0;
constexpr int STATUS_INVALID = 1;        // node index out of range or negative capacity
constexpr int STATUS_OVERFLOW = 2;       // int64 headroom exceeded (scaled costs, sums, prices)
constexpr int STATUS_NEGATIVE_CYCLE = 3; // residual_distances: the flow is not optimal
constexpr int STATUS_NO_MEMORY = 4;
constexpr int STATUS_INTERNAL = 5;       // an invariant of the algorithm failed

constexpr int64_t ALPHA = 8;
constexpr int MAX_PATH_LENGTH = 8;  // 8 beat 2 and 4 on 200k random arcs
constexpr int64_t I64_MAX = std::numeric_limits<int64_t>::max();
// Prices and scaled costs stay within a quarter of int64 so that every reduced cost
// cost + pi[u] - pi[v] (at most 3/4 of the range) is exact.
constexpr int64_t HEADROOM = I64_MAX / 4;

struct Instance {
    int64_t n;
    int64_t m;
    const int64_t* tail;
    const int64_t* head;
    const int64_t* cap;
    const int64_t* cost;
};

int validate(const Instance& g) {
    for (int64_t i = 0; i < g.m; ++i) {
        if (g.tail[i] < 0 || g.tail[i] >= g.n || g.head[i] < 0 || g.head[i] >= g.n) {
            return STATUS_INVALID;
        }
        if (g.cap[i] < 0) {
            return STATUS_INVALID;
        }
    }
    return STATUS_OK;
}

// Residual graph in CSR form: arc a leaves node source(a) = target[reverse[a]].
struct Residual {
    std::vector<int64_t> first_out;  // n + 1 offsets
    std::vector<int64_t> target;
    std::vector<int64_t> reverse;
    std::vector<int64_t> res_cap;
    std::vector<int64_t> cost;       // scaled (solve) or original (distances)
    std::vector<int64_t> forward_of; // original arc -> its forward residual arc (-1: self loop)
};

void build_residual(const Instance& g, const int64_t* flow, int64_t scale, Residual& r) {
    const int64_t n = g.n;
    r.first_out.assign(n + 1, 0);
    for (int64_t i = 0; i < g.m; ++i) {
        if (g.tail[i] == g.head[i]) continue;
        ++r.first_out[g.tail[i] + 1];
        ++r.first_out[g.head[i] + 1];
    }
    for (int64_t v = 0; v < n; ++v) r.first_out[v + 1] += r.first_out[v];
    const int64_t k = r.first_out[n];
    r.target.resize(k);
    r.reverse.resize(k);
    r.res_cap.resize(k);
    r.cost.resize(k);
    r.forward_of.assign(g.m, -1);
    std::vector<int64_t> pos(r.first_out.begin(), r.first_out.end() - 1);
    for (int64_t i = 0; i < g.m; ++i) {
        const int64_t u = g.tail[i], v = g.head[i];
        if (u == v) continue;
        const int64_t f = flow ? flow[i] : 0;
        const int64_t a = pos[u]++, b = pos[v]++;
        r.target[a] = v;
        r.target[b] = u;
        r.reverse[a] = b;
        r.reverse[b] = a;
        r.res_cap[a] = g.cap[i] - f;
        r.res_cap[b] = f;
        r.cost[a] = g.cost[i] * scale;
        r.cost[b] = -g.cost[i] * scale;
        r.forward_of[i] = a;
    }
}

// Global update (Goldberg 1997, section 6): a bucket-based Dijkstra, in units of epsilon, from the
// nodes with a deficit backwards over residual arcs; every node is then lowered by its rank so that
// admissible paths lead to deficits. Returns a status.
struct GlobalUpdate {
    std::vector<int64_t> rank, buckets, bucket_next, bucket_prev;
};

int global_update(int64_t n, const Residual& r, const std::vector<int64_t>& excess,
                  std::vector<int64_t>& pi, std::vector<int64_t>& next_out, int64_t epsilon,
                  GlobalUpdate& w) {
    const int64_t max_rank = ALPHA * n;
    const int64_t end = n;  // sentinel
    w.rank.resize(n);
    w.buckets.assign(max_rank + 1, end);
    w.bucket_next.resize(n + 1);
    w.bucket_prev.resize(n + 1);
    __int128 total_excess = 0;
    int64_t b0 = end;
    for (int64_t i = 0; i < n; ++i) {
        if (excess[i] < 0) {
            w.rank[i] = 0;
            w.bucket_next[i] = b0;
            w.bucket_prev[b0] = i;
            b0 = i;
        } else {
            total_excess += excess[i];
            w.rank[i] = max_rank;
        }
    }
    if (total_excess == 0) return STATUS_OK;
    w.buckets[0] = b0;
    int64_t rk = 0;
    for (; rk != max_rank; ++rk) {
        while (w.buckets[rk] != end) {
            const int64_t u = w.buckets[rk];
            w.buckets[rk] = w.bucket_next[u];
            const int64_t pu = pi[u];
            for (int64_t a = r.first_out[u]; a != r.first_out[u + 1]; ++a) {
                const int64_t ra = r.reverse[a];
                if (r.res_cap[ra] <= 0) continue;
                const int64_t v = r.target[a];
                const int64_t old_rank = w.rank[v];
                if (rk >= old_rank) continue;
                const int64_t nrc = (r.cost[ra] + pi[v] - pu) / epsilon;
                int64_t new_rank = old_rank;
                if (nrc < max_rank) new_rank = rk + 1 + nrc;
                if (new_rank < old_rank) {
                    w.rank[v] = new_rank;
                    next_out[v] = r.first_out[v];
                    if (old_rank < max_rank) {
                        if (w.buckets[old_rank] == v) {
                            w.buckets[old_rank] = w.bucket_next[v];
                        } else {
                            const int64_t pv = w.bucket_prev[v], nv = w.bucket_next[v];
                            w.bucket_next[pv] = nv;
                            w.bucket_prev[nv] = pv;
                        }
                    }
                    const int64_t nv = w.buckets[new_rank];
                    w.bucket_next[v] = nv;
                    w.bucket_prev[nv] = v;
                    w.buckets[new_rank] = v;
                }
            }
            if (excess[u] > 0) {
                total_excess -= excess[u];
                if (total_excess <= 0) break;
            }
        }
        if (total_excess <= 0) break;
    }
    for (int64_t u = 0; u < n; ++u) {
        const int64_t k = w.rank[u] < rk ? w.rank[u] : rk;
        if (k > 0) {
            const __int128 np = static_cast<__int128>(pi[u]) - static_cast<__int128>(epsilon) * k;
            if (np < -HEADROOM) return STATUS_OVERFLOW;
            pi[u] = static_cast<int64_t>(np);
            next_out[u] = r.first_out[u];
        }
    }
    return STATUS_OK;
}

int solve_impl(const Instance& g, int64_t* flow_out) {
    int st = validate(g);
    if (st != STATUS_OK) return st;
    const int64_t n = g.n;
    const int64_t scale = n + 1;
    __int128 cap_sum = 0;
    int64_t max_cost = 0;
    for (int64_t i = 0; i < g.m; ++i) {
        cap_sum += g.cap[i];
        const int64_t c = g.cost[i];
        if (c == std::numeric_limits<int64_t>::min()) return STATUS_OVERFLOW;
        const int64_t a = c < 0 ? -c : c;
        if (a > max_cost) max_cost = a;
    }
    if (cap_sum > static_cast<__int128>(I64_MAX)) return STATUS_OVERFLOW;
    if (static_cast<__int128>(max_cost) * scale > static_cast<__int128>(HEADROOM)) {
        return STATUS_OVERFLOW;
    }

    Residual r;
    build_residual(g, nullptr, scale, r);
    const std::vector<int64_t>& first_out = r.first_out;
    const std::vector<int64_t>& target = r.target;
    const std::vector<int64_t>& reverse = r.reverse;
    const std::vector<int64_t>& cost = r.cost;
    std::vector<int64_t>& res_cap = r.res_cap;
    const int64_t k = first_out[n];

    std::vector<int64_t> pi(n, 0);
    std::vector<int64_t> excess(n, 0);
    std::vector<int64_t> next_out(first_out.begin(), first_out.end() - 1);
    std::vector<char> path_arc(k, 0);
    std::vector<int64_t> path;
    path.reserve(MAX_PATH_LENGTH + 1);
    std::deque<int64_t> active;
    GlobalUpdate work;
    // A global update every n relabels: 2n + k (arcs) took 3.3x longer on the planner's
    // 16 x 256 network (22.6M relabels for 16k nodes); n/2, 2n and n/4 were measured too.
    const int64_t global_update_skip = n;
    int64_t relabels = 0;
    int64_t next_global_update = global_update_skip;

    int64_t epsilon = max_cost * scale;
    if (epsilon < 1) epsilon = 1;
    // Zero flow is epsilon-optimal for epsilon = max |scaled cost|: each phase first divides.
    bool last_phase = false;
    while (!last_phase) {
        epsilon = epsilon > ALPHA ? epsilon / ALPHA : 1;
        last_phase = epsilon == 1;
        // Phase start: saturate every residual arc of negative reduced cost (0-optimal flow).
        for (int64_t u = 0; u < n; ++u) {
            const int64_t pu = pi[u];
            for (int64_t a = first_out[u]; a != first_out[u + 1]; ++a) {
                const int64_t c = res_cap[a];
                if (c > 0 && cost[a] + pu - pi[target[a]] < 0) {
                    const int64_t v = target[a];
                    res_cap[a] = 0;
                    res_cap[reverse[a]] += c;
                    excess[u] -= c;
                    excess[v] += c;
                }
            }
        }
        for (int64_t u = 0; u < n; ++u) {
            next_out[u] = first_out[u];
            if (excess[u] > 0) active.push_back(u);
        }
        // Partial augment-relabel (Goldberg 1997, section 5): from an active node, follow
        // admissible arcs up to MAX_PATH_LENGTH, relabelling and retreating at dead ends, then
        // push along the path.
        while (true) {
            while (!active.empty() && excess[active.front()] <= 0) active.pop_front();
            if (active.empty()) break;
            const int64_t start = active.front();
            int64_t tip = start;
            while (static_cast<int>(path.size()) < MAX_PATH_LENGTH && excess[tip] >= 0) {
                const int64_t pt = pi[tip];
                int64_t min_rc = I64_MAX;
                const int64_t last = first_out[tip + 1];
                bool advanced = false;
                bool cycle = false;
                for (int64_t a = next_out[tip]; a != last; ++a) {
                    if (res_cap[a] > 0) {
                        const int64_t v = target[a];
                        const int64_t rc = cost[a] + pt - pi[v];
                        if (rc < 0) {
                            path.push_back(a);
                            next_out[tip] = a;
                            if (path_arc[a]) {
                                cycle = true;
                            } else {
                                path_arc[a] = 1;
                                tip = v;
                            }
                            advanced = true;
                            break;
                        }
                        if (rc < min_rc) min_rc = rc;
                    }
                }
                if (cycle) break;
                if (advanced) continue;
                // Relabel tip: the arc back along the path will have capacity after the push.
                if (tip != start) {
                    const int64_t ra = reverse[path.back()];
                    const int64_t rc = cost[ra] + pt - pi[target[ra]];
                    if (rc < min_rc) min_rc = rc;
                }
                for (int64_t a = first_out[tip]; a != next_out[tip]; ++a) {
                    if (res_cap[a] > 0) {
                        const int64_t rc = cost[a] + pt - pi[target[a]];
                        if (rc < min_rc) min_rc = rc;
                    }
                }
                if (min_rc == I64_MAX) return STATUS_INTERNAL;
                const int64_t np = pt - (min_rc + epsilon);
                if (np < -HEADROOM || np > HEADROOM) return STATUS_OVERFLOW;
                pi[tip] = np;
                next_out[tip] = first_out[tip];
                ++relabels;
                if (tip != start) {
                    const int64_t pa = path.back();
                    path_arc[pa] = 0;
                    tip = target[reverse[pa]];
                    path.pop_back();
                }
            }
            int64_t v = start;
            for (size_t i = 0; i < path.size(); ++i) {
                const int64_t pa = path[i];
                const int64_t u = v;
                v = target[pa];
                path_arc[pa] = 0;
                const int64_t delta = res_cap[pa] < excess[u] ? res_cap[pa] : excess[u];
                res_cap[pa] -= delta;
                res_cap[reverse[pa]] += delta;
                excess[u] -= delta;
                excess[v] += delta;
                if (excess[v] > 0 && excess[v] <= delta) active.push_back(v);
            }
            path.clear();
            if (relabels >= next_global_update) {
                st = global_update(n, r, excess, pi, next_out, epsilon, work);
                if (st != STATUS_OK) return st;
                next_global_update = relabels + global_update_skip;
            }
        }
    }

    for (int64_t u = 0; u < n; ++u) {
        if (excess[u] != 0) return STATUS_INTERNAL;
    }
    for (int64_t i = 0; i < g.m; ++i) {
        const int64_t a = r.forward_of[i];
        if (a < 0) {
            flow_out[i] = g.cost[i] < 0 ? g.cap[i] : 0;  // a self loop is its own cycle
        } else {
            flow_out[i] = res_cap[reverse[a]];
        }
    }
    (void)k;
    return STATUS_OK;
}

int distances_impl(const Instance& g, const int64_t* flow, int64_t source, int64_t* dist) {
    int st = validate(g);
    if (st != STATUS_OK) return st;
    const int64_t n = g.n;
    if (source < 0 || source >= n) return STATUS_INVALID;
    int64_t max_cost = 0;
    for (int64_t i = 0; i < g.m; ++i) {
        const int64_t c = g.cost[i];
        if (c == std::numeric_limits<int64_t>::min()) return STATUS_OVERFLOW;
        const int64_t a = c < 0 ? -c : c;
        if (a > max_cost) max_cost = a;
    }
    // A shortest path has fewer than n arcs until a cycle is detected: |dist| < n * max_cost.
    if (static_cast<__int128>(max_cost) * n >= static_cast<__int128>(I64_MAX)) {
        return STATUS_OVERFLOW;
    }
    Residual r;
    build_residual(g, flow, 1, r);
    for (int64_t i = 0; i < g.m; ++i) {
        const int64_t a = r.forward_of[i];
        if (a < 0) {
            // A self loop of negative cost with room to move is a negative cycle.
            const bool room = (flow[i] < g.cap[i] && g.cost[i] < 0) ||
                              (flow[i] > 0 && g.cost[i] > 0);
            if (room) return STATUS_NEGATIVE_CYCLE;
        }
    }
    for (int64_t v = 0; v < n; ++v) dist[v] = I64_MAX;
    std::vector<int64_t> hops(n, 0);
    std::vector<char> queued(n, 0);
    std::deque<int64_t> queue;
    dist[source] = 0;
    queue.push_back(source);
    queued[source] = 1;
    while (!queue.empty()) {
        const int64_t u = queue.front();
        queue.pop_front();
        queued[u] = 0;
        const int64_t du = dist[u];
        for (int64_t a = r.first_out[u]; a != r.first_out[u + 1]; ++a) {
            if (r.res_cap[a] <= 0) continue;
            const int64_t v = r.target[a];
            const int64_t nd = du + r.cost[a];
            if (nd < dist[v]) {
                dist[v] = nd;
                hops[v] = hops[u] + 1;
                if (hops[v] >= n) return STATUS_NEGATIVE_CYCLE;
                if (!queued[v]) {
                    queued[v] = 1;
                    queue.push_back(v);
                }
            }
        }
    }
    return STATUS_OK;
}

// ---- Python glue ---------------------------------------------------------------------------

bool is_int64_format(const char* fmt) {
    if (fmt == nullptr) return false;
    if (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<') ++fmt;
    return (std::strcmp(fmt, "q") == 0 || std::strcmp(fmt, "l") == 0);
}

// Acquire a 1-D C-contiguous int64 buffer; on failure sets a Python error and returns false.
bool get_int64(PyObject* obj, Py_buffer* view, bool writable, const char* name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) return false;
    if (view->itemsize != 8 || !is_int64_format(view->format) || view->ndim > 1) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D contiguous int64 buffer (format 'q')",
                     name);
        PyBuffer_Release(view);
        return false;
    }
    return true;
}

struct Buffers {
    Py_buffer views[6];
    int count = 0;
    ~Buffers() {
        for (int i = 0; i < count; ++i) PyBuffer_Release(&views[i]);
    }
    Py_buffer* add(PyObject* obj, bool writable, const char* name) {
        if (!get_int64(obj, &views[count], writable, name)) return nullptr;
        return &views[count++];
    }
};

int64_t length(const Py_buffer* v) { return static_cast<int64_t>(v->len / 8); }

bool load_graph(long long n, PyObject* t, PyObject* h, PyObject* c, PyObject* w,
                Buffers& bufs, Instance& g) {
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "num_nodes must be non-negative");
        return false;
    }
    Py_buffer* bt = bufs.add(t, false, "tail");
    if (!bt) return false;
    Py_buffer* bh = bufs.add(h, false, "head");
    if (!bh) return false;
    Py_buffer* bc = bufs.add(c, false, "capacity");
    if (!bc) return false;
    Py_buffer* bw = bufs.add(w, false, "cost");
    if (!bw) return false;
    const int64_t m = length(bt);
    if (length(bh) != m || length(bc) != m || length(bw) != m) {
        PyErr_SetString(PyExc_ValueError, "tail, head, capacity and cost must have equal lengths");
        return false;
    }
    g.n = n;
    g.m = m;
    g.tail = static_cast<const int64_t*>(bt->buf);
    g.head = static_cast<const int64_t*>(bh->buf);
    g.cap = static_cast<const int64_t*>(bc->buf);
    g.cost = static_cast<const int64_t*>(bw->buf);
    return true;
}

PyObject* py_solve(PyObject*, PyObject* args) {
    Buffers bufs;
    Instance g{};
    long long n = 0;
    PyObject *t, *h, *c, *w, *out;
    if (!PyArg_ParseTuple(args, "LOOOOO:solve", &n, &t, &h, &c, &w, &out)) return nullptr;
    if (!load_graph(n, t, h, c, w, bufs, g)) return nullptr;
    Py_buffer* bf = bufs.add(out, true, "flow_out");
    if (!bf) return nullptr;
    if (length(bf) != g.m) {
        PyErr_SetString(PyExc_ValueError, "flow_out must have one entry per arc");
        return nullptr;
    }
    int64_t* flow = static_cast<int64_t*>(bf->buf);
    int status;
    Py_BEGIN_ALLOW_THREADS
    try {
        status = solve_impl(g, flow);
    } catch (const std::bad_alloc&) {
        status = STATUS_NO_MEMORY;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

PyObject* py_residual_distances(PyObject*, PyObject* args) {
    Buffers bufs;
    Instance g{};
    long long n = 0, source = 0;
    PyObject *t, *h, *c, *w, *fl, *out;
    if (!PyArg_ParseTuple(args, "LOOOOOLO:residual_distances", &n, &t, &h, &c, &w, &fl, &source,
                          &out)) {
        return nullptr;
    }
    if (!load_graph(n, t, h, c, w, bufs, g)) return nullptr;
    Py_buffer* bf = bufs.add(fl, false, "flow");
    if (!bf) return nullptr;
    if (length(bf) != g.m) {
        PyErr_SetString(PyExc_ValueError, "flow must have one entry per arc");
        return nullptr;
    }
    Py_buffer* bd = bufs.add(out, true, "dist_out");
    if (!bd) return nullptr;
    if (length(bd) != g.n) {
        PyErr_SetString(PyExc_ValueError, "dist_out must have one entry per node");
        return nullptr;
    }
    const int64_t* flow = static_cast<const int64_t*>(bf->buf);
    int64_t* dist = static_cast<int64_t*>(bd->buf);
    int status;
    Py_BEGIN_ALLOW_THREADS
    try {
        status = distances_impl(g, flow, source, dist);
    } catch (const std::bad_alloc&) {
        status = STATUS_NO_MEMORY;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

PyObject* py_flow_cost(PyObject*, PyObject* args) {
    PyObject *c, *f;
    if (!PyArg_ParseTuple(args, "OO:flow_cost", &c, &f)) return nullptr;
    Buffers bufs;
    Py_buffer* bc = bufs.add(c, false, "cost");
    if (!bc) return nullptr;
    Py_buffer* bf = bufs.add(f, false, "flow");
    if (!bf) return nullptr;
    if (length(bc) != length(bf)) {
        PyErr_SetString(PyExc_ValueError, "cost and flow must have equal lengths");
        return nullptr;
    }
    const int64_t* cost = static_cast<const int64_t*>(bc->buf);
    const int64_t* flow = static_cast<const int64_t*>(bf->buf);
    const int64_t m = length(bc);
    // Each product fits in 127 bits; the sum of up to 2^63 / 8 of them is checked as it grows.
    __int128 total = 0;
    const __int128 limit = (static_cast<__int128>(1) << 125);
    for (int64_t i = 0; i < m; ++i) {
        total += static_cast<__int128>(cost[i]) * flow[i];
        if (total > limit || total < -limit) {
            PyErr_SetString(PyExc_OverflowError, "flow cost exceeds 125 bits");
            return nullptr;
        }
    }
    const bool negative = total < 0;
    unsigned __int128 mag = negative ? static_cast<unsigned __int128>(-total)
                                     : static_cast<unsigned __int128>(total);
    PyObject* hi = PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(mag >> 64));
    PyObject* lo = PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(mag));
    PyObject* sixty_four = PyLong_FromLong(64);
    PyObject* result = nullptr;
    if (hi && lo && sixty_four) {
        PyObject* shifted = PyNumber_Lshift(hi, sixty_four);
        if (shifted) {
            result = PyNumber_Or(shifted, lo);
            Py_DECREF(shifted);
        }
    }
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_XDECREF(sixty_four);
    if (result && negative) {
        PyObject* neg = PyNumber_Negative(result);
        Py_DECREF(result);
        result = neg;
    }
    return result;
}

PyMethodDef methods[] = {
    {"solve", py_solve, METH_VARARGS,
     "solve(num_nodes, tail, head, capacity, cost, flow_out) -> status\n\n"
     "Min-cost circulation by cost scaling (Goldberg 1997); writes the flow into flow_out."},
    {"residual_distances", py_residual_distances, METH_VARARGS,
     "residual_distances(num_nodes, tail, head, capacity, cost, flow, source, dist_out) -> "
     "status\n\nShortest distances from source in the residual network (SPFA); unreachable "
     "nodes get INT64_MAX; status 3 means a negative cycle."},
    {"flow_cost", py_flow_cost, METH_VARARGS,
     "flow_cost(cost, flow) -> int\n\nsum(cost * flow) exactly, in 128-bit arithmetic."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mincost",
    "Min-cost circulation by cost scaling, and residual shortest distances (int64 buffers).", -1,
    methods, nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__mincost(void) {
    PyObject* m = PyModule_Create(&module);
    if (m == nullptr) return nullptr;
    const struct {
        const char* name;
        int value;
    } constants[] = {
        {"STATUS_OK", STATUS_OK},
        {"STATUS_INVALID", STATUS_INVALID},
        {"STATUS_OVERFLOW", STATUS_OVERFLOW},
        {"STATUS_NEGATIVE_CYCLE", STATUS_NEGATIVE_CYCLE},
        {"STATUS_NO_MEMORY", STATUS_NO_MEMORY},
        {"STATUS_INTERNAL", STATUS_INTERNAL},
    };
    for (const auto& c : constants) {
        if (PyModule_AddIntConstant(m, c.name, c.value) != 0) {
            Py_DECREF(m);
            return nullptr;
        }
    }
    return m;
}
