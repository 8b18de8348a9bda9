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
}

impl LocalGroup {
    /// Handles for `world` ranks, rank order.
    pub fn new(world: usize) -> Vec<LocalGroup> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                world,
                arrived: 0,
                generation: 0,
                aborted: None,
                slots: (0..world).map(|_| None).collect(),
            }),
            turn: Condvar::new(),
        });
        (0..world)
            .map(|rank| LocalGroup {
                rank,
                world,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    /// Make every rank's current and future collectives fail with `why` (a rank failed).
    pub fn abort(&self, why: &str) {
        self.abort_handle().abort(why);
    }

    /// A handle that aborts the group from anywhere (a rank's error path).
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle(Arc::clone(&self.shared))
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

/// Aborts a [`LocalGroup`]: every waiting and future collective fails.
#[derive(Clone)]
pub struct AbortHandle(Arc<Shared>);

impl AbortHandle {
    pub fn abort(&self, why: &str) {
        let mut st = self
            .0
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if st.aborted.is_none() {
            st.aborted = Some(why.to_string());
        }
        self.0.turn.notify_all();
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
