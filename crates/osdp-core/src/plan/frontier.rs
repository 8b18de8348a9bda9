//! Pareto frontiers of (memory, time) with back-pointers, so that the choices behind any point
//! can be recovered. The planner sums frontiers (Minkowski sum, then prune dominated points);
//! identical groups are summed by doubling.
//!
//! Where host memory can bind (offloaded state under a host budget it may exceed), points also
//! carry their host bytes and frontiers are three-dimensional: a point is dropped only when
//! another is no worse on device memory, host memory and time. [`Arena::host_limit`] says which
//! kind a search builds.

use crate::cost::Choice;

/// One non-dominated way to run a group: its memory, its time, and how to recover it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub mem: u64,
    pub time: f64,
    pub node: u32,
    /// Host memory (offloaded state); 0 in two-dimensional frontiers.
    pub host: u64,
}

/// What a point is made of.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Node {
    /// Op at `slot` of its group runs with `choice`.
    Op { slot: u32, choice: Choice },
    /// One instance of group class `class`, run `way`, with its ops under `inner`.
    Instance { class: u32, way: Way, inner: u32 },
    /// Every instance of group class `class`: under `inner`, for each of its slots one `Op`
    /// per instance, and one `Way` per instance.
    Dealt { class: u32, inner: u32 },
    /// How one instance runs.
    Way(Way),
    /// `count` copies of a node.
    Times { node: u32, count: u32 },
    /// Both parts.
    Pair(u32, u32),
    /// Nothing (the identity of the sum).
    Empty,
}

/// How one instance of a block runs: keeping its activations, recomputing them (its
/// recomputation fetching its weights again for the backward), or recomputing them and keeping
/// the weights its recomputation fetched ([`Plan::keep_weights`](crate::plan::Plan::keep_weights)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    Plain,
    Recompute,
    Keep,
}

impl Way {
    pub fn recomputes(self) -> bool {
        self != Way::Plain
    }
}

#[derive(Debug, Default)]
pub struct Arena {
    pub nodes: Vec<Node>,
    /// `Some(h)`: frontiers are three-dimensional and points above `h` bytes of host memory
    /// are left out (host memory only adds up); `None`: host memory is ignored (it cannot
    /// bind) and frontiers are (memory, time) staircases.
    pub host_limit: Option<u64>,
    /// A three-dimensional sum had more pairs than [`MAX_PAIRS_3D`]: the frontiers built are
    /// incomplete and must not be used.
    pub overflow: bool,
    /// The buckets of [`sum_on_grid`], kept between sums so that each does not allocate (and
    /// fault in) its own.
    pub(super) grid: Vec<Pair>,
}

/// Most pairs one three-dimensional sum may form. Frontiers of many ops that trade device for
/// host memory grow combinatorially; past this the search gives up (see
/// [`Arena::overflow`]) and the caller prices host memory instead.
pub const MAX_PAIRS_3D: usize = 1 << 21;

impl Arena {
    pub fn push(&mut self, node: Node) -> u32 {
        self.nodes.push(node);
        (self.nodes.len() - 1) as u32
    }
}

/// Points sorted by memory ascending with time strictly descending (two-dimensional), or by
/// memory then host memory ascending (three-dimensional).
pub type Frontier = Vec<Point>;

/// Keep only points no other point beats on both memory and time (and host memory, when any
/// point holds some).
pub fn prune(pts: Vec<Point>) -> Frontier {
    if pts.iter().any(|p| p.host > 0) {
        prune3(pts)
    } else {
        prune2(pts)
    }
}

fn prune2(mut pts: Vec<Point>) -> Frontier {
    pts.sort_by(|a, b| a.mem.cmp(&b.mem).then(a.time.total_cmp(&b.time)));
    let mut out: Frontier = Vec::with_capacity(pts.len());
    for p in pts {
        if out.last().is_none_or(|last| p.time < last.time) {
            out.push(p);
        }
    }
    out
}

/// Keep only points no other point beats on memory, host memory and time: sorted by memory, a
/// point survives when no earlier one has both less host memory and less time (a staircase of
/// host memory → least time seen so far answers that).
fn prune3(mut pts: Vec<Point>) -> Frontier {
    pts.sort_by(|a, b| {
        a.mem
            .cmp(&b.mem)
            .then(a.host.cmp(&b.host))
            .then(a.time.total_cmp(&b.time))
    });
    sweep3(pts)
}

/// [`prune3`] of points already sorted by memory, then host memory, then time.
fn sweep3(pts: Vec<Point>) -> Frontier {
    use std::collections::BTreeMap;
    // Host memory → the least time of a kept point with at most that much; times fall as
    // host memory rises.
    let mut stairs: BTreeMap<u64, f64> = BTreeMap::new();
    let mut out: Frontier = Vec::with_capacity(pts.len());
    for p in pts {
        if stairs
            .range(..=p.host)
            .next_back()
            .is_some_and(|(_, &t)| t <= p.time)
        {
            continue;
        }
        let beaten: Vec<u64> = stairs
            .range(p.host..)
            .take_while(|(_, &t)| t >= p.time)
            .map(|(&h, _)| h)
            .collect();
        for h in beaten {
            stairs.remove(&h);
        }
        stairs.insert(p.host, p.time);
        out.push(p);
    }
    out
}

