//! Collectives behind one trait, and the local backend: ranks are threads of one process that
//! exchange real tensors. Every rank reduces the contributions in rank order, so all ranks get
//! bit-identical results, as NCCL's ring guarantees for its ranks.

use std::sync::{Arc, Condvar, Mutex};

use tch::Tensor;

/// A collective failed: another rank gave up, or the group was stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("collective aborted: {0}")]
pub struct Aborted(pub String);

/// The operations the executor needs. Tensors are flat (1-D) where sizes must line up.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Concatenate every rank's equally sized `shard`, in rank order.
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted>;
    /// Sum `full` over ranks and return this rank's `1/world` chunk of the sum.
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted>;
    /// Sum over ranks.
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted>;
    /// `root`'s tensor on every rank.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted>;
    fn barrier(&self) -> Result<(), Aborted>;
    /// Hybrid sharding's two groups of this rank, where the backend arranged the ranks in
    /// nodes; `None` where all of them are one node.
    fn nodes(&self) -> Option<&NodeGroups> {
        None
    }
}

/// A rank's groups when the ranks are arranged as nodes of `ranks_per_node` consecutive ranks:
/// rank `r` is local rank `r % ranks_per_node` of node `r / ranks_per_node`.
pub struct NodeGroups {
    /// The ranks of this rank's node, in rank order (group rank = local rank): hybrid
    /// sharding's shard group.
    pub shard: Box<dyn Collective>,
    /// The ranks with this rank's local index, one per node, in node order (group rank =
    /// node): hybrid sharding's replica group.
    pub replica: Box<dyn Collective>,
}

impl NodeGroups {
    /// This rank's node (its index in the replica group).
    pub fn node(&self) -> usize {
        self.replica.rank()
    }
}

/// Why `ranks_per_node` cannot arrange `world` ranks in several nodes, if it cannot.
pub fn check_node_size(world: usize, ranks_per_node: usize) -> Result<(), String> {
    if ranks_per_node == 0 || world % ranks_per_node != 0 {
        return Err(format!(
            "{ranks_per_node} ranks per node do not divide the {world} ranks into whole nodes"
        ));
    }
    Ok(())
}

/// One rank: nothing to exchange.
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted> {
        Ok(shard.shallow_clone())
    }
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        Ok(full.shallow_clone())
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        Ok(t.shallow_clone())
    }
    fn broadcast(&self, t: &Tensor, _root: usize) -> Result<Tensor, Aborted> {
        Ok(t.shallow_clone())
    }
    fn barrier(&self) -> Result<(), Aborted> {
        Ok(())
    }
}

struct Shared {
    state: Mutex<State>,
    turn: Condvar,
}

struct State {
    world: usize,
    arrived: usize,
    generation: u64,
    aborted: Option<String>,
    slots: Vec<Option<Tensor>>,
}

/// The local backend: one handle per rank thread, made together by [`LocalGroup::new`].
pub struct LocalGroup {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    /// Every group made with this one (its node groups and the other ranks'): a failed rank
    /// aborts them all, wherever the others wait.
    family: Arc<Vec<Arc<Shared>>>,
    nodes: Option<NodeGroups>,
}

fn shared(world: usize) -> Arc<Shared> {
    Arc::new(Shared {
        state: Mutex::new(State {
            world,
            arrived: 0,
            generation: 0,
            aborted: None,
            slots: (0..world).map(|_| None).collect(),
        }),
        turn: Condvar::new(),
    })
}

impl LocalGroup {
    /// Handles for `world` ranks, rank order, all on one node.
    pub fn new(world: usize) -> Vec<LocalGroup> {
        let one = shared(world);
        let family = Arc::new(vec![Arc::clone(&one)]);
        (0..world)
            .map(|rank| LocalGroup {
                rank,
                world,
                shared: Arc::clone(&one),
                family: Arc::clone(&family),
                nodes: None,
            })
            .collect()
    }

