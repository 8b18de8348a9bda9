//! A collective backend over TCP for ranks that are separate processes (one per GPU later, or
//! CPU ranks on several machines): rank 0 listens on `MASTER_ADDR:MASTER_PORT`, the others
//! connect ([`join`] checks who they are and that they run the same thing), and every
//! collective goes through rank 0, which reduces in rank order — the same order as the local
//! backend, so a run gives the same bits whichever backend carries it. The same connections are
//! the bootstrap for NCCL: rank 0 can share its unique id over them.

mod join;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::collective::{check_node_size, sum_in_rank_order, Aborted, Collective, NodeGroups};
pub use join::{Membership, RunToken, Terms};

/// A frame's first byte past the tensor tags (0 fp32, 1 f64, 2 i64): a live process's
/// heartbeat, and rank 0's word that the run is over, with why.
const HEARTBEAT: u8 = 0xFF;
const STOPPING: u8 = 0xFE;
/// Longest reason a stopping frame carries.
const MAX_STOPPING_BYTES: usize = 4096;

/// One process's handle on the group.
pub struct TcpGroup {
    links: Links,
    /// The node groups, when [`TcpGroup::with_nodes`] arranged the ranks in several nodes.
    nodes: Option<NodeGroups>,
}

/// The connections of one process, shared by its group and its node groups (every collective
/// of any of them goes through rank 0, one at a time).
#[derive(Clone)]
struct Links {
    rank: usize,
    world: usize,
    /// Rank 0: ranks 1.. in order. Others: rank 0.
    peers: Arc<Vec<Peer>>,
    /// How long a read or write waits on a peer that sends (or takes) nothing.
    timeout: Duration,
    /// Beats while any handle on these links lives.
    heartbeat: Arc<Heartbeat>,
}

/// A connection to another rank's process.
struct Peer {
    rank: usize,
    stream: TcpStream,
    /// Held while a whole frame is written, so a heartbeat never lands inside a tensor.
    sending: Mutex<()>,
}

impl Peer {
    /// Why a read or write to this peer failed, as the run's last word.
    fn lost(&self, e: &std::io::Error, timeout: Duration) -> Aborted {
        let r = self.rank;
        Aborted(match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "rank {r} sent nothing for {} s, not even its heartbeat: it is stopped, hung or \
                 unreachable (OSDP_COLLECTIVE_TIMEOUT_S sets how long to wait)",
                timeout.as_secs_f64()
            ),
            std::io::ErrorKind::UnexpectedEof => {
                format!("rank {r}'s process closed its connection: it ended or was killed")
            }
            _ => format!("connection to rank {r} lost: {e}"),
        })
    }

    /// Send one whole frame.
    fn send(&self, parts: &[&[u8]], timeout: Duration) -> Result<(), Aborted> {
        let _frame = self.sending.lock().unwrap_or_else(|p| p.into_inner());
        for part in parts {
            (&self.stream)
                .write_all(part)
                .map_err(|e| self.lost(&e, timeout))?;
        }
        Ok(())
    }

    fn read_exact(&self, buf: &mut [u8], timeout: Duration) -> Result<(), Aborted> {
        (&self.stream)
            .read_exact(buf)
            .map_err(|e| self.lost(&e, timeout))
    }
}

/// The thread that tells every peer this process lives, so a long step is not taken for a
/// dead rank; stopped when the links go.
struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Heartbeat {
    /// Beat on every peer every `every` (skipping a peer while a frame is being sent to it:
    /// the frame's own bytes show this process lives).
    fn start(peers: Arc<Vec<Peer>>, every: Duration) -> Heartbeat {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || loop {
            let next = Instant::now() + every;
            while Instant::now() < next {
                if stopped.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(every.min(Duration::from_millis(20)));
            }
            for p in peers.iter() {
                if let Ok(_frame) = p.sending.try_lock() {
                    let _ = (&p.stream).write_all(&[HEARTBEAT]);
                }
            }
        });
        Heartbeat {
            stop,
            thread: Mutex::new(Some(thread)),
        }
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.lock().map(|mut t| t.take()).unwrap_or(None);
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop();
    }
}