/// The three-dimensional sum: every pair within the host limit, pruned, then cut at `limit`
/// bytes of device memory (keeping the first point).
fn sum3(a: &[Point], b: &[Point], limit: u64, host_limit: u64, arena: &mut Arena) -> Frontier {
    if arena.overflow || a.len().saturating_mul(b.len()) > MAX_PAIRS_3D {
        arena.overflow = true;
        return Vec::new();
    }
    // A pair's parts, by index, in `node` (`i · |b| + j`) until the survivors get arena nodes.
    let width = b.len();
    let pair = |i: usize, j: usize, pairs: &mut Vec<Point>| {
        let (p, q) = (&a[i], &b[j]);
        let host = p.host.saturating_add(q.host);
        if host <= host_limit {
            pairs.push(Point {
                mem: p.mem.saturating_add(q.mem),
                time: p.time + q.time,
                node: (i * width + j) as u32,
                host,
            });
        }
    };
    // One frontier shifted by each point of the other, the longer inside: the frontiers are
    // sorted, so the pairs come in long sorted runs that the sort merges. Ordered by the pair's
    // index after the figures, the pairs sort as they would in index order (so equal pairs
    // keep the same one whichever way they were made).
    let mut pairs: Vec<Point> = Vec::with_capacity(a.len() * b.len());
    if a.len() >= b.len() {
        for j in 0..b.len() {
            for i in 0..a.len() {
                pair(i, j, &mut pairs);
            }
        }
    } else {
        for i in 0..a.len() {
            for j in 0..b.len() {
                pair(i, j, &mut pairs);
            }
        }
    }
    pairs.sort_by(|x, y| {
        x.mem
            .cmp(&y.mem)
            .then(x.host.cmp(&y.host))
            .then(x.time.total_cmp(&y.time))
            .then(x.node.cmp(&y.node))
    });
    let mut kept = sweep3(pairs);
    if let Some(cut) = kept.iter().skip(1).position(|p| p.mem > limit) {
        kept.truncate(cut + 1);
    }
    kept.into_iter()
        .map(|p| {
            let (i, j) = (p.node as usize / width, p.node as usize % width);
            Point {
                node: arena.push(Node::Pair(a[i].node, b[j].node)),
                ..p
            }
        })
        .collect()
}

/// Minkowski sum of two frontiers, pruned. Only surviving points get arena nodes.
///
/// `resolution` > 0 keeps at most one point per `resolution` bytes of memory (the fastest): the
/// frontier stays small on large models, and a budget query loses at most `resolution` bytes of
/// budget per sum. 0 keeps the exact frontier.
///
/// Points above `limit` bytes are left out (the first point, the smallest memory, is always
/// kept): memory only adds up, so a caller that will never ask above `limit` loses nothing.
/// `u64::MAX` keeps everything.
///
/// Each point of the smaller frontier shifts the larger one into a sorted run; the runs are
/// merged into the exact frontier one at a time (a linear merge each, pruning as it goes), then
/// thinned to the resolution. Thinning the exact frontier keeps what thinning every point would:
/// a dominated point never changes what is kept.
///
/// Three-dimensional frontiers ([`Arena::host_limit`]) are summed exactly (no resolution).
pub fn sum(a: &[Point], b: &[Point], resolution: u64, limit: u64, arena: &mut Arena) -> Frontier {
    if a.is_empty() || b.is_empty() {
        return Vec::new();
    }
    if let Some(host_limit) = arena.host_limit {
        return sum3(a, b, limit, host_limit, arena);
    }
    let (big, small) = if a.len() >= b.len() { (a, b) } else { (b, a) };
    // Everything a resolution bucket starting at or below `limit` can hold, and the whole
    // first bucket.
    let cutoff = match resolution {
        0 => limit,
        r => limit
            .saturating_add(r - 1)
            .max((big[0].mem + small[0].mem).saturating_add(r - 1)),
    };
    if let Some(kept) = sum_on_grid(big, small, resolution, limit, cutoff, &mut arena.grid) {
        return kept
            .into_iter()
            .map(|c| Point {
                mem: c.mem,
                time: c.time,
                node: arena.push(Node::Pair(big[c.i as usize].node, small[c.j as usize].node)),
                host: 0,
            })
            .collect();
    }
    let mut exact: Vec<Pair> = Vec::with_capacity(big.len() + small.len());
    let mut scratch: Vec<Pair> = Vec::with_capacity(big.len() + small.len());
    for (j, q) in small.iter().enumerate() {
        merge_run(&exact, big, q, j as u32, cutoff, &mut scratch);
        std::mem::swap(&mut exact, &mut scratch);
    }
    let mut kept: Vec<Pair> = Vec::with_capacity(exact.len());
    // Memory of the first point of the current resolution bucket.
    let mut anchor = 0u64;
    for c in exact {
        let first = kept.len() == 1;
        match kept.last_mut() {
            // Everything still to come lies above `limit`, in a bucket of its own.
            Some(_)
                if c.mem > limit
                    && (resolution == 0 || c.mem >= anchor.saturating_add(resolution)) =>
            {
                break
            }
            Some(last) if c.time >= last.time => {}
            // A faster point less than `resolution` above the bucket's first replaces it; the
            // least-memory point stays, so the least budget any plan fits is found exactly.
            Some(last) if resolution > 0 && !first && c.mem < anchor.saturating_add(resolution) => {
                *last = c
            }
            _ => {
                anchor = c.mem;
                kept.push(c);
            }
        }
    }
    kept.into_iter()
        .map(|c| Point {
            mem: c.mem,
            time: c.time,
            node: arena.push(Node::Pair(big[c.i as usize].node, small[c.j as usize].node)),
            host: 0,
        })
        .collect()
}

