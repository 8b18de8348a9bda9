//! Pareto frontiers of (memory, time) with back-pointers, so that the choices behind any point
//! can be recovered. The planner sums frontiers (Minkowski sum, then prune dominated points);
//! identical groups are summed by doubling.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::cost::Choice;

/// One non-dominated way to run a group: its memory, its time, and how to recover it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub mem: u64,
    pub time: f64,
    pub node: u32,
}

/// What a point is made of.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Node {
    /// Op at `slot` of its group runs with `choice`.
    Op { slot: u32, choice: Choice },
    /// One instance of group class `class`, recomputed or not, with its ops under `inner`.
    Instance {
        class: u32,
        recompute: bool,
        inner: u32,
    },
    /// Both parts.
    Pair(u32, u32),
    /// Nothing (the identity of the sum).
    Empty,
}

#[derive(Debug, Default)]
pub struct Arena {
    pub nodes: Vec<Node>,
}

impl Arena {
    pub fn push(&mut self, node: Node) -> u32 {
        self.nodes.push(node);
        (self.nodes.len() - 1) as u32
    }
}

/// Points sorted by memory ascending with time strictly descending.
pub type Frontier = Vec<Point>;

/// Keep only points no other point beats on both memory and time.
pub fn prune(mut pts: Vec<Point>) -> Frontier {
    pts.sort_by(|a, b| a.mem.cmp(&b.mem).then(a.time.total_cmp(&b.time)));
    let mut out: Frontier = Vec::with_capacity(pts.len());
    for p in pts {
        if out.last().is_none_or(|last| p.time < last.time) {
            out.push(p);
        }
    }
    out
}

/// Minkowski sum of two frontiers, pruned. Only surviving points get arena nodes.
///
/// `resolution` > 0 keeps at most one point per `resolution` bytes of memory (the fastest): the
/// frontier stays small on large models, and a budget query loses at most `resolution` bytes of
/// budget per sum. 0 keeps the exact frontier.
///
/// Each point of the smaller frontier shifts the larger one, which stays sorted by memory, so
/// the sum is a k-way merge of sorted runs: no sort, `O(n·k·log k)`.
pub fn sum(a: &[Point], b: &[Point], resolution: u64, arena: &mut Arena) -> Frontier {
    if a.is_empty() || b.is_empty() {
        return Vec::new();
    }
    let (big, small) = if a.len() >= b.len() { (a, b) } else { (b, a) };
    let mut next = vec![0usize; small.len()];
    // Times are non-negative, so their bit patterns order like the numbers.
    let mut heap: BinaryHeap<Reverse<(u64, u64, usize)>> = small
        .iter()
        .enumerate()
        .map(|(j, q)| Reverse((big[0].mem + q.mem, (big[0].time + q.time).to_bits(), j)))
        .collect();
    let mut out: Frontier = Vec::with_capacity(big.len() + small.len());
    // Memory of the first point of the current resolution bucket.
    let mut anchor = 0u64;
    while let Some(Reverse((mem, time_bits, j))) = heap.pop() {
        let time = f64::from_bits(time_bits);
        let i = next[j];
        if out.last().is_none_or(|last| time < last.time) {
            let node = arena.push(Node::Pair(big[i].node, small[j].node));
            let point = Point { mem, time, node };
            match out.last_mut() {
                // A faster point less than `resolution` above the bucket's first replaces it.
                Some(last) if resolution > 0 && mem < anchor.saturating_add(resolution) => {
                    *last = point
                }
                _ => {
                    anchor = mem;
                    out.push(point);
                }
            }
        }
        next[j] += 1;
        if let Some(p) = big.get(i + 1) {
            let q = &small[j];
            heap.push(Reverse((p.mem + q.mem, (p.time + q.time).to_bits(), j)));
        }
    }
    out
}

/// The frontier of `count` independent copies of `f` (each copy may pick a different point).
/// Small frontiers are added one copy at a time (cheap merges); large ones by doubling.
pub fn repeat(f: &[Point], count: u64, resolution: u64, arena: &mut Arena) -> Frontier {
    let empty = arena.push(Node::Empty);
    let mut acc: Frontier = vec![Point {
        mem: 0,
        time: 0.0,
        node: empty,
    }];
    if f.len() <= 64 {
        for _ in 0..count {
            acc = sum(&acc, f, resolution, arena);
        }
        return acc;
    }
    let mut power: Frontier = f.to_vec();
    let mut n = count;
    while n > 0 {
        if n & 1 == 1 {
            acc = sum(&acc, &power, resolution, arena);
        }
        n >>= 1;
        if n > 0 {
            power = sum(&power, &power, resolution, arena);
        }
    }
    acc
}

/// The cheapest point using at most `mem` bytes.
pub fn best_within(f: &[Point], mem: u64) -> Option<&Point> {
    let idx = f.partition_point(|p| p.mem <= mem);
    idx.checked_sub(1).map(|i| &f[i])
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

    #[test]
    fn repeat_equals_brute_force_sums() {
        let mut a = Arena::default();
        let f = pts(&mut a, &[(1, 10.0), (4, 6.0), (9, 1.0)]);
        let got = repeat(&f, 3, 0, &mut a);
        // Brute force over all 27 triples.
        let mut all = Vec::new();
        for x in &f {
            for y in &f {
                for z in &f {
                    all.push(Point {
                        mem: x.mem + y.mem + z.mem,
                        time: x.time + y.time + z.time,
                        node: 0,
                    });
                }
            }
        }
        let want: Vec<(u64, f64)> = prune(all).iter().map(|p| (p.mem, p.time)).collect();
        let got: Vec<(u64, f64)> = got.iter().map(|p| (p.mem, p.time)).collect();
        assert_eq!(got, want);
        // Within 11 bytes, 1 + 1 + 9 (time 10 + 10 + 1) beats 1 + 4 + 4 (time 22).
        assert_eq!(
            best_within(&repeat(&f, 3, 0, &mut a), 11).map(|p| p.time),
            Some(21.0)
        );
        assert!(best_within(&f, 0).is_none());
    }
}