impl TcpGroup {
    /// Join the group under `terms`: rank 0 waits for every other rank, the others connect to
    /// rank 0; either gives up after the join timeout with a message naming who is missing, and
    /// a rank whose terms differ from rank 0's ends the join on every rank. Past the join every
    /// read and write waits at most the collective timeout for a peer that sends nothing, while
    /// a heartbeat shows every live process's peers that it lives.
    pub fn join(m: &Membership, terms: &Terms) -> Result<TcpGroup, String> {
        let streams = if m.rank == 0 {
            join::gather(m, terms)?
        } else {
            vec![join::enter(m, terms)?]
        };
        let timeout = m.collective_timeout;
        let mut peers = Vec::with_capacity(streams.len());
        for (i, stream) in streams.into_iter().enumerate() {
            stream
                .set_read_timeout(Some(timeout))
                .and_then(|()| stream.set_write_timeout(Some(timeout)))
                .map_err(|e| e.to_string())?;
            peers.push(Peer {
                rank: if m.rank == 0 { i + 1 } else { 0 },
                stream,
                sending: Mutex::new(()),
            });
        }
        let peers = Arc::new(peers);
        let every = (timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(5));
        Ok(TcpGroup {
            links: Links {
                rank: m.rank,
                world: m.world,
                heartbeat: Arc::new(Heartbeat::start(Arc::clone(&peers), every)),
                peers,
                timeout,
            },
            nodes: None,
        })
    }

    /// The group with its ranks arranged as nodes of `ranks_per_node` consecutive ranks (see
    /// [`NodeGroups`]); unchanged when that is one node. Every process must arrange the same.
    pub fn with_nodes(self, ranks_per_node: usize) -> Result<TcpGroup, String> {
        let world = self.links.world;
        check_node_size(world, ranks_per_node)?;
        if ranks_per_node >= world {
            return Ok(self);
        }
        let part = |across| {
            Box::new(TcpPart {
                links: self.links.clone(),
                ranks_per_node,
                across,
            }) as Box<dyn Collective>
        };
        let nodes = NodeGroups {
            shard: part(false),
            replica: part(true),
        };
        Ok(TcpGroup {
            nodes: Some(nodes),
            ..self
        })
    }

    /// The connections to the other processes (rank 0: one per other rank; the others: one
    /// to rank 0), heartbeat stopped and without deadlines, for a backend that bootstraps over
    /// this group and then watches them.
    pub fn into_streams(self) -> Vec<TcpStream> {
        drop(self.nodes);
        self.links.heartbeat.stop();
        let streams: Vec<TcpStream> = self
            .links
            .peers
            .iter()
            .filter_map(|p| p.stream.try_clone().ok())
            .collect();
        for s in &streams {
            let _ = s
                .set_read_timeout(None)
                .and_then(|()| s.set_write_timeout(None));
        }
        streams
    }
}

impl Links {
    /// Rank 0: every rank's tensor, in rank order (its own first). Others: send theirs.
    fn gather_to_root(&self, t: &Tensor) -> Result<Option<Vec<Tensor>>, Aborted> {
        self.telling_all(|| {
            if self.rank == 0 {
                // Every rank sends a tensor of the same size as ours: anything else is refused
                // before a byte of it is allocated.
                let expected = Wire::of(t.kind(), t.numel());
                let mut all = vec![t.reshape([-1])];
                for p in self.peers.iter() {
                    all.push(recv_tensor(p, expected, self.timeout)?);
                }
                Ok(Some(all))
            } else {
                send_tensor(&self.peers[0], t, self.timeout)?;
                Ok(None)
            }
        })
    }

    /// Rank 0 sends `out(r)` to each rank r and keeps `out(0)`; others receive theirs, of
    /// `expected` kind and elements.
    fn scatter_from_root(
        &self,
        out: Option<&dyn Fn(usize) -> Tensor>,
        expected: Wire,
    ) -> Result<Tensor, Aborted> {
        self.telling_all(|| match (self.rank, out) {
            (0, Some(out)) => {
                for (i, p) in self.peers.iter().enumerate() {
                    send_tensor(p, &out(i + 1), self.timeout)?;
                }
                Ok(out(0))
            }
            _ => recv_tensor(&self.peers[0], expected, self.timeout),
        })
    }