/// [`sum`] with a resolution, on a grid: every pair lands in the bucket of `resolution` bytes
/// its memory falls in (counted from the least memory a pair can have), each bucket keeps its
/// fastest pair, and the buckets in order give the staircase. Every pair of the exact sum has
/// a kept point at most as slow and less than `resolution` bytes above it, the guarantee the
/// merge's thinning gives, in `|small| · |big|` branch-free steps where merging the runs takes
/// `|small| · (|big| + frontier)` branchy ones. `None` (merge instead) where the grid would
/// have more buckets than there are pairs, or no resolution is asked.
fn sum_on_grid(
    big: &[Point],
    small: &[Point],
    resolution: u64,
    limit: u64,
    cutoff: u64,
    grid: &mut Vec<Pair>,
) -> Option<Vec<Pair>> {
    if resolution == 0 {
        return None;
    }
    let base = big[0].mem.saturating_add(small[0].mem);
    let last = big[big.len() - 1]
        .mem
        .saturating_add(small[small.len() - 1].mem);
    let top = last.min(cutoff).max(base);
    let buckets = (top - base) / resolution + 1;
    if buckets > (big.len() * small.len()) as u64 {
        return None;
    }
    grid.clear();
    grid.resize(
        buckets as usize,
        Pair {
            mem: u64::MAX,
            time: f64::INFINITY,
            i: 0,
            j: 0,
        },
    );
    // A pair's bucket from its parts' (no division per pair): with `d = q · r + s` for each
    // part's memory above its frontier's least, the pair's bucket is `q_a + q_b`, plus one
    // where `s_a + s_b` reaches `r`.
    let split = |f: &[Point]| -> Vec<(u64, u64)> {
        f.iter()
            .map(|p| {
                let d = p.mem - f[0].mem;
                (d / resolution, d % resolution)
            })
            .collect()
    };
    let (big_at, small_at) = (split(big), split(small));
    for (j, q) in small.iter().enumerate() {
        let (qb, qr) = small_at[j];
        for (i, p) in big.iter().enumerate() {
            let mem = p.mem + q.mem;
            if mem > top {
                // `big` rises in memory: the rest of this run lies above too.
                break;
            }
            let time = p.time + q.time;
            let (pb, pr) = big_at[i];
            let cell = &mut grid[(qb + pb + u64::from(qr + pr >= resolution)) as usize];
            if time < cell.time || (time == cell.time && mem < cell.mem) {
                *cell = Pair {
                    mem,
                    time,
                    i: i as u32,
                    j: j as u32,
                };
            }
        }
    }
    // The least-memory pair first, whatever its bucket's fastest: the least budget any plan
    // fits is found exactly.
    let least = Pair {
        mem: base,
        time: big[0].time + small[0].time,
        i: 0,
        j: 0,
    };
    let mut kept: Vec<Pair> = vec![least];
    for (b, &c) in grid.iter().enumerate() {
        if c.time == f64::INFINITY {
            continue;
        }
        // A bucket starting above `limit` is never asked for.
        if base + b as u64 * resolution > limit {
            break;
        }
        if kept.last().is_none_or(|last| c.time < last.time) {
            kept.push(c);
        }
    }
    Some(kept)
}

/// A point of a sum before it gets a node: `big[i]` + `small[j]`.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Pair {
    mem: u64,
    time: f64,
    i: u32,
    j: u32,
}