    /// Handles for `world` ranks arranged as nodes of `ranks_per_node` consecutive ranks,
    /// each with its [`NodeGroups`] (none when that is one node).
    pub fn with_nodes(world: usize, ranks_per_node: usize) -> Result<Vec<LocalGroup>, String> {
        check_node_size(world, ranks_per_node)?;
        if ranks_per_node >= world {
            return Ok(LocalGroup::new(world));
        }
        let nodes = world / ranks_per_node;
        let all = shared(world);
        let shard: Vec<Arc<Shared>> = (0..nodes).map(|_| shared(ranks_per_node)).collect();
        let replica: Vec<Arc<Shared>> = (0..ranks_per_node).map(|_| shared(nodes)).collect();
        let family: Arc<Vec<Arc<Shared>>> = Arc::new(
            std::iter::once(Arc::clone(&all))
                .chain(shard.iter().cloned())
                .chain(replica.iter().cloned())
                .collect(),
        );
        let member = |rank: usize, world: usize, shared: &Arc<Shared>| LocalGroup {
            rank,
            world,
            shared: Arc::clone(shared),
            family: Arc::clone(&family),
            nodes: None,
        };
        Ok((0..world)
            .map(|rank| {
                let (node, local) = (rank / ranks_per_node, rank % ranks_per_node);
                LocalGroup {
                    nodes: Some(NodeGroups {
                        shard: Box::new(member(local, ranks_per_node, &shard[node])),
                        replica: Box::new(member(node, nodes, &replica[local])),
                    }),
                    ..member(rank, world, &all)
                }
            })
            .collect())
    }

    /// Make every rank's current and future collectives fail with `why` (a rank failed).
    pub fn abort(&self, why: &str) {
        self.abort_handle().abort(why);
    }