    /// Run one exchange; when it fails on rank 0, tell every other rank why before they wait
    /// out their own deadline, so each stops with the same message naming the rank at fault.
    fn telling_all<T>(&self, exchange: impl FnOnce() -> Result<T, Aborted>) -> Result<T, Aborted> {
        let out = exchange();
        if let (0, Err(Aborted(why))) = (self.rank, &out) {
            let why = &why.as_bytes()[..why.len().min(MAX_STOPPING_BYTES)];
            for p in self.peers.iter() {
                // A peer that takes nothing more is not waited for.
                let _ = p.stream.set_write_timeout(Some(Duration::from_secs(1)));
                let len = (why.len() as u32).to_le_bytes();
                let _ = p.send(&[&[STOPPING], &len, why], self.timeout);
            }
        }
        out
    }
}

fn send_tensor(p: &Peer, t: &Tensor, timeout: Duration) -> Result<(), Aborted> {
    let t = t.contiguous().reshape([-1]);
    let (tag, bytes): (u8, Vec<u8>) = match t.kind() {
        Kind::Double => (
            1,
            Vec::<f64>::try_from(&t)
                .unwrap_or_default()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        Kind::Int64 => (
            2,
            Vec::<i64>::try_from(&t)
                .unwrap_or_default()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        _ => (
            0,
            Vec::<f32>::try_from(&t.to_kind(Kind::Float))
                .unwrap_or_default()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
    };
    let len = (bytes.len() as u64).to_le_bytes();
    p.send(&[&[tag], &len, &bytes], timeout)
}

/// What a tensor looks like on the wire: its tag (0 fp32, 1 f64, 2 i64) and byte length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Wire {
    tag: u8,
    bytes: u64,
}

impl Wire {
    fn of(kind: Kind, numel: usize) -> Wire {
        let (tag, size) = match kind {
            Kind::Double => (1, 8),
            Kind::Int64 => (2, 8),
            _ => (0, 4),
        };
        Wire {
            tag,
            bytes: numel as u64 * size,
        }
    }
}

/// The first byte of the next tensor frame from `p`, past its heartbeats; rank 0's word that
/// the run is over ends the wait with rank 0's reason.
fn next_frame(p: &Peer, timeout: Duration) -> Result<u8, Aborted> {
    loop {
        let mut tag = [0u8];
        p.read_exact(&mut tag, timeout)?;
        match tag[0] {
            HEARTBEAT => continue,
            STOPPING => {
                let mut len = [0u8; 4];
                p.read_exact(&mut len, timeout)?;
                let len = (u32::from_le_bytes(len) as usize).min(MAX_STOPPING_BYTES);
                let mut why = vec![0u8; len];
                p.read_exact(&mut why, timeout)?;
                let why = osdp_core::text::printable(&String::from_utf8_lossy(&why)).into_owned();
                return Err(Aborted(format!("rank {} stopped the run: {why}", p.rank)));
            }
            tag => return Ok(tag),
        }
    }
}

/// Receive a tensor that must be `expected`: a header announcing anything else (a stranger on
/// the port, a rank of another model or plan) ends the run with a message instead of an
/// allocation of whatever size it claims.
fn recv_tensor(p: &Peer, expected: Wire, timeout: Duration) -> Result<Tensor, Aborted> {
    let tag = next_frame(p, timeout)?;
    let mut len = [0u8; 8];
    p.read_exact(&mut len, timeout)?;
    let len = u64::from_le_bytes(len);
    if tag != expected.tag || len != expected.bytes {
        return Err(Aborted(format!(
            "rank {} sent a tensor of {len} bytes (type {tag}) where {} bytes (type {}) were \
             expected: a process that is not part of this run, or one started with another \
             model or plan",
            p.rank, expected.bytes, expected.tag
        )));
    }
    let mut bytes = vec![0u8; len as usize];
    p.read_exact(&mut bytes, timeout)?;
    Ok(match tag {
        1 => Tensor::from_slice(
            &bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect::<Vec<_>>(),
        ),
        2 => Tensor::from_slice(
            &bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect::<Vec<_>>(),
        ),
        _ => Tensor::from_slice(
            &bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap_or([0; 4])))
                .collect::<Vec<_>>(),
        ),
    })
}