/// Merge the run `big` shifted by `q` (run `j`) into the frontier `acc`, keeping the frontier
/// (up to `cutoff`, and its first point) in `out`. Ties go to `acc` (the earlier runs), as the
/// order (memory, time, run) would have it.
fn merge_run(acc: &[Pair], big: &[Point], q: &Point, j: u32, cutoff: u64, out: &mut Vec<Pair>) {
    out.clear();
    let (mut ia, mut ib) = (0usize, 0usize);
    let mut last = f64::INFINITY;
    loop {
        let from_acc = match (acc.get(ia), big.get(ib)) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(a), Some(p)) => {
                let bm = p.mem + q.mem;
                a.mem < bm || (a.mem == bm && a.time <= p.time + q.time)
            }
        };
        let c = if from_acc {
            acc[ia]
        } else {
            let p = &big[ib];
            Pair {
                mem: p.mem + q.mem,
                time: p.time + q.time,
                i: ib as u32,
                j,
            }
        };
        if c.mem > cutoff && !out.is_empty() {
            break;
        }
        if c.time < last {
            out.push(c);
            last = c.time;
            if from_acc {
                ia += 1;
            } else {
                ib += 1;
            }
        } else if from_acc {
            // Times fall along both streams and the kept ones only fall: skip every point no
            // faster than the last kept.
            ia = gallop(ia, acc.len(), |k| acc[k].time >= last);
        } else {
            ib = gallop(ib, big.len(), |k| big[k].time + q.time >= last);
        }
    }
}

/// The first index in `from..len` where `slower` fails, given that it holds at `from` and
/// fails from some index on (rounding keeps sums of falling times in order): gallop, then
/// bisect.
fn gallop(from: usize, len: usize, slower: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut step) = (from, 1usize);
    loop {
        let hi = lo + step;
        if hi >= len || !slower(hi) {
            // `slower` holds at `lo` and fails at `hi` (or the end).
            let (mut a, mut b) = (lo + 1, hi.min(len));
            while a < b {
                let mid = a + (b - a) / 2;
                if slower(mid) {
                    a = mid + 1;
                } else {
                    b = mid;
                }
            }
            return a;
        }
        lo = hi;
        step *= 2;
    }
}

/// Frontiers of up to this many points are repeated one copy at a time; larger ones by
/// doubling ([`repeat`]).
const ONE_AT_A_TIME: usize = 64;

/// Whether [`repeat`] of a three-dimensional frontier of `len` points, `count` times, must
/// overflow ([`Arena::overflow`]): with two copies or more, a frontier repeated by doubling
/// first sums itself with itself, `len²` pairs, past [`MAX_PAIRS_3D`] whatever else happens.
pub fn repeat_overflows(len: usize, count: u64) -> bool {
    count >= 2 && len > ONE_AT_A_TIME && len.saturating_mul(len) > MAX_PAIRS_3D
}

/// The frontier of `count` independent copies of `f` (each copy may pick a different point),
/// leaving out points above `limit` (the first is always kept). `floor`: a lower bound on the
/// memory of one copy, so a partial sum of `t` copies may stop at `limit − (count − t)·floor`.
/// Small frontiers are added one copy at a time (cheap merges); large ones by doubling.
/// `cut`: partial sums that cannot lead to a plan faster than its `t_max` are left out
/// ([`RepeatCut`]).
pub fn repeat(
    f: &[Point],
    count: u64,
    resolution: u64,
    limit: u64,
    floor: u64,
    arena: &mut Arena,
    cut: Option<&RepeatCut>,
) -> Frontier {
    let trim = |f: Frontier, left: u64| match cut {
        Some(c) => c.after(left).apply(f),
        None => f,
    };
    let empty = arena.push(Node::Empty);
    let mut acc: Frontier = vec![Point {
        mem: 0,
        time: 0.0,
        node: empty,
        host: 0,
    }];
    let room = |left: u64| limit.saturating_sub(floor.saturating_mul(left));
    if let ([p], Ok(n)) = (f, u32::try_from(count)) {
        // One way to run each copy: the copies of it.
        return vec![Point {
            mem: p.mem.saturating_mul(count),
            time: p.time * count as f64,
            node: arena.push(Node::Times {
                node: p.node,
                count: n,
            }),
            host: p.host.saturating_mul(count),
        }]
        .into_iter()
        .filter(|p| arena.host_limit.is_none_or(|h| p.host <= h))
        .collect();
    }
    if f.len() <= ONE_AT_A_TIME {
        for t in 1..=count {
            acc = trim(sum(&acc, f, resolution, room(count - t), arena), count - t);
        }
        return acc;
    }
    let mut power: Frontier = f.to_vec();
    let (mut n, mut done, mut size) = (count, 0u64, 1u64);
    while n > 0 {
        if n & 1 == 1 {
            done += size;
            acc = trim(
                sum(&acc, &power, resolution, room(count - done), arena),
                count - done,
            );
        }
        n >>= 1;
        if n > 0 {
            size *= 2;
            // `power` (size copies) will be added at most once more together with the rest.
            power = trim(
                sum(&power, &power, resolution, room(count - size), arena),
                count - size,
            );
        }
    }
    acc
}