    /// A handle that aborts the group, and every group made with it, from anywhere (a
    /// rank's error path).
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle(Arc::clone(&self.family))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves the data consistent (slots only).
        self.shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Wait until every rank has arrived.
    fn sync(&self) -> Result<(), Aborted> {
        let mut st = self.lock();
        if let Some(why) = &st.aborted {
            return Err(Aborted(why.clone()));
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == st.world {
            st.arrived = 0;
            st.generation += 1;
            self.shared.turn.notify_all();
            return Ok(());
        }
        while st.generation == generation {
            if let Some(why) = &st.aborted {
                return Err(Aborted(why.clone()));
            }
            st = self
                .shared
                .turn
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        Ok(())
    }

    /// Publish `t`, wait for everyone, and hand every rank's tensor to `combine`.
    fn exchange(
        &self,
        t: &Tensor,
        combine: impl FnOnce(&[Tensor]) -> Tensor,
    ) -> Result<Tensor, Aborted> {
        self.lock().slots[self.rank] = Some(t.shallow_clone());
        self.sync()?;
        let all: Vec<Tensor> = self
            .lock()
            .slots
            .iter()
            .map(|s| s.as_ref().map(Tensor::shallow_clone))
            .collect::<Option<_>>()
            .ok_or_else(|| Aborted("a rank published nothing".into()))?;
        let out = combine(&all);
        drop(all);
        // Nobody may overwrite a slot before every rank has read them all.
        self.sync()?;
        self.lock().slots[self.rank] = None;
        Ok(out)
    }
}

/// Aborts a [`LocalGroup`] and the groups made with it: every waiting and future collective
/// fails.
#[derive(Clone)]
pub struct AbortHandle(Arc<Vec<Arc<Shared>>>);

impl AbortHandle {
    pub fn abort(&self, why: &str) {
        for shared in self.0.iter() {
            let mut st = shared
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if st.aborted.is_none() {
                st.aborted = Some(why.to_string());
            }
            shared.turn.notify_all();
        }
    }
}

/// The sum every backend uses: rank 0's tensor, then rank 1's, … — one order, the same bits.
pub(crate) fn sum_in_rank_order(all: &[Tensor]) -> Tensor {
    let mut acc = all[0].copy();
    for t in &all[1..] {
        acc += t;
    }
    acc
}

impl Collective for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted> {
        self.exchange(shard, |all| Tensor::cat(all, 0))
    }
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        let (rank, world) = (self.rank as i64, self.world as i64);
        self.exchange(full, |all| {
            let chunk = all[0].size()[0] / world;
            let mine: Vec<Tensor> = all
                .iter()
                .map(|t| t.narrow(0, rank * chunk, chunk))
                .collect();
            sum_in_rank_order(&mine)
        })
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        self.exchange(t, sum_in_rank_order)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted> {
        self.exchange(t, |all| all[root].copy())
    }
    fn barrier(&self) -> Result<(), Aborted> {
        self.sync()
    }
    fn nodes(&self) -> Option<&NodeGroups> {
        self.nodes.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(LocalGroup) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .map(|g| {
                let f = Arc::clone(&f);
                std::thread::spawn(move || f(g))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.reshape([-1])).unwrap()
    }

    #[test]
    fn gather_scatter_and_reduce_exchange_real_values() {
        let out = run_ranks(3, |g| {
            let r = g.rank() as f32;
            let shard = Tensor::from_slice(&[r, r + 10.0]);
            let gathered = values(&g.all_gather(&shard).unwrap());
            let full = Tensor::from_slice(&[r, 1.0, 2.0 * r, 1.0, 3.0, r]);
            let scattered = values(&g.reduce_scatter(&full).unwrap());
            let reduced = values(&g.all_reduce(&Tensor::from_slice(&[r])).unwrap());
            let bcast = values(&g.broadcast(&Tensor::from_slice(&[r]), 2).unwrap());
            g.barrier().unwrap();
            (gathered, scattered, reduced, bcast)
        });
        for (rank, (gathered, scattered, reduced, bcast)) in out.into_iter().enumerate() {
            assert_eq!(gathered, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
            // Sum over ranks of [r, 1, 2r, 1, 3, r] = [3, 3, 6, 3, 9, 3], two values per rank.
            let expected = [[3.0, 3.0], [6.0, 3.0], [9.0, 3.0]][rank].to_vec();
            assert_eq!(scattered, expected);
            assert_eq!(reduced, vec![3.0]);
            assert_eq!(bcast, vec![2.0]);
        }
    }

    #[test]
    fn node_groups_are_a_nodes_consecutive_ranks_and_one_rank_per_node() {
        let handles: Vec<_> = LocalGroup::with_nodes(6, 3)
            .unwrap()
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let r = g.rank() as f32;
                    let n = g.nodes().unwrap();
                    let shard = values(&n.shard.all_gather(&Tensor::from_slice(&[r])).unwrap());
                    let replica = values(&n.replica.all_reduce(&Tensor::from_slice(&[r])).unwrap());
                    // Both groups at once, then the whole world: no group waits on another.
                    let world = values(&g.all_reduce(&Tensor::from_slice(&[r])).unwrap());
                    (n.shard.rank(), n.node(), shard, replica, world)
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            let (local, node, shard, replica, world) = h.join().unwrap();
            assert_eq!((local, node), (rank % 3, rank / 3));
            let first = (3 * node) as f32;
            assert_eq!(shard, vec![first, first + 1.0, first + 2.0]);
            // Ranks l and l + 3.
            assert_eq!(replica, vec![(2 * local + 3) as f32]);
            assert_eq!(world, vec![15.0]);
        }
        assert!(LocalGroup::with_nodes(6, 4).is_err());
        assert!(LocalGroup::with_nodes(4, 4).unwrap()[0].nodes().is_none());
    }

    #[test]
    fn a_failed_rank_releases_the_others_in_every_node_group() {
        let handles: Vec<_> = LocalGroup::with_nodes(4, 2)
            .unwrap()
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    if g.rank() == 0 {
                        g.abort("rank 0 failed");
                        return Err(Aborted("rank 0 failed".into()));
                    }
                    // Rank 1 waits for rank 0 in their node; ranks 2 and 3 meet in theirs,
                    // then wait for ranks 0 and 1 across nodes.
                    let n = g.nodes().unwrap();
                    n.shard.barrier()?;
                    n.replica
                        .all_reduce(&Tensor::from_slice(&[1.0f32]))
                        .map(|_| ())
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), Err(Aborted("rank 0 failed".into())));
        }
    }

    #[test]
    fn a_failed_rank_releases_the_others() {
        let out = run_ranks(3, |g| {
            if g.rank() == 1 {
                g.abort("rank 1 failed");
                return Err(Aborted("rank 1 failed".into()));
            }
            g.all_reduce(&Tensor::from_slice(&[1.0f32])).map(|_| ())
        });
        for r in out {
            assert_eq!(r, Err(Aborted("rank 1 failed".into())));
        }
    }
}