impl Collective for TcpGroup {
    fn rank(&self) -> usize {
        self.links.rank
    }
    fn world(&self) -> usize {
        self.links.world
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted> {
        let kind = shard.kind();
        let full = self
            .links
            .gather_to_root(shard)?
            .map(|a| Tensor::cat(&a, 0));
        let same = full.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.links.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, shard.numel() * self.links.world),
        )?;
        Ok(out.to_kind(kind))
    }
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        let kind = full.kind();
        let chunk = full.size()[0] / self.links.world as i64;
        let sum = self
            .links
            .gather_to_root(full)?
            .map(|a| sum_in_rank_order(&a));
        let part = sum
            .as_ref()
            .map(|s| move |r: usize| s.narrow(0, r as i64 * chunk, chunk));
        let out = self.links.scatter_from_root(
            part.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, chunk as usize),
        )?;
        Ok(out.to_kind(kind))
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let sum = self.links.gather_to_root(t)?.map(|a| sum_in_rank_order(&a));
        let same = sum.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.links.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let chosen = self
            .links
            .gather_to_root(t)?
            .map(|a| a[root].shallow_clone());
        let same = chosen.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.links.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn barrier(&self) -> Result<(), Aborted> {
        self.all_reduce(&Tensor::from(0.0f64)).map(|_| ())
    }
    fn nodes(&self) -> Option<&NodeGroups> {
        self.nodes.as_ref()
    }
}

/// One of the groups the ranks are partitioned into — every node's ranks, or every local
/// index's ranks across the nodes — over the whole group's connections. Every rank runs the
/// same collective on its own group at the same time (the executor's ranks run in step), so
/// rank 0 receives every rank's tensor, reduces each group in its rank order and sends each
/// rank its group's result: the local backend's bits.
struct TcpPart {
    links: Links,
    ranks_per_node: usize,
    /// The replica groups (one rank per node) rather than the nodes.
    across: bool,
}

impl TcpPart {
    /// Which group rank `r` is in, and its rank there.
    fn place(&self, r: usize) -> (usize, usize) {
        let (node, local) = (r / self.ranks_per_node, r % self.ranks_per_node);
        if self.across {
            (local, node)
        } else {
            (node, local)
        }
    }

    fn size(&self) -> usize {
        if self.across {
            self.links.world / self.ranks_per_node
        } else {
            self.ranks_per_node
        }
    }

    /// The world ranks of group `g`, in group rank order.
    fn members(&self, g: usize) -> Vec<usize> {
        let rpn = self.ranks_per_node;
        (0..self.size())
            .map(|k| {
                if self.across {
                    k * rpn + g
                } else {
                    g * rpn + k
                }
            })
            .collect()
    }

    /// Rank 0: every group's tensors in group rank order, by group. Others: send theirs.
    fn by_group(&self, t: &Tensor) -> Result<Option<Vec<Vec<Tensor>>>, Aborted> {
        let groups = self.links.world / self.size();
        Ok(self.links.gather_to_root(t)?.map(|all| {
            (0..groups)
                .map(|g| {
                    self.members(g)
                        .into_iter()
                        .map(|r| all[r].shallow_clone())
                        .collect()
                })
                .collect()
        }))
    }

    /// Rank 0 sends each rank `out(group, group rank)`; the others receive theirs.
    fn reply(
        &self,
        out: Option<impl Fn(usize, usize) -> Tensor>,
        expected: Wire,
    ) -> Result<Tensor, Aborted> {
        let to_rank = out.map(|f| {
            move |r: usize| {
                let (g, k) = self.place(r);
                f(g, k)
            }
        });
        self.links.scatter_from_root(
            to_rank.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            expected,
        )
    }
}