/// The cheapest point using at most `mem` bytes. `three_d`: the frontier is three-dimensional
/// (times do not fall along it; every point is within its host limit).
pub fn best_within(f: &[Point], mem: u64, three_d: bool) -> Option<&Point> {
    let idx = f.partition_point(|p| p.mem <= mem);
    if three_d {
        // The fastest; of equally fast ones the first (least memory).
        f[..idx]
            .iter()
            .reduce(|best, p| if p.time < best.time { p } else { best })
    } else {
        idx.checked_sub(1).map(|i| &f[i])
    }
}

/// A lower bound on the least time of a group by the memory it may hold: the linear relaxation
/// of its choices (as if a plan could mix them fractionally), a convex, non-increasing
/// function. `mem` and `time` are its least-memory point; `edges` (memory added, time saved)
/// run steepest first to its fastest point. Below `mem` nothing fits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hull {
    pub mem: f64,
    pub time: f64,
    /// (Δmemory > 0, Δtime < 0), by Δtime/Δmemory ascending.
    pub edges: Vec<(f64, f64)>,
}

impl Hull {
    /// The lower convex hull of `points` (memory, time), from the least memory (fastest of
    /// those) to the fastest (least memory of those); `None` for no points.
    pub fn of(points: impl IntoIterator<Item = (f64, f64)>) -> Option<Hull> {
        let mut pts: Vec<(f64, f64)> = points.into_iter().collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let mut chain: Vec<(f64, f64)> = Vec::with_capacity(pts.len());
        for q in pts {
            // A point no faster than the last kept is never on the falling chain.
            if chain.last().is_some_and(|l: &(f64, f64)| q.1 >= l.1) {
                continue;
            }
            while let [.., a, b] = chain[..] {
                // Drop `b` when it lies on or above the segment from `a` to `q`.
                if (b.0 - a.0) * (q.1 - a.1) - (b.1 - a.1) * (q.0 - a.0) <= 0.0 {
                    chain.pop();
                } else {
                    break;
                }
            }
            chain.push(q);
        }
        let &(mem, time) = chain.first()?;
        let edges = chain
            .windows(2)
            .map(|w| (w[1].0 - w[0].0, w[1].1 - w[0].1))
            .collect();
        Some(Hull { mem, time, edges })
    }

    /// `k` independent copies.
    pub fn times(&self, k: f64) -> Hull {
        Hull {
            mem: self.mem * k,
            time: self.time * k,
            edges: self.edges.iter().map(|&(m, t)| (m * k, t * k)).collect(),
        }
    }

    /// Both groups together (the Minkowski sum: edges merged by slope).
    pub fn plus(&self, other: &Hull) -> Hull {
        let mut edges = Vec::with_capacity(self.edges.len() + other.edges.len());
        let (mut i, mut j) = (0, 0);
        while i < self.edges.len() || j < other.edges.len() {
            let take_self = match (self.edges.get(i), other.edges.get(j)) {
                (Some(a), Some(b)) => a.1 * b.0 <= b.1 * a.0,
                (a, _) => a.is_some(),
            };
            if take_self {
                edges.push(self.edges[i]);
                i += 1;
            } else {
                edges.push(other.edges[j]);
                j += 1;
            }
        }
        Hull {
            mem: self.mem + other.mem,
            time: self.time + other.time,
            edges,
        }
    }

    /// Its points, least memory first.
    fn vertices(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        std::iter::once((self.mem, self.time)).chain(self.edges.iter().scan(
            (self.mem, self.time),
            |p, &(m, t)| {
                *p = (p.0 + m, p.1 + t);
                Some(*p)
            },
        ))
    }

    /// The group one way or the other (the hull of both).
    pub fn either(&self, other: &Hull) -> Hull {
        Hull::of(self.vertices().chain(other.vertices())).expect("both have points")
    }

    /// The least time within a memory: infinite below `mem`, then along the edges, then flat at
    /// the fastest point. Read at falling memories (a frontier's points, least memory first,
    /// leave falling room), each call steps down from the last one's vertex; a rise starts
    /// again with a binary search.
    pub fn least_time(&self) -> impl FnMut(f64) -> f64 + '_ {
        let mut cm = Vec::with_capacity(self.edges.len() + 1);
        let mut ct = Vec::with_capacity(self.edges.len() + 1);
        for (m, t) in self.vertices() {
            cm.push(m);
            ct.push(t);
        }
        // The last call's room and the first vertex above it.
        let (mut last, mut k) = (f64::NEG_INFINITY, 0usize);
        move |room: f64| {
            if room < self.mem {
                return f64::INFINITY;
            }
            if room >= last {
                k = cm.partition_point(|&x| x <= room);
            } else {
                while cm[k - 1] > room {
                    k -= 1;
                }
            }
            last = room;
            if k >= cm.len() {
                return ct[ct.len() - 1];
            }
            // Between vertices k − 1 and k.
            let (dm, dt) = self.edges[k - 1];
            ct[k - 1] + dt * ((room - cm[k - 1]) / dm)
        }
    }

    /// Shifted by `mem` bytes and `time` seconds.
    pub fn shifted(mut self, mem: f64, time: f64) -> Hull {
        self.mem += mem;
        self.time += time;
        self
    }
}

/// What [`repeat`] may leave out: partial sums that, with the copies still to add (each at
/// least `one`) and what the rest of the plan adds (`outside`), cannot be faster than `t_max`
/// within `limit` bytes held.
#[derive(Debug, Clone)]
pub struct RepeatCut {
    pub one: Hull,
    pub outside: Hull,
    pub limit: u64,
    pub t_max: f64,
}

impl RepeatCut {
    /// The cut for a partial sum with `left` copies still to add.
    fn after(&self, left: u64) -> Cut {
        Cut {
            rest: self.one.times(left as f64).plus(&self.outside),
            limit: self.limit,
            t_max: self.t_max,
        }
    }
}

/// A bound for leaving out partial sums that cannot lead to a plan faster than `t_max`: a point
/// of memory `m` and time `t` goes when `t + rest(limit − m) > t_max`, `rest` a lower bound on
/// what the parts still to add take (a [`Hull`]).
#[derive(Debug, Clone)]
pub struct Cut {
    pub rest: Hull,
    pub limit: u64,
    pub t_max: f64,
}

impl Cut {
    /// Keep only the points that may still lead to a plan faster than `t_max`.
    pub fn apply(&self, f: Frontier) -> Frontier {
        let mut rest_at = self.rest.least_time();
        f.into_iter()
            .filter(|p| {
                let room = self.limit as f64 - p.mem as f64;
                p.time + rest_at(room) <= self.t_max
            })
            .collect()
    }
}