impl Collective for TcpPart {
    fn rank(&self) -> usize {
        self.place(self.links.rank).1
    }
    fn world(&self) -> usize {
        self.size()
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted> {
        let kind = shard.kind();
        let full: Option<Vec<Tensor>> = self
            .by_group(shard)?
            .map(|groups| groups.iter().map(|g| Tensor::cat(g, 0)).collect());
        let out = self.reply(
            full.as_ref()
                .map(|f| move |g: usize, _| f[g].shallow_clone()),
            Wire::of(kind, shard.numel() * self.size()),
        )?;
        Ok(out.to_kind(kind))
    }
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        let kind = full.kind();
        let chunk = full.size()[0] / self.size() as i64;
        let sums: Option<Vec<Tensor>> = self
            .by_group(full)?
            .map(|groups| groups.iter().map(|g| sum_in_rank_order(g)).collect());
        let out = self.reply(
            sums.as_ref()
                .map(|s| move |g: usize, k: usize| s[g].narrow(0, k as i64 * chunk, chunk)),
            Wire::of(kind, chunk as usize),
        )?;
        Ok(out.to_kind(kind))
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let sums: Option<Vec<Tensor>> = self
            .by_group(t)?
            .map(|groups| groups.iter().map(|g| sum_in_rank_order(g)).collect());
        let out = self.reply(
            sums.as_ref()
                .map(|s| move |g: usize, _| s[g].shallow_clone()),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let chosen: Option<Vec<Tensor>> = self
            .by_group(t)?
            .map(|groups| groups.iter().map(|g| g[root].shallow_clone()).collect());
        let out = self.reply(
            chosen
                .as_ref()
                .map(|c| move |g: usize, _| c[g].shallow_clone()),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn barrier(&self) -> Result<(), Aborted> {
        self.all_reduce(&Tensor::from(0.0f64)).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use std::net::TcpListener;

    use super::join::{say_hello, Answer};
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port()
    }

    fn member(rank: usize, world: usize, port: u16, timeout: Duration) -> Membership {
        Membership {
            rank,
            world,
            master: format!("127.0.0.1:{port}"),
            join_timeout: Duration::from_secs(20),
            collective_timeout: timeout,
            token: RunToken::new("t"),
        }
    }

    /// Ranks that compute far longer than the collective timeout between two collectives are
    /// alive, and their heartbeat says so.
    #[test]
    fn a_step_longer_than_the_deadline_is_not_a_dead_peer() {
        let port = free_port();
        let timeout = Duration::from_millis(400);
        let h: Vec<_> = (0..2)
            .map(|rank| {
                std::thread::spawn(move || {
                    let g = TcpGroup::join(&member(rank, 2, port, timeout), &Terms::default())?;
                    if rank == 1 {
                        std::thread::sleep(timeout * 5);
                    }
                    let sum = g.all_reduce(&Tensor::from(1.0f64)).map_err(|a| a.0)?;
                    Ok::<f64, String>(sum.double_value(&[]))
                })
            })
            .collect();
        for h in h {
            assert_eq!(h.join().unwrap(), Ok(2.0));
        }
    }

    /// A rank that joined and then falls silent (here a stand-in that sends no heartbeat)
    /// ends the collective on every rank at the deadline, each naming the silent rank.
    #[test]
    fn a_silent_peer_stops_every_rank_at_the_deadline_by_name() {
        let port = free_port();
        let timeout = Duration::from_millis(500);
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                std::thread::spawn(move || {
                    let g = TcpGroup::join(&member(rank, 3, port, timeout), &Terms::default())?;
                    let started = Instant::now();
                    let out = g.all_reduce(&Tensor::from(1.0f64)).map(|_| ());
                    Ok::<_, String>((out.map_err(|a| a.0), started.elapsed()))
                })
            })
            .collect();
        let until = Instant::now() + Duration::from_secs(10);
        let silent = loop {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                break s;
            }
            assert!(Instant::now() < until, "rank 0 never listened");
            std::thread::sleep(Duration::from_millis(10));
        };
        let heard = say_hello(&silent, (2, 3), &RunToken::new("t"), &Terms::default());
        assert_eq!(heard.map(|h| h.answer), Some(Answer::Welcome));
        let results: Vec<_> = ranks
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        let (e0, took0) = (results[0].0.clone().unwrap_err(), results[0].1);
        let (e1, took1) = (results[1].0.clone().unwrap_err(), results[1].1);
        assert!(e0.starts_with("rank 2 sent nothing for 0.5 s"), "{e0}");
        assert_eq!(e1, format!("rank 0 stopped the run: {e0}"));
        for took in [took0, took1] {
            assert!(took < timeout * 6, "the deadline held: {took:?}");
        }
    }