/// A seeded stream of pseudo-random numbers for the tests (a 64-bit linear congruential
/// generator's high bits): the same frontiers every run, no dependency.
#[cfg(test)]
pub(crate) fn test_rng(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed >> 33
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(arena: &mut Arena, v: &[(u64, f64)]) -> Frontier {
        v.iter()
            .map(|&(mem, time)| Point {
                mem,
                time,
                node: arena.push(Node::Empty),
                host: 0,
            })
            .collect()
    }

    #[test]
    fn prune_drops_dominated_points() {
        let mut a = Arena::default();
        let f = prune(pts(
            &mut a,
            &[(10, 5.0), (5, 9.0), (10, 4.0), (20, 4.0), (30, 1.0)],
        ));
        let got: Vec<(u64, f64)> = f.iter().map(|p| (p.mem, p.time)).collect();
        assert_eq!(got, vec![(5, 9.0), (10, 4.0), (30, 1.0)]);
    }

    /// A three-dimensional sum under a host limit `h` keeps exactly the points of the sum
    /// under a larger limit that hold at most `h` (a point that dominates another holds no
    /// more host memory), so its size bounds the larger sum's from below: what
    /// `ClassSum::overflow_certain` decides overflow on.
    #[test]
    fn a_three_dimensional_sum_under_a_lower_host_limit_is_the_whole_sums_points_under_it() {
        let mut rand = test_rng(3);
        let figures = |f: &[Point]| -> Vec<(u64, u64, u64)> {
            f.iter()
                .map(|p| (p.mem, p.host, p.time.to_bits()))
                .collect()
        };
        for round in 0..100 {
            let mut parts: Vec<Vec<(u64, u64, f64)>> = Vec::new();
            for _ in 0..(2 + rand() % 3) {
                parts.push(
                    (0..(1 + rand() % 8))
                        .map(|_| (rand() % 40, rand() % 30, (rand() % 50) as f64))
                        .collect(),
                );
            }
            let sum_under = |h: u64| -> Frontier {
                let mut a = Arena {
                    host_limit: Some(h),
                    ..Arena::default()
                };
                let mut total = vec![Point {
                    mem: 0,
                    time: 0.0,
                    node: a.push(Node::Empty),
                    host: 0,
                }];
                for part in &parts {
                    let pts: Vec<Point> = part
                        .iter()
                        .map(|&(mem, host, time)| Point {
                            mem,
                            time,
                            node: a.push(Node::Empty),
                            host,
                        })
                        .collect();
                    total = sum(&total, &prune3(pts), 0, u64::MAX, &mut a);
                }
                assert!(!a.overflow);
                total
            };
            let whole = sum_under(u64::MAX);
            for h in [0, 5, 20, 45, 80] {
                let under: Vec<Point> = whole.iter().filter(|p| p.host <= h).copied().collect();
                assert_eq!(
                    figures(&sum_under(h)),
                    figures(&under),
                    "round {round}, host limit {h}"
                );
            }
        }
    }

    /// `repeat_overflows` says exactly when `repeat` gives up on a three-dimensional
    /// frontier it doubles.
    #[test]
    fn repeat_overflows_when_the_first_doubling_is_too_large() {
        let side = (MAX_PAIRS_3D as f64).sqrt() as usize + 1;
        for (len, count) in [
            (side, 1),
            (side, 2),
            (side, 3),
            (side, 48),
            (100, 2),
            (3, 5),
        ] {
            let mut a = Arena {
                host_limit: Some(u64::MAX),
                ..Arena::default()
            };
            // `len` points no other dominates: more memory, less host memory.
            let f: Frontier = (0..len as u64)
                .map(|k| Point {
                    mem: k,
                    time: 1.0,
                    node: a.push(Node::Empty),
                    host: len as u64 - k,
                })
                .collect();
            let limit = if len == side { 0 } else { u64::MAX };
            repeat(&f, count, 0, limit, 0, &mut a, None);
            assert_eq!(a.overflow, repeat_overflows(len, count), "{len} × {count}");
        }
    }

    #[test]
    fn repeat_equals_brute_force_sums() {
        let mut a = Arena::default();
        let f = pts(&mut a, &[(1, 10.0), (4, 6.0), (9, 1.0)]);
        let got = repeat(&f, 3, 0, u64::MAX, 0, &mut a, None);
        // Brute force over all 27 triples.
        let mut all = Vec::new();
        for x in &f {
            for y in &f {
                for z in &f {
                    all.push(Point {
                        mem: x.mem + y.mem + z.mem,
                        time: x.time + y.time + z.time,
                        node: 0,
                        host: 0,
                    });
                }
            }
        }
        let want: Vec<(u64, f64)> = prune(all).iter().map(|p| (p.mem, p.time)).collect();
        let got: Vec<(u64, f64)> = got.iter().map(|p| (p.mem, p.time)).collect();
        assert_eq!(got, want);
        // Within 11 bytes, 1 + 1 + 9 (time 10 + 10 + 1) beats 1 + 4 + 4 (time 22).
        assert_eq!(
            best_within(&repeat(&f, 3, 0, u64::MAX, 0, &mut a, None), 11, false).map(|p| p.time),
            Some(21.0)
        );
        assert!(best_within(&f, 0, false).is_none());
    }

    #[test]
    fn sum_is_the_pruned_set_of_all_pairs_up_to_the_limit() {
        let mut a = Arena::default();
        // Two staircases with ties and near-ties in memory and time.
        let mut rand = test_rng(7);
        for _ in 0..20 {
            let x: Vec<(u64, f64)> = (0..12)
                .map(|_| (rand() % 50, (rand() % 40) as f64))
                .collect();
            let y: Vec<(u64, f64)> = (0..7)
                .map(|_| (rand() % 30, (rand() % 25) as f64))
                .collect();
            let (f, g) = (prune(pts(&mut a, &x)), prune(pts(&mut a, &y)));
            let mut all = Vec::new();
            for p in &f {
                for q in &g {
                    all.push(Point {
                        mem: p.mem + q.mem,
                        time: p.time + q.time,
                        node: 0,
                        host: 0,
                    });
                }
            }
            let want: Vec<(u64, f64)> = prune(all).iter().map(|p| (p.mem, p.time)).collect();
            for limit in [0, 10, 35, u64::MAX] {
                let got: Vec<(u64, f64)> = sum(&f, &g, 0, limit, &mut a)
                    .iter()
                    .map(|p| (p.mem, p.time))
                    .collect();
                let cut: Vec<(u64, f64)> = want
                    .iter()
                    .enumerate()
                    .filter(|(k, p)| *k == 0 || p.0 <= limit)
                    .map(|(_, p)| *p)
                    .collect();
                assert_eq!(got, cut, "limit {limit}");
            }
        }
    }

    /// With a resolution (on the grid where it is dense enough, merged where it is not), a sum
    /// is a staircase of real pairs and loses less than one resolution step: for every pair of
    /// the exact sum up to the limit there is a kept point at most as slow and less than
    /// `resolution` bytes above it, so a budget query gives up less than that much budget.
    #[test]
    fn a_sum_at_a_resolution_loses_less_than_one_step_of_memory() {
        let mut a = Arena::default();
        let mut rand = test_rng(5);
        let (mut on_grid, mut merged) = (0, 0);
        for round in 0..200 {
            // Dense memories (the grid) in most rounds, spread ones (the merge) in some.
            let spread = if round % 4 == 0 { 5_000 } else { 60 };
            let x: Vec<(u64, f64)> = (0..(2 + rand() % 40))
                .map(|_| (rand() % spread, (rand() % 400) as f64 / 8.0))
                .collect();
            let y: Vec<(u64, f64)> = (0..(1 + rand() % 9))
                .map(|_| (rand() % spread, (rand() % 200) as f64 / 8.0))
                .collect();
            let (f, g) = (prune(pts(&mut a, &x)), prune(pts(&mut a, &y)));
            let resolution = 1 + rand() % 9;
            let limit = [u64::MAX, rand() % (2 * spread)][(rand() % 2) as usize];
            let (big, small) = if f.len() >= g.len() {
                (&f, &g)
            } else {
                (&g, &f)
            };
            let top = big[0].mem + small[0].mem + resolution - 1;
            let cutoff = limit.saturating_add(resolution - 1).max(top);
            match sum_on_grid(big, small, resolution, limit, cutoff, &mut Vec::new()) {
                Some(_) => on_grid += 1,
                None => merged += 1,
            }
            let got = sum(&f, &g, resolution, limit, &mut a);
            assert!(got
                .windows(2)
                .all(|w| w[0].mem < w[1].mem && w[0].time > w[1].time));
            let pair = |p: &Point| match a.nodes[p.node as usize] {
                Node::Pair(i, j) => (i, j),
                ref other => panic!("{other:?}"),
            };
            for p in &got {
                let (i, j) = pair(p);
                let (pi, pj) = (
                    f.iter().chain(&g).find(|q| q.node == i).unwrap(),
                    f.iter().chain(&g).find(|q| q.node == j).unwrap(),
                );
                assert_eq!((p.mem, p.time), (pi.mem + pj.mem, pi.time + pj.time));
            }
            for p in &f {
                for q in &g {
                    let (mem, time) = (p.mem + q.mem, p.time + q.time);
                    if mem > limit && mem > got[0].mem {
                        continue;
                    }
                    assert!(
                        got.iter()
                            .any(|k| k.time <= time && k.mem < mem + resolution),
                        "round {round}: pair ({mem}, {time}) has no kept point at resolution \
                         {resolution}, limit {limit}: {got:?}"
                    );
                }
            }
        }
        assert!(
            on_grid > 20 && merged > 20,
            "grid {on_grid}, merged {merged}"
        );
    }

    /// The hull is a lower bound on every combination of the groups it stands for (summed,
    /// repeated, one way or the other), and is met at its vertices; a cut keeps every point
    /// that, with the best rest, reaches `t_max`.
    #[test]
    fn hulls_bound_every_combination_from_below() {
        let mut rand = test_rng(11);
        let at = |h: &Hull, x: f64| -> f64 { h.least_time()(x) };
        // A cut keeps a point exactly when its time and the rest's least time fit `t_max`.
        let rest = Hull::of([(10.0, 5.0), (20.0, 1.0)]).unwrap();
        let p = |mem, time| Point {
            mem,
            time,
            node: 0,
            host: 0,
        };
        let cut = |t_max| {
            Cut {
                rest: rest.clone(),
                limit: 30,
                t_max,
            }
            .apply(vec![p(5, 2.0), p(15, 1.0), p(25, 0.0)])
            .len()
        };
        // Rooms 25, 15, 5: the rest takes 1, 3, nothing fits; totals 3, 4, ∞.
        assert_eq!((cut(2.9), cut(3.0), cut(4.0), cut(1e9)), (0, 1, 2, 2));
        for _ in 0..30 {
            let x: Vec<(f64, f64)> = (0..6)
                .map(|_| ((rand() % 50) as f64, (rand() % 40) as f64))
                .collect();
            let y: Vec<(f64, f64)> = (0..5)
                .map(|_| ((rand() % 30) as f64, (rand() % 25) as f64))
                .collect();
            let (hx, hy) = (Hull::of(x.clone()).unwrap(), Hull::of(y.clone()).unwrap());
            let sum = hx.plus(&hy);
            let twice = hx.times(2.0);
            let either = hx.either(&hy);
            for &(mx, tx) in &x {
                assert!(at(&hx, mx) <= tx + 1e-6, "{x:?}: {mx} {tx}");
                assert!(at(&either, mx) <= tx + 1e-6);
                for &(my, ty) in &y {
                    assert!(at(&sum, mx + my) <= tx + ty + 1e-6, "{x:?} {y:?}");
                    assert!(at(&either, my) <= ty + 1e-6);
                }
                for &(mz, tz) in &x {
                    assert!(at(&twice, mx + mz) <= tx + tz + 1e-6);
                }
            }
            // Met at the vertices: the least-memory point and the fastest one.
            let least = x.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
            let fastest = x.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
            let at_least = x
                .iter()
                .filter(|p| p.0 == least)
                .map(|p| p.1)
                .fold(f64::INFINITY, f64::min);
            assert!((at(&hx, least) - at_least).abs() < 1e-6);
            assert!((at(&hx, 1e9) - fastest).abs() < 1e-6);
            // Nothing fits below the least memory.
            if least >= 1.0 {
                assert!(at(&hx, least - 1.0) > 1e5);
            }
        }
    }
}