    /// Four processes (threads here) as two nodes of two: each node's ranks and each local
    /// index's ranks exchange as their own groups, with the local backend's results.
    #[test]
    fn node_groups_over_tcp_give_the_local_backends_results() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let run = |rank: usize, g: &dyn Collective| -> Vec<Vec<f32>> {
            let n = g.nodes().expect("two nodes");
            let r = rank as f32;
            let full = Tensor::from_slice(&[r, 1.0, 2.0 * r, 3.0]);
            let out = [
                n.shard.all_gather(&Tensor::from_slice(&[r, r + 10.0])),
                n.shard.reduce_scatter(&full),
                n.replica.all_reduce(&Tensor::from_slice(&[r])),
                n.replica.reduce_scatter(&full),
                n.shard.broadcast(&Tensor::from_slice(&[r]), 1),
                g.all_reduce(&Tensor::from_slice(&[r])),
            ];
            out.into_iter()
                .map(|t| Vec::<f32>::try_from(t.unwrap().reshape([-1])).unwrap())
                .collect()
        };
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                std::thread::spawn(move || {
                    let m = Membership {
                        rank,
                        world: 4,
                        master: format!("127.0.0.1:{port}"),
                        join_timeout: Duration::from_secs(20),
                        collective_timeout: Duration::from_secs(60),
                        token: RunToken::new("t"),
                    };
                    let g = TcpGroup::join(&m, &Terms::default())
                        .and_then(|g| g.with_nodes(2))
                        .unwrap();
                    run(rank, &g)
                })
            })
            .collect();
        let tcp: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let local: Vec<_> = crate::collective::LocalGroup::with_nodes(4, 2)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(rank, g)| std::thread::spawn(move || run(rank, &g)))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        assert_eq!(tcp, local);
        // Rank 3 is local rank 1 of node 1: its node is ranks 2 and 3, its replicas 1 and 3.
        assert_eq!(tcp[3][0], vec![2.0, 12.0, 3.0, 13.0]);
        assert_eq!(tcp[3][2], vec![4.0]);
        assert_eq!(tcp[3][4], vec![3.0]);
    }

    /// Past the join, a peer that announces a tensor of another size (here 1 TiB) ends the
    /// run with a message instead of an allocation.
    #[test]
    fn a_joined_peer_announcing_a_huge_tensor_ends_the_run_with_a_message() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let m = Membership {
            rank: 0,
            world: 2,
            master: format!("127.0.0.1:{port}"),
            join_timeout: Duration::from_secs(20),
            collective_timeout: Duration::from_secs(60),
            token: RunToken::new("t"),
        };
        let terms = Terms::default().with("lr", 3e-4);
        let t = terms.clone();
        let h0 = std::thread::spawn(move || TcpGroup::join(&m, &t));
        let until = Instant::now() + Duration::from_secs(10);
        let mut peer = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < until, "rank 0 never listened: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        let heard = say_hello(&peer, (1, 2), &RunToken::new("t"), &terms).unwrap();
        assert_eq!((heard.answer, heard.sealed), (Answer::Welcome, true));
        let g0 = h0.join().unwrap().unwrap();
        let mut head = vec![0u8];
        head.extend_from_slice(&(1u64 << 40).to_le_bytes());
        peer.write_all(&head).unwrap();
        let Err(Aborted(why)) = g0.all_reduce(&Tensor::from(1.0f32)) else {
            panic!("a huge tensor is refused")
        };
        assert!(
            why.contains("1099511627776 bytes") && why.contains("not part of this run"),
            "{why}"
        );
    }
}
